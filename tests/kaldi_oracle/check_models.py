"""Kaldi's chunk requests on given models, compiled and run by Kaldi and by nnetc.

    python tests/kaldi_oracle/check_models.py BIN_DIR OUT_DIR MODEL... [--options K] [--train]
        [--cases CHUNKxBATCHdD,...]

For each MODEL (.raw, or .mdl: the network after the transition model) and each case of CASES (chunk, batch, with derivatives or not),
BIN_DIR/genchunk writes a kaldi-ref style network case to OUT_DIR/NAME_cCHUNK_bBATCH_dD
(the chunk request of kaldi_stats.json; with derivatives the input and output have them
and the model derivative is asked for); then, as check_networks.py does for random
networks, nnetc's unoptimized and optimized computations are run against Kaldi's numbers
and the optimized command count, peak bytes and printout compared with Kaldi's; and the
stats of the computation Kaldi's CachingOptimizingCompiler makes (shortcut compilation
for batch > 1) with nnetc's compile_request.  With ``--options K``, each case is made K
more times, Kaldi optimizing with optimizer options drawn at random (genchunk's OPTSEED:
options.json) and nnetc with the same.  With ``--train``, batch-norm runs in training mode
(normalising by each minibatch's own statistics) and the request stores component
statistics, which are compared with Kaldi's (test_compile_reference.check_stored_stats).
``--cases`` replaces CASES, e.g. ``--cases 21x1d1,150x8d1``.
Prints one line per failing case and a summary.

A derivative through a ReLU whose input is within float32 rounding of zero depends on
the order of the sums before it: Kaldi's BLAS and NumPy's may put that input on either
side, and the derivative then differs over the unit's whole receptive field.  A case
whose only failures are derivatives and where such an input exists (|x| below 1e-6 of
the largest input of its layer) is reported apart, as inconclusive, with the unit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from check_networks import check
from oracle_io import complaint, report, to_npz

import numpy as np

from engine.compiler.computation import CommandType  # noqa: E402
from engine.compiler.compiler import CompilerOptions, compile_computation  # noqa: E402
from engine.compiler.request import ComputationRequest  # noqa: E402
from engine.runtime.executor import Executor  # noqa: E402
from engine.compiler.shortcut import compile_request  # noqa: E402
from engine.nnet.model_io import load_nnet  # noqa: E402
from test_compile_reference import read_options  # noqa: E402

CASES = [(21, 1, 0), (150, 1, 0), (21, 8, 0), (150, 8, 0), (21, 1, 1), (17, 3, 1)]


def relu_kinks(case: Path) -> list[str]:
    """The ReLU inputs of the case's forward run (unoptimized) within 1e-6 of the
    largest input of their layer from zero: "component (row, column) value"."""
    nnet = load_nnet(case / "model.txt")
    req = ComputationRequest.from_json((case / "request.json").read_bytes())
    arrays = np.load(case / "arrays.npz")
    found: list[str] = []

    class Recording(Executor):
        def _execute(self, c):
            if c.command_type == CommandType.PROPAGATE:
                comp = self._components[c.arg1]
                if type(comp).__name__ == "RectifiedLinearComponent":
                    x = np.asarray(self._sub(c.arg3))
                    a = np.abs(x)
                    r, k = np.unravel_index(np.argmin(a), a.shape)
                    if a.size and a[r, k] <= 1e-6 * a.max():
                        found.append(f"{self.computation_name(c.arg1)} ({r}, {k}) {x[r, k]:.3g}")
            return super()._execute(c)

    ex = Recording(compile_computation(nnet, [req], CompilerOptions()), nnet)
    for spec in req.inputs:
        ex.accept_input(spec.name, arrays[f"input.{spec.name}"])
    ex.run()
    return found


def main() -> None:
    args = sys.argv[1:]
    k_options = 0
    if "--options" in args:
        i = args.index("--options")
        k_options = int(args[i + 1])
        del args[i:i + 2]
    cases = CASES
    if "--cases" in args:
        i = args.index("--cases")
        cases = [tuple(int(v) for v in c.replace("x", " ").replace("d", " ").split())
                 for c in args[i + 1].split(",")]
        del args[i:i + 2]
    train = "--train" in args
    if train:
        args.remove("--train")
    bin_dir, out = Path(args[0]), Path(args[1])
    bad = n = inconclusive = 0
    for model in args[2:]:
        name = (Path(model).parent.name if Path(model).name in ("model.raw", "final.mdl")
                else Path(model).stem)
        for (chunk, batch, deriv), opt_seed in [(c, s) for c in cases
                                                for s in [None, *range(1, k_options + 1)]]:
            case = out / (f"{name}_c{chunk}_b{batch}_d{deriv}"
                          + ("" if opt_seed is None else f"_o{opt_seed}")
                          + ("_train" if train else ""))
            case.mkdir(parents=True, exist_ok=True)
            extra = [] if opt_seed is None else [str(opt_seed * 1000 + chunk + batch + deriv)]
            if train:
                extra = [*(extra or ["-1"]), "1"]
            p = subprocess.run([str(bin_dir / "genchunk"), model, str(chunk), str(batch),
                                str(deriv), str(case), *extra], capture_output=True, text=True)
            if p.returncode:
                print(f"{case.name}: Kaldi failed: {complaint(p.stderr, p.returncode)}")
                continue
            to_npz(case)
            n += 1
            problems = check(case)
            try:
                nnet = load_nnet(case / "model.txt")
                req = ComputationRequest.from_json((case / "request.json").read_bytes())
                options = read_options(case / "options.json")
                st = compile_request(nnet, req, options, use_shortcut=True).stats()
                ref = json.loads((case / "shortcut.json").read_text())
                if (st["commands"], st["peak_bytes"]) != (ref["commands"], ref["peak_bytes"]):
                    problems.append(f"shortcut stats: ours {st['commands']}/{st['peak_bytes']}, "
                                    f"kaldi {ref}")
            except Exception as e:  # noqa: BLE001
                problems.append(f"shortcut compile: {type(e).__name__}: {str(e)[:300]}")
            if problems and deriv and all("deriv" in p or "gradient" in p for p in problems):
                kinks = relu_kinks(case)
                if kinks:
                    inconclusive += 1
                    print(f"{case.name}: inconclusive, derivatives through a ReLU input at "
                          f"zero within rounding: {'; '.join(kinks)}")
                    continue
            if problems:
                bad += 1
                report(case.name, problems)
    print(f"{bad} failing of {n} cases ({inconclusive} inconclusive: see above)")


if __name__ == "__main__":
    main()
