"""Whole-network property tests on random networks (Kaldi's nnet-derivative-test.cc,
nnet-compile-test.cc and nnet-test-utils.cc, applied to nnetc).

For each seed, engine.nnet.random_config draws a network (one of Kaldi's
GenerateConfigSequence architectures or the extra ones that cover the other
component types), a request like ComputeExampleComputationRequestSimple and
random data.  Every network must initialise, validate, compile (unoptimized),
run forward and backward, and pass finite-difference checks of input
derivatives and model gradients.

The executor computes in float32 only, so the checks follow Kaldi's float32
test: a few random directions, predicted change (derivative . direction)
against measured change of the objective sum(output * output_deriv).  We use
central differences, which remove the first-order curvature error, and a 5%
tolerance on the vector of directions (Kaldi fails at 25%); when a first try
with Kaldi's delta crosses a kink (ReLU, max-pooling) smaller deltas are tried;
differences below the float32 rounding noise of the objective always pass.
Networks whose derivatives are inexact by design (BackpropTruncation with a
scale) run forward/backward but are not finite-difference checked, as Kaldi
does for limited derivative times.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from engine.compiler.request import ComputationRequest, IoSpecification
from engine.core.errors import NotComputableError
from engine.core.index import Index
from engine.nnet.components.base import iter_types
from engine.nnet.random_config import (GENERATOR_NAMES, GenerationOptions, generate_config_sequence,
                                       random_inputs, random_output_derivs, random_request)

from network_harness import (approx_equal_vectors, compile_request, dot_gradient, objective,
                             perturbed_copy, random_param_directions, run_network)

# Kaldi's dimensions scaled down: the same architectures, a fraction of the work.
OPTS = GenerationOptions(dim_scale=0.3)
NUM_FAST = 100         # random kinds (the fast file runs in about a minute on 2 cores)
NUM_SLOW = 400
PER_KIND = 2           # plus this many seeds forced to each kind
NUM_DIRECTIONS = 3
TOL = 0.05
DELTAS = (1.0e-3, 1.0e-4, 1.0e-5)

DESCRIPTOR_TYPES = ("Append", "Sum", "Offset", "Switch", "Round", "ReplaceIndex", "Failover",
                    "IfDefined", "Const", "Scale")


def _make(seed: int, kind: str | None = None):
    rng = np.random.default_rng(seed)
    net = generate_config_sequence(rng, OPTS, kind=kind)
    nnet = net.build(rng)
    return rng, net, nnet


def _full_deriv_request(req: ComputationRequest) -> ComputationRequest:
    """The same Indexes with every derivative asked for (Kaldi's derivative tests)."""
    return ComputationRequest(
        [IoSpecification(s.name, s.indexes, True) for s in req.inputs],
        [IoSpecification(s.name, s.indexes, True) for s in req.outputs],
        need_model_derivative=True)


def _assert_close(what: str, ours, ref, rel: float = 1e-4) -> None:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs {ref.shape}"
    if ref.size:
        err = float(np.max(np.abs(ours - ref)))
        tol = 1e-5 + rel * float(np.max(np.abs(ref)))
        assert err <= tol, f"{what}: max abs difference {err:.3g} > {tol:.3g}"


def _fd_inputs(nnet, req, comp, x, dy, base, rng, delta):
    pred, meas = [], []
    for _ in range(NUM_DIRECTIONS):
        dirs = {k: rng.standard_normal(v.shape) for k, v in x.items()}
        if len(x) > 1 and rng.integers(0, 2) == 0:   # as Kaldi: sometimes only the others
            dirs[next(iter(x))] *= 0.0
        pred.append(delta * sum(float(np.vdot(base.input_derivs[k].astype(np.float64), d))
                                for k, d in dirs.items()))
        plus = run_network(nnet, req, {k: x[k] + delta * dirs[k] for k in x}, None,
                           computation=comp)
        minus = run_network(nnet, req, {k: x[k] - delta * dirs[k] for k in x}, None,
                            computation=comp)
        meas.append((objective(plus.outputs, dy) - objective(minus.outputs, dy)) / 2)
    return pred, meas


def _fd_params(nnet, req, comp, x, dy, base, rng, delta):
    pred, meas = [], []
    for _ in range(NUM_DIRECTIONS):
        dirs = random_param_directions(nnet, rng)
        pred.append(delta * dot_gradient(base.model_gradient, dirs))
        plus = run_network(perturbed_copy(nnet, dirs, delta), req, x, None, computation=comp)
        minus = run_network(perturbed_copy(nnet, dirs, -delta), req, x, None, computation=comp)
        meas.append((objective(plus.outputs, dy) - objective(minus.outputs, dy)) / 2)
    return pred, meas


def _noise_floor(outputs, dy) -> float:
    """Rounding noise of a float32 objective difference: a few float32 epsilons
    of sum |output * deriv| (matters only when the derivatives are ~0, e.g. a
    saturated softmax)."""
    return 2.0e-7 * float(sum(np.sum(np.abs(outputs[k].astype(np.float64) * d))
                              for k, d in dy.items()))


def _check_fd(label, fd, *args) -> None:
    nnet, req, comp, x, dy, base = args
    floor = _noise_floor(base.outputs, dy) * np.sqrt(NUM_DIRECTIONS)
    tries = []
    for k, delta in enumerate(DELTAS):
        rng = np.random.default_rng(1000 + k)
        pred, meas = fd(*args, rng, delta)
        if (approx_equal_vectors(pred, meas, TOL)
                or float(np.linalg.norm(np.subtract(pred, meas))) <= floor):
            return
        tries.append(f"delta={delta:g}: predicted {np.round(pred, 6)} measured {np.round(meas, 6)}")
    raise AssertionError(f"{label}: finite differences disagree: " + "; ".join(tries))


def check_random_network(seed: int, kind: str | None = None) -> None:
    rng, net, nnet = _make(seed, kind)
    label = f"seed {seed} ({net.kind})"
    nnet.validate()
    req = random_request(nnet, rng)
    full = _full_deriv_request(req)
    x = random_inputs(nnet, full, rng)
    dy = random_output_derivs(nnet, full, rng)

    comp = compile_request(nnet, full)
    base = run_network(nnet, full, x, dy, computation=comp)
    for name, arr in [*base.outputs.items(), *base.input_derivs.items(),
                      *base.model_gradient.items()]:
        assert np.all(np.isfinite(arr)), f"{label}: {name} is not finite"
    assert set(base.input_derivs) == {s.name for s in full.inputs}

    # The request with Kaldi's random flags computes the same numbers: pruning of
    # unneeded derivatives must not change what is computed.
    some = run_network(nnet, req, x, {k: dy[k] for k in dy if req.outputs[
        req.index_of_output(k)].has_deriv})
    for k, v in some.outputs.items():
        _assert_close(f"{label}: output {k} (random flags)", v, base.outputs[k])
    if any(s.has_deriv for s in req.outputs):
        for k, v in some.input_derivs.items():
            if all(s.has_deriv for s in req.outputs):
                _assert_close(f"{label}: input deriv {k} (random flags)", v,
                              base.input_derivs[k])
        if all(s.has_deriv for s in req.outputs):
            for k, v in some.model_gradient.items():
                _assert_close(f"{label}: gradient {k} (random flags)", v,
                              base.model_gradient[k])

    if not net.exact_derivatives:
        return
    _check_fd(f"{label}: input derivatives", _fd_inputs, nnet, full, comp, x, dy, base)
    if base.model_gradient:
        _check_fd(f"{label}: model gradient", _fd_params, nnet, full, comp, x, dy, base)


@pytest.mark.parametrize("kind,seed", [(k, s) for k in GENERATOR_NAMES for s in range(PER_KIND)])
def test_each_kind(kind, seed):
    check_random_network(seed, kind)


@pytest.mark.parametrize("seed", range(NUM_FAST))
def test_random_network(seed):
    check_random_network(10_000 + seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(NUM_SLOW))
def test_random_network_many(seed):
    # The many-seed sweep (about two minutes) runs with the rest of the suite and in CI;
    # `-m "not slow"` leaves it out for a quick local run.
    check_random_network(20_000 + seed)


# -- the generator ------------------------------------------------------------------------------------


def _generated_texts(n: int, only: str | None = None) -> list[str]:
    texts = []
    for kind in ([only] if only else GENERATOR_NAMES):
        for seed in range(n):
            net = generate_config_sequence(np.random.default_rng(seed), OPTS, kind=kind)
            texts.append(net.config_text())
    return texts


def test_generator_covers_every_component_and_descriptor_type():
    texts = "\n".join(_generated_texts(40) + _generated_texts(300, "simple_components"))
    used = set(re.findall(r"type=(\w+)", texts))
    registered = set(iter_types())
    assert used <= registered, f"generator uses unregistered types {used - registered}"
    assert registered <= used, f"component types never generated: {sorted(registered - used)}"
    for d in DESCRIPTOR_TYPES:
        assert f"{d}(" in texts, f"descriptor {d} never generated"
    assert re.search(r"Offset\(\w+, 0, [1-9]\)", texts), "Offset with an x offset never generated"
    assert "ReplaceIndex(ivector, t, 0)" in texts and re.search(r"ReplaceIndex\(\w+, x, ", texts)
    assert "dim-range-node" in texts and "output-node name=output2" in texts
    assert "input-node name=ivector" in texts


def test_generator_is_deterministic():
    for seed in range(5):
        a = generate_config_sequence(np.random.default_rng(seed), OPTS)
        b = generate_config_sequence(np.random.default_rng(seed), OPTS)
        assert a.configs == b.configs
        rng1, rng2 = np.random.default_rng(seed), np.random.default_rng(seed)
        _, _, n1 = _make(seed)
        _, _, n2 = _make(seed)
        r1, r2 = random_request(n1, rng1), random_request(n2, rng2)
        assert r1 == r2
        for p, q in zip(n1.components, n2.components):
            for u, v in zip(p.param_arrays(), q.param_arrays()):
                assert np.array_equal(u, v)


def test_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="unknown network kind"):
        generate_config_sequence(np.random.default_rng(0), OPTS, kind="nope")


def test_request_shape_follows_kaldi():
    for seed in range(20):
        rng, net, nnet = _make(seed, "simple")
        req = random_request(nnet, rng)
        (out,) = [s for s in req.outputs if s.name == "output"]
        ns = sorted({i.n for i in out.indexes})
        ts = sorted({i.t for i in out.indexes})
        assert 1 <= len(ns) <= 4 and ns[0] in (0, 1) and ns == list(range(ns[0], ns[-1] + 1))
        assert 1 <= len(ts) <= 10 and 0 <= ts[0] < 10 and ts == list(range(ts[0], ts[-1] + 1))
        inp = req.inputs[0]
        assert inp.name == "input" and len(inp.indexes) >= 3 * len(ns)
        if nnet.input_dim("ivector") > 0:
            assert [i.t for i in req.inputs[1].indexes] == [0] * len(ns)
        if req.need_model_derivative or any(s.has_deriv for s in req.inputs):
            assert out.has_deriv


# -- network-level properties ------------------------------------------------------------------------


def test_affine_gradient_is_manual_sum_over_frames_and_sequences():
    rng, net, nnet = _make(3, "simplest")
    idx = [Index(n, t, 0) for n in range(3) for t in range(5)]
    req = ComputationRequest([IoSpecification("input", idx, True)],
                             [IoSpecification("output", idx, True)], need_model_derivative=True)
    x = random_inputs(nnet, req, rng)
    dy = random_output_derivs(nnet, req, rng)
    run = run_network(nnet, req, x, dy)
    comp = nnet.get_component_by_name("affine1")
    X, DY = x["input"].astype(np.float64), dy["output"].astype(np.float64)
    _assert_close("output", run.outputs["output"], X @ comp.linear_params.T + comp.bias_params)
    _assert_close("input deriv", run.input_derivs["input"], DY @ comp.linear_params)
    _assert_close("weight gradient", run.model_gradient["affine1.linear_params"], DY.T @ X)
    _assert_close("bias gradient", run.model_gradient["affine1.bias_params"], DY.sum(0))


@pytest.mark.parametrize("kind", ["simple_context", "rnn", "lstm", "statistics", "attention",
                                  "cnn_new", "multi_io", "tdnnf"])
def test_gradient_of_batch_is_sum_over_sequences(kind):
    """Sequences (n) are independent, so the model gradient of a request with
    several sequences is the sum of the gradients of one-sequence requests, and
    its outputs are theirs stacked."""
    rng, net, nnet = _make(7, kind)
    req = _full_deriv_request(random_request(nnet, rng, need_deriv=True))
    x = random_inputs(nnet, req, rng)
    dy = random_output_derivs(nnet, req, rng)
    whole = run_network(nnet, req, x, dy)
    ns = sorted({i.n for i in req.inputs[0].indexes})
    total: dict[str, np.ndarray] = {}
    for n in ns:
        def rows(spec):
            return [r for r, i in enumerate(spec.indexes) if i.n == n]
        sub = ComputationRequest(
            [IoSpecification(s.name, [s.indexes[r] for r in rows(s)], True) for s in req.inputs],
            [IoSpecification(s.name, [s.indexes[r] for r in rows(s)], True)
             for s in req.outputs], need_model_derivative=True)
        part = run_network(nnet, sub, {s.name: x[s.name][rows(s)] for s in req.inputs},
                           {s.name: dy[s.name][rows(s)] for s in req.outputs})
        for s in req.outputs:
            _assert_close(f"{kind}: output {s.name} n={n}", part.outputs[s.name],
                          whole.outputs[s.name][rows(s)])
        for s in req.inputs:
            _assert_close(f"{kind}: input deriv {s.name} n={n}", part.input_derivs[s.name],
                          whole.input_derivs[s.name][rows(s)])
        for k, g in part.model_gradient.items():
            total[k] = total.get(k, 0.0) + g.astype(np.float64)
    assert total
    for k, g in total.items():
        _assert_close(f"{kind}: gradient {k}", whole.model_gradient[k], g, rel=1e-3)


def _shifted(req: ComputationRequest, dt: int) -> ComputationRequest:
    def sh(spec):
        return IoSpecification(spec.name, [Index(i.n, i.t + dt if spec.name != "ivector"
                                                 else i.t, i.x) for i in spec.indexes],
                               spec.has_deriv)
    return ComputationRequest([sh(s) for s in req.inputs], [sh(s) for s in req.outputs],
                              need_model_derivative=req.need_model_derivative)


@pytest.mark.parametrize("kind", ["rnn", "rnn_clockwork", "lstm", "fast_lstm", "gru",
                                  "lstm_truncation", "statistics"])
def test_request_far_from_time_zero(kind):
    """Recurrent requests a million frames (a multiple of the modulus) from t=0
    compile to the same program as near t=0 (the graph builder does not walk
    back to t=0) and give the same numbers; i-vectors stay at t=0."""
    rng, net, nnet = _make(11, kind)
    req = _full_deriv_request(random_request(nnet, rng, need_deriv=True))
    x = random_inputs(nnet, req, rng)
    dy = random_output_derivs(nnet, req, rng)
    dt = nnet.modulus() * 1_000_000
    near, far = run_network(nnet, req, x, dy), run_network(nnet, _shifted(req, dt), x, dy)
    assert len(far.computation.commands) == len(near.computation.commands)
    assert ([(m.num_rows, m.num_cols) for m in far.computation.matrices]
            == [(m.num_rows, m.num_cols) for m in near.computation.matrices])
    for k in near.outputs:
        _assert_close(f"{kind}: output {k}", far.outputs[k], near.outputs[k])
    for k in near.input_derivs:
        _assert_close(f"{kind}: input deriv {k}", far.input_derivs[k], near.input_derivs[k])
    for k in near.model_gradient:
        _assert_close(f"{kind}: gradient {k}", far.model_gradient[k], near.model_gradient[k])


@pytest.mark.parametrize("kind", ["simple_context", "simple", "rnn", "lstm", "cnn_new",
                                  "statistics", "tdnnf"])
def test_missing_context_is_not_computable(kind):
    """Input frames that stop short of the network's right context make the last
    output frame uncomputable: compiling raises NotComputableError."""
    from engine.nnet.graph import compute_simple_context
    rng, net, nnet = _make(0, kind)
    left, right = compute_simple_context(nnet)
    frames = 4
    in_ix = [Index(0, t, 0) for t in range(-left, frames + right - 1)]
    out_ix = [Index(0, t, 0) for t in range(frames)]
    if right == 0:  # no right context (recurrent, statistics): ask past the end of the input
        out_ix.append(Index(0, frames, 0))
    inputs = [IoSpecification("input", in_ix)]
    if nnet.input_dim("ivector") > 0:
        inputs.append(IoSpecification("ivector", [Index(0, 0, 0)]))
    req = ComputationRequest(inputs, [IoSpecification("output", out_ix)])
    with pytest.raises(NotComputableError):
        compile_request(nnet, req)


def test_recurrent_output_without_any_input_is_not_computable():
    rng, net, nnet = _make(1, "rnn")
    req = ComputationRequest([IoSpecification("input", [Index(0, t, 0) for t in range(10)])],
                             [IoSpecification("output", [Index(0, 1_000_000, 0)])])
    with pytest.raises(NotComputableError):
        compile_request(nnet, req)


# -- the harness's optimize hook (the optimizer's own differential tests use it) ----------------------


@pytest.mark.parametrize("kind", GENERATOR_NAMES)
def test_optimized_run_matches_unoptimized(kind):
    import engine.optimizer as opt   # noqa: PLC0415  (a broken optimizer import fails here, never skips)
    rng, net, nnet = _make(5, kind)
    req = _full_deriv_request(random_request(nnet, rng))
    x = random_inputs(nnet, req, rng)
    dy = random_output_derivs(nnet, req, rng)
    plain = run_network(nnet, req, x, dy)
    hooks = [True, lambda c, n, r: opt.optimize(c, n, opt.OptimizeOptions(), request=r)]
    for hook in hooks:
        run = run_network(nnet, req, x, dy, optimize=hook)
        assert run.computation is not plain.computation
        got = dict(zip(("outputs", "input_derivs", "model_gradient"), run))
        for what, ref in zip(("outputs", "input_derivs", "model_gradient"), plain):
            assert set(got[what]) == set(ref), what
            for k, v in ref.items():
                _assert_close(f"{kind}: optimized {what} {k}", got[what][k], v)
