"""Translation between wire models (schemas/) and engine objects: the only module
that knows both.  Matrix decoding checks shapes here, so that a wrong matrix is
reported against its request field before any engine code runs."""

from __future__ import annotations

import base64
import binascii
import re
import secrets

import msgpack
import numpy as np
import orjson
from pydantic import BaseModel

from engine.compiler.request import ComputationRequest, IoSpecification
from engine.core.finite import as_float32, non_finite
from engine.compiler.gc_pause import gc_paused
from engine.core.index import INT32_MAX, index_rows
from engine.inference import InferenceOptions
from engine.optimizer.options import OptimizeOptions
from schemas.common import EncodedIndexes, EncodedMatrix
from schemas.compile import ComputationRequestModel, OptimizerOptions
from schemas.compute import InferOptions
from schemas.models import ModelInfo
from service.errors import FieldError, ServiceError

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
        raw = _encoded_data(value, field, "float32", 4)
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
    above ``threshold`` elements), its data left as the float32 values (``Float32Data``)
    for ``wire_json`` to code a piece at a time.  A matrix holding NaN or infinite
    values (a network's output can overflow on finite input) always goes in the base64
    form, which keeps them: JSON has no such numbers, and the JSON encoder would write
    them as null."""
    a = np.ascontiguousarray(np.asarray(arr), dtype=_F32_LE)
    if a.ndim == 1:
        a = a.reshape(1, -1)
    if (encoding == "json" or (encoding == "auto" and a.size <= threshold)) \
            and np.isfinite(a).all():
        # the rows as float64 (the float32 values exactly, as JSON numbers), written out by
        # wire_json without a Python float per value
        return a.astype(np.float64)
    return EncodedMatrix.model_construct(shape=(int(a.shape[0]), int(a.shape[1])),
                                         dtype="float32", data=Float32Data(a))


class Float32Data:
    """The ``data`` of an answer's encoded matrix before it is coded: its float32 values
    (little-endian, row-major), base64-coded by ``wire_json``."""

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray):
        self.values = values

    def view(self) -> memoryview:
        """The bytes of the values (a view, no copy)."""
        return memoryview(self.values.reshape(-1).view(np.uint8))

    def __str__(self) -> str:
        return b64encode(self.view())


# Large matrices are base64-coded a piece at a time: each piece is one short call holding
# the GIL, between which the event loop runs (one call over an 80 MB answer held it 0.2 s).
# A piece of whole 3-byte groups (4 characters) codes exactly as it does within the whole.
_B64_PIECE = 3 << 18                      # bytes, 1 MiB of text
_B64_TEXT = re.compile("[A-Za-z0-9+/]*")


def b64_pieces(raw) -> list[bytes]:
    """The base64 text of ``raw`` (bytes-like), as pieces of 1 MiB whose concatenation is
    ``base64.b64encode(raw)``."""
    view = memoryview(raw)
    return [binascii.b2a_base64(view[at:at + _B64_PIECE], newline=False)
            for at in range(0, len(view), _B64_PIECE)]


def b64encode(raw) -> str:
    """``base64.b64encode(raw).decode("ascii")``, piece by piece."""
    return "".join(piece.decode("ascii") for piece in b64_pieces(raw))


def b64decode(text: str) -> bytes:
    """``base64.b64decode(text, validate=True)``, piece by piece, with its verdicts: the
    pieces before the last must be the alphabet alone (whole 4-character groups: they
    decode as they do within the whole), else the whole goes to ``base64.b64decode``;
    the last piece is decoded after the 4 characters before it, which put the strict
    decoder in the state it has there within the whole."""
    piece = _B64_PIECE // 3 * 4
    if len(text) <= piece:
        return base64.b64decode(text, validate=True)
    if not text.isascii():
        raise ValueError("string argument should contain only ASCII characters")
    out = []
    last = (len(text) - 1) // piece * piece
    for at in range(0, last, piece):
        part = text[at:at + piece]
        if _B64_TEXT.fullmatch(part) is None:
            return base64.b64decode(text, validate=True)
        out.append(binascii.a2b_base64(part))
    out.append(binascii.a2b_base64(text[last - 4:], strict_mode=True)[3:])
    return b"".join(out)


# -- requests and options ---------------------------------------------------------------------

def indexes_from_wire(value: EncodedIndexes, field: str) -> np.ndarray:
    """(k, 3) int64 n, t, x rows of Indexes sent in the encoded form (errors name
    ``field``)."""
    rows, cols = value.shape
    if cols != 3 or rows < 0:
        raise FieldError(field, f"shape {list(value.shape)}: expected [rows, 3]")
    raw = _encoded_data(value, field, "int32", 4)
    return np.frombuffer(raw, dtype="<i4").astype(np.int64).reshape(rows, 3)


def _encoded_data(value, field: str, dtype: str, itemsize: int) -> bytes:
    """The bytes of an encoded matrix or Index list (raw, or base64 text), as many as its
    (non-negative) shape needs."""
    raw = value.data
    if isinstance(raw, str):
        try:
            raw = b64decode(raw)
        except (binascii.Error, ValueError):
            raise FieldError(field, "data is not valid base64") from None
    shape = list(value.shape)
    need = shape[0] * shape[1] * itemsize
    if len(raw) != need:
        raise FieldError(field, f"data has {len(raw)} bytes, shape {shape} {dtype} needs "
                                f"{need}")
    return raw


def request_to_engine(req: ComputationRequestModel,
                      max_indexes: int | None = None) -> ComputationRequest:
    """The engine's request for a validated wire request: each spec's Indexes read into an
    array in one pass (the schema has made them integer triples, or they came encoded),
    counted against ``max_indexes`` (413 beyond it, before any Index object is made),
    then the Index objects made in bulk with the cyclic garbage collector paused (none
    of this makes cycles; a 40000-frame request's Indexes set off full collections
    otherwise)."""
    specs = []
    for kind, group in (("inputs", req.inputs), ("outputs", req.outputs)):
        for k, s in enumerate(group):
            if isinstance(s.indexes, EncodedIndexes):
                rows = indexes_from_wire(s.indexes, f"request.{kind}.{k}.indexes")
            else:
                try:
                    rows = index_rows(s.indexes)
                except OverflowError:    # beyond 64 bits: the plain path names the index
                    rows = None
            specs.append((kind, k, s, rows))
    count = sum(len(s.indexes) if rows is None else len(rows) for _, _, s, rows in specs)
    if max_indexes is not None and count > max_indexes:
        raise ServiceError(413, "RequestTooLarge",
                           f"the request has {count} Indexes (inputs and outputs), more than "
                           f"this service's max_request_indexes ({max_indexes}); split it",
                           "request")

    def spec(kind, k, s, rows):
        if rows is None:
            return IoSpecification.from_json(s.model_dump(), f"{kind[:-1]} {k}")
        return IoSpecification(s.name, rows, s.has_deriv)
    with gc_paused():
        made = [spec(*x) for x in specs]
    n_in = len(req.inputs)
    return ComputationRequest(made[:n_in], made[n_in:], req.need_model_derivative,
                              req.store_component_stats)


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
    """``model`` as JSON (``wire_pieces`` joined)."""
    return b"".join(wire_pieces(model, exclude_none))


# an answer's large matrices are written this many bytes (about) at a time
_PIECE = 1 << 20


def wire_pieces(model: BaseModel, exclude_none: bool = False) -> list[bytes]:
    """``model`` as JSON, in pieces whose concatenation is the document.  ``model`` is a
    wire model made with ``model_construct`` whose JSON-rows matrices are float64 arrays
    (``matrix_to_wire``: through pydantic, each value of a 40000 x 500 answer was a
    Python float in a list, validated and then written: 1.3 GB more at the peak and twice
    the time) and whose encoded matrices hold ``Float32Data``.  orjson writes the
    document; a matrix of more than ``_PIECE`` bytes is left out of it and written a
    block of rows (or 1 MiB of base64) at a time, in the pieces between: no call holds the
    GIL for a whole large matrix, and no copy of the whole answer is made (an 80 MB
    base64 answer was coded in one 0.2 s call, then copied twice in one piece each, while
    the event loop and every other client waited).  ``exclude_none``: fields that are None
    are left out, at every level (FastAPI's response_model_exclude_none)."""
    return _pieces(model, exclude_none, msgpack_out=False)


def msgpack_pieces(model: BaseModel, exclude_none: bool = False) -> list[bytes]:
    """``model`` as msgpack, in pieces, as ``wire_pieces`` makes its JSON: the bytes the
    JSON answer re-encoded as msgpack gives (``msgpack.packb(orjson.loads(json))``: base64
    text stays text, JSON rows are float64 arrays), made without the JSON and a copy of the
    whole answer."""
    return _pieces(model, exclude_none, msgpack_out=True)


def _pieces(model: BaseModel, exclude_none: bool, msgpack_out: bool) -> list[bytes]:
    """``wire_pieces`` or ``msgpack_pieces``: the document written with a marker string
    in place of each large matrix, then split at the markers (as the format writes them)
    and the matrices' pieces put between."""
    large: list = []
    mark = f"nnetc-piece-{secrets.token_hex(8)}-"

    def plain(obj):
        if isinstance(obj, BaseModel):
            return {k: v for k, v in obj if not (exclude_none and v is None)}
        if isinstance(obj, np.ndarray):
            if obj.nbytes <= _PIECE:
                return obj.tolist() if msgpack_out else orjson.Fragment(
                    orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY))
        elif isinstance(obj, Float32Data):
            if obj.values.nbytes <= _PIECE:
                return str(obj)
        elif msgpack_out and isinstance(obj, tuple):
            return list(obj)
        elif msgpack_out and isinstance(obj, np.generic):    # (orjson writes them itself)
            return obj.item()
        else:
            raise TypeError(f"{type(obj).__name__} is not a wire type")
        large.append(obj)
        return f"{mark}{len(large) - 1}"
    if msgpack_out:
        doc = msgpack.packb(_plain_tree(model, plain))
        marks = {msgpack.packb(f"{mark}{k}"): k for k in range(len(large))}
        write = _large_msgpack_pieces
    else:
        doc = orjson.dumps(model, default=plain)
        marks = {f'"{mark}{k}"'.encode(): k for k in range(len(large))}
        write = _large_pieces
    if not large:
        return [doc]
    parts = re.split(b"(" + b"|".join(map(re.escape, marks)) + b")", doc)
    pieces = [parts[0]]
    for k in range(1, len(parts), 2):
        pieces.extend(write(large[marks[parts[k]]]))
        pieces.append(parts[k + 1])
    return [p for p in pieces if p]


def _plain_tree(obj, plain):
    """``obj`` with every value msgpack cannot write made plain by ``plain`` (msgpack's own
    ``default`` is not asked about tuples, nor about a model's fields in order)."""
    while not isinstance(obj, (dict, list, str, int, float, bool, type(None), bytes)):
        obj = plain(obj)
    if isinstance(obj, dict):
        return {k: _plain_tree(v, plain) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain_tree(v, plain) for v in obj]
    return obj


def _large_msgpack_pieces(obj) -> list[bytes]:
    if isinstance(obj, Float32Data):
        view = obj.view()
        size = (len(view) + 2) // 3 * 4
        coded = b64_pieces(view)
        return [_msgpack_str_head(size), *coded]
    rows = max(1, _PIECE // max(1, obj.shape[1] * 9))    # 9 bytes a float64
    out = [_msgpack_array_head(obj.shape[0])]
    for at in range(0, obj.shape[0], rows):
        out.append(b"".join(map(msgpack.packb, obj[at:at + rows].tolist())))
    return out


def _msgpack_str_head(size: int) -> bytes:
    """The header msgpack writes before a text of ``size`` bytes (the shortest form)."""
    if size < 32:
        return bytes([0xA0 | size])
    if size < 256:
        return b"\xd9" + size.to_bytes(1, "big")
    if size < 65536:
        return b"\xda" + size.to_bytes(2, "big")
    return b"\xdb" + size.to_bytes(4, "big")


def _msgpack_array_head(count: int) -> bytes:
    if count < 16:
        return bytes([0x90 | count])
    if count < 65536:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def _large_pieces(obj) -> list[bytes]:
    if isinstance(obj, Float32Data):
        view = obj.view()
        coded = b64_pieces(view)
        return [b'"', *coded, b'"']
    rows = max(1, _PIECE // max(1, obj.shape[1] * 20))    # about 20 bytes a value
    blocks = [orjson.dumps(obj[at:at + rows], option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]
              for at in range(0, obj.shape[0], rows)]
    out = [b"["]
    for k, block in enumerate(blocks):
        out.append(block if k == 0 else b"," + block)
    out.append(b"]")
    return out
