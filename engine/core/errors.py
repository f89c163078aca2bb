"""Typed errors raised by the engine.

Every error carries enough context to name what is at fault (file, line, byte
offset, node, component, command).  The service maps these classes to HTTP
status codes in one place (service/errors.py); the engine knows nothing of HTTP.
"""

from __future__ import annotations


class NnetcError(Exception):
    """Base class of every error the engine raises on purpose."""


class ConfigError(NnetcError, ValueError):
    """A malformed config line, unknown name or type, invalid option.

    ``source`` is the file name (or "<config>"), ``line`` the 1-based line
    number; both are folded into the message when given.
    """

    def __init__(self, message: str, *, source: str | None = None, line: int | None = None,
                 text: str | None = None):
        self.reason = message
        self.source = source
        self.line = line
        self.text = text
        where = ""
        if source is not None or line is not None:
            where = f"{source or '<config>'}"
            if line is not None:
                where += f":{line}"
            where += ": "
        msg = where + message
        if text is not None:
            line = text.strip()
            if len(line) > _MAX_LINE_ECHO:     # a long line is named, not echoed whole
                msg += (f" (in line: {line[:_MAX_LINE_ECHO]!r}... of {len(line)} "
                        f"characters)")
            else:
                msg += f" (in line: {line!r})"
        super().__init__(msg)


# how much of a client's text (a config line, a descriptor, an id) an error message quotes
_MAX_LINE_ECHO = 200


def clipped(text: str) -> str:
    """``text`` as an error message quotes it: at most its first _MAX_LINE_ECHO characters,
    and "..." after them when there were more."""
    return text if len(text) <= _MAX_LINE_ECHO else text[:_MAX_LINE_ECHO] + "..."


class ModelFormatError(NnetcError, ValueError):
    """A Kaldi model file (text or binary) that cannot be read.

    ``offset`` is the byte offset where reading failed.
    """

    def __init__(self, message: str, *, source: str | None = None, offset: int | None = None):
        self.reason = message
        self.source = source
        self.offset = offset
        where = f"{source or '<model>'}"
        if offset is not None:
            where += f" at byte {offset}"
        super().__init__(f"{where}: {message}")


class ComponentError(NnetcError, ValueError):
    """A component that is misconfigured or used wrongly; names the component."""

    def __init__(self, message: str, *, component: str | None = None):
        self.component = component
        self.reason = message
        super().__init__(f"component {component}: {message}" if component else message)


class DimensionError(ComponentError):
    """Shapes that disagree at run time (or dims that disagree in a network)."""


class RequestError(NnetcError, ValueError):
    """A ComputationRequest that is malformed (unknown node, bad indexes...)."""


class NotComputableError(NnetcError):
    """Requested outputs cannot be computed from the supplied inputs."""


class CompilerError(NnetcError):
    """A network/request combination the compiler does not support (Kaldi's
    'this case not handled' errors), naming the node at fault."""


class CheckError(NnetcError):
    """A computation failed the checker (a bug in the compiler or a pass)."""


class ExecutionError(NnetcError):
    """A failure while executing a computation; names the command."""


class ResourceLimitError(NnetcError):
    """A computation that would need more memory than the limit its caller set
    (``Executor(max_peak_bytes=...)``); raised before anything is allocated."""


class Cancelled(NnetcError):
    """Work stopped because its caller asked it to (a ``should_stop`` hook that said so,
    asked between chunks): nothing was wrong with the input, the result was no longer
    wanted (e.g. past the caller's deadline).  ``done`` and ``total`` count the units of
    work (chunk computations) finished before the stop and planned in all."""

    def __init__(self, message: str, *, done: int | None = None, total: int | None = None):
        self.done = done
        self.total = total
        super().__init__(message)


class InferenceError(RequestError):
    """Inputs unusable for inference or streaming (engine.inference): a feature or
    i-vector matrix of the wrong dimension, missing i-vectors, chunk sizes or
    contexts the model cannot use; names the option or array at fault."""


class StreamError(InferenceError):
    """A Stream used out of order (push after finish) or given a state it cannot
    import (corrupt bytes, another model or configuration)."""
