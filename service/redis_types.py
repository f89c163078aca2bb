"""Telling a Redis key of the wrong type from an outage.

Every key the service writes has one Redis type (models: hashes; cached computations
and stream checkpoints: strings).  A key of another type -- written by something else
sharing the database, or by hand -- makes Redis answer ``WRONGTYPE``: that is a broken
record, handled as the store's other broken records are (dropped, recompiled or
reported as corrupt), not a reason to take Redis for unreachable.
"""

from __future__ import annotations

import redis


def is_wrong_type(e: BaseException) -> bool:
    """``e`` is Redis refusing an operation on a key holding another type (alone, or
    as one command of a pipeline, whose error message redis-py prefixes)."""
    return isinstance(e, redis.ResponseError) and "WRONGTYPE" in str(e)
