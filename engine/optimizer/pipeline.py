"""The optimizer pipeline: Kaldi's Optimize() (nnet-optimize.cc).

``optimize(computation, nnet, options, request)`` returns an optimized copy of
the computation (the argument is left as it was); with ``in_place=True`` it
optimizes and returns the computation itself, for a caller that has no further
use for the unoptimized one (the copy costs 0.05-0.2 ms on a chunk request).
The passes run in Kaldi's order, each gated by its option, each in its own module of
``engine.optimizer.passes`` with one function ``pass_name(computation, ctx) ->
bool`` (True when it changed something) that edits the computation in place.

``PASSES`` is the single list of passes.  A pass whose module (or function) is
not importable -- some are written by other work in progress -- is skipped and
the skip is recorded in the pass table with the reason (and logged), never
silently: ``run_passes`` returns the table.

In check mode (``options.check_after_each_pass``) the ComputationChecker runs on
the input and after every pass that ran; a failure raises ``CheckError`` naming
the pass and the passes that ran before it.
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.compiler.computation import NnetComputation
from engine.compiler.gc_pause import gc_paused
from engine.core.cancel import checkpoint
from engine.core.errors import CheckError
from engine.optimizer.analysis import Analyzer, ComponentProperties
from engine.optimizer.checker import check_computation
from engine.optimizer.options import DEFAULT_OPTIONS, INT32_MAX, INT32_MIN, OptimizeOptions

log = logging.getLogger("engine.optimizer")


class PassContext:
    """What a pass gets besides the computation: the network, the options, the
    request (may be None), the component properties (``props``, asked of each
    component once) and an analysis cache.  ``analyzer(computation)`` is valid
    until the computation changes: a pass that got it and then edits the
    computation calls ``invalidate()``, or, if it brought the analysis up to
    date with its edits, ``analysis_updated()``.  The pipeline invalidates
    after every pass that reports a change and did neither; a pass that reports
    no change has changed nothing, so the next pass can use the same analysis."""

    def __init__(self, nnet, options: OptimizeOptions, request=None):
        self.nnet = nnet
        self.options = options
        self.request = request
        self.props = ComponentProperties(nnet)
        self.changed: dict[str, bool] = {}   # pass name -> changed, for passes run so far
        # a renumbering a pass left to the next one (extend_matrices to variable merging)
        self.renumber_due = False
        # zeroings variable merging found for remove_unnecessary_zeroing (see there)
        self.zeroings = None
        self._analyzer: Analyzer | None = None
        self._analyzed: NnetComputation | None = None
        self._shape: tuple[int, int, int] = (0, 0, 0)
        self._updated = False

    @property
    def max_output_time(self) -> int | None:
        """Largest t over the request's outputs (Kaldi's MaxOutputTimeInRequest)."""
        reqs = self.request if isinstance(self.request, (list, tuple)) else [self.request]
        ts = [t for r in reqs if r is not None if (t := r.max_output_time()) is not None]
        return max(ts, default=None)

    @staticmethod
    def _shape_of(computation: NnetComputation) -> tuple[int, int, int]:
        # the sizes guard against a pass that added unused submatrices (SplitRowOps
        # can) without reporting a change
        return (len(computation.commands), len(computation.submatrices),
                len(computation.matrices))

    def analyzer(self, computation: NnetComputation) -> Analyzer:
        shape = self._shape_of(computation)
        if (self._analyzer is None or self._analyzed is not computation
                or self._shape != shape):
            self._analyzer = Analyzer(self.nnet, computation, self.props)
            self._analyzed = computation
            self._shape = shape
        return self._analyzer

    def analysis_updated(self, analyzer: Analyzer, computation: NnetComputation) -> None:
        """``analyzer`` describes ``computation`` as it is now (a pass edited both)."""
        self._analyzer, self._analyzed = analyzer, computation
        self._shape = self._shape_of(computation)
        self._updated = True

    def invalidate(self) -> None:
        self._analyzer = None
        self._analyzed = None


def _deriv_limits_set(o: OptimizeOptions, ctx: PassContext) -> bool:
    if o.min_deriv_time != INT32_MIN or o.max_deriv_time != INT32_MAX:
        return True
    return o.max_deriv_time_relative != INT32_MAX


ROW_OP_PASSES = ("snip_row_ops", "split_row_ops", "replace_row_with_matrix_ops")


def _extends(o: OptimizeOptions) -> bool:
    return o.optimize and o.extend_matrices and not o.optimize_looped_computation


def merges_variables(o: OptimizeOptions) -> bool:
    """The gate of variable_merging_optimization."""
    return o.optimize and (o.remove_assignments or o.backprop_in_place or o.propagate_in_place)


def removes_unnecessary_zeroing(o: OptimizeOptions) -> bool:
    """The gate of remove_unnecessary_zeroing."""
    return o.optimize and o.initialize_undefined


def allocates_from_other(o: OptimizeOptions) -> bool:
    """The gate of remove_unnecessary_allocation."""
    return o.optimize and o.allocate_from_other and not o.optimize_looped_computation


@dataclass(frozen=True)
class PassSpec:
    name: str                       # the function, Kaldi's name in snake_case
    module: str                     # engine.optimizer.passes.<module>
    gate: Callable[[OptimizeOptions, PassContext], bool]
    check_rewrite: bool = False     # Kaldi checks rewrites only before in-place merging
    function: Callable | None = None  # given directly (tests); else imported by name


PASSES: tuple[PassSpec, ...] = (
    # before everything else: the deriv-time limits must see the unmerged matrices
    PassSpec("limit_derivative_times", "limit_derivative_times", _deriv_limits_set,
             check_rewrite=True),
    PassSpec("consolidate_model_update", "consolidate_model_update",
             lambda o, c: o.optimize and o.consolidate_model_update, check_rewrite=True),
    PassSpec("convert_addition_to_assignment", "convert_addition",
             lambda o, c: o.optimize and o.convert_addition),
    PassSpec("snip_row_ops", "optimize_row_ops", lambda o, c: o.optimize and o.snip_row_ops),
    PassSpec("split_row_ops", "optimize_row_ops", lambda o, c: o.optimize and o.split_row_ops),
    PassSpec("replace_row_with_matrix_ops", "optimize_row_ops",
             lambda o, c: o.optimize and o.optimize_row_ops),
    # the row-op passes leave unused indexes/submatrices behind; when extend_matrices
    # runs next, it renumbers instead (once, after its own changes: see its module)
    PassSpec("renumber_computation", "renumber",
             lambda o, c: any(c.changed.get(n) for n in ROW_OP_PASSES) and not _extends(o)),
    PassSpec("extend_matrices", "extend_matrices", lambda o, c: _extends(o)),
    PassSpec("variable_merging_optimization", "variable_merging",
             lambda o, c: merges_variables(o)),
    PassSpec("remove_unnecessary_zeroing", "initialize_undefined",
             lambda o, c: removes_unnecessary_zeroing(o)),
    PassSpec("move_sizing_commands", "move_sizing_commands",
             lambda o, c: (o.optimize and o.move_sizing_commands)
             or o.optimize_looped_computation),
    # not gated by 'optimize': a looped computation cannot run without it
    PassSpec("optimize_looped_computation", "optimize_looped",
             lambda o, c: o.optimize_looped_computation),
    PassSpec("remove_unnecessary_allocation", "allocate_from_other",
             lambda o, c: allocates_from_other(o)),
    # required for correctness whatever the options: passes may have moved I/O
    PassSpec("consolidate_io_operations", "consolidate_io", lambda o, c: True),
    PassSpec("fix_goto_label", "consolidate_io", lambda o, c: o.optimize_looped_computation),
    PassSpec("optimize_memory_compression", "memory_compression",
             lambda o, c: o.memory_compression_level > 0 and not o.optimize_looped_computation),
)


@dataclass
class PassRecord:
    name: str
    module: str
    status: str            # "ran", "off" (gated out), "missing" (not importable)
    changed: bool = False
    seconds: float = 0.0
    note: str = ""
    stats: dict = field(default_factory=dict)   # computation stats after the pass


def load_pass(spec: PassSpec) -> tuple[Callable | None, str]:
    """(function, "") or (None, reason) when the pass is not available."""
    if spec.function is not None:
        return spec.function, ""
    modname = f"engine.optimizer.passes.{spec.module}"
    mod = sys.modules.get(modname)
    if mod is None:
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name is not None and modname.startswith(e.name):
                return None, f"module {modname} does not exist yet"
            raise
    fn = getattr(mod, spec.name, None)
    if fn is None:
        return None, f"module {modname} has no function {spec.name}"
    return fn, ""


def _check(nnet, computation, where: str, ran: list[str], check_rewrite: bool) -> None:
    try:
        check_computation(nnet, computation, check_rewrite=check_rewrite)
    except CheckError as e:
        before = ", ".join(ran[:-1]) if where != "input" else ""
        raise CheckError(
            f"optimizer pass {where!r} produced an invalid computation "
            f"(passes run before it: {before or 'none'}): {e}") from e


def run_passes(computation: NnetComputation, nnet, options: OptimizeOptions | None = None,
               request=None, passes: tuple[PassSpec, ...] = PASSES, in_place: bool = False
               ) -> tuple[NnetComputation, list[PassRecord]]:
    """Optimize a copy of ``computation`` (with ``in_place``, ``computation``
    itself); returns (optimized, pass table).  The cyclic garbage collector is paused meanwhile (see engine.compiler.gc_pause:
    the analyses allocate millions of small lists, and full collections over
    the computation's objects found nothing and cost ~40% of the time)."""
    table: list[PassRecord] = []
    with gc_paused():
        return _run_passes(computation, nnet, options, request, passes, in_place, table), table


def _run_passes(computation, nnet, options, request, passes, in_place,
                table: list[PassRecord] | None = None) -> NnetComputation:
    """The passes on ``computation`` (or a copy); with ``table``, a PassRecord of each
    is appended to it (optimize() keeps none: a record and two clock readings per
    pass, on every compile, that nobody read)."""
    options = options if options is not None else DEFAULT_OPTIONS
    comp = computation if in_place else computation.copy()
    ctx = PassContext(nnet, options, request)
    ran: list[str] = []
    check = options.check_after_each_pass
    if check:
        _check(nnet, comp, "input", ran, check_rewrite=False)
    t0 = 0.0
    for spec in passes:
        checkpoint("before the optimizer pass", spec.name)
        if not spec.gate(options, ctx):
            if table is not None:
                table.append(PassRecord(spec.name, spec.module, "off"))
            continue
        fn, why = load_pass(spec)
        if fn is None:
            log.info("optimizer: skipping pass %s: %s", spec.name, why)
            if table is not None:
                table.append(PassRecord(spec.name, spec.module, "missing", note=why))
            continue
        if table is not None:
            t0 = time.perf_counter()
        ctx._updated = False
        changed = bool(fn(comp, ctx))
        if changed and not ctx._updated:
            ctx.invalidate()
        ctx.changed[spec.name] = changed
        ran.append(spec.name)
        if table is not None:
            rec = PassRecord(spec.name, spec.module, "ran", changed, time.perf_counter() - t0)
            table.append(rec)
        if check:
            _check(nnet, comp, spec.name, ran, check_rewrite=spec.check_rewrite)
            if table is not None:
                rec.stats = comp.stats()
    if ctx.renumber_due:    # the pass it was left to did not run (a custom pass list)
        from engine.optimizer.passes.renumber import renumber_computation  # noqa: PLC0415
        renumber_computation(comp)
        ctx.renumber_due = False
    return comp


def optimize(computation: NnetComputation, nnet, options: OptimizeOptions | None = None,
             request=None, in_place: bool = False) -> NnetComputation:
    """Kaldi's Optimize(): an optimized copy of ``computation``, or with
    ``in_place`` the computation itself, optimized."""
    with gc_paused():
        return _run_passes(computation, nnet, options, request, PASSES, in_place)


def format_pass_table(table: list[PassRecord]) -> str:
    lines = [f"{'pass':34} {'status':8} {'changed':7} {'ms':>8}  note"]
    for r in table:
        lines.append(f"{r.name:34} {r.status:8} {str(r.changed):7} {r.seconds * 1e3:8.2f}  "
                     f"{r.note}")
    return "\n".join(lines)
