"""BufferPool owners (engine/runtime/backend.py): a named caller gets its own released
buffers back first, unnamed ones next, a new one rather than another owner's (unless
the pool is too full to take a new one back); unnamed callers take unnamed buffers,
then the latest owner's; ``disown`` makes an owner's buffers anyone's.  The byte count
and the bound hold over all owners."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from engine.core.errors import StreamError
from engine.runtime.backend import BufferPool


def _buf(rows=3, cols=4):
    return np.empty((rows, cols), dtype=np.float32)


def test_an_owner_gets_its_own_buffers_back_last_released_first():
    pool = BufferPool()
    a, b = pool.new_owner(), pool.new_owner()
    assert a != b and None not in (a, b)
    xa1, xa2, xb = _buf(), _buf(), _buf()
    pool.release(np, xa1, a)
    pool.release(np, xb, b)
    pool.release(np, xa2, a)
    assert pool.get(np, 3, 4, a) is xa2
    assert pool.get(np, 3, 4, b) is xb
    assert pool.get(np, 3, 4, a) is xa1
    assert pool.pooled_bytes == 0 and pool.hits == 3 and pool.misses == 0


def test_an_owner_takes_unnamed_buffers_next_and_never_another_owners():
    pool = BufferPool()
    a, b = pool.new_owner(), pool.new_owner()
    free, theirs = _buf(), _buf()
    pool.release(np, theirs, b)
    pool.release(np, free)                # released without an owner
    assert pool.get(np, 3, 4, a) is free
    got = pool.get(np, 3, 4, a)           # b's is b's: a new buffer
    assert got is not theirs and got.shape == (3, 4) and got.dtype == np.float32
    assert pool.misses == 1 and pool.pooled_bytes == theirs.nbytes
    assert pool.get(np, 3, 4, b) is theirs


def test_an_unnamed_caller_takes_unnamed_buffers_then_the_latest_owners():
    pool = BufferPool()
    a, b = pool.new_owner(), pool.new_owner()
    xa, xb, free = _buf(), _buf(), _buf()
    pool.release(np, xa, a)
    pool.release(np, xb, b)
    pool.release(np, free)
    assert pool.get(np, 3, 4) is free
    assert pool.get(np, 3, 4) is xb       # b's list came in after a's
    assert pool.get(np, 3, 4) is xa
    assert pool.pooled_bytes == 0


def test_a_pool_too_full_to_take_a_new_buffer_back_lends_another_owners():
    """Where the bound would drop a new buffer on its release, a named caller takes
    another owner's rather than allocate on every call."""
    x = _buf()
    pool = BufferPool(max_bytes=x.nbytes)
    a, b = pool.new_owner(), pool.new_owner()
    pool.release(np, x, b)
    assert pool.pooled_bytes == x.nbytes
    assert pool.get(np, 3, 4, a) is x
    roomy = BufferPool(max_bytes=2 * x.nbytes)
    roomy.release(np, x, b)
    assert roomy.get(np, 3, 4, a) is not x


def test_disown_makes_an_owners_buffers_anyones_and_keeps_the_count():
    pool = BufferPool()
    a, b = pool.new_owner(), pool.new_owner()
    xs = [_buf(), _buf(2, 2)]
    for x in xs:
        pool.release(np, x, a)
    pool.disown(a)
    assert pool.pooled_bytes == sum(x.nbytes for x in xs)
    assert pool.get(np, 2, 2, b) is xs[1]
    assert pool.get(np, 3, 4, b) is xs[0]
    pool.disown(a, "never seen")          # nothing left: a no-op
    assert pool.held() == [] and pool.pooled_bytes == 0


def test_the_bound_counts_every_owners_buffers():
    x = _buf()
    pool = BufferPool(max_bytes=2 * x.nbytes)
    a, b = pool.new_owner(), pool.new_owner()
    pool.release(np, _buf(), a)
    pool.release(np, _buf(), b)
    pool.release(np, _buf())              # dropped: the pool is full
    assert pool.pooled_bytes == 2 * x.nbytes and len(pool.held()) == 2


def test_owners_from_threads_never_share_a_buffer():
    pool = BufferPool()
    held: list = []
    lock = threading.Lock()

    def work():
        me = pool.new_owner()
        mine = []
        for i in range(200):
            x = pool.get(np, 2, 3, me)
            mine.append(x)
            if i % 3 == 2:
                for y in mine[:-1]:
                    pool.release(np, y, me)
                mine = mine[-1:]
        with lock:
            held.extend(mine)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [id(x) for x in held] + [id(x) for x in pool.held()]
    assert len(ids) == len(set(ids))     # no buffer is both held and free, or held twice
    assert pool.pooled_bytes == sum(x.nbytes for x in pool.held())


def test_a_stream_names_its_executor_and_gives_its_buffers_up_when_it_ends():
    from inference_nets import TDNN_PLAIN, feats, make_nnet  # noqa: PLC0415

    from engine.inference.looped import LoopedConfig  # noqa: PLC0415
    from engine.inference.stream import LoopedModel  # noqa: PLC0415
    model = LoopedModel(make_nnet(TDNN_PLAIN), LoopedConfig(5, 0, 1))
    pool = model.pool
    x = feats(60, seed=1)

    def owned(owner):
        return sum(len(d.get(owner, ())) for d in pool._free.values())

    s, t = model.stream(), model.stream()
    assert s.executor.pool_owner is not None
    assert s.executor.pool_owner != t.executor.pool_owner
    s.push(x[:30])
    t.push(x[:30])
    assert owned(s.executor.pool_owner) > 0 and owned(t.executor.pool_owner) > 0
    s.finish()                        # ended: its buffers are anyone's
    assert owned(s.executor.pool_owner) == 0
    t.close()                         # dropped before its end: the same
    assert owned(t.executor.pool_owner) == 0 and t.finished
    with pytest.raises(StreamError, match="after finish\\(\\) or close\\(\\)"):
        t.push(x[30:40])
    u = model.stream()
    u.push(x[:30])
    owner = u.executor.pool_owner
    assert owned(owner) > 0
    del u
    gc.collect()                      # collected: the same
    assert owned(owner) == 0
