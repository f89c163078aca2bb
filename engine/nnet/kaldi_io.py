"""Kaldi's basic serialization (base/io-funcs, matrix I/O) for text and binary streams.

Binary streams start with ``\\0B``.  Tokens are written followed by one space;
binary integers/floats are preceded by a size byte; float matrices/vectors are
``FM``/``FV`` (``DM``/``DV`` for double) followed by their sizes and raw
little-endian data.  Text matrices are ``[`` rows ``]`` with one row per line.

Every read failure raises ``ModelFormatError`` naming the source and byte offset.
"""

from __future__ import annotations

import struct

import numpy as np

from engine.core.errors import ModelFormatError
from engine.core.index import INT32_MAX, INT32_MIN

_WS = b" \t\n\r\v\f"
BINARY_HEADER = b"\0B"


class KaldiReader:
    """Sequential reader over a Kaldi stream held in memory."""

    def __init__(self, data: bytes, binary: bool | None = None, source: str = "<model>",
                 pos: int = 0):
        self.data = bytes(data)
        self.source = source
        self.pos = pos
        if binary is None:
            binary = self.data[pos:pos + 2] == BINARY_HEADER
            if binary:
                self.pos += 2
        self.binary = binary

    # -- errors -----------------------------------------------------------------
    def error(self, message: str, offset: int | None = None) -> ModelFormatError:
        return ModelFormatError(message, source=self.source,
                                offset=self.pos if offset is None else offset)

    # -- low level --------------------------------------------------------------
    def at_eof(self) -> bool:
        self._skip_ws()
        return self.pos >= len(self.data)

    def _skip_ws(self) -> None:
        d, p, n = self.data, self.pos, len(self.data)
        while p < n and d[p] in _WS:
            p += 1
        self.pos = p

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise self.error(f"unexpected end of file (wanted {n} more bytes)")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def _word(self) -> str:
        """Next whitespace-delimited word (text mode and tokens)."""
        self._skip_ws()
        d, start, n = self.data, self.pos, len(self.data)
        p = start
        while p < n and d[p] not in _WS:
            p += 1
        if p == start:
            raise self.error("unexpected end of file (expected a token)")
        self.pos = p
        try:
            return d[start:p].decode("ascii")
        except UnicodeDecodeError:
            raise self.error(f"non-ASCII bytes where a token was expected: {d[start:p][:20]!r}",
                             offset=start) from None

    # -- tokens -----------------------------------------------------------------
    def read_token(self) -> str:
        tok = self._word()
        if self.binary:
            # Kaldi's WriteToken leaves exactly one space after a binary token.
            if self.pos < len(self.data):
                self.pos += 1
        return tok

    def peek_byte(self) -> bytes:
        """The next byte, not consumed and without skipping whitespace (Kaldi's
        ``is.peek()``); b"" at the end."""
        return self.data[self.pos:self.pos + 1]

    def peek_token(self) -> str:
        save = self.pos
        try:
            return self.read_token()
        finally:
            self.pos = save

    def expect_token(self, expected: str) -> None:
        start = self.pos
        tok = self.read_token()
        if tok != expected:
            raise self.error(f"expected token {expected!r}, got {tok!r}", offset=start)

    def try_token(self, expected: str) -> bool:
        """Consume ``expected`` if it is the next token; return whether it was."""
        save = self.pos
        try:
            tok = self.read_token()
        except ModelFormatError:
            self.pos = save
            return False
        if tok == expected:
            return True
        self.pos = save
        return False

    # -- basic types ------------------------------------------------------------
    def read_int(self) -> int:
        """A Kaldi int32 (every integer field of the files read here is one)."""
        if not self.binary:
            self._skip_ws()
        start = self.pos
        if self.binary:
            size = self._take(1)[0]
            if size == 4:
                v = struct.unpack("<i", self._take(4))[0]
            elif size == 8:
                v = struct.unpack("<q", self._take(8))[0]
            elif size == 0xFC:  # unsigned 4-byte
                v = struct.unpack("<I", self._take(4))[0]
            else:
                raise self.error(f"bad integer size byte {size}", offset=start)
        else:
            w = self._word()
            try:
                v = int(w)
            except ValueError:
                raise self.error(f"expected an integer, got {w!r}", offset=start) from None
        if not INT32_MIN <= v <= INT32_MAX:
            raise self.error(f"integer {v} is out of the range of a 32-bit integer",
                             offset=start)
        return v

    def read_float(self) -> float:
        """A Kaldi BaseFloat: a double in a binary file is rounded to float, as Kaldi's
        ReadBasicType<float> does (so that what was read is what gets written)."""
        if self.binary:
            with np.errstate(over="ignore"):
                return float(np.float32(self.read_binary_real()))
        start = self.pos
        w = self._word()
        try:
            with np.errstate(over="ignore"):
                return float(np.float32(w))
        except ValueError:
            raise self.error(f"expected a number, got {w!r}", offset=start) from None

    def read_binary_real(self) -> float:
        """A binary float or double (size byte 4 or 8), at its own precision."""
        start = self.pos
        size = self._take(1)[0]
        if size == 4:
            return float(np.frombuffer(self._take(4), dtype="<f4")[0])
        if size == 8:
            return float(np.frombuffer(self._take(8), dtype="<f8")[0])
        raise self.error(f"bad float size byte {size}", offset=start)

    def read_bool(self) -> bool:
        self._skip_ws()
        start = self.pos
        c = self._take(1)
        if c == b"T":
            return True
        if c == b"F":
            return False
        raise self.error(f"expected a boolean T or F, got {c!r}", offset=start)

    # -- vectors and matrices ---------------------------------------------------
    def read_int_vector(self) -> list[int]:
        if self.binary:
            start = self.pos
            size = self._take(1)[0]
            if size != 4:
                raise self.error(f"integer vector has element size {size}, expected 4",
                                 offset=start)
            n = self.read_int_raw()
            if n < 0 or n * 4 > len(self.data) - self.pos:
                raise self.error(f"integer vector size {n} exceeds the file", offset=start)
            return np.frombuffer(self._take(4 * n), dtype="<i4").astype(int).tolist()
        start = self.pos
        if self._word() != "[":
            raise self.error("expected '[' to start an integer vector", offset=start)
        out = []
        while True:
            w_start = self.pos
            w = self._word()
            if w == "]":
                return out
            try:
                out.append(int(w))
            except ValueError:
                raise self.error(f"expected an integer in vector, got {w!r}",
                                 offset=w_start) from None

    def read_int_raw(self) -> int:
        return struct.unpack("<i", self._take(4))[0]

    def read_vector(self) -> np.ndarray:
        """A Kaldi Vector<float> (FV/DV binary, or '[ ... ]' text)."""
        if self.binary:
            start = self.pos
            tok = self.read_token()
            if tok not in ("FV", "DV"):
                raise self.error(f"expected a vector (FV/DV), got token {tok!r}", offset=start)
            n = self.read_int()
            width = 4 if tok == "FV" else 8
            if n < 0 or n * width > len(self.data) - self.pos:
                raise self.error(f"vector size {n} exceeds the file", offset=start)
            raw = self._take(n * width)
            return np.frombuffer(raw, dtype="<f4" if width == 4 else "<f8").astype(np.float32)
        return self._read_text_array(is_matrix=False)

    def read_matrix(self) -> np.ndarray:
        """A Kaldi Matrix<float> (FM/DM binary, or '[ rows ]' text). Always float32 2-D."""
        if self.binary:
            start = self.pos
            tok = self.read_token()
            if tok not in ("FM", "DM"):
                if tok.startswith("CM"):
                    raise self.error("compressed matrices are not supported in models",
                                     offset=start)
                raise self.error(f"expected a matrix (FM/DM), got token {tok!r}", offset=start)
            rows = self.read_int()
            cols = self.read_int()
            width = 4 if tok == "FM" else 8
            if rows < 0 or cols < 0 or rows * cols * width > len(self.data) - self.pos:
                raise self.error(f"matrix size {rows}x{cols} exceeds the file", offset=start)
            raw = self._take(rows * cols * width)
            arr = np.frombuffer(raw, dtype="<f4" if width == 4 else "<f8")
            return arr.astype(np.float32).reshape(rows, cols)
        return self._read_text_array(is_matrix=True)

    def _read_text_array(self, is_matrix: bool) -> np.ndarray:
        self._skip_ws()
        start = self.pos
        if self.data[start:start + 1] != b"[":
            what = "matrix" if is_matrix else "vector"
            got = self.data[start:start + 10]
            raise self.error(f"expected '[' to start a text {what}, got {got!r}")
        end = self.data.find(b"]", start + 1)
        if end < 0:
            raise self.error("unterminated text matrix/vector (no closing ']')")
        body = self.data[start + 1:end]
        self.pos = end + 1
        try:
            text = body.decode("ascii")
        except UnicodeDecodeError:
            raise self.error("non-ASCII bytes inside a text matrix", offset=start) from None
        if not is_matrix:
            try:
                return np.array(text.split(), dtype=np.float32)
            except ValueError as e:
                raise self.error(f"bad number in text vector: {e}", offset=start) from None
        rows = [ln.split() for ln in text.split("\n")]
        rows = [r for r in rows if r]
        if not rows:
            return np.zeros((0, 0), dtype=np.float32)
        ncol = len(rows[0])
        for i, r in enumerate(rows):
            if len(r) != ncol:
                raise self.error(f"text matrix row {i} has {len(r)} values, row 0 has {ncol}",
                                 offset=start)
        try:
            flat = np.array([v for r in rows for v in r], dtype=np.float32)
        except ValueError as e:
            raise self.error(f"bad number in text matrix: {e}", offset=start) from None
        return flat.reshape(len(rows), ncol)


def _float_strs(values, min_precision: int = 6) -> list[str]:
    """C-style %g text with at least ``min_precision`` significant digits (Kaldi's
    streams print 6, or 7 once a file stream is initialised), using more digits,
    up to 9, only where needed to read back to the same float32 (Kaldi would lose
    those bits; we do not)."""
    v = np.asarray(values, dtype=np.float32).ravel()
    out = np.char.mod(f"%.{min_precision}g", v)
    bad = out.astype(np.float32) != v
    bad &= ~np.isnan(v)
    for prec in range(min_precision + 1, 10):
        if not bad.any():
            break
        idx = np.nonzero(bad)[0]
        fixed = np.char.mod(f"%.{prec}g", v[idx])
        out = out.astype(f"<U{max(out.dtype.itemsize // 4, fixed.dtype.itemsize // 4)}")
        out[idx] = fixed
        bad[idx] = fixed.astype(np.float32) != v[idx]
    return out.tolist()


def _fmt_floats(values, min_precision: int = 6) -> str:
    return " ".join(_float_strs(values, min_precision))


def format_float(x: float, min_precision: int = 6) -> str:
    return _float_strs([x], min_precision)[0]


class KaldiWriter:
    """Accumulates a Kaldi stream; ``getvalue()`` returns the bytes."""

    def __init__(self, binary: bool, header: bool = False):
        self.binary = binary
        self.parts: list[bytes] = []
        # Kaldi's InitKaldiOutputStream (used for files) raises the text precision
        # to 7 digits; a bare stream (e.g. one component printed alone) keeps 6.
        self.precision = 7 if header else 6
        if binary and header:
            self.parts.append(BINARY_HEADER)

    def getvalue(self) -> bytes:
        return b"".join(self.parts)

    def raw(self, b: bytes | str) -> None:
        self.parts.append(b.encode("ascii") if isinstance(b, str) else b)

    def write_token(self, tok: str) -> None:
        self.parts.append(tok.encode("ascii") + b" ")

    def write_int(self, v: int) -> None:
        if self.binary:
            self.parts.append(b"\x04" + struct.pack("<i", int(v)))
        else:
            self.parts.append(f"{int(v)} ".encode())

    def write_float(self, v: float) -> None:
        if self.binary:
            self.parts.append(b"\x04" + np.float32(v).astype("<f4").tobytes())
        else:
            self.parts.append((format_float(v, self.precision) + " ").encode())

    def write_bool(self, v: bool) -> None:
        self.parts.append(b"T" if v else b"F")
        if not self.binary:
            self.parts.append(b" ")

    def write_int_vector(self, vals) -> None:
        vals = [int(x) for x in vals]
        if self.binary:
            self.parts.append(b"\x04" + struct.pack("<i", len(vals)))
            self.parts.append(np.asarray(vals, dtype="<i4").tobytes())
        else:
            self.parts.append(("[ " + "".join(f"{x} " for x in vals) + "]\n").encode())

    def write_vector(self, v) -> None:
        v = np.asarray(v, dtype=np.float32).ravel()
        if self.binary:
            self.write_token("FV")
            self.write_int(v.size)
            self.parts.append(v.astype("<f4").tobytes())
        else:
            body = _fmt_floats(v, self.precision)
            self.parts.append((" [ " + body + (" " if body else "") + "]\n").encode())

    def write_matrix(self, m) -> None:
        m = np.asarray(m, dtype=np.float32)
        if m.ndim != 2:
            m = m.reshape(m.shape[0] if m.ndim else 0, -1)
        if self.binary:
            self.write_token("FM")
            self.write_int(m.shape[0])
            self.write_int(m.shape[1])
            self.parts.append(np.ascontiguousarray(m).astype("<f4").tobytes())
            return
        if m.size == 0:
            self.parts.append(b" [ ]\n")
            return
        lines = [" ["]
        strs = _float_strs(m, self.precision)
        c = m.shape[1]
        for i in range(m.shape[0]):
            lines.append("\n  " + " ".join(strs[i * c:(i + 1) * c]) + " ")
        lines.append("]\n")
        self.parts.append("".join(lines).encode())


# --------------------------------------------------------------------------------------
# Kaldi ``double`` values (component statistics are kept in double precision)


def read_double(reader: KaldiReader) -> float:
    """WriteBasicType<double>: size byte 8 + 8 bytes in binary; a number in text."""
    if reader.binary:
        return reader.read_binary_real()
    start = reader.pos
    tok = reader.read_token()
    try:
        return float(tok)
    except ValueError:
        raise reader.error(f"expected a number, got {tok!r}", offset=start) from None


def double_text(value: float, min_precision: int = 6) -> str:
    """C++ streams print doubles with 6 (bare stream) or 7 (file stream) significant
    digits; more digits are used only when those would not read back to the same
    double, so nothing is lost."""
    value = float(value)
    text = f"{value:.{min_precision}g}"
    if float(text) != value:
        for prec in range(min_precision + 1, 18):
            text = f"{value:.{prec}g}"
            if float(text) == value:
                break
    return text


def write_double(writer: KaldiWriter, value: float) -> None:
    if writer.binary:
        writer.raw(b"\x08" + struct.pack("<d", float(value)))
    else:
        writer.raw(double_text(value, writer.precision) + " ")


def write_double_vector(writer: KaldiWriter, v) -> None:
    v = np.asarray(v, dtype=np.float64).ravel()
    if writer.binary:
        writer.write_token("DV")
        writer.write_int(v.size)
        writer.raw(v.astype("<f8").tobytes())
    else:
        writer.write_vector(v)


def write_double_matrix(writer: KaldiWriter, m) -> None:
    m = np.asarray(m, dtype=np.float64)
    if m.ndim != 2:
        m = m.reshape(0, 0)
    if writer.binary:
        writer.write_token("DM")
        writer.write_int(m.shape[0])
        writer.write_int(m.shape[1])
        writer.raw(np.ascontiguousarray(m).astype("<f8").tobytes())
    else:
        writer.write_matrix(m)


def _read_binary_array(reader: KaldiReader, tokens: tuple[str, str], ndim: int) -> np.ndarray:
    start = reader.pos
    tok = reader.read_token()
    if tok not in tokens:
        what = "vector" if ndim == 1 else "matrix"
        raise reader.error(f"expected a {what} ({'/'.join(tokens)}), got token {tok!r}",
                           offset=start)
    shape = [reader.read_int() for _ in range(ndim)]
    width = 4 if tok[0] == "F" else 8
    count = int(np.prod(shape)) if shape else 0
    if min(shape) < 0 or count * width > len(reader.data) - reader.pos:
        raise reader.error(f"size {'x'.join(map(str, shape))} exceeds the file", offset=start)
    raw = reader._take(count * width)
    return np.frombuffer(raw, dtype="<f4" if width == 4 else "<f8").astype(np.float64).reshape(shape)


def read_double_vector(reader: KaldiReader) -> np.ndarray:
    """A Vector<double> (DV, or FV, in binary; text); returned as float64."""
    if reader.binary:
        return _read_binary_array(reader, ("FV", "DV"), 1)
    return reader.read_vector().astype(np.float64)


def read_double_matrix(reader: KaldiReader) -> np.ndarray:
    if reader.binary:
        return _read_binary_array(reader, ("FM", "DM"), 2)
    return reader.read_matrix().astype(np.float64)
