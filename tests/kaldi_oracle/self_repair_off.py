"""A model with self-repair off, and a genchunk case of it packed for CI.

    python tests/kaldi_oracle/self_repair_off.py MODEL OUT.txt
    python tests/kaldi_oracle/self_repair_off.py --pack CASE DEST

The first form writes MODEL (.raw or .mdl; a .mdl's network) as a text .raw with every
self-repair scale 0: ``self_repair_scale`` of the sigmoid, tanh, ReLU (Kaldi's
``<SelfRepairScale>``, written only when nonzero), GRU and ClipGradient components, and
the five scales of LstmNonlinearityComponent's ``<SelfRepairConfig>`` (its entries 5-9;
0-4 are the thresholds).  Kaldi's sigmoid/tanh/ReLU self-repair runs in backprop on a
random half of the calls (``RandUniform() > 0.5``, nnet-simple-component.cc
RepairGradients; nnetc draws from its own generator), so with derivatives Kaldi's
numbers and ours differ by chance; with the scale 0 Kaldi returns before the draw and
neither side adds anything (ClipGradient the same).  LstmNonlinearity's self-repair draws
nothing (it follows the stored derivative averages, on both sides the same) but is off
here too; GRU's draws whether to store statistics and repair on each call whatever the
scale, but with the scale 0 adds nothing to the derivatives.  Then, e.g.:

    BIN/genchunk OUT.txt 21 1 1 CASE          # or check_models.py BIN DIR OUT.txt --cases ...

The second form packs such a case (genchunk's folder, DERIV 1) without its two model
files, for a model already in tests/data: request.json, stats.json, shortcut.json,
computation.txt.gz, and arrays.npz holding the driver's arrays plus ``grad.COMPONENT.PARAM``,
Kaldi's model derivative (model_grad.txt, Kaldi's SetNnetAsGradient convention: parameters
+ gradient, minus the model's parameters, in float32)."""

from __future__ import annotations

import gzip
import shutil
import sys
from pathlib import Path

import numpy as np

from oracle_io import read_matrices

from engine.nnet.model_io import load_model, load_nnet, save_model  # noqa: E402


def self_repair_off(nnet) -> list[str]:
    """Sets every self-repair scale of ``nnet`` to 0, in place; the names of the
    components that had one that was not."""
    changed = []
    for name, c in zip(nnet.component_names, nnet.components):
        on = False
        if getattr(c, "self_repair_scale", 0.0) != 0.0:
            c.self_repair_scale = 0.0
            on = True
        cfg = getattr(c, "self_repair_config", None)
        if cfg is not None and np.any(np.asarray(cfg)[5:] != 0):
            c.self_repair_config = np.asarray(cfg).copy()
            c.self_repair_config[5:] = 0
            on = True
        if on:
            changed.append(name)
    return changed


def pack(case: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("request.json", "stats.json", "shortcut.json"):
        shutil.copy(case / f, dest / f)
    (dest / "computation.txt.gz").write_bytes(
        gzip.compress((case / "computation.txt").read_bytes(), mtime=0))
    arrays = read_matrices(case / "arrays.txt")
    nnet, grad = load_nnet(case / "model.txt"), load_nnet(case / "model_grad.txt")
    for name, c, g in zip(nnet.component_names, nnet.components, grad.components):
        if not c.is_updatable:
            continue
        for p, a, b in zip(c.PARAMS, c.param_arrays(), g.param_arrays()):
            arrays[f"grad.{name}.{p}"] = (np.asarray(b, np.float64)
                                          - np.asarray(a, np.float64)).astype(np.float32)
    np.savez_compressed(dest / "arrays.npz", **arrays)


def main() -> None:
    if sys.argv[1] == "--pack":
        pack(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    model = load_model(sys.argv[1])
    changed = self_repair_off(model.nnet)
    save_model(model.nnet, sys.argv[2], binary=False)
    print(f"self-repair set to 0 in {len(changed)} components: {', '.join(changed)}")


if __name__ == "__main__":
    main()
