"""Pieces shared by component modules: the opening token that files may leave out, Kaldi
file-format fields read and written from one table, fields that old models may lack
(each told by the token already read), the base of components whose whole file is such
a table (DistributeComponent, the statistics components, RestrictedAttentionComponent
and others), the skipping of old models' statistics, and the base of components whose
input and output are both ``dim`` columns (with the copy, optionally scaled, that their
propagate or backprop makes).

A field is ``(token, attribute, kind)``: the Kaldi token, the component attribute that
holds the value, and how the value is stored (INT, FLOAT, BOOL, DOUBLE, VECTOR and
INT_VECTOR for a float or integer vector, or MATRIX).  Each component keeps its own field
table, so its tokens and their order stay in its class.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, NamedTuple

from engine.nnet.components.base import Component
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter, read_double, write_double


class FieldKind(NamedTuple):
    """How one field's value is read and written."""

    read: Callable[[KaldiReader], Any]
    write: Callable[[KaldiWriter, Any], None]


INT = FieldKind(lambda r: r.read_int(), lambda w, v: w.write_int(v))
FLOAT = FieldKind(lambda r: r.read_float(), lambda w, v: w.write_float(v))
BOOL = FieldKind(lambda r: r.read_bool(), lambda w, v: w.write_bool(v))
DOUBLE = FieldKind(read_double, write_double)
VECTOR = FieldKind(lambda r: r.read_vector(), lambda w, v: w.write_vector(v))
INT_VECTOR = FieldKind(lambda r: r.read_int_vector(), lambda w, v: w.write_int_vector(v))
MATRIX = FieldKind(lambda r: r.read_matrix(), lambda w, v: w.write_matrix(v))


def expect_open_token(reader: KaldiReader, type_name: str, first: str) -> None:
    """Kaldi's ExpectOneOrTwoTokens: the opening ``<Type>`` may or may not be present."""
    reader.try_token(f"<{type_name}>")
    reader.expect_token(first)


def read_fields(reader: KaldiReader, comp: Component, fields, opening: bool = False) -> None:
    """Reads each field's token and value into ``comp`` (a component, or another object
    that holds the attributes); with ``opening``, the component's opening token (which
    may be absent, as in Kaldi) comes first."""
    for i, (token, attr, kind) in enumerate(fields):
        if opening and i == 0:
            expect_open_token(reader, comp.type_name, token)
        else:
            reader.expect_token(token)
        setattr(comp, attr, kind.read(reader))


def read_optional_fields(reader: KaldiReader, comp: Component, fields, tok: str) -> str:
    """Fields that files may leave out, in order, after ``tok`` (the token just read):
    for each field in turn, where ``tok`` is its token, its value is read into ``comp``
    and the next token read (a field that is absent keeps its value).  Returns the first
    token that is none of them, for the caller to check."""
    for token, attr, kind in fields:
        if tok == token:
            setattr(comp, attr, kind.read(reader))
            tok = reader.read_token()
    return tok


def write_fields(writer: KaldiWriter, comp: Component, fields, opening: bool = False) -> None:
    """Writes each field's token and ``comp``'s value; with ``opening``, the component's
    opening token first."""
    if opening:
        writer.write_token(f"<{comp.type_name}>")
    for token, attr, kind in fields:
        writer.write_token(token)
        kind.write(writer, getattr(comp, attr))


def skip_old_stats(reader: KaldiReader) -> None:
    """Skips the unused statistics old models stored after <ValueAvg> (already read)."""
    reader.read_vector()
    reader.expect_token("<DerivAvg>")
    reader.read_vector()
    reader.expect_token("<Count>")
    read_double(reader)


def write_scaled(dst, src, scale: float) -> None:
    """``dst[...] = src * scale``; a plain copy where the scale is 1."""
    if scale != 1.0:
        dst[...] = src * scale
    else:
        dst[...] = src


class SameDimComponent(Component):
    """Base of components whose input and output are both ``dim`` columns wide."""

    dim: int

    def input_dim(self) -> int:
        return self.dim

    def output_dim(self) -> int:
        return self.dim

    def copy_input(self, in_value, out, scale: float = 1.0) -> None:
        """Checks the input is ``dim`` columns wide and writes it, times ``scale``, to
        ``out``."""
        self.check_shape("input", in_value, None, self.dim)
        write_scaled(out, in_value, scale)


class TokenFieldsComponent(Component):
    """A component whose file is ``<Type>``, then ``_FIELDS`` (token, attribute, kind)
    in order, then ``</Type>``; ``_problems()`` lists what is wrong with its options.
    A subclass that also reads older files, which differ, has its own read."""

    _FIELDS: ClassVar[tuple[tuple[str, str, FieldKind], ...]] = ()

    def _problems(self) -> list[str]:
        return []

    def _raise_problems(self, source) -> None:
        """Raises ``source.error`` (a config line's or a reader's) naming the problems."""
        bad = self._problems()
        if bad:
            raise source.error(f"{self.type_name}: " + "; ".join(bad))

    def _check_read(self, reader: KaldiReader) -> None:
        """The check after reading (by default the problems, as a format error)."""
        self._raise_problems(reader)

    @classmethod
    def read(cls, reader: KaldiReader):
        c = cls()
        read_fields(reader, c, cls._FIELDS, opening=True)
        reader.expect_token(f"</{cls.type_name}>")
        c._check_read(reader)
        return c

    def write(self, writer: KaldiWriter) -> None:
        write_fields(writer, self, self._FIELDS, opening=True)
        writer.write_token(f"</{self.type_name}>")
