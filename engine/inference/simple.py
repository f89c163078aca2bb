"""Whole-utterance inference: Kaldi's DecodableNnetSimple
(nnet-am-decodable-simple.{h,cc}) as driven by nnet3-compute, plus batching of
many utterances in the spirit of NnetBatchComputer (nnet-batch-compute.cc).

An utterance of T frames gives ceil(T / frame_subsampling_factor) output rows.
They are computed in chunks of ``frames_per_chunk`` output frames (rounded up to
a multiple of lcm(subsampling factor, network modulus)); the last chunk is
simply shorter.  A chunk starting at output frame f0 reads input frames
[f0 - left, f_last + right] where left/right are the network's context plus the
extra contexts (``extra_left_context_initial`` replacing ``extra_left_context``
for the first chunk, ``extra_right_context_final`` replacing
``extra_right_context`` for the last, when >= 0); frames outside the utterance
repeat the first or last frame.  Requests are shifted so that the chunk's first
output is at t=0, so equal-shaped chunks share one compiled computation.  The
i-vector is the per-utterance one, or the online i-vector row for the frame in
the middle of the chunk.  Log priors are subtracted when given; ``apply_exp``
exponentiates at the end (nnet3-compute --apply-exp).

Batching: chunks of every utterance with the same request shape are merged
along ``n`` (utterance-chunk k becomes sequence n=k of one request, its rows
n-major as Kaldi's requests are), at most ``max_batch`` per computation; a last
partial minibatch gets its own (smaller) computation.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.compiler.request import ComputationRequest, IoSpecification
from engine.core.cancel import stopping_when
from engine.core.errors import Cancelled, InferenceError, ResourceLimitError
from engine.core.index import Index
from engine.inference.common import (CachingCompiler, as_features, check_acoustic_scale,
                                     check_ivectors, check_simple, lcm, log_priors,
                                     prepare_nnet, scale_output, simple_context)
from engine.runtime.parallel import run_concurrently


# output frames per thread below which Inferencer(threads=K) computes in one thread
PARALLEL_MIN_FRAMES = 400


@dataclass(frozen=True)
class InferenceOptions:
    """Kaldi's NnetSimpleComputationOptions plus nnet3-compute's flags."""

    frames_per_chunk: int = 50
    extra_left_context: int = 0
    extra_right_context: int = 0
    extra_left_context_initial: int = -1
    extra_right_context_final: int = -1
    frame_subsampling_factor: int = 1
    acoustic_scale: float = 1.0
    apply_exp: bool = False
    use_priors: bool = False
    output: str = "output"
    max_batch: int = 16
    # chunk computations run at the same time, each product on one BLAS thread
    # (engine.runtime.parallel); with more than one, a group of equal-shaped chunks is
    # split into that many batches (of at most max_batch) rather than one.  Used only
    # where it pays (Inferencer.parallel_pays): CPU (NumPy backend), a network without
    # recurrence, and at least PARALLEL_MIN_FRAMES output frames per thread
    threads: int = 1

    def check(self) -> None:
        if self.frame_subsampling_factor < 1:
            raise InferenceError(f"frame_subsampling_factor: must be >= 1, got "
                                 f"{self.frame_subsampling_factor}")
        if self.frames_per_chunk < 1:
            raise InferenceError(f"frames_per_chunk: must be >= 1, got {self.frames_per_chunk}")
        for name in ("extra_left_context", "extra_right_context"):
            if getattr(self, name) < 0:
                raise InferenceError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("extra_left_context_initial", "extra_right_context_final"):
            if getattr(self, name) < -1:
                raise InferenceError(f"{name}: must be >= -1 (-1 meaning: same as the "
                                     f"non-edge value), got {getattr(self, name)}")
        if self.max_batch < 1:
            raise InferenceError(f"max_batch: must be >= 1, got {self.max_batch}")
        if not 1 <= self.threads <= 64:
            raise InferenceError(f"threads: must be in [1, 64], got {self.threads}")
        check_acoustic_scale(self.acoustic_scale)


@dataclass
class Utterance:
    """One utterance to decode: features plus an optional i-vector source."""

    features: np.ndarray
    ivector: np.ndarray | None = None
    online_ivectors: np.ndarray | None = None
    online_ivector_period: int = 0


@dataclass
class _Chunk:
    utt: int
    first_sub: int       # first subsampled output frame
    num_sub: int         # subsampled output frames in this chunk
    rows: np.ndarray     # the utterance's feature rows to read (edges repeated)
    ivector: np.ndarray | None
    key: tuple           # (input t begin relative to output start, num input, num_sub)


class Inferencer:
    """Decodes utterances with one model and one set of options.  Holds the
    prepared network and a compiled-computation cache, so repeated calls (and
    equal-shaped chunks) compile once."""

    def __init__(self, nnet, options: InferenceOptions = InferenceOptions(), priors=None,
                 backend=np, collapse: bool = True, optimize: bool = True,
                 max_peak_bytes: int | None = None, pool=None):
        """``max_peak_bytes``: chunk computations needing more matrix memory at their
        peak, and utterances whose output matrix alone is larger, are refused
        (ResourceLimitError) before they run.  ``pool``: the BufferPool the chunks'
        matrices are kept in between runs (one shared by many inferencers bounds what
        they keep together); a pool of its own when None."""
        options.check()
        self.max_peak_bytes = max_peak_bytes
        check_simple(nnet, options.output)
        self.options = options
        self.nnet = prepare_nnet(nnet, collapse=collapse)
        self.backend = backend
        self.left_context, self.right_context = simple_context(self.nnet, options.output)
        self.input_dim = self.nnet.input_dim("input")
        self.output_dim = self.nnet.output_dim(options.output)
        self.log_priors = log_priors(priors, self.output_dim) if options.use_priors else None
        if options.use_priors and priors is None:
            # An .mdl with an empty <Priors> (chain models) is fine: nothing is subtracted,
            # as in Kaldi; pass an empty array for it (see model_priors()).
            raise InferenceError("use_priors: asked for, but the model has no priors (a .mdl "
                                 "is needed)")
        n = lcm(options.frame_subsampling_factor, self.nnet.modulus())
        # Kaldi's CheckAndFixConfigs: round frames-per-chunk up to a multiple of n.
        self.frames_per_chunk = n * ((options.frames_per_chunk + n - 1) // n)
        self.compiler = CachingCompiler(self.nnet, optimize=optimize)
        # recurrence: data parallelism does not pay
        from engine.nnet.graph import has_recurrence  # noqa: PLC0415
        self._recurrent = has_recurrence(self.nnet)
        from engine.runtime.backend import BufferPool  # noqa: PLC0415
        self.pool = BufferPool() if pool is None else pool

    # -- chunk planning (DecodableNnetSimple::EnsureFrameIsComputed) ----------------------------
    def _plan(self, k: int, utt: Utterance) -> list[_Chunk]:
        o = self.options
        feats = utt.features
        num_frames = feats.shape[0]
        if num_frames == 0:
            raise InferenceError(f"utterance {k}: zero-length features")
        fsf = o.frame_subsampling_factor
        total_sub = (num_frames + fsf - 1) // fsf
        per_chunk = self.frames_per_chunk // fsf
        chunks = []
        for first_sub in range(0, total_sub, per_chunk):
            num_sub = min(total_sub - first_sub, per_chunk)
            last_sub = first_sub + num_sub - 1
            first_out, last_out = first_sub * fsf, last_sub * fsf
            extra_left = o.extra_left_context
            if first_out == 0 and o.extra_left_context_initial >= 0:
                extra_left = o.extra_left_context_initial
            extra_right = o.extra_right_context
            if last_sub == total_sub - 1 and o.extra_right_context_final >= 0:
                extra_right = o.extra_right_context_final
            first_in = first_out - self.left_context - extra_left
            last_in = last_out + self.right_context + extra_right
            rows = np.clip(np.arange(first_in, last_in + 1), 0, num_frames - 1)
            ivec = self._ivector_for(k, utt, first_out, last_out - first_out)
            key = (first_in - first_out, last_in + 1 - first_in, num_sub, ivec is not None)
            chunks.append(_Chunk(k, first_sub, num_sub, rows, ivec, key))
        return chunks

    @staticmethod
    def _ivector_for(k: int, utt: Utterance, out_start: int, num_out: int):
        """DecodableNnetSimple::GetCurrentIvector: the row for the frame in the middle of
        the chunk, clamped to the last row unless that is more than 50 frames away."""
        if utt.ivector is not None:
            return utt.ivector
        if utt.online_ivectors is None:
            return None
        period = utt.online_ivector_period
        frame = out_start + num_out // 2
        row = frame // period
        have = utt.online_ivectors.shape[0]
        if row >= have:
            if (row - (have - 1)) * period > 50:
                raise InferenceError(f"utterance {k}: no online i-vector for frame {frame}: "
                                     f"only {have} rows at period {period} (wrong "
                                     f"--online-ivector-period?)")
            row = have - 1
        return utt.online_ivectors[row]

    def _request(self, key: tuple, batch: int) -> ComputationRequest:
        begin, num_in, num_sub, has_ivec = key
        fsf = self.options.frame_subsampling_factor
        inputs = [IoSpecification("input", [Index(n, begin + i, 0) for n in range(batch)
                                            for i in range(num_in)])]
        if has_ivec:
            inputs.append(IoSpecification("ivector", [Index(n, 0, 0) for n in range(batch)]))
        outputs = [IoSpecification(self.options.output,
                                   [Index(n, i * fsf, 0) for n in range(batch)
                                    for i in range(num_sub)])]
        return ComputationRequest(inputs, outputs)

    def _run_batch(self, chunks: list[_Chunk], utts: list[Utterance],
                   computation) -> np.ndarray:
        from engine.runtime.backend import to_host  # noqa: PLC0415
        from engine.runtime.executor import Executor  # noqa: PLC0415
        key = chunks[0].key
        feats = np.concatenate([utts[c.utt].features[c.rows] for c in chunks], axis=0)
        ex = Executor(computation, self.nnet, backend=self.backend, pool=self.pool,
                      max_peak_bytes=self.max_peak_bytes)
        ex.accept_input("input", feats)
        if key[3]:
            ex.accept_input("ivector", np.stack([c.ivector for c in chunks]).astype(np.float32))
        ex.run()
        out = to_host(ex.get_output(self.options.output))
        ex.release()
        return np.asarray(out, dtype=np.float32)

    # -- public API --------------------------------------------------------------------------
    def make_utterance(self, features, ivector=None, online_ivectors=None,
                       online_ivector_period: int = 0, where: str = "features") -> Utterance:
        feats = as_features(features, self.input_dim, where)
        ivec, online, period = check_ivectors(self.nnet, ivector, online_ivectors,
                                              online_ivector_period)
        return Utterance(feats, ivec, online, period)

    def infer_batch(self, utterances: list[Utterance],
                    should_stop: Callable[[], bool] | None = None) -> list[np.ndarray]:
        """Outputs (subsampled frames x output dim) for each utterance, in order,
        computing equal-shaped chunks of all utterances together.  ``should_stop``
        (optional) is asked before each chunk computation (and each compile): when it
        returns True the call stops there with ``Cancelled`` (a caller's deadline that
        passed; nothing more is computed, with threads each running computation
        finishes first)."""
        chunks = [c for k, u in enumerate(utterances) for c in self._plan(k, u)]
        groups: dict[tuple, list[_Chunk]] = {}
        for c in chunks:
            groups.setdefault(c.key, []).append(c)
        fsf = self.options.frame_subsampling_factor
        rows = [(u.features.shape[0] + fsf - 1) // fsf for u in utterances]
        if self.max_peak_bytes is not None and 4 * sum(rows) * self.output_dim > \
                self.max_peak_bytes:
            raise ResourceLimitError(
                f"the output {self.options.output!r} ({sum(rows)} frames x "
                f"{self.output_dim}) needs {4 * sum(rows) * self.output_dim} bytes, more "
                f"than the limit of {self.max_peak_bytes} bytes")
        outs = [np.empty((r, self.output_dim), dtype=np.float32) for r in rows]
        frames = sum(c.num_sub for c in chunks)
        threads = self.options.threads if self.parallel_pays(frames) else 1
        batches = []
        for group in groups.values():
            size = self._batch_size(len(group), threads)
            batches += [group[s:s + size] for s in range(0, len(group), size)]
        stop = _Stopper(should_stop, len(batches))
        # compiled here first: the jobs only run computations (with one thread,
        # run_concurrently runs them here in turn)
        comps = []
        with stopping_when(should_stop):     # (a compile stops between its phases too)
            for b in batches:
                stop.check()
                comps.append(self.compiler.compile(self._request(b[0].key, len(b))))
        results = run_concurrently([lambda b=b, c=c: stop.run(self._run_batch, b, utterances, c)
                                    for b, c in zip(batches, comps)], threads)
        for batch, result in zip(batches, results):
            per = batch[0].num_sub
            for j, c in enumerate(batch):
                outs[c.utt][c.first_sub:c.first_sub + per] = result[j * per:(j + 1) * per]
        return [self._finish(o) for o in outs]

    def _batch_size(self, num_chunks: int, threads: int) -> int:
        """Chunks per computation for a group of ``num_chunks`` equal-shaped ones: all
        of them (at most max_batch) on one thread; with more threads, split so that
        each thread has a batch (``threads`` batches of equal size, at most max_batch)."""
        mb = self.options.max_batch
        if threads <= 1:
            return mb
        return max(1, min(mb, -(-num_chunks // threads)))

    def parallel_pays(self, num_output_frames: int) -> bool:
        """Whether ``threads`` > 1 is used for a call with this many output frames in
        all.  Measured on a 2-core CPU (bench/RESULTS.md, item 17): TDNN/TDNN-F decode
        faster in two threads once each has a few hundred frames (TDNN-F, 1000 frames
        in chunks of 50: 23.8 -> 14.8 ms; 300 frames: 5.8 -> 7.1 ms), while networks
        with recurrence, whose computations are many small commands, get slower
        (BLSTM 1000 frames: 24.6 -> 44.8 ms): the threads share the interpreter."""
        return (self.options.threads > 1 and self.backend is np and not self._recurrent
                and num_output_frames >= PARALLEL_MIN_FRAMES * self.options.threads)

    def _finish(self, out: np.ndarray) -> np.ndarray:
        if self.log_priors is not None:
            out -= self.log_priors
        out = scale_output(out, self.options.acoustic_scale)
        if self.options.apply_exp:
            np.exp(out, out=out)
        return out

    def infer(self, features, ivector=None, online_ivectors=None,
              online_ivector_period: int = 0,
              should_stop: Callable[[], bool] | None = None) -> np.ndarray:
        """One utterance (nnet3-compute on a single matrix); ``should_stop`` as for
        ``infer_batch``."""
        return self.infer_batch([self.make_utterance(features, ivector, online_ivectors,
                                                     online_ivector_period)], should_stop)[0]


class _Stopper:
    """Asks a caller's ``should_stop`` hook before each of ``total`` chunk computations
    (from one thread or several) and counts those finished."""

    def __init__(self, should_stop: Callable[[], bool] | None, total: int):
        self.should_stop = should_stop
        self.total = total
        self.done = 0
        self.stopped = False
        self._lock = threading.Lock()

    def check(self) -> None:
        # (once it has said stop, the hook is not asked again: the computations left to
        # run_concurrently stop at once)
        if self.should_stop is not None and (self.stopped or self.should_stop()):
            with self._lock:
                done = self.done
                self.stopped = True
            raise Cancelled(f"inference stopped by its caller after {done} of {self.total} "
                            f"chunk computations", done=done, total=self.total)

    def run(self, fn, *args):
        self.check()
        out = fn(*args)
        with self._lock:
            self.done += 1
        return out


def infer(model, features, options: InferenceOptions = InferenceOptions(), ivector=None,
          online_ivectors=None, online_ivector_period: int = 0, backend=np) -> np.ndarray:
    """Convenience: ``model`` is an engine.nnet.model_io.Model (priors used when
    ``options.use_priors``) or an Nnet."""
    from engine.inference.common import model_priors  # noqa: PLC0415
    nnet = getattr(model, "nnet", model)
    priors = model_priors(model)
    return Inferencer(nnet, options, priors=priors, backend=backend).infer(
        features, ivector, online_ivectors, online_ivector_period)
