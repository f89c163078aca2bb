"""nnetc engine: Kaldi nnet3 model language, compiler, optimizer and runtime.

Pure computation: imports the standard library and NumPy (CuPy lazily, when a
GPU backend is asked for). Never imports the web stack.
"""

__version__ = "0.1.0"
# Bumped whenever the compiled IR or its semantics change; part of every cache key.
IR_VERSION = 2
