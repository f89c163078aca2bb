"""Bad files and paths given to ``nnetc``: exit status 2 and ``error: ...`` naming the file
or field at fault, never a traceback or click's bare "Aborted!" (fuzz25 repro_4); inputs the
HTTP API refuses with a 4xx are refused by the CLI too."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from service.cli import main

CONFIG = """input-node name=input dim=4
component name=a type=SigmoidComponent dim=8
component-node name=a component=a input=Append(Offset(input, -1), Offset(input, 2))
output-node name=output input=a
"""
CASE = Path(__file__).resolve().parents[1] / "data" / "networks_compile" / "case013"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def refused(r, *named: str) -> None:
    """Exit status 2 with the typed error's message, which names each of ``named``."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output and "Aborted!" not in r.output
    assert "error: " in r.output
    for what in named:
        assert what in r.output, (what, r.output)


@pytest.fixture()
def files(tmp_path):
    model = tmp_path / "net.config"
    model.write_text(CONFIG)
    np.save(tmp_path / "feats.npy", np.random.default_rng(0).standard_normal((30, 4))
            .astype(np.float32))
    return tmp_path, model, tmp_path / "feats.npy"


# -- output paths ----------------------------------------------------------------------------

def test_an_output_in_a_missing_directory_is_refused_before_any_work(files, monkeypatch):
    tmp, model, feats = files
    from engine.inference import Inferencer  # noqa: PLC0415
    from engine.inference.stream import LoopedModel  # noqa: PLC0415

    def never(*_, **__):
        raise AssertionError("computed before the output path was checked")
    monkeypatch.setattr(Inferencer, "infer", never)
    monkeypatch.setattr(LoopedModel, "__init__", never)
    bad = "/nonexistent/dir/o.npy"
    refused(run("infer", model, "--features", feats, "--out", bad), bad, "does not exist")
    refused(run("stream", model, "--features", feats, "--out", bad), bad, "does not exist")
    refused(run("copy", model, "/nonexistent/o.raw"), "/nonexistent/o.raw")
    refused(run("init", model, "/nonexistent/o.raw"), "/nonexistent/o.raw")
    # a path under a file: its "directory" is no directory
    under_file = tmp / "feats.npy" / "o.npy"
    refused(run("infer", model, "--features", feats, "--out", under_file), str(under_file),
            "not a directory")


def test_compute_checks_every_output_path_first(tmp_path, monkeypatch):
    from engine.runtime.executor import Executor  # noqa: PLC0415

    def never(*_, **__):
        raise AssertionError("computed before the output paths were checked")
    monkeypatch.setattr(Executor, "__init__", never)
    base = ["compute", CASE / "model.txt", "--request", CASE / "request.json",
            "--inputs", CASE / "arrays.npz"]
    refused(run(*base, "--out", "/nonexistent/x.npz"), "--out /nonexistent/x.npz")
    refused(run(*base, "--out", tmp_path / "o.npz", "--model-grad", "/nonexistent/g.txt"),
            "--model-grad /nonexistent/g.txt")


def test_a_write_that_fails_anyway_is_an_error(files, monkeypatch):
    tmp, model, feats = files
    # a real failing write: /dev/full takes the open and refuses the bytes
    refused(run("copy", model, "/dev/full"), "/dev/full", "No space left")

    def full(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(np, "save", full)
    monkeypatch.setattr(np, "savez", full)
    out = tmp / "o.npy"
    for cmd in ("infer", "stream"):
        refused(run(cmd, model, "--features", feats, "--out", out), str(out), "No space left")
    refused(run("compute", CASE / "model.txt", "--request", CASE / "request.json",
                "--inputs", CASE / "arrays.npz", "--out", tmp / "o.npz"),
            str(tmp / "o.npz"), "No space left")


# -- unreadable input files ------------------------------------------------------------------

def test_a_request_that_is_not_utf8_is_refused(tmp_path):
    req = tmp_path / "req_utf16.json"
    req.write_bytes(b'\xff\xfe{"a":1}')          # a UTF-16 byte-order mark, cut short
    refused(run("compile", CASE / "model.txt", "--request", req), str(req), "UTF-16",
            "not valid JSON")
    req.write_bytes(b'{"inputs": [], "outputs": ["\xe9"]}')   # Latin-1, not UTF-8
    refused(run("compile", CASE / "model.txt", "--request", req), str(req), "utf-8")


@pytest.mark.parametrize("content", [b"PK\x03\x04garbage", b"", b"\x93NUMPY\x01\x00"])
def test_compute_refuses_an_unreadable_inputs_archive(tmp_path, content):
    bad = tmp_path / "garbage.npz"
    bad.write_bytes(content)
    refused(run("compute", CASE / "model.txt", "--request", CASE / "request.json",
                "--inputs", bad, "--out", tmp_path / "o.npz"), str(bad), "cannot read")


def test_compute_refuses_a_npy_for_its_inputs(tmp_path):
    npy = tmp_path / "inputs.npy"
    np.save(npy, np.zeros((21, 11), np.float32))
    refused(run("compute", CASE / "model.txt", "--request", CASE / "request.json",
                "--inputs", npy, "--out", tmp_path / "o.npz"), str(npy), ".npz")


@pytest.mark.parametrize("cmd", ["infer", "stream"])
@pytest.mark.parametrize("content", [b"", b"\x93NUMPY", b"PK\x03\x04garbage"])
def test_an_unreadable_features_file_is_refused(files, cmd, content):
    tmp, model, _ = files
    bad = tmp / "bad.npy"
    bad.write_bytes(content)
    refused(run(cmd, model, "--features", bad, "--out", tmp / "o.npy"), "--features",
            str(bad))


def test_features_in_an_npz_archive_are_refused(files):
    tmp, model, _ = files
    npz = tmp / "feats.npz"
    np.savez(npz, feats=np.zeros((10, 4), np.float32))
    refused(run("infer", model, "--features", npz, "--out", tmp / "o.npy"), str(npz), ".npz")


# -- what the HTTP API refuses ---------------------------------------------------------------

def _case_inputs(tmp_path, **changes) -> Path:
    arrays = dict(np.load(CASE / "arrays.npz"))
    arrays.update(changes)
    path = tmp_path / "inputs.npz"
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("key, value", [("input.input", np.nan), ("input.input", np.inf),
                                        ("output_deriv.output", -np.inf)])
def test_compute_refuses_nan_and_inf_as_the_service_does(tmp_path, key, value):
    """/compute answers 422 "<field>: contains NaN or infinite values" (matrix_from_wire)."""
    a = np.load(CASE / "arrays.npz")[key].copy()
    a[3, 2] = value
    inputs = _case_inputs(tmp_path, **{key: a})
    refused(run("compute", CASE / "model.txt", "--request", CASE / "request.json",
                "--inputs", inputs, "--out", tmp_path / "o.npz"),
            str(inputs), repr(key), "NaN or infinite")
    assert not (tmp_path / "o.npz").exists()


def test_compute_refuses_an_array_the_request_does_not_take(tmp_path):
    """As /compute's output_derivs / inputs fields: a derivative for an output without
    has_deriv (or an input the request lacks) is an error naming it, not ignored."""
    req = json.loads((CASE / "request.json").read_text())
    req["need_model_derivative"] = False
    req["outputs"][0]["has_deriv"] = False
    path = tmp_path / "req.json"
    path.write_text(json.dumps(req))
    # case013's arrays hold output_deriv.output
    refused(run("compute", CASE / "model.txt", "--request", path, "--inputs",
                CASE / "arrays.npz", "--out", tmp_path / "o.npz"),
            "'output_deriv.output'", "has_deriv")
    inputs = _case_inputs(tmp_path, **{"input.ivector": np.zeros((1, 3), np.float32)})
    refused(run("compute", CASE / "model.txt", "--request", CASE / "request.json",
                "--inputs", inputs, "--out", tmp_path / "o.npz"), "'input.ivector'")
    # the reference arrays (outputs kept beside the inputs) still run
    r = run("compute", CASE / "model.txt", "--request", CASE / "request.json", "--inputs",
            CASE / "arrays.npz", "--out", tmp_path / "o.npz")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("where, value", [("io", "yes"), ("io", 1), ("io", None),
                                          ("need_model_derivative", "true"),
                                          ("store_component_stats", 0)])
def test_a_flag_that_is_not_a_json_boolean_is_refused(tmp_path, where, value):
    """The HTTP schema takes has_deriv and the request flags as StrictBool."""
    req = json.loads((CASE / "request.json").read_text())
    if where == "io":
        req["outputs"][0]["has_deriv"] = value
    else:
        req[where] = value
    path = tmp_path / "req.json"
    path.write_text(json.dumps(req))
    refused(run("compile", CASE / "model.txt", "--request", path), str(path),
            "has_deriv" if where == "io" else where, json.dumps(value))


def test_zero_frames_as_the_http_api(files):
    """The HTTP stream API takes an empty push and a finish with no frames (200, zero output
    rows); /infer refuses zero frames (422 "zero-length features").  The CLI does the
    same: ``stream`` writes a (0, output-dim) matrix, ``infer`` exits 2."""
    tmp, model, _ = files
    empty = tmp / "empty.npy"
    np.save(empty, np.zeros((0, 4), np.float32))
    out = tmp / "o.npy"
    r = run("stream", model, "--features", empty, "--out", out)
    assert r.exit_code == 0, r.output
    got = np.load(out)
    assert got.shape == (0, 8) and got.dtype == np.float32
    refused(run("infer", model, "--features", empty, "--out", tmp / "o2.npy"),
            "zero-length features")
    assert not (tmp / "o2.npy").exists()
