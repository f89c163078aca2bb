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


def stats_tolerance(field: str, scale: float, component_type: str) -> float:
    """How far a component statistic stored during a run may be from Kaldi's, given the
    size of Kaldi's (``scale``, the largest magnitude in the field): 1e-4 of it (float32
    sums in another order); 4e-3 for sums of squared output derivatives (twice the
    derivatives' own 2e-3: a saturated softmax's backprop cancels); and 2 more for a
    ReLU's derivative sums, a count that moves by one for each output within rounding of
    zero."""
    tol = (4e-3 if field == "oderiv_sumsq" else 1e-4) * scale + 1e-5
    if field == "deriv_sum" and component_type == "RectifiedLinearComponent":
        tol += 2.0
    return tol
