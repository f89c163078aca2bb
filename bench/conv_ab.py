"""The time-height convolution's all-steps-at-once form against Kaldi's step-by-step
form, in one process on the same computation (the step form is what
``engine.nnet.components._convolution`` falls back to when ``_step_plan`` gives
None).  Runs alternate between the two forms so that a busy machine slows both
alike; prints the median of each and their ratio, for the forward and for forward
+ backward (input derivative and parameter gradient).

    python3 bench/conv_ab.py [--model bench/models/cnn_tdnn.cfg] [--chunk 150]
                             [--batch 1] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from engine.compiler.request import ComputationRequest, IoSpecification  # noqa: E402
from engine.nnet.components import _convolution as conv  # noqa: E402
from engine.runtime.executor import Executor  # noqa: E402


def _runner(nnet, comp, inputs, dy):
    def run():
        ex = Executor(comp, nnet)
        for name, x in inputs.items():
            ex.accept_input(name, x)
        ex.run()
        out = ex.get_output("output")
        if dy is not None:
            ex.accept_output_deriv("output", dy)
            ex.run()
            ex.get_model_gradient()
        ex.release()
        return out
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "bench" / "models" / "cnn_tdnn.cfg"))
    ap.add_argument("--chunk", type=int, default=150)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    nnet = common.load_for_inference(args.model)
    fwd_req = common.chunk_request(nnet, args.chunk, args.batch)
    bwd_req = ComputationRequest(
        [IoSpecification(s.name, s.indexes, True) for s in fwd_req.inputs],
        [IoSpecification(s.name, s.indexes, True) for s in fwd_req.outputs],
        need_model_derivative=True)
    rng = np.random.default_rng(0)
    inputs = {s.name: rng.standard_normal((len(s.indexes), nnet.input_dim(s.name))
                                          ).astype(np.float32) for s in fwd_req.inputs}
    dy = rng.standard_normal((len(fwd_req.outputs[0].indexes), nnet.output_dim("output"))
                             ).astype(np.float32)
    cases = {"forward": _runner(nnet, common.compile_cold(nnet, fwd_req), inputs, None),
             "forward+backward": _runner(nnet, common.compile_cold(nnet, bwd_req), inputs, dy)}
    plan = conv._step_plan
    print(f"{Path(args.model).name} chunk {args.chunk} batch {args.batch}, "
          f"median of {args.repeat} alternating runs")
    for label, run in cases.items():
        times: dict[str, list[float]] = {"steps": [], "all-at-once": []}
        outs = {}
        for form in times:                      # warm-up, and the outputs compared
            conv._step_plan = (lambda ci, k: None) if form == "steps" else plan
            outs[form] = run()
        for _ in range(args.repeat):
            for form in times:
                conv._step_plan = (lambda ci, k: None) if form == "steps" else plan
                t = time.perf_counter()
                run()
                times[form].append(time.perf_counter() - t)
        conv._step_plan = plan
        a, b = outs["steps"], outs["all-at-once"]
        diff = float(np.abs(a - b).max() / max(1e-30, float(np.abs(a).max())))
        old, new = (statistics.median(times[f]) * 1e3 for f in ("steps", "all-at-once"))
        print(f"  {label:17} steps {old:9.2f} ms  all-at-once {new:9.2f} ms  "
              f"ratio {new / old:.3f}  (outputs agree to {diff:.1e} relative)")


if __name__ == "__main__":
    main()
