"""Looped compilation for streaming: Kaldi's nnet-compile-looped.{h,cc}
(ModifyNnetIvectorPeriod, GetChunkSize, CreateLoopedComputationRequest,
ExtrapolateComputationRequest, CompileLooped) and the set-up half of
DecodableNnetSimpleLoopedInfo (decodable-simple-looped.cc).

A looped computation is compiled from requests for consecutive chunks of one
stream: the first with the left context (plus any extra initial left context)
and the right context, each later one with just the next ``chunk_size`` input
frames.  They are compiled together as segments of one computation, so a later
chunk reuses what earlier chunks computed (recurrent state, left-context
activations).  The optimizer's looped pass (engine.optimizer,
``optimize_looped_computation``) then finds two segments whose live matrices
are the same up to the time shift, cuts the command list there and closes it
with swap commands and a goto: run once, it computes the first chunk(s) and
then repeats the steady-state chunk for ever.  If the repetition is not found
with N requests, N is doubled (5, 10, 20, ... up to 100), as Kaldi does.

I-vectors: a network reading ``ReplaceIndex(ivector, t, 0)`` wants one
i-vector per sequence at t=0, which a stream cannot give before it has seen the
data; ModifyNnetIvectorPeriod rewrites it to ``Round(ivector, period)`` so that
each chunk supplies i-vectors for its own (rounded) times.

Two checks make failures fast and clear (Kaldi has neither; it would retry up
to 100 requests or run a broken computation):

- ``find_future_recurrence``, before compiling: a recurrence whose time offsets
  add up to a positive shift (a backward LSTM reading ``Offset(r, 1)``) makes
  every output depend on all later frames, which no chunked computation can
  give; InferenceError names the nodes and the shift.  Kaldi's looped decodable
  runs such a network anyway, the recurrence cut at each chunk's end (its
  ``IfDefined`` finds nothing there), so that the output depends on the chunk
  size; ``LoopedConfig(truncate_future_recurrence=True)`` asks for exactly that
  (checked against Kaldi's DecodableNnetSimpleLooped on the reference BLSTM).
- ``check_looped_computation``, after compiling: no command may read a matrix
  before the command that creates it (in the multi-segment compilation an
  optional input such as ``Failover(Offset(x, 1), x)`` at a chunk's last frame
  can be resolved to a cindex that only the next chunk computes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.compiler.request import ComputationRequest, IoSpecification
from engine.core.errors import InferenceError
from engine.core.index import K_NO_TIME, Index


def get_chunk_size(nnet, frame_subsampling_factor: int, advised_chunk_size: int) -> int:
    """Kaldi's GetChunkSize: the smallest size >= the advised one that is a multiple of
    the network's modulus and of the frame-subsampling factor."""
    if frame_subsampling_factor < 1:
        raise InferenceError(f"frame_subsampling_factor: must be >= 1, got "
                             f"{frame_subsampling_factor}")
    if advised_chunk_size < 1:
        raise InferenceError(f"chunk size must be >= 1, got {advised_chunk_size}")
    step = math.lcm(nnet.modulus(), frame_subsampling_factor)
    return -(-advised_chunk_size // step) * step


def modify_nnet_ivector_period(nnet, ivector_period: int):
    """Kaldi's ModifyNnetIvectorPeriod on a copy of ``nnet``: every component-node
    line reading ``ReplaceIndex(X, t, 0)`` reads ``Round(X, ivector_period)``
    instead.  Returns the (possibly unchanged) copy."""
    from engine.nnet.config import apply_config  # noqa: PLC0415
    if ivector_period <= 0:
        raise InferenceError(f"i-vector period must be > 0, got {ivector_period}")
    out = nnet.copy()
    changed = []
    for line in out.config_lines():
        if not line.startswith("component-node"):
            continue
        pos = line.find("ReplaceIndex(")
        if pos < 0:
            continue
        end = line.find(", t, 0)", pos)
        if end < 0:
            raise InferenceError(f"cannot rewrite the ReplaceIndex expression for looped "
                                 f"computation in: {line}")
        inner = line[pos + len("ReplaceIndex("):end]
        changed.append(line[:pos] + f"Round({inner}, {ivector_period})"
                       + line[end + len(", t, 0)"):])
    if changed:
        apply_config(out, "\n".join(changed) + "\n", source="<ivector-period>")
    return out


def _request(begin_in: int, end_in: int, begin_out: int, end_out: int, num_sequences: int,
             fsf: int, ivector_times: list[int]) -> ComputationRequest:
    # As in Kaldi's requests, n has the larger stride (one block of rows per sequence).
    inputs = [IoSpecification("input", [Index(n, t, 0) for n in range(num_sequences)
                                        for t in range(begin_in, end_in)])]
    if ivector_times:
        inputs.append(IoSpecification("ivector", [Index(n, t, 0) for n in range(num_sequences)
                                                  for t in ivector_times]))
    outputs = [IoSpecification("output", [Index(n, t, 0) for n in range(num_sequences)
                                          for t in range(begin_out, end_out, fsf)])]
    return ComputationRequest(inputs, outputs)


def create_looped_requests(nnet, chunk_size: int, frame_subsampling_factor: int,
                           ivector_period: int, left_context_begin: int, right_context: int,
                           num_sequences: int = 1) -> tuple[ComputationRequest, ...]:
    """Kaldi's CreateLoopedComputationRequest: the requests for the first three
    chunks.  ``left_context_begin`` is the network's left context plus the extra
    initial left context; each chunk asks for i-vectors only at the rounded times
    that no earlier chunk covered."""
    has_ivector = nnet.get_node_index("ivector") >= 0
    if (chunk_size % frame_subsampling_factor or chunk_size % nnet.modulus()
            or (has_ivector and chunk_size % ivector_period)):
        raise InferenceError(f"chunk size {chunk_size} must be a multiple of the subsampling "
                             f"factor, the network modulus and the i-vector period")
    if left_context_begin < 0 or right_context < 0:
        raise InferenceError("contexts must be >= 0")
    bounds = [(-left_context_begin, chunk_size + right_context)]
    for _ in range(2):
        b = bounds[-1][1]
        bounds.append((b, b + chunk_size))
    seen: set[int] = set()
    requests = []
    for k, (b, e) in enumerate(bounds):
        times: list[int] = []
        if has_ivector:
            for t in range(b, e):
                it = t - t % ivector_period   # Python's % is Kaldi's Mod() (non-negative)
                if it not in seen:
                    seen.add(it)
                    times.append(it)
            times.sort()
        requests.append(_request(b, e, k * chunk_size, (k + 1) * chunk_size, num_sequences,
                                 frame_subsampling_factor, times))
    return tuple(requests)


def shift_request(request: ComputationRequest, t_offset: int) -> ComputationRequest:
    """Kaldi's AddTimeOffsetToComputationRequest, on a copy."""
    def shift(spec):
        return IoSpecification(spec.name, [Index(i.n, i.t + t_offset, i.x)
                                           for i in spec.indexes], spec.has_deriv)
    return ComputationRequest([shift(s) for s in request.inputs],
                              [shift(s) for s in request.outputs],
                              request.need_model_derivative, request.store_component_stats)


def extrapolate_request(request1: ComputationRequest, request2: ComputationRequest
                        ) -> ComputationRequest:
    """Kaldi's ExtrapolateComputationRequest: the next request of the sequence, given
    two that differ only by a time offset."""
    offset = request2.inputs[0].indexes[0].t - request1.inputs[0].indexes[0].t
    if shift_request(request2, -offset) != request1:
        raise InferenceError("looped compilation: consecutive chunk requests differ by more "
                             "than a time offset")
    return shift_request(request2, offset)


def _positive_cycle(vertices: list, edges: list[tuple[int, int, int]]) -> list[int] | None:
    """A cycle of positive total weight in the graph (vertex indexes along it), or
    None: Bellman-Ford on the negated weights, then walking back from a vertex
    still relaxed in round |V| to land on the cycle."""
    n = len(vertices)
    dist = [0] * n
    pred = [-1] * n
    last = -1
    for _ in range(n):
        last = -1
        for a, b, w in edges:
            if dist[a] + w > dist[b]:
                dist[b] = dist[a] + w
                pred[b] = a
                last = b
        if last < 0:
            return None
    v = last
    for _ in range(n):
        v = pred[v]
    cycle, u = [v], pred[v]
    while u != v:
        cycle.append(u)
        u = pred[u]
    return cycle[::-1]


def find_future_recurrence(nnet, output_name: str = "output") -> str | None:
    """Why ``nnet`` cannot be computed in a looped way, or None: a recurrence among
    the nodes ``output_name`` depends on whose time offsets add up to a positive
    shift (node X at t needs X at t + d, d > 0, as in the backward half of a
    BLSTM).  Then each output depends on every later frame of the utterance, and
    a chunk can only truncate that dependency.

    Vertices are (node, t mod modulus), so that Round() and clockwork offsets
    are exact; edge weights are the t offsets of each node's dependencies."""
    from engine.nnet.graph import (cindex_dependencies, find_sccs,  # noqa: PLC0415
                                   graph_transpose, nnet_to_directed_graph)
    from engine.core.index import Cindex  # noqa: PLC0415
    from engine.nnet.components.base import MiscComputationInfo  # noqa: PLC0415
    out = nnet.get_node_index(output_name)
    if out < 0:
        return None
    graph = nnet_to_directed_graph(nnet)
    needed, stack, rev = {out}, [out], graph_transpose(graph)
    while stack:
        for d in rev[stack.pop()]:
            if d not in needed:
                needed.add(d)
                stack.append(d)
    mod = nnet.modulus()
    misc = MiscComputationInfo()
    for scc in find_sccs(graph):
        if not needed.issuperset(scc) or (len(scc) == 1 and scc[0] not in graph[scc[0]]):
            continue
        members = set(scc)
        vertices = [(node, r) for node in scc for r in range(mod)]
        vid = {v: i for i, v in enumerate(vertices)}
        edges = []
        for (node, r), i in vid.items():
            for dep in cindex_dependencies(nnet, Cindex(node, Index(0, r, 0)), misc):
                if dep.node in members and dep.index.t != K_NO_TIME:
                    edges.append((i, vid[(dep.node, dep.index.t % mod)], dep.index.t - r))
        cycle = _positive_cycle(vertices, edges)
        if cycle is not None:
            steps = [(vertices[a][0], vertices[b][0], w) for a, b, w in edges
                     if a in cycle and b in cycle
                     and cycle.index(b) == (cycle.index(a) + 1) % len(cycle)]
            shift = sum(w for _, _, w in steps)
            ahead = [f"{nnet._user_name(a)} reads {nnet._user_name(b)} at t+{w}"
                     for a, b, w in steps if w > 0]
            names = [nnet._user_name(i) for i in dict.fromkeys(x for x, _, _ in steps)
                     if not nnet.is_component_input_node(i)]
            more = f" (+{len(names) - 6} more)" if len(names) > 6 else ""
            return (f"the recurrence through {', '.join(names[:6])}{more} depends on its own "
                    f"value {shift} frame(s) later ({'; '.join(ahead[:3])}), e.g. a backward "
                    f"LSTM: each output depends on all later frames, which a looped "
                    f"(streaming) computation cannot give")
    return None


def check_loopable(nnet, output_name: str = "output") -> None:
    """InferenceError naming the reason when ``nnet`` cannot be streamed."""
    why = find_future_recurrence(nnet, output_name)
    if why is not None:
        # (whole-utterance inference: engine.inference.Inferencer, the service's /infer)
        raise InferenceError(f"looped compilation is not possible: {why}; use "
                             f"whole-utterance inference instead, or, for what "
                             f"Kaldi's looped decodable computes (that recurrence cut at "
                             f"each chunk's end, the output then depending on the chunk "
                             f"size), set truncate_future_recurrence")


def check_looped_computation(computation, nnet) -> None:
    """InferenceError when a command reads a matrix before the command that creates
    it (allocation or user input): in a looped computation that is a chunk reading
    what only a later chunk computes, which would fail (or read stale data) at run
    time.  Then the whole checker (engine.optimizer.checker) runs."""
    from engine.compiler.computation import CommandType as CT  # noqa: PLC0415
    from engine.compiler.computation import submatrix_accesses  # noqa: PLC0415
    creators = (CT.ALLOC_MATRIX, CT.ACCEPT_INPUT, CT.SWAP_MATRIX)
    cmds, subs = computation.commands, computation.submatrices
    segment_of, accessed, created_at = [], [], {}
    segment = 0
    for i, cmd in enumerate(cmds):
        segment += cmd.command_type == CT.NO_OPERATION_MARKER
        segment_of.append(segment)
        ms = [subs[s].matrix_index for s, _ in submatrix_accesses(computation, cmd)]
        accessed.append(ms)
        if cmd.command_type in creators:
            for m in ms:
                created_at.setdefault(m, i)
    for i, ms in enumerate(accessed):
        for m in ms:
            c = created_at.get(m)
            if c is not None and c <= i:
                continue
            what = f"m{m}"
            dbg = computation.matrix_debug_info
            if m < len(dbg) and dbg[m].cindexes:
                node, idx = dbg[m].cindexes[0]
                what += f" ({nnet.nodes[node].name} from t={idx[1]})"
            made = (f", which only chunk segment {segment_of[c]} creates (c{c})"
                    if c is not None else ", which nothing creates")
            raise InferenceError(
                f"looped compilation produced an invalid computation: "
                f"'{computation.command_string(i, nnet).strip()}' in chunk segment {segment_of[i]} "
                f"reads {what}{made}.  An optional input (IfDefined/Failover, or a "
                f"component that accepts missing inputs) of one chunk was resolved to "
                f"something only a later chunk computes.")
    from engine.core.errors import CheckError  # noqa: PLC0415
    from engine.optimizer.checker import check_computation  # noqa: PLC0415
    try:
        check_computation(nnet, computation)
    except CheckError as e:
        raise InferenceError(f"looped compilation produced an invalid computation: {e}"
                             ) from None


def compile_looped(nnet, request1, request2, request3, optimize_options=None,
                   max_requests: int = 100, truncate_future_recurrence: bool = False):
    """Kaldi's CompileLooped: compile 5, 10, 20, ... chunk requests as segments and
    optimize with ``optimize_looped_computation`` until the computation ends in a
    goto.  Raises InferenceError up front for a network that cannot be looped
    (``check_loopable``, unless ``truncate_future_recurrence``: see the module
    docstring), when no loop forms, and when the looped
    computation is invalid (``check_looped_computation``)."""
    from dataclasses import replace  # noqa: PLC0415

    from engine.compiler.compiler import compile_computation  # noqa: PLC0415
    from engine.compiler.computation import CommandType as CT  # noqa: PLC0415
    from engine.optimizer import OptimizeOptions, optimize  # noqa: PLC0415
    if not truncate_future_recurrence:
        check_loopable(nnet)
    opts = replace(optimize_options or OptimizeOptions(), optimize_looped_computation=True)
    num = 5
    while num <= max_requests:
        requests = [request1, request2, request3]
        while len(requests) < num:
            requests.append(extrapolate_request(requests[-2], requests[-1]))
        computation = compile_computation(nnet, requests)
        computation = optimize(computation, nnet, opts, request=requests[2])
        if computation.commands and computation.commands[-1].command_type == CT.GOTO_LABEL:
            check_looped_computation(computation, nnet)
            return computation
        num *= 2
    raise InferenceError(f"looped compilation failed with {num // 2} chunk requests: the "
                         f"network's state does not repeat from chunk to chunk")


@dataclass(frozen=True)
class LoopedConfig:
    """Kaldi's NnetSimpleLoopedComputationOptions (the fields that shape the
    computation)."""

    frames_per_chunk: int = 20
    extra_left_context_initial: int = 0
    frame_subsampling_factor: int = 1
    # a recurrence reading later frames (a BLSTM's backward half) is cut at each
    # chunk's end, as Kaldi's looped decodable does, instead of refused
    truncate_future_recurrence: bool = False

    def check(self) -> None:
        if self.frames_per_chunk < 1:
            raise InferenceError(f"frames_per_chunk: the chunk size must be >= 1, got "
                                 f"{self.frames_per_chunk}")
        if self.extra_left_context_initial < 0:
            raise InferenceError(f"extra_left_context_initial: must be >= 0, got "
                                 f"{self.extra_left_context_initial}")
        if self.frame_subsampling_factor < 1:
            raise InferenceError(f"frame_subsampling_factor: must be >= 1, got "
                                 f"{self.frame_subsampling_factor}")
