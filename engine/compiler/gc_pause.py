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

The last one out also moves what is tracked into the oldest generation
(``gc.freeze()`` then ``gc.unfreeze()``: two list splices), unless the
application has frozen objects of its own.  Otherwise everything the pause
let through -- the new computation's containers, mostly the (node, Index)
pairs of its debug info -- sits in the youngest generation when the collector
comes back, and the next allocation starts a collection that walks all of it
and frees nothing: 0.6 ms of a 12 ms TDNN 150x8 compile, 3.2 ms of 67 ms for
TDNN-LSTM 150x8.  In the oldest generation they are walked only by full
collections, which the collector runs rarely (and does not run more often for
objects that arrive this way); cyclic garbage made during the pause, if any,
waits for one of those.
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
                if gc.get_freeze_count() == 0:
                    gc.freeze()
                    gc.unfreeze()
                gc.enable()
