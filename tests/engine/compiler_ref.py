"""Helpers shared by the compiler front-half tests: reference cases and Kaldi's
matrix debug lines (see tests/data/compiler/README.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from engine.compiler.request import ComputationRequest
from engine.core.errors import ConfigError, ModelFormatError
from engine.core.index import Index
from engine.nnet.nnet import Nnet

CASES_DIR = Path(__file__).resolve().parent.parent / "data" / "compiler" / "networks"
CASES = sorted(p.name for p in CASES_DIR.iterdir()) if CASES_DIR.is_dir() else []


def config_parts(text: str) -> list[str]:
    parts = re.split(r"^# config \d+\n", text, flags=re.M)
    return [p for p in parts if p.strip()]


def load_case(case: str, base: Path = CASES_DIR):
    """(nnet built from configs.txt, request) or None if a component type is missing."""
    d = base / case
    try:
        nnet = Nnet.from_config(*config_parts((d / "configs.txt").read_text()))
    except (ConfigError, ModelFormatError) as e:
        if "unknown component type" in str(e):
            return None, str(e)
        raise
    req = ComputationRequest.from_json(json.loads((d / "request.json").read_text()))
    return nnet, req


_RANGE = re.compile(r"\((-?\d+),(-?\d+)(?::(-?\d+))?(?:,(-?\d+))?\)")


def parse_indexes(text: str) -> tuple[list[Index], bool]:
    """Inverse of Kaldi's PrintIndexes: (rows, complete).  When Kaldi shortened
    the printout (`` ... `` in the middle), only the rows fully printed before
    the cut are returned, with complete=False."""
    complete = "..." not in text
    if not complete:
        text = text.split(" ... ")[0]
    out = []
    for m in _RANGE.finditer(text):
        n, t1 = int(m.group(1)), int(m.group(2))
        t2 = int(m.group(3)) if m.group(3) is not None else t1
        x = int(m.group(4)) if m.group(4) is not None else 0
        out.extend(Index(n, t, x) for t in range(t1, t2 + 1))
    return out, complete


def kaldi_matrices(case: str, base: Path = CASES_DIR) -> list[tuple[str, str, str]]:
    """(matrix, node name, printed indexes) per matrix debug line."""
    path = base / case / "kaldi_matrices.txt"
    if not path.exists():
        path = base / case / "computation.txt"
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r"^(m\d+) == (?:value|deriv): ([^\[]+)(\[.*\])$", line.strip())
        if m:
            out.append((m.group(1), m.group(2), m.group(3)))
    return out


def explain_by_steps(kaldi: list[Index], steps: list[list[Index]],
                     partial_end: bool = False) -> bool:
    """True if ``kaldi`` (rows of one of Kaldi's matrices) is one of ``steps`` or
    a concatenation of whole steps (Kaldi's optimizer merges matrices of
    consecutive recurrent steps; it never reorders rows inside a step).  With
    ``partial_end`` the last piece may be the start of a step (a cut printout)."""
    by_first: dict[Index, list[list[Index]]] = {}
    for s in steps:
        if s:
            by_first.setdefault(s[0], []).append(s)
    p = 0
    while p < len(kaldi):
        cands = [s for s in by_first.get(kaldi[p], []) if kaldi[p:p + len(s)] == s]
        if not cands and partial_end:
            cands = [s for s in by_first.get(kaldi[p], []) if s[:len(kaldi) - p] == kaldi[p:]]
        if not cands:
            return False
        p += max(len(s) for s in cands)
    return True


def first_difference(ours: str, ref: str) -> str:
    """Where two printouts first differ (line number and both lines)."""
    a, b = ours.splitlines(), ref.splitlines()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"line {i + 1}:\n  ours:  {x}\n  kaldi: {y}"
    return f"lengths differ: ours {len(a)} lines, kaldi {len(b)} lines"
