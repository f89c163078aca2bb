"""Plain-data form of an ``NnetComputation`` (Kaldi's NnetComputation::Read/Write
plays this role for nnet3's computation cache).

``computation_to_data`` gives a dict of lists, ints, floats and strings (JSON- or
msgpack-ready, no pickle); ``computation_from_data`` rebuilds the computation and
validates it on the way in, so a corrupted or hostile cache entry raises
``CheckError`` instead of producing a computation that misbehaves later.

Precomputed component indexes are stored through their own ``to_data`` with the
name of their class; on reading, only classes defined in ``engine.nnet.components``
are accepted.

Rows of Indexes are flat lists of integers: a matrix's debug cindexes as node, n, t, x,
node, n, t, x, ...; a precomputed info's Indexes as n, t, x, ...  (IR version 2; version
1 held one list per row).  A cached computation of a 40000-frame request then holds a few
lists of integers, not 1.4 million lists, tuples and Index objects, which every full
collection of Python's garbage collector walked (about 0.18 s each, the service's event
loop and every other client waiting); the rebuilt computation holds its debug cindexes
as arrays (``DebugCindexes``).
"""

from __future__ import annotations

import importlib
from itertools import chain

import numpy as np

from engine.compiler.computation import (COMMAND_SPECS, ArgKind, Command, CommandType,
                                         DebugCindexes, MatrixDebugInfo, MatrixInfo,
                                         NnetComputation, PrecomputedIndexesInfo,
                                         SubMatrixInfo, debug_rows)
from engine.compiler.graph_nodes import make_indexes
from engine.core.errors import CheckError

IR_VERSION = 2


def _flat_cindexes(cindexes) -> list[int]:
    """node, n, t, x, node, n, ... of a matrix's debug cindexes."""
    return debug_rows(cindexes).ravel().tolist()


def _rows(flat, width: int, what: str) -> np.ndarray:
    """A flat list of integers as a (k, width) int64 array."""
    if not isinstance(flat, list) or len(flat) % width:
        raise CheckError(f"{what}: expected a flat list of integers, {width} per row")
    try:
        return np.array(flat, dtype=np.int64).reshape(-1, width)
    except (TypeError, ValueError, OverflowError):
        raise CheckError(f"{what}: expected integers") from None


_ALLOWED_PREFIX = "engine.nnet.components."


def computation_to_data(c: NnetComputation) -> dict:
    pre = []
    for info in c.component_precomputed_indexes[1:]:
        d = info.data
        pre.append({
            "class": f"{type(d).__module__}:{type(d).__qualname__}" if d is not None else None,
            "data": d.to_data() if d is not None else None,
            "input_indexes": list(chain.from_iterable(info.input_indexes)),
            "output_indexes": list(chain.from_iterable(info.output_indexes)),
        })
    return {
        "ir_version": IR_VERSION,
        "matrices": [list(m) for m in c.matrices],
        "submatrices": [list(s) for s in c.submatrices],
        "matrix_debug_info": [[d.is_deriv, _flat_cindexes(d.cindexes)]
                              for d in c.matrix_debug_info],
        "precomputed_indexes": pre,
        "indexes": [list(map(int, v)) for v in c.indexes],
        "indexes_multi": [[list(p) for p in v] for v in c.indexes_multi],
        "indexes_ranges": [[list(p) for p in v] for v in c.indexes_ranges],
        "commands": [cmd.to_data() for cmd in c.commands],
        "need_model_derivative": bool(c.need_model_derivative),
        "segments": [list(s) for s in c.segments],
    }


def _load_class(name: str):
    module, _, qual = name.partition(":")
    if not module.startswith(_ALLOWED_PREFIX) or not qual or "." in qual:
        raise CheckError(f"precomputed indexes of class {name!r} are not allowed")
    cls = getattr(importlib.import_module(module), qual, None)
    if cls is None:
        raise CheckError(f"unknown precomputed-indexes class {name!r}")
    return cls


def computation_from_data(data: dict) -> NnetComputation:
    try:
        if data.get("ir_version") != IR_VERSION:
            raise CheckError(f"computation data has IR version {data.get('ir_version')!r}, "
                             f"expected {IR_VERSION}")
        c = NnetComputation()
        c.matrices = [MatrixInfo(*map(int, m)) for m in data["matrices"]]
        c.submatrices = [SubMatrixInfo(*map(int, s)) for s in data["submatrices"]]
        c.matrix_debug_info = [
            MatrixDebugInfo(bool(d), DebugCindexes(_rows(cidx, 4, f"matrix_debug_info[{m}]")))
            for m, (d, cidx) in enumerate(data["matrix_debug_info"])]
        c.component_precomputed_indexes = [PrecomputedIndexesInfo()]
        for k, p in enumerate(data["precomputed_indexes"], start=1):
            obj = _load_class(p["class"]).from_data(p["data"]) if p["class"] else None
            rows_in = _rows(p["input_indexes"], 3, f"precomputed_indexes[{k}].input_indexes")
            rows_out = _rows(p["output_indexes"], 3,
                             f"precomputed_indexes[{k}].output_indexes")
            info = PrecomputedIndexesInfo(obj, make_indexes(rows_in), make_indexes(rows_out))
            info.remember_index_rows(rows_in, rows_out)
            c.component_precomputed_indexes.append(info)
        c.indexes = [[int(v) for v in lst] for lst in data["indexes"]]
        c.indexes_multi = [[(int(a), int(b)) for a, b in lst] for lst in data["indexes_multi"]]
        c.indexes_ranges = [[(int(a), int(b)) for a, b in lst] for lst in data["indexes_ranges"]]
        c.commands = [Command(CommandType(int(x[0])), float(x[1]), *map(int, x[2:9]))
                      for x in data["commands"]]
        c.need_model_derivative = bool(data["need_model_derivative"])
        c.segments = [(int(a), int(b)) for a, b in data["segments"]]
    except CheckError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CheckError(f"malformed computation data: {type(e).__name__}: {e}") from None
    validate_references(c)
    return c


def validate_references(c: NnetComputation) -> None:
    """Every index a command or table holds points inside its table (the
    structural part of Kaldi's ComputationChecker::CheckComputationIndexes)."""
    nm, ns = len(c.matrices), len(c.submatrices)
    if nm == 0 or ns == 0 or tuple(c.matrices[0][:2]) != (0, 0):
        raise CheckError("computation has no empty matrix/submatrix 0")
    for i, s in enumerate(c.submatrices[1:], start=1):
        if not 0 < s.matrix_index < nm:
            raise CheckError(f"submatrix {i} refers to matrix {s.matrix_index}")
        m = c.matrices[s.matrix_index]
        if (s.row_offset < 0 or s.col_offset < 0 or s.num_rows <= 0 or s.num_cols <= 0
                or s.row_offset + s.num_rows > m.num_rows
                or s.col_offset + s.num_cols > m.num_cols):
            raise CheckError(f"submatrix {i} lies outside matrix m{s.matrix_index}")
    sizes = {ArgKind.SUBMATRIX: ns, ArgKind.PRECOMPUTED: len(c.component_precomputed_indexes),
             ArgKind.INDEXES: len(c.indexes), ArgKind.INDEXES_MULTI: len(c.indexes_multi),
             ArgKind.INDEXES_RANGES: len(c.indexes_ranges), ArgKind.COMMAND: len(c.commands)}
    for k, cmd in enumerate(c.commands):
        spec = COMMAND_SPECS[cmd.command_type]
        for slot, a in zip(spec.slots, cmd.args):
            limit = sizes.get(slot.kind)
            if limit is not None and not 0 <= a < limit:
                raise CheckError(f"c{k}: {slot.kind.name.lower()} argument {a} out of range")
    for i, lst in enumerate(c.indexes_multi):
        for s, r in lst:
            if s != -1 and not (0 < s < ns and 0 <= r < c.submatrices[s].num_rows):
                raise CheckError(f"indexes_multi[{i}] holds an invalid pair ({s}, {r})")
