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

# A gated recurrence as Kaldi's (non-fast) LSTM layers have it: three affines read the same
# Append(input, r(t-1)) (decoding fuses them into one product: engine/optimizer/fuse.py),
# sigmoid gates, a tanh candidate, r(t) = o * tanh(i * g) projected back.
GATED = """
input-node name=input dim=8
component name=Wi type=NaturalGradientAffineComponent input-dim=14 output-dim=10
component name=Wo type=NaturalGradientAffineComponent input-dim=14 output-dim=10
component name=Wg type=NaturalGradientAffineComponent input-dim=14 output-dim=10
component-node name=i1 component=Wi input=Append(input, IfDefined(Offset(r, -1)))
component-node name=o1 component=Wo input=Append(input, IfDefined(Offset(r, -1)))
component-node name=g1 component=Wg input=Append(input, IfDefined(Offset(r, -1)))
component name=sig_i type=SigmoidComponent dim=10
component-node name=i component=sig_i input=i1
component name=sig_o type=SigmoidComponent dim=10
component-node name=o component=sig_o input=o1
component name=tanh_g type=TanhComponent dim=10
component-node name=g component=tanh_g input=g1
component name=c type=ElementwiseProductComponent input-dim=20 output-dim=10
component-node name=c component=c input=Append(i, g)
component name=tanh_c type=TanhComponent dim=10
component-node name=h component=tanh_c input=c
component name=m type=ElementwiseProductComponent input-dim=20 output-dim=10
component-node name=m component=m input=Append(o, h)
component name=proj type=AffineComponent input-dim=10 output-dim=6
component-node name=r component=proj input=m
component name=out type=AffineComponent input-dim=6 output-dim=5
component-node name=out component=out input=r
output-node name=output input=out
"""

# an x-vector in miniature: frame layers with context, statistics extraction and
# pooling over up to 10000 frames ahead (mean and standard deviation), segment layers
XVECTOR = """input-node name=input dim=6
component name=tdnn1 type=AffineComponent input-dim=30 output-dim=16
component-node name=tdnn1 component=tdnn1 input=Append(Offset(input, -2), Offset(input, -1), input, Offset(input, 1), Offset(input, 2))
component name=relu1 type=RectifiedLinearComponent dim=16
component-node name=relu1 component=relu1 input=tdnn1
component name=tdnn2 type=AffineComponent input-dim=48 output-dim=12
component-node name=tdnn2 component=tdnn2 input=Append(Offset(relu1, -2), relu1, Offset(relu1, 2))
component name=relu2 type=RectifiedLinearComponent dim=12
component-node name=relu2 component=relu2 input=tdnn2
component name=stats-extraction type=StatisticsExtractionComponent input-dim=12 input-period=1 output-period=1 include-variance=true
component-node name=stats-extraction component=stats-extraction input=relu2
component name=stats-pooling type=StatisticsPoolingComponent input-dim=25 input-period=1 left-context=0 right-context=10000 num-log-count-features=0 output-stddevs=true
component-node name=stats-pooling component=stats-pooling input=stats-extraction
component name=segment type=AffineComponent input-dim=24 output-dim=8
component-node name=segment component=segment input=Round(stats-pooling, 1)
output-node name=output input=segment
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


# -- Kaldi's model references, read once for every end-to-end test (CLI and service) -------
#
# Cases: ("online", tests/data/inference/online_ivectors, setting) -- the Kaldi-made
# online-i-vector case, always -- and ("ref", ../shared/kaldi-ref/models/<arch>, ...) when
# ../shared is there.  A case reads as (model file, options, jobs): options as
# nnet3-compute's or the looped decodable's fields (online_ivector_period included), jobs
# (features, i-vector or None, online i-vector rows or None, Kaldi's output) per utterance.

ONLINE_CASE = Path(__file__).resolve().parents[1] / "data" / "inference" / "online_ivectors"
# networks written by Kaldi's xconfig tools, with Kaldi's output on them (each case.json
# lists offline and looped settings; see tests/engine/test_xconfig_architectures.py)
XCONFIG_CASES = Path(__file__).resolve().parents[1] / "data" / "inference" / "xconfig"


def _xconfig_params(looped: bool) -> list:
    import pytest  # noqa: PLC0415
    return [pytest.param("xconfig", d, s, id=f"xconfig-{d.name}-{s['key']}")
            for d in sorted(p.parent for p in XCONFIG_CASES.glob("*/case.json"))
            for s in read_json(d / "case.json")["settings"] if s["looped"] == looped]


def _xconfig_jobs(folder: Path, setting: dict) -> list:
    z = np.load(folder / "case.npz")
    return [(z["features"], z["ivector"] if "ivector" in z.files else None, None,
             z[f"output.{setting['key']}"])]


def _reference_params(local_json: str, shared_json: str, per_setting: bool) -> list:
    import pytest  # noqa: PLC0415
    from refdata import shared_ref  # noqa: PLC0415
    out = [pytest.param("online", ONLINE_CASE, s, id=f"online-{s['key']}")
           for s in read_json(ONLINE_CASE / local_json)["settings"]]
    for d in model_dirs(shared_ref(), shared_json):
        settings = read_json(d / shared_json)["settings"] if per_setting else [None]
        out += [pytest.param("ref", d, s, id=f"ref-{d.name}" + (f"-{s['key']}" if s else ""),
                             marks=pytest.mark.conformance) for s in settings]
    return out


def infer_reference_params() -> list:
    """(kind, folder, setting) of every nnet3-compute reference (infer.json, and the
    offline settings of the xconfig cases)."""
    return (_reference_params("offline.json", "infer.json", per_setting=False)
            + _xconfig_params(looped=False))


def looped_reference_params() -> list:
    """(kind, folder, setting) of every looped-decodable reference (looped.json, and the
    looped settings of the xconfig cases)."""
    return (_reference_params("case.json", "looped.json", per_setting=True)
            + _xconfig_params(looped=True))


def infer_reference(kind: str, folder: Path, setting) -> tuple[Path, dict, list]:
    """(model file, nnet3-compute options, jobs) of an infer_reference_params case."""
    if kind == "xconfig":
        o = {k: setting[k] for k in ("frames_per_chunk", "extra_left_context",
                                     "extra_right_context", "extra_left_context_initial",
                                     "extra_right_context_final", "frame_subsampling_factor")}
        return folder / "model.raw", o, _xconfig_jobs(folder, setting)
    if kind == "online":
        z = np.load(folder / "offline.npz")
        return folder / "model.raw", dict(setting), [
            (np.load(folder / "case.npz")["features"], None, z[f"online.{setting['key']}"],
             z[f"output.{setting['key']}"])]
    o = nnet3_compute_options(read_json(folder / "infer.json"))
    z = np.load(folder / "infer.npz")
    jobs = []
    for u in sorted(k.split(".", 1)[1] for k in z.files if k.startswith("features.")):
        # a per-utterance i-vector, or online ones (a matrix, one row per
        # online_ivector_period frames, as nnet3-compute's --online-ivectors)
        iv = z.get(f"online_ivectors.{u}", z.get(f"ivector.{u}"))
        online = iv is not None and (o.get("ivectors") == "online" or iv.ndim == 2)
        jobs.append((z[f"features.{u}"], None if online else iv, iv if online else None,
                     z[f"output.{u}"]))
    return model_file(folder), o, jobs


def looped_reference(kind: str, folder: Path, setting: dict) -> tuple[Path, dict, list]:
    """(model file, looped options, jobs) of a looped_reference_params case; the options
    carry Kaldi's defaults where the setting omits one and truncate_future_recurrence for
    a network with a recurrence reading later frames (as Kaldi's looped decodable runs
    it)."""
    from engine.inference.looped import find_future_recurrence  # noqa: PLC0415
    from engine.nnet.model_io import load_nnet  # noqa: PLC0415
    path = folder / "model.raw" if kind in ("online", "xconfig") else model_file(folder)
    o = {"frames_per_chunk": setting.get("frames_per_chunk", 20),
         "extra_left_context_initial": setting.get("extra_left_context_initial", 0),
         "frame_subsampling_factor": setting.get("frame_subsampling_factor", 1),
         "online_ivector_period": setting.get("online_ivector_period"),
         "truncate_future_recurrence": find_future_recurrence(load_nnet(path)) is not None}
    if kind == "xconfig":
        return path, o, _xconfig_jobs(folder, setting)
    if kind == "online":
        z = np.load(folder / "case.npz")
        return path, o, [(z["features"], None, z[f"online.{setting['key']}"],
                          z[f"output.{setting['key']}"])]
    z, prefix = np.load(folder / "looped.npz"), f"output.{setting['key']}."
    return path, o, [(z[f"features.{k[len(prefix):]}"], z.get(f"ivector.{k[len(prefix):]}"),
                      None, z[k]) for k in z.files if k.startswith(prefix)]
