"""Static memory plan of a straight-line computation and the commands bound to it.

Kaldi's NnetComputer keeps a matrix per ``m`` and resizes it on kAllocMatrix /
kDeallocMatrix; the CUDA allocator behind it caches the memory.  A computation
without kGotoLabel (every computation except the looped ones) always executes
the same command sequence, so where each matrix lives can be decided once:

- ``StaticLayout`` walks the commands once, as the executor would, following
  every matrix through allocation, swaps, deallocation, input and output.  Each
  allocation (or accepted input) starts an *instance*; a swap moves instances
  between matrix numbers, so every submatrix argument of every command resolves
  to one instance.  Instances whose matrix is handed to the caller (kProvideOutput)
  are *external*: they get a buffer of their own from the pool at run time, as in
  the dynamic executor, because the caller keeps it.  All other instances get an
  offset in one flat float32 arena (best fit over their lifetimes, 64-byte
  aligned), so the arena is about Kaldi's peak matrix memory.
- ``BoundProgram`` is the command list compiled against one arena buffer: every
  submatrix argument that lies in the arena is a NumPy/CuPy view created once, so
  executing a command does no lookups, no slicing and no allocation; element-wise
  chains get preallocated temporaries (shared by commands of the same shape:
  commands run one at a time).  Commands that touch an external instance, or
  whose work is dominated by their own Python (backprop, statistics, pointer
  lists), use the dynamic closures of program.py, which read the executor's
  matrix list; the bound allocation commands keep that list exactly as the
  dynamic executor does (a view of the arena instead of a pool buffer).

The layout is ``None`` (the dynamic program is used) for looped computations and
for command lists that use a matrix that is not allocated or allocate one twice:
those then fail, or run, exactly as with the dynamic executor.

A bound program is reused as long as its arena buffer comes back: with a shared
``BufferPool`` the buffer goes back to the pool when the run ends and the pool
(a LIFO per shape) returns the same one to the next run; an executor without a
pool of its own takes arenas from a small process-wide cache of idle ones.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict

import numpy as np

from engine.compiler.computation import COMMAND_SPECS, ArgKind
from engine.compiler.computation import CommandType as CT

_ALIGN = 16                 # floats: 64 bytes

_LIST_OPS = (CT.ALLOC_MATRIX, CT.DEALLOC_MATRIX, CT.SWAP_MATRIX)

_SUBMATRIX_SLOTS = {ct: tuple(i for i, slot in enumerate(spec.slots)
                              if slot.kind == ArgKind.SUBMATRIX)
                    for ct, spec in COMMAND_SPECS.items()}


_MULTI = (CT.COPY_ROWS_MULTI, CT.ADD_ROWS_MULTI, CT.COPY_TO_ROWS_MULTI, CT.ADD_TO_ROWS_MULTI)


def _args(c):
    return (c.arg1, c.arg2, c.arg3, c.arg4, c.arg5, c.arg6, c.arg7)


class StaticLayout:
    """Instances, their arena offsets and, per command, the instance behind each
    submatrix argument.  ``ok`` is False when the computation needs the dynamic
    executor (see the module docstring)."""

    def __init__(self, computation, outputs_in_arena: bool = False):
        self.ok = False
        # True: outputs are arena instances too (the executor copies them out), so
        # that every address the commands touch is fixed (CUDA graphs: cuda_graph.py)
        self.outputs_in_arena = outputs_in_arena
        self.inst_matrix: list[int] = []      # instance -> matrix number
        self.inst_shape: list[tuple] = []
        self.inst_offset: list[int] = []      # arena offset in floats; -1 = external
        self.cmd_inst: list = []              # per command: {slot: instance}
        self.accept_inst: dict[int, int] = {}  # kAcceptInput command -> instance
        self.multi_inst: dict[int, dict] = {}  # pointer-list command -> {matrix: instance}
        self.total = 0                        # arena floats (without alignment slack)
        self.all_freed_at_end = False         # no arena instance outlives the commands
        self._build(computation)

    def _build(self, comp) -> None:
        cmds = comp.commands
        subs = comp.submatrices
        mats = comp.matrices
        n = len(cmds)
        current: list = [None] * len(mats)    # matrix -> live instance
        start: list[int] = []
        end: list[int] = []
        external: list[bool] = []
        provided: set[int] = set()

        def new_instance(m, k):
            info = mats[m]
            self.inst_matrix.append(m)
            self.inst_shape.append((info.num_rows, info.num_cols))
            start.append(k)
            end.append(n)
            external.append(False)
            current[m] = len(self.inst_matrix) - 1
            return current[m]

        for k, c in enumerate(cmds):
            ct = c.command_type
            refs = {}
            if ct == CT.GOTO_LABEL:
                return
            if ct in (CT.ALLOC_MATRIX, CT.ACCEPT_INPUT):
                if c.arg1 <= 0 or not comp.is_whole_matrix(c.arg1):
                    return
                m = subs[c.arg1].matrix_index
                if current[m] is not None:
                    return
                i = new_instance(m, k)
                refs[0] = i
                if ct == CT.ACCEPT_INPUT:
                    self.accept_inst[k] = i
            elif ct == CT.DEALLOC_MATRIX:
                if c.arg1 <= 0:
                    return
                m = subs[c.arg1].matrix_index
                i = current[m]
                if i is None:
                    return
                end[i] = k
                current[m] = None
                refs[0] = i
            elif ct == CT.SWAP_MATRIX:
                if c.arg1 <= 0 or c.arg2 <= 0:
                    return
                m1, m2 = subs[c.arg1].matrix_index, subs[c.arg2].matrix_index
                if mats[m1].num_rows != mats[m2].num_rows or mats[m1].num_cols != mats[m2].num_cols:
                    return
                current[m1], current[m2] = current[m2], current[m1]
            elif ct == CT.PROVIDE_OUTPUT:
                if c.arg1 <= 0 or not comp.is_whole_matrix(c.arg1):
                    return
                i = current[subs[c.arg1].matrix_index]
                if i is None:
                    return
                external[i] = not self.outputs_in_arena
                provided.add(i)
                refs[0] = i
            else:
                args = _args(c)
                for slot in _SUBMATRIX_SLOTS[ct]:
                    s = args[slot]
                    if s > 0:
                        i = current[subs[s].matrix_index]
                        if i is None:
                            return
                        refs[slot] = i
                if ct in _MULTI:
                    named = {}
                    for s, _ in comp.indexes_multi[c.arg2]:
                        if s >= 0:
                            m = subs[s].matrix_index
                            if current[m] is None:
                                return
                            named[m] = current[m]
                    self.multi_inst[k] = named
            self.cmd_inst.append(refs)
        self._place(start, end, external)
        # outputs in the arena are copied out when provided, so at the end they are
        # no longer the caller's concern either
        self.all_freed_at_end = all(end[i] < n for i in range(len(end))
                                    if not external[i] and i not in provided)
        self.ok = True

    def _place(self, start, end, external) -> None:
        """Offsets in one arena for the non-external instances: largest first, each
        at the lowest offset free of every placed instance whose lifetime meets
        its own (instances that are never alive at the same time share memory)."""
        self.inst_offset = [-1] * len(start)
        todo = [i for i in range(len(start)) if not external[i]]
        if not todo:
            self.total = 0
            return
        sizes = {i: -(-(self.inst_shape[i][0] * self.inst_shape[i][1]) // _ALIGN) * _ALIGN
                 for i in todo}
        todo.sort(key=lambda i: (-sizes[i], start[i], i))
        p_start = np.empty(len(todo), np.int64)
        p_end = np.empty(len(todo), np.int64)
        p_off = np.empty(len(todo), np.int64)
        p_size = np.empty(len(todo), np.int64)
        top = 0
        for j, i in enumerate(todo):
            size = sizes[i]
            meet = (p_start[:j] <= end[i]) & (p_end[:j] >= start[i])
            best = 0
            if meet.any():
                offs, szs = p_off[:j][meet], p_size[:j][meet]
                order = np.argsort(offs, kind="stable")
                for off, sz in zip(offs[order].tolist(), szs[order].tolist()):
                    if off - best >= size:
                        break
                    best = max(best, off + sz)
            p_start[j], p_end[j], p_off[j], p_size[j] = start[i], end[i], best, size
            self.inst_offset[i] = best
            top = max(top, best + size)
        self.total = top

    @property
    def nbytes(self) -> int:
        return 4 * (self.total + _ALIGN)


# --------------------------------------------------------------------------------------
# binding


class Scratch:
    """Temporaries for element-wise chains, one set per (shape, slot): commands
    run one at a time, so commands of the same shape share them."""

    def __init__(self, xp):
        self.xp = xp
        self._bufs: dict = {}

    def get(self, shape, slot: int = 0, dtype=np.float32):
        key = (tuple(shape), slot, np.dtype(dtype).str)
        a = self._bufs.get(key)
        if a is None:
            a = self._bufs[key] = self.xp.empty(shape, dtype=dtype)
        return a


class BoundProgram:
    """The commands of one computation bound to one arena buffer (see the module
    docstring).  ``ops`` has the dynamic program's signature: op(executor, matrices)."""

    def __init__(self, program, buf, xp):
        self.buf = buf
        layout = program.layout
        comp = program.computation
        flat = buf.reshape(-1)
        addr = _address(buf)
        base = ((-addr) % 64) // 4 if addr % 4 == 0 else 0
        self.inst_views: list = [None] * len(layout.inst_offset)
        for i, off in enumerate(layout.inst_offset):
            if off >= 0:
                r, c = layout.inst_shape[i]
                o = base + off
                self.inst_views[i] = flat[o:o + r * c].reshape(r, c)
        # what the executor's matrix list holds for arena matrices (never pooled)
        self.inst_ids = frozenset(id(v) for v in self.inst_views if v is not None)
        self.command_types = [c.command_type for c in comp.commands]
        # CUDA graphs (cuda_graph.py): per segment its pieces; the stream they are
        # captured on; per command whether it can be captured (shared by the
        # program's bound copies)
        self.graph_segments: dict = {}
        self.graph_stream = None
        self.capturable: dict = program.capturable
        self._sub_views: dict = {}
        self.scratch = Scratch(xp)
        from engine.runtime.program import (bind_command,  # noqa: PLC0415
                                            matrices_read_dynamically, no_op,
                                            relu_after_product, write_after_zeroing)
        ops = [bind_command(program, self, k, c) for k, c in enumerate(comp.commands)]
        # a zeroing and the propagate that adds to the zeros: one write
        self.zeroings_dropped = write_after_zeroing(program, self, ops)
        # a product and the ReLU of its output: one pass
        self.relus_fused = relu_after_product(program, self, ops)
        # allocation, deallocation and swap commands only keep the executor's matrix
        # list; for matrices that no remaining closure looks up they are dropped
        needed = matrices_read_dynamically(program, ops)
        self.needed = frozenset(needed)     # matrices the executor's list must hold
        subs = comp.submatrices
        for k, c in enumerate(comp.commands):
            if c.command_type in _LIST_OPS and ops[k] is not None:
                ms = [subs[c.arg1].matrix_index]
                if c.command_type == CT.SWAP_MATRIX:
                    ms.append(subs[c.arg2].matrix_index)
                if not any(m in needed for m in ms):
                    ops[k] = no_op
        self.ops = ops
        # per input/output stop, the commands before it that do something:
        # (command index, closure) pairs, and where each command index starts in them
        stops = program.stops
        self.runs: dict[int, list] = {stop: [] for stop in set(stops)}
        for k, op in enumerate(ops):
            if k < stops[k] and op is not no_op:
                self.runs[stops[k]].append((k, op))
        self.run_start = [bisect.bisect_left(self.runs[stops[k]], k, key=lambda e: e[0])
                          for k in range(len(ops) + 1)]

    def view(self, inst: int, s: int, comp):
        """The array of submatrix ``s`` on instance ``inst`` (None if external)."""
        key = (inst, s)
        v = self._sub_views.get(key)
        if v is None:
            whole = self.inst_views[inst]
            if whole is None:
                return None
            sm = comp.submatrices[s]
            if (sm.row_offset == 0 and sm.col_offset == 0 and sm.num_rows == whole.shape[0]
                    and sm.num_cols == whole.shape[1]):
                v = whole
            else:
                v = whole[sm.row_offset:sm.row_offset + sm.num_rows,
                          sm.col_offset:sm.col_offset + sm.num_cols]
            self._sub_views[key] = v
        return v


def _address(buf) -> int:
    try:
        return int(buf.__array_interface__["data"][0])
    except (AttributeError, KeyError, TypeError):
        try:
            return int(buf.data.ptr)      # cupy
        except AttributeError:
            return 0


def arena_shape(layout: StaticLayout) -> tuple[int, int]:
    return (1, layout.total + _ALIGN)


class _IdleArenas:
    """Idle bound programs of executors that have no pool of their own, by
    program, least recently used dropped first beyond ``max_bytes``."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._idle: OrderedDict = OrderedDict()   # (id(program), k) -> (program, bound)
        self._bytes = 0
        self._seq = 0

    def take(self, program):
        with self._lock:
            for key in reversed(self._idle):
                if key[0] == id(program) and self._idle[key][0] is program:
                    _, bound = self._idle.pop(key)
                    self._bytes -= bound.buf.nbytes
                    return bound
        return None

    def give(self, program, bound) -> None:
        with self._lock:
            for key in [k for k, (p, _) in self._idle.items() if p._computation() is None]:
                self._bytes -= self._idle.pop(key)[1].buf.nbytes   # computation gone
            self._seq += 1
            self._idle[(id(program), self._seq)] = (program, bound)
            self._bytes += bound.buf.nbytes
            while self._bytes > self.max_bytes and self._idle:
                _, (_, old) = self._idle.popitem(last=False)
                self._bytes -= old.buf.nbytes

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
            self._bytes = 0


IDLE_ARENAS = _IdleArenas()
