"""Translation between wire models (schemas/) and engine objects: the only module
that knows both.  Matrix decoding checks shapes here, so that a wrong matrix is
reported against its request field before any engine code runs."""

from __future__ import annotations

import base64
import binascii

import numpy as np
import orjson
from pydantic import BaseModel

from engine.compiler.request import ComputationRequest, IoSpecification
from engine.core.finite import as_float32, non_finite
from engine.core.index import INT32_MAX
from engine.inference import InferenceOptions
from engine.optimizer.options import OptimizeOptions
from schemas.common import EncodedMatrix
from schemas.compile import ComputationRequestModel, OptimizerOptions
from schemas.compute import InferOptions
from schemas.models import ModelInfo
from service.errors import FieldError

_F32_LE = np.dtype("<f4")


# -- matrices -------------------------------------------------------------------------------

def matrix_from_wire(value, field: str, cols: int | None = None,
                     rows: int | None = None) -> np.ndarray:
    """A float32 (rows, cols) array from JSON rows or the encoded form; ``rows``/``cols``,
    when given, are the shape the request implies (errors name ``field``)."""
    if isinstance(value, EncodedMatrix):
        r, c = value.shape
        if r < 0 or c < 0:
            raise FieldError(field, f"negative shape {list(value.shape)}")
        if r > INT32_MAX or c > INT32_MAX:     # rows and columns are 32-bit, as in Kaldi
            raise FieldError(field, f"shape {list(value.shape)}: a dimension is more than "
                                    f"{INT32_MAX}")
        raw = value.data
        if isinstance(raw, str):
            try:
                raw = base64.b64decode(raw, validate=True)
            except (binascii.Error, ValueError):
                raise FieldError(field, "data is not valid base64") from None
        if len(raw) != r * c * 4:
            raise FieldError(field, f"data has {len(raw)} bytes, shape {[r, c]} float32 "
                                    f"needs {r * c * 4}")
        arr = np.frombuffer(raw, dtype=_F32_LE).astype(np.float32).reshape(r, c)
    else:
        widths = {len(row) for row in value}
        if len(widths) > 1:
            raise FieldError(field, f"rows have different lengths {sorted(widths)}")
        arr = as_float32(value).reshape(len(value), widths.pop() if widths else 0)
    if rows is not None and cols is not None and arr.shape != (rows, cols):
        raise FieldError(field, f"expected a matrix of shape [{rows}, {cols}], got "
                                f"{list(arr.shape)}")
    if cols is not None and arr.shape[1] != cols:
        raise FieldError(field, f"expected {cols} columns, got {arr.shape[1]}")
    bad = non_finite(arr)
    if bad:
        raise FieldError(field, bad)
    return arr


def matrix_to_wire(arr, encoding: str, threshold: int):
    """JSON rows (a C-ordered float64 array, for an answer made with ``model_construct``
    and written by ``wire_json``), or the base64 form (``encoding`` 'base64', or 'auto'
    above ``threshold`` elements).  A matrix holding NaN or infinite values (a network's
    output can overflow on finite input) always goes in the base64 form, which keeps them:
    JSON has no such numbers, and the JSON encoder would write them as null."""
    a = np.ascontiguousarray(np.asarray(arr), dtype=_F32_LE)
    if a.ndim == 1:
        a = a.reshape(1, -1)
    if (encoding == "json" or (encoding == "auto" and a.size <= threshold)) \
            and np.isfinite(a).all():
        # the rows as float64 (the float32 values exactly, as JSON numbers), written out by
        # wire_json without a Python float per value
        return a.astype(np.float64)
    return EncodedMatrix(shape=(int(a.shape[0]), int(a.shape[1])),
                         data=base64.b64encode(a.tobytes()).decode("ascii"))


# -- requests and options ---------------------------------------------------------------------

def request_to_engine(req: ComputationRequestModel) -> ComputationRequest:
    def spec(s, kind, k):
        return IoSpecification.from_json(s.model_dump(), f"{kind} {k}")
    return ComputationRequest([spec(s, "input", k) for k, s in enumerate(req.inputs)],
                              [spec(s, "output", k) for k, s in enumerate(req.outputs)],
                              req.need_model_derivative, req.store_component_stats)


def optimize_options(opts: OptimizerOptions | None) -> OptimizeOptions:
    if opts is None:
        return OptimizeOptions()
    return OptimizeOptions.from_dict(opts.model_dump(exclude_none=True))


def inference_options(opts: InferOptions, threads: int = 1) -> InferenceOptions:
    """The engine's options for a client's ``opts``; ``threads`` is the service's
    setting (not the client's to choose)."""
    return InferenceOptions(**opts.model_dump(), threads=threads)


def model_info(figures: dict) -> ModelInfo:
    """``figures`` as ``nnetc info --json`` prints them (service.cli.model_info)."""
    return ModelInfo(left_context=figures.get("left-context"),
                     right_context=figures.get("right-context"),
                     modulus=figures["modulus"], num_parameters=figures["num-parameters"],
                     input_dims=figures["input-dim"], output_dims=figures["output-dim"],
                     num_components=figures["num-components"],
                     component_types=figures["component-types"],
                     num_priors=figures.get("num-priors"),
                     streaming=figures.get("streaming"))


def stats_to_wire(stats: dict) -> dict:
    """component -> statistic -> a number (counts), a list (vectors) or a list of rows
    (matrices), from the float64 arrays of Executor.component_stats."""
    return {c: {k: np.asarray(v, dtype=np.float64).tolist() for k, v in fields.items()}
            for c, fields in stats.items()}


def gradient_to_wire(grad_nnet, encoding: str, threshold: int) -> dict:
    """component name -> parameter name -> gradient matrix (updatable components)."""
    out: dict = {}
    for name, comp in zip(grad_nnet.component_names, grad_nnet.components):
        if not comp.is_updatable:
            continue
        out[name] = {p: matrix_to_wire(a, encoding, threshold)
                     for p, a in zip(comp.PARAMS, comp.param_arrays())}
    return out


# -- answers --------------------------------------------------------------------------------------

def wire_json(model: BaseModel, exclude_none: bool = False) -> bytes:
    """``model`` as JSON, written by orjson: a wire model made with ``model_construct``
    whose JSON-rows matrices are float64 arrays (``matrix_to_wire``), which orjson writes
    directly -- through pydantic, each value of a 40000 x 500 answer was a Python float in
    a list, validated and then written (1.3 GB more at the peak and twice the time).
    ``exclude_none``: fields that are None are left out, at every level (FastAPI's
    response_model_exclude_none)."""
    def plain(obj):
        if isinstance(obj, BaseModel):
            return {k: v for k, v in obj if not (exclude_none and v is None)}
        raise TypeError(f"{type(obj).__name__} is not a wire type")
    return orjson.dumps(model, default=plain, option=orjson.OPT_SERIALIZE_NUMPY)
