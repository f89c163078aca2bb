"""Final I/O ordering: Kaldi's ConsolidateIoOperations and FixGotoLabel as run at
the end of Optimize().

Passes that move commands may leave kAcceptInput / kProvideOutput away from the
edges of their segment; the executor hands data in and out only at segment
boundaries, so inputs go back to the start of each segment and outputs to its
end (the compiler's own consolidate_io_operations, which also refreshes
``computation.segments``).  Not optional: the computation cannot run otherwise.
"""

from __future__ import annotations

from operator import is_not

from engine.compiler.compiler import consolidate_io_operations as _consolidate
from engine.compiler.computation import NnetComputation
from engine.optimizer.passes.remove_no_ops import fix_goto_label as _fix_goto_label


def consolidate_io_operations(computation: NnetComputation, ctx=None) -> bool:
    before = list(computation.commands)
    _consolidate(computation)
    return any(map(is_not, before, computation.commands))


def fix_goto_label(computation: NnetComputation, ctx=None) -> bool:
    return _fix_goto_label(computation)
