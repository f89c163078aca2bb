"""The config language: line splitting, node structure and order, applying
configs to an existing network, validation errors naming file and line."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nnet_ref_cases import local_network_cases, missing_types_in_config

from engine.core.errors import ConfigError, NnetcError
from engine.nnet.config import apply_config, parse_config_line, read_config_lines
from engine.nnet.nnet import Nnet, NodeType, ObjectiveType

BASE = """\
# a small recurrent network
input-node name=input dim=4
component name=s1 type=SigmoidComponent dim=12
component-node name=s1 component=s1 input=Append(Offset(input, -1), input, Offset(input, 1))
component-node name=t1 component=t1 input=Sum(s1, IfDefined(Offset(t1, -1)))
component name=t1 type=TanhComponent dim=12   # defined after its use: two passes
dim-range-node name=half input-node=t1 dim-offset=6 dim=6
output-node name=output input=half objective=quadratic
"""


def build(*texts):
    nnet = Nnet()
    for i, t in enumerate(texts):
        apply_config(nnet, t, source=f"cfg{i}", rng=np.random.default_rng(0))
    return nnet


def test_line_splitting_like_kaldi():
    cfg = parse_config_line("component-node name=x component=y input=Append(a, Offset(b, -1)) "
                            "foo='quoted value' bar=\"q2\"")
    assert cfg.first_token == "component-node"
    assert cfg.values == {"name": "x", "component": "y", "input": "Append(a, Offset(b, -1))",
                          "foo": "quoted value", "bar": "q2"}
    assert parse_config_line("dim=3 name=a").first_token == ""
    lines = read_config_lines("a=1 # c\n\n  # only comment\nb=2 \\\n  c=3\n", "f")
    assert [(sl.text, sl.line) for sl in lines] == [("a=1", 1), ("b=2 c=3", 4)]


def test_node_structure_and_order():
    nnet = build(BASE)
    assert [(n.name, n.type) for n in nnet.nodes] == [
        ("input", NodeType.INPUT), ("s1_input", NodeType.DESCRIPTOR), ("s1", NodeType.COMPONENT),
        ("t1_input", NodeType.DESCRIPTOR), ("t1", NodeType.COMPONENT),
        ("half", NodeType.DIM_RANGE), ("output", NodeType.DESCRIPTOR)]
    assert nnet.component_names == ["s1", "t1"]
    assert nnet.is_component_input_node(1) and not nnet.is_output_node(1)
    assert nnet.is_output_node(6) and nnet.nodes[6].objective_type == ObjectiveType.QUADRATIC
    assert nnet.is_dim_range_node(5) and nnet.nodes[5].node_index == 4
    assert nnet.input_dim("input") == 4 and nnet.output_dim("output") == 6
    assert nnet.input_dim("output") == -1 and nnet.output_dim("input") == -1
    assert nnet.node_dim(1) == 12
    assert nnet.config_lines() == [
        "input-node name=input dim=4",
        "component-node name=s1 component=s1 input=Append(Offset(input, -1), input, "
        "Offset(input, 1))",
        "component-node name=t1 component=t1 input=Sum(s1, IfDefined(Offset(t1, -1)))",
        "dim-range-node name=half input-node=t1 dim-offset=6 dim=6",
        "output-node name=output input=half objective=quadratic"]
    assert nnet.nodes[2].origin == ("cfg0", 4)


def test_config_round_trip():
    nnet = build(BASE)
    again = build(nnet.config_text().replace(
        "component-node name=s1", "component name=s1 type=SigmoidComponent dim=12\n"
        "component name=t1 type=TanhComponent dim=12\ncomponent-node name=s1"))
    assert again.config_lines() == nnet.config_lines()


def test_second_config_adds_and_replaces():
    nnet = build(BASE, """\
component name=t1 type=SigmoidComponent dim=12
output-node name=output input=t1
output-node name=extra input=Offset(s1, 2)
""")
    # the redefined output moves to the position of its new line
    assert nnet.output_names() == ["output", "extra"]
    assert nnet.output_dim("output") == 12
    assert nnet.nodes[nnet.get_node_index("output")].objective_type == ObjectiveType.LINEAR
    # component replaced in place, keeping its index
    assert nnet.component_names == ["s1", "t1"]
    assert nnet.components[1].type_name == "SigmoidComponent"


def test_failed_config_leaves_network_unchanged():
    nnet = build(BASE)
    before = nnet.config_lines()
    with pytest.raises(ConfigError):
        apply_config(nnet, "output-node name=output input=nosuch\n", source="bad")
    assert nnet.config_lines() == before


@pytest.mark.parametrize("extra,fragment,line", [
    ("bogus-node name=x\n", "not expected", 9),
    ("output-node name=o2 input=nosuch\n", "nosuch", 9),
    ("component-node name=c component=nosuch input=input\n", "no component named", 9),
    ("component name=c type=NoSuchComponent dim=3\n", "NoSuchComponent", 9),
    ("component name=c type=SigmoidComponent dim=5\ncomponent-node name=c component=c "
     "input=input\n", "dimension mismatch", 10),
    ("output-node name=o2 input=Sum(input, s1)\n", "inconsistent dimensions", 9),
    ("input-node name=input2 dim=0\n", "dim", 9),
    ("input-node name=input2 dim=x\n", "not an integer", 9),
    ("input-node name=input2 dim=3 colour=red\n", "colour", 9),
    ("dim-range-node name=dr input-node=t1 dim-offset=10 dim=6\n", "dim-range", 9),
    ("dim-range-node name=dr input-node=s1_input dim-offset=0 dim=6\n", "input-node", 9),
    ("input-node name=s1 dim=3\n", "appears twice", 9),
    ("output-node name=o2 input=s1_input\n", "cannot be used", 9),
    ("name=x dim=3\n", "not expected", 9),
    ("input-node dim=3\n", "name", 9),
    ("input-node name=1abc dim=3\n", "not allowed", 9),
    ("output-node name=o2 input=half objective=cubic\n", "objective", 9),
    ("output-node name=o2 input=Offset(half, 1\n", "expected ')'", 9),
    ("component-node name=z component=t1 input=Sum(s1, IfDefined(z))\n", "no time offset", 9),
])
def test_errors_name_file_line_and_reason(extra, fragment, line):
    with pytest.raises(ConfigError) as e:
        build(BASE + extra.replace("\n", "\n", 1))
    msg = str(e.value)
    assert fragment in msg
    assert e.value.source == "cfg0" and e.value.line == line, msg


def test_zero_offset_cycle_through_two_nodes():
    with pytest.raises(ConfigError) as e:
        build("""input-node name=input dim=3
component name=a type=SigmoidComponent dim=3
component name=b type=SigmoidComponent dim=3
component-node name=a component=a input=Sum(input, IfDefined(Offset(b, 1)))
component-node name=b component=b input=Offset(a, -1)
output-node name=output input=b
""")
    assert "no time offset" in str(e.value)


def test_orphans():
    text = BASE + "component name=unused type=TanhComponent dim=3\ninput-node name=spare dim=2\n"
    nnet = build(text)
    nnet.validate()  # Kaldi only warns about orphans
    with pytest.raises(ConfigError, match="not used"):
        nnet.validate(allow_orphans=False)


@pytest.mark.parametrize("case", local_network_cases(), ids=lambda p: p.name)
def test_reference_config_sequences_build_the_reference_structure(case):
    """configs.txt applied in order gives the node structure of Kaldi's model.txt."""
    configs = (case / "configs.txt").read_text()
    missing = missing_types_in_config(configs)
    if missing:
        pytest.fail(f"component types not registered: {missing}")
    parts = [p for p in configs.split("# config ") if p.strip()]
    nnet = build(*("#" + p for p in parts))
    expected = (case / "model.txt").read_text().split("<Nnet3> \n", 1)[1].split("\n\n")[0]
    assert nnet.config_lines() == expected.splitlines()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([
    "input-node name=input dim=3", "input-node name=x dim=-1", "output-node name=output input=input",
    "output-node name=o input=Offset(input, 1", "component name=s type=SigmoidComponent dim=3",
    "component-node name=s component=s input=input", "dim-range-node name=d input-node=s "
    "dim-offset=1 dim=2", "component name=s type=Nope", "garbage", "a=b=c", "name='x",
    "output-node name=output input=Sum(s, d)", "component-node name=r component=s "
    "input=IfDefined(r)"]), max_size=6), st.text(max_size=20))
def test_fuzzed_configs_raise_only_typed_errors(lines, noise):
    text = "\n".join(lines) + "\n" + noise
    try:
        build(text)
    except NnetcError:
        pass


def test_parameter_budget_stops_huge_configs_before_allocating():
    """A config of a few bytes asking for a huge parameter matrix (fuzzing found
    dim=100000000 allocating 9 GB or raising MemoryError) is a ConfigError naming the
    component, raised before the allocation; the budget covers a config's components
    together; a MemoryError while initialising is a ConfigError too."""
    from engine.nnet.components import _param_utils  # noqa: PLC0415
    huge = ("input-node name=input dim=11\n"
            "component name=affine type=AffineComponent input-dim=11 output-dim=100000000\n")
    with pytest.raises(ConfigError, match=r"'affine' \(AffineComponent\).*\(100000000, 11\)"):
        build(huge)
    conv = ("component name=c type=TimeHeightConvolutionComponent num-filters-in=100000 "
            "num-filters-out=100000 height-in=1 height-out=1 height-offsets=0 time-offsets=0\n")
    with pytest.raises(ConfigError, match="TimeHeightConvolutionComponent 'c'.*parameter array"):
        build(conv)
    with pytest.raises(ConfigError, match="'g' .*GruNonlinearity"):
        build("component name=g type=GruNonlinearityComponent cell-dim=100000000 "
              "recurrent-dim=100000\n")
    # together: each fits, the sum does not (a smaller budget keeps the test quick)
    three = "".join(f"component name=a{i} type=AffineComponent input-dim=100 output-dim=100\n"
                    for i in range(3))
    with _param_utils.parameter_budget(25000):
        with pytest.raises(ConfigError, match=r"'a2'.*may hold 25000 in all, and 4800 are left"):
            apply_config(Nnet(), three)
    nodes = ("input-node name=input dim=100\ncomponent-node name=a0 component=a0 input=input\n"
             "output-node name=output input=a0\n")
    assert build(three + nodes).num_parameters() == 3 * 100 * 101   # the default budget


def _peak_bytes(fn):
    """(tracemalloc's peak while ``fn`` runs, the ConfigError it raised or None)."""
    import gc  # noqa: PLC0415
    import tracemalloc  # noqa: PLC0415
    gc.collect()
    tracemalloc.start()
    try:
        try:
            fn()
            raised = None
        except ConfigError as e:
            raised = e
        return tracemalloc.get_traced_memory()[1], raised
    finally:
        tracemalloc.stop()


def test_the_parameters_of_a_whole_config_are_counted_before_any_is_drawn():
    """Fuzzing: AffineComponent input-dim=4 output-dim=33554000 drew its linear
    parameters (under the 2^27 budget) and only then refused the bias, 1.5 GB a
    request.  The whole component (and config) is counted first: nothing is drawn."""
    one = ("input-node name=input dim=4\n"
           "component name=a0 type=AffineComponent input-dim=4 output-dim=33554000\n"
           "component-node name=a component=a0 input=input\noutput-node name=output input=a\n")
    peak, e = _peak_bytes(lambda: build(one))
    assert e is not None and "'a0' (AffineComponent)" in str(e)
    assert "167770000 values" in str(e) and e.line == 2
    assert peak < 20 << 20, peak          # the linear part alone would be 512 MiB
    # two components that each fit, the second refused before the first is drawn
    two = ("component name=a type=AffineComponent input-dim=4 output-dim=20000000\n"
           "component name=b type=AffineComponent input-dim=4 output-dim=20000000\n")
    peak, e = _peak_bytes(lambda: build(two))
    assert e is not None and "'b' (AffineComponent)" in str(e) and e.line == 2
    assert "34217728 are left" in str(e)
    assert peak < 20 << 20, peak


def test_node_checks_run_before_parameters_are_drawn():
    """Fuzzing: ConstantComponent output-dim=99999999 in a config whose nodes then have
    a dimension mismatch drew 1e8 values (13 s, 1.2 GB) before the error; the nodes
    are checked against components initialised without drawing."""
    cfg = ("input-node name=input dim=4\n"
           "component name=k type=ConstantComponent output-dim=99999999\n"
           "component-node name=k component=k input=input\n"
           "component name=b type=AffineComponent input-dim=7 output-dim=3\n"
           "component-node name=b component=b input=k\noutput-node name=output input=b\n")
    peak, e = _peak_bytes(lambda: build(cfg))
    assert e is not None and "dimension mismatch" in str(e)
    assert peak < 20 << 20, peak
    # a caller's check sees the network's sizes before anything is drawn
    seen = []

    def refuse(nnet):
        seen.append(nnet.array_bytes())
        raise ConfigError("too big")
    big = ("input-node name=input dim=4\n"
           "component name=a type=LinearComponent input-dim=4 output-dim=25000000\n"
           "component-node name=a component=a input=input\noutput-node name=output input=a\n")
    peak, e = _peak_bytes(lambda: apply_config(Nnet(), big, check=refuse))
    assert e is not None and e.reason == "too big" and seen == [4 * 4 * 25000000]
    assert peak < 20 << 20, peak


def test_drawing_after_the_count_gives_the_values_of_one_draw():
    """The counting pass takes nothing from ``rng``: the parameters are those one
    draw in config order gives (as before), also across the block size of a draw."""
    from engine.nnet.components import _param_utils  # noqa: PLC0415
    cfg = ("input-node name=input dim=3\n"
           "component name=a type=AffineComponent input-dim=3 output-dim=700000 "
           "param-stddev=0.5 bias-stddev=2\n"
           "component name=f type=FixedAffineComponent input-dim=3 output-dim=2\n"
           "component-node name=a component=a input=input\n"
           "component-node name=f component=f input=input\n"
           "output-node name=output input=Append(a, f)\n")
    nnet = Nnet()
    apply_config(nnet, cfg, rng=np.random.default_rng(3))
    rng = np.random.default_rng(3)
    want_lin = (rng.standard_normal((700000, 3)) * 0.5).astype(np.float32)
    want_bias = (rng.standard_normal(700000) * 2.0).astype(np.float32)
    fixed = rng.standard_normal((2, 4)).astype(np.float32)
    a, f = nnet.components
    assert 3 * 700000 > _param_utils._DRAW_BLOCK
    assert np.array_equal(a.linear_params, want_lin)
    assert np.array_equal(a.bias_params, want_bias)
    assert np.array_equal(f.linear_params, fixed[:, :3])
    assert f.linear_params.flags.c_contiguous and f.linear_params.flags.writeable
    assert nnet.array_bytes() == 4 * (700000 * 4 + 2 * 4)


def test_memory_error_while_initialising_is_a_config_error(monkeypatch):
    from engine.nnet.components import affine  # noqa: PLC0415

    def no_memory(*a, **k):
        raise MemoryError("cannot allocate")
    monkeypatch.setattr(affine, "gaussian", no_memory)
    with pytest.raises(ConfigError, match=r"'a' \(AffineComponent\): its sizes are out of range"):
        build("component name=a type=AffineComponent input-dim=3 output-dim=4\n")


def test_node_lookup_follows_edits_of_the_node_list():
    """get_node_index keeps a name table; nodes added, renamed, removed or reordered in
    place (as config edits, collapsing and fusion do) never leave it answering wrong."""
    nnet = Nnet.from_config(
        "input-node name=input dim=4\n"
        "component name=a type=AffineComponent input-dim=4 output-dim=3\n"
        "component-node name=a component=a input=input\n"
        "output-node name=output input=a\n", rng=np.random.default_rng(0))
    names = [n.name for n in nnet.nodes]
    assert [nnet.get_node_index(n) for n in names] == list(range(len(names)))
    assert nnet.get_node_index("nope") == -1
    out = nnet.get_node_index("output")
    nnet.nodes[out].name = "final"                      # renamed in place
    assert nnet.get_node_index("output") == -1 and nnet.get_node_index("final") == out
    nnet.nodes.insert(0, nnet.nodes.pop(out))           # moved to the front
    assert nnet.get_node_index("final") == 0 and nnet.get_node_index("input") == 1
    del nnet.nodes[0]                                   # removed
    assert nnet.get_node_index("final") == -1 and nnet.get_node_index("input") == 0
    nnet.read_config("output-node name=output input=a\n")   # added by a config edit
    assert nnet.nodes[nnet.get_node_index("output")].name == "output"


# -- numbers in options: what Kaldi's ConvertStringToInteger / ConvertStringToReal read --

def _one_component(options: str, kind: str = "NormalizeComponent dim=4") -> Nnet:
    return Nnet.from_config("input-node name=input dim=4\n"
                            f"component name=a type={kind} {options}\n"
                            "component-node name=a component=a input=input\n"
                            "output-node name=output input=a\n")


@pytest.mark.parametrize("text, value", [("2", 2.0), ("-1.5", -1.5), ("1e-3", 1e-3),
                                         (".5", 0.5), ("5.", 5.0), ("+2E+3", 2000.0)])
def test_real_options_read_as_kaldi_reads_them(text, value):
    assert parse_config_line(f"x v={text}").get_float("v") == value
    assert parse_config_line(f"x v=1,{text}").get_float_list("v") == [1.0, value]


@pytest.mark.parametrize("text", ["nan", "NaN", "１０", "1_0", "0x10", "e5", "1e", "."])
def test_real_options_refuse_what_kaldi_does_not_read_and_nan(text):
    with pytest.raises(ConfigError, match=r"option v=.* is not a number"):
        parse_config_line(f"x v={text}").get_float("v")
    with pytest.raises(ConfigError, match="number list"):
        parse_config_line(f"x v=1,{text}").get_float_list("v")


def test_nan_option_is_named_as_such():
    with pytest.raises(ConfigError, match=r":2: component 'a'.*target-rms='nan' is not a "
                                          r"number \(NaN is not accepted\)"):
        _one_component("target-rms=nan")


@pytest.mark.parametrize("text", ["１０", "1_0", "0x10", "1.0", "--1"])
def test_integer_options_take_ascii_digits_only(text):
    with pytest.raises(ConfigError, match="is not an integer"):
        parse_config_line(f"x v={text}").get_int("v")
    with pytest.raises(ConfigError, match="integer list"):
        parse_config_line(f"x v=1,{text}").get_int_list("v")
    # the node dims and descriptor integers are read by the same rule
    with pytest.raises(ConfigError, match="dim"):
        Nnet.from_config(f"input-node name=input dim={text}\n")
    with pytest.raises(ConfigError, match="Offset"):
        Nnet.from_config("input-node name=input dim=4\n"
                         f"output-node name=output input=Offset(input, {text})\n")


@pytest.mark.parametrize("kind", ["NormalizeComponent dim=4", "BatchNormComponent dim=4"])
@pytest.mark.parametrize("value", ["inf", "-inf", "0", "-1"])
def test_target_rms_must_be_finite_and_positive(kind, value):
    with pytest.raises(ConfigError, match="target-rms"):
        _one_component(f"target-rms={value}", kind)


def test_batchnorm_epsilon_must_be_finite():
    with pytest.raises(ConfigError, match="epsilon=inf"):
        _one_component("epsilon=inf", "BatchNormComponent dim=4")
