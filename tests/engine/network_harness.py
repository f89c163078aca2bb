"""Running whole networks for differential tests (what Kaldi's nnet-derivative-test.cc
and nnet-optimize-test.cc do around NnetComputer).

``run_network(nnet, request, inputs, output_derivs, optimize=None)`` compiles a
request (Kaldi's Compiler::CreateComputation, no optimization unless asked),
runs forward and, when output derivatives are given, backward, and returns a
:class:`NetworkRun` with host (NumPy) copies of

- ``outputs``: output name -> matrix (request row order),
- ``input_derivs``: input name -> derivative, for inputs with ``has_deriv``,
- ``model_gradient``: ``"component.param"`` -> gradient array when the request
  has ``need_model_derivative`` (Kaldi's plain gradient: learning rate 1,
  parameters zeroed, as SetNnetAsGradient), else an empty dict,

plus the gradient network and the computation that was run.  A NetworkRun also
unpacks as ``outputs, input_derivs, model_gradient``.

``optimize`` may be None/False (unoptimized), True (``engine.optimizer.optimize``
with its default options), an options object (passed to
``engine.optimizer.optimize(computation, nnet, options, request=request)``), or
a callable ``f(computation, nnet, request) -> computation`` (returning None
means it changed ``computation`` in place).

The finite-difference helpers below (objective, parameter perturbation, dot
products) follow nnet-derivative-test.cc.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.compiler.compiler import CompilerOptions, compile_computation
from engine.compiler.request import ComputationRequest
from engine.runtime.backend import to_host
from engine.runtime.executor import Executor, io_names


@dataclass
class NetworkRun:
    outputs: dict[str, np.ndarray]
    input_derivs: dict[str, np.ndarray] = field(default_factory=dict)
    model_gradient: dict[str, np.ndarray] = field(default_factory=dict)
    gradient_nnet: Any = None
    computation: Any = None

    def __iter__(self):
        return iter((self.outputs, self.input_derivs, self.model_gradient))


def _apply_optimize(computation, nnet, request, optimize):
    if optimize is None or optimize is False:
        return computation
    if callable(optimize) and not isinstance(optimize, bool):
        result = optimize(computation, nnet, request)
        return computation if result is None else result
    from engine import optimizer as opt  # noqa: PLC0415  (only when asked to optimize)
    options = opt.OptimizeOptions() if optimize is True else optimize
    result = opt.optimize(computation, nnet, options, request=request)
    return computation if result is None or isinstance(result, bool) else result


def compile_request(nnet, request: ComputationRequest, optimize=None):
    """The (optionally optimized) computation for ``request``."""
    request.validate(nnet)
    computation = compile_computation(nnet, [request], CompilerOptions())
    return _apply_optimize(computation, nnet, request, optimize)


def updatable_params(nnet) -> dict[str, np.ndarray]:
    """``"component.param"`` -> the live parameter array of each updatable component."""
    out = {}
    for name, comp in zip(nnet.component_names, nnet.components):
        if comp.is_updatable:
            for p, arr in zip(comp.PARAMS, comp.param_arrays()):
                out[f"{name}.{p}"] = arr
    return out


def run_network(nnet, request: ComputationRequest, inputs: dict, output_derivs: dict | None,
                optimize=None, *, computation=None, backend=np) -> NetworkRun:
    """Compile (unless ``computation`` is given) and run ``request`` on ``nnet``.

    ``output_derivs`` None runs forward only; otherwise it maps every output with
    ``has_deriv`` to its derivative and the backward part is run too.
    """
    if computation is None:
        computation = compile_request(nnet, request, optimize)
    ex = Executor(computation, nnet, backend=backend)
    for spec in request.inputs:
        ex.accept_input(spec.name, np.asarray(inputs[spec.name], dtype=np.float32))
    ex.run()
    outputs = {s.name: np.array(to_host(ex.get_output(s.name))) for s in request.outputs}
    run = NetworkRun(outputs, computation=computation)
    backward = output_derivs is not None and any(s.has_deriv for s in request.outputs)
    if backward:
        # As in Kaldi (Compiler::ComputeDerivNeeded), an output without has_deriv
        # still accepts a derivative when a node it reads needs one for another
        # output; its derivative is zero by definition.
        accepted = set(io_names(computation, nnet)[3])
        for spec in request.outputs:
            if spec.has_deriv:
                ex.accept_output_deriv(spec.name,
                                       np.asarray(output_derivs[spec.name], dtype=np.float32))
            elif spec.name in accepted:
                ex.accept_output_deriv(spec.name, np.zeros(
                    (len(spec.indexes), nnet.output_dim(spec.name)), np.float32))
        ex.run()
        run.input_derivs = {s.name: np.array(to_host(ex.get_input_deriv(s.name)))
                            for s in request.inputs if s.has_deriv}
        if request.need_model_derivative:
            grad = ex.get_model_gradient()
            run.gradient_nnet = grad
            run.model_gradient = {k: np.array(to_host(v), dtype=np.float32)
                                  for k, v in updatable_params(grad).items()}
    ex.release()
    return run


# -- finite differences (nnet-derivative-test.cc) -------------------------------------------------------


def objective(outputs: dict[str, np.ndarray], output_derivs: dict[str, np.ndarray]) -> float:
    """sum over outputs of trace(output^T deriv), in float64 (Kaldi's TraceMatMat)."""
    return float(sum(np.vdot(np.asarray(outputs[k], np.float64),
                             np.asarray(d, np.float64)) for k, d in output_derivs.items()))


def approx_equal_vectors(predicted, measured, tol: float) -> bool:
    """Kaldi's ApproxEqual(a, b, tol): ||a - b|| <= tol * max(||a||, ||b||)."""
    a, b = np.asarray(predicted, np.float64), np.asarray(measured, np.float64)
    return float(np.linalg.norm(a - b)) <= tol * max(float(np.linalg.norm(a)),
                                                       float(np.linalg.norm(b)))


def perturbed_copy(nnet, directions: dict[str, np.ndarray], scale: float):
    """A copy of ``nnet`` with ``scale * directions[k]`` added to each named parameter."""
    new = nnet.copy()
    live = updatable_params(new)
    for k, d in directions.items():
        arr = live[k]
        arr += (scale * d).astype(arr.dtype)
    return new


def random_param_directions(nnet, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Standard-normal directions for every parameter (Kaldi's PerturbParams)."""
    return {k: rng.standard_normal(np.shape(v)) for k, v in updatable_params(nnet).items()}


def dot_gradient(gradient: dict[str, np.ndarray], directions: dict[str, np.ndarray]) -> float:
    return float(sum(np.vdot(np.asarray(gradient[k], np.float64), np.asarray(d, np.float64))
                     for k, d in directions.items() if k in gradient))


__all__ = ["NetworkRun", "run_network", "compile_request", "updatable_params", "objective",
           "approx_equal_vectors", "perturbed_copy", "random_param_directions", "dot_gradient"]
