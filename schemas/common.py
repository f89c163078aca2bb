"""Shared wire types: matrices and errors.

A matrix travels either as JSON rows (``[[1.0, 2.0], [3.0, 4.0]]``, handy for
small data) or, for anything large, as ``{"shape": [r, c], "dtype": "float32",
"data": <base64 of the little-endian float32 bytes, row-major>}``.  In a msgpack
body ``data`` may also be the raw bytes (msgpack has a binary type).  A request's
Indexes likewise: ``[[n, t, x], ...]`` or ``{"shape": [k, 3], "dtype": "int32",
"data": <base64 of the little-endian int32 n, t, x values, row by row>}``.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

# Numbers and switches in requests are taken only as JSON (or msgpack) types them: a
# string such as "5", a boolean for a number, 5.0 for an integer or 1 / "yes" for a
# boolean is a 422 naming the field, where pydantic's default (lax) mode would convert
# it quietly.  An integer is accepted for a real number.  Response models keep the
# plain types: the service builds them.
Int, Float, Bool = StrictInt, StrictFloat, StrictBool


class Strict(BaseModel):
    """Base of every wire model: unknown fields are an error (a typo in an option
    must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid")


class EncodedMatrix(Strict):
    shape: tuple[Int, Int] = Field(description="[rows, cols]")
    dtype: Literal["float32"] = "float32"
    data: Union[str, bytes] = Field(
        description="base64 of rows*cols little-endian float32 values, row-major "
                    "(raw bytes allowed in msgpack bodies)")


class EncodedIndexes(Strict):
    shape: tuple[Int, Int] = Field(description="[rows, 3]")
    dtype: Literal["int32"] = "int32"
    data: Union[str, bytes] = Field(
        description="base64 of rows*3 little-endian int32 values n, t, x, row-major "
                    "(raw bytes allowed in msgpack bodies)")


# JSON rows or the encoded form
Matrix = Union[list[list[Float]], EncodedMatrix]
Indexes = Union[list[tuple[Int, Int, Int]], EncodedIndexes]
Vector = list[Float]

MatrixEncoding = Literal["json", "base64", "auto"]


class ErrorDetail(Strict):
    type: str = Field(description="error class, e.g. ConfigError, NotFound, RequestError")
    message: str
    field: str | None = Field(default=None,
                              description="the request field at fault, dotted, when known")


class ErrorResponse(Strict):
    error: ErrorDetail
