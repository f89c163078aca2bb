"""Batched streaming: many Streams of one LoopedModel advanced by one looped
computation, Kaldi's decodable-batch-looped.{h,cc} (DecodableNnetBatchLoopedInfo,
NnetBatchLoopedComputer::AdvanceChunkUntilStable / AdvanceChunk) together with
the NnetComputer::GetState / SetState / GetSnapshot it relies on
(nnet-compute.cc).

As in Kaldi, the looped computation is compiled once per batch size B from
requests whose ``n`` runs over 0..B-1 (``BatchPlan``, cached on the
LoopedModel), and a chunk of B independent streams is computed by gathering
each stream's carried matrices into the rows of the batched computation's
matrices (its ``n`` dimension), running one chunk, and scattering the new state
back into each stream.  A stream's state stays in the single-sequence form its
own executor uses, so a stream can go from batched chunks to ``push`` on its
own, or be exported and imported, at any point.

Where Kaldi differs, and why:

* Kaldi finds the row layout of every state matrix by running the same random
  input in every sequence and testing which of two layouts ("batch first" or
  "time first") repeats; here each row's cindex (node, n, t, x), kept in the
  computation's matrix debug info, says which stream and which row of the
  single-sequence matrix it holds, and the matching single-sequence matrix is the
  one with the same node and (t, x) rows.  A calibration run with different
  random input in each sequence then checks the mapping against streams run
  alone.  Where the two computations carry different matrices (the optimizer
  treated them differently, e.g. around statistics pooling) that phase is not
  batchable: StreamBatcher computes its streams one by one, and a batch size
  whose computation cannot be made at all is not used (``unbatchable``).
* Kaldi batches first chunks apart from the others and squeezes the state left
  by a first chunk into the steady-state shapes by keeping the most recent rows,
  an approximation.  Here streams are grouped by their phase in the looped
  computation (program counter and pending I/O commands of their executor): the
  first chunk, the few chunks before the loop closes, and the steady-state
  chunk(s).  Each group runs from the batched computation's matching phase, so
  every chunk is computed exactly as the stream alone would compute it (up to
  float32 rounding of the larger matrix products).
* The executor's state is read and set through its public state API
  (``Executor.position``, ``matrices``, ``holds_memos``, ``restore_state``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from engine.compiler.computation import debug_rows
from engine.core.errors import InferenceError, StreamError
from engine.inference.looped import compile_looped, create_looped_requests
from engine.inference.stream import LoopedModel, Stream

# Calibration: how far two runs of the same chunk may differ (batched matrix products
# round differently), and how many chunks the looped computation may take to settle.
_CAL_REL_TOL = 2e-3
_CAL_ABS_TOL = 1e-4
_MAX_CAL_CHUNKS = 64


def _new_executor(computation, model: LoopedModel, pool=None):
    from engine.runtime.executor import Executor  # noqa: PLC0415
    return Executor(computation, model.nnet, backend=model.backend,
                    pool=model.pool if pool is None else pool,
                    max_peak_bytes=model.max_peak_bytes)


class _NanPool:
    """A buffer pool for calibration: every matrix starts as NaN and none is reused,
    so rows or columns a computation has not written yet (e.g. the recurrent half
    of a spliced input, filled in the next chunk) read as NaN in both runs and
    are told apart from values that differ."""

    def get(self, xp, num_rows: int, num_cols: int, owner=None):
        return xp.full((num_rows, num_cols), np.nan, dtype=np.float32)

    def release(self, xp, a, owner=None) -> None:
        pass


# -- the batched computation and its state mapping ----------------------------------------------

@dataclass
class _Phase:
    """One phase of the single-stream computation and the batched phase it maps to:
    ``pairs`` lists (single matrix i, batched matrix j, rows) where ``rows[b]`` are
    the rows of matrix j holding stream b's copy of matrix i; None when the two
    computations carry different matrices here (they were optimized differently).
    ``batchable``: this phase and the one after the next chunk both map."""

    single: tuple
    batched: tuple
    pairs: list | None
    reason: str = ""
    batchable: bool = False


def _row_map(computation, m: int, batch_size: int):
    """(key, rows) for matrix m from its debug cindexes: key = (is_deriv, the (node,
    t, x) rows of one sequence), rows = (B, r) row numbers per sequence; None when
    the debug info does not split the rows evenly into B identical sequences."""
    dbg = computation.matrix_debug_info
    num_rows = computation.matrices[m].num_rows
    if m >= len(dbg) or len(dbg[m].cindexes) != num_rows or num_rows % batch_size:
        return None
    a = debug_rows(dbg[m].cindexes)   # (no (node, Index) pairs made for DebugCindexes)
    order = np.argsort(a[:, 1], kind="stable")
    r = num_rows // batch_size
    if not np.array_equal(a[order, 1], np.repeat(np.arange(batch_size), r)):
        return None
    rows = order.reshape(batch_size, r)
    ntx = a[:, [0, 2, 3]][rows]
    if not (ntx == ntx[:1]).all():
        return None
    return (bool(dbg[m].is_deriv), ntx[0].tobytes()), rows


def _close(a: np.ndarray, ref: np.ndarray, same_unset: bool = True) -> bool:
    """Equal up to float32 rounding where both are set; NaN marks what a run has not
    written yet (see _NanPool).  With ``same_unset`` the unwritten parts must agree
    too; without, a part written in one run only passes (the other run overwrites
    it before reading it, so carrying it over changes nothing)."""
    if a.shape != ref.shape:
        return False
    unset_a, unset_r = np.isnan(a), np.isnan(ref)
    if same_unset and not np.array_equal(unset_a, unset_r):
        return False
    both = ~(unset_a | unset_r)
    a, ref = a[both], ref[both]
    if not ref.size:
        return True
    return float(np.abs(a - ref).max()) <= _CAL_ABS_TOL + _CAL_REL_TOL * float(np.abs(ref).max())


class BatchPlan:
    """The looped computation of a LoopedModel compiled for ``batch_size`` sequences
    (Kaldi's DecodableNnetBatchLoopedInfo entry for one batch size), and, for every
    phase a single stream can be in between chunks, the batched phase to start from
    and where each carried matrix goes.  Built by ``batch_plan(model, B)``."""

    def __init__(self, model: LoopedModel, batch_size: int, seed: int = 0):
        if batch_size < 2:
            raise InferenceError(f"a batched looped computation needs at least 2 sequences, "
                                 f"got {batch_size}")
        self.model = model
        self.batch_size = batch_size
        requests = create_looped_requests(model.nnet, model.chunk_size, model.fsf,
                                          model.chunk_size, model.frames_left_context,
                                          model.frames_right_context, batch_size)
        if model.has_ivectors:
            got = [len(r.inputs[1].indexes) for r in requests[:2]]
            if got != [batch_size * c for c in model.num_ivectors]:
                raise InferenceError(f"batched looped requests ask for {got} i-vector rows, "
                                     f"expected {batch_size} x {model.num_ivectors}")
        self.computation = compile_looped(
            model.nnet, *requests, optimize_options=model.optimize_options,
            truncate_future_recurrence=model.config.truncate_future_recurrence)
        self.phases: dict[tuple, _Phase] = {}
        self.following: dict[tuple, tuple] = {}  # single phase -> the one a chunk later
        self._device_rows: dict = {}            # row numbers on a GPU backend, made once
        self._calibrate(np.random.default_rng(seed))

    # -- calibration (Kaldi: AdvanceChunkUntilStable) ---------------------------------------
    def _calibrate(self, rng) -> None:
        """Run the batched computation with different random input per sequence next to
        single streams (the first and last sequence), chunk by chunk until the pair of
        phases repeats; at every phase, map the carried matrices and check the mapped
        values and the outputs against the single streams.  A phase is batchable when
        it maps to one batched phase whose matrices correspond, and so does the phase
        a chunk later."""
        from engine.runtime.backend import to_host  # noqa: PLC0415
        m, nb = self.model, self.batch_size
        sample = sorted({0, nb - 1})
        pool = _NanPool()
        batched = _new_executor(self.computation, m, pool)
        singles = {b: _new_executor(m.computation, m, pool) for b in sample}
        seen: set[tuple] = set()
        conflicts: dict[tuple, str] = {}
        batched_next: dict[tuple, tuple] = {}   # single phase -> batched phase a chunk later
        prev = None
        for k in range(_MAX_CAL_CHUNKS):
            key1 = singles[sample[0]].position
            keyb = batched.position
            if any(singles[b].position != key1 for b in sample):
                raise InferenceError("looped computation: single streams fed different input "
                                     "ended in different phases")
            if batched.holds_memos or any(s.holds_memos for s in singles.values()):
                raise InferenceError("cannot batch streams of this model: its looped "
                                     "computation keeps memos between chunks")
            if prev is not None:
                self.following[prev] = key1
                if batched_next.setdefault(prev, keyb) != keyb:
                    conflicts[prev] = "the batched computation goes on to two different phases"
            prev = key1
            if (key1, keyb) in seen:
                break
            seen.add((key1, keyb))
            if key1 not in self.phases:
                try:
                    pairs, reason = self._map_state(batched, singles, to_host), ""
                except InferenceError as e:
                    pairs, reason = None, str(e)
                self.phases[key1] = _Phase(key1, keyb, pairs, reason)
            elif self.phases[key1].batched != keyb:
                conflicts[key1] = (f"it meets two phases of the {nb}-stream computation (the "
                                   f"two were optimized into loops of different lengths)")
            # one chunk of random input, different in every sequence
            begin, end = m.input_range(k)
            feats = rng.standard_normal((nb, end - begin, m.input_dim)).astype(np.float32)
            ivecs = None
            if m.has_ivectors:
                count = m.num_ivectors[0 if k == 0 else 1]
                ivecs = rng.standard_normal((nb, count, m.ivector_dim)).astype(np.float32)
            out = _run(batched, feats.reshape(-1, m.input_dim),
                       None if ivecs is None else ivecs.reshape(-1, m.ivector_dim), to_host)
            per = out.shape[0] // nb
            for b in sample:
                ref = _run(singles[b], feats[b], None if ivecs is None else ivecs[b], to_host)
                if not _close(out[b * per:(b + 1) * per], ref):
                    raise InferenceError(f"cannot batch streams of this model: chunk {k} of "
                                         f"sequence {b} differs from the stream run alone")
        else:
            raise InferenceError(f"the looped computation did not settle within "
                                 f"{_MAX_CAL_CHUNKS} chunks")
        batched.release()
        for s in singles.values():
            s.release()
        for key1, reason in conflicts.items():
            self.phases[key1].pairs, self.phases[key1].reason = None, reason
        for key1, phase in self.phases.items():
            nxt = self.phases[self.following[key1]]
            phase.batchable = (phase.pairs is not None and nxt.pairs is not None
                               and batched_next[key1] == nxt.batched)
            if phase.pairs is not None and not phase.batchable:
                phase.reason = f"the phase after its chunk does not map: {nxt.reason}"

    def _map_state(self, batched, singles: dict, to_host) -> list:
        """Pairs (i, j, rows) for the matrices live in both executors now."""
        nb = self.batch_size
        sc = self.model.computation
        live1 = [i for i, a in enumerate(next(iter(singles.values())).matrices)
                 if a is not None]
        liveb = [j for j, a in enumerate(batched.matrices) if a is not None]
        if len(live1) != len(liveb):
            raise InferenceError(f"cannot batch streams of this model: {len(live1)} matrices "
                                 f"carried by a single stream, {len(liveb)} by {nb} streams")
        by_key: dict = defaultdict(list)
        for i in live1:
            rm = _row_map(sc, i, 1)
            by_key[None if rm is None else rm[0]].append(i)
        used: set[int] = set()
        pairs = []
        for j in liveb:
            rm = _row_map(self.computation, j, nb)
            rows_b, cols = self.computation.matrices[j][:2]
            same_unset = rm is None or not by_key.get(rm[0])
            if not same_unset:
                cands = [(i, rm[1]) for i in by_key[rm[0]] if i not in used]
            else:
                # no usable debug info: try Kaldi's two layouts on every matrix of the shape
                r = rows_b // nb
                layouts = [np.arange(nb * r).reshape(nb, r), np.arange(nb * r).reshape(r, nb).T]
                cands = [(i, rows) for i in live1 if i not in used
                         and sc.matrices[i].num_rows * nb == rows_b
                         and sc.matrices[i].num_cols == cols for rows in layouts]
            big = to_host(batched.matrices[j])
            good = [(i, rows) for i, rows in cands
                    if all(_close(big[rows[b]], to_host(ex.matrices[i]), same_unset)
                           for b, ex in singles.items())]
            if not good:
                raise InferenceError(f"cannot batch streams of this model: the {nb}-stream "
                                     f"computation's matrix m{j} matches no matrix carried by "
                                     f"a single stream")
            i, rows = good[0]
            used.add(i)
            pairs.append((i, j, rows))
        return pairs

    # -- running ------------------------------------------------------------------------------
    def run(self, streams: list[Stream], inputs: list) -> list[np.ndarray]:
        """One chunk for ``streams`` (at most ``batch_size``, all in the same phase;
        slots beyond them repeat the first stream and are discarded).  ``inputs`` are
        each stream's (features, i-vectors) for the chunk.  Gathers the streams'
        state, runs, scatters the new state back; returns each stream's raw output."""
        from engine.runtime.backend import to_host  # noqa: PLC0415
        m, nb = self.model, self.batch_size
        if not 0 < len(streams) <= nb:
            raise StreamError(f"a batch of {len(streams)} streams for a computation of {nb}")
        phase = self.phases.get(streams[0].executor.position)
        if any(s.executor.position != streams[0].executor.position for s in streams):
            raise StreamError("streams batched together must be at the same phase of the "
                              "looped computation (see StreamBatcher.groups)")
        if phase is None:
            raise StreamError(f"stream is at program counter {streams[0].executor.position[0]}, "
                              f"not between two chunks of the looped computation")
        if not phase.batchable:
            raise StreamError(f"streams at program counter {phase.single[0]} cannot be "
                              f"batched: {phase.reason}")
        slots = list(range(len(streams))) + [0] * (nb - len(streams))
        xp, pool = m.backend, m.pool
        ex = _new_executor(self.computation, m)
        big = [None] * len(self.computation.matrices)
        for p, (i, j, _) in enumerate(phase.pairs):
            parts = xp.concatenate([streams[s].executor.matrices[i] for s in slots], axis=0)
            dest = pool.get(xp, parts.shape[0], parts.shape[1])
            dest[self._rows(phase, p, None)] = parts
            big[j] = dest
        ex.restore_state(phase.batched, big)
        feats = np.concatenate([inputs[s][0] for s in slots], axis=0)
        ivecs = (np.concatenate([inputs[s][1] for s in slots], axis=0)
                 if m.has_ivectors else None)
        out = _run(ex, feats, ivecs, to_host)
        nxt = self.phases[self.following[phase.single]]
        if ex.position != nxt.batched:
            raise StreamError(f"the {nb}-stream computation stopped at program counter "
                              f"{ex.position[0]}, not where the calibration saw it stop")
        for b, s in enumerate(streams):
            own = s.executor.matrices
            new = [None] * len(own)
            for p, (i, j, _) in enumerate(nxt.pairs):
                new[i] = ex.matrices[j][self._rows(nxt, p, b)]   # a fresh array
            for a in own:
                if a is not None:
                    pool.release(xp, a)
            s.executor.restore_state(nxt.single, new)
        ex.release()
        per = out.shape[0] // nb
        return [out[b * per:(b + 1) * per] for b in range(len(streams))]

    def batchable(self, stream: Stream) -> bool:
        """Whether ``stream``'s next chunk can run in this batched computation."""
        phase = self.phases.get(stream.executor.position)
        return phase is not None and phase.batchable

    def _rows(self, phase: _Phase, p: int, b: int | None):
        """Rows of pair p of ``phase``: all, in stream order (b None), or stream b's,
        as an index array of the model's backend."""
        rows = phase.pairs[p][2]
        xp = self.model.backend
        if xp is np:
            return rows.reshape(-1) if b is None else rows[b]
        key = (phase.single, p)
        dev = self._device_rows.get(key)
        if dev is None:
            dev = self._device_rows[key] = (xp.asarray(rows.reshape(-1)),
                                            [xp.asarray(r) for r in rows])
        return dev[0] if b is None else dev[1][b]


def _run(ex, feats, ivecs, to_host) -> np.ndarray:
    ex.accept_input("input", feats)
    if ivecs is not None:
        ex.accept_input("ivector", ivecs)
    ex.run()
    return np.array(to_host(ex.get_output("output")), dtype=np.float32, copy=True)


def batch_plan(model: LoopedModel, batch_size: int) -> BatchPlan:
    """The model's BatchPlan for ``batch_size`` streams, compiled on first use."""
    with model.batch_lock:
        plan = model.batch_plans.get(batch_size)
        if plan is None:
            plan = model.batch_plans[batch_size] = BatchPlan(model, batch_size)
        return plan


# -- the scheduler-facing API -------------------------------------------------------------------

class StreamBatcher:
    """Advances any set of Streams of one LoopedModel, each at its own position, with
    as few batched computations as their phases allow (Kaldi's
    NnetBatchLoopedComputer without the thread and queues: the caller is the
    scheduler).  ``batch_sizes`` (optional) lists the batch sizes that may be
    compiled; a group of n streams then runs in the smallest one >= n, the spare
    sequences repeating a stream (fewer compilations, some wasted arithmetic).
    A group of one stream runs in the stream's own computation."""

    def __init__(self, model: LoopedModel, max_batch_size: int = 16,
                 batch_sizes: list[int] | None = None):
        if model.num_sequences != 1:
            raise InferenceError("StreamBatcher takes the single-stream LoopedModel whose "
                                 "streams it advances")
        if max_batch_size < 1:
            raise InferenceError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if batch_sizes is not None:
            batch_sizes = sorted({int(b) for b in batch_sizes})
            if not batch_sizes or batch_sizes[0] < 1:
                raise InferenceError(f"batch_sizes must be positive, got {batch_sizes}")
            max_batch_size = min(max_batch_size, batch_sizes[-1])
        self.model = model
        self.max_batch_size = max_batch_size
        self.batch_sizes = batch_sizes
        self.num_runs = 0            # computations run (statistics)
        self.unbatchable: dict[int, str] = {}   # batch size -> why no plan could be made

    def _plan(self, size: int) -> BatchPlan | None:
        """The plan for ``size`` streams; None (streams then run one by one) when the
        model cannot be batched at that size, the reason kept in ``unbatchable``."""
        if size in self.unbatchable:
            return None
        try:
            return batch_plan(self.model, size)
        except InferenceError as e:
            self.unbatchable[size] = str(e)
            return None

    def _size_for(self, n: int) -> int:
        if self.batch_sizes is None or n == 1:
            return n
        return next(b for b in self.batch_sizes if b >= n)

    def _check(self, streams) -> None:
        if len({id(s) for s in streams}) != len(streams):
            raise StreamError("the same stream was given twice")
        for s in streams:
            if not isinstance(s, Stream):
                raise StreamError(f"expected Streams, got {type(s).__name__}")
            if s.model is not self.model and s.model.fingerprint != self.model.fingerprint:
                raise StreamError("a stream of another model or chunk configuration was given")

    def groups(self, streams) -> list[list[int]]:
        """How ``step`` would batch ``streams``: the positions of the streams with a
        chunk ready, one list per computation (same phase, at most max_batch_size).
        A scheduler may wait for more streams when the groups are small."""
        streams = list(streams)
        self._check(streams)
        by_phase: dict[tuple, list[int]] = defaultdict(list)
        for idx, s in enumerate(streams):
            if s.next_chunk() is not None:
                by_phase[s.executor.position].append(idx)
        return [members[lo:lo + self.max_batch_size] for members in by_phase.values()
                for lo in range(0, len(members), self.max_batch_size)]

    def step(self, streams) -> list[np.ndarray]:
        """Compute the next chunk of every stream in ``streams`` that has one ready;
        returns each stream's new output rows (empty for the others).  A stream whose
        input has ended (``end_input``) and whose last chunk is computed here ends."""
        streams = list(streams)
        outs = [np.zeros((0, self.model.output_dim), np.float32) for _ in streams]
        for part in self.groups(streams):
            group = [streams[i] for i in part]
            inputs = [s.chunk_inputs(*s.next_chunk()) for s in group]
            size = self._size_for(len(part))
            plan = self._plan(size) if size > 1 else None
            if plan is not None and plan.batchable(group[0]):
                raws = plan.run(group, inputs)
                self.num_runs += 1
            else:
                raws = [s._run_chunk(*x) for s, x in zip(group, inputs)]
                self.num_runs += len(group)
            for s, i, raw in zip(group, part, raws):
                outs[i] = s.take_output(raw)
        for s in streams:
            if not s.finished and s.flushed:
                s._end()
        return outs

    def advance(self, streams) -> list[np.ndarray]:
        """``step`` until no stream has a chunk ready: every output row computable from
        the frames given so far (and, for streams whose input ended, the rest)."""
        streams = list(streams)
        pieces: list[list[np.ndarray]] = [[] for _ in streams]
        while True:
            outs = self.step(streams)
            for p, o in zip(pieces, outs):
                if o.shape[0]:
                    p.append(o)
            if not any(s.chunk_ready for s in streams):
                break
        return [np.concatenate(p, axis=0) if p else
                np.zeros((0, self.model.output_dim), np.float32) for p in pieces]
