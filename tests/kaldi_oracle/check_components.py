"""Random simple components from Kaldi (GenerateRandomSimpleComponent) against nnetc.

    python tests/kaldi_oracle/check_components.py BIN_DIR OUT_DIR FIRST_SEED LAST_SEED

Types without a kaldi-ref components folder (training-mode batch-norm and dropout, whose
outputs are random or need stats; TdnnComponent, which needs precomputed indexes) are
skipped.  Checks output, input derivative, gradient and byte-identical text I/O."""

from __future__ import annotations

import sys
from pathlib import Path

from oracle_io import generate, report

from component_harness import (check_io_roundtrip, check_reference_case,  # noqa: E402
                               load_component_text)

SKIP = {"BatchNormComponent", "DropoutComponent", "TdnnComponent"}


def main() -> None:
    bin_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    first, last = int(sys.argv[3]), int(sys.argv[4])
    bad = n = 0
    for seed in range(first, last + 1):
        case = out / f"c{seed}"
        failed = generate(bin_dir / "gencomp", seed, case)
        kind = (case / "type").read_text().strip() if (case / "type").exists() else "?"
        if kind in SKIP:
            continue
        if failed:
            print(f"c{seed} {kind}: Kaldi failed: {failed}")
            continue
        n += 1
        problems = []
        try:
            check_reference_case(case)
        except Exception as e:  # noqa: BLE001
            problems.append(f"values: {type(e).__name__}: {str(e)[:300]}")
        try:
            check_io_roundtrip(load_component_text(case / "component.txt"),
                               (case / "component.txt").read_bytes())
        except Exception as e:  # noqa: BLE001
            problems.append(f"text I/O: {type(e).__name__}: {str(e)[:300]}")
        if problems:
            bad += 1
            report(f"c{seed} {kind}", problems)
    print(f"{bad} failing of {n} components")


if __name__ == "__main__":
    main()
