"""Looped computations: Kaldi's ``OptimizeLoopedComputation`` (class
``ComputationLoopedOptimizer`` in nnet-optimize-utils.cc), run when the hidden
option ``optimize_looped_computation`` is set (by looped compilation, for
streaming), after ``move_sizing_commands`` and before the allocation passes.

A looped computation is compiled from several requests for consecutive chunks
of one stream (segments separated by kNoOperationMarker, each starting with its
inputs followed by a kNoOperationPermanent).  After the first chunk or two, one
segment looks like the previous one shifted in time: the same matrices (by
their cindexes, up to a time offset) are alive at the same point.  This pass
finds the first two splice points (the kNoOperationPermanent of each segment)
where the live matrices are the same up to the expected time shift, cuts the
command list after the second one, turns it into ``goto`` to a label put at the
first one, and before the goto swaps each matrix of the later segment into the
place of its counterpart in the earlier one.  Running the result executes the
first segment(s) once and then the repeating segment forever, carrying the
state (e.g. recurrent outputs from the previous chunk) in the swapped matrices.

If no repeat is found the computation is left alone and the pass returns
False; the looped compiler then tries again with more segments.
"""

from __future__ import annotations

from engine.compiler.computation import Command, NnetComputation
from engine.core.errors import CheckError
from engine.core.index import K_NO_TIME
from engine.optimizer.analysis import CT, Analyzer, ComputationAnalysis
from engine.optimizer.passes._edit import commands_of_type
from engine.optimizer.passes.remove_no_ops import fix_goto_label
from engine.optimizer.passes.renumber import renumber_computation

__all__ = ["fix_goto_label", "optimize_looped_computation", "find_time_shift"]


def find_time_shift(computation: NnetComputation) -> int:
    """Kaldi's FindTimeShift: the t offset between the first outputs of segments 2
    and 3 (segment 1 is skipped: it has the extra left context)."""
    ends = commands_of_type(computation, CT.NO_OPERATION_MARKER)
    if len(ends) < 3:
        raise CheckError(f"looped computation: expected at least 3 segments, found "
                         f"{len(ends)} segment markers")
    cmds = computation.commands

    def first_output(begin: int, end: int) -> int:
        for i in range(begin, end):
            if cmds[i].command_type == CT.PROVIDE_OUTPUT:
                return i
        raise CheckError("looped computation: could not locate output commands for "
                         "segments 2 and 3")

    c2, c3 = cmds[first_output(ends[0], ends[1])], cmds[first_output(ends[1], ends[2])]
    if c2.arg2 != c3.arg2:
        raise CheckError("looped computation: segments 2 and 3 start with outputs of different "
                         "nodes")
    m2 = computation.submatrices[c2.arg1].matrix_index
    m3 = computation.submatrices[c3.arg1].matrix_index
    d2 = computation.matrix_debug_info[m2].cindexes
    d3 = computation.matrix_debug_info[m3].cindexes
    if len(d2) != len(d3) or not d2:
        raise CheckError("looped computation: outputs of segments 2 and 3 differ in size")
    shift = d3[0][1][1] - d2[0][1][1]
    if any(b[1][1] != a[1][1] + shift for a, b in zip(d2, d3)):
        raise CheckError("looped computation: outputs of segments 2 and 3 are not shifted "
                         "copies of each other")
    return shift


def _matrix_pairs(computation: NnetComputation) -> list[tuple[int, int]]:
    """Kaldi's CreateMatrixPairs: per matrix, (unique id, time offset) where the id
    names its cindexes with times made relative to the first real t, and whether
    it is a derivative."""
    ids: dict[tuple, int] = {}
    out = [(0, 0)]
    for m in range(1, len(computation.matrices)):
        dbg = computation.matrix_debug_info[m]
        ts = [ci[1][1] for ci in dbg.cindexes if ci[1][1] != K_NO_TIME]
        if not ts:
            raise CheckError(f"looped computation: all t values of m{m} are kNoTime")
        t0 = ts[0]
        key = tuple((ci[0], ci[1][0], ci[1][1] - t0 if ci[1][1] != K_NO_TIME else K_NO_TIME,
                     ci[1][2]) for ci in dbg.cindexes)
        vid = ids.setdefault(key, len(ids) + 1)
        out.append((2 * vid + (1 if dbg.is_deriv else 0), t0))
    return out


def _active_matrices(computation: NnetComputation, analyzer: Analyzer,
                     splice_points: list[int]) -> list[list[int]]:
    """Kaldi's FindActiveMatrices: per splice point, the matrices written before it
    and read after it (first non-zeroing access before, last access after)."""
    analysis = ComputationAnalysis(computation, analyzer)
    whole = computation.whole_submatrices()
    active: list[list[int]] = [[] for _ in splice_points]
    for m in range(1, len(computation.matrices)):
        s = whole[m]
        first, last = analysis.first_nontrivial_access(s), analysis.last_access(s)
        for i, p in enumerate(splice_points):
            if first < p < last:
                active[i].append(m)
    return active


def _first_repeat(pair_lists: list[list[tuple[int, int]]], shift: int) -> tuple[int, int] | None:
    """Kaldi's FindFirstRepeat: the first s < t whose lists agree up to a time shift
    of (t - s) * shift (or no shift) element by element."""
    for s in range(len(pair_lists)):
        for t in range(s + 1, len(pair_lists)):
            a, b = pair_lists[s], pair_lists[t]
            d = (t - s) * shift
            if len(a) == len(b) and all(p[0] == q[0] and q[1] in (p[1], p[1] + d)
                                        for p, q in zip(a, b)):
                return s, t
    return None


def _check_identified(computation: NnetComputation, list1: list[int], list2: list[int],
                      diff: int) -> None:
    """Kaldi's CheckIdentifiedMatrices: each pair has the same shape and cindexes up to
    a shift of ``diff`` in t."""
    if diff <= 0 or len(list1) != len(list2):
        raise CheckError("looped computation: identified matrices do not match")
    for m1, m2 in zip(list1, list2):
        if computation.matrices[m1] != computation.matrices[m2]:
            raise CheckError(f"looped computation: m{m1} and m{m2} differ in shape")
        d1, d2 = computation.matrix_debug_info[m1], computation.matrix_debug_info[m2]
        if d1.is_deriv != d2.is_deriv or len(d1.cindexes) != len(d2.cindexes):
            raise CheckError(f"looped computation: m{m1} and m{m2} differ")
        for a, b in zip(d1.cindexes, d2.cindexes):
            ta, tb = a[1][1], b[1][1]
            if (a[0] != b[0] or a[1][0] != b[1][0] or a[1][2] != b[1][2]
                    or not ((ta == K_NO_TIME and tb == K_NO_TIME) or tb == ta + diff)):
                raise CheckError(f"looped computation: m{m2} is not m{m1} shifted by {diff}")


def _swap_order(list1: list[int], list2: list[int]) -> list[tuple[int, int]]:
    """Kaldi's GetMatrixSwapOrder: order the swaps (list1[i] <- list2[i]) so that a
    matrix is overwritten only after its own content has moved on.  The lists may
    overlap (state carried over two chunks); cycles cannot occur because each
    swap moves data to a strictly earlier time."""
    pos_in_2 = {m: i for i, m in enumerate(list2)}
    done = [False] * len(list1)
    swaps: list[tuple[int, int]] = []
    for _ in range(len(list1) + 1):
        if len(swaps) == len(list1):
            return swaps
        for i, (m1, m2) in enumerate(zip(list1, list2)):
            if done[i]:
                continue
            j = pos_in_2.get(m1)
            if j is None or done[j]:
                swaps.append((m1, m2))
                done[i] = True
    raise CheckError("looped computation: matrix swaps form a cycle")


def _form_infinite_loop(command1: int, command2: int, computation: NnetComputation) -> None:
    """Cut after command2, turn it into a goto to a label inserted at command1."""
    cmds = computation.commands
    if not (command1 < command2 < len(cmds)
            and cmds[command1].command_type == CT.NO_OPERATION_PERMANENT
            and cmds[command2].command_type == CT.NO_OPERATION_PERMANENT):
        raise CheckError("looped computation: splice points are not kNoOperationPermanent")
    del cmds[command2 + 1:]
    cmds[command2] = Command.make(CT.GOTO_LABEL, command1)
    cmds.insert(command1, Command.make(CT.NO_OPERATION_LABEL))


def _add_swap_commands(list1: list[int], list2: list[int],
                       computation: NnetComputation) -> None:
    goto = computation.commands.pop()
    if goto.command_type != CT.GOTO_LABEL:
        raise CheckError("looped computation: the last command is not the goto")
    whole = computation.whole_submatrices()
    for m1, m2 in _swap_order(list1, list2):
        computation.commands.append(Command.make(CT.SWAP_MATRIX, whole[m1], whole[m2]))
    computation.commands.append(goto)


def optimize_looped_computation(computation: NnetComputation, ctx) -> bool:
    """Kaldi's OptimizeLoopedComputation; True if the loop was formed."""
    if len(computation.matrix_debug_info) != len(computation.matrices):
        raise CheckError("looped computations need the matrix debug info (compile with "
                         "output_debug_info)")
    analyzer = ctx.analyzer(computation) if hasattr(ctx, "analyzer") else Analyzer(ctx.nnet,
                                                                                    computation)
    splice_points = commands_of_type(computation, CT.NO_OPERATION_PERMANENT)
    shift = find_time_shift(computation)
    active = _active_matrices(computation, analyzer, splice_points)
    pairs = _matrix_pairs(computation)
    pair_to_matrix = {p: m for m, p in enumerate(pairs) if m > 0}
    pair_lists = [[pairs[m] for m in lst] for lst in active]
    found = _first_repeat(pair_lists, shift)
    if found is None:
        return False
    seg1, seg2 = found
    list1, list2 = [], []
    for p, q in zip(pair_lists[seg1], pair_lists[seg2]):
        if p[1] == q[1]:
            continue   # the same matrix in both places: nothing to carry over
        list1.append(pair_to_matrix[p])
        list2.append(pair_to_matrix[q])
    _check_identified(computation, list1, list2, shift * (seg2 - seg1))
    _form_infinite_loop(splice_points[seg1], splice_points[seg2], computation)
    _add_swap_commands(list1, list2, computation)
    renumber_computation(computation)
    fix_goto_label(computation)
    return True
