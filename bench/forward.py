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
"""

from __future__ import annotations

import statistics

import numpy as np

from bench import common


def _sync(xp) -> None:
    if xp is not np:
        xp.cuda.Device().synchronize()


def measure_forward(model, chunk: int, batch: int, repeat: int = 7, backend: str = "numpy",
                    compile_repeat: int | None = None, shortcut: bool = True,
                    workloads: dict | None = None) -> dict:
    """``model``: a path or an already prepared Nnet.  ``workloads``: gemm_s/python_s
    already measured in this process (measured here when None)."""
    from engine.runtime.backend import get_backend  # noqa: PLC0415
    from engine.runtime.executor import Executor  # noqa: PLC0415
    xp = get_backend(backend)
    nnet = common.load_for_inference(model) if not hasattr(model, "components") else model
    request = common.chunk_request(nnet, chunk, batch)
    c_rep = repeat if compile_repeat is None else compile_repeat
    computation = None

    def compile_once():
        nonlocal computation
        computation = common.compile_cold(nnet, request, shortcut=shortcut)
    compile_s = common.median_time(compile_once, c_rep, warmup=0)
    stats = computation.stats()

    rng = np.random.default_rng(0)
    inputs = {s.name: xp.asarray(rng.standard_normal(
        (len(s.indexes), nnet.input_dim(s.name))).astype(np.float32)) for s in request.inputs}
    pool = common.CountingPool()

    def forward():
        ex = Executor(computation, nnet, backend=xp, pool=pool)
        for name, x in inputs.items():
            ex.accept_input(name, x)
        ex.run()
        ex.get_output("output")
        ex.release()
        _sync(xp)
    forward()                      # builds the executor's program and fills the pool
    pool.reset_peak()
    forward()                      # one run from zero bytes held: the real peak
    measured_peak = pool.peak
    runs = common.timings(forward, repeat, warmup=1)
    exec_s = statistics.median(runs)
    flops = common.gemm_flops(computation, nnet)
    if workloads is None:
        workloads = {"gemm_s": common.gemm_s(), "python_s": common.python_s()}
    return {
        "chunk": chunk, "batch": batch, "backend": backend, "shortcut": shortcut,
        "compile_ms": compile_s * 1e3, "exec_ms": exec_s * 1e3, "exec_min_ms": min(runs) * 1e3,
        "frames_per_s": chunk * batch / exec_s,
        "peak_bytes": stats["peak_bytes"], "measured_peak_bytes": measured_peak,
        "commands": stats["commands"], "matrices": stats["matrices"],
        "gemm_flops": flops, "gflops": flops / exec_s / 1e9,
        "gemm_s": workloads["gemm_s"], "python_s": workloads["python_s"],
    }
