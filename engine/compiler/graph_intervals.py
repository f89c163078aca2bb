"""Kaldi's ComputationGraphBuilder Compute + Prune (nnet-computation-graph.cc) for
the commonest requests on the commonest networks, by interval arithmetic.

When it applies.  Every input of every node is the node's own Index with t mapped by
``t + b`` (Offset in t) or set to a constant (ReplaceIndex(..., t, v)), n and x
unchanged, combined by Append and Sum, possibly inside IfDefined, with Const()s;
components need all their inputs, except statistics components with period 1
(extraction with input and output period 1, pooling with input period 1), which
read a window t + b .. t + b + w and are computable where any of it is; a
recurrence goes through IfDefined (no Failover, no IfDefined around a Sum, no
statistics window inside it).  The request is one segment on an empty graph, its
inputs are on input nodes, and each of its inputs and outputs is, for every n it
has, one range of t at one x (the same for all), each Index once.  The common case
is a whole grid (every n of one range with the same t range): chunk requests
(offline or online, batched, with or without i-vectors) on TDNN, TDNN-F, LSTM,
BLSTM and GRU networks, and the two-sequence request of shortcut compilation on
them.  Otherwise (``_build_sequences``) each n has its own ranges -- a batch of
utterances of different lengths, such as x-vector extraction, whose pooling
window of 10000 frames made the general builds walk 10000 frames per utterance
and node and refuse 16 utterances -- and the n with the same ranges are planned
together: nothing is read across n, so each n's part of the pruned graph is
what its own ranges give.

Why it is exact.  A cindex is computable exactly when its required (not IfDefined)
inputs are, so each node is computable on one t range: the supplied range on
inputs, the intersection of its required inputs' ranges mapped back elsewhere
(sources of required inputs first; a cycle of required inputs is not planned).
Kaldi's pruned graph holds the cindexes reachable from the requested outputs
through used dependencies (a required input always, an IfDefined one where it is
computable), all computable when the outputs are.  Each node's t set is therefore
the union of what its readers ask of it, mapped through the (monotone) t maps and,
for IfDefined inputs, cut to the computable range: consumers first, strongly
connected component by component, a recurrence iterated to its fixed point (in
jumps: once two rounds grow every range alike, the growth goes on alike until a
range meets its computable bound).  Where a t set is not one interval (a gap
between two Offsets' ranges), an input needed is not supplied, something asked for
is not computable or a recurrence does not stop, this module declines and the
array build (engine.compiler.graph_arrays) or Kaldi's own algorithm decides, as
before (they also report the errors).  Ids are Kaldi's canonical ones as the array
build makes them: the inputs in request order, then the rest sorted by (node, t,
x, n); each cindex's dependencies are its distinct used input ids, sorted.  The
work is a few operations per node in plain Python and a fixed number of
whole-array operations, instead of the array build's sweeps of lookups per node.

tests/engine/test_graph_intervals.py compares it with the array build and with
Kaldi's per-cindex algorithm on random networks and requests, the compiler
reference networks, the xconfig networks of tests/data/inference, recurrences
of several shifts and the reference models' chunk requests.
"""

from __future__ import annotations

import numpy as np

from engine.compiler.array_ops import max_reduce, min_reduce
from engine.compiler.graph_nodes import (COMPONENT, DEPS_DESCRIPTOR, DEPS_GENERAL,
                                         DEPS_IDENTITY, DEPS_OFFSETS, INPUT, CindexTable)
from engine.core.cancel import checkpoint
from engine.core.index import K_NO_TIME
from engine.nnet.components.statistics import (StatisticsExtractionComponent,
                                               StatisticsPoolingComponent)
from engine.nnet.descriptors import (BinarySumDescriptor, ConstantSumDescriptor,
                                     OffsetForwardingDescriptor,
                                     OptionalSumDescriptor, ReplaceIndexForwardingDescriptor,
                                     RoundingForwardingDescriptor, SimpleForwardingDescriptor,
                                     SimpleSumDescriptor, SumOp)

# Switch for tests and profiling (the array build is used where this is off).
ENABLED = True

_PLAN_KEY = "graph_interval_plan"
_NO_PLAN = ("no plan",)


class _Plan:
    """Per network (kept with its NodeTable): per node, its inputs as (source node,
    a, b, optional) with the source's t = a * t + b (a is 1 or 0; optional: inside
    IfDefined), or (source node, WINDOW, b, w) for a statistics component reading
    t + b .. t + b + w (w >= 1), distinct, or None for input nodes; the nodes in an
    order where the sources of required inputs come first (for computability); and the
    strongly connected components consumers first, each as (nodes consumers first,
    whether it is a cycle)."""

    __slots__ = ("slots", "is_input", "has_optional", "has_window", "required_first", "sccs",
                 "scc_of", "margin", "num_nodes")

    def __init__(self, slots, is_input, has_optional, has_window, required_first, sccs, scc_of,
                 margin, num_nodes) -> None:
        self.slots = slots
        self.is_input = is_input
        self.has_optional = has_optional
        self.has_window = has_window
        self.required_first = required_first
        self.sccs = sccs
        self.scc_of = scc_of
        self.margin = margin
        self.num_nodes = num_nodes


def _t_map(fd) -> tuple[int, int, int] | None:
    """(source node, a, b) of a forwarding descriptor that maps Index (n, t, x) to
    (node, (n, a * t + b, x)), else None."""
    a, b = 1, 0
    while True:
        kind = type(fd)
        if kind is SimpleForwardingDescriptor:
            return fd.node_index, a, b
        if kind is OffsetForwardingDescriptor:
            o = fd.offset
            if o.n or o.x:
                return None
            b += o.t
        elif kind is ReplaceIndexForwardingDescriptor:
            if fd.variable != "t":
                return None
            a, b = 0, fd.value
        elif kind is RoundingForwardingDescriptor:
            m = fd.t_modulus
            if m != 1:
                if a:
                    return None
                b = b // m * m
        else:
            return None
        fd = fd.src


def _positions(sd, out: list) -> bool:
    """Append (forwarding descriptor, optional) for each input of a descriptor part
    made of Sum()s of inputs, IfDefined(input)s and Const()s; False for anything
    else (Failover, IfDefined of a Sum)."""
    kind = type(sd)
    if kind is SimpleSumDescriptor:
        out.append((sd.src, False))
        return True
    if kind is OptionalSumDescriptor:
        if type(sd.src) is not SimpleSumDescriptor:
            return False
        out.append((sd.src.src, True))
        return True
    if kind is BinarySumDescriptor and sd.op == SumOp.SUM:
        return _positions(sd.src1, out) and _positions(sd.src2, out)
    # a constant is computable everywhere and reads nothing
    return kind is ConstantSumDescriptor


# ``a`` of a window slot (src, WINDOW, b, w): the inputs t + b .. t + b + w, computable
# when any of them is, using those that are (Kaldi's statistics components)
WINDOW = 2


def _window(comp) -> tuple[int, int] | None:
    """(b, w) when ``comp`` reads, for output t, its input at t + b .. t + b + w and is
    computable when any of them is: statistics pooling with input-period 1 and
    statistics extraction with both periods 1 (w = 0: the one input at t).  Other
    periods (inputs every k frames, outputs only at multiples of k) are not planned."""
    if not isinstance(comp, (StatisticsExtractionComponent, StatisticsPoolingComponent)):
        return None
    if comp.input_period != 1 or getattr(comp, "output_period", 1) != 1:
        return None
    if comp.input_rule() is not None:
        return None
    probe = np.array([-7, 0, 1, 5], dtype=np.int64)
    rel = np.asarray(comp.input_times(probe)) - probe[:, None]
    if rel.ndim != 2 or not rel.shape[1] or not (rel == rel[0]).all():
        return None
    steps = rel[0]
    if not (np.diff(steps) == 1).all():
        return None
    return int(steps[0]), int(steps[-1] - steps[0])


def _node_maps(nodes, v: int) -> list | None:
    mode = nodes.deps_mode[v]
    if mode == DEPS_GENERAL:
        win = _window(nodes.component[v]) if nodes.kind[v] == COMPONENT else None
        if win is None:
            return None
        b, w = win
        return [(nodes.src[v], 1, b, False) if w == 0 else (nodes.src[v], WINDOW, b, w)]
    if mode in (DEPS_IDENTITY, DEPS_OFFSETS):
        sh = nodes.shifts[v]
        if sh is None or any(dn or dx for _, dn, _, dx in sh):
            return None
        return [(p, 1, dt, False) for p, _, dt, _ in sh]
    if mode != DEPS_DESCRIPTOR or nodes.fast[v] is None:
        return None
    found: list = []
    for part in nodes.descriptor[v].parts:
        if not _positions(part, found):
            return None
    maps = []
    for fd, optional in found:
        m = _t_map(fd)
        if m is None:
            return None
        maps.append((*m, optional))
    return maps or None


def _make_plan(nodes) -> _Plan | None:
    num = len(nodes.kind)
    slots: list = []
    is_input: list = []
    for v in range(num):
        if nodes.kind[v] == INPUT:
            slots.append(None)
            is_input.append(True)
            continue
        is_input.append(False)
        maps = _node_maps(nodes, v)
        if maps is None:
            return None
        slots.append(tuple(dict.fromkeys(maps)))
    # (a window's w is truthy: windows count as optional inputs where the used inputs
    # are cut to the computable ranges)
    has_optional = any(sl is not None and any(m[3] for m in sl) for sl in slots)
    has_window = any(sl is not None and any(m[1] == WINDOW for m in sl) for sl in slots)
    # sources of required inputs and of windows first (Kahn: a window's computable
    # range is found from its source's); a cycle of required inputs (a recurrence
    # without IfDefined) is not planned
    users: list = [[] for _ in range(num)]
    missing = [0] * num
    for v, sl in enumerate(slots):
        for src in {m[0] for m in sl or () if not m[3] or m[1] == WINDOW}:
            users[src].append(v)
            missing[v] += 1
    ready = [v for v in range(num) if not missing[v]]
    required_first = []
    while ready:
        v = ready.pop()
        required_first.append(v)
        for u in users[v]:
            missing[u] -= 1
            if not missing[u]:
                ready.append(u)
    if len(required_first) < num:
        return None
    # strongly connected components (Kaldi's epochs), consumers first
    epochs = nodes.epochs
    sccs: list = []
    scc_of = [0] * num
    for v in reversed(nodes.order):
        if sccs and epochs[sccs[-1][0][0]] == epochs[v]:
            sccs[-1][0].append(v)
        else:
            sccs.append(([v], False))
        scc_of[v] = len(sccs) - 1
    sccs = [(members, len(members) > 1 or any(m[0] == members[0]
                                               for m in slots[members[0]] or ()))
            for members, _ in sccs]
    # a window inside a recurrence is not planned (the rounds below grow ranges by
    # shifts only)
    if has_window and any(cyclic and any(m[1] == WINDOW for v in members
                                         for m in slots[v] or ())
                          for members, cyclic in sccs):
        return None
    return _Plan(slots, is_input, has_optional, has_window, required_first, sccs, scc_of,
                 tuple(nodes.margin), num)


def plan_for(nodes) -> _Plan | None:
    """The network's plan (None when the network is not one this module handles),
    made once per NodeTable."""
    extra = nodes.extra
    plan = extra.get(_PLAN_KEY, _NO_PLAN)
    if plan is _NO_PLAN:
        plan = extra[_PLAN_KEY] = _make_plan(nodes)
    return plan


def _grid(rows: np.ndarray):
    """(n_lo, n_hi, t_lo, t_hi, x, position of each grid cell (t - t_lo) * num_n +
    (n - n_lo) in ``rows``) when ``rows`` (n, t, x) are a whole grid, each Index
    once; else None."""
    # (array_ops.column_bounds, a column at a time, is slower on a request's few rows:
    # ~7 against ~4 us on 47 x 3)
    lo, hi = min_reduce(rows, 0).tolist(), max_reduce(rows, 0).tolist()
    if lo[2] != hi[2]:
        return None
    num_n = hi[0] - lo[0] + 1
    num = len(rows)
    if num_n * (hi[1] - lo[1] + 1) != num:
        return None
    if num_n == 1:
        cell = rows[:, 1] - lo[1]
    else:
        cell = (rows[:, 1] - lo[1]) * num_n + (rows[:, 0] - lo[0])
    pos = np.full(num, -1, dtype=np.int64)
    pos[cell] = np.arange(num)
    if min_reduce(pos) < 0:
        return None          # an Index repeated (so another is missing)
    return lo[0], hi[0], lo[1], hi[1], lo[2], pos


_INF = 1 << 60
_UNBOUNDED = _INF // 2
_ABSENT = -(1 << 62)     # no range (an n without this input or output)
# More cindexes than this: left to the array build, whose table limits apply.
_MAX_ROWS = 1 << 26
# Rounds over a recurrence before declining (with the jumps below, a recurrence
# takes a handful).
_MAX_ROUNDS = 64


def _computable(plan: _Plan, supplied: dict) -> list:
    """Per node, the t range [lo, hi) where its cindexes are computable (None:
    nowhere; unbounded sides are -_INF, _INF): the supplied range on inputs, the
    intersection of what the required inputs allow elsewhere (IfDefined inputs
    never make a cindex not computable)."""
    slots = plan.slots
    comp: list = [None] * plan.num_nodes
    for v in plan.required_first:
        sl = slots[v]
        if sl is None:
            got = supplied.get(v)
            if got is not None:
                comp[v] = (got[2][2], got[2][3] + 1)
            continue
        lo, hi = -_INF, _INF
        for src, a, b, optional in sl:
            if optional and a != WINDOW:
                continue
            cs = comp[src]
            if cs is None:
                lo = _INF
                break
            if a == WINDOW:
                # t + b .. t + b + w meets the source's range
                if cs[0] - b - optional > lo:
                    lo = cs[0] - b - optional
                if cs[1] - b < hi:
                    hi = cs[1] - b
            elif a:
                if cs[0] - b > lo:
                    lo = cs[0] - b
                if cs[1] - b < hi:
                    hi = cs[1] - b
            elif not cs[0] <= b < cs[1]:
                lo = _INF
                break
        if lo < hi:
            comp[v] = (lo, hi)
    return comp


def _merge(ivs: list):
    """The union of intervals [lo, hi) as one interval, or None when there is a gap."""
    if len(ivs) == 1:
        return ivs[0]
    ivs.sort()
    lo, hi = ivs[0]
    for a, b in ivs[1:]:
        if a > hi:
            return None
        if b > hi:
            hi = b
    return lo, hi


def _spans(plan: _Plan, demand: list, comp, supplied: dict) -> list | None:
    """Per node, the t range [lo, hi) of its cindexes in the pruned graph (None: no
    cindexes), from ``demand`` (the outputs' ranges), or None when some node's t
    set is not one range, an input needed is not supplied, or something asked
    for is not computable.  Consumers first, strongly connected component by
    component; a recurrence (through IfDefined) is iterated to its fixed point."""
    slots, is_input = plan.slots, plan.is_input
    span: list = [None] * plan.num_nodes
    scc_of = plan.scc_of

    def push(v: int, lo: int, hi: int, inside: int) -> None:
        # the ranges v asks of its inputs (only those inside SCC ``inside`` when
        # inside >= 0, only those outside it otherwise)
        for src, a, b, optional in slots[v]:
            if inside >= 0:
                if scc_of[src] != inside:
                    continue
            elif inside == -2 and scc_of[src] == scc_of[v]:
                continue
            if a:
                lo2, hi2 = lo + b, hi + b
                if a == WINDOW:
                    hi2 += optional   # (w; a window uses what is computable, as IfDefined)
            else:
                lo2, hi2 = b, b + 1
            if optional:
                cs = comp[src]
                if cs is None:
                    continue
                if cs[0] > lo2:
                    lo2 = cs[0]
                if cs[1] < hi2:
                    hi2 = cs[1]
                if lo2 >= hi2:
                    continue
            d = demand[src]
            if d is None:
                demand[src] = [(lo2, hi2)]
            else:
                d.append((lo2, hi2))

    def settle(v: int, inside: int) -> bool:
        # v's range from what it was asked (False: not one range), then what v
        # asks of its inputs (``inside`` as for push)
        ivs = demand[v]
        if ivs is None:
            return True
        got = _merge(ivs)
        if got is None:
            return False
        span[v] = got
        demand[v] = [got]
        if not is_input[v]:
            push(v, got[0], got[1], inside)
        return True

    for index, (members, cyclic) in enumerate(plan.sccs):
        if not cyclic:
            if not settle(members[0], -1):
                return None
            continue
        # a recurrence: rounds until nothing grows; when two rounds in a row grow
        # every range by the same amounts, the ranges go on so until one reaches
        # its computable bound, and that many rounds are taken at once
        last = None
        jumped = False
        for _ in range(_MAX_ROUNDS):
            before = [span[v] for v in members]
            for v in members:
                if not settle(v, index):
                    return None
            after = [span[v] for v in members]
            if after == before and not jumped:
                # (each node asked its inputs for what its range was, and every
                # such request was taken in: a fixed point; after a jump, the
                # requests from the new ranges are taken in by the next round)
                break
            jumped = False
            if None in before or None in after:
                last = None
                continue
            step = [(q[0] - p[0], q[1] - p[1]) for p, q in zip(before, after)]
            if step == last:
                k = _INF
                for v, (dl, dh) in zip(members, step):
                    lo, hi = span[v]
                    cs = comp[v] if comp is not None else None
                    if cs is None:
                        return None
                    # (a bound within _UNBOUNDED of infinity is one shifted from
                    # it: the range grows without bound, and Kaldi loops)
                    if dl < 0:
                        if cs[0] <= -_UNBOUNDED:
                            return None
                        k = min(k, (lo - cs[0]) // -dl)
                    if dh > 0:
                        if cs[1] >= _UNBOUNDED:
                            return None
                        k = min(k, (cs[1] - hi) // dh)
                k -= 1
                if k >= 1:
                    for v, (dl, dh) in zip(members, step):
                        lo, hi = span[v]
                        got = (lo + k * dl, hi + k * dh)
                        span[v] = got
                        demand[v].append(got)
                    jumped = True
                last = None
            else:
                last = step
        else:
            return None
        for v in members:
            if span[v] is not None and not is_input[v]:
                push(v, span[v][0], span[v][1], -2)
    # inputs needed must be supplied; with IfDefined, every range must be
    # computable (the outputs' ranges are what could fail)
    for v, got in enumerate(span):
        if got is None:
            continue
        if is_input[v]:
            sup = supplied.get(v)
            if sup is None or got[0] < sup[2][2] or got[1] > sup[2][3] + 1:
                return None
        elif comp is not None:
            cs = comp[v]
            if cs is None or got[0] < cs[0] or got[1] > cs[1]:
                return None
    return span


def build_intervals(builder, request):
    """(coords, is_input, dep_ptr, dep_idx, table) of the request's segment, as
    engine.compiler.graph_arrays.build_arrays gives them, or None where this
    module does not apply (the module docstring says when)."""
    if not ENABLED or len(builder.graph):
        return None
    nodes = builder.nodes
    plan = plan_for(nodes)
    if plan is None:
        return None
    nnet = builder.nnet
    is_input = plan.is_input
    shape = None
    # supplied inputs: node, rows, grid
    supplied: dict[int, tuple] = {}
    in_rows: list = []
    # the Indexes as arrays (inputs, then outputs): validated ones when given
    io_rows = builder.io_rows
    if io_rows is None:
        io_rows = request.index_rows()
    io_nodes = _io_nodes(nnet, request, is_input)
    if io_nodes is None:
        return None
    if plan.has_window:
        return _build_sequences(plan, request, io_rows, io_nodes)
    num_in = len(request.inputs)
    for v, rows in zip(io_nodes[:num_in], io_rows):
        g = _grid(rows)
        if g is None or (shape is not None and g[:2] + g[4:5] != shape):
            return _build_sequences(plan, request, io_rows, io_nodes)
        shape = g[:2] + g[4:5]
        supplied[v] = (len(in_rows), rows, g)
        in_rows.append(rows)
    demand: list = [None] * plan.num_nodes
    for v, rows in zip(io_nodes[num_in:], io_rows[num_in:]):
        g = _grid(rows)
        if g is None or (shape is not None and g[:2] + g[4:5] != shape):
            return _build_sequences(plan, request, io_rows, io_nodes)
        shape = g[:2] + g[4:5]
        demand[v] = [(g[2], g[3] + 1)]
    if shape is None or not supplied:
        return None
    n_lo, n_hi, x0 = shape
    num_n = n_hi - n_lo + 1
    comp = _computable(plan, supplied) if plan.has_optional else None
    span = _spans(plan, demand, comp, supplied)
    if span is None:
        return None
    slots = plan.slots
    # ids: the inputs in request order, then node by node (t, then n)
    base = sum(map(len, in_rows))
    rest = [v for v in range(plan.num_nodes) if span[v] is not None and not is_input[v]]
    lens = [(span[v][1] - span[v][0]) * num_n for v in rest]
    start: dict[int, int] = {}
    # the grid of every node read, end to end: per node, where its cells start in
    # ``cells`` and its lowest t (cell (t - lo) * num_n + (n - n_lo))
    goff: dict[int, int] = {}
    glo: dict[int, int] = {}
    parts = []
    at = 0
    for v, (k, rows, g) in supplied.items():
        goff[v], glo[v] = at, g[2]
        off = sum(map(len, in_rows[:k]))
        parts.append(g[5] + off if off else g[5])
        at += len(rows)
    pos = 0
    for v, m in zip(rest, lens):
        start[v] = pos
        goff[v], glo[v] = at + pos, span[v][0]
        pos += m
    rest_total = pos
    if rest_total > _MAX_ROWS:
        return None      # (the array build's limits decide, and report)
    total = base + rest_total
    parts.append(np.arange(base, total, dtype=np.int64))
    cells = np.concatenate(parts) if len(parts) > 1 else parts[0]
    # coords of the rest: row start[v] + (t - lo) * num_n + (n - n_lo) of node v
    lens_arr = np.array(lens, dtype=np.int64)
    coords = np.empty((total, 4), dtype=np.int64)
    if base:
        coords[:base, 0] = np.repeat(np.array(list(supplied), dtype=np.int64),
                                     [len(r) for r in in_rows])
        coords[:base, 1:] = np.concatenate(in_rows) if len(in_rows) > 1 else in_rows[0]
    coords[base:, 0] = np.repeat(np.array(rest, dtype=np.int64), lens_arr)
    if num_n == 1:
        coords[base:, 1] = n_lo
        # t: the row less one offset per node, start[v] - lo
        coords[base:, 2] = np.arange(rest_total, dtype=np.int64) - np.repeat(
            np.array([start[v] - span[v][0] for v in rest], dtype=np.int64), lens_arr)
    else:
        within = np.arange(rest_total, dtype=np.int64) - np.repeat(
            np.array([start[v] for v in rest], dtype=np.int64), lens_arr)
        t_rel, n_rel = np.divmod(within, num_n)
        coords[base:, 1] = n_rel + n_lo
        coords[base:, 2] = t_rel + np.repeat(np.array([span[v][0] for v in rest],
                                                      dtype=np.int64), lens_arr)
    coords[base:, 3] = x0
    # dependencies: per input (slot) of every node, one block of edges; a slot
    # (src, 1, b) reads cell goff[src] + (lo + b - glo[src]) * num_n + within, a
    # slot (src, 0, b) cell goff[src] + (b - glo[src]) * num_n + within % num_n
    sh_c, sh_s, sh_m = [], [], []        # shift slots: cell base, first row, rows
    rp_c, rp_s, rp_m = [], [], []        # replace slots
    for v, m in zip(rest, lens):
        lo, hi = span[v]
        s = start[v]
        for src, a, b, optional in slots[v]:
            if a:
                t0, t1 = lo, hi
                if optional:
                    # the rows whose input is computable (an interval)
                    cs = comp[src]
                    if cs is None:
                        continue
                    if cs[0] - b > t0:
                        t0 = cs[0] - b
                    if cs[1] - b < t1:
                        t1 = cs[1] - b
                    if t0 >= t1:
                        continue
                sh_c.append(goff[src] + (t0 + b - glo[src]) * num_n)
                sh_s.append(s + (t0 - lo) * num_n)
                sh_m.append((t1 - t0) * num_n)
            else:
                if optional:
                    cs = comp[src]
                    if cs is None or not cs[0] <= b < cs[1]:
                        continue
                rp_c.append(goff[src] + (b - glo[src]) * num_n)
                rp_s.append(s)
                rp_m.append(m)
    src_parts, dst_parts = [], []
    for c, s, m, shift in ((sh_c, sh_s, sh_m, True), (rp_c, rp_s, rp_m, False)):
        if not c:
            continue
        # edge j of block i (the block's j-th row): position first[i] + j of the edges
        m_arr = np.array(m, dtype=np.int64)
        ends = np.cumsum(m_arr)
        first = ends - m_arr
        pos = np.arange(int(ends[-1]), dtype=np.int64)
        # its row (among all cindexes: after the base inputs) and the cell it reads
        row = pos + np.repeat(np.array(s, dtype=np.int64) + (base - first), m_arr)
        if shift:
            cell = pos + np.repeat(np.array(c, dtype=np.int64) - first, m_arr)
        else:
            cell = np.repeat(np.array(c, dtype=np.int64), m_arr)
            if num_n > 1:
                cell += (pos - np.repeat(first, m_arr)) % num_n
        src_parts.append(row)
        dst_parts.append(cells[cell])
    ptr, dst, flags = _csr(src_parts, dst_parts, total, base)
    t_lo = min([sp[0] for sp in span if sp is not None]
               + [g[2] for _, _, g in supplied.values()])
    t_hi = max([sp[1] - 1 for sp in span if sp is not None]
               + [g[3] for _, _, g in supplied.values()])
    return coords, flags, ptr, dst, _table(plan, coords, t_lo, t_hi, n_lo, n_hi, x0)


def _csr(src_parts: list, dst_parts: list, total: int, base: int):
    """(dep_ptr, dep_idx, is_input) of ``total`` cindexes, the first ``base`` the inputs,
    from edges given as blocks of (reading row, id read), each block's rows in order:
    each row's distinct ids, sorted."""
    if src_parts:
        src = np.concatenate(src_parts) if len(src_parts) > 1 else src_parts[0]
        dst = np.concatenate(dst_parts) if len(dst_parts) > 1 else dst_parts[0]
        key = src * total + dst
        # sorted runs (one per block): the stable sort merges them, several times
        # faster than the default sort here
        key.sort(kind="stable")
        if len(key) > 1 and (key[1:] == key[:-1]).any():
            key = np.unique(key)
        src, dst = np.divmod(key, total)
        ptr = np.zeros(total + 1, dtype=np.int64)
        np.add.accumulate(np.bincount(src, minlength=total), out=ptr[1:])
    else:
        ptr, dst = np.zeros(total + 1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    flags = np.zeros(total, dtype=bool)
    flags[:base] = True
    return ptr, dst, flags


def _io_nodes(nnet, request, is_input) -> list[int] | None:
    """The node of each input, then of each output, of the request; None when one is
    not an input (output) node, is named twice or has no Indexes."""
    out: list[int] = []
    for specs, want in ((request.inputs, True), (request.outputs, False)):
        for spec in specs:
            v = nnet.get_node_index(spec.name)
            if v < 0 or is_input[v] != want or v in out or not spec.indexes:
                return None
            out.append(v)
    return out


# Distinct sequence shapes (the t ranges of one n) beyond this many: left to the array
# build (each shape is planned on its own).
_MAX_SHAPES = 4096
# Sequence shapes planned between two asks of the compile's stop hook (engine.core.cancel).
_SHAPES_PER_CHECKPOINT = 64


def _sequences(rows: np.ndarray) -> tuple | None:
    """(ns, lo, hi, x) when ``rows`` (n, t, x) hold, for each n, one range of t, each
    Index once, and one x for all: the distinct n sorted, the first and last t of
    each; else None."""
    x = rows[:, 2]
    if min_reduce(x) != max_reduce(x):
        return None
    n, t = rows[:, 0], rows[:, 1]
    if (t == K_NO_TIME).any():
        return None
    order = np.lexsort((t, n))
    n, t = n[order], t[order]
    new = np.empty(len(n), dtype=bool)
    new[0] = True
    np.not_equal(n[1:], n[:-1], out=new[1:])
    if not ((t[1:] - t[:-1] == 1) | new[1:]).all():
        return None          # a gap or an Index repeated
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(n)) - 1
    return n[first], t[first], t[last], int(x[0])


def _build_sequences(plan: _Plan, request, io_rows: list, io_nodes: list[int]):
    """build_intervals where the request is not one grid: each n has its own t range
    on every input and output (variable-length sequences), or the network has
    statistics windows.  Nothing is read across n (the plan maps t only), so each n's
    part of the pruned graph is what its ranges give alone; the n with the same
    ranges (their "shape") are planned once.  The cindexes are the cells of a dense
    (node, t, n) mask, which np.nonzero lists in the canonical order (inputs in
    request order, then the rest by node, t, n); an id table of the same shape finds
    the dependencies.  Declines (None) where that table would be large against the
    graph (sequences far apart in t)."""
    num_in = len(request.inputs)
    seqs = []
    x0 = None
    for rows in io_rows:
        sq = _sequences(rows)
        if sq is None or (x0 is not None and sq[3] != x0):
            return None
        x0 = sq[3]
        seqs.append(sq)
    if not num_in or len(seqs) == num_in:
        return None
    all_n = np.unique(np.concatenate([sq[0] for sq in seqs]))
    num_n = len(all_n)
    # per n its shape: per input and output, its (lo, hi) or (_ABSENT, _ABSENT)
    table = np.full((num_n, 2 * len(seqs)), _ABSENT, dtype=np.int64)
    for k, (ns, lo, hi, _) in enumerate(seqs):
        at = np.searchsorted(all_n, ns)
        table[at, 2 * k] = lo
        table[at, 2 * k + 1] = hi
    shapes, shape_of = np.unique(table, axis=0, return_inverse=True)
    shape_of = shape_of.reshape(-1)
    if len(shapes) > _MAX_SHAPES:
        return None
    num_nodes = plan.num_nodes
    need_comp = plan.has_optional
    # per shape and node: the span [lo, hi) of the rest (empty for inputs and nodes
    # not in the graph) and, where IfDefined or windows need it, the computable range
    # (empty where nowhere; the bounds, within +-2 * _INF, fit int64)
    span_lo = np.zeros((len(shapes), num_nodes), dtype=np.int64)
    span_hi = np.zeros((len(shapes), num_nodes), dtype=np.int64)
    comp_lo = np.full((len(shapes), num_nodes), _INF, dtype=np.int64)
    comp_hi = np.full((len(shapes), num_nodes), -_INF, dtype=np.int64)
    for p, row in enumerate(shapes.tolist()):
        if p and not p % _SHAPES_PER_CHECKPOINT:
            checkpoint("the interval graph build, per sequence shape")
        supplied: dict[int, tuple] = {}
        demand: list = [None] * num_nodes
        for k, v in enumerate(io_nodes):
            lo, hi = row[2 * k], row[2 * k + 1]
            if lo == _ABSENT:
                continue
            if k < num_in:
                supplied[v] = (k, None, (None, None, lo, hi))
            else:
                demand[v] = [(lo, hi + 1)]
        comp = _computable(plan, supplied) if need_comp else None
        span = _spans(plan, demand, comp, supplied)
        if span is None:
            return None
        for v, sp in enumerate(span):
            if sp is not None and not plan.is_input[v]:
                span_lo[p, v], span_hi[p, v] = sp
        if need_comp:
            for v, cs in enumerate(comp):
                if cs is not None:
                    comp_lo[p, v], comp_hi[p, v] = cs
    # per node and n (n as its position in all_n)
    span_lo, span_hi = span_lo[shape_of].T, span_hi[shape_of].T
    comp_lo, comp_hi = comp_lo[shape_of].T, comp_hi[shape_of].T
    has = span_hi > span_lo
    in_rows = io_rows[:num_in]
    base = sum(map(len, in_rows))
    rest_total = int((span_hi - span_lo)[has].sum())
    if rest_total > _MAX_ROWS:
        return None
    t_lo = min(int(min_reduce(sq[1])) for sq in seqs[:num_in])
    t_hi = max(int(max_reduce(sq[2])) for sq in seqs[:num_in])
    if has.any():
        t_lo = min(t_lo, int(min_reduce(span_lo[has])))
        t_hi = max(t_hi, int(max_reduce(span_hi[has])) - 1)
    num_t = t_hi - t_lo + 1
    total = base + rest_total
    if num_nodes * num_t * num_n > max(1 << 22, 8 * total):
        return None
    # the rest: mask[v, t - t_lo, n] where v's span for n holds t
    tt = np.arange(t_lo, t_hi + 1, dtype=np.int64)[None, :, None]
    mask = (tt >= span_lo[:, None, :]) & (tt < span_hi[:, None, :])
    node, ti, ni = np.nonzero(mask)
    coords = np.empty((total, 4), dtype=np.int64)
    coords[:base, 0] = np.repeat(np.array(io_nodes[:num_in], dtype=np.int64),
                                 [len(r) for r in in_rows])
    coords[:base, 1:] = np.concatenate(in_rows) if len(in_rows) > 1 else in_rows[0]
    coords[base:, 0] = node
    coords[base:, 1] = all_n[ni]
    coords[base:, 2] = ti + t_lo
    coords[base:, 3] = x0
    # ids by (node, t - t_lo, position of n); the inputs' too
    ids = np.full((num_nodes, num_t, num_n), -1, dtype=np.int64)
    ids[node, ti, ni] = np.arange(base, total, dtype=np.int64)
    inp = coords[:base]
    ids[inp[:, 0], inp[:, 2] - t_lo, np.searchsorted(all_n, inp[:, 1])] = np.arange(base)
    flat = ids.reshape(-1)
    # dependencies, node by node (each node's rows are one stretch), slot by slot
    bounds = np.searchsorted(node, np.arange(num_nodes + 1)) + base
    src_parts, dst_parts = [], []
    for v in range(num_nodes):
        r0, r1 = int(bounds[v]), int(bounds[v + 1])
        if r0 == r1:
            continue
        rows = np.arange(r0, r1, dtype=np.int64)
        t, n = ti[r0 - base:r1 - base] + t_lo, ni[r0 - base:r1 - base]
        for src, a, b, optional in plan.slots[v]:
            if optional:
                # the inputs used: those computable (per row, its n's range)
                c0, c1 = comp_lo[src][n], comp_hi[src][n]
                if a == WINDOW:
                    # row i reads t + b .. t + b + w cut to its computable range: count[i]
                    # inputs from first[i] on
                    first = np.maximum(t + b, c0)
                    count = np.minimum(t + b + optional + 1, c1) - first
                    keep = count > 0
                    first, count = first[keep], count[keep]
                    row_of = np.repeat(rows[keep], count)
                    n_of = np.repeat(n[keep], count)
                    ends = np.cumsum(count)
                    ts = (np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64)
                          + np.repeat(first - (ends - count), count))
                else:
                    ts = t + b if a else np.full(len(rows), b, dtype=np.int64)
                    keep = (ts >= c0) & (ts < c1)
                    row_of, n_of, ts = rows[keep], n[keep], ts[keep]
            else:
                row_of, n_of = rows, n
                ts = t + b if a else np.full(len(rows), b, dtype=np.int64)
            if not len(row_of):
                continue
            ts = ts - t_lo
            if int(min_reduce(ts)) < 0 or int(max_reduce(ts)) >= num_t:
                return None      # (not expected: every input used is in the graph)
            got = flat[(src * num_t + ts) * num_n + n_of]
            if int(min_reduce(got)) < 0:
                return None      # (likewise)
            src_parts.append(row_of)
            dst_parts.append(got)
    ptr, dst, flags = _csr(src_parts, dst_parts, total, base)
    return coords, flags, ptr, dst, _table(plan, coords, t_lo, t_hi, int(all_n[0]),
                                           int(all_n[-1]), x0)


def _table(plan: _Plan, coords: np.ndarray, t_lo: int, t_hi: int, n_lo: int, n_hi: int,
           x0: int) -> CindexTable:
    """The graph's lookup table (dense, with the network's margins), made from the
    ranges known here (the cindexes' t in [t_lo, t_hi], n in [n_lo, n_hi], x = x0)
    rather than from the coordinates."""
    mg = plan.margin
    # room in t beyond the margins, as the array build leaves: the steps add
    # cindexes a little outside the graph's t range (a dim-range node's step made
    # like its source's), and a table they do not fit in is made anew
    pad = mg[1] + max(16, (t_hi - t_lo) // 2)
    lo = [n_lo - mg[0], t_lo - pad, x0 - mg[2]]
    hi = [n_hi + mg[0], t_hi + pad, x0 + mg[2]]
    stride_t = hi[2] - lo[2] + 1
    stride_n = (hi[1] - lo[1] + 1) * stride_t
    stride_node = (hi[0] - lo[0] + 1) * stride_n
    cells = plan.num_nodes * stride_node
    num = len(coords)
    if cells > max(CindexTable.MAX_DENSE, 8 * num):
        return CindexTable(coords, plan.num_nodes, plan.margin)
    # (every row's x is x0; one product over the rows is quicker than four columns)
    keys = coords @ np.array([stride_node, stride_n, stride_t, 1], dtype=np.int64)
    keys += -lo[2] - lo[0] * stride_n - lo[1] * stride_t
    table = np.full(cells, -1, dtype=np.int64)
    table[keys] = np.arange(num, dtype=np.int64)
    return CindexTable.from_dense(table, lo, hi, (stride_n, stride_t, stride_node), keys,
                                  plan.margin)


__all__ = ["build_intervals", "plan_for", "ENABLED"]
