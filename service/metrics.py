"""Prometheus metrics, one registry per app (so several apps in one process,
as in tests, do not collide on the global registry)."""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, Info, generate_latest)

CONTENT_TYPE = CONTENT_TYPE_LATEST   # the /metrics response's media type

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                    60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_latency = Histogram(
            "nnetc_request_seconds", "HTTP request latency", ["route", "method", "status"],
            buckets=_LATENCY_BUCKETS, registry=r)
        self.compile_seconds = Histogram(
            "nnetc_compile_seconds", "compile + optimize time of cache misses",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.job_seconds = Histogram(
            "nnetc_job_seconds", "time a job spends in the worker", ["kind"],
            buckets=_LATENCY_BUCKETS, registry=r)
        self.cache_events = Counter(
            "nnetc_cache_events_total", "computation cache lookups", ["event"], registry=r)
        self.jobs_cancelled = Counter(
            "nnetc_jobs_cancelled_total", "jobs past their deadline (job_timeout_s: the API "
            "answered 504) that the worker did not start (when=queued) or stopped between "
            "chunks (when=running)", ["kind", "when"], registry=r)
        self.queue_depth = Gauge("nnetc_queue_depth", "jobs waiting for the worker",
                                 registry=r)
        self.batch_size = Histogram(
            "nnetc_batch_size", "sequences (n values) per executed computation",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)

        self.jobs_per_batch = Histogram(
            "nnetc_jobs_per_batch", "jobs the worker ran together (dynamic batching)", ["kind"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.streams_open = Gauge("nnetc_streams_open", "streams held by this process",
                                  registry=r)
        self.stream_bytes = Gauge(
            "nnetc_stream_bytes", "bytes the open streams of this process may hold, each at "
            "its estimate (counted against max_stream_bytes)", registry=r)
        self.stream_events = Counter(
            "nnetc_stream_events_total", "stream lifecycle: opened, finished, closed, expired, "
            "restored (from a checkpoint), conflict, checkpoint_error", ["event"], registry=r)

        self.blas = Info(
            "nnetc_blas", "the BLAS the CPU backend's products run on: library, version, "
            "kernel set, threads, and environment overrides of the kernel choice", registry=r)

    def set_blas(self, libraries: list[dict], environment: dict,
                 thread_policy: str = "stable") -> None:
        """Fill nnetc_blas_info from engine.runtime.blas (the first library; NumPy
        loads one) and the BLAS thread policy (engine.runtime.parallel)."""
        lib = libraries[0] if libraries else {}
        self.blas.info({"library": str(lib.get("library") or "unknown"),
                        "version": str(lib.get("version") or ""),
                        "kernels": str(lib.get("architecture") or ""),
                        "threads": str(lib.get("threads") or ""),
                        "coretype_override": environment.get("OPENBLAS_CORETYPE", ""),
                        "thread_policy": thread_policy})

    def cache_event(self, event: str) -> None:
        self.cache_events.labels(event=event).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
