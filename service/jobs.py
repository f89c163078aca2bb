"""Jobs and their results as bytes, for workers in other processes (service/redis_queue.py).

A job payload in process holds engine objects (the model entry, the ComputationRequest,
options, NumPy arrays); on the wire it is msgpack of plain data: the model by id, the
request as its JSON form, options as their fields, arrays as (shape, little-endian
float32 bytes).  Results likewise: computations as ``computation_to_data``, arrays as
bytes, a model gradient as the network in Kaldi's binary format, stream summaries as
dicts.  Errors travel as (class name, message, status, field) and are raised again as the
same class on the other side, so the API answers with the status and message a job run
in process would give.  Nothing is pickled: decoding cannot run code.
"""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np

from engine.compiler.request import ComputationRequest
from engine.compiler.serialize import computation_from_data, computation_to_data
from engine.core import errors as engine_errors
from engine.inference import InferenceOptions
from engine.optimizer.options import OptimizeOptions
from service.errors import FieldError, ServiceError

WIRE_VERSION = 1
_F32 = np.dtype("<f4")
_F64 = np.dtype("<f8")


# -- arrays ------------------------------------------------------------------------------------

def _arr(a, dtype=_F32) -> list | None:
    if a is None:
        return None
    a = np.asarray(a, dtype=dtype)       # (0-d arrays keep their shape: counts)
    return [list(a.shape), np.ascontiguousarray(a).tobytes()]


def _unarr(v, dtype=_F32) -> np.ndarray | None:
    if v is None:
        return None
    shape, raw = v
    return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("=")).reshape(shape)


def _stats(stats: dict | None) -> dict | None:
    """Component statistics (component -> name -> float64 array) as little-endian
    float64 bytes with their shapes (counts and sums are doubles, as in Kaldi)."""
    if stats is None:
        return None
    return {c: {k: _arr(v, _F64) for k, v in fields.items()} for c, fields in stats.items()}


def _unstats(d: dict | None) -> dict | None:
    if d is None:
        return None
    return {c: {k: _unarr(v, _F64) for k, v in fields.items()} for c, fields in d.items()}


def _arrs(d: dict) -> dict:
    return {k: _arr(v) for k, v in d.items()}


def _unarrs(d: dict) -> dict:
    return {k: _unarr(v) for k, v in d.items()}


# -- jobs --------------------------------------------------------------------------------------

def encode_job(kind: str, p: dict) -> bytes:
    d: dict = {"v": WIRE_VERSION, "kind": kind}
    if "entry" in p:
        d["model_id"] = p["entry"].model_id
    if kind in ("compile", "compute"):
        d.update(request=p["request"].to_json(), options=dataclasses.asdict(p["options"]),
                 optimize=p["optimize"], use_shortcut=p["use_shortcut"])
    if kind == "compute":
        d.update(inputs=_arrs(p["inputs"]), output_derivs=_arrs(p.get("output_derivs", {})))
    elif kind == "infer":
        d.update(features=_arr(p["features"]), ivector=_arr(p["ivector"]),
                 online_ivectors=_arr(p["online_ivectors"]),
                 online_ivector_period=p["online_ivector_period"],
                 options=dataclasses.asdict(p["options"]))
    elif kind == "stream_open":
        d.update(options=p["options"], ivector=_arr(p["ivector"]),
                 online_ivector_period=p.get("online_ivector_period"))
    elif kind == "stream_push":
        d.update(stream_id=p["stream_id"], features=_arr(p["features"]),
                 ivector=_arr(p.get("ivector")), offset=p.get("offset"),
                 online_ivectors=_arr(p.get("online_ivectors")))
    elif kind in ("stream_finish", "stream_close", "stream_info"):
        d.update(stream_id=p["stream_id"])
    elif kind not in ("compile",):
        raise ValueError(f"no wire form for job kind {kind!r}")
    return msgpack.packb(d, use_bin_type=True)


def decode_job(data: bytes, registry) -> tuple[str, dict]:
    """(kind, payload) with the model looked up in ``registry``; raises ValueError
    for bytes that are not a job of this version."""
    d = msgpack.unpackb(data, raw=False)
    if not isinstance(d, dict) or d.get("v") != WIRE_VERSION:
        raise ValueError("not a job of this wire version")
    kind = d["kind"]
    p: dict = {}
    if "model_id" in d:
        p["entry"] = registry.get(d["model_id"])
    if kind in ("compile", "compute"):
        p.update(request=ComputationRequest.from_json(d["request"]),
                 options=OptimizeOptions(**d["options"]), optimize=d["optimize"],
                 use_shortcut=d["use_shortcut"])
    if kind == "compute":
        p.update(inputs=_unarrs(d["inputs"]), output_derivs=_unarrs(d["output_derivs"]))
    elif kind == "infer":
        p.update(features=_unarr(d["features"]), ivector=_unarr(d["ivector"]),
                 online_ivectors=_unarr(d["online_ivectors"]),
                 online_ivector_period=d["online_ivector_period"],
                 options=InferenceOptions(**d["options"]))
        if p["ivector"] is not None:
            p["ivector"] = p["ivector"].reshape(-1)
    elif kind == "stream_open":
        p.update(options=d["options"], ivector=_unarr(d["ivector"]),
                 online_ivector_period=d.get("online_ivector_period"))
        if p["ivector"] is not None:
            p["ivector"] = p["ivector"].reshape(-1)
    elif kind == "stream_push":
        p.update(stream_id=d["stream_id"], features=_unarr(d["features"]),
                 ivector=_unarr(d["ivector"]), offset=d["offset"],
                 online_ivectors=_unarr(d.get("online_ivectors")))
        if p["ivector"] is not None:
            p["ivector"] = p["ivector"].reshape(-1)
    elif kind in ("stream_finish", "stream_close", "stream_info"):
        p.update(stream_id=d["stream_id"])
    return kind, p


# -- results -----------------------------------------------------------------------------------

def encode_result(kind: str, r) -> bytes:
    from engine.nnet.model_io import nnet_to_bytes  # noqa: PLC0415
    if kind == "compile":
        d = {"compiled": _compiled(r, with_computation=True)}
    elif kind == "compute":
        compiled, res = r
        d = {"compiled": _compiled(compiled, with_computation=False),
             "outputs": _arrs(res.outputs), "input_derivs": _arrs(res.input_derivs),
             "gradient": None if res.gradient is None else nnet_to_bytes(res.gradient, True),
             "stats": _stats(res.stats)}
    elif kind == "infer":
        d = {"output": _arr(r)}
    elif kind in ("stream_push", "stream_finish"):
        out, first, summary = r
        d = {"output": _arr(out), "first": first, "summary": summary}
    elif kind in ("stream_open", "stream_info"):
        d = {"summary": r}
    elif kind == "stream_close":
        d = {}
    else:
        raise ValueError(f"no wire form for results of {kind!r}")
    return msgpack.packb({"v": WIRE_VERSION, "ok": d}, use_bin_type=True)


def _compiled(c, with_computation: bool) -> dict:
    return {"key": c.key, "cached": c.cached, "compile_ms": c.compile_ms,
            "optimized": c.optimized,
            "computation": computation_to_data(c.computation) if with_computation else None}


def encode_error(e: BaseException) -> bytes:
    if isinstance(e, ServiceError):
        d = {"class": "ServiceError", "status": e.status, "type": e.type, "message": e.message,
             "field": e.field}
    elif isinstance(e, engine_errors.NnetcError):
        d = {"class": type(e).__name__, "message": str(e),
             "field": getattr(e, "field", None)}
    else:
        d = {"class": "Internal", "message": f"{type(e).__name__}"}
    return msgpack.packb({"v": WIRE_VERSION, "error": d}, use_bin_type=True)


def decode_result(kind: str, data: bytes):
    """The result a job run in process would have returned (engine and service objects
    rebuilt), or raises the error it raised."""
    from service.operations import Compiled, ComputeResult  # noqa: PLC0415
    d = msgpack.unpackb(data, raw=False)
    if not isinstance(d, dict) or d.get("v") != WIRE_VERSION:
        raise ServiceError(502, "BadWorkerReply", "a worker replied in an unknown format")
    if "error" in d:
        raise _error(d["error"])
    r = d["ok"]

    def compiled(c):
        comp = computation_from_data(c["computation"]) if c["computation"] is not None else None
        return Compiled(c["key"], comp, c["cached"], c["compile_ms"], c["optimized"])
    if kind == "compile":
        return compiled(r["compiled"])
    if kind == "compute":
        gradient = None
        if r["gradient"] is not None:
            from engine.nnet.model_io import load_model  # noqa: PLC0415
            gradient = load_model(r["gradient"], source="gradient").nnet
        return compiled(r["compiled"]), ComputeResult(_unarrs(r["outputs"]),
                                                      _unarrs(r["input_derivs"]), gradient,
                                                      _unstats(r.get("stats")))
    if kind == "infer":
        return _unarr(r["output"])
    if kind in ("stream_push", "stream_finish"):
        return _unarr(r["output"]), r["first"], r["summary"]
    if kind in ("stream_open", "stream_info"):
        return r["summary"]
    return None


def _error(e: dict) -> BaseException:
    cls = e.get("class")
    if cls == "ServiceError":
        if e.get("type") == "RequestError" and e.get("status") == 422 and e.get("field"):
            err = FieldError.__new__(FieldError)
            ServiceError.__init__(err, 422, "RequestError", e["message"], e["field"])
            return err
        return ServiceError(e["status"], e["type"], e["message"], e.get("field"))
    engine_cls = getattr(engine_errors, cls or "", None)
    if isinstance(engine_cls, type) and issubclass(engine_cls, engine_errors.NnetcError):
        err = engine_cls.__new__(engine_cls)
        Exception.__init__(err, e["message"])
        return err
    return ServiceError(500, "InternalError", "the worker failed on this job "
                                              f"({e.get('message', 'unknown error')})")
