"""Model-update consolidation: Kaldi's ConsolidateModelUpdate /
ModelUpdateConsolidator (nnet-optimize-utils.cc).

In recurrent networks one updatable component is backpropagated once per time
step, and each of those backprops would update the parameters with a small
matrix product.  This pass turns them into kBackpropNoModelUpdate (they still
produce the input derivative) and adds, at the end of the computation, one
kBackprop per component that does the whole update at once on consolidated
matrices: the input values (and output values, if the component needs them)
and the output derivatives of all the steps, stacked by rows.  The rows are
copied into the consolidated matrices just before each original backprop
(when they hold the right values); variable merging later removes most of
those copies by making the producers write in place.

Only simple updatable components without memos qualify (as in Kaldi); nothing
happens unless the computation needs model derivatives.
"""

from __future__ import annotations

from engine.compiler.computation import (K_DEFAULT_STRIDE, K_STRIDE_EQUAL_NUM_COLS, Command,
                                         MatrixDebugInfo, NnetComputation)
from engine.nnet.components.base import ComponentProperty as P
from engine.optimizer.analysis import CT



class ModelUpdateConsolidator:
    def __init__(self, nnet, computation: NnetComputation):
        self.nnet = nnet
        self.c = computation
        n = len(computation.commands)
        self.extra_commands: list[list[Command]] = [[] for _ in range(n)]  # before command i
        self.final_commands: list[Command] = []
        self.final_deallocs: list[Command] = []

    def consolidate_submatrices(self, commands: list[int], submatrices: list[int]) -> int:
        """A new matrix stacking ``submatrices`` by rows, each copied in just before the
        matching command; returns the submatrix covering the new matrix."""
        c = self.c
        num_cols = c.submatrices[submatrices[0]].num_cols
        num_rows = 0
        stride = K_DEFAULT_STRIDE
        debug = MatrixDebugInfo()
        for s in submatrices:
            sm = c.submatrices[s]
            assert sm.num_cols == num_cols
            num_rows += sm.num_rows
            if c.matrix_debug_info:
                src = c.matrix_debug_info[sm.matrix_index]
                debug.is_deriv = src.is_deriv
                debug.cindexes.extend(src.cindexes[sm.row_offset:sm.row_offset + sm.num_rows])
            if (c.is_whole_matrix(s)
                    and c.matrices[sm.matrix_index].stride_type == K_STRIDE_EQUAL_NUM_COLS):
                stride = K_STRIDE_EQUAL_NUM_COLS
        whole = c.new_matrix(num_rows, num_cols, stride)
        m = c.submatrices[whole].matrix_index
        if c.matrix_debug_info:
            c.matrix_debug_info[m] = debug
        # zeroed for safety; remove_unnecessary_zeroing drops it when the copies cover it
        self.extra_commands[0].append(Command.make(CT.ALLOC_MATRIX, whole))
        self.extra_commands[0].append(Command.make(CT.SET_CONST, whole, alpha=0.0))
        self.final_deallocs.append(Command.make(CT.DEALLOC_MATRIX, whole))
        row = 0
        for ci, s in zip(commands, submatrices):
            nr = c.submatrices[s].num_rows
            part = c.new_submatrix(whole, row, nr, 0, num_cols)
            self.extra_commands[ci].append(Command.make(CT.MATRIX_COPY, part, s))
            row += nr
        return whole

    def consolidate_component(self, component: int, backprops: list[int]) -> None:
        props = self.nnet.components[component].properties()
        need_in = bool(props & P.BACKPROP_NEEDS_INPUT)
        need_out = bool(props & P.BACKPROP_NEEDS_OUTPUT)
        ins, outs, derivs = [], [], []
        for ci in backprops:
            cmd = self.c.commands[ci]
            assert cmd.command_type == CT.BACKPROP and cmd.arg2 == 0
            cmd.command_type = CT.BACKPROP_NO_MODEL_UPDATE
            ins.append(cmd.arg3)
            outs.append(cmd.arg4)
            derivs.append(cmd.arg5)
        in_sub = self.consolidate_submatrices(backprops, ins) if need_in else 0
        out_sub = self.consolidate_submatrices(backprops, outs) if need_out else 0
        deriv_sub = self.consolidate_submatrices(backprops, derivs)
        # no input derivative, no precomputed indexes (simple component), no memo
        self.final_commands.append(Command.make(CT.BACKPROP, component, 0, in_sub, out_sub,
                                                deriv_sub, 0, 0))

    def apply(self) -> bool:
        by_component: dict[int, list[int]] = {}
        for ci, cmd in enumerate(self.c.commands):
            if cmd.command_type != CT.BACKPROP:
                continue
            props = self.nnet.components[cmd.arg1].properties()
            if (props & P.UPDATABLE_COMPONENT and props & P.SIMPLE_COMPONENT
                    and not props & P.USES_MEMO):
                by_component.setdefault(cmd.arg1, []).append(ci)
        todo = sorted(k for k, v in by_component.items() if len(v) > 1)
        if not todo:
            return False
        for comp in todo:
            self.consolidate_component(comp, by_component[comp])
        new: list[Command] = []
        for ci, cmd in enumerate(self.c.commands):
            new.extend(self.extra_commands[ci])
            new.append(cmd)
        new.extend(self.final_commands)
        new.extend(self.final_deallocs)
        self.c.commands = new
        return True


def consolidate_model_update(computation: NnetComputation, ctx) -> bool:
    if not computation.need_model_derivative:
        return False
    return ModelUpdateConsolidator(ctx.nnet, computation).apply()
