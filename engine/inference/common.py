"""Shared pieces of the inference front-end: preparing a network for decoding
(Kaldi's SetBatchnormTestMode / SetDropoutTestMode / CollapseModel from
nnet-utils.cc, as nnet3-compute and DecodableNnetSimpleLoopedInfo do), the
context of a simple network for a named output (ComputeSimpleNnetContext), a
small caching compiler (CachingOptimizingCompiler: compile + optimize once per
distinct request), the input checks of DecodableNnetSimple::EnsureFrameIsComputed
and the log-prior handling of DecodableNnetSimple.

Decoding networks are collapsed (engine.optimizer.collapse, every fold on:
``DECODING_COLLAPSE``), their LSTM cells of sigmoid/tanh/product nodes made LstmNonlinearity
components (engine.optimizer.fast_lstm), forward identities made aliases
(engine.optimizer.aliases), their sibling affines fused and recurrent affines
split (engine.optimizer.fuse) unless
the caller asks for the network as it is (``collapse=False``); the numbers agree
either way to float32 rounding.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from engine.core.errors import ConfigError, InferenceError
from engine.core.finite import as_float32, non_finite, to_float32
from engine.core.index import Index
from engine.optimizer.collapse import CollapseModelConfig


# How decoding networks are collapsed: every fold of Kaldi's CollapseModel, batch-norm
# and test-mode dropout included.  Kaldi's CollapseModelConfig has those two off at
# the reference commit ("temporarily", since 2019, while a bug was looked into), so
# nnet3-compute keeps them; folded, a batch-norm's per-column scale and offset become
# the next affine/linear/TDNN's weights and bias (Append()s of Offset()s of one node
# included), and the plain TDNN loses one full pass over each layer's output per
# layer (bench/RESULTS.md, sixteenth session: 150x8 forward -15%).  Outputs are
# equal to float32 rounding (tests/engine/test_collapse.py; Kaldi's own outputs in
# the inference tests).  Our dropout fold scales by what test mode does (see
# engine.optimizer.collapse).
DECODING_COLLAPSE = CollapseModelConfig.everything()


def lcm(a: int, b: int) -> int:
    from math import gcd  # noqa: PLC0415
    return a * b // gcd(a, b)


def prepare_nnet(nnet, collapse: bool = True):
    """A copy of ``nnet`` ready for decoding: batch-norm and dropout in test mode;
    with ``collapse``, Kaldi's CollapseModel with every fold on (``DECODING_COLLAPSE``),
    then batch-norms and fixed scales or biases that CollapseModel leaves (after a ReLU,
    before a residual sum) folded into the affines around them
    (engine.optimizer.fold_diagonal), then LSTM cells written as sigmoid, tanh and
    product nodes (Kaldi's "lstmp-layer") rewritten as one LstmNonlinearityComponent
    each and their constant dropout masks dropped (engine.optimizer.fast_lstm), then
    nodes that pass their input through unchanged (gradient truncation and clipping,
    no-ops, test-mode dropout) made aliases of what they read
    (engine.optimizer.aliases; those read only whole, e.g. a no-op over an Append(),
    written into their readers), residual sums' scales folded into their branches'
    affines (TDNN-F's bypass scale: engine.optimizer.fold_diagonal), then sibling
    affines fused, the i-vector columns of
    affines split off and recurrent affines split (engine.optimizer.fuse: one product
    per step for the gate affines of an LSTM that reads one input four times; the
    i-vector's product computed once per sequence, not per frame; only the recurrent
    columns of a product left in the frame-by-frame loop),
    then collapsed again (the split's outside half may fold what precedes it); its
    parameters read-only (``Nnet.freeze_parameters``).  The caller's network is never
    modified."""
    from engine.optimizer.collapse import collapse_model_in_place  # noqa: PLC0415
    from engine.optimizer.aliases import alias_forward_identities_in_place  # noqa: PLC0415
    from engine.optimizer.fold_diagonal import (fold_diagonal_nodes_in_place,  # noqa: PLC0415
                                                fold_residual_scales_in_place)
    from engine.optimizer.fast_lstm import (convert_lstm_cells_in_place,  # noqa: PLC0415
                                            drop_constant_dropout_masks_in_place)
    from engine.optimizer.fuse import (fuse_sibling_affines_in_place,  # noqa: PLC0415
                                       split_constant_inputs_in_place,
                                       split_recurrent_affines_in_place)
    nnet = nnet.copy()
    nnet.set_test_mode(True)
    if collapse:
        collapse_model_in_place(nnet, DECODING_COLLAPSE)
        fold_diagonal_nodes_in_place(nnet)
        convert_lstm_cells_in_place(nnet)
        drop_constant_dropout_masks_in_place(nnet)
        alias_forward_identities_in_place(nnet)
        fold_residual_scales_in_place(nnet)
        fuse_sibling_affines_in_place(nnet)
        split_constant_inputs_in_place(nnet)
        if split_recurrent_affines_in_place(nnet):
            collapse_model_in_place(nnet, DECODING_COLLAPSE)
    # read-only weights: the executor may use its contiguous transposed copies
    return nnet.freeze_parameters()


def check_simple(nnet, output_name: str = "output") -> None:
    """Kaldi's IsSimpleNnet, with the output name configurable (``--output``)."""
    o = nnet.get_node_index(output_name)
    if o < 0 or not nnet.is_output_node(o):
        raise InferenceError(f"output: the network has no output node named {output_name!r} "
                             f"(outputs: {', '.join(nnet.output_names())})")
    i = nnet.get_node_index("input")
    if i < 0 or not nnet.is_input_node(i):
        raise InferenceError("the network has no input node named 'input'")
    others = [n for n in nnet.input_names() if n not in ("input", "ivector")]
    if others:
        raise InferenceError(f"the network is not simple: inputs other than 'input' and "
                             f"'ivector' ({', '.join(others)})")


def simple_context(nnet, output_name: str = "output") -> tuple[int, int]:
    """(left, right) context of ``output_name`` with respect to 'input' (Kaldi's
    ComputeSimpleNnetContext, which probes computability over windows shifted by
    0..modulus and takes the largest context)."""
    from engine.nnet.graph import evaluate_computability  # noqa: PLC0415
    check_simple(nnet, output_name)
    modulus = nnet.modulus()
    has_ivector = nnet.get_node_index("ivector") >= 0
    window = 40
    while window < 800:
        results = []
        for start in range(modulus + 1):
            frames = [Index(0, t, 0) for t in range(start, start + window)]
            inputs = {"input": frames}
            if has_ivector:
                inputs["ivector"] = [Index(0, t, 0) for t in range(start - modulus,
                                                                   start + window)]
            ok = evaluate_computability(nnet, inputs, {output_name: frames})[output_name]
            if True not in ok:
                break
            first = ok.index(True)
            last_ok = window - 1 - ok[::-1].index(True)
            if not all(ok[first:last_ok + 1]):
                break
            results.append((first, window - 1 - last_ok))
        if len(results) == modulus + 1:
            if results[0] != results[modulus]:
                raise ConfigError("network context differs between time shifts that differ "
                                  "by the modulus; the network is not time-invariant")
            return max(r[0] for r in results), max(r[1] for r in results)
        window *= 2
    raise InferenceError(f"cannot work out the context of output {output_name!r}: nothing is "
                         f"computable from 'input' within 800 frames (not a simple network?)")


def compile_for_inference(nnet, request, optimize: bool = True, use_shortcut: bool = True):
    """A forward computation for ``request`` as the inference front-end runs it: shortcut
    compilation for the multi-chunk batches (the same computation as the Compiler's,
    made from a two-sequence one), optimized with Kaldi's defaults, then (when
    optimized) each output's row reordering moved before the row-wise components that
    write it (engine.optimizer.gather_first: a batch's outputs are n-major, the
    computation's rows t-major; the narrower input is reordered instead of the output,
    the same rows, fewer bytes)."""
    from engine.compiler.shortcut import compile_request  # noqa: PLC0415
    computation = compile_request(nnet, request, optimize=optimize, use_shortcut=use_shortcut)
    if optimize:
        from engine.optimizer.gather_first import gather_before_row_wise  # noqa: PLC0415
        gather_before_row_wise(computation, nnet)
    return computation


class CachingCompiler:
    """Kaldi's CachingOptimizingCompiler: compiled (and optimized) computations
    keyed by the request's canonical bytes, least recently used dropped first."""

    def __init__(self, nnet, capacity: int = 64, optimize: bool = True):
        self.nnet = nnet
        self.capacity = capacity
        self.optimize = optimize
        self._cache: OrderedDict[bytes, object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, request):
        key = request.canonical_bytes()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        computation = compile_for_inference(self.nnet, request, optimize=self.optimize)
        with self._lock:
            self._cache[key] = computation
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return computation

    def __len__(self) -> int:
        return len(self._cache)


def as_rows(rows, dim: int, dtype=None) -> np.ndarray:
    """``rows`` as an array; an empty list of rows (JSON ``[]``), which carries no
    width, as zero rows of width ``dim``."""
    with np.errstate(over="ignore", invalid="ignore"):   # (see engine.core.finite)
        a = np.asarray(rows, dtype=dtype)
    return np.zeros((0, dim), np.float32) if a.shape in ((0,), (0, 0)) else a


def require_finite(a: np.ndarray, what: str) -> None:
    """InferenceError naming ``what`` and the first value of ``a`` that is NaN or infinite
    (engine.core.finite), if any."""
    bad = non_finite(a)
    if bad:
        raise InferenceError(f"{what}: {bad}")


def as_features(feats, dim: int, what: str = "features") -> np.ndarray:
    """A float32 (frames, dim) matrix, or InferenceError naming what is wrong."""
    a = as_rows(feats, dim)
    if a.ndim != 2:
        raise InferenceError(f"{what}: expected a 2-d matrix (frames x {dim}), got shape "
                             f"{a.shape}")
    if a.shape[1] != dim:
        raise InferenceError(f"{what}: the network expects 'input' features of dimension "
                             f"{dim} but the matrix has {a.shape[1]} columns")
    if a.dtype.kind not in "fiu":
        raise InferenceError(f"{what}: expected numbers, got dtype {a.dtype}")
    a = to_float32(a)
    require_finite(a, what)
    return a


def check_ivectors(nnet, ivector, online_ivectors, online_ivector_period) -> tuple:
    """Validate the i-vector arguments against the network; returns
    (ivector float32 vector or None, online matrix or None, period)."""
    # each message starts with the argument at fault ("ivector: ..."), so that a caller
    # can tell its user which of its own fields to fix
    want = nnet.input_dim("ivector") if nnet.get_node_index("ivector") >= 0 else 0
    if ivector is not None and online_ivectors is not None:
        raise InferenceError("ivector: give either a per-utterance i-vector or online "
                             "i-vectors, not both")
    if want == 0:
        if ivector is not None:
            raise InferenceError("ivector: the network has no 'ivector' input but an "
                                 "i-vector was given")
        if online_ivectors is not None:
            raise InferenceError("online_ivectors: the network has no 'ivector' input but "
                                 "online i-vectors were given")
        return None, None, 0
    if ivector is None and online_ivectors is None:
        raise InferenceError(f"ivector: the network expects 'ivector' features of dimension "
                             f"{want} but no i-vectors were given")
    if ivector is not None:
        v = as_float32(ivector)
        if v.ndim == 2 and v.shape[0] == 1:
            v = v[0]
        if v.ndim != 1 or v.shape[0] != want:
            raise InferenceError(f"ivector: the network expects dimension {want}, got an "
                                 f"array of shape {np.shape(ivector)}")
        require_finite(v, "ivector")
        return v, None, 0
    m = as_float32(online_ivectors)
    if m.ndim != 2 or m.shape[1] != want or m.shape[0] == 0:
        raise InferenceError(f"online_ivectors: expected a non-empty matrix with {want} "
                             f"columns, got shape {np.shape(online_ivectors)}")
    if online_ivector_period is None or int(online_ivector_period) <= 0:
        raise InferenceError(f"online_ivector_period: online i-vectors need a period > 0 "
                             f"(--online-ivector-period), got {online_ivector_period}")
    require_finite(m, "online_ivectors")
    return None, m, int(online_ivector_period)


def model_priors(model):
    """The priors to pass for a loaded model (engine.nnet.model_io.Model): its vector,
    an empty one for an .mdl without priors (chain models: --use-priors is then a
    no-op, as in Kaldi), None for a bare network."""
    priors = getattr(model, "priors", None)
    if priors is None and getattr(model, "is_am", False):
        return np.zeros(0, dtype=np.float32)
    return priors


def check_acoustic_scale(scale) -> float:
    """The acoustic scale as a finite float (within float32's range: the output is
    scaled in float32)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)) \
            or not np.isfinite(scale) or abs(scale) > float(np.finfo(np.float32).max):
        raise InferenceError(f"acoustic_scale: must be a finite number in float32 range, "
                             f"got {scale!r}")
    return float(scale)


def scale_output(out: np.ndarray, scale: float) -> np.ndarray:
    """``out`` times the acoustic scale (float32, as Kaldi's CuMatrix::Scale)."""
    return out if scale == 1.0 else out * np.float32(scale)


def log_priors(priors, output_dim: int) -> np.ndarray | None:
    """log(priors) as float32 (Kaldi applies the log in float), checked against the
    output dimension; None when there are no priors."""
    if priors is None:
        return None
    p = np.asarray(priors, dtype=np.float32).reshape(-1)
    if p.size == 0:
        return None
    if p.size != output_dim:
        raise InferenceError(f"the model's priors have dimension {p.size} but the output has "
                             f"dimension {output_dim}")
    with np.errstate(divide="ignore"):
        return np.log(p)
