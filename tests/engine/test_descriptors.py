"""Descriptors: parsing, Kaldi's normalisation and printing, and their semantics
(map_to_input, is_computable with Failover/IfDefined, scales, modulus)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nnet_ref_cases import NETWORKS, shared_network_cases

from engine.core.errors import ConfigError, NnetcError
from engine.core.index import Cindex, Index
from engine.nnet.descriptors import (
    SCALE_NOT_FOUND, BinarySumDescriptor, ConstantSumDescriptor, OffsetForwardingDescriptor,
    OptionalSumDescriptor, ReplaceIndexForwardingDescriptor, RoundingForwardingDescriptor,
    SimpleForwardingDescriptor, SimpleSumDescriptor, SumOp, SwitchingForwardingDescriptor,
    parse_descriptor)

NAMES = ["input", "ivector", None, "a", None, "b", "c.d", "e-f"]
REF = json.loads((NETWORKS / "descriptors.json").read_text())


def _names(case):
    return [n or "**" for n in case["names"]]


def parse(text, names=NAMES):
    return parse_descriptor(text, names)


def show(desc, names=NAMES):
    return desc.write([n or "**" for n in names])


# -- Kaldi's normalised printouts -----------------------------------------------------------


@pytest.mark.parametrize("case", sorted(REF))
def test_reference_descriptors_print_back_identically(case):
    """Every descriptor in the reference model files parses and prints byte-identically."""
    c = REF[case]
    for node, text in c["normalized"].items():
        assert parse_descriptor(text, c["names"]).write(_names(c)) == text, node


@pytest.mark.parametrize("case", sorted(k for k in REF if REF[k]["raw"]))
def test_raw_config_descriptors_normalise_like_kaldi(case):
    """configs.txt inputs (as written) print as Kaldi's model.txt normalised form."""
    c = REF[case]
    for node, raw in c["raw"].items():
        assert parse_descriptor(raw, c["names"]).write(_names(c)) == c["normalized"][node], node


@pytest.mark.conformance
@pytest.mark.parametrize("case_dir", shared_network_cases(), ids=lambda p: p.name)
def test_shared_reference_descriptors(case_dir):
    from engine.nnet.config import parse_config_line  # noqa: PLC0415
    text = (case_dir / "model.txt").read_text()
    section = text.split("<Nnet3> \n", 1)[1].split("\n\n", 1)[0].splitlines()
    names: list[str | None] = []
    inputs = []
    for line in section:
        cfg = parse_config_line(line)
        if cfg.first_token in ("input-node", "dim-range-node"):
            names.append(cfg.values["name"])
        elif cfg.first_token == "component-node":
            names += [None, cfg.values["name"]]
        else:
            names.append(None)
        if "input" in cfg.values:
            inputs.append(cfg.values["input"])
    for s in inputs:
        assert parse_descriptor(s, names).write([n or "**" for n in names]) == s


def test_shared_set_present_or_skipped():
    if not shared_network_cases():
        pytest.skip("../shared/kaldi-ref not present: full reference set not run")
    assert len(shared_network_cases()) > 10


# -- normalisation rules -----------------------------------------------------------------------


@pytest.mark.parametrize("raw,expected", [
    ("Append(input, Append(a, b))", "Append(input, a, b)"),
    ("Append(Offset(input, -3))", "Offset(input, -3)"),
    ("Offset(input, 0)", "input"),
    ("Offset(Offset(input, 1), 2)", "Offset(input, 3)"),
    ("Offset(Offset(input, 1, 2), -1)", "Offset(input, 0, 2)"),
    ("Offset(Offset(input, 1), -1)", "input"),
    ("Sum(a, b, c.d)", "Sum(a, Sum(b, c.d))"),
    ("Sum(a)", "a"),
    ("Scale(2, Offset(a, 1))", "Offset(Scale(2, a), 1)"),
    ("Scale(2, Scale(0.5, a))", "a"),
    ("Scale(-1.0, Sum(a, b))", "Sum(Scale(-1, a), Scale(-1, b))"),
    ("Offset(Sum(a, b), 2)", "Sum(Offset(a, 2), Offset(b, 2))"),
    ("Offset(IfDefined(a), -1)", "IfDefined(Offset(a, -1))"),
    ("Round(Failover(a, b), 3)", "Failover(Round(a, 3), Round(b, 3))"),
    ("Sum(Append(a, b), Append(input, c.d))", "Append(Sum(a, input), Sum(b, c.d))"),
    ("Offset(Append(a, b), 1)", "Append(Offset(a, 1), Offset(b, 1))"),
    ("Sum(Const(1.0, 77), Scale(-1.0, a))", "Sum(Const(1, 77), Scale(-1, a))"),
    ("ReplaceIndex(ivector, t, 0)", "ReplaceIndex(ivector, t, 0)"),
    ("Scale(0.123456789, a)", "Scale(0.123457, a)"),
    ("Switch(a, Offset(b, 1))", "Switch(a, Offset(b, 1))"),
    ("Offset( input , -1 )", "Offset(input, -1)"),
    ("e-f", "e-f"),
])
def test_normalisation(raw, expected):
    assert show(parse(raw)) == expected


def test_structure_matches_kaldi_classes():
    d = parse("Append(Offset(input, -1), Failover(a, Const(2, 5)), IfDefined(Offset(b, -2)))")
    assert d.num_parts() == 3
    p0, p1, p2 = d.parts
    assert isinstance(p0, SimpleSumDescriptor) and isinstance(p0.src, OffsetForwardingDescriptor)
    assert isinstance(p1, BinarySumDescriptor) and p1.op == SumOp.FAILOVER
    assert isinstance(p1.src2, ConstantSumDescriptor)
    assert isinstance(p2, OptionalSumDescriptor)
    d2 = parse("Switch(Round(a, 2), ReplaceIndex(b, x, 1))")
    fd = d2.part(0).src
    assert isinstance(fd, SwitchingForwardingDescriptor)
    assert isinstance(fd.srcs[0], RoundingForwardingDescriptor)
    assert isinstance(fd.srcs[1], ReplaceIndexForwardingDescriptor)


# -- semantics --------------------------------------------------------------------------------


def test_map_to_input():
    a, b = NAMES.index("a"), NAMES.index("b")
    fd = parse("Offset(a, -2, 1)").part(0).src
    assert fd.map_to_input(Index(3, 10, 0)) == Cindex(a, Index(3, 8, 1))
    sw = parse("Switch(a, b, Offset(a, 5))").part(0).src
    assert sw.map_to_input(Index(0, -1, 0)) == Cindex(a, Index(0, 4, 0))  # -1 mod 3 = 2
    assert sw.map_to_input(Index(0, 4, 0)) == Cindex(b, Index(0, 4, 0))
    rd = parse("Round(a, 3)").part(0).src
    assert rd.map_to_input(Index(0, -1, 0)) == Cindex(a, Index(0, -3, 0))
    assert rd.map_to_input(Index(0, 5, 2)) == Cindex(a, Index(0, 3, 2))
    ri = parse("ReplaceIndex(a, x, 7)").part(0).src
    assert ri.map_to_input(Index(1, 2, 3)) == Cindex(a, Index(1, 2, 7))


def test_is_computable_failover_and_ifdefined():
    a, b = NAMES.index("a"), NAMES.index("b")
    present = {Cindex(b, Index(0, 0, 0)), Cindex(a, Index(0, 1, 0))}
    have = present.__contains__
    fo = parse("Failover(Offset(a, -1), b)")
    used: list[Cindex] = []
    assert fo.is_computable(Index(0, 2, 0), have, used)
    assert used == [Cindex(a, Index(0, 1, 0))]
    assert fo.is_computable(Index(0, 0, 0), have, used)
    assert used == [Cindex(b, Index(0, 0, 0))]
    assert not fo.is_computable(Index(0, 5, 0), have, used) and used == []
    opt = parse("IfDefined(Offset(a, -1))")
    assert opt.is_computable(Index(0, 9, 0), have, used) and used == []
    assert opt.is_computable(Index(0, 2, 0), have, used) and used == [Cindex(a, Index(0, 1, 0))]
    s = parse("Sum(a, b)")
    assert not s.is_computable(Index(0, 1, 0), have, used) and used == []
    app = parse("Append(Const(1, 3), b)")
    assert app.is_computable(Index(0, 0, 0), have, used) and used == [Cindex(b, Index(0, 0, 0))]
    assert sorted(parse("Sum(a, Failover(b, a))").get_dependencies(Index(0, 0, 0))) == sorted(
        [Cindex(a, Index(0, 0, 0)), Cindex(b, Index(0, 0, 0)), Cindex(a, Index(0, 0, 0))])


def test_scales_and_constant_term():
    a, b = NAMES.index("a"), NAMES.index("b")
    d = parse("Sum(Const(2.5, 4), Scale(-1, a))").part(0)
    assert d.get_scale_for_node(a) == -1.0
    assert d.get_scale_for_node(b) == SCALE_NOT_FOUND and math.isinf(SCALE_NOT_FOUND)
    assert d.get_scale_for_node(-1) == 2.5
    assert parse("Offset(Scale(3, b), 1)").part(0).get_scale_for_node(-1) == 0.0
    with pytest.raises(ConfigError):
        parse("Sum(Scale(2, a), Scale(3, a))").part(0).get_scale_for_node(a)
    with pytest.raises(ConfigError):
        parse("IfDefined(Sum(a, Const(1, 3)))").part(0).get_scale_for_node(-1)
    sw = SwitchingForwardingDescriptor([SimpleForwardingDescriptor(a, 2.0),
                                        SimpleForwardingDescriptor(b)])
    assert sw.get_scale_for_node(a) == 2.0 and sw.get_scale_for_node(99) == SCALE_NOT_FOUND


def test_modulus_and_node_dependencies():
    assert parse("Switch(a, b, Round(a, 2))").modulus() == 6
    assert parse("Round(Offset(a, 1), 4)").modulus() == 4
    assert parse("ReplaceIndex(Round(a, 4), t, 0)").modulus() == 1  # as Kaldi
    assert parse("Append(Round(a, 2), Sum(b, Round(a, 3)))").modulus() == 6
    assert parse("Append(a, Sum(b, Offset(a, 1)))").get_node_dependencies() == [3, 5, 3]


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,fragment", [
    ("Offset(a, 1", "expected ')'"),
    ("Offset(a, x)", "expected an integer"),
    ("Offset(zz, 1)", "'zz'"),
    ("Append(a,, b)", "','"),
    ("Sum(a, b) c.d", "end of expression"),
    ("Switch(Sum(a, b), a)", "Switch"),
    ("Scale(2, Const(1, 3))", "Scale"),
    ("Offset(Const(1, 3), 1)", "Const"),
    ("Const(1, 0)", "dimension"),
    ("Const(inf, 2)", "finite"),
    ("Round(a, 0)", "modulus"),
    ("ReplaceIndex(a, n, 0)", "'t' or 'x'"),
    ("a$", "bad token"),
    ("", "empty"),
    ("Sum(Append(a, b), c.d)", "different numbers of terms"),
    ("Offset(a, 99999999999)", "integer"),
])
def test_errors_name_the_problem(text, fragment):
    with pytest.raises(ConfigError) as e:
        parse(text)
    assert fragment in str(e.value)


def test_error_names_position():
    with pytest.raises(ConfigError) as e:
        parse("Append(a, Offset(b, q))")
    assert "character 20" in str(e.value)


def test_descriptor_node_is_not_referable():
    with pytest.raises(ConfigError) as e:
        parse_descriptor("out", ["input", None], all_names=["input", "out"])
    assert "cannot be used in a descriptor" in str(e.value)


# -- property tests -------------------------------------------------------------------------------

_leaf = st.sampled_from(["input", "a", "b", "c.d", "Const(1.5, 3)"])


def _extend(inner):
    ints = st.integers(-5, 5)
    return st.one_of(
        st.builds(lambda xs: f"Append({', '.join(xs)})", st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda xs: f"Sum({', '.join(xs)})", st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda x, y: f"Failover({x}, {y})", inner, inner),
        st.builds(lambda x: f"IfDefined({x})", inner),
        st.builds(lambda x, t: f"Offset({x}, {t})", inner, ints),
        st.builds(lambda x, t, u: f"Offset({x}, {t}, {u})", inner, ints, ints),
        st.builds(lambda xs: f"Switch({', '.join(xs)})", st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda x, m: f"Round({x}, {m})", inner, st.integers(1, 4)),
        st.builds(lambda x, v, k: f"ReplaceIndex({x}, {v}, {k})", inner,
                  st.sampled_from(["t", "x"]), ints),
        st.builds(lambda s, x: f"Scale({s}, {x})", st.sampled_from(["-1", "0.5", "2", "1e-3"]),
                  inner),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(_leaf, _extend, max_leaves=8))
def test_random_expressions_round_trip(expr):
    """Any expression either fails with a ConfigError or normalises to a form that
    parses back to an equal Descriptor and prints identically."""
    try:
        d = parse(expr)
    except NnetcError as e:
        assert isinstance(e, ConfigError)
        return
    printed = show(d)
    again = parse(printed)
    assert again == d
    assert show(again) == printed


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="()/, -+.01xtabinputSumOfsetApdIfDeCcRvlw", max_size=40))
def test_fuzzed_text_only_raises_config_errors(text):
    try:
        parse(text)
    except ConfigError:
        pass
