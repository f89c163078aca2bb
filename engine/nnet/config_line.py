"""One line of Kaldi's config language, split into ``key=value`` pairs
(Kaldi's ConfigLine in util/text-utils).

Typed getters record which keys were used, so callers can report unused
(unknown) options.  Errors name the source, line number, option and reason.
"""

from __future__ import annotations

import re
import shlex

from engine.core.errors import ConfigError
from engine.core.index import INT32_MAX, INT32_MIN  # Kaldi's integer options are int32

# what Kaldi's ConvertStringToInteger / ConvertStringToReal read: ASCII digits with an
# optional sign (Python's int() and float() would also take other scripts' digits,
# surrounding spaces and underscores), and for reals the usual decimal and exponent
# forms and inf / infinity (any case).  NaN is refused: no option means anything
# with it, and it would only turn every output of the network into NaN.
INT_RE = re.compile(r"[+-]?[0-9]+\Z")
REAL_RE = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity)\Z",
                   re.IGNORECASE)


def _parse_real(s: str) -> float | None:
    s = s.strip()    # Kaldi skips white space around a number
    return float(s) if REAL_RE.match(s) else None


def _nan_note(pieces) -> str:
    """A note for the error when one of the numbers given is NaN (which float() reads)."""
    is_nan = any(p.strip().lower().lstrip("+-") == "nan" for p in pieces)
    return " (NaN is not accepted)" if is_nan else ""


def _parse_int(s: str) -> int | None:
    s = s.strip()
    return int(s) if INT_RE.match(s) else None


def _parse_bool(s: str) -> bool | None:
    low = s.lower()
    if low in ("true", "t", "1", "yes"):
        return True
    if low in ("false", "f", "0", "no"):
        return False
    return None


class ConfigLine:
    """``first_token key1=value1 key2=value2 ...``.

    ``first_token`` is e.g. ``component`` or ``input-node``; for a component's
    own options (after ``type=`` is taken) it may be empty.
    """

    def __init__(self, text: str, *, source: str | None = None, line: int | None = None):
        self.text = text
        self.source = source
        self.line = line
        self.first_token = ""
        self.values: dict[str, str] = {}
        self.used: set[str] = set()
        self._parse(text)

    @classmethod
    def from_parts(cls, first_token: str, values: dict[str, str], *, text: str = "",
                   source: str | None = None, line: int | None = None) -> "ConfigLine":
        """A ConfigLine whose tokens were already split by another parser (the
        network config reader splits lines the way Kaldi does, allowing spaces
        inside values such as ``input=Append(a, b)``)."""
        obj = cls("", source=source, line=line)
        obj.text = text
        obj.first_token = first_token
        obj.values = dict(values)
        return obj

    def error(self, message: str) -> ConfigError:
        return ConfigError(message, source=self.source, line=self.line, text=self.text)

    def _parse(self, text: str) -> None:
        s = text.strip()
        if not s:
            return
        try:
            parts = shlex.split(s, posix=True)
        except ValueError as e:
            raise self.error(f"cannot split line into tokens: {e}") from None
        if parts and "=" not in parts[0]:
            self.first_token = parts[0]
            parts = parts[1:]
        for p in parts:
            if "=" not in p:
                raise self.error(f"expected key=value, got {p!r}")
            k, v = p.split("=", 1)
            if not k:
                raise self.error(f"empty option name in {p!r}")
            if k in self.values:
                raise self.error(f"option {k!r} given twice")
            self.values[k] = v

    # -- queries ----------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.values

    def _get(self, key: str):
        self.used.add(key)
        return self.values.get(key)

    def get_str(self, key: str, default: str | None = None, required: bool = False) -> str | None:
        v = self._get(key)
        if v is None:
            if required:
                raise self.error(f"missing required option {key}=")
            return default
        return v

    def get_int(self, key: str, default: int | None = None, required: bool = False) -> int | None:
        v = self._get(key)
        if v is None:
            if required:
                raise self.error(f"missing required option {key}= (an integer)")
            return default
        n = _parse_int(v)
        if n is None:
            raise self.error(f"option {key}={v!r} is not an integer")
        return self.check_int32(key, n)

    def check_int32(self, key: str, n: int) -> int:
        """``n``, the value of option ``key``, if it is a 32-bit integer (as Kaldi's
        integer options are); a ConfigError naming the option otherwise."""
        if not INT32_MIN <= n <= INT32_MAX:
            raise self.error(f"option {key}: {n} is out of the range of a 32-bit integer")
        return n

    def get_float(self, key: str, default: float | None = None,
                  required: bool = False) -> float | None:
        v = self._get(key)
        if v is None:
            if required:
                raise self.error(f"missing required option {key}= (a number)")
            return default
        x = _parse_real(v)
        if x is None:
            raise self.error(f"option {key}={v!r} is not a number" + _nan_note([v]))
        return x

    def get_bool(self, key: str, default: bool | None = None,
                 required: bool = False) -> bool | None:
        v = self._get(key)
        if v is None:
            if required:
                raise self.error(f"missing required option {key}= (true or false)")
            return default
        b = _parse_bool(v)
        if b is None:
            raise self.error(f"option {key}={v!r} is not a boolean (accepted: true, false)")
        return b

    def get_int_list(self, key: str, default: list[int] | None = None, sep: str = ",",
                     required: bool = False) -> list[int] | None:
        v = self._get(key)
        if v is None:
            if required:
                raise self.error(f"missing required option {key}= (a list of integers)")
            return default
        if v == "":
            return []
        values = [_parse_int(x) for x in v.split(sep)]
        if None in values:
            raise self.error(f"option {key}={v!r} is not a {sep!r}-separated integer list")
        return [self.check_int32(key, n) for n in values]

    def get_float_list(self, key: str, default: list[float] | None = None, sep: str = ",",
                       required: bool = False) -> list[float] | None:
        v = self._get(key)
        if v is None:
            if required:
                raise self.error(f"missing required option {key}= (a list of numbers)")
            return default
        if v == "":
            return []
        pieces = v.split(sep)
        out = [_parse_real(x) for x in pieces]
        if None in out:
            raise self.error(f"option {key}={v!r} is not a {sep!r}-separated number list"
                             + _nan_note(pieces))
        return out

    def get_choice(self, key: str, choices: list[str], default: str | None = None,
                   required: bool = False) -> str | None:
        v = self.get_str(key, default, required)
        if v is not None and v not in choices:
            raise self.error(f"option {key}={v!r} is not one of: {', '.join(choices)}")
        return v

    def unused(self) -> list[str]:
        return [k for k in self.values if k not in self.used]

    def check_all_used(self, what: str = "") -> None:
        extra = self.unused()
        if extra:
            where = f" for {what}" if what else ""
            raise self.error(f"unknown option(s){where}: {', '.join(extra)}")
