"""PyTorch (CPU) versions of the reference TDNN-F and TDNN-LSTM, built from the
same weights, for the ``torch`` suite.

They are what a PyTorch user would write for these xconfig architectures:
batch-first (B, T, C) tensors over the whole chunk; a TDNN layer is one
``linear`` on the spliced (time-shifted, concatenated) input; batch-norm in test
mode is a per-dimension scale and offset; the LSTM (Kaldi's LstmNonlinearity:
peepholes, projection, recurrence delay 3) loops over blocks of 3 frames, which
are independent of each other because the recurrence reaches back 3 frames.  The
layer structure (names, time offsets, the 0.66 bypass scales) is read from the
network itself, and every output is checked against nnetc's engine before
anything is timed.

Tensors carry the time of their first frame; an Offset is a slice.
"""

from __future__ import annotations

import re
import statistics

import numpy as np

from bench import common


def _torch():
    import torch  # noqa: PLC0415  (an optional benchmark dependency)
    return torch


class _Seq:
    """(B, T, C) tensor whose frame 0 is time ``t0``."""

    def __init__(self, x, t0: int):
        self.x, self.t0 = x, t0

    @property
    def t1(self) -> int:
        return self.t0 + self.x.shape[1]

    def window(self, start: int, end: int):
        """Frames [start, end) (times)."""
        return self.x[:, start - self.t0:end - self.t0]


class _Layers:
    """Weights of the prepared network as torch tensors, by component name."""

    def __init__(self, nnet):
        self.torch = _torch()
        self.nnet = nnet
        self.config = nnet.config_text()

    def comp(self, name):
        return self.nnet.components[self.nnet.get_component_index(name)]

    def t(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))

    def affine(self, name):
        c = self.comp(name)
        w = self.t(c.linear_params if hasattr(c, "linear_params") else c.params)
        b = self.t(c.bias_params) if hasattr(c, "bias_params") and c.bias_params.size else None
        return w, b

    def batchnorm(self, name):
        c = self.comp(name)
        assert c.test_mode and c.block_dim == c.dim
        return self.t(c.scale_vec), self.t(c.offset_vec)


def _splice(seq: _Seq, offsets: list[int]) -> _Seq:
    """Append(Offset(x, o) for o in offsets) over every time where all exist."""
    torch = _torch()
    start, end = seq.t0 - min(offsets), seq.t1 - max(offsets)
    return _Seq(torch.cat([seq.window(start + o, end + o) for o in offsets], dim=2), start)


class TorchTdnnf:
    """TDNN-F: idct + deltas + batch-norm + i-vector, tdnn1, factorised layers with a
    scaled bypass, prefinal and output (the 'output' branch only)."""

    def __init__(self, nnet):
        L = self.L = _Layers(nnet)
        self.idct = L.affine("idct")
        self.delta = L.batchnorm("delta")
        self.tdnn1 = (L.affine("tdnn1.affine"), L.batchnorm("tdnn1.batchnorm"))
        self.layers = []
        for m in re.finditer(r"name=(tdnnf\d+)\.noop component=\S+ input=Sum\(Scale\(([-\d.e]+), ",
                             L.config):
            name, scale = m.group(1), float(m.group(2))
            lin, aff = L.comp(f"{name}.linear"), L.comp(f"{name}.affine")
            self.layers.append((L.affine(f"{name}.linear"), list(lin.time_offsets),
                                L.affine(f"{name}.affine"), list(aff.time_offsets),
                                L.batchnorm(f"{name}.batchnorm"), scale))
        self.prefinal_l = L.affine("prefinal-l")
        self.prefinal = (L.affine("prefinal-chain.affine"), L.batchnorm("prefinal-chain.batchnorm1"),
                         L.affine("prefinal-chain.linear"), L.batchnorm("prefinal-chain.batchnorm2"))
        self.out = L.affine("output.affine")

    def __call__(self, x, ivector, t0: int):
        torch = _torch()
        F = torch.nn.functional
        idct = _Seq(F.linear(x, *self.idct), t0)
        s, e = idct.t0 + 2, idct.t1 - 2
        d1 = idct.window(s + 1, e + 1) - idct.window(s - 1, e - 1)
        d2 = idct.window(s - 2, e - 2) + idct.window(s + 2, e + 2) - 2 * idct.window(s, e)
        h = torch.cat([idct.window(s, e), d1, d2], dim=2) * self.delta[0] + self.delta[1]
        iv = ivector[:, None, :].expand(-1, h.shape[1], -1)
        (w, b), (bs, bo) = self.tdnn1
        cur = _Seq(torch.relu(F.linear(torch.cat([h, iv], dim=2), w, b)) * bs + bo, s)
        for (lw, lb), loffs, (aw, ab), aoffs, (bs, bo), scale in self.layers:
            lin = _splice(cur, loffs)
            lin = _Seq(F.linear(lin.x, lw, lb), lin.t0)
            aff = _splice(lin, aoffs)
            y = torch.relu(F.linear(aff.x, aw, ab)) * bs + bo
            cur = _Seq(scale * cur.window(aff.t0, aff.t1) + y, aff.t0)
        h = F.linear(cur.x, *self.prefinal_l)
        (aw, ab), (b1s, b1o), (lw, lb), (b2s, b2o) = self.prefinal
        h = torch.relu(F.linear(h, aw, ab)) * b1s + b1o
        h = F.linear(h, lw, lb) * b2s + b2o
        return _Seq(F.linear(h, *self.out), cur.t0)


class TorchTdnnLstm:
    """TDNN-LSTM: LDA splice, two TDNN layers, LSTM (peepholes, projection, delay
    3), TDNN, LSTM, output affine + log-softmax."""

    def __init__(self, nnet):
        L = self.L = _Layers(nnet)
        self.lda = L.affine("lda")
        self.tdnn = {k: (L.affine(f"{k}.affine"), L.batchnorm(f"{k}.batchnorm"))
                     for k in ("tdnn1", "tdnn2", "tdnn3")}
        self.lstm = {}
        for k in ("lstm1", "lstm2"):
            nl = L.comp(f"{k}.lstm_nonlin")
            self.lstm[k] = (L.affine(f"{k}.W_all"), L.t(nl.params), nl.cell_dim,
                            L.affine(f"{k}.W_rp"), L.comp(f"{k}.W_rp").output_dim() // 2)
        self.out = L.affine("output.affine")

    def _tdnn(self, seq, name, offsets):
        F = _torch().nn.functional
        s = _splice(seq, offsets)
        (w, b), (bs, bo) = self.tdnn[name]
        return _Seq(_torch().relu(F.linear(s.x, w, b)) * bs + bo, s.t0)

    def _lstm(self, seq, name, delay=3):
        torch = _torch()
        F = torch.nn.functional
        (w, b), peep, cd, (pw, pb), rdim = self.lstm[name]
        B, T, _ = seq.x.shape
        r_prev = seq.x.new_zeros((B, delay, rdim))
        c_prev = seq.x.new_zeros((B, delay, cd))
        outs = []
        for s in range(0, T, delay):
            xb = seq.x[:, s:s + delay]
            n = xb.shape[1]
            g = F.linear(torch.cat([xb, r_prev[:, :n]], dim=2), w, b)
            ig, fg, cg, og = g.split(cd, dim=2)
            cp = c_prev[:, :n]
            i = torch.sigmoid(ig + peep[0] * cp)
            f = torch.sigmoid(fg + peep[1] * cp)
            c = f * cp + i * torch.tanh(cg)
            o = torch.sigmoid(og + peep[2] * c)
            rp = F.linear(o * torch.tanh(c), pw, pb)
            outs.append(rp)
            r_prev, c_prev = rp[:, :, :rdim], c
        return _Seq(torch.cat(outs, dim=1), seq.t0)

    def __call__(self, x, ivector, t0: int):
        torch = _torch()
        F = torch.nn.functional
        lda = _splice(_Seq(x, t0), [-2, -1, 0, 1, 2])
        h = _Seq(F.linear(lda.x, *self.lda), lda.t0)
        h = self._tdnn(h, "tdnn1", [0])
        h = self._tdnn(h, "tdnn2", [-1, 0, 1])
        h = self._lstm(h, "lstm1")
        h = self._tdnn(h, "tdnn3", [-3, 0, 3])
        h = self._lstm(h, "lstm2")
        return _Seq(torch.log_softmax(F.linear(h.x, *self.out), dim=2), h.t0)


MODELS = {"tdnnf": TorchTdnnf, "tdnn_lstm": TorchTdnnLstm}


def _engine_output(nnet, request, inputs):
    from engine.runtime.executor import run_computation  # noqa: PLC0415
    comp = common.compile_cold(nnet, request)
    outs, _, _ = run_computation(comp, nnet, inputs)
    return outs["output"]


def compare_and_time(r, name, path, chunk, batch, threads=None) -> dict:
    """PyTorch against our forward of the same case, both on ``threads`` BLAS/intra-op
    threads (None: each library's default)."""
    torch = _torch()
    nnet = r.nnet(name, path)
    # built from the stored structure (its components by their xconfig names); the
    # outputs are compared below, whatever form of the network ours runs
    model = MODELS[name](r.nnet(name, path, "as-stored"))
    request = common.chunk_request(nnet, chunk, batch)
    rng = np.random.default_rng(7)
    inputs = {s.name: rng.standard_normal((len(s.indexes), nnet.input_dim(s.name)))
              .astype(np.float32) for s in request.inputs}
    left = -min(i.t for i in request.inputs[0].indexes)
    T = chunk + left + (max(i.t for i in request.inputs[0].indexes) - chunk + 1)
    x = torch.from_numpy(inputs["input"].reshape(batch, T, -1))
    iv = torch.from_numpy(inputs["ivector"]) if "ivector" in inputs else None

    def run_torch():
        with torch.inference_mode():
            y = model(x, iv, -left)
        return y.window(0, chunk)
    ours = _engine_output(nnet, request, inputs).reshape(batch, chunk, -1)
    theirs = run_torch().numpy()
    err = float(np.abs(ours - theirs).max())
    tol = 1e-4 + 2e-3 * float(np.abs(ours).max())
    if not err <= tol:
        raise AssertionError(f"{name} {chunk}x{batch}: PyTorch output differs from nnetc's by "
                             f"{err:g} (tolerance {tol:g}); not timing it")
    saved_threads = torch.get_num_threads()
    if threads is not None:
        # the same thread budget as ours (a split run: its K threads)
        torch.set_num_threads(common.cores_of(threads))
    try:
        runs = common.timings(run_torch, r.repeat, warmup=2)
        torch_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(saved_threads)
    f = r.forward(name, path, chunk, batch, threads)
    torch_ms, torch_min = statistics.median(runs) * 1e3, min(runs) * 1e3
    return {"model": name, "chunk": chunk, "batch": batch, "max_abs_diff": err,
            "torch_ms": torch_ms, "torch_min_ms": torch_min, "ours_ms": f["exec_ms"],
            "ours_min_ms": f["exec_min_ms"], "ours_over_torch": f["exec_ms"] / torch_ms,
            "ours_over_torch_min": f["exec_min_ms"] / torch_min,
            "threads": r.threads_label(threads), "torch_threads": torch_threads}


def run_suite(r) -> list[dict]:
    _torch()   # ImportError -> the suite is reported as skipped
    rows = []
    for name, path in r.models():
        if name not in MODELS:
            continue
        for chunk, batch in [(21, 1), (150, 1), (150, 8)]:
            for threads in r.thread_settings:
                if common.runs_case(threads, batch):
                    rows.append(compare_and_time(r, name, path, chunk, batch, threads))
    return rows


__all__ = ["TorchTdnnf", "TorchTdnnLstm", "run_suite", "compare_and_time"]
