"""The executor's command list compiled into closures (the dispatch loop of
Kaldi's NnetComputer::Run / ExecuteCommand, nnet-compute.cc, without its
per-command interpretation cost).

Kaldi's C++ ``ExecuteCommand`` pays a switch and a few pointer loads per
command; a Python interpreter that re-reads the command, looks its submatrices
up and compares shapes on every run pays several microseconds instead, which
dominates small chunks (a 21-frame BLSTM chunk is ~2000 commands).  So each
command is turned, once per computation and backend, into a closure with
everything static already bound: matrix numbers, slice tuples of its
submatrices, row/pointer/range plans, alpha, and shape checks done at build
time when they depend only on the computation.  A run then is one loop calling
``op(executor, matrices)``; the closure returns a new program counter only for
kGotoLabel.

Two forms exist (``Program``):

- the *dynamic* closures (``ProgramBuilder``) read each matrix from the
  executor's list on every call, because allocation, swapping and state import
  replace them; they serve looped computations (kGotoLabel), the compressing
  executor (real kCompressMatrix / kDecompressMatrix) and command lists the
  static plan does not accept;
- the *bound* closures (``bind_command``, arena.py): for every other computation
  the matrices live at fixed places of one arena, so each closure holds the very
  arrays (views) it works on, plus preallocated temporaries.

Results are identical to the interpreted handlers of executor.py (the same
NumPy/CuPy operations on the same values, only without the lookups; see
fastpaths.py for the component forms); commands whose cost is dominated by
their own work (backprop, propagate that stores statistics) simply call those
handlers.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import numpy as np

from engine.compiler.computation import CommandType as CT
from engine.nnet.components.nonlinear import RectifiedLinearComponent
from engine.runtime import kernels as K
from engine.runtime.arena import BoundProgram, Scratch, StaticLayout
from engine.runtime.fastpaths import (bind_product_relu, bind_propagate, bind_propagate_write,
                                      fast_propagate)
from engine.runtime.parallel import ThreadChoice, blas_threads_settable


def _views(computation):
    """Per submatrix: (matrix index, None for the whole matrix or a slice pair)."""
    out = [(0, None)]
    mats = computation.matrices
    for sm in computation.submatrices[1:]:
        mi = mats[sm.matrix_index]
        if (sm.row_offset == 0 and sm.col_offset == 0 and sm.num_rows == mi.num_rows
                and sm.num_cols == mi.num_cols):
            out.append((sm.matrix_index, None))
        else:
            out.append((sm.matrix_index,
                        (slice(sm.row_offset, sm.row_offset + sm.num_rows),
                         slice(sm.col_offset, sm.col_offset + sm.num_cols))))
    return out


def _getter(xp, views, s):
    """A function mats -> the array of submatrix ``s``."""
    if s == 0:
        # Kaldi's empty submatrix (e.g. the input of a component that needs none)
        return lambda mats: xp.zeros((0, 0), dtype=np.float32)
    m, key = views[s]
    if key is None:
        return lambda mats: mats[m]
    return lambda mats: mats[m][key]


def _shape(computation, s):
    sm = computation.submatrices[s]
    return (sm.num_rows, sm.num_cols)


def _raiser(message):
    def op(ex, mats):
        raise ValueError(message)
    return op


def command_matrices(computation, c) -> list[int]:
    """Matrix numbers a command names through its submatrix arguments (used to
    diagnose 'used before it is allocated' after a compiled command fails)."""
    from engine.compiler.computation import COMMAND_SPECS, ArgKind  # noqa: PLC0415
    out = []
    for pos, slot in enumerate(COMMAND_SPECS[c.command_type].slots, start=1):
        if slot.kind == ArgKind.SUBMATRIX:
            s = getattr(c, f"arg{pos}")
            if s > 0:
                out.append(computation.submatrices[s].matrix_index)
    return out


class ProgramBuilder:
    """Builds the dynamic closures for one computation on one backend."""

    def __init__(self, computation, xp, plan, components=None, compress: bool = False):
        self.c = computation
        self.xp = xp
        self.components = components   # to choose fast propagates (fastpaths.py)
        self.plan = plan            # Executor._plan-like: (kind, index) -> kernel plan
        self.compress_real = compress  # carry out kCompressMatrix / kDecompressMatrix
        self.views = _views(computation)
        self.ctypes: dict[int, type] = {}   # command -> component type with a fast form
        self.row_plans: dict[int, object] = {}

    def build(self) -> list:
        ops = []
        for k, c in enumerate(self.c.commands):
            ct = c.command_type
            if ct in (CT.ACCEPT_INPUT, CT.PROVIDE_OUTPUT):
                ops.append(None)     # the run loop stops here
                continue
            self.k = k
            make = _FACTORIES.get(ct)
            ops.append(make(self, c) if make is not None else _slow(c))
        return ops

    # -- one factory per command type ------------------------------------------------------
    def alloc(self, c):
        m = self.c.submatrices[c.arg1].matrix_index
        info = self.c.matrices[m]
        rows, cols, xp = info.num_rows, info.num_cols, self.xp

        def op(ex, mats):
            old = mats[m]
            if old is not None:
                ex.pool.release(xp, old, ex.pool_owner)
            mats[m] = ex.pool.get(xp, rows, cols, ex.pool_owner)
        return op

    def dealloc(self, c):
        m = self.c.submatrices[c.arg1].matrix_index
        xp = self.xp

        def op(ex, mats):
            old = mats[m]
            if old is not None:
                ex.pool.release(xp, old, ex.pool_owner)
                mats[m] = None
        return op

    def swap(self, c):
        m1 = self.c.submatrices[c.arg1].matrix_index
        m2 = self.c.submatrices[c.arg2].matrix_index

        def op(ex, mats):
            mats[m1], mats[m2] = mats[m2], mats[m1]
        return op

    def set_const(self, c):
        alpha = c.alpha
        if c.arg1 == 0:
            return _nop
        m, key = self.views[c.arg1]
        if key is None:
            def op(ex, mats):
                mats[m].fill(alpha)
        else:
            def op(ex, mats):
                mats[m][key] = alpha
        return op

    def propagate(self, c):
        if c.arg6:      # stores statistics: rare (training), keep the full handler
            return _slow(c)
        ci, pi, memo_index = c.arg1, c.arg2, c.arg5
        get_in = _getter(self.xp, self.views, c.arg3)
        m_out, key_out = self.views[c.arg4]
        if c.arg4 == 0:
            get_out = _getter(self.xp, self.views, 0)
        elif key_out is None:
            def get_out(mats):
                return mats[m_out]
        else:
            def get_out(mats):
                return mats[m_out][key_out]
        fast, ctype = None, None
        if self.xp is np and self.components is not None and ci < len(self.components):
            ctype = type(self.components[ci])
            fast = fast_propagate(ctype)
            if fast is not None:
                self.ctypes[self.k] = ctype
        if memo_index > 0:
            def op(ex, mats):
                ex._memos[memo_index] = ex._components[ci].propagate(
                    ex._precomputed[pi], get_in(mats), get_out(mats))
        elif fast is not None and self.xp is np and c.arg3 > 0 and c.arg4 > 0:
            m_in, key_in = self.views[c.arg3]
            k = self.k

            def op(ex, mats):
                comp = ex._components[ci]
                if type(comp) is not ctype:
                    comp.propagate(ex._precomputed[pi], get_in(mats), get_out(mats))
                    return
                f = _bound_for(ex, k, ctype, mats[m_in], key_in, mats[m_out], key_out)
                if f is None:
                    fast(comp, ex._precomputed[pi], get_in(mats), get_out(mats))
                else:
                    f(comp, ex._precomputed[pi])
        elif fast is not None:
            def op(ex, mats):
                comp = ex._components[ci]
                if type(comp) is ctype:
                    fast(comp, ex._precomputed[pi], get_in(mats), get_out(mats))
                else:
                    comp.propagate(ex._precomputed[pi], get_in(mats), get_out(mats))
        elif c.arg3 > 0 and key_out is None and self.views[c.arg3][1] is None:
            m_in = self.views[c.arg3][0]

            def op(ex, mats):      # whole input, whole output
                ex._components[ci].propagate(ex._precomputed[pi], mats[m_in], mats[m_out])
        else:
            def op(ex, mats):
                ex._components[ci].propagate(ex._precomputed[pi], get_in(mats), get_out(mats))
        return op

    def matrix_copy(self, c):
        if _shape(self.c, c.arg1) != _shape(self.c, c.arg2):
            return _raiser(f"shape mismatch {_shape(self.c, c.arg1)} vs {_shape(self.c, c.arg2)}")
        get_d, get_s = _getter(self.xp, self.views, c.arg1), _getter(self.xp, self.views, c.arg2)
        alpha, xp = c.alpha, self.xp
        if alpha == 1.0:
            if c.arg1 == c.arg2:
                return _nop
            copyto = xp.copyto

            def op(ex, mats):
                copyto(get_d(mats), get_s(mats))
        else:
            multiply = xp.multiply

            def op(ex, mats):
                # float32 * Python float stays float32, as ``alpha * src`` does
                multiply(get_s(mats), alpha, out=get_d(mats))
        return op

    def matrix_add(self, c):
        if _shape(self.c, c.arg1) != _shape(self.c, c.arg2):
            return _raiser(f"shape mismatch {_shape(self.c, c.arg1)} vs {_shape(self.c, c.arg2)}")
        get_d, get_s = _getter(self.xp, self.views, c.arg1), _getter(self.xp, self.views, c.arg2)
        alpha, add = c.alpha, self.xp.add
        if alpha == 1.0:
            def op(ex, mats):
                d = get_d(mats)
                add(d, get_s(mats), out=d)
        else:
            def op(ex, mats):
                d = get_d(mats)
                add(d, alpha * get_s(mats), out=d)
        return op

    def copy_rows(self, c):
        get_d, get_s = _getter(self.xp, self.views, c.arg1), _getter(self.xp, self.views, c.arg2)
        plan, alpha, xp = self.plan("rows", c.arg3), c.alpha, self.xp
        self.row_plans[self.k] = plan
        fn = K.add_rows if c.command_type == CT.ADD_ROWS else K.copy_rows

        def op(ex, mats):
            fn(xp, get_d(mats), get_s(mats), plan, alpha)
        return op

    def rows_multi(self, c):
        get_d = _getter(self.xp, self.views, c.arg1)
        plan = K.make_matrix_multi_plan(self.xp, self.c, self.c.indexes_multi[c.arg2],
                                        self.views)
        self.row_plans[self.k] = plan
        alpha, xp, add = c.alpha, self.xp, c.command_type == CT.ADD_ROWS_MULTI

        def op(ex, mats):
            K.rows_multi_by_matrix(xp, get_d(mats), plan, mats, alpha, add)
        return op

    def to_rows_multi(self, c):
        if c.command_type == CT.COPY_TO_ROWS_MULTI and c.alpha != 1.0:
            return _raiser("CopyToRowsMulti does not support alpha != 1 (as in Kaldi)")
        get_s = _getter(self.xp, self.views, c.arg1)
        plan = K.make_matrix_multi_plan(self.xp, self.c, self.c.indexes_multi[c.arg2],
                                        self.views, scatter=True)
        self.row_plans[self.k] = plan
        alpha, xp, add = c.alpha, self.xp, c.command_type == CT.ADD_TO_ROWS_MULTI

        def op(ex, mats):
            K.to_rows_multi_by_matrix(xp, get_s(mats), plan, mats, alpha, add)
        return op

    def add_row_ranges(self, c):
        get_d, get_s = _getter(self.xp, self.views, c.arg1), _getter(self.xp, self.views, c.arg2)
        plan, alpha, xp = self.plan("ranges", c.arg3), c.alpha, self.xp
        self.row_plans[self.k] = plan

        def op(ex, mats):
            K.add_row_ranges(xp, get_d(mats), get_s(mats), plan, alpha)
        return op

    def compress(self, c):
        m = self.c.submatrices[c.arg1].matrix_index if c.arg1 > 0 else 0
        if self.compress_real:
            # Kaldi's NnetComputer on a GPU: the matrix is replaced by its compressed
            # form until the matching kDecompressMatrix (CompressingExecutor)
            if c.command_type == CT.COMPRESS_MATRIX:
                def op(ex, mats):
                    ex._compress_matrix(m, c)
            else:
                def op(ex, mats):
                    ex._decompress_matrix(m)
            return op

        # Kaldi's CPU build leaves the matrix as it is (see Executor._compress); the
        # only effect is the check that the matrix exists.
        def op(ex, mats):
            if m and mats[m] is None:
                raise TypeError(f"matrix m{m} is not allocated")
        return op

    def noop(self, c):
        return _nop

    def goto(self, c):
        target = c.arg1
        cmds = self.c.commands
        if not (0 <= target < len(cmds)) or cmds[target].command_type != CT.NO_OPERATION_LABEL:
            return _raiser(f"goto target c{target} is not a label")

        def op(ex, mats):
            return target      # the loop then steps past the label
        return op


# bindings kept per command and executor (see _bound_for)
_BOUND_ENTRIES = 16


def _bound_for(ex, k, ctype, a, key_a, b, key_b):
    """The bound fast propagate (fastpaths.bind_propagate) of command ``k`` on the
    matrices ``a`` (input) and ``b`` (output) as this executor holds them now, or
    None when there is none.  Dynamic programs (looped computations) run the same
    command on a few pool buffers chunk after chunk, so each command keeps its last
    ``_BOUND_ENTRIES`` bindings, per executor and thread (``ex._dyn_bound``: a binding
    holds its thread's temporaries, Program.dyn_scratch; Executor._switch_thread).  The
    buffers come round in a cycle set by the order of the chunk's allocations,
    deallocations and swaps through the executor's own last-in-first-out free lists in
    the pool (BufferPool owners): six on the reference TDNN at 21-frame chunks and twelve
    for some of TDNN-F's commands, where two entries missed every time (11 and 16 new
    bindings a chunk); with sixteen, none of the three reference streams binds anything
    past its first chunks (bench/RESULTS.md, thirty-seventh session).  An entry holds
    the matrices themselves, so an identity match is always the same memory; the oldest
    entry goes first."""
    if a is None or b is None:
        return None
    cache = ex._dyn_bound
    entries = cache.get(k)
    if entries is not None:
        for e in entries:
            if e[0] is a and e[1] is b:
                return e[2]
    f = bind_propagate(ctype, a if key_a is None else a[key_a],
                       b if key_b is None else b[key_b], ex._program.dyn_scratch())
    e = (a, b, f)
    if entries is None:
        cache[k] = [e]
    else:
        entries.insert(0, e)
        if len(entries) > _BOUND_ENTRIES:
            entries.pop()
    return f


def _nop(ex, mats):
    return None


no_op = _nop


def _slow(c):
    """A command run by the executor's interpreted handler."""
    def op(ex, mats):
        ex._execute(c)
    return op


_FACTORIES = {
    CT.ALLOC_MATRIX: ProgramBuilder.alloc,
    CT.DEALLOC_MATRIX: ProgramBuilder.dealloc,
    CT.SWAP_MATRIX: ProgramBuilder.swap,
    CT.SET_CONST: ProgramBuilder.set_const,
    CT.PROPAGATE: ProgramBuilder.propagate,
    CT.MATRIX_COPY: ProgramBuilder.matrix_copy,
    CT.MATRIX_ADD: ProgramBuilder.matrix_add,
    CT.COPY_ROWS: ProgramBuilder.copy_rows,
    CT.ADD_ROWS: ProgramBuilder.copy_rows,
    CT.COPY_ROWS_MULTI: ProgramBuilder.rows_multi,
    CT.ADD_ROWS_MULTI: ProgramBuilder.rows_multi,
    CT.COPY_TO_ROWS_MULTI: ProgramBuilder.to_rows_multi,
    CT.ADD_TO_ROWS_MULTI: ProgramBuilder.to_rows_multi,
    CT.ADD_ROW_RANGES: ProgramBuilder.add_row_ranges,
    CT.COMPRESS_MATRIX: ProgramBuilder.compress,
    CT.DECOMPRESS_MATRIX: ProgramBuilder.compress,
    CT.NO_OPERATION: ProgramBuilder.noop,
    CT.NO_OPERATION_PERMANENT: ProgramBuilder.noop,
    CT.NO_OPERATION_MARKER: ProgramBuilder.noop,
    CT.NO_OPERATION_LABEL: ProgramBuilder.noop,
    CT.GOTO_LABEL: ProgramBuilder.goto,
    # BACKPROP / BACKPROP_NO_MODEL_UPDATE: the interpreted handler (see _slow)
}


# --------------------------------------------------------------------------------------
# the program of one computation on one backend


class Program:
    """The dynamic closures of a computation (``ops``, None at input/output
    commands), ``stops[pc]``: the first input/output command at or after ``pc``,
    and, when the computation has a static layout, the closures bound to arena
    buffers (``bound_for``)."""

    MAX_BOUND = 4       # bound copies kept (one per arena buffer in use)

    def __init__(self, computation, xp, plan, components=None, compress: bool = False,
                 outputs_in_arena: bool = False):
        builder = ProgramBuilder(computation, xp, plan, components, compress)
        if xp is np:
            blas_threads_settable()   # (finds the BLAS's thread count for the product kernel)
        # a weak reference: programs are cached per computation (executor._PLAN_CACHE,
        # arena.IDLE_ARENAS) and must not keep it alive
        self._computation = weakref.ref(computation)
        self.xp = xp
        self.ops = builder.build()
        self.ctypes = builder.ctypes
        self.row_plans = builder.row_plans
        n = len(self.ops)
        self.stops = [n] * (n + 1)
        nxt = n
        for k in range(n - 1, -1, -1):
            if self.ops[k] is None:
                nxt = k
            self.stops[k] = nxt
        layout = None if compress else StaticLayout(computation, outputs_in_arena)
        self.layout = layout if layout is not None and layout.ok else None
        self._bound: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.capturable: dict[int, bool] = {}    # CUDA graphs: see cuda_graph.py
        self._thread_choices: dict[int, ThreadChoice] = {}
        self._tls = threading.local()     # per thread: dyn_scratch()

    def dyn_scratch(self) -> Scratch:
        """The temporaries of the fast propagates bound on an executor's own matrices
        (``_bound_for``), one set per thread, kept for as long as the program.  Commands
        run one at a time in a thread, so executors of one thread share them, as the
        commands of a bound program share its scratch.  Per executor, they were new
        arrays each run: large ones (BLSTM 150x8's log-softmax, two 1.4 MB buffers)
        came from fresh pages of the allocator (~700 page faults, ~0.8 ms a run)."""
        s = getattr(self._tls, "scratch", None)
        if s is None:
            s = self._tls.scratch = Scratch(np)
        return s

    def thread_choice(self, pc: int) -> ThreadChoice:
        """Whether the commands from ``pc`` to the next input/output command run on
        one BLAS thread (engine.runtime.parallel.ThreadChoice), shared by every run of
        this program."""
        choice = self._thread_choices.get(pc)
        if choice is None:
            choice = self._thread_choices.setdefault(pc, ThreadChoice())
        return choice

    @property
    def computation(self):
        c = self._computation()
        if c is None:
            raise RuntimeError("the computation of this program no longer exists")
        return c

    def bind(self, buf) -> BoundProgram:
        """The commands bound to the arena buffer ``buf`` (new)."""
        return BoundProgram(self, buf, self.xp)

    def bound_for(self, buf) -> BoundProgram:
        """The bound commands of ``buf``, reused when ``buf`` has been bound before."""
        key = id(buf)
        with self._lock:
            b = self._bound.get(key)
            if b is not None and b.buf is buf:
                self._bound.move_to_end(key)
                return b
        b = self.bind(buf)
        with self._lock:
            self._bound[key] = b
            while len(self._bound) > self.MAX_BOUND:
                self._bound.popitem(last=False)
        return b


def build_program(computation, xp, plan, components=None, compress: bool = False,
                  outputs_in_arena: bool = False) -> Program:
    """The compiled form of ``computation`` (see ``Program``).  ``components``: the
    network's components, to pick fast propagates by type; ``compress``: carry
    out compression commands (CompressingExecutor); ``outputs_in_arena``: outputs
    live in the arena too (arena.StaticLayout; for CUDA graphs)."""
    return Program(computation, xp, plan, components, compress, outputs_in_arena)


# --------------------------------------------------------------------------------------
# binding one command to an arena (arena.BoundProgram)


_EMPTY = np.zeros((0, 0), dtype=np.float32)


def bind_command(program: Program, bound: BoundProgram, k: int, c):
    """The closure of command ``k`` on ``bound``'s arena: arrays bound where the
    command touches only arena instances, else the dynamic closure."""
    dyn = program.ops[k]
    if dyn is None:
        return None
    make = _BINDERS.get(c.command_type)
    if make is None:
        return dyn
    op = make(program, bound, k, c)
    return dyn if op is None else op


def _bview(program, bound, k, slot, s):
    """The bound array of submatrix ``s`` (argument ``slot`` of command ``k``), or
    None when it is external (or empty)."""
    if s <= 0:
        return None
    return bound.view(program.layout.cmd_inst[k][slot], s, program.computation)


def _bind_alloc(program, bound, k, c):
    i = program.layout.cmd_inst[k][0]
    v = bound.inst_views[i]
    if v is None:
        return None
    m = program.computation.submatrices[c.arg1].matrix_index

    def op(ex, mats):
        mats[m] = v
    return op


def _bind_dealloc(program, bound, k, c):
    i = program.layout.cmd_inst[k][0]
    if bound.inst_views[i] is None:
        return None
    m = program.computation.submatrices[c.arg1].matrix_index

    def op(ex, mats):
        mats[m] = None
    return op


def _bind_set_const(program, bound, k, c):
    v = _bview(program, bound, k, 0, c.arg1)
    if v is None:
        return None
    fill, alpha = v.fill, c.alpha

    def op(ex, mats):
        fill(alpha)
    return op


def _bind_propagate(program, bound, k, c):
    if c.arg6:
        return None
    x = _bview(program, bound, k, 2, c.arg3) if c.arg3 > 0 else _EMPTY
    y = _bview(program, bound, k, 3, c.arg4) if c.arg4 > 0 else _EMPTY
    if x is None or y is None or (program.xp is not np and (c.arg3 == 0 or c.arg4 == 0)):
        return None
    ci, pi, memo = c.arg1, c.arg2, c.arg5
    if memo > 0:
        def op(ex, mats):
            ex._memos[memo] = ex._components[ci].propagate(ex._precomputed[pi], x, y)
        return op
    ctype = program.ctypes.get(k)
    f = bind_propagate(ctype, x, y, bound.scratch) if ctype is not None else None
    if f is not None:
        def op(ex, mats):
            comp = ex._components[ci]
            if type(comp) is ctype:
                f(comp, ex._precomputed[pi])
            else:
                comp.propagate(ex._precomputed[pi], x, y)
        return op

    def op(ex, mats):
        ex._components[ci].propagate(ex._precomputed[pi], x, y)
    return op


def _bind_backprop(program, bound, k, c):
    """kBackprop / kBackpropNoModelUpdate with its four submatrices bound (the
    interpreted handler, Executor._backprop, looks each up on every call)."""
    views = []
    for slot, s in ((2, c.arg3), (3, c.arg4), (4, c.arg5), (5, c.arg6)):
        if s <= 0:
            if slot == 4:
                return None     # no output derivative: the handler's empty-matrix case
            views.append(None)
            continue
        v = _bview(program, bound, k, slot, s)
        if v is None:
            return None
        views.append(v)
    x, y, dy, dx = views
    ci, pi, memo_i = c.arg1, c.arg2, c.arg7
    updates = c.command_type == CT.BACKPROP

    def op(ex, mats):
        to_update, memo = ex._backprop_state(ci, updates, memo_i)
        ex._components[ci].backprop(ex.computation_name(ci), ex._precomputed[pi],
                                    x, y, dy, memo, to_update, dx)
    return op


def _bind_matrix_copy(program, bound, k, c):
    comp = program.computation
    if _shape(comp, c.arg1) != _shape(comp, c.arg2):
        return None
    if c.arg1 == c.arg2 and c.alpha == 1.0:
        return _nop
    d, s = _bview(program, bound, k, 0, c.arg1), _bview(program, bound, k, 1, c.arg2)
    if d is None or s is None:
        return None
    xp = program.xp
    if c.alpha == 1.0:
        def op(ex, mats):
            d[...] = s
    else:
        multiply = xp.multiply
        # float32 * a Python float is float32 * float32(alpha)
        alpha = xp.asarray(c.alpha, dtype=s.dtype)

        def op(ex, mats):
            multiply(s, alpha, d)
    return op


def _bind_matrix_add(program, bound, k, c):
    comp = program.computation
    if _shape(comp, c.arg1) != _shape(comp, c.arg2):
        return None
    d, s = _bview(program, bound, k, 0, c.arg1), _bview(program, bound, k, 1, c.arg2)
    if d is None or s is None:
        return None
    xp = program.xp
    add = xp.add
    if c.alpha == 1.0:
        def op(ex, mats):
            add(d, s, d)
    else:
        multiply = xp.multiply
        tmp = bound.scratch.get(s.shape, 0, s.dtype)
        alpha = xp.asarray(c.alpha, dtype=s.dtype)

        def op(ex, mats):
            # alpha * src, as a float32 temporary, then added
            multiply(s, alpha, tmp)
            add(d, tmp, d)
    return op


def _bind_rows(program, bound, k, c):
    d, s = _bview(program, bound, k, 0, c.arg1), _bview(program, bound, k, 1, c.arg2)
    plan = program.row_plans.get(k)
    if d is None or s is None or plan is None:
        return None
    xp, alpha = program.xp, c.alpha
    if c.command_type == CT.ADD_ROW_RANGES:
        fn = K.add_row_ranges
    else:
        fn = K.add_rows if c.command_type == CT.ADD_ROWS else K.copy_rows

    def op(ex, mats):
        fn(xp, d, s, plan, alpha)
    return op


def _bind_multi(program, bound, k, c):
    """The pointer-list commands with the matrices they name bound (their
    instances at this command, from the layout)."""
    this = _bview(program, bound, k, 0, c.arg1)
    plan = program.row_plans.get(k)
    insts = program.layout.multi_inst.get(k)
    if this is None or plan is None or insts is None:
        return None
    arrays = {}
    for m, i in insts.items():
        v = bound.inst_views[i]
        if v is None:
            return None
        arrays[m] = v
    xp, alpha = program.xp, c.alpha
    ct = c.command_type
    if ct in (CT.COPY_ROWS_MULTI, CT.ADD_ROWS_MULTI):
        add = ct == CT.ADD_ROWS_MULTI
        # every source in this arena: one gather over the arena (kernels.arena_rows_gather)
        gather = (K.arena_rows_gather(this, plan, arrays, bound.buf)
                  if xp is np and this.shape[0] == plan.num_rows else None)
        if gather is not None:
            return _gather_op(this, gather, alpha, add, plan)

        def op(ex, mats):
            K.rows_multi_by_matrix(xp, this, plan, arrays, alpha, add)
    else:
        add = ct == CT.ADD_TO_ROWS_MULTI
        # every destination in this arena: one scatter (kernels.arena_rows_scatter);
        # a CopyToRowsMulti with alpha != 1 keeps the per-matrix form, which refuses it
        scatter = (K.arena_rows_scatter(this, plan, arrays, bound.buf)
                   if xp is np and this.shape[0] == plan.num_rows and (add or alpha == 1.0)
                   else None)
        if scatter is not None:
            return _scatter_op(this, scatter, alpha, add)

        def op(ex, mats):
            K.to_rows_multi_by_matrix(xp, this, plan, arrays, alpha, add)
    return op


def _gather_op(this, gather, alpha: float, add: bool, plan):
    """The closure of an arena-gathered CopyRowsMulti / AddRowsMulti (the same
    operations on each row as kernels.rows_multi_by_matrix)."""
    windows, offsets, valid = gather
    if not add:
        if alpha == 0.0:
            return _nop          # (as rows_multi_by_matrix: the destination is left alone)
        nulls = plan.null_positions if plan.has_null else None

        def op(ex, mats):
            this[...] = windows[offsets]
            if alpha != 1.0:
                np.multiply(this, alpha, out=this)
            if nulls is not None:
                this[nulls] = 0
        return op
    some = offsets if valid is None else offsets[valid]
    rows = slice(None) if valid is None else valid

    def op(ex, mats):
        vals = windows[some]
        if alpha != 1.0:
            vals *= alpha
        this[rows] += vals
    return op


def _scatter_op(this, scatter, alpha: float, add: bool):
    """The closure of an arena-scattered CopyToRowsMulti / AddToRowsMulti (the same
    operations on each row as kernels.to_rows_multi_by_matrix)."""
    windows, offsets, valid = scatter
    some = offsets if valid is None else offsets[valid]
    rows = slice(None) if valid is None else valid
    if not add:
        def op(ex, mats):
            windows[some] = this[rows]
        return op

    def op(ex, mats):
        vals = this[rows]
        if alpha != 1.0:
            vals = alpha * vals
        windows[some] += vals
    return op


def _bind_compress(program, bound, k, c):
    return _nop       # the layout has checked that the matrix is allocated here


_BINDERS = {
    CT.BACKPROP: _bind_backprop,
    CT.BACKPROP_NO_MODEL_UPDATE: _bind_backprop,
    CT.ALLOC_MATRIX: _bind_alloc,
    CT.DEALLOC_MATRIX: _bind_dealloc,
    CT.SET_CONST: _bind_set_const,
    CT.PROPAGATE: _bind_propagate,
    CT.MATRIX_COPY: _bind_matrix_copy,
    CT.MATRIX_ADD: _bind_matrix_add,
    CT.COPY_ROWS: _bind_rows,
    CT.ADD_ROWS: _bind_rows,
    CT.ADD_ROW_RANGES: _bind_rows,
    CT.COMPRESS_MATRIX: _bind_compress,
    CT.DECOMPRESS_MATRIX: _bind_compress,
    CT.COPY_ROWS_MULTI: _bind_multi,
    CT.ADD_ROWS_MULTI: _bind_multi,
    CT.COPY_TO_ROWS_MULTI: _bind_multi,
    CT.ADD_TO_ROWS_MULTI: _bind_multi,
}

_MATRIX_LIST_OPS = (CT.ALLOC_MATRIX, CT.DEALLOC_MATRIX, CT.SWAP_MATRIX)


def write_after_zeroing(program: Program, bound: BoundProgram, ops: list) -> int:
    """Kaldi's compiler zeroes the output of a component that adds to it (a Linear, a
    TDNN without bias: kPropagateAdds) with a kSetConst 0 right before the propagate.
    On the arena, where both commands see the same array, such a pair becomes one
    closure that writes the product into the output (fastpaths.bind_propagate_write):
    the zeroing pass and the addition pass go (TDNN-F: two of its products per layer).
    Edits ``ops`` (the zeroing becomes ``no_op``); returns the number of pairs."""
    if program.xp is not np:
        return 0
    cmds = program.computation.commands
    inst = program.layout.cmd_inst
    pairs = 0
    for k in range(len(cmds) - 1):
        z, c = cmds[k], cmds[k + 1]
        if (z.command_type != CT.SET_CONST or z.alpha != 0.0 or z.arg1 <= 0
                or c.command_type != CT.PROPAGATE or c.arg4 != z.arg1 or c.arg3 <= 0
                or c.arg5 > 0 or c.arg6 or ops[k] is None or ops[k + 1] is None
                or inst[k][0] != inst[k + 1][3]):
            continue
        ctype = program.ctypes.get(k + 1)
        if ctype is None:
            continue
        x = _bview(program, bound, k + 1, 2, c.arg3)
        y = _bview(program, bound, k + 1, 3, c.arg4)
        # (the zeroing's view is y: the same instance and submatrix, one cached view)
        if x is None or y is None:
            continue
        f = bind_propagate_write(ctype, x, y, bound.scratch)
        if f is None:
            continue
        ops[k + 1] = _written(f, ctype, c.arg1, c.arg2, x, y)
        ops[k] = _nop
        pairs += 1
    return pairs


def _written(f, ctype, ci: int, pi: int, x, y):
    def op(ex, mats):
        comp = ex._components[ci]
        if type(comp) is ctype:
            f(comp, ex._precomputed[pi])
        else:       # another component: its own propagate adds, to the zeros it needs
            y.fill(0.0)
            comp.propagate(ex._precomputed[pi], x, y)
    return op


def relu_after_product(program: Program, bound: BoundProgram, ops: list) -> int:
    """An affine-type component (or a TDNN with bias) followed, as the next command that
    names its output matrix, by a ReLU of that output -- in place (each TDNN-F layer's
    affine part in the decoding form, where batch-norms are folded away), or into
    another matrix when nothing else reads the product's and nothing between the two
    names the ReLU's -- becomes one closure at the product's place: the product kernel
    writes max(0, product + bias) into the ReLU's output (fastpaths.bind_product_relu),
    the bits of the two propagates, one pass over the output instead of three.  Where
    the kernel does not apply at run time the closure runs the two commands there.
    Edits ``ops`` (the ReLU becomes ``no_op``); returns the number of pairs."""
    if program.xp is not np:
        return 0
    comp = program.computation
    cmds = comp.commands
    subs = comp.submatrices
    inst = program.layout.cmd_inst
    users: dict[int, list[int]] = {}      # matrix -> the commands that name it, in order
    for j, c in enumerate(cmds):
        for m in dict.fromkeys(command_matrices(comp, c)):
            users.setdefault(m, []).append(j)
    list_ops = (CT.ALLOC_MATRIX, CT.DEALLOC_MATRIX)
    pairs = 0
    for k, c in enumerate(cmds):
        ctype = program.ctypes.get(k)
        if (c.command_type != CT.PROPAGATE or ctype is None or c.arg3 <= 0 or c.arg4 <= 0
                or c.arg5 > 0 or c.arg6 or ops[k] in (None, _nop)):
            continue
        m = subs[c.arg4].matrix_index
        later = [j for j in users[m] if j > k and cmds[j].command_type not in list_ops]
        if not later:
            continue
        kr = later[0]
        r = cmds[kr]
        if (r.command_type != CT.PROPAGATE
                or program.ctypes.get(kr) is not RectifiedLinearComponent
                or r.arg3 != c.arg4 or r.arg4 <= 0 or r.arg5 > 0 or r.arg6
                or ops[kr] in (None, _nop) or inst[k][3] != inst[kr][2]):
            continue
        if r.arg4 != c.arg4:        # into another matrix: the product's is read by no one
            my = subs[r.arg4].matrix_index
            if (len(later) > 1 or my == m
                    or any(k < j < kr for j in users[my])):
                continue
        x = _bview(program, bound, k, 2, c.arg3)
        z = _bview(program, bound, k, 3, c.arg4)
        y = _bview(program, bound, kr, 3, r.arg4)
        if x is None or y is None or z is None or y.shape != z.shape:
            continue
        f = bind_product_relu(ctype, x, y)
        if f is None:
            continue
        ops[k] = _with_relu(f, ctype, c.arg1, c.arg2, r.arg1, y.shape[1], ops[k], ops[kr])
        ops[kr] = _nop
        pairs += 1
    return pairs


def _with_relu(f, ctype, ci: int, pi: int, ri: int, dim: int, product_op, relu_op):
    def op(ex, mats):
        comps = ex._components
        comp, relu = comps[ci], comps[ri]
        if (type(comp) is ctype and type(relu) is RectifiedLinearComponent
                and relu.dim == dim and f(comp, ex._precomputed[pi])):
            return
        product_op(ex, mats)      # (the kernel did not apply: the two commands)
        relu_op(ex, mats)
    return op


def matrices_read_dynamically(program: Program, ops: list) -> set[int]:
    """Matrices whose entry in the executor's matrix list some command of ``ops``
    reads (the dynamic closures among them, which look matrices up), closed over
    swaps; allocation, deallocation and swap commands of other matrices need not
    keep the list (arena.BoundProgram drops them)."""
    comp = program.computation
    subs = comp.submatrices
    needed: set[int] = set()
    for k, c in enumerate(comp.commands):
        op = ops[k]
        ct = c.command_type
        if op is None or op is _nop or ct in _MATRIX_LIST_OPS:
            continue
        if op is program.ops[k]:          # a dynamic closure
            needed.update(command_matrices(comp, c))
            plan = program.row_plans.get(k)
            for g in getattr(plan, "groups", ()):
                m = getattr(g, "matrix", None)
                if m is None:            # a per-submatrix plan
                    m = subs[g.submatrix].matrix_index
                needed.add(m)
    layout = program.layout
    for i, m in enumerate(layout.inst_matrix):   # external instances: pool buffers
        if layout.inst_offset[i] < 0:
            needed.add(m)
    for c in comp.commands:        # outputs are read from the list (also arena ones)
        if c.command_type == CT.PROVIDE_OUTPUT and c.arg1 > 0:
            needed.add(subs[c.arg1].matrix_index)
    swaps = [(subs[c.arg1].matrix_index, subs[c.arg2].matrix_index)
             for c in comp.commands if c.command_type == CT.SWAP_MATRIX]
    changed = True
    while changed:
        changed = False
        for m1, m2 in swaps:
            if (m1 in needed) != (m2 in needed):
                needed.update((m1, m2))
                changed = True
    return needed
