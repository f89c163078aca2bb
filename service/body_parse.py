"""Large JSON bodies are parsed in a process of their own.

FastAPI reads a JSON body with ``json.loads`` and validates it in the event loop: a
single call holding the GIL for the whole body (a 34 MB /compute body with its input as
JSON rows held the loop 0.65 s to parse and 0.15 s to validate, and every other client
waited -- a /healthz as long).  A thread would not help: neither the parse nor the
validation lets the GIL go.  So a body of at least ``min_bytes`` (``NNETC_PARSE_OFFLOAD_
BYTES``) is parsed by a helper process (``NNETC_PARSE_PROCESSES``, started on first
use), which also packs each matrix sent as JSON rows, and each list of Indexes, into the
encoded forms the schemas accept (``{"shape": [r, c], "data": <little-endian float32
bytes>}``, ``{"shape": [k, 3], "data": <little-endian int32 n, t, x>}``): what comes back
is small to unpickle and quick to validate, and the routes decode it as they decode any
encoded matrix or Index list.  The event loop only waits.

The packing keeps the answer of the in-process parse exactly: a matrix is packed only
when every row is a list of the same, non-zero length of JSON numbers whose float32 value
does not depend on the route (floats, and integers no larger than 2**53, which a float64
holds exactly), Indexes only when each is a list of three integers within 32 bits;
anything else (ragged rows, a string or a boolean in a row, an empty matrix, an Index out
of range) is left as sent, for validation and the engine to judge as before.  A JSON
syntax error comes back as FastAPI would raise it (422, naming the character), any other
failure to read the body (not UTF-8, nested too deeply) as FastAPI's 400.  Should the
helper process die, the body is parsed in the event loop as before and the next one
starts a new helper.  The helper also makes large msgpack bodies JSON and JSON answers
msgpack for the middleware (``_OPERATIONS``).
"""

from __future__ import annotations

import asyncio
import base64
import email.message
import itertools
import json
import logging
import math
import os
import pickle
import struct
import subprocess
import sys
import threading
import types
import typing

import msgpack
import numpy as np
import orjson

log = logging.getLogger("nnetc.service")

_EXACT_INT = 2 ** 53
_INT32_MIN, _INT32_MAX = -(2 ** 31), 2 ** 31 - 1
_F32_LE = np.dtype("<f4")


# -- in the helper process ------------------------------------------------------------------

def parse_body(body: bytes, paths: tuple[tuple[str, ...], ...]) -> tuple:
    """``("ok", value)`` with the matrices and Indexes at ``paths`` (``packed_paths``)
    packed, ``("json_invalid", msg, pos)`` for a JSON syntax error, ``("error", kind,
    message)`` for any other failure to read the body (what FastAPI turns into its 400).
    (``("unsent",)`` comes back instead when the answer cannot be sent: see ``_serve``.)"""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return ("json_invalid", e.msg, e.pos)
    except Exception as e:  # noqa: BLE001 - reported as FastAPI reports it
        return ("error", type(e).__name__, str(e))
    for kind, *path in paths:
        _pack_at(value, tuple(path), _PACKERS[kind])
    return ("ok", value)


def _pack_at(node, path: tuple[str, ...], pack) -> None:
    """Pack what is at ``path`` below ``node`` with ``pack`` (``*``: every value of a
    dict, ``[]``: every item of a list)."""
    if not path:
        return
    key, rest = path[0], path[1:]
    if key == "[]":
        keys = range(len(node)) if isinstance(node, list) else []
    elif not isinstance(node, dict):
        return
    else:
        keys = list(node) if key == "*" else [key] if key in node else []
    for k in keys:
        if rest:
            _pack_at(node[k], rest, pack)
        else:
            packed = pack(node[k])
            if packed is not None:
                node[k] = packed


def pack_indexes(rows) -> dict | None:
    """The encoded form of Indexes sent as ``[[n, t, x], ...]``, or None where packing
    could change what validation and the engine make of them: anything but lists of three
    integers, or an integer outside 32 bits (the engine's own check names it)."""
    if type(rows) is not list or not rows:
        return None
    if any(type(r) is not list or len(r) != 3 for r in rows):
        return None
    flat = list(itertools.chain.from_iterable(rows))
    if set(map(type, flat)) != {int}:
        return None
    try:
        values = np.array(flat, dtype=np.int64)
    except OverflowError:
        return None
    if values.min() < _INT32_MIN or values.max() > _INT32_MAX:
        return None
    return {"shape": [len(rows), 3], "data": values.astype("<i4").tobytes()}


def pack_rows(rows) -> dict | None:
    """The encoded form of a matrix sent as JSON rows, or None where packing could change
    what validation and decoding make of it (see the module docstring)."""
    if type(rows) is not list or not rows:
        return None
    if any(type(r) is not list for r in rows):
        return None
    widths = set(map(len, rows))
    if len(widths) != 1 or 0 in widths:
        return None
    kinds = set(map(type, itertools.chain.from_iterable(rows)))
    if not kinds <= {float, int}:
        return None
    if int in kinds and any(type(v) is int and not -_EXACT_INT <= v <= _EXACT_INT
                            for v in itertools.chain.from_iterable(rows)):
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        values = np.array(rows, dtype=np.float64).astype(_F32_LE)
    return {"shape": [len(rows), widths.pop()], "data": values.tobytes()}


# msgpack bodies are made JSON data (binary as base64 text), and JSON answers msgpack for
# clients that accept it, here too: in the event loop for small ones, in a helper process
# for large ones (service/middleware.py)

def _bytes_to_b64(obj):
    """The msgpack body as JSON data: binary as base64 text; a non-finite number (which
    JSON cannot carry: orjson would write null, and an optional field would quietly
    take its default) is a ValueError naming where it is."""
    if isinstance(obj, (bytes, bytearray)):
        return base64.b64encode(obj).decode("ascii")
    if isinstance(obj, dict):
        return {str(k): _bytes_to_b64(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_bytes_to_b64(v) for v in obj]
    if isinstance(obj, msgpack.Timestamp):
        raise ValueError("msgpack timestamps are not accepted (plain maps, arrays, strings, "
                         "numbers and binary only)")
    if type(obj) is float and not math.isfinite(obj):
        raise _NonFinite(obj)
    return obj


class _NonFinite(ValueError):
    pass


def _non_finite_path(obj, path: str = "") -> str | None:
    """Where the first non-finite number of a decoded msgpack body is (``a.b.3``)."""
    if type(obj) is float and not math.isfinite(obj):
        return path or "the top level"
    items = (obj.items() if isinstance(obj, dict) else
             enumerate(obj) if isinstance(obj, (list, tuple)) else ())
    for k, v in items:
        found = _non_finite_path(v, f"{path}.{k}" if path else str(k))
        if found is not None:
            return found
    return None


def _msgpack_to_json(body: bytes) -> bytes:
    obj = msgpack.unpackb(body, raw=False, strict_map_key=False, ext_hook=_no_ext)
    try:
        return orjson.dumps(_bytes_to_b64(obj))
    except _NonFinite as e:
        raise ValueError(f"the number {e.args[0]} at {_non_finite_path(obj)}: only finite "
                         f"numbers are accepted") from None


def _no_ext(code: int, data: bytes):
    """msgpack ``ext_hook``: the wire format has no extension types (a Timestamp or an
    application's own would otherwise reach the schemas as a bare tuple)."""
    raise ValueError(f"msgpack extension type {code} is not accepted (plain maps, arrays, "
                     f"strings, numbers and binary only)")


def msgpack_to_json(body: bytes) -> tuple:
    """``("ok", JSON bytes)`` of a msgpack body, or ``("error", the 400's message)``."""
    try:
        return ("ok", _msgpack_to_json(body))
    except Exception as e:  # noqa: BLE001 - any undecodable body is the client's
        return ("error", f"body is not valid msgpack: {type(e).__name__}"
                         + (f" ({e})" if str(e) else ""))


def json_to_msgpack(data: bytes) -> tuple:
    """``("ok", msgpack bytes)`` of a JSON answer, or ``("error", why)``."""
    try:
        return ("ok", msgpack.packb(orjson.loads(data)))
    except Exception as e:  # noqa: BLE001 - told to the caller, which converts it itself
        return ("error", f"{type(e).__name__}: {e}")


_PACKERS = {"matrix": pack_rows, "indexes": pack_indexes}
_OPERATIONS = {"json": parse_body, "msgpack_to_json": msgpack_to_json,
               "json_to_msgpack": json_to_msgpack}


# -- in the service ------------------------------------------------------------------------

def packed_paths(model: type) -> tuple[tuple[str, ...], ...]:
    """Where a body model's matrices and Indexes are, each as (kind, *keys):
    ``("matrix", "features")`` for a ``Matrix`` field (or an optional one),
    ``("matrix", "inputs", "*")`` for a ``dict[str, Matrix]``, ``("indexes", "request",
    "inputs", "[]", "indexes")`` for the Indexes of each item of a list, through nested
    models."""
    from pydantic import BaseModel  # noqa: PLC0415

    from schemas.common import EncodedIndexes, EncodedMatrix  # noqa: PLC0415

    def kind_of(t) -> str | None:
        args = typing.get_args(t)
        if not any(typing.get_origin(a) is list for a in args):
            return None
        return ("matrix" if EncodedMatrix in args else
                "indexes" if EncodedIndexes in args else None)

    def walk(t, prefix) -> list:
        if isinstance(t, type) and issubclass(t, BaseModel):
            return [p for name, f in t.model_fields.items()
                    for p in walk(f.annotation, (*prefix, f.alias or name))]
        origin, args = typing.get_origin(t), typing.get_args(t)
        kind = kind_of(t)
        if kind is not None:
            return [(kind, *prefix)]
        if origin in (typing.Union, types.UnionType):
            return [p for a in args if a is not type(None) for p in walk(a, prefix)]
        if origin is dict and len(args) == 2:
            return walk(args[1], (*prefix, "*"))
        if origin is list and len(args) == 1:
            return walk(args[0], (*prefix, "[]"))
        return []
    return tuple(dict.fromkeys(walk(model, ())))


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this content type as JSON (``application/json``
    or ``application/*+json``; a body without one it does not read as JSON)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


class _Helper:
    """One helper process: ``python -m service.body_parse``, bodies and answers as
    length-prefixed pickles over its standard input and output.  A process started this
    way, not by multiprocessing, does not import the service's main module again (which
    a script that does not guard its start would then run again)."""

    def __init__(self):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "service.body_parse"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def call(self, op: str, *args) -> tuple:
        from engine.compiler.gc_pause import gc_paused  # noqa: PLC0415 (not in the helper)
        _send(self.proc.stdin, (op, args))
        data = _receive(self.proc.stdout, load=False)
        with gc_paused():     # the value's lists make no cycles: no collections meanwhile
            return pickle.loads(data)

    def stop(self) -> None:
        try:
            self.proc.stdin.close()       # the helper ends at the end of its input
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def _send(stream, value) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream, load: bool = True):
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the helper's output ended")
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the helper's output ended")
    return pickle.loads(data) if load else data


def _serve() -> None:
    """The helper process: do what each message of its input asks (``_OPERATIONS``),
    answer on its output."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr          # nothing else may write to the answers' stream
    while True:
        try:
            op, args = _receive(stdin)
        except EOFError:
            return
        result = _OPERATIONS[op](*args)
        try:
            _send(stdout, result)
        except Exception:  # noqa: BLE001 - e.g. nested too deeply to pickle: the service
            _send(stdout, ("unsent",))   # parses this one itself


class BodyParser:
    """The helper processes (started when first needed) and the size from which a body
    goes to them."""

    def __init__(self, processes: int, min_bytes: int):
        self.processes = processes
        self.min_bytes = min_bytes
        self._idle: list[_Helper] = []
        self._all: list[_Helper] = []
        self._lock = threading.Lock()
        self._free = threading.Semaphore(processes)
        self._closed = False

    def wanted(self, size: int) -> bool:
        return self.processes > 0 and size >= self.min_bytes and not self._closed

    def _call(self, op: str, *args) -> tuple | None:
        with self._free:
            with self._lock:
                if self._closed:
                    return None
                helper = self._idle.pop() if self._idle else None
            if helper is None:
                try:
                    helper = _Helper()
                except OSError as e:
                    log.warning(f"no body parser process could be started ({e}); this "
                                f"body is handled in the event loop")
                    return None
                with self._lock:
                    self._all.append(helper)
            try:
                result = helper.call(op, *args)
            except (OSError, EOFError, ValueError, pickle.UnpicklingError, struct.error):
                log.warning("the body parser process stopped; this body is handled in the "
                            "event loop and the next large one starts a new process")
                with self._lock:
                    if helper in self._all:      # (close() may have let it go already)
                        self._all.remove(helper)
                helper.proc.kill()
                helper.stop()
                return None
            with self._lock:
                if self._closed:                 # closed meanwhile: not kept
                    helper.stop()
                else:
                    self._idle.append(helper)
            return None if result[0] == "unsent" else result

    async def call(self, op: str, *args) -> tuple | None:
        """What operation ``op`` (``_OPERATIONS``) gives for ``args`` in a helper process;
        None when the helper process died meanwhile or could not send its answer (the
        caller does the work itself, as before)."""
        return await asyncio.to_thread(self._call, op, *args)

    async def parse(self, body: bytes, paths) -> tuple | None:
        """``parse_body`` of ``body`` in a helper process (see ``call``)."""
        return await self.call("json", body, paths)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            helpers, self._all, self._idle = self._all, [], []
        for helper in helpers:
            helper.stop()


if __name__ == "__main__":
    _serve()
