"""Descriptors: how a network node's input is glued together from other nodes'
outputs (Kaldi's nnet-descriptor.h/.cc).

The class structure follows Kaldi's, because the compiler walks it:

- ``ForwardingDescriptor`` maps one output Index to one input Cindex:
  ``SimpleForwarding`` (a node, with a scale), ``Offset``, ``Switch``,
  ``Round``, ``ReplaceIndex``.
- ``SumDescriptor`` sums (or fails over between) forwarding descriptors:
  ``SimpleSum``, ``BinarySum`` (SUM or FAILOVER), ``Optional`` (IfDefined),
  ``Constant`` (Const).
- ``Descriptor`` appends ``SumDescriptor`` parts column-wise.

Parsing goes through an intermediate tree (Kaldi's GeneralDescriptor) that is
normalised exactly as Kaldi does it, so that ``write`` prints Kaldi's
normalised form byte for byte.  The parser itself lives in
``descriptor_parse.py``; ``parse_descriptor`` is re-exported here.
"""

from __future__ import annotations

import math
from enum import IntEnum
from typing import Callable, Sequence

from engine.core.errors import ConfigError
from engine.core.index import Cindex, Index

# Kaldi's GetScaleForNode answers +infinity for "this node does not appear here".
SCALE_NOT_FOUND = math.inf

CindexSet = Callable[[Cindex], bool]


def lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b) if a and b else max(a, b)


def format_cpp_float(x: float) -> str:
    """What ``std::ostream << float`` prints with default settings (%g, 6 digits)."""
    return "%g" % x


def _scale_valid(x: float) -> bool:
    return x - x == 0  # false for inf and nan, as Kaldi's test


# ---------------------------------------------------------------------------------
# forwarding descriptors


class ForwardingDescriptor:
    """Maps an output Index to exactly one input Cindex."""

    def map_to_input(self, index: Index) -> Cindex:
        raise NotImplementedError

    def dim(self, nnet) -> int:
        raise NotImplementedError

    def modulus(self) -> int:
        return 1

    def write(self, names: Sequence[str]) -> str:
        raise NotImplementedError

    def get_node_dependencies(self) -> list[int]:
        raise NotImplementedError

    def get_scale_for_node(self, node: int) -> float:
        raise NotImplementedError

    def copy(self) -> "ForwardingDescriptor":
        raise NotImplementedError

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self):
        return hash(repr(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class SimpleForwardingDescriptor(ForwardingDescriptor):
    def __init__(self, node_index: int, scale: float = 1.0):
        if node_index < 0:
            raise ValueError("SimpleForwardingDescriptor needs a node index >= 0")
        self.node_index = int(node_index)
        self.scale = float(scale)

    def map_to_input(self, index: Index) -> Cindex:
        return Cindex(self.node_index, index)

    def dim(self, nnet) -> int:
        return nnet.node_dim(self.node_index)

    def write(self, names: Sequence[str]) -> str:
        name = names[self.node_index]
        if self.scale == 1.0:
            return name
        return f"Scale({format_cpp_float(self.scale)}, {name})"

    def get_node_dependencies(self) -> list[int]:
        return [self.node_index]

    def get_scale_for_node(self, node: int) -> float:
        return self.scale if node == self.node_index else SCALE_NOT_FOUND

    def copy(self) -> "SimpleForwardingDescriptor":
        return SimpleForwardingDescriptor(self.node_index, self.scale)


class OffsetForwardingDescriptor(ForwardingDescriptor):
    def __init__(self, src: ForwardingDescriptor, offset: Index):
        self.src = src
        self.offset = Index(*offset)

    def map_to_input(self, index: Index) -> Cindex:
        o = self.offset
        return self.src.map_to_input(Index(index.n + o.n, index.t + o.t, index.x + o.x))

    def dim(self, nnet) -> int:
        return self.src.dim(nnet)

    def modulus(self) -> int:
        return self.src.modulus()

    def write(self, names: Sequence[str]) -> str:
        s = f"Offset({self.src.write(names)}, {self.offset.t}"
        if self.offset.x != 0:
            s += f", {self.offset.x}"
        return s + ")"

    def get_node_dependencies(self) -> list[int]:
        return self.src.get_node_dependencies()

    def get_scale_for_node(self, node: int) -> float:
        return self.src.get_scale_for_node(node)

    def copy(self) -> "OffsetForwardingDescriptor":
        return OffsetForwardingDescriptor(self.src.copy(), self.offset)


class SwitchingForwardingDescriptor(ForwardingDescriptor):
    def __init__(self, srcs: list[ForwardingDescriptor]):
        if not srcs:
            raise ValueError("Switch() needs at least one argument")
        self.srcs = list(srcs)

    def map_to_input(self, index: Index) -> Cindex:
        # Python's % is the mathematical modulus Kaldi computes by hand.
        return self.srcs[index.t % len(self.srcs)].map_to_input(index)

    def dim(self, nnet) -> int:
        return self.srcs[0].dim(nnet)

    def modulus(self) -> int:
        ans = len(self.srcs)
        for s in self.srcs:
            ans = lcm(ans, s.modulus())
        return ans

    def write(self, names: Sequence[str]) -> str:
        return "Switch(" + ", ".join(s.write(names) for s in self.srcs) + ")"

    def get_node_dependencies(self) -> list[int]:
        out: list[int] = []
        for s in self.srcs:
            out.extend(s.get_node_dependencies())
        return out

    def get_scale_for_node(self, node: int) -> float:
        ans = SCALE_NOT_FOUND
        for s in self.srcs:
            this = s.get_scale_for_node(node)
            if this != SCALE_NOT_FOUND:
                if ans != SCALE_NOT_FOUND and ans != this:
                    raise ConfigError(f"invalid descriptor: node {node} appears in Switch() "
                                      f"with two different scales {this:g} vs. {ans:g}")
                ans = this
        return ans

    def copy(self) -> "SwitchingForwardingDescriptor":
        return SwitchingForwardingDescriptor([s.copy() for s in self.srcs])


class RoundingForwardingDescriptor(ForwardingDescriptor):
    def __init__(self, src: ForwardingDescriptor, t_modulus: int):
        if t_modulus < 1:
            raise ValueError(f"Round() needs a modulus >= 1, got {t_modulus}")
        self.src = src
        self.t_modulus = int(t_modulus)

    def map_to_input(self, index: Index) -> Cindex:
        return self.src.map_to_input(Index(index.n, index.t - index.t % self.t_modulus, index.x))

    def dim(self, nnet) -> int:
        return self.src.dim(nnet)

    def modulus(self) -> int:
        # Kaldi reports the rounding modulus alone, not combined with the source's.
        return self.t_modulus

    def write(self, names: Sequence[str]) -> str:
        return f"Round({self.src.write(names)}, {self.t_modulus})"

    def get_node_dependencies(self) -> list[int]:
        return self.src.get_node_dependencies()

    def get_scale_for_node(self, node: int) -> float:
        return self.src.get_scale_for_node(node)

    def copy(self) -> "RoundingForwardingDescriptor":
        return RoundingForwardingDescriptor(self.src.copy(), self.t_modulus)


class ReplaceIndexForwardingDescriptor(ForwardingDescriptor):
    def __init__(self, src: ForwardingDescriptor, variable: str, value: int):
        if variable not in ("t", "x"):
            raise ValueError(f"ReplaceIndex() variable must be 't' or 'x', got {variable!r}")
        self.src = src
        self.variable = variable
        self.value = int(value)

    def map_to_input(self, index: Index) -> Cindex:
        if self.variable == "t":
            return self.src.map_to_input(Index(index.n, self.value, index.x))
        return self.src.map_to_input(Index(index.n, index.t, self.value))

    def dim(self, nnet) -> int:
        return self.src.dim(nnet)

    # Kaldi does not override Modulus() here: ReplaceIndex hides the source's modulus.

    def write(self, names: Sequence[str]) -> str:
        return f"ReplaceIndex({self.src.write(names)}, {self.variable}, {self.value})"

    def get_node_dependencies(self) -> list[int]:
        return self.src.get_node_dependencies()

    def get_scale_for_node(self, node: int) -> float:
        return self.src.get_scale_for_node(node)

    def copy(self) -> "ReplaceIndexForwardingDescriptor":
        return ReplaceIndexForwardingDescriptor(self.src.copy(), self.variable, self.value)


# ---------------------------------------------------------------------------------
# sum descriptors


class SumDescriptor:
    def get_dependencies(self, index: Index) -> list[Cindex]:
        raise NotImplementedError

    def is_computable(self, index: Index, cindex_set: CindexSet,
                      used_inputs: list[Cindex] | None) -> bool:
        raise NotImplementedError

    def dim(self, nnet) -> int:
        raise NotImplementedError

    def get_node_dependencies(self) -> list[int]:
        raise NotImplementedError

    def get_scale_for_node(self, node: int) -> float:
        raise NotImplementedError

    def modulus(self) -> int:
        raise NotImplementedError

    def write(self, names: Sequence[str]) -> str:
        raise NotImplementedError

    def copy(self) -> "SumDescriptor":
        raise NotImplementedError

    __eq__ = ForwardingDescriptor.__eq__
    __hash__ = ForwardingDescriptor.__hash__
    __repr__ = ForwardingDescriptor.__repr__


class SimpleSumDescriptor(SumDescriptor):
    def __init__(self, src: ForwardingDescriptor):
        self.src = src

    def get_dependencies(self, index: Index) -> list[Cindex]:
        return [self.src.map_to_input(index)]

    def is_computable(self, index, cindex_set, used_inputs=None) -> bool:
        c = self.src.map_to_input(index)
        present = bool(cindex_set(c))
        if present and used_inputs is not None:
            used_inputs.append(c)
        return present

    def dim(self, nnet) -> int:
        return self.src.dim(nnet)

    def get_node_dependencies(self) -> list[int]:
        return self.src.get_node_dependencies()

    def get_scale_for_node(self, node: int) -> float:
        # Forwarding descriptors carry no constant term.
        return self.src.get_scale_for_node(node) if node >= 0 else 0.0

    def modulus(self) -> int:
        return self.src.modulus()

    def write(self, names) -> str:
        return self.src.write(names)

    def copy(self) -> "SimpleSumDescriptor":
        return SimpleSumDescriptor(self.src.copy())


class OptionalSumDescriptor(SumDescriptor):
    """IfDefined(x): x where computable, zero elsewhere; always computable."""

    def __init__(self, src: SumDescriptor):
        self.src = src

    def get_dependencies(self, index: Index) -> list[Cindex]:
        return self.src.get_dependencies(index)

    def is_computable(self, index, cindex_set, used_inputs=None) -> bool:
        # Evaluated for its side effect on used_inputs; the answer is always yes.
        self.src.is_computable(index, cindex_set, used_inputs)
        return True

    def dim(self, nnet) -> int:
        return self.src.dim(nnet)

    def get_node_dependencies(self) -> list[int]:
        return self.src.get_node_dependencies()

    def get_scale_for_node(self, node: int) -> float:
        ans = self.src.get_scale_for_node(node)
        if node < 0 and ans != 0.0:
            raise ConfigError("illegal combination of IfDefined() and Const() in a descriptor")
        return ans

    def modulus(self) -> int:
        return self.src.modulus()

    def write(self, names) -> str:
        return f"IfDefined({self.src.write(names)})"

    def copy(self) -> "OptionalSumDescriptor":
        return OptionalSumDescriptor(self.src.copy())


class ConstantSumDescriptor(SumDescriptor):
    def __init__(self, value: float, dim: int):
        if dim <= 0 or not _scale_valid(value):
            raise ValueError(f"Const() needs a finite value and a dimension > 0, "
                             f"got {value!r}, {dim!r}")
        self.value = float(value)
        self.dim_ = int(dim)

    def get_dependencies(self, index: Index) -> list[Cindex]:
        return []

    def is_computable(self, index, cindex_set, used_inputs=None) -> bool:
        return True

    def dim(self, nnet) -> int:
        return self.dim_

    def get_node_dependencies(self) -> list[int]:
        return []

    def get_scale_for_node(self, node: int) -> float:
        return self.value if node < 0 else SCALE_NOT_FOUND

    def modulus(self) -> int:
        return 1

    def write(self, names) -> str:
        return f"Const({format_cpp_float(self.value)}, {self.dim_})"

    def copy(self) -> "ConstantSumDescriptor":
        return ConstantSumDescriptor(self.value, self.dim_)


class SumOp(IntEnum):
    SUM = 0
    FAILOVER = 1


class BinarySumDescriptor(SumDescriptor):
    """Sum(a, b) or Failover(a, b) (a if computable, else b)."""

    SUM = SumOp.SUM
    FAILOVER = SumOp.FAILOVER

    def __init__(self, op: SumOp, src1: SumDescriptor, src2: SumDescriptor):
        self.op = SumOp(op)
        self.src1 = src1
        self.src2 = src2

    def get_dependencies(self, index: Index) -> list[Cindex]:
        return self.src1.get_dependencies(index) + self.src2.get_dependencies(index)

    def is_computable(self, index, cindex_set, used_inputs=None) -> bool:
        want = used_inputs is not None
        in1: list[Cindex] | None = [] if want else None
        in2: list[Cindex] | None = [] if want else None
        ok1 = self.src1.is_computable(index, cindex_set, in1)
        ok2 = self.src2.is_computable(index, cindex_set, in2)
        if self.op == SumOp.SUM:
            if ok1 and ok2:
                if want:
                    used_inputs.extend(in1)
                    used_inputs.extend(in2)
                return True
            return False
        if ok1:
            if want:
                used_inputs.extend(in1)
            return True
        if ok2:
            if want:
                used_inputs.extend(in2)
            return True
        return False

    def dim(self, nnet) -> int:
        d1, d2 = self.src1.dim(nnet), self.src2.dim(nnet)
        if d1 != d2:
            what = "Sum" if self.op == SumOp.SUM else "Failover"
            raise ConfigError(f"{what}() expression with inconsistent dimensions: {d1} vs. {d2}")
        return d1

    def get_node_dependencies(self) -> list[int]:
        return self.src1.get_node_dependencies() + self.src2.get_node_dependencies()

    def get_scale_for_node(self, node: int) -> float:
        a1 = self.src1.get_scale_for_node(node)
        a2 = self.src2.get_scale_for_node(node)
        v1, v2 = _scale_valid(a1), _scale_valid(a2)
        if node < 0:
            # node -1 asks for the constant term.
            if self.op == SumOp.SUM:
                return a1 + a2
            if a1 != a2:
                raise ConfigError("illegal combination of Failover() and Const() in a "
                                  "descriptor (not supported)")
        if v1 and v2 and a1 != a2:
            raise ConfigError(f"unsupported descriptor: node {node} appears with scales "
                              f"{a1:g} and {a2:g}")
        return a1 if not v2 else a2

    def modulus(self) -> int:
        return lcm(self.src1.modulus(), self.src2.modulus())

    def write(self, names) -> str:
        what = "Sum" if self.op == SumOp.SUM else "Failover"
        return f"{what}({self.src1.write(names)}, {self.src2.write(names)})"

    def copy(self) -> "BinarySumDescriptor":
        return BinarySumDescriptor(self.op, self.src1.copy(), self.src2.copy())


# ---------------------------------------------------------------------------------
# the top level


class Descriptor:
    """Append() of SumDescriptor parts; the input of a component or output node."""

    def __init__(self, parts: list[SumDescriptor]):
        if not parts:
            raise ValueError("a Descriptor needs at least one part")
        self.parts = list(parts)

    def num_parts(self) -> int:
        return len(self.parts)

    def part(self, i: int) -> SumDescriptor:
        return self.parts[i]

    def dim(self, nnet) -> int:
        return sum(p.dim(nnet) for p in self.parts)

    def write(self, names: Sequence[str]) -> str:
        if len(self.parts) == 1:
            return self.parts[0].write(names)
        return "Append(" + ", ".join(p.write(names) for p in self.parts) + ")"

    def get_dependencies(self, index: Index) -> list[Cindex]:
        out: list[Cindex] = []
        for p in self.parts:
            out.extend(p.get_dependencies(index))
        return out

    def is_computable(self, index: Index, cindex_set: CindexSet,
                      used_inputs: list[Cindex] | None = None) -> bool:
        if used_inputs is not None:
            used_inputs.clear()
        for p in self.parts:
            if not p.is_computable(index, cindex_set, used_inputs):
                if used_inputs is not None:
                    used_inputs.clear()
                return False
        return True

    def get_node_dependencies(self) -> list[int]:
        out: list[int] = []
        for p in self.parts:
            out.extend(p.get_node_dependencies())
        return out

    def modulus(self) -> int:
        ans = 1
        for p in self.parts:
            ans = lcm(ans, p.modulus())
        return ans

    def copy(self) -> "Descriptor":
        return Descriptor([p.copy() for p in self.parts])

    def renumber(self, old_to_new: Sequence[int]) -> "Descriptor":
        """A copy with node indexes mapped through ``old_to_new``."""
        new = self.copy()
        for fd in iter_forwarding(new):
            if isinstance(fd, SimpleForwardingDescriptor):
                fd.node_index = int(old_to_new[fd.node_index])
        return new

    def __eq__(self, other) -> bool:
        return isinstance(other, Descriptor) and self.parts == other.parts

    def __repr__(self) -> str:
        return f"Descriptor({self.parts!r})"


def iter_forwarding(obj):
    """Every ForwardingDescriptor inside ``obj`` (depth first, parents first)."""
    stack = [obj]
    while stack:
        d = stack.pop()
        if isinstance(d, Descriptor):
            stack.extend(reversed(d.parts))
        elif isinstance(d, (SimpleSumDescriptor, OptionalSumDescriptor)):
            stack.append(d.src)
        elif isinstance(d, BinarySumDescriptor):
            stack.extend([d.src2, d.src1])
        elif isinstance(d, ForwardingDescriptor):
            yield d
            if isinstance(d, SwitchingForwardingDescriptor):
                stack.extend(reversed(d.srcs))
            elif hasattr(d, "src"):
                stack.append(d.src)


from engine.nnet.descriptor_parse import parse_descriptor, tokenize_descriptor  # noqa: E402,F401
