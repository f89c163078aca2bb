"""Pausing Python's cyclic garbage collector around compilation and optimization.

No Kaldi counterpart: this is about the CPython runtime.  Compiling and
optimizing a large request allocates millions of small containers (cindex
lists, per-command attribute lists, access tuples) while the computation being
built already holds millions more.  Each allocation burst triggers collections
whose oldest generation rescans the whole heap, which on the blstm chunk-150
request was about 40% of the optimizer's time.  Nothing these phases build
relies on the cycle collector (reference counting frees it), so the collector
is paused for their duration and put back as it was afterwards.

``gc_paused()`` nests and is safe across threads: a counter (under a lock)
records how many callers are inside; the first one in remembers whether the
collector was enabled and disables it, the last one out restores that state.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused():
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
