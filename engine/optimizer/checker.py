"""Computation checker: Kaldi's ComputationChecker and CheckComputation
(nnet-analyze.cc).

``check_computation(nnet, computation)`` proves a computation well formed or
raises ``CheckError`` naming the command (in its printed form) and the problem:

- indexes: every argument in range, dimensions agree with each other and with
  the components, in-place operation only where the component allows it, memos
  produced once and consumed once by a backprop of the same component, goto at
  the end pointing back to a label;
- matrix accesses: every matrix initialized before use, used, not used after it
  is destroyed;
- undefined: no variable read before it is written;
- compression: every compress followed by a decompress across the segment marker;
- debug info: one cindex per row;
- rewrite (``check_rewrite=True``, for unoptimized computations only): no
  variable modified after it was read.

Looped computations (ending in kGotoLabel) are checked as Kaldi does: the
trailing swap commands are read as deallocations, and unused variables allowed.
"""

from __future__ import annotations

from engine.compiler.computation import NnetComputation
from engine.core.errors import CheckError
from engine.nnet.components.base import ComponentProperty as P
from engine.optimizer.analysis import CT, READ, WRITE, Analyzer



class ComputationChecker:
    def __init__(self, nnet, computation: NnetComputation, check_rewrite: bool = False,
                 check_unused_variables: bool = True):
        self.nnet = nnet
        self.c = computation
        self.check_rewrite = check_rewrite
        self.check_unused_variables = check_unused_variables
        self.a: Analyzer | None = None
        self._strings: list[str] | None = None

    # -- error reporting -------------------------------------------------------------------
    def _cmd(self, i: int) -> str:
        if self._strings is None:
            try:
                self._strings = self.c.command_strings(self.nnet)
            except Exception:  # noqa: BLE001 -- a broken computation may not print
                self._strings = [f"{c.command_type.kaldi_name} {c.args}" for c in self.c.commands]
        return f"c{i}: {self._strings[i]}"

    def fail(self, i: int, problem: str):
        raise CheckError(f"computation check failed at {self._cmd(i)}: {problem}")

    def fail_matrix(self, m: int, problem: str, command: int | None = None):
        where = f" (at {self._cmd(command)})" if command is not None and command >= 0 else ""
        raise CheckError(f"computation check failed: matrix m{m} {problem}{where}")

    # -- the checks --------------------------------------------------------------------------
    def check(self) -> None:
        self.check_indexes()
        try:
            self.a = Analyzer(self.nnet, self.c)
        except CheckError as e:
            if getattr(e, "command", None) is None:
                raise
            self.fail(e.command, e.reason)
        self.check_matrix_accesses()
        self.check_compression()
        self.check_undefined()
        self.check_debug_info()
        if self.check_rewrite:
            self.check_rewrite_order()

    def _sub_ok(self, s: int, allow_zero: bool = False) -> bool:
        return (0 if allow_zero else 1) <= s < len(self.c.submatrices)

    def check_indexes(self) -> None:
        c = self.c
        subs = c.submatrices
        ncomp = len(self.nnet.components)
        memo_to_command: dict[int, int] = {}
        n = len(c.commands)
        for i, cmd in enumerate(c.commands):
            ct = cmd.command_type
            if ct in (CT.ALLOC_MATRIX, CT.DEALLOC_MATRIX, CT.DECOMPRESS_MATRIX):
                if not self._sub_ok(cmd.arg1) or not c.is_whole_matrix(cmd.arg1):
                    self.fail(i, "submatrix index out of range or not a whole matrix")
            elif ct == CT.SET_CONST:
                if not self._sub_ok(cmd.arg1):
                    self.fail(i, "submatrix index out of range")
            elif ct == CT.SWAP_MATRIX:
                if not (self._sub_ok(cmd.arg1) and self._sub_ok(cmd.arg2)
                        and c.is_whole_matrix(cmd.arg1) and c.is_whole_matrix(cmd.arg2)):
                    self.fail(i, "submatrix index out of range or not a whole matrix")
                a, b = subs[cmd.arg1], subs[cmd.arg2]
                if (a.num_rows, a.num_cols) != (b.num_rows, b.num_cols):
                    self.fail(i, "dimension mismatch in swap")
            elif ct == CT.PROPAGATE:
                self._check_propagate(i, cmd, ncomp, memo_to_command)
            elif ct in (CT.BACKPROP, CT.BACKPROP_NO_MODEL_UPDATE):
                self._check_backprop(i, cmd, ncomp, memo_to_command)
            elif ct in (CT.MATRIX_COPY, CT.MATRIX_ADD):
                if not (self._sub_ok(cmd.arg1) and self._sub_ok(cmd.arg2)):
                    self.fail(i, "submatrix index out of range")
                a, b = subs[cmd.arg1], subs[cmd.arg2]
                if (a.num_rows, a.num_cols) != (b.num_rows, b.num_cols):
                    self.fail(i, f"dimension mismatch {a.num_rows}x{a.num_cols} vs "
                                 f"{b.num_rows}x{b.num_cols}")
                if cmd.arg1 == cmd.arg2 and not (ct == CT.MATRIX_COPY and cmd.alpha != 1.0):
                    self.fail(i, "adding/copying a submatrix to itself")
            elif ct in (CT.ADD_ROWS, CT.COPY_ROWS):
                self._check_rows(i, cmd)
            elif ct in (CT.ADD_ROWS_MULTI, CT.COPY_ROWS_MULTI, CT.ADD_TO_ROWS_MULTI,
                        CT.COPY_TO_ROWS_MULTI):
                self._check_multi(i, cmd)
            elif ct == CT.ADD_ROW_RANGES:
                self._check_ranges(i, cmd)
            elif ct == CT.COMPRESS_MATRIX:
                if not self._sub_ok(cmd.arg1) or not c.is_whole_matrix(cmd.arg1):
                    self.fail(i, "submatrix index out of range or not a whole matrix")
                if not 1 <= cmd.arg2 <= 4:
                    self.fail(i, f"invalid compression type {cmd.arg2}")
                if cmd.arg3 not in (0, 1):
                    self.fail(i, "invalid truncate flag")
                if cmd.alpha < 0.0 or cmd.alpha > 1000.0 or (cmd.alpha == 0.0 and cmd.arg2 != 2):
                    self.fail(i, f"invalid range {cmd.alpha} for compression")
            elif ct in (CT.ACCEPT_INPUT, CT.PROVIDE_OUTPUT):
                if not self._sub_ok(cmd.arg1) or not c.is_whole_matrix(cmd.arg1):
                    self.fail(i, "submatrix index out of range or not a whole matrix")
                node = cmd.arg2
                if not (0 <= node < len(self.nnet.nodes)
                        and (self.nnet.is_input_node(node) or self.nnet.is_output_node(node))):
                    self.fail(i, f"node {node} is not an input or output node")
            elif ct == CT.GOTO_LABEL:
                lab = cmd.arg1
                if not (0 <= lab < i and c.commands[lab].command_type == CT.NO_OPERATION_LABEL):
                    self.fail(i, "goto has an invalid destination (must be an earlier label)")
                if i + 1 != n:
                    self.fail(i, "goto is not the last command")
        if memo_to_command:
            memo, ci = next(iter(memo_to_command.items()))
            self.fail(ci, f"memo {memo} is produced but never consumed")

    def _component(self, i: int, cmd, ncomp: int):
        if not 0 <= cmd.arg1 < ncomp:
            self.fail(i, f"component index {cmd.arg1} out of range")
        comp = self.nnet.components[cmd.arg1]
        props = comp.properties()
        if cmd.arg2 != 0 and not 0 < cmd.arg2 < len(self.c.component_precomputed_indexes):
            self.fail(i, "precomputed-indexes index out of range")
        if cmd.arg2 != 0 and props & P.SIMPLE_COMPONENT:
            self.fail(i, "precomputed indexes given to a simple component")
        return comp, props

    def _check_propagate(self, i, cmd, ncomp, memo_to_command) -> None:
        comp, props = self._component(i, cmd, ncomp)
        subs = self.c.submatrices
        if (not self._sub_ok(cmd.arg3, True) or (cmd.arg3 == 0 and props & P.SIMPLE_COMPONENT)
                or not self._sub_ok(cmd.arg4)):
            self.fail(i, "submatrix indexes out of range")
        if cmd.arg3 > 0 and subs[cmd.arg3].num_cols != comp.input_dim():
            self.fail(i, f"input has {subs[cmd.arg3].num_cols} columns, component input-dim "
                         f"is {comp.input_dim()}")
        if subs[cmd.arg4].num_cols != comp.output_dim():
            self.fail(i, f"output has {subs[cmd.arg4].num_cols} columns, component output-dim "
                         f"is {comp.output_dim()}")
        if props & P.SIMPLE_COMPONENT and subs[cmd.arg3].num_rows != subs[cmd.arg4].num_rows:
            self.fail(i, "num-rows mismatch for a simple component")
        if cmd.arg3 == cmd.arg4 and not props & P.PROPAGATE_IN_PLACE:
            self.fail(i, "in-place propagation, which this component does not support")
        if cmd.arg5 > 0:
            if cmd.arg5 in memo_to_command:
                self.fail(i, f"memo index {cmd.arg5} re-used")
            memo_to_command[cmd.arg5] = i
        if cmd.arg6 not in (0, 1):
            self.fail(i, f"store-stats flag must be 0 or 1, is {cmd.arg6}")

    def _check_backprop(self, i, cmd, ncomp, memo_to_command) -> None:
        comp, props = self._component(i, cmd, ncomp)
        subs = self.c.submatrices
        if not (self._sub_ok(cmd.arg3, True) and self._sub_ok(cmd.arg4, True)
                and self._sub_ok(cmd.arg5) and self._sub_ok(cmd.arg6, True)):
            self.fail(i, "submatrix index out of range")
        if props & P.BACKPROP_NEEDS_INPUT and cmd.arg3 == 0:
            self.fail(i, "backprop needs the input value but none is supplied")
        if props & P.BACKPROP_NEEDS_OUTPUT and cmd.arg4 == 0:
            self.fail(i, "backprop needs the output value but none is supplied")
        if cmd.arg6 == 0 and not props & P.UPDATABLE_COMPONENT:
            self.fail(i, "backprop has no effect (no input derivative, not updatable)")
        if cmd.arg5 == cmd.arg6 and not props & P.BACKPROP_IN_PLACE:
            self.fail(i, "in-place backprop, which this component does not support")
        idim, odim = comp.input_dim(), comp.output_dim()
        for arg, dim, what in ((cmd.arg3, idim, "input value"), (cmd.arg4, odim, "output value"),
                               (cmd.arg5, odim, "output derivative"),
                               (cmd.arg6, idim, "input derivative")):
            if arg != 0 and subs[arg].num_cols != dim:
                self.fail(i, f"{what} has {subs[arg].num_cols} columns, expected {dim}")
        if cmd.arg3 != 0 and cmd.arg6 != 0 and subs[cmd.arg3].num_rows != subs[cmd.arg6].num_rows:
            self.fail(i, "num-rows mismatch between input value and input derivative")
        if cmd.arg4 != 0 and subs[cmd.arg4].num_rows != subs[cmd.arg5].num_rows:
            self.fail(i, "num-rows mismatch between output value and output derivative")
        if (props & P.SIMPLE_COMPONENT and cmd.arg6 != 0
                and subs[cmd.arg5].num_rows != subs[cmd.arg6].num_rows):
            self.fail(i, "num-rows mismatch between output and input derivative")
        if cmd.arg7 != 0:
            if cmd.arg7 < 0 or cmd.arg7 not in memo_to_command:
                self.fail(i, f"memo {cmd.arg7} was not produced by an earlier propagate")
            prop = memo_to_command.pop(cmd.arg7)
            if self.c.commands[prop].arg1 != cmd.arg1:
                self.fail(i, f"memo {cmd.arg7} was produced by c{prop} for another component")
            if not props & P.USES_MEMO:
                self.fail(i, "memo given to a component that does not use one")

    def _check_rows(self, i, cmd) -> None:
        c = self.c
        if not (self._sub_ok(cmd.arg1) and self._sub_ok(cmd.arg2)
                and 0 <= cmd.arg3 < len(c.indexes)):
            self.fail(i, "index out of range")
        idx = c.indexes[cmd.arg3]
        d, s = c.submatrices[cmd.arg1], c.submatrices[cmd.arg2]
        if len(idx) != d.num_rows:
            self.fail(i, f"{len(idx)} row indexes for {d.num_rows} rows")
        if d.num_cols != s.num_cols:
            self.fail(i, "column-dimension mismatch")
        if idx and (max(idx) >= s.num_rows or min(idx) < -1):
            self.fail(i, f"row index out of range (source has {s.num_rows} rows)")
        if cmd.arg1 == cmd.arg2:
            self.fail(i, "copying rows of a submatrix to itself")

    def _check_multi(self, i, cmd) -> None:
        c = self.c
        if not (self._sub_ok(cmd.arg1) and 0 <= cmd.arg2 < len(c.indexes_multi)):
            self.fail(i, "index out of range")
        pairs = c.indexes_multi[cmd.arg2]
        d = c.submatrices[cmd.arg1]
        if len(pairs) != d.num_rows:
            self.fail(i, f"{len(pairs)} row pairs for {d.num_rows} rows")
        for s, r in pairs:
            if s == -1:
                if r != -1:
                    self.fail(i, "row index must be -1 where the submatrix is -1")
                continue
            if not self._sub_ok(s):
                self.fail(i, f"submatrix {s} out of range in the row list")
            if not 0 <= r < c.submatrices[s].num_rows:
                self.fail(i, f"row {r} out of range of submatrix {s}")
            if s == cmd.arg1:
                self.fail(i, "copying from self")
            if c.submatrices[s].num_cols != d.num_cols:
                self.fail(i, f"submatrix {s} has a different number of columns")
        if cmd.command_type in (CT.ADD_TO_ROWS_MULTI, CT.COPY_TO_ROWS_MULTI):
            real = [p for p in pairs if p[0] != -1]
            if len(set(real)) != len(real):
                self.fail(i, "duplicate destination row in a to-rows-multi command")

    def _check_ranges(self, i, cmd) -> None:
        c = self.c
        if not (self._sub_ok(cmd.arg1) and self._sub_ok(cmd.arg2)
                and 0 <= cmd.arg3 < len(c.indexes_ranges)):
            self.fail(i, "index out of range")
        pairs = c.indexes_ranges[cmd.arg3]
        d, s = c.submatrices[cmd.arg1], c.submatrices[cmd.arg2]
        if len(pairs) != d.num_rows:
            self.fail(i, f"{len(pairs)} ranges for {d.num_rows} rows")
        if d.num_cols != s.num_cols:
            self.fail(i, "column-dimension mismatch")
        for a, b in pairs:
            if not ((a == -1 and b == -1) or (b > a >= 0 and b <= s.num_rows)):
                self.fail(i, f"invalid row range {a},{b}")

    def check_matrix_accesses(self) -> None:
        for m in range(1, len(self.c.matrices)):
            acc = self.a.matrix_accesses[m]
            if acc.allocate_command == -1:
                self.fail_matrix(m, "is never initialized")
            if not acc.accesses:
                if acc.is_input:
                    continue  # an input nobody needs (an unused derivative): allowed
                self.fail_matrix(m, "is never accessed", acc.allocate_command)
            first, last = acc.accesses[0][0], acc.accesses[-1][0]
            if first < acc.allocate_command:
                self.fail_matrix(m, f"is accessed before it is initialized (by "
                                    f"c{acc.allocate_command})", first)
            if acc.deallocate_command != -1 and last >= acc.deallocate_command:
                self.fail_matrix(m, f"is accessed after it is destroyed (by "
                                    f"c{acc.deallocate_command})", last)

    def check_compression(self) -> None:
        cmds = self.c.commands
        middle = next((i for i, c in enumerate(cmds)
                       if c.command_type == CT.NO_OPERATION_MARKER), -1)
        for m in range(1, len(self.c.matrices)):
            acc = self.a.matrix_accesses[m].accesses
            for k, (ci, _) in enumerate(acc):
                ct = cmds[ci].command_type
                if ct == CT.DECOMPRESS_MATRIX:
                    if k == 0 or cmds[acc[k - 1][0]].command_type != CT.COMPRESS_MATRIX:
                        self.fail(ci, "decompression not preceded by a compression")
                elif ct == CT.COMPRESS_MATRIX:
                    nxt = acc[k + 1][0] if k + 1 < len(acc) else -1
                    if (nxt < 0 or cmds[nxt].command_type != CT.DECOMPRESS_MATRIX
                            or not ci < middle < nxt):
                        self.fail(ci, "compression must be followed by a decompression in "
                                      "the backward pass")

    def check_undefined(self) -> None:
        a, cmds = self.a, self.c.commands
        for v, acc in enumerate(a.variable_accesses):
            if not acc:
                if self.check_unused_variables:
                    info = a.variables.variable_info(v)
                    mi = self.c.matrices[info.matrix_index]
                    # Kaldi tolerates unused trailing rows of a partially used matrix
                    if (info.row_offset >= 0.8 * mi.num_rows
                            and not (info.col_offset == 0 and info.num_cols == mi.num_cols)):
                        continue
                    raise CheckError(f"computation check failed: variable "
                                     f"{a.variables.describe_variable(v)} is never used")
                continue
            ci, kind = acc[0]
            if kind != WRITE and cmds[ci].command_type != CT.COMPRESS_MATRIX:
                self.fail(ci, f"variable {a.variables.describe_variable(v)} is read before "
                              "it is written to")

    def check_debug_info(self) -> None:
        dbg = self.c.matrix_debug_info
        if not dbg:
            return
        if len(dbg) != len(self.c.matrices):
            raise CheckError(f"computation check failed: debug info for {len(dbg)} matrices, "
                             f"computation has {len(self.c.matrices)}")
        for m in range(1, len(dbg)):
            if len(dbg[m].cindexes) != self.c.matrices[m].num_rows:
                self.fail_matrix(m, f"has {self.c.matrices[m].num_rows} rows but "
                                    f"{len(dbg[m].cindexes)} cindexes in its debug info")

    def check_rewrite_order(self) -> None:
        a = self.a
        for v, acc in enumerate(a.variable_accesses):
            first_read = next((k for k, (_, kind) in enumerate(acc) if kind == READ), None)
            if first_read is None:
                continue
            for ci, kind in acc[first_read + 1:]:
                if kind != READ:
                    self.fail(ci, f"variable {a.variables.describe_variable(v)} is modified "
                                  "after being read (not expected before optimization)")


def check_computation(nnet, computation: NnetComputation, check_rewrite: bool = False) -> None:
    """Kaldi's CheckComputation; raises CheckError."""
    cmds = computation.commands
    if cmds and cmds[-1].command_type == CT.GOTO_LABEL:
        # looped: the swaps before the goto hand matrices to the next iteration;
        # read them as deallocations of their second argument.
        looped = computation.copy()
        k = len(looped.commands) - 2
        while k >= 0 and looped.commands[k].command_type == CT.SWAP_MATRIX:
            sc = looped.commands[k]
            sc.command_type = CT.DEALLOC_MATRIX
            sc.arg1, sc.arg2 = sc.arg2, sc.arg1
            k -= 1
        ComputationChecker(nnet, looped, check_rewrite, check_unused_variables=False).check()
        return
    ComputationChecker(nnet, computation, check_rewrite).check()
