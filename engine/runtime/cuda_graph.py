"""Forward computations on a GPU replayed as CUDA graphs (CuPy backend).

No Kaldi counterpart (Kaldi's NnetComputer launches every command's kernels from
C++ each time).  From Python each command costs one or a few CuPy kernel launches
of 10-50 us of host time, so a forward chunk of a recurrent network (a TDNN-LSTM
at 21 frames: ~300 commands; a BLSTM at 150 frames: ~14,000) is bound by the host,
not the GPU.  A straight-line computation bound to an arena (arena.py) touches the
same device addresses on every run -- the arena's views, the network's device
weights, the index plans -- so the commands between two input/output commands (a
*segment*) can be recorded once with CUDA stream capture and then replayed with a
single launch.

When the executor uses graphs (``usable``): backend CuPy, ``ENABLED``; no backprop,
compression or goto commands and no statistics to store (a replay runs no Python,
so it can keep no memos and write nothing on the host); no random component
outside test mode (a replay would repeat the same mask); every component's device
copy shared (its arrays frozen: ``backend.device_component``), so that its address
is fixed.  The program is then built with outputs in the arena
(``StaticLayout(outputs_in_arena=True)``) and ``get_output`` hands out a copy.

Per bound program and segment: the first run is eager (it also loads the kernels
and warms the caches); the second is captured and then launched; later runs
launch the graphs.  CuPy refuses to capture cuBLAS calls, so a segment becomes a
list of pieces: one graph per longest run of capturable commands, and the other
commands (GEMMs, the host's matrix-list bookkeeping) run eagerly in between, in
order.  Graphs are kept with the device components they read and are launched
only for an executor holding those same objects (else the segment is captured
again).  All captures of a bound program are made on one CUDA stream of its own:
CuPy's memory pool keeps freed blocks per stream, so the pieces (which run one
after another) share their temporaries' blocks, and nothing else -- no eager
command, no other bound program -- is ever given memory a graph writes.  A
capture that fails as a whole is abandoned, the segment marked eager-only, and
the commands run eagerly, which also raises any real error with the command's
name.
"""

from __future__ import annotations

import logging
import threading
import weakref
from itertools import islice

import numpy as np

from engine.compiler.computation import CommandType as CT
from engine.nnet.components.base import ComponentProperty as P
from engine.runtime.arena import _LIST_OPS

log = logging.getLogger(__name__)

# Graphs on; set False to run every command eagerly (tests do, to compare with eager runs).
ENABLED = True
# Keep the CuPy state of threads that ran executors until no capture is under way
# (``hold_thread_state``); False only to reproduce the crash it prevents (tests).
HOLD_THREAD_STATE = True
CAPTURE_ON_RUN = 2      # the run of a segment that is captured

_NOT_IN_GRAPHS = (CT.BACKPROP, CT.BACKPROP_NO_MODEL_UPDATE, CT.COMPRESS_MATRIX,
                  CT.DECOMPRESS_MATRIX, CT.GOTO_LABEL)
_capture_lock = threading.Lock()


# -- threads that end while another captures ----------------------------------------------
# CuPy keeps per-thread state in a ``threading.local``: the thread's cuBLAS handle among it,
# destroyed when the thread ends.  Destroying a cuBLAS handle synchronizes the device, and
# doing so while another thread's stream is capturing crashed the process (a segmentation
# fault in the ending thread: 3 of 84 runs of six short-lived threads on an H200).  So every
# thread that runs an executor on CuPy has its CuPy state held here (``_held``, by the id of
# its per-thread dict, with a weak reference that dies with the thread), and the state of
# threads that have ended is let go only under ``_capture_lock``, when no capture is under
# way.  CuPy's thread-local object is found once, as the one whose per-thread dict holds the
# cuBLAS handle CuPy gives the finding thread (``_cupy_local``; None when this CuPy keeps its
# handles elsewhere, and then nothing is held: engine/README.md, Runtime).

_cupy_local = None
_cupy_local_searched = False
_held: dict[int, tuple] = {}
_this_thread = threading.local()        # our own per-thread marker (its death = the thread's)
_HANDLES_ATTR = "cublas_handles"


class _Alive:
    """Kept in ``_this_thread``: freed when the thread ends."""

    __slots__ = ("__weakref__",)


def _find_cupy_local():
    """CuPy's per-thread state object: the plain ``threading.local`` whose dict in this
    thread holds this thread's cuBLAS handle (made here first), or None."""
    global _cupy_local, _cupy_local_searched
    if _cupy_local_searched:
        return _cupy_local
    import gc  # noqa: PLC0415
    import cupy  # noqa: PLC0415
    handle = cupy.cuda.device.get_cublas_handle()

    def holds_it(o) -> bool:
        handles = o.__dict__.get(_HANDLES_ATTR)
        return isinstance(handles, dict) and any(
            getattr(h, "handle", None) == handle for h in handles.values())
    # exact type only: touching a subclass's dict in this thread would run its __init__
    found = [o for o in gc.get_objects()
             if type(o) is threading.local and o is not _this_thread and holds_it(o)]
    _cupy_local = found[0] if len(found) == 1 else None
    _cupy_local_searched = True
    if _cupy_local is None:
        log.warning("CuPy's per-thread state was not found (%d candidates): threads that end "
                    "while another captures a CUDA graph are not guarded", len(found))
    return _cupy_local


def hold_thread_state() -> None:
    """Called by each run of an executor on CuPy: hold this thread's CuPy state (once per
    thread) so that its end destroys nothing while a graph is being captured."""
    local = _cupy_local if _cupy_local_searched else _find_cupy_local()
    if local is None or not HOLD_THREAD_STATE:
        return
    d = local.__dict__
    if id(d) in _held:
        return
    alive = _Alive()
    _this_thread.alive = alive
    _held[id(d)] = (weakref.ref(alive), d)
    if _capture_lock.acquire(blocking=False):     # a new thread: let go of the ended ones
        try:
            _release_ended()
        finally:
            _capture_lock.release()


def _release_ended() -> None:
    """Let go of the CuPy state of threads that have ended; only under ``_capture_lock``.
    The dict is emptied here so that its handles are destroyed now, not at some later
    collection that might fall inside a capture."""
    for key, (alive, d) in list(_held.items()):
        if alive() is None:
            del _held[key]
            d.clear()


def held_thread_count() -> int:
    """How many threads' CuPy state is held (tests, diagnostics)."""
    return len(_held)


class CaptureFailed:
    """A segment that could not be captured, and why (``reason``)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def computation_allows(computation) -> bool:
    """No command that a replay cannot stand for (see the module docstring)."""
    return not computation.need_model_derivative and not any(
        c.command_type in _NOT_IN_GRAPHS for c in computation.commands)


def usable(ex, plans: dict) -> bool:
    """Whether executor ``ex`` runs its straight-line segments as CUDA graphs;
    ``plans``: the per-computation, per-backend cache (the command check is kept
    there)."""
    if not ENABLED or ex.xp is np or ex.nnet_to_store_stats is not None:
        return False
    allowed = plans.get("graphs")
    if allowed is None:
        allowed = plans["graphs"] = computation_allows(ex.computation)
    if not allowed:
        return False
    for host in ex.nnet.components:
        if host.properties() & P.RANDOM_COMPONENT and not getattr(host, "test_mode", False):
            return False
    from engine.runtime.backend import is_shared_device_copy  # noqa: PLC0415
    return all(is_shared_device_copy(h, d, ex.xp) for h, d in zip(ex.nnet.components,
                                                                 ex._components))


class _Segment:
    __slots__ = ("runs", "pieces", "components")

    def __init__(self):
        self.runs = 0
        self.pieces = None          # per run of the segment: graphs and eager closures
        self.components = None


def _try_capture(stream, ops, ex, mats):
    """``ops`` recorded on ``stream``: (graph, error) with graph None when one of
    them cannot be captured (an exception during the capture)."""
    try:
        with stream:
            stream.begin_capture()
            try:
                for op in ops:
                    op(ex, mats)
            finally:
                graph = stream.end_capture()
    except Exception as e:  # noqa: BLE001 (the reason is reported by the caller)
        return None, e
    return graph, None


def _make_pieces(ex, bound, items, mats) -> list:
    """The segment as a list of pieces: a graph for each longest run of commands
    that can be captured, the closure itself for the others (allocation,
    deallocation and swap commands, which only keep the host's matrix list, and
    commands that CuPy will not capture: its cuBLAS calls, for one).  Whether a
    command can be captured is tried on its own the first time (a capture executes
    nothing) and remembered per program (``bound.capturable``).  Every capture of
    ``bound`` is made on its own stream (``bound.graph_stream``), so the pieces share
    its memory-pool blocks for their temporaries -- they run one after another --
    and no other bound program or eager command is ever given those blocks."""
    import cupy  # noqa: PLC0415
    stream = bound.graph_stream
    if stream is None:
        stream = bound.graph_stream = cupy.cuda.Stream(non_blocking=True)
    ctypes, capturable = bound.command_types, bound.capturable
    pieces: list = []
    run: list = []

    def close_run():
        if run:
            graph, err = _try_capture(stream, run, ex, mats)
            if graph is None:
                raise RuntimeError(f"capturing {len(run)} commands failed: {err}")
            pieces.append((graph,))      # a graph piece: a 1-tuple
            run.clear()
    for k, op in items:
        ok = capturable.get(k)
        if ok is None:
            ok = capturable[k] = (ctypes[k] not in _LIST_OPS and
                                  _try_capture(stream, (op,), ex, mats)[0] is not None)
        if ok:
            run.append(op)
            continue
        close_run()
        pieces.append(op)
    close_run()
    return pieces


def _run_pieces(pieces, ex, mats) -> None:
    for p in pieces:
        if type(p) is tuple:
            p[0].launch()
        else:
            p(ex, mats)


def run_segment(ex, bound, start: int, stop: int, mats) -> bool:
    """Run commands [start, stop) of ``bound`` for ``ex`` with CUDA graphs; False
    when they must run eagerly (first run, or a segment that cannot be captured)."""
    segments = bound.graph_segments
    key = (start, stop)
    seg = segments.get(key)
    if seg is None:
        seg = segments[key] = _Segment()
    elif type(seg) is CaptureFailed:
        return False
    comps = ex._components
    if seg.pieces is not None:
        held = seg.components
        if len(held) == len(comps) and all(a is b for a, b in zip(held, comps)):
            _run_pieces(seg.pieces, ex, mats)
            return True
        seg.pieces, seg.components, seg.runs = None, None, 0    # new weights: capture again
    seg.runs += 1
    if seg.runs < CAPTURE_ON_RUN:
        return False
    items = list(islice(bound.runs[stop], bound.run_start[start], None))
    with _capture_lock:
        _release_ended()
        try:
            pieces = _make_pieces(ex, bound, items, mats)
        except Exception as e:  # noqa: BLE001 (any failure: run eagerly, which reports real errors)
            segments[key] = CaptureFailed(f"{type(e).__name__}: {e}")
            log.debug("segment c%d-c%d runs eagerly: capture failed: %s", start, stop, e)
            return False
    if not any(type(p) is tuple for p in pieces):
        segments[key] = CaptureFailed("no command of the segment can be captured")
        return False
    seg.pieces, seg.components = pieces, tuple(comps)
    _run_pieces(pieces, ex, mats)
    return True


def graph_count(bound) -> int:
    """How many graphs the segments of ``bound`` replay (tests, diagnostics)."""
    return sum(sum(type(p) is tuple for p in s.pieces)
               for s in bound.graph_segments.values()
               if type(s) is _Segment and s.pieces is not None)
