"""Data parallelism on the CPU: independent computations (the chunks of different
utterances, the halves of a batch) run at the same time in threads, each matrix
product on one BLAS thread.

Why: a multi-threaded BLAS splits every product of a computation across the cores,
and for the products of speech networks (tens to a few thousand rows, K and N of 64
to 1536) OpenBLAS gains little from its second thread: TDNN-F 150x8 ran in 16.4 ms
on two BLAS threads and 22.9 ms on one, while the same eight sequences as two
batch-4 computations in two threads, one BLAS thread each, took 13.5 ms (2-core
machine, 2026-11-26; NumPy releases the GIL in its products and element-wise
kernels).  Left at two BLAS threads each, the two computations fight over the cores
(19-38 ms).  Networks whose commands are many and small (TDNN-LSTM) are bound by the
interpreter instead and gain little or lose.

``run_concurrently(jobs, threads)`` runs callables on ``threads`` threads started for
the call (a shared pool would make overlapping or nested calls wait for each other's
jobs), each product on one BLAS thread.  How the BLAS is held to one thread depends on
what the library offers, found once by a probe:

- a *thread-local* setting (MKL's ``MKL_Set_Num_Threads_Local``, OpenBLAS built with
  OpenMP): each lane sets its own count to one and puts it back before it ends; no
  other thread of the process is affected.
- a *process-wide* one: OpenBLAS built with pthreads -- the build NumPy's wheels ship
  -- exports ``openblas_set_num_threads_local`` but it sets the library's one global
  count (seen with NumPy 2.4.6 / OpenBLAS 0.3.31 and NumPy 2.5.2: a count set in one
  thread is the count every thread reads).  Lanes setting and restoring it themselves
  race: a lane finishing first restores the old count under a lane still running,
  and the last to finish can leave the process at one thread for good.  So the
  count is set to one once, when the first concurrent section of the process starts,
  and restored when the last one ends (a reference count under a lock, so
  overlapping and nested calls compose).  While any section runs, *every* thread of
  the process computes its products on one BLAS thread -- a matter of speed only
  (a product's numbers do not depend on its thread count), and what the cores can
  give while several computations share them anyway.

Where neither exists (``blas_threads_settable()`` is False: no threadpoolctl, another
BLAS) the jobs run one after another in the calling thread: the count cannot be set, and
computations left to fight over the cores are slower than run in turn.

Every job computes what it would compute alone: results are exactly those of running
the jobs one after another (each product's numbers do not depend on the thread that
computes it, and the executor's shared state -- buffer pools, compiled programs, the
product-form choices -- is guarded by locks).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_setters: list | None = None     # BLAS thread-count setters ``int f(int n)``, found once
_local: bool = False             # whether they set the calling thread's count only
_sections = 0                    # concurrent sections running (process-wide setters)
_saved: list = []                # the counts they replaced, restored by the last one


def _find_setters() -> tuple[list, list]:
    """ctypes functions ``int f(int n)`` that set a BLAS thread count and return the
    previous one, one per BLAS library loaded, with the libraries' threadpoolctl
    controllers (threadpoolctl finds the libraries; [] when it is missing or a library
    has no such function)."""
    try:
        from threadpoolctl import ThreadpoolController  # noqa: PLC0415
    except ImportError:
        return [], []
    out, libs = [], []
    for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
        api = lib.internal_api
        if api == "openblas":
            pre, suf = getattr(lib, "_symbol_prefix", ""), getattr(lib, "_symbol_suffix", "")
            names = ["openblas_set_num_threads_local",
                     f"{pre}openblas_set_num_threads_local{suf}"]
        elif api == "mkl":
            names = ["MKL_Set_Num_Threads_Local", "mkl_set_num_threads_local"]
        else:
            return [], []      # a BLAS we cannot hold to one thread: no concurrency
        fn = None
        for name in names:
            fn = getattr(lib.dynlib, name, None)
            if fn is not None:
                break
        if fn is None:
            return [], []
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
        out.append(fn)
        libs.append(lib)
    return out, libs


def _thread_local(setters: list, libs: list) -> bool:
    """Whether each setter changes only the calling thread's count: one is set to one
    in a helper thread while this thread reads the library's count.  A count of one
    already, or an unreadable one, cannot tell: then process-wide (the safe reading)."""
    if not setters:
        return False
    try:
        counts = [lib.get_num_threads() for lib in libs]
    except Exception:                   # noqa: BLE001 -- cannot tell
        return False
    if any(c is None or c <= 1 for c in counts):
        return False
    set_there, read_here = threading.Event(), threading.Event()

    def helper():
        before = [fn(1) for fn in setters]
        set_there.set()
        read_here.wait(5.0)
        for fn, n in zip(setters, before):
            fn(n)
    t = threading.Thread(target=helper, name="nnetc-blas-probe", daemon=True)
    t.start()
    set_there.wait(5.0)
    try:
        seen = [lib.get_num_threads() for lib in libs]
    finally:
        read_here.set()
        t.join()
    return seen == counts


def _blas_setters() -> list:
    global _setters, _local
    if _setters is None:
        with _lock:
            if _setters is None:
                setters, libs = _find_setters()
                _local = _thread_local(setters, libs)
                _setters = setters
    return _setters


def blas_threads_settable() -> bool:
    """Whether the loaded BLAS libraries' thread counts can be set (thread-locally or
    process-wide: see the module docstring), what ``run_concurrently`` needs to run
    jobs at the same time."""
    return bool(_blas_setters())


def blas_setting_is_thread_local() -> bool:
    """Whether the setting changes the calling thread's count only (else a concurrent
    section holds the whole process at one BLAS thread)."""
    return bool(_blas_setters()) and _local


def _enter_section() -> None:
    """Process-wide setters: the first section sets every library to one thread."""
    global _sections, _saved
    with _lock:
        if _sections == 0:
            _saved = [fn(1) for fn in _setters]
        _sections += 1


def _leave_section() -> None:
    """... and the last one puts the counts back."""
    global _sections
    with _lock:
        _sections -= 1
        if _sections == 0:
            for fn, n in zip(_setters, _saved):
                fn(n)


def run_concurrently(jobs: Sequence[Callable[[], T]], threads: int) -> list[T]:
    """The results of ``jobs`` (in order), run ``threads`` at a time: job i on lane
    i % threads, each lane a thread started for it (about 0.1 ms), its products on one
    BLAS thread.  With one thread or one job, or without a BLAS thread setting
    (``blas_threads_settable()``), the jobs simply run here one after another.  An
    exception of a job is raised once all jobs have ended (the first in job order)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    jobs = list(jobs)
    if threads == 1 or len(jobs) <= 1 or not blas_threads_settable():
        return _run_in_turn(jobs)
    threads = min(threads, len(jobs))
    lanes = [jobs[k::threads] for k in range(threads)]
    done: list = [None] * threads
    local = blas_setting_is_thread_local()
    workers = [threading.Thread(target=_run_lane, args=(lanes[k], done, k, local),
                                name=f"nnetc-par-{k}", daemon=True) for k in range(threads)]
    if not local:
        _enter_section()
    try:
        for w in workers:
            w.start()
    finally:
        for w in workers:
            if w.ident is not None:
                w.join()
        if not local:
            _leave_section()
    results: list = [None] * len(jobs)
    error = None
    for k, lane in enumerate(done):
        for j, (ok, value) in enumerate(lane):
            i = k + j * threads
            if ok:
                results[i] = value
            elif error is None or i < error[0]:
                error = (i, value)
    if error is not None:
        raise error[1]
    return results


def _run_in_turn(jobs: list) -> list:
    """The jobs one after another in the calling thread (its BLAS setting untouched),
    under the same contract: every job runs, then the first failure is raised."""
    results: list = []
    error = None
    for job in jobs:
        try:
            results.append(job())
        except Exception as e:          # noqa: BLE001 -- re-raised below, after the rest
            results.append(None)
            if error is None:
                error = e
    if error is not None:
        raise error
    return results


def _run_lane(lane: list, done: list, k: int, local: bool) -> None:
    setters = _blas_setters() if local else []
    before = [set_local(1) for set_local in setters]
    out = []
    try:
        for job in lane:
            try:
                out.append((True, job()))
            except BaseException as e:       # re-raised by run_concurrently
                out.append((False, e))
    finally:
        for set_local, n in zip(setters, before):
            set_local(n)
        done[k] = out
