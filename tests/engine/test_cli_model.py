"""``nnetc info``, ``init`` and ``copy``: outputs, conversions, and exit status 2
with the typed error's message (no traceback) on bad input."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner
from nnet_ref_cases import NETWORKS

from engine.nnet.model_io import load_model
from service.cli import main

CONFIG = """input-node name=input dim=4
component name=a type=SigmoidComponent dim=8
component-node name=a component=a input=Append(Offset(input, -1), Offset(input, 2))
output-node name=output input=a
"""


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_init_info_copy(tmp_path):
    cfg = tmp_path / "net.config"
    cfg.write_text(CONFIG)
    extra = tmp_path / "extra.config"
    extra.write_text("output-node name=output2 input=Offset(a, 1)\n")
    raw = tmp_path / "net.raw"
    r = run("init", cfg, extra, raw, "--binary")
    assert r.exit_code == 0, r.output
    assert raw.read_bytes().startswith(b"\0B<Nnet3>")
    r = run("info", raw, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert (info["left-context"], info["right-context"]) == (1, 2)
    assert info["input-dim"] == {"input": 4} and info["output-dim"] == {"output": 8,
                                                                        "output2": 8}
    assert info["component-types"] == {"SigmoidComponent": 1} and info["modulus"] == 1
    assert info["streaming"] == "yes"
    r = run("info", cfg)
    assert r.exit_code == 0 and "left-context: 1" in r.output and "right-context: 2" in r.output
    txt = tmp_path / "net.txt"
    assert run("copy", raw, txt, "--text").exit_code == 0
    assert txt.read_bytes().startswith(b"<Nnet3> \n")
    back = tmp_path / "back.raw"
    assert run("copy", txt, back, "--binary").exit_code == 0
    assert back.read_bytes() == raw.read_bytes()


def test_copy_reference_text_model_preserves_parameters(tmp_path):
    src = NETWORKS / "case024" / "model.txt"
    out = tmp_path / "m.raw"
    r = run("copy", src, out, "--binary")
    assert r.exit_code == 0, r.output
    a, b = load_model(src).nnet, load_model(out).nnet
    for ca, cb in zip(a.components, b.components):
        for pa, pb in zip(ca.param_arrays(), cb.param_arrays()):
            assert np.array_equal(np.asarray(pa), np.asarray(pb))


def test_errors_exit_2_with_message(tmp_path):
    bad = tmp_path / "bad.config"
    bad.write_text(CONFIG + "output-node name=o input=nosuch\n")
    r = run("info", bad)
    assert r.exit_code == 2
    assert "bad.config:5" in r.output and "nosuch" in r.output and "Traceback" not in r.output
    junk = tmp_path / "junk.raw"
    junk.write_bytes(b"\0B<Nnet3> \n")
    r = run("copy", junk, tmp_path / "o.raw")
    assert r.exit_code == 2 and "junk.raw" in r.output and "Traceback" not in r.output
    r = run("init", tmp_path / "missing.config", tmp_path / "o.raw")
    assert r.exit_code == 2 and "missing.config" in r.output
    r = run("info")
    assert r.exit_code == 2  # click usage error


def test_info_says_whether_and_how_a_network_streams():
    from pathlib import Path  # noqa: PLC0415
    blstm = Path(__file__).resolve().parents[1] / "data" / "inference" / "blstm" / "model.raw"
    r = run("info", blstm, "--json")
    assert r.exit_code == 0, r.output
    note = json.loads(r.output)["streaming"]
    assert note.startswith("only with truncate_future_recurrence") and "blstm1-backward" in note
    assert "whole-utterance" not in note      # the refusal's advice is not part of the reason
    r = run("info", blstm)
    assert "streaming: only with truncate_future_recurrence" in r.output
