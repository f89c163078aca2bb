"""Compressed matrices: Kaldi's ``CuCompressedMatrix`` (cudamatrix/cu-compressed-matrix.h/.cc,
the ``_cuda_compress_*`` / ``_cuda_uncompress`` kernels of cu-kernels.cu) and the
``kCompressMatrix`` / ``kDecompressMatrix`` commands of ``NnetComputer``
(nnet-compute.cc).

Semantics, element by element (``I`` the integer type, ``max(I)`` its largest value):

- ``scale = float32(range / max(I))``; ``range == 0`` is the "sign only" mode
  (only for uint8, as in Kaldi, whose sign kernel exists only for uint8): the
  stored value is 1 where the input is > 0 and 0 elsewhere, and it decompresses
  with scale 1 (to 0 or 1).  That is all the backprop of a ReLU needs.
- otherwise ``q = round_half_even(x * float32(1 / scale))`` computed in float32;
  with ``truncate`` ``q`` is clamped to ``[min(I), max(I)]``, without it the
  integer wraps around as a C cast does.
- decompression gives ``float32(q) * scale``.

Kaldi's ``NewCuCompressedMatrix`` (which ``NnetComputer`` calls) ignores the
command's truncate flag and always truncates; ``command_compressed_matrix``
follows that, ``compress_matrix`` takes the flag as the class constructor does.

Kaldi compresses only when a GPU is in use; its CPU build treats both commands
as no-ops (and so does the default ``Executor``).  ``CompressingExecutor`` runs
the real compression on any backend, for GPU workers that want the memory saving
and for tests that check the effect of ``memory_compression_level``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.core.errors import ExecutionError
from engine.runtime.executor import Executor

# CuCompressedMatrixType (cu-compressed-matrix.h): value -> integer dtype
COMPRESSED_INT8 = 1
COMPRESSED_UINT8 = 2
COMPRESSED_INT16 = 3
COMPRESSED_UINT16 = 4

COMPRESSION_DTYPES = {
    COMPRESSED_INT8: np.int8,
    COMPRESSED_UINT8: np.uint8,
    COMPRESSED_INT16: np.int16,
    COMPRESSED_UINT16: np.uint16,
}


@dataclass
class CompressedMatrix:
    """An integer matrix plus the float32 scale that maps it back."""

    data: object          # integer array (numpy or cupy), shape (rows, cols)
    scale: np.float32     # 0 means sign-only (decompresses with scale 1)
    compression_type: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def _dtype_for(compression_type: int):
    try:
        return COMPRESSION_DTYPES[int(compression_type)]
    except KeyError:
        raise ExecutionError(f"unknown compressed-matrix type {compression_type} (expected 1=int8, "
                             "2=uint8, 3=int16 or 4=uint16)") from None


def compression_scale(compression_type: int, range_: float) -> np.float32:
    """Kaldi's scale_ = range / numeric_limits<I>::max(), in float32."""
    dtype = _dtype_for(compression_type)
    if range_ < 0 or (range_ == 0 and dtype in (np.int16, np.uint16)):
        # NewCuCompressedMatrix asserts range >= 0 for 8-bit and range > 0 for 16-bit types
        raise ExecutionError(f"invalid range {range_} for compressed-matrix type "
                             f"{np.dtype(dtype).name}")
    return np.float32(np.float32(range_) / np.float32(np.iinfo(dtype).max))


def compress_matrix(xp, mat, compression_type: int, range_: float,
                    truncate: bool = True) -> CompressedMatrix:
    """CuCompressedMatrix<I>(range, truncate).CopyFromMat(mat)."""
    dtype = _dtype_for(compression_type)
    scale = compression_scale(compression_type, range_)
    x = xp.asarray(mat, dtype=np.float32)
    if scale == 0:
        if dtype is not np.uint8:
            raise ExecutionError("sign-only compression (range 0) is implemented only for uint8, "
                                 "as in Kaldi")
        return CompressedMatrix((x > 0).astype(np.uint8), np.float32(0.0), int(compression_type))
    # 1.0 / scale_ is a double division in Kaldi, then narrowed to float
    inv_scale = np.float32(1.0 / float(scale))
    info = np.iinfo(dtype)
    # undefined rows (never written, dropped before they are read) may hold garbage,
    # NaN included: its rounding and its cast are allowed to be invalid
    with np.errstate(over="ignore", invalid="ignore"):
        q = xp.rint(x * inv_scale)                # float32, round half to even
        if truncate:
            q = xp.clip(q, info.min, info.max)
            data = q.astype(dtype)
        else:
            # __float2int_rn saturates at the int32 range; the narrowing cast wraps
            q = xp.clip(q, np.iinfo(np.int32).min, np.iinfo(np.int32).max)
            data = q.astype(np.int64).astype(dtype)
    return CompressedMatrix(data, scale, int(compression_type))


def decompress_matrix(xp, cm: CompressedMatrix, out=None):
    """CuCompressedMatrix::CopyToMat: float32(q) * scale (scale 1 in sign-only mode)."""
    scale = np.float32(1.0) if cm.scale == 0 else cm.scale
    vals = cm.data.astype(np.float32) * scale
    if out is None:
        return vals
    if tuple(out.shape) != cm.shape:
        raise ExecutionError(f"decompressing a {cm.shape[0]} x {cm.shape[1]} matrix into one of "
                             f"shape {tuple(out.shape)}")
    out[...] = vals
    return out


def command_compressed_matrix(xp, mat, command) -> CompressedMatrix:
    """What NnetComputer does for a kCompressMatrix command: type from arg2, range
    from alpha; NewCuCompressedMatrix drops the truncate flag (arg3), so values
    are always truncated."""
    return compress_matrix(xp, mat, command.arg2, command.alpha, truncate=True)


class CompressingExecutor(Executor):
    """An Executor that carries out kCompressMatrix / kDecompressMatrix as Kaldi's
    NnetComputer does on a GPU: the matrix is replaced by its compressed form
    (its float buffer goes back to the pool) until the matching decompression,
    which allocates it again and fills it from the compressed data.  The
    commands run in the executor's compiled program like all others
    (program.py builds them as closures calling the two methods below)."""

    _real_compression = True

    def _compress_matrix(self, m: int, c) -> None:
        a = self._matrices[m]
        if m in self._compressed or a is None or a.shape[0] == 0:
            raise ExecutionError(f"cannot compress matrix m{m}: it is not allocated or is "
                                 "already compressed")
        self._compressed[m] = command_compressed_matrix(self.xp, a, c)
        self.pool.release(self.xp, a, self.pool_owner)
        self._matrices[m] = None

    def _decompress_matrix(self, m: int) -> None:
        cm = self._compressed.pop(m, None)
        if cm is None or self._matrices[m] is not None:
            raise ExecutionError(f"cannot decompress matrix m{m}: it was not compressed")
        info = self.computation.matrices[m]
        buf = self.pool.get(self.xp, info.num_rows, info.num_cols, self.pool_owner)
        self._matrices[m] = decompress_matrix(self.xp, cm, out=buf)

    def compressed_bytes(self) -> int:
        """Bytes currently held in compressed form."""
        return sum(cm.nbytes for cm in self._compressed.values())
