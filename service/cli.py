"""The ``nnetc`` command line.  Engine commands import only the engine; ``serve``
imports the web stack lazily.

Model commands (Kaldi's nnet3-info, nnet3-init, nnet3-copy):

- ``nnetc info MODEL [--json]``: contexts, modulus, parameter count, inputs,
  outputs and component type counts.
- ``nnetc init CONFIG... OUT [--binary]``: build a network from configs
  applied in order (a first argument that is a model is the starting network).
- ``nnetc copy IN OUT [--binary]``: convert between config, text and binary.

Errors the engine raises on purpose (NnetcError) exit with status 2 and their
message on stderr, without a traceback; so do the CLI's own: an output path that cannot
be written (checked before any work, and again when writing), an input file numpy cannot
read.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import zipfile
import zlib

import click

from engine.core.errors import NnetcError


def _typed_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NnetcError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
    return wrapper


def _with_thread_policy(fn):
    """The command with a --thread-policy option (also NNETC_BLAS_THREAD_POLICY, as for
    the service): engine.runtime.parallel's BLAS thread policy for the command's run, put
    back afterwards."""
    @click.option("--thread-policy", type=click.Choice(["stable", "adaptive"]),
                  default="stable", show_default=True, envvar="NNETC_BLAS_THREAD_POLICY",
                  help="BLAS thread policy (engine/runtime/parallel.py; env "
                       "NNETC_BLAS_THREAD_POLICY): 'adaptive' lets the BLAS thread count "
                       "change for speed also where one thread rounds otherwise (OpenBLAS's "
                       "Haswell kernels), results then agreeing to float32 rounding.")
    @functools.wraps(fn)
    def wrapped(*args, thread_policy, **kwargs):
        from engine.runtime.parallel import thread_policy_set  # noqa: PLC0415
        with thread_policy_set(thread_policy):
            return fn(*args, **kwargs)
    return wrapped


def _check_out(path: str, what: str) -> None:
    """Refuse an output path that cannot be written, before any work is done: its
    directory must exist and be writable (``what``: the option or argument, for the
    message)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        why = "is not a directory" if os.path.exists(folder) else "does not exist"
        raise NnetcError(f"{what} {path}: cannot write: the directory {folder} {why}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise NnetcError(f"{what} {path}: cannot write: the directory {folder} is not "
                         f"writable")


@contextlib.contextmanager
def _writing(path: str, what: str):
    """A write that fails all the same (disk full, the directory removed meanwhile) is
    the same error as one refused beforehand."""
    try:
        yield
    except OSError as e:
        raise NnetcError(f"{what} {path}: cannot write: {e.strerror or e}") from None


# what numpy raises on a file that is not the .npy/.npz it expects (an empty or cut file:
# EOFError; a damaged archive: BadZipFile, zlib.error, NotImplementedError for a
# compression method zipfile lacks)
_NUMPY_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error,
                      NotImplementedError)


@click.group()
def main() -> None:
    """nnetc: compile, run, stream and serve Kaldi nnet3 networks."""


def model_info(model) -> dict:
    """The figures ``nnetc info`` prints (also usable by the service)."""
    from engine.nnet.graph import compute_simple_context, is_simple_nnet  # noqa: PLC0415
    nnet = model.nnet
    info: dict = {}
    if is_simple_nnet(nnet):
        left, right = compute_simple_context(nnet)
        info["left-context"] = left
        info["right-context"] = right
    info["modulus"] = nnet.modulus()
    info["num-parameters"] = nnet.num_parameters()
    info["input-dim"] = {n: nnet.input_dim(n) for n in nnet.input_names()}
    info["output-dim"] = {n: nnet.output_dim(n) for n in nnet.output_names()}
    info["num-components"] = nnet.num_components()
    info["component-types"] = nnet.component_type_counts()
    if model.priors is not None:
        info["num-priors"] = int(model.priors.size)
    info["streaming"] = _streaming_note(nnet)
    return info


def _streaming_note(nnet) -> str:
    """Whether the network streams (Kaldi's looped decodable), and what it takes."""
    from engine.inference.looped import find_future_recurrence  # noqa: PLC0415
    from engine.nnet.graph import is_simple_nnet  # noqa: PLC0415
    if nnet.get_node_index("output") < 0 or not is_simple_nnet(nnet):
        return "no: streams need a simple network with an 'output' node"
    why = find_future_recurrence(nnet, "output")
    if why is None:
        return "yes"
    return ("only with truncate_future_recurrence (the output then depends on the chunk "
            f"size): {why}")


@main.command()
@click.argument("model_path", metavar="MODEL", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@_typed_errors
def info(model_path: str, as_json: bool) -> None:
    """Print a model's context, modulus, parameters, inputs and outputs.

    MODEL is a config file, a text or binary .raw, or a .mdl.
    """
    from engine.nnet.model_io import load_model  # noqa: PLC0415
    model = load_model(model_path)
    figures = model_info(model)
    if as_json:
        click.echo(json.dumps(figures, indent=1))
        return
    for key in ("left-context", "right-context", "modulus", "num-parameters", "streaming"):
        if key in figures:
            click.echo(f"{key}: {figures[key]}")
    for name, dim in figures["input-dim"].items():
        click.echo(f"input-node name={name} dim={dim}")
    for name, dim in figures["output-dim"].items():
        click.echo(f"output-node name={name} dim={dim}")
    for t, n in figures["component-types"].items():
        click.echo(f"component-type {t}: {n}")


@main.command()
@click.argument("paths", nargs=-1, required=True, metavar="CONFIG... OUT")
@click.option("--binary/--text", default=False, help="Write a binary (default: text) model.")
@click.option("--seed", type=int, default=None, help="Seed for random initial parameters.")
@_typed_errors
def init(paths: tuple[str, ...], binary: bool, seed: int | None) -> None:
    """Build a network from config files applied in order and write it to OUT.

    As with nnet3-init, a first argument that is a model (.raw/.mdl) is the
    network the configs are applied to.
    """
    import numpy as np  # noqa: PLC0415

    from engine.core.errors import ConfigError  # noqa: PLC0415
    from engine.nnet.config import apply_config  # noqa: PLC0415
    from engine.nnet.model_io import Model, load_model, save_model  # noqa: PLC0415
    from engine.nnet.nnet import Nnet  # noqa: PLC0415
    if len(paths) < 2:
        raise click.UsageError("need at least one CONFIG and the OUT path")
    configs, out = list(paths[:-1]), paths[-1]
    _check_out(out, "OUT")
    rng = np.random.default_rng(seed)
    nnet = Nnet()
    first = configs[0]
    try:
        with open(first, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror}", source=first) from None
    if head.startswith(b"\0B") or head.lstrip().startswith(b"<"):
        nnet = load_model(first).nnet
        configs = configs[1:]
    for path in configs:
        try:
            with open(path, "rb") as f:
                text = f.read().decode("utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read: {e.strerror}", source=path) from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"not UTF-8 text (byte {e.start})", source=path) from None
        apply_config(nnet, text, source=path, rng=rng)
    with _writing(out, "OUT"):
        save_model(Model(nnet), out, binary=binary)


@main.command()
@click.argument("src", metavar="IN", type=click.Path(dir_okay=False))
@click.argument("dst", metavar="OUT", type=click.Path(dir_okay=False))
@click.option("--binary/--text", default=True, help="Write binary (default) or text.")
@click.option("--raw", "raw_only", is_flag=True,
              help="Write only the network even when IN is a .mdl (as nnet3-copy does).")
@_typed_errors
def copy(src: str, dst: str, binary: bool, raw_only: bool) -> None:
    """Copy a model, converting between config, text and binary forms."""
    from engine.nnet.model_io import load_model, save_model  # noqa: PLC0415
    _check_out(dst, "OUT")
    model = load_model(src)
    with _writing(dst, "OUT"):
        save_model(model, dst, binary=binary, as_am=False if raw_only else None)



# -- compile / compute (Kaldi's Compiler + NnetComputer on a request file) ------------------


def _load_request(path: str):
    from engine.compiler.request import ComputationRequest  # noqa: PLC0415
    from engine.core.errors import RequestError  # noqa: PLC0415
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise RequestError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return ComputationRequest.from_json(data)
    except RequestError as e:
        raise RequestError(f"{path}: {e}") from None


def _compile_for_cli(model_path: str, request_path: str, no_optimize: bool,
                     no_shortcut: bool = False):
    """(nnet, request, computation, compile_ms, optimized) for compile/compute.

    Compiles through engine.compiler.shortcut.compile_request (shortcut
    compilation for regular multi-sequence requests, as Kaldi's
    CachingOptimizingCompiler); --no-optimize gives Kaldi's raw computation,
    compiled without the shortcut."""
    import time  # noqa: PLC0415

    from engine.compiler.shortcut import compile_request  # noqa: PLC0415
    from engine.nnet.model_io import load_model  # noqa: PLC0415
    nnet = load_model(model_path).nnet
    request = _load_request(request_path)
    t0 = time.perf_counter()
    # compile_request validates the request first
    computation = compile_request(nnet, request, None,
                                  use_shortcut=not (no_shortcut or no_optimize),
                                  optimize=not no_optimize)
    compile_ms = (time.perf_counter() - t0) * 1000.0
    return nnet, request, computation, compile_ms, not no_optimize


@main.command("compile")
@click.argument("model_path", metavar="MODEL", type=click.Path(dir_okay=False))
@click.option("--request", "request_path", required=True, type=click.Path(dir_okay=False),
              help="ComputationRequest as JSON (inputs/outputs with name, has_deriv, "
                   "indexes [[n, t, x], ...]; need_model_derivative).")
@click.option("--no-optimize", is_flag=True, help="Skip the optimizer.")
@click.option("--no-shortcut", is_flag=True,
              help="Compile all sequences directly instead of expanding a two-sequence "
                   "computation (Kaldi's --use-shortcut=false).")
@click.option("--print", "do_print", is_flag=True,
              help="Print the computation in Kaldi's NnetComputation::Print format.")
@click.option("--stats", "do_stats", is_flag=True,
              help="Print one JSON object: commands, matrices, peak_bytes, compile_ms.")
@_typed_errors
def compile_cmd(model_path: str, request_path: str, no_optimize: bool, no_shortcut: bool,
                do_print: bool, do_stats: bool) -> None:
    """Compile a request for MODEL into a computation (Kaldi's Compiler).

    Without --no-optimize the computation goes through engine.optimizer (the
    --stats field "optimized" says which); regular multi-sequence requests are
    compiled by shortcut unless --no-shortcut is given."""
    nnet, _, computation, compile_ms, optimized = _compile_for_cli(model_path, request_path,
                                                                   no_optimize, no_shortcut)
    if do_print:
        click.echo(computation.to_text(nnet), nl=False)
    if do_stats or not do_print:
        stats = computation.stats()
        stats["compile_ms"] = round(compile_ms, 3)
        stats["optimized"] = optimized
        click.echo(json.dumps(stats))


@main.command("compute")
@click.argument("model_path", metavar="MODEL", type=click.Path(dir_okay=False))
@click.option("--request", "request_path", required=True, type=click.Path(dir_okay=False),
              help="ComputationRequest as JSON.")
@click.option("--inputs", "inputs_path", required=True, type=click.Path(dir_okay=False),
              help="NPZ with input.<name> for every input and output_deriv.<name> for every "
                   "output with has_deriv (finite values; an input.<name> or "
                   "output_deriv.<name> the request does not take is an error).")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="NPZ to write: output.<name> and input_deriv.<name>.")
@click.option("--model-grad", "grad_path", type=click.Path(dir_okay=False), default=None,
              help="Write the model-parameter gradient as a Kaldi text model.")
@click.option("--stats-model", "stats_path", type=click.Path(dir_okay=False), default=None,
              help="Write the model with the statistics the computation stored added to its "
                   "own (a request with store_component_stats), as a Kaldi text model.")
@click.option("--no-optimize", is_flag=True, help="Skip the optimizer.")
@click.option("--no-shortcut", is_flag=True, help="Do not use shortcut compilation.")
@click.option("--backend", type=click.Choice(["numpy", "cupy"]), default="numpy",
              show_default=True)
@_typed_errors
def compute_cmd(model_path: str, request_path: str, inputs_path: str, out_path: str,
                grad_path: str | None, stats_path: str | None, no_optimize: bool,
                no_shortcut: bool, backend: str) -> None:
    """Compile a request and run it (Kaldi's NnetComputer): outputs, input
    derivatives and, with --model-grad, the parameter gradients; with --stats-model,
    the model as Kaldi's NnetComputer leaves the network it stores statistics in."""
    import numpy as np  # noqa: PLC0415

    from engine.core.errors import ExecutionError, RequestError  # noqa: PLC0415
    from engine.core.finite import non_finite, to_float32  # noqa: PLC0415
    from engine.runtime.backend import get_backend, to_host  # noqa: PLC0415
    from engine.runtime.executor import Executor  # noqa: PLC0415

    for path, what in ((out_path, "--out"), (grad_path, "--model-grad"),
                       (stats_path, "--stats-model")):
        if path is not None:
            _check_out(path, what)
    nnet, request, computation, _, _ = _compile_for_cli(model_path, request_path, no_optimize,
                                                        no_shortcut)
    if grad_path is not None and not request.need_model_derivative:
        raise RequestError("--model-grad needs a request with need_model_derivative: true")
    if stats_path is not None and not request.store_component_stats:
        raise RequestError("--stats-model needs a request with store_component_stats: true")
    try:
        loaded = np.load(inputs_path)
        if not isinstance(loaded, np.lib.npyio.NpzFile):    # a .npy: one array
            raise ValueError("a .npy array, not an .npz archive of input.<name> arrays")
        with loaded:
            arrays = dict(loaded)
    except _NUMPY_READ_ERRORS as e:
        raise ExecutionError(f"{inputs_path}: cannot read the inputs as .npz: "
                             f"{e or type(e).__name__}") from None
    # as the service's /compute (fields inputs and output_derivs): an array for a name the
    # request does not take is an error, not ignored
    wanted = {"input": {s.name for s in request.inputs},
              "output_deriv": {s.name for s in request.outputs if s.has_deriv}}
    for key in sorted(arrays):
        kind, _, name = key.partition(".")
        if kind in wanted and name not in wanted[kind]:
            expected = ", ".join(f"{kind}.{n}" for n in sorted(wanted[kind])) or "none"
            because = (f" (output {name!r} does not have has_deriv: true)"
                       if kind == "output_deriv" and request.index_of_output(name) >= 0
                       else "")
            raise ExecutionError(f"{inputs_path}: array {key!r} is not in the request"
                                 f"{because}; expected {expected}")

    def need(key: str):
        if key not in arrays:
            raise ExecutionError(f"{inputs_path}: missing array {key!r}")
        a = arrays[key]
        if a.dtype.kind not in "fiu":
            raise ExecutionError(f"{inputs_path}: array {key!r}: expected numbers, got dtype "
                                 f"{a.dtype}")
        a = to_float32(a)
        # the service's rule for input matrices (engine.core.finite)
        bad = non_finite(a)
        if bad:
            raise ExecutionError(f"{inputs_path}: array {key!r} {bad}")
        return a

    # every array checked before anything is computed
    inputs = {spec.name: need(f"input.{spec.name}") for spec in request.inputs}
    derivs = {spec.name: need(f"output_deriv.{spec.name}") for spec in request.outputs
              if spec.has_deriv}
    # with --stats-model, the network computed with is the one the statistics go to (as
    # nnet3-train's NnetComputer): it is this process's own copy of the model
    ex = Executor(computation, nnet, backend=get_backend(backend),
                  nnet_to_store_stats=nnet if stats_path is not None else None)
    for name, value in inputs.items():
        ex.accept_input(name, value)
    ex.run()
    out = {f"output.{s.name}": to_host(ex.get_output(s.name)) for s in request.outputs}
    if derivs:
        for name, value in derivs.items():
            ex.accept_output_deriv(name, value)
        ex.run()
        for spec in request.inputs:
            if spec.has_deriv:
                out[f"input_deriv.{spec.name}"] = to_host(ex.get_input_deriv(spec.name))
    with _writing(out_path, "--out"):
        np.savez(out_path, **out)
    from engine.nnet.model_io import save_model  # noqa: PLC0415
    if grad_path is not None:
        with _writing(grad_path, "--model-grad"):
            save_model(ex.get_model_gradient(), grad_path, binary=False, as_am=False)
    if stats_path is not None:
        with _writing(stats_path, "--stats-model"):
            save_model(nnet, stats_path, binary=False, as_am=False)


# -- infer / stream (Kaldi's nnet3-compute and the looped decodable) ------------------------


def _load_npy(path: str, what: str):
    import numpy as np  # noqa: PLC0415

    from engine.core.errors import InferenceError  # noqa: PLC0415
    try:
        loaded = np.load(path, allow_pickle=False)
    except _NUMPY_READ_ERRORS as e:      # an empty file: EOFError
        raise InferenceError(f"{what} {path}: cannot read a .npy array: "
                             f"{e or type(e).__name__}") from None
    if not isinstance(loaded, np.ndarray):      # an .npz archive
        loaded.close()
        raise InferenceError(f"{what} {path}: cannot read a .npy array: the file is an .npz "
                             f"archive")
    return loaded


@main.command("infer")
@click.argument("model_path", metavar="MODEL", type=click.Path(dir_okay=False))
@click.option("--features", "features_path", required=True, type=click.Path(dir_okay=False),
              help="Features (frames x input-dim) as .npy.")
@click.option("--ivector", "ivector_path", type=click.Path(dir_okay=False), default=None,
              help="Per-utterance i-vector as .npy.")
@click.option("--online-ivectors", "online_path", type=click.Path(dir_okay=False), default=None,
              help="Online i-vectors (rows every --online-ivector-period frames) as .npy.")
@click.option("--online-ivector-period", type=int, default=0, show_default=True)
@click.option("--frames-per-chunk", type=int, default=50, show_default=True)
@click.option("--extra-left-context", type=int, default=0, show_default=True)
@click.option("--extra-right-context", type=int, default=0, show_default=True)
@click.option("--extra-left-context-initial", type=int, default=-1, show_default=True)
@click.option("--extra-right-context-final", type=int, default=-1, show_default=True)
@click.option("--frame-subsampling-factor", type=int, default=1, show_default=True)
@click.option("--acoustic-scale", type=float, default=1.0, show_default=True,
              help="Scale the output by this (after the priors, before --apply-exp).")
@click.option("--apply-exp", is_flag=True, help="Exponentiate the output.")
@click.option("--use-priors", is_flag=True, help="Subtract the log priors of a .mdl.")
@click.option("--output", "output_name", default="output", show_default=True,
              help="Output node to compute.")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="Where to write the output matrix (.npy).")
@click.option("--threads", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Chunk batches computed at the same time, each matrix product on one BLAS "
                   "thread (faster than a multi-threaded BLAS for TDNN/TDNN-F/CNN models on "
                   "long inputs; not used for recurrent networks or short inputs).")
@_with_thread_policy
@_typed_errors
def infer_cmd(model_path, features_path, ivector_path, online_path, online_ivector_period,
              frames_per_chunk, extra_left_context, extra_right_context,
              extra_left_context_initial, extra_right_context_final, frame_subsampling_factor,
              acoustic_scale, apply_exp, use_priors, output_name, out_path, threads) -> None:
    """Whole-utterance inference with the semantics of Kaldi's nnet3-compute."""
    import numpy as np  # noqa: PLC0415

    from engine.core.errors import InferenceError  # noqa: PLC0415
    from engine.inference import InferenceOptions, Inferencer  # noqa: PLC0415
    from engine.nnet.model_io import load_model  # noqa: PLC0415
    if online_path is None and online_ivector_period:
        raise InferenceError("--online-ivector-period needs --online-ivectors")
    _check_out(out_path, "--out")
    model = load_model(model_path)
    opts = InferenceOptions(frames_per_chunk=frames_per_chunk,
                            extra_left_context=extra_left_context,
                            extra_right_context=extra_right_context,
                            extra_left_context_initial=extra_left_context_initial,
                            extra_right_context_final=extra_right_context_final,
                            frame_subsampling_factor=frame_subsampling_factor,
                            acoustic_scale=acoustic_scale, apply_exp=apply_exp,
                            use_priors=use_priors, output=output_name, threads=threads)
    feats = _load_npy(features_path, "--features")
    ivector = _load_npy(ivector_path, "--ivector") if ivector_path else None
    online = _load_npy(online_path, "--online-ivectors") if online_path else None
    from engine.inference.common import model_priors  # noqa: PLC0415
    out = Inferencer(model.nnet, opts, priors=model_priors(model)).infer(
        feats, ivector, online, online_ivector_period)
    with _writing(out_path, "--out"):
        np.save(out_path, out.astype(np.float32, copy=False))


@main.command("stream")
@click.argument("model_path", metavar="MODEL", type=click.Path(dir_okay=False))
@click.option("--features", "features_path", required=True, type=click.Path(dir_okay=False),
              help="Features (frames x input-dim) as .npy, pushed in random-sized pieces.")
@click.option("--ivector", "ivector_path", type=click.Path(dir_okay=False), default=None,
              help="Per-utterance i-vector as .npy.")
@click.option("--online-ivectors", "online_path", type=click.Path(dir_okay=False), default=None,
              help="Online i-vectors (a row every --online-ivector-period frames) as .npy, "
                   "pushed with the frames they describe; each chunk reads the row of its "
                   "last input frame, as Kaldi's looped decodable.")
@click.option("--online-ivector-period", type=int, default=0, show_default=True)
@click.option("--frames-per-chunk", "--chunk-size", "chunk_size", type=int, default=20,
              show_default=True,
              help="Frames per chunk (rounded up to the modulus and subsampling factor).")
@click.option("--frame-subsampling-factor", type=int, default=1, show_default=True)
@click.option("--extra-left-context-initial", type=int, default=0, show_default=True)
@click.option("--acoustic-scale", type=float, default=1.0, show_default=True,
              help="Scale the output by this (after the priors).")
@click.option("--use-priors", is_flag=True, help="Subtract the log priors of a .mdl.")
@click.option("--truncate-future-recurrence", is_flag=True,
              help="Stream a network with a recurrence reading later frames (a BLSTM) as "
                   "Kaldi's looped decodable does: that recurrence cut at each chunk's end.")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="Where to write the output matrix (.npy).")
@_with_thread_policy
@_typed_errors
def stream_cmd(model_path, features_path, ivector_path, online_path, online_ivector_period,
               chunk_size, frame_subsampling_factor, extra_left_context_initial,
               acoustic_scale, use_priors, truncate_future_recurrence, out_path) -> None:
    """Streaming inference with Kaldi's looped decodable (state carried across chunks)."""
    import numpy as np  # noqa: PLC0415

    from engine.core.errors import InferenceError  # noqa: PLC0415

    from engine.inference.looped import LoopedConfig  # noqa: PLC0415
    from engine.inference.stream import LoopedModel  # noqa: PLC0415
    from engine.nnet.model_io import load_model  # noqa: PLC0415
    _check_out(out_path, "--out")
    model = load_model(model_path)
    feats = _load_npy(features_path, "--features")
    ivector = _load_npy(ivector_path, "--ivector") if ivector_path else None
    if (online_path is None) != (not online_ivector_period):
        raise InferenceError("--online-ivectors and --online-ivector-period go together")
    online = _load_npy(online_path, "--online-ivectors") if online_path else None
    from engine.inference.common import model_priors  # noqa: PLC0415
    looped = LoopedModel(model.nnet, LoopedConfig(chunk_size, extra_left_context_initial,
                                                  frame_subsampling_factor,
                                                  truncate_future_recurrence),
                         priors=model_priors(model), use_priors=use_priors)
    stream = looped.stream(ivector, online_ivector_period or None, acoustic_scale)
    if np.ndim(feats) != 2:
        stream.push(feats)  # raises the typed error for a malformed matrix
    rng = np.random.default_rng()
    pieces, pos, sent = [], 0, 0
    while pos < feats.shape[0]:
        n = int(rng.integers(1, 2 * looped.chunk_size + 1))
        rows = None
        if online is not None:
            # the rows for the frames pushed so far (as an online extractor gives them)
            want = min(len(online), -(-(pos + n) // online_ivector_period))
            rows, sent = online[sent:want], max(sent, want)
        pieces.append(stream.push(feats[pos:pos + n], online_ivectors=rows))
        pos += n
    if online is not None and sent < len(online):
        pieces.append(stream.push(feats[:0], online_ivectors=online[sent:]))
    pieces.append(stream.finish())
    with _writing(out_path, "--out"):
        np.save(out_path, np.concatenate(pieces, axis=0).astype(np.float32, copy=False))


def _settings(settings_class, overrides: dict):
    """The service settings from NNETC_* environment variables and the command's options;
    a value that does not validate is a usage error naming its variable (exit status 2),
    not a traceback."""
    from pydantic import ValidationError  # noqa: PLC0415
    try:
        return settings_class(**overrides)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            field = ".".join(str(x) for x in err["loc"]) or "settings"
            where = (f"--{field.replace('_', '-')}" if field in overrides
                     else f"NNETC_{field.upper()}")
            value = err.get("input")
            shown = f" (got {value!r})" if isinstance(value, (str, int, float)) else ""
            problems.append(f"{where}: {err['msg']}{shown}")
        raise click.UsageError("invalid settings: " + "; ".join(problems)) from None


@main.command("serve")
@click.option("--host", default=None, help="Interface to listen on (default: settings, "
                                           "127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port (default: settings, 8000).")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
              default=None, help="Log level (default: settings, INFO).")
def serve_cmd(host, port, log_level) -> None:
    """Run the HTTP service in process (LRU cache, one worker thread; with
    NNETC_REDIS_URL the compiled computations are also kept in Redis).

    Other settings come from NNETC_* environment variables (service/settings.py)."""
    import uvicorn  # noqa: PLC0415

    from service.app import create_app  # noqa: PLC0415
    from service.settings import Settings  # noqa: PLC0415
    overrides = {k: v for k, v in (("host", host), ("port", port), ("log_level", log_level))
                 if v is not None}
    settings = _settings(Settings, overrides)
    uvicorn.run(create_app(settings), **uvicorn_options(settings))


def uvicorn_options(settings) -> dict:
    """What `nnetc serve` gives uvicorn besides the app.  The HTTP parser is h11, named:
    uvicorn's default ("auto") takes httptools whenever that package is installed (any
    other package may bring it), and uvicorn's httptools protocol puts no bound on a
    request's header block -- a client sending one endless header made the server hold
    every byte of it (200 MB sent, 375 MB resident), where h11 closes the connection
    after its 16 KiB limit.  (httptools answered a small /compute about 0.3 ms sooner.)"""
    return {"host": settings.host, "port": settings.port,
            "log_level": settings.log_level.lower(), "access_log": False, "http": "h11",
            # uvicorn answers 503 once the open connections, the requesting one
            # included, reach limit_concurrency: max_connections are served
            "limit_concurrency": (None if settings.max_connections is None
                                  else settings.max_connections + 1)}


@main.command("worker")
@click.option("--name", default=None, help="Consumer name (default: host-pid).")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
              default=None, help="Log level (default: settings, INFO).")
def worker_cmd(name, log_level) -> None:
    """Run jobs from the Redis Stream of the service (NNETC_QUEUE=redis): compile, compute
    (batched along n), infer and streams, until SIGTERM or Ctrl-C.

    Needs NNETC_REDIS_URL; other settings come from NNETC_* environment variables
    (service/settings.py): BACKEND, MAX_BATCH, WORKER_CLAIM_IDLE_S, MAX_COMPUTATION_BYTES..."""
    import signal  # noqa: PLC0415

    from service import logs  # noqa: PLC0415
    from service.app import build_services  # noqa: PLC0415
    from service.redis_queue import RedisWorker  # noqa: PLC0415
    from service.settings import Settings  # noqa: PLC0415
    overrides = {"log_level": log_level} if log_level else {}
    settings = _settings(Settings, overrides)
    if not settings.redis_url:
        raise click.UsageError("nnetc worker needs NNETC_REDIS_URL")
    logs.configure(settings.log_level)
    services = build_services(settings.model_copy(update={"queue": "inprocess"}))
    worker = RedisWorker(services.cache.client, services.operations, services.streams,
                         services.registry, max_batch=settings.max_batch,
                         claim_idle_s=settings.worker_claim_idle_s, name=name,
                         max_deliveries=settings.worker_max_deliveries)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    worker.run()


@main.group("bench")
def bench_group() -> None:
    """Benchmarks (bench/ in the source tree; issue 7)."""


@bench_group.command("forward")
@click.argument("model_path", metavar="MODEL", type=click.Path(exists=True))
@click.option("--chunk", type=int, required=True, help="Output frames per sequence.")
@click.option("--batch", type=int, default=1, show_default=True, help="Sequences (n).")
@click.option("--repeat", type=int, default=7, show_default=True,
              help="Timed runs (median) of compile and of forward, after a warm-up.")
@click.option("--backend", type=click.Choice(["numpy", "cupy"]), default="numpy",
              show_default=True)
@click.option("--split", type=int, default=1, show_default=True,
              help="Compute the batch as K computations of batch/K sequences at the same "
                   "time, one BLAS thread each (engine/runtime/parallel.py; numpy backend).")
@click.option("--network", type=click.Choice(["decoding", "as-stored"]), default="decoding",
              show_default=True,
              help="The network timed: as the inference front-end runs it (Kaldi's "
                   "CollapseModel with every fold, then batch-norms folded into the "
                   "affines around them, LSTM cells as LstmNonlinearity, forward "
                   "identities as aliases, sibling-affine fusion and recurrent-affine "
                   "splitting) or as stored (test mode only: the structure of Kaldi's "
                   "kaldi_stats.json figures).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_with_thread_policy
@_typed_errors
def bench_forward_cmd(model_path, chunk, batch, repeat, backend, split, network,
                      as_json) -> None:
    """Cold compile and forward time of MODEL on the chunk request of kaldi_stats.json.

    MODEL is a model or config file, or a directory holding model.raw or final.mdl
    (e.g. ../shared/kaldi-ref/models/tdnnf).  When a kaldi_stats.json lies beside the
    model and lists this chunk and batch, the output adds Kaldi's figures and ours
    against them ("kaldi": compile normalised by python_s, forward by gemm_s, peak
    bytes and commands as plain ratios; below 1 is better than Kaldi).
    """
    from bench.forward import kaldi_comparison, measure_forward, resolve_model  # noqa: PLC0415
    if chunk < 1 or batch < 1 or repeat < 1:
        raise click.UsageError("--chunk, --batch and --repeat must be positive")
    if split < 1 or batch % split:
        raise click.UsageError(f"--split {split} must be positive and divide --batch {batch}")
    if split > 1 and backend != "numpy":
        raise click.UsageError("--split is for the numpy backend")
    try:
        model_path = resolve_model(model_path)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="MODEL") from None
    from engine.runtime.parallel import thread_policy  # noqa: PLC0415
    figures = measure_forward(model_path, chunk, batch, repeat=repeat, backend=backend,
                              split=split, network=network)
    figures["network"] = network
    figures["thread_policy"] = thread_policy()
    kaldi = kaldi_comparison(model_path, figures)
    if kaldi is not None:
        # Kaldi's figures were taken on the network as stored: only that form compares
        # the same computation (the decoding form has fewer commands)
        kaldi["same_structure"] = network == "as-stored"
        if network != "as-stored":
            kaldi["note"] = (f"Kaldi's figures are of the network as stored; this run timed "
                             f"the {network} form ({figures['commands']} commands against "
                             f"Kaldi's {kaldi['case'].get('commands')}): --network as-stored "
                             f"compares the same computation")
        figures["kaldi"] = kaldi
    if backend == "numpy":
        # what the products ran on (library, kernel set, threads, overrides): figures
        # from machines or settings that differ here are not comparable
        from engine.runtime.blas import describe  # noqa: PLC0415
        figures["blas"] = describe(os.environ).removeprefix("BLAS: ")
    if as_json:
        click.echo(json.dumps(figures))
        return
    for key, value in figures.items():
        if key == "kaldi":
            for k, v in value.items():
                if k.endswith("_ratio"):
                    click.echo(f"kaldi.{k}: " + ("-" if v is None else f"{v:.3g}"))
                elif k == "note":
                    click.echo(f"kaldi.note: {v}")
            continue
        click.echo(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")


if __name__ == "__main__":
    sys.exit(main())
