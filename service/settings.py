"""Service settings (pydantic-settings): the one place where environment
variables become values.  Every field can be set as ``NNETC_<FIELD>`` (e.g.
``NNETC_AUTH_TOKEN``) or passed to ``create_app(Settings(...))``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.registry import DEFAULT_MAX_MODEL_BYTES, DEFAULT_MAX_NODES


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NNETC_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    cache_size: int = Field(default=256, ge=1,
                            description="compiled computations kept in the in-process LRU")
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024,
                                description="larger request bodies get 413")
    auth_token: str | None = Field(default=None,
                                   description="when set, every API route needs "
                                               "'Authorization: Bearer <token>'")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    max_models: int = Field(default=64, ge=1, description="registered models kept in memory")
    max_model_bytes: int = Field(
        default=DEFAULT_MAX_MODEL_BYTES, ge=1 << 20,
        description="the bytes of the arrays (parameters, statistics) of the models this "
                    "process holds, all together: a registration beyond gets 413 naming "
                    "it, before a config's random parameters are drawn; deleting a model "
                    "frees its share (with Redis, models kept there are dropped from this "
                    "process, least recently used first, to make room, and loaded again "
                    "when asked for)")
    max_model_nodes: int = Field(
        default=DEFAULT_MAX_NODES, ge=2,
        description="networks with more nodes get 413 at registration (a component-node "
                    "counts twice); the work of registering (the context) and compiling grows "
                    "with it: a 1500-node chain takes seconds")
    queue_size: int = Field(default=1024, ge=1, description="jobs waiting for the worker "
                                                            "before requests get 503")
    job_timeout_s: float = Field(
        default=600.0, gt=0,
        description="a job not answered by then gets 504; it is the job's deadline too: a "
                    "worker does not start a job past it, and infer work stops between "
                    "chunks once it passes (service/deadlines.py)")
    parse_processes: int = Field(
        default=1, ge=0, le=64,
        description="helper processes that parse large JSON bodies (service/body_parse.py), "
                    "so that one large body does not hold the event loop, and every other "
                    "client, while it is read; 0: every body is parsed in the event loop")
    parse_offload_bytes: int = Field(
        default=1 << 20, ge=0,
        description="JSON bodies of at least this many bytes go to the helper processes "
                    "(parse_processes); smaller ones are parsed in the event loop, where "
                    "it is quicker than the hop")
    base64_threshold: int = Field(default=4096, ge=0,
                                  description="'auto' encoding returns matrices with more "
                                              "elements than this as base64")
    backend: Literal["numpy", "cupy"] = "numpy"
    native: bool = Field(
        default=True,
        description="run the optimizer's busiest passes in C when the extension "
                    "engine.optimizer._native is built (engine.optimizer.native); false: "
                    "their Python forms, with the same results, about a third slower to "
                    "compile")
    own_products: bool = Field(
        default=True,
        description="multiply by frozen (decoding) weights with the product kernel of "
                    "engine.core._sgemm where it is built and the CPU has AVX2 + FMA "
                    "(engine.core.sgemm: 1.3-3x OpenBLAS on a decoding chunk's products; "
                    "each element an in-order FMA chain, the same bits for any batch or "
                    "chunk size); false: the BLAS product, which rounds otherwise")
    infer_threads: int = Field(
        default=1, ge=1, le=64,
        description="chunks of an infer request computed this many batches at a time, "
                    "each matrix product on one BLAS thread (engine.runtime.parallel): on a "
                    "CPU with several cores, networks without recurrence (TDNN, TDNN-F, CNN) "
                    "decode long utterances faster this way than with a multi-threaded "
                    "BLAS; used only for such networks and at least 400 output frames per "
                    "thread (Inferencer.parallel_pays)")
    blas_thread_policy: Literal["stable", "adaptive"] = Field(
        default="stable",
        description="'stable': the BLAS thread count is changed (one thread for small "
                    "computations, infer_threads) only where that changes no number, so a "
                    "computation gives the same bits every run; 'adaptive': changed for "
                    "speed also where the BLAS rounds otherwise on one thread (OpenBLAS's "
                    "Haswell kernels on AVX2 machines), results then agreeing from run to "
                    "run to float32 rounding -- on a machine shared with other work a "
                    "small computation's products at two threads can take 3-13 times "
                    "their one-thread time (engine.runtime.parallel)")
    max_request_indexes: int = Field(
        default=100_000, ge=1,
        description="requests with more Indexes (inputs and outputs together), and infer "
                    "options with a larger frames_per_chunk, get 413 before compiling: "
                    "compiling costs about 25 kB per frame of a TDNN-F (2.5 GB at the "
                    "default)")
    max_pooled_bytes: int = Field(
        default=1 << 30, ge=0,
        description="matrices that inference and streams keep between chunks for reuse, "
                    "all cached models together (each kept its own 1 GiB pool before)")
    cache_bytes: int = Field(
        default=1 << 30, ge=1 << 20,
        description="the in-process computation cache also drops its least recently used "
                    "entries while their estimated size is above this")
    max_infer_work_factor: int = Field(
        default=20, ge=1,
        description="an infer request computes every chunk with its extra context: when "
                    "that comes to more frames than this many times the utterance's (and "
                    "more than max_request_indexes) it gets 413 before anything runs "
                    "(tiny chunks with a huge extra context would hold a worker for hours)")
    max_recurrent_chunk_frames: int = Field(
        default=1024, ge=1,
        description="streams and infer requests on a network with recurrence (LSTM, GRU) "
                    "may have chunks of at most this many frames (frames_per_chunk rounded "
                    "up to a multiple of frame_subsampling_factor), else 413: such a chunk "
                    "is compiled frame by frame (a fast LSTM: about 14 s for 2000 frames on "
                    "one core) while the worker serves nobody else")
    max_computation_bytes: int = Field(
        default=4 << 30, ge=1 << 20,
        description="compute requests (and infer chunks) whose computation needs more "
                    "matrix memory at its peak (Kaldi's peak bytes) get 413 before anything "
                    "is allocated")
    max_response_bytes: int = Field(
        default=256 << 20, ge=1 << 10,
        description="compute and infer requests, and stream pushes, whose answer would "
                    "carry more float32 values than this many bytes (outputs, input "
                    "derivatives, the model gradient) get 413 before anything is computed: "
                    "encoding an answer takes several times its size in memory")
    redis_url: str | None = Field(
        default=None,
        description="Redis URL (redis://host:port/db) of the computation cache shared by "
                    "the service's processes, behind the in-process LRU; unset: the LRU only")
    redis_ttl_s: int | None = Field(default=None, ge=1,
                                    description="expiry of cache entries in Redis (none: "
                                                "kept until Redis evicts them)")
    redis_timeout_s: float = Field(default=1.0, gt=0,
                                   description="connect/read timeout of a Redis call; after "
                                               "a failure Redis is skipped for 5 s")
    max_connections: int | None = Field(
        default=None, ge=1,
        description="`nnetc serve`: HTTP connections (WebSockets included) open at once; "
                    "a request arriving on one more gets 503 and its connection is closed "
                    "(uvicorn's limit_concurrency, its plain-text 'Service Unavailable').  Each "
                    "request is bounded on its own (max_body_bytes, max_request_indexes, "
                    "max_response_bytes); requests in flight together add up (one "
                    "/compute of 40000 TDNN frames with a JSON-rows answer: about 2 GB at "
                    "its peak).  Unset: no limit")
    max_streams: int = Field(default=256, ge=1,
                             description="open streams one process holds; more get 503")
    max_stream_bytes: int = Field(
        default=2 << 30, ge=1 << 20,
        description="memory all open streams of this process may hold together, each "
                    "counted at its estimate when opened (LoopedModel.stream_bytes: its "
                    "looped computation's peak matrix bytes, the objects its executor "
                    "binds per command, one chunk's input); an open (or a takeover of "
                    "another process's stream) beyond gets 503, and a single stream larger "
                    "than all of it 413")
    max_stream_ivector_rows: int = Field(
        default=4096, ge=1,
        description="online i-vector rows a stream holds before the chunks that read them "
                    "are computed; a push beyond gets 413 (push rows with the frames they "
                    "describe): bounds a stream's memory (4096 rows of 100 floats: 1.6 MB)")
    stream_idle_s: int = Field(default=600, ge=1,
                               description="a stream not pushed to for this long is closed "
                                           "(and its checkpoint expires in Redis)")
    max_batch: int = Field(default=8, ge=1, le=1024,
                           description="compute jobs run together as one computation along "
                                       "n (dynamic batching): at most this many; 1 turns it "
                                       "off")
    batch_delay_ms: float = Field(default=2.0, ge=0.0, le=1000.0,
                                  description="how long the worker waits for more "
                                              "compatible compute jobs before running a "
                                              "batch, while other compute (or infer) "
                                              "requests are in flight: a lone request does "
                                              "not wait")
    queue: Literal["inprocess", "redis"] = Field(
        default="inprocess",
        description="where jobs run: 'inprocess' (a worker thread in this process) or "
                    "'redis' (a Redis Stream read by `nnetc worker` processes; needs "
                    "redis_url)")
    worker_claim_idle_s: float = Field(
        default=30.0, gt=0,
        description="a job a worker took and has not answered for this long is taken over "
                    "by another worker (the first is presumed dead); keep it above the "
                    "longest job")

    worker_max_deliveries: int = Field(
        default=3, ge=1,
        description="a job delivered to this many workers that all stopped while running it "
                    "is answered with an error (500 JobKilledWorkers) instead of being run "
                    "again")

    @model_validator(mode="after")
    def _queue_needs_redis(self):
        if self.queue == "redis" and not self.redis_url:
            raise ValueError("queue 'redis' needs redis_url (NNETC_REDIS_URL)")
        return self
