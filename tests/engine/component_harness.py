"""Shared checks for component tests (the ideas of Kaldi's nnet-component-test.cc).

- ``load_component_text`` / reference cases in kaldi-ref/components/<Type>/<case>/.
- ``check_reference_case``: output, input derivative and parameter gradient against Kaldi
  (gradient.txt = parameters + gradient: Kaldi's SetAsGradient keeps the parameters).
- ``check_io_roundtrip``: text and binary write/read give identical parameters, and text
  written from a Kaldi text file is byte-identical to it.
- ``check_properties``: declared flags hold (in-place propagate/backprop, backprop without
  input/output when not needed, propagate-adds / backprop-adds semantics).
- ``check_derivatives``: finite differences in float64 for the input derivative and each
  parameter gradient.
Components are expected to preserve the dtype of the arrays they are given (float32 in
production; float64 here for finite differences).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.core.xp import array_module, to_numpy
from engine.nnet.components import new_component_from_config, read_component
from engine.nnet.components.base import Component, ComponentProperty as P
from engine.nnet.config_line import ConfigLine
from engine.nnet.kaldi_io import KaldiReader, KaldiWriter

REF_DIRS = [
    Path(__file__).resolve().parents[1] / "data" / "components",
    Path(__file__).resolve().parents[3] / "shared" / "kaldi-ref" / "components",
]


def reference_cases(type_name: str | None = None, full: bool = False) -> list[Path]:
    """Case directories for ``type_name`` (all types if None): the tests/data subset,
    plus the full shared set when ``full`` and it exists."""
    out: dict[str, Path] = {}
    for base in (REF_DIRS if full else REF_DIRS[:1]):
        if not base.is_dir():
            continue
        for tdir in sorted(base.iterdir()):
            if type_name is not None and tdir.name != type_name:
                continue
            for case in sorted(tdir.iterdir()):
                if (case / "component.txt").exists():
                    out.setdefault(f"{tdir.name}/{case.name}", case)
    return list(out.values())


def tolerance_ok(ours, ref, extra: float = 1.0) -> tuple[bool, float, float]:
    ours = np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if ours.shape != ref.shape:
        return False, float("inf"), 0.0
    if ref.size == 0:
        return True, 0.0, 0.0
    err = float(np.max(np.abs(ours - ref)))
    tol = extra * (1e-4 + 2e-3 * float(np.max(np.abs(ref))))
    return err <= tol, err, tol


def assert_close(what: str, ours, ref, extra: float = 1.0) -> None:
    ok, err, tol = tolerance_ok(ours, ref, extra)
    assert ok, f"{what}: max abs error {err:.3g} > tolerance {tol:.3g} (shape {np.shape(ours)} vs {np.shape(ref)})"


def load_component_text(path: Path) -> Component:
    return read_component(KaldiReader(Path(path).read_bytes(), binary=False, source=str(path)))


def component_from_config(type_name: str, config: str, seed: int = 0) -> Component:
    cfg = ConfigLine(config, source="<test>")
    return new_component_from_config(type_name, cfg, name="test", rng=np.random.default_rng(seed))


def run_forward(comp: Component, x):
    """Propagate ``x`` (a NumPy or CuPy array) through ``comp`` into a fresh output."""
    xp = array_module(x)
    out = xp.zeros((x.shape[0], comp.output_dim()), dtype=x.dtype)
    memo = comp.propagate(None, x, out)
    return out, memo


def run_backward(comp: Component, x, y, dy, memo, to_update=None):
    xp = array_module(dy)
    dx = xp.zeros((x.shape[0], comp.input_dim()), dtype=dy.dtype)
    comp.backprop("test", None, x, y, dy, memo, to_update, dx)
    return dx


def check_reference_case(case: Path, xp=np) -> None:
    """Output, input derivative and gradient of the case's component against Kaldi's,
    computed on the array backend ``xp`` (numpy or cupy)."""
    comp = load_component_text(case / "component.txt")
    arrays = np.load(case / "arrays.npz")
    grad = None
    if (case / "gradient.txt").exists():
        grad = comp.copy()
        grad.set_as_gradient()
    run, run_grad = comp, grad
    if xp is not np:
        run = comp.to_backend(xp)
        run_grad = grad.to_backend(xp) if grad is not None else None
    x = xp.asarray(arrays["input"].astype(np.float32))
    y, memo = run_forward(run, x)
    assert_close(f"{case.name} output", to_numpy(y), arrays["output"])
    dy = xp.asarray(arrays["output_deriv"].astype(np.float32))
    dx = run_backward(run, x, y, dy, memo, run_grad)
    assert_close(f"{case.name} input_deriv", to_numpy(dx), arrays["input_deriv"])
    if grad is not None:
        # Kaldi's SetAsGradient() does not zero the parameters, so gradient.txt holds
        # the original parameters plus the plain gradient.
        ref = load_component_text(case / "gradient.txt")
        for p, ours, theirs, orig in zip(grad.PARAMS, run_grad.param_arrays(),
                                         ref.param_arrays(), comp.param_arrays()):
            assert_close(f"{case.name} gradient {p}", to_numpy(ours),
                         np.asarray(theirs, np.float64) - np.asarray(orig, np.float64))


def _params_equal(a: Component, b: Component) -> None:
    assert type(a) is type(b)
    for p in a.PARAMS + a.ARRAYS:
        va, vb = getattr(a, p), getattr(b, p)
        if va is None or vb is None:
            assert va is None and vb is None, p
        else:
            np.testing.assert_array_equal(np.asarray(va), np.asarray(vb), err_msg=p)


def check_io_roundtrip(comp: Component, original_text: bytes | None = None) -> None:
    w = KaldiWriter(binary=False)
    comp.write(w)
    text = w.getvalue()
    if original_text is not None:
        assert text.strip() == original_text.strip(), "text written differs from Kaldi's text"
    back = read_component(KaldiReader(text, binary=False))
    _params_equal(comp, back)
    wb = KaldiWriter(binary=True)
    comp.write(wb)
    back_b = read_component(KaldiReader(wb.getvalue(), binary=True))
    _params_equal(comp, back_b)
    wt = KaldiWriter(binary=False)
    back_b.write(wt)
    assert wt.getvalue() == text, "text -> binary -> text is not stable"


def _to_float64(comp: Component) -> Component:
    c = comp.copy()
    for p in c.PARAMS + c.ARRAYS:
        v = getattr(c, p)
        if isinstance(v, np.ndarray) and v.dtype == np.float32:
            setattr(c, p, v.astype(np.float64))
    return c


def check_properties(comp: Component, num_rows: int = 7, seed: int = 1) -> None:
    """Declared flags are true (Kaldi's TestSimpleComponentPropagateProperties and
    the backprop equivalents)."""
    rng = np.random.default_rng(seed)
    props = comp.properties()
    x = rng.standard_normal((num_rows, comp.input_dim())).astype(np.float32)
    y, memo = run_forward(comp, x)
    if props & P.PROPAGATE_ADDS:
        base = rng.standard_normal(y.shape).astype(np.float32)
        out = base.copy()
        comp.propagate(None, x, out)
        np.testing.assert_allclose(out, base + y, rtol=1e-5, atol=1e-5)
    if props & P.PROPAGATE_IN_PLACE and comp.input_dim() == comp.output_dim():
        buf = x.copy()
        comp.propagate(None, buf, buf)
        np.testing.assert_allclose(buf, y, rtol=1e-5, atol=1e-6)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx = run_backward(comp, x, y, dy, memo)
    x_arg = x if props & P.BACKPROP_NEEDS_INPUT else None
    y_arg = y if props & P.BACKPROP_NEEDS_OUTPUT else None
    if not props & P.USES_MEMO:
        memo2 = None
    else:
        _, memo2 = run_forward(comp, x)
    dx2 = np.zeros_like(dx)
    comp.backprop("test", None, x_arg, y_arg, dy, memo2, None, dx2)
    np.testing.assert_allclose(dx2, dx, rtol=1e-5, atol=1e-6)
    if props & P.BACKPROP_ADDS:
        base = rng.standard_normal(dx.shape).astype(np.float32)
        acc = base.copy()
        comp.backprop("test", None, x, y, dy, memo2, None, acc)
        np.testing.assert_allclose(acc, base + dx, rtol=1e-5, atol=1e-5)
    if props & P.BACKPROP_IN_PLACE and comp.input_dim() == comp.output_dim():
        buf = dy.copy()
        comp.backprop("test", None, x_arg, y_arg, buf, memo2, None, buf)
        np.testing.assert_allclose(buf, dx, rtol=1e-5, atol=1e-6)


def _objective(comp: Component, x, dy) -> float:
    y, _ = run_forward(comp, x)
    return float(np.sum(y * dy))


def check_derivatives(comp: Component, num_rows: int = 5, seed: int = 2,
                      delta: float = 1e-6, rtol: float = 1e-3,
                      input_scale: float = 1.0) -> None:
    """Finite-difference checks in float64 of the input derivative and parameter gradient."""
    rng = np.random.default_rng(seed)
    c64 = _to_float64(comp)
    x = rng.standard_normal((num_rows, comp.input_dim())) * input_scale
    y, memo = run_forward(c64, x)
    dy = rng.standard_normal(y.shape)
    grad = None
    if comp.properties() & P.UPDATABLE_COMPONENT:
        grad = c64.copy()
        grad.set_as_gradient()
    dx = run_backward(c64, x, y, dy, memo, grad)
    f0 = float(np.sum(y * dy))
    # input derivative, along random directions
    for _ in range(3):
        d = rng.standard_normal(x.shape) * delta
        predicted = float(np.sum(dx * d))
        actual = (_objective(c64, x + d, dy) - _objective(c64, x - d, dy)) / 2
        scale = max(abs(predicted), abs(actual), 1e-10 * max(1.0, abs(f0)))
        assert abs(predicted - actual) <= rtol * scale + 1e-12, (
            f"{comp.type_name}: input derivative predicted {predicted:.6g} vs actual {actual:.6g}")
    if grad is None:
        return
    for p in c64.PARAMS:
        g = np.asarray(getattr(grad, p))
        orig = getattr(c64, p)
        d = rng.standard_normal(orig.shape) * delta
        predicted = float(np.sum(g * d))
        setattr(c64, p, orig + d)
        fp = _objective(c64, x, dy)
        setattr(c64, p, orig - d)
        fm = _objective(c64, x, dy)
        setattr(c64, p, orig)
        actual = (fp - fm) / 2
        scale = max(abs(predicted), abs(actual), 1e-10 * max(1.0, abs(f0)))
        assert abs(predicted - actual) <= rtol * scale + 1e-12, (
            f"{comp.type_name}: gradient of {p} predicted {predicted:.6g} vs actual {actual:.6g}")
