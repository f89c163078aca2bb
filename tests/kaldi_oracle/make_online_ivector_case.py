"""Kaldi's looped decodable with an online i-vector matrix, as a fixed test case.

    python tests/kaldi_oracle/make_online_ivector_case.py BIN_DIR OUT_DIR [--offline]

Writes OUT_DIR/model.raw (a small recurrent network with an 'ivector' input, random
parameters), OUT_DIR/case.npz (features; per setting the online i-vector rows and
the output of BIN_DIR/geninfer, i.e. DecodableNnetSimpleLooped) and OUT_DIR/case.json
(the settings).  tests/data/inference/online_ivectors was made with it; CI reads that
copy (tests/engine/test_stream_online_ivectors.py).  With --offline it reads the
model.raw and features already in OUT_DIR and writes offline.npz / offline.json: the
same with Kaldi's DecodableNnetSimple (nnet3-compute's --online-ivectors), for
tests/engine/test_inference.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from check_infer import kaldi

from engine.nnet.nnet import Nnet  # noqa: E402
from engine.nnet.model_io import Model, save_model  # noqa: E402

CONFIG = """\
input-node name=input dim=13
input-node name=ivector dim=8
component name=affine1 type=NaturalGradientAffineComponent input-dim=47 output-dim=32
component-node name=affine1 component=affine1 input=Append(Offset(input, -1), input, Offset(input, 1), ReplaceIndex(ivector, t, 0))
component name=relu1 type=RectifiedLinearComponent dim=32
component-node name=relu1 component=relu1 input=affine1
component name=rec type=NaturalGradientAffineComponent input-dim=64 output-dim=32
component-node name=rec component=rec input=Append(relu1, IfDefined(Offset(tanh, -1)))
component name=tanh type=TanhComponent dim=32
component-node name=tanh component=tanh input=rec
component name=out type=NaturalGradientAffineComponent input-dim=40 output-dim=10
component-node name=out component=out input=Append(tanh, ReplaceIndex(ivector, t, 0))
component name=logsm type=LogSoftmaxComponent dim=10
component-node name=logsm component=logsm input=out
output-node name=output input=logsm
"""

# (key, frames per chunk, extra left context initial, subsampling, period, rows beyond
# ceil(T / period): too few (< 0) or too many (> 0))
SETTINGS = [("fpc20_elci0_fsf1_p10", 20, 0, 1, 10, 0),
            ("fpc7_elci5_fsf1_p3_short", 7, 5, 1, 3, -4),
            ("fpc21_elci0_fsf3_p1_long", 21, 0, 3, 1, 3),
            ("fpc1_elci0_fsf1_p4", 1, 0, 1, 4, 0)]
T = 90

# offline (nnet3-compute): (key, frames per chunk, extra left/right context, extra left
# context initial, extra right context final, subsampling, period, rows beyond ceil(T / period))
OFFLINE = [("fpc50_p10", 50, 0, 0, -1, -1, 1, 10, 0),
           ("fpc7_elc3_erc2_p3_short", 7, 3, 2, -1, -1, 1, 3, -5),
           ("fpc21_elci0_ercf4_fsf3_p1_long", 21, 0, 0, 0, 4, 3, 1, 4),
           ("fpc1_p4", 1, 0, 0, -1, -1, 1, 4, 0),
           ("fpc150_elc10_p7", 150, 10, 0, -1, -1, 1, 7, 0)]


def _kaldi_output(bin_dir: Path, out: Path, key: str, feats, online, o: dict, period: int,
                  looped: bool) -> np.ndarray:
    """BIN_DIR/geninfer's output for OUT_DIR/model.raw on these inputs (exits if Kaldi
    refuses)."""
    ref, err, _ = kaldi(bin_dir / "geninfer", str(out / "model.raw"),
                        {"features": feats, "online": online}, looped, o, period)
    if ref is None:
        raise SystemExit(f"{key}: Kaldi refused: {err}")
    return ref


def offline(bin_dir: Path, out: Path) -> None:
    feats = np.load(out / "case.npz")["features"]
    rng = np.random.default_rng(20261127)
    arrays, settings = {}, []
    for key, fpc, elc, erc, elci, ercf, fsf, period, extra in OFFLINE:
        online = rng.standard_normal((-(-T // period) + extra, 8)).astype(np.float32)
        o = dict(frames_per_chunk=fpc, extra_left_context=elc, extra_right_context=erc,
                 extra_left_context_initial=elci, extra_right_context_final=ercf,
                 frame_subsampling_factor=fsf)
        arrays[f"online.{key}"] = online
        arrays[f"output.{key}"] = _kaldi_output(bin_dir, out, key, feats, online, o, period,
                                                looped=False)
        settings.append({"key": key, "online_ivector_period": period, **o})
    np.savez_compressed(out / "offline.npz", **arrays)
    (out / "offline.json").write_text(json.dumps({
        "what": "Kaldi DecodableNnetSimple (geninfer, reference commit; nnet3-compute with "
                "--online-ivectors) on case.npz's features", "num_frames": T,
        "settings": settings}, indent=1) + "\n")
    print(f"wrote {out}/offline.*")


def main() -> None:
    bin_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    if "--offline" in sys.argv:
        offline(bin_dir, out)
        return
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261126)
    nnet = Nnet.from_config(CONFIG, rng=np.random.default_rng(7))
    save_model(Model(nnet), str(out / "model.raw"), binary=True)
    feats = rng.standard_normal((T, 13)).astype(np.float32)
    arrays, settings = {"features": feats}, []
    for key, fpc, elci, fsf, period, extra in SETTINGS:
        rows = -(-T // period) + extra
        online = rng.standard_normal((rows, 8)).astype(np.float32)
        o = dict(frames_per_chunk=fpc, extra_left_context=0, extra_right_context=0,
                 extra_left_context_initial=elci, extra_right_context_final=-1,
                 frame_subsampling_factor=fsf)
        arrays[f"online.{key}"] = online
        arrays[f"output.{key}"] = _kaldi_output(bin_dir, out, key, feats, online, o, period,
                                                looped=True)
        settings.append({"key": key, "frames_per_chunk": fpc, "extra_left_context_initial": elci,
                         "frame_subsampling_factor": fsf, "online_ivector_period": period})
    np.savez_compressed(out / "case.npz", **arrays)
    (out / "case.json").write_text(json.dumps({
        "what": "Kaldi DecodableNnetSimpleLooped (geninfer, reference commit) with an online "
                "i-vector matrix; model.raw read by Kaldi as written",
        "num_frames": T, "settings": settings}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
