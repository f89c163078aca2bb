"""Kaldi's text forms of Index lists and integer vectors (nnet-common.cc
PrintIndexes, PrintCindexes, PrintIntegerVector), as used by the computation
printer (NnetComputation::Print) and by error messages.

Same range compression and the same elision of strings longer than 200
characters ("first 100 ... last 100") as Kaldi, so printouts compare
byte for byte.
"""

from __future__ import annotations

def format_indexes(indexes) -> str:
    """Kaldi's PrintIndexes: runs of consecutive t with equal n, x become (n,t1:t2)."""
    idx = [tuple(i) for i in indexes]
    if not idx:
        return "[ ]"
    parts = []
    start = 0
    n = len(idx)
    for i in range(1, n + 1):
        if i == n or not (idx[i][1] == idx[i - 1][1] + 1 and idx[i][0] == idx[i - 1][0]
                          and idx[i][2] == idx[i - 1][2]):
            nn, t0, x0 = idx[start]
            s = f"({nn},{t0}" if i == start + 1 else f"({nn},{t0}:{idx[i - 1][1]}"
            if x0 != 0:
                s += f",{x0}"
            parts.append(s + ")")
            start = i
    return _elide("[" + ", ".join(parts) + "]")


def format_cindexes(cindexes, node_names: list[str]) -> str:
    """Kaldi's PrintCindexes: node name followed by its Indexes, per run of equal node."""
    if not cindexes:
        return "[ ]"
    out = []
    i = 0
    n = len(cindexes)
    while i < n:
        node = cindexes[i][0]
        j = i
        while j < n and cindexes[j][0] == node:
            j += 1
        name = node_names[node] if 0 <= node < len(node_names) else f"node{node}"
        out.append(name + format_indexes([c[1] for c in cindexes[i:j]]))
        i = j
    return "".join(out)


def format_int_vector(ints) -> str:
    """Kaldi's PrintIntegerVector: runs of equal values (vxN) or +1 steps (a:b)."""
    ints = [int(v) for v in ints]
    if not ints:
        return "[ ]"
    n = len(ints)
    starts = []
    cur = 0
    for i in range(1, n):
        a, b, v = ints[cur], ints[cur + 1], ints[i]
        if not ((b == a and v == a) or (b == a + 1 and v == a + i - cur)):
            starts.append(cur)
            cur = i
    starts.append(cur)
    starts.append(n)
    parts = []
    for r in range(len(starts) - 1):
        s0, s1 = starts[r], starts[r + 1]
        if s1 == s0 + 1:
            parts.append(str(ints[s0]))
        elif s1 == s0 + 2:
            parts.append(f"{ints[s0]}, {ints[s0 + 1]}")
        elif ints[s0] == ints[s0 + 1]:
            parts.append(f"{ints[s0]}x{s1 - s0}")
        else:
            parts.append(f"{ints[s0]}:{ints[s1 - 1]}")
    return "[" + ", ".join(parts) + "]"


def _elide(s: str, max_len: int = 200) -> str:
    if len(s) <= max_len:
        return s
    return s[: max_len // 2] + " ... " + s[len(s) - max_len // 2:]


def _fmt_float(v: float) -> str:
    # C++ ostream default formatting (6 significant digits, %g-like).
    return f"{v:g}"
