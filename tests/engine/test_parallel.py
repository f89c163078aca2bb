"""engine.runtime.parallel (independent computations at the same time, one BLAS thread
each) and what uses it: Inferencer(threads=K) and the service's infer_threads.

- run_concurrently: results in job order, jobs spread over threads, one thread = a plain
  loop, the first failing job's exception after every job ended, each job's products on
  one BLAS thread and the process's setting back as it was afterwards (also after many
  overlapping calls: a process-wide setting, as NumPy's OpenBLAS has, is held by a
  reference count), the probe telling a thread-local setting from a process-wide one,
  jobs in turn without a BLAS setting, nested calls; jobs in turn where one BLAS thread
  changes the numbers (in their lanes under the adaptive thread policy), and the probe
  that finds that out;
- Inferencer with threads=2 gives exactly the outputs of threads=1 (utterances of
  different lengths and chunk shapes, i-vectors, a recurrent network, subsampling), and
  splits a group of chunks into one batch per thread.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine.core.errors import InferenceError
from engine.inference import InferenceOptions, Inferencer, simple
from engine.runtime import parallel
from engine.runtime.parallel import run_concurrently

from inference_nets import RECURRENT, TDNN_IVECTOR, feats, make_nnet


def _local_blas_threads() -> list[int]:
    """This thread's BLAS thread count per library (read through the per-thread setter,
    which returns the count it replaces)."""
    out = []
    for set_local in parallel._blas_setters():
        n = set_local(1)
        set_local(n)
        out.append(n)
    return out


# where the count cannot be set (no threadpoolctl, a BLAS other than OpenBLAS or MKL)
# run_concurrently runs its jobs in turn by design, as the tests of that path check
needs_settable_blas = pytest.mark.skipif(not parallel.blas_threads_settable(),
                                         reason="the BLAS library's thread count cannot be set")


@pytest.fixture
def independent(monkeypatch):
    """The concurrent path, as on a BLAS whose products do not depend on the thread
    count (where they do, run_concurrently runs in turn: tested below)."""
    monkeypatch.setattr(parallel, "_dependent", False)


def test_results_in_order_and_spread_over_threads(independent):
    seen: dict[int, int] = {}

    def job(i):
        seen[i] = threading.get_ident()
        time.sleep(0.01)
        return i * i
    assert run_concurrently([lambda i=i: job(i) for i in range(7)], 3) == \
        [i * i for i in range(7)]
    if parallel.blas_threads_settable():
        assert len(set(seen.values())) == 3
        assert threading.get_ident() not in seen.values()   # lanes are threads of the call


def test_one_thread_or_one_job_runs_here():
    me = threading.get_ident()
    assert run_concurrently([threading.get_ident] * 3, 1) == [me] * 3
    assert run_concurrently([threading.get_ident], 4) == [me]
    assert run_concurrently([], 4) == []
    with pytest.raises(ValueError, match="threads must be >= 1"):
        run_concurrently([threading.get_ident], 0)


@pytest.mark.parametrize("threads,settable", [(2, True), (2, False), (1, True)],
                         ids=["threads", "no-blas-setting", "one-thread"])
def test_first_failure_raised_after_all_jobs_ended(monkeypatch, threads, settable, independent):
    """The same contract whether the jobs run in threads or in turn here (one thread,
    or a BLAS whose thread count cannot be set): every job runs, then the first failure
    in job order is raised."""
    if settable and not parallel.blas_threads_settable():
        pytest.skip("the BLAS library's thread count cannot be set")
    if not settable:
        monkeypatch.setattr(parallel, "blas_threads_settable", lambda: False)
    ran = []

    def ok(i):
        time.sleep(0.005)
        ran.append(i)
        return i

    def bad(i):
        raise KeyError(f"job {i}")
    jobs = [lambda: ok(0), lambda: bad(1), lambda: ok(2), lambda: bad(3), lambda: ok(4)]
    with pytest.raises(KeyError, match="job 1"):
        run_concurrently(jobs, threads)
    assert sorted(ran) == [0, 2, 4]


@needs_settable_blas
def test_each_job_on_one_blas_thread_and_the_setting_restored(independent):
    from threadpoolctl import ThreadpoolController  # noqa: PLC0415
    libs = ThreadpoolController().select(user_api="blas").lib_controllers
    before = [lib.get_num_threads() for lib in libs]
    inside = run_concurrently([_local_blas_threads] * 3, 2)
    assert inside == [[1] * len(parallel._blas_setters())] * 3
    assert [lib.get_num_threads() for lib in libs] == before
    seen = []
    t = threading.Thread(target=lambda: seen.append([lib.get_num_threads() for lib in libs]))
    t.start()
    t.join()
    assert seen == [before]


@needs_settable_blas
def test_overlapping_calls_leave_the_setting_as_it_was(independent):
    """Lanes ending at different times, calls overlapping from several threads: every
    job sees one BLAS thread, and once all have ended the count is what it was (lanes
    restoring a process-wide count themselves left it at 1 or restored it under a lane
    still running)."""
    from threadpoolctl import ThreadpoolController  # noqa: PLC0415
    libs = ThreadpoolController().select(user_api="blas").lib_controllers
    before = [lib.get_num_threads() for lib in libs]

    def job(i):
        time.sleep(0.001 * (i % 4))
        return _local_blas_threads()

    def call(k):
        return run_concurrently([lambda i=i: job(i + k) for i in range(5)], 2 + k % 2)
    for _ in range(3):
        seen = run_concurrently([lambda k=k: call(k) for k in range(4)], 4)
        # (one count per library the setting holds: SciPy's own OpenBLAS, loaded with
        # scipy.special, is left out, as no product here uses it)
        ones = [1] * len(parallel._blas_setters())
        assert all(s == ones for per_call in seen for s in per_call), (
            seen, parallel._local, parallel._sections, before)
        assert [lib.get_num_threads() for lib in libs] == before
    if not parallel.blas_setting_is_thread_local():
        assert parallel._sections == 0


class _FakeLib:
    def __init__(self, read):
        self.read = read

    def get_num_threads(self):
        return self.read()


def test_probe_tells_a_thread_local_setting_from_a_process_wide_one():
    """parallel._thread_local: a setter whose count another thread reads is process-wide
    (NumPy's pthreads OpenBLAS); one each thread keeps for itself is thread-local; a
    count of one cannot tell and counts as process-wide."""
    shared = {"n": 4}

    def set_global(n):
        old, shared["n"] = shared["n"], n
        return old
    assert not parallel._thread_local([set_global], [_FakeLib(lambda: shared["n"])])
    assert shared["n"] == 4                         # the probe put it back

    mine = threading.local()

    def set_local(n):
        old = getattr(mine, "n", 4)
        mine.n = n
        return old
    assert parallel._thread_local([set_local], [_FakeLib(lambda: getattr(mine, "n", 4))])
    shared["n"] = 1
    assert not parallel._thread_local([set_global], [_FakeLib(lambda: shared["n"])])
    assert not parallel._thread_local([], [])


def test_without_a_blas_thread_setting_jobs_run_in_turn(monkeypatch):
    monkeypatch.setattr(parallel, "_setters", [])
    me = threading.get_ident()
    assert run_concurrently([threading.get_ident] * 3, 3) == [me] * 3


def test_where_one_thread_changes_the_numbers_jobs_run_in_turn(monkeypatch):
    """On a BLAS whose products round otherwise on one thread (OpenBLAS's Haswell
    kernels), holding the process at one thread would change the numbers of every
    thread's products: the jobs run here, one after another, at the count in force."""
    monkeypatch.setattr(parallel, "_dependent", True)
    monkeypatch.setattr(parallel, "_above_one", lambda: True)
    me = threading.get_ident()
    assert run_concurrently([threading.get_ident] * 3, 3) == [me] * 3
    if parallel.blas_threads_settable():
        before = _local_blas_threads()
        assert run_concurrently([_local_blas_threads] * 2, 2) == [before] * 2


@needs_settable_blas
def test_at_one_blas_thread_lanes_run_even_where_it_changes_the_numbers(monkeypatch):
    """At one BLAS thread already (a caller's limit, an enclosing section) the lanes'
    setting changes no count: the jobs run in threads as usual."""
    monkeypatch.setattr(parallel, "_dependent", True)
    monkeypatch.setattr(parallel, "_above_one", lambda: False)
    me = threading.get_ident()

    def job():
        time.sleep(0.01)        # (a thread's ident is reused once it has ended)
        return threading.get_ident()
    seen = run_concurrently([job] * 3, 3)
    assert me not in seen and len(set(seen)) == 3


def test_adaptive_policy_runs_lanes_where_one_thread_changes_the_numbers(monkeypatch):
    """Under the adaptive BLAS thread policy the jobs run in their lanes even where one
    BLAS thread rounds otherwise (under the stable one they run in turn: above)."""
    monkeypatch.setattr(parallel, "_dependent", True)
    monkeypatch.setattr(parallel, "_above_one", lambda: True)
    monkeypatch.setattr(parallel, "blas_threads_settable", lambda: True)
    monkeypatch.setattr(parallel, "blas_setting_is_thread_local", lambda: True)
    monkeypatch.setattr(parallel, "_blas_setters", lambda: [])
    me = threading.get_ident()

    def job():
        time.sleep(0.01)
        return threading.get_ident()
    assert run_concurrently([job] * 3, 3) == [me] * 3       # stable: in turn
    with parallel.thread_policy_set("adaptive"):
        monkeypatch.setattr(parallel, "_dependent", True)  # (the policy change forgot it)
        seen = run_concurrently([job] * 3, 3)
    assert me not in seen and len(set(seen)) == 3


class _ProbeBlas:
    """A BLAS for products_depend_on_thread_count: the sample of products it gives
    at the count in force and on one thread."""

    def __init__(self, monkeypatch, differ: bool, above_one: bool = True):
        self.held = 0
        self.holds = 0
        monkeypatch.setattr(parallel, "_dependent", None)
        monkeypatch.setattr(parallel, "_above_one", lambda: above_one)
        monkeypatch.setattr(parallel, "_hold_one", self.hold)
        monkeypatch.setattr(parallel, "_let_go", self.let_go)
        base = [np.arange(6, dtype=np.float32).reshape(2, 3)]
        other = [base[0] + np.float32(1e-7) * np.float32(differ)]
        monkeypatch.setattr(parallel, "_probe_products",
                            lambda: [a.copy() for a in (other if self.held else base)])

    def hold(self):
        self.held += 1
        self.holds += 1
        return "token"

    def let_go(self, token):
        assert token == "token"
        self.held -= 1


@pytest.mark.parametrize("differ", [True, False])
def test_probe_compares_one_thread_with_the_count_in_force(monkeypatch, differ):
    """The sample computed on one thread (held, then let go) against the count in
    force decides, once: asked again, the answer is kept."""
    blas = _ProbeBlas(monkeypatch, differ)
    assert parallel.products_depend_on_thread_count() is differ
    assert blas.held == 0 and blas.holds == 1
    assert parallel.products_depend_on_thread_count() is differ
    assert blas.holds == 1
    parallel.forget_thread_choices()            # a process that changed its count: again
    assert parallel._dependent is None


def test_probe_waits_while_the_count_is_one(monkeypatch):
    """At one BLAS thread (or none settable) nothing can be compared, and nothing
    will change the count: False, and the question stays open."""
    blas = _ProbeBlas(monkeypatch, differ=True, above_one=False)
    assert parallel.products_depend_on_thread_count() is False
    assert blas.holds == 0 and parallel._dependent is None


def test_probe_products_cover_the_runtime_layouts():
    """The real sample: per shape the components' form, the exchanged form and the
    transposed copy (engine.runtime.gemm's layouts), float32."""
    got = parallel._probe_products()
    assert len(got) == 3 * len(parallel._PROBE_SHAPES)
    for (rows, _, n), (a, b, c) in zip(parallel._PROBE_SHAPES,
                                       zip(got[0::3], got[1::3], got[2::3])):
        assert a.shape == c.shape == (rows, n) and b.shape == (n, rows)
        assert a.dtype == np.float32
    assert isinstance(parallel.products_depend_on_thread_count(), bool)


def test_nested_calls_do_not_wait_for_each_other(independent):
    inner = [lambda i=i: i for i in range(4)]
    outer = [lambda: sum(run_concurrently(inner, 2)) for _ in range(3)]
    assert run_concurrently(outer, 3) == [6, 6, 6]


def _treat_as_non_recurrent(monkeypatch):
    """Inferencers made afterwards use their threads for recurrent networks too (they
    compute the same; Inferencer.parallel_pays leaves them out for speed only)."""
    from engine.nnet import graph  # noqa: PLC0415
    monkeypatch.setattr(graph, "graph_has_cycles", lambda g: False)


def _utterances(inf, lengths, ivector_dim=0, seed=0):
    rng = np.random.default_rng(seed)
    return [inf.make_utterance(feats(n, seed=seed + k),
                               ivector=rng.standard_normal(ivector_dim).astype(np.float32)
                               if ivector_dim else None)
            for k, n in enumerate(lengths)]


@pytest.mark.parametrize("config,ivector_dim,opts", [
    (TDNN_IVECTOR, 4, {"frames_per_chunk": 20}),
    (TDNN_IVECTOR, 4, {"frames_per_chunk": 21, "frame_subsampling_factor": 3}),
    (RECURRENT, 0, {"frames_per_chunk": 17, "extra_left_context": 4}),
])
def test_inferencer_threads_equal_one_thread(config, ivector_dim, opts, monkeypatch):
    monkeypatch.setattr(simple, "PARALLEL_MIN_FRAMES", 0)        # small inputs: force it
    _treat_as_non_recurrent(monkeypatch)
    nnet = make_nnet(config)
    one = Inferencer(nnet, InferenceOptions(**opts))
    two = Inferencer(nnet, InferenceOptions(threads=2, **opts))
    three = Inferencer(nnet, InferenceOptions(threads=3, max_batch=2, **opts))
    utts = _utterances(one, [95, 60, 130, 61, 7, 95], ivector_dim)
    ref = one.infer_batch(utts)
    for inf in (two, three):
        got = inf.infer_batch(utts)
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            # the batches differ (one per thread), so products of other row counts: float32
            # rounding apart (OpenBLAS's small-matrix kernels depend on the row count)
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_same_computation_in_threads_is_bit_identical():
    """Executors of one computation at the same time (shared program, buffer pool and
    product forms) compute exactly what they compute one after another."""
    from engine.compiler.request import ComputationRequest, IoSpecification  # noqa: PLC0415
    from engine.compiler.shortcut import compile_request  # noqa: PLC0415
    from engine.core.index import Index  # noqa: PLC0415
    from engine.runtime.backend import BufferPool  # noqa: PLC0415
    from engine.runtime.executor import Executor  # noqa: PLC0415
    nnet = make_nnet(RECURRENT)
    req = ComputationRequest(
        [IoSpecification("input", [Index(n, t, 0) for n in range(3) for t in range(-2, 43)])],
        [IoSpecification("output", [Index(n, t, 0) for n in range(3) for t in range(40)])])
    comp = compile_request(nnet, req)
    pool = BufferPool()
    xs = [feats(135, seed=s) for s in range(6)]

    def run(x):
        ex = Executor(comp, nnet, pool=pool)
        ex.accept_input("input", x)
        ex.run()
        y = np.array(ex.get_output("output"))
        ex.release()
        return y
    alone = [run(x) for x in xs]
    together = run_concurrently([lambda x=x: run(x) for x in xs], 3)
    assert all(np.array_equal(a, b) for a, b in zip(alone, together))


def test_batch_size_per_thread():
    inf = Inferencer(make_nnet(TDNN_IVECTOR), InferenceOptions(max_batch=16))
    assert inf._batch_size(8, 1) == 16
    assert inf._batch_size(8, 2) == 8 // 2
    assert inf._batch_size(7, 2) == 4
    assert inf._batch_size(40, 4) == 10
    assert inf._batch_size(1, 4) == 1
    assert Inferencer(make_nnet(TDNN_IVECTOR), InferenceOptions(max_batch=3))._batch_size(40, 4) == 3


def test_parallel_only_where_it_pays():
    """Threads are used for networks without recurrence and enough output frames per
    thread; recurrent networks and short inputs run in one thread."""
    tdnn = Inferencer(make_nnet(TDNN_IVECTOR), InferenceOptions(threads=2))
    # the CPU rule (NNETC_TEST_BACKEND=cupy swaps the backend; another backend never splits)
    tdnn.backend = np
    assert tdnn.parallel_pays(2 * simple.PARALLEL_MIN_FRAMES)
    assert not tdnn.parallel_pays(2 * simple.PARALLEL_MIN_FRAMES - 1)
    assert not Inferencer(make_nnet(TDNN_IVECTOR)).parallel_pays(10 ** 6)
    rec = Inferencer(make_nnet(RECURRENT), InferenceOptions(threads=2))
    assert rec._recurrent and not rec.parallel_pays(10 ** 6)
    assert not tdnn._recurrent
    with pytest.raises(InferenceError, match="threads: must be in"):
        InferenceOptions(threads=0).check()


def test_threads_on_another_backend_run_in_turn(monkeypatch):
    """threads > 1 is for the CPU: with another backend the batches run one after
    another (run_concurrently is given one thread) and are not split per thread."""
    from engine.inference import simple  # noqa: PLC0415

    class OtherBackend:
        pass
    nnet = make_nnet(TDNN_IVECTOR)
    monkeypatch.setattr(simple, "PARALLEL_MIN_FRAMES", 0)
    inf = Inferencer(nnet, InferenceOptions(frames_per_chunk=20, threads=2))
    inf.backend = OtherBackend()
    threads = []
    monkeypatch.setattr(simple, "run_concurrently",
                        lambda jobs, k: threads.append(k) or run_concurrently(jobs, k))
    ran = []
    monkeypatch.setattr(simple.Inferencer, "_run_batch",
                        lambda self, b, u, c: ran.append(len(b)) or
                        np.zeros((len(b) * b[0].num_sub, self.output_dim), np.float32))
    inf.infer_batch(_utterances(inf, [95, 95, 95], 4))
    assert threads == [1] and sum(ran) == 15 and max(ran) == 12    # batches of max_batch


def test_inferencer_threads_errors_reach_the_caller(monkeypatch):
    """A chunk computation that fails in a worker thread fails the call with its typed
    error (the service turns it into a 4xx), nothing left running."""
    from engine.core.errors import ResourceLimitError  # noqa: PLC0415
    monkeypatch.setattr(simple, "PARALLEL_MIN_FRAMES", 0)
    nnet = make_nnet(TDNN_IVECTOR)
    inf = Inferencer(nnet, InferenceOptions(frames_per_chunk=20, threads=2), max_peak_bytes=100)
    before = threading.active_count()
    with pytest.raises(ResourceLimitError, match="more than the limit of 100 bytes"):
        inf.infer_batch(_utterances(inf, [95, 95, 95], 4))
    assert threading.active_count() == before


@pytest.mark.parametrize("seed", range(12))
def test_inferencer_threads_on_random_networks(seed, monkeypatch):
    """Random networks of every generator kind (recurrent ones included), random chunk
    sizes, batch limits and utterances: 3 threads equal 1 (a campaign of 200 seeds from
    123000 found no difference; this is a slice of it)."""
    from engine.nnet.random_config import generate_config_sequence  # noqa: PLC0415
    monkeypatch.setattr(simple, "PARALLEL_MIN_FRAMES", 0)
    _treat_as_non_recurrent(monkeypatch)        # threads for recurrent kinds too
    rng = np.random.default_rng(123000 + seed)
    nnet = generate_config_sequence(rng).build(rng)
    one = Inferencer(nnet, InferenceOptions(frames_per_chunk=int(rng.integers(5, 30))))
    three = Inferencer(nnet, InferenceOptions(frames_per_chunk=one.options.frames_per_chunk,
                                              threads=3, max_batch=int(rng.integers(1, 5))))
    ivd = nnet.input_dim("ivector")
    utts = [one.make_utterance(
        rng.standard_normal((int(rng.integers(1, 120)), one.input_dim)).astype(np.float32),
        ivector=rng.standard_normal(ivd).astype(np.float32) if ivd > 0 else None)
        for _ in range(int(rng.integers(1, 6)))]
    for a, b in zip(one.infer_batch(utts), three.infer_batch(utts)):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
