"""The executor: Kaldi's ``NnetComputer`` (nnet-compute.h/.cc).

Usage mirrors Kaldi::

    ex = Executor(computation, nnet, backend=numpy)
    ex.accept_input("input", x)          # every kAcceptInput of the forward part
    ex.run()                             # forward, up to the first kProvideOutput
    y = ex.get_output("output")
    ex.accept_output_deriv("output", dy) # kAcceptInput of the backward part
    ex.run()                             # backward
    dx = ex.get_input_deriv("input")
    grad = ex.get_model_gradient()       # an Nnet holding the parameter gradients

As in Kaldi, a program counter walks the command list; ``run`` stops at the
next input/output command, and the I/O calls consume those commands
(``GetIoMatrixIndex``).  Model gradients go to a copy of the network whose
updatable components were ``copy()``'d and ``set_as_gradient()`` (Kaldi's
``SetNnetAsGradient``); the backprop of such a component receives that copy as
``to_update``.  Memos returned by ``propagate`` are kept under the memo index
of the command until the backprop that names the same index takes them.

Every failure raises ``ExecutionError`` naming the command index and its
printed form ("while executing c17: ...").
"""

from __future__ import annotations

import weakref
from itertools import islice
from threading import get_ident

import numpy as np

from engine.compiler.computation import CommandType as CT
from engine.compiler.computation import NnetComputation
from engine.core.errors import ExecutionError, NnetcError, ResourceLimitError
from engine.nnet.components.base import ComponentProperty as P
from engine.runtime import cuda_graph
from engine.runtime import kernels as K
from engine.runtime.arena import IDLE_ARENAS, arena_shape
from engine.runtime.backend import BufferPool, backend_name, device_component, to_host
from engine.runtime.program import build_program, command_matrices

# Per-computation, per-backend index plans (built once, reused by every run).
_PLAN_CACHE: "weakref.WeakKeyDictionary[NnetComputation, dict]" = weakref.WeakKeyDictionary()

_IO = (CT.ACCEPT_INPUT, CT.PROVIDE_OUTPUT)
# the bindings of dynamic programs kept per executor for threads other than the current
# one (Executor._switch_thread)
_THREADS_KEPT = 4


def _signature(computation: NnetComputation) -> tuple:
    """What must be unchanged for cached plans and programs to stay valid: the
    command objects (by identity), the matrix and submatrix shapes (immutable
    tuples, compared by value: extend_matrices grows a matrix in place) and the
    sizes of the index tables.  Optimizer passes that rewrite a computation in
    place replace, insert or drop commands and table entries, which this
    catches; a pass that edited a command's fields in place and changed nothing
    else would not be -- call ``forget_computation`` then."""
    c = computation
    return (tuple(c.commands), tuple(c.submatrices), tuple(c.matrices), len(c.indexes),
            len(c.indexes_multi), len(c.indexes_ranges), len(c.component_precomputed_indexes))


def _plans_for(computation: NnetComputation, xp) -> dict:
    sig = _signature(computation)
    per = _PLAN_CACHE.get(computation)
    if per is None or per.get("__signature__") != sig:
        per = {"__signature__": sig}
        _PLAN_CACHE[computation] = per
    return per.setdefault(backend_name(xp), {})


def check_peak_bytes(computation: NnetComputation, max_peak_bytes: int) -> None:
    """ResourceLimitError when ``computation`` needs more than ``max_peak_bytes`` bytes
    of matrices at its peak."""
    peak = peak_bytes_of(computation)
    if peak > max_peak_bytes:
        raise ResourceLimitError(
            f"the computation needs {peak} bytes of matrices at its peak, more than the "
            f"limit of {max_peak_bytes} bytes")


def peak_bytes_of(computation: NnetComputation) -> int:
    """``computation.peak_bytes()``, computed once per computation (and again after
    it changes, as the cached plans are)."""
    _plans_for(computation, np)           # (re)validates the cache entry
    per = _PLAN_CACHE[computation]
    peak = per.get("__peak__")
    if peak is None:
        peak = per["__peak__"] = computation.peak_bytes()
    return peak


def forget_computation(computation: NnetComputation) -> None:
    """Drop the index plans and compiled program cached for ``computation`` (after
    modifying it in place in a way the signature check cannot see)."""
    _PLAN_CACHE.pop(computation, None)


def _component_to_backend(comp, xp):
    """A copy of ``comp`` on ``xp`` that this executor may write (gradients, stats)."""
    return comp if xp is np else comp.to_backend(xp)


class Executor:
    # kCompressMatrix / kDecompressMatrix: no-ops as in Kaldi's CPU build
    # (CompressingExecutor carries them out)
    _real_compression = False
    # run straight-line computations on an arena (arena.py); False keeps the
    # dynamic closures for every computation (tests compare the two)
    _use_arena = True

    def __init__(self, computation: NnetComputation, nnet, backend=np,
                 pool: BufferPool | None = None, nnet_to_store_stats=None,
                 max_peak_bytes: int | None = None, pool_owner=None):
        """``max_peak_bytes``: refuse (ResourceLimitError, before anything is
        allocated) a computation whose matrices need more bytes at their peak.
        ``pool_owner``: the name this executor takes and gives back the pool's
        buffers under (``BufferPool.new_owner``; None: unnamed)."""
        if max_peak_bytes is not None:
            check_peak_bytes(computation, max_peak_bytes)
        self.computation = computation
        self.nnet = nnet
        self.xp = backend
        self._own_pool = pool is None     # arenas then come from arena.IDLE_ARENAS
        self.pool = pool if pool is not None else BufferPool()
        self.pool_owner = pool_owner
        self.nnet_to_store_stats = nnet_to_store_stats
        self._plans = _plans_for(computation, backend)
        # (device_component(c, np) is c: a copy of the list is all a NumPy run needs)
        self._components = (list(nnet.components) if backend is np else
                            [device_component(c, backend) for c in nnet.components])
        # the precomputed indexes as the components take them (on a GPU, device copies;
        # CUDA graphs rely on their addresses staying fixed), made once per computation
        # and backend (never written)
        pre = self._plans.get("precomputed")
        if pre is None:
            pre = self._plans["precomputed"] = [None] + [
                info.data if backend is np or info.data is None
                else info.data.to_backend(backend)
                for info in computation.component_precomputed_indexes[1:]]
        self._precomputed = pre
        self._matrices: list = [None] * len(computation.matrices)
        self._memos: dict[int, object] = {}
        self._pc = 0
        self._pending: list[int] = []
        self._grad_nnet = None
        self._grad_components: dict[int, object] = {}
        self._stats_components: dict[int, object] = {}
        self._handed_out: set[int] = set()   # matrices given to the caller
        self._compressed: dict[int, object] = {}   # CompressingExecutor's matrices
        # the static plan (program.py, arena.py): decided when the first command
        # or input comes; _bound is the program bound to this run's arena
        self._mode: str | None = None       # None (undecided), "static", "dynamic"
        self._graphs = False                # static segments replayed as CUDA graphs
        self._program = None
        self._bound = None
        # dynamic programs: per command, its bound fast propagates on the matrices
        # it last ran on (program._bound_for), and the thread they were bound on:
        # their temporaries are that thread's (Program.dyn_scratch), so a run on
        # another thread uses bindings of its own, never the first thread's (whose
        # other executors use those temporaries meanwhile).  The bindings of the
        # last few other threads are kept for when the executor comes back to them
        # (a stream pushed from a pool of threads).
        self._dyn_bound: dict = {}
        self._dyn_thread = 0
        self._dyn_other: dict = {}      # thread -> its bindings, the latest last
        if computation.need_model_derivative:
            self._make_gradient_nnet()

    # -- model gradient ------------------------------------------------------------------
    def _make_gradient_nnet(self) -> None:
        grad = self.nnet.copy()
        for i, comp in enumerate(grad.components):
            if comp.properties() & P.UPDATABLE_COMPONENT:
                g = comp.copy()
                g.set_as_gradient()
                grad.components[i] = g
                self._grad_components[i] = _component_to_backend(g, self.xp)
            else:
                # as Kaldi's NnetComputer, non-updatable components get their copy in
                # the gradient network as ``to_update``, to store backprop statistics
                # (e.g. the nonlinearities' derivative averages) there.
                self._stats_components[i] = _component_to_backend(comp, self.xp)
        self._grad_nnet = grad

    def component_stats(self) -> dict[str, dict]:
        """The statistics the computation stored so far in ``nnet_to_store_stats`` (empty
        without one): for each component that stores them here -- one whose propagate
        stores statistics (a request with store_component_stats), or a non-updatable one
        whose backprop does (a nonlinearity's output-derivative sums, gradient clipping
        counts) -- its ``Component.stats()``, by component name.  Updatable components'
        backprop statistics go to the gradient network, as in Kaldi."""
        target = self.nnet_to_store_stats
        if target is None:
            return {}
        wanted: set[int] = set()
        for c in self.computation.commands:
            if c.command_type == CT.PROPAGATE and c.arg6:
                wanted.add(c.arg1)
            elif (c.command_type == CT.BACKPROP
                  and not self._components[c.arg1].properties() & P.UPDATABLE_COMPONENT
                  and target.components[c.arg1].STAT_FIELDS):
                wanted.add(c.arg1)
        return {target.component_names[i]: target.components[i].stats()
                for i in sorted(wanted)}

    def get_model_gradient(self):
        """The gradient network (Kaldi's SetNnetAsGradient convention); None when the
        computation does not compute model derivatives."""
        if self._grad_nnet is None:
            return None
        if self.xp is not np:
            for i, g in list(self._grad_components.items()) + list(self._stats_components.items()):
                host = self._grad_nnet.components[i]
                for p in host.PARAMS + host.ARRAYS:
                    v = getattr(g, p, None)
                    if v is not None:
                        setattr(host, p, to_host(v))
        return self._grad_nnet

    # -- I/O -------------------------------------------------------------------------------
    def _node_index(self, name: str) -> int:
        idx = self.nnet.get_node_index(name)
        if idx < 0:
            raise ExecutionError(f"no node named {name!r} in the network")
        return idx

    def _io_matrix_index(self, name: str, is_output: bool, consume: bool = True) -> int:
        return self._io_command(name, is_output, consume)[1]

    def _io_command(self, name: str, is_output: bool, consume: bool = True) -> tuple[int, int]:
        """(command index, matrix index) of the pending input/output command for
        ``name`` (Kaldi's GetIoMatrixIndex)."""
        node = self._node_index(name)
        cmds = self.computation.commands
        while self._pc < len(cmds) and (cmds[self._pc].command_type in _IO
                                        or cmds[self._pc].command_type == CT.NO_OPERATION_MARKER):
            if cmds[self._pc].command_type != CT.NO_OPERATION_MARKER:
                self._pending.append(self._pc)
            self._pc += 1
        for k, ci in enumerate(self._pending):
            c = cmds[ci]
            if (c.command_type == CT.PROVIDE_OUTPUT) == is_output and c.arg2 == node:
                if not is_output and consume:
                    del self._pending[k]
                if not self.computation.is_whole_matrix(c.arg1):
                    raise ExecutionError(f"c{ci}: input/output is not a whole matrix")
                return ci, self.computation.submatrices[c.arg1].matrix_index
        what = "provide output" if is_output else "accept input"
        raise ExecutionError(f"cannot {what} for node {name!r}: it is not expected at this "
                             f"point in the computation (command c{self._pc})")

    def accept_input(self, name: str, matrix) -> None:
        """Kaldi's AcceptInput: features for an input node, or the derivative
        w.r.t. an output node in the backward part."""
        m = self._io_matrix_index(name, is_output=False, consume=False)
        info = self.computation.matrices[m]
        arr = self.xp.asarray(matrix)
        if arr.ndim != 2 or arr.shape != (info.num_rows, info.num_cols):
            raise ExecutionError(f"input {name!r}: expected a matrix of shape "
                                 f"({info.num_rows}, {info.num_cols}) as in the request, "
                                 f"got {tuple(arr.shape)}")
        ci, _ = self._io_command(name, is_output=False)  # now consume the pending command
        self._decide_mode()
        if self._bound is not None:
            inst = self._program.layout.accept_inst[ci]
            view = self._bound.inst_views[inst]
            if view is not None:      # the input lives in the arena
                view[...] = arr
                # (the matrix list holds arena views only where some closure reads
                # them; those are deallocated by the commands, never left behind)
                if m in self._bound.needed:
                    self._matrices[m] = view
                return
        buf = self.pool.get(self.xp, info.num_rows, info.num_cols, self.pool_owner)
        buf[...] = arr  # a private copy: the pool may recycle it after a dealloc
        self._matrices[m] = buf

    accept_output_deriv = accept_input

    def get_output(self, name: str):
        """Kaldi's GetOutput: a network output, or an input derivative in the
        backward part.  The array stays owned by the caller (never pooled)."""
        m = self._io_matrix_index(name, is_output=True)
        a = self._matrices[m]
        if a is None:
            raise ExecutionError(f"output {name!r} (matrix m{m}) has not been computed")
        if self._bound is not None and id(a) in self._bound.inst_ids:
            # an output in the arena (CUDA graphs): the caller gets a copy, which the
            # list keeps in the view's place, so that giving the arena back cannot take
            # it (and asking again gives the same array, as for any other output)
            a = self._matrices[m] = a.copy()
        self._handed_out.add(id(a))
        self._maybe_finish()
        return a

    get_input_deriv = get_output

    def release(self) -> None:
        """Give every matrix still held (except those handed to the caller) back to
        the pool; call when done with a computation that is not run to its end
        (e.g. forward only), so the next run can reuse the memory."""
        arena = self._bound.inst_ids if self._bound is not None else ()
        for m, a in enumerate(self._matrices):
            if a is not None and id(a) not in self._handed_out and id(a) not in arena:
                self.pool.release(self.xp, a, self.pool_owner)
            self._matrices[m] = None
        self._memos.clear()
        self._dyn_bound.clear()
        self._dyn_other.clear()
        self._release_arena()

    # -- carried state (looped computations between chunks) ----------------------------------
    @property
    def position(self) -> tuple[int, tuple[int, ...]]:
        """Where the run stands: the program counter and the pending input/output
        commands (between two chunks of a looped computation: the same pair for
        every chunk of the steady state)."""
        return self._pc, tuple(self._pending)

    @property
    def matrices(self) -> list:
        """The executor's matrices by index (None where not allocated): the live
        arrays, which the next commands read and write, not copies."""
        return self._matrices

    @property
    def holds_memos(self) -> bool:
        """Whether propagate memos (kept for a backprop) are held: such a state
        cannot be exported or moved to another executor."""
        return bool(self._memos)

    def restore_state(self, position: tuple, matrices: list) -> None:
        """Continue from ``position`` (as ``position`` gives it) with ``matrices``
        (one per matrix of the computation, None where not allocated, arrays of the
        executor's backend that it may keep): how a stream's state moves between
        executors (engine.inference.stream export/import, engine.inference.batch).
        Only for computations run command by command (looped ones)."""
        pc, pending = int(position[0]), [int(p) for p in position[1]]
        n = len(self.computation.commands)
        if not 0 <= pc <= n or any(not 0 <= p < n for p in pending):
            raise ExecutionError(f"restore_state: program counter {pc} or pending commands "
                                 f"{pending} out of range (the computation has {n} commands)")
        if len(matrices) != len(self.computation.matrices):
            raise ExecutionError(f"restore_state: {len(matrices)} matrices given, the "
                                 f"computation has {len(self.computation.matrices)}")
        if self._bound is not None:
            raise ExecutionError("restore_state: this executor runs an arena-bound program")
        self._pc, self._pending, self._matrices = pc, pending, matrices

    # -- the static plan ---------------------------------------------------------------------
    def _get_program(self):
        program = self._program
        if program is None:
            self._graphs = (not self._real_compression and self._use_arena
                            and cuda_graph.usable(self, self._plans))
            key = ("program/compress" if self._real_compression
                   else "program/graph" if self._graphs else "program")
            program = self._plans.get(key)
            if program is None:
                program = self._plans[key] = build_program(
                    self.computation, self.xp, self._plan, self._components,
                    compress=self._real_compression, outputs_in_arena=self._graphs)
            self._program = program
        return program

    def _decide_mode(self) -> None:
        """Before the first command runs: use the arena-bound program when the
        computation has a static layout (see arena.py)."""
        if self._mode is not None:
            return
        if type(self)._execute is not Executor._execute:
            self._mode = "dynamic"    # a subclass handles some commands itself
            return
        program = self._get_program()
        if (not self._use_arena or program.layout is None
                or self._matrices.count(None) != len(self._matrices)):
            self._mode = "dynamic"
            return
        self._mode = "static"
        shape = arena_shape(program.layout)
        if self._own_pool:
            bound = IDLE_ARENAS.take(program)
            if bound is None:
                bound = program.bind(self.xp.empty(shape, dtype=np.float32))
        else:
            bound = program.bound_for(self.pool.get(self.xp, *shape, self.pool_owner))
        self._bound = bound

    def _release_arena(self) -> None:
        bound, self._bound = self._bound, None
        if bound is None:
            return
        # no view of the arena may stay in the matrix list once it is given back
        # (release() would otherwise hand it to the pool as a matrix of its own)
        ids = bound.inst_ids
        mats = self._matrices
        for m in bound.needed:
            if mats[m] is not None and id(mats[m]) in ids:
                mats[m] = None
        if self._own_pool:
            IDLE_ARENAS.give(self._program, bound)
        else:
            self.pool.release(self.xp, bound.buf, self.pool_owner)

    def _maybe_finish(self) -> None:
        """At the end of the commands, give the arena back: when the layout says
        nothing in it is alive any more but outputs, and every output still pending is
        out of it (an output in the arena is copied out when asked for; with several
        outputs at the end, those not yet asked for keep the arena)."""
        bound = self._bound
        if (bound is None or self._pc < len(self.computation.commands)
                or not self._program.layout.all_freed_at_end):
            return
        cmds, subs, ids = self.computation.commands, self.computation.submatrices, bound.inst_ids
        for ci in self._pending:
            c = cmds[ci]
            if c.command_type == CT.PROVIDE_OUTPUT:
                a = self._matrices[subs[c.arg1].matrix_index]
                if a is not None and id(a) in ids:
                    return
        self._release_arena()

    # -- running ---------------------------------------------------------------------------
    def _check_no_pending_io(self) -> None:
        cmds = self.computation.commands
        while self._pc < len(cmds) and cmds[self._pc].command_type in _IO:
            self._pending.append(self._pc)
            self._pc += 1
        for ci in self._pending:
            c = cmds[ci]
            if c.command_type == CT.ACCEPT_INPUT:
                raise ExecutionError(f"cannot run the computation: no input was given for node "
                                     f"{self.nnet.get_node_name(c.arg2)!r} (c{ci})")
        self._pending.clear()

    def run(self) -> None:
        """Execute commands up to the next input/output command (Kaldi's Run)."""
        cmds = self.computation.commands
        n = len(cmds)
        if self._pc >= n:
            raise ExecutionError(f"running a computation that has finished (program counter "
                                 f"{self._pc} of {n} commands)")
        self._check_no_pending_io()
        self._decide_mode()
        if self.xp is not np:
            cuda_graph.hold_thread_state()   # this thread's end must not fall in a capture
        if type(self)._execute is not Executor._execute:
            self._run_interpreted(cmds, n)   # a subclass handles some commands itself
            return
        program = self._get_program()
        tid = get_ident()
        if tid != self._dyn_thread:
            # (the dynamic closures: every command of a dynamic program, and those of a
            # bound program that touch matrices outside its arena)
            self._switch_thread(tid)
        mats = self._matrices
        pc = self._pc
        # the command running, set by the stretches below: on an error, where the run
        # stopped (for the error report and the program counter)
        at = [pc]
        try:
            if self._bound is not None:
                # straight-line commands: no goto, no program-counter checks, only
                # the commands that do something (arena.BoundProgram.runs)
                bound = self._bound
                stop = program.stops[pc]
                if self._graphs and cuda_graph.run_segment(self, bound, pc, stop, mats):
                    stretch = None
                    pc = stop
                else:
                    runs = islice(bound.runs[stop], bound.run_start[pc], None)

                    def stretch():
                        for at[0], op in runs:
                            op(self, mats)
                        return stop
            else:
                # every command of a dynamic program, gotos included (a looped
                # computation's chunk is such a stretch, run again and again from the
                # same command)
                ops = program.ops

                def stretch():
                    p = pc
                    while p < n:
                        at[0] = p
                        op = ops[p]
                        if op is None:      # an input/output command: stop, as Kaldi's Run
                            break
                        target = op(self, mats)
                        if target is not None:
                            p = target
                        p += 1
                    return p
            if stretch is not None:
                # on one BLAS thread where that is faster (parallel.ThreadChoice)
                pc = program.thread_choice(pc).run(stretch) if self.xp is np else stretch()
        except ExecutionError as e:
            self._pc = pc = at[0]
            if str(e).startswith("while executing"):
                raise
            raise self._error(e) from e
        except (NnetcError, ValueError, IndexError, KeyError, TypeError, ArithmeticError,
                AttributeError, MemoryError, RuntimeError) as e:
            self._pc = pc = at[0]
            if isinstance(e, MemoryError):
                # (the arena or a matrix could not be allocated: not a missing matrix)
                raise self._error(ExecutionError(
                    f"out of memory ({e}); the computation's matrices need "
                    f"{peak_bytes_of(self.computation)} bytes at their peak")) from e
            for m in command_matrices(self.computation, cmds[pc]):
                if mats[m] is None:
                    raise self._error(ExecutionError(
                        f"matrix m{m} is used before it is allocated")) from e
            raise self._error(e) from e
        self._pc = pc
        self._maybe_finish()

    def _switch_thread(self, tid: int) -> None:
        """Make the bindings of thread ``tid`` the current ones (see __init__)."""
        other = self._dyn_other
        if self._dyn_bound:
            other[self._dyn_thread] = self._dyn_bound
            if len(other) > _THREADS_KEPT:
                del other[next(iter(other))]
        self._dyn_bound = other.pop(tid, None) or {}
        self._dyn_thread = tid

    def _run_interpreted(self, cmds, n) -> None:
        while self._pc < n:
            c = cmds[self._pc]
            if c.command_type in _IO:
                break
            try:
                self._execute(c)
            except ExecutionError as e:
                if str(e).startswith("while executing"):
                    raise
                raise self._error(e) from e
            except (NnetcError, ValueError, IndexError, KeyError, TypeError, ArithmeticError,
                    AttributeError, MemoryError, RuntimeError) as e:
                raise self._error(e) from e
            self._pc += 1

    def _error(self, e: Exception) -> ExecutionError:
        try:
            text = self.computation.command_string(self._pc, self.nnet).rstrip("\n")
        except Exception:  # noqa: BLE001 (never mask the real error while describing it)
            text = f"c{self._pc}: {self.computation.commands[self._pc].command_type.name}"
        err = ExecutionError(f"while executing {text}: {type(e).__name__}: {e}")
        err.command_index = self._pc
        return err

    def _sub(self, s: int):
        if s == 0:
            # Kaldi's empty submatrix: e.g. the input of a component whose input
            # step is empty (a ConstantFunctionComponent that needs no input).
            return self.xp.zeros((0, 0), dtype=np.float32)
        sm = self.computation.submatrices[s]
        a = self._matrices[sm.matrix_index]
        if a is None:
            raise ExecutionError(f"matrix m{sm.matrix_index} is used before it is allocated")
        if (sm.row_offset == 0 and sm.col_offset == 0 and sm.num_rows == a.shape[0]
                and sm.num_cols == a.shape[1]):
            return a
        return a[sm.row_offset:sm.row_offset + sm.num_rows,
                 sm.col_offset:sm.col_offset + sm.num_cols]

    def _sub_or_none(self, s: int):
        return None if s <= 0 else self._sub(s)

    def _plan(self, kind: str, i: int):
        key = (kind, i)
        p = self._plans.get(key)
        if p is None:
            c = self.computation
            if kind == "rows":
                p = K.make_row_plan(self.xp, c.indexes[i])
            elif kind == "multi":
                p = K.make_multi_plan(self.xp, c.indexes_multi[i])
            else:
                p = K.make_range_plan(self.xp, c.indexes_ranges[i])
            self._plans[key] = p
        return p

    def _execute(self, c) -> None:
        _HANDLERS[c.command_type](self, c)

    # -- handlers, one per command type -------------------------------------------------------
    def _alloc(self, c):
        m = self.computation.submatrices[c.arg1].matrix_index
        info = self.computation.matrices[m]
        if self._matrices[m] is not None:
            self.pool.release(self.xp, self._matrices[m], self.pool_owner)
        self._matrices[m] = self.pool.get(self.xp, info.num_rows, info.num_cols, self.pool_owner)

    def _dealloc(self, c):
        m = self.computation.submatrices[c.arg1].matrix_index
        if self._matrices[m] is not None:
            self.pool.release(self.xp, self._matrices[m], self.pool_owner)
        self._matrices[m] = None

    def _swap(self, c):
        m1 = self.computation.submatrices[c.arg1].matrix_index
        m2 = self.computation.submatrices[c.arg2].matrix_index
        self._matrices[m1], self._matrices[m2] = self._matrices[m2], self._matrices[m1]

    def _set_const(self, c):
        self._sub(c.arg1)[...] = c.alpha

    def _propagate(self, c):
        comp = self._components[c.arg1]
        out = self._sub(c.arg4)
        memo = comp.propagate(self._precomputed[c.arg2], self._sub(c.arg3), out)
        if c.arg6:
            # Kaldi stores stats in the network it was given to update (here the
            # gradient network) unless a separate stats network is named.
            target = self.nnet_to_store_stats
            if target is not None:
                stats_comp = target.components[c.arg1]
            else:
                stats_comp = (self._stats_components.get(c.arg1)
                              or self._grad_components.get(c.arg1))
            if stats_comp is not None:
                in_value = None if c.arg3 == c.arg4 else self._sub(c.arg3)
                stats_comp.store_stats(in_value, out, memo)
        if c.arg5 > 0:
            self._memos[c.arg5] = memo

    def _backprop(self, c):
        to_update, memo = self._backprop_state(c.arg1, c.command_type == CT.BACKPROP, c.arg7)
        self._components[c.arg1].backprop(
            self.computation_name(c.arg1), self._precomputed[c.arg2],
            self._sub_or_none(c.arg3), self._sub_or_none(c.arg4), self._sub(c.arg5),
            memo, to_update, self._sub_or_none(c.arg6))

    def _backprop_state(self, ci: int, updates: bool, memo_index: int):
        """(to_update, memo) of a backprop of component ``ci``: the component of the
        gradient network (or the one collecting statistics) when the command is a
        kBackprop (``updates``), and the memo its propagate left (taken out)."""
        to_update = None
        if updates:
            if self._components[ci].properties() & P.UPDATABLE_COMPONENT:
                if self.computation.need_model_derivative:
                    to_update = self._grad_components.get(ci)
            elif self.nnet_to_store_stats is not None:
                # as Kaldi's NnetComputer: a non-updatable component's backprop stores
                # its statistics (output-derivative sums, clipping counts) where the
                # forward statistics go
                to_update = self.nnet_to_store_stats.components[ci]
            else:
                to_update = self._stats_components.get(ci)
        memo = None
        if memo_index > 0:
            if memo_index not in self._memos:
                raise ExecutionError(f"memo {memo_index} was requested but never generated")
            memo = self._memos.pop(memo_index)
        return to_update, memo

    def computation_name(self, component_index: int) -> str:
        return self.nnet.component_names[component_index]

    def _matrix_copy(self, c):
        dest, src = self._sub(c.arg1), self._sub(c.arg2)
        if dest.shape != src.shape:
            raise ValueError(f"shape mismatch {dest.shape} vs {src.shape}")
        if c.alpha == 1.0:
            if dest is not src:
                dest[...] = src
        else:
            dest[...] = c.alpha * src

    def _matrix_add(self, c):
        dest, src = self._sub(c.arg1), self._sub(c.arg2)
        if dest.shape != src.shape:
            raise ValueError(f"shape mismatch {dest.shape} vs {src.shape}")
        if c.alpha == 1.0:
            dest += src
        else:
            dest += c.alpha * src

    def _copy_rows(self, c):
        K.copy_rows(self.xp, self._sub(c.arg1), self._sub(c.arg2), self._plan("rows", c.arg3),
                    c.alpha)

    def _add_rows(self, c):
        K.add_rows(self.xp, self._sub(c.arg1), self._sub(c.arg2), self._plan("rows", c.arg3),
                   c.alpha)

    def _rows_multi(self, c):
        K.rows_multi(self.xp, self._sub(c.arg1), self._plan("multi", c.arg2), self._sub, c.alpha,
                     add=c.command_type == CT.ADD_ROWS_MULTI)

    def _to_rows_multi(self, c):
        if c.command_type == CT.COPY_TO_ROWS_MULTI and c.alpha != 1.0:
            raise ValueError("CopyToRowsMulti does not support alpha != 1 (as in Kaldi)")
        K.to_rows_multi(self.xp, self._sub(c.arg1), self._plan("multi", c.arg2), self._sub,
                        c.alpha, add=c.command_type == CT.ADD_TO_ROWS_MULTI)

    def _add_row_ranges(self, c):
        K.add_row_ranges(self.xp, self._sub(c.arg1), self._sub(c.arg2),
                         self._plan("ranges", c.arg3), c.alpha)

    def _compress(self, c):
        if self._real_compression:
            m = self.computation.submatrices[c.arg1].matrix_index
            if c.command_type == CT.COMPRESS_MATRIX:
                self._compress_matrix(m, c)
            else:
                self._decompress_matrix(m)
            return
        # Kaldi compresses only on a GPU; its CPU build (which produced the reference
        # numbers) leaves the matrix as it is, and so do we, on every backend.
        self._sub(c.arg1)

    def _compress_matrix(self, m: int, c) -> None:
        raise ExecutionError("this executor does not compress matrices")

    def _decompress_matrix(self, m: int) -> None:
        raise ExecutionError("this executor does not compress matrices")

    def _noop(self, c):
        pass

    def _goto(self, c):
        target = c.arg1
        cmds = self.computation.commands
        if not (0 <= target < len(cmds)) or cmds[target].command_type != CT.NO_OPERATION_LABEL:
            raise ValueError(f"goto target c{target} is not a label")
        self._pc = target  # run() then steps past the label

    def _io_in_body(self, c):
        raise ValueError("input/output command reached inside run()")


_HANDLERS = {
    CT.ALLOC_MATRIX: Executor._alloc,
    CT.DEALLOC_MATRIX: Executor._dealloc,
    CT.SWAP_MATRIX: Executor._swap,
    CT.SET_CONST: Executor._set_const,
    CT.PROPAGATE: Executor._propagate,
    CT.BACKPROP: Executor._backprop,
    CT.BACKPROP_NO_MODEL_UPDATE: Executor._backprop,
    CT.MATRIX_COPY: Executor._matrix_copy,
    CT.MATRIX_ADD: Executor._matrix_add,
    CT.COPY_ROWS: Executor._copy_rows,
    CT.ADD_ROWS: Executor._add_rows,
    CT.COPY_ROWS_MULTI: Executor._rows_multi,
    CT.ADD_ROWS_MULTI: Executor._rows_multi,
    CT.COPY_TO_ROWS_MULTI: Executor._to_rows_multi,
    CT.ADD_TO_ROWS_MULTI: Executor._to_rows_multi,
    CT.ADD_ROW_RANGES: Executor._add_row_ranges,
    CT.COMPRESS_MATRIX: Executor._compress,
    CT.DECOMPRESS_MATRIX: Executor._compress,
    CT.ACCEPT_INPUT: Executor._io_in_body,
    CT.PROVIDE_OUTPUT: Executor._io_in_body,
    CT.NO_OPERATION: Executor._noop,
    CT.NO_OPERATION_PERMANENT: Executor._noop,
    CT.NO_OPERATION_MARKER: Executor._noop,
    CT.NO_OPERATION_LABEL: Executor._noop,
    CT.GOTO_LABEL: Executor._goto,
}

EXECUTOR_HANDLERS = _HANDLERS


def run_computation(computation: NnetComputation, nnet, inputs: dict, output_derivs: dict | None
                    = None, backend=np, pool: BufferPool | None = None):
    """Convenience: run forward (and backward when ``output_derivs`` is given) on a
    single-segment computation.  Returns (outputs, input_derivs, executor); the
    input and output names come from the computation's own I/O commands."""
    ex = Executor(computation, nnet, backend=backend, pool=pool)
    names_in, names_out, deriv_in, deriv_out = io_names(computation, nnet)
    for name in names_in:
        if name not in inputs:
            raise ExecutionError(f"no input given for node {name!r}")
        ex.accept_input(name, inputs[name])
    ex.run()
    outputs = {name: ex.get_output(name) for name in names_out}
    input_derivs = {}
    if deriv_out and output_derivs is not None:  # None: forward only
        for name in deriv_out:
            if name not in output_derivs:
                raise ExecutionError(f"no output derivative given for node {name!r}")
            ex.accept_output_deriv(name, output_derivs[name])
        ex.run()
        input_derivs = {name: ex.get_input_deriv(name) for name in deriv_in}
    ex.release()
    return outputs, input_derivs, ex


def io_names(computation: NnetComputation, nnet) -> tuple[list, list, list, list]:
    """(inputs, outputs, input-derivatives provided, output-derivatives accepted), by
    node name, in command order, split at the first segment marker."""
    ins, outs, dins, douts = [], [], [], []
    backward = False
    for c in computation.commands:
        if c.command_type == CT.NO_OPERATION_MARKER:
            backward = True
        elif c.command_type == CT.ACCEPT_INPUT:
            (douts if backward else ins).append(nnet.get_node_name(c.arg2))
        elif c.command_type == CT.PROVIDE_OUTPUT:
            (dins if backward else outs).append(nnet.get_node_name(c.arg2))
    return ins, outs, dins, douts
