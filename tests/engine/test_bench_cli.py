"""``nnetc bench forward``: the JSON object it prints on a tiny model (shape and
internal consistency only -- wall-clock times are never asserted); its --split,
--network and --thread-policy options."""

from __future__ import annotations

import json

from click.testing import CliRunner

from service.cli import main

# A TDNN with an i-vector input: context 2 on the left, 1 on the right.
CONFIG = """\
input-node name=input dim=5
input-node name=ivector dim=3
component name=affine1 type=NaturalGradientAffineComponent input-dim=18 output-dim=8
component-node name=affine1 component=affine1 input=Append(Offset(input, -1), input, Offset(input, 1), ReplaceIndex(ivector, t, 0))
component name=relu1 type=RectifiedLinearComponent dim=8
component-node name=relu1 component=relu1 input=affine1
component name=affine2 type=AffineComponent input-dim=16 output-dim=4
component-node name=affine2 component=affine2 input=Append(Offset(relu1, -1), relu1)
component name=logsm type=LogSoftmaxComponent dim=4
component-node name=logsm component=logsm input=affine2
output-node name=output input=logsm
"""

KEYS = {"compile_ms", "exec_ms", "frames_per_s", "peak_bytes", "commands", "gemm_s", "python_s"}


def _run(args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_bench_forward_json(tmp_path):
    cfg = tmp_path / "tiny.config"
    cfg.write_text(CONFIG)
    r = _run(["bench", "forward", cfg, "--chunk", 6, "--batch", 2, "--repeat", 2, "--json"])
    assert r.exit_code == 0, r.output
    figures = json.loads(r.output)
    assert KEYS <= set(figures)
    for key in KEYS:
        assert isinstance(figures[key], (int, float)) and figures[key] > 0, key
    assert isinstance(figures["commands"], int) and isinstance(figures["peak_bytes"], int)
    assert figures["chunk"] == 6 and figures["batch"] == 2 and figures["backend"] == "numpy"
    # frames_per_s is chunk x batch frames per exec_ms
    assert abs(figures["frames_per_s"] * figures["exec_ms"] / 1e3 - 12) < 1e-6 * 12
    # two matrix products: 2 * rows * weights, rows = 12 output frames (+ the extra
    # frame of context for affine1)
    assert figures["gemm_flops"] == 2 * (14 * 8 * 18 + 12 * 4 * 16)
    assert figures["measured_peak_bytes"] > 0
    assert "threads" in figures["blas"]        # the BLAS the products ran on


def test_bench_forward_table_and_errors(tmp_path):
    cfg = tmp_path / "tiny.config"
    cfg.write_text(CONFIG)
    r = _run(["bench", "forward", cfg, "--chunk", 3, "--repeat", 1])
    assert r.exit_code == 0, r.output
    assert "exec_ms:" in r.output and "commands:" in r.output
    r = _run(["bench", "forward", cfg, "--chunk", 0])
    assert r.exit_code != 0 and "positive" in r.output
    r = _run(["bench", "forward", tmp_path / "missing.raw", "--chunk", 3])
    assert r.exit_code == 2 and "missing.raw" in r.output


def test_bench_forward_split(tmp_path):
    """--split 2: the batch as two computations at once (outputs checked against the
    whole batch inside measure_forward); the same matrix-product work in all."""
    cfg = tmp_path / "tiny.config"
    cfg.write_text(CONFIG)
    r = _run(["bench", "forward", cfg, "--chunk", 6, "--batch", 2, "--repeat", 2, "--split", 2,
              "--json"])
    assert r.exit_code == 0, r.output
    figures = json.loads(r.output)
    assert figures["split"] == 2 and figures["batch"] == 2
    assert figures["gemm_flops"] == 2 * (14 * 8 * 18 + 12 * 4 * 16)
    assert abs(figures["frames_per_s"] * figures["exec_ms"] / 1e3 - 12) < 1e-6 * 12
    r = _run(["bench", "forward", cfg, "--chunk", 6, "--batch", 3, "--split", 2])
    assert r.exit_code != 0 and "divide --batch 3" in r.output


def test_bench_forward_thread_policy(tmp_path):
    """--thread-policy: named in the figures, the process's policy as it was afterwards,
    an unknown one refused."""
    from engine.runtime import parallel  # noqa: PLC0415
    cfg = tmp_path / "tiny.config"
    cfg.write_text(CONFIG)
    seen = []
    real = parallel.set_thread_policy
    parallel.set_thread_policy = lambda p: (seen.append(p), real(p))
    try:
        r = _run(["bench", "forward", cfg, "--chunk", 4, "--repeat", 1,
                  "--thread-policy", "adaptive", "--json"])
    finally:
        parallel.set_thread_policy = real
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["thread_policy"] == "adaptive"
    assert seen == ["adaptive", "stable"] and parallel.thread_policy() == "stable"
    r = _run(["bench", "forward", cfg, "--chunk", 4, "--thread-policy", "fast"])
    assert r.exit_code == 2 and "--thread-policy" in r.output


def test_bench_forward_network_forms():
    """--network: the decoding form (collapsed, each LSTM cell one LstmNonlinearity over
    its stacked and split gate affine: the BLSTM's) against the stored structure, which
    gives Kaldi's command count for the kaldi_stats chunk request (1961 at 21x1); the
    same number of output frames."""
    from pathlib import Path  # noqa: PLC0415
    blstm = Path(__file__).resolve().parents[1] / "data" / "inference" / "blstm" / "model.raw"
    figs = {}
    for net in ("as-stored", "decoding"):
        r = _run(["bench", "forward", blstm, "--chunk", 21, "--repeat", 1, "--network", net,
                  "--json"])
        assert r.exit_code == 0, r.output
        figs[net] = json.loads(r.output)
        assert figs[net]["network"] == net
    assert figs["as-stored"]["commands"] == 1961
    assert figs["decoding"]["commands"] == 416
    # the decoding form computes the gate affines' input halves for every frame before
    # the recurrence (engine.optimizer.fuse.split_recurrent_affines_in_place): more memory
    assert (figs["decoding"]["peak_bytes"], figs["as-stored"]["peak_bytes"]) == (72096, 46400)
    r = _run(["bench", "forward", blstm, "--chunk", 21, "--network", "raw"])
    assert r.exit_code != 0 and "raw" in r.output


def test_suite_thread_settings_follow_the_backend(capsys):
    """python -m bench --backend cupy: a split run (CPU threads, one BLAS thread each)
    is refused up front rather than failing inside the forward suite (the settings
    default to 'default' there, '1,default,split2' on NumPy)."""
    import pytest  # noqa: PLC0415

    from bench.__main__ import main as bench_main  # noqa: PLC0415
    with pytest.raises(SystemExit) as e:
        bench_main(["forward", "--backend", "cupy", "--blas-threads", "1,split2"])
    assert e.value.code == 2
    assert "splitK runs are for the CPU" in capsys.readouterr().err


def test_bench_forward_model_directory_and_kaldi_figures(tmp_path):
    """MODEL may be a directory holding model.raw (the layout of kaldi-ref/models/*);
    a kaldi_stats.json beside the model adds Kaldi's figures for the case and ours
    against them.  The figures here are Kaldi's for the BLSTM's 21x1 chunk request
    (kaldi-ref/models/blstm/kaldi_stats.json); on the stored structure our command
    count and peak bytes equal Kaldi's, so those ratios are exactly 1."""
    import shutil  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415
    src = Path(__file__).resolve().parents[1] / "data" / "inference" / "blstm" / "model.raw"
    model_dir = tmp_path / "blstm"
    model_dir.mkdir()
    shutil.copy(src, model_dir / "model.raw")
    case = {"chunk": 21, "batch": 1, "commands": 1961, "matrices": 552, "peak_bytes": 46400,
            "compile_ms": 20.776, "exec_ms": 2.252}
    work = {"gemm_s": 0.118, "python_s": 0.17}
    (model_dir / "kaldi_stats.json").write_text(json.dumps(
        {"cases": [case], "reference_workload": work}))
    r = _run(["bench", "forward", model_dir, "--chunk", 21, "--repeat", 1, "--network",
              "as-stored", "--json"])
    assert r.exit_code == 0, r.output
    figs = json.loads(r.output)
    kaldi = figs["kaldi"]
    assert kaldi["case"] == case
    assert kaldi["commands_ratio"] == 1.0 and kaldi["peak_bytes_ratio"] == 1.0
    assert abs(kaldi["exec_ratio"] - (figs["exec_ms"] / figs["gemm_s"])
               / (case["exec_ms"] / work["gemm_s"])) < 1e-12
    assert abs(kaldi["compile_ratio"] - (figs["compile_ms"] / figs["python_s"])
               / (case["compile_ms"] / work["python_s"])) < 1e-12
    assert kaldi["same_structure"] is True and "note" not in kaldi
    # the decoding form (the default) is compared too, and says it is not Kaldi's structure
    r = _run(["bench", "forward", model_dir, "--chunk", 21, "--repeat", 1, "--json"])
    assert r.exit_code == 0, r.output
    kaldi = json.loads(r.output)["kaldi"]
    assert kaldi["same_structure"] is False and "--network as-stored" in kaldi["note"]
    assert kaldi["commands_ratio"] < 1.0
    # a case Kaldi's file does not list: no comparison, the figures as before
    r = _run(["bench", "forward", model_dir, "--chunk", 5, "--repeat", 1, "--json"])
    assert r.exit_code == 0, r.output
    assert "kaldi" not in json.loads(r.output)
    # the plain listing names the ratios
    r = _run(["bench", "forward", model_dir, "--chunk", 21, "--repeat", 1])
    assert r.exit_code == 0 and "kaldi.exec_ratio:" in r.output, r.output
    # a directory with no model in it
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _run(["bench", "forward", empty, "--chunk", 3])
    assert r.exit_code == 2 and "holds none of model.raw, final.mdl" in r.output, r.output
