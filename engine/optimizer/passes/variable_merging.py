"""Variable merging: Kaldi's VariableMergingOptimization / VariableMergingOptimizer
(nnet-optimize.cc, nnet-optimize-utils.cc).

Three kinds of command relate a source submatrix s1 to a destination s2 that
could share memory:

- ``s2 = s1`` (kMatrixCopy; option remove_assignments): if s2 is not touched
  before the copy and s1 is not written after it nor read after s2 changes, the
  two are one matrix and the copy disappears;
- propagate of a component with PROPAGATE_IN_PLACE (option propagate_in_place)
  when the input is last used by that propagate and the output first written by
  it;
- backprop of a component with BACKPROP_IN_PLACE (option backprop_in_place), the
  same for output-derivative and input-derivative.

Merging replaces one matrix (the "discarded" one) by a submatrix of the other
(the "kept" one).  A *left merge* keeps s1's matrix (s2 must then be a whole
matrix), a *right merge* keeps s2's (s1 must be whole); allow_left_merge /
allow_right_merge switch them.  The discarded matrix's allocation,
deallocation and initial zeroing become no-ops; inputs and outputs keep their
own matrix.  Each round merges every pair it can among variables not yet
touched by a merge in that round; rounds repeat until nothing merges.

Rounds are Kaldi's, computed with less work and the same result:

- each round sees the analysis of the computation as the round started (Kaldi
  builds a new analyzer per round); after a round only the matrices that took
  part in a merge are analysed again (``Analyzer.reanalyze``), and
- the next round looks only at candidates that touch one of those matrices:
  every other candidate depends on nothing that changed and was turned down
  last time (anything turned down because of the round's dirty variables
  touches a merged matrix), so it would be turned down again; nor at those
  turned down for good (see ``merge_variables``);
- the renumbering and removal of no-ops that Kaldi does after every round that
  merged something is done once at the end.  In between only the order of
  commands and the identity of submatrices matter: no-ops touch nothing, and
  renumbering keeps the order of matrices and submatrices.  The one place
  where submatrix numbers are compared (the backprop arguments below) compares
  what renumbering would make equal -- the same extent -- after the first round.
  What the skipped renumberings would have decided is the position of each
  group of equal submatrices (the first one in use at that time): that is
  tracked as a sort key per submatrix (``_SubmatrixOrder``) and handed to the
  final renumbering.

With the default options (remove_unnecessary_zeroing next), the rounds and the
zeroing decisions run in C when the extension is built (engine.optimizer.native,
``native_rounds``): the same decisions on the same data held as flat arrays,
about ten times faster.  This module stays the reference: the C code makes the
merges once everything is decided and hands back what ``_apply_native`` needs, or
answers None, the computation untouched, when it holds something the C code
leaves to Python (an error the analysis reports, a zeroing only the per-variable
access lists decide), and the Python rounds then run.
"""

from __future__ import annotations

from collections import Counter
from operator import itemgetter

from engine.compiler.computation import K_STRIDE_EQUAL_NUM_COLS, NnetComputation
from engine.core.cancel import checkpoint
from engine.nnet.components.base import ComponentProperty as P
from engine.optimizer import native
from engine.optimizer.analysis import (CT, Analyzer, ComponentProperties, ComputationAnalysis,
                                       _accesses_of, native_plans)
from engine.optimizer.passes.initialize_undefined import unnecessary_zeroings
from engine.optimizer.passes.remove_no_ops import (fix_goto_label, remove_no_ops,
                                                   remove_no_ops_from)
from engine.optimizer.pipeline import removes_unnecessary_zeroing
from engine.optimizer.passes.renumber import (renumber_computation, renumber_with_maps,
                                              submatrix_info)

_PROPAGATE_IN_PLACE, _BACKPROP_IN_PLACE = int(P.PROPAGATE_IN_PLACE), int(P.BACKPROP_IN_PLACE)
_FIRST = itemgetter(0)
if native.EXTENSION is not None:   # the access plans of the analysis, for the C rounds
    native.EXTENSION.configure(native_plans(), (_PROPAGATE_IN_PLACE, _BACKPROP_IN_PLACE,
                                                int(P.PROPAGATE_ADDS), int(P.BACKPROP_ADDS)),
                               CT.NO_OPERATION)


class VariableMergingOptimizer:
    """One round (Kaldi's VariableMergingOptimizer::MergeVariables) on an analysis
    of the computation as the round starts."""

    def __init__(self, options, computation: NnetComputation, analyzer: Analyzer,
                 props, first_round: bool = True, renumbered: bool = True):
        self.o = options
        self.props = props
        self.c = computation
        self.a = analyzer
        self.analysis = ComputationAnalysis(computation, analyzer)
        # as the round starts (reanalyze() updates it after the round)
        self.matrix_to_submatrix = analyzer.submatrices_of
        # Kaldi's dirty variables: those of the kept submatrices (rectangles per
        # matrix) and of the discarded matrices (whose submatrices have moved)
        self.dirty: dict[int, list[tuple[int, int, int, int]]] = {}
        self.moved: set[int] = set()
        # submatrix numbers tell equal extents apart only in the first round of a
        # renumbered computation
        self.by_number = first_round and renumbered
        self.groups: dict[int, list[int]] = {}   # kept matrix -> itself and the discarded
        # candidates no later round need look at (see merge_variables)
        self.settled: list[int] = []

    def _same(self, s: int, t: int) -> bool:
        """s and t are the same submatrix (as numbered after a renumbering); an
        argument left out (-1 or 0) is no submatrix."""
        if self.by_number or s == t:
            return s == t
        return s > 0 and t > 0 and self.c.submatrices[s] == self.c.submatrices[t]

    def _candidate(self, cmd) -> tuple[int, int]:
        """(s1, s2): source and destination that might be merged, or (-1, -1)."""
        o = self.o
        ct = cmd.command_type
        if ct == CT.MATRIX_COPY and o.remove_assignments:
            return cmd.arg2, cmd.arg1
        if ct == CT.PROPAGATE and o.propagate_in_place:
            if self.props[cmd.arg1] & _PROPAGATE_IN_PLACE:
                return cmd.arg3, cmd.arg4
        elif ct in (CT.BACKPROP, CT.BACKPROP_NO_MODEL_UPDATE) and o.backprop_in_place:
            if self.props[cmd.arg1] & _BACKPROP_IN_PLACE:
                s1, s2 = cmd.arg5, cmd.arg6
                # the values the backprop reads must not be overwritten by it
                same = self._same
                if same(cmd.arg3, s1) or same(cmd.arg3, s2) or same(cmd.arg4, s1) \
                        or same(cmd.arg4, s2):
                    return -1, -1
                return s1, s2
        return -1, -1

    def merge_variables(self, commands) -> bool:
        """Try the candidates among ``commands`` (indexes, increasing).  Those
        that no later round need look at again go to ``settled``: the ones that
        merged (the copy is gone, or source and destination are now on one
        matrix) and those that cannot merge in this round or any later one:
        neither the source nor the destination is a whole matrix where a merge
        direction needs it (merging never makes a part of a matrix whole), or
        both are already on one matrix."""
        merged = False
        cmds = self.c.commands
        subs = self.c.submatrices
        whole = self.a.submatrix_whole
        left_ok, right_ok = self.o.allow_left_merge, self.o.allow_right_merge
        settled = self.settled
        candidate = self._candidate
        copy = CT.MATRIX_COPY if self.o.remove_assignments else None
        for ci in commands:
            cmd = cmds[ci]
            if cmd.command_type == copy:   # the usual candidate, inline
                s1, s2 = cmd.arg2, cmd.arg1
            else:
                s1, s2 = candidate(cmd)
            if s1 <= 0 or s2 <= 0:
                continue
            left, right = left_ok and whole[s2], right_ok and whole[s1]
            if not (left or right) or subs[s1][0] == subs[s2][0]:
                settled.append(ci)
                continue
            keep = self.kept_side(ci, s1, s2, left, right)
            if keep:
                if keep == s1:
                    self.do_merge(ci, s1, s2)
                else:
                    self.do_merge(ci, s2, s1)
                settled.append(ci)
                merged = True
        return merged

    def kept_side(self, ci: int, s1: int, s2: int, left: bool, right: bool) -> int:
        """How s1 and s2 (on two matrices) merge at command ci in this round: s1
        when they can by a left merge (which keeps s1's matrix), else s2 when
        they can by a right merge, else 0.  ``left``, ``right``: whether the
        options and the wholeness of s2, s1 allow each.  The conditions are
        independent tests; the ones that turn most candidates down and cost
        least come first."""
        c, a = self.c, self.a
        if self.dirty and (self._is_dirty(s1) or self._is_dirty(s2)):
            return 0
        # s1, s2 have not moved: their matrix and wholeness are as at the round's start
        s2m, whole = a.submatrix_matrix, a.submatrix_whole
        m1, m2 = s2m[s1], s2m[s2]
        whole1, whole2 = whole[s1], whole[s2]
        macc = a.matrix_accesses
        a1, a2 = macc[m1], macc[m2]
        if (a1.is_input and a2.is_input) or (a1.is_output and a2.is_output):
            return 0
        if (a1.is_input or a1.is_output or a2.is_input or a2.is_output) and not (whole1
                                                                                 and whole2):
            return 0
        # a matrix that must be contiguous may only become a whole matrix
        mats = c.matrices
        if not whole1 and mats[m2].stride_type == K_STRIDE_EQUAL_NUM_COLS:
            left = False
        if not whole2 and mats[m1].stride_type == K_STRIDE_EQUAL_NUM_COLS:
            right = False
        if not (left or right):
            return 0
        # when they are used: s2 first (zeroing aside) at ci; for an assignment s2 = s1,
        # s1 not written after ci nor read once s2 changes, otherwise s1 last used at ci
        an = self.analysis
        invalidated = an.first_use_at(s2, ci)
        if invalidated < 0:
            return 0
        cmd = c.commands[ci]
        if cmd.command_type == CT.MATRIX_COPY and cmd.alpha == 1.0:
            last, last_write = an.last_access_and_write(s1)
            if not (last_write < ci and last < invalidated):
                return 0
        elif an.last_access(s1) != ci:
            return 0
        # the kept matrix must exist before the discarded one is first used (Kaldi
        # asserts this; it can fail when one of the merge directions is switched off)
        if left and self._alloc_precedes(m1, m2):
            return s1
        if right and self._alloc_precedes(m2, m1):
            return s2
        return 0

    def _is_dirty(self, s: int) -> bool:
        """A variable of s was touched by a merge in this round."""
        if s in self.moved:
            return True
        m, ro, nr, co, nc = self.c.submatrices[s]
        rects = self.dirty.get(m)
        if rects:
            R1, C1 = ro + nr, co + nc
            for r0, r1, c0, c1 in rects:
                if r0 < R1 and ro < r1 and c0 < C1 and co < c1:
                    return True
        return False

    def _alloc_precedes(self, m_keep: int, m_discard: int) -> bool:
        """The kept matrix is allocated before the discarded one's first access
        other than a zeroing (Kaldi's first_nontrivial_matrix_access)."""
        ma = self.a.matrix_accesses
        cmds = self.c.commands
        if cmds[ma[m_discard].allocate_command].command_type == CT.ACCEPT_INPUT:
            return True   # the input's own matrix is used, allocated by kAcceptInput
        first = len(cmds)
        set_const = CT.SET_CONST
        for ci, _, _ in self.a.entries[m_discard]:
            cmd = cmds[ci]
            if cmd.command_type != set_const or cmd.alpha != 0.0:
                first = ci
                break
        return first > ma[m_keep].allocate_command

    def do_merge(self, ci: int, s_keep: int, s_discard: int) -> None:
        c = self.c
        m_keep, ro, nr, co, nc = c.submatrices[s_keep]
        m_discard = c.submatrices[s_discard].matrix_index
        self.dirty.setdefault(m_keep, []).append((ro, ro + nr, co, co + nc))
        self.moved.update(self.matrix_to_submatrix[m_discard])
        assert m_keep != m_discard and m_keep > 0 and m_discard > 0
        self.groups.setdefault(m_keep, [m_keep]).append(m_discard)
        # every submatrix of the discarded matrix becomes the same region of s_keep
        subs = c.submatrices
        for s in self.matrix_to_submatrix[m_discard]:
            _, a_ro, a_nr, a_co, a_nc = subs[s]
            subs[s] = submatrix_info((m_keep, a_ro + ro, a_nr, a_co + co, a_nc))
        cmd = c.commands[ci]
        if cmd.command_type == CT.MATRIX_COPY and cmd.alpha == 1.0:
            cmd.command_type = CT.NO_OPERATION
            cmd.arg1 = cmd.arg2 = -1
        ma = self.a.matrix_accesses
        # one deallocation goes: the discarded matrix's, or, when it is an output
        # (never deallocated), the kept one's, since the output now owns the memory
        if ma[m_discard].deallocate_command != -1:
            c.commands[ma[m_discard].deallocate_command].command_type = CT.NO_OPERATION
        else:
            assert ma[m_keep].deallocate_command != -1
            c.commands[ma[m_keep].deallocate_command].command_type = CT.NO_OPERATION
        alloc_keep, alloc_discard = ma[m_keep].allocate_command, ma[m_discard].allocate_command
        assert alloc_keep != -1 and alloc_discard != -1
        if c.commands[alloc_discard].command_type == CT.ACCEPT_INPUT:
            # the input's matrix is the one that comes from the user: keep its "allocation"
            c.commands[alloc_keep].command_type = CT.NO_OPERATION
            zero_of = m_keep
        else:
            c.commands[alloc_discard].command_type = CT.NO_OPERATION
            zero_of = m_discard
        ents = self.a.entries[zero_of]
        first = ents[0][0] if ents else -1
        if first >= 0:
            z = c.commands[first]
            if z.command_type == CT.SET_CONST and z.alpha == 0.0:
                z.command_type = CT.NO_OPERATION
        if c.matrices[m_discard].stride_type == K_STRIDE_EQUAL_NUM_COLS:
            c.matrices[m_keep] = c.matrices[m_keep]._replace(stride_type=K_STRIDE_EQUAL_NUM_COLS)


class _SubmatrixOrder:
    """Where each submatrix would stand after the renumberings Kaldi does between
    rounds: each renumbering keeps the submatrices in use, in order, one per
    extent (the first).  ``key[s]`` is the number of the submatrix that stands for
    s's group, so sorting the submatrices in use by key gives Kaldi's final order
    (the groups only ever grow: submatrices of one extent move together)."""

    def __init__(self, computation: NnetComputation, analyzer: Analyzer):
        self.c, self.a = computation, analyzer
        self.key = list(range(len(computation.submatrices)))

    def _in_use(self, matrices) -> set[int]:
        """Submatrices that commands touching ``matrices`` refer to (accesses,
        indexes_multi lists, allocation and deallocation)."""
        cmds, cacc = self.c.commands, self.a.command_accesses
        used: set[int] = set()
        for m in matrices:
            ma = self.a.matrix_accesses[m]
            for ci, _, _ in self.a.entries[m]:
                used.update(map(_FIRST, cacc[ci]))
            for ci in (ma.allocate_command, ma.deallocate_command):
                if ci >= 0:
                    cmd = cmds[ci]
                    used.add(cmd.arg1)
                    if cmd.command_type == CT.SWAP_MATRIX:
                        used.add(cmd.arg2)
        return used

    def renumbered(self, matrices, used: set[int], first: bool) -> None:
        """A renumbering after a round in which ``matrices`` changed (their
        submatrices moved or lost references; ``used``: those of their
        submatrices still referred to).  After the ``first`` round, also the
        submatrices that were equal before it (only they can be grouped on the
        matrices that did not change)."""
        subs, key = self.c.submatrices, self.key
        of = self.a.submatrices_of
        matrices = set(matrices)
        if first:
            # the matrices of submatrices that have an equal one, the changed aside
            others = {info[0] for info, k in Counter(subs[1:]).items() if k > 1} - matrices
            if others:
                used = used | self._in_use(others)
                matrices |= others
        members = [s for m in matrices for s in of[m] if s in used]
        # each member whose extent an earlier member has, with that first one
        # (each extent hashed once); the group's smallest key goes to all of it
        first_of: dict = {}
        setdefault = first_of.setdefault
        dups = [(t, s) for s in members if (t := setdefault(subs[s], s)) != s]
        for t, s in dups:
            if key[s] < key[t]:
                key[t] = key[s]
        for t, s in dups:
            key[s] = key[t]


def merge_candidates(computation: NnetComputation, options, props) -> list[int]:
    """The commands that may merge their source and destination in some round:
    kMatrixCopy (remove_assignments), propagates (propagate_in_place) and
    backprops (backprop_in_place) of components that can work in place, both
    submatrices given.  None of this changes while merging (merges change the
    submatrix table, never a command's arguments), so it is decided once."""
    o = options
    copy = CT.MATRIX_COPY if o.remove_assignments else None
    propagate = CT.PROPAGATE if o.propagate_in_place else None
    backprops = (CT.BACKPROP, CT.BACKPROP_NO_MODEL_UPDATE) if o.backprop_in_place else ()
    kinds = {copy, propagate, *backprops}
    cmds = computation.commands
    out = []
    for ci in [i for i, cmd in enumerate(cmds) if cmd.command_type in kinds]:
        cmd = cmds[ci]
        ct = cmd.command_type
        if ct == copy:
            s1, s2 = cmd.arg2, cmd.arg1
        elif ct == propagate and props[cmd.arg1] & _PROPAGATE_IN_PLACE:
            s1, s2 = cmd.arg3, cmd.arg4
        elif ct in backprops and props[cmd.arg1] & _BACKPROP_IN_PLACE:
            s1, s2 = cmd.arg5, cmd.arg6
        else:
            continue
        if s1 > 0 and s2 > 0:
            out.append(ci)
    return out


def variable_merging_optimization(computation: NnetComputation, ctx) -> bool:
    """Kaldi's VariableMergingOptimization: rounds of merging until one merges nothing.
    When the pass before left a renumbering due (``ctx.renumber_due``: see
    extend_matrices), the final renumbering here does it; the merges decided on the
    computation as it is are the same as on its renumbered form (equal extents are
    compared by extent, and ``_SubmatrixOrder`` groups them as a renumbering would)."""
    due = bool(getattr(ctx, "renumber_due", False))
    if due:
        ctx.renumber_due = False
    merged = _merge_rounds(computation, ctx, due)
    if due and not merged:
        renumber_computation(computation)
    return merged or due


def _zeroing_next(ctx) -> bool:
    """Whether remove_unnecessary_zeroing runs next in the pipeline of ``ctx``."""
    return hasattr(ctx, "zeroings") and removes_unnecessary_zeroing(ctx.options)


def _merge_rounds(computation: NnetComputation, ctx, due: bool) -> bool:
    o = ctx.options
    if not o.allow_left_merge and not o.allow_right_merge:
        return False   # nothing can merge
    props = getattr(ctx, "props", None)   # (an empty one is falsy: test for None)
    if props is None:
        props = ComponentProperties(ctx.nnet)
    if native.NATIVE is not None and _zeroing_next(ctx):
        edits = native_rounds(computation, o, props, due)
        if edits is not None:
            return _apply_native(computation, ctx, edits)
    commands = merge_candidates(computation, o, props)
    if not commands:
        return False
    analyzer = (ctx.analyzer(computation) if hasattr(ctx, "analyzer")
                else Analyzer(ctx.nnet, computation, props))
    candidates = set(commands)
    order = None
    settled: set[int] = set()
    while True:
        checkpoint("a round of variable merging")
        opt = VariableMergingOptimizer(o, computation, analyzer, props,
                                       first_round=order is None, renumbered=not due)
        if not opt.merge_variables(commands):
            break
        settled.update(opt.settled)
        used, touched = analyzer.reanalyze(opt.groups)
        first = order is None
        if first:
            order = _SubmatrixOrder(computation, analyzer)
        order.renumbered(opt.groups, used, first)
        # the candidates that touch a merged matrix (see the module docstring)
        commands = sorted(touched.intersection(candidates).difference(settled))
        if not commands:
            break   # a round with nothing to try merges nothing
    if order is None:
        return False
    if _zeroing_next(ctx):
        # the next pass's decisions, taken on this analysis (see
        # remove_unnecessary_zeroing), which then need not follow the deletion of
        # the no-ops and the renumbering
        cmds = computation.commands
        gone = [cmds[z] for z in unnecessary_zeroings(computation, analyzer)]
        remove_no_ops(computation)
        return _hand_on_zeroings(computation, ctx, order.key, gone)
    # the analysis follows the deletion of the no-ops and the renumbering (the
    # next passes need it): cheaper than analysing the result again.  No-ops
    # refer to nothing, so deleting them first leaves the renumbering as it was
    # and gives it fewer commands to walk.
    remove_no_ops_from(computation, analyzer)
    _, matrix_used, sub_source = renumber_with_maps(computation, submatrix_order=order.key)
    analyzer.renumbered(matrix_used, sub_source)
    if hasattr(ctx, "analysis_updated"):
        ctx.analysis_updated(analyzer, computation)
    return True


def native_rounds(computation: NnetComputation, options, props, due: bool):
    """The rounds of ``_merge_rounds`` and the zeroing decisions after them, in C:
    False when nothing merges (the computation unchanged), None when the Python pass
    must decide (unchanged too), else the merges made -- submatrices moved, commands
    turned into kNoOperation, merged copies' arguments cleared, as the Python rounds
    make them -- and (the commands without the no-ops, the matrices that became of
    stride equal to their columns, the zeroing commands remove_unnecessary_zeroing
    drops, the ``_SubmatrixOrder`` key) for ``_apply_native``."""
    c = computation
    o = options
    return native.NATIVE.merge(c.commands, c.submatrices, c.matrices, props,
                               lambda cmd: _accesses_of(cmd, c, props),
                               (o.remove_assignments, o.propagate_in_place, o.backprop_in_place,
                                o.allow_left_merge, o.allow_right_merge), not due)


def _apply_native(computation: NnetComputation, ctx, edits) -> bool:
    """What ``_merge_rounds`` does after its rounds when remove_unnecessary_zeroing runs
    next, on the result of ``native_rounds``."""
    if edits is False:
        return False
    commands, strides, gone, key = edits
    mats = computation.matrices
    for m in strides:
        mats[m] = mats[m]._replace(stride_type=K_STRIDE_EQUAL_NUM_COLS)
    shorter = len(commands) != len(computation.commands)
    computation.commands = commands   # (remove_no_ops)
    if shorter:
        fix_goto_label(computation)
    return _hand_on_zeroings(computation, ctx, key, gone)


def _hand_on_zeroings(computation: NnetComputation, ctx, key: list[int], gone: list) -> bool:
    """The end of the rounds when remove_unnecessary_zeroing runs next (the no-ops
    deleted): the renumbering in the rounds' submatrix order, and the zeroing commands
    that pass drops, decided here (``gone``), handed on to it."""
    renumber_with_maps(computation, submatrix_order=key)
    ctx.zeroings = (computation, len(computation.commands), gone)
    return True
