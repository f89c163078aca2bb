"""Generate random networks with Kaldi and check nnetc against them.

    python tests/kaldi_oracle/check_networks.py BIN_DIR OUT_DIR FIRST_SEED LAST_SEED [OPTIONS]

For each seed: BIN_DIR/gen writes a kaldi-ref style case to OUT_DIR/sSEED (OPTIONS 1: with
Kaldi's allow_ivector, off by default, so that some networks read an i-vector; 2: Kaldi
optimizes with optimizer options drawn at random, written to options.json, and so do we;
3: both; 4, alone or added to those: batch-norm in training mode; 0, the default, is the
kaldi-ref networks' generation); then the unoptimized and optimized computations are run
against Kaldi's numbers (test_compile_reference.check_case), the optimized command count,
peak bytes and printout compared with Kaldi's, and, where Kaldi's request stored component
statistics (model_after.txt), those statistics (test_compile_reference.check_stored_stats).
Prints one line per failing case and a summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path


from oracle_io import generate, report

from compiler_ref import first_difference  # noqa: E402
from engine.compiler.request import ComputationRequest  # noqa: E402
from engine.compiler.shortcut import compile_request  # noqa: E402
from engine.nnet.model_io import load_nnet  # noqa: E402
from engine.core.index import INT32_MAX, INT32_MIN  # noqa: E402
from test_compile_reference import check_case, check_stored_stats, read_options  # noqa: E402

STATS_COMPARED = [0]     # networks whose stored statistics were compared


def check(case: Path) -> list[str]:
    problems = []
    options = read_options(case / "options.json")
    window = options is not None and (
        options.min_deriv_time != INT32_MIN or options.max_deriv_time != INT32_MAX
        or options.max_deriv_time_relative != INT32_MAX)
    for opt in (False, True):
        try:
            if not opt and window:
                # Kaldi limits the derivative times whatever "optimize" says: its numbers
                # are those of a computation with the window, optimized or not
                check_case(case, optimize=True, options=options.replace(optimize=False))
                continue
            check_case(case, optimize=opt, options=options)
        except Exception as e:  # noqa: BLE001 (report every kind of failure)
            problems.append(f"optimize={opt}: {type(e).__name__}: {str(e)[:300]}")
    try:
        nnet = load_nnet(case / "model.txt")
        req = ComputationRequest.from_json((case / "request.json").read_bytes())
        comp = compile_request(nnet, req, options)
        ref = json.loads((case / "stats.json").read_text())["optimized"]
        st = comp.stats()
        if (st["commands"], st["peak_bytes"]) != (ref["commands"], ref["peak_bytes"]):
            problems.append(f"optimized stats: ours {st['commands']}/{st['peak_bytes']}, kaldi {ref}")
        text = comp.to_text(nnet)
        if text != (case / "computation.txt").read_text():
            problems.append("printout: " + first_difference(text, (case / "computation.txt").read_text()))
    except Exception as e:  # noqa: BLE001
        problems.append(f"compile: {type(e).__name__}: {str(e)[:300]}")
    if (case / "model_after.txt").exists():
        try:
            found, compared = check_stored_stats(case, options)
            problems += found
            STATS_COMPARED[0] += compared > 0
        except Exception as e:  # noqa: BLE001
            problems.append(f"stored stats: {type(e).__name__}: {str(e)[:300]}")
    return problems


def main() -> None:
    bin_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    first, last = int(sys.argv[3]), int(sys.argv[4])
    options = sys.argv[5:6]
    bad = n = 0
    for seed in range(first, last + 1):
        case = out / f"s{seed}"
        failed = generate(bin_dir / "gen", seed, case, *options)
        if failed:
            print(f"s{seed}: Kaldi failed: {failed}")
            continue
        n += 1
        problems = check(case)
        if problems:
            bad += 1
            report(f"s{seed}", problems)
    print(f"{bad} failing of {n} networks ({STATS_COMPARED[0]} with stored statistics "
          "compared)")


if __name__ == "__main__":
    main()
