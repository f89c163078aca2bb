"""Cooperative stops inside one long piece of engine work: compiling and optimizing.

Inference asks its caller's ``should_stop`` hook between chunk computations
(``Inferencer.infer_batch``).  A single compile has no chunks, and may still run for
seconds (a per-cindex graph build of millions of cindexes, a long recurrent request
as stored), so the compiler and the optimizer call ``checkpoint`` at points where
stopping leaves nothing behind: between the compiler's phases, every few thousand
cindexes of the per-cindex graph build, between the rounds of the array build and
of variable merging, every 64 sequence shapes of the interval build, and between
optimizer passes.  ``checkpoint`` asks the hook
given to the innermost ``stopping_when`` of the calling thread (a context variable:
other threads, and code outside the ``with``, are not affected) and raises
``Cancelled`` when it says so.  Without a hook a checkpoint costs one context-variable
read.

Nothing is kept from a stopped compile: the computation under construction is
dropped with the exception, and the caches of compiled computations see nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from engine.core.errors import Cancelled

_should_stop: ContextVar[Callable[[], bool] | None] = ContextVar("nnetc_should_stop",
                                                                 default=None)


@contextmanager
def stopping_when(should_stop: Callable[[], bool] | None) -> Iterator[None]:
    """Within the block, ``checkpoint`` in this thread asks ``should_stop`` (None: never
    stop; a nested block replaces the outer hook until it ends)."""
    token = _should_stop.set(should_stop)
    try:
        yield
    finally:
        _should_stop.reset(token)


def checkpoint(where: str, name: str = "") -> None:
    """Raise ``Cancelled`` naming ``where`` (and ``name``, when given: joined only then,
    so that a checkpoint without a hook formats nothing) when the current hook says
    stop."""
    hook = _should_stop.get()
    if hook is not None and hook():
        raise Cancelled(f"compilation stopped by its caller ({where}{' ' + name if name else ''})")


__all__ = ["checkpoint", "stopping_when"]
