"""Parsing of descriptor expressions (Kaldi's DescriptorTokenize in nnet-parse.cc
and GeneralDescriptor in nnet-descriptor.cc).

An expression such as ``Append(Offset(tdnn1, -1), Scale(0.5, Sum(a, b)))`` is
tokenised, parsed into a ``_General`` tree that can hold any nesting, then
normalised the way Kaldi normalises it: Append flattened to the top, Offset of
Offset merged, Offset(x, 0) dropped, Sum/Failover/IfDefined lifted out of
forwarding expressions, Sum with more than two arguments made right-nested,
Scale pushed down to the node names.  The normalised tree converts to the
Descriptor classes of ``descriptors.py``.

Every failure is a ConfigError naming the token, its character position and the
rest of the expression.
"""

from __future__ import annotations

import re
from typing import Sequence

from engine.core.errors import ConfigError, clipped
from engine.core.index import INT32_MAX, INT32_MIN, Index
from engine.nnet.config_line import INT_RE as _INT_RE
from engine.nnet.config_line import REAL_RE as _REAL_RE

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")

_END = "end of input"
# How deeply expressions may nest.  Kaldi's own configs nest a few levels; the parser,
# the normalisation and everything that walks a descriptor later recurse once per
# level, so a bound here keeps a malformed line from exhausting the stack.
MAX_NESTING = 64

# GeneralDescriptor kinds
APPEND, SUM, FAILOVER, IFDEFINED, OFFSET, SWITCH, ROUND, REPLACE, SCALE, CONST, NODE = range(11)
_KEYWORDS = {"Append": APPEND, "Sum": SUM, "Failover": FAILOVER, "IfDefined": IFDEFINED,
             "Offset": OFFSET, "Switch": SWITCH, "Scale": SCALE, "Const": CONST,
             "Round": ROUND, "ReplaceIndex": REPLACE}
_KIND_NAMES = {v: k for k, v in _KEYWORDS.items()}


def is_valid_name(name: str) -> bool:
    """Kaldi's IsValidName: a letter or '_' first, then letters, digits, '_', '-', '.'."""
    return bool(_NAME_RE.match(name)) and name.isascii()


def tokenize_descriptor(text: str) -> list[tuple[str, int]]:
    """Split into names, numbers and the punctuation '(' ')' ','; each with its position."""
    tokens: list[tuple[str, int]] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t":
            i += 1
            continue
        if c in "(),":
            tokens.append((c, i))
            i += 1
            continue
        j = i
        while j < n and text[j] not in " \t(),":
            j += 1
        word = text[i:j]
        if not (is_valid_name(word) or _REAL_RE.match(word)):
            raise ConfigError(f"cannot tokenize descriptor: bad token {word!r} at "
                              f"character {i} of {text!r}")
        tokens.append((word, i))
        i = j
    return tokens


class _General:
    """Kaldi's GeneralDescriptor: any expression before normalisation."""

    __slots__ = ("kind", "v1", "v2", "alpha", "children")

    def __init__(self, kind: int, v1: int = -1, v2: int = -1, alpha: float = 0.0,
                 children: list["_General"] | None = None):
        self.kind = kind
        self.v1 = v1
        self.v2 = v2
        self.alpha = alpha
        self.children = children if children is not None else []

    def clone_shallow(self) -> "_General":
        return _General(self.kind, self.v1, self.v2, self.alpha, [])

    def assign(self, other: "_General") -> None:
        self.kind, self.v1, self.v2 = other.kind, other.v1, other.v2
        self.alpha, self.children = other.alpha, other.children


class DescriptorNames:
    """The node names descriptors are parsed against, made once for a whole network
    (a table per descriptor made reading an N-node config O(N^2))."""

    __slots__ = ("lookup", "all_names")

    def __init__(self, node_names: Sequence[str | None], all_names: Sequence[str] | None = None):
        self.lookup = {name: i for i, name in enumerate(node_names) if name}
        self.all_names = set(all_names) if all_names is not None else set()


class _Parser:
    def __init__(self, text: str, names: DescriptorNames):
        self.text = text
        self.tokens = tokenize_descriptor(text)
        self.pos = 0
        self.depth = 0
        self.lookup = names.lookup
        self.all_names = names.all_names

    # -- helpers ------------------------------------------------------------------
    def peek(self) -> str:
        return self.tokens[self.pos][0] if self.pos < len(self.tokens) else _END

    def error(self, message: str) -> ConfigError:
        if self.pos < len(self.tokens):
            where = f" at character {self.tokens[self.pos][1]}"
            rest = self.text[self.tokens[self.pos][1]:]
            ctx = f"; next part of expression is: {rest[:40]!r}"
        else:
            where, ctx = " at end of expression", ""
        return ConfigError(f"bad descriptor {clipped(self.text)!r}: {message}{where}{ctx}")

    def expect(self, tok: str, what: str) -> None:
        got = self.peek()
        if got != tok:
            raise self.error(f"expected {tok!r} while parsing {what}, got {got!r}")
        self.pos += 1

    def read_int(self, what: str) -> int:
        got = self.peek()
        if not _INT_RE.match(got) or not INT32_MIN <= int(got) <= INT32_MAX:
            raise self.error(f"expected an integer while parsing {what}, got {got!r}")
        self.pos += 1
        return int(got)

    def read_real(self, what: str) -> float:
        got = self.peek()
        if not _REAL_RE.match(got):
            raise self.error(f"expected a number while parsing {what}, got {got!r}")
        self.pos += 1
        return float(got)

    # -- grammar ------------------------------------------------------------------
    def parse(self) -> _General:
        tok = self.peek()
        kind = _KEYWORDS.get(tok)
        if kind is None:
            idx = self.lookup.get(tok)
            if idx is None:
                if tok in self.all_names:
                    raise self.error(f"node {tok!r} cannot be used in a descriptor (only "
                                     f"input, component and dim-range nodes can)")
                if tok == _END:
                    raise self.error("expected a descriptor, got end of expression")
                raise self.error(f"expected a descriptor or node name, got {tok!r} "
                                 f"(no such node)")
            self.pos += 1
            return _General(NODE, idx)
        if self.depth >= MAX_NESTING:
            raise self.error(f"expressions nested more than {MAX_NESTING} deep")
        self.pos += 1
        self.expect("(", _KIND_NAMES[kind])
        self.depth += 1
        try:
            return self._parse_args(kind)
        finally:
            self.depth -= 1

    def _parse_args(self, kind: int) -> _General:
        g = _General(kind)
        if kind in (APPEND, SUM, SWITCH):
            g.children.append(self.parse())
            while True:
                t = self.peek()
                if t == ")":
                    self.pos += 1
                    break
                if t == ",":
                    self.pos += 1
                    g.children.append(self.parse())
                else:
                    raise self.error(f"expected ',' or ')' in {_KIND_NAMES[kind]}(), got {t!r}")
        elif kind == IFDEFINED:
            g.children.append(self.parse())
            self.expect(")", "IfDefined")
        elif kind == FAILOVER:
            g.children.append(self.parse())
            self.expect(",", "Failover")
            g.children.append(self.parse())
            self.expect(")", "Failover")
        elif kind == OFFSET:
            g.children.append(self.parse())
            self.expect(",", "Offset")
            g.v1 = self.read_int("Offset")
            if self.peek() == ",":
                self.pos += 1
                g.v2 = self.read_int("Offset")
            else:
                g.v2 = 0
            self.expect(")", "Offset")
        elif kind == ROUND:
            g.children.append(self.parse())
            self.expect(",", "Round")
            g.v1 = self.read_int("Round")
            if g.v1 < 1:
                self.pos -= 1
                raise self.error(f"Round() modulus must be >= 1, got {g.v1}")
            self.expect(")", "Round")
        elif kind == REPLACE:
            g.children.append(self.parse())
            self.expect(",", "ReplaceIndex")
            t = self.peek()
            if t not in ("t", "x"):
                raise self.error(f"expected 't' or 'x' in ReplaceIndex(), got {t!r}")
            g.v1 = 1 if t == "t" else 2
            self.pos += 1
            self.expect(",", "ReplaceIndex")
            g.v2 = self.read_int("ReplaceIndex")
            self.expect(")", "ReplaceIndex")
        elif kind == SCALE:
            g.alpha = self.read_real("Scale")
            if g.alpha - g.alpha != 0:
                self.pos -= 1
                raise self.error("Scale() needs a finite scale")
            self.expect(",", "Scale")
            g.children.append(self.parse())
            self.expect(")", "Scale")
        elif kind == CONST:
            g.alpha = self.read_real("Const")
            if g.alpha - g.alpha != 0:
                self.pos -= 1
                raise self.error("Const() needs a finite value")
            self.expect(",", "Const")
            g.v1 = self.read_int("Const")
            if g.v1 <= 0:
                self.pos -= 1
                raise self.error(f"Const() dimension must be > 0, got {g.v1}")
            self.expect(")", "Const")
        return g


# -------------------------------------------------------------------------------------
# normalisation (Kaldi's NormalizeAppend + Normalize, repeated to a fixed point)


def _num_append_terms(g: _General, counts: dict[int, int]) -> int:
    """The number of Append() terms of ``g``; ``counts`` caches the answer for every
    sub-expression (by id), so that picking the terms apart stays linear."""
    n = counts.get(id(g))
    if n is not None:
        return n
    if g.kind in (NODE, CONST):
        n = 1
    elif g.kind == APPEND:
        n = sum(_num_append_terms(c, counts) for c in g.children)
    else:
        n = _num_append_terms(g.children[0], counts)
        for c in g.children[1:]:
            m = _num_append_terms(c, counts)
            if m != n:
                raise ConfigError(f"{_KIND_NAMES[g.kind]}() combines Append() expressions "
                                  f"with different numbers of terms ({n} vs. {m})")
    counts[id(g)] = n
    return n


def _append_terms(g: _General, counts: dict[int, int]) -> list[_General]:
    """The Append() terms of ``g`` in order (Kaldi's GetAppendTerm for every term),
    each a new expression with no Append inside: an Append's terms are its children's,
    one after the other; any other expression's i-th term is the expression over its
    children's i-th terms.  Work linear in the size of the result (``counts``: as
    _num_append_terms left it)."""
    if g.kind == NODE:
        return [_General(NODE, g.v1)]
    if g.kind == APPEND:
        return [t for c in g.children for t in _append_terms(c, counts)]
    kids = [_append_terms(c, counts) for c in g.children]
    out = []
    for i in range(counts[id(g)]):
        term = g.clone_shallow()
        term.children = [k[i] for k in kids]
        out.append(term)
    return out


def _normalize_append(g: _General) -> _General:
    counts: dict[int, int] = {}
    _num_append_terms(g, counts)        # (also checks that Sum() etc. terms agree)
    terms = _append_terms(g, counts)
    if len(terms) == 1:
        return terms[0]
    return _General(APPEND, children=terms)


def _normalize_once(d: _General) -> bool:
    changed = False
    fall_through = False
    if d.kind == OFFSET:
        child = d.children[0]
        if child.kind == OFFSET:
            d.v1 += child.v1
            d.v2 += child.v2
            d.children[0] = child.children[0]
            changed = True
            fall_through = True
        elif d.v1 == 0 and d.v2 == 0:
            d.assign(child)
            changed = True
        else:
            fall_through = True
    if fall_through or d.kind in (SWITCH, ROUND, REPLACE) and not changed:
        child = d.children[0]
        if child.kind == APPEND:
            raise AssertionError("Append() left inside a forwarding expression")
        if child.kind in (SUM, FAILOVER, IFDEFINED):
            if len(d.children) > 1:
                raise ConfigError("Sum(), Failover() or IfDefined() inside Switch() cannot "
                                  "be normalized")
            # Offset(Sum(x, y), 1) -> Sum(Offset(x, 1), Offset(y, 1)), and alike.
            new_children = []
            for gc in child.children:
                wrapper = d.clone_shallow()
                wrapper.children = [gc]
                new_children.append(wrapper)
            d.kind, d.v1, d.v2, d.alpha = child.kind, child.v1, child.v2, child.alpha
            d.children = new_children
            changed = True
    elif d.kind == SUM:
        if len(d.children) == 1:
            d.assign(d.children[0])
            changed = True
        elif len(d.children) > 2:
            rest = _General(SUM, children=d.children[1:])
            d.children = [d.children[0], rest]
            changed = True
    elif d.kind == SCALE:
        child = d.children[0]
        if child.kind in (OFFSET, REPLACE, ROUND):
            # Swap the two nodes: Scale(s, Offset(x, 1)) -> Offset(Scale(s, x), 1).
            d.kind, child.kind = child.kind, d.kind
            d.alpha, child.alpha = child.alpha, d.alpha
            d.v1, child.v1 = child.v1, d.v1
            d.v2, child.v2 = child.v2, d.v2
            changed = True
        elif child.kind == SUM:
            d.children = [_General(SCALE, alpha=d.alpha, children=[gc])
                          for gc in child.children]
            d.kind, d.alpha = SUM, 0.0
            changed = True
        elif child.kind == SCALE:
            d.alpha *= child.alpha
            d.children = [child.children[0]]
            changed = True
        elif child.kind != NODE:
            raise ConfigError(f"cannot normalize Scale() applied to "
                              f"{_KIND_NAMES.get(child.kind, 'this')}() expression; "
                              f"push Scale() inside other expressions")
    for c in d.children:
        if _normalize_once(c):
            changed = True
    return changed


def _normalized(g: _General) -> _General:
    ans = _normalize_append(g)
    for _ in range(10000):
        if not _normalize_once(ans):
            return ans
    raise ConfigError("descriptor normalization did not converge")


# -------------------------------------------------------------------------------------
# conversion


def _to_sum(g: _General):
    from engine.nnet import descriptors as D  # noqa: PLC0415
    if g.kind in (SUM, FAILOVER):
        if len(g.children) != 2:
            raise ConfigError("badly formed Sum()/Failover() expression")
        op = D.SumOp.SUM if g.kind == SUM else D.SumOp.FAILOVER
        return D.BinarySumDescriptor(op, _to_sum(g.children[0]), _to_sum(g.children[1]))
    if g.kind == IFDEFINED:
        return D.OptionalSumDescriptor(_to_sum(g.children[0]))
    if g.kind == CONST:
        return D.ConstantSumDescriptor(g.alpha, g.v1)
    return D.SimpleSumDescriptor(_to_forwarding(g))


def _to_forwarding(g: _General):
    from engine.nnet import descriptors as D  # noqa: PLC0415
    if g.kind == NODE:
        return D.SimpleForwardingDescriptor(g.v1)
    if g.kind == OFFSET:
        return D.OffsetForwardingDescriptor(_to_forwarding(g.children[0]), Index(0, g.v1, g.v2))
    if g.kind == SWITCH:
        return D.SwitchingForwardingDescriptor([_to_forwarding(c) for c in g.children])
    if g.kind == ROUND:
        return D.RoundingForwardingDescriptor(_to_forwarding(g.children[0]), g.v1)
    if g.kind == REPLACE:
        return D.ReplaceIndexForwardingDescriptor(_to_forwarding(g.children[0]),
                                                  "t" if g.v1 == 1 else "x", g.v2)
    if g.kind == SCALE:
        if len(g.children) != 1 or g.children[0].kind != NODE:
            raise ConfigError("invalid combination of Scale() and other expressions in "
                              "descriptor")
        return D.SimpleForwardingDescriptor(g.children[0].v1, g.alpha)
    if g.kind == CONST:
        raise ConfigError("Const() appears too deep in the descriptor expression")
    raise ConfigError(f"{_KIND_NAMES.get(g.kind, '?')}() cannot appear inside a forwarding "
                      f"expression (Offset/Switch/Round/ReplaceIndex/Scale)")


def parse_descriptor(text: str, node_names: "Sequence[str | None] | DescriptorNames",
                     all_names: Sequence[str] | None = None):
    """Parse ``text`` into a normalised ``Descriptor``.

    ``node_names[i]`` is the name by which node ``i`` may be referred to, or
    None (or "") for nodes a descriptor may not use.  ``all_names`` (optional)
    lets the error for a non-referable node say why.  A caller parsing many
    descriptors of one network passes ``DescriptorNames(node_names, all_names)``
    instead, made once.
    """
    from engine.nnet.descriptors import Descriptor  # noqa: PLC0415
    names = (node_names if isinstance(node_names, DescriptorNames)
             else DescriptorNames(node_names, all_names))
    p = _Parser(text, names)
    if not p.tokens:
        raise ConfigError("empty descriptor expression")
    g = p.parse()
    if p.pos != len(p.tokens):
        raise p.error(f"expected end of expression, got {p.peek()!r}")
    try:
        norm = _normalized(g)
    except RecursionError:
        raise ConfigError(f"descriptor {text[:60]!r}... is nested too deeply") from None
    try:
        if norm.kind == APPEND:
            parts = [_to_sum(c) for c in norm.children]
        else:
            parts = [_to_sum(norm)]
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise ConfigError(f"bad descriptor {text!r}: {e.reason}") from None
        raise ConfigError(f"bad descriptor {text!r}: {e}") from None
    return Descriptor(parts)
