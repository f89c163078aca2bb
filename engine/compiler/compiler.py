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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.compiler.compile_utils import (convert_to_indexes,  # noqa: F401 (re-exported)
                                           ensure_contiguous_property, has_contiguous_property,
                                           split_locations, split_locations_backward,
                                           split_pair_list)
from engine.compiler.computation import (K_DEFAULT_STRIDE, K_STRIDE_EQUAL_NUM_COLS, Command,
                                         CommandType as CT, MatrixDebugInfo, NnetComputation,
                                         PrecomputedIndexesInfo)
from engine.compiler.gc_pause import gc_paused
from engine.core.errors import NnetcError, RequestError
from engine.core.index import K_NO_TIME
from engine.nnet.components.base import ComponentProperty as P


class CompilerError(NnetcError):
    """A network/request combination the compiler does not support (Kaldi's
    'this case not handled' errors), naming the node at fault."""


@dataclass(frozen=True)
class CompilerOptions:
    output_debug_info: bool = True


@dataclass
class _StepInfo:
    node_index: int = -1
    value: int = 0
    deriv: int = 0
    segment: int = 0
    precomputed_indexes_index: int = 0
    output_indexes: list = field(default_factory=list)
    output_cindex_ids: list = field(default_factory=list)
    value_parts: list = field(default_factory=list)
    deriv_parts: list = field(default_factory=list)
    input_locations_list: list = field(default_factory=list)


def _cindex_key(c) -> tuple[int, int, int, int]:
    return (c[0], c[1][1], c[1][2], c[1][0])


def _pair_key(p) -> tuple[int, int, int, int]:
    c = p[0]
    return (c[0], c[1][1], c[1][2], c[1][0])


def _compile_part(part):
    """The compiled form (engine.compiler.fast_descriptors) of one SumDescriptor
    part, or None when it has no compiled form."""
    from engine.compiler.fast_descriptors import compile_descriptor  # noqa: PLC0415
    from engine.nnet.descriptors import Descriptor  # noqa: PLC0415
    return compile_descriptor(Descriptor([part]))


# ----------------------------------------------------------------------------------------
# the compiler


def _node_type_name(nnet, i: int) -> str:
    return nnet.nodes[i].type.name


class Compiler:
    def __init__(self, nnet, requests):
        if not requests:
            raise RequestError("no computation request given")
        self.nnet = nnet
        self.requests = list(requests)
        if len(self.requests) > 1:
            for r in self.requests:
                if r.need_model_derivative:
                    raise RequestError("model derivatives are not supported for multi-segment "
                                       "(looped) computations")
                if r.store_component_stats != self.requests[0].store_component_stats:
                    raise RequestError("store_component_stats must agree between segments")
        self.graph = None
        self.steps: list[_StepInfo] = []
        self.cindex_id_to_location: list[tuple[int, int]] = []

    # -- driver ---------------------------------------------------------------------------
    def create_computation(self, options: CompilerOptions = CompilerOptions()) -> NnetComputation:
        from engine.compiler.graph import (ComputationGraph,  # noqa: PLC0415
                                           ComputationGraphBuilder, build_computation_graph)
        from engine.compiler.steps import (ComputationStepsComputer,  # noqa: PLC0415
                                           compute_computation_phases, compute_computation_steps)

        nnet = self.nnet
        graph = ComputationGraph()
        builder = ComputationGraphBuilder(nnet, graph)
        for req in self.requests:
            build_computation_graph(nnet, req, graph, builder)
        self.graph = graph
        phases_per_segment = compute_computation_phases(nnet, graph)
        computer = ComputationStepsComputer(nnet, graph)
        steps = [list(s) for s in compute_computation_steps(nnet, self.requests,
                                                            phases_per_segment, graph, computer)]
        step_to_segment = list(computer.step_to_segment)
        self.step_to_segment = step_to_segment
        # (step, row) of every cindex; the steps computer may have added blank cindexes
        loc = [(-1, -1)] * len(graph.cindexes)
        for s, ids in enumerate(steps):
            for r, cid in enumerate(ids):
                loc[cid] = (s, r)
        self.cindex_id_to_location = loc

        computation = NnetComputation()
        if options.output_debug_info:
            computation.matrix_debug_info = [MatrixDebugInfo()]
        deriv_needed = self._compute_deriv_needed(steps, step_to_segment)
        self._create_step_info(deriv_needed, step_to_segment, steps, computation)
        self._add_commands(deriv_needed, step_to_segment, computation)
        consolidate_io_operations(computation)
        if options.output_debug_info:
            self._output_debug_info(computation)
        else:
            computation.matrix_debug_info = []
        return computation

    # -- which steps need derivatives -----------------------------------------------------------
    def _step_dependencies(self, this_step: list[int], step: int) -> set[int]:
        if not this_step:
            return set()
        graph = self.graph
        node = graph.cindexes[this_step[0]][0]
        if self.nnet.is_component_node(node):
            return {step - 1}
        deps = set()
        loc = self.cindex_id_to_location
        for cid in this_step:
            for d in graph.dependencies[cid]:
                deps.add(loc[d][0])
        return deps

    def _compute_deriv_needed(self, steps, step_to_segment) -> list[bool]:
        nnet, graph = self.nnet, self.graph
        need = [False] * len(steps)
        for step, this_step in enumerate(steps):
            if not this_step:
                continue
            cid = this_step[0]
            node = graph.cindexes[cid][0]
            name = nnet.nodes[node].name
            for d in self._step_dependencies(this_step, step):
                if need[d]:
                    need[step] = True
                    break
            req = self.requests[step_to_segment[step]]
            if graph.is_input[cid]:
                i = req.index_of_input(name)
                if i == -1:
                    raise CompilerError(f"input node {name!r} is used but not in the request")
                if req.inputs[i].has_deriv:
                    need[step] = True
            if nnet.is_output_node(node):
                i = req.index_of_output(name)
                if i != -1 and req.outputs[i].has_deriv:
                    need[step] = True
            if nnet.is_component_node(node) and req.need_model_derivative:
                comp = nnet.components[nnet.nodes[node].component_index]
                if (comp.properties() & P.UPDATABLE_COMPONENT
                        and getattr(comp, "learning_rate", 1.0) != 0):
                    need[step] = True
        return need

    # -- matrices and submatrices ----------------------------------------------------------------
    def _stride_type(self, node_index: int) -> int:
        nnet = self.nnet
        if nnet.is_component_input_node(node_index):
            comp_node, flag = node_index + 1, P.INPUT_CONTIGUOUS
        elif nnet.is_component_node(node_index):
            comp_node, flag = node_index, P.OUTPUT_CONTIGUOUS
        else:
            return K_DEFAULT_STRIDE
        comp = nnet.components[nnet.nodes[comp_node].component_index]
        return K_STRIDE_EQUAL_NUM_COLS if comp.properties() & flag else K_DEFAULT_STRIDE

    def _create_step_info(self, deriv_needed, step_to_segment, by_step, computation) -> None:
        nnet, graph = self.nnet, self.graph
        self.steps = steps = [_StepInfo() for _ in by_step]
        self._by_step = by_step
        for step, ids in enumerate(by_step):
            info = steps[step]
            info.output_cindex_ids = ids
            info.segment = step_to_segment[step]
            info.output_indexes = [graph.cindexes[c][1] for c in ids]
            if not ids:
                # the (empty) input step of a component that needs no input
                if step + 1 >= len(by_step) or not by_step[step + 1]:
                    raise CompilerError(f"empty step {step} not followed by a component step")
                info.node_index = graph.cindexes[by_step[step + 1][0]][0] - 1
                continue
            info.node_index = node_index = graph.cindexes[ids[0]][0]
            node = nnet.nodes[node_index]
            num_rows, num_cols = len(ids), nnet.node_dim(node_index)
            if not nnet.is_dim_range_node(node_index):
                stride = self._stride_type(node_index)
                info.value = computation.new_matrix(num_rows, num_cols, stride)
                if deriv_needed[step]:
                    info.deriv = computation.new_matrix(num_rows, num_cols, stride)
            else:
                source = next((graph.dependencies[c][0] for c in ids if graph.dependencies[c]),
                              -1)
                if source < 0:
                    raise CompilerError(f"dim-range node {node.name!r}: no source rows")
                in_step = self.cindex_id_to_location[source][0]
                if not (0 <= in_step < step) or len(steps[in_step].output_cindex_ids) != len(ids):
                    raise CompilerError(f"dim-range node {node.name!r}: its rows do not match "
                                        f"the rows of its source step")
                info.value = computation.new_submatrix(steps[in_step].value, 0, -1,
                                                       node.dim_offset, node.dim)
                if deriv_needed[step]:
                    info.deriv = computation.new_submatrix(steps[in_step].deriv, 0, -1,
                                                           node.dim_offset, node.dim)
            if nnet.is_descriptor_node(node_index):
                desc = node.descriptor
                num_parts = desc.num_parts()
                info.input_locations_list = [self._input_locations_list(step, p)
                                             for p in range(num_parts)]
                if num_parts == 1:
                    info.value_parts = [info.value]
                    if deriv_needed[step]:
                        info.deriv_parts = [info.deriv]
                else:
                    off = 0
                    for p in range(num_parts):
                        d = desc.part(p).dim(nnet)
                        info.value_parts.append(computation.new_submatrix(info.value, 0, -1,
                                                                          off, d))
                        if deriv_needed[step]:
                            info.deriv_parts.append(
                                computation.new_submatrix(info.deriv, 0, -1, off, d))
                        off += d

    def _later_segment_ids(self, info) -> frozenset[int]:
        """The cindex ids that steps of segments after ``info``'s compute.  Kaldi
        resolves IfDefined/Failover against the whole multi-segment graph (CindexSet
        over all of it), so a step of one chunk could pick an input that only a later
        chunk's steps compute, e.g. ``Failover(Offset(x, 1), x)`` at the chunk's last
        frame, reading a matrix that does not exist yet.  The graph builder decided
        computability segment by segment and never chose those; neither do we."""
        seg = info.segment
        if seg + 1 >= len(self.graph.segment_ends):
            return frozenset()
        cache = self.__dict__.setdefault("_later_ids", {})
        if seg not in cache:
            first = next(s for s, g in enumerate(self.step_to_segment) if g > seg)
            cache[seg] = frozenset(c for ids in self._by_step[first:] for c in ids)
        return cache[seg]

    def _input_locations_list(self, step: int, part: int) -> list[list[tuple[int, int]]]:
        """For each output row, the sorted (step, row) locations summed into it."""
        info = self.steps[step]
        graph = self.graph
        desc = self.nnet.nodes[info.node_index].descriptor.part(part)
        loc = self.cindex_id_to_location
        get_id = graph.get_cindex_id

        later = self._later_segment_ids(info)

        def in_graph(c) -> bool:
            i = get_id(c)
            return i != -1 and i not in later

        # Compiled once per (node, part) for this compilation (descriptors are
        # not assumed immutable between compilations).
        cache = self.__dict__.setdefault("_fast_parts", {})
        key = (info.node_index, part)
        if key not in cache:
            cache[key] = _compile_part(desc)
        fast = cache[key]
        if fast is not None:
            return self._input_locations_fast(info, fast)
        out = []
        for index in info.output_indexes:
            if index[1] == K_NO_TIME:
                out.append([])
                continue
            used: list = []
            if not desc.is_computable(index, in_graph, used):
                raise CompilerError(
                    f"node {self.nnet.nodes[info.node_index].name!r}: Index {tuple(index)} is "
                    f"not computable from the pruned graph")
            if len(used) > 1:
                used.sort(key=_cindex_key)
            out.append([loc[get_id(c)] for c in used])
        return out

    def _input_locations_fast(self, info, fast) -> list[list[tuple[int, int]]]:
        """_input_locations_list through a compiled descriptor part: the same
        inputs (those present in the pruned graph, IfDefined/Failover resolved),
        sorted the same way."""
        get, loc = self.graph._ids.get, self.cindex_id_to_location
        all_required, deps = fast.all_required, fast.deps
        later = self._later_segment_ids(info)
        if later:
            get0 = get

            def get(ci):
                i = get0(ci)
                return None if i in later else i
        out = []
        if all_required and fast.dep1 is not None:
            # One required input per row (plain forwarding): its location.
            dep1 = fast.dep1
            for index in info.output_indexes:
                if index[1] == K_NO_TIME:
                    out.append([])
                    continue
                d = get(dep1(index))
                if d is None:
                    raise CompilerError(
                        f"node {self.nnet.nodes[info.node_index].name!r}: Index "
                        f"{tuple(index)} is not computable from the pruned graph")
                out.append([loc[d]])
            return out
        for index in info.output_indexes:
            if index[1] == K_NO_TIME:
                out.append([])
                continue
            ins = deps(index)
            ids = [get(ci) for ci in ins]
            if all_required:
                ok = None not in ids
                used = range(len(ins))
            else:
                ok, used = fast.evaluate([d is not None for d in ids])
            if not ok:
                raise CompilerError(
                    f"node {self.nnet.nodes[info.node_index].name!r}: Index {tuple(index)} is "
                    f"not computable from the pruned graph")
            if len(used) == 1:
                out.append([loc[ids[used[0]]]])
            else:
                pairs = sorted(((ins[u], ids[u]) for u in used), key=_pair_key)
                out.append([loc[d] for _, d in pairs])
        return out

    # -- descriptors ----------------------------------------------------------------------------
    def _split_by_scale(self, desc, locations):
        """Kaldi's SplitByScale: (shared_alpha, []) when every node has the same
        scale, else (inf, [(alpha, locations restricted to that alpha's nodes)])."""
        nodes = sorted(set(desc.get_node_dependencies()))
        alpha_to_nodes: dict[float, list[int]] = {}
        for n in nodes:
            a = desc.get_scale_for_node(n)
            if a - a != 0:
                raise CompilerError(f"descriptor scale for node {n} is not finite")
            alpha_to_nodes.setdefault(a, []).append(n)
        if len(alpha_to_nodes) == 1:
            return next(iter(alpha_to_nodes)), []
        step_alpha: dict[int, int] = {}
        alphas = sorted(alpha_to_nodes)
        node_alpha = {n: k for k, a in enumerate(alphas) for n in alpha_to_nodes[a]}
        for lst in locations:
            for s, _ in lst:
                if s not in step_alpha:
                    step_alpha[s] = node_alpha[self.steps[s].node_index]
        split = [(a, [[] for _ in locations]) for a in alphas]
        for r, lst in enumerate(locations):
            for pair in lst:
                split[step_alpha[pair[0]]][1][r].append(pair)
        return math.inf, split

    def _compile_forward_sum_descriptor(self, step: int, part: int, computation) -> None:
        info = self.steps[step]
        value = info.value_parts[part]
        desc = self.nnet.nodes[info.node_index].descriptor.part(part)
        offset = desc.get_scale_for_node(-1)
        if offset != 0.0:
            computation.add(CT.SET_CONST, value, alpha=offset)
        locations = info.input_locations_list[part]
        shared, split = self._split_by_scale(desc, locations)
        pieces = [(shared, locations)] if math.isfinite(shared) else split
        for alpha, locs in pieces:
            submat_lists = [[(self.steps[s].value, r) for s, r in lst] for lst in locs]
            for column in split_locations(submat_lists):
                self._forward_from_locations(value, alpha, column, computation)

    def _forward_from_locations(self, value: int, alpha: float, column, computation) -> None:
        ok, src, rows = convert_to_indexes(column)
        if ok:
            n_in = computation.submatrices[src].num_rows
            if n_in == len(rows) and all(r == i for i, r in enumerate(rows)):
                computation.add(CT.MATRIX_ADD, value, src, alpha=alpha)
            else:
                computation.indexes.append(rows)
                computation.add(CT.ADD_ROWS, value, src, len(computation.indexes) - 1,
                                alpha=alpha)
        else:
            computation.indexes_multi.append(list(column))
            computation.add(CT.ADD_ROWS_MULTI, value, len(computation.indexes_multi) - 1,
                            alpha=alpha)

    def _compile_backward_sum_descriptor(self, step: int, part: int, computation) -> None:
        info = self.steps[step]
        deriv = info.deriv_parts[part]
        desc = self.nnet.nodes[info.node_index].descriptor.part(part)
        locations = info.input_locations_list[part]
        shared, split = self._split_by_scale(desc, locations)
        pieces = [(shared, locations)] if math.isfinite(shared) else split
        for alpha, locs in pieces:
            submat_lists = [[(self.steps[s].deriv, r) for s, r in lst if self.steps[s].deriv > 0]
                            for lst in locs]
            for column in split_locations_backward(submat_lists):
                self._backward_from_locations(step, deriv, alpha, column, computation)

    def _backward_from_locations(self, step, deriv: int, alpha: float, column,
                                 computation) -> None:
        ok, in_deriv, rows = convert_to_indexes(column)
        if not ok:
            computation.indexes_multi.append(list(column))
            computation.add(CT.ADD_TO_ROWS_MULTI, deriv, len(computation.indexes_multi) - 1,
                            alpha=alpha)
            return
        num_rows = computation.submatrices[deriv].num_rows
        n_in = computation.submatrices[in_deriv].num_rows
        if n_in == num_rows and all(r == i for i, r in enumerate(rows)):
            computation.add(CT.MATRIX_ADD, in_deriv, deriv, alpha=alpha)
            return
        if n_in >= num_rows:
            reverse = [-1] * n_in
            unique = True
            for i, r in enumerate(rows):
                if r >= 0:
                    if reverse[r] != -1:
                        unique = False
                        break
                    reverse[r] = i
            if unique:
                computation.indexes.append(reverse)
                computation.add(CT.ADD_ROWS, in_deriv, deriv, len(computation.indexes) - 1,
                                alpha=alpha)
                return
        ok, ranges = has_contiguous_property(rows)
        if ok:
            ranges = list(ranges) + [(-1, -1)] * (n_in - len(ranges))
            computation.indexes_ranges.append(ranges)
            computation.add(CT.ADD_ROW_RANGES, in_deriv, deriv, len(computation.indexes_ranges) - 1,
                            alpha=alpha)
            return
        raise CompilerError(f"node {self.nnet.nodes[self.steps[step].node_index].name!r}: "
                            f"backprop through this descriptor needs a row mapping the "
                            f"compiler does not support (as in Kaldi)")

    # -- per step ----------------------------------------------------------------------------------
    def _is_input_step(self, step: int) -> bool:
        return step < len(self.steps) and self.nnet.is_input_node(self.steps[step].node_index)

    def _compile_forward(self, step: int, computation) -> None:
        nnet = self.nnet
        info = self.steps[step]
        node = info.node_index
        if nnet.is_input_node(node):
            computation.add(CT.ACCEPT_INPUT, info.value, node)
            if not self._is_input_step(step + 1):
                computation.add(CT.NO_OPERATION_PERMANENT)
        elif nnet.is_dim_range_node(node):
            pass
        elif nnet.is_component_node(node):
            self._forward_component(step, computation)
        else:
            for part in range(len(info.value_parts)):
                self._compile_forward_sum_descriptor(step, part, computation)
            if nnet.is_output_node(node):
                computation.add(CT.PROVIDE_OUTPUT, info.value, node)

    def _forward_component(self, step: int, computation) -> None:
        info, in_info = self.steps[step], self.steps[step - 1]
        ci = self.nnet.nodes[info.node_index].component_index
        props = self.nnet.components[ci].properties()
        memo = step if info.deriv > 0 and props & P.USES_MEMO else 0
        stats = 1 if self.requests[0].store_component_stats and props & P.STORES_STATS else 0
        computation.add(CT.PROPAGATE, ci, info.precomputed_indexes_index, in_info.value,
                        info.value, memo, stats)

    def _compile_backward(self, step: int, computation) -> None:
        nnet = self.nnet
        info = self.steps[step]
        node = info.node_index
        if nnet.is_input_node(node):
            if info.deriv != 0:
                computation.add(CT.PROVIDE_OUTPUT, info.deriv, node)
            if not self._is_input_step(step + 1):
                computation.add(CT.NO_OPERATION_PERMANENT)
        elif nnet.is_dim_range_node(node):
            pass
        elif nnet.is_component_node(node):
            self._backward_component(step, computation)
        else:
            if nnet.is_output_node(node) and info.deriv > 0:
                computation.add(CT.ACCEPT_INPUT, info.deriv, node)
            for part in range(len(info.value_parts)):
                self._compile_backward_sum_descriptor(step, part, computation)

    def _backward_component(self, step: int, computation) -> None:
        info, in_info = self.steps[step], self.steps[step - 1]
        ci = self.nnet.nodes[info.node_index].component_index
        props = self.nnet.components[ci].properties()
        if info.deriv <= 0 or (in_info.deriv <= 0 and not props & P.UPDATABLE_COMPONENT):
            raise CompilerError(f"component node {self.nnet.nodes[info.node_index].name!r}: "
                                f"backprop without the derivatives it needs")
        in_value = in_info.value if props & P.BACKPROP_NEEDS_INPUT else 0
        out_value = info.value if props & P.BACKPROP_NEEDS_OUTPUT else 0
        memo = step if props & P.USES_MEMO else 0
        computation.add(CT.BACKPROP, ci, info.precomputed_indexes_index, in_value, out_value,
                        info.deriv, in_info.deriv, memo)

    # -- commands -------------------------------------------------------------------------------------
    def _add_commands(self, deriv_needed, step_to_segment, computation) -> None:
        computation.need_model_derivative = self.requests[0].need_model_derivative
        whole = computation.whole_submatrices()
        self._allocate_matrices(whole, computation)
        self._set_up_precomputed_indexes(step_to_segment, computation)
        n = len(self.steps)
        for step in range(n):
            self._compile_forward(step, computation)
            if step + 1 < n and step_to_segment[step + 1] != step_to_segment[step]:
                computation.add(CT.NO_OPERATION_MARKER)
        computation.add(CT.NO_OPERATION_MARKER)
        for step in range(n - 1, -1, -1):
            if deriv_needed[step]:
                self._compile_backward(step, computation)
        self._deallocate_matrices(whole, step_to_segment, computation)

    def _allocate_matrices(self, whole, computation) -> None:
        nnet, graph = self.nnet, self.graph
        supplied = set()
        for info in self.steps:
            if not info.output_cindex_ids:
                continue
            if graph.is_input[info.output_cindex_ids[0]]:
                supplied.add(computation.submatrices[info.value].matrix_index)
            if nnet.is_output_node(info.node_index) and info.deriv != 0:
                supplied.add(computation.submatrices[info.deriv].matrix_index)
        for m in range(1, len(computation.matrices)):
            if m not in supplied:
                computation.add(CT.ALLOC_MATRIX, whole[m])
                computation.add(CT.SET_CONST, whole[m], alpha=0.0)

    def _set_up_precomputed_indexes(self, step_to_segment, computation) -> None:
        nnet = self.nnet
        computation.component_precomputed_indexes = [PrecomputedIndexesInfo()]
        for step, info in enumerate(self.steps):
            if not nnet.is_component_node(info.node_index):
                continue
            in_info = self.steps[step - 1]
            comp = nnet.components[nnet.nodes[info.node_index].component_index]
            req = self.requests[step_to_segment[step]]
            data = comp.precompute_indexes(req.misc_info, in_info.output_indexes,
                                           info.output_indexes, req.need_derivatives())
            if data is None:
                info.precomputed_indexes_index = 0
                continue
            info.precomputed_indexes_index = len(computation.component_precomputed_indexes)
            entry = PrecomputedIndexesInfo(data)
            ins, outs = in_info.output_indexes, info.output_indexes
            if ins and ins[-1][0] == 1 and outs and outs[-1][0] == 1:
                # kept for shortcut compilation (ExpandComputation), as Kaldi does
                entry.input_indexes = list(ins)
                entry.output_indexes = list(outs)
            computation.component_precomputed_indexes.append(entry)

    def _deallocate_matrices(self, whole, step_to_segment, computation) -> None:
        nnet = self.nnet
        keep = set()
        for step, info in enumerate(self.steps):
            req = self.requests[step_to_segment[step]]
            node = info.node_index
            if nnet.is_output_node(node):
                keep.add(computation.submatrices[info.value].matrix_index)
            elif nnet.is_input_node(node):
                i = req.index_of_input(nnet.nodes[node].name)
                if i == -1:
                    raise CompilerError(f"input node {nnet.nodes[node].name!r} not in request")
                if req.inputs[i].has_deriv:
                    keep.add(computation.submatrices[info.deriv].matrix_index)
        for m in range(1, len(computation.matrices)):
            if m not in keep:
                computation.add(CT.DEALLOC_MATRIX, whole[m])

    def _output_debug_info(self, computation) -> None:
        dbg = [MatrixDebugInfo() for _ in computation.matrices]
        for info in self.steps:
            if info.value == 0 or not computation.is_whole_matrix(info.value):
                continue
            vm = computation.submatrices[info.value].matrix_index
            if dbg[vm].cindexes:
                continue  # an alias made by a dim-range node covering all columns
            dbg[vm].is_deriv = False
            node = info.node_index
            # plain (node, Index) tuples: Cindex objects for 100k rows cost real time
            dbg[vm].cindexes = [(node, i) for i in info.output_indexes]
            if info.deriv != 0 and computation.is_whole_matrix(info.deriv):
                dm = computation.submatrices[info.deriv].matrix_index
                dbg[dm].is_deriv = True
                dbg[dm].cindexes = dbg[vm].cindexes
        computation.matrix_debug_info = dbg


def consolidate_io_operations(computation: NnetComputation) -> None:
    """Kaldi's ConsolidateIoOperations: within each marker-separated segment, put
    kAcceptInput first and kProvideOutput last, keeping relative order."""
    cmds = computation.commands
    out: list[Command] = []
    seg: list[Command] = []
    segments = []

    def flush():
        start = len(out)
        out.extend(c for c in seg if c.command_type == CT.ACCEPT_INPUT)
        out.extend(c for c in seg if c.command_type not in (CT.ACCEPT_INPUT, CT.PROVIDE_OUTPUT))
        out.extend(c for c in seg if c.command_type == CT.PROVIDE_OUTPUT)
        segments.append((start, len(out)))
        seg.clear()

    for c in cmds:
        if c.command_type == CT.NO_OPERATION_MARKER:
            flush()
            out.append(c)
        else:
            seg.append(c)
    flush()
    computation.commands = out
    computation.segments = segments


def compile_computation(nnet, requests, options: CompilerOptions = CompilerOptions()
                        ) -> NnetComputation:
    """Kaldi's Compiler::CreateComputation for one request or a list of requests
    (segments of a looped computation)."""
    if not isinstance(requests, (list, tuple)):
        requests = [requests]
    # The compiler allocates hundreds of thousands of small lists and tuples
    # (one graph vertex each) and frees them by reference counting; the cyclic
    # collector's full passes over them cost up to 40% of the compile time and
    # find nothing, so it is paused for the duration (gc_pause: nests, thread-safe).
    with gc_paused():
        return Compiler(nnet, requests).create_computation(options)
