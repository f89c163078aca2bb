"""A stream's push and finish are all or nothing (engine.inference.stream): when a chunk
computation fails, or the caller's ``should_stop`` hook answers True (asked before each
chunk the call computes and once after the last), the stream is put back as it was
before the call -- frames, counters, i-vectors and the executor's carried matrices -- so
no output row is lost and the same call may be made again.  Checked on a recurrent
network (state carried between chunks), a TDNN with per-utterance i-vectors and an
online i-vector stream: after any number of undone calls, the output equals that of a
stream never interrupted, bit for bit, and the executor's pool holds no more than it
did."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.errors import Cancelled, ExecutionError
from engine.inference.looped import LoopedConfig
from engine.inference.stream import LoopedModel, Stream
from inference_nets import RECURRENT, TDNN_IVECTOR, TDNN_PLAIN, feats, make_nnet

_MODELS: dict = {}


def looped(config_text: str, chunk: int = 6) -> LoopedModel:
    key = (config_text, chunk)
    if key not in _MODELS:
        _MODELS[key] = LoopedModel(make_nnet(config_text), LoopedConfig(chunk))
    return _MODELS[key]


def _ivector(model: LoopedModel, seed: int = 3):
    if not model.has_ivectors:
        return None
    return np.random.default_rng(seed).standard_normal(model.ivector_dim).astype(np.float32)


def _plain(model: LoopedModel, x, cuts) -> np.ndarray:
    """The output of a stream never interrupted, pushed in the pieces ``cuts``."""
    s = model.stream(_ivector(model))
    out, pos = [], 0
    for n in cuts:
        out.append(s.push(x[pos:pos + n]))
        pos += n
    out.append(s.finish())
    return np.concatenate(out, axis=0)


class _StopAt:
    """A should_stop hook that answers True at its ``k``-th question (1-based)."""

    def __init__(self, k: int):
        self.k, self.asked = k, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.asked == self.k


def _state(s: Stream) -> tuple:
    ex = s.executor
    return (s.num_received, s.buffer_start, s.chunks_computed, s.num_emitted, s.input_ended,
            s.finished, s.buffer.tobytes(), ex.position,
            [None if a is None else np.asarray(a).tobytes() for a in ex.matrices])


@pytest.mark.parametrize("config", [RECURRENT, TDNN_PLAIN, TDNN_IVECTOR],
                         ids=["recurrent", "tdnn", "tdnn_ivector"])
@pytest.mark.parametrize("stop_at", [1, 2, 3, 5])
def test_a_stopped_push_is_undone_and_can_be_sent_again(config, stop_at):
    model = looped(config)
    x = feats(80)
    cuts = [7, 31, 13, 29]          # the second push computes several chunks
    expected = _plain(model, x, cuts)
    s = model.stream(_ivector(model))
    out, pos = [], 0
    for i, n in enumerate(cuts):
        piece = x[pos:pos + n]
        if i == 1:
            before = _state(s)
            for attempt in range(6):
                misses = model.pool.misses
                with pytest.raises(Cancelled, match="it is as before this call") as e:
                    s.push(piece, should_stop=_StopAt(stop_at))
                # asked before each chunk: stopped before the stop_at-th one ran
                assert e.value.done == stop_at - 1
                assert _state(s) == before
                if attempt:
                    # the copies and what the chunks left went back to the pool and are
                    # taken again: at most one new buffer per chunk (an output handed out)
                    assert model.pool.misses - misses <= stop_at - 1
        out.append(s.push(piece))
        pos += n
    out.append(s.finish())
    got = np.concatenate(out, axis=0)
    assert got.tobytes() == expected.tobytes()


def test_a_stop_asked_after_the_last_chunk_also_undoes_the_push():
    """The hook is asked once more when every chunk is done: a push finished past a
    deadline is not kept either (its answer would reach nobody)."""
    model = looped(RECURRENT)
    x = feats(60)
    expected = _plain(model, x, [20, 40])
    s = model.stream()
    first = s.push(x[:20])
    before = _state(s)
    counting = _StopAt(10 ** 9)
    s.push(x[20:40], should_stop=counting)         # learn how often it is asked
    s = model.stream()
    assert s.push(x[:20]).tobytes() == first.tobytes()
    with pytest.raises(Cancelled) as e:
        s.push(x[20:40], should_stop=_StopAt(counting.asked))
    assert e.value.done == counting.asked - 1 and e.value.done >= 3
    assert _state(s) == before
    got = np.concatenate([first, s.push(x[20:]), s.finish()], axis=0)
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("config", [RECURRENT, TDNN_IVECTOR], ids=["recurrent", "tdnn_ivector"])
def test_a_push_whose_chunk_computation_fails_is_undone(config, monkeypatch):
    """A chunk that fails after its commands have written the carried matrices (the
    failure raised after the real run): the stream is as before the push."""
    model = looped(config)
    x = feats(70)
    expected = _plain(model, x, [9, 40, 21])
    s = model.stream(_ivector(model))
    out = [s.push(x[:9])]
    before = _state(s)
    real = Stream._run_chunk
    calls = []

    def failing(self, f, iv):
        y = real(self, f, iv)
        calls.append(1)
        if len(calls) == 3:
            raise ExecutionError("a chunk computation failed (test)")
        return y
    monkeypatch.setattr(Stream, "_run_chunk", failing)
    with pytest.raises(ExecutionError, match="failed \\(test\\)"):
        s.push(x[9:49])
    monkeypatch.undo()
    assert _state(s) == before
    out += [s.push(x[9:49]), s.push(x[49:]), s.finish()]
    assert np.concatenate(out, axis=0).tobytes() == expected.tobytes()


def test_a_push_that_sets_a_new_ivector_and_is_stopped_keeps_the_old_one():
    model = looped(TDNN_IVECTOR)
    x = feats(60)
    s = model.stream(_ivector(model, 3))
    s.push(x[:10])
    old = s.ivector
    with pytest.raises(Cancelled):
        s.push(x[10:40], ivector=_ivector(model, 4), should_stop=_StopAt(2))
    assert s.ivector is old and s.num_received == 10


def test_a_stopped_finish_leaves_the_stream_open():
    model = looped(RECURRENT)
    x = feats(50)
    expected = _plain(model, x, [50])
    s = model.stream()
    first = s.push(x)
    before = _state(s)
    with pytest.raises(Cancelled):
        s.finish(should_stop=_StopAt(1))
    assert _state(s) == before and not s.finished and not s.input_ended
    got = np.concatenate([first, s.finish()], axis=0)
    assert got.tobytes() == expected.tobytes()
    assert s.finished


def test_an_online_ivector_push_that_is_stopped_drops_its_rows():
    model = looped(TDNN_IVECTOR)
    x = feats(90)
    rows = np.random.default_rng(5).standard_normal((12, model.ivector_dim)).astype(np.float32)
    period = 10

    def run(stop: bool) -> np.ndarray:
        s = model.stream(online_ivector_period=period)
        out = [s.push(x[:20], online_ivectors=rows[:3])]
        if stop:
            held = (s.online_received, s.online_start, s.online_rows.tobytes())
            with pytest.raises(Cancelled):
                s.push(x[20:70], online_ivectors=rows[3:8], should_stop=_StopAt(2))
            assert (s.online_received, s.online_start, s.online_rows.tobytes()) == held
        out += [s.push(x[20:70], online_ivectors=rows[3:8]),
                s.push(x[70:], online_ivectors=rows[8:]), s.finish()]
        return np.concatenate(out, axis=0)
    assert run(True).tobytes() == run(False).tobytes()


def test_a_push_that_computes_nothing_never_asks_the_hook():
    model = looped(RECURRENT)
    s = model.stream()
    asked = []
    out = s.push(feats(2), should_stop=lambda: asked.append(1) or True)
    assert out.shape[0] == 0 and not asked and s.num_received == 2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), config=st.sampled_from([RECURRENT, TDNN_IVECTOR]),
       num_frames=st.integers(1, 70))
def test_undone_calls_anywhere_leave_the_output_unchanged(data, config, num_frames):
    """Pushes in random pieces; before each push and before finish, any number of
    attempts that are stopped at a random question of the hook or fail in a random
    chunk, each undone; then the call itself.  The output is the uninterrupted
    stream's, bit for bit."""
    model = looped(config, chunk=5)
    x = feats(num_frames, seed=num_frames)
    cuts = data.draw(st.lists(st.integers(0, 25), max_size=6))
    cuts.append(num_frames - min(num_frames, sum(cuts)))
    expected = _plain(model, x, cuts)
    s = model.stream(_ivector(model))

    def attempts(call):
        for _ in range(data.draw(st.integers(0, 2))):
            before = _state(s)
            k = data.draw(st.integers(1, 6))
            if data.draw(st.booleans()):
                try:
                    call(_StopAt(k))
                except Cancelled:
                    pass
                else:
                    # fewer questions than k: the call went through; nothing to undo
                    return True
            else:
                runs = []
                real = Stream._run_chunk

                def failing(self, f, iv):
                    runs.append(1)
                    y = real(self, f, iv)
                    if len(runs) == k:
                        raise ExecutionError("failed (test)")
                    return y
                Stream._run_chunk = failing
                try:
                    call(None)
                except ExecutionError:
                    pass
                else:
                    return True
                finally:
                    Stream._run_chunk = real
            assert _state(s) == before
        return False

    out, pos = [], 0
    for n in cuts:
        piece = x[pos:pos + n]
        kept = []
        if attempts(lambda hook: kept.append(s.push(piece, should_stop=hook))):
            out += kept
        else:
            out.append(s.push(piece))
        pos += n
    kept = []
    if attempts(lambda hook: kept.append(s.finish(should_stop=hook))):
        out += kept
    else:
        out.append(s.finish())
    assert np.concatenate(out, axis=0).tobytes() == expected.tobytes()
