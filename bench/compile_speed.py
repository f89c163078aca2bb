"""Cold compile + optimize speed against Kaldi's figures (issue 5).

For each reference model in ../shared/kaldi-ref/models (tests/data/models when that
folder is absent) and each chunk request (chunk 21/150 x batch 1/8: input t in
[-left_context, chunk + right_context), output t in [0, chunk), n in [0, batch),
i-vector at t=0 per n -- the requests behind kaldi_stats.json), prints our cold
compile+optimize time, Kaldi's, the interpreter reference workload
(shared/bench/refwork.py python_s) for both machines, and the normalised ratio

    (ours / our_python_s) / (kaldi / kaldi_python_s)

(below 1.0: faster than Kaldi once machine speed is factored out).  Ours and
our python_s are CPU times of this thread unless --wall is given (the
machine is shared; Kaldi's figures are wall times on an idle machine).  "Cold" means a
fresh Compiler and optimizer run per request, nothing cached; each case is timed
``--repeat`` times and the median kept.  With ``--split`` it also prints the time
spent in the graph builder, steps, the rest of the compiler and the optimizer.
The xvector request (request.json, stats pooling over 10000 frames) and a batch of 16
utterances of different lengths are timed once with ``--xvector``.

    python3 bench/compile_speed.py [--repeat 3] [--split] [--xvector] [--models tdnn,tdnnf]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))

from bench.common import python_s_on  # noqa: E402
from engine.compiler.compiler import compile_computation  # noqa: E402
from engine.compiler.request import ComputationRequest, IoSpecification  # noqa: E402
from engine.core.index import Index  # noqa: E402
from engine.nnet.model_io import load_model  # noqa: E402
from engine.optimizer import OptimizeOptions, optimize  # noqa: E402

CASES = [(21, 1), (21, 8), (150, 1), (150, 8)]
# CPU time of this thread by default: the machine this runs on is shared, and
# wall time swings with the other load (use --wall for perf_counter); other threads
# of this process (OpenBLAS's spinning workers) are left out.
CLOCK = time.thread_time


def model_dirs() -> list[Path]:
    base = SHARED / "kaldi-ref" / "models"
    if not base.is_dir():
        base = ROOT / "tests" / "data" / "models"
    return sorted(p for p in base.iterdir() if p.is_dir())


def context(model_dir: Path, nnet) -> tuple[int, int]:
    info = model_dir / "infer.json"
    if info.exists():
        d = json.loads(info.read_text())["info"]
        return d["left-context"], d["right-context"]
    from engine.inference.common import simple_context  # noqa: PLC0415
    return simple_context(nnet)


def chunk_request(nnet, left: int, right: int, chunk: int, batch: int) -> ComputationRequest:
    inputs = [IoSpecification("input", [Index(n, t, 0) for n in range(batch)
                                        for t in range(-left, chunk + right)])]
    if nnet.get_node_index("ivector") >= 0:
        inputs.append(IoSpecification("ivector", [Index(n, 0, 0) for n in range(batch)]))
    outputs = [IoSpecification("output", [Index(n, t, 0) for n in range(batch)
                                          for t in range(chunk)])]
    return ComputationRequest(inputs, outputs)


def timed_compile(nnet, request, split: bool) -> tuple[float, dict, object]:
    """(total seconds, split seconds, optimized computation) for one cold compile."""
    parts: dict[str, float] = {}
    t0 = CLOCK()
    if split:
        with _timing(parts):
            computation = compile_computation(nnet, [request])
    else:
        computation = compile_computation(nnet, [request])
    t1 = CLOCK()
    # in place, as the service's compile path does: the computation was made just now
    optimized = optimize(computation, nnet, OptimizeOptions(), request=request, in_place=True)
    t2 = CLOCK()
    if split:
        parts["compiler_rest"] = (t1 - t0) - sum(parts.values())
    parts["compiler"] = t1 - t0
    parts["optimizer"] = t2 - t1
    return t2 - t0, parts, optimized


class _timing:
    """Wraps the front-half entry points (looked up by the Compiler at call time)
    to add the seconds spent in each to ``parts``."""

    TARGETS = [("engine.compiler.graph", "build_computation_graph", "graph"),
               ("engine.compiler.steps", "compute_computation_phases", "phases"),
               ("engine.compiler.steps", "compute_computation_steps", "steps")]

    def __init__(self, parts: dict) -> None:
        self.parts = parts
        self.saved: list = []

    def __enter__(self):
        import importlib  # noqa: PLC0415
        for mod_name, fn_name, label in self.TARGETS:
            mod = importlib.import_module(mod_name)
            fn = getattr(mod, fn_name)
            self.saved.append((mod, fn_name, fn))
            setattr(mod, fn_name, self._wrap(fn, label))
        return self

    def _wrap(self, fn, label):
        parts = self.parts

        def wrapped(*a, **k):
            t = CLOCK()
            try:
                return fn(*a, **k)
            finally:
                parts[label] = parts.get(label, 0.0) + CLOCK() - t
        return wrapped

    def __exit__(self, *exc) -> None:
        for mod, fn_name, fn in self.saved:
            setattr(mod, fn_name, fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--xvector", action="store_true")
    ap.add_argument("--models", default="")
    ap.add_argument("--wall", action="store_true", help="time with perf_counter, not CPU time")
    args = ap.parse_args()
    global CLOCK
    if args.wall:
        CLOCK = time.perf_counter
    ours_py = python_s_on(CLOCK)
    print(f"our python_s = {ours_py:.4f} ({'wall' if args.wall else 'CPU'} time)")
    wanted = set(filter(None, args.models.split(",")))
    header = (f"{'model':10} {'chunk':>5} {'batch':>5} {'ours_ms':>9} {'kaldi_ms':>9} "
              f"{'our_py_s':>8} {'k_py_s':>7} {'ratio':>7} {'cmds':>6} {'k_cmds':>6}")
    print(header)
    for d in model_dirs():
        if wanted and d.name not in wanted:
            continue
        if not (d / "model.raw").exists():
            continue
        nnet = load_model(str(d / "model.raw")).nnet
        stats_path = d / "kaldi_stats.json"
        if not stats_path.exists():
            continue
        stats = json.loads(stats_path.read_text())
        kaldi = {(c["chunk"], c["batch"]): c for c in stats["cases"]}
        their_py = stats["reference_workload"]["python_s"]
        left, right = context(d, nnet)
        for chunk, batch in CASES:
            req = chunk_request(nnet, left, right, chunk, batch)
            runs, last_parts, comp = [], {}, None
            for _ in range(args.repeat):
                secs, last_parts, comp = timed_compile(nnet, req, args.split)
                runs.append(secs)
            ours_ms = statistics.median(runs) * 1000.0
            k = kaldi.get((chunk, batch))
            k_ms = k["compile_ms"] if k else float("nan")
            ratio = (ours_ms / ours_py) / (k_ms / their_py) if k else float("nan")
            k_cmds = k["commands"] if k else "-"
            print(f"{d.name:10} {chunk:5d} {batch:5d} {ours_ms:9.1f} {k_ms:9.3f} "
                  f"{ours_py:8.4f} {their_py:7.3f} {ratio:7.1f} {comp.stats()['commands']:6d} "
                  f"{k_cmds!s:>6}", flush=True)
            if args.split:
                print("    split: " + ", ".join(f"{k}={v * 1000:.1f}ms"
                                                for k, v in last_parts.items()))
    if args.xvector:
        d = SHARED / "kaldi-ref" / "models" / "xvector"
        if (d / "request.json").exists():
            nnet = load_model(str(d / "model.raw")).nnet
            req = ComputationRequest.from_json((d / "request.json").read_bytes())
            secs, parts, comp = timed_compile(nnet, req, args.split)
            print(f"xvector request: {secs * 1000:.0f} ms cold compile+optimize, "
                  f"{comp.stats()['commands']} commands; "
                  + ", ".join(f"{k}={v * 1000:.0f}ms" for k, v in parts.items()))
            # a batch of 16 utterances of different lengths (100-400 frames, context 7 on
            # each side), the embedding at t=0 of each: one sequence shape per utterance
            lens = [100 + (37 * k) % 301 for k in range(16)]
            batch = ComputationRequest(
                [IoSpecification("input", [Index(n, t, 0) for n, m in enumerate(lens)
                                           for t in range(-7, m + 7)])],
                [IoSpecification("output", [Index(n, 0, 0) for n in range(len(lens))])])
            secs, parts, comp = timed_compile(nnet, batch, args.split)
            print(f"xvector batch of 16 utterances of 100-400 frames: {secs * 1000:.0f} ms "
                  f"cold compile+optimize, {comp.stats()['commands']} commands; "
                  + ", ".join(f"{k}={v * 1000:.0f}ms" for k, v in parts.items()))


if __name__ == "__main__":
    main()
