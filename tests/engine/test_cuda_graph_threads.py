"""cuda_graph's hold on the CuPy state of threads (runs without a GPU).

A thread's CuPy state (its cuBLAS handle among it) is destroyed when the thread ends;
doing that while another thread captures a CUDA graph crashed the process on an H200.
``hold_thread_state`` keeps each executor thread's state until ``_capture_lock`` is free.
These tests put a stand-in ``threading.local`` where CuPy's would be, with objects that
record whether a capture could have been under way when they were destroyed.  The real
thing, on a GPU: test_gpu_backend.py::test_threads_ending_while_others_capture_do_not_crash.
"""

from __future__ import annotations

import threading

import pytest

from engine.runtime import cuda_graph


class _Handle:
    """Stands for a cuBLAS handle: notes, when destroyed, whether the capture lock was held
    by someone other than the releasing code (i.e. a capture may have been under way)."""

    def __init__(self, log, capturing):
        self.log, self.capturing = log, capturing

    def __del__(self):
        self.log.append(self.capturing.is_set())


@pytest.fixture
def fake_cupy(monkeypatch):
    local = threading.local()
    monkeypatch.setattr(cuda_graph, "_cupy_local", local)
    monkeypatch.setattr(cuda_graph, "_cupy_local_searched", True)
    monkeypatch.setattr(cuda_graph, "_held", {})
    monkeypatch.setattr(cuda_graph, "HOLD_THREAD_STATE", True)
    return local


def _thread_using(local, log, capturing, hold=True):
    def work():
        if hold:
            cuda_graph.hold_thread_state()
        local.cublas_handles = {0: _Handle(log, capturing)}
    t = threading.Thread(target=work)
    t.start()
    t.join()


def test_a_thread_that_ends_during_a_capture_keeps_its_state_until_the_capture_is_over(
        fake_cupy):
    log, capturing = [], threading.Event()
    with cuda_graph._capture_lock:              # a capture under way in this thread
        capturing.set()
        for _ in range(3):
            _thread_using(fake_cupy, log, capturing)
        # a fourth thread arrives: it cannot let go of the others (the lock is taken)
        _thread_using(fake_cupy, log, capturing)
        assert log == []
        assert cuda_graph.held_thread_count() == 4
        capturing.clear()
        cuda_graph._release_ended()             # what run_segment does under the lock
    assert log == [False] * 4
    assert cuda_graph.held_thread_count() == 0


def test_a_new_thread_lets_go_of_ended_ones_when_no_capture_runs(fake_cupy):
    log, capturing = [], threading.Event()
    for _ in range(5):
        _thread_using(fake_cupy, log, capturing)
    # each new thread let go of the one before it (the lock was free)
    assert log == [False] * 4
    assert cuda_graph.held_thread_count() == 1
    with cuda_graph._capture_lock:
        cuda_graph._release_ended()
    assert log == [False] * 5


def test_living_threads_are_held_once(fake_cupy):
    log, capturing = [], threading.Event()
    go, ready = threading.Event(), threading.Barrier(4)

    def work():
        for _ in range(3):
            cuda_graph.hold_thread_state()
        fake_cupy.cublas_handles = {0: _Handle(log, capturing)}
        ready.wait()
        go.wait()
    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    ready.wait()
    assert cuda_graph.held_thread_count() == 3
    with cuda_graph._capture_lock:
        cuda_graph._release_ended()             # all alive: nothing let go
    assert cuda_graph.held_thread_count() == 3 and log == []
    go.set()
    for t in threads:
        t.join()
    with cuda_graph._capture_lock:
        cuda_graph._release_ended()
    assert log == [False] * 3


def test_without_the_hold_the_state_goes_with_the_thread(fake_cupy, monkeypatch):
    """The stand-in reproduces the hazard: unheld, the state is destroyed at the thread's
    end, whatever another thread is doing."""
    monkeypatch.setattr(cuda_graph, "HOLD_THREAD_STATE", False)
    log, capturing = [], threading.Event()
    with cuda_graph._capture_lock:
        capturing.set()
        _thread_using(fake_cupy, log, capturing)
        assert log == [True]


def test_cupys_thread_local_is_found_by_its_handles(monkeypatch):
    """The search: the one plain threading.local whose dict in this thread holds the
    handle CuPy gives this thread (subclasses are left alone: touching them would run
    __init__; another local with a ``cublas_handles`` of other handles is not taken -- on
    a GPU, the real CuPy's is one)."""
    import sys  # noqa: PLC0415
    import types  # noqa: PLC0415

    class Sub(threading.local):
        def __init__(self):
            raise AssertionError("a subclass's __init__ ran")
    made = []
    local, decoy = threading.local(), threading.local()
    decoy.cublas_handles = {0: types.SimpleNamespace(handle=7)}

    def get_cublas_handle():
        made.append(1)
        local.cublas_handles = {0: types.SimpleNamespace(handle=12345)}
        return 12345
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(device=types.SimpleNamespace(
        get_cublas_handle=get_cublas_handle))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cuda_graph, "_cupy_local", None)
    monkeypatch.setattr(cuda_graph, "_cupy_local_searched", False)
    other, sub = threading.local(), Sub.__new__(Sub)
    other.x = 1
    assert cuda_graph._find_cupy_local() is local
    assert made == [1]
    assert cuda_graph._find_cupy_local() is local and made == [1]    # searched once
    del sub
