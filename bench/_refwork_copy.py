"""A copy of ../shared/bench/refwork.py, used only when that folder is absent.

Reference workloads for normalising timings taken on different machines.

Figures such as Kaldi's compile and forward times in ../kaldi-ref/models/*/kaldi_stats.json
were measured beside these two workloads on the same machine ("reference_workload" there).
To compare a time of ours with theirs, run these workloads in the same process as our
measurement and compare the ratios:  (ours / our_workload) / (theirs / their_workload).
Use `gemm_s` for execution times (BLAS-bound) and `python_s` for compile times
(interpreter-bound). Both are medians of 5 runs.
"""
import statistics
import time

import numpy as np


def gemm_s() -> float:
    """Ten float32 1024x1024x1024 matrix products."""
    rng = np.random.default_rng(0)
    a = rng.random((1024, 1024), dtype=np.float32)
    b = rng.random((1024, 1024), dtype=np.float32)
    a @ b
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def python_s() -> float:
    """Build a dict of 300k tuple keys and sort its items: typical interpreter work."""
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        d = {}
        for i in range(300000):
            d[(i % 7, i, i % 13)] = i
        sorted(d.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


if __name__ == "__main__":
    print({"gemm_s": gemm_s(), "python_s": python_s()})
