"""Runtime: executing an NnetComputation on NumPy or CuPy (Kaldi's NnetComputer)."""

from engine.runtime.backend import BufferPool, get_backend, to_host
from engine.runtime.executor import Executor, run_computation

__all__ = ["BufferPool", "Executor", "get_backend", "run_computation", "to_host"]
