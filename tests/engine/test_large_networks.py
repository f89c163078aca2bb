"""Networks of thousands of nodes load, compile, collapse for decoding and run in work
linear in their size.  A config of N lines used to cost O(N^2) to read (a name table
per descriptor, a scan per name), O(N^3) to compile (every node's chain walked in full,
with a list membership test per step) and O(N^3) to prepare for decoding (one
forward identity of a chain aliased per round, each round re-parsing every descriptor
with a new name table): a 2000-node chain took minutes to compile, and a client could
post one.  The checks here count the work (rounds, tables, chain steps), not time."""

from __future__ import annotations

import numpy as np
import pytest

from engine.compiler import graph_arrays
from engine.compiler.compiler import compile_computation
from engine.compiler.graph_nodes import node_table_for
from engine.compiler.request import ComputationRequest, IoSpecification
from engine.core.index import Index
from engine.inference.common import prepare_nnet
from engine.nnet import descriptor_parse
from engine.nnet.config import apply_config
from engine.nnet.nnet import Nnet, NodeType
from engine.nnet.random_config import generate_config_sequence
from engine.optimizer import aliases, optimize
from engine.runtime.executor import run_computation

N = 1500


def _noop_chain(n: int, dim: int = 2) -> str:
    lines = [f"input-node name=input dim={dim}"]
    for i in range(n):
        lines.append(f"component name=c{i} type=NoOpComponent dim={dim}")
        lines.append(f"component-node name=c{i} component=c{i} "
                     f"input={'input' if i == 0 else f'c{i - 1}'}")
    lines.append(f"output-node name=output input=c{n - 1}")
    return "\n".join(lines) + "\n"


class _Count:
    def __init__(self, monkeypatch, owner, name):
        self.calls = 0
        real = getattr(owner, name)

        def counted(*a, **k):
            self.calls += 1
            return real(*a, **k)
        monkeypatch.setattr(owner, name, counted)


def test_reading_a_long_config_makes_one_name_table(monkeypatch):
    tables = _Count(monkeypatch, descriptor_parse.DescriptorNames, "__init__")
    nnet = Nnet.from_config(_noop_chain(N))
    assert nnet.num_nodes() == 2 * N + 2
    assert tables.calls == 1          # not one per descriptor (N + 1 of them)


def test_a_long_chain_compiles_and_runs():
    nnet = Nnet.from_config(_noop_chain(N))
    request = ComputationRequest([IoSpecification("input", [Index(0, t, 0) for t in range(3)])],
                                 [IoSpecification("output", [Index(0, t, 0) for t in range(3)])])
    comp = optimize(compile_computation(nnet, request), nnet)
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    outputs = run_computation(comp, nnet, {"input": x})[0]
    np.testing.assert_array_equal(outputs["output"], x)


def test_chains_follow_links_once(monkeypatch):
    """Every node's chain on a chain network: the links are found in one pass, and a
    chain is made only when asked for (the graph build asks for the head's)."""
    nnet = Nnet.from_config(_noop_chain(N))
    nodes = node_table_for(nnet)
    pos = [0] * len(nodes.kind)
    for p, v in enumerate(nodes.order):
        pos[v] = p
    chains = graph_arrays._Chains(nodes, pos)
    assert chains._made == {}
    out = nnet.get_node_index("output")
    # the output's descriptor reads c{N-1} ... down to the input node
    head = chains[out]
    # through every component node and its input node, down to the input
    assert head == list(range(out - 1, 0, -1)) + [nnet.get_node_index("input")]
    assert len(chains._made) == 1


def _reference_chains(nodes, pos):
    """The definition of graph_arrays._chains, walked node by node."""
    num = len(nodes.kind)
    readers = [[] for _ in range(num)]
    for v in range(num):
        for p in nodes.producers[v]:
            readers[p].append(v)

    def same(v):
        sh = nodes.shifts[v]
        return sh[0][0] if sh is not None and len(sh) == 1 and sh[0][1:] == (0, 0, 0) else -1
    out = []
    for v in range(num):
        chain, prev, c = [], v, same(v)
        while (c >= 0 and readers[c] == [prev] and nodes.kind[c] != graph_arrays.INPUT
               and pos[c] < pos[prev] and c not in chain and c != v):
            nxt = same(c)
            if nxt < 0:
                break
            chain.append(c)
            prev, c = c, nxt
        out.append(chain + [c] if chain else [])
    return out


@pytest.mark.parametrize("seed", range(0, 120, 3))
def test_chains_match_their_definition_on_random_networks(seed):
    nnet = Nnet()
    for text in generate_config_sequence(np.random.default_rng(seed)).configs:
        apply_config(nnet, text, rng=np.random.default_rng(seed))
    for net in (nnet, prepare_nnet(nnet)):
        nodes = node_table_for(net)
        pos = [0] * len(nodes.kind)
        for p, v in enumerate(nodes.order):
            pos[v] = p
        want = _reference_chains(nodes, pos)
        got = graph_arrays._Chains(nodes, pos)
        assert [got[v] for v in range(len(want))] == want


def test_a_chain_of_identities_is_aliased_in_one_round(monkeypatch):
    applied = _Count(monkeypatch, aliases, "_apply")
    nnet = Nnet.from_config(_noop_chain(N))
    dec = prepare_nnet(nnet)
    assert applied.calls == 1
    # nothing but the input and the output is left: the output reads the input
    assert [n.type for n in dec.nodes] == [NodeType.INPUT, NodeType.DESCRIPTOR]
    assert dec.nodes[1].descriptor.get_node_dependencies() == [0]


def _affine_scale_chain(n: int) -> str:
    lines = ["input-node name=input dim=2"]
    prev = "input"
    for i in range(n):
        lines += [f"component name=a{i} type=AffineComponent input-dim=2 output-dim=2",
                  f"component-node name=a{i} component=a{i} input={prev}",
                  f"component name=s{i} type=FixedScaleComponent dim=2 scale=0.5",
                  f"component-node name=s{i} component=s{i} input=a{i}",
                  f"component name=r{i} type=RectifiedLinearComponent dim=2",
                  f"component-node name=r{i} component=r{i} input=s{i}"]
        prev = f"r{i}"
    return "\n".join(lines + [f"output-node name=output input={prev}"]) + "\n"


def test_collapsing_a_long_network_parses_against_one_name_table(monkeypatch):
    """Each affine -> fixed-scale pair folds (300 folds); the descriptors the folds
    rewrite are parsed against one name table per collapse, not one per fold."""
    nnet = Nnet.from_config(_affine_scale_chain(300))
    tables = _Count(monkeypatch, descriptor_parse.DescriptorNames, "__init__")
    dec = prepare_nnet(nnet)
    assert dec.num_nodes() == nnet.num_nodes() - 2 * 300      # every scale node folded
    assert tables.calls <= 4


def test_a_long_append_takes_linear_work(monkeypatch):
    """Append() of thousands of terms (a 30 kB config line): reading it picks every term
    apart once (Kaldi's GetAppendTerm per term walked the terms before it: quadratic),
    and addition-to-assignment tests each written column block against the matrix's
    bounding box, not against every block before it; the result is the Append."""
    from engine.optimizer.passes import convert_addition
    n = 3000
    counts = _Count(monkeypatch, descriptor_parse, "_num_append_terms")
    terms = ", ".join("input" if i % 3 else f"Offset(input, {i % 5})" for i in range(n))
    nnet = Nnet.from_config("input-node name=input dim=2\n"
                            f"output-node name=output input=Append({terms})\n")
    assert nnet.output_dim("output") == 2 * n
    assert counts.calls <= 2 * n + 10
    scans = []
    real = convert_addition._Touched.untouched

    def untouched(self, s):
        # the rectangles the test scans: those of a matrix whose box s overlaps
        m, ro, nr, co, nc = self.subs[s]
        b = self.box[m]
        inside = b is not None and b[0] < ro + nr and ro < b[1] and b[2] < co + nc and co < b[3]
        scans.append(len(self.rects[m]) if inside else 0)
        return real(self, s)
    monkeypatch.setattr(convert_addition._Touched, "untouched", untouched)
    request = ComputationRequest([IoSpecification("input", [Index(0, t, 0) for t in range(6)])],
                                 [IoSpecification("output", [Index(0, 0, 0)])])
    comp = optimize(compile_computation(nnet, request), nnet)
    assert len(scans) >= n and sum(scans) <= 4 * n      # not ~n^2 / 2
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    out = run_computation(comp, nnet, {"input": x})[0]["output"]
    want = np.concatenate([x[0] if i % 3 else x[i % 5] for i in range(n)])
    np.testing.assert_array_equal(out[0], want)


def test_touched_rectangles_equal_a_scan_of_all():
    """convert_addition._Touched (distinct rectangles and a bounding box) answers as a
    scan of every submatrix touched so far does, on random rectangles."""
    from engine.optimizer.passes.convert_addition import _Touched
    rng = np.random.default_rng(0)
    for _ in range(50):
        subs = [None] + [(int(m), int(r), int(nr), int(c), int(nc)) for m, r, nr, c, nc in
                         zip(rng.integers(1, 3, 60), rng.integers(0, 8, 60),
                             rng.integers(1, 4, 60), rng.integers(0, 8, 60),
                             rng.integers(1, 4, 60))]
        touched, seen = _Touched(subs, 3), []
        for s in rng.integers(1, 61, 80).tolist():
            m, ro, nr, co, nc = subs[s]
            want = not any(subs[t][0] == m and subs[t][1] < ro + nr and ro < subs[t][1] +
                           subs[t][2] and subs[t][3] < co + nc and co < subs[t][3] + subs[t][4]
                           for t in seen)
            assert touched.untouched(s) == want
            if rng.random() < 0.6:
                touched.add(s)
                seen.append(s)


def test_an_error_in_a_long_line_quotes_only_its_start():
    from engine.core.errors import ConfigError
    line = "output-node name=output input=Sum(" + ",".join(["input"] * 5000) + ")"
    with pytest.raises(ConfigError) as e:
        Nnet.from_config("input-node name=input dim=2\n" + line + "\n")
    msg = str(e.value)
    assert len(msg) < 600 and f"of {len(line)} characters" in msg and ":2:" in msg
