"""Streaming inference: Kaldi's DecodableNnetSimpleLoopedInfo and
DecodableNnetSimpleLooped (decodable-simple-looped.{h,cc}), turned into a push
interface whose state can be exported and imported.

``LoopedModel`` prepares the network (test mode, collapsing when available,
i-vector period = chunk size), works out the chunk size and contexts, and
compiles the looped computation once (engine.inference.looped).  Each
``Stream`` runs that computation with its own executor: chunk k needs input
frames [-left, C + right) for k = 0 and [kC + right, (k+1)C + right) after
that (C the chunk size, ``left`` the network's left context plus
``extra_left_context_initial``); a chunk is computed as soon as its frames have
all arrived, and ``finish()`` computes the remaining chunks with the last frame
repeated (frames before 0 repeat frame 0), keeping only the output rows of the
utterance's ceil(T / subsampling) subsampled frames.  I-vectors, for networks
with an 'ivector' input, come one of two ways:

- per utterance: ``stream(ivector)``; ``push(frames, ivector)`` may replace it
  for the chunks computed from then on;
- online, as Kaldi's looped decodable takes an online i-vector matrix:
  ``stream(online_ivector_period=P)`` and ``push(frames, online_ivectors=rows)``
  appending rows (row r describes input frames up to r*P).  Chunk k reads row
  min(end_k // P, rows - 1), end_k being one past its last input frame (Kaldi's
  GetCurrentIvector with end_input_frame), so a chunk also waits for that row
  unless the input has ended.  Pushed in any pieces, the output equals Kaldi's
  DecodableNnetSimpleLooped given the whole matrix.

The chunk's i-vector is repeated for each i-vector time its request lists.

State: what the executor holds between chunks (the carried matrices, its
program counter and pending I/O commands) plus the buffered input frames and
counters.  ``export_state()`` writes it as an .npz byte string (no pickle)
stamped with a fingerprint of the model and configuration; importing it into a
Stream of an equal LoopedModel (in another process) continues bit-identically.
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
import weakref
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np

from engine.core.errors import Cancelled, InferenceError, StreamError
from engine.core.finite import as_float32
from engine.inference.common import (as_features, as_rows, check_acoustic_scale, check_simple,
                                     log_priors, prepare_nnet, require_finite, scale_output,
                                     simple_context)
from engine.inference.looped import (LoopedConfig, compile_looped, create_looped_requests,
                                     find_future_recurrence, get_chunk_size,
                                     modify_nnet_ivector_period)

STATE_VERSION = 1
# the Python objects a stream's executor binds per command of its looped computation
# (fast-path closures and their views: 330-450 bytes per command measured, CPython 3.11)
_BOUND_BYTES_PER_COMMAND = 512


class LoopedModel:
    """A network compiled for streaming with one chunk configuration (Kaldi's
    DecodableNnetSimpleLoopedInfo).  Thread-safe to share between streams."""

    def __init__(self, nnet, config: LoopedConfig = LoopedConfig(), priors=None,
                 use_priors: bool = False, backend=np, collapse: bool = True,
                 optimize_options=None, num_sequences: int = 1,
                 max_peak_bytes: int | None = None, pool=None):
        """``max_peak_bytes``: a looped computation needing more matrix memory at its
        peak is refused (ResourceLimitError) here, and by the executors of its
        streams, before anything is allocated.  ``pool``: the BufferPool its streams'
        matrices are kept in between chunks (shared by many looped models, it bounds
        what they keep together); a pool of its own when None."""
        config.check()
        if num_sequences < 1:
            raise InferenceError(f"num_sequences must be >= 1, got {num_sequences}")
        self.num_sequences = num_sequences
        check_simple(nnet, "output")
        self.config = config
        prepared = prepare_nnet(nnet, collapse=collapse)
        left, right = simple_context(prepared, "output")
        self.frames_left_context = left + config.extra_left_context_initial
        self.frames_right_context = right
        self.fsf = config.frame_subsampling_factor
        self.chunk_size = get_chunk_size(prepared, self.fsf, config.frames_per_chunk)
        self.has_ivectors = prepared.get_node_index("ivector") >= 0
        self.ivector_dim = prepared.input_dim("ivector") if self.has_ivectors else 0
        if self.has_ivectors:
            # a copy (writeable again): frozen like prepare_nnet's (engine/runtime/gemm.py)
            prepared = modify_nnet_ivector_period(prepared, self.chunk_size).freeze_parameters()
        self.nnet = prepared
        self.input_dim = prepared.input_dim("input")
        self.output_dim = prepared.output_dim("output")
        self.log_priors = log_priors(priors, self.output_dim) if use_priors else None
        if use_priors and priors is None:
            raise InferenceError("use_priors: asked for, but the model has no priors (a .mdl "
                                 "is needed)")
        self.requests = create_looped_requests(prepared, self.chunk_size, self.fsf,
                                               self.chunk_size, self.frames_left_context,
                                               self.frames_right_context, num_sequences)
        self.num_ivectors = ([len(r.inputs[1].indexes) // num_sequences
                              for r in self.requests[:2]]
                             if self.has_ivectors else [0, 0])
        # why the output depends on the chunk size (a recurrence cut at each chunk's
        # end, config.truncate_future_recurrence), or None
        self.truncation = (find_future_recurrence(prepared, "output")
                           if config.truncate_future_recurrence else None)
        self.computation = compile_looped(
            prepared, *self.requests, optimize_options=optimize_options,
            truncate_future_recurrence=config.truncate_future_recurrence)
        self.backend = backend
        self.optimize_options = optimize_options
        self.max_peak_bytes = max_peak_bytes
        if max_peak_bytes is not None:
            from engine.runtime.executor import check_peak_bytes  # noqa: PLC0415
            check_peak_bytes(self.computation, max_peak_bytes)
        # batched looped computations (engine.inference.batch.BatchPlan), by batch size
        self.batch_plans: dict = {}
        self.batch_lock = threading.Lock()
        from engine.runtime.backend import BufferPool  # noqa: PLC0415
        self.pool = BufferPool() if pool is None else pool
        self.fingerprint = self._fingerprint()

    def _fingerprint(self) -> str:
        from engine.nnet.model_io import nnet_to_bytes  # noqa: PLC0415
        h = hashlib.sha256()
        h.update(nnet_to_bytes(self.nnet, binary=True))
        h.update(json.dumps([self.num_sequences, self.chunk_size, self.frames_left_context,
                             self.frames_right_context, self.fsf,
                             *(["truncated"] if self.config.truncate_future_recurrence
                               else []),
                             len(self.computation.commands),
                             len(self.computation.matrices),
                             None if self.log_priors is None else
                             hashlib.sha256(self.log_priors.tobytes()).hexdigest()]).encode())
        return h.hexdigest()

    def stream_bytes(self) -> int:
        """What one Stream of this model holds, in bytes, at most (the figure a server
        budgets an open stream at): its executor's matrices, at most the looped
        computation's peak (``peak_bytes``: the state carried between chunks
        included), the Python objects it binds per command of the computation (fast
        paths and views, engine.runtime.program), the chunk's input and i-vector
        matrices it is given (which peak_bytes leaves out), and the input frames the
        stream buffers for its next chunk (one chunk's input range).

        Not in it: what all the model's streams share (the compiled computation, its
        plans); the matrices released back to the model's BufferPool between chunks,
        which the pool's own bound covers (each stream's kept apart for it: the
        BufferPool owners); the frames and rows an online i-vector
        stream buffers while its chunks wait for their rows (its caller bounds those).
        Nor, where the pool drops released buffers (beyond its max_bytes), the
        buffers of the stream's last chunks that its bound fast paths still refer to:
        up to sixteen times every matrix its propagates read and write (the bindings
        each command keeps: engine.runtime.program._bound_for), for each of the up to
        five threads the stream was last pushed from (Executor._switch_thread).  Nor the
        copies a push or finish makes of the matrices held between chunks (to undo
        itself: Stream.push) while it runs: they are taken from the pool and given back
        when it returns, so they count once per push running at a time, not per open
        stream.  Measured with tracemalloc in tests/engine/test_stream_bytes.py."""
        from engine.runtime.executor import peak_bytes_of  # noqa: PLC0415
        comp = self.computation
        frames = self.chunk_size + self.frames_left_context + self.frames_right_context
        ivector_rows = max(self.num_ivectors) * self.num_sequences + 1
        return (peak_bytes_of(comp) + _BOUND_BYTES_PER_COMMAND * len(comp.commands)
                + 4 * self.num_sequences * 2 * frames * self.input_dim
                + 4 * ivector_rows * self.ivector_dim)

    def input_range(self, k: int) -> tuple[int, int]:
        """[begin, end) of the input frames chunk k reads."""
        if k == 0:
            return -self.frames_left_context, self.chunk_size + self.frames_right_context
        b = k * self.chunk_size + self.frames_right_context
        return b, b + self.chunk_size

    def stream(self, ivector=None, online_ivector_period: int | None = None,
               acoustic_scale: float = 1.0) -> "Stream":
        """A new stream: with a per-utterance ``ivector``, or with online i-vector rows
        pushed every ``online_ivector_period`` input frames (see the module docstring);
        its outputs (log priors subtracted first when the model uses them) are
        multiplied by ``acoustic_scale``, as in Kaldi's looped decodable."""
        if self.num_sequences != 1:
            raise InferenceError(f"this LoopedModel runs {self.num_sequences} sequences at "
                                 f"once; use StreamBatch")
        return Stream(self, ivector, online_ivector_period, acoustic_scale)

    def import_stream(self, state: bytes, acoustic_scale: float | None = None) -> "Stream":
        """A Stream continuing from ``state`` (written by Stream.export_state), with the
        acoustic scale the state records.  A caller that knows the scale the stream was
        opened with may pass it: a state that records another one is refused, and a
        state written without one (an earlier version) takes it."""
        return Stream._from_state(self, state, acoustic_scale)


def check_online_period(model: LoopedModel, period, ivector) -> int:
    """The online i-vector period asked for (0: none), checked against the model and
    against a per-utterance ``ivector`` given as well."""
    if period is None:
        return 0
    if not model.has_ivectors:
        raise InferenceError("online_ivector_period: the network has no 'ivector' input")
    if isinstance(period, bool) or not isinstance(period, (int, np.integer)) or period < 1:
        raise InferenceError(f"online_ivector_period: must be a positive integer, got "
                             f"{period!r}")
    if ivector is not None:
        raise InferenceError("online_ivector_period: give either a per-utterance "
                             "i-vector or an online_ivector_period (online i-vector "
                             "rows), not both")
    return int(period)


def check_online_rows(model: LoopedModel, rows) -> np.ndarray:
    """Online i-vector rows as a float32 matrix of the model's i-vector dimension."""
    a = as_rows(rows, model.ivector_dim, np.float32)
    if a.ndim == 1 and a.shape[0] == model.ivector_dim:
        a = a[None, :]
    if a.ndim != 2 or a.shape[1] != model.ivector_dim:
        raise InferenceError(f"online_ivectors: expected rows of dimension "
                             f"{model.ivector_dim}, got an array of shape {np.shape(rows)}")
    require_finite(a, "online_ivectors")
    return a


def check_ivector(model: LoopedModel, ivector):
    """A per-utterance i-vector as a float32 copy (None for a network without one)."""
    if not model.has_ivectors:
        if ivector is not None:
            raise InferenceError("ivector: the network has no 'ivector' input but an "
                                 "i-vector was given")
        return None
    if ivector is None:
        raise InferenceError(f"ivector: the network expects an i-vector of dimension "
                             f"{model.ivector_dim} but none was given")
    v = as_float32(ivector).reshape(-1)
    if v.shape[0] != model.ivector_dim or np.ndim(ivector) > 2:
        raise InferenceError(f"ivector: the network expects dimension {model.ivector_dim}, "
                             f"got an array of shape {np.shape(ivector)}")
    require_finite(v, "ivector")
    return v.copy()


def online_row(end: int, period: int, num_rows: int) -> int:
    """The online i-vector row a chunk whose input ends before frame ``end`` reads
    (Kaldi's looped decodable: end // period, the last row when there are fewer)."""
    return min(end // period, num_rows - 1)


def has_online_row(end: int, period: int, num_rows: int) -> bool:
    """Whether that row has arrived (a chunk waits for it until the input ends)."""
    return num_rows > end // period


class Stream:
    """One utterance fed in pieces: ``push(frames)`` returns the output rows that
    became computable, ``finish()`` the rest."""

    def __init__(self, model: LoopedModel, ivector=None, online_ivector_period=None,
                 acoustic_scale: float = 1.0):
        self.model = model
        self.acoustic_scale = check_acoustic_scale(acoustic_scale)
        # online i-vectors: the period, the rows kept (from row ``online_start`` on)
        self.online_period = check_online_period(model, online_ivector_period, ivector)
        self.online_rows = (np.zeros((0, model.ivector_dim), dtype=np.float32)
                            if self.online_period else None)
        self.online_start = 0
        self.online_received = 0
        self.ivector = None if self.online_period else check_ivector(self.model, ivector)
        self.executor = _own_executor(self, model)
        self.buffer = np.zeros((0, model.input_dim), dtype=np.float32)
        self.buffer_start = 0        # frame index of buffer[0]
        self.num_received = 0
        self.chunks_computed = 0
        self.num_emitted = 0         # subsampled output rows returned so far
        self.input_ended = False     # end_input()/finish(): the right edge may be flushed
        self.finished = False

    # -- pushing ---------------------------------------------------------------------------
    def push(self, frames, ivector=None, online_ivectors=None,
             should_stop: Callable[[], bool] | None = None) -> np.ndarray:
        """Append feature frames; returns the newly computable output rows (possibly
        none).  ``ivector`` replaces the stream's per-utterance i-vector for the
        chunks computed from now on; ``online_ivectors`` appends rows to an online
        stream's i-vector matrix (module docstring).

        All or nothing: when anything raises -- a chunk computation that fails, or
        ``should_stop()`` answering True (asked before each chunk the push computes and
        once after the last; ``Cancelled`` is raised) -- the stream is put back as it
        was before the push, so no output row is lost and the same push may be sent
        again."""
        with self._all_or_nothing() as saved:
            self.feed(frames, ivector, online_ivectors)
            return self._advance(saved, should_stop)

    def feed(self, frames, ivector=None, online_ivectors=None) -> None:
        """Append frames (and i-vector rows) without computing anything: for a
        scheduler that advances many streams in one batched computation
        (engine.inference.batch)."""
        if self.finished:
            raise StreamError("push after finish() or close(): the stream has ended")
        if self.input_ended:
            raise StreamError("push after end_input(): no more frames are accepted")
        feats = as_features(frames, self.model.input_dim, "pushed frames")
        rows = None
        if self.online_period:
            if ivector is not None:
                raise InferenceError("ivector: this stream takes online i-vector rows "
                                     "(online_ivectors), not a per-utterance i-vector")
            if online_ivectors is not None:
                rows = check_online_rows(self.model, online_ivectors)
        else:
            if online_ivectors is not None:
                raise InferenceError("online_ivectors: this stream was opened without an "
                                     "online_ivector_period (it takes a per-utterance "
                                     "i-vector)")
            if ivector is not None:
                self.ivector = check_ivector(self.model, ivector)
        if rows is not None and rows.shape[0]:
            self.online_rows = np.concatenate([self.online_rows, rows], axis=0)
            self.online_received += rows.shape[0]
        if feats.shape[0]:
            self.buffer = np.concatenate([self.buffer, feats], axis=0)
            self.num_received += feats.shape[0]

    def end_input(self) -> None:
        """Announce that no more frames come, without computing: the remaining chunks
        (right edge padded with the last frame) become ready, and the stream ends
        once they are computed (by ``finish()`` or a batched advance)."""
        if self.finished:
            raise StreamError("end_input() on a stream that has ended")
        self._check_rows_for_the_end()
        self.input_ended = True

    def _check_rows_for_the_end(self) -> None:
        """An online stream cannot end with frames but no i-vector row: refused before
        anything changes, so the caller may push a row and end it again."""
        if self.online_period and self.online_received == 0 and self.num_received > 0:
            raise StreamError("online_ivectors: no i-vector row was pushed; push at least one "
                              "before ending the stream")

    def finish(self, should_stop: Callable[[], bool] | None = None) -> np.ndarray:
        """Flush the right edge (repeating the last frame); the stream then ends.  All or
        nothing, as ``push``: on an error or a stop the stream is as before the call
        (not ended)."""
        if self.finished:
            raise StreamError("finish() called twice (or after close()): the stream has ended")
        self._check_rows_for_the_end()
        with self._all_or_nothing() as saved:
            self.input_ended = True
            out = self._advance(saved, should_stop)
        self._end()
        return out

    def _end(self) -> None:
        self.finished = True
        self.executor.release()
        self._disown()

    def close(self) -> None:
        """Give what the stream holds back to its model's pool, when it is dropped
        before its end (after ``finish()`` there is nothing left to give).  The
        stream has ended: pushing more raises StreamError."""
        if not self.finished:
            self._end()

    @property
    def num_output_frames(self) -> int:
        return self.num_emitted

    @property
    def held_frames(self) -> int:
        """Input frames kept for chunks not computed yet (what a chunk waiting for its
        online i-vector row makes grow)."""
        return self.num_received - self.buffer_start

    @property
    def held_ivector_rows(self) -> int:
        """Online i-vector rows kept for chunks not computed yet."""
        return self.online_received - self.online_start

    @property
    def chunk_ready(self) -> bool:
        """Whether the next chunk can be computed now (its frames have all arrived,
        or the input has ended and the chunk still has output rows to give)."""
        return self.next_chunk() is not None

    @property
    def flushed(self) -> bool:
        """The input has ended and every output row has been computed."""
        return self.input_ended and self.next_chunk() is None

    def next_chunk(self) -> tuple[int, int, int] | None:
        """(k, begin, end): the index and input frame range of the next chunk when it
        can be computed now, else None."""
        if self.finished or self.num_received == 0:
            return None
        m = self.model
        k = self.chunks_computed
        begin, end = m.input_range(k)
        if self.input_ended:
            total_sub = (self.num_received + m.fsf - 1) // m.fsf
            if k * (m.chunk_size // m.fsf) >= total_sub:
                return None
        elif end > self.num_received:
            return None
        elif self.online_period and not has_online_row(end, self.online_period,
                                                       self.online_received):
            return None      # the chunk's i-vector row has not arrived yet
        return k, begin, end

    def _online_row(self, end: int) -> np.ndarray:
        """The online i-vector of the chunk whose input ends before frame ``end``."""
        if self.online_received == 0:
            raise StreamError("online i-vectors: the input has ended but no i-vector row was "
                              "pushed")
        r = online_row(end, self.online_period, self.online_received)
        return self.online_rows[r - self.online_start]

    @contextmanager
    def _all_or_nothing(self):
        """push and finish: what the block changes is undone when it raises (``_Saved``,
        given to the block for ``_advance``)."""
        saved = _Saved(self)
        try:
            yield saved
        except BaseException:
            saved.restore(self)
            raise
        finally:
            saved.drop(self)

    def _advance(self, saved: _Saved, should_stop: Callable[[], bool] | None
                 ) -> np.ndarray:
        """Compute every chunk that can be computed now; ``saved`` keeps the executor's
        matrices before the first one runs (see push)."""
        pieces = []
        while (chunk := self.next_chunk()) is not None:
            if should_stop is not None and should_stop():
                raise self._stopped(len(pieces))
            saved.keep_executor(self.executor)
            feats, ivectors = self.chunk_inputs(*chunk)
            pieces.append(self.take_output(self._run_chunk(feats, ivectors)))
        if not pieces:
            return np.zeros((0, self.model.output_dim), dtype=np.float32)
        if should_stop is not None and should_stop():
            raise self._stopped(len(pieces))
        return np.concatenate(pieces, axis=0)

    @staticmethod
    def _stopped(done: int) -> Cancelled:
        return Cancelled(f"stream stopped by its caller after {done} chunk computation"
                         f"{'' if done == 1 else 's'}; it is as before this call (send the "
                         f"same frames again)", done=done)

    def chunk_inputs(self, k: int, begin: int, end: int):
        """The input rows of chunk k (frames before 0 repeat frame 0, frames past the
        end repeat the last one) and its i-vector rows (None without i-vectors)."""
        m = self.model
        rows = np.clip(np.arange(begin, end), 0, self.num_received - 1) - self.buffer_start
        feats = self.buffer[rows]
        ivectors = None
        if m.has_ivectors:
            count = m.num_ivectors[0 if k == 0 else 1]
            v = self._online_row(end) if self.online_period else self.ivector
            ivectors = np.repeat(v[None, :], count, axis=0)
        return feats, ivectors

    def _run_chunk(self, feats, ivectors) -> np.ndarray:
        from engine.runtime.backend import to_host  # noqa: PLC0415
        ex = self.executor
        ex.accept_input("input", feats)
        if ivectors is not None:
            ex.accept_input("ivector", ivectors)
        ex.run()
        # a copy: the executor may recycle the output matrix in a later chunk
        return np.array(to_host(ex.get_output("output")), dtype=np.float32, copy=True)

    def take_output(self, out: np.ndarray) -> np.ndarray:
        """Book-keeping after the next chunk was computed (here or in a batch) with
        raw network output ``out``: priors, acoustic scale, counters, the input buffer;
        returns the rows to give to the caller (the right edge's surplus rows dropped)."""
        m = self.model
        if m.log_priors is not None:
            out = out - m.log_priors
        out = scale_output(out, self.acoustic_scale)
        self.chunks_computed += 1
        if self.input_ended:
            total_sub = (self.num_received + m.fsf - 1) // m.fsf
            out = out[:max(0, total_sub - self.num_emitted)]
        self.num_emitted += out.shape[0]
        # keep from the next chunk's first frame on, and always the last frame (right-edge
        # padding); chunk 0's negative frames repeat frame 0, which is then still here.
        next_begin, _ = m.input_range(self.chunks_computed)
        keep_from = min(max(next_begin, 0), self.num_received - 1)
        if keep_from > self.buffer_start:
            self.buffer = self.buffer[keep_from - self.buffer_start:].copy()
            self.buffer_start = keep_from
        if self.online_period:
            # later chunks read rows from min(end // period, last row) on
            _, next_end = m.input_range(self.chunks_computed)
            first = online_row(next_end, self.online_period, self.online_received)
            if first > self.online_start:
                self.online_rows = self.online_rows[first - self.online_start:].copy()
                self.online_start = first
        return out

    # -- state -------------------------------------------------------------------------------
    def export_state(self) -> bytes:
        """The stream's state as bytes (an .npz archive without pickled objects)."""
        if self.finished:
            raise StreamError("cannot export a finished stream")
        from engine.runtime.backend import to_host  # noqa: PLC0415
        ex = self.executor
        mats = {f"m{i}": np.asarray(to_host(a), dtype=np.float32)
                for i, a in enumerate(ex.matrices) if a is not None}
        if ex.holds_memos:
            raise StreamError("cannot export a stream whose computation holds memos")
        meta = {"version": STATE_VERSION, "fingerprint": self.model.fingerprint,
                "pc": ex.position[0], "pending": list(ex.position[1]),
                "buffer_start": self.buffer_start,
                "num_received": self.num_received, "chunks_computed": self.chunks_computed,
                "num_emitted": self.num_emitted, "input_ended": self.input_ended,
                "online_period": self.online_period, "online_start": self.online_start,
                "online_received": self.online_received,
                "acoustic_scale": self.acoustic_scale}
        arrays = dict(mats)
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
        arrays["buffer"] = self.buffer
        if self.ivector is not None:
            arrays["ivector"] = self.ivector
        if self.online_period:
            arrays["online_rows"] = self.online_rows
        bio = io.BytesIO()
        np.savez(bio, **arrays)
        return bio.getvalue()

    @classmethod
    def _from_state(cls, model: LoopedModel, state: bytes,
                    acoustic_scale: float | None = None) -> "Stream":
        try:
            with np.load(io.BytesIO(state), allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            meta = json.loads(arrays.pop("meta").tobytes().decode("utf-8"))
        except Exception as e:  # noqa: BLE001 (any decoding failure means corrupt bytes)
            raise StreamError(f"stream state is not readable: {type(e).__name__}: {e}") from None
        if not isinstance(meta, dict) or meta.get("version") != STATE_VERSION:
            raise StreamError(f"stream state has version {meta.get('version')!r} "
                              f"(expected {STATE_VERSION})")
        if meta.get("fingerprint") != model.fingerprint:
            # (or to an engine that prepared the network otherwise: the fingerprint covers
            # the decoding network, collapsed and fused as engine.inference.common does)
            raise StreamError("stream state belongs to another model or chunk configuration "
                              "(or was written by an engine version that prepares the "
                              "network differently)")
        comp = model.computation
        recorded = meta.get("acoustic_scale")
        if acoustic_scale is None:
            acoustic_scale = 1.0 if recorded is None else recorded
        elif recorded is not None and recorded != acoustic_scale:
            raise StreamError(f"stream state was written with acoustic_scale {recorded!r}, "
                              f"not {acoustic_scale!r}")
        try:
            period = int(meta.get("online_period", 0))
            online = arrays.pop("online_rows", None)
            if period:
                s = cls(model, None, period, acoustic_scale)
                if online is None or online.ndim != 2 or online.shape[1] != model.ivector_dim:
                    raise ValueError("bad online i-vector rows")
                s.online_rows = online.astype(np.float32)
                s.online_start = int(meta["online_start"])
                s.online_received = int(meta["online_received"])
                if s.online_start + s.online_rows.shape[0] != s.online_received:
                    raise ValueError("online i-vector rows do not end at the last row received")
            else:
                s = cls(model, arrays.pop("ivector", None), None, acoustic_scale)
        except (InferenceError, KeyError, ValueError, TypeError) as e:
            raise StreamError(f"stream state is inconsistent: {e}") from None
        buf = arrays.pop("buffer", None)
        try:
            if buf is None or buf.ndim != 2 or buf.shape[1] != model.input_dim:
                raise ValueError("bad input buffer")
            s.buffer = buf.astype(np.float32)
            s.buffer_start = int(meta["buffer_start"])
            s.num_received = int(meta["num_received"])
            s.chunks_computed = int(meta["chunks_computed"])
            s.num_emitted = int(meta["num_emitted"])
            s.input_ended = bool(meta.get("input_ended", False))
            pc, pending = int(meta["pc"]), [int(p) for p in meta["pending"]]
            if not (0 <= pc <= len(comp.commands)) or any(
                    not 0 <= p < len(comp.commands) for p in pending):
                raise ValueError("program counter out of range")
            if s.buffer_start + s.buffer.shape[0] != s.num_received:
                raise ValueError("buffer does not end at the last received frame")
            matrices = [None] * len(comp.matrices)
            for key, a in arrays.items():
                i = int(key[1:]) if key.startswith("m") else -1
                info = comp.matrices[i] if 0 < i < len(comp.matrices) else None
                if info is None or a.shape != (info.num_rows, info.num_cols):
                    raise ValueError(f"array {key!r} does not match the computation")
                buf_m = s.executor.pool.get(s.executor.xp, info.num_rows, info.num_cols,
                                            s.executor.pool_owner)
                buf_m[...] = s.executor.xp.asarray(a)
                matrices[i] = buf_m
        except (KeyError, ValueError, TypeError) as e:
            raise StreamError(f"stream state is inconsistent: {e}") from None
        s.executor.restore_state((pc, pending), matrices)
        return s


# what push() and finish() may change, put back when they fail or are stopped
_STREAM_FIELDS = ("buffer", "buffer_start", "num_received", "chunks_computed", "num_emitted",
                  "input_ended", "finished", "ivector", "online_rows", "online_start",
                  "online_received")


def _own_executor(holder, model: LoopedModel):
    """The executor of ``holder`` (a Stream or StreamBatch): it takes its model's pool
    buffers under a name of its own (runtime/backend.BufferPool owners), so that its
    chunks run on the same buffers chunk after chunk however many streams share the
    pool.  ``holder._disown()`` makes its free buffers anyone's again; it runs by
    itself when ``holder`` is collected."""
    from engine.runtime.executor import Executor  # noqa: PLC0415
    pool = model.pool
    owner = pool.new_owner()
    holder._disown = weakref.finalize(holder, pool.disown, owner)
    return Executor(model.computation, model.nnet, backend=model.backend, pool=pool,
                    max_peak_bytes=model.max_peak_bytes, pool_owner=owner)


# the pool owner (runtime/backend.BufferPool) of the copies a push keeps to undo itself:
# one for all streams, apart from theirs, so that taking and giving back the copies leaves
# the buffers each stream's chunks run on (and their bound fast paths) where they were,
# and the streams share one set of copies, as they push one after another
_UNDO_OWNER = "stream undo copies"


class _Saved:
    """A stream as a push or finish found it.  The arrays among its fields are replaced,
    never written in place, so they are kept by reference; the executor's matrices
    (written in place by every chunk) are copied before the first chunk runs, into
    buffers of the executor's pool, which go back to it when the call succeeds."""

    __slots__ = ("fields", "matrices", "position")

    def __init__(self, stream: Stream) -> None:
        self.fields = [getattr(stream, k) for k in _STREAM_FIELDS]
        self.position = None
        self.matrices: list | None = None

    def keep_executor(self, ex) -> None:
        if self.matrices is not None:
            return
        pool, xp, owner = ex.pool, ex.xp, _UNDO_OWNER
        copies = []
        for a in ex.matrices:
            if a is None:
                copies.append(None)
                continue
            c = pool.get(xp, a.shape[0], a.shape[1], owner)
            c[...] = a
            copies.append(c)
        self.position = ex.position
        self.matrices = copies

    def restore(self, stream: Stream) -> None:
        for k, v in zip(_STREAM_FIELDS, self.fields):
            setattr(stream, k, v)
        if self.matrices is not None:
            ex = stream.executor
            ex.release()     # what the chunks left half done goes back to the pool
            ex.restore_state(self.position, self.matrices)
            self.matrices = None     # now the executor's

    def drop(self, stream: Stream) -> None:
        if self.matrices is not None:
            ex = stream.executor
            for c in self.matrices:
                if c is not None:
                    ex.pool.release(ex.xp, c, _UNDO_OWNER)
            self.matrices = None


class StreamBatch:
    """Several streams advanced in lock-step by one looped computation whose requests
    have ``n`` = 0..B-1 (a LoopedModel built with ``num_sequences=B``): a chunk is
    computed when every stream has its frames or has finished (a finished stream's
    input repeats its last frame, its surplus rows are dropped).  Streams must start
    together.  I-vectors: one per stream, or with ``online_ivector_period`` rows pushed
    per stream (``push(j, frames, online_ivectors=rows)``), each chunk reading every
    stream's row as a Stream does (and waiting for it unless that stream finished).  For independent Streams at any chunk position (different start times,
    first chunks next to steady-state ones, export/import in between) use
    engine.inference.batch.StreamBatcher."""

    def __init__(self, model: LoopedModel, ivectors=None, online_ivector_period=None,
                 acoustic_scale: float = 1.0):
        self.model = model
        self.acoustic_scale = check_acoustic_scale(acoustic_scale)
        b = model.num_sequences
        # online i-vectors (as Stream): the period, and per stream the rows pushed
        self.online_period = check_online_period(model, online_ivector_period, ivectors)
        if self.online_period:
            self.ivectors = None
            self.online_rows = [np.zeros((0, model.ivector_dim), np.float32) for _ in range(b)]
        else:
            ivectors = [None] * b if ivectors is None else list(ivectors)
            if len(ivectors) != b:
                raise InferenceError(f"expected {b} i-vectors (one per stream), got "
                                     f"{len(ivectors)}")
            self.ivectors = [check_ivector(model, v) for v in ivectors]
            self.online_rows = None
        self.executor = _own_executor(self, model)
        # per stream: the frames still needed (from frame ``start[j]`` on) and how
        # many were pushed in all; frames no later chunk reads are dropped
        self.frames = [np.zeros((0, model.input_dim), np.float32) for _ in range(b)]
        self.start = [0] * b
        self.received = [0] * b
        self.finished = [False] * b
        self.emitted = [0] * b
        self.chunks_computed = 0

    def push(self, j: int, frames, online_ivectors=None) -> None:
        """Append frames (and, with an online_ivector_period, i-vector rows) to stream
        j (outputs come from ``advance``)."""
        if self.finished[j]:
            raise StreamError(f"stream {j}: push after finish")
        f = as_features(frames, self.model.input_dim, f"stream {j} frames")
        if online_ivectors is not None:
            if not self.online_period:
                raise InferenceError("online_ivectors: this StreamBatch was made without an "
                                     "online_ivector_period")
            rows = check_online_rows(self.model, online_ivectors)
            self.online_rows[j] = np.concatenate([self.online_rows[j], rows], axis=0)
        self.frames[j] = np.concatenate([self.frames[j], f], axis=0)
        self.received[j] += f.shape[0]

    def finish(self, j: int) -> None:
        if self.finished[j]:
            raise StreamError(f"stream {j}: finish() called twice")
        if self.received[j] == 0:
            raise StreamError(f"stream {j}: finished without any frames")
        if self.online_period and self.online_rows[j].shape[0] == 0:
            raise StreamError(f"stream {j}: online i-vectors: no i-vector row was pushed; "
                              f"push at least one before finishing")
        self.finished[j] = True

    def _ivector_rows(self, k: int, end: int) -> np.ndarray:
        """The i-vector rows chunk k gives the computation, stream after stream."""
        m = self.model
        count = m.num_ivectors[0 if k == 0 else 1]
        if self.online_period:
            per = [rows[online_row(end, self.online_period, rows.shape[0])]
                   for rows in self.online_rows]
        else:
            per = self.ivectors
        return np.repeat(np.stack(per), count, axis=0)

    def advance(self) -> list[np.ndarray]:
        """Compute every chunk that all streams allow; the new output rows per stream."""
        from engine.runtime.backend import to_host  # noqa: PLC0415
        m = self.model
        b = m.num_sequences
        per_chunk = m.chunk_size // m.fsf
        outs: list[list[np.ndarray]] = [[] for _ in range(b)]
        while True:
            k = self.chunks_computed
            begin, end = m.input_range(k)
            totals = [(n + m.fsf - 1) // m.fsf for n in self.received]
            ready = all((fin and n > 0) or n >= end
                        for n, fin in zip(self.received, self.finished))
            if ready and self.online_period:
                # each stream has the row the chunk reads, or has finished
                ready = all(fin or has_online_row(end, self.online_period, rows.shape[0])
                            for rows, fin in zip(self.online_rows, self.finished))
            if not ready or all(fin and k * per_chunk >= tot
                                for fin, tot in zip(self.finished, totals)):
                break
            # frames before 0 repeat frame 0, frames past the end repeat the last one
            feats = np.concatenate([f[np.clip(np.arange(begin, end), 0, n - 1) - s0]
                                    for f, n, s0 in zip(self.frames, self.received,
                                                        self.start)], axis=0)
            self.executor.accept_input("input", feats)
            if m.has_ivectors:
                self.executor.accept_input("ivector", self._ivector_rows(k, end))
            self.executor.run()
            out = np.array(to_host(self.executor.get_output("output")), np.float32, copy=True)
            if m.log_priors is not None:
                out -= m.log_priors
            out = scale_output(out, self.acoustic_scale)
            self.chunks_computed += 1
            self._drop_frames_before(m.input_range(k + 1)[0])
            for j in range(b):
                rows = out[j * per_chunk:(j + 1) * per_chunk]
                if self.finished[j]:
                    rows = rows[:max(0, totals[j] - self.emitted[j])]
                self.emitted[j] += rows.shape[0]
                outs[j].append(rows)
        return [np.concatenate(o, axis=0) if o else np.zeros((0, m.output_dim), np.float32)
                for o in outs]

    def _drop_frames_before(self, first: int) -> None:
        """Forget frames before ``first`` (the first frame a later chunk reads),
        keeping at least the last frame pushed (a finished stream repeats it)."""
        for j, f in enumerate(self.frames):
            keep = min(max(first, 0), self.received[j] - 1)
            if keep > self.start[j]:
                self.frames[j] = f[keep - self.start[j]:].copy()
                self.start[j] = keep
