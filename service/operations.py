"""What the worker does: compile (through the cache), compute, infer.

Job handlers take plain payloads (engine objects; a worker process rebuilds them
from ids and bytes: service/jobs.py) and return engine results; the
routes translate to and from the wire through service/convert.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from engine.compiler.computation import NnetComputation
from engine.compiler.request import ComputationRequest
from engine.compiler.shortcut import compile_request
from engine.core.errors import Cancelled
from engine.inference import InferenceOptions, Inferencer
from engine.inference.common import model_priors
from engine.optimizer.options import OptimizeOptions
from engine.runtime.backend import to_host
from engine.runtime.executor import Executor
from service import deadlines
from service.cache import cache_key
from service.registry import ModelEntry

_INFERENCERS_PER_MODEL = 8
log = logging.getLogger("nnetc.worker")


@dataclass
class Compiled:
    key: str
    computation: NnetComputation
    cached: bool
    compile_ms: float
    optimized: bool


@dataclass
class ComputeResult:
    outputs: dict
    input_derivs: dict
    gradient: object | None      # the gradient Nnet (Kaldi's SetNnetAsGradient convention)
    # component -> statistic -> float64 array (store_component_stats), or None
    stats: dict | None = None


class Operations:
    def __init__(self, cache, metrics, backend, max_computation_bytes: int | None = None,
                 pool=None):
        self.cache = cache
        self.metrics = metrics
        self.xp = backend
        self.max_computation_bytes = max_computation_bytes
        # the matrices every inferencer keeps between chunks (one bound for all of them)
        self.pool = pool
        # Compiles are serialised: in the service they already run on the one worker;
        # the lock keeps direct callers (tests, a future pool) from compiling twice at once.
        self._compile_lock = threading.Lock()

    # -- compile ---------------------------------------------------------------------------
    def compile(self, entry: ModelEntry, request: ComputationRequest, options: OptimizeOptions,
                optimize: bool, use_shortcut: bool) -> Compiled:
        key = cache_key(entry.structure_hash, request, options, optimize, use_shortcut)
        found = self.cache.get(key)
        if found is not None:
            meta = self.cache.meta(key) or {}
            return Compiled(key, found, True, float(meta.get("compile_ms", 0.0)), optimize)
        with self._compile_lock:
            t0 = time.perf_counter()
            computation = compile_request(entry.model.nnet, request, options,
                                          use_shortcut=use_shortcut, optimize=optimize)
            seconds = time.perf_counter() - t0
        self.metrics.compile_seconds.observe(seconds)
        log.info("compiled", extra={"model_id": entry.model_id, "computation_id": key,
                                    "compile_ms": round(seconds * 1000.0, 3),
                                    "optimized": optimize, **computation.stats()})
        # the cached computation (rebuilt from its plain data and validated) is the one
        # every later hit returns: run that one from the start, so its program is reused
        computation = self.cache.put(key, computation, {"model_id": entry.model_id,
                                                        "compile_ms": seconds * 1000.0})
        return Compiled(key, computation, False, seconds * 1000.0, optimize)

    def compile_job(self, p: dict) -> Compiled:
        deadlines.check(p, "compile")      # (compute jobs too: not started past it)
        # and stopped between the compiler's phases and passes once the deadline passes
        # (engine.core.cancel): a compile nobody waits for frees the worker
        with deadlines.compiles_stopped(p):
            return self.compile(p["entry"], p["request"], p["options"], p["optimize"],
                                p["use_shortcut"])

    # -- compute ---------------------------------------------------------------------------
    def compute_job(self, p: dict) -> tuple[Compiled, ComputeResult]:
        entry: ModelEntry = p["entry"]
        request: ComputationRequest = p["request"]
        compiled = self.compile_job(p)
        nnet = entry.model.nnet
        # statistics go to a network of their own (Kaldi's NnetComputer given one to store
        # them in), never the shared model; zeroed, so it holds what this job stored
        stats_nnet = nnet.stats_copy() if request.store_component_stats else None
        # sequences computed for clients (a merged batch's zero padding not counted)
        n_values = {i.n for s in request.outputs for i in s.indexes}
        self.metrics.batch_size.observe(p.get("jobs", len(n_values)))
        log.debug("compute", extra={"model_id": entry.model_id,
                                    "computation_id": compiled.key, "batch_size": len(n_values),
                                    "cached": compiled.cached})
        ex = Executor(compiled.computation, nnet, backend=self.xp,
                      max_peak_bytes=self.max_computation_bytes, nnet_to_store_stats=stats_nnet)
        for spec in request.inputs:
            ex.accept_input(spec.name, self.xp.asarray(p["inputs"][spec.name]))
        ex.run()
        outputs = {s.name: to_host(ex.get_output(s.name)) for s in request.outputs}
        input_derivs = {}
        if any(s.has_deriv for s in request.outputs):
            for spec in request.outputs:
                if spec.has_deriv:
                    ex.accept_output_deriv(spec.name,
                                           self.xp.asarray(p["output_derivs"][spec.name]))
            ex.run()
            input_derivs = {s.name: to_host(ex.get_input_deriv(s.name))
                            for s in request.inputs if s.has_deriv}
        gradient = ex.get_model_gradient() if request.need_model_derivative else None
        stats = ex.component_stats() if stats_nnet is not None else None
        ex.release()
        return compiled, ComputeResult(outputs, input_derivs, gradient, stats)

    # -- dynamic batching of compute jobs --------------------------------------------------
    @staticmethod
    def compute_batch_key(p: dict):
        """Jobs with equal keys are one sequence each (every Index has n = 0) of the same
        request on the same model with the same options, and ask for no model
        derivative or statistics, on a network that computes each sequence on its own
        (no batch-norm in training mode, whose statistics would mix the jobs): they
        can run as one computation along n (None: the job runs alone)."""
        req: ComputationRequest = p["request"]
        if req.need_model_derivative or req.store_component_stats:
            return None
        if p["entry"].row_coupled:
            return None
        for spec in (*req.inputs, *req.outputs):
            if any(i.n != 0 for i in spec.indexes):
                return None
        return (p["entry"].model_id, req.canonical_bytes(), p["options"].cache_key(),
                p["optimize"], p["use_shortcut"])

    def compute_batch(self, payloads: list[dict]) -> list:
        """Jobs of one ``compute_batch_key`` as one computation: sequence k of the merged
        request is job k's request with n = k (padded with zero sequences to a power of
        two); inputs and output derivatives stacked, outputs and input derivatives split
        back.  Each result is what
        ``compute_job`` would give for that job (its own computation id; float32
        rounding aside, the same numbers: sequences do not interact).  If the merged
        computation fails, the jobs run one by one, so a failure stays with its job."""
        base = payloads[0]
        req: ComputationRequest = base["request"]
        b = len(payloads)
        # the merged computation has a power-of-two number of sequences, the ones past
        # the jobs' fed zeros and dropped: one computation per bucket (1, 2, 4, 8, ...)
        # is compiled and cached, not one per batch size that happens to form
        size = 1 << (b - 1).bit_length()

        def stacked(name, key):
            parts = [p[key][name] for p in payloads]
            if size > b:
                parts.append(np.zeros(((size - b) * parts[0].shape[0], parts[0].shape[1]),
                                      dtype=np.float32))
            return np.concatenate(parts)

        merged_req = req.replicated(size)
        # stopped only when no job of the batch is waited for
        merged = dict(base, request=merged_req, jobs=b,
                      deadline=deadlines.latest([deadlines.deadline_of(p) for p in payloads]),
                      inputs={k: stacked(k, "inputs") for k in base["inputs"]},
                      output_derivs={k: stacked(k, "output_derivs")
                                     for k in base.get("output_derivs", {})})
        try:
            compiled, result = self.compute_job(merged)
        except Exception:  # noqa: BLE001 - find which job it was: each alone
            out = []
            for p in payloads:
                try:
                    out.append(self.compute_job(p))
                except Exception as e:  # noqa: BLE001
                    out.append(e)
            return out
        own_key = cache_key(base["entry"].structure_hash, req, base["options"],
                            base["optimize"], base["use_shortcut"])
        rows = {s.name: len(s.indexes) for s in (*req.inputs, *req.outputs)}
        out = []
        for k in range(b):
            def part(mats):
                return {name: m[k * rows[name]:(k + 1) * rows[name]] for name, m in mats.items()}
            out.append((Compiled(own_key, compiled.computation, compiled.cached,
                                 compiled.compile_ms, compiled.optimized),
                        ComputeResult(part(result.outputs), part(result.input_derivs), None)))
        return out

    # -- infer -----------------------------------------------------------------------------
    def infer_job(self, p: dict):
        """One utterance; stopped between chunks once the job's deadline has passed
        (Cancelled: service/deadlines.py)."""
        deadlines.check(p, "infer")
        return self._inferencer(p).infer(p["features"], p["ivector"], p["online_ivectors"],
                                         p["online_ivector_period"],
                                         should_stop=deadlines.job_stop_hook(p))

    @staticmethod
    def infer_batch_key(p: dict):
        """Infer jobs with equal keys (model and options) can run together."""
        return (p["entry"].model_id, p["options"])

    def infer_batch(self, payloads: list[dict]) -> list:
        """Infer jobs of one ``infer_batch_key`` together: the equal-shaped chunks of all
        their utterances computed as batches along n (Inferencer.infer_batch, as
        nnet3-compute's chunks of one utterance are).  A job whose inputs are unusable
        fails alone; if the batch fails, the jobs run one by one.  Jobs past their
        deadline are not started, and the batch stops between chunks once every job's
        deadline has passed (each then gets Cancelled)."""
        inferencer = self._inferencer(payloads[0])
        out: list = [None] * len(payloads)
        utts, where = [], []
        for k, p in enumerate(payloads):
            try:
                deadlines.check(p, "infer")
                utts.append(inferencer.make_utterance(p["features"], p["ivector"],
                                                      p["online_ivectors"],
                                                      p["online_ivector_period"]))
                where.append(k)
            except Exception as e:  # noqa: BLE001 - this job's own error
                out[k] = e
        if utts:
            try:
                results = inferencer.infer_batch(utts, should_stop=deadlines.stop_hook(
                    [deadlines.deadline_of(payloads[k]) for k in where]))
            except Cancelled as e:          # nobody waits for any of them
                results = [e] * len(where)
            except Exception:  # noqa: BLE001 - find which job it was: each alone
                results = []
                for k in where:
                    try:
                        results.append(self.infer_job(payloads[k]))
                    except Exception as e:  # noqa: BLE001
                        results.append(e)
            for k, r in zip(where, results):
                out[k] = r
        return out

    def _inferencer(self, p: dict) -> Inferencer:
        entry: ModelEntry = p["entry"]
        opts: InferenceOptions = p["options"]
        opts.check()
        with entry.lock:
            cache: OrderedDict = entry.extras.setdefault("inferencers", OrderedDict())
            inferencer = cache.get(opts)
            if inferencer is None:
                inferencer = Inferencer(entry.model.nnet, opts,
                                        priors=model_priors(entry.model), backend=self.xp,
                                        max_peak_bytes=self.max_computation_bytes,
                                        pool=self.pool)
                cache[opts] = inferencer
                while len(cache) > _INFERENCERS_PER_MODEL:
                    cache.popitem(last=False)
            cache.move_to_end(opts)
        return inferencer
