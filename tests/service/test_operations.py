"""Operations endpoints: metrics, readiness, offline docs, internal errors that leak
nothing; the BLAS thread policy setting."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from service.settings import Settings
from tests.service.conftest import TINY_CONFIG, encode, make_client, register, request_for


def test_metrics_cover_requests_compile_cache_queue_batches():
    with make_client() as c:
        mid = register(c, config=TINY_CONFIG)["model_id"]
        body = {"model_id": mid, "request": request_for(0, 3, n=2),
                "inputs": {"input": encode(np.zeros((10, 4)))}}
        assert c.post("/compute", json=body).status_code == 200
        assert c.post("/compute", json=body).status_code == 200
        text = c.get("/metrics").text
    for needle in ('nnetc_request_seconds_count{method="POST",route="/compute",status="200"} 2.0',
                   "nnetc_compile_seconds_count 1.0",
                   'nnetc_cache_events_total{event="hit"} 1.0',
                   'nnetc_cache_events_total{event="miss"} 1.0',
                   "nnetc_queue_depth 0.0",
                   'nnetc_batch_size_bucket{le="2.0"} 2.0',
                   'nnetc_job_seconds_count{kind="compute"} 2.0'):
        assert needle in text, needle
    # the BLAS the products run on, with any override of its kernel choice
    from engine.runtime.blas import blas_environment, blas_libraries  # noqa: PLC0415
    lib = blas_libraries()[0]
    info = [line for line in text.splitlines() if line.startswith("nnetc_blas_info{")]
    assert len(info) == 1
    assert f'library="{lib["library"]}"' in info[0]
    assert f'kernels="{lib["architecture"] or ""}"' in info[0]
    import os  # noqa: PLC0415
    override = blas_environment(os.environ).get("OPENBLAS_CORETYPE", "")
    assert f'coretype_override="{override}"' in info[0]


def test_readyz_follows_the_worker():
    c = make_client()
    assert c.get("/readyz").status_code == 503      # lifespan not started: no worker
    with c:
        assert c.get("/readyz").json()["status"] == "ready"


def test_startup_finds_out_whether_one_blas_thread_changes_the_numbers(monkeypatch):
    """The CPU service asks engine.runtime.parallel before its worker starts (the
    question holds the process at one BLAS thread for a moment: not while anything else
    computes)."""
    from engine.runtime import parallel  # noqa: PLC0415
    asked = []
    monkeypatch.setattr(parallel, "products_depend_on_thread_count",
                        lambda: asked.append(True) or False)
    with make_client(backend="numpy") as c:
        assert asked == [True]
        assert c.get("/readyz").status_code == 200


@pytest.mark.parametrize("env, module, attr", [
    # the optimizer's passes in C (engine.optimizer.native); false: their Python forms
    ("NNETC_NATIVE", "engine.optimizer.native", "NATIVE"),
    # the product kernel for frozen weights (engine.core.sgemm); false: the BLAS product
    ("NNETC_OWN_PRODUCTS", "engine.core.sgemm", "KERNEL"),
])
def test_native_code_settings(monkeypatch, env, module, attr):
    """A setting false turns the C extension's use off; the default uses it where it is
    built."""
    import importlib  # noqa: PLC0415
    mod = importlib.import_module(module)
    monkeypatch.setattr(mod, attr, mod.EXTENSION)
    monkeypatch.setenv(env, "false")
    with make_client() as c:
        assert not mod.enabled()
        assert c.get("/readyz").status_code == 200
    monkeypatch.delenv(env)
    with make_client():
        assert mod.enabled() == (mod.EXTENSION is not None)


def test_blas_thread_policy_setting(monkeypatch):
    """NNETC_BLAS_THREAD_POLICY reaches engine.runtime.parallel (process-wide, as the BLAS
    thread count is) and /metrics; the default is the stable policy; an unknown name is
    refused when the settings are read, naming the field."""
    from engine.runtime import parallel  # noqa: PLC0415
    from pydantic import ValidationError  # noqa: PLC0415
    monkeypatch.setenv("NNETC_BLAS_THREAD_POLICY", "adaptive")
    try:
        with make_client() as c:
            assert parallel.thread_policy() == "adaptive"
            text = c.get("/metrics").text
        info = [line for line in text.splitlines() if line.startswith("nnetc_blas_info{")]
        assert 'thread_policy="adaptive"' in info[0]
    finally:
        monkeypatch.delenv("NNETC_BLAS_THREAD_POLICY")
        parallel.set_thread_policy("stable")
    with make_client() as c:
        assert parallel.thread_policy() == "stable"
        assert 'thread_policy="stable"' in c.get("/metrics").text
    monkeypatch.setenv("NNETC_BLAS_THREAD_POLICY", "fastest")
    with pytest.raises(ValidationError, match="blas_thread_policy"):
        Settings()


def test_docs_offline_or_absent():
    with make_client() as c:
        assert "/infer" in c.get("/openapi.json").json()["paths"]
        r = c.get("/docs")
        if importlib.util.find_spec("swagger_ui_bundle") is None:
            assert r.status_code == 404
            return
        assert r.status_code == 200
        assert "http://" not in r.text and "https://" not in r.text   # no CDN
        assert c.get("/docs/static/swagger-ui-bundle.js").status_code == 200


def test_internal_error_is_500_without_details():
    with make_client() as c:
        mid = register(c, config=TINY_CONFIG)["model_id"]

        def broken(payload):
            raise RuntimeError("secret internal detail")
        c.app.state.services.queue.handlers["compile"] = broken
        r = c.post("/compile", json={"model_id": mid, "request": request_for(0, 3)})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "InternalError" and "secret" not in r.text
        assert "Traceback" not in r.text
        assert c.get("/readyz").status_code == 200   # the worker survived


def test_route_dependencies_run_in_the_event_loop():
    """Every dependency of every route is a coroutine function: FastAPI runs a plain
    function dependency in its thread pool, a hop to a worker thread and back (110 us
    median, measured on a 2-core machine) per dependency per request, for
    dependencies that never wait (service.deps)."""
    import importlib  # noqa: PLC0415
    import inspect  # noqa: PLC0415
    import pkgutil  # noqa: PLC0415

    from fastapi.routing import APIRoute, APIWebSocketRoute  # noqa: PLC0415

    import service.routes  # noqa: PLC0415
    from service.routes.health import healthz  # noqa: PLC0415

    def calls(dependant):
        for d in dependant.dependencies:
            yield d.call
            yield from calls(d)

    seen = 0
    for info in pkgutil.iter_modules(service.routes.__path__):
        module = importlib.import_module(f"service.routes.{info.name}")
        router = getattr(module, "router", None)
        for route in getattr(router, "routes", ()):
            if isinstance(route, (APIRoute, APIWebSocketRoute)):
                for call in calls(route.dependant):
                    seen += 1
                    assert inspect.iscoroutinefunction(call), (route.path, call)
    assert seen >= 10     # (the routes do have dependencies: services, settings, auth)
    # and the liveness probe needs no thread of the pool either
    assert inspect.iscoroutinefunction(healthz)


def test_auth_outside_a_dependency_still_refuses():
    """The 401 given before the body is read (service.errors._unauthorized) checks the
    token with the same function as the route dependency."""
    with make_client(auth_token="s3cret") as c:
        assert c.get("/models").status_code == 401
        assert c.get("/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        r = c.post("/models", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 401
