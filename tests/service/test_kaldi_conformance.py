"""Kaldi's reference networks through the HTTP API, end to end: a client registers the
model text (POST /models), compiles the reference request (POST /compile with the
listing) and runs it (POST /compute with Kaldi's inputs and output derivatives).  The
statistics and listing must be Kaldi's (stats.json, computation.txt) and the outputs,
input derivatives and model gradients Kaldi's to float32 rounding (arrays.npz,
model_grad.txt).  Always on the 14 Kaldi-made cases of tests/data/networks_kaldi_gen;
on every case of ../shared/kaldi-ref/networks when it is there."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from engine.nnet.model_io import load_nnet
from refdata import DATA, shared_ref
from tests.service.conftest import decode

LOCAL = sorted((DATA / "networks_kaldi_gen").iterdir())


def _cases() -> list:
    out = [pytest.param(p, id=f"gen-{p.name}") for p in LOCAL]
    ref = shared_ref()
    if ref is not None:
        out += [pytest.param(p, id=f"ref-{p.name}", marks=pytest.mark.conformance)
                for p in sorted((ref / "networks").iterdir()) if (p / "request.json").exists()]
    return out


def _b64(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a, dtype="<f4")
    return {"shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}


def _close(what: str, ours: np.ndarray, ref: np.ndarray) -> None:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs {ref.shape}"
    if ref.size:
        err = float(np.max(np.abs(ours - ref)))
        tol = 1e-4 + 2e-3 * float(np.max(np.abs(ref)))
        assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("case", _cases())
def test_reference_network_over_http(client, case: Path):
    r = client.post("/models", json={"text": (case / "model.txt").read_text()})
    assert r.status_code in (200, 201), r.text
    mid = r.json()["model_id"]
    request = json.loads((case / "request.json").read_text())

    r = client.post("/compile", json={"model_id": mid, "request": request, "listing": True})
    assert r.status_code == 200, r.text
    got = r.json()
    want = json.loads((case / "stats.json").read_text())["optimized"]
    assert (got["stats"]["commands"], got["stats"]["peak_bytes"]) == (
        want["commands"], want["peak_bytes"])
    if (case / "computation.txt").exists():
        assert got["listing"] == (case / "computation.txt").read_text()

    arrays = np.load(case / "arrays.npz")
    body = {"model_id": mid, "request": request, "encoding": "base64",
            "inputs": {s["name"]: _b64(arrays[f"input.{s['name']}"])
                       for s in request["inputs"]},
            "output_derivs": {s["name"]: _b64(arrays[f"output_deriv.{s['name']}"])
                              for s in request["outputs"] if s.get("has_deriv")}}
    r = client.post("/compute", json=body)
    assert r.status_code == 200, r.text
    res = r.json()
    for s in request["outputs"]:
        _close(f"output {s['name']}", decode(res["outputs"][s["name"]]),
               arrays[f"output.{s['name']}"])
    if any(s.get("has_deriv") for s in request["outputs"]):
        for s in request["inputs"]:
            if s.get("has_deriv"):
                _close(f"input derivative {s['name']}",
                       decode(res["input_derivs"][s["name"]]),
                       arrays[f"input_deriv.{s['name']}"])
    if request.get("need_model_derivative") and (case / "model_grad.txt").exists():
        # Kaldi's SetNnetAsGradient convention: model_grad.txt holds parameters + gradient
        ref, orig = load_nnet(case / "model_grad.txt"), load_nnet(case / "model.txt")
        grads = res["model_gradient"] or {}
        checked = 0
        for name, theirs, o in zip(ref.component_names, ref.components, orig.components):
            if name not in grads:
                continue
            for p, b, a0 in zip(theirs.PARAMS, theirs.param_arrays(), o.param_arrays()):
                if p in grads[name]:
                    _close(f"gradient {name}.{p}", decode(grads[name][p]).reshape(b.shape),
                           np.asarray(b, np.float64) - np.asarray(a0, np.float64))
                    checked += 1
        if any(c.is_updatable for c in orig.components):
            assert checked, "no model gradient compared"


@pytest.mark.parametrize("case", LOCAL, ids=lambda p: p.name)
def test_structure_hash_leaves_the_model_alone(case: Path):
    """Registering hashes a model's structure with its parameters zeroed in a copy; the
    copy must not share arrays with the model (it did for a CompositeComponent, whose
    parameters live in its members: seed218's weights came out zero)."""
    from service.registry import structure_hash  # noqa: PLC0415
    nnet = load_nnet(case / "model.txt")
    before = [a.copy() for c in nnet.components for a in c.param_arrays()]
    first = structure_hash(nnet)
    after = [a for c in nnet.components for a in c.param_arrays()]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert structure_hash(nnet) == first
