"""Looped compilation and Streams (engine.inference.looped/stream, `nnetc stream`):
Kaldi's looped-decodable references, streaming == offline for any cutting,
export/import of the state, and typed errors."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refdata import shared_ref
from engine.compiler.computation import CommandType as CT
from engine.core.errors import InferenceError, StreamError
from engine.inference import InferenceOptions, Inferencer
from engine.inference.looped import (LoopedConfig, create_looped_requests, extrapolate_request,
                                     get_chunk_size, modify_nnet_ivector_period)
from engine.inference.stream import LoopedModel
from engine.nnet.model_io import Model, load_model, save_model
from inference_nets import (RECURRENT, TDNN_IVECTOR, TDNN_PLAIN, assert_close, feats,
                            kaldi_looped_config, make_nnet, model_dirs, model_file, read_json)

SHARED = shared_ref()

_MODELS: dict = {}


def looped(config_text: str, chunk: int = 6, elci: int = 0, fsf: int = 1) -> LoopedModel:
    key = (config_text, chunk, elci, fsf)
    if key not in _MODELS:
        _MODELS[key] = LoopedModel(make_nnet(config_text), LoopedConfig(chunk, elci, fsf))
    return _MODELS[key]


def run_stream(model: LoopedModel, x, cuts, ivector=None, reimport_at=()):
    s = model.stream(ivector)
    pieces, pos = [], 0
    for k, n in enumerate(cuts):
        pieces.append(s.push(x[pos:pos + n]))
        pos += n
        if k in reimport_at:
            s = model.import_stream(s.export_state())
    pieces.append(s.push(x[pos:]))
    pieces.append(s.finish())
    return np.concatenate(pieces, axis=0)


def drive_batch(sb, xs, piece: int, after_advance=None) -> list[np.ndarray]:
    """Push ``xs`` (one per stream of StreamBatch ``sb``) ``piece`` frames at a time,
    finishing each stream when its frames run out; the outputs per stream."""
    got: list[list] = [[] for _ in xs]
    for start in range(0, max(len(x) for x in xs), piece):
        for j, x in enumerate(xs):
            if start < len(x):
                sb.push(j, x[start:start + piece])
            elif not sb.finished[j]:
                sb.finish(j)
        for j, o in enumerate(sb.advance()):
            got[j].append(o)
        if after_advance is not None:
            after_advance()
    for j in range(len(xs)):
        if not sb.finished[j]:
            sb.finish(j)
    for j, o in enumerate(sb.advance()):
        got[j].append(o)
    return [np.concatenate(g, axis=0) for g in got]


# -- Kaldi references ----------------------------------------------------------------------


@pytest.mark.skipif(SHARED is None, reason="../shared/kaldi-ref not present (full set)")
@pytest.mark.parametrize("model_dir", model_dirs(SHARED, "looped.json"), ids=lambda p: p.name)
def test_kaldi_looped_reference(model_dir):
    js = read_json(model_dir / "looped.json")
    z = np.load(model_dir / "looped.npz")
    nnet = load_model(model_file(model_dir)).nnet
    rng = np.random.default_rng(7)
    for s in js["settings"]:
        model = LoopedModel(nnet, kaldi_looped_config(nnet, s))
        for key in z.files:
            prefix = f"output.{s['key']}."
            if not key.startswith(prefix):
                continue
            utt = key[len(prefix):]
            x = z[f"features.{utt}"]
            cuts = rng.integers(1, 45, size=len(x) // 10)
            out = run_stream(model, x, cuts, z.get(f"ivector.{utt}"), reimport_at={2, 5})
            assert_close(out, z[key], f"{model_dir.name} {s['key']} {utt}")


# -- looped compilation ----------------------------------------------------------------------


def test_looped_requests_and_extrapolation():
    nnet = modify_nnet_ivector_period(make_nnet(TDNN_IVECTOR), 6)
    r1, r2, r3 = create_looped_requests(nnet, 6, 2, 6, 5, 4, num_sequences=2)
    assert [i.t for i in r1.inputs[0].indexes[:3]] == [-5, -4, -3]
    assert len(r1.inputs[0].indexes) == 2 * (5 + 6 + 4)
    assert [i.t for i in r2.inputs[0].indexes[:6]] == list(range(10, 16))
    assert [i.t for i in r1.outputs[0].indexes] == [0, 2, 4] * 2
    assert [i.n for i in r1.outputs[0].indexes] == [0, 0, 0, 1, 1, 1]
    # i-vector times: rounded down to the period, each listed once over all chunks
    assert [i.t for i in r1.inputs[1].indexes] == [-6, 0, 6] * 2
    assert [i.t for i in r2.inputs[1].indexes] == [12, 12]
    r4 = extrapolate_request(r2, r3)
    assert [i.t for i in r4.inputs[0].indexes[:2]] == [22, 23]
    with pytest.raises(InferenceError):
        extrapolate_request(r1, r2)
    line = [ln for ln in nnet.config_lines() if ln.startswith("component-node name=affine1")]
    assert "Round(ivector, 6)" in line[0] and "ReplaceIndex" not in line[0]


def test_looped_computation_ends_in_goto():
    model = looped(RECURRENT)
    cmds = model.computation.commands
    assert cmds[-1].command_type == CT.GOTO_LABEL
    assert any(c.command_type == CT.SWAP_MATRIX for c in cmds)
    assert get_chunk_size(model.nnet, 3, 7) == 9


# -- streaming == offline ------------------------------------------------------------------------


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_frames=st.integers(1, 60), data=st.data(), fsf=st.sampled_from([1, 2, 3]))
def test_stream_equals_offline_non_recurrent(num_frames, data, fsf):
    model = looped(TDNN_IVECTOR, chunk=6, fsf=fsf)
    x, iv = feats(num_frames, seed=num_frames), feats(1, 4, seed=3)[0]
    cuts = data.draw(st.lists(st.integers(0, 15), max_size=8))
    out = run_stream(model, x, cuts, iv)
    ref = Inferencer(make_nnet(TDNN_IVECTOR),
                     InferenceOptions(frames_per_chunk=12, frame_subsampling_factor=fsf)
                     ).infer(x, iv)
    assert_close(out, ref, f"T={num_frames} cuts={cuts} fsf={fsf}")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_frames=st.integers(1, 50), data=st.data(), elci=st.sampled_from([0, 4]))
def test_stream_recurrent_carries_state(num_frames, data, elci):
    """A recurrent stream equals one computation over the whole utterance (state is
    carried, never restarted), with the first chunk's extra left context."""
    model = looped(RECURRENT, chunk=5, elci=elci)
    x = feats(num_frames, seed=num_frames)
    cuts = data.draw(st.lists(st.integers(0, 12), max_size=8))
    out = run_stream(model, x, cuts)
    ref = Inferencer(make_nnet(RECURRENT),
                     InferenceOptions(frames_per_chunk=100, extra_left_context_initial=elci)
                     ).infer(x)
    assert_close(out, ref, f"T={num_frames} cuts={cuts}")


def test_outputs_arrive_as_soon_as_computable():
    model = looped(TDNN_PLAIN, chunk=6)           # context 4/4
    s = model.stream()
    assert s.push(feats(9)).shape == (0, 6)        # chunk 0 needs frames [-4, 10)
    assert s.push(feats(1, seed=2)).shape == (6, 6)
    assert s.push(feats(5, seed=3)).shape == (0, 6)
    assert s.push(feats(1, seed=4)).shape == (6, 6)
    assert s.finish().shape == (4, 6)             # 16 frames in all
    assert s.num_output_frames == 16


@pytest.mark.parametrize("cut", [0, 1, 2, 3, 5])
def test_export_import_continues_bit_identically(cut):
    model = looped(RECURRENT, chunk=5)
    x = feats(41)
    s = model.stream()
    first = s.push(x[:7 * cut + 3])
    clone = model.import_stream(s.export_state())
    # a fresh model object (as in another process) accepts the state too
    other = LoopedModel(make_nnet(RECURRENT), LoopedConfig(5, 0, 1))
    clone2 = other.import_stream(s.export_state())
    rest = [np.concatenate([st.push(x[7 * cut + 3:]), st.finish()]) for st in (s, clone, clone2)]
    np.testing.assert_array_equal(rest[0], rest[1])
    np.testing.assert_array_equal(rest[0], rest[2])
    assert first.shape[0] + rest[0].shape[0] == 41


def test_acoustic_scale_after_priors_kept_through_export_import():
    """The acoustic scale multiplies each output row after the log priors are taken
    off (Kaldi's looped decodable), in Stream, StreamBatch and the StreamBatcher, and
    travels with the stream's state."""
    from engine.inference.batch import StreamBatcher  # noqa: PLC0415
    from engine.inference.stream import STATE_VERSION, StreamBatch  # noqa: PLC0415
    nnet = make_nnet(RECURRENT)
    priors = np.linspace(0.05, 0.3, nnet.output_dim("output")).astype(np.float32)
    model = LoopedModel(nnet, LoopedConfig(5, 0, 1), priors=priors, use_priors=True)
    x = feats(33)
    plain = run_stream(model, x, [4, 9, 6])
    scale = 0.37
    want = plain * np.float32(scale)
    s = model.stream(acoustic_scale=scale)
    got = [s.push(x[:11])]
    state = s.export_state()
    clone = model.import_stream(state)
    assert clone.acoustic_scale == scale
    rest = [np.concatenate([t.push(x[11:]), t.finish()]) for t in (s, clone)]
    np.testing.assert_array_equal(np.concatenate([got[0], rest[0]]), want)
    np.testing.assert_array_equal(np.concatenate([got[0], rest[1]]), want)
    # the priors are subtracted before scaling: scaled output != (raw * scale) - priors
    raw = run_stream(LoopedModel(nnet, LoopedConfig(5, 0, 1)), x, [33])
    np.testing.assert_allclose(want, (raw - np.log(priors)) * scale, rtol=1e-5, atol=1e-6)
    # a caller that knows the scale: the same one is accepted, another refused
    assert model.import_stream(state, scale).acoustic_scale == scale
    with pytest.raises(StreamError, match="acoustic_scale 0.37, not 0.5"):
        model.import_stream(state, 0.5)
    # a state written before the scale was recorded takes the caller's (or 1)
    import io, json  # noqa: E401, PLC0415
    with np.load(io.BytesIO(state)) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes())
    assert meta["version"] == STATE_VERSION
    del meta["acoustic_scale"]
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    bio = io.BytesIO()
    np.savez(bio, **arrays)
    assert model.import_stream(bio.getvalue()).acoustic_scale == 1.0
    old = model.import_stream(bio.getvalue(), scale)
    np.testing.assert_array_equal(np.concatenate([old.push(x[11:]), old.finish()]), rest[0])
    # StreamBatch and the StreamBatcher scale as the Stream does
    model3 = LoopedModel(nnet, LoopedConfig(5, 0, 1), priors=priors, use_priors=True,
                         num_sequences=2)
    sb = StreamBatch(model3, acoustic_scale=scale)
    out = drive_batch(sb, [x, x[:20]], 7)
    # (two sequences per product: float32 rounding apart from one)
    np.testing.assert_allclose(out[0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[1], run_stream(model, x[:20], [20]) * np.float32(scale),
                               rtol=1e-5, atol=1e-6)
    streams = [model.stream(acoustic_scale=scale), model.stream()]
    batcher = StreamBatcher(model)
    pieces: list[list] = [[], []]
    for st_ in streams:
        st_.feed(x)
        st_.end_input()
    for j, o in enumerate(batcher.advance(streams)):
        pieces[j].append(o)
    np.testing.assert_allclose(np.concatenate(pieces[0]), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.concatenate(pieces[1]), plain, rtol=1e-5, atol=1e-6)
    for bad in (float("nan"), float("inf"), "2", True):
        with pytest.raises(InferenceError, match="acoustic_scale: must be a finite number"):
            model.stream(acoustic_scale=bad)
    with pytest.raises(InferenceError, match="acoustic_scale"):
        InferenceOptions(acoustic_scale=float("nan")).check()


# -- errors ---------------------------------------------------------------------------------------


def test_stream_errors():
    model = looped(TDNN_IVECTOR, chunk=6)
    iv = feats(1, 4)[0]
    with pytest.raises(InferenceError, match="no i-vector|none was given"):
        model.stream()
    with pytest.raises(InferenceError, match="dimension 4"):
        model.stream(np.zeros(3, np.float32))
    s = model.stream(iv)
    with pytest.raises(InferenceError, match="dimension 8"):
        s.push(feats(5, dim=7))
    s.push(feats(3))
    state = s.export_state()
    s.finish()
    with pytest.raises(StreamError, match="push after finish"):
        s.push(feats(2))
    with pytest.raises(StreamError, match="twice"):
        s.finish()
    with pytest.raises(StreamError, match="not readable"):
        model.import_stream(b"garbage")
    with pytest.raises(StreamError, match="another model"):
        looped(TDNN_IVECTOR, chunk=12).import_stream(state)
    with pytest.raises(StreamError, match="another model"):
        looped(TDNN_PLAIN).import_stream(state)
    with pytest.raises(InferenceError, match="no 'ivector' input"):
        looped(TDNN_PLAIN).stream(iv)
    with pytest.raises(InferenceError, match="chunk size"):
        LoopedModel(make_nnet(TDNN_PLAIN), LoopedConfig(0, 0, 1))
    with pytest.raises(InferenceError, match="extra_left_context_initial"):
        LoopedModel(make_nnet(TDNN_PLAIN), LoopedConfig(6, -1, 1))


def test_cli_stream(tmp_path):
    from service.cli import main
    nnet = make_nnet(TDNN_IVECTOR)
    save_model(Model(nnet), tmp_path / "m.raw", binary=False)
    x, iv = feats(37), feats(1, 4, seed=5)[0]
    np.save(tmp_path / "f.npy", x)
    np.save(tmp_path / "iv.npy", iv)
    args = ["stream", str(tmp_path / "m.raw"), "--features", str(tmp_path / "f.npy"),
            "--ivector", str(tmp_path / "iv.npy"), "--chunk-size", "5",
            "--frame-subsampling-factor", "3", "--extra-left-context-initial", "2",
            "--out", str(tmp_path / "o.npy")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    ref = Inferencer(nnet, InferenceOptions(frame_subsampling_factor=3)).infer(x, iv)
    assert_close(np.load(tmp_path / "o.npy"), ref, "nnetc stream")
    r = CliRunner().invoke(main, args[:-2] + ["--acoustic-scale", "0.25", "--out",
                                              str(tmp_path / "o4.npy")])
    assert r.exit_code == 0, r.output
    np.testing.assert_array_equal(np.load(tmp_path / "o4.npy"),
                                  np.load(tmp_path / "o.npy") * np.float32(0.25))
    r = CliRunner().invoke(main, args[:4] + ["--out", str(tmp_path / "o.npy")])
    assert r.exit_code == 2 and "i-vector" in r.output
    # Kaldi's option names and output options: --frames-per-chunk, --acoustic-scale;
    # --use-priors needs a .mdl
    scaled = [a if a != "--chunk-size" else "--frames-per-chunk" for a in args[:-2]] + [
        "--acoustic-scale", "0.25", "--out", str(tmp_path / "o2.npy")]
    r = CliRunner().invoke(main, scaled)
    assert r.exit_code == 0, r.output
    np.testing.assert_array_equal(np.load(tmp_path / "o2.npy"),
                                  np.load(tmp_path / "o.npy") * np.float32(0.25))
    r = CliRunner().invoke(main, args[:-2] + ["--use-priors", "--out", str(tmp_path / "o3.npy")])
    assert r.exit_code == 2 and "priors" in r.output


def test_stream_batch_equals_single_streams():
    from engine.inference.stream import StreamBatch
    nnet = make_nnet(TDNN_IVECTOR)
    single = looped(TDNN_IVECTOR, chunk=6)
    batch_model = LoopedModel(nnet, LoopedConfig(6, 0, 1), num_sequences=3)
    xs = [feats(n, seed=n) for n in (23, 9, 31)]
    ivs = [feats(1, 4, seed=10 + j)[0] for j in range(3)]
    sb = StreamBatch(batch_model, ivs)
    got = drive_batch(sb, xs, 5)
    for j, x in enumerate(xs):
        ref = run_stream(single, x, [], ivs[j])
        assert_close(got[j], ref, f"stream {j}")
    with pytest.raises(StreamError):
        sb.push(0, feats(2))


@pytest.mark.parametrize("config_text", [TDNN_PLAIN, TDNN_IVECTOR, RECURRENT])
def test_looped_models_decode_with_frozen_weights(config_text):
    """The streaming network (prepared, i-vector period rewritten) has read-only
    parameters, so the executor may use its transposed weight copies; the
    caller's network stays writeable."""
    nnet = make_nnet(config_text)
    model = LoopedModel(nnet, LoopedConfig(6, 0, 1))
    params = [getattr(c, p) for c in model.nnet.components for p in c.PARAMS]
    assert params and not any(a.flags.writeable for a in params if isinstance(a, np.ndarray))
    assert all(a.flags.writeable for c in nnet.components for p in c.PARAMS
               if isinstance(a := getattr(c, p), np.ndarray))


def test_concurrent_streams_of_one_model_equal_sequential_ones():
    """Streams of one LoopedModel share its dynamic program; the bound propagates
    each executor keeps (runtime/program._bound_for) are its own, so streams run
    at the same time in threads give exactly what they give one after another."""
    import threading  # noqa: PLC0415
    for config in (RECURRENT, TDNN_PLAIN):
        model = LoopedModel(make_nnet(config), LoopedConfig(5, 0, 1))
        xs = [feats(40 + 7 * j, seed=j) for j in range(4)]
        want = [run_stream(model, x, [3, 11, 2, 9]) for x in xs]
        got: list = [None] * len(xs)

        def work(j):
            for _ in range(3):
                got[j] = run_stream(model, xs[j], [3, 11, 2, 9])
        threads = [threading.Thread(target=work, args=(j,)) for j in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for g, w in zip(got, want):
            assert np.array_equal(g, w)
        s = model.stream()
        s.push(xs[0])
        if s.executor.xp is np:      # the bound fast propagates are NumPy's (program.py)
            from engine.runtime.program import _BOUND_ENTRIES  # noqa: PLC0415
            bound = s.executor._dyn_bound
            assert bound and all(len(v) <= _BOUND_ENTRIES for v in bound.values())


@pytest.mark.parametrize("config", [RECURRENT, TDNN_PLAIN, TDNN_IVECTOR],
                         ids=["recurrent", "tdnn", "tdnn_ivector"])
def test_a_streams_steady_chunks_bind_no_new_fast_paths(config, monkeypatch):
    """The pool buffers a stream's chunks run on come round in a cycle (the chunk's
    allocations, deallocations and swaps through last-in-first-out free lists); the
    bindings each command keeps (runtime/program._bound_for) cover it, so once the
    stream is past its first chunks nothing is bound again.  (With the two bindings
    kept before, these networks bound 3-5 propagates anew every chunk.)"""
    import engine.runtime.program as program  # noqa: PLC0415
    model = LoopedModel(make_nnet(config), LoopedConfig(5, 0, 1))
    s = model.stream(feats(1, model.ivector_dim, seed=3)[0] if model.has_ivectors else None)
    if s.executor.xp is not np:
        pytest.skip("the bound fast propagates are NumPy's (runtime/program.py)")
    x = feats(400, seed=2)
    for i in range(0, 100, 5):
        s.push(x[i:i + 5])
    binds = []
    real = program.bind_propagate
    monkeypatch.setattr(program, "bind_propagate", lambda *a: binds.append(1) or real(*a))
    for i in range(100, 400, 5):
        s.push(x[i:i + 5])
    assert s.chunks_computed > 70 and not binds


def _deep_tdnn(layers: int = 5, dim: int = 24) -> str:
    """A TDNN of ``layers`` affine+ReLU layers of one width: several matrices of one
    shape are live at once in a chunk, as in the reference TDNN."""
    lines = ["input-node name=input dim=8",
             f"component name=a0 type=AffineComponent input-dim=24 output-dim={dim}",
             "component-node name=a0 component=a0 input=Append(Offset(input, -1), input, "
             "Offset(input, 1))",
             f"component name=r0 type=RectifiedLinearComponent dim={dim}",
             "component-node name=r0 component=r0 input=a0"]
    for i in range(1, layers):
        off = 1 if i == 1 else 3
        lines += [f"component name=a{i} type=NaturalGradientAffineComponent "
                  f"input-dim={3 * dim} output-dim={dim}",
                  f"component-node name=a{i} component=a{i} input=Append(Offset(r{i - 1}, "
                  f"-{off}), r{i - 1}, Offset(r{i - 1}, {off}))",
                  f"component name=r{i} type=RectifiedLinearComponent dim={dim}",
                  f"component-node name=r{i} component=r{i} input=a{i}"]
    lines += [f"component name=out type=AffineComponent input-dim={dim} output-dim=6",
              f"component-node name=out component=out input=r{layers - 1}",
              "output-node name=output input=out"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("config", [_deep_tdnn(), RECURRENT, TDNN_IVECTOR],
                         ids=["deep_tdnn", "recurrent", "tdnn_ivector"])
def test_streams_interleaved_on_one_pool_bind_no_new_fast_paths(config, monkeypatch):
    """Streams of one model share its pool; each takes back the buffers it released
    (BufferPool owners), so, pushed in turn, they bind nothing past their first
    chunks either, and each gives the output it gives alone.  (Without owners each
    took the buffers the one before had just released: the deep TDNN bound 2160
    propagates over these 240 chunks.)"""
    import engine.runtime.program as program  # noqa: PLC0415
    model = LoopedModel(make_nnet(config), LoopedConfig(5, 0, 1))
    iv = feats(1, model.ivector_dim, seed=3)[0] if model.has_ivectors else None
    streams = [model.stream(iv) for _ in range(4)]
    if streams[0].executor.xp is not np:
        pytest.skip("the bound fast propagates are NumPy's (runtime/program.py)")
    xs = [feats(400, seed=10 + j) for j in range(4)]
    outs: list[list] = [[] for _ in streams]

    def push(begin, end):
        for j, s in enumerate(streams):
            outs[j].append(s.push(xs[j][begin:end]))

    for i in range(0, 100, 5):
        push(i, i + 5)
    binds = []
    real = program.bind_propagate
    monkeypatch.setattr(program, "bind_propagate", lambda *a: binds.append(1) or real(*a))
    for i in range(100, 400, 5):
        push(i, i + 5)
    assert all(s.chunks_computed > 70 for s in streams) and not binds
    monkeypatch.setattr(program, "bind_propagate", real)
    for j, s in enumerate(streams):
        alone = model.stream(iv)
        want = np.concatenate([alone.push(xs[j]), alone.finish()])
        got = np.concatenate(outs[j] + [s.finish()])
        assert np.array_equal(got, want), f"stream {j}"


def test_a_stream_pushed_from_another_thread_runs_on_that_threads_temporaries(monkeypatch):
    """The bound fast paths of a stream's executor (runtime/program._bound_for) hold
    the temporaries of the thread that bound them (Program.dyn_scratch, one set per
    thread).  A stream pushed from one thread and then another must not keep using
    the first thread's set, which that thread's other streams are using meanwhile: its
    bindings are made again on the new thread.  (They were kept: every bound call of
    the second push ran on the first thread's temporaries.)"""
    import threading  # noqa: PLC0415

    import engine.runtime.program as program  # noqa: PLC0415
    model = LoopedModel(make_nnet(_deep_tdnn()), LoopedConfig(5, 0, 1))
    s = model.stream()
    if s.executor.xp is not np:
        pytest.skip("the bound fast propagates are NumPy's (runtime/program.py)")
    prog = s.executor._get_program()
    calls: list = []
    real = program.bind_propagate

    def spy(ctype, a, b, scratch):
        f = real(ctype, a, b, scratch)
        if f is None:
            return None

        def g(*args):
            calls.append(scratch is prog.dyn_scratch())
            return f(*args)
        return g

    monkeypatch.setattr(program, "bind_propagate", spy)
    x = feats(200, seed=4)
    want = np.concatenate([model.stream().push(x[:100])])
    got = [s.push(x[:50])]
    worker = threading.Thread(target=lambda: got.append(s.push(x[50:100])))
    worker.start()
    worker.join()
    assert len(calls) > 20 and all(calls), f"{calls.count(False)} of {len(calls)} calls"
    assert np.array_equal(np.concatenate(got), want)


def test_a_stream_pushed_from_two_threads_in_turn_keeps_each_threads_bindings(monkeypatch):
    """An executor keeps the bindings of the last few threads it ran on
    (Executor._switch_thread): a stream pushed from two threads in turn binds
    nothing past its first chunks on each, and gives the output it gives alone.
    (Made anew at every change of thread, they cost 13-27 new bindings a chunk on
    the reference TDNN and TDNN-F.)"""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    import engine.runtime.program as program  # noqa: PLC0415
    model = LoopedModel(make_nnet(_deep_tdnn()), LoopedConfig(5, 0, 1))
    s = model.stream()
    if s.executor.xp is not np:
        pytest.skip("the bound fast propagates are NumPy's (runtime/program.py)")
    x = feats(400, seed=6)
    alone = model.stream()
    want = np.concatenate([alone.push(x), alone.finish()])
    binds: list = []
    real = program.bind_propagate
    got = []
    with ThreadPoolExecutor(1) as a, ThreadPoolExecutor(1) as b:
        for k, i in enumerate(range(0, 400, 5)):
            if i == 100:
                monkeypatch.setattr(program, "bind_propagate",
                                    lambda *args: binds.append(1) or real(*args))
            got.append((a if k % 2 else b).submit(s.push, x[i:i + 5]).result())
    assert s.chunks_computed > 70 and not binds
    monkeypatch.setattr(program, "bind_propagate", real)
    assert np.array_equal(np.concatenate(got + [s.finish()]), want)


def test_streams_pushed_from_a_thread_pool_give_what_they_give_alone():
    """Streams of one model, each push handed to a pool of two threads (so a stream's
    pushes hop between threads while the other thread runs another stream): every
    stream's output is bit-identical to the stream run alone.  (With the bindings
    kept across threads, 24 of 30 such streams came out wrong in one run: two
    streams computed in the same temporaries at once.)"""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415
    model = LoopedModel(make_nnet(_deep_tdnn(6, 256)), LoopedConfig(20, 0, 1))
    xs = [feats(300, seed=20 + j) for j in range(6)]
    want = []
    for x in xs:
        s = model.stream()
        want.append(np.concatenate([s.push(x), s.finish()]))
    streams = [model.stream() for _ in xs]
    outs: list[list] = [[] for _ in xs]
    with ThreadPoolExecutor(2) as pool:
        for i in range(0, 300, 10):
            futures = [pool.submit(lambda j=j: outs[j].append(streams[j].push(xs[j][i:i + 10])))
                       for j in range(len(xs))]
            for f in futures:
                f.result()
    for j, s in enumerate(streams):
        assert np.array_equal(np.concatenate(outs[j] + [s.finish()]), want[j]), f"stream {j}"


def test_stream_batch_keeps_only_the_frames_later_chunks_read():
    """A long StreamBatch holds a bounded window of frames (not the whole history)
    and still equals single streams."""
    from engine.inference.stream import StreamBatch
    model = LoopedModel(make_nnet(RECURRENT), LoopedConfig(5, 0, 1), num_sequences=2)
    single = looped(RECURRENT, chunk=5)
    xs = [feats(400, seed=3), feats(377, seed=4)]
    sb = StreamBatch(model)
    bound = model.chunk_size + model.frames_left_context + model.frames_right_context + 7
    windows = []
    got = drive_batch(sb, xs, 7, after_advance=lambda: windows.append(
        max(f.shape[0] for f in sb.frames)))
    assert len(windows) > 50 and max(windows) <= bound
    for j, x in enumerate(xs):
        assert_close(got[j], run_stream(single, x, []), f"stream {j}")


def test_executor_state_api_checks_what_it_restores():
    """Executor.position / matrices / restore_state (what stream export/import and
    StreamBatcher use): a state moved to a fresh executor continues the stream to
    the bit; out-of-range positions and wrong matrix counts are refused."""
    from engine.core.errors import ExecutionError  # noqa: PLC0415
    from engine.runtime.executor import Executor  # noqa: PLC0415
    model = looped(RECURRENT, chunk=6)
    x = feats(40)
    a = model.stream()
    a.push(x[:20])
    b = model.stream()
    b.push(x[:20])
    # move a's state into a fresh executor and go on with it
    fresh = Executor(model.computation, model.nnet, pool=model.pool)
    fresh.restore_state(a.executor.position, [None if m is None else m.copy()
                                              for m in a.executor.matrices])
    a.executor = fresh
    assert not fresh.holds_memos
    out_a = np.concatenate([a.push(x[20:]), a.finish()])
    out_b = np.concatenate([b.push(x[20:]), b.finish()])
    assert np.array_equal(out_a, out_b)
    n = len(model.computation.commands)
    with pytest.raises(ExecutionError, match="out of range"):
        fresh.restore_state((n + 1, ()), [None] * len(model.computation.matrices))
    with pytest.raises(ExecutionError, match="matrices given"):
        fresh.restore_state((0, ()), [None])
