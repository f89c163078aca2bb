"""ComputationRequest and IoSpecification (Kaldi's nnet-computation.h).

A request names, for each input node (or component node supplied from
outside), the Indexes whose values the caller provides, and for each output
node the Indexes it wants back; ``has_deriv`` asks for a derivative there
(an output derivative is supplied by the caller, an input derivative is
returned).  The order of ``indexes`` is the row order of the user's matrices,
so it is part of the request's identity.

Besides Kaldi's fields this module gives the request a JSON form (the format of
``kaldi-ref/networks/*/request.json``: ``indexes`` as ``[n, t, x]`` rows), a
canonical byte encoding and its sha256 (used in cache keys), and
``validate(nnet)``, which checks a request against a network before the
compiler sees it, so that a bad request fails with a RequestError naming the
node and Index at fault instead of an assertion deep in the graph builder.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from engine.compiler.array_ops import max_reduce, min_reduce
from engine.core.errors import RequestError, clipped
from engine.core.index import INT32_MAX, INT32_MIN, Index, array_to_indexes, index_rows
from engine.nnet.components.base import MiscComputationInfo


def _to_index_list(indexes: Any, where: str) -> list[Index]:
    """Accept a list of Index / (n, t, x) triples, or an (N, 3) int array."""
    if isinstance(indexes, np.ndarray):
        arr = indexes
        if arr.ndim != 2 or arr.shape[1] != 3 or (arr.size and arr.dtype.kind not in "iu"):
            raise RequestError(f"{where}: indexes must be an (N, 3) integer array of [n, t, x] "
                               f"rows, got shape {arr.shape} dtype {arr.dtype}")
        return array_to_indexes(arr)
    out: list[Index] = []
    for k, row in enumerate(indexes):
        if isinstance(row, Index):
            out.append(row)
            continue
        try:
            n, t, x = row
            if any(isinstance(v, bool) or int(v) != v for v in (n, t, x)):
                raise TypeError
            out.append(Index(int(n), int(t), int(x)))
        except (TypeError, ValueError):
            raise RequestError(f"{where}: index {k} is {row!r}, expected [n, t, x] "
                               f"integers") from None
    return out


def _parse_json(text: str | bytes) -> Any:
    """JSON text (bytes in UTF-8, or UTF-16/32 as json.loads detects them from the first
    bytes, as the HTTP service reads a body), or RequestError naming what is wrong."""
    try:
        return json.loads(text)
    except UnicodeDecodeError as e:
        bom = ""
        if text[:2] in (b"\xff\xfe", b"\xfe\xff"):
            bom = ", after a UTF-16 byte-order mark"
        elif text[:3] == b"\xef\xbb\xbf":
            bom = ", after a UTF-8 byte-order mark"
        raise RequestError(f"request is not valid JSON: its bytes are not {e.encoding} text "
                           f"({e.reason} at byte {e.start}{bom}); write it as UTF-8") from None
    except RecursionError:
        raise RequestError("request is not valid JSON: nested too deeply") from None
    except ValueError as e:          # JSONDecodeError, an integer of too many digits
        raise RequestError(f"request is not valid JSON: {e}") from None


def _json_flag(obj: dict, key: str, where: str) -> bool:
    """The switch ``key`` of a JSON object: false when absent, else a JSON boolean (as the
    HTTP schema's StrictBool takes it: 1, "yes" or null are refused, not converted)."""
    value = obj.get(key, False)
    if not isinstance(value, bool):
        try:
            shown = json.dumps(value)
        except (TypeError, ValueError):
            shown = repr(value)
        raise RequestError(f"{where}{key!r} must be true or false (a JSON boolean), got "
                           f"{clipped(shown)}")
    return value


@dataclass(eq=True)
class IoSpecification:
    """One input or output of a request: node name, Indexes (row order), deriv flag."""

    name: str
    indexes: list[Index] = field(default_factory=list)
    has_deriv: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise RequestError(f"input/output name must be a string, got {self.name!r}")
        self.indexes = _to_index_list(self.indexes, f"{self.name!r}")
        self.has_deriv = bool(self.has_deriv)

    def indexes_array(self) -> np.ndarray:
        """The Indexes as an (N, 3) int32 array of [n, t, x] rows."""
        return index_rows(self.indexes, np.int32)

    def to_json(self) -> dict:
        return {"name": self.name, "has_deriv": self.has_deriv,
                "indexes": [[i.n, i.t, i.x] for i in self.indexes]}

    @classmethod
    def from_json(cls, obj: dict, where: str = "io") -> "IoSpecification":
        if not isinstance(obj, dict):
            raise RequestError(f"{where}: expected an object with name/indexes/has_deriv")
        if "name" not in obj:
            raise RequestError(f"{where}: missing 'name'")
        if "indexes" not in obj:
            raise RequestError(f"{where} {obj['name']!r}: missing 'indexes'")
        return cls(obj["name"], _to_index_list(obj["indexes"], f"{where} {obj['name']!r}"),
                   _json_flag(obj, "has_deriv", f"{where} {obj['name']!r}: "))

    def __str__(self) -> str:
        return (f"name={self.name}, has-deriv={'true' if self.has_deriv else 'false'}, "
                f"num-indexes={len(self.indexes)}")


class ComputationRequest:
    """Kaldi's ComputationRequest: inputs, outputs and what the caller needs back."""

    def __init__(self, inputs: Sequence[IoSpecification], outputs: Sequence[IoSpecification],
                 need_model_derivative: bool = False, store_component_stats: bool = False,
                 misc_info: MiscComputationInfo | None = None):
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.need_model_derivative = bool(need_model_derivative)
        self.store_component_stats = bool(store_component_stats)
        self.misc_info = misc_info if misc_info is not None else MiscComputationInfo()

    # -- lookups ------------------------------------------------------------------
    def index_of_input(self, name: str) -> int:
        """Position of the input named ``name`` in ``inputs``, or -1."""
        for i, spec in enumerate(self.inputs):
            if spec.name == name:
                return i
        return -1

    def index_of_output(self, name: str) -> int:
        """Position of the output named ``name`` in ``outputs``, or -1."""
        for i, spec in enumerate(self.outputs):
            if spec.name == name:
                return i
        return -1

    def max_output_time(self) -> int | None:
        """Largest t over the outputs' Indexes (Kaldi's MaxOutputTimeInRequest), None
        when there are none."""
        return max((ix.t for o in self.outputs for ix in o.indexes), default=None)

    def need_derivatives(self) -> bool:
        """True if any derivative (model or input) is wanted (Kaldi's NeedDerivatives).

        As in Kaldi, asking for a derivative while no output supplies one is an
        error: the backward pass would have nothing to start from.
        """
        ans = self.need_model_derivative or any(s.has_deriv for s in self.inputs)
        if ans and not any(s.has_deriv for s in self.outputs):
            raise RequestError("model or input derivatives were requested but no output "
                               "has has_deriv=true")
        return ans

    # -- equality, encoding ---------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ComputationRequest):
            return NotImplemented
        return (self.inputs == other.inputs and self.outputs == other.outputs
                and self.need_model_derivative == other.need_model_derivative
                and self.store_component_stats == other.store_component_stats)

    def __hash__(self) -> int:
        return hash(self.canonical_bytes())

    def to_json(self) -> dict:
        obj: dict[str, Any] = {"inputs": [s.to_json() for s in self.inputs],
                               "outputs": [s.to_json() for s in self.outputs],
                               "need_model_derivative": self.need_model_derivative}
        # Kept out when false so that reference request.json files round-trip.
        if self.store_component_stats:
            obj["store_component_stats"] = True
        return obj

    @classmethod
    def from_json(cls, obj: dict | str | bytes) -> "ComputationRequest":
        if isinstance(obj, (str, bytes)):
            obj = _parse_json(obj)
        if not isinstance(obj, dict):
            raise RequestError("request must be a JSON object with 'inputs' and 'outputs'")
        unknown = set(obj) - {"inputs", "outputs", "need_model_derivative",
                              "store_component_stats"}
        if unknown:
            raise RequestError(f"request has unknown field(s): {', '.join(sorted(unknown))}")
        for key in ("inputs", "outputs"):
            if not isinstance(obj.get(key), list):
                raise RequestError(f"request field '{key}' must be a list")
        inputs = [IoSpecification.from_json(o, f"input {k}") for k, o in enumerate(obj["inputs"])]
        outputs = [IoSpecification.from_json(o, f"output {k}")
                   for k, o in enumerate(obj["outputs"])]
        return cls(inputs, outputs, _json_flag(obj, "need_model_derivative", "request field "),
                   _json_flag(obj, "store_component_stats", "request field "))

    def canonical_bytes(self) -> bytes:
        """A deterministic encoding of everything that affects compilation: a JSON line
        of the names, flags and Index counts (key order fixed, all flags present), then
        each input's and output's Indexes in order as little-endian int64 n, t, x rows
        (the row order kept).  Made without a Python object per Index: for a 40000-frame
        request a list per Index made the garbage collector walk the whole heap twice."""
        def spec(s: IoSpecification) -> list:
            return [s.name, 1 if s.has_deriv else 0, len(s.indexes)]
        head = {"v": 2, "inputs": [spec(s) for s in self.inputs],
                "outputs": [spec(s) for s in self.outputs],
                "need_model_derivative": int(self.need_model_derivative),
                "store_component_stats": int(self.store_component_stats)}
        parts = [json.dumps(head, sort_keys=True, separators=(",", ":")).encode("ascii"), b"\n"]
        for s in (*self.inputs, *self.outputs):
            try:
                parts.append(index_rows(s.indexes).astype("<i8", copy=False).tobytes())
            except OverflowError:     # beyond 64 bits (never valid): as JSON text instead
                head["v"] = 3
                return json.dumps([head, [[[*i] for i in t.indexes] for t in (
                    *self.inputs, *self.outputs)]], sort_keys=True,
                    separators=(",", ":")).encode("ascii")
        return b"".join(parts)

    def hash(self) -> str:
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    def replicated(self, copies: int) -> "ComputationRequest":
        """This one-sequence request (every Index has n = 0) for ``copies`` sequences:
        each input and output lists its Indexes for n = 0, then n = 1, ... (n-major,
        the form shortcut compilation expands), so the rows of sequence k are block k
        of each matrix.  Used to run independent requests as one computation."""
        if copies < 1:
            raise RequestError(f"replicated: copies must be >= 1, got {copies}")
        for spec in (*self.inputs, *self.outputs):
            if any(i.n != 0 for i in spec.indexes):
                raise RequestError(f"replicated: {spec.name!r} has Indexes with n != 0")

        def many(spec: IoSpecification) -> IoSpecification:
            return IoSpecification(spec.name, [Index(n, i.t, i.x) for n in range(copies)
                                               for i in spec.indexes], spec.has_deriv)
        return ComputationRequest([many(s) for s in self.inputs],
                                  [many(s) for s in self.outputs],
                                  self.need_model_derivative, self.store_component_stats)

    def index_rows(self) -> list[np.ndarray]:
        """The Indexes of the inputs, then the outputs, as (N, 3) int64 arrays of [n,
        t, x] rows, unchecked: what ``validate`` returns, for callers that did not
        validate (the compiler's phases take either)."""
        return [index_rows(s.indexes) for s in (*self.inputs, *self.outputs)]

    # -- validation ---------------------------------------------------------------------
    def validate(self, nnet) -> list[np.ndarray]:
        """Check the request against ``nnet``; raise RequestError naming what is wrong.
        Returns the Indexes of the inputs, then the outputs, as (N, 3) int64 arrays of
        [n, t, x] rows (read for the checks; shortcut compilation reuses them)."""
        if not self.outputs:
            raise RequestError("request has no outputs")
        if not self.inputs:
            raise RequestError("request has no inputs")
        rows = []
        for kind, specs in (("input", self.inputs), ("output", self.outputs)):
            seen_names: set[str] = set()
            for spec in specs:
                if spec.name in seen_names:
                    raise RequestError(f"{kind} {spec.name!r} is listed more than once")
                seen_names.add(spec.name)
                node = nnet.get_node_index(spec.name)
                if node == -1:
                    raise RequestError(f"{kind} {spec.name!r}: the network has no node "
                                       f"with this name")
                if kind == "input" and not (nnet.is_input_node(node)
                                            or nnet.is_component_node(node)):
                    raise RequestError(f"input {spec.name!r} is not an input node or a "
                                       f"component node")
                if kind == "output" and not nnet.is_output_node(node):
                    raise RequestError(f"output {spec.name!r} is not an output node")
                rows.append(_check_indexes(kind, spec.name, spec.indexes))
        self.need_derivatives()
        return rows


def _check_indexes(kind: str, name: str, indexes: list[Index]) -> np.ndarray:
    """The Indexes as an (N, 3) int64 array, once checked (non-empty, within 32 bits
    and t not kNoTime, no repeats); read-only, as the compiler's phases share it."""
    if not indexes:
        raise RequestError(f"{kind} {name!r} has an empty list of indexes")
    # the common case on whole arrays and one set; a failure is located row by row
    try:
        rows = index_rows(indexes)
        in_range = (int(min_reduce(rows, axis=None)) > INT32_MIN
                    and int(max_reduce(rows, axis=None)) <= INT32_MAX)
    except OverflowError:
        in_range = False
    if in_range and len(set(indexes)) == len(indexes):
        rows.flags.writeable = False
        return rows
    seen: dict[Index, int] = {}
    for k, idx in enumerate(indexes):
        for v in idx:
            if not INT32_MIN < v <= INT32_MAX:
                raise RequestError(f"{kind} {name!r}: index {k} {tuple(idx)} is outside the "
                                   f"32-bit range (or uses the reserved t = kNoTime)")
        prev = seen.setdefault(idx, k)
        if prev != k:
            raise RequestError(f"{kind} {name!r}: index (n={idx.n}, t={idx.t}, x={idx.x}) is "
                               f"listed twice (rows {prev} and {k})")
    raise AssertionError("_check_indexes: a failed check went unreported")


def io_spec(name: str, indexes: Iterable[Index] | np.ndarray, has_deriv: bool = False
            ) -> IoSpecification:
    """Shorthand used by tests and the service: ``io_spec('input', [(0, t, 0) ...])``."""
    return IoSpecification(name, indexes if isinstance(indexes, np.ndarray) else list(indexes),
                           has_deriv)


__all__ = ["IoSpecification", "ComputationRequest", "io_spec"]
