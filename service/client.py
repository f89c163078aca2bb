"""A Python client of the nnetc service: NumPy arrays in, NumPy arrays out.

    from service.client import NnetcClient
    c = NnetcClient("http://127.0.0.1:8000")
    mid = c.register("final.mdl")["model_id"]          # a file: sent as the raw body
    y = c.infer(mid, features, ivector=ivec, frames_per_chunk=50)
    with c.stream(mid, frames_per_chunk=20) as s:      # online, state kept by the service
        for piece in pieces:
            rows = s.push(piece)                         # the rows computable so far
        rows = s.finish()

Bodies and answers travel as msgpack with matrices as raw little-endian float32 bytes
(no JSON numbers, no base64).  Errors the service reports are raised as
``ServiceCallError`` with its status, type, message and field.  Any ``httpx.Client``
may be given instead of a URL (e.g. FastAPI's TestClient).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import msgpack
import numpy as np

from service.body_parse import pack_indexes

MSGPACK = "application/msgpack"


class ServiceCallError(Exception):
    def __init__(self, status: int, type_: str, message: str, field: str | None = None):
        super().__init__(f"{status} {type_}: {message}")
        self.status, self.type, self.message, self.field = status, type_, message, field


def _matrix(a) -> dict:
    a = np.ascontiguousarray(np.asarray(a, dtype=np.float32), dtype="<f4")
    if a.ndim == 1:
        a = a.reshape(1, -1)
    if a.ndim != 2:
        raise ValueError(f"expected a matrix, got an array of shape {a.shape}")
    return {"shape": [int(a.shape[0]), int(a.shape[1])], "dtype": "float32",
            "data": a.tobytes()}


def _array(m) -> np.ndarray:
    if isinstance(m, dict):
        data = m["data"]
        if isinstance(data, str):
            import base64  # noqa: PLC0415
            data = base64.b64decode(data)
        return np.frombuffer(data, "<f4").astype(np.float32).reshape(m["shape"])
    return np.asarray(m, dtype=np.float32)


def _request_json(request) -> dict:
    """The wire form of a request (an engine ComputationRequest, or its JSON form as it
    is): long Index lists go in the encoded form (int32 bytes, a twelfth of the JSON and
    nothing for the service to walk), unless a value is outside 32 bits (then the
    service's check names it)."""
    if not hasattr(request, "to_json"):
        return request
    wire = request.to_json()
    for spec in (*wire["inputs"], *wire["outputs"]):
        if len(spec["indexes"]) > 64:
            packed = pack_indexes(spec["indexes"])   # as the service packs large bodies
            if packed is not None:
                spec["indexes"] = packed
    return wire


class NnetcClient:
    def __init__(self, base_url: str | httpx.Client = "http://127.0.0.1:8000",
                 token: str | None = None, timeout: float = 600.0):
        if isinstance(base_url, (str, httpx.URL)):
            self.http = httpx.Client(base_url=base_url, timeout=timeout)
        else:
            # a client object of the httpx interface: httpx's, or one built on its
            # successor httpx2 (Starlette's TestClient is, once httpx2 is installed)
            self.http = base_url
        self.headers = {"Accept": MSGPACK}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def close(self) -> None:
        self.http.close()

    # -- transport -----------------------------------------------------------------------------
    def _answer(self, r: httpx.Response):
        if r.status_code == 204:
            return None
        body = (msgpack.unpackb(r.content, raw=False)
                if r.headers.get("content-type", "").startswith(MSGPACK) else r.json())
        if r.status_code >= 400:
            err = body.get("error", {}) if isinstance(body, dict) else {}
            raise ServiceCallError(r.status_code, err.get("type", "HTTPError"),
                                   err.get("message", r.text[:500]), err.get("field"))
        return body

    def _post(self, path: str, body: dict):
        return self._answer(self.http.post(path, content=msgpack.packb(body, use_bin_type=True),
                                           headers={**self.headers, "Content-Type": MSGPACK}))

    def _get(self, path: str):
        return self._answer(self.http.get(path, headers=self.headers))

    def _delete(self, path: str):
        return self._answer(self.http.delete(path, headers=self.headers))

    # -- models ----------------------------------------------------------------------------------
    def register(self, model: str | Path | bytes | None = None, *, config: str | None = None,
                 seed: int | None = None, name: str | None = None) -> dict:
        """A model file (path or bytes: Kaldi binary/text model or config, sent as the raw
        body), or ``config`` text; returns the registration (``model_id``, ``info``...)."""
        if config is not None:
            body: dict = {"config": config}
            if seed is not None:
                body["seed"] = seed
            if name is not None:
                body["name"] = name
            return self._post("/models", body)
        data = model if isinstance(model, bytes) else Path(model).read_bytes()
        params = {k: v for k, v in (("name", name), ("seed", seed)) if v is not None}
        return self._answer(self.http.post(
            "/models/upload", content=data, params=params,
            headers={**self.headers, "Content-Type": "application/octet-stream"}))

    def models(self) -> list[dict]:
        return self._get("/models")["models"]

    def model(self, model_id: str) -> dict:
        return self._get(f"/models/{model_id}")

    def delete_model(self, model_id: str) -> None:
        self._delete(f"/models/{model_id}")

    # -- compile / compute / infer ------------------------------------------------------------
    def compile(self, model_id: str, request, *, optimizer: dict | None = None,
                no_optimize: bool = False, use_shortcut: bool = True,
                listing: bool = False) -> dict:
        body = {"model_id": model_id, "request": _request_json(request),
                "no_optimize": no_optimize, "use_shortcut": use_shortcut, "listing": listing}
        if optimizer:
            body["optimizer"] = optimizer
        return self._post("/compile", body)

    def compute(self, model_id: str, request, inputs: dict, output_derivs: dict | None = None,
                **compile_options) -> dict:
        """{"outputs": {name: array}, "input_derivs": {...}, "model_gradient":
        {component: {parameter: array}} or None, "component_stats": {component:
        {statistic: float64 array}} or None (store_component_stats), "computation_id": ...}."""
        body = {"model_id": model_id, "request": _request_json(request),
                "inputs": {k: _matrix(v) for k, v in inputs.items()},
                "output_derivs": {k: _matrix(v) for k, v in (output_derivs or {}).items()},
                "encoding": "base64", **compile_options}
        r = self._post("/compute", body)
        grad = r.get("model_gradient")
        return {"computation_id": r["computation_id"],
                "outputs": {k: _array(v) for k, v in r["outputs"].items()},
                "input_derivs": {k: _array(v) for k, v in r.get("input_derivs", {}).items()},
                "model_gradient": None if grad is None else
                {c: {p: _array(m) for p, m in ps.items()} for c, ps in grad.items()},
                "component_stats": None if r.get("component_stats") is None else
                {c: {k: np.asarray(v, dtype=np.float64) for k, v in fs.items()}
                 for c, fs in r["component_stats"].items()}}

    def infer(self, model_id: str, features, ivector=None, online_ivectors=None,
              online_ivector_period: int = 0, **options) -> np.ndarray:
        """nnet3-compute's output; ``options`` are its options (frames_per_chunk,
        extra_left_context, frame_subsampling_factor, apply_exp, use_priors, ...)."""
        body = {"model_id": model_id, "features": _matrix(features), "options": options,
                "encoding": "base64", "online_ivector_period": online_ivector_period}
        if ivector is not None:
            body["ivector"] = [float(v) for v in np.asarray(ivector).reshape(-1)]
        if online_ivectors is not None:
            body["online_ivectors"] = _matrix(online_ivectors)
        return _array(self._post("/infer", body)["output"])

    # -- streams ---------------------------------------------------------------------------------
    def stream(self, model_id: str, ivector=None, online_ivector_period: int | None = None,
               **options) -> "ClientStream":
        """Open a stream (options: frames_per_chunk, extra_left_context_initial,
        frame_subsampling_factor, acoustic_scale, use_priors), with a per-utterance
        ``ivector`` or, given ``online_ivector_period``, online i-vector rows pushed
        with the frames."""
        body = {"model_id": model_id, "options": options}
        if ivector is not None:
            body["ivector"] = [float(v) for v in np.asarray(ivector).reshape(-1)]
        if online_ivector_period is not None:
            body["online_ivector_period"] = int(online_ivector_period)
        return ClientStream(self, self._post("/streams", body))


class ClientStream:
    """An open stream: ``push`` frames, ``finish``; frames are sent with their offset,
    so a push the service already counted is refused (409), never doubled."""

    def __init__(self, client: NnetcClient, info: dict):
        self.client = client
        self.info = info
        self.stream_id = info["stream_id"]
        self.sent = 0
        self.finished = False

    def push(self, frames, ivector=None, online_ivectors=None) -> np.ndarray:
        """Send frames (and a new per-utterance ``ivector``, or the next rows of an
        online stream's i-vector matrix); returns the output rows now computable."""
        body = {"features": _matrix(frames), "offset": self.sent, "encoding": "base64"}
        if ivector is not None:
            body["ivector"] = [float(v) for v in np.asarray(ivector).reshape(-1)]
        if online_ivectors is not None:
            body["online_ivectors"] = _matrix(np.atleast_2d(online_ivectors))
        r = self.client._post(f"/streams/{self.stream_id}/frames", body)
        self.sent = r["frames_received"]
        return _array(r["output"])

    def finish(self) -> np.ndarray:
        r = self.client._post(f"/streams/{self.stream_id}/finish", {"encoding": "base64"})
        self.finished = True
        return _array(r["output"])

    def close(self) -> None:
        if not self.finished:
            self.client._delete(f"/streams/{self.stream_id}")
            self.finished = True

    def __enter__(self) -> "ClientStream":
        return self

    def __exit__(self, *exc) -> None:
        if not self.finished:
            try:
                self.close()
            except ServiceCallError:
                pass
