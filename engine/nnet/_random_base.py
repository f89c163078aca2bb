"""Shared pieces of the random network generator (engine/nnet/random_config.py):
generation options, the RandomNetwork record and Kaldi's RandInt-style helpers
(nnet-test-utils.cc)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.nnet.nnet import Nnet


@dataclass(frozen=True)
class GenerationOptions:
    """Kaldi's NnetGenerationOptions plus ``dim_scale``: free dimensions
    (input, hidden, output sizes) are multiplied by it, so tests can run the
    same architectures at a fraction of Kaldi's sizes."""

    allow_context: bool = True
    allow_nonlinearity: bool = True
    allow_recursion: bool = True
    allow_clockwork: bool = True
    allow_multiple_inputs: bool = True
    allow_multiple_outputs: bool = True
    allow_final_nonlinearity: bool = True
    allow_use_of_x_dim: bool = True
    allow_ivector: bool = True
    allow_statistics_pooling: bool = True
    output_dim: int = -1
    dim_scale: float = 1.0


@dataclass
class RandomNetwork:
    kind: str
    configs: list[str]
    recurrent: bool = False
    exact_derivatives: bool = True
    notes: list[str] = field(default_factory=list)

    def build(self, rng: np.random.Generator | None = None) -> Nnet:
        """The initialised network, in test mode (dropout off, batch-norm using its
        stored statistics), parameters drawn from ``rng``."""
        nnet = Nnet.from_config(*self.configs, source=f"<random {self.kind}>", rng=rng)
        nnet.set_test_mode(True)
        return nnet

    def config_text(self) -> str:
        return "".join(f"# config {i}\n{c}" for i, c in enumerate(self.configs))


# -- small helpers -----------------------------------------------------------------------------


def _ri(rng: np.random.Generator, lo: int, hi: int) -> int:
    """Kaldi's RandInt: uniform on [lo, hi], both ends included."""
    return int(rng.integers(lo, hi + 1))


def _coin(rng: np.random.Generator) -> bool:
    return bool(rng.integers(0, 2) == 0)


def _dim(rng, opts: GenerationOptions, lo: int, hi: int, minimum: int = 2) -> int:
    """A free dimension from Kaldi's range [lo, hi], scaled by ``opts.dim_scale``."""
    s = opts.dim_scale
    lo2 = max(minimum, int(round(lo * s)))
    hi2 = max(lo2, int(round(hi * s)))
    return _ri(rng, lo2, hi2)


def _output_dim(rng, opts: GenerationOptions) -> int:
    return opts.output_dim if opts.output_dim > 0 else _dim(rng, opts, 100, 299)


def _splice_context(rng) -> list[int]:
    ctx = [i for i in range(-5, 4) if rng.integers(0, 3) == 0]
    return ctx or [0]


def _append_offsets(node: str, ctx: list[int]) -> str:
    return ", ".join(f"Offset({node}, {o})" for o in ctx)
