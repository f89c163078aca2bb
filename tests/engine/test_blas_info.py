"""engine.runtime.blas: what BLAS the CPU backend's products run on (reported by the
service's log and /metrics and by the benchmarks), and the environment overrides."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from engine.runtime.blas import blas_environment, blas_libraries, describe


def test_libraries_name_numpys_blas():
    libs = blas_libraries()
    assert libs, "threadpoolctl (a dependency) finds NumPy's BLAS"
    for lib in libs:
        assert set(lib) == {"library", "version", "architecture", "threads", "threading_layer"}
        assert lib["library"] and lib["threads"] >= 1


def test_scipys_own_blas_is_not_reported():
    """scipy.special (imported for expit by the first small sigmoid) loads SciPy's own
    OpenBLAS, which computes none of NumPy's products: the report stays the same."""
    code = ("from engine.runtime.blas import blas_libraries; a = blas_libraries(); "
            "from engine.nnet.components.nonlinear import expit; expit(); "
            "from threadpoolctl import threadpool_info; "
            "n = sum(lib.get('user_api') == 'blas' for lib in threadpool_info()); "
            "print(a == blas_libraries(), n, len(a))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == "True", out


def test_environment_keeps_only_the_blas_variables():
    env = {"OPENBLAS_CORETYPE": "Haswell", "MKL_NUM_THREADS": "2", "OMP_NUM_THREADS": "1",
           "PATH": "/bin", "NNETC_BACKEND": "numpy"}
    assert blas_environment(env) == {"MKL_NUM_THREADS": "2", "OMP_NUM_THREADS": "1",
                                     "OPENBLAS_CORETYPE": "Haswell"}


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return " avx2" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not any(lib["library"] == "openblas" for lib in blas_libraries())
                    or platform.machine().lower() not in ("x86_64", "amd64")
                    or not _has_avx2(),
                    reason="NumPy's BLAS is not OpenBLAS on an x86-64 processor with AVX2 "
                           "(the Haswell kernels this test forces)")
def test_an_openblas_coretype_override_is_seen_and_reported():
    """OPENBLAS_CORETYPE decides the kernel set when NumPy loads; the report names
    the set OpenBLAS runs and the variable (checked in a fresh process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENBLAS_")}
    env["OPENBLAS_CORETYPE"] = "Haswell"
    code = ("import os; from engine.runtime.blas import blas_libraries, describe; "
            "print(blas_libraries()[0]['architecture']); print(describe(os.environ))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[0] == "Haswell"
    assert "kernels Haswell" in out[1] and "OPENBLAS_CORETYPE=Haswell" in out[1]


def test_describe_is_one_line():
    text = describe({"OPENBLAS_NUM_THREADS": "1", "HOME": "/root"})
    assert text.startswith("BLAS: ") and "\n" not in text
    assert text.endswith("(environment: OPENBLAS_NUM_THREADS=1)")
    assert "environment" not in describe()
