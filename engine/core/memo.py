"""Memos keyed by what one request holds (rows of indexes and the like), which a
later compile of an equal request would find filled.  Each is registered here so
that whoever needs a compile that has seen nothing before -- the benchmarks'
cold compiles, a test -- can empty them all with ``clear_request_memos()``.
Memos keyed by the network alone (compiled descriptors, per-node plans) are part
of loading a network and are not registered."""

from __future__ import annotations

_MEMOS: list[dict] = []


def request_memo() -> dict:
    """A new, registered, empty memo."""
    memo: dict = {}
    _MEMOS.append(memo)
    return memo


def clear_request_memos() -> None:
    """Empty every registered memo."""
    for memo in _MEMOS:
        memo.clear()
