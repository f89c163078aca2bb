"""Streams with an online i-vector matrix (engine.inference.stream): rows pushed
with the frames, each chunk reading row min(end // period, rows - 1) as Kaldi's
DecodableNnetSimpleLooped does.  Checked against Kaldi's output
(tests/data/inference/online_ivectors), cut into pieces any way, across export and
import of the state, batched with StreamBatcher, and on bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from refdata import DATA
from engine.core.errors import InferenceError, StreamError
from engine.inference.batch import StreamBatcher
from engine.inference.looped import LoopedConfig
from engine.inference.stream import LoopedModel
from engine.nnet.model_io import load_model
from inference_nets import TDNN_PLAIN, assert_close, make_nnet

CASE = DATA / "inference" / "online_ivectors"
SETTINGS = json.loads((CASE / "case.json").read_text())["settings"]
ARRAYS = dict(np.load(CASE / "case.npz"))
FEATS = ARRAYS["features"]
_MODELS: dict = {}


def model_for(s: dict) -> LoopedModel:
    key = s["key"]
    if key not in _MODELS:
        _MODELS[key] = LoopedModel(load_model(str(CASE / "model.raw")).nnet,
                                   LoopedConfig(s["frames_per_chunk"],
                                                s["extra_left_context_initial"],
                                                s["frame_subsampling_factor"]))
    return _MODELS[key]


def stream_out(lm, feats, rows, period, rng, lag=(-2, 3), reimport=False) -> np.ndarray:
    """Frames in random pieces; rows arrive with the frames they describe, give or
    take ``lag``; the rest before finish().  ``reimport``: export and import the
    state after every push."""
    s = lm.stream(online_ivector_period=period)
    out, pos, sent = [], 0, 0
    while pos < feats.shape[0]:
        step = int(rng.integers(1, 30))
        want = min(rows.shape[0], max(0, (pos + step) // period + int(rng.integers(*lag))))
        new = None
        if want > sent:
            new, sent = rows[sent:want], want
        out.append(s.push(feats[pos:pos + step], online_ivectors=new))
        pos += step
        if reimport:
            s = lm.import_stream(s.export_state())
    if sent < rows.shape[0]:
        out.append(s.push(feats[:0], online_ivectors=rows[sent:]))
    out.append(s.finish())
    return np.concatenate(out, axis=0)


@pytest.mark.parametrize("setting", SETTINGS, ids=[s["key"] for s in SETTINGS])
def test_stream_equals_kaldi_looped_with_online_ivectors(setting):
    lm = model_for(setting)
    rows = ARRAYS[f"online.{setting['key']}"]
    ref = ARRAYS[f"output.{setting['key']}"]
    period = setting["online_ivector_period"]
    outs = [stream_out(lm, FEATS, rows, period, np.random.default_rng(seed))
            for seed in range(4)]
    for got in outs:
        assert_close(got, ref, setting["key"])
        # how the frames and rows were cut changes nothing, to the bit
        assert np.array_equal(got, outs[0])
    # the state exported and imported after every push: the same bits
    again = stream_out(lm, FEATS, rows, period, np.random.default_rng(0), reimport=True)
    assert np.array_equal(again, outs[0])


def test_a_chunk_waits_for_its_ivector_row():
    s_ = SETTINGS[0]          # 20-frame chunks, a row every 10 frames
    lm, rows, period = model_for(s_), ARRAYS[f"online.{s_['key']}"], 10
    s = lm.stream(online_ivector_period=period)
    _, end = lm.input_range(0)
    assert s.push(FEATS[:end + 5]).shape[0] == 0          # frames, but no row yet
    need = end // period                                   # chunk 0 reads this row
    assert s.push(FEATS[:0], online_ivectors=rows[:need]).shape[0] == 0
    first = s.push(FEATS[:0], online_ivectors=rows[need:need + 1])
    assert first.shape[0] == lm.chunk_size // lm.fsf
    rest = s.push(FEATS[end + 5:], online_ivectors=rows[need + 1:])
    whole = np.concatenate([first, rest, s.finish()])
    assert_close(whole, ARRAYS[f"output.{s_['key']}"])


def test_equal_rows_give_the_per_utterance_stream():
    lm = model_for(SETTINGS[1])
    v = np.random.default_rng(3).standard_normal(8).astype(np.float32)
    per_utt = lm.stream(v)
    a = np.concatenate([per_utt.push(FEATS), per_utt.finish()])
    online = lm.stream(online_ivector_period=5)
    b = np.concatenate([online.push(FEATS, online_ivectors=np.tile(v, (3, 1))),
                        online.finish()])
    assert np.array_equal(a, b)


def test_rows_before_the_ones_later_chunks_read_are_dropped():
    s_ = SETTINGS[3]          # one-frame chunks, a row every 4 frames
    lm, rows = model_for(s_), ARRAYS[f"online.{s_['key']}"]
    s = lm.stream(online_ivector_period=4)
    s.push(FEATS[:60], online_ivectors=rows[:16])
    assert s.online_received == 16
    assert s.online_start > 0 and s.online_rows.shape[0] == 16 - s.online_start
    assert s.online_rows.shape[0] <= 3


def test_batched_online_streams_equal_single_ones():
    """Three online streams advanced by StreamBatcher (15 frames and the rows for
    them per push) give each the output of a stream run on its own."""
    s_ = SETTINGS[0]
    lm, rows, period = model_for(s_), ARRAYS[f"online.{s_['key']}"], 10
    batcher = StreamBatcher(lm, max_batch_size=4)
    sets = [rows * np.float32(k + 1) for k in range(3)]
    streams = [lm.stream(online_ivector_period=period) for _ in sets]
    got: list[list] = [[] for _ in streams]
    for start in range(0, FEATS.shape[0], 15):
        for s, r in zip(streams, sets):
            s.feed(FEATS[start:start + 15],
                   online_ivectors=r[start // period:(start + 15) // period])
        for k, o in enumerate(batcher.advance(streams)):
            got[k].append(o)
    for s, r in zip(streams, sets):
        s.feed(FEATS[:0], online_ivectors=r[FEATS.shape[0] // period:])
        s.end_input()
    for k, o in enumerate(batcher.advance(streams)):
        got[k].append(o)
    chunks = -(-FEATS.shape[0] // lm.chunk_size)
    assert batcher.num_runs < len(sets) * chunks     # chunks of several streams ran together
    for k, r in enumerate(sets):
        single = lm.stream(online_ivector_period=period)
        alone = np.concatenate([single.push(FEATS, online_ivectors=r), single.finish()])
        assert_close(np.concatenate(got[k]), alone, str(k))


def test_online_ivector_errors():
    lm = model_for(SETTINGS[0])
    v = np.zeros(8, np.float32)
    with pytest.raises(InferenceError, match="either a per-utterance"):
        lm.stream(v, online_ivector_period=10)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(InferenceError, match="positive integer"):
            lm.stream(online_ivector_period=bad)
    s = lm.stream(online_ivector_period=10)
    with pytest.raises(InferenceError, match="not a per-utterance i-vector"):
        s.push(FEATS[:5], ivector=v)
    with pytest.raises(InferenceError, match="dimension 8"):
        s.push(FEATS[:5], online_ivectors=np.zeros((2, 7), np.float32))
    with pytest.raises(InferenceError, match="NaN"):
        s.push(FEATS[:5], online_ivectors=np.full((1, 8), np.nan, np.float32))
    s.push(FEATS[:30])
    for end in (s.end_input, s.finish):
        with pytest.raises(StreamError, match="no i-vector row was pushed"):
            end()
    # refused before anything changed: a row, and the stream ends with it
    out = np.concatenate([s.push(FEATS[:0], online_ivectors=np.ones((1, 8), np.float32)),
                          s.finish()])
    assert out.shape == (30, 10) and s.finished
    with pytest.raises(InferenceError, match="without an online_ivector_period"):
        lm.stream(v).push(FEATS[:5], online_ivectors=np.zeros((1, 8), np.float32))
    plain = LoopedModel(make_nnet(TDNN_PLAIN), LoopedConfig(6))
    with pytest.raises(InferenceError, match="no 'ivector' input"):
        plain.stream(online_ivector_period=3)


def test_cli_stream_with_online_ivectors(tmp_path):
    from click.testing import CliRunner  # noqa: PLC0415

    from service.cli import main  # noqa: PLC0415
    s_ = SETTINGS[2]          # 21-frame chunks, subsampling 3, a row per frame, 3 too many
    np.save(tmp_path / "f.npy", FEATS)
    np.save(tmp_path / "on.npy", ARRAYS[f"online.{s_['key']}"])
    args = ["stream", str(CASE / "model.raw"), "--features", str(tmp_path / "f.npy"),
            "--online-ivectors", str(tmp_path / "on.npy"), "--online-ivector-period", "1",
            "--chunk-size", "21", "--frame-subsampling-factor", "3",
            "--out", str(tmp_path / "o.npy")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert_close(np.load(tmp_path / "o.npy"), ARRAYS[f"output.{s_['key']}"], "nnetc stream")
    r = CliRunner().invoke(main, [a for a in args if a not in ("--online-ivector-period", "1")])
    assert r.exit_code == 2 and "go together" in r.output


def test_lock_step_stream_batch_with_online_ivectors():
    """StreamBatch (streams advanced together by one B-sequence computation) with an
    online_ivector_period: each stream's rows, each chunk reading its own row as a
    Stream does; a stream that finished early uses its last row."""
    from engine.inference.stream import StreamBatch  # noqa: PLC0415
    s_ = SETTINGS[0]
    period = s_["online_ivector_period"]
    nnet = load_model(str(CASE / "model.raw")).nnet
    batch_model = LoopedModel(nnet, LoopedConfig(s_["frames_per_chunk"]), num_sequences=3)
    single = model_for(s_)
    rows = ARRAYS[f"online.{s_['key']}"]
    sets = [rows, rows[::-1].copy(), rows * np.float32(0.5)]
    lengths = [90, 61, 90]
    sb = StreamBatch(batch_model, online_ivector_period=period)
    got: list[list] = [[] for _ in sets]

    def finish(j: int, r, n: int) -> None:
        """Stream j's remaining rows, then its end (once)."""
        if not sb.finished[j]:
            sb.push(j, FEATS[:0], online_ivectors=r[n // period:])
            sb.finish(j)
    for start in range(0, 90, 15):
        for j, (r, n) in enumerate(zip(sets, lengths)):
            if start < n:
                sb.push(j, FEATS[start:min(start + 15, n)],
                        online_ivectors=r[start // period:min(start + 15, n) // period])
            else:
                finish(j, r, n)
        for j, o in enumerate(sb.advance()):
            got[j].append(o)
    for j, (r, n) in enumerate(zip(sets, lengths)):
        finish(j, r, n)
    for j, o in enumerate(sb.advance()):
        got[j].append(o)
    for j, (r, n) in enumerate(zip(sets, lengths)):
        alone = single.stream(online_ivector_period=period)
        want = np.concatenate([alone.push(FEATS[:n], online_ivectors=r), alone.finish()])
        assert_close(np.concatenate(got[j]), want, f"stream {j}")
    assert_close(np.concatenate(got[0]), ARRAYS[f"output.{s_['key']}"], "Kaldi")
    with pytest.raises(InferenceError, match="either a per-utterance"):
        StreamBatch(batch_model, ivectors=[np.zeros(8)] * 3, online_ivector_period=period)
    with pytest.raises(InferenceError, match="without an online_ivector_period"):
        StreamBatch(batch_model, ivectors=[np.zeros(8, np.float32)] * 3).push(
            0, FEATS[:3], online_ivectors=np.zeros((1, 8), np.float32))
