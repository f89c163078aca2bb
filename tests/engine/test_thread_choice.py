"""engine.runtime.parallel.ThreadChoice: a computation's commands on one BLAS thread
where that is faster.

- the choice follows the faster setting (a fake clock: no wall-clock assertion), after a
  first untimed run and TRIALS timed runs of each setting, alternating; one thread only
  when faster by MARGIN; kept afterwards, and timed again after RECHECK runs (a choice
  made while the machine was loaded heals; one that stands is checked half as often), or
  at once after SLOW_RUNS runs that each take DECISIVE times the chosen setting's best;
- nothing is timed or decided while the count is one anyway, nor where one BLAS thread
  gives other numbers (products_depend_on_thread_count) under the stable thread policy;
  under the adaptive one it is (set_thread_policy; unknown policy names refused);
- forget_thread_choices makes it decide again;
- a failing run lets the thread go and reaches the caller;
- with the real BLAS: the count is one while held, and as it was afterwards;
- the executor: a computation run many times gives bit-identical outputs whichever
  setting it is on (also with products of a TDNN-F chunk's sizes, whose rounding some
  BLAS kernels change with the thread count), and its program decides once the count can
  be more than one.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.runtime import parallel
from engine.runtime.parallel import ThreadChoice, forget_thread_choices

from inference_nets import RECURRENT, feats, make_nnet


class _Clock:
    """perf_counter for parallel: each run advances it by what the run costs in the
    setting it runs in."""

    def __init__(self, held_cost: float, free_cost: float):
        self.now = 0.0
        self.held = 0
        self.costs = (free_cost, held_cost)
        self.settings: list[bool] = []

    def perf_counter(self) -> float:
        return self.now

    def work(self) -> str:
        held = self.held > 0
        self.settings.append(held)
        self.now += self.costs[held]
        return "done"


@pytest.fixture
def fake(monkeypatch):
    def make(held_cost, free_cost, above_one=True):
        clock = _Clock(held_cost, free_cost)

        def hold():
            clock.held += 1
            return "token"

        def let_go(token):
            assert token == "token"
            clock.held -= 1
        monkeypatch.setattr(parallel, "time", clock)
        # (the first choice's early check: test_the_first_choice_is_checked_again_soon)
        monkeypatch.setattr(ThreadChoice, "FIRST_RECHECK", 0)
        monkeypatch.setattr(parallel, "_above_one", lambda: above_one)
        # (the choice between settings is made where they give the same numbers)
        monkeypatch.setattr(parallel, "products_depend_on_thread_count", lambda: False)
        monkeypatch.setattr(parallel, "_hold_one", hold)
        monkeypatch.setattr(parallel, "_let_go", let_go)
        return clock
    return make


@pytest.mark.parametrize("held_cost, free_cost, expect_one", [
    (1.0, 2.0, True),        # one thread twice as fast
    (2.0, 1.0, False),       # the library's count faster
    (0.99, 1.0, False),      # one thread faster by less than MARGIN
])
def test_choice_follows_the_faster_setting(fake, held_cost, free_cost, expect_one):
    clock = fake(held_cost, free_cost)
    choice = ThreadChoice()
    trials = 1 + 2 * ThreadChoice.TRIALS
    for _ in range(trials - 1):
        assert choice.run(clock.work) == "done"
        assert choice.one is None
    choice.run(clock.work)
    assert choice.one is expect_one
    # the first run untimed on the library's count, then alternating
    assert clock.settings == [False] + [k % 2 == 1 for k in range(1, trials)]
    for _ in range(5):
        choice.run(clock.work)
    assert clock.settings[trials:] == [expect_one] * 5
    assert clock.held == 0


def test_a_choice_is_checked_again_and_heals(fake, monkeypatch):
    """Timed while one thread was faster (the other core busy, say), then the library's
    count becomes faster: the check after RECHECK runs turns the choice round."""
    monkeypatch.setattr(ThreadChoice, "RECHECK", 4)
    monkeypatch.setattr(ThreadChoice, "CHECK_COST", 1e9)    # the interval as RECHECK says
    clock = fake(1.0, 2.0)
    choice = ThreadChoice()
    trials = 2 * ThreadChoice.TRIALS
    for _ in range(1 + trials):
        choice.run(clock.work)
    assert choice.one is True and choice.decisions == 1
    clock.costs = (1.0, 2.0)          # (free, held): the library's count now faster
    start = len(clock.settings)
    for _ in range(4 - 1):
        choice.run(clock.work)
    assert clock.settings[start:] == [True] * 3 and choice.one is True
    # the 4th run starts the check: alternating, first on one thread
    for _ in range(trials):
        choice.run(clock.work)
    assert clock.settings[start + 3:] == [k % 2 == 0 for k in range(trials)]
    assert choice.one is False and choice.decisions == 2
    assert choice.interval == 4       # changed: checked again soon
    assert clock.held == 0


def test_a_run_of_slow_runs_brings_the_check_forward(fake):
    """The library's count chosen on an idle machine; then another process takes a core
    and its runs take DECISIVE times as long: after SLOW_RUNS of them the next run starts
    the check, which turns the choice round after DECISIVE_AFTER timings of each (a
    decisive gap).  A single slow run (a hiccup) does not."""
    clock = fake(2.0, 1.0)                  # (one thread, library's count)
    choice = ThreadChoice()
    for _ in range(1 + 2 * ThreadChoice.TRIALS):
        choice.run(clock.work)
    assert choice.one is False and choice.best == 1.0 and choice.left == choice.interval
    clock.costs = (10.0, 2.0)               # (free, held): the library's count 10x slower
    choice.run(clock.work)                  # one slow run, then back to normal
    clock.costs = (1.0, 2.0)
    choice.run(clock.work)
    assert choice.slow == 0 and choice.one is False
    clock.costs = (10.0, 2.0)
    start = len(clock.settings)
    for _ in range(ThreadChoice.SLOW_RUNS):
        choice.run(clock.work)
    assert choice.one is False and choice.left == 0
    for _ in range(2 * ThreadChoice.DECISIVE_AFTER):
        choice.run(clock.work)              # the check: one thread, the library's count
    assert clock.settings[start:] == ([False] * ThreadChoice.SLOW_RUNS
                                      + [True, False] * ThreadChoice.DECISIVE_AFTER)
    assert choice.one is True and choice.decisions == 2 and clock.held == 0


def test_a_choice_that_stands_is_checked_less_often(fake, monkeypatch):
    monkeypatch.setattr(ThreadChoice, "RECHECK", 4)
    monkeypatch.setattr(ThreadChoice, "RECHECK_MAX", 16)
    monkeypatch.setattr(ThreadChoice, "CHECK_COST", 1e9)
    clock = fake(2.0, 1.0)
    choice = ThreadChoice()
    intervals = []
    for _ in range(200):
        choice.run(clock.work)
        if not intervals or intervals[-1] != choice.interval:
            intervals.append(choice.interval)
    assert intervals == [4, 8, 16]
    assert choice.one is False
    # a check costs TRIALS runs on the slower setting: here 3 in each 16 + 6 runs
    held = sum(clock.settings[-100:])
    assert 0 < held <= 3 * (100 // (16 + 6) + 1)


def test_a_decisive_gap_decides_at_once_and_spaces_the_checks(fake):
    """On a loaded machine the library's count can be 200x slower for a small
    computation: DECISIVE_AFTER (two) timings of each decide, and the next check waits
    until its slow runs cost at most CHECK_COST of the work in between.  A single
    stalled run (a hiccup of the host) does not decide."""
    clock = fake(1.0, 200.0)
    choice = ThreadChoice()
    for _ in range(5):     # untimed, then one thread and the library's count twice each
        choice.run(clock.work)
    assert clock.settings == [False, True, False, True, False]
    assert choice.one is True and choice.decisions == 1
    assert choice.interval == min(ThreadChoice.RECHECK_MAX,   # 40,000
                                  round(ThreadChoice.DECISIVE_AFTER * 200.0
                                        / ThreadChoice.CHECK_COST))
    # no clear gap: the full TRIALS of each
    clock = fake(1.0, 1.5)
    choice = ThreadChoice()
    for _ in range(2 * ThreadChoice.TRIALS):
        choice.run(clock.work)
    assert choice.one is None
    choice.run(clock.work)
    assert choice.one is True and choice.interval == ThreadChoice.RECHECK


def test_the_first_choice_is_checked_again_soon(fake, monkeypatch):
    """The first choice (timed while, say, the BLAS's threads still spin after loading a
    model) is checked again after FIRST_RECHECK runs; the one made then follows the
    usual spacing (RECHECK, then doubling while it stands)."""
    monkeypatch.setattr(ThreadChoice, "RECHECK", 100)
    monkeypatch.setattr(ThreadChoice, "CHECK_COST", 1e9)    # the interval as RECHECK says
    clock = fake(1.0, 2.0)                  # one thread looks faster at first ...
    monkeypatch.setattr(ThreadChoice, "FIRST_RECHECK", 10)
    choice = ThreadChoice()
    for _ in range(1 + 2 * ThreadChoice.TRIALS):
        choice.run(clock.work)
    assert choice.one is True and choice.interval == 10 and choice.decisions == 1
    clock.costs = (1.0, 2.0)                # ... then the library's count is
    for _ in range(10 + 2 * ThreadChoice.TRIALS):
        choice.run(clock.work)
    assert choice.one is False and choice.decisions == 2 and choice.interval == 100
    for _ in range(100 + 2 * ThreadChoice.TRIALS):
        choice.run(clock.work)
    assert choice.one is False and choice.decisions == 3 and choice.interval == 200


def test_nothing_decided_at_one_thread(fake):
    clock = fake(1.0, 2.0, above_one=False)
    choice = ThreadChoice()
    for _ in range(20):
        choice.run(clock.work)
    assert choice.one is None and choice.runs == 0
    assert clock.settings == [False] * 20


def test_nothing_decided_where_one_thread_changes_the_numbers(fake, monkeypatch):
    """Where products on one BLAS thread round otherwise (OpenBLAS's Haswell kernels),
    every run stays at the count in force: a computation gives the same bits every
    run, never those of a trial on one thread."""
    clock = fake(1.0, 2.0)
    monkeypatch.setattr(parallel, "products_depend_on_thread_count", lambda: True)
    choice = ThreadChoice()
    for _ in range(4 * (1 + 2 * ThreadChoice.TRIALS)):
        choice.run(clock.work)
    assert choice.one is None and choice.runs == 0
    assert clock.settings == [False] * len(clock.settings)


@pytest.fixture
def adaptive():
    """The adaptive BLAS thread policy for one test (the stable one, the default, after)."""
    with parallel.thread_policy_set("adaptive"):
        yield


def test_the_adaptive_policy_decides_where_one_thread_changes_the_numbers(fake, monkeypatch,
                                                                            adaptive):
    """Under set_thread_policy("adaptive") the choice is made where products on one BLAS
    thread round otherwise too (speed first: a loaded machine's two-thread products of a
    small computation can be many times slower); back on the stable policy the choice
    starts over and nothing is decided there any more."""
    clock = fake(1.0, 3.5)
    monkeypatch.setattr(parallel, "products_depend_on_thread_count", lambda: True)
    assert parallel.thread_policy() == "adaptive" and not parallel.count_is_fixed()
    choice = ThreadChoice()
    for _ in range(5):     # untimed, then one thread and the library's count twice each
        choice.run(clock.work)
    assert choice.one is True and clock.settings == [False, True, False, True, False]
    choice.run(clock.work)
    assert clock.settings[-1] is True and clock.held == 0
    parallel.set_thread_policy("stable")
    assert parallel.count_is_fixed()
    start = len(clock.settings)
    for _ in range(10):
        choice.run(clock.work)
    assert choice.one is None and clock.settings[start:] == [False] * 10


def test_thread_policy_names_are_checked():
    with pytest.raises(ValueError, match="unknown BLAS thread policy 'fast'.*stable, adaptive"):
        parallel.set_thread_policy("fast")
    assert parallel.thread_policy() == "stable"


def test_forget_makes_it_decide_again(fake):
    clock = fake(1.0, 2.0)
    choice = ThreadChoice()
    for _ in range(1 + 2 * ThreadChoice.TRIALS):
        choice.run(clock.work)
    assert choice.one is True
    forget_thread_choices()
    choice.run(clock.work)
    assert choice.one is None and choice.runs == 1


def test_a_failing_run_lets_go_and_raises(fake):
    clock = fake(1.0, 2.0)
    choice = ThreadChoice()
    choice.run(clock.work)          # the untimed first run

    def boom():
        assert clock.held == 1      # the second run is a one-thread trial
        raise ValueError("boom")
    with pytest.raises(ValueError, match="boom"):
        choice.run(boom)
    assert clock.held == 0
    assert choice.times == ([], [])     # a failed run is not a timing


def _count() -> int:
    return parallel._getters[0]()


@pytest.mark.skipif(not parallel.blas_threads_settable() or not parallel._getters,
                    reason="the loaded BLAS is not an OpenBLAS or MKL whose thread count "
                           "threadpoolctl can set and read (the test needs the real count)")
def test_real_blas_count_held_and_restored():
    before = _count()
    choice = ThreadChoice()
    choice.one, choice.left = True, 10 ** 9     # one thread chosen, no check due
    seen = choice.run(_count)
    assert seen == 1
    assert _count() == before


def test_executor_outputs_equal_in_either_setting():
    from engine.compiler.request import ComputationRequest, IoSpecification  # noqa: PLC0415
    from engine.compiler.shortcut import compile_request  # noqa: PLC0415
    from engine.core.index import Index  # noqa: PLC0415
    from engine.runtime.executor import Executor  # noqa: PLC0415
    nnet = make_nnet(RECURRENT)
    req = ComputationRequest(
        [IoSpecification("input", [Index(0, t, 0) for t in range(-2, 43)])],
        [IoSpecification("output", [Index(0, t, 0) for t in range(40)])])
    comp = compile_request(nnet, req)
    x = feats(45)
    outs, program, xp = [], None, None
    for _ in range(3 + 2 * ThreadChoice.TRIALS):
        ex = Executor(comp, nnet)
        ex.accept_input("input", x)
        ex.run()
        outs.append(np.array(ex.get_output("output")))
        program, xp = ex._program, ex.xp
        ex.release()
    assert all(np.array_equal(outs[0], y) for y in outs[1:])
    if xp is not np:
        # NNETC_TEST_BACKEND=cupy: BLAS threads are the CPU's; another backend never chooses
        assert program._thread_choices == {}
        return
    # one stretch of commands: from the first after the input to the output
    (choice,) = program._thread_choices.values()
    if parallel._above_one() and not parallel.products_depend_on_thread_count():
        assert choice.one is not None
    else:
        assert choice.one is None


# products of the sizes of a TDNN-F chunk (tens of rows, 64-384 columns): the shapes whose
# rounding depends on the BLAS thread count with OpenBLAS's Haswell kernels
_WIDE = """
input-node name=input dim=40
component name=a1 type=AffineComponent input-dim=120 output-dim=384
component-node name=a1 component=a1 input=Append(Offset(input, -1), input, Offset(input, 1))
component name=r1 type=RectifiedLinearComponent dim=384
component-node name=r1 component=r1 input=a1
component name=l2 type=AffineComponent input-dim=768 output-dim=64
component-node name=l2 component=l2 input=Append(Offset(r1, -1), r1)
component name=a2 type=AffineComponent input-dim=128 output-dim=384
component-node name=a2 component=a2 input=Append(l2, Offset(l2, 1))
component name=r2 type=RectifiedLinearComponent dim=384
component-node name=r2 component=r2 input=a2
component name=out type=AffineComponent input-dim=384 output-dim=300
component-node name=out component=out input=r2
output-node name=output input=out
"""


@pytest.mark.parametrize("rows", [21, 150])
def test_a_computation_gives_the_same_bits_every_run(rows):
    """Run after run -- through the first run, the thread-count trials and the choice --
    a computation's outputs are bit-identical: the runtime tries one BLAS thread only
    where that changes no number (on OpenBLAS's Haswell kernels a 21-row TDNN-F forward
    came out two ways over twelve runs before products_depend_on_thread_count)."""
    from engine.compiler.request import ComputationRequest, IoSpecification  # noqa: PLC0415
    from engine.compiler.shortcut import compile_request  # noqa: PLC0415
    from engine.core.index import Index  # noqa: PLC0415
    from engine.runtime.executor import Executor  # noqa: PLC0415
    nnet = make_nnet(_WIDE)
    req = ComputationRequest(
        [IoSpecification("input", [Index(0, t, 0) for t in range(-2, rows + 2)])],
        [IoSpecification("output", [Index(0, t, 0) for t in range(rows)])])
    comp = compile_request(nnet, req)
    x = np.random.default_rng(5).standard_normal((rows + 4, 40)).astype(np.float32)
    outs = []
    for _ in range(4 + 4 * ThreadChoice.TRIALS):
        ex = Executor(comp, nnet)
        ex.accept_input("input", x)
        ex.run()
        outs.append(np.array(ex.get_output("output")))
        ex.release()
    assert all(np.array_equal(outs[0], y) for y in outs[1:])


def test_a_streams_chunks_choose_too_and_give_the_same_bits():
    """A looped computation runs its dynamic program (no arena), a stretch per chunk from
    the same command each time: those stretches choose their thread count as the bound
    programs' do, and a stream's output is bit-identical whatever they choose."""
    from engine.inference.looped import LoopedConfig  # noqa: PLC0415
    from engine.inference.stream import LoopedModel  # noqa: PLC0415
    model = LoopedModel(make_nnet(RECURRENT), LoopedConfig(5, 0, 1))
    x = feats(300, seed=8)
    outs = []
    # (where one BLAS thread changes the numbers, the runtime never holds one: not tried)
    settings = (None, False) if parallel.products_depend_on_thread_count() else (None, True, False)
    for one in settings:
        s = model.stream()
        if s.executor.xp is not np:
            pytest.skip("BLAS threads are the CPU backend's")
        program = s.executor._get_program()
        for choice in program._thread_choices.values():
            choice._reset()
            choice.one, choice.left = one, 10 ** 9     # a setting held throughout
        outs.append(np.concatenate([s.push(x), s.finish()]))
        assert program._thread_choices, "the chunks' stretches choose no thread count"
    assert all(np.array_equal(outs[0], y) for y in outs[1:])
