"""Kaldi's reference networks through the command line, end to end: ``nnetc compile
--stats`` and ``--print`` give Kaldi's statistics and printout (stats.json,
computation.txt), ``nnetc compute --model-grad`` Kaldi's outputs, input derivatives and
model gradients (arrays.npz, model_grad.txt).  Always on the 14 Kaldi-made cases of
tests/data/networks_kaldi_gen; on every case of ../shared/kaldi-ref/networks when it is
there."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from engine.nnet.model_io import load_nnet
from inference_nets import assert_close
from refdata import DATA, shared_ref
from service.cli import main

LOCAL = sorted((DATA / "networks_kaldi_gen").iterdir())


def _cases() -> list:
    out = [pytest.param(p, id=f"gen-{p.name}") for p in LOCAL]
    ref = shared_ref()
    if ref is not None:
        out += [pytest.param(p, id=f"ref-{p.name}", marks=pytest.mark.conformance)
                for p in sorted((ref / "networks").iterdir()) if (p / "request.json").exists()]
    return out


def _run(*args) -> str:
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("case", _cases())
def test_reference_network_through_the_cli(case: Path, tmp_path):
    model, request = case / "model.txt", case / "request.json"
    stats = json.loads(_run("compile", model, "--request", request, "--stats"))
    want = json.loads((case / "stats.json").read_text())
    assert (stats["commands"], stats["peak_bytes"]) == (want["optimized"]["commands"],
                                                        want["optimized"]["peak_bytes"])
    raw = json.loads(_run("compile", model, "--request", request, "--stats", "--no-optimize",
                          "--no-shortcut"))
    assert (raw["commands"], raw["peak_bytes"]) == (want["unoptimized"]["commands"],
                                                    want["unoptimized"]["peak_bytes"])
    if (case / "computation.txt").exists():
        printed = _run("compile", model, "--request", request, "--print")
        assert printed.rstrip("\n") == (case / "computation.txt").read_text().rstrip("\n")

    arrays = np.load(case / "arrays.npz")
    req = json.loads(request.read_text())
    np.savez(tmp_path / "in.npz", **{k: arrays[k] for k in arrays.files
                                     if k.startswith(("input.", "output_deriv."))})
    grad_path = tmp_path / "grad.txt"
    args = ["compute", model, "--request", request, "--inputs", tmp_path / "in.npz",
            "--out", tmp_path / "out.npz"]
    if req.get("need_model_derivative"):
        args += ["--model-grad", grad_path]
    _run(*args)
    out = np.load(tmp_path / "out.npz")
    for s in req["outputs"]:
        assert_close(out[f"output.{s['name']}"], arrays[f"output.{s['name']}"],
                     f"{case.name} output {s['name']}")
    if any(s.get("has_deriv") for s in req["outputs"]):
        for s in req["inputs"]:
            if s.get("has_deriv"):
                assert_close(out[f"input_deriv.{s['name']}"], arrays[f"input_deriv.{s['name']}"],
                             f"{case.name} input derivative {s['name']}")
    if req.get("need_model_derivative") and (case / "model_grad.txt").exists():
        # ours: the plain gradient; Kaldi's model_grad.txt: parameters + gradient
        ours, theirs, orig = (load_nnet(grad_path), load_nnet(case / "model_grad.txt"),
                              load_nnet(model))
        for name, a, b, o in zip(orig.component_names, ours.components, theirs.components,
                                 orig.components):
            if not o.is_updatable:
                continue
            for p, pa, pb, po in zip(o.PARAMS, a.param_arrays(), b.param_arrays(),
                                     o.param_arrays()):
                assert_close(pa, np.asarray(pb, np.float64) - np.asarray(po, np.float64),
                             f"{case.name} gradient {name}.{p}")
