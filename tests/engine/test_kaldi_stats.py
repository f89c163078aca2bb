"""Fidelity of our computations to Kaldi's: command counts, peak bytes and the
optimized printout, per reference network (kaldi-ref stats.json, computation.txt).

Every one of the 69 reference cases must come out exactly as Kaldi's optimizer
makes it: the same number of commands, the same peak bytes (Kaldi's convention,
``NnetComputation.peak_bytes()``) and a printout byte-identical to Kaldi's
computation.txt.  On a fresh clone the cases are rebuilt from their configs
(tests/data/compiler/networks, batch-norm and dropout put in test mode as the
reference models are; the computation depends on structure only, not on the
parameter values) and checked against tests/data/kaldi_stats/kaldi_stats.json
(stats.json of each case plus the SHA-256 of its computation.txt); with
../shared/kaldi-ref present the reference model.txt files are used and the
printouts are diffed line by line.

The last differences (12 cases) came from one place: Kaldi's SplitLocations takes
the terms used by most rows of a summed input in the iteration order of an
``std::unordered_map``, which decides which term is written first (and so which
add the optimizer can turn into a copy, and how variables merge afterwards);
``engine.compiler.compile_utils.unordered_map_order`` reproduces libstdc++'s order.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine.compiler.compile_utils import unordered_map_order
from engine.compiler.computation import CommandType, NnetComputation
from engine.compiler.request import ComputationRequest
from engine.compiler.shortcut import compile_request
from engine.nnet.model_io import load_nnet
from engine.optimizer.analysis import reference_peak_bytes
from engine.optimizer.collapse import set_batchnorm_test_mode, set_dropout_test_mode
from service.cli import main

from compiler_ref import CASES_DIR, first_difference, load_case
from inference_nets import model_file
from refdata import DATA, shared_ref

CT = CommandType
KALDI = json.loads((DATA / "kaldi_stats" / "kaldi_stats.json").read_text())
LOCAL_CASES = sorted(c for c in KALDI if (CASES_DIR / c).is_dir())


def _full_cases() -> list[Path]:
    ref = shared_ref()
    if ref is None:
        return []
    return sorted(p for p in (ref / "networks").iterdir() if (p / "stats.json").exists())


FULL_CASES = _full_cases()


def _ours(nnet, req) -> tuple[dict, dict, NnetComputation]:
    """(optimized stats, unoptimized stats, optimized computation), compiled as
    `nnetc compile` does (shortcut compilation where it applies)."""
    opt = compile_request(nnet, req)
    raw = compile_request(nnet, req, use_shortcut=False, optimize=False)
    return opt.stats(), raw.stats(), opt


def test_local_set_covers_every_reference_case():
    assert len(LOCAL_CASES) == len(KALDI) == 69


@functools.lru_cache(maxsize=None)
def _local(case: str) -> tuple[dict, dict, str]:
    """(optimized stats, unoptimized stats, optimized printout) of a local case."""
    nnet, req = load_case(case)
    assert nnet is not None, req          # (None, reason) when a component type is missing
    set_batchnorm_test_mode(nnet)
    set_dropout_test_mode(nnet)
    opt, raw, comp = _ours(nnet, req)
    return opt, raw, comp.to_text(nnet)


@pytest.mark.parametrize("case", LOCAL_CASES)
def test_case_matches_kaldi_stats_and_printout(case):
    opt, raw, text = _local(case)
    ref = KALDI[case]
    assert (opt["commands"], opt["peak_bytes"]) == (ref["optimized"]["commands"],
                                                    ref["optimized"]["peak_bytes"])
    assert (raw["commands"], raw["peak_bytes"]) == (ref["unoptimized"]["commands"],
                                                    ref["unoptimized"]["peak_bytes"])
    assert hashlib.sha256(text.encode()).hexdigest() == ref["computation_sha256"], (
        f"{case}: optimized printout differs from Kaldi's computation.txt; see "
        f"`nnetc compile MODEL --request REQ --print` against it")


def test_issue_targets_on_the_local_set():
    """The issue's quality target, as a summary: peak <= Kaldi on every case and
    commands <= Kaldi on the median (here: equal everywhere)."""
    ratios, over_peak = [], []
    for case in LOCAL_CASES:
        opt = _local(case)[0]
        ref = KALDI[case]["optimized"]
        ratios.append(opt["commands"] / ref["commands"])
        if opt["peak_bytes"] > ref["peak_bytes"]:
            over_peak.append((case, opt["peak_bytes"], ref["peak_bytes"]))
    ratios.sort()
    assert not over_peak
    assert ratios[len(ratios) // 2] <= 1.0
    assert ratios[0] == ratios[-1] == 1.0


@pytest.mark.skipif(not FULL_CASES, reason="../shared/kaldi-ref is not present (fresh clone)")
@pytest.mark.parametrize("case", FULL_CASES, ids=lambda p: p.name)
def test_full_reference_set_matches_kaldi(case):
    """Every network case of ../shared (however many it holds): command counts and peak
    bytes, optimized and not, and the optimized printout, as Kaldi's."""
    nnet = load_nnet(case / "model.txt")
    req = ComputationRequest.from_json((case / "request.json").read_bytes())
    opt, raw, comp = _ours(nnet, req)
    ref = json.loads((case / "stats.json").read_text())
    for key, ours in (("optimized", opt), ("unoptimized", raw)):
        assert (ours["commands"], ours["peak_bytes"]) == (
            ref[key]["commands"], ref[key]["peak_bytes"]), (case.name, key, ours, ref[key])
    kaldi_text = case / "computation.txt"
    if kaldi_text.exists():
        text, kaldi = comp.to_text(nnet), kaldi_text.read_text()
        assert text == kaldi, f"{case.name}: {first_difference(text, kaldi)}"


# -- the peak-bytes convention -----------------------------------------------------------------


def test_peak_bytes_is_kaldis_convention():
    """kAllocMatrix adds, kDeallocMatrix subtracts (also for a supplied input, whose
    kAcceptInput added nothing), kSwapMatrix changes nothing."""
    c = NnetComputation()
    inp = c.new_matrix(10, 10)            # 400 bytes, supplied by the user
    a = c.new_matrix(10, 10)              # 400
    b = c.new_matrix(10, 10)              # 400
    d = c.new_matrix(5, 5)                # 100
    c.add(CT.ACCEPT_INPUT, inp, 0)        # 0
    c.add(CT.ALLOC_MATRIX, a)             # 400
    c.add(CT.SWAP_MATRIX, a, b)           # 400 (b now holds the memory)
    c.add(CT.DEALLOC_MATRIX, inp)         # 0
    c.add(CT.ALLOC_MATRIX, d)             # 100
    c.add(CT.ALLOC_MATRIX, a)             # 500
    c.add(CT.DEALLOC_MATRIX, b)           # 100
    c.add(CT.DEALLOC_MATRIX, a)           # -300
    c.add(CT.DEALLOC_MATRIX, d)           # -400
    assert c.peak_bytes() == 500
    assert c.stats()["peak_bytes"] == 500 == reference_peak_bytes(c)


def test_cli_stats_report_kaldis_peak_on_an_optimized_computation():
    # case013: a swap-following count would give 26568 here; Kaldi's stats say 25644
    case = DATA / "networks_compile" / "case013"
    r = CliRunner().invoke(main, ["compile", str(case / "model.txt"), "--request",
                                  str(case / "request.json"), "--stats"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.output)
    ref = json.loads((case / "stats.json").read_text())["optimized"]
    assert stats["optimized"] is True
    assert (stats["commands"], stats["peak_bytes"]) == (ref["commands"], ref["peak_bytes"])
    assert stats["peak_bytes"] == 25644


# -- the std::unordered_map order behind SplitLocations ------------------------------------------


@pytest.mark.parametrize("keys, order", [
    # orders printed by iterating a libstdc++ (GCC 12) std::unordered_map<int, int>
    # after inserting the keys in this order
    ([3, 5], [5, 3]),
    ([2, 15, 5, 28], [5, 28, 15, 2]),                      # 2/15 and 5/28 share buckets
    (list(range(15)), [14, 13] + list(range(13))),         # a rehash at the 14th key
    ([40, 7, 33, 12, 99, 26, 5, 18, 61, 3, 77, 14, 52, 90, 21, 8],
     [8, 21, 40, 14, 7, 33, 77, 12, 99, 26, 52, 5, 18, 90, 61, 3]),
])
def test_unordered_map_order_is_libstdcxx(keys, order):
    assert unordered_map_order(keys) == order


def test_summed_input_terms_come_in_kaldis_order():
    """case005: output = Sum(affine, Round(statistics-pooling, 1)); both terms are
    used by every row, so Kaldi writes them in unordered_map order: the affine
    term first (a copy after optimization), then the pooled statistics added."""
    case = DATA / "networks_compile" / "case005"
    nnet = load_nnet(case / "model.txt")
    req = ComputationRequest.from_json((case / "request.json").read_bytes())
    raw = compile_request(nnet, req, use_shortcut=False, optimize=False)
    lines = raw.command_strings(nnet)
    add_rows = next(i for i, t in enumerate(lines) if ".AddRows(" in t and "m3[" in t)
    add_pool = next(i for i, t in enumerate(lines) if t.endswith("+= m7"))
    assert add_rows < add_pool
    opt = compile_request(nnet, req)
    assert opt.to_text(nnet) == (case / "computation.txt").read_text()


# -- the models' chunk requests (models/*/kaldi_stats.json) ------------------------------------


def _model_chunk_cases() -> list:
    ref = shared_ref()
    if ref is None:
        return []
    out = []
    for stats in sorted((ref / "models").glob("*/kaldi_stats.json")):
        for case in json.loads(stats.read_text())["cases"]:
            out.append(pytest.param(stats.parent, case,
                                    id=f"{stats.parent.name}-{case['chunk']}x{case['batch']}"))
    return out


@pytest.mark.skipif(shared_ref() is None, reason="../shared/kaldi-ref is not present (fresh clone)")
@pytest.mark.parametrize("model_dir,case", _model_chunk_cases())
def test_model_chunk_requests_match_kaldi_stats(model_dir, case):
    """The chunk requests of kaldi_stats.json (input t in [-left, chunk + right), output
    t in [0, chunk), n in [0, batch), i-vector at t=0 per n) on the network as stored, in
    test mode (the structure Kaldi's figures were measured on): commands, matrices and
    peak bytes as Kaldi's optimized computation.  The decoding form of the network
    (collapsed, sibling affines fused, i-vector columns and recurrent affines split) is
    never above them in commands, nor in matrices but for one per i-vector split; nor in
    peak bytes (TDNN-F 150x1: 529200 against 534576 once its residual scales are folded:
    the in-place scalings gone, merging pairs other matrices), except where a recurrent
    affine was split: its input half, computed for every frame before the loop, lives
    through it (memory traded for speed, engine.optimizer.fuse: 1.29-1.6x on the reference
    TDNN-LSTM and BLSTM)."""
    from bench import common  # noqa: PLC0415
    request_of = common.chunk_request
    nnet = common.load_for_inference(model_file(model_dir), "as-stored")
    st = common.compile_cold(nnet, request_of(nnet, case["chunk"], case["batch"])).stats()
    assert ((st["commands"], st["matrices"], st["peak_bytes"])
            == (case["commands"], case["matrices"], case["peak_bytes"])), (model_dir.name, case)
    dec = common.load_for_inference(model_file(model_dir))
    ds = common.compile_cold(dec, request_of(dec, case["chunk"], case["batch"])).stats()
    # the halves of split nodes: <node>.x with <node>.c (i-vector columns) or <node>.r
    # (recurrent columns)
    names = set(dec.node_names)
    halves = [n[-1] for n in names if n[-2:] in (".c", ".r") and n[:-2] + ".x" in names]
    # an i-vector split adds the matrix of the i-vector's product (one row per sequence)
    assert ds["commands"] <= st["commands"], (ds, st)
    assert ds["matrices"] <= st["matrices"] + halves.count("c"), (ds, st)
    if "r" in halves:
        assert st["peak_bytes"] < ds["peak_bytes"] <= 1.7 * st["peak_bytes"], (ds, st)
    else:
        assert ds["peak_bytes"] <= st["peak_bytes"], (ds, st)
