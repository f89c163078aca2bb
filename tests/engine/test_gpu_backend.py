"""The CuPy backend on a GPU (skipped where CuPy or a GPU is missing, as in CI).

- every component reference case of Kaldi (tests/data subset; the full set where
  ../shared/kaldi-ref exists) computed on the GPU: output, input derivative, gradient;
- every reference network, unoptimized and optimized, run on the GPU against Kaldi's
  outputs, input derivatives and model gradients;
- random networks of every generator kind, optimized, forward and backward with model
  gradients: the GPU run equals the NumPy run, with the arena program and without it,
  and with real memory compression (CompressingExecutor, what Kaldi does on a GPU)
  within the quantisation error;
- the reference models' chunk requests (batch 1 and 3, shortcut compilation) and
  streaming with StreamBatch: GPU equals NumPy;
- the time-height convolution's all-at-once form (window, block and gather steps) and
  attention's strided context views: GPU equals NumPy (added without a GPU at hand: run
  through with NumPy standing in for CuPy only).

The whole engine suite also runs on the GPU with NNETC_TEST_BACKEND=cupy (conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.errors import ExecutionError, InferenceError
from engine.runtime.backend import get_backend, to_host

try:
    cp = get_backend("cupy")
except ExecutionError as e:          # no CuPy, or no usable GPU
    pytest.skip(str(e), allow_module_level=True)

from engine.compiler.request import ComputationRequest, IoSpecification  # noqa: E402
from engine.inference.looped import LoopedConfig, find_future_recurrence  # noqa: E402
from engine.inference.stream import LoopedModel, StreamBatch  # noqa: E402
from engine.nnet.random_config import (GENERATOR_NAMES, GenerationOptions,  # noqa: E402
                                       generate_config_sequence, random_inputs,
                                       random_output_derivs, random_request)
from engine.optimizer import OptimizeOptions  # noqa: E402
from engine.runtime.compression import CompressingExecutor  # noqa: E402
from engine.runtime.executor import Executor  # noqa: E402

import component_harness as H  # noqa: E402
import test_compile_reference as R  # noqa: E402
from network_harness import compile_request, run_network, updatable_params  # noqa: E402
from nnet_ref_cases import DATA, shared_models  # noqa: E402
from test_streaming import drive_batch  # noqa: E402

pytestmark = pytest.mark.gpu


def _close(what: str, ours, ref, rel: float = 1e-4) -> None:
    """GPU against NumPy: float32 rounding of differently ordered sums."""
    ours, ref = np.asarray(to_host(ours), np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs {ref.shape}"
    if ref.size == 0:
        return
    err = float(np.max(np.abs(ours - ref)))
    tol = 1e-5 + rel * float(np.max(np.abs(ref)))
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


# -- Kaldi's reference components and networks on the GPU -----------------------------------


@pytest.mark.parametrize("case", H.reference_cases(full=True),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_component_reference_on_gpu(case):
    H.check_reference_case(case, xp=cp)


_NETWORKS = R._cases(False) + R._cases(True)


@pytest.mark.parametrize("optimize", [False, True], ids=["raw", "optimized"])
@pytest.mark.parametrize("case", _NETWORKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_network_reference_on_gpu(case, optimize):
    R.check_case(case, backend=cp, optimize=optimize)


# -- random networks: GPU equals NumPy -------------------------------------------------------


def _random_case(kind: str, seed: int):
    rng = np.random.default_rng(seed)
    nnet = generate_config_sequence(rng, GenerationOptions(dim_scale=0.3), kind=kind).build(rng)
    req = random_request(nnet, rng)
    req = ComputationRequest(
        [IoSpecification(s.name, s.indexes, True) for s in req.inputs],
        [IoSpecification(s.name, s.indexes, True) for s in req.outputs],
        need_model_derivative=any(c.is_updatable for c in nnet.components))
    return nnet, req, random_inputs(nnet, req, rng), random_output_derivs(nnet, req, rng)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kind", GENERATOR_NAMES)
def test_random_network_gpu_equals_numpy(kind, seed, monkeypatch):
    nnet, req, x, dy = _random_case(kind, 900 + seed)
    comp = compile_request(nnet, req, optimize=True)
    ref = run_network(nnet, req, x, dy, computation=comp)
    for arena in (True, False):
        monkeypatch.setattr(Executor, "_use_arena", arena)
        got = run_network(nnet, req, x, dy, computation=comp, backend=cp)
        for what, a, b in zip(("output", "input deriv", "gradient"), got, ref):
            assert set(a) == set(b)
            for k in b:
                _close(f"{kind} seed {seed} arena={arena}: {what} {k}", a[k], b[k])


def _run_compressing(comp, nnet, req, x, dy, xp):
    ex = CompressingExecutor(comp, nnet, backend=xp)
    for s in req.inputs:
        ex.accept_input(s.name, x[s.name])
    ex.run()
    for s in req.outputs:
        ex.accept_output_deriv(s.name, dy[s.name])
    ex.run()
    out = {s.name: to_host(ex.get_input_deriv(s.name)) for s in req.inputs}
    grad = ex.get_model_gradient()
    if grad is not None:
        out.update({k: np.asarray(v) for k, v in updatable_params(grad).items()})
    ex.release()
    return out


@pytest.mark.parametrize("kind", GENERATOR_NAMES)
def test_memory_compression_on_gpu_equals_numpy(kind):
    """Real compression (CompressingExecutor) of saved activations: the same integer
    codes on both backends, so the derivatives agree to float32 rounding."""
    nnet, req, x, dy = _random_case(kind, 950)
    comp = compile_request(nnet, req, optimize=OptimizeOptions(memory_compression_level=2))
    ref = _run_compressing(comp, nnet, req, x, dy, np)
    got = _run_compressing(comp, nnet, req, x, dy, cp)
    assert set(got) == set(ref)
    for k in ref:
        _close(f"{kind}: compressed-run {k}", got[k], ref[k], rel=1e-3)


# -- reference models: chunk requests and streaming ------------------------------------------


def _model_paths():
    """The local BLSTM (tests/data/inference) and the reference models of ../shared."""
    local = sorted((DATA / "inference").glob("*/model.raw"))
    names = {p.parent.name for p in local}
    return local + [p for p in shared_models() if p.parent.name not in names]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("path", _model_paths(), ids=lambda p: p.parent.name)
def test_model_chunk_forward_gpu_equals_numpy(path, batch):
    from bench import common  # noqa: PLC0415
    nnet = common.load_for_inference(path)
    req = common.chunk_request(nnet, 21, batch)
    comp = common.compile_cold(nnet, req, shortcut=True)
    rng = np.random.default_rng(3)
    x = {s.name: rng.standard_normal((len(s.indexes), nnet.input_dim(s.name))).astype(np.float32)
         for s in req.inputs}
    ref = run_network(nnet, req, x, None, computation=comp)
    got = run_network(nnet, req, x, None, computation=comp, backend=cp)
    _close(f"{path.parent.name} 21x{batch}", got.outputs["output"], ref.outputs["output"],
           rel=1e-3)


@pytest.mark.parametrize("path", _model_paths(), ids=lambda p: p.parent.name)
def test_stream_batch_gpu_equals_numpy(path):
    from engine.nnet.model_io import load_model  # noqa: PLC0415
    model = load_model(path)
    nnet = model.nnet
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((n, nnet.input_dim("input"))).astype(np.float32)
          for n in (37, 55)]
    ivs = None
    if nnet.get_node_index("ivector") >= 0:
        ivs = [rng.standard_normal(nnet.input_dim("ivector")).astype(np.float32)
               for _ in xs]
    if find_future_recurrence(nnet, "output") is not None:
        # a backward recurrence (BLSTM) cannot be streamed: refused on the GPU as well
        with pytest.raises(InferenceError, match="looped compilation is not possible"):
            LoopedModel(nnet, LoopedConfig(frames_per_chunk=10), backend=cp, num_sequences=2)
        return
    outs = {}
    for name, xp in (("numpy", np), ("cupy", cp)):
        lm = LoopedModel(nnet, LoopedConfig(frames_per_chunk=10), backend=xp,
                         num_sequences=2)
        outs[name] = drive_batch(StreamBatch(lm, ivs), xs, 13)
    for j in range(len(xs)):
        _close(f"{path.parent.name} stream {j}", outs["cupy"][j], outs["numpy"][j], rel=1e-3)


# -- CUDA graphs (engine/runtime/cuda_graph.py) -------------------------------------------------


def _forward(comp, nnet, x, *, pool=None):
    """One forward run on the GPU; the output and the bound program it ran on."""
    ex = Executor(comp, nnet, backend=cp, pool=pool)
    for k, v in x.items():
        ex.accept_input(k, v)
    ex.run()
    bound = ex._bound
    out = to_host(ex.get_output("output"))
    ex.release()
    return out, bound, ex._graphs


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("path", _model_paths(), ids=lambda p: p.parent.name)
def test_cuda_graph_replays_equal_eager_runs(path, batch, monkeypatch):
    """Decoding networks (frozen) run their forward as a graph from the second run on;
    every replay, with new inputs each time, equals the eager GPU run and NumPy."""
    from bench import common  # noqa: PLC0415
    from engine.runtime import cuda_graph  # noqa: PLC0415
    nnet = common.load_for_inference(path)
    req = common.chunk_request(nnet, 21, batch)
    comp = common.compile_cold(nnet, req, shortcut=True)
    rng = np.random.default_rng(11)
    runs = [{s.name: rng.standard_normal((len(s.indexes), nnet.input_dim(s.name))).astype(
        np.float32) for s in req.inputs} for _ in range(4)]
    monkeypatch.setattr(cuda_graph, "ENABLED", False)
    eager = [_forward(comp, nnet, x)[0] for x in runs]
    monkeypatch.setattr(cuda_graph, "ENABLED", True)
    graphed, bounds = [], set()
    for x in runs:
        out, bound, used = _forward(comp, nnet, x)
        assert used, "the executor did not use CUDA graphs"
        graphed.append(out)
        bounds.add(id(bound))
    assert len(bounds) == 1                       # the arena came back each time
    from engine.runtime.cuda_graph import CaptureFailed, graph_count  # noqa: PLC0415
    failed = [s.reason for s in bound.graph_segments.values() if isinstance(s, CaptureFailed)]
    assert graph_count(bound) and not failed, f"capture failed: {failed}"
    for k, (g, e, x) in enumerate(zip(graphed, eager, runs)):
        np.testing.assert_array_equal(g, e, err_msg=f"run {k}")
        ref = run_network(nnet, req, x, None, computation=comp).outputs["output"]
        # (x-vector statistics pooling sums many frames: float32 order effects of ~2e-3)
        _close(f"{path.parent.name} run {k} vs NumPy", g, ref, rel=5e-3)


def test_cuda_graph_follows_new_weights():
    """New (frozen) weights assigned to a decoding network: the next run uses them
    (a new shared device copy, so the graph is captured again)."""
    from bench import common  # noqa: PLC0415
    path = _model_paths()[0]
    nnet = common.load_for_inference(path)
    req = common.chunk_request(nnet, 21, 1)
    comp = common.compile_cold(nnet, req, shortcut=True)
    rng = np.random.default_rng(12)
    x = {s.name: rng.standard_normal((len(s.indexes), nnet.input_dim(s.name))).astype(np.float32)
         for s in req.inputs}
    for _ in range(3):
        before, _, used = _forward(comp, nnet, x)
    assert used
    comp_i = next(i for i, c in enumerate(nnet.components) if c.PARAMS)
    c = nnet.components[comp_i]
    p = c.PARAMS[0]
    new = getattr(c, p) * 0.5
    new.flags.writeable = False
    setattr(c, p, new)
    after = [_forward(comp, nnet, x)[0] for _ in range(3)]
    ref = run_network(nnet, req, x, None, computation=comp).outputs["output"]
    assert not np.allclose(after[0], before)
    for k, a in enumerate(after):
        _close(f"run {k} after new weights", a, ref, rel=1e-3)


def test_cuda_graphs_not_used_for_training_networks():
    """Writeable weights or derivatives: eager runs (a replay could not follow
    in-place weight changes, nor keep memos for backprop)."""
    from bench import common  # noqa: PLC0415
    from engine.nnet.model_io import load_model  # noqa: PLC0415
    path = _model_paths()[0]
    nnet = load_model(path).nnet            # writeable weights
    nnet.set_test_mode(True)
    req = common.chunk_request(nnet, 21, 1)
    comp = compile_request(nnet, req, optimize=True)
    x = {s.name: np.ones((len(s.indexes), nnet.input_dim(s.name)), np.float32)
         for s in req.inputs}
    for _ in range(3):
        _, _, used = _forward(comp, nnet, x)
        assert not used
    nnet2, req2, x2, dy2 = _random_case(GENERATOR_NAMES[0], 960)
    nnet2.freeze_parameters()
    comp2 = compile_request(nnet2, req2, optimize=True)
    ex = Executor(comp2, nnet2, backend=cp)
    for s in req2.inputs:
        ex.accept_input(s.name, x2[s.name])
    ex.run()
    assert not ex._graphs                    # has backprop commands


def test_cuda_graphs_from_threads_equal_sequential_runs():
    """Executors of one computation in several threads (the service's workers), which
    stay alive until all have run (threads that end at once: the test below)."""
    import threading  # noqa: PLC0415

    from bench import common  # noqa: PLC0415
    path = _model_paths()[0]
    nnet = common.load_for_inference(path)
    req = common.chunk_request(nnet, 21, 1)
    comp = common.compile_cold(nnet, req, shortcut=True)
    rng = np.random.default_rng(14)
    xs = [{s.name: rng.standard_normal((len(s.indexes), nnet.input_dim(s.name))).astype(
        np.float32) for s in req.inputs} for _ in range(6)]
    want = [run_network(nnet, req, x, None, computation=comp).outputs["output"] for x in xs]
    got: list = [[] for _ in xs]

    done = threading.Barrier(len(xs))

    def work(j):
        try:
            for _ in range(4):
                got[j].append(_forward(comp, nnet, xs[j])[0])
        finally:
            done.wait()
    threads = [threading.Thread(target=work, args=(j,)) for j in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for j, outs in enumerate(got):
        assert len(outs) == 4
        for k, o in enumerate(outs):
            _close(f"thread {j} run {k}", o, want[j], rel=1e-3)


def test_threads_ending_while_others_capture_do_not_crash():
    """Short-lived threads that end while others capture CUDA graphs
    (gpu_thread_exit.py, four processes of eight rounds of six threads): a thread's end
    destroyed its cuBLAS handle during another's capture and crashed the process (3 of 84
    one-round processes on an H200) until cuda_graph held the CuPy state of ended threads
    until no capture is under way."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415
    script = Path(__file__).with_name("gpu_thread_exit.py")
    path = _model_paths()[0]
    procs = [subprocess.Popen([sys.executable, str(script), str(path), "--rounds", "8"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(4)]
    for p in procs:
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, f"status {p.returncode}:\n{out[-4000:]}"
        assert "mismatches 0" in out, out[-4000:]


# -- the convolution's all-at-once form and attention's strided views on the GPU ------------


def test_convolution_im2col_on_gpu_equals_numpy():
    """convolve_forward / backward data / backward params of random time-height
    convolutions (window, block and gather steps, small chunks too) on CuPy equal NumPy's."""
    from engine.core.errors import ConfigError  # noqa: PLC0415
    from engine.nnet.components import _convolution as conv  # noqa: PLC0415
    from test_components_nonsimple import Setup  # noqa: PLC0415
    from test_convolution_im2col import _random_case  # noqa: PLC0415
    from engine.core.index import Index  # noqa: PLC0415
    kinds, ran = set(), 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        cfg, toffs = _random_case(rng)
        try:
            comp = H.component_from_config("TimeHeightConvolutionComponent", cfg, seed=seed)
        except ConfigError:
            continue
        span = max(toffs) - min(toffs)
        outs = [Index(n, t, 0) for n in range(2) for t in range(0, 10 - span if span < 6 else 4)]
        avail = [Index(n, t, 0) for n in range(2)
                 for t in range(min(toffs) - 1, 13 + max(toffs))]
        s = Setup(comp, outs, avail)
        plan = conv._step_plan(s.pi, comp.linear_params.shape[1])
        kinds.update(step[3] for step in plan[2])
        pi_gpu = s.pi.to_backend(cp)
        x = rng.standard_normal((len(s.ins), comp.input_dim())).astype(np.float32)
        w = comp.linear_params.astype(np.float32)
        b = comp.bias_params.astype(np.float32)
        dy = rng.standard_normal((len(s.outs), comp.output_dim())).astype(np.float32)
        out = np.empty((len(s.outs), comp.output_dim()), np.float32)
        conv.convolve_forward(s.pi, x, w, out, bias=b)
        out_g = cp.empty(out.shape, cp.float32)
        conv.convolve_forward(pi_gpu, cp.asarray(x), cp.asarray(w), out_g, bias=cp.asarray(b))
        _close(f"{cfg}: forward", out_g, out)
        dx = np.zeros_like(x)
        conv.convolve_backward_data(s.pi, w, dy, dx)
        dx_g = cp.zeros(x.shape, cp.float32)
        conv.convolve_backward_data(pi_gpu, cp.asarray(w), cp.asarray(dy), dx_g)
        _close(f"{cfg}: input derivative", dx_g, dx)
        gw = np.zeros_like(w)
        conv.convolve_backward_params(s.pi, x, dy, 0.5, gw)
        gw_g = cp.zeros(w.shape, cp.float32)
        conv.convolve_backward_params(pi_gpu, cp.asarray(x), cp.asarray(dy), 0.5, gw_g)
        _close(f"{cfg}: parameter gradient", gw_g, gw)
        ran += 1
    assert ran >= 25 and kinds == {"block", "window", "gather"}, (ran, kinds)


def test_attention_on_gpu_equals_numpy():
    from engine.core.index import Index  # noqa: PLC0415
    from test_components_nonsimple import ATTENTION_CONFIGS, Setup  # noqa: PLC0415
    for cfg in ATTENTION_CONFIGS:
        comp = H.component_from_config("RestrictedAttentionComponent", cfg)
        st = comp.time_stride
        avail = [Index(n, t, 0) for n in range(3) for t in range(-4 * st, 10 * st, st)]
        outs = [Index(n, t, 0) for n in range(3) for t in range(0, 6 * st, st)]
        s = Setup(comp, outs, avail)
        rng = np.random.default_rng(4)
        x = rng.standard_normal((len(s.ins), comp.input_dim())).astype(np.float32)
        x[~s.in_mask] = 0
        dy = rng.standard_normal((len(s.outs), comp.output_dim())).astype(np.float32)
        y = np.zeros((len(s.outs), comp.output_dim()), np.float32)
        memo = comp.propagate(s.pi, x, y)
        dx = np.zeros_like(x)
        comp.backprop("t", s.pi, x, y, dy, memo, None, dx)
        gcomp = comp.to_backend(cp) if hasattr(comp, "to_backend") else comp
        pi_gpu = s.pi.to_backend(cp)
        y_g = cp.zeros(y.shape, cp.float32)
        memo_g = gcomp.propagate(pi_gpu, cp.asarray(x), y_g)
        dx_g = cp.zeros(x.shape, cp.float32)
        gcomp.backprop("t", pi_gpu, cp.asarray(x), y_g, cp.asarray(dy), memo_g, None, dx_g)
        _close(f"{cfg}: output", y_g, y)
        _close(f"{cfg}: input derivative", dx_g, dx)


def test_row_range_sums_on_gpu_add_each_range_in_order():
    """AddRowRanges (statistics extraction and pooling) on the GPU: each range's rows
    added in order in float32 (Kaldi's AddRowRanges) -- the bits of a sequential loop --
    with one-row, empty and overlapping ranges, a column view as source, and large rows
    before small ones.  CuPy's add.reduceat left one-row windows of small values a
    rounding residue: an x-vector's stddev of a one-frame window was then noise instead
    of sqrt(variance floor), 1e-3 off NumPy's output (seen on an H200).  NumPy's
    reduceat is within float32 rounding of it, and gives a one-row range's row exactly."""
    from engine.nnet.components._nonsimple_utils import add_row_ranges  # noqa: PLC0415
    rng = np.random.default_rng(12)
    full = rng.standard_normal((200, 41)).astype(np.float32)
    full[:100] *= 1e4
    src = full[:, 1:]                                   # a column view
    begins = np.array([0, 150, 199, 10, 10, 120, 60, 3], np.int64)
    ends = np.array([200, 151, 200, 10, 90, 199, 61, 2], np.int64)   # 10:10, 3:2 empty
    in_order = np.zeros((8, 40), np.float32)
    for i, (b, e) in enumerate(zip(begins, ends)):
        for k in range(b, e):
            in_order[i] += src[k]
    got = cp.zeros((8, 40), dtype=cp.float32)
    add_row_ranges(cp.asarray(full)[:, 1:], cp.asarray(begins), cp.asarray(ends), got)
    assert np.array_equal(to_host(got), in_order)
    on_host = np.zeros((8, 40), np.float32)
    add_row_ranges(src, begins, ends, on_host)
    for i in range(8):
        scale = np.abs(src[begins[i]:ends[i]]).sum(axis=0) if ends[i] > begins[i] else 0
        assert np.all(np.abs(on_host[i] - in_order[i]) <= 1e-6 * scale + 1e-6), i
    for i in (1, 2, 6):                                  # one-row ranges: the row itself
        assert np.array_equal(to_host(got)[i], src[begins[i]])
    half = cp.zeros((8, 40), dtype=cp.float32)
    add_row_ranges(cp.asarray(src), cp.asarray(begins), cp.asarray(ends), half, alpha=0.5)
    assert np.array_equal(to_host(half), np.float32(0.5) * in_order)
