"""The optimizer's passes in C: the extension ``engine.optimizer._native``
(engine/optimizer/_native.c), built by ``pip install`` where a C compiler is at hand
(pyproject.toml, ``[[tool.setuptools.ext-modules]]``, optional).

Each pass that has a C form (variable merging's rounds, convert_addition_to_assignment,
extend_matrices, move_sizing_commands, remove_unnecessary_allocation, and the submatrix
and matrix part of renumbering)
keeps its Python form as the reference: the C code reads the computation, decides the
same things on flat arrays and hands back what to change, or None when the computation
holds something it leaves to Python (an error to report, a case it does not handle),
and the pass then runs in Python.  Each pass module hands the C code its tables (which
argument slots of each command type it reads) when it is imported.

``NATIVE`` is the module (``EXTENSION``), or None when it was not built or
``set_enabled(False)`` was called (every pass then runs in Python; the service's
``NNETC_NATIVE=false`` does that); the passes read it at each call, so a test can switch
it.  tests/engine/test_native_passes.py compares the optimized computations of the two
forms.
"""

from __future__ import annotations


def _extension():
    try:
        from engine.optimizer import _native  # noqa: PLC0415
    except ImportError:
        return None
    from engine.compiler.computation import Command  # noqa: PLC0415
    _native.configure_command(Command)   # its slots are read directly
    return _native


# the built extension (each pass module configures it at import, whether or not it is used)
EXTENSION = _extension()
NATIVE = EXTENSION


def set_enabled(enabled: bool) -> None:
    """Run the passes in C (when the extension is built) or, with False, in Python (the
    service's NNETC_NATIVE setting)."""
    global NATIVE
    NATIVE = EXTENSION if enabled else None


def enabled() -> bool:
    """Whether the passes run in C."""
    return NATIVE is not None
