"""Short-lived threads computing on the GPU while others capture CUDA graphs.

Run as a program (by test_gpu_backend.py, in a subprocess, since the defect it guards
against is a segmentation fault):

    python tests/engine/gpu_thread_exit.py MODEL [--rounds R] [--threads T] [--no-hold]

Each round compiles the model's 21x1 chunk request afresh (a new program, so its
segments are captured again) and starts T threads that each run it four times and
end at once, without waiting for the others: threads end while others capture.  Every
output is compared with a NumPy run.  Exit status 0 when all rounds ran and matched;
a crash shows as a negative status (the signal).  ``--no-hold`` turns off
``cuda_graph.HOLD_THREAD_STATE``, which reproduces the crash (3 of 84 processes of one
round on an H200 before the hold existed).
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=6)
    ap.add_argument("--no-hold", action="store_true")
    args = ap.parse_args(argv)
    faulthandler.enable()

    from bench import common
    from engine.runtime import cuda_graph
    from engine.runtime.backend import get_backend, to_host
    from engine.runtime.executor import Executor
    cuda_graph.HOLD_THREAD_STATE = not args.no_hold
    cp = get_backend("cupy")
    nnet = common.load_for_inference(args.model)
    req = common.chunk_request(nnet, 21, 1)
    rng = np.random.default_rng(3)
    xs = [{s.name: rng.standard_normal((len(s.indexes), nnet.input_dim(s.name))).astype(
        np.float32) for s in req.inputs} for _ in range(args.threads)]

    def forward(comp, x, backend):
        ex = Executor(comp, nnet, backend=backend)
        for k, v in x.items():
            ex.accept_input(k, v)
        ex.run()
        out = to_host(ex.get_output("output"))
        graphs = ex._graphs
        ex.release()
        return out, graphs

    comp0 = common.compile_cold(nnet, req)
    want = [forward(comp0, x, np)[0] for x in xs]
    bad: list[str] = []
    graphed = 0
    for r in range(args.rounds):
        comp = common.compile_cold(nnet, req)
        got: list = [[] for _ in xs]

        def work(j, comp=comp, got=got):
            for _ in range(4):
                got[j].append(forward(comp, xs[j], cp))
        threads = [threading.Thread(target=work, args=(j,)) for j in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for j, outs in enumerate(got):
            if len(outs) != 4:
                bad.append(f"round {r} thread {j}: {len(outs)} of 4 runs")
            for k, (o, g) in enumerate(outs):
                graphed += g
                err = float(np.max(np.abs(o - want[j])))
                if not err <= 1e-3 * max(1.0, float(np.max(np.abs(want[j])))):
                    bad.append(f"round {r} thread {j} run {k}: max diff {err:.3g}")
    print(f"rounds {args.rounds}, threads {args.threads}, hold {not args.no_hold}, "
          f"graph runs {graphed}, held {cuda_graph.held_thread_count()}, "
          f"mismatches {len(bad)}", flush=True)
    for b in bad[:10]:
        print(b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
