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
jobs); each sets the BLAS library's thread count *for itself* to one (OpenBLAS's
``openblas_set_num_threads_local``, 0.3.27 and later, as NumPy's wheels ship it, or
MKL's ``MKL_Set_Num_Threads_Local``) and puts it back before it ends, so no other
thread of the process is affected.  Where the BLAS has no per-thread setting
(``per_thread_blas()`` is False) the jobs run one after another in the calling
thread: the process-wide setting cannot be changed safely from any thread, and
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
_setters: list | None = None     # per-thread BLAS thread-count setters, found once


def _find_setters() -> list:
    """ctypes functions ``int f(int n)`` that set the calling thread's BLAS thread
    count and return the previous one, one per BLAS library loaded (threadpoolctl
    finds the libraries; [] when it is missing or a library has no such function)."""
    try:
        from threadpoolctl import ThreadpoolController  # noqa: PLC0415
    except ImportError:
        return []
    out = []
    for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
        api = lib.internal_api
        if api == "openblas":
            pre, suf = getattr(lib, "_symbol_prefix", ""), getattr(lib, "_symbol_suffix", "")
            names = ["openblas_set_num_threads_local",
                     f"{pre}openblas_set_num_threads_local{suf}"]
        elif api == "mkl":
            names = ["MKL_Set_Num_Threads_Local", "mkl_set_num_threads_local"]
        else:
            return []          # a BLAS we cannot pin per thread: no concurrency at all
        fn = None
        for name in names:
            fn = getattr(lib.dynlib, name, None)
            if fn is not None:
                break
        if fn is None:
            return []
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
        out.append(fn)
    return out


def _blas_setters() -> list:
    global _setters
    if _setters is None:
        with _lock:
            if _setters is None:
                _setters = _find_setters()
    return _setters


def per_thread_blas() -> bool:
    """Whether the loaded BLAS libraries take a thread count per calling thread (what
    ``run_concurrently`` needs to run jobs at the same time)."""
    return bool(_blas_setters())


def run_concurrently(jobs: Sequence[Callable[[], T]], threads: int) -> list[T]:
    """The results of ``jobs`` (in order), run ``threads`` at a time: job i on lane
    i % threads, each lane a thread started for it (about 0.1 ms), its products on one
    BLAS thread.  With one thread or one job, or without a per-thread BLAS setting,
    the jobs simply run here one after another.  An exception of a job is raised once
    all jobs have ended (the first in job order)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    jobs = list(jobs)
    if threads == 1 or len(jobs) <= 1 or not per_thread_blas():
        return _run_in_turn(jobs)
    threads = min(threads, len(jobs))
    lanes = [jobs[k::threads] for k in range(threads)]
    done: list = [None] * threads
    workers = [threading.Thread(target=_run_lane, args=(lanes[k], done, k),
                                name=f"nnetc-par-{k}", daemon=True) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
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


def _run_lane(lane: list, done: list, k: int) -> None:
    setters = _blas_setters()
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
