"""Kaldi's references through the command line, end to end.  Networks: ``nnetc compile
--stats`` and ``--print`` give Kaldi's statistics and printout (stats.json,
computation.txt), ``nnetc compute --model-grad`` Kaldi's outputs, input derivatives and
model gradients (arrays.npz, model_grad.txt); always on the 14 Kaldi-made cases of
tests/data/networks_kaldi_gen, on every case of ../shared/kaldi-ref/networks when it is
there.  Models: ``nnetc infer`` against nnet3-compute (infer.json) and ``nnetc stream``
against the looped decodable (looped.json), on the Kaldi-made online-i-vector cases always
and the reference models of ../shared when present; both under the adaptive BLAS thread
policy too (--thread-policy, NNETC_BLAS_THREAD_POLICY)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from engine.nnet.model_io import load_nnet
from inference_nets import (assert_close, infer_reference, infer_reference_params,
                            looped_reference, looped_reference_params)
from refdata import network_case_params
from service.cli import main


def _run(*args) -> str:
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("case", network_case_params())
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


# -- models: nnetc infer (nnet3-compute) and nnetc stream (the looped decodable) ------------

_FLAGS = {"frames_per_chunk": "--frames-per-chunk", "extra_left_context": "--extra-left-context",
          "extra_right_context": "--extra-right-context",
          "extra_left_context_initial": "--extra-left-context-initial",
          "extra_right_context_final": "--extra-right-context-final",
          "frame_subsampling_factor": "--frame-subsampling-factor",
          "acoustic_scale": "--acoustic-scale"}


def _io_args(tmp_path: Path, j: int, feats, ivector, online, period) -> list:
    """The .npy files of job ``j`` written and their options: --features, --out, and
    --ivector or --online-ivectors with --online-ivector-period."""
    np.save(tmp_path / f"f{j}.npy", feats)
    args = ["--features", tmp_path / f"f{j}.npy", "--out", tmp_path / f"o{j}.npy"]
    if ivector is not None:
        np.save(tmp_path / f"iv{j}.npy", ivector)
        args += ["--ivector", tmp_path / f"iv{j}.npy"]
    if online is not None:
        np.save(tmp_path / f"on{j}.npy", online)
        args += ["--online-ivectors", tmp_path / f"on{j}.npy", "--online-ivector-period", period]
    return args


@pytest.mark.parametrize("kind,folder,setting", infer_reference_params())
def test_reference_inference_through_the_cli(kind, folder: Path, setting, tmp_path):
    model, o, jobs = infer_reference(kind, folder, setting)
    flags = [a for k, f in _FLAGS.items() if k in o for a in (f, o[k])]
    flags += [f"--{k.replace('_', '-')}" for k in ("apply_exp", "use_priors") if o.get(k)]
    for j, (feats, ivector, online, want) in enumerate(jobs):
        _run("infer", model, *_io_args(tmp_path, j, feats, ivector, online,
                                       o.get("online_ivector_period")), *flags)
        assert_close(np.load(tmp_path / f"o{j}.npy"), want, f"{folder.name} nnetc infer")


@pytest.mark.parametrize("kind,folder,setting", looped_reference_params())
def test_reference_streams_through_the_cli(kind, folder: Path, setting, tmp_path):
    model, o, jobs = looped_reference(kind, folder, setting)
    flags = ["--frames-per-chunk", o["frames_per_chunk"],
             "--extra-left-context-initial", o["extra_left_context_initial"],
             "--frame-subsampling-factor", o["frame_subsampling_factor"]]
    if o["truncate_future_recurrence"]:
        flags.append("--truncate-future-recurrence")
    for j, (feats, ivector, online, want) in enumerate(jobs):
        _run("stream", model, *_io_args(tmp_path, j, feats, ivector, online,
                                        o["online_ivector_period"]), *flags)
        assert_close(np.load(tmp_path / f"o{j}.npy"), want, f"{folder.name} nnetc stream")


def test_infer_and_stream_take_the_thread_policy(tmp_path, monkeypatch):
    """``--thread-policy adaptive`` (or NNETC_BLAS_THREAD_POLICY) holds for the command's
    run and is put back afterwards; the outputs still agree with Kaldi's; an unknown
    policy is a usage error."""
    from engine.runtime import parallel  # noqa: PLC0415
    seen = []
    real = parallel.set_thread_policy
    monkeypatch.setattr(parallel, "set_thread_policy", lambda p: (seen.append(p), real(p)))
    kind, folder, setting = infer_reference_params()[0].values
    model, o, jobs = infer_reference(kind, folder, setting)
    flags = [a for k, f in _FLAGS.items() if k in o for a in (f, o[k])]
    flags += [f"--{k.replace('_', '-')}" for k in ("apply_exp", "use_priors") if o.get(k)]
    feats, ivector, online, want = jobs[0]
    io = _io_args(tmp_path, 0, feats, ivector, online, o.get("online_ivector_period"))
    _run("infer", model, *io, *flags, "--thread-policy", "adaptive")
    assert_close(np.load(tmp_path / "o0.npy"), want, f"{folder.name} nnetc infer adaptive")
    assert seen == ["adaptive", "stable"] and parallel.thread_policy() == "stable"
    monkeypatch.setenv("NNETC_BLAS_THREAD_POLICY", "adaptive")
    kind, folder, setting = looped_reference_params()[0].values
    model, o, jobs = looped_reference(kind, folder, setting)
    feats, ivector, online, want = jobs[0]
    _run("stream", model, *_io_args(tmp_path, 1, feats, ivector, online,
                                    o["online_ivector_period"]),
         "--frames-per-chunk", o["frames_per_chunk"],
         "--extra-left-context-initial", o["extra_left_context_initial"],
         "--frame-subsampling-factor", o["frame_subsampling_factor"],
         *(["--truncate-future-recurrence"] if o["truncate_future_recurrence"] else []))
    assert_close(np.load(tmp_path / "o1.npy"), want, f"{folder.name} nnetc stream adaptive")
    assert seen[2:] == ["adaptive", "stable"] and parallel.thread_policy() == "stable"
    monkeypatch.setenv("NNETC_BLAS_THREAD_POLICY", "fast")
    r = CliRunner().invoke(main, ["infer", str(model), *map(str, io), *map(str, flags)])
    assert r.exit_code == 2 and "--thread-policy" in r.output and "'fast'" in r.output
