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
  the process computes its products on one BLAS thread, which is what the cores can
  give while several computations share them anyway.

Where neither exists (``blas_threads_settable()`` is False: no threadpoolctl, another
BLAS) the jobs run one after another in the calling thread: the count cannot be set, and
computations left to fight over the cores are slower than run in turn.

Whether a product's numbers depend on its BLAS thread count depends on the library and
the machine: OpenBLAS 0.3.31's Haswell kernels (NumPy 2.4.6's wheel on an AVX2 AMD EPYC)
round 251 of 768 float32 shapes tried differently on one thread than on two, its
SkylakeX kernels none of those tried.  Changing the count is then not a matter of speed
only: a computation run again could give other bits, and a section holding the process at
one thread would change the numbers of whatever other threads compute meanwhile.  So the
count is changed only where it changes no number: ``products_depend_on_thread_count()``
finds out once per process, by computing a sample of products of the shapes and layouts
speech networks have at the count in force and on one thread; where they differ,
``run_concurrently`` runs the jobs in turn and ``ThreadChoice`` keeps the count in force
(each computation's results are then the same run after run, whatever runs beside it,
at the cost of those two speed-ups on such a machine).  That is the ``"stable"`` thread
policy, the default.  Its price is steepest on a machine shared with other work: while
another process holds a core, a product split over two OpenBLAS threads waits for a
thread that has none (a TDNN-F 150-frame forward: 18-77 ms at two threads against 5.7-5.9
ms on one, AMD EPYC Zen 3 with the Haswell kernels, a compile job on the other core).
``set_thread_policy("adaptive")`` lets ``ThreadChoice`` and ``run_concurrently`` change
the count there too: results then agree from run to run to float32 rounding (as they do
across batch compositions), not bit for bit.  Where products do not depend on the count
the two policies are the same.

Every job computes what it would compute alone: results are exactly those of running
the jobs one after another (where the count is changed at all, the products' numbers do
not depend on it, and the executor's shared state -- buffer pools, compiled programs,
the product-form choices -- is guarded by locks).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import threading
import time
from typing import Callable, Sequence, TypeVar

import numpy as np

from engine.core import sgemm
from engine.runtime.blas import scipys_own_library

T = TypeVar("T")
log = logging.getLogger(__name__)

_lock = threading.Lock()
_setters: list | None = None     # BLAS thread-count setters ``int f(int n)``, found once
_local: bool = False             # whether they set the calling thread's count only
_sections = 0                    # concurrent sections running (process-wide setters)
_saved: list = []                # the counts they replaced, restored by the last one
_getters: list = []              # ``int f(void)`` reading each library's count (may be empty)


def _find_setters() -> tuple[list, list]:
    """ctypes functions ``int f(int n)`` that set a BLAS thread count and return the
    previous one, one per BLAS library loaded (SciPy's own copy aside: see
    engine.runtime.blas), with the libraries' threadpoolctl controllers
    (threadpoolctl finds the libraries; [] when it is missing or a library has no
    such function)."""
    try:
        from threadpoolctl import ThreadpoolController  # noqa: PLC0415
    except ImportError:
        return [], []
    out, libs = [], []
    for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
        if scipys_own_library(getattr(lib, "filepath", None)):
            continue           # SciPy's own copy (scipy.special): none of our products
        if lib.internal_api not in ("openblas", "mkl"):
            return [], []      # a BLAS we cannot hold to one thread: no concurrency
        fn = _library_function(lib, "openblas_set_num_threads_local",
                               ("MKL_Set_Num_Threads_Local", "mkl_set_num_threads_local"),
                               [ctypes.c_int])
        if fn is None:
            return [], []
        out.append(fn)
        libs.append(lib)
    return out, libs


def _find_getters(libs: list) -> list:
    """ctypes functions ``int f(void)`` reading the thread count of each library of
    ``libs`` (the calling thread's, where the setting is thread-local); [] when one
    of them has none."""
    out = []
    for lib in libs:
        fn = _library_function(lib, "openblas_get_num_threads",
                               ("MKL_Get_Max_Threads", "mkl_get_max_threads"), [])
        if fn is None:
            return []
        out.append(fn)
    return out


def _library_function(lib, openblas_name: str, mkl_names: tuple, argtypes: list):
    """The ctypes function ``int f(argtypes)`` of a threadpoolctl controller's library
    (OpenBLAS: ``openblas_name``, bare or with the build's symbol prefix and suffix;
    MKL: the first of ``mkl_names`` it exports), or None."""
    if lib.internal_api == "openblas":
        pre, suf = getattr(lib, "_symbol_prefix", ""), getattr(lib, "_symbol_suffix", "")
        names = (openblas_name, f"{pre}{openblas_name}{suf}")
    else:
        names = mkl_names
    for name in names:
        fn = getattr(lib.dynlib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
            return fn
    return None


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
    global _setters, _local, _getters
    if _setters is None:
        with _lock:
            if _setters is None:
                setters, libs = _find_setters()
                _local = _thread_local(setters, libs)
                _getters = _find_getters(libs) if setters else []
                if _getters:
                    # the product kernel's threads follow the library's count (held at
                    # one where the BLAS is: engine.core.sgemm)
                    sgemm.set_threads(1, ctypes.cast(_getters[0], ctypes.c_void_p).value)
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
    BLAS thread.  With one thread or one job, without a BLAS thread setting
    (``blas_threads_settable()``), or where one BLAS thread would give other numbers than
    the count in force (``products_depend_on_thread_count()``; at one thread already,
    the lanes change nothing and run), the jobs simply run here one after another.  An
    exception of a job is raised once all jobs have ended (the first in job order)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    jobs = list(jobs)
    if (threads == 1 or len(jobs) <= 1 or not blas_threads_settable()
            or (_above_one() and count_is_fixed())):
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


# -- whether the thread count changes the numbers --------------------------------------------------

_probe_lock = threading.Lock()
_dependent: bool | None = None    # products_depend_on_thread_count's answer, once found

# (rows, K, N): one- and few-row products (recurrent steps, small batches), a chunk's
# tens of rows, a batch's hundreds; narrow and wide weights
_PROBE_SHAPES = ((1, 384, 1024), (3, 384, 300), (5, 256, 1024), (8, 512, 640), (21, 128, 384),
                 (24, 64, 384), (37, 384, 64), (64, 768, 256), (150, 768, 256), (300, 256, 500))


def _probe_products() -> list[np.ndarray]:
    """The sample of products compared by products_depend_on_thread_count, at the count
    in force: each shape as ``x @ W.T`` (the components' form), ``W @ x.T`` (the
    exchanged form) and ``x @ Wt`` with Wt contiguous (the transposed copy) -- the
    layouts of engine.runtime.gemm."""
    rng = np.random.default_rng(2024)
    out = []
    for rows, k, n in _PROBE_SHAPES:
        x = rng.standard_normal((rows, k)).astype(np.float32)
        w = rng.standard_normal((n, k)).astype(np.float32)
        out += [x @ w.T, w @ x.T, x @ np.ascontiguousarray(w.T)]
    return out


def products_depend_on_thread_count() -> bool:
    """Whether float32 products computed on one BLAS thread differ, in any bit, from the
    same products at the count in force (see the module docstring), found once per
    process on a sample (``_PROBE_SHAPES``).  False where nothing can tell now -- the
    count cannot be set, or is one already -- and then asked again next time: while the
    count is one, nothing changes it anyway.  The comparison itself holds this thread's
    products at one BLAS thread for a few milliseconds, once (with a process-wide
    setting, as a concurrent section does, every thread's): a process that computes in
    several threads asks before they start (the service does, at startup)."""
    global _dependent
    if _dependent is not None:
        return _dependent
    if not _above_one():
        return False
    with _probe_lock:
        if _dependent is None:
            with np.errstate(all="ignore"):
                now = _probe_products()
                token = _hold_one()
                try:
                    one = _probe_products()
                finally:
                    _let_go(token)
            _dependent = not all(np.array_equal(a, b) for a, b in zip(now, one))
            if _dependent:
                log.info("the BLAS library's products round otherwise on one thread than at "
                         "its count in force: the BLAS thread count is left as it is (no "
                         "one-thread choice for small work, concurrent jobs run in turn)")
    return _dependent


# -- the policy: may the count change where the numbers then change? ----------------------------

THREAD_POLICIES = ("stable", "adaptive")
_adaptive = False       # set_thread_policy("adaptive")


def set_thread_policy(policy: str) -> None:
    """``"stable"`` (the default): the runtime changes no BLAS thread count where products
    on one thread round otherwise than at the count in force, so a computation gives the
    same bits every run; ``"adaptive"``: ``ThreadChoice`` and ``run_concurrently`` change
    it for speed there too (see the module docstring).  A change of policy makes every
    ThreadChoice decide again (``forget_thread_choices``)."""
    global _adaptive
    if policy not in THREAD_POLICIES:
        raise ValueError(f"unknown BLAS thread policy {policy!r}: expected one of "
                         f"{', '.join(THREAD_POLICIES)}")
    adaptive = policy == "adaptive"
    if adaptive != _adaptive:
        _adaptive = adaptive
        forget_thread_choices()


def thread_policy() -> str:
    return "adaptive" if _adaptive else "stable"


@contextlib.contextmanager
def thread_policy_set(policy: str):
    """``set_thread_policy(policy)`` for the block, the policy in force before it put back
    afterwards (a command line run, a benchmark run)."""
    before = thread_policy()
    set_thread_policy(policy)
    try:
        yield
    finally:
        set_thread_policy(before)


def count_is_fixed() -> bool:
    """Whether the runtime must keep the BLAS thread count in force: under the stable
    policy, where one BLAS thread would give other numbers
    (``products_depend_on_thread_count()``)."""
    return not _adaptive and products_depend_on_thread_count()


# -- one BLAS thread for small work ----------------------------------------------------------------

def _above_one() -> bool:
    """Whether the products of this thread run on more than one BLAS thread now, as
    far as can be told (a count that cannot be read counts as more than one); False
    when the count cannot be set."""
    if not _blas_setters():
        return False
    if not _local and _sections:
        return False            # a concurrent section holds the process at one thread
    return not _getters or _getters[0]() > 1


def _hold_one() -> list | None:
    """Put this thread's products on one BLAS thread (process-wide setters: as a
    concurrent section does, and composing with them); the token for ``_let_go``."""
    if _local:
        return [fn(1) for fn in _setters]
    _enter_section()
    return None


def _let_go(token: list | None) -> None:
    if _local:
        for fn, n in zip(_setters, token):
            fn(n)
    else:
        _leave_section()


_epoch = 0      # bumped by forget_thread_choices


def forget_thread_choices() -> None:
    """Make every ThreadChoice decide again (a process that changes its BLAS thread
    count: the choices were timed under the old one), and products_depend_on_thread_count
    look again (it compared one thread with the old count)."""
    global _epoch, _dependent
    _epoch += 1
    with _probe_lock:
        _dependent = None


def _timed(fn: Callable[[], T], one: bool) -> tuple[T, float]:
    """(``fn()``, its seconds), its products on one BLAS thread if ``one``."""
    token = _hold_one() if one else None
    try:
        t = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t
    finally:
        if one:
            _let_go(token)


class ThreadChoice:
    """Whether one stretch of work that runs again and again (the commands of a
    compiled computation up to its next input/output command) is faster with its
    products on one BLAS thread than at the count in force.

    A multi-threaded BLAS splits every product, which pays for large products and
    costs for small ones: each split product wakes the other threads and waits for
    them.  On a 2-core machine (2026-11-26, OpenBLAS 0.3.31, pthreads) TDNN-F's
    21-frame forward took 0.70 ms with one BLAS thread and 0.94 ms with two, TDNN-LSTM's
    150-frame one 13.1 and 15.1 ms, while TDNN-F's 150-frame one took 4.4 ms on one
    and 3.1 ms on two.  Which way a computation goes depends on its products and the
    machine, so it is measured: after a first run (which pays one-off costs: arena
    binding, the product forms' timing in engine.runtime.gemm), runs alternate
    between the two settings until each has ``TRIALS`` timings, then the faster
    (fastest run against fastest run; one thread only when faster by ``MARGIN``)
    is kept -- not for good: a choice timed while another process held a core (a
    two-thread product then waits for a thread that has none: 4-200x slower at 21
    frames) would otherwise hold for the life of the process.  After ``RECHECK``
    runs on the chosen setting the two are timed again in the same way; a choice
    that stands waits twice as long before the next check (up to ``RECHECK_MAX``
    runs), one that changes goes back to ``RECHECK``.  A gap of ``DECISIVE`` times or
    more between the fastest timings of the two settings so far decides once each has
    ``DECISIVE_AFTER`` timings (a loaded machine's two-thread run of a small computation
    can take 200 times the one-thread one: no need to pay for more; but one timing
    each was not enough: on a KVM guest a run now and then stalls for milliseconds
    whatever the setting -- a TDNN-F 21x1 forward of 0.6 ms timed once at 3.6 ms -- and
    such a single timing chose one thread for the next RECHECK runs); and the next check waits long
    enough for the runs it spends on the slower setting to cost at most
    ``CHECK_COST`` of the work in between.  Runs on the chosen setting are timed too:
    ``SLOW_RUNS`` in a row that each take ``DECISIVE`` times the setting's fastest timing
    at the decision bring the check forward to the next run (a choice of the library's
    count made on an idle machine, when another process then takes a core, would
    otherwise cost 2-17x per run for up to ``RECHECK_MAX`` runs: TDNN-LSTM 150x8 under
    such load 62 -> 117-1072 ms).
    The first choice is checked again after ``FIRST_RECHECK`` runs, whatever it cost:
    it is timed in a process's first runs of the computation, right after loading a
    model (whose preparation multiplies with the BLAS), and OpenBLAS's idle threads spin
    for about 0.1 s after a multi-threaded product, taking a core from the product
    kernel's worker (engine.core.sgemm) and the caller: on a 2-vCPU Intel Xeon model 167
    guest TDNN 150x1 forwards of 1.8 ms (two threads) took 5-9 ms in that window and the
    first trials chose one thread (2.7 ms) for the next RECHECK runs.
    ``forget_thread_choices`` makes every choice start over.
    Nothing is decided while the count is one anyway (a one-thread BLAS, a
    concurrent section of ``run_concurrently``, a caller's own limit), nor where
    the count cannot be set, nor, under the stable thread policy, where products on
    one BLAS thread give other numbers (``count_is_fixed``): there the stretch always
    runs at the count in force, so that a computation gives the same bits every run.
    Elsewhere (and under the adaptive policy) only speed depends on the choice.  With a
    process-wide setting (NumPy's OpenBLAS) holding one thread is a concurrent section:
    every thread's products run on one BLAS thread meanwhile, as they do while sections
    run."""

    TRIALS = 3
    MARGIN = 0.03
    RECHECK = 512
    RECHECK_MAX = 65536
    DECISIVE = 3.0
    DECISIVE_AFTER = 2
    FIRST_RECHECK = 24
    CHECK_COST = 0.01
    SLOW_RUNS = 3
    __slots__ = ("runs", "times", "one", "epoch", "left", "interval", "last", "decisions",
                 "best", "slow")

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.runs = 0
        self.times: tuple[list, list] = ([], [])
        self.one: bool | None = None       # None: still deciding
        self.epoch = _epoch
        self.left = 0                      # runs on the chosen setting until a check
        self.interval = self.RECHECK
        self.last: bool | None = None      # the choice before the check under way
        self.decisions = 0                 # how many times it has decided (checks too)
        self.best = 0.0                    # the chosen setting's fastest timing
        self.slow = 0                      # runs in a row since, DECISIVE times slower

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` in the setting chosen (or on trial)."""
        if self.epoch != _epoch:
            self._reset()
        one = self.one
        if one is None:
            return self._trial(fn)
        self.left -= 1
        if self.left <= 0:
            self._recheck()
            return self._trial(fn)
        out, secs = _timed(fn, one)
        if self.best > 0.0 and secs >= self.DECISIVE * self.best:
            self.slow += 1
            if self.slow >= self.SLOW_RUNS:
                self.left = 0           # the machine has changed: check at the next run
        else:
            self.slow = 0
        return out

    def _recheck(self) -> None:
        """Time both settings again (the one-off costs of a first run are paid)."""
        self.last, self.one = self.one, None
        self.runs = 1
        self.times = ([], [])

    def _trial(self, fn: Callable[[], T]) -> T:
        if count_is_fixed() or not _above_one():
            return fn()         # a choice that would change bits, or nothing to choose now
        k = self.runs
        self.runs = k + 1
        if k == 0:
            return fn()
        one = k % 2 == 1
        out, secs = _timed(fn, one)
        times = self.times
        times[one].append(secs)
        lib, held = times
        if len(lib) >= self.DECISIVE_AFTER and len(held) >= self.DECISIVE_AFTER:
            a, b = min(lib), min(held)
            if (max(a, b) >= self.DECISIVE * min(a, b)
                    or (len(lib) >= self.TRIALS and len(held) >= self.TRIALS)):
                self._decide(b < a * (1.0 - self.MARGIN))
        return out

    def _decide(self, one: bool) -> None:
        if self.last is None or one != self.last or self.decisions == 1:
            interval = self.RECHECK
        else:
            interval = min(2 * self.interval, self.RECHECK_MAX)
        # the runs on the slower setting at the next check, against the work until then
        chosen, other = self.times[one], self.times[not one]
        slower = min(other) / max(min(chosen), 1e-12)
        needed = math.ceil(len(other) * slower / self.CHECK_COST)
        if self.decisions == 0 and self.FIRST_RECHECK:
            # the first choice is timed in a process's first runs, when other work's
            # after-effects are still about (see FIRST_RECHECK): checked again soon
            self.interval = self.FIRST_RECHECK
        else:
            self.interval = min(max(interval, needed), self.RECHECK_MAX)
        self.one, self.last, self.left = one, None, self.interval
        self.best, self.slow = min(chosen), 0
        self.decisions += 1
