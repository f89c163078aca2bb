"""Where the tests' reference data is: tests/data (copied cases, always there) and
../shared/kaldi-ref (the full Kaldi reference set, beside a development checkout and
in CI).  A module of its own, not conftest: test modules of two folders importing
``conftest`` get whichever conftest Python loaded first."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
SHARED_REF = ROOT.parent / "shared" / "kaldi-ref"


def shared_ref() -> Path | None:
    return SHARED_REF if SHARED_REF.is_dir() else None
