"""The ``nnetc`` command line.  Engine commands import only the engine; ``serve``
imports the web stack lazily."""

from __future__ import annotations

import sys

import click


@click.group()
def main() -> None:
    """nnetc: compile, run, stream and serve Kaldi nnet3 networks."""


if __name__ == "__main__":
    sys.exit(main())
