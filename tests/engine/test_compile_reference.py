"""Compiler + executor against Kaldi's reference networks (kaldi-ref/networks).

For each case (a subset copied to tests/data/networks_compile, the full set when
../shared/kaldi-ref exists): compile without optimization, run forward and
backward, and compare outputs, input derivatives and model gradients with
Kaldi's, and the command count / peak bytes with Kaldi's unoptimized stats.

Note on model_grad.txt: the reference was written as Kaldi's SetNnetAsGradient
leaves a network, which sets learning rate 1 and is_gradient but does not zero
the parameters; so Kaldi's file holds parameters + gradient, and we compare our
(pure) gradient with that minus the model's parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.compiler.compiler import (CompilerOptions, compile_computation,
                                      convert_to_indexes, ensure_contiguous_property,
                                      has_contiguous_property, split_locations,
                                      split_locations_backward, split_pair_list)
from engine.compiler.request import ComputationRequest
from engine.runtime.backend import to_host
from engine.runtime.executor import Executor

from refdata import shared_ref, stats_tolerance

LOCAL = Path(__file__).resolve().parents[1] / "data" / "networks_compile"


def _cases(full: bool) -> list[Path]:
    if full:
        ref = shared_ref()
        if ref is None:
            return []
        return sorted(p for p in (ref / "networks").iterdir() if (p / "request.json").exists())
    return sorted(p for p in LOCAL.iterdir() if p.is_dir())


def _close(what, ours, ref):
    ours = np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs {ref.shape}"
    if ref.size == 0:
        return
    err = float(np.max(np.abs(ours - ref)))
    tol = 1e-4 + 2e-3 * float(np.max(np.abs(ref)))
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


def read_options(path: Path):
    """The OptimizeOptions written by the Kaldi oracle's drivers (options.json: our field
    names), or None when ``path`` does not exist (the default options)."""
    from engine.optimizer import OptimizeOptions
    if not path.exists():
        return None
    return OptimizeOptions.from_dict(json.loads(path.read_text()))


def _load(case: Path):
    from engine.nnet.model_io import load_nnet
    nnet = load_nnet(case / "model.txt")
    req = ComputationRequest.from_json((case / "request.json").read_bytes())
    return nnet, req


def check_case(case: Path, backend=np, optimize: bool = False, options=None) -> None:
    """Compile ``case`` (unoptimized: also its command count and peak bytes against
    Kaldi's; ``optimize``: with ``options``, default the default OptimizeOptions), run
    it on ``backend`` and compare outputs, input derivatives and model gradients with
    Kaldi's."""
    nnet, req = _load(case)
    comp = compile_computation(nnet, [req], CompilerOptions())
    if optimize:
        from engine.optimizer import OptimizeOptions, optimize as run_optimizer
        comp = run_optimizer(comp, nnet, options or OptimizeOptions(), request=req)
    else:
        stats = comp.stats()
        ref_stats = json.loads((case / "stats.json").read_text())["unoptimized"]
        assert stats["commands"] == ref_stats["commands"], (stats, ref_stats)
        assert stats["peak_bytes"] == ref_stats["peak_bytes"], (stats, ref_stats)
    arrays = np.load(case / "arrays.npz")
    ex = Executor(comp, nnet, backend=backend)
    for spec in req.inputs:
        ex.accept_input(spec.name, arrays[f"input.{spec.name}"])
    ex.run()
    for spec in req.outputs:
        _close(f"output {spec.name}", to_host(ex.get_output(spec.name)), arrays[f"output.{spec.name}"])
    if any(s.has_deriv for s in req.outputs):
        for spec in req.outputs:
            if spec.has_deriv:
                ex.accept_output_deriv(spec.name, arrays[f"output_deriv.{spec.name}"])
        ex.run()
        for spec in req.inputs:
            if spec.has_deriv:
                _close(f"input_deriv {spec.name}", to_host(ex.get_input_deriv(spec.name)),
                       arrays[f"input_deriv.{spec.name}"])
    if req.need_model_derivative and (case / "model_grad.txt").exists():
        from engine.nnet.model_io import load_nnet
        grad = ex.get_model_gradient()
        ref = load_nnet(case / "model_grad.txt")
        checked = 0
        for name, ours, theirs, orig in zip(grad.component_names, grad.components,
                                            ref.components, nnet.components):
            if not ours.is_updatable:
                continue
            for p, a, b, o in zip(ours.PARAMS, ours.param_arrays(), theirs.param_arrays(),
                                  orig.param_arrays()):
                _close(f"gradient {name}.{p}", a,
                       np.asarray(b, np.float64) - np.asarray(o, np.float64))
                checked += 1
        assert checked > 0 or not any(c.is_updatable for c in nnet.components)


def _numbers(component) -> dict:
    """The numeric fields of a component (parameters and statistics), by name."""
    out = {}
    for k, v in vars(component).items():
        if isinstance(v, bool) or k == "name":
            continue
        if isinstance(v, (int, float, np.floating, np.integer)):
            out[k] = np.asarray([float(v)])
        elif isinstance(v, np.ndarray) and v.dtype.kind in "fi":
            out[k] = v.astype(np.float64).ravel()
    return out


# Kaldi's StoreStats (attention) or backprop statistics (GRU) of these types skip a call
# at random even when nothing is stored yet
RANDOM_STATS = {"RestrictedAttentionComponent", "GruNonlinearityComponent",
                "OutputGruNonlinearityComponent"}
# the types whose backprop self-repairs on about half of the minibatches, drawn at random,
# once they have statistics (self-repair-scale > 0)
SELF_REPAIRING = {"RectifiedLinearComponent", "SigmoidComponent", "TanhComponent"}


def check_stored_stats(case: Path, options=None) -> tuple[list[str], int]:
    """With store_component_stats, Kaldi's network after the run (model_after.txt) against
    ours after the same run, every numeric field of every component: the statistics the
    forward pass stored (nonlinearities' value/derivative sums and count, batch-norm's
    in training mode) and the backprop's (output-derivative sums of squares).  Kaldi
    stores a component's statistics on the first call and then on about one in two (one
    in four for the backprop's), drawn from its generator, so a component propagated or
    backpropagated more than once is left out, and so are the types that draw even on
    the first call (RANDOM_STATS); with a backprop and a self-repairing nonlinearity
    (SELF_REPAIRING) nothing is compared.  Returns (problems, how many fields were
    compared).  Tolerances: refdata.stats_tolerance."""
    from engine.compiler.computation import CommandType as CT
    from engine.nnet.model_io import load_nnet
    from engine.optimizer import OptimizeOptions, optimize
    nnet, req = _load(case)
    comp = optimize(compile_computation(nnet, [req], CompilerOptions()), nnet,
                    options or OptimizeOptions(), request=req)
    calls: dict = {}
    for c in comp.commands:
        if c.command_type in (CT.PROPAGATE, CT.BACKPROP, CT.BACKPROP_NO_MODEL_UPDATE):
            key = (c.arg1, c.command_type == CT.PROPAGATE)
            calls[key] = calls.get(key, 0) + 1
    # (a nonlinearity that has statistics already stores more on about one call in two:
    # a trained model's are left out; batch-norm's always stores)
    before = [{k: float(v[0]) for k, v in _numbers(c).items() if v.size == 1}
              for c in nnet.components]
    arrays = np.load(case / "arrays.npz")
    # as gen.cc: the network computed with is the one the statistics go to
    ex = Executor(comp, nnet, nnet_to_store_stats=nnet)
    for spec in req.inputs:
        ex.accept_input(spec.name, arrays[f"input.{spec.name}"])
    ex.run()
    if any(s.has_deriv for s in req.outputs):
        for spec in req.outputs:
            if spec.has_deriv:
                ex.accept_output_deriv(spec.name, arrays[f"output_deriv.{spec.name}"])
        ex.run()
    ref = load_nnet(case / "model_after.txt")
    problems, compared = [], 0
    if any(s.has_deriv for s in req.outputs) and any(
            type(c).__name__ in SELF_REPAIRING and getattr(c, "self_repair_scale", 0.0) > 0
            for c in nnet.components):
        # the backprop repairs (or not) on a draw from Kaldi's generator, and the
        # repaired derivatives feed the statistics of the layers below
        return problems, compared
    for ci, (name, ours, theirs) in enumerate(zip(nnet.component_names, nnet.components,
                                                   ref.components)):
        if (calls.get((ci, True), 0) > 1 or calls.get((ci, False), 0) > 1
                or type(ours).__name__ in RANDOM_STATS
                or (type(ours).__name__ != "BatchNormComponent"
                    and (before[ci].get("count", 0) or before[ci].get("oderiv_count", 0)))):
            continue
        a, b = _numbers(ours), _numbers(theirs)
        if a.keys() != b.keys():
            problems.append(f"stored stats {name}: fields {sorted(a)} vs {sorted(b)}")
            continue
        for k in a:
            x, y = a[k], b[k]
            if x.shape != y.shape:
                problems.append(f"stored stats {name}.{k}: shape {x.shape} vs Kaldi's {y.shape}")
                continue
            scale = float(np.max(np.abs(y))) if y.size else 0.0
            if k == "stats_sum" and "stats_sumsq" in b:
                # batch-norm's sums of frame values: a mean near zero is the difference of
                # large terms; their size is the root of the sum of squares times count
                scale = max(scale, float(np.sqrt(np.max(b["stats_sumsq"]) * b["count"][0])))
            if x.size and not np.max(np.abs(x - y)) <= stats_tolerance(
                    k, scale, type(ours).__name__):
                problems.append(f"stored stats {name}.{k}: max diff "
                                f"{float(np.max(np.abs(x - y)))} (Kaldi's up to {scale})")
            compared += 1
    return problems, compared


@pytest.mark.parametrize("case", _cases(False), ids=lambda p: p.name)
def test_reference_subset(case):
    check_case(case)


_FULL = _cases(True)


@pytest.mark.skipif(not _FULL, reason="../shared/kaldi-ref is not present (fresh clone)")
@pytest.mark.parametrize("case", _FULL, ids=lambda p: p.name)
def test_reference_full(case):
    check_case(case)


def test_print_names_nodes_and_components():
    case = LOCAL / "case013"
    nnet, req = _load(case)
    comp = compile_computation(nnet, [req])
    text = comp.to_text(nnet)
    assert text.startswith("matrix m1(")
    assert "# begin forward commands\n" in text
    assert "= user input [for node: 'input']" in text
    assert "to user [for node: 'output']" in text
    assert "# computation segment separator" in text
    nodebug = compile_computation(nnet, [req], CompilerOptions(output_debug_info=False))
    assert "cindex-ids" not in nodebug.to_text(nnet)
    assert len(nodebug.commands) == len(comp.commands)


# -- nnet-compile-utils ---------------------------------------------------------------------


def test_split_locations_separates_frequent_sources():
    # submatrix 5 is used by every row: it gets its own column first
    lists = [[(5, 0), (7, 1)], [(5, 1)], [(5, 2), (8, 0)], [(5, 3)]]
    out = split_locations(lists)
    assert out[0] == [(5, 0), (5, 1), (5, 2), (5, 3)]
    assert out[1] == [(7, 1), (-1, -1), (8, 0), (-1, -1)]
    assert split_locations([[], []]) == []
    assert split_locations([[(1, 2)], []]) == [[(1, 2), (-1, -1)]]


def test_convert_to_indexes():
    assert convert_to_indexes([(3, 1), (-1, -1), (3, 0)]) == (True, 3, [1, -1, 0])
    assert convert_to_indexes([(3, 1), (4, 0)])[0] is False


def test_backward_splits_have_no_write_conflicts():
    assert ensure_contiguous_property([0, 0, 1, 0, -1, 1]) == [[0, 0, 1, -1, -1, -1],
                                                               [-1, -1, -1, 0, -1, 1]]
    assert split_pair_list([(1, 0), (1, 0), (2, 0), (-1, -1)]) == [
        [(1, 0), (-1, -1), (2, 0), (-1, -1)], [(-1, -1), (1, 0), (-1, -1), (-1, -1)]]
    ok, ranges = has_contiguous_property([0, 0, 1, 1, -1, 2])
    assert ok and ranges == [(0, 2), (2, 4), (5, 6)]
    assert has_contiguous_property([0, 1, 0])[0] is False
    lists = [[(4, 0)], [(4, 1)], [(4, 0)]]
    out = split_locations_backward(lists)
    for column in out:
        rows = [r for s, r in column if s != -1]
        ok, _ = has_contiguous_property([r if s != -1 else -1 for s, r in column])
        assert ok and rows
