"""Malformed models and configs made by mutating the small models in tests/data (byte
flips, bad sizes, swapped tokens, rewritten descriptors).  Each of these once crashed
with an untyped exception, hung, attempted a huge allocation, or loaded into a network
that failed only later (when written, compiled or run); now loading either raises a
typed error that says where, or gives a network that writes, compiles and runs."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from engine.compiler.shortcut import compile_request
from engine.core.errors import ConfigError, ModelFormatError
from engine.nnet.graph import compute_simple_context
from engine.nnet.model_io import load_model, nnet_to_bytes
from engine.nnet.random_config import random_inputs, random_request
from engine.runtime.executor import Executor

DATA = Path(__file__).resolve().parents[1] / "data"


def _component_text(type_name: str) -> bytes:
    return next((DATA / "components" / type_name).glob("*/component.txt")).read_bytes()


def _wrap(component: bytes, input_dim: int, node_input: bytes = b"input") -> bytes:
    """A text model holding one component ``c`` between input and output."""
    return (b"<Nnet3> \ninput-node name=input dim=%d\ncomponent-node name=c component=c "
            b"input=%s\noutput-node name=output input=c\n\n<NumComponents> 1 \n"
            b"<ComponentName> c " % (input_dim, node_input) + component.strip()
            + b" \n</Nnet3> \n")


def _run(nnet) -> None:
    rng = np.random.default_rng(0)
    req = random_request(nnet, rng, need_deriv=True)
    ex = Executor(compile_request(nnet, req), nnet)
    x = random_inputs(nnet, req, rng)
    for s in req.inputs:
        ex.accept_input(s.name, x[s.name])
    ex.run()


def _load_fails(data: bytes, *needles: str, offset: int | None = None) -> ModelFormatError:
    with pytest.raises(ModelFormatError) as e:
        load_model(data, source="bad.raw")
    for n in needles:
        assert n in str(e.value), str(e.value)
    if offset is not None:
        assert e.value.offset == offset, str(e.value)
    return e.value


# -- descriptors -------------------------------------------------------------------------


@pytest.mark.parametrize("wrap", ["Sum({}, input)", "Offset({}, 1)", "IfDefined({})"])
def test_deeply_nested_descriptor_is_a_config_error(wrap):
    """Was RecursionError from the descriptor parser (a config of a few KB)."""
    expr = "input"
    for _ in range(1000):
        expr = wrap.format(expr)
    config = f"input-node name=input dim=3\noutput-node name=output input={expr}\n"
    with pytest.raises(ConfigError) as e:
        load_model(config.encode(), source="deep.config")
    assert e.value.line == 2 and "nested more than 64 deep" in str(e.value)
    # the same line in the config section of a text model
    model = (DATA / "networks" / "case027" / "model.txt").read_bytes()
    model = model.replace(b"output-node name=output input=input",
                          b"output-node name=output input=" + expr.encode())
    with pytest.raises(ConfigError) as e:
        load_model(model, source="deep.raw")
    assert e.value.source == "deep.raw" and e.value.line == 3
    assert "nested more than 64 deep" in str(e.value)


def test_wide_nested_append_is_normalised_in_linear_time(monkeypatch):
    """Picking the terms out of nested Append()s recounted every subtree for every
    term: this 95 KB line took 16 s (a 300-deep one over 30 s).  The subtrees' term
    counts are now asked for about twice per term of the result (counted, not timed)."""
    from engine.nnet import descriptor_parse

    calls = []
    count_terms = descriptor_parse._num_append_terms

    def counted(*args):
        calls.append(1)
        return count_terms(*args)
    monkeypatch.setattr(descriptor_parse, "_num_append_terms", counted)
    chain = "input"
    for _ in range(63):
        chain = f"Append({chain}, input)"
    config = ("input-node name=input dim=1\noutput-node name=output input=Append("
              + ", ".join([chain] * 100) + ")\n")
    nnet = load_model(config.encode()).nnet
    assert nnet.output_dim("output") == 6400
    assert len(calls) <= 3 * 6400, len(calls)


@pytest.mark.parametrize("offset", [1, 2147483647])
def test_recurrence_that_never_reaches_the_input_is_an_error_not_a_hang(offset):
    """A loop through Offset() with nothing to start it from (no IfDefined/Failover):
    working out the context (nnetc info, writing a .mdl, inference) searched for ever."""
    data = _wrap(_component_text("SigmoidComponent"), 1,
                 b"Offset(c, %d)" % offset)
    nnet = load_model(data).nnet
    with pytest.raises(ConfigError, match=r"output\(t=0\).*never reaches the inputs"):
        compute_simple_context(nnet)


# -- numbers in the file -----------------------------------------------------------------


def test_integers_out_of_int32_range():
    """Read as they were (a binary 8-byte integer, or any text integer): the model
    loaded and then could not be written (struct.error)."""
    good = _wrap(_component_text("ClipGradientComponent"), 1)
    nnet_to_bytes(load_model(good).nnet, binary=True)
    bad = good.replace(b"<NumElementsClipped> 0", b"<NumElementsClipped> 99999999999")
    _load_fails(bad, "99999999999 is out of the range of a 32-bit integer",
                offset=bad.index(b"99999999999"))
    binary = nnet_to_bytes(load_model(good).nnet, binary=True)
    field = b"<NumElementsClipped> \x04\x00\x00\x00\x00"
    assert field in binary
    bad = binary.replace(field, b"<NumElementsClipped> \x08" + struct.pack("<q", 2 ** 40))
    _load_fails(bad, "out of the range of a 32-bit integer",
                offset=bad.index(b"<NumElementsClipped>") + 21)


def test_binary_double_in_a_float_field_is_rounded_to_float():
    """A BaseFloat stored as a double (size byte 8) kept its double value: 5e-312 passed
    BatchNormComponent's target-rms > 0 check, was written as 0 and the written model
    no longer loaded.  Kaldi rounds it to float, as now."""
    data = (DATA / "inference" / "xconfig" / "cnn_res" / "model.raw").read_bytes()
    field = data.index(b"<TargetRms> \x04") + 12

    def with_target_rms(v: float) -> bytes:
        return data[:field] + b"\x08" + struct.pack("<d", v) + data[field + 5:]

    _load_fails(with_target_rms(5e-312), "ivector-batchnorm", "target-rms=0")
    model = load_model(with_target_rms(0.1))
    bn = model.nnet.get_component_by_name("ivector-batchnorm")
    assert bn.target_rms == float(np.float32(0.1))
    again = load_model(nnet_to_bytes(model.nnet, binary=True)).nnet
    assert again.get_component_by_name("ivector-batchnorm").target_rms == bn.target_rms


# -- component parameters that disagree with each other ----------------------------------


@pytest.mark.parametrize("type_name", ["RepeatedAffineComponent",
                                       "NaturalGradientRepeatedAffineComponent",
                                       "BlockAffineComponent"])
def test_bias_that_does_not_match_the_linear_params(type_name):
    """Loaded; running it raised a NumPy broadcast error inside the executor."""
    text = _component_text(type_name)
    from engine.nnet.kaldi_io import KaldiReader  # noqa: PLC0415
    from engine.nnet.components.base import read_component  # noqa: PLC0415
    good = _wrap(text, read_component(KaldiReader(text, binary=False)).input_dim())
    _run(load_model(good).nnet)
    start = good.index(b"[", good.index(b"<BiasParams>"))
    bad = good[:start] + b"[ 0.5" + good[start + 1:]          # one bias value too many
    _load_fails(bad, type_name, "bias dimension")


@pytest.mark.parametrize("change", [(b"<BlockDim> 3", b"<BlockDim> 4"),
                                    (b"<BlockDim> 3", b"<BlockDim> 0"),
                                    (b"<TargetRms> 1.45", b"<TargetRms> 0"),
                                    (b"<TargetRms> 1.45", b"<TargetRms> inf"),
                                    (b"<TargetRms> 1.45", b"<TargetRms> nan")])
def test_normalize_component_options(change):
    """Loaded; running raised ZeroDivisionError or a reshape error in the executor."""
    good = _wrap(_component_text("NormalizeComponent"), 6)
    _run(load_model(good).nnet)
    bad = good.replace(*change)
    _load_fails(bad, "NormalizeComponent", change[1].split()[0].decode())


@pytest.mark.parametrize("field", [b"<Epsilon>", b"<TargetRms>"])
@pytest.mark.parametrize("value", [b"inf", b"nan", b"0"])
def test_batchnorm_epsilon_and_target_rms_finite_and_positive(field, value):
    """A non-finite epsilon or target-rms made every output NaN or inf."""
    from engine.nnet.nnet import Nnet  # noqa: PLC0415
    good = nnet_to_bytes(Nnet.from_config(
        "input-node name=input dim=4\n"
        "component name=c type=BatchNormComponent dim=4 test-mode=true\n"
        "component-node name=c component=c input=input\n"
        "output-node name=output input=c\n"), binary=False)
    _run(load_model(good).nnet)
    start = good.index(field) + len(field) + 1
    bad = good[:start] + value + good[good.index(b" ", start):]
    _load_fails(bad, "BatchNormComponent", "epsilon=", "target-rms=")


@pytest.mark.parametrize("type_name,dims", [("PnormComponent", 38),
                                            ("SumBlockComponent", 18),
                                            ("ElementwiseProductComponent", 6)])
@pytest.mark.parametrize("out_dim", [b"4", b"0", b"-2", b"2147483647"])
def test_block_column_maps_need_output_dim_dividing_input_dim(type_name, dims, out_dim):
    """Loaded; running tried to allocate 432 GiB (SumBlockComponent with output-dim
    2^31-1) or failed in a reshape."""
    good = _wrap(_component_text(type_name), dims)
    _run(load_model(good).nnet)
    head, rest = good.split(b"<OutputDim> ", 1)
    bad = head + b"<OutputDim> " + out_dim + b" " + rest.split(b" ", 1)[1]
    _load_fails(bad, type_name, "must be a positive multiple of <OutputDim>")


@pytest.mark.parametrize("value", [b"nan", b"0", b"-5"])
def test_time_height_convolution_max_memory(value):
    """A NaN <MaxMemoryMb> loaded and made compiling raise ValueError (int(nan)); 0 a
    ZeroDivisionError."""
    good = (DATA / "networks_kaldi_gen" / "seed287" / "model.txt").read_bytes()
    bad = good.replace(b"<MaxMemoryMb> 200", b"<MaxMemoryMb> " + value)
    assert bad != good
    _load_fails(bad, "TimeHeightConvolutionComponent", "<MaxMemoryMb>")
    config = ("input-node name=input dim=6\ncomponent name=conv "
              "type=TimeHeightConvolutionComponent num-filters-in=2 num-filters-out=2 "
              "height-in=3 height-out=3 time-offsets=-1,0,1 height-offsets=-1,0,1 "
              f"max-memory-mb={value.decode()}\n"
              "component-node name=conv component=conv input=input\n"
              "output-node name=output input=conv\n")
    with pytest.raises(ConfigError, match="max-memory-mb"):
        load_model(config.encode())


def test_time_height_convolution_heights_are_bounded():
    """Checking the model made a table of height-in entries: <HeightIn> 2147483646
    allocated 2 GiB before the dimension mismatch was noticed (height-in=1000000000 in a
    config, 1 GiB)."""
    good = (DATA / "networks_kaldi_gen" / "seed287" / "model.txt").read_bytes()
    start = good.index(b"<HeightIn> ") + len(b"<HeightIn> ")
    bad = good[:start] + b"2147483646" + good[good.index(b" ", start):]
    _load_fails(bad, "TimeHeightConvolutionComponent", "must not exceed 65536")
    config = ("input-node name=input dim=6\ncomponent name=conv "
              "type=TimeHeightConvolutionComponent num-filters-in=2 num-filters-out=2 "
              "height-in=1000000000 height-out=3 time-offsets=-1,0,1 height-offsets=-1,0,1\n"
              "component-node name=conv component=conv input=input\n"
              "output-node name=output input=conv\n")
    with pytest.raises(ConfigError, match="must not exceed 65536"):
        load_model(config.encode())


def test_statistics_components_bound_the_inputs_of_one_output():
    """A period or context of billions loaded; working out the context (nnetc info)
    then built lists of hundreds of millions of Indexes per output, for ever."""
    model = (DATA / "networks" / "case017" / "model.txt").read_bytes()
    config = (DATA / "networks" / "case017" / "configs.txt").read_text()
    for old, new, option in [(b"<OutputPeriod> 9", b"<OutputPeriod> 2147483646",
                              "output-period=9"),
                             (b"<LeftContext> 90", b"<LeftContext> 2147483646",
                              "left-context=90")]:
        bad = model.replace(old, new)
        assert bad != model
        e = _load_fails(bad, "Statistics", "inputs (at most 131072)")
        at = bad.index(new)
        assert bad.rindex(b"<ComponentName>", 0, at) < e.offset < bad.index(b"</Stat", at) + 40
        bad_config = config.replace(option, option.split("=")[0] + "=2147483646")
        assert bad_config != config
        with pytest.raises(ConfigError, match=r"inputs \(at most 131072\)") as e:
            load_model(bad_config.encode())
        assert e.value.line is not None


def test_attention_stats_count_without_stats():
    """A non-zero <StatsCount> with the (empty) stats of a fresh component loaded, and
    the network's info() raised IndexError; stats of shapes that do not fit the heads
    loaded too (and broke storing stats later)."""
    data = (DATA / "inference" / "xconfig" / "attention" / "model.raw").read_bytes()
    field = data.index(b"<StatsCount> \x08") + 13
    counted = data[:field] + b"\x08" + struct.pack("<d", 1e6) + data[field + 9:]
    nnet = load_model(counted).nnet
    assert "stats-count=1e+06" in nnet.info()
    empty = b"<EntropyStats> DV \x04\x00\x00\x00\x00"
    assert empty in data
    bad = data.replace(empty, b"<EntropyStats> DV \x04\x01\x00\x00\x00" + bytes(8), 1)
    _load_fails(bad, "RestrictedAttentionComponent", "stats of shapes (1,) and (0, 0)")


@pytest.mark.parametrize("block_dim", [0, -1, 1000000])
def test_general_dropout_block_dim(block_dim):
    """Loaded; compiling raised ZeroDivisionError or ValueError (negative dimensions),
    running a reshape error."""
    data = (DATA / "inference" / "xconfig" / "tdnnf_options" / "model.raw").read_bytes()
    field = data.index(b"<BlockDim> ", data.index(b"<GeneralDropoutComponent>")) + 11
    bad = data[:field] + b"\x04" + struct.pack("<i", block_dim) + data[field + 5:]
    _load_fails(bad, "GeneralDropoutComponent", f"<BlockDim> {block_dim} must be > 0")


# -- nesting -----------------------------------------------------------------------------


def _nested_composite(depth: int) -> bytes:
    inner = _component_text("SigmoidComponent").strip() + b" "
    body = (b"<CompositeComponent> <MaxRowsProcess> 0 <NumComponents> 1 " * depth + inner
            + b"</CompositeComponent> " * depth)
    return _wrap(body, 1)


def test_nested_composite_components(monkeypatch):
    """Each level asked its sub-component's properties three times: 20 levels took
    3^20 calls (a hang); 250 levels loaded and then overflowed the stack when run; 5000
    levels failed without saying where.  Loading and running 20 levels now asks the
    innermost component's properties about once per level (counted, not timed)."""
    from engine.nnet.components.nonlinear import SigmoidComponent

    calls = []
    properties = SigmoidComponent.properties

    def counted(self, *args, **kw):
        calls.append(1)
        return properties(self, *args, **kw)
    monkeypatch.setattr(SigmoidComponent, "properties", counted)
    nnet = load_model(_nested_composite(20)).nnet
    _run(nnet)
    assert 0 < len(calls) <= 2 * 20 + 20, len(calls)
    _load_fails(_nested_composite(33), "nested 33 deep")
    data = _nested_composite(5000)
    _load_fails(data, "component 'c' nests sub-components too deeply",
                offset=data.index(b"<ComponentName> c ") + len(b"<ComponentName>"))
