"""One forward measurement: ``nnetc bench forward MODEL --chunk C --batch B
[--repeat 7] [--backend numpy|cupy] --json``.

Builds the chunk request of kaldi_stats.json for MODEL (decoding set-up: test
mode, collapsed), times the cold compile + optimize (shortcut compilation for
batch > 1) and the forward run (Executor: accept inputs, run, get output,
release), each the median of ``repeat`` runs after a warm-up, and measures the
reference workloads of ../shared/bench/refwork.py in the same process.

Figures: compile_ms, exec_ms, frames_per_s (output frames x batch per second),
peak_bytes (Kaldi's definition: most float32 bytes allocated by kAllocMatrix and
not yet freed, over the command list), measured_peak_bytes (what the executor
really held at once, inputs included), commands and matrices (no-ops not
counted, as Kaldi's figures), gemm_flops and gflops (achieved, GEMM work only),
gemm_s and python_s.

With ``split`` = K > 1 (``--split K``; the batch a multiple of K) the B sequences are
computed as K computations of B/K sequences at the same time, in K threads with one
BLAS thread each (engine.runtime.parallel, what ``Inferencer`` does with
``threads=K``): exec_ms is the time for all B sequences, inputs sliced and outputs
joined included, and the outputs are checked equal to the single computation's.
compile_ms, peak_bytes and commands are then those of the B/K computation.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from bench import common


def _sync(xp) -> None:
    if xp is not np:
        xp.cuda.Device().synchronize()


def measure_forward(model, chunk: int, batch: int, repeat: int = 7, backend: str = "numpy",
                    compile_repeat: int | None = None, shortcut: bool = True,
                    workloads: dict | None = None, split: int = 1,
                    network: str = "decoding") -> dict:
    """``model``: a path (loaded as ``network``: bench.common.load_for_inference) or an
    already prepared Nnet; ``network`` names its form either way (the decoding form is
    compiled as the inference front-end compiles it: compile_for_inference).
    ``workloads``: gemm_s/python_s already measured in this process (measured here when
    None).  ``split``: see the module docstring."""
    from engine.runtime.backend import get_backend  # noqa: PLC0415
    from engine.runtime.executor import Executor  # noqa: PLC0415
    if split < 1 or batch % split:
        raise ValueError(f"split {split} does not divide the batch {batch}")
    if split > 1 and backend != "numpy":
        raise ValueError("split runs are for the CPU (numpy backend)")
    xp = get_backend(backend)
    nnet = (common.load_for_inference(model, network) if not hasattr(model, "components")
            else model)
    full_request = common.chunk_request(nnet, chunk, batch)
    # the computation that runs: all B sequences, or B/K of them per thread
    request = common.chunk_request(nnet, chunk, batch // split)
    c_rep = repeat if compile_repeat is None else compile_repeat
    computation = None

    def compile_once():
        nonlocal computation
        computation = common.compile_cold(nnet, request, shortcut=shortcut, network=network)
    compile_s = common.median_time(compile_once, c_rep, warmup=0)
    stats = computation.stats()

    rng = np.random.default_rng(0)
    inputs = {s.name: xp.asarray(rng.standard_normal(
        (len(s.indexes), nnet.input_dim(s.name))).astype(np.float32)) for s in full_request.inputs}
    pool = common.CountingPool()
    programs: set = set()

    def run_one(parts: dict):
        ex = Executor(computation, nnet, backend=xp, pool=pool)
        for name, x in parts.items():
            ex.accept_input(name, x)
        ex.run()
        programs.add(ex._program)
        y = ex.get_output("output")
        ex.release()
        return y

    if split == 1:
        def forward():
            y = run_one(inputs)
            _sync(xp)
            return y
    else:
        from engine.runtime.parallel import run_concurrently  # noqa: PLC0415
        # the chunk request lists each IO n-major: sequence group k is a block of rows
        blocks = [{name: x[k * len(x) // split:(k + 1) * len(x) // split]
                   for name, x in inputs.items()} for k in range(split)]

        def forward():
            outs = run_concurrently([lambda b=b: run_one(b) for b in blocks], split)
            return np.concatenate(outs, axis=0)
        whole = Executor(common.compile_cold(nnet, full_request, shortcut=shortcut,
                                             network=network), nnet, backend=xp)
        for name, x in inputs.items():
            whole.accept_input(name, x)
        whole.run()
        expected = whole.get_output("output")
        got = forward()
        # against the output's scale: float32 sums in another order (BLAS kernels block a
        # 4-sequence product otherwise than an 8-sequence one) differ by rounding of the
        # largest terms, which on a network with large outputs (the synthetic CNN-TDNN's
        # reach 1e11) is far above any fixed absolute tolerance where terms cancel
        diff = float(np.max(np.abs(got - expected)))
        scale = float(np.max(np.abs(expected)))
        if not diff <= 1e-4 * scale + 1e-5:
            raise AssertionError("split forward differs from the single computation: max "
                                 f"abs diff {diff} against outputs up to {scale}")
    forward()                      # builds the executor's program and fills the pool
    pool.reset_peak()
    forward()                      # one run from zero bytes held: the real peak
    measured_peak = pool.peak
    # those first runs ask whether the BLAS's products depend on its thread count (once
    # per process, and again after forget_thread_choices, which the thread settings
    # call): multi-threaded BLAS products, after which OpenBLAS's idle threads spin for
    # about 0.1 s (see common.BLAS_SETTLE_S)
    time.sleep(common.BLAS_SETTLE_S)
    # warm-up: also long enough for the executor to settle whether the computation's
    # products run on one BLAS thread (engine.runtime.parallel.ThreadChoice: its first
    # choice, its check FIRST_RECHECK runs later), as the product forms are settled in
    # the first run
    from engine.runtime.parallel import ThreadChoice  # noqa: PLC0415
    runs = common.timings(forward, repeat,
                          warmup=ThreadChoice.FIRST_RECHECK + 4 * ThreadChoice.TRIALS)
    exec_s = statistics.median(runs)
    flops = common.gemm_flops(computation, nnet) * split
    # what each program's stretches settled on (engine.runtime.parallel.ThreadChoice)
    choices = {c.one for p in programs for c in p._thread_choices.values()}
    blas_choice = ("-" if not choices or choices == {None} else
                   "one" if choices == {True} else "lib" if choices == {False} else "mixed")
    if workloads is None:
        workloads = {"gemm_s": common.gemm_s(), "python_s": common.python_s()}
    return {
        "chunk": chunk, "batch": batch, "backend": backend, "shortcut": shortcut,
        "split": split,
        "compile_ms": compile_s * 1e3, "exec_ms": exec_s * 1e3, "exec_min_ms": min(runs) * 1e3,
        "frames_per_s": chunk * batch / exec_s,
        "peak_bytes": stats["peak_bytes"], "measured_peak_bytes": measured_peak,
        "commands": stats["commands"], "matrices": stats["matrices"],
        "gemm_flops": flops, "gflops": flops / exec_s / 1e9, "blas_choice": blas_choice,
        "gemm_s": workloads["gemm_s"], "python_s": workloads["python_s"],
    }


MODEL_FILES = ("model.raw", "final.mdl")


def resolve_model(path) -> Path:
    """MODEL as given to ``nnetc bench forward``: a model or config file, or a directory
    holding one (``model.raw``, as in ../shared/kaldi-ref/models/*, or ``final.mdl``).
    Raises ValueError naming the directory when it holds neither."""
    p = Path(path)
    if not p.is_dir():
        return p
    for name in MODEL_FILES:
        if (p / name).is_file():
            return p / name
    raise ValueError(f"model directory {str(p)!r} holds none of {', '.join(MODEL_FILES)}")


def kaldi_comparison(model_path, figures: dict) -> dict | None:
    """Kaldi's figures for the same chunk case, from a ``kaldi_stats.json`` beside the
    model file, and ours as ratios against them: compile normalised by ``python_s``,
    forward by ``gemm_s`` (ours / our workload over Kaldi's / Kaldi's workload, below 1
    better than Kaldi; the workloads of ../shared/bench/refwork.py), peak bytes and
    commands as plain ratios.  None when there is no such file or no such case."""
    stats_path = Path(model_path).parent / "kaldi_stats.json"
    if not stats_path.is_file():
        return None
    stats = json.loads(stats_path.read_text())
    case = next((c for c in stats.get("cases", ())
                 if c.get("chunk") == figures["chunk"] and c.get("batch") == figures["batch"]),
                None)
    work = stats.get("reference_workload") or {}
    if case is None:
        return None
    return {
        "case": case, "reference_workload": work,
        "compile_ratio": common.normalised_ratio(figures["compile_ms"], figures["python_s"],
                                                 case.get("compile_ms"), work.get("python_s")),
        "exec_ratio": common.normalised_ratio(figures["exec_ms"], figures["gemm_s"],
                                              case.get("exec_ms"), work.get("gemm_s")),
        "peak_bytes_ratio": (figures["peak_bytes"] / case["peak_bytes"]
                             if case.get("peak_bytes") else None),
        "commands_ratio": (figures["commands"] / case["commands"]
                           if case.get("commands") else None),
    }
