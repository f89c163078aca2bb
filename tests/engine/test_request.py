"""ComputationRequest: JSON form, canonical hash, validation against a network."""

import json

import numpy as np
import pytest

from engine.compiler.request import ComputationRequest, IoSpecification, io_spec
from engine.core.errors import RequestError
from engine.core.index import Index
from engine.nnet.nnet import Nnet

from compiler_ref import CASES, CASES_DIR

CONFIG = """
input-node name=input dim=3
input-node name=ivector dim=2
component name=a type=AffineComponent input-dim=5 output-dim=4
component-node name=a component=a input=Append(input, ReplaceIndex(ivector, t, 0))
output-node name=output input=a
"""


@pytest.fixture(scope="module")
def nnet():
    return Nnet.from_config(CONFIG)


def make_request(out_deriv=False, in_deriv=False, model_deriv=False):
    return ComputationRequest(
        [io_spec("input", [Index(0, t, 0) for t in range(4)], in_deriv),
         io_spec("ivector", [Index(0, 0, 0)])],
        [io_spec("output", [Index(0, t, 0) for t in range(4)], out_deriv)],
        need_model_derivative=model_deriv)


@pytest.mark.parametrize("case", CASES[:12])
def test_reference_json_round_trip(case):
    obj = json.loads((CASES_DIR / case / "request.json").read_text())
    req = ComputationRequest.from_json(obj)
    assert req.to_json() == obj
    again = ComputationRequest.from_json(json.dumps(req.to_json()))
    assert again == req and again.hash() == req.hash()
    spec = req.inputs[0]
    assert [list(i) for i in spec.indexes] == obj["inputs"][0]["indexes"]
    assert spec.indexes_array().shape == (len(obj["inputs"][0]["indexes"]), 3)


def test_array_and_list_indexes_agree():
    arr = np.array([[0, 5, 0], [1, 5, 0], [0, 6, 2]], dtype=np.int64)
    a = IoSpecification("input", arr, True)
    b = IoSpecification("input", [(0, 5, 0), (1, 5, 0), (0, 6, 2)], True)
    assert a == b
    assert a.indexes[2] == Index(0, 6, 2)
    np.testing.assert_array_equal(a.indexes_array(), arr)


def test_hash_is_deterministic_and_sensitive():
    base = make_request()
    assert base.hash() == make_request().hash()
    assert base.canonical_bytes() == make_request().canonical_bytes()
    variants = [make_request(out_deriv=True), make_request(out_deriv=True, in_deriv=True),
                make_request(out_deriv=True, model_deriv=True)]
    reordered = make_request()
    reordered.outputs[0].indexes.reverse()
    variants.append(reordered)
    stats = make_request()
    stats.store_component_stats = True
    variants.append(stats)
    hashes = {base.hash()} | {v.hash() for v in variants}
    assert len(hashes) == len(variants) + 1
    assert len(base.hash()) == 64


def test_lookups(nnet):
    req = make_request()
    assert req.index_of_input("ivector") == 1
    assert req.index_of_input("output") == -1
    assert req.index_of_output("output") == 0
    rows = req.validate(nnet)
    assert [r.tolist() for r in rows] == [[list(i) for i in s.indexes]
                                          for s in req.inputs + req.outputs]


@pytest.mark.parametrize("mutate, message", [
    (lambda r: setattr(r.inputs[0], "name", "inptu"), "'inptu': the network has no node"),
    (lambda r: setattr(r.outputs[0], "name", "a"), "output 'a' is not an output node"),
    (lambda r: setattr(r.inputs[0], "name", "output"), "input 'output' is not an input node"),
    (lambda r: r.inputs[0].indexes.append(Index(0, 2, 0)),
     "index (n=0, t=2, x=0) is listed twice (rows 2 and 4)"),
    (lambda r: r.outputs[0].indexes.clear(), "output 'output' has an empty list"),
    (lambda r: r.outputs.clear(), "request has no outputs"),
    (lambda r: r.inputs.append(IoSpecification("input", [Index(0, 9, 0)])),
     "input 'input' is listed more than once"),
    (lambda r: setattr(r, "need_model_derivative", True), "no output has has_deriv"),
    (lambda r: r.inputs[1].indexes.append(Index(1, -2 ** 31, 0)), "outside the 32-bit range"),
    (lambda r: r.inputs[1].indexes.append(Index(1, 0, 2 ** 31)), "'ivector': index 1 (1, 0, 2147483648)"),
    (lambda r: r.inputs[1].indexes.append(Index(2 ** 70, 0, 0)), "outside the 32-bit range"),
])
def test_validate_names_the_fault(nnet, mutate, message):
    req = make_request()
    mutate(req)
    with pytest.raises(RequestError) as e:
        req.validate(nnet)
    assert message in str(e.value)


@pytest.mark.parametrize("obj, message", [
    ("{not json", "not valid JSON"),
    ({"inputs": []}, "'outputs' must be a list"),
    ({"inputs": [], "outputs": [], "extra": 1}, "unknown field(s): extra"),
    ({"inputs": [{"name": "input"}], "outputs": []}, "missing 'indexes'"),
    ({"inputs": [{"name": "input", "indexes": [[0, 1]]}], "outputs": []},
     "index 0 is [0, 1], expected [n, t, x]"),
    ({"inputs": [{"name": "input", "indexes": [[0, 1.5, 0]]}], "outputs": []},
     "expected [n, t, x] integers"),
])
def test_from_json_errors(obj, message):
    with pytest.raises(RequestError) as e:
        ComputationRequest.from_json(obj)
    assert message in str(e.value)


_IO = {"name": "input", "indexes": [[0, 0, 0]]}


@pytest.mark.parametrize("obj, message", [
    ({"inputs": [{**_IO, "has_deriv": "yes"}], "outputs": []},
     "input 0 'input': 'has_deriv' must be true or false (a JSON boolean), got \"yes\""),
    ({"inputs": [], "outputs": [{**_IO, "has_deriv": 1}]}, "output 0 'input': 'has_deriv'"),
    ({"inputs": [], "outputs": [{**_IO, "has_deriv": None}]}, "got null"),
    ({"inputs": [], "outputs": [], "need_model_derivative": "true"},
     "'need_model_derivative' must be true or false"),
    ({"inputs": [], "outputs": [], "store_component_stats": 0},
     "'store_component_stats' must be true or false"),
])
def test_flags_must_be_json_booleans(obj, message):
    """As the HTTP schema (StrictBool): 1, "yes" or null are not converted."""
    with pytest.raises(RequestError) as e:
        ComputationRequest.from_json(json.dumps(obj).encode())
    assert message in str(e.value)


@pytest.mark.parametrize("data, message", [
    (b'\xff\xfe{"a":1}', "after a UTF-16 byte-order mark"),
    (b'{"inputs": [], "outputs": ["\xe9"]}', "not utf-8 text (invalid continuation byte"),
    (b"[" * 100_000, "nested too deeply"),
    (b'{"inputs": [1' + b"1" * 5000 + b"]}", "not valid JSON"),
])
def test_undecodable_bytes_are_a_request_error(data, message):
    with pytest.raises(RequestError) as e:
        ComputationRequest.from_json(data)
    assert message in str(e.value)


def test_every_reference_request_loads():
    """The strict flags take every request.json of tests/data and ../shared/kaldi-ref."""
    from refdata import DATA, SHARED_REF  # noqa: PLC0415
    paths = sorted(DATA.rglob("request.json")) + sorted(SHARED_REF.rglob("request.json"))
    assert len(paths) >= 100
    for path in paths:
        ComputationRequest.from_json(path.read_bytes())


def test_replicated_lists_sequences_n_major():
    one = ComputationRequest(
        [IoSpecification("input", [Index(0, t, 0) for t in range(-1, 3)], has_deriv=True)],
        [IoSpecification("output", [Index(0, t, 0) for t in range(2)], has_deriv=True)],
        need_model_derivative=False)
    three = one.replicated(3)
    assert [tuple(i) for i in three.outputs[0].indexes] == [
        (n, t, 0) for n in range(3) for t in range(2)]
    assert len(three.inputs[0].indexes) == 12 and three.inputs[0].has_deriv
    assert three.need_model_derivative is False
    assert one.replicated(1) == one
    with pytest.raises(RequestError, match="copies"):
        one.replicated(0)
    with pytest.raises(RequestError, match="n != 0"):
        three.replicated(2)


@pytest.mark.parametrize("inputs", [["relu1"], ["input", "relu1"]])
def test_input_at_a_component_node_is_refused_by_name(inputs):
    """Kaldi's graph builder accepts a value supplied at a component node but then
    asserts that the component is computable from its own input, which the graph never
    holds: a RequestError naming the node (was a KeyError from pruning)."""
    from engine.compiler.shortcut import compile_request  # noqa: PLC0415
    nnet = Nnet.from_config(
        "input-node name=input dim=4\n"
        "component name=affine1 type=AffineComponent input-dim=4 output-dim=5\n"
        "component-node name=affine1 component=affine1 input=input\n"
        "component name=relu1 type=RectifiedLinearComponent dim=5\n"
        "component-node name=relu1 component=relu1 input=affine1\n"
        "output-node name=output input=relu1\n", rng=np.random.default_rng(0))
    req = ComputationRequest(
        [IoSpecification(n, [Index(0, t, 0) for t in range(5)]) for n in inputs],
        [IoSpecification("output", [Index(0, t, 0) for t in range(5)])])
    with pytest.raises(RequestError, match="input 'relu1' is a component node"):
        compile_request(nnet, req)


def test_canonical_bytes_tell_apart_where_each_index_belongs():
    """The Index counts in the header line: the same Indexes split differently between
    two inputs, or an input's name holding what looks like the header's end, encode
    differently; the rows are the Indexes' n, t, x as little-endian int64."""
    def req(split: int, name: str = "a") -> ComputationRequest:
        rows = [Index(0, t, 0) for t in range(4)]
        return ComputationRequest([IoSpecification(name, rows[:split]),
                                   IoSpecification("b", rows[split:])],
                                  [IoSpecification("output", [Index(0, 0, 0)])])
    encodings = {req(k).canonical_bytes() for k in range(5)}
    assert len(encodings) == 5
    assert req(2, 'a"]\n').canonical_bytes() != req(2).canonical_bytes()
    head, _, rows = req(4).canonical_bytes().partition(b"\n")
    assert np.frombuffer(rows, "<i8").reshape(-1, 3).tolist() == \
        [[0, t, 0] for t in range(4)] + [[0, 0, 0]]
    huge = req(2)
    huge.inputs[0].indexes.append(Index(2 ** 70, 0, 0))     # never valid, still encoded
    assert huge.canonical_bytes() != req(2).canonical_bytes() and hash(huge) is not None
