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

from engine.compiler import graph_arrays, graph_intervals
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


def _same_data(a, b) -> bool:
    """Two computations' plain-data forms are the same (arrays compared by value)."""
    import orjson  # noqa: PLC0415
    opt = orjson.OPT_SERIALIZE_NUMPY
    return orjson.dumps(a, option=opt) == orjson.dumps(b, option=opt)


def test_a_long_append_takes_linear_work(monkeypatch):
    """Append() of thousands of terms (a 30 kB config line): reading it picks every term
    apart once (Kaldi's GetAppendTerm per term walked the terms before it: quadratic),
    and addition-to-assignment tests each written column block against the matrix's
    bounding box, not against every block before it; the result is the Append."""
    from engine.compiler.serialize import computation_to_data
    from engine.optimizer import native
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
    # the walk's Python form is the one instrumented (its C form, engine/optimizer/_native.c,
    # makes the same bounding-box test first and must give the same computation)
    c_form = computation_to_data(optimize(compile_computation(nnet, request), nnet)) \
        if native.NATIVE is not None else None
    monkeypatch.setattr(native, "NATIVE", None)
    comp = optimize(compile_computation(nnet, request), nnet)
    assert len(scans) >= n and sum(scans) <= 4 * n      # not ~n^2 / 2
    assert c_form is None or _same_data(c_form, computation_to_data(comp))
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


# An x-vector-like network: statistics pooling looks 10000 frames ahead of each output
# (Kaldi's `stats-layer config=mean+stddev(0:1:1:10000)`), so the graph builder's
# table spans that far in t whatever the data.
_XVECTOR_LIKE = """
input-node name=input dim=6
component name=a1 type=AffineComponent input-dim=18 output-dim=8
component name=r1 type=RectifiedLinearComponent dim=8
component name=a2 type=AffineComponent input-dim=8 output-dim=8
component name=r2 type=RectifiedLinearComponent dim=8
component name=extract type=StatisticsExtractionComponent input-dim=8 input-period=1 output-period=1 include-variance=true
component name=pool type=StatisticsPoolingComponent input-dim=17 input-period=1 left-context=0 right-context=10000 num-log-count-features=0 output-stddevs=true variance-floor=1e-10
component name=out type=AffineComponent input-dim=16 output-dim=3
component-node name=a1 component=a1 input=Append(Offset(input, -1), input, Offset(input, 1))
component-node name=r1 component=r1 input=a1
component-node name=a2 component=a2 input=r1
component-node name=r2 component=r2 input=a2
component-node name=extract component=extract input=r2
component-node name=pool component=pool input=extract
component-node name=out component=out input=Round(pool, 1)
output-node name=output input=out
"""


def test_a_long_pooling_window_fits_the_dense_table_unpadded(monkeypatch):
    """Variable-length sequences (not decomposable: no shortcut) through statistics
    pooling over 10000 frames ahead: the table spans ~10000 t values per node and
    sequence, over the cell limit once padded by half its span for growth.  The
    padding shrinks to what fits instead of the array build giving up (which left the
    per-cindex build to run into its cindex limit: 8 x-vector utterances of up to 150
    frames were refused that way, after 5-15 s); the outputs are those of each
    sequence computed alone.  (Since the interval build takes such requests, the array
    build is what it declines to, e.g. statistics with periods above 1: it is switched
    off here to test the array build's table.)"""
    monkeypatch.setattr(graph_intervals, "ENABLED", False)
    nnet = Nnet.from_config(_XVECTOR_LIKE, rng=np.random.default_rng(3))
    lens = [12, 9, 7]
    # 3 sequences x 16 graph nodes x ~10030 t values: ~480,000 cells unpadded, ~960,000
    # with the usual padding; a limit between the two
    monkeypatch.setattr(graph_arrays, "MAX_TABLE_CELLS", 700_000)
    rows = [Index(n, t, 0) for n, n_len in enumerate(lens) for t in range(n_len)]
    outs = [Index(n, t, 0) for n, n_len in enumerate(lens) for t in range(1, n_len - 1)]
    req = ComputationRequest([IoSpecification("input", rows)],
                             [IoSpecification("output", outs)])
    seen = []
    real = graph_arrays.ArrayGraphBuild._make_table

    def make_table(self, lo, hi, coords):
        real(self, lo, hi, coords)
        seen.append(len(self.table))
    monkeypatch.setattr(graph_arrays.ArrayGraphBuild, "_make_table", make_table)
    comp = optimize(compile_computation(nnet, [req]), nnet, request=req)
    # the wide table was made (had the array build given up, the per-cindex build would
    # have made the graph, and the last table would be the first, small one)
    assert len(seen) >= 2 and 450_000 < seen[-1] <= 700_000
    x = np.random.default_rng(4).standard_normal((len(rows), 6)).astype(np.float32)
    got = run_computation(comp, nnet, {"input": x})[0]["output"]
    start = 0
    for n, n_len in enumerate(lens):
        one = ComputationRequest([IoSpecification("input", [Index(0, t, 0) for t in range(n_len)])],
                                 [IoSpecification("output", [Index(0, t, 0)
                                                             for t in range(1, n_len - 1)])])
        alone = run_computation(compile_computation(nnet, [one]), nnet,
                                {"input": x[start:start + n_len]})[0]["output"]
        o0 = sum(k - 2 for k in lens[:n])
        np.testing.assert_allclose(got[o0:o0 + n_len - 2], alone, rtol=1e-5, atol=1e-5)
        start += n_len
