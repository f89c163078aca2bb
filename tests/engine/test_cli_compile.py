"""`nnetc compile` and `nnetc compute` on a reference case."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from refdata import stats_tolerance
from service.cli import main

CASE = Path(__file__).resolve().parents[1] / "data" / "networks_compile" / "case013"


def test_compile_stats_and_print():
    r = CliRunner().invoke(main, ["compile", str(CASE / "model.txt"), "--request",
                                  str(CASE / "request.json"), "--no-optimize", "--stats"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.output)
    ref = json.loads((CASE / "stats.json").read_text())["unoptimized"]
    assert stats["commands"] == ref["commands"] and stats["peak_bytes"] == ref["peak_bytes"]
    assert stats["compile_ms"] >= 0 and stats["optimized"] is False
    r = CliRunner().invoke(main, ["compile", str(CASE / "model.txt"), "--request",
                                  str(CASE / "request.json"), "--no-optimize", "--print"])
    assert r.exit_code == 0 and r.output.startswith("matrix m1(")
    assert "# begin forward commands" in r.output


def test_compute_writes_outputs_derivatives_and_gradient(tmp_path):
    out, grad = tmp_path / "out.npz", tmp_path / "grad.txt"
    r = CliRunner().invoke(main, ["compute", str(CASE / "model.txt"), "--request",
                                  str(CASE / "request.json"), "--inputs",
                                  str(CASE / "arrays.npz"), "--out", str(out),
                                  "--model-grad", str(grad), "--no-optimize"])
    assert r.exit_code == 0, r.output
    ours, ref = np.load(out), np.load(CASE / "arrays.npz")
    assert set(ours.files) == {"output.output"}  # the request asks for no input derivative
    err = np.abs(ours["output.output"] - ref["output.output"]).max()
    assert err <= 1e-4 + 2e-3 * np.abs(ref["output.output"]).max()
    assert grad.read_text().startswith("<Nnet3>") and "<IsGradient> T" in grad.read_text()


def test_compute_writes_the_model_with_its_statistics_as_kaldi(tmp_path):
    """--stats-model: the network after the run, as Kaldi's NnetComputer leaves the one it
    was given to store statistics in (a Kaldi case of tests/data/networks_kaldi_stored_stats
    with batch-norm in training mode: its model_after.txt)."""
    from engine.nnet.model_io import load_nnet  # noqa: PLC0415
    case = CASE.parent.parent / "networks_kaldi_stored_stats" / "bn_seed0872"
    out, after = tmp_path / "out.npz", tmp_path / "after.txt"
    r = CliRunner().invoke(main, ["compute", str(case / "model.txt"), "--request",
                                  str(case / "request.json"), "--inputs",
                                  str(case / "arrays.npz"), "--out", str(out),
                                  "--stats-model", str(after)])
    assert r.exit_code == 0, r.output
    ours, theirs = load_nnet(after), load_nnet(case / "model_after.txt")
    compared = 0
    for name, a, b in zip(ours.component_names, ours.components, theirs.components):
        for k, v in b.stats().items():
            tol = stats_tolerance(k, float(np.max(np.abs(v), initial=0)), type(b).__name__)
            assert np.max(np.abs(a.stats()[k] - v), initial=0) <= tol, (name, k)
            compared += int(np.any(v))
    assert compared >= 5
    # without store_component_stats in the request there is nothing to write
    r = CliRunner().invoke(main, ["compute", str(CASE / "model.txt"), "--request",
                                  str(CASE / "request.json"), "--inputs",
                                  str(CASE / "arrays.npz"), "--out", str(out),
                                  "--stats-model", str(after)])
    assert r.exit_code == 2 and "store_component_stats" in r.output


def test_bad_request_exits_2_naming_the_problem(tmp_path):
    bad = tmp_path / "req.json"
    bad.write_text(json.dumps({"inputs": [{"name": "nope", "indexes": [[0, 0, 0]]}],
                               "outputs": [{"name": "output", "indexes": [[0, 0, 0]]}]}))
    r = CliRunner().invoke(main, ["compile", str(CASE / "model.txt"), "--request", str(bad)])
    assert r.exit_code == 2 and "nope" in r.output
