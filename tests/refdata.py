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


def network_case_params() -> list:
    """pytest params of the Kaldi reference network cases for the end-to-end tests: the
    14 Kaldi-made ones of tests/data/networks_kaldi_gen always ("gen-..."), every case
    of ../shared/kaldi-ref/networks when it is there ("ref-...", marked conformance)."""
    import pytest  # noqa: PLC0415
    out = [pytest.param(p, id=f"gen-{p.name}")
           for p in sorted((DATA / "networks_kaldi_gen").iterdir())]
    ref = shared_ref()
    if ref is not None:
        out += [pytest.param(p, id=f"ref-{p.name}", marks=pytest.mark.conformance)
                for p in sorted((ref / "networks").iterdir()) if (p / "request.json").exists()]
    return out
