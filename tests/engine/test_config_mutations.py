"""Mutated reference configs (tests/data/compiler/networks) and requests: whatever a
client sends, building, compiling and running raise only typed errors (NnetcError),
and what is built stays small.  The mutations are the ones that found real defects: dimensions set to 0,
negative, 1e8, nan or inf (dim=100000000 made a config allocate 9-89 GB), truncated
tokens, swapped descriptor functions and component types, Indexes at and beyond the
int32 limits, duplicated, shifted and truncated Index lists."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from engine.compiler.request import ComputationRequest
from engine.compiler.shortcut import compile_request
from engine.core.errors import NnetcError
from engine.nnet.model_io import load_nnet
from engine.nnet.nnet import Nnet
from engine.nnet.random_config import random_inputs, random_request
from engine.runtime.executor import Executor

CASES = sorted((Path(__file__).resolve().parents[1] / "data" / "compiler" / "networks").iterdir())
SHARED_NETS = Path(__file__).resolve().parents[3] / "shared" / "kaldi-ref" / "networks"
NUMBERS = ["0", "-1", "-7", "1", "2", "100000000", "1e30", "nan", "inf", "3.5", "", ",",
           "1,,2", "-3,0,3", "0:1"]
FUNCTIONS = ["Offset(", "Round(", "Switch(", "IfDefined(", "Failover(", "ReplaceIndex("]
TYPES = ["AffineComponent", "TdnnComponent", "LstmNonlinearityComponent",
         "TimeHeightConvolutionComponent", "StatisticsPoolingComponent",
         "RestrictedAttentionComponent", "BatchNormComponent", "NoOpComponent",
         "SumBlockComponent", "PermuteComponent"]
# What a mutated case may build: parameters and a computation's peak bytes.  The
# reference networks take at most about 0.25 MB; the defects this guards against
# (dim=100000000 and the like) asked for gigabytes.  A bound on sizes rather than on
# time: it does not depend on the machine (a hang is the per-test timeout's business).
MAX_BYTES = 64 << 20


def _mutate(line: str, r: random.Random) -> str:
    toks = line.split(" ")
    k = r.randrange(8)
    if k == 0 and toks:
        toks.pop(r.randrange(len(toks)))
    elif k == 1:
        nums = [i for i, t in enumerate(toks) if re.search(r"=-?\d", t)]
        if nums:
            i = r.choice(nums)
            toks[i] = f"{toks[i].split('=')[0]}={r.choice(NUMBERS)}"
    elif k == 2:
        i = r.randrange(len(toks))
        toks[i] = toks[i][:r.randrange(len(toks[i]) + 1)]
    elif k == 3 and toks:
        toks.insert(r.randrange(len(toks)), r.choice(toks))
    elif k == 4:
        return line.replace("Offset(", r.choice(FUNCTIONS), 1)
    elif k == 5:
        return re.sub(r"type=\w+", "type=" + r.choice(TYPES), line)
    elif k == 6:
        return ""
    else:
        i = r.randrange(len(toks))
        s = toks[i]
        if s:
            j = r.randrange(len(s))
            toks[i] = s[:j] + r.choice("()(,=-0x") + s[j + 1:]
    return " ".join(toks)


def _run(nnet, req, seed: int) -> None:
    comp = compile_request(nnet, req)
    assert comp.peak_bytes() <= MAX_BYTES, ("computation", comp.peak_bytes())
    rng = np.random.default_rng(seed)
    ex = Executor(comp, nnet)
    x = random_inputs(nnet, req, rng)
    for s in req.inputs:
        ex.accept_input(s.name, x[s.name])
    ex.run()
    for s in req.outputs:
        ex.get_output(s.name)


@pytest.mark.parametrize("block", range(4))
def test_mutated_configs_raise_only_typed_errors(block):
    r = random.Random(1000 + block)
    built = 0
    for it in range(60):
        case = r.choice(CASES)
        parts = [("#" + p).split("\n")
                 for p in (case / "configs.txt").read_text().split("# config ") if p.strip()]
        for _ in range(r.randrange(1, 4)):
            p = parts[r.randrange(len(parts))]
            i = r.randrange(1, len(p)) if len(p) > 1 else 0
            p[i] = _mutate(p[i], r)
        texts = ["\n".join(p) for p in parts]
        try:
            nnet = Nnet.from_config(*texts, rng=np.random.default_rng(it))
            if any(nnet.input_dim(n) > 100000 for n in nnet.input_names()):
                continue    # (the inputs the test would make are the problem, not nnetc)
            assert nnet.array_bytes() <= MAX_BYTES, (case.name, texts)
            built += 1
            _run(nnet, random_request(nnet, np.random.default_rng(it)), it)
        except NnetcError:
            pass
    assert built >= 10, built     # the mutations leave enough networks to compile and run


@pytest.mark.parametrize("block", range(2))
def test_mutated_requests_raise_only_typed_errors(block):
    r = random.Random(2000 + block)
    big = [2**31 - 1, -2**31, 2**31, -2**31 - 1, 2**40, -2**40, 10**6, -10**6]
    nets: dict = {}
    compiled = 0
    for it in range(50):
        case = r.choice(CASES)
        if case not in nets:
            model = SHARED_NETS / case.name / "model.txt"
            if model.exists():
                nets[case] = load_nnet(model)
            else:
                parts = [p for p in (case / "configs.txt").read_text().split("# config ")
                         if p.strip()]
                nets[case] = Nnet.from_config(*("#" + p for p in parts),
                                              rng=np.random.default_rng(0))
        nnet = nets[case]
        d = json.loads((case / "request.json").read_text())
        for _ in range(r.randrange(1, 4)):
            spec = r.choice(d["inputs"] + d["outputs"])
            k = r.randrange(6)
            if k <= 1 and spec["indexes"]:
                i = r.randrange(len(spec["indexes"]))
                ix = list(spec["indexes"][i])
                j = r.randrange(3)
                ix[j] = r.choice(big + [ix[j] + r.randint(-5, 5)])
                spec["indexes"][i] = ix
            elif k == 2 and spec["indexes"]:
                spec["indexes"].append(r.choice(spec["indexes"]))
            elif k == 3:
                spec["indexes"] = spec["indexes"][:r.randrange(len(spec["indexes"]) + 1)]
            elif k == 4:
                shift = r.choice(big)
                spec["indexes"] = [[n, t + shift, x] for n, t, x in spec["indexes"]]
            else:
                spec["has_deriv"] = not spec.get("has_deriv", False)
        try:
            req = ComputationRequest.from_json(json.dumps(d).encode())
            _run(nnet, req, it)
            compiled += 1
        except NnetcError:
            pass
    assert compiled >= 3, compiled
