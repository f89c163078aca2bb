"""Structured logs: one JSON object per line on stderr, with whatever ``extra``
fields the caller passed (model, computation key, timings, status)."""

from __future__ import annotations

import json
import logging
import time

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "event": record.getMessage()}
        for k, v in vars(record).items():
            if k not in _STANDARD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str) -> None:
    """Give the ``nnetc`` loggers a JSON handler (once) at ``level``."""
    root = logging.getLogger("nnetc")
    root.setLevel(level)
    if not any(getattr(h, "_nnetc_json", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        handler._nnetc_json = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False
