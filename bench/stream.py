"""The ``stream`` suite: online (looped) inference as a streaming client sees it.

For each reference model that can stream (a future-offset recurrence such as
BLSTM's is refused), the first looped setting of its ``looped.json`` (frames per
chunk, extra left context, frame subsampling) or, without one, 21 frames per
chunk: one utterance of ``FRAMES`` random frames (and a random i-vector when the
model has one) is pushed in 10-frame pieces, as audio arrives, into

- one ``Stream``: total time, the median time of one chunk's computation, and the
  real-time factor (seconds of computation per second of audio, 100 frames/s);
- a ``StreamBatch`` of ``BATCH`` streams advanced together (the same utterance
  each): frames per second over all streams, against the single stream's;
- whole-utterance inference (``Inferencer``, the utterance as one chunk) of the
  same frames: ``stream_over_offline`` is the price of streaming.

Outputs are checked first: the stream equals the offline result within Kaldi's
reference tolerance (networks with optional future inputs excepted, see
engine/README.md).  Timings are medians of ``repeat`` runs after a warm-up.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from bench import common

FRAMES = 3000            # 30 s of audio at 100 frames/s
PIECE = 10               # frames per push: 100 ms of audio
BATCH = 8


def _setting(path) -> dict:
    f = path.parent / "looped.json"
    if f.exists():
        settings = json.loads(f.read_text()).get("settings") or []
        if settings:
            return settings[0]
    return {"frames_per_chunk": 21, "extra_left_context_initial": 0,
            "frame_subsampling_factor": 1}


def _push_all(stream, x) -> np.ndarray:
    pieces = [stream.push(x[i:i + PIECE]) for i in range(0, x.shape[0], PIECE)]
    pieces.append(stream.finish())
    return np.concatenate(pieces, axis=0)


def measure_stream(name: str, path, repeat: int = 3) -> dict | None:
    from engine.core.errors import InferenceError  # noqa: PLC0415
    from engine.inference import InferenceOptions, Inferencer  # noqa: PLC0415
    from engine.inference.looped import LoopedConfig  # noqa: PLC0415
    from engine.inference.stream import LoopedModel, Stream, StreamBatch  # noqa: PLC0415
    from engine.nnet.model_io import load_model  # noqa: PLC0415
    nnet = load_model(str(path)).nnet
    s = _setting(path)
    config = LoopedConfig(s["frames_per_chunk"], s["extra_left_context_initial"],
                          s["frame_subsampling_factor"])
    try:
        model = LoopedModel(nnet, config)
    except InferenceError:
        return None                     # cannot stream (e.g. a BLSTM)
    batch_model = LoopedModel(nnet, config, num_sequences=BATCH)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((FRAMES, model.input_dim)).astype(np.float32)
    iv = (rng.standard_normal(model.ivector_dim).astype(np.float32)
          if model.has_ivectors else None)

    # the whole utterance as one chunk: a recurrent network's state then runs through
    # it as in the stream (nnet3-compute's chunks would each start from zero state)
    offline = Inferencer(nnet, InferenceOptions(
        frames_per_chunk=FRAMES, extra_left_context_initial=s["extra_left_context_initial"],
        frame_subsampling_factor=model.fsf))
    want = offline.infer(x, ivector=iv)
    got = _push_all(model.stream(iv), x)
    err = float(np.max(np.abs(got - want))) if want.size else 0.0

    chunk_times: list[float] = []
    run_chunk = Stream._run_chunk

    def timed_chunk(self, feats, ivectors):
        t = time.perf_counter()
        out = run_chunk(self, feats, ivectors)
        chunk_times.append(time.perf_counter() - t)
        return out

    def one_stream():
        _push_all(model.stream(iv), x)

    def batch_of_streams():
        sb = StreamBatch(batch_model, [iv] * BATCH if iv is not None else None)
        for i in range(0, FRAMES, PIECE):
            for j in range(BATCH):
                sb.push(j, x[i:i + PIECE])
            sb.advance()
        for j in range(BATCH):
            sb.finish(j)
        sb.advance()

    def whole():
        offline.infer(x, ivector=iv)

    Stream._run_chunk = timed_chunk
    try:
        stream_s = statistics.median(common.timings(one_stream, repeat))
    finally:
        Stream._run_chunk = run_chunk
    batch_s = statistics.median(common.timings(batch_of_streams, repeat))
    offline_s = statistics.median(common.timings(whole, repeat))
    audio_s = FRAMES / 100.0
    return {"model": name, "frames_per_chunk": model.chunk_size, "fsf": model.fsf,
            "max_abs_diff": err, "tolerance": 1e-4 + 2e-3 * float(np.max(np.abs(want))),
            "stream_ms": stream_s * 1e3, "chunk_ms": statistics.median(chunk_times) * 1e3,
            "rtf": stream_s / audio_s, "frames_per_s": FRAMES / stream_s,
            "batch": BATCH, "batch_frames_per_s": BATCH * FRAMES / batch_s,
            "batch_speedup": (BATCH * FRAMES / batch_s) / (FRAMES / stream_s),
            "offline_ms": offline_s * 1e3, "stream_over_offline": stream_s / offline_s}


def suite_stream(r) -> list[dict]:
    rows = []
    with common.blas_threads(r.plain_settings[0]):
        for name, path in r.models():
            row = measure_stream(name, path, repeat=max(1, min(r.repeat, 3)))
            if row is not None:
                row["threads"] = r.threads_label(r.plain_settings[0])
                rows.append(row)
    return rows
