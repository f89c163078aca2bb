"""The Compiler: Kaldi's ``Compiler::CreateComputation`` (nnet-compile.h/.cc) and
the location-splitting helpers of nnet-compile-utils.cc, plus
``ConsolidateIoOperations`` (nnet-optimize.cc) which the compiler always runs.

From the pruned computation graph and its steps (engine.compiler.graph/steps),
each step gets a matrix for its values (and one for derivatives where needed);
descriptor steps are compiled into copy/add commands from their input steps,
component steps into Propagate/Backprop, input and output steps into
kAcceptInput/kProvideOutput.  The backward commands come after a marker, in
reverse step order; every matrix is allocated (and zeroed) up front and freed at
the end, except the outputs and requested input derivatives.

How a descriptor becomes commands (ComputeInputLocationsList ->
SplitByScale -> SplitLocations -> ConvertToIndexes): each output row gets the
list of (step, row) locations that are summed into it; those lists are split
into "columns" of at most one source per row; a column that reads a single
matrix becomes kMatrixAdd (identity rows) or kAddRows, otherwise kAddRowsMulti.
Backward goes the other way, choosing kMatrixAdd, reversed kAddRows,
kAddRowRanges or kAddToRowsMulti so that no destination row is written twice
by one command.

Everything per row is done on arrays: the input locations of a descriptor node
are computed for all its steps at once (an input that is the Index shifted by a
constant is one lookup in the graph's key table; others go through the
compiled descriptor's NumPy form, or, for a descriptor class without a compiled
form, the object tree row by row), as a (rows, width) matrix of input cindex
ids sorted like Kaldi's; the splitting helpers of engine.compiler.compile_utils
work on such matrices.  The common forward cases (each scale piece of a part
reads at most one input per row at a constant shift, or sums inputs that each
come from one step) are decided for every step at once by _batch_forward; the
other parts, and all backward commands, are split step by step.  Index objects
exist only where the computation keeps them (the Indexes of component
precomputed indexes kept for the shortcut), shared between equal Indexes; the
matrix debug info holds node, n, t, x arrays (DebugCindexes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import compress, islice

import numpy as np

from engine.compiler.array_ops import rows_all, rows_count
from engine.compiler.compile_utils import (column_source, left_align, row_ranges,
                                           split_columns, split_columns_backward,
                                           unordered_map_order)
from engine.compiler.compile_utils import (convert_to_indexes,  # noqa: F401 (re-exported)
                                           ensure_contiguous_property, has_contiguous_property,
                                           split_locations, split_locations_backward,
                                           split_pair_list)
from engine.compiler.computation import (K_DEFAULT_STRIDE, K_STRIDE_EQUAL_NUM_COLS, Command,
                                         CommandType as CT, DebugCindexes, MatrixDebugInfo,
                                         MatrixInfo, NnetComputation, PrecomputedIndexesInfo,
                                         SubMatrixInfo, command_types, positions)
from engine.compiler.fast_descriptors import compile_descriptor, offset_chain
from engine.compiler.gc_pause import gc_paused
from engine.compiler.graph_nodes import COMPONENT, DESCRIPTOR, DIM_RANGE, INPUT, make_indexes
from engine.core.cancel import checkpoint
from engine.core.errors import CompilerError, RequestError
from engine.core.index import K_NO_TIME, Index
from engine.nnet.components.base import Component, ComponentProperty as P
from engine.nnet.descriptors import (Descriptor, ReplaceIndexForwardingDescriptor,
                                     SimpleForwardingDescriptor)

_tuple_new = tuple.__new__
# component property flags as plain ints (NodeTable.props holds ints; IntFlag
# arithmetic costs far more than int arithmetic)
_UPDATABLE = int(P.UPDATABLE_COMPONENT)
_INPUT_CONTIGUOUS = int(P.INPUT_CONTIGUOUS)
_OUTPUT_CONTIGUOUS = int(P.OUTPUT_CONTIGUOUS)
_USES_MEMO = int(P.USES_MEMO)
_STORES_STATS = int(P.STORES_STATS)
_BACKPROP_NEEDS_INPUT = int(P.BACKPROP_NEEDS_INPUT)
_BACKPROP_NEEDS_OUTPUT = int(P.BACKPROP_NEEDS_OUTPUT)
# command types read in per-step loops (an enum class attribute costs more than a global)
_PROPAGATE, _SET_CONST, _MATRIX_ADD, _ADD_ROWS = (CT.PROPAGATE, CT.SET_CONST, CT.MATRIX_ADD,
                                                  CT.ADD_ROWS)
_PROVIDE_OUTPUT, _ALLOC_MATRIX, _DEALLOC_MATRIX = (CT.PROVIDE_OUTPUT, CT.ALLOC_MATRIX,
                                                   CT.DEALLOC_MATRIX)


@dataclass(frozen=True)
class CompilerOptions:
    output_debug_info: bool = True


class _StepInfo:
    __slots__ = ("node_index", "value", "deriv", "segment", "precomputed_indexes_index",
                 "ids", "value_parts", "deriv_parts", "inputs")

    def __init__(self, node_index: int, ids: np.ndarray, segment: int, value: int, deriv: int,
                 value_parts, deriv_parts) -> None:
        self.node_index = node_index
        self.ids = ids
        self.segment = segment
        # submatrices of the values and derivatives (0: none), and of the column
        # ranges of the descriptor parts (empty for other nodes)
        self.value = value
        self.deriv = deriv
        self.value_parts: list[int] | tuple = value_parts
        self.deriv_parts: list[int] | tuple = deriv_parts
        self.precomputed_indexes_index = 0
        # per descriptor part: (rows, width) input cindex ids in Kaldi's order, -1
        # padded (filled in part by part when first needed, for all steps of the
        # node at once; None for a part not asked for yet)
        self.inputs: list | None = None


def _compile_part(part):
    """The compiled form (engine.compiler.fast_descriptors) of one SumDescriptor
    part, or None when it has no compiled form."""
    return compile_descriptor(Descriptor([part]))


def _input_positions(fast) -> list | None:
    """Per dependency position of a fast descriptor part, (node, dn, dt, dx, fixed t):
    the Index shifted by a constant (Offset chains; fixed t None) or, for
    ReplaceIndex(node, t, value), (node, 0, 0, 0, value); None when an input is
    anything else."""
    out = []
    for fd in fast.forwarding:
        fixed = _fixed_time_input(fd)
        if fixed is not None:
            out.append((fixed[0], 0, 0, 0, fixed[1]))
            continue
        shift = offset_chain(fd)
        if shift is None:
            return None
        out.append((*shift, None))
    return out


def _fixed_time_input(fd) -> tuple[int, int] | None:
    """(node, t) when the forwarding descriptor ``fd`` reads Index (n, t, x) of
    ``node`` for every Index (n, any t, x) (ReplaceIndex(node, t, value), as an
    i-vector input is read), else None."""
    if (type(fd) is ReplaceIndexForwardingDescriptor and fd.variable == "t"
            and type(fd.src) is SimpleForwardingDescriptor):
        return fd.src.node_index, fd.value
    return None


def _sort_rows(D: np.ndarray, coords: np.ndarray) -> np.ndarray:
    """Each row of the (m, K) id matrix D (-1 = none, left-aligned) in Kaldi's Cindex
    order (node, t, x, n); equal cindexes keep their order."""
    m, k = D.shape
    if k < 2:
        return D
    valid = D >= 0
    c = np.take(coords, np.maximum(D, 0), axis=0)
    row = np.repeat(np.arange(m), k).reshape(m, k)
    big = np.where(valid, 0, 1)
    order = np.lexsort((c[..., 1].ravel(), c[..., 3].ravel(), c[..., 2].ravel(),
                        c[..., 0].ravel(), big.ravel(), row.ravel()))
    return D.ravel()[order].reshape(m, k)


# ----------------------------------------------------------------------------------------
# the compiler


class Compiler:
    def __init__(self, nnet, requests, io_rows: list | None = None):
        """``io_rows``: as for compile_computation."""
        if not requests:
            raise RequestError("no computation request given")
        self.nnet = nnet
        self.requests = list(requests)
        if io_rows is not None and len(io_rows) != len(self.requests):
            raise ValueError("io_rows: one list of arrays per request is needed")
        self.io_rows = io_rows
        if len(self.requests) > 1:
            for r in self.requests:
                if r.need_model_derivative:
                    raise RequestError("model derivatives are not supported for multi-segment "
                                       "(looped) computations")
                if r.store_component_stats != self.requests[0].store_component_stats:
                    raise RequestError("store_component_stats must agree between segments")
        self.graph = None
        self.steps: list[_StepInfo] = []

    # -- driver ---------------------------------------------------------------------------
    def create_computation(self, options: CompilerOptions = CompilerOptions()) -> NnetComputation:
        from engine.compiler.graph import (ComputationGraph,  # noqa: PLC0415
                                           ComputationGraphBuilder, build_computation_graph)
        from engine.compiler.steps import (ComputationStepsComputer,  # noqa: PLC0415
                                           compute_computation_phases, compute_computation_steps)

        nnet = self.nnet
        graph = ComputationGraph()
        builder = ComputationGraphBuilder(nnet, graph)
        rows = self.io_rows or [None] * len(self.requests)
        for req, io_rows in zip(self.requests, rows):
            build_computation_graph(nnet, req, graph, builder, io_rows=io_rows)
            checkpoint("the computation graph")
        self.graph = graph
        phases_per_segment = compute_computation_phases(nnet, graph)
        computer = ComputationStepsComputer(nnet, graph)
        compute_computation_steps(nnet, self.requests, phases_per_segment, graph, computer,
                                  io_rows=self.io_rows)
        checkpoint("the computation steps")
        self._setup(computer)

        computation = NnetComputation()
        deriv_needed = self._compute_deriv_needed()
        self._create_step_info(deriv_needed, computation)
        self._add_commands(deriv_needed, computation)
        checkpoint("the commands")
        consolidate_io_operations(computation)
        if options.output_debug_info:
            self._output_debug_info(computation)
        else:
            computation.matrix_debug_info = []
        return computation

    def _setup(self, computer) -> None:
        graph = self.graph
        n = len(graph)
        self.coords = graph.coords
        self.loc_step = computer.loc_step[:n]
        self.loc_row = computer.loc_row[:n]
        self.step_to_segment = list(computer.step_to_segment)
        self.step_ids = computer.step_ids
        self.step_nodes = computer.step_nodes
        # the steps' ids end to end: step s is _all_ids[_step_start[s]:][:_step_len[s]]
        # (both with one more entry, for "no step": the end, 0), as the computer
        # keeps them (StepList)
        view = computer.steps
        self._all_ids = view.ids
        self._step_start = view.ptr
        self._step_len = np.zeros(len(view.ptr), dtype=np.int64)
        np.subtract(view.ptr[1:], view.ptr[:-1], out=self._step_len[:-1])
        self._coords_of_steps = None
        # the steps whose first cindex is an input
        has = self._step_len[:-1] > 0
        first = self._all_ids[self._step_start[:-1][has]]
        self._input_steps = has.nonzero()[0][graph.is_input_array[first]].tolist()
        table = graph.node_table
        # Facts that depend only on the network (node kinds, dims and strides,
        # compiled descriptor parts, scales, batch plans) live with the network's
        # NodeTable, which is remade when the network is edited
        # (graph_nodes.node_table_for).
        self._shared = shared = table.extra
        kinds = shared.get("compiler_kinds")
        if kinds is None:
            kinds = shared["compiler_kinds"] = tuple(
                [k == want for k in table.kind] for want in (INPUT, COMPONENT, DIM_RANGE,
                                                             DESCRIPTOR))
        self.kind_input, self.kind_component, self.kind_dim_range, self.kind_descriptor = kinds
        self.kind_output = table.is_output
        self.kind_component_input = table.is_component_input
        self.component_index = table.component_index
        self.props = table.props
        self._facts = shared.setdefault("compiler_facts", {})
        self._part_cache = shared.setdefault("compiler_parts", {})
        self._node_margin = shared.setdefault("compiler_margins", {})

    def _steps_coords(self) -> tuple[np.ndarray, list[int], list[int]]:
        """The node, n, t, x rows of all steps end to end (not to be written to), and
        where each step's rows start and how many there are (made when first
        asked for)."""
        if self._coords_of_steps is None:
            coords = np.take(self.coords, self._all_ids, axis=0)
            coords.flags.writeable = False
            self._coords_of_steps = (coords, self._step_start.tolist(),
                                     self._step_len.tolist())
        return self._coords_of_steps

    def _indexes_of(self, ids: np.ndarray) -> list:
        """Index objects of cindex ids (equal Indexes share one object)."""
        # (np.take gathers rows of the coordinate array several times faster than
        # fancy indexing does; so throughout)
        return make_indexes(np.take(self.coords, ids, axis=0)[:, 1:])

    def _node_name(self, node: int) -> str:
        return self.nnet.nodes[node].name

    # -- which steps need derivatives -----------------------------------------------------------
    def _compute_deriv_needed(self) -> list[bool]:
        nnet, graph, requests = self.nnet, self.graph, self.requests
        num_steps = len(self.step_ids)
        need = [False] * num_steps
        wants = any(r.need_model_derivative or any(s.has_deriv for s in r.inputs)
                    or any(s.has_deriv for s in r.outputs) for r in requests)
        is_input = graph.is_input_array
        if not wants:
            # no derivative anywhere: only check that every input used is supplied
            for step in self._input_steps:
                name = self._node_name(self.step_nodes[step])
                if requests[self.step_to_segment[step]].index_of_input(name) == -1:
                    raise CompilerError(f"input node {name!r} is used but not in the "
                                        f"request")
            return need
        dep_steps = self._step_dependencies()
        for step in range(num_steps):
            ids = self.step_ids[step]
            if not len(ids):
                continue
            cid = int(ids[0])
            node = self.step_nodes[step]
            req = requests[self.step_to_segment[step]]
            if wants:
                deps = [step - 1] if self.kind_component[node] else dep_steps[step]
                for d in deps:
                    if need[d]:
                        need[step] = True
                        break
            if is_input[cid]:
                name = self._node_name(node)
                i = req.index_of_input(name)
                if i == -1:
                    raise CompilerError(f"input node {name!r} is used but not in the request")
                if req.inputs[i].has_deriv:
                    need[step] = True
            if self.kind_output[node]:
                i = req.index_of_output(self._node_name(node))
                if i != -1 and req.outputs[i].has_deriv:
                    need[step] = True
            if self.kind_component[node] and req.need_model_derivative:
                comp = nnet.components[self.component_index[node]]
                if (self.props[node] & _UPDATABLE
                        and getattr(comp, "learning_rate", 1.0) != 0):
                    need[step] = True
        return need

    def _step_dependencies(self) -> list[list[int]]:
        """For each step, the steps holding the dependencies of its cindexes."""
        from engine.compiler.steps import _csr_rows  # noqa: PLC0415
        graph = self.graph
        num_steps = len(self.step_ids)
        owner_step = np.repeat(np.arange(num_steps), self._step_len[:-1])
        owner, dep = _csr_rows(graph.dep_ptr, graph.dep_idx, self._all_ids)
        pairs = np.unique(owner_step[owner] * (num_steps + 1) + self.loc_step[dep])
        src, dst = np.divmod(pairs, num_steps + 1)
        bounds = np.searchsorted(src, np.arange(num_steps + 1)).tolist()
        dl = dst.tolist()
        return [dl[bounds[s]:bounds[s + 1]] for s in range(num_steps)]

    # -- matrices and submatrices ----------------------------------------------------------------
    def _stride_type(self, node_index: int) -> int:
        if self.kind_component_input[node_index]:
            comp_node, flag = node_index + 1, _INPUT_CONTIGUOUS
        elif self.kind_component[node_index]:
            comp_node, flag = node_index, _OUTPUT_CONTIGUOUS
        else:
            return K_DEFAULT_STRIDE
        return K_STRIDE_EQUAL_NUM_COLS if self.props[comp_node] & flag else K_DEFAULT_STRIDE

    def _node_facts(self, node_index: int):
        """(dim, stride type, dim-range node or None, column widths of the descriptor
        parts or None) of a node."""
        facts = self._facts.get(node_index)
        if facts is None:
            nnet = self.nnet
            node = nnet.nodes[node_index]
            parts = None
            if self.kind_descriptor[node_index] and node.descriptor.num_parts() > 1:
                parts = [node.descriptor.part(p).dim(nnet)
                         for p in range(node.descriptor.num_parts())]
            facts = self._facts[node_index] = (
                nnet.node_dim(node_index), self._stride_type(node_index),
                node if self.kind_dim_range[node_index] else None, parts)
        return facts

    def _dim_range_sources(self) -> dict[int, int]:
        """For each dim-range step, the step holding the source of its first cindex
        that has one (Kaldi's CreateStepInfo), -1 where none has."""
        graph = self.graph
        if True not in self.kind_dim_range:
            return {}
        step_len = self._step_len[:-1]
        chosen = (np.array(self.kind_dim_range)[np.array(self.step_nodes, dtype=np.int64)]
                  & (step_len > 0))
        steps = chosen.nonzero()[0].tolist()
        if not steps:
            return {}
        ids = self._all_ids[np.repeat(chosen, step_len)]
        lens = step_len[chosen]
        starts = np.zeros(len(steps), dtype=np.int64)
        np.add.accumulate(lens[:-1], out=starts[1:])
        ptr, idx = graph.dep_ptr, graph.dep_idx
        has = ptr[ids + 1] > ptr[ids]
        pos = np.minimum.reduceat(np.where(has, np.arange(len(ids)), len(ids)), starts)
        ok = pos < len(ids)
        src = np.full(len(steps), -1, dtype=np.int64)
        src[ok] = self.loc_step[idx[ptr[ids[pos[ok]]]]]
        return dict(zip(steps, src.tolist()))

    def _create_step_info(self, deriv_needed, computation) -> None:
        step_ids, step_nodes = self.step_ids, self.step_nodes
        num_steps = len(step_ids)
        self.steps = steps = []
        sources = self._dim_range_sources()
        segs = self.step_to_segment
        new_submatrix = computation.new_submatrix
        # matrices and their whole submatrices appended directly (as new_matrix
        # does, without its per-call checks: rows and columns are checked here)
        mats, subs = computation.matrices, computation.submatrices
        # (a new computation: no debug info entries to keep in step with the matrices)
        if not mats:
            mats.append(MatrixInfo(0, 0, K_DEFAULT_STRIDE))
            subs.append(SubMatrixInfo(0, 0, 0, 0, 0))
        mat_append, sub_append = mats.append, subs.append
        # for each matrix, the last submatrix covering all of it (Kaldi's
        # GetWholeSubmatrices, as NnetComputation.whole_submatrices finds it): the
        # one made with the matrix, unless a dim-range node covering all its
        # columns makes another later
        self._whole = whole = [0] * len(mats)
        whole_append = whole.append

        def column_range(base: int, off: int, width: int) -> int:
            """new_submatrix(base, 0, -1, off, width), appended directly when in range
            (new_submatrix reports the error otherwise)."""
            b = subs[base]
            if base <= 0 or not (0 <= off and off + width <= b[4] and width > 0 and b[2] > 0):
                return new_submatrix(base, 0, -1, off, width)
            sub_append(_tuple_new(SubMatrixInfo, (b[0], b[1], b[2], b[3] + off, width)))
            mi = mats[b[0]]
            if b[1] == 0 and b[3] + off == 0 and b[2] == mi[0] and width == mi[1]:
                whole[b[0]] = len(subs) - 1
            return len(subs) - 1

        facts_of, facts = self._node_facts, self._facts
        kind_descriptor = self.kind_descriptor
        # the steps of each descriptor node (see _prepare_descriptors), the step
        # that made each matrix 1.. (for the debug info; a step that made a value and
        # a derivative matrix is there twice) and the steps of output nodes
        node_steps: dict[int, list[int]] = {}
        self._matrix_steps = made = []
        self._output_steps = outputs = []
        kind_output = self.kind_output
        for step, ids, node, seg, need in zip(range(num_steps), step_ids, step_nodes, segs,
                                              deriv_needed):
            num_rows = len(ids)
            if not num_rows:
                # the (empty) input step of a component that needs no input
                if step + 1 >= num_steps or not len(step_ids[step + 1]):
                    raise CompilerError(f"empty step {step} not followed by a component step")
                steps.append(_StepInfo(step_nodes[step + 1] - 1, ids, seg, 0, 0, (), ()))
                continue
            dim, stride, dim_range, parts = facts.get(node) or facts_of(node)
            deriv = 0
            if dim_range is None:
                if dim <= 0:
                    raise ValueError(f"new_matrix: bad dimensions {num_rows} x {dim}")
                m = len(mats)
                made.append(step)
                mat_append(_tuple_new(MatrixInfo, (num_rows, dim, stride)))
                value = len(subs)
                sub_append(_tuple_new(SubMatrixInfo, (m, 0, num_rows, 0, dim)))
                whole_append(value)
                if need:
                    made.append(step)
                    mat_append(_tuple_new(MatrixInfo, (num_rows, dim, stride)))
                    deriv = value + 1
                    sub_append(_tuple_new(SubMatrixInfo, (m + 1, 0, num_rows, 0, dim)))
                    whole_append(deriv)
            else:
                in_step = sources[step]
                if in_step == -1:
                    raise CompilerError(f"dim-range node {dim_range.name!r}: no source rows")
                if not (0 <= in_step < step) or len(steps[in_step].ids) != num_rows:
                    raise CompilerError(f"dim-range node {dim_range.name!r}: its rows do not "
                                        f"match the rows of its source step")
                off, width = dim_range.dim_offset, dim_range.dim
                value = column_range(steps[in_step].value, off, width)
                if need:
                    deriv = column_range(steps[in_step].deriv, off, width)
            if not kind_descriptor[node]:
                steps.append(_StepInfo(node, ids, seg, value, deriv, (), ()))
                continue
            if step_list := node_steps.get(node):
                step_list.append(step)
            else:
                node_steps[node] = [step]
            if kind_output[node]:
                outputs.append(step)
            if parts is None:
                vp, dp = [value], [deriv] if need else []
            else:
                # column ranges of the parts: submatrices of the whole value (and
                # derivative) matrix appended directly, as new_submatrix would
                off = 0
                vp, dp = [], []
                if dim_range is None and sum(parts) <= dim and min(parts) > 0:
                    for d in parts:
                        sub_append(_tuple_new(SubMatrixInfo, (m, 0, num_rows, off, d)))
                        vp.append(len(subs) - 1)
                        if need:
                            sub_append(_tuple_new(SubMatrixInfo, (m + 1, 0, num_rows, off, d)))
                            dp.append(len(subs) - 1)
                        off += d
                else:
                    for d in parts:
                        vp.append(new_submatrix(value, 0, -1, off, d))
                        if need:
                            dp.append(new_submatrix(deriv, 0, -1, off, d))
                        off += d
            steps.append(_StepInfo(node, ids, seg, value, deriv, vp, dp))
        self._prepare_descriptors(node_steps)

    # -- input locations ---------------------------------------------------------------------------
    def _prepare_descriptors(self, node_steps: dict[int, list[int]]) -> None:
        """Keep the steps of each descriptor node (``node_steps``, non-empty steps in
        order); compile the nodes' parts, and make one lookup table with room for
        every constant shift of the descriptors."""
        self._node_steps = node_steps
        margins = self._node_margin
        for node in node_steps:
            if node not in margins:
                # compiled once per (node, part) and network (see _setup)
                desc = self.nnet.nodes[node].descriptor
                m = [0, 0, 0]
                for p in range(desc.num_parts()):
                    fast = self._part_cache[(node, p)] = _compile_part(desc.part(p))
                    shifts = fast.linear_positions() if fast is not None else None
                    for _, dn, dt, dx in shifts or ():
                        m = [max(m[0], abs(dn)), max(m[1], abs(dt)), max(m[2], abs(dx))]
                margins[node] = m
        margin = tuple(map(max, zip((0, 0, 0), *map(margins.__getitem__, node_steps))))
        self._table = self.graph.table(self.nnet.num_nodes(), margin)

    def _inputs(self, step: int, part: int) -> np.ndarray:
        """Kaldi's ComputeInputLocationsList for one descriptor part of a step: the
        input cindexes summed into each row, sorted; computed for all steps of the
        node at once, part by part as asked (the parts _batch_forward did are
        never asked for in forward-only computations)."""
        info = self.steps[step]
        inputs = info.inputs
        if inputs is None or inputs[part] is None:
            node = info.node_index
            steps = self._node_steps[node]
            all_steps = self.steps
            ids = np.concatenate([all_steps[s].ids for s in steps])
            lens = [len(all_steps[s].ids) for s in steps]
            bounds = np.zeros(len(lens) + 1, dtype=np.int64)
            np.add.accumulate(lens, out=bounds[1:])
            seg = np.repeat(np.array([all_steps[s].segment for s in steps], dtype=np.int64),
                            lens)
            b = bounds.tolist()
            if inputs is None:
                num_parts = self.nnet.nodes[node].descriptor.num_parts()
                for s in steps:
                    all_steps[s].inputs = [None] * num_parts
            D = self._part_inputs(node, part, ids, seg)
            for k, s in enumerate(steps):
                all_steps[s].inputs[part] = D[b[k]:b[k + 1]]
            inputs = info.inputs
        return inputs[part]

    def _part_inputs(self, node: int, part: int, ids: np.ndarray, seg: np.ndarray
                     ) -> np.ndarray:
        """(rows, width) input ids of descriptor part ``part`` of node ``node`` for the
        cindexes ``ids`` (of segments ``seg``), each row's inputs in Kaldi's order
        (left-aligned, -1 padded)."""
        desc = self.nnet.nodes[node].descriptor.part(part)
        fast = self._part_cache[(node, part)]
        coords = self.coords
        table = self._table
        c = np.take(coords, ids, axis=0)
        blank = c[:, 2] == K_NO_TIME
        m = len(ids)
        if fast is None:
            return self._part_inputs_general(node, desc, ids, seg, blank)
        k = fast.num_deps
        if k == 0:
            return np.zeros((m, 0), dtype=np.int64)
        shifts = fast.linear_positions()
        if shifts is not None:
            cols = []
            for w, dn, dt, dx in shifts:
                col = None if blank.any() else table.find_shifted(ids, node, w, dn, dt, dx)
                if col is None:
                    col = table.find(w, c[:, 1] + dn, c[:, 2] + dt, c[:, 3] + dx)
                cols.append(col)
            D = np.stack(cols, axis=1) if k > 1 else cols[0][:, None]
        else:
            slots = fast.deps_arrays(c[:, 1], c[:, 2], c[:, 3])
            D = np.stack([table.find(s[0] if type(s[0]) is int else s[0].astype(np.int64),
                                     s[1], s[2], s[3]) for s in slots], axis=1)
        present = D >= 0
        if len(self.requests) > 1:
            # inputs computed by steps of later segments do not count (see below)
            ls = self.loc_step[np.maximum(D, 0)]
            later = present & (ls >= 0)
            later[later] = np.array(self.step_to_segment)[ls[later]] > np.broadcast_to(
                seg[:, None], D.shape)[later]
            present &= ~later
        if blank.any():
            present[blank] = False
        if fast.all_required:
            ok = rows_all(present) | blank
            used = present
        else:
            ok = fast.computable_arrays(present) | blank
            used = fast.used_arrays(present)
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise CompilerError(
                f"node {self._node_name(node)!r}: Index {tuple(c[bad, 1:].tolist())} is "
                f"not computable from the pruned graph")
        D = np.where(used, D, -1)
        if not used.all():
            D = left_align(D, D)[0]
        if shifts is not None and D.shape[1] > 1 and used.all():
            # the same order in every row: that of the shifts
            order = sorted(range(k), key=lambda j: (shifts[j][0], shifts[j][2], shifts[j][3],
                                                     shifts[j][1]))
            return D[:, order]
        return _sort_rows(D, coords)

    def _part_inputs_general(self, node: int, desc, ids: np.ndarray, seg: np.ndarray,
                             blank: np.ndarray) -> np.ndarray:
        """_part_inputs through the descriptor's object tree, Index by Index (a
        descriptor class without a compiled form)."""
        graph = self.graph
        get_id = graph.get_cindex_id
        seg_of_step = self.step_to_segment
        loc_step = self.loc_step
        rows = []
        for r, (c, s, b) in enumerate(zip(self.coords[ids].tolist(), seg.tolist(),
                                          blank.tolist())):
            if b:
                rows.append([])
                continue

            def in_graph(ci, s=s) -> bool:
                i = get_id(ci)
                return i != -1 and not (loc_step[i] >= 0 and seg_of_step[loc_step[i]] > s)
            used: list = []
            index = _tuple_new(Index, c[1:])
            if not desc.is_computable(index, in_graph, used):
                raise CompilerError(
                    f"node {self._node_name(node)!r}: Index {tuple(index)} is not computable "
                    f"from the pruned graph")
            rows.append([get_id(ci) for ci in used])
        width = max((len(r) for r in rows), default=0)
        D = np.full((len(rows), width), -1, dtype=np.int64)
        for i, r in enumerate(rows):
            D[i, :len(r)] = r
        return _sort_rows(D, self.coords)

    # -- descriptors ----------------------------------------------------------------------------
    def _scales(self, node: int, part: int):
        """Kaldi's SplitByScale, per node part: (shared alpha, None) when every input
        node has the same scale, else (None, [(alpha, input nodes)]) by alpha."""
        key = ("scale", node, part)
        hit = self._part_cache.get(key)
        if hit is not None:
            return hit
        desc = self.nnet.nodes[node].descriptor.part(part)
        alpha_to_nodes: dict[float, list[int]] = {}
        for n in sorted(set(desc.get_node_dependencies())):
            a = desc.get_scale_for_node(n)
            if a - a != 0:
                raise CompilerError(f"descriptor scale for node {n} is not finite")
            alpha_to_nodes.setdefault(a, []).append(n)
        if len(alpha_to_nodes) == 1:
            hit = (next(iter(alpha_to_nodes)), None, desc.get_scale_for_node(-1))
        else:
            hit = (math.inf, [(a, np.array(alpha_to_nodes[a], dtype=np.int64))
                              for a in sorted(alpha_to_nodes)], desc.get_scale_for_node(-1))
        self._part_cache[key] = hit
        return hit

    def _pieces(self, step: int, part: int, subs: np.ndarray):
        """(alpha, S, R) pieces of a descriptor part: S the submatrices (``subs`` of
        the input steps) and R the rows summed into each row, split by scale."""
        info = self.steps[step]
        D = self._inputs(step, part)
        valid = D >= 0
        if D.shape[1] and not valid[:, -1].any():
            # the node's widest row is in another step
            width = int(rows_count(valid).max()) if len(D) else 0
            D, valid = D[:, :width], valid[:, :width]
        safe = np.maximum(D, 0)
        S = np.where(valid, subs[self.loc_step[safe]], -1)
        R = np.where(valid, self.loc_row[safe], -1)
        shared, split, _ = self._scales(info.node_index, part)
        if split is None:
            return [(shared, S, R)]
        nodes = self.coords[safe, 0]
        out = []
        for alpha, which in split:
            keep = valid & np.isin(nodes, which)
            out.append((alpha, *left_align(S, R, keep)))
        return out

    def _batch_plan(self, node: int, part: int):
        """How the forward commands of a descriptor part can be decided for all its
        steps at once, when every input is the Index shifted by a constant or the
        Index with t replaced by a constant (an i-vector input): its SplitByScale
        pieces in order, as [(alpha, inputs, optional)], where a piece reads one
        input per row (required, or optional as in IfDefined) or sums several
        required inputs (``inputs``, (node, dn, dt, dx, fixed t or None) each, in the
        order each row sorts them: a piece that sums an input of fixed t and another
        of the same node is not done here); None otherwise."""
        key = ("plan", node, part)
        if key in self._part_cache:
            return self._part_cache[key]
        out = None
        fast = self._part_cache[(node, part)]
        shifts = _input_positions(fast) if fast is not None else None
        if shifts is not None and fast.num_deps:
            k = fast.num_deps
            shared, split, _ = self._scales(node, part)
            optional = None
            if fast.all_required:
                optional = False
            elif k == 1:
                no, yes = np.zeros((1, 1), dtype=bool), np.ones((1, 1), dtype=bool)
                if (fast.computable_arrays(no)[0] and fast.computable_arrays(yes)[0]
                        and fast.used_arrays(yes)[0, 0]):
                    optional = True
            groups = ([(shared, list(range(k)))] if split is None else
                      [(alpha, [j for j, sh in enumerate(shifts) if sh[0] in nodes.tolist()])
                       for alpha, nodes in split])
            pieces = []
            for alpha, at in groups:
                if not at or optional is None or (len(at) > 1 and optional):
                    pieces = None
                    break
                if len(at) > 1 and any(shifts[j][4] is not None for j in at) and len(
                        {shifts[j][0] for j in at}) < len(at):
                    # a fixed t beside another input of its node: the order of the two
                    # would depend on each row's t
                    pieces = None
                    break
                pieces.append((alpha, sorted((shifts[j] for j in at),
                                             key=lambda sh: (sh[0], sh[2], sh[3], sh[1])),
                               optional))
            out = pieces
        self._part_cache[key] = out
        return out

    def _node_batch_plans(self, node: int) -> list:
        """The parts of descriptor node ``node`` that _batch_plan can do, as [(part,
        offset, pieces, shifts, fixed)]: the part's constant offset, its pieces as
        [(alpha, optional, number of inputs)], the (node - ``node``, n, t, x) shift
        of every input of the pieces in order, flattened, and (position, t) of the
        inputs that read a fixed t."""
        key = ("plans", node)
        out = self._part_cache.get(key)
        if out is None:
            out = []
            for p in range(self.nnet.nodes[node].descriptor.num_parts()):
                plan = self._batch_plan(node, p)
                if plan is None:
                    continue
                pieces = [(float(alpha), optional, len(shs)) for alpha, shs, optional in plan]
                inputs = [sh for _, shs, _ in plan for sh in shs]
                shifts = [v for w, dn, dt, dx, _ in inputs for v in (w - node, dn, dt, dx)]
                fixed = [(j, sh[4]) for j, sh in enumerate(inputs) if sh[4] is not None]
                out.append((p, float(self._scales(node, p)[2]), pieces, shifts, fixed))
            self._part_cache[key] = out
        return out

    def _batch_forward(self) -> dict:
        """The forward commands of the descriptor parts _batch_plan can do, for all
        steps at once: {(step, part): (offset, [(alpha, command type, source
        submatrix, rows or pairs) or None])}.  A part whose required input is
        missing, or whose summed inputs do not each come from one step, is left
        to the general path (which reports the former)."""
        table = self._table
        if table.mode == "dict":
            return {}
        # one column per input of each piece and step, step-major within each node
        # part: its step and shift; the (first, end) columns of the parts reading
        # a fixed t, and that t
        col_step: list = []
        col_shift: list = []
        fixed_spans: list = []
        work = []
        for node, nsteps in self._node_steps.items():
            plans = self._node_batch_plans(node)
            if not plans:
                continue
            work.append((nsteps, plans))
            ns = len(nsteps)
            for _, _, pieces, shifts, fixed in plans:
                k = len(shifts) >> 2
                base = len(col_step)
                col_step += nsteps if k == 1 else [st for st in nsteps for _ in range(k)]
                col_shift += shifts * ns
                if not fixed:
                    continue
                if k == 1:
                    fixed_spans.append((base, base + ns, fixed[0][1]))
                else:
                    # columns are step-major: input j of the i-th step is base + i k + j
                    fixed_spans += [(i + j, i + j + 1, t) for i in range(base, base + k * ns, k)
                                    for j, t in fixed]
        if not col_step:
            return {}
        steps = self.steps
        step_len = self._step_len
        cs = np.array(col_step, dtype=np.int64)
        lens = step_len[cs]
        num_cols = len(col_step)
        starts = np.zeros(num_cols, dtype=np.int64)
        np.add.accumulate(lens[:-1], out=starts[1:])   # (np.cumsum with out= is slower)
        total = int(starts[-1] + lens[-1])
        # the rows of each column's step, gathered from all steps' ids
        rows = self._all_ids[(self._step_start[cs] - starts).repeat(lens) + np.arange(total)]
        keys = table.key_of[rows]
        blank = keys < 0
        # each column's shift (node, n, t, x) as a key offset: one product with the strides
        delta = np.array(col_shift, dtype=np.int64).reshape(-1, 4) @ np.array(
            [table.stride_node, table.stride_n, table.stride_t, 1], dtype=np.int64)
        keys = keys + delta.repeat(lens)
        b = starts.tolist() + [len(rows)]
        absent = blank
        if fixed_spans:
            # the rows of columns reading a fixed t: keys moved from their own t to
            # that one (a t outside the table is in no cindex)
            absent = blank.copy()
            for first, end, t in fixed_spans:
                lo, hi = b[first], b[end]
                if table.lo[2] <= t <= table.hi[2]:
                    keys[lo:hi] += (t - self.coords[rows[lo:hi], 2]) * table.stride_t
                else:
                    absent[lo:hi] = True
        any_absent = absent.any()
        if any_absent:
            keys[absent] = 0
        src = table._lookup(keys)
        if any_absent:
            src[absent] = -1
        present = src >= 0
        safe = np.maximum(src, 0)
        src_step = self.loc_step[safe]
        if len(self.requests) > 1:
            # inputs computed by steps of later segments do not count (see _part_inputs)
            seg_of = np.array(self.step_to_segment, dtype=np.int64)
            row_seg = np.repeat(seg_of[cs], lens)
            present &= ~((src_step >= 0) & (seg_of[np.maximum(src_step, 0)] > row_seg))
        src_row = self.loc_row[safe]
        local = np.arange(len(rows)) - starts.repeat(lens)
        big = len(steps) + 1
        low = np.minimum.reduceat(np.where(present, src_step, big), starts)
        high = np.maximum.reduceat(np.where(present, src_step, -1), starts)
        missing = np.logical_or.reduceat(~present & ~blank, starts)
        full = np.logical_and.reduceat(present, starts)
        ident = np.logical_and.reduceat(present & (src_row == local), starts)
        ident &= (low == high) & (step_len[np.minimum(low, big - 1)] == lens)
        # rows and submatrices read, as lists only where a column needs them (most
        # columns copy a whole matrix)
        rows_arr = np.where(present, src_row, -1)
        need = (~ident).repeat(lens)
        rows_out = np.where(need, rows_arr, -1).tolist() if need.any() else []
        multi = (low != high).repeat(lens)
        subs_out = (np.where(present & multi, self._value_subs[np.maximum(src_step, 0)],
                             -1).tolist() if multi.any() else [])
        vsub = self._value_subs.tolist()
        low, high = low.tolist(), high.tolist()
        missing, full, ident = missing.tolist(), full.tolist(), ident.tolist()
        matrix_add, add_rows, add_rows_multi = _MATRIX_ADD, _ADD_ROWS, CT.ADD_ROWS_MULTI

        def column(k: int, alpha):
            hi = high[k]
            if hi < 0:
                return None
            if low[k] == hi:
                if ident[k]:
                    return (alpha, matrix_add, vsub[hi], None)
                return (alpha, add_rows, vsub[hi], rows_out[b[k]:b[k + 1]])
            return (alpha, add_rows_multi, -1,
                    list(zip(subs_out[b[k]:b[k + 1]], rows_out[b[k]:b[k + 1]])))

        def summed(k: int, n: int, alpha):
            # a sum of n inputs (columns k .. k + n - 1): when each input position
            # reads a whole single step (each source is then used by every row),
            # Kaldi's SplitLocations gives one column per source, in unordered_map
            # order, if the sources differ, and one column per position, in order,
            # if they are all one; None otherwise
            ks = range(k, k + n)
            if not all(full[j] and low[j] == high[j] for j in ks):
                return None
            subs = [vsub[low[j]] if low[j] < big else -1 for j in ks]
            num_distinct = len(set(subs))
            if num_distinct == n:
                at = dict(zip(subs, ks))
                return [column(at[sub], alpha) for sub in unordered_map_order(subs)]
            if num_distinct == 1:
                return [column(j, alpha) for j in ks]
            return None

        out: dict = {}
        k = 0
        for nsteps, plans in work:
            for p, offset, pieces, _, _ in plans:
                for st in nsteps:
                    cols: list | None = []
                    for alpha, optional, n in pieces:
                        if cols is None:
                            pass
                        elif n > 1:
                            more = summed(k, n, alpha)
                            if more is None:
                                cols = None
                            else:
                                cols += more
                        elif missing[k] and not optional:
                            cols = None
                        else:
                            cols.append(column(k, alpha))
                        k += n
                    if cols is not None:
                        out[(st, p)] = (offset, cols)
        return out

    def _compile_forward_sum_descriptor(self, step: int, part: int, computation) -> None:
        """The forward commands of a descriptor part that _batch_forward did not do."""
        info = self.steps[step]
        value = info.value_parts[part]
        _, _, offset = self._scales(info.node_index, part)
        if offset != 0.0:
            computation.commands.append(Command(CT.SET_CONST, float(offset), value))
        for alpha, S, R in self._pieces(step, part, self._value_subs):
            if S.shape[1] == 1:
                self._forward_column(value, alpha, S[:, 0], R[:, 0], computation)
                continue
            for cs, cr in split_columns(S, R):
                self._forward_column(value, alpha, cs, cr, computation)

    def _forward_column(self, value: int, alpha: float, cs, cr, computation) -> None:
        src = column_source(cs)
        if src >= 0:
            m = len(cr)
            if (computation.submatrices[src].num_rows == m and cr[0] == 0 and cr[-1] == m - 1
                    and (np.diff(cr) == 1).all()):
                computation.commands.append(Command(CT.MATRIX_ADD, float(alpha), value, src))
            else:
                computation.indexes.append(cr.tolist())
                computation.commands.append(Command(CT.ADD_ROWS, float(alpha), value, src,
                                                    len(computation.indexes) - 1))
        else:
            computation.indexes_multi.append(list(zip(cs.tolist(), cr.tolist())))
            computation.commands.append(Command(CT.ADD_ROWS_MULTI, float(alpha), value,
                                                len(computation.indexes_multi) - 1))

    def _compile_backward_sum_descriptor(self, step: int, part: int, computation) -> None:
        info = self.steps[step]
        deriv = info.deriv_parts[part]
        for alpha, S, R in self._pieces(step, part, self._deriv_subs):
            S, R = left_align(S, R, S > 0)
            for cs, cr in split_columns_backward(S, R):
                self._backward_column(step, deriv, alpha, cs, cr, computation)

    def _backward_column(self, step, deriv: int, alpha: float, cs, cr, computation) -> None:
        alpha = float(alpha)
        in_deriv = column_source(cs)
        if in_deriv == -2:
            computation.indexes_multi.append(list(zip(cs.tolist(), cr.tolist())))
            computation.commands.append(Command(CT.ADD_TO_ROWS_MULTI, alpha, deriv,
                                                len(computation.indexes_multi) - 1))
            return
        rows = np.where(cs >= 0, cr, -1)
        num_rows = computation.submatrices[deriv].num_rows
        n_in = computation.submatrices[in_deriv].num_rows
        if n_in == num_rows and (rows == np.arange(num_rows)).all():
            computation.commands.append(Command(CT.MATRIX_ADD, alpha, in_deriv, deriv))
            return
        if n_in >= num_rows:
            pos = np.flatnonzero(rows >= 0)
            vals = rows[pos]
            if len(np.unique(vals)) == len(vals):
                reverse = np.full(n_in, -1, dtype=np.int64)
                reverse[vals] = pos
                computation.indexes.append(reverse.tolist())
                computation.commands.append(Command(CT.ADD_ROWS, alpha, in_deriv, deriv,
                                                    len(computation.indexes) - 1))
                return
        ranges = row_ranges(rows)
        if ranges is not None:
            full = [(-1, -1)] * n_in
            full[:len(ranges)] = [tuple(r) for r in ranges.tolist()]
            computation.indexes_ranges.append(full)
            computation.commands.append(Command(CT.ADD_ROW_RANGES, alpha, in_deriv, deriv,
                                                len(computation.indexes_ranges) - 1))
            return
        raise CompilerError(f"node {self._node_name(self.steps[step].node_index)!r}: "
                            f"backprop through this descriptor needs a row mapping the "
                            f"compiler does not support (as in Kaldi)")

    # -- per step ----------------------------------------------------------------------------------
    def _is_input_step(self, step: int) -> bool:
        return step < len(self.steps) and self.kind_input[self.steps[step].node_index]

    def _compile_forward_input(self, step: int, computation) -> None:
        """The forward commands of an input step (component and descriptor steps are
        done in _add_commands; dim-range steps have none)."""
        info = self.steps[step]
        computation.commands.append(Command(CT.ACCEPT_INPUT, 1.0, info.value, info.node_index))
        if not self._is_input_step(step + 1):
            computation.commands.append(Command(CT.NO_OPERATION_PERMANENT))

    def _compile_backward(self, step: int, computation) -> None:
        info = self.steps[step]
        node = info.node_index
        if self.kind_input[node]:
            if info.deriv != 0:
                computation.commands.append(Command(CT.PROVIDE_OUTPUT, 1.0, info.deriv, node))
            if not self._is_input_step(step + 1):
                computation.commands.append(Command(CT.NO_OPERATION_PERMANENT))
        elif self.kind_dim_range[node]:
            pass
        elif self.kind_component[node]:
            self._backward_component(step, computation)
        else:
            if self.kind_output[node] and info.deriv > 0:
                computation.commands.append(Command(CT.ACCEPT_INPUT, 1.0, info.deriv, node))
            for part in range(len(info.value_parts)):
                self._compile_backward_sum_descriptor(step, part, computation)

    def _backward_component(self, step: int, computation) -> None:
        info, in_info = self.steps[step], self.steps[step - 1]
        node = info.node_index
        props = self.props[node]
        if info.deriv <= 0 or (in_info.deriv <= 0 and not props & _UPDATABLE):
            raise CompilerError(f"component node {self._node_name(node)!r}: "
                                f"backprop without the derivatives it needs")
        in_value = in_info.value if props & _BACKPROP_NEEDS_INPUT else 0
        out_value = info.value if props & _BACKPROP_NEEDS_OUTPUT else 0
        memo = step if props & _USES_MEMO else 0
        computation.commands.append(Command(CT.BACKPROP, 1.0, self.component_index[node],
                                            info.precomputed_indexes_index, in_value,
                                            out_value, info.deriv, in_info.deriv, memo))

    # -- commands ------------------------------------------------------------------------------
    def _add_commands(self, deriv_needed, computation) -> None:
        computation.need_model_derivative = self.requests[0].need_model_derivative
        whole = self._whole
        self._allocate_matrices(whole, computation)
        self._set_up_precomputed_indexes(computation)
        steps = self.steps
        self._value_subs = np.array([s.value for s in steps] + [0], dtype=np.int64)
        self._deriv_subs = np.array([s.deriv for s in steps] + [0], dtype=np.int64)
        batch = self._batch_forward()
        seg = self.step_to_segment
        n = len(steps)
        # the steps come segment by segment: where each segment but the last ends (a
        # marker follows every segment)
        ends = ([s + 1 for s in range(n - 1) if seg[s + 1] != seg[s]]
                if len(self.requests) > 1 else [])
        # the forward commands: component steps and batched descriptor parts inline
        cmds = computation.commands
        cmd_append = cmds.append
        kind_component, kind_descriptor = self.kind_component, self.kind_descriptor
        kind_output, kind_input = self.kind_output, self.kind_input
        comp_index, props = self.component_index, self.props
        stats = self.requests[0].store_component_stats
        indexes, indexes_multi = computation.indexes, computation.indexes_multi
        lo = 0
        for hi in ends + [n]:
            for step in range(lo, hi):
                info = steps[step]
                node = info.node_index
                if kind_component[node]:
                    p = props[node]
                    memo = step if info.deriv > 0 and p & _USES_MEMO else 0
                    cmd_append(Command(_PROPAGATE, 1.0, comp_index[node],
                                       info.precomputed_indexes_index, steps[step - 1].value,
                                       info.value, memo, 1 if stats and p & _STORES_STATS else 0))
                elif kind_descriptor[node]:
                    for part, value in enumerate(info.value_parts):
                        batched = batch.get((step, part))
                        if batched is None:
                            self._compile_forward_sum_descriptor(step, part, computation)
                            continue
                        offset, cols = batched
                        if offset != 0.0:
                            cmd_append(Command(_SET_CONST, offset, value))
                        for cmd in cols:
                            if cmd is None:
                                continue
                            alpha, ct, src, data = cmd
                            if ct == _MATRIX_ADD:
                                cmd_append(Command(ct, alpha, value, src))
                            elif ct == _ADD_ROWS:
                                indexes.append(data)
                                cmd_append(Command(ct, alpha, value, src, len(indexes) - 1))
                            else:
                                indexes_multi.append(data)
                                cmd_append(Command(ct, alpha, value, len(indexes_multi) - 1))
                    if kind_output[node]:
                        cmd_append(Command(_PROVIDE_OUTPUT, 1.0, info.value, node))
                elif kind_input[node]:
                    self._compile_forward_input(step, computation)
            cmd_append(Command(CT.NO_OPERATION_MARKER))
            lo = hi
        for step in reversed(list(compress(range(n), deriv_needed))):
            self._compile_backward(step, computation)
        self._deallocate_matrices(whole, computation)

    def _allocate_matrices(self, whole, computation) -> None:
        subs = computation.submatrices
        steps = self.steps
        # the matrices of steps whose first cindex is a supplied input
        supplied = {subs[steps[s].value][0] for s in self._input_steps}
        for s in self._output_steps:
            if steps[s].deriv != 0:
                supplied.add(subs[steps[s].deriv].matrix_index)
        alloc, zero = _ALLOC_MATRIX, CT.SET_CONST
        cmds = computation.commands
        for m in range(1, len(computation.matrices)):
            if m not in supplied:
                w = whole[m]
                cmds += (Command(alloc, 1.0, w), Command(zero, 0.0, w))

    def _precomputes(self) -> list:
        """Per node: None, or for a component node whose component has precomputed
        indexes, (component, its precompute_index_arrays or None)."""
        out = self._shared.get("compiler_precomputes")
        if out is None:
            nnet = self.nnet
            out = self._shared["compiler_precomputes"] = [None] * len(self.kind_component)
            for node, is_component in enumerate(self.kind_component):
                if not is_component:
                    continue
                comp = nnet.components[self.component_index[node]]
                if type(comp).precompute_indexes is not Component.precompute_indexes:
                    out[node] = (comp, getattr(comp, "precompute_index_arrays", None))
        return out

    def _set_up_precomputed_indexes(self, computation) -> None:
        computation.component_precomputed_indexes = [PrecomputedIndexesInfo()]
        precomputes = self._precomputes()
        steps = self.steps
        need_derivatives: dict[int, bool] = {}
        # entries that keep their input and output Indexes (made in one go below)
        kept = []
        # the steps of components with precomputed indexes (for others, not a
        # component or the default, there are none)
        for step in compress(range(len(steps)), map(precomputes.__getitem__, self.step_nodes)):
            info = steps[step]
            comp, by_arrays = precomputes[info.node_index]
            in_info = steps[step - 1]
            req = self.requests[info.segment]
            need = need_derivatives.get(info.segment)
            if need is None:
                need = need_derivatives[info.segment] = req.need_derivatives()
            in_rows = out_rows = None
            if by_arrays is not None:
                coords, starts, lens = self._steps_coords()
                at = starts[step - 1]
                in_rows = coords[at:at + lens[step - 1], 1:]
                at = starts[step]
                out_rows = coords[at:at + lens[step], 1:]
                data = by_arrays(req.misc_info, in_rows, out_rows, need)
            else:
                data = comp.precompute_indexes(req.misc_info, self._indexes_of(in_info.ids),
                                               self._indexes_of(info.ids), need)
            if data is None:
                continue
            info.precomputed_indexes_index = len(computation.component_precomputed_indexes)
            entry = PrecomputedIndexesInfo(data)
            ins, outs = in_info.ids, info.ids
            if (len(ins) and self.coords[ins[-1], 1] == 1 and len(outs)
                    and self.coords[outs[-1], 1] == 1):
                # kept for shortcut compilation (ExpandComputation), as Kaldi does
                kept.append((entry, ins, outs, in_rows, out_rows))
            computation.component_precomputed_indexes.append(entry)
        if kept:
            objs = iter(self._indexes_of(np.concatenate([ids for _, ins, outs, _, _ in kept
                                                         for ids in (ins, outs)])))
            for entry, ins, outs, in_rows, out_rows in kept:
                entry.input_indexes = list(islice(objs, len(ins)))
                entry.output_indexes = list(islice(objs, len(outs)))
                if in_rows is not None:
                    entry.remember_index_rows(in_rows, out_rows)

    def _deallocate_matrices(self, whole, computation) -> None:
        subs = computation.submatrices
        steps = self.steps
        keep = {subs[steps[s].value].matrix_index for s in self._output_steps}
        kind_input = self.kind_input
        # (the steps of input nodes are among those whose first cindex is an input)
        for s in self._input_steps:
            info = steps[s]
            node = info.node_index
            if kind_input[node]:
                req = self.requests[info.segment]
                i = req.index_of_input(self._node_name(node))
                if i == -1:
                    raise CompilerError(f"input node {self._node_name(node)!r} not in request")
                if req.inputs[i].has_deriv:
                    keep.add(subs[info.deriv].matrix_index)
        dealloc = _DEALLOC_MATRIX
        computation.commands += [Command(dealloc, 1.0, whole[m])
                                 for m in range(1, len(computation.matrices)) if m not in keep]

    def _output_debug_info(self, computation) -> None:
        """The matrices' debug info: each matrix holds the rows of the step that made
        it (the other steps' submatrices are parts of those: a dim-range node
        covering all columns aliases its source's matrix), as a slice of one array
        of all steps' node, n, t, x rows (DebugCindexes: the (node, Index) pairs are
        made only if read)."""
        made = np.array(self._matrix_steps, dtype=np.int64)
        if len(made) != len(computation.matrices) - 1:
            raise CompilerError("a matrix was made by no step")
        coords = self._steps_coords()[0]
        starts = self._step_start[made]
        ends = starts + self._step_len[made]
        # a step's derivative matrix comes right after its value matrix
        is_deriv = np.zeros(len(made), dtype=bool)
        is_deriv[1:] = made[1:] == made[:-1]
        computation.matrix_debug_info = [MatrixDebugInfo(), *map(
            MatrixDebugInfo, is_deriv.tolist(),
            map(DebugCindexes, map(coords.__getitem__, map(slice, starts.tolist(),
                                                              ends.tolist()))))]


def _io_in_place(kinds: list, markers: list[int], io: list[int], accept) -> bool:
    """Whether each segment already starts with its kAcceptInput commands and ends
    with its kProvideOutput ones (``io``: the positions of both, ascending;
    ``markers``: the segment ends)."""
    at, start = 0, 0
    for end in markers:
        ins, outs = [], []
        while at < len(io) and io[at] < end:
            (ins if kinds[io[at]] == accept else outs).append(io[at])
            at += 1
        if ins != list(range(start, start + len(ins))) or \
                outs != list(range(end - len(outs), end)):
            return False
        start = end + 1
    return True


def consolidate_io_operations(computation: NnetComputation) -> None:
    """Kaldi's ConsolidateIoOperations: within each marker-separated segment, put
    kAcceptInput first and kProvideOutput last, keeping relative order."""
    cmds = computation.commands
    accept, provide, marker = CT.ACCEPT_INPUT, CT.PROVIDE_OUTPUT, CT.NO_OPERATION_MARKER
    kinds = command_types(cmds)
    markers = positions(kinds, marker) + [len(cmds)]
    io = sorted(positions(kinds, accept) + positions(kinds, provide))
    if _io_in_place(kinds, markers, io, accept):
        # (the usual case: the commands stay as they are)
        computation.segments = [(0 if k == 0 else markers[k - 1] + 1, end)
                                for k, end in enumerate(markers)]
        return
    out: list[Command] = []
    segments = []
    start = 0
    at = 0
    for end in markers:
        first = len(out)
        mine = []
        while at < len(io) and io[at] < end:
            mine.append(io[at])
            at += 1
        if mine:
            out.extend(cmds[i] for i in mine if kinds[i] == accept)
            prev = start
            for i in mine:
                out.extend(cmds[prev:i])
                prev = i + 1
            out.extend(cmds[prev:end])
            out.extend(cmds[i] for i in mine if kinds[i] == provide)
        else:
            out.extend(cmds[start:end])
        segments.append((first, len(out)))
        if end < len(cmds):
            out.append(cmds[end])
        start = end + 1
    computation.commands = out
    computation.segments = segments


def compile_computation(nnet, requests, options: CompilerOptions = CompilerOptions(),
                        io_rows: list | None = None) -> NnetComputation:
    """Kaldi's Compiler::CreateComputation for one request or a list of requests
    (segments of a looped computation).  ``io_rows``: per request, its Indexes as
    ComputationRequest.validate returns them (inputs, then outputs, as (N, 3) int64
    arrays), when the caller has them: the graph and the steps then read them
    rather than converting the Index lists again."""
    if not isinstance(requests, (list, tuple)):
        requests = [requests]
    # The compiler allocates many small lists and tuples and frees them by
    # reference counting; the cyclic collector's full passes over them cost
    # real time and find nothing, so it is paused for the duration (gc_pause:
    # nests, thread-safe).
    with gc_paused():
        return Compiler(nnet, requests, io_rows).create_computation(options)
