"""Descriptors compiled into plain Python functions for the graph builder
(the speed-critical use of Kaldi's Descriptor::GetDependencies and
Descriptor::IsComputable in nnet-computation-graph.cc).

engine.nnet.descriptors walks an object tree per Index and builds Index /
Cindex named tuples on the way; the graph builder asks that question a few
times for each of up to a million cindexes.  Here each node's descriptor is
turned, once per network, into:

- ``deps(idx)``: the input cindexes of Index ``idx`` as ``(node, (n, t, x))`` tuples, in
  GetDependencies order (parts left to right, Sum/Failover left then right).
  The code is generated from the forwarding-descriptor chain (Offset, Switch,
  Round, ReplaceIndex, node) so that evaluating it is one Python call.  Plain
  tuples hash and compare equal to the Cindex/Index named tuples the graph
  stores, so they can be looked up directly.
- ``all_required``: true when the descriptor contains no IfDefined, Failover
  or Const.  Then it is computable exactly when every dependency is, and all
  dependencies are used: the builder needs no per-cindex evaluation of the
  tree at all.
- ``uses_present``: true when, for an Index it can compute, the inputs the
  descriptor uses are exactly those present (no Failover, and IfDefined only
  around a single input); the graph builder then reads what is used off the
  statuses alone.
- ``deps_arrays(n, t, x)``: the same for whole arrays of Indexes (NumPy), for
  the array graph builder (engine.compiler.graph_arrays) and the compiler.
- ``linear_positions()``: per dependency position, the node and constant
  (n, t, x) shift when every input is the Index shifted (Offset chains).
- ``computable(present)`` / ``evaluate(present)``: the general answer given, for
  each dependency position (same order as ``deps``), whether that input is in
  the cindex set; ``computable_arrays`` / ``used_arrays`` the same for many
  Indexes at once (a boolean matrix, one row per Index).  They follow the
  semantics of engine.nnet.descriptors (IfDefined always computable but reports
  the inputs its source used; Failover takes the first computable side; Sum
  needs both; Append needs all parts and reports nothing when a part fails).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from engine.compiler.array_ops import rows_all
from engine.nnet.descriptors import (BinarySumDescriptor, ConstantSumDescriptor, Descriptor,
                                     ForwardingDescriptor, OffsetForwardingDescriptor,
                                     OptionalSumDescriptor, ReplaceIndexForwardingDescriptor,
                                     RoundingForwardingDescriptor, SimpleForwardingDescriptor,
                                     SimpleSumDescriptor, SumDescriptor,
                                     SwitchingForwardingDescriptor, SumOp)


class UnsupportedDescriptor(Exception):
    """A descriptor class this module does not know; callers use the object tree."""


def _forward_expr(fd: ForwardingDescriptor, n: str, t: str, x: str) -> str:
    """Python expression for ``fd.map_to_input(Index(n, t, x))`` as a plain tuple."""
    kind = type(fd)
    if kind is SimpleForwardingDescriptor:
        if (n, t, x) == ("n", "t", "x"):
            # Unchanged Index: share the caller's object (less memory, and the
            # graph's cindexes then share Index objects as the object tree does).
            return f"({fd.node_index}, idx)"
        return f"({fd.node_index}, ({n}, {t}, {x}))"
    if kind is OffsetForwardingDescriptor:
        o = fd.offset
        return _forward_expr(fd.src, _shift(n, o.n), _shift(t, o.t), _shift(x, o.x))
    if kind is RoundingForwardingDescriptor:
        m = fd.t_modulus
        # t - t % m as (t // m) * m: equal for Python's ints (floor division and modulus
        # agree), and t written once, so that nested Round()s stay linear in size
        return _forward_expr(fd.src, n, t if m == 1 else f"(({t}) // {m} * {m})", x)
    if kind is ReplaceIndexForwardingDescriptor:
        if fd.variable == "t":
            return _forward_expr(fd.src, n, str(fd.value), x)
        return _forward_expr(fd.src, n, t, str(fd.value))
    if kind is SwitchingForwardingDescriptor:
        # Python's % is the mathematical modulus, as in the object version.
        choices = ", ".join(_forward_expr(s, n, t, x) for s in fd.srcs)
        return f"(({choices},)[({t}) % {len(fd.srcs)}])"
    raise UnsupportedDescriptor(type(fd).__name__)


def _shift(var: str, by: int) -> str:
    if by == 0:
        return var
    return f"({var} + {by})" if by > 0 else f"({var} - {-by})"


def _forward_arrays(fd: ForwardingDescriptor, n, t, x) -> tuple:
    """``map_to_input`` on whole int64 arrays: (node, n, t, x), node an int or,
    below a Switch, an array."""
    kind = type(fd)
    if kind is SimpleForwardingDescriptor:
        return fd.node_index, n, t, x
    if kind is OffsetForwardingDescriptor:
        o = fd.offset
        return _forward_arrays(fd.src, n + o.n if o.n else n, t + o.t if o.t else t,
                               x + o.x if o.x else x)
    if kind is RoundingForwardingDescriptor:
        m = fd.t_modulus
        return _forward_arrays(fd.src, n, t if m == 1 else t - t % m, x)
    if kind is ReplaceIndexForwardingDescriptor:
        if fd.variable == "t":
            return _forward_arrays(fd.src, n, np.full_like(t, fd.value), x)
        return _forward_arrays(fd.src, n, t, np.full_like(x, fd.value))
    if kind is SwitchingForwardingDescriptor:
        which = t % len(fd.srcs)
        outs = [_forward_arrays(s, n, t, x) for s in fd.srcs]
        return tuple(np.choose(which, [np.broadcast_to(np.asarray(o[k], dtype=np.int64),
                                                       t.shape) for o in outs])
                     for k in range(4))
    raise UnsupportedDescriptor(type(fd).__name__)


def _sum_forwarding(sd: SumDescriptor, out: list) -> None:
    """The forwarding descriptors of ``sd`` in GetDependencies order."""
    kind = type(sd)
    if kind is SimpleSumDescriptor:
        out.append(sd.src)
    elif kind is OptionalSumDescriptor:
        _sum_forwarding(sd.src, out)
    elif kind is BinarySumDescriptor:
        _sum_forwarding(sd.src1, out)
        _sum_forwarding(sd.src2, out)
    elif kind is not ConstantSumDescriptor:
        raise UnsupportedDescriptor(type(sd).__name__)


def _sum_exprs(sd: SumDescriptor, out: list[str], n: str, t: str, x: str) -> None:
    """Forwarding expressions of ``sd`` in GetDependencies order."""
    kind = type(sd)
    if kind is SimpleSumDescriptor:
        out.append(_forward_expr(sd.src, n, t, x))
    elif kind is OptionalSumDescriptor:
        _sum_exprs(sd.src, out, n, t, x)
    elif kind is ConstantSumDescriptor:
        pass
    elif kind is BinarySumDescriptor:
        _sum_exprs(sd.src1, out, n, t, x)
        _sum_exprs(sd.src2, out, n, t, x)
    else:
        raise UnsupportedDescriptor(type(sd).__name__)


def _all_required(sd: SumDescriptor) -> bool:
    kind = type(sd)
    if kind is SimpleSumDescriptor:
        return True
    if kind is BinarySumDescriptor:
        return sd.op == SumOp.SUM and _all_required(sd.src1) and _all_required(sd.src2)
    return False


def _uses_present(sd: SumDescriptor) -> tuple[bool, bool]:
    """(whether ``sd``, when computable, uses exactly the positions present; whether
    no position is present whenever it is not computable)."""
    kind = type(sd)
    if kind is SimpleSumDescriptor or kind is ConstantSumDescriptor:
        return True, True
    if kind is OptionalSumDescriptor:
        # never fails; uses its source's inputs when that is computable, none otherwise
        exact, empty = _uses_present(sd.src)
        return exact and empty, True
    if kind is BinarySumDescriptor and sd.op == SumOp.SUM:
        # computable when both sides are, using both sides' inputs; when one side
        # fails the other's inputs may still be present
        return _uses_present(sd.src1)[0] and _uses_present(sd.src2)[0], False
    return False, False


# A compiled sum descriptor: given the presence flags and the position of its
# first dependency, (computable, positions used, next position).
_Eval = Callable[[list, int], tuple]


def _compile_eval(sd: SumDescriptor) -> _Eval:
    kind = type(sd)
    if kind is SimpleSumDescriptor:
        def simple(p, i):
            return (True, [i], i + 1) if p[i] else (False, [], i + 1)
        return simple
    if kind is OptionalSumDescriptor:
        inner = _compile_eval(sd.src)

        def optional(p, i):
            _, used, j = inner(p, i)
            return True, used, j
        return optional
    if kind is ConstantSumDescriptor:
        return lambda p, i: (True, [], i)
    if kind is BinarySumDescriptor:
        a, b = _compile_eval(sd.src1), _compile_eval(sd.src2)
        is_sum = sd.op == SumOp.SUM

        def binary(p, i):
            ok1, u1, j = a(p, i)
            ok2, u2, k = b(p, j)
            if is_sum:
                return (True, u1 + u2, k) if ok1 and ok2 else (False, [], k)
            if ok1:
                return True, u1, k
            if ok2:
                return True, u2, k
            return False, [], k
        return binary
    raise UnsupportedDescriptor(type(sd).__name__)


# The same on whole arrays: given the (m, K) presence matrix, the position of the
# first dependency and whether the used positions are wanted, (computable (m,),
# [(position, mask of rows using it)], next position).  Every mask is already
# restricted to the rows where that sub-descriptor is computable.
_EvalArrays = Callable[[np.ndarray, int, bool], tuple]


def _compile_eval_arrays(sd: SumDescriptor) -> _EvalArrays:
    kind = type(sd)
    if kind is SimpleSumDescriptor:
        def simple(p, i, want):
            ok = p[:, i]
            return ok, ([(i, ok)] if want else None), i + 1
        return simple
    if kind is OptionalSumDescriptor:
        inner = _compile_eval_arrays(sd.src)

        def optional(p, i, want):
            _, used, j = inner(p, i, want)
            return np.ones(p.shape[0], dtype=bool), used, j
        return optional
    if kind is ConstantSumDescriptor:
        return lambda p, i, want: (np.ones(p.shape[0], dtype=bool), [] if want else None, i)
    if kind is BinarySumDescriptor:
        a, b = _compile_eval_arrays(sd.src1), _compile_eval_arrays(sd.src2)
        is_sum = sd.op == SumOp.SUM

        def binary(p, i, want):
            ok1, u1, j = a(p, i, want)
            ok2, u2, k = b(p, j, want)
            if is_sum:
                ok = ok1 & ok2
                return ok, ([(q, m & ok) for q, m in u1 + u2] if want else None), k
            ok = ok1 | ok2
            if not want:
                return ok, None, k
            return ok, u1 + [(q, m & ~ok1) for q, m in u2], k
        return binary
    raise UnsupportedDescriptor(type(sd).__name__)


def offset_chain(fd) -> tuple[int, int, int, int] | None:
    """(node, dn, dt, dx) when the forwarding descriptor ``fd`` reads the Index shifted
    by a constant (a chain of Offsets over a node, or the node itself), else None."""
    dn = dt = dx = 0
    while type(fd) is OffsetForwardingDescriptor:
        o = fd.offset
        dn, dt, dx = dn + o.n, dt + o.t, dx + o.x
        fd = fd.src
    if type(fd) is not SimpleForwardingDescriptor:
        return None
    return fd.node_index, dn, dt, dx


class FastDescriptor:
    """One node's Descriptor as generated functions (see the module docstring)."""

    __slots__ = ("deps", "dep1", "all_required", "uses_present", "num_deps", "_parts",
                 "forwarding", "_array_parts")

    def __init__(self, desc: Descriptor) -> None:
        exprs: list[str] = []
        for part in desc.parts:
            _sum_exprs(part, exprs, "n", "t", "x")
        self.num_deps = len(exprs)
        src = f"def deps(idx):\n    n, t, x = idx\n    return [{', '.join(exprs)}]\n"
        scope: dict = {}
        exec(src, scope)  # noqa: S102 - code generated above from the descriptor tree
        self.deps: Callable[[tuple], list] = scope["deps"]
        # With exactly one input: that input itself (no list), for hot loops.
        self.dep1: Callable[[tuple], tuple] | None = None
        if len(exprs) == 1:
            exec(f"def dep1(idx):\n    n, t, x = idx\n    return {exprs[0]}\n", scope)  # noqa: S102
            self.dep1 = scope["dep1"]
        self.all_required = all(_all_required(p) for p in desc.parts)
        self.uses_present = all(_uses_present(p)[0] for p in desc.parts)
        self._parts = [_compile_eval(p) for p in desc.parts]
        self._array_parts = [_compile_eval_arrays(p) for p in desc.parts]
        self.forwarding: list = []
        for part in desc.parts:
            _sum_forwarding(part, self.forwarding)

    def linear_positions(self) -> list[tuple[int, int, int, int]] | None:
        """Per dependency position, (node, dn, dt, dx) when every input is the Index
        shifted by a constant (Offset chains), else None."""
        out = []
        for fd in self.forwarding:
            shift = offset_chain(fd)
            if shift is None:
                return None
            out.append(shift)
        return out

    def deps_arrays(self, n: np.ndarray, t: np.ndarray, x: np.ndarray) -> list[tuple]:
        """``deps`` for many Indexes at once: per dependency position, the
        (node, n, t, x) int64 arrays (node an int unless a Switch decides it)."""
        return [_forward_arrays(fd, n, t, x) for fd in self.forwarding]

    def evaluate(self, present: list) -> tuple[bool, list[int]]:
        """(computable, positions of the dependencies used) given presence flags."""
        if self.all_required:
            if all(present):
                return True, list(range(self.num_deps))
            return False, []
        used: list[int] = []
        i = 0
        for part in self._parts:
            ok, u, i = part(present, i)
            if not ok:
                return False, []
            used.extend(u)
        return True, used

    def computable(self, present: list) -> bool:
        if self.all_required:
            return all(present)
        return self.evaluate(present)[0]

    def computable_arrays(self, present: np.ndarray) -> np.ndarray:
        """``computable`` for each row of the (m, num_deps) boolean matrix ``present``."""
        if self.all_required:
            return rows_all(present)
        ok = np.ones(present.shape[0], dtype=bool)
        i = 0
        for part in self._array_parts:
            k, _, i = part(present, i, False)
            ok &= k
        return ok

    def used_arrays(self, present: np.ndarray) -> np.ndarray:
        """The positions ``evaluate`` reports as used, for each row of ``present``
        ((m, num_deps) booleans; a row that is not computable uses nothing)."""
        if self.all_required:
            return present & rows_all(present)[:, None]
        ok = np.ones(present.shape[0], dtype=bool)
        used: list = []
        i = 0
        for part in self._array_parts:
            k, u, i = part(present, i, True)
            ok &= k
            used.extend(u)
        out = np.zeros(present.shape, dtype=bool)
        for q, m in used:
            out[:, q] |= m & ok
        return out


def _structure(obj) -> tuple:
    """A hashable value equal for descriptor trees that compile to the same code."""
    kind = type(obj)
    if kind is SimpleForwardingDescriptor:
        return ("node", obj.node_index)
    if kind is OffsetForwardingDescriptor:
        return ("offset", tuple(obj.offset), _structure(obj.src))
    if kind is RoundingForwardingDescriptor:
        return ("round", obj.t_modulus, _structure(obj.src))
    if kind is ReplaceIndexForwardingDescriptor:
        return ("replace", obj.variable, obj.value, _structure(obj.src))
    if kind is SwitchingForwardingDescriptor:
        return ("switch",) + tuple(_structure(s) for s in obj.srcs)
    if kind is SimpleSumDescriptor:
        return ("simple", _structure(obj.src))
    if kind is OptionalSumDescriptor:
        return ("optional", _structure(obj.src))
    if kind is ConstantSumDescriptor:
        return ("const",)
    if kind is BinarySumDescriptor:
        return ("binary", int(obj.op), _structure(obj.src1), _structure(obj.src2))
    if kind is Descriptor:
        return ("append",) + tuple(_structure(p) for p in obj.parts)
    raise UnsupportedDescriptor(kind.__name__)


# Compiled descriptors by structure: generating and exec'ing the code is most of
# the cost for small requests, and networks repeat the same shapes.  Scales and
# constant values do not enter the structure (nothing here depends on them).
_CACHE: dict[tuple, FastDescriptor] = {}
_CACHE_LIMIT = 4096


def compile_descriptor(desc: Descriptor) -> FastDescriptor | None:
    """The compiled form of ``desc``, or None for a descriptor class not known here."""
    try:
        key = _structure(desc)
    except UnsupportedDescriptor:
        return None
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    try:
        fast = FastDescriptor(desc)
    except UnsupportedDescriptor:
        return None
    if len(_CACHE) >= _CACHE_LIMIT:
        _CACHE.clear()
    _CACHE[key] = fast
    return fast


__all__ = ["FastDescriptor", "compile_descriptor", "UnsupportedDescriptor"]
