"""Batched streaming (engine.inference.batch): independent Streams at different
chunk positions advanced together by one looped computation along n.  Random
mixes of streams (different start times, random pieces, online i-vector changes,
early ends, some chunks computed alone, export/import between batched advances)
give the same output as each stream advanced alone, to float32 rounding; the
recurrent and TDNN-F reference models agree with Kaldi's looped decodable."""

from __future__ import annotations

import numpy as np
import pytest

from refdata import shared_ref
from engine.core.errors import InferenceError, StreamError
from engine.inference.batch import BatchPlan, StreamBatcher, batch_plan
from engine.inference.looped import LoopedConfig
from engine.inference.stream import LoopedModel
from engine.nnet.model_io import load_model
from inference_nets import (RECURRENT, TDNN_IVECTOR, TDNN_PLAIN, assert_close, feats,
                            kaldi_looped_config, make_nnet, model_dirs, model_file, read_json)

SHARED = shared_ref()

# Recurrence (delay 3) next to a per-utterance i-vector: left context 1 + 2 = 3, right 1.
RECURRENT_IVECTOR = """
input-node name=input dim=8
input-node name=ivector dim=3
component name=a1 type=AffineComponent input-dim=27 output-dim=16
component-node name=a1 component=a1 input=Append(Offset(input, -1), input, Offset(input, 1), ReplaceIndex(ivector, t, 0))
component name=r1 type=AffineComponent input-dim=32 output-dim=16
component-node name=r1 component=r1 input=Append(a1, IfDefined(Offset(t1, -3)))
component name=t1 type=TanhComponent dim=16
component-node name=t1 component=t1 input=r1
component name=a2 type=AffineComponent input-dim=32 output-dim=5
component-node name=a2 component=a2 input=Append(Offset(t1, -2), t1)
output-node name=output input=a2
"""

# Statistics pooling over a long window: the single- and 3-stream looped computations
# come out of the optimizer carrying different matrices, so their states do not map.
STATS = """
input-node name=input dim=8
component name=statistics-extraction type=StatisticsExtractionComponent input-dim=8 input-period=2 output-period=4 include-variance=true
component name=statistics-pooling type=StatisticsPoolingComponent input-dim=17 input-period=4 left-context=12 right-context=16 num-log-count-features=0 output-stddevs=true variance-floor=1e-10
component name=affine type=AffineComponent input-dim=8 output-dim=16
component-node name=statistics-extraction component=statistics-extraction input=input
component-node name=statistics-pooling component=statistics-pooling input=statistics-extraction
component-node name=affine component=affine input=input
output-node name=output input=Sum(affine, Round(statistics-pooling, 4))
"""

_MODELS: dict = {}


def looped(config_text: str, chunk: int, elci: int = 0, fsf: int = 1) -> LoopedModel:
    key = (config_text, chunk, elci, fsf)
    if key not in _MODELS:
        _MODELS[key] = LoopedModel(make_nnet(config_text), LoopedConfig(chunk, elci, fsf))
    return _MODELS[key]


def assert_float32_equal(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    """Equal up to the rounding of float32 products summed in another order."""
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs {ref.shape}"
    if ref.size:
        err = float(np.abs(ours - ref).max())
        assert err <= 1e-5 * (1.0 + float(np.abs(ref).max())), f"{what}: max abs error {err:.3g}"


def simulate(model: LoopedModel, seed: int, num_streams: int = 6, max_len: int = 60,
             max_piece: int = 9, online_ivectors: bool = False, max_batch_size: int = 16,
             batch_sizes=None, alone_prob: float = 0.15, export_prob: float = 0.1):
    """Streams fed by a random scheduler and advanced by a StreamBatcher; returns the
    batched outputs, each stream's log of (piece, i-vector) pushes, and the batcher."""
    rng = np.random.default_rng(seed)
    batcher = StreamBatcher(model, max_batch_size=max_batch_size, batch_sizes=batch_sizes)
    dim, ivdim = model.input_dim, model.ivector_dim

    def ivec():
        return rng.standard_normal(ivdim).astype(np.float32) if model.has_ivectors else None

    lengths = rng.integers(1, max_len + 1, size=num_streams)
    xs = [rng.standard_normal((n, dim)).astype(np.float32) for n in lengths]
    ends = [int(n) if rng.random() < 0.7 else int(rng.integers(1, n + 1)) for n in lengths]
    starts = rng.integers(0, 6, size=num_streams)
    first_iv = [ivec() for _ in range(num_streams)]
    streams = [model.stream(v) for v in first_iv]
    logs = [[("start", v)] for v in first_iv]
    outs = [[] for _ in range(num_streams)]
    pos = [0] * num_streams
    for rnd in range(400):
        for j, s in enumerate(streams):
            if rnd < starts[j] or s.input_ended:
                continue
            n = int(rng.integers(0, max_piece + 1))
            piece = xs[j][pos[j]:min(pos[j] + n, ends[j])]
            pos[j] += piece.shape[0]
            iv = ivec() if online_ivectors and rng.random() < 0.3 else None
            logs[j].append(("push", piece, iv))
            if rng.random() < alone_prob:
                outs[j].append(s.push(piece, iv))      # this chunk computed alone
            else:
                s.feed(piece, iv)
            if pos[j] >= ends[j]:
                s.end_input()
                logs[j].append(("end",))
            if rng.random() < export_prob:
                streams[j] = s = model.import_stream(s.export_state())
        # step() computes one chunk per stream, so a stream may fall behind; with online
        # i-vectors the chunk/i-vector pairing must match the alone runs, so advance all.
        if online_ivectors or rng.random() < 0.5:
            new = batcher.advance(streams)
        else:
            new = batcher.step(streams)
        for j, o in enumerate(new):
            outs[j].append(o)
        if all(s.finished for s in streams):
            break
    for j, o in enumerate(batcher.advance(streams)):
        outs[j].append(o)
    assert all(s.finished for s in streams), "every stream ends once its input ended"
    return [np.concatenate(o, axis=0) for o in outs], logs, batcher


def replay_alone(model: LoopedModel, log) -> np.ndarray:
    s = model.stream(log[0][1])
    pieces = []
    for entry in log[1:]:
        if entry[0] == "push":
            pieces.append(s.push(entry[1], entry[2]))
    pieces.append(s.finish())
    return np.concatenate(pieces, axis=0)


# -- small networks (always) ----------------------------------------------------------------

CASES = [  # (network, chunk, extra left context initial, subsampling, online i-vectors)
    (RECURRENT, 5, 0, 1, False),
    (RECURRENT, 4, 3, 2, False),
    (TDNN_IVECTOR, 6, 0, 3, True),
    (TDNN_PLAIN, 5, 2, 1, False),
    (RECURRENT_IVECTOR, 6, 2, 2, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"c{c[1]}e{c[2]}f{c[3]}")
@pytest.mark.parametrize("seed", [1, 2])
def test_random_mix_equals_streams_alone(case, seed):
    config, chunk, elci, fsf, online = case
    model = looped(config, chunk, elci, fsf)
    got, logs, batcher = simulate(model, seed * 101 + chunk, online_ivectors=online,
                                  max_batch_size=4 if seed == 2 else 16)
    for j, log in enumerate(logs):
        ref = replay_alone(model, log)
        assert_float32_equal(got[j], ref, f"stream {j}")
    # the streams were really batched: fewer computations than chunks
    total_chunks = sum(int(np.ceil(g.shape[0] / (model.chunk_size // fsf))) for g in got)
    assert batcher.num_runs < total_chunks


def test_padded_batch_sizes():
    """Groups run in the smallest allowed compiled size, spare sequences discarded."""
    model = LoopedModel(make_nnet(RECURRENT), LoopedConfig(5, 0, 1))
    got, logs, batcher = simulate(model, 7, num_streams=7, max_batch_size=16,
                                  batch_sizes=[4], alone_prob=0.0, export_prob=0.2)
    for j, log in enumerate(logs):
        assert_float32_equal(got[j], replay_alone(model, log), f"stream {j}")
    assert set(model.batch_plans) == {4}


def test_first_and_steady_state_chunks_in_one_call():
    """Streams in their first chunk, just before the loop closes, in steady state and
    finishing are all advanced by one call (grouped by phase), matching alone runs."""
    model = looped(RECURRENT_IVECTOR, 6, 2, 2)
    x = feats(80, seed=4)
    iv = feats(1, 3, seed=5)[0]
    batcher = StreamBatcher(model)
    streams = [model.stream(iv) for _ in range(5)]
    done = [0, 6, 12, 30, 42]       # frames already given, streams at different chunks
    for s, n in zip(streams, done):
        s.push(x[:n])
    for s, n in zip(streams, done):
        s.feed(x[n:n + 13])
    streams[4].end_input()
    phases = {(s.executor._pc, tuple(s.executor._pending)) for s in streams}
    assert len(phases) >= 3
    groups = batcher.groups(streams)
    assert sorted(i for g in groups for i in g) == [i for i, s in enumerate(streams)
                                                    if s.chunk_ready]
    assert len(groups) == len({(streams[g[0]].executor._pc,) for g in groups}) <= len(phases)
    assert StreamBatcher(model, max_batch_size=1).groups(streams) == [[i] for g in groups
                                                                      for i in g]
    runs = batcher.num_runs
    outs = batcher.advance(streams)
    assert batcher.num_runs - runs < sum(o.shape[0] for o in outs) // 3
    assert streams[4].finished and not streams[0].finished
    for s, n, o in zip(streams, done, outs):
        alone = model.stream(iv)
        first = alone.push(x[:n])
        rest = alone.push(x[n:n + 13])
        if s is streams[4]:
            rest = np.concatenate([rest, alone.finish()])
        assert_float32_equal(o, rest, f"stream after {n} frames")
        assert first.shape[0] + rest.shape[0] == s.num_output_frames


def test_export_import_between_batched_advances():
    model = looped(RECURRENT, 5)
    xs = [feats(n, seed=n) for n in (47, 33, 52)]
    batcher = StreamBatcher(model)
    streams = [model.stream() for _ in xs]
    outs = [[] for _ in xs]
    for k in range(0, 60, 7):
        for s, x in zip(streams, xs):
            if not s.input_ended:
                s.feed(x[k:k + 7])
                if k + 7 >= len(x):
                    s.end_input()
        for j, o in enumerate(batcher.advance(streams)):
            outs[j].append(o)
        if not streams[1].finished:
            # another process's model object takes the state as well
            other = LoopedModel(make_nnet(RECURRENT), LoopedConfig(5, 0, 1)) if k == 14 else model
            streams[1] = other.import_stream(streams[1].export_state())
    for j, x in enumerate(xs):
        s = model.stream()
        ref = np.concatenate([s.push(x), s.finish()])
        assert_float32_equal(np.concatenate(outs[j]), ref, f"stream {j}")


@pytest.mark.parametrize("kind", ["rnn", "rnn_clockwork", "fast_lstm", "gru", "tdnnf"])
def test_random_recurrent_networks(kind):
    """Kaldi's random test architectures (engine.nnet.random_config), looped with a
    random chunk configuration: batched streams equal streams alone."""
    from engine.nnet.random_config import GenerationOptions, generate_config_sequence
    rng = np.random.default_rng(3)
    nnet = generate_config_sequence(rng, GenerationOptions(dim_scale=0.3), kind=kind).build(rng)
    model = LoopedModel(nnet, LoopedConfig(int(rng.integers(3, 9)), int(rng.integers(0, 3)),
                                           int(rng.integers(1, 3))))
    got, logs, batcher = simulate(model, 5, num_streams=5, max_len=40,
                                  online_ivectors=model.has_ivectors)
    for j, log in enumerate(logs):
        assert_float32_equal(got[j], replay_alone(model, log), f"{kind} stream {j}")
    assert not batcher.unbatchable
    assert all(p.batchable for p in model.batch_plans[max(model.batch_plans)].phases.values())


def test_unbatchable_phases_run_alone():
    """Where the batched computation carries other matrices than the single one, the
    streams of that phase are computed one by one, with the same results."""
    model = looped(STATS, 4)
    got, logs, batcher = simulate(model, 3, num_streams=4, max_len=40, export_prob=0.0)
    for j, log in enumerate(logs):
        assert_float32_equal(got[j], replay_alone(model, log), f"stream {j}")
    plan = batch_plan(model, 2)
    blocked = [p for p in plan.phases.values() if not p.batchable]
    assert blocked and all(p.reason for p in blocked)
    s, t = model.stream(), model.stream()
    s.feed(feats(40))
    t.feed(feats(40, seed=2))
    if not plan.batchable(s):
        with pytest.raises(StreamError, match="cannot be batched"):
            plan.run([s, t], [s.chunk_inputs(*s.next_chunk()), t.chunk_inputs(*t.next_chunk())])


def test_batch_plan_cache_and_phases():
    model = looped(TDNN_PLAIN, 5)
    plan = batch_plan(model, 3)
    assert batch_plan(model, 3) is plan
    assert plan.phases[(0, ())].pairs == []          # the first chunk carries nothing in
    steady = [p for p in plan.phases.values() if p.pairs]
    assert steady, "the state after a chunk is carried"
    for p in steady:
        for i, j, rows in p.pairs:
            assert rows.shape == (3, model.computation.matrices[i].num_rows)
            assert plan.computation.matrices[j].num_rows == 3 * rows.shape[1]
            assert sorted(rows.reshape(-1).tolist()) == list(range(3 * rows.shape[1]))


def test_errors():
    model = looped(TDNN_PLAIN, 5)
    other = looped(TDNN_PLAIN, 10)
    batcher = StreamBatcher(model)
    s = model.stream()
    with pytest.raises(StreamError, match="twice"):
        batcher.step([s, s])
    with pytest.raises(StreamError, match="another model"):
        batcher.step([s, other.stream()])
    with pytest.raises(InferenceError, match="at least 2"):
        BatchPlan(model, 1)
    with pytest.raises(InferenceError, match="single-stream"):
        StreamBatcher(LoopedModel(make_nnet(TDNN_PLAIN), LoopedConfig(5, 0, 1), num_sequences=2))
    with pytest.raises(InferenceError, match="max_batch_size"):
        StreamBatcher(model, max_batch_size=0)
    a, b = model.stream(), model.stream()
    a.push(feats(20))
    a.feed(feats(5))
    b.feed(feats(20))
    with pytest.raises(StreamError, match="same phase"):
        batch_plan(model, 2).run([a, b], [a.chunk_inputs(*a.next_chunk()),
                                          b.chunk_inputs(*b.next_chunk())])
    s.feed(feats(20))
    s.end_input()
    with pytest.raises(StreamError, match="end_input"):
        s.feed(feats(2))
    batcher.advance([s])
    assert s.finished and s.num_output_frames == 20
    with pytest.raises(StreamError, match="twice"):
        s.finish()
    # a stream with no frames at all ends without output
    e = model.stream()
    e.end_input()
    assert batcher.advance([e])[0].shape == (0, model.output_dim) and e.finished


# -- Kaldi reference models (when ../shared/kaldi-ref exists) ----------------------------------


@pytest.mark.skipif(SHARED is None, reason="../shared/kaldi-ref not present (full set)")
@pytest.mark.parametrize("model_dir", model_dirs(SHARED, "looped.json"), ids=lambda p: p.name)
def test_kaldi_looped_reference_batched(model_dir):
    """Each utterance twice, starting at different times and cut differently, one
    stream exported and imported mid-way: Kaldi's looped-decodable outputs."""
    js = read_json(model_dir / "looped.json")
    z = np.load(model_dir / "looped.npz")
    nnet = load_model(model_file(model_dir)).nnet
    rng = np.random.default_rng(11)
    for setting in js["settings"]:
        model = LoopedModel(nnet, kaldi_looped_config(nnet, setting))
        prefix = f"output.{setting['key']}."
        utts = [k[len(prefix):] for k in z.files if k.startswith(prefix)] * 2
        streams = [model.stream(z.get(f"ivector.{u}")) for u in utts]
        xs = [z[f"features.{u}"] for u in utts]
        batcher = StreamBatcher(model, batch_sizes=[len(utts)])
        outs = [[] for _ in utts]
        pos = [0] * len(utts)
        for rnd in range(200):
            for j, s in enumerate(streams):
                if rnd < (0, 0, 1, 3)[j % 4] or s.input_ended:
                    continue
                n = int(rng.integers(10, 45))
                s.feed(xs[j][pos[j]:pos[j] + n])
                pos[j] += n
                if pos[j] >= len(xs[j]):
                    s.end_input()
            for j, o in enumerate(batcher.advance(streams)):
                outs[j].append(o)
            if rnd == 4 and not streams[1].finished:     # (a short utterance may be done)
                streams[1] = model.import_stream(streams[1].export_state())
            if all(s.finished for s in streams):
                break
        for j, u in enumerate(utts):
            assert_close(np.concatenate(outs[j]), z[prefix + u],
                         f"{model_dir.name} {setting['key']} {u} (stream {j})")
