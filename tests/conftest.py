import os
from pathlib import Path

import pytest

from refdata import DATA


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


@pytest.fixture
def compiles(monkeypatch) -> list:
    """The computations built while the test runs, one entry per call of
    Compiler.create_computation (the root of every compile: plain, shortcut, looped):
    tests of work that must be refused *before* compiling assert it stays empty,
    which says what they mean and, unlike a time limit, does not depend on the
    machine."""
    from engine.compiler.compiler import Compiler

    made: list = []
    create = Compiler.create_computation

    def counted(self, *args, **kw):
        made.append(self)
        return create(self, *args, **kw)
    monkeypatch.setattr(Compiler, "create_computation", counted)
    return made


# -- the whole suite on the GPU -------------------------------------------------------------
#
# NNETC_TEST_BACKEND=cupy runs every network the engine tests execute on CuPy: each
# Executor, Inferencer and LoopedModel made with the NumPy backend is made with CuPy
# instead, and an Executor's outputs and input derivatives come back as host arrays (as
# the service receives them).  What the tests then compare is unchanged: Kaldi's
# reference arrays, finite differences, offline against streamed.  Used on a GPU machine
# (see README "GPU"); CI has none and runs NumPy.

TEST_BACKEND = os.environ.get("NNETC_TEST_BACKEND", "numpy")


def _run_everything_on(name: str) -> None:
    import functools

    import numpy as np

    from engine.inference import simple, stream
    from engine.runtime import executor
    from engine.runtime.backend import get_backend, to_host

    xp = get_backend(name)

    def on_backend(cls, pos: int):
        """Replace a NumPy ``backend`` argument (keyword, or positional ``pos``) of
        ``cls.__init__`` by ``xp``."""
        init = cls.__init__

        @functools.wraps(init)
        def wrapped(self, *args, **kw):
            if len(args) > pos:
                if args[pos] is np:
                    args = (*args[:pos], xp, *args[pos + 1:])
            elif kw.get("backend", np) is np:
                kw["backend"] = xp
            init(self, *args, **kw)
        cls.__init__ = wrapped

    on_backend(executor.Executor, 2)
    on_backend(simple.Inferencer, 3)
    on_backend(stream.LoopedModel, 4)
    for method in ("get_output", "get_input_deriv"):
        fn = getattr(executor.Executor, method)

        def host(self, *args, _fn=fn, **kw):
            return to_host(_fn(self, *args, **kw))
        setattr(executor.Executor, method, functools.wraps(fn)(host))


if TEST_BACKEND != "numpy":
    _run_everything_on(TEST_BACKEND)
