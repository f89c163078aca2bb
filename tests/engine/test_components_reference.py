"""Every component reference case from Kaldi (kaldi-ref/components): output, input
derivative and parameter gradient to float32 rounding, and byte-identical text I/O.

The tests/data subset (one case per type) always runs; the full shared set runs when
../shared/kaldi-ref exists (marked ``conformance``)."""

from pathlib import Path

import pytest

from component_harness import (
    check_io_roundtrip,
    check_reference_case,
    load_component_text,
    reference_cases,
)
from engine.nnet.components import component_class

SUBSET = reference_cases()
FULL = [c for c in reference_cases(full=True) if c not in SUBSET]


def _id(p: Path) -> str:
    return f"{p.parent.name}/{p.name}"


def _require_type(case: Path) -> None:
    if component_class(case.parent.name) is None:
        pytest.fail(f"component type {case.parent.name} is not implemented")


@pytest.mark.parametrize("case", SUBSET, ids=_id)
def test_reference_subset(case):
    _require_type(case)
    check_reference_case(case)


@pytest.mark.parametrize("case", SUBSET, ids=_id)
def test_text_io_byte_identical(case):
    _require_type(case)
    comp = load_component_text(case / "component.txt")
    check_io_roundtrip(comp, (case / "component.txt").read_bytes())


@pytest.mark.conformance
@pytest.mark.parametrize("case", FULL, ids=_id)
def test_reference_full(case):
    _require_type(case)
    check_reference_case(case)
    comp = load_component_text(case / "component.txt")
    check_io_roundtrip(comp, (case / "component.txt").read_bytes())
