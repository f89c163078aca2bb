"""One APIRouter per resource."""

from __future__ import annotations

import concurrent.futures
from contextlib import contextmanager

from fastapi import Request, Response

from engine.core.errors import Cancelled, NnetcError
from service.convert import wire_json
from service.errors import ServiceError


def field_of(e: Exception, default: str, named: tuple[str, ...] = ()) -> str:
    """The request field an engine error is about: the one of ``named`` whose last part
    its message starts with (``"ivector: ..."`` for ``ivector``, ``"use_priors: ..."`` for
    ``options.use_priors``), else ``default``."""
    text = str(e)
    return next((f for f in named if text.startswith(f.rsplit(".", 1)[-1] + ":")), default)


@contextmanager
def blame(request: Request, field: str, named: tuple[str, ...] = ()):
    """Engine errors raised inside are reported against request field ``field``, or
    against the field of ``named`` that their message starts with."""
    try:
        yield
    except NnetcError as e:
        if getattr(request.state, "error_field", None) is None:
            request.state.error_field = field_of(e, field, named)
        raise


def json_answer(model, exclude_none: bool = False) -> Response:
    """``model`` (a wire model made with ``model_construct``, its JSON-rows matrices as
    arrays: service.convert.wire_json) as the HTTP answer.  A route returning it skips
    FastAPI's validation of its response model, which such a model would not pass; the
    route's response_model still describes it in the OpenAPI schema."""
    return Response(wire_json(model, exclude_none), media_type="application/json")


def run_job(services, kind: str, payload: dict):
    """Submit a job to the worker and wait for its result (routes are sync and run in
    the thread pool, so waiting here does not block the event loop)."""
    future = services.queue.submit(kind, payload)
    try:
        return future.result(timeout=services.settings.job_timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()      # not started yet: never started; running: stops at its deadline
    except Cancelled:
        pass                 # the worker stopped it at its deadline (service/deadlines.py)
    raise ServiceError(504, "Timeout", f"{kind} job did not finish within "
                                       f"{services.settings.job_timeout_s} s"
                                       + _UNDONE.get(kind, ""))


# the worker undoes a stream push or finish that has not finished by the job's deadline
# (engine Stream.push, service/streams.py); one finished just as the deadline passed (the
# answer on its way) is kept, which a push's offset tells apart
_UNDONE = {
    "stream_push": "; a push not finished by then is undone, the stream left as before it: "
                   "send it again, with its offset (409 OffsetMismatch then says it was "
                   "kept after all)",
    "stream_finish": "; a finish not finished by then is undone, the stream left open: "
                     "finish it again",
}

