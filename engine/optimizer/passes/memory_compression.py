"""Memory compression: Kaldi's ``OptimizeMemoryCompression`` (class
``MemoryCompressionOptimizer`` in nnet-optimize-utils.cc), the last pass of
``Optimize()``, run when ``memory_compression_level > 0`` and the computation
is not looped.

In training, many matrices are written in the forward pass and read again only
in the backward pass.  Between those two moments they can be held in a
compressed form.  For every matrix that is not an output, whose last forward
access precedes the forward/backward marker and whose first backward access
follows it, a kCompressMatrix goes right after the last forward access and a
kDecompressMatrix right before the first backward access:

- level >= 1: if that backward access is the matrix's last access, only reads
  it, and is the backprop of a RectifiedLinearComponent, only the sign is kept
  (uint8, range 0): the ReLU backprop needs nothing else, so results are exact;
- level >= 2: otherwise int16 in [-10, 10] with truncation, which changes
  results slightly (exact zeros stay zero);
- level 3 adds nothing beyond level 2 (as in Kaldi).

The executor carries these commands out only where compression is in effect
(see engine.runtime.compression; Kaldi compresses only on a GPU).
"""

from __future__ import annotations

import bisect

from engine.compiler.computation import Command, NnetComputation
from engine.optimizer.analysis import CT, Access, Analyzer, accesses_submatrices
from engine.optimizer.passes._edit import commands_of_type, insert_commands

# Kaldi's CuCompressedMatrixType values (the same table is in engine.runtime.compression)
COMPRESSED_UINT8 = 2
COMPRESSED_INT16 = 3


def _plan(nnet, computation: NnetComputation, analyzer: Analyzer, level: int,
          middle: int) -> list[tuple[int, int, int, int, float, bool]]:
    """(matrix, forward command, backward command, type, range, truncate) per matrix
    to compress (Kaldi's ProcessMatrix)."""
    out = []
    for m in range(1, len(computation.matrices)):
        acc = analyzer.matrix_accesses[m]
        if acc.is_output:
            continue
        accesses = acc.accesses
        k = bisect.bisect_left([ci for ci, _ in accesses], middle)
        if k == len(accesses) or k == 0:
            continue   # not accessed in the backward pass, or not in the forward pass
        fwd, _ = accesses[k - 1]
        bwd, bwd_access = accesses[k]
        last = k + 1 == len(accesses)
        bcmd = computation.commands[bwd]
        if (level >= 1 and last and bwd_access == Access.READ
                and bcmd.command_type == CT.BACKPROP
                and nnet.components[bcmd.arg1].type_name == "RectifiedLinearComponent"):
            out.append((m, fwd, bwd, COMPRESSED_UINT8, 0.0, True))
            continue
        if level >= 2:
            out.append((m, fwd, bwd, COMPRESSED_INT16, 10.0, True))
    return out


def _may_compress(nnet, backward: list, level: int) -> bool:
    """False when _plan would find nothing, seen from the commands after the
    marker alone: every matrix compressed is accessed there (its first backward
    access), by a command other than handing out an output (outputs are never
    compressed), and at level 1 that access is a ReLU backprop.  A forward-only
    computation has only deallocations and outputs there."""
    if level == 1:
        return any(c.command_type == CT.BACKPROP
                   and nnet.components[c.arg1].type_name == "RectifiedLinearComponent"
                   for c in backward)
    return any(c.command_type != CT.PROVIDE_OUTPUT and accesses_submatrices(c.command_type)
               for c in backward)


def optimize_memory_compression(computation: NnetComputation, ctx) -> bool:
    """Kaldi's OptimizeMemoryCompression with ``ctx.options.memory_compression_level``."""
    level = ctx.options.memory_compression_level
    cmds = computation.commands
    if level == 0 or not cmds or cmds[-1].command_type == CT.GOTO_LABEL:
        return False
    markers = commands_of_type(computation, CT.NO_OPERATION_MARKER)
    if len(markers) != 1:
        # none: no backward pass; several: not expected outside looped computations
        return False
    if not _may_compress(ctx.nnet, cmds[markers[0] + 1:], level):
        return False
    analyzer = ctx.analyzer(computation) if hasattr(ctx, "analyzer") else Analyzer(ctx.nnet,
                                                                                    computation)
    plan = _plan(ctx.nnet, computation, analyzer, level, markers[0])
    if not plan:
        return False
    whole = computation.whole_submatrices()
    new: list[tuple[int, Command]] = []
    for m, fwd, bwd, ctype, range_, truncate in plan:
        s = whole[m]
        new.append((fwd + 1, Command.make(CT.COMPRESS_MATRIX, s, ctype, int(truncate),
                                          alpha=range_)))
        new.append((bwd, Command.make(CT.DECOMPRESS_MATRIX, s)))
    insert_commands(new, computation)
    return True
