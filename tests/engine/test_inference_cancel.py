"""Inferencer's should_stop hook: asked before each chunk computation (and inside each
compile, at the compiler's checkpoints: engine.core.cancel), it stops a long inference
between chunks with Cancelled (what a server uses to stop work past its deadline); a hook
that never says stop changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.errors import Cancelled
from engine.inference import InferenceOptions, Inferencer
from engine.nnet.nnet import Nnet
from tests.engine.inference_nets import TDNN_PLAIN

X = np.random.default_rng(7).standard_normal((500, 8)).astype(np.float32)


def _inferencer(**options) -> Inferencer:
    nnet = Nnet.from_config(TDNN_PLAIN, rng=np.random.default_rng(0))
    return Inferencer(nnet, InferenceOptions(frames_per_chunk=10, max_batch=1, **options))


def _counting(inf: Inferencer, monkeypatch) -> list:
    runs = []
    real = inf._run_batch

    def run(chunks, utts, computation):
        runs.append(len(chunks))
        return real(chunks, utts, computation)
    monkeypatch.setattr(inf, "_run_batch", run)
    return runs


def _asked_in_compiles(inf: Inferencer, asked: list, monkeypatch) -> list:
    """How many times the hook is asked inside each compile that is not a cache hit (at
    the compiler's checkpoints: engine.core.cancel)."""
    inside = []
    real = inf.compiler.compile

    def compile_(request):
        before, cached = len(asked), len(inf.compiler)
        out = real(request)
        if len(inf.compiler) > cached:        # compiled, not a hit
            inside.append(len(asked) - before)
        return out
    monkeypatch.setattr(inf.compiler, "compile", compile_)
    return inside


def test_a_hook_that_says_stop_stops_between_chunks(monkeypatch):
    inf = _inferencer()
    runs = _counting(inf, monkeypatch)
    asked = []

    def should_stop():
        asked.append(len(runs))
        return len(runs) >= 5
    inside = _asked_in_compiles(inf, asked, monkeypatch)
    with pytest.raises(Cancelled) as e:
        inf.infer(X, should_stop=should_stop)
    assert len(runs) == 5                      # 50 chunks planned, 5 computed
    assert (e.value.done, e.value.total) == (5, 50)
    assert "after 5 of 50 chunk computations" in str(e.value)
    # asked before each chunk's compile (all but the first a cache hit), inside the
    # compiles that are not (at their checkpoints), and before each chunk computation,
    # the last time saying stop
    assert len(inside) >= 1 and min(inside) >= 5
    assert asked[-1] == 5 and len(asked) == 50 + sum(inside) + 6


def test_a_hook_asked_first_stops_before_anything_is_computed(monkeypatch):
    inf = _inferencer()
    runs = _counting(inf, monkeypatch)
    with pytest.raises(Cancelled) as e:
        inf.infer(X, should_stop=lambda: True)
    assert runs == [] and e.value.done == 0


def test_a_hook_that_never_says_stop_changes_nothing(monkeypatch):
    inf = _inferencer()
    calls = []
    inside = _asked_in_compiles(inf, calls, monkeypatch)
    out = inf.infer(X, should_stop=lambda: calls.append(1) and False)
    np.testing.assert_array_equal(out, inf.infer(X))
    # before each compile and each computation, and at the checkpoints of the compiles
    # that are not cache hits
    assert len(inside) >= 1 and len(calls) == 50 + 50 + sum(inside)


def test_with_threads_the_stop_holds_for_every_lane(monkeypatch):
    inf = _inferencer(threads=2)
    # lanes are CPU threads: NumPy here (NNETC_TEST_BACKEND=cupy swaps the backend, and
    # another backend computes in one lane)
    inf.backend = np
    assert inf.parallel_pays(2000)
    x = np.tile(X, (4, 1))
    runs = _counting(inf, monkeypatch)
    with pytest.raises(Cancelled) as e:
        inf.infer(x, should_stop=lambda: len(runs) >= 6)
    # each lane asks before its next chunk: at most one more per lane after the sixth
    assert 6 <= len(runs) <= 7 and e.value.total == 200
