"""Shortcut compilation (engine/compiler/shortcut.py; Kaldi's CompileViaShortcut,
RequestIsDecomposable, FindNStride, ConvertNumNValues, ExpandComputation).

- the n-stride detection and the n-count conversion on the layouts requests use
  (n-major, n-interleaved, n inside an x group) and on irregular ones;
- which requests decompose, and into what;
- the expanded computation passes the checker and computes the same outputs,
  input derivatives and model gradients as normal compilation + optimization,
  on the reference networks (widened to N = 3..5 sequences in both layouts), on
  random networks of every generator kind, and on the reference models;
- on the reference requests that are themselves decomposable, the shortcut
  computation reproduces Kaldi's arrays;
- the compiler only ever sees the two-sequence request.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.compiler import compiler as compiler_module
from engine.compiler.compiler import compile_computation
from engine.compiler.request import ComputationRequest, IoSpecification
from engine.compiler.shortcut import (ShortcutNotApplicable, compile_request,
                                      compile_via_shortcut, convert_num_n_values,
                                      expand_computation, find_n_stride,
                                      request_is_decomposable)
from engine.core.errors import NotComputableError
from engine.core.index import Index, index_rows
from engine.nnet.model_io import load_nnet
from engine.nnet.random_config import (GENERATOR_NAMES, GenerationOptions,
                                       generate_config_sequence, random_request)
from engine.optimizer import OptimizeOptions, check_computation

from refdata import shared_ref
from network_harness import run_network

DATA = Path(__file__).resolve().parents[1] / "data"
LOCAL_CASES = sorted(p for p in (DATA / "networks_compile").iterdir()
                     if (p / "request.json").exists())
SHARED = shared_ref()
SHARED_CASES = (sorted(p for p in (SHARED / "networks").iterdir()
                       if (p / "request.json").exists()) if SHARED else [])
TOL = 1e-4


# -- n-stride and n-count conversion ------------------------------------------------------


def _rows(layout: str, num_n: int, ts=range(-2, 5), xs=(0,)) -> np.ndarray:
    if layout == "n-major":
        out = [(n, t, x) for n in range(num_n) for t in ts for x in xs]
    elif layout == "interleaved":
        out = [(n, t, x) for t in ts for x in xs for n in range(num_n)]
    else:  # "x-inner": n outside the x group, so the stride is len(xs)
        out = [(n, t, x) for t in ts for n in range(num_n) for x in xs]
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("layout,xs,stride", [("n-major", (0,), 7), ("interleaved", (0,), 1),
                                              ("x-inner", (0, 1, 2), 3),
                                              ("n-major", (0, 1), 14)])
def test_find_n_stride_and_conversion_round_trip(layout, xs, stride):
    rows5 = _rows(layout, 5, xs=xs)
    assert find_n_stride(rows5) == stride
    rows2 = convert_num_n_values(rows5, stride, 5, 2)
    np.testing.assert_array_equal(rows2, _rows(layout, 2, xs=xs))
    assert find_n_stride(rows2) == stride
    np.testing.assert_array_equal(convert_num_n_values(rows2, stride, 2, 5), rows5)


def test_find_n_stride_rejects_irregular_indexes():
    good = _rows("interleaved", 3)
    assert find_n_stride(good) == 1
    assert find_n_stride(good[:-1]) == 0                      # size not a multiple of N
    missing = good.copy()
    missing[4, 1] = 99                                        # a twin differs in t
    assert find_n_stride(missing) == 0
    assert find_n_stride(_rows("interleaved", 1)) == 0        # one sequence
    shifted = good.copy()
    shifted[:, 0] += 1                                        # n does not start at 0
    assert find_n_stride(shifted) == 0
    # twins one stride apart but straddling a block of stride * N rows
    straddle = np.array([(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (0, 2, 0), (0, 3, 0),
                         (1, 2, 0), (1, 3, 0)], dtype=np.int64)
    assert find_n_stride(straddle) == 2
    crossing = np.array([(0, 0, 0), (0, 1, 0), (1, 1, 0), (1, 0, 0)], dtype=np.int64)
    assert find_n_stride(crossing) == 0


def _n_stride_by_twins(rows: np.ndarray) -> int:
    """find_n_stride with Kaldi's per-row checks (FindNStride, full_check): the
    reference for find_n_stride's block-reshape check."""
    size = rows.shape[0]
    if size < 2:
        return 0
    n, rest = rows[:, 0], rows[:, 1:]
    big_n = int(n[-1]) + 1
    if big_n <= 1 or n[0] != 0 or size % big_n != 0 or n.min() < 0 or n.max() >= big_n:
        return 0
    twin = [i for i in range(size) if n[i] == 1 and (rest[i] == rest[0]).all()]
    per_n = size // big_n
    if 1 in twin:
        stride = 1
    elif per_n in twin:
        stride = per_n
    else:
        ok = [i for i in twin if 2 <= i < per_n and size % i == 0]
        if not ok:
            return 0
        stride = ok[0]
    if stride >= size:
        return 0
    for i in range(size):
        if n[i] < big_n - 1 and not (i + stride < size and n[i + stride] == n[i] + 1
                                     and (rest[i + stride] == rest[i]).all()):
            return 0
        if n[i] > 0 and not (i - stride >= 0 and n[i - stride] == n[i] - 1
                             and (rest[i - stride] == rest[i]).all()):
            return 0
        if n[i] == 0 and i // (stride * big_n) != (i + stride * (big_n - 1)) // (stride * big_n):
            return 0
    return stride


def test_find_n_stride_equals_per_row_twin_checks():
    rng = np.random.default_rng(5)
    found = 0
    for trial in range(3000):
        layout = ["n-major", "interleaved", "x-inner"][trial % 3]
        num_n = int(rng.integers(1, 5))
        rows = _rows(layout, num_n, xs=(0, 1) if trial % 4 == 0 else (0,),
                     ts=range(int(rng.integers(1, 5))))
        for _ in range(int(rng.integers(0, 3))):
            # disturb: swap two rows, change a value, or drop rows at the end
            k = int(rng.integers(0, 3))
            i, j = rng.integers(0, len(rows), 2)
            if k == 0:
                rows[[i, j]] = rows[[j, i]]
            elif k == 1:
                rows[i, int(rng.integers(0, 3))] += int(rng.integers(-1, 2))
            elif len(rows) > 2:
                rows = rows[:len(rows) - int(rng.integers(1, 3))]
        want = _n_stride_by_twins(rows)
        assert find_n_stride(rows) == want, rows.tolist()
        found += want > 0
    assert 500 < found < 2900


def _spec(name, layout, num_n, ts, has_deriv=False):
    return IoSpecification(name, _rows(layout, num_n, ts=ts).astype(np.int32), has_deriv)


def test_request_is_decomposable():
    req = ComputationRequest([_spec("input", "interleaved", 4, range(-3, 8), True)],
                             [_spec("output", "interleaved", 4, range(0, 5), True)],
                             need_model_derivative=True)
    found = request_is_decomposable(req)
    assert found is not None
    mini, num_n = found
    assert num_n == 4 and mini.need_model_derivative
    assert mini.inputs[0].has_deriv and mini.outputs[0].has_deriv
    assert mini.inputs[0].indexes == [Index(n, t, 0) for t in range(-3, 8) for n in range(2)]
    assert mini.outputs[0].indexes == [Index(n, t, 0) for t in range(0, 5) for n in range(2)]
    # two sequences: nothing to gain
    two = ComputationRequest([_spec("input", "n-major", 2, range(-3, 8))],
                             [_spec("output", "n-major", 2, range(0, 5))])
    assert request_is_decomposable(two) is None
    # the inputs and outputs disagree on N
    mixed = ComputationRequest([_spec("input", "n-major", 4, range(-3, 8))],
                               [_spec("output", "n-major", 3, range(0, 5))])
    assert request_is_decomposable(mixed) is None
    # sequences of different lengths
    ragged = [Index(n, t, 0) for n in range(3) for t in range(0, 5 + n)]
    irregular = ComputationRequest([IoSpecification("input", ragged)],
                                   [_spec("output", "n-major", 3, range(0, 5))])
    assert request_is_decomposable(irregular) is None
    # the rows as validation returns them (compile_request passes them on) give the same
    for r in (req, two, mixed, irregular):
        rows = [index_rows(s.indexes) for s in r.inputs + r.outputs]
        assert request_is_decomposable(r, rows) == request_is_decomposable(r)


# -- equivalence with normal compilation ------------------------------------------------------


def widen(req: ComputationRequest, num_n: int, layout: str, full_derivs: bool = False
          ) -> ComputationRequest:
    """``req`` with the pattern of its first sequence repeated for n = 0..num_n-1,
    in n-major or interleaved row order."""
    def one(spec: IoSpecification, deriv: bool) -> IoSpecification:
        rows = spec.indexes_array()
        base = rows[rows[:, 0] == rows[:, 0].min()]
        reps = []
        for n in range(num_n):
            r = base.copy()
            r[:, 0] = n
            reps.append(r)
        stacked = np.stack(reps, axis=1 if layout == "interleaved" else 0).reshape(-1, 3)
        return IoSpecification(spec.name, stacked, deriv)
    return ComputationRequest([one(s, s.has_deriv or full_derivs) for s in req.inputs],
                              [one(s, s.has_deriv or full_derivs) for s in req.outputs],
                              req.need_model_derivative or full_derivs,
                              req.store_component_stats)


def _data(nnet, req, seed):
    rng = np.random.default_rng(seed)
    inputs = {s.name: rng.standard_normal((len(s.indexes), nnet.input_dim(s.name))
                                          ).astype(np.float32) for s in req.inputs}
    derivs = {s.name: rng.standard_normal((len(s.indexes), nnet.output_dim(s.name))
                                          ).astype(np.float32)
              for s in req.outputs if s.has_deriv}
    return inputs, (derivs or None)


def _max_rel_diff(a, b) -> tuple[float, str]:
    worst, where = 0.0, ""
    for kind, da, db in (("output", a.outputs, b.outputs),
                         ("input-deriv", a.input_derivs, b.input_derivs),
                         ("gradient", a.model_gradient, b.model_gradient)):
        assert set(da) == set(db), (kind, sorted(da), sorted(db))
        for k in da:
            x, y = np.asarray(da[k], np.float64), np.asarray(db[k], np.float64)
            assert x.shape == y.shape, (kind, k, x.shape, y.shape)
            if x.size:
                err = float(np.abs(x - y).max()) / (1e-4 + float(np.abs(x).max()))
                if err > worst:
                    worst, where = err, f"{kind} {k}"
    return worst, where


def assert_shortcut_equivalent(nnet, req, seed=0, expect_shortcut=True):
    shortcut = compile_via_shortcut(nnet, req, OptimizeOptions())
    if not expect_shortcut:
        assert shortcut is None
        return None
    assert shortcut is not None, "a regular request was not compiled by shortcut"
    check_computation(nnet, shortcut)
    normal = compile_request(nnet, req, use_shortcut=False)
    inputs, derivs = _data(nnet, req, seed)
    a = run_network(nnet, req, inputs, derivs, computation=normal)
    b = run_network(nnet, req, inputs, derivs, computation=shortcut)
    err, where = _max_rel_diff(a, b)
    assert err <= TOL, f"shortcut differs from normal compilation in {where}: {err:.3g}"
    return shortcut, normal


def _load_case(case: Path):
    return load_nnet(case / "model.txt"), ComputationRequest.from_json(
        (case / "request.json").read_bytes())


@pytest.mark.parametrize("case", LOCAL_CASES, ids=lambda p: p.name)
@pytest.mark.parametrize("layout,num_n", [("n-major", 3), ("interleaved", 5)])
def test_reference_networks_widened(case, layout, num_n):
    nnet, req = _load_case(case)
    assert_shortcut_equivalent(nnet, widen(req, num_n, layout, full_derivs=True))


@pytest.mark.skipif(not SHARED_CASES, reason="../shared/kaldi-ref is not present (fresh clone)")
def test_all_shared_reference_networks_widened():
    # one test for the 69 cases keeps the run short: N = 3 or 4, layouts alternating
    for k, case in enumerate(SHARED_CASES):
        nnet, req = _load_case(case)
        layout = ("n-major", "interleaved")[k % 2]
        try:
            assert_shortcut_equivalent(nnet, widen(req, 3 + k % 2, layout, k % 3 == 0), seed=k)
        except AssertionError as e:
            raise AssertionError(f"{case.name}: {e}") from None


def _close(what, ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    err = float(np.abs(ours - ref).max())
    assert err <= 1e-4 + 2e-3 * float(np.abs(ref).max()), f"{what}: max error {err:.3g}"


def check_against_kaldi(case: Path):
    """A reference request that is itself decomposable, compiled by shortcut, gives
    Kaldi's outputs, input derivatives and gradients."""
    nnet, req = _load_case(case)
    computation = compile_via_shortcut(nnet, req, OptimizeOptions())
    assert computation is not None
    arrays = np.load(case / "arrays.npz")
    inputs = {s.name: arrays[f"input.{s.name}"] for s in req.inputs}
    derivs = {s.name: arrays[f"output_deriv.{s.name}"] for s in req.outputs if s.has_deriv}
    run = run_network(nnet, req, inputs, derivs or None, computation=computation)
    for s in req.outputs:
        _close(f"output {s.name}", run.outputs[s.name], arrays[f"output.{s.name}"])
    for name, value in run.input_derivs.items():
        _close(f"input_deriv {name}", value, arrays[f"input_deriv.{name}"])
    if req.need_model_derivative and derivs and (case / "model_grad.txt").exists():
        # Kaldi's file holds parameters + gradient (see test_compile_reference.py)
        ref = load_nnet(case / "model_grad.txt")
        for name, theirs, orig in zip(nnet.component_names, ref.components, nnet.components):
            if not orig.is_updatable:
                continue
            for p, b, o in zip(orig.PARAMS, theirs.param_arrays(), orig.param_arrays()):
                _close(f"gradient {name}.{p}", run.model_gradient[f"{name}.{p}"],
                       np.asarray(b, np.float64) - np.asarray(o, np.float64))


_LOCAL_DECOMPOSABLE = [c for c in LOCAL_CASES
                       if request_is_decomposable(_load_case(c)[1]) is not None]


@pytest.mark.parametrize("case", _LOCAL_DECOMPOSABLE, ids=lambda p: p.name)
def test_decomposable_reference_requests_match_kaldi(case):
    check_against_kaldi(case)


@pytest.mark.skipif(not SHARED_CASES, reason="../shared/kaldi-ref is not present (fresh clone)")
def test_all_decomposable_shared_requests_match_kaldi():
    checked = 0
    for case in SHARED_CASES:
        if request_is_decomposable(_load_case(case)[1]) is None:
            continue
        try:
            check_against_kaldi(case)
        except AssertionError as e:
            raise AssertionError(f"{case.name}: {e}") from None
        checked += 1
    assert checked >= 10


_KINDS = list(GENERATOR_NAMES)


@pytest.mark.parametrize("kind", _KINDS)
def test_random_networks(kind):
    opts = GenerationOptions(dim_scale=0.3)
    done = 0
    for seed in range(40):
        rng = np.random.default_rng(1000 + seed)
        net = generate_config_sequence(rng, opts, kind=kind)
        nnet = net.build(rng)
        try:
            req = random_request(nnet, rng)
        except NotComputableError:
            continue
        wide = widen(req, 3 + seed % 3, ("interleaved", "n-major")[seed % 2], seed % 2 == 0)
        try:
            wide.validate(nnet)
            compile_computation(nnet, [wide])
        except NotComputableError:
            continue
        try:
            assert_shortcut_equivalent(nnet, wide, seed=seed)
        except AssertionError as e:
            raise AssertionError(f"{kind} seed {seed}: {e}\n{net.config_text()}") from None
        done += 1
        if done == 2:
            break
    assert done > 0, f"no computable request for {kind}"


# -- what the compiler sees; fallbacks --------------------------------------------------------


def test_compiler_only_sees_two_sequences(monkeypatch):
    nnet, req = _load_case(LOCAL_CASES[0])
    wide = widen(req, 6, "interleaved")
    seen = []
    real = compiler_module.compile_computation

    def spy(nnet_, requests, *a, **k):
        seen.extend(max(ix.n for s in r.inputs + r.outputs for ix in s.indexes) + 1
                    for r in requests)
        return real(nnet_, requests, *a, **k)

    monkeypatch.setattr(compiler_module, "compile_computation", spy)
    computation = compile_request(nnet, wide)
    assert seen == [2]
    rows = {len(s.indexes) for s in wide.outputs}
    assert any(m.num_rows in rows for m in computation.matrices[1:])
    seen.clear()
    compile_request(nnet, wide, use_shortcut=False)
    assert seen == [6]


def test_irregular_requests_compile_normally():
    nnet, req = _load_case(LOCAL_CASES[0])
    wide = widen(req, 3, "n-major")
    ragged = ComputationRequest(wide.inputs, [IoSpecification(
        wide.outputs[0].name, wide.outputs[0].indexes[:-1])], wide.need_model_derivative)
    assert compile_via_shortcut(nnet, ragged) is None
    comp = compile_request(nnet, ragged)
    check_computation(nnet, comp)


def test_expanding_a_computation_without_the_structure_is_refused():
    nnet, req = _load_case(LOCAL_CASES[0])
    three = compile_computation(nnet, [widen(req, 3, "n-major")])   # n in 0..2, not {0, 1}
    with pytest.raises(ShortcutNotApplicable):
        expand_computation(nnet, req.misc_info, three, 4)
    nodebug = compile_computation(nnet, [widen(req, 2, "n-major")])
    nodebug.matrix_debug_info = []
    with pytest.raises(ShortcutNotApplicable):
        expand_computation(nnet, req.misc_info, nodebug, 4)


def test_unoptimized_shortcut_equals_unoptimized_compilation():
    nnet, req = _load_case(LOCAL_CASES[1])
    wide = widen(req, 4, "interleaved", full_derivs=True)
    a = compile_via_shortcut(nnet, wide, optimize=False)
    b = compile_request(nnet, wide, use_shortcut=False, optimize=False)
    assert a is not None
    assert a.stats() == b.stats()
    assert [c.command_type for c in a.commands] == [c.command_type for c in b.commands]


# -- reference models (chunk requests as in kaldi_stats.json) ------------------------------------


def chunk_request(nnet, chunk: int, batch: int) -> ComputationRequest:
    from engine.nnet.graph import compute_simple_context  # noqa: PLC0415
    left, right = compute_simple_context(nnet)
    ins = [IoSpecification("input", [Index(n, t, 0) for t in range(-left, chunk + right)
                                     for n in range(batch)])]
    if nnet.input_dim("ivector") != -1:
        ins.append(IoSpecification("ivector", [Index(n, 0, 0) for n in range(batch)]))
    return ComputationRequest(ins, [IoSpecification("output", [
        Index(n, t, 0) for t in range(chunk) for n in range(batch)])])


_MODELS = sorted((SHARED / "models").glob("*/model.raw")) if SHARED else []


@pytest.mark.skipif(not _MODELS, reason="../shared/kaldi-ref is not present (fresh clone)")
@pytest.mark.parametrize("model", [m for m in _MODELS if m.parent.name != "xvector"],
                         ids=lambda p: p.parent.name)
def test_reference_models_chunk_requests(model):
    nnet = load_nnet(model)
    req = chunk_request(nnet, 21, 3)
    shortcut, normal = assert_shortcut_equivalent(nnet, req)
    assert shortcut.stats() == normal.stats()


# -- the command line ----------------------------------------------------------------------------


def test_cli_compile_uses_the_shortcut(tmp_path):
    import json  # noqa: PLC0415

    from click.testing import CliRunner  # noqa: PLC0415

    from service.cli import main  # noqa: PLC0415
    case = LOCAL_CASES[0]
    nnet, req = _load_case(case)
    wide = widen(req, 5, "interleaved", full_derivs=True)
    path = tmp_path / "request.json"
    path.write_text(json.dumps(wide.to_json()))
    runs = {}
    for flags in ((), ("--no-shortcut",)):
        r = CliRunner().invoke(main, ["compile", str(case / "model.txt"), "--request", str(path),
                                      "--stats", *flags])
        assert r.exit_code == 0, r.output
        runs[flags] = json.loads(r.output)
    expected = compile_via_shortcut(nnet, wide).stats()
    assert {k: runs[()][k] for k in expected} == expected
    assert runs[()]["optimized"] and runs[("--no-shortcut",)]["optimized"]
    assert runs[()]["commands"] == runs[("--no-shortcut",)]["commands"]


def test_debug_cindex_rows_equal_the_debug_info():
    """The debug cindexes as one array (NnetComputation.debug_cindex_rows: the
    compiler's arrays, DebugCindexes) are those of the debug info read as (node,
    Index) pairs, after optimization too (entries the optimizer replaced by lists
    are read from their lists)."""
    from engine.compiler.computation import DebugCindexes
    from engine.optimizer.pipeline import optimize

    def from_lists(c):
        return np.array([[node, *idx] for d in c.matrix_debug_info[1:]
                         for node, idx in d.cindexes], dtype=np.int64).reshape(-1, 4)

    replaced = 0
    for case in LOCAL_CASES:
        nnet, req = _load_case(case)
        found = request_is_decomposable(widen(req, 3, "interleaved"))
        if found is None:
            continue
        mini = found[0]
        comp = compile_computation(nnet, [mini])
        assert all(type(d.cindexes) is DebugCindexes for d in comp.matrix_debug_info[1:])
        assert comp.debug_cindex_rows().tolist() == from_lists(comp).tolist()
        opt = optimize(comp, nnet, OptimizeOptions(), request=mini)
        assert opt.debug_cindex_rows().tolist() == from_lists(opt).tolist()
        replaced += sum(type(d.cindexes) is not DebugCindexes for d in opt.matrix_debug_info[1:])
    assert replaced, "some entries were replaced by the optimizer"
