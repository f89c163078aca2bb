"""Shared basics: Index/Cindex, typed errors, array-module helpers."""

from engine.core.errors import (  # noqa: F401
    NnetcError,
    ConfigError,
    ModelFormatError,
    ComponentError,
    DimensionError,
    NotComputableError,
    CheckError,
    ExecutionError,
    RequestError,
    ResourceLimitError,
)
from engine.core.index import Index, Cindex, K_NO_TIME  # noqa: F401
