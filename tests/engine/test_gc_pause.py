"""The cycle collector is paused while a request compiles (engine/compiler/gc_pause.py):
the pause nests, restores the collector's state, and hands what it let through to the
oldest generation so that the first young collection after it does not walk the new
computation; objects an application froze stay frozen."""

from __future__ import annotations

import gc

from engine.compiler.gc_pause import gc_paused


def test_pause_nests_and_restores_the_collector_state():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()          # the inner exit leaves it paused
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()          # an application's "off" is kept
    finally:
        gc.enable()


_OLDEST_GENERATION_CHECK = """
import gc, importlib.util, sys
spec = importlib.util.spec_from_file_location("gc_pause", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
gc.unfreeze()          # a throwaway interpreter: start from no frozen objects
gc.collect()
with mod.gc_paused():
    kept = [[i] for i in range(5000)]   # 5001 tracked containers made while paused
young = gc.get_count()[0]
assert young < 100, young              # not waiting for a young collection
assert not any(x is kept for x in gc.get_objects(generation=0))
if sys.version_info[:2] == (3, 11):    # where the splice's target was read off CPython
    assert any(x is kept for x in gc.get_objects(generation=2))
"""


def test_what_the_pause_let_through_goes_to_the_oldest_generation():
    # in a fresh interpreter that starts with nothing frozen: some installations
    # freeze objects at start-up (gc.get_freeze_count() > 0), and then the pause
    # rightly leaves the generations alone (the next test)
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    import engine.compiler.gc_pause as mod  # noqa: PLC0415
    r = subprocess.run([sys.executable, "-I", "-S", "-c", _OLDEST_GENERATION_CHECK,
                        str(Path(mod.__file__))], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_objects_frozen_by_the_application_stay_frozen():
    gc.collect()
    mine = [[i] for i in range(100)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            made = [[i] for i in range(1000)]
        assert gc.get_freeze_count() == frozen
        del made
    finally:
        gc.unfreeze()
        del mine
