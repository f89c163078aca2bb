"""Stopping a compile (engine.core.cancel): within ``stopping_when(hook)`` the compiler
and the optimizer ask the hook at their checkpoints and raise ``Cancelled`` naming the
phase once it says stop.  A compile stopped at any of its checkpoints leaves nothing
behind: the next compile of the same request gives the same computation.  Hooks are
per thread and per block; without one nothing is asked."""

from __future__ import annotations

import threading

import pytest

from compiler_ref import CASES, load_case
from engine.compiler.graph import ComputationGraph, ComputationGraphBuilder
from engine.compiler.request import ComputationRequest, IoSpecification
from engine.compiler.serialize import computation_to_data
from engine.compiler.shortcut import compile_request
from engine.core.cancel import checkpoint, stopping_when
from engine.core.errors import Cancelled
from engine.core.index import Index
from engine.core.memo import clear_request_memos
from inference_nets import RECURRENT, make_nnet


class _StopAt:
    """A hook that says stop at its ``at``-th call (never when ``at`` is None) and
    counts the calls."""

    def __init__(self, at: int | None = None):
        self.at, self.calls = at, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.at is not None and self.calls >= self.at


def _chunk_request(t_in: range, t_out: range, n: int = 1) -> ComputationRequest:
    return ComputationRequest(
        [IoSpecification("input", [Index(k, t, 0) for k in range(n) for t in t_in])],
        [IoSpecification("output", [Index(k, t, 0) for k in range(n) for t in t_out],
                         has_deriv=True)], need_model_derivative=True)


def _stop_everywhere(nnet, request) -> int:
    """Compile ``request`` stopping at each checkpoint in turn; returns how many there
    were.  Each stop is Cancelled; afterwards the compile gives what it gave before."""
    clear_request_memos()
    want = computation_to_data(compile_request(nnet, request))
    count = _StopAt()
    clear_request_memos()
    with stopping_when(count):
        assert computation_to_data(compile_request(nnet, request)) == want   # a hook that never stops
    assert count.calls >= 5
    for at in range(1, count.calls + 1):
        clear_request_memos()
        with stopping_when(_StopAt(at)), pytest.raises(Cancelled,
                                                       match="compilation stopped by its "
                                                             "caller"):
            compile_request(nnet, request)
    clear_request_memos()
    assert computation_to_data(compile_request(nnet, request)) == want
    return count.calls


def test_a_compile_stopped_at_any_checkpoint_leaves_nothing_behind():
    # a recurrent network with derivatives (graph, steps, commands, every pass, several
    # merge rounds), and a multi-sequence request (the shortcut's mini compile)
    nnet = make_nnet(RECURRENT)
    assert _stop_everywhere(nnet, _chunk_request(range(-3, 12), range(0, 9))) >= 15
    assert _stop_everywhere(nnet, _chunk_request(range(-3, 12), range(0, 9), n=3)) >= 15


@pytest.mark.parametrize("case", CASES[:6])
def test_reference_networks_stop_anywhere(case):
    nnet, req = load_case(case)
    assert nnet is not None, req       # (every component type is implemented)
    _stop_everywhere(nnet, req)


def test_the_per_cindex_graph_build_stops_within_a_few_thousand_cindexes():
    """The slow fallback build asks the hook every 4096 cindexes it takes off its queue
    and between its rounds: stopped at the first ask of a round it names the build."""
    nnet = make_nnet(RECURRENT)
    builder = ComputationGraphBuilder(nnet, ComputationGraph())
    builder.use_arrays = False
    hook = _StopAt(3)
    with stopping_when(hook), pytest.raises(Cancelled, match="per-cindex graph build"):
        builder.compute(_chunk_request(range(0, 3000), range(0, 2990)))
    assert hook.calls == 3
    assert len(builder.graph) < 3 * 4096 + 10000    # stopped early, not at the end


def test_hooks_belong_to_their_thread_and_block():
    checkpoint("outside any block")                 # no hook: nothing asked
    outer, inner = _StopAt(), _StopAt(1)
    with stopping_when(outer):
        checkpoint("outer")
        with stopping_when(inner), pytest.raises(Cancelled, match=r"\(inner pass x\)"):
            checkpoint("inner", "pass x")
        checkpoint("outer again")                   # the outer hook is back
        with stopping_when(None):
            checkpoint("none")                      # None: never stop
        seen = []
        t = threading.Thread(target=lambda: (checkpoint("other thread"), seen.append(1)))
        t.start()
        t.join()
        assert seen == [1]                          # another thread has no hook
    assert (outer.calls, inner.calls) == (2, 1)


def test_inference_stops_inside_a_compile_too():
    """Inferencer.infer_batch asks its should_stop hook before each compile and
    computation, and inside a compile at the compiler's checkpoints: a hook that says
    stop at its second call stops the first compile (the first call is the check before
    it), and the inferencer compiles that request again afterwards."""
    import numpy as np  # noqa: PLC0415

    from engine.inference import InferenceOptions, Inferencer  # noqa: PLC0415
    from inference_nets import TDNN_PLAIN  # noqa: PLC0415
    inf = Inferencer(make_nnet(TDNN_PLAIN), InferenceOptions(frames_per_chunk=13))
    x = np.random.default_rng(3).standard_normal((40, 8)).astype(np.float32)
    hook = _StopAt(2)
    with pytest.raises(Cancelled, match="compilation stopped by its caller"):
        inf.infer_batch([inf.make_utterance(x)], should_stop=hook)
    assert hook.calls == 2
    (want,) = inf.infer_batch([inf.make_utterance(x)])
    np.testing.assert_array_equal(want, inf.infer(x))


def test_the_interval_build_of_many_sequence_shapes_stops_between_shapes():
    """A batch of sequences of many different lengths is planned shape by shape; the
    build asks the hook every 64 shapes (the first ask at shape 64)."""
    nnet = make_nnet(RECURRENT)
    lens = [5 + k for k in range(200)]
    req = ComputationRequest(
        [IoSpecification("input", [Index(n, t, 0) for n, m in enumerate(lens)
                                   for t in range(-3, m + 3)])],
        [IoSpecification("output", [Index(n, t, 0) for n, m in enumerate(lens)
                                    for t in range(m)])])
    builder = ComputationGraphBuilder(nnet, ComputationGraph())
    hook = _StopAt(2)
    with stopping_when(hook), pytest.raises(Cancelled, match="per sequence shape"):
        builder.compute(req)
    assert hook.calls == 2
    # without a stop it is the interval build's
    builder = ComputationGraphBuilder(nnet, ComputationGraph())
    builder.compute(req)
    assert builder.array_method == "intervals"
