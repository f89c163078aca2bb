"""Reading and writing the drivers' text matrices ("name rows cols" then the rows)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "tests", ROOT / "tests" / "engine"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def read_matrices(path: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    lines = Path(path).read_text().split("\n")
    i = 0
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        name, r, c = lines[i].split()
        r, c = int(r), int(c)
        rows = [np.array(lines[i + 1 + k].split(), dtype=np.float32) for k in range(r)]
        out[name] = np.array(rows, dtype=np.float32).reshape(r, c)
        i += 1 + r
    return out


def write_matrices(path: Path, mats: dict) -> None:
    with open(path, "w") as f:
        for k, m in mats.items():
            m = np.atleast_2d(m)
            f.write(f"{k} {m.shape[0]} {m.shape[1]}\n")
            for row in m:
                f.write(" ".join(repr(float(v)) for v in row) + "\n")


def to_npz(case: Path) -> None:
    """arrays.txt (the drivers' output) -> arrays.npz (the kaldi-ref layout)."""
    if (case / "arrays.txt").exists():
        np.savez_compressed(case / "arrays.npz", **read_matrices(case / "arrays.txt"))


def generate(binary: Path, seed: int, case: Path, *extra: str) -> str | None:
    """Run a case driver (gen, gencomp) for ``seed`` into the folder ``case`` (made
    here; ``extra``: more arguments) and convert its arrays; None, or Kaldi's last
    line of complaint when it failed."""
    case.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([str(binary), str(seed), str(case), *extra], capture_output=True,
                       text=True)
    if p.returncode:
        return complaint(p.stderr, p.returncode)
    to_npz(case)
    return None


def complaint(stderr: str, returncode: int) -> str:
    """What a failed driver said: Kaldi's ERROR or ASSERTION_FAILED line (the stack trace
    after it names nothing), else its last line."""
    lines = stderr.strip().splitlines()
    for line in lines:
        if "ASSERTION_FAILED" in line or "ERROR (" in line or line.startswith("ERROR"):
            return line.strip()
    return (lines or [f"exit status {returncode}"])[-1]


def report(name: str, problems: list[str]) -> None:
    print(f"{name} FAIL\n    " + "\n    ".join(problems))
