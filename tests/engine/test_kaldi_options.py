"""Networks made by Kaldi with optimizer options other than the defaults
(tests/data/networks_kaldi_options).

Each case is a kaldi-ref style network case written by tests/kaldi_oracle/gen.cc with
OPTIONS 2 (3 for the ``iv`` case, whose network may read an i-vector): Kaldi's random
network and request for the seed in the folder name, optimized with the
``NnetOptimizeOptions`` in ``options.json`` (each switch off with probability 0.3, some
with a derivative-time window, memory compression 0-3), then run.  The nine cases are a
greedy cover, by size, of what 1,932 such cases showed: every switch off at least once,
each window kind and compression level with derivatives, model derivatives, an i-vector,
and a computation in which Kaldi keeps no-ops (RemoveUnnecessaryAllocation, which deletes
them, switched off).  All 1,932 matched (tests/kaldi_oracle/README.md).

Checked here: our computation optimized with the same options gives Kaldi's outputs,
input derivatives and model gradients, its command count and peak bytes, and its printout
line for line; without optimization (the derivative-time window applied, as Kaldi applies
it whatever ``optimize`` says) the same numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.compiler.request import ComputationRequest
from engine.compiler.shortcut import compile_request
from engine.nnet.model_io import load_nnet
from engine.optimizer import OptimizeOptions

from test_compile_reference import check_case, read_options

CASES = sorted((Path(__file__).resolve().parents[1] / "data" / "networks_kaldi_options").iterdir())


def _id(p: Path) -> str:
    return p.name


def _options(case: Path) -> OptimizeOptions:
    options = read_options(case / "options.json")
    assert options is not None, case
    return options


def test_the_cases_are_there_and_cover_every_switch():
    assert len(CASES) == 9
    off = {k for c in CASES for k, v in json.loads((c / "options.json").read_text()).items()
           if v is False}
    switches = {f for f in OptimizeOptions.result_fields()
                if isinstance(getattr(OptimizeOptions(), f), bool)}
    assert switches - {"optimize_looped_computation"} <= off


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_numbers_match_kaldi_with_its_options(case):
    check_case(case, optimize=True, options=_options(case))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_numbers_match_kaldi_without_optimizing(case):
    check_case(case, optimize=True, options=_options(case).replace(optimize=False))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_printout_and_stats_are_kaldis(case):
    nnet = load_nnet(case / "model.txt")
    req = ComputationRequest.from_json((case / "request.json").read_bytes())
    comp = compile_request(nnet, req, _options(case))
    ref = json.loads((case / "stats.json").read_text())["optimized"]
    stats = comp.stats()
    assert (stats["commands"], stats["peak_bytes"]) == (ref["commands"], ref["peak_bytes"])
    assert comp.to_text(nnet) == (case / "computation.txt").read_text()
