"""bench's service suite (bench/service.py) on a small config model: rows with the
batched and unbatched timings, the mean batch and the cache figures."""

from __future__ import annotations

import pytest

from bench.service import measure_service
from tests.service.conftest import TINY_CONFIG


def test_service_bench_row(tmp_path):
    cfg = tmp_path / "tiny.cfg"
    cfg.write_text(TINY_CONFIG)
    row = measure_service("tiny", cfg, clients=4, rounds=2, chunk=5)
    assert row["model"] == "tiny" and row["clients"] == 4 and row["chunk"] == 5
    assert row["batched_over_unbatched"] == pytest.approx(
        row["batched_round_ms"] / row["unbatched_round_ms"])
    assert 1.0 <= row["mean_batch"] <= 4.0
    assert row["computes_per_s"] == pytest.approx(4 / (row["batched_round_ms"] / 1e3))
    assert row["compile_miss_ms"] > 0 and row["compile_hit_ms"] > 0
