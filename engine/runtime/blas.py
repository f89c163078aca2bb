"""What BLAS the CPU backend's products run on, for logs, metrics and benchmarks.

NumPy's matrix products are the bulk of a forward pass, and their speed depends on
the BLAS library NumPy loaded, the kernel set it chose for the processor and its
thread count -- and on environment variables that override those choices.  On an
AVX-512 machine, ``OPENBLAS_CORETYPE=Haswell`` (set on some hosts for older OpenBLAS
builds) halves the GEMM rate of NumPy 2.4's OpenBLAS 0.3.31 (bench/RESULTS.md, item
19).  The engine never changes these settings; it reports them.  (The engine reads
no environment: callers pass the variables in.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

#: environment variables that steer the BLAS libraries NumPy may load
ENV_PREFIXES = ("OPENBLAS_", "MKL_", "OMP_", "GOTO_")


def scipys_own_library(path) -> bool:
    """A library SciPy's wheels ship for SciPy (``scipy.libs/``): loaded by
    scipy.special, which the engine imports for ``expit``, and computing none of the
    engine's products (NumPy's BLAS does)."""
    return bool(path) and "scipy.libs" in Path(path).parts


def blas_libraries() -> list[dict]:
    """One dict per BLAS library loaded in this process (threadpoolctl) that NumPy's
    products may run on -- SciPy's own copy left out (``scipys_own_library``): library
    (internal_api), version, kernel set (architecture, OpenBLAS only), threads and
    threading layer.  [] when threadpoolctl cannot tell."""
    import numpy  # noqa: F401, PLC0415  (loads NumPy's BLAS)
    try:
        from threadpoolctl import threadpool_info  # noqa: PLC0415
    except ImportError:
        return []
    return [{"library": lib.get("internal_api"), "version": lib.get("version"),
             "architecture": lib.get("architecture"), "threads": lib.get("num_threads"),
             "threading_layer": lib.get("threading_layer")}
            for lib in threadpool_info()
            if lib.get("user_api") == "blas" and not scipys_own_library(lib.get("filepath"))]


def blas_environment(environ: Mapping[str, str]) -> dict:
    """The OPENBLAS_*/MKL_*/OMP_*/GOTO_* variables of ``environ``."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES)}


def describe(environ: Mapping[str, str] | None = None) -> str:
    """One line for a log: the libraries and the variables of ``environ`` that
    steer them."""
    libs = blas_libraries()
    parts = [f"{d['library']} {d['version']}"
             + (f" kernels {d['architecture']}" if d.get("architecture") else "")
             + f", {d['threads']} threads" for d in libs] or ["unknown (threadpoolctl found none)"]
    env = blas_environment(environ or {})
    text = "BLAS: " + "; ".join(parts)
    if env:
        text += " (environment: " + ", ".join(f"{k}={v}" for k, v in env.items()) + ")"
    return text
