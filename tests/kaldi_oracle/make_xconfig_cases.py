"""Networks written by Kaldi's xconfig tools, run by Kaldi, as fixed test cases.

    python tests/kaldi_oracle/make_xconfig_cases.py STEPS BIN_DIR OUT_DIR [NAME...]

STEPS: the ``egs/wsj/s5/steps`` folder of a Kaldi tree (its xconfig library turns each
``xconfigs/NAME.xconfig`` here into ``final.config``, as steps/nnet3/xconfig_to_configs.py
does, without running nnet3-init).  For each NAME (default: all) it writes
OUT_DIR/NAME/final.config, OUT_DIR/NAME/model.raw (the config built by nnetc with
parameters from a fixed seed, then perturbed as Kaldi's PerturbParams does, since the
xconfig output layers start at zero; every batch-norm given statistics: a count of 100
and random means and variances, since Kaldi draws random ones for a zero count),
OUT_DIR/NAME/case.npz (features, an i-vector when the network has an 'ivector' input,
and per setting the output of BIN_DIR/geninfer: Kaldi's DecodableNnetSimple as
nnet3-compute runs it, or DecodableNnetSimpleLooped) and OUT_DIR/NAME/case.json (the
settings); and OUT_DIR/NAME/kaldi_chunks.json and computation_c21_b1.txt.gz: Kaldi's
compilation of the chunk requests of kaldi_stats.json (BIN_DIR/genchunk; see
compile_figures).  tests/data/inference/xconfig was made with it; CI reads that copy
(tests/engine/test_xconfig_architectures.py)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

from check_infer import kaldi

from engine.nnet.model_io import Model, save_model  # noqa: E402
from engine.nnet.nnet import Nnet  # noqa: E402

HERE = Path(__file__).resolve().parent
T = 70
# (key, looped, frames per chunk, extra left / right context, extra left context initial,
# extra right context final, frame subsampling factor)
SETTINGS = [("offline_fpc17_elc4_erc2", False, 17, 4, 2, -1, -1, 1),
            ("offline_fpc50_elci0_ercf3_fsf3", False, 50, 0, 0, 0, 3, 3),
            ("looped_fpc20_elci8", True, 20, 0, 0, 8, -1, 1),
            ("looped_fpc21_elci0_fsf3", True, 21, 0, 0, 0, -1, 3)]
# the matrix of a fixed-affine-layer reading {out}/lda.mat: 72 outputs, 3 x 20 feature
# dims + 12 i-vector dims and the bias column
LDA_SHAPE = (72, 73)
# the chunk requests whose compilation by Kaldi is recorded (chunk, batch)
CHUNKS = [(21, 1), (150, 1), (21, 8), (150, 8)]


def final_config(steps: Path, xconfig: Path, out: Path) -> str:
    """Kaldi's xconfig library's final.config for ``xconfig`` (written into ``out``)."""
    sys.path.insert(0, str(steps))
    import libs.nnet3.xconfig.parser as xparser  # noqa: PLC0415
    spec = importlib.util.spec_from_file_location(
        "xconfig_to_configs", steps / "nnet3" / "xconfig_to_configs.py")
    x2c = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(x2c)
    x2c.write_config_files(str(out), xparser.read_xconfig_file(str(xconfig), []))
    return (out / "final.config").read_text()


def build(config: str, source: str, seed: int) -> Nnet:
    rng = np.random.default_rng(seed)
    nnet = Nnet.from_config(config, source=source, rng=rng)
    for comp in nnet.components:
        if type(comp).__name__ == "BatchNormComponent":
            mean = 0.5 * rng.standard_normal(comp.block_dim)
            var = rng.uniform(0.5, 2.0, comp.block_dim)
            comp.count = 100.0
            comp.stats_sum = 100.0 * mean
            comp.stats_sumsq = 100.0 * (mean ** 2 + var)
        elif comp.is_updatable:
            # perturbed (Kaldi's PerturbParams): the xconfig output layers start at zero
            for arr in comp.param_arrays():
                if np.size(arr):
                    scale = max(float(np.std(arr)), 0.3)
                    arr += (scale * rng.standard_normal(np.shape(arr))).astype(arr.dtype)
    return nnet


def make(steps: Path, bin_dir: Path, out_dir: Path, name: str, seed: int) -> None:
    out = out_dir / name
    out.mkdir(parents=True, exist_ok=True)
    # an xconfig may name files in the case's folder as {out}: the LDA-like matrix of a
    # fixed-affine-layer (random, written here), the IDCT matrix (written by the library)
    text = (HERE / "xconfigs" / f"{name}.xconfig").read_text().replace("{out}", str(out))
    if f"{out}/lda.mat" in text:
        lda = np.random.default_rng(seed).standard_normal(LDA_SHAPE)
        (out / "lda.mat").write_text(
            " [\n" + "\n".join(" " + " ".join(f"{v:.6f}" for v in row) for row in lda)
            + " ]\n")
    xconfig = out / "xconfig"
    xconfig.write_text(text)
    config = final_config(steps, xconfig, out)
    nnet = build(config, f"{name}/final.config", seed)
    save_model(Model(nnet), str(out / "model.raw"), binary=True)
    for f in out.iterdir():   # the rest is in model.raw
        if f.name not in ("final.config", "model.raw"):
            f.unlink()
    rng = np.random.default_rng(seed + 1)
    arrays = {"features": rng.standard_normal((T, nnet.input_dim("input"))).astype(np.float32)}
    mats = {"features": arrays["features"]}
    if nnet.get_node_index("ivector") >= 0:
        arrays["ivector"] = rng.standard_normal(nnet.input_dim("ivector")).astype(np.float32)
        mats["ivector"] = arrays["ivector"][None]
    settings = []
    for key, looped, fpc, elc, erc, elci, ercf, fsf in SETTINGS:
        o = dict(frames_per_chunk=fpc, extra_left_context=elc, extra_right_context=erc,
                 extra_left_context_initial=elci, extra_right_context_final=ercf,
                 frame_subsampling_factor=fsf)
        ref, err, _ = kaldi(bin_dir / "geninfer", str(out / "model.raw"), mats, looped, o, 0)
        if ref is None:
            raise SystemExit(f"{name} {key}: Kaldi refused: {err}")
        arrays[f"output.{key}"] = ref
        settings.append({"key": key, "looped": looped, **o})
    np.savez_compressed(out / "case.npz", **arrays)
    compile_figures(bin_dir, out)
    (out / "case.json").write_text(json.dumps({
        "what": f"xconfigs/{name}.xconfig through Kaldi's xconfig library (final.config), "
                f"built by nnetc with seed {seed} and batch-norm statistics set (model.raw, "
                "read by Kaldi as written); outputs of geninfer (reference commit): "
                "DecodableNnetSimple as nnet3-compute, or DecodableNnetSimpleLooped",
        "num_frames": T, "settings": settings}, indent=1) + "\n")
    print(f"wrote {out}")


def compile_figures(bin_dir: Path, out: Path) -> None:
    """kaldi_chunks.json: per chunk request of CHUNKS (built by BIN_DIR/genchunk: the
    request of kaldi_stats.json), Kaldi's command count and peak bytes of its unoptimized
    and optimized computations and of the one CachingOptimizingCompiler makes (shortcut
    compilation for batch > 1), and the left/right context it used; and the printout of
    its optimized computation for the first request (computation_c21_b1.txt.gz)."""
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for chunk, batch in CHUNKS:
            case = Path(tmp) / f"c{chunk}_b{batch}"
            case.mkdir()
            p = subprocess.run([str(bin_dir / "genchunk"), str(out / "model.raw"), str(chunk),
                                str(batch), "0", str(case)], capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(f"{out.name} chunk {chunk} batch {batch}: Kaldi refused: "
                                 f"{p.stderr.strip().splitlines()[-1:]}")
            request = json.loads((case / "request.json").read_text())
            ts = [t for _, t, _ in request["inputs"][0]["indexes"]]
            figures[f"c{chunk}_b{batch}"] = {
                "chunk": chunk, "batch": batch, "left_context": -min(ts),
                "right_context": max(ts) - chunk + 1,
                **json.loads((case / "stats.json").read_text()),
                "shortcut": json.loads((case / "shortcut.json").read_text())}
            if (chunk, batch) == CHUNKS[0]:
                with gzip.open(out / "computation_c21_b1.txt.gz", "wt") as f:
                    f.write((case / "computation.txt").read_text())
    (out / "kaldi_chunks.json").write_text(json.dumps(figures, indent=1) + "\n")


def main() -> None:
    steps, bin_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    names = sys.argv[4:] or sorted(p.stem for p in (HERE / "xconfigs").glob("*.xconfig"))
    for name in names:
        make(steps, bin_dir, out_dir, name, zlib.crc32(name.encode()) % 10000)


if __name__ == "__main__":
    main()
