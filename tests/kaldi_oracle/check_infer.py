"""nnet3-compute and Kaldi's looped decodable against nnetc on random settings.

    python tests/kaldi_oracle/check_infer.py BIN_DIR MODEL N SEED [--looped] [--options]

MODEL: a .raw or .mdl.  N random cases: utterance length 1-259 frames, frames-per-chunk
1/7/20/50/150, extra left/right context, extra-left-context-initial,
extra-right-context-final, frame-subsampling-factor 1 or 3, and (for models with an
i-vector input) a per-utterance i-vector or online i-vectors at period 1/3/10 with a few rows
too many or too few.  Each runs through BIN_DIR/geninfer (Kaldi's DecodableNnetSimple, the
model in test mode and collapsed, as nnet3-compute) and engine.inference.Inferencer; with
--looped also DecodableNnetSimpleLooped against a stream (engine.inference.stream, random
push sizes; online i-vector rows pushed with the frames they describe, give or take a few).
Both refusing a case counts as agreeing."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from oracle_io import complaint, read_matrices, write_matrices

from engine.inference.looped import LoopedConfig  # noqa: E402
from engine.inference.simple import InferenceOptions, Inferencer  # noqa: E402
from engine.inference.stream import LoopedModel  # noqa: E402
from engine.nnet.model_io import load_model  # noqa: E402
from test_compile_reference import read_options  # noqa: E402


KALDI_MERGE_ASSERT = "FirstNontrivialMatrixAccess(m_to_discard) > alloc_keep"


def kaldi(binary: Path, model: str, mats: dict, looped: bool, o: dict, period: int,
          opt_seed: int | None = None):
    """(Kaldi's output, None) or (None, its complaint); with ``opt_seed`` (looped only) also
    the optimizer options it drew, else None: (output, complaint, options)."""
    with tempfile.TemporaryDirectory() as d:
        write_matrices(Path(d) / "in.txt", mats)
        args = [str(binary), model, f"{d}/in.txt", f"{d}/out.txt", str(int(looped))] + [
            str(o[k]) for k in ("frames_per_chunk", "extra_left_context", "extra_right_context",
                                "extra_left_context_initial", "extra_right_context_final",
                                "frame_subsampling_factor")] + [str(period)]
        if opt_seed is not None:
            args.append(str(opt_seed))
        p = subprocess.run(args, capture_output=True, text=True)
        opts = read_options(Path(f"{d}/out.txt.options.json"))
        if p.returncode:
            return None, complaint(p.stderr, p.returncode), opts
        return read_matrices(Path(d) / "out.txt")["output"], None, opts


def stream_through(lm, feats, iv, online, period, rng) -> np.ndarray:
    """The stream's output for ``feats`` pushed in random pieces; online i-vector rows
    (if any) arrive with the frames they describe, give or take a few, the rest
    before finish()."""
    T = feats.shape[0]
    s = lm.stream(iv) if online is None else lm.stream(online_ivector_period=period)
    pieces, pos, rows_sent = [], 0, 0
    while pos < T:
        step = int(rng.integers(1, 40))
        new_rows = None
        if online is not None:
            want = min(online.shape[0], max(0, (pos + step) // period + int(rng.integers(-2, 3))))
            if want > rows_sent:
                new_rows, rows_sent = online[rows_sent:want], want
        pieces.append(s.push(feats[pos:pos + step], online_ivectors=new_rows))
        pos += step
    if online is not None and rows_sent < online.shape[0]:
        pieces.append(s.push(feats[:0], online_ivectors=online[rows_sent:]))
    pieces.append(s.finish())
    return np.concatenate(pieces, axis=0)


def main() -> None:
    bin_dir, model_path, n, seed = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    looped_too = "--looped" in sys.argv
    # --options: the looped runs optimized with options drawn at random per case (Kaldi's
    # and ours the same); offline runs as without it
    with_options = "--options" in sys.argv
    m = load_model(model_path)
    nnet = m.nnet
    rng = np.random.default_rng(seed)
    in_dim = nnet.input_dim("input")
    iv_dim = nnet.input_dim("ivector") if nnet.get_node_index("ivector") >= 0 else 0
    bad = compared = kaldi_asserts = 0
    for k in range(n):
        o = dict(frames_per_chunk=int(rng.choice([1, 7, 20, 50, 150])),
                 extra_left_context=int(rng.choice([0, 0, 5, 40])),
                 extra_right_context=int(rng.choice([0, 0, 3])),
                 extra_left_context_initial=int(rng.choice([-1, -1, 0, 10])),
                 extra_right_context_final=int(rng.choice([-1, -1, 0, 4])),
                 frame_subsampling_factor=int(rng.choice([1, 1, 3])))
        T = int(rng.integers(1, 260))
        feats = rng.standard_normal((T, in_dim)).astype(np.float32)
        mats = {"features": feats}
        period, iv, online = 0, None, None
        if iv_dim:
            if rng.random() < 0.5:
                iv = rng.standard_normal(iv_dim).astype(np.float32)
                mats["ivector"] = iv[None]
            else:
                period = int(rng.choice([1, 3, 10]))
                rows = max(1, -(-T // period) + int(rng.integers(-3, 2)))
                online = rng.standard_normal((rows, iv_dim)).astype(np.float32)
                mats["online"] = online
        for looped in ([False, True] if looped_too else [False]):
            opt_seed = seed * 1000 + k if (looped and with_options) else None
            ref, kerr, opts = kaldi(bin_dir / "geninfer", model_path, mats, looped, o, period,
                                    opt_seed)
            tag = f"case {k}: T={T} looped={looped} period={period} {o}"
            if opts is not None:
                tag += f" options {opts.to_dict()}"
            try:
                if looped:
                    # (a BLSTM's backward recurrence cut at chunk ends, as Kaldi does)
                    lm = LoopedModel(nnet, LoopedConfig(o["frames_per_chunk"],
                                                        max(0, o["extra_left_context_initial"]),
                                                        o["frame_subsampling_factor"],
                                                        truncate_future_recurrence=True),
                                     optimize_options=opts)
                    ours = stream_through(lm, feats, iv, online, period, rng)
                else:
                    ours = Inferencer(nnet, InferenceOptions(**o), priors=m.priors).infer(
                        feats, iv, online, period)
                oerr = None
            except Exception as e:  # noqa: BLE001
                ours, oerr = None, f"{type(e).__name__}: {e}"
            if ref is None and ours is None:
                continue
            compared += 1
            if ref is None and ours is not None and KALDI_MERGE_ASSERT in kerr:
                # Kaldi's own limit with a merge direction switched off; nnetc declines
                # that merge (variable_merging.py _alloc_precedes) and computes
                kaldi_asserts += 1
                print(f"Kaldi asserts ({kerr}), nnetc computes: {tag}")
                continue
            if ref is None or ours is None:
                bad += 1
                print(f"FAIL, one side refuses: {tag}\n    kaldi: {kerr}\n    ours: {oerr}")
            elif ours.shape != ref.shape:
                bad += 1
                print(f"FAIL, shape {ours.shape} vs {ref.shape}: {tag}")
            elif ref.size:
                err = float(np.max(np.abs(ours - ref)))
                tol = 1e-4 + 2e-3 * float(np.max(np.abs(ref)))
                if err > tol:
                    bad += 1
                    print(f"FAIL, max error {err:.3g} > {tol:.3g}: {tag}")
    print(f"{Path(model_path).name}: {bad} failing of {compared} compared"
          + (f" ({kaldi_asserts} of them Kaldi's merge assertion, see above)"
             if kaldi_asserts else ""))


if __name__ == "__main__":
    main()
