"""LoopedModel.stream_bytes, the figure a server budgets an open stream at, against what
streams really hold: the memory (tracemalloc: NumPy's buffers and the Python objects;
on CuPy, with NNETC_TEST_BACKEND=cupy, also the device memory its pool hands out) that
streams of a model add once each has computed a few chunks, pushed in turn as a server
pushes them, less what their shared buffer pool keeps (bounded on its own)."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from engine.inference.looped import LoopedConfig
from engine.inference.stream import LoopedModel
from engine.nnet.nnet import Nnet
from engine.runtime.backend import BufferPool
from tests.engine.inference_nets import GATED, RECURRENT, TDNN_IVECTOR, TDNN_PLAIN

_STREAMS = 4


def _held_per_stream(model: LoopedModel) -> float:
    iv = np.zeros(model.ivector_dim, np.float32) if model.has_ivectors else None
    rng = np.random.default_rng(0)
    c, r = model.chunk_size, model.frames_right_context
    x = rng.standard_normal((c * 4 + r, model.input_dim)).astype(np.float32)
    pieces = [x[:c + r]] + [x[k * c + r:(k + 1) * c + r] for k in range(1, 4)]
    model.stream(iv).push(x)       # the plans shared by the model's streams are made
    device = _device_bytes(model.backend)
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        before += device()
        pooled = model.pool.pooled_bytes
        streams = [model.stream(iv) for _ in range(_STREAMS)]
        for piece in pieces:
            for s in streams:
                s.push(piece)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
        after += device()
    finally:
        tracemalloc.stop()
    assert all(s.chunks_computed == 4 for s in streams)
    return (after - before - (model.pool.pooled_bytes - pooled)) / _STREAMS


def _device_bytes(xp):
    """Bytes of device memory in use (CuPy's pool: arrays alive, the BufferPool's
    included, as pooled_bytes counts them); 0 on NumPy, whose buffers tracemalloc sees."""
    if xp is np:
        return lambda: 0
    pool = xp.get_default_memory_pool()

    def in_use() -> int:
        xp.cuda.Device().synchronize()
        return pool.used_bytes()
    return in_use


@pytest.mark.parametrize("config,fpc", [(TDNN_PLAIN, 20), (TDNN_PLAIN, 1000),
                                        (TDNN_IVECTOR, 300), (RECURRENT, 20),
                                        (RECURRENT, 300), (GATED, 100)],
                         ids=["tdnn-20", "tdnn-1000", "tdnn-ivector-300", "recurrent-20",
                              "recurrent-300", "gated-100"])
def test_stream_bytes_covers_what_a_stream_holds(config, fpc):
    nnet = Nnet.from_config(config, rng=np.random.default_rng(0))
    model = LoopedModel(nnet, LoopedConfig(fpc, 0, 1), pool=BufferPool(1 << 30))
    held = _held_per_stream(model)
    est = model.stream_bytes()
    assert est >= model.computation.peak_bytes()
    assert held <= est, (held, est)
    if model.backend is np:
        # tight on NumPy; on CuPy (NNETC_TEST_BACKEND=cupy) streams keep far less host
        # and device memory than the figure budgets (an H200, 2026-11-29: 12.5 KB against
        # 54 KB for tdnn-20, 18.6 KB against 3.4 MB for gated-100), so a GPU server
        # admits fewer streams than it could: safe, not tight
        assert est <= 3 * held, (held, est)
