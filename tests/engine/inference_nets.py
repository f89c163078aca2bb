"""Small networks for the inference and streaming tests (built from Kaldi config
text with seeded random parameters), and reference-data helpers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.nnet.nnet import Nnet

# A TDNN with a per-utterance i-vector: left context 2 + 3 = 5, right 1 + 3 = 4.
TDNN_IVECTOR = """
input-node name=input dim=8
input-node name=ivector dim=4
component name=affine1 type=AffineComponent input-dim=28 output-dim=16
component-node name=affine1 component=affine1 input=Append(Offset(input, -2), input, Offset(input, 1), ReplaceIndex(ivector, t, 0))
component name=relu1 type=RectifiedLinearComponent dim=16
component-node name=relu1 component=relu1 input=affine1
component name=affine2 type=AffineComponent input-dim=48 output-dim=12
component-node name=affine2 component=affine2 input=Append(Offset(relu1, -3), relu1, Offset(relu1, 3))
component name=logsm type=LogSoftmaxComponent dim=12
component-node name=logsm component=logsm input=affine2
output-node name=output input=logsm
component name=xent type=AffineComponent input-dim=16 output-dim=5
component-node name=xent component=xent input=relu1
output-node name=output-xent input=xent
"""

# A plain TDNN without i-vectors: left context 4, right context 4.
TDNN_PLAIN = """
input-node name=input dim=8
component name=affine1 type=AffineComponent input-dim=24 output-dim=16
component-node name=affine1 component=affine1 input=Append(Offset(input, -1), input, Offset(input, 1))
component name=tanh1 type=TanhComponent dim=16
component-node name=tanh1 component=tanh1 input=affine1
component name=affine2 type=AffineComponent input-dim=48 output-dim=6
component-node name=affine2 component=affine2 input=Append(Offset(tanh1, -3), tanh1, Offset(tanh1, 3))
output-node name=output input=affine2
"""

# A recurrent network (delay-2 recurrence through IfDefined): left context 2, right 3.
RECURRENT = """
input-node name=input dim=8
component name=a1 type=AffineComponent input-dim=24 output-dim=16
component-node name=a1 component=a1 input=Append(Offset(input, -1), input, Offset(input, 1))
component name=r1 type=AffineComponent input-dim=32 output-dim=16
component-node name=r1 component=r1 input=Append(a1, IfDefined(Offset(t1, -2)))
component name=t1 type=TanhComponent dim=16
component-node name=t1 component=t1 input=r1
component name=a2 type=AffineComponent input-dim=48 output-dim=6
component-node name=a2 component=a2 input=Append(Offset(t1, -1), t1, Offset(t1, 2))
output-node name=output input=a2
"""


def make_nnet(config: str, seed: int = 0) -> Nnet:
    return Nnet.from_config(config, rng=np.random.default_rng(seed))


def feats(num_frames: int, dim: int = 8, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((num_frames, dim)).astype(np.float32)


def assert_close(ours: np.ndarray, ref: np.ndarray, what: str = "") -> None:
    """kaldi-ref's agreement rule: max|ours - ref| <= 1e-4 + 2e-3 * max|ref|."""
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs {ref.shape}"
    err = float(np.abs(ours - ref).max()) if ref.size else 0.0
    tol = 1e-4 + 2e-3 * float(np.abs(ref).max()) if ref.size else 0.0
    assert err <= tol, f"{what}: max abs error {err:.3g} > tolerance {tol:.3g}"


def model_dirs(shared: Path | None, filename: str) -> list[Path]:
    if shared is None:
        return []
    return sorted(p.parent for p in (shared / "models").glob(f"*/{filename}"))


def model_file(model_dir: Path) -> Path:
    """A reference model folder's network: model.raw, or else its one .mdl / .raw."""
    if (model_dir / "model.raw").exists():
        return model_dir / "model.raw"
    found = sorted(model_dir.glob("*.mdl")) + sorted(model_dir.glob("*.raw"))
    assert found, f"{model_dir}: no model.raw, .mdl or .raw"
    return found[0]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def kaldi_looped_config(nnet: Nnet, setting: dict):
    """The LoopedConfig that computes what Kaldi's looped decodable computes for a
    looped.json setting: for a network with a recurrence reading later frames (a
    BLSTM), Kaldi cuts it at each chunk's end, which nnetc does only when asked."""
    from engine.inference.looped import LoopedConfig, find_future_recurrence  # noqa: PLC0415
    # (Kaldi's NnetSimpleLoopedComputationOptions defaults for a setting that omits one)
    return LoopedConfig(setting.get("frames_per_chunk", 20),
                        setting.get("extra_left_context_initial", 0),
                        setting.get("frame_subsampling_factor", 1),
                        truncate_future_recurrence=find_future_recurrence(nnet) is not None)


# nnet3-compute options an infer.json may list in "extra" (as command-line flags) besides
# the ones it names as fields
NNET3_COMPUTE = {"acoustic-scale": float, "apply-exp": bool, "use-priors": bool,
                 "extra-left-context-initial": int, "extra-right-context-final": int,
                 "online-ivector-period": int, "frames-per-chunk": int,
                 "extra-left-context": int, "extra-right-context": int,
                 "frame-subsampling-factor": int}


def nnet3_compute_flags(extra: list[str]) -> dict:
    """``["--acoustic-scale=0.1", "--apply-exp"]`` as InferenceOptions fields; an
    option the tests do not know fails them (rather than being ignored)."""
    out = {}
    for flag in extra:
        name, _, value = flag.lstrip("-").partition("=")
        kind = NNET3_COMPUTE.get(name)
        assert kind is not None, f"nnet3-compute option not understood by this test: {flag}"
        if kind is bool:
            out[name.replace("-", "_")] = value.lower() not in ("false", "0") if value else True
        else:
            out[name.replace("-", "_")] = kind(value)
    return out


def nnet3_compute_options(infer_json: dict) -> dict:
    """An infer.json's nnet3-compute options as one dict: its named fields and the flags
    listed in its "extra" (``nnet3_compute_flags``)."""
    o = dict(infer_json["nnet3_compute_options"])
    o.update(nnet3_compute_flags(o.pop("extra", None) or []))
    return o
