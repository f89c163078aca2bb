"""The ``nnetc`` command line.  Engine commands import only the engine; ``serve``
imports the web stack lazily.

Model commands (Kaldi's nnet3-info, nnet3-init, nnet3-copy):

- ``nnetc info MODEL [--json]``: contexts, modulus, parameter count, inputs,
  outputs and component type counts.
- ``nnetc init CONFIG... OUT [--binary]``: build a network from configs
  applied in order (a first argument that is a model is the starting network).
- ``nnetc copy IN OUT [--binary]``: convert between config, text and binary.

Errors the engine raises on purpose (NnetcError) exit with status 2 and their
message on stderr, without a traceback.
"""

from __future__ import annotations

import functools
import json
import sys

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
    return info


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
    for key in ("left-context", "right-context", "modulus", "num-parameters"):
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
    model = load_model(src)
    save_model(model, dst, binary=binary, as_am=False if raw_only else None)


if __name__ == "__main__":
    sys.exit(main())
