import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
SHARED_REF = ROOT.parent / "shared" / "kaldi-ref"


def shared_ref() -> Path | None:
    return SHARED_REF if SHARED_REF.is_dir() else None


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA
