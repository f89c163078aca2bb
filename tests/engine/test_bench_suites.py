"""``python -m bench``: the suites' rows on a tiny reference model with made-up Kaldi
figures (structure and internal consistency only -- wall-clock times are never
asserted), and its argument checks."""

from __future__ import annotations

import json

import pytest

import bench.__main__ as bench_main
from bench import common

from test_bench_cli import CONFIG

KALDI = {"reference_workload": {"gemm_s": 0.1, "python_s": 0.2},
         "cases": [{"chunk": c, "batch": b, "commands": 10, "matrices": 5, "peak_bytes": 4000,
                    "compile_ms": 2.0, "exec_ms": 1.0}
                   for c, b in [(21, 1), (21, 8), (150, 1), (150, 8)]]}


@pytest.fixture
def tiny_models(tmp_path, monkeypatch):
    d = tmp_path / "models" / "tiny"
    d.mkdir(parents=True)
    (d / "model.raw").write_text(CONFIG)
    (d / "kaldi_stats.json").write_text(json.dumps(KALDI))
    monkeypatch.setattr(common, "MODELS", tmp_path / "models")
    # fast stand-ins for the reference workloads (their values only scale the ratios)
    monkeypatch.setattr(common, "gemm_s", lambda: 0.05)
    monkeypatch.setattr(common, "python_s", lambda: 0.1)
    return tmp_path


def test_forward_suites_run_under_each_thread_setting(tiny_models, capsys):
    out = tiny_models / "r.json"
    assert bench_main.main(["forward", "roofline", "memory", "--repeat", "1", "--models", "tiny",
                            "--blas-threads", "1,default,1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["machine"]["blas_threads"] in (["1", "default"],
                                                 "default (threadpoolctl not installed)")
    assert set(result["machine"]["gemm_s_same_threads"]) == {"1", "default"}
    # the BLAS NumPy runs (library, kernel set, threads) and the settings that steer it
    blas = result["machine"]["blas"]
    assert isinstance(blas, list) and all("library" in b and "architecture" in b
                                          for b in blas)
    assert all(k.startswith(("OPENBLAS_", "MKL_", "OMP_", "GOTO_"))
               for k in result["machine"]["blas_env"])
    fwd = result["suites"]["forward"]["rows"]
    # each case once per distinct setting (the repeated "1" is dropped)
    assert [(r["chunk"], r["batch"], r["threads"]) for r in fwd] == [
        (21, 1, "1"), (21, 1, "default"), (150, 1, "1"), (150, 1, "default"),
        (150, 8, "1"), (150, 8, "default")]
    for r in fwd:
        assert r["kaldi_ms"] == 1.0 and r["exec_ms"] > 0 and r["min_ms"] <= r["exec_ms"]
        # (ours / gemm_s) / (Kaldi's / Kaldi's gemm_s)
        assert r["ratio_vs_kaldi"] == pytest.approx((r["exec_ms"] / 0.05) / (1.0 / 0.1))
        assert r["ratio_raw"] == pytest.approx(r["exec_ms"] / 1.0)
    roof = result["suites"]["roofline"]["rows"]
    assert [r["threads"] for r in roof] == [r["threads"] for r in fwd]
    for r in roof:
        assert 0 < r["gflops_min"] and r["roofline"] == pytest.approx(
            r["gflops"] / r["gemm_peak_gflops"])
    mem = result["suites"]["memory"]["rows"]
    assert [(r["chunk"], r["batch"]) for r in mem] == [(21, 1), (150, 1), (150, 8)]
    assert all(r["kaldi_peak_bytes"] == 4000 and r["peak_bytes"] > 0 for r in mem)
    # the tiny network is the same in both forms: its timed form holds the same peak
    assert all(r["timed_form_peak_bytes"] == r["peak_bytes"] for r in mem)


def test_compile_suite_takes_the_median_of_per_round_ratios(tiny_models, monkeypatch):
    """Each round is normalised by the mean of the workload runs around it (the first
    run, untimed, is dropped), and a case's ratio is the median over the rounds."""
    workloads = iter([9.0, 0.1, 0.2, 0.3, 0.4])
    calls = []

    def fake_python_s_on(clock=None, runs=5):
        calls.append(runs)
        return next(workloads)
    monkeypatch.setattr(common, "python_s_on", fake_python_s_on)
    out = tiny_models / "c.json"
    assert bench_main.main(["compile", "--models", "tiny", "--compile-rounds", "3",
                            "--compile-repeat", "2", "--json", str(out)]) == 0
    assert calls == [1] * 5
    rows = json.loads(out.read_text())["suites"]["compile"]["rows"]
    assert [(r["chunk"], r["batch"]) for r in rows] == [(21, 1), (21, 8), (150, 1), (150, 8)]
    for r in rows:
        assert r["rounds"] == 3 and r["runs"] == 6
        assert r["python_cpu_s_runs"] == [0.1, 0.2, 0.3, 0.4]
        assert r["python_cpu_s"] == pytest.approx(0.25)
        ratios = r["ratio_rounds"]
        assert len(ratios) == 3 and r["ratio_vs_kaldi"] == sorted(ratios)[1]
        # round i: (its median ms / the mean of workloads i and i+1) / (2.0 / 0.2)
        per_round_ms = [x * 10 * w for x, w in zip(ratios, (0.15, 0.25, 0.35))]
        assert all(m > 0 for m in per_round_ms) and r["ours_ms"] > 0
        assert r["ratio_raw"] == pytest.approx(r["ours_ms"] / 2.0)
        assert r["commands"] > 0 and r["kaldi_commands"] == 10
        # the form the other suites time, in the same rounds (against the same workloads)
        assert r["timed_form"] == "decoding" and r["timed_form_ms"] > 0
        assert r["timed_form_commands"] > 0
        other = r["timed_form_ratio_rounds"]
        assert len(other) == 3 and r["timed_form_ratio"] == sorted(other)[1]


def test_compile_suite_compares_kaldi_with_the_stored_form(tiny_models, monkeypatch):
    """Kaldi's figures are of the network as stored: that form's compile is the one
    compared with them (its commands are Kaldi's), whatever form the other suites time;
    with --network as-stored there is no second form to time."""
    monkeypatch.setattr(common, "python_s_on", lambda clock=None, runs=5: 0.1)
    from bench.suites import COMPILE_CASES  # noqa: PLC0415
    stored = common.load_for_inference(tiny_models / "models" / "tiny" / "model.raw",
                                       "as-stored")
    want = [common.compile_cold(stored, common.chunk_request(stored, c, b)).stats()["commands"]
            for c, b in COMPILE_CASES]
    for network in ("decoding", "as-stored"):
        out = tiny_models / f"c-{network}.json"
        assert bench_main.main(["compile", "--models", "tiny", "--compile-rounds", "1",
                                "--compile-repeat", "1", "--network", network,
                                "--json", str(out)]) == 0
        rows = json.loads(out.read_text())["suites"]["compile"]["rows"]
        assert [r["commands"] for r in rows] == want
        assert all(("timed_form" in r) == (network == "decoding") for r in rows)


def test_split_setting_rows(tiny_models):
    """'split2': the batch-8 case only, computed as two batch-4 computations at once (the
    outputs checked against the batch-8 computation inside measure_forward); memory
    rows keep the first plain setting."""
    out = tiny_models / "s.json"
    assert bench_main.main(["forward", "roofline", "memory", "--repeat", "1", "--models",
                            "tiny", "--blas-threads", "split2,1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    fwd = result["suites"]["forward"]["rows"]
    assert [(r["chunk"], r["batch"], r["threads"]) for r in fwd] == [
        (21, 1, "1"), (150, 1, "1"), (150, 8, "split2"), (150, 8, "1")]
    assert all(r["exec_ms"] > 0 for r in fwd)
    assert [r["threads"] for r in result["suites"]["roofline"]["rows"]] == \
        [r["threads"] for r in fwd]
    assert set(result["machine"]["gemm_s_same_threads"]) <= {"split2", "1"}
    assert [(r["chunk"], r["batch"]) for r in result["suites"]["memory"]["rows"]] == [
        (21, 1), (150, 1), (150, 8)]


def test_thread_policy_of_a_run(tiny_models):
    """--thread-policy adaptive: recorded with the machine facts, in force during the run,
    the process's policy put back afterwards; the default run records 'stable'."""
    from engine.runtime import parallel  # noqa: PLC0415
    out = tiny_models / "p.json"
    during = []
    real = parallel.thread_policy

    def spy():
        during.append(real())
        return during[-1]
    parallel.thread_policy = spy
    try:
        assert bench_main.main(["memory", "--models", "tiny", "--thread-policy", "adaptive",
                                "--json", str(out)]) == 0
    finally:
        parallel.thread_policy = real
    assert json.loads(out.read_text())["machine"]["thread_policy"] == "adaptive"
    assert "adaptive" in during and parallel.thread_policy() == "stable"
    assert bench_main.main(["memory", "--models", "tiny", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["machine"]["thread_policy"] == "stable"


def test_measure_forward_split_checks_its_batch(tiny_models):
    from bench.forward import measure_forward  # noqa: PLC0415
    path = tiny_models / "models" / "tiny" / "model.raw"
    f = measure_forward(path, 21, 4, repeat=1, split=2,
                        workloads={"gemm_s": 0.05, "python_s": 0.1})
    assert f["split"] == 2 and f["exec_ms"] > 0
    assert f["frames_per_s"] == pytest.approx(21 * 4 / (f["exec_ms"] / 1e3))
    with pytest.raises(ValueError, match="does not divide"):
        measure_forward(path, 21, 3, repeat=1, split=2,
                        workloads={"gemm_s": 0.05, "python_s": 0.1})


def test_bad_arguments_are_reported(tiny_models, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main.main(["forward", "--blas-threads", "1,zero"])
    assert e.value.code == 2
    assert "'zero' is neither a positive number, 'default' nor 'splitK'" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main.main(["forward", "--blas-threads", "split1"])
    with pytest.raises(SystemExit):
        bench_main.main(["nosuchsuite"])
    assert "unknown suite(s) nosuchsuite" in capsys.readouterr().err


def test_stream_suite_rows(tiny_models, monkeypatch):
    from bench import stream  # noqa: PLC0415
    monkeypatch.setattr(stream, "FRAMES", 230)
    out = tiny_models / "s.json"
    assert bench_main.main(["stream", "--repeat", "1", "--models", "tiny",
                            "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["suites"]["stream"]["rows"]
    assert [r["model"] for r in rows] == ["tiny"]
    r = rows[0]
    # no looped.json: 21 frames per chunk, no subsampling; the stream equals the
    # whole-utterance result within Kaldi's tolerance
    assert (r["frames_per_chunk"], r["fsf"], r["batch"]) == (21, 1, stream.BATCH)
    assert r["max_abs_diff"] <= r["tolerance"]
    assert r["frames_per_s"] == pytest.approx(230 / (r["stream_ms"] / 1e3))
    assert r["rtf"] == pytest.approx((r["stream_ms"] / 1e3) / 2.3)
    assert r["batch_speedup"] == pytest.approx(r["batch_frames_per_s"] / r["frames_per_s"])
    assert r["stream_over_offline"] == pytest.approx(r["stream_ms"] / r["offline_ms"])
    assert 0 < r["chunk_ms"] <= r["stream_ms"]


def test_synthetic_cnn_tdnn_model_and_its_convolution_flops():
    """bench/models/cnn_tdnn.cfg builds (parameters from seed 0, test mode), runs the
    chunk request, and its time-height convolutions count once per output height in
    the roofline's GEMM operations."""
    import numpy as np  # noqa: PLC0415
    from engine.compiler.computation import CommandType as CT  # noqa: PLC0415
    from engine.runtime.executor import Executor  # noqa: PLC0415
    models = dict(common.synthetic_models())
    assert "cnn-tdnn" in models
    nnet = common.load_for_inference(models["cnn-tdnn"])
    req = common.chunk_request(nnet, 4, 2)
    comp = common.compile_cold(nnet, req)
    expect = 0
    convs = 0
    for c in comp.commands:
        if c.command_type != CT.PROPAGATE:
            continue
        k = nnet.components[c.arg1]
        w = getattr(k, "linear_params", getattr(k, "params", None))
        if not isinstance(w, np.ndarray) or w.ndim != 2:
            continue
        heights = 1
        if type(k).__name__ == "TimeHeightConvolutionComponent":
            heights, convs = k.model.height_out, convs + 1
        expect += 2 * comp.submatrices[c.arg4].num_rows * w.size * heights
    assert convs == 6 and common.gemm_flops(comp, nnet) == expect
    rng = np.random.default_rng(0)
    ex = Executor(comp, nnet)
    for s in req.inputs:
        ex.accept_input(s.name, rng.standard_normal(
            (len(s.indexes), nnet.input_dim(s.name))).astype(np.float32))
    ex.run()
    out = ex.get_output("output")
    assert out.shape == (8, 2000) and np.all(np.isfinite(out))
