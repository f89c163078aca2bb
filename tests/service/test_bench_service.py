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


def test_service_bench_streams(tmp_path):
    """The streams part: every client's output equals a stream run alone (checked inside),
    and the figures are consistent; a network that cannot stream gives none."""
    from bench.service import measure_service_streams  # noqa: PLC0415
    cfg = tmp_path / "tiny.cfg"
    cfg.write_text(TINY_CONFIG)
    row = measure_service_streams("tiny", cfg, clients=3, frames=60, piece=7)
    assert row["stream_clients"] == 3
    assert 0 < row["stream_push_ms"] <= row["stream_push_ms_p95"]
    assert row["stream_rtf"] > 0
    backward = tmp_path / "backward.cfg"
    backward.write_text(BACKWARD_CONFIG)
    assert measure_service_streams("backward", backward, clients=2, frames=20) == {}


# a recurrence on a later frame (as a backward LSTM's): no looped computation exists
BACKWARD_CONFIG = """input-node name=input dim=4
component name=a type=AffineComponent input-dim=10 output-dim=6
component-node name=a component=a input=Append(input, IfDefined(Offset(t, 1)))
component name=t type=TanhComponent dim=6
component-node name=t component=t input=a
component name=o type=AffineComponent input-dim=6 output-dim=3
component-node name=o component=o input=t
output-node name=output input=o
"""


def test_service_bench_over_http(tmp_path):
    """The real-HTTP part: `nnetc serve` in its own process answers /healthz, a /compute
    and stream pushes; the figures are medians in milliseconds."""
    from bench.service import measure_service_http  # noqa: PLC0415
    cfg = tmp_path / "tiny.cfg"
    cfg.write_text(TINY_CONFIG)
    row = measure_service_http("tiny", cfg, requests=5, chunk=5, large_frames=2000)
    assert set(row) == {"http_healthz_ms", "http_compute_ms", "http_push_ms",
                        "http_large_body_mb", "http_large_compute_ms",
                        "http_healthz_max_during_large_ms", "http_healthz_during_large_ratio",
                        "http_large_msgpack_body_mb", "http_large_msgpack_compute_ms",
                        "http_healthz_max_during_large_msgpack_ms"}
    assert all(v > 0 for v in row.values())
    assert row["http_large_body_mb"] > 0.05
