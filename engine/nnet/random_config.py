"""Random network configs and requests for differential testing (Kaldi's
nnet-test-utils.cc: GenerateConfigSequence and its per-architecture helpers,
ComputeExampleComputationRequestSimple).

``generate_config_sequence(rng)`` returns a :class:`RandomNetwork`: a list of
config texts applied in order (as ``nnet3-init`` would) plus what a tester
needs to know about it.  The architectures are Kaldi's (simplest, simple
context / TDNN, simple with batch-norm and i-vectors, statistics pooling, RNN,
clockwork RNN, LSTM with and without BackpropTruncation, old CNN, new
TimeHeightConvolution CNN, restricted attention, distribute, composite) and a
few more so that every descriptor type and every component type that the
compiler can run appears in some network: a chain of random simple components
(Kaldi's GenerateRandomComponentConfig list), a "fast LSTM" built on
LstmNonlinearityComponent, a GRU on GruNonlinearity/OutputGruNonlinearity, a
TDNN-F-like factored network with dropout and batch-norm in test mode, and a
network with two inputs, dim-range nodes and a second output.

Everything is drawn from the ``numpy.random.Generator`` passed in, so a seed
fixes the network, its parameters (``RandomNetwork.build``), the request and
the data.  Options that make derivatives inexact (gradient clipping that
fires, back-propagation truncation with a scale) are reported through
``RandomNetwork.exact_derivatives`` so a finite-difference test knows what to
expect; self-repair is switched off as in Kaldi's own tests.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from engine.compiler.request import ComputationRequest, IoSpecification
from engine.core.index import Index
from engine.nnet.nnet import Nnet
from engine.nnet._random_base import (GenerationOptions, RandomNetwork, _append_offsets,  # noqa: F401
                                     _coin, _dim, _output_dim, _ri, _splice_context)


# -- Kaldi's architectures ----------------------------------------------------------------------


def gen_simplest(rng, opts) -> RandomNetwork:
    i, o = _dim(rng, opts, 10, 29), _output_dim(rng, opts)
    return RandomNetwork("simplest", [
        f"component name=affine1 type=AffineComponent input-dim={i} output-dim={o}\n"
        f"input-node name=input dim={i}\n"
        "component-node name=affine1_node component=affine1 input=input\n"
        "output-node name=output input=affine1_node\n"])


def gen_simple_context(rng, opts) -> RandomNetwork:
    ctx = _splice_context(rng)
    i, o = _dim(rng, opts, 10, 29), _output_dim(rng, opts)
    if _coin(rng):
        text = (f"component name=affine1 type=AffineComponent input-dim={i * len(ctx)} "
                f"output-dim={o}\ninput-node name=input dim={i}\n"
                f"component-node name=affine1_node component=affine1 "
                f"input=Append({_append_offsets('input', ctx)})\n"
                "output-node name=output input=affine1_node\n")
    else:
        text = (f"component name=tdnn1 type=TdnnComponent input-dim={i} output-dim={o} "
                f"time-offsets={','.join(map(str, ctx))} "
                f"use-bias={'true' if _coin(rng) else 'false'} "
                f"use-natural-gradient={'true' if _coin(rng) else 'false'}\n"
                f"input-node name=input dim={i}\n"
                "component-node name=tdnn1_node component=tdnn1 input=input\n"
                "output-node name=output input=tdnn1_node\n")
    return RandomNetwork("simple_context", [text])


def gen_simple(rng, opts) -> RandomNetwork:
    ctx = _splice_context(rng)
    i, o, h = _dim(rng, opts, 10, 29), _output_dim(rng, opts), _dim(rng, opts, 40, 89)
    iv = _dim(rng, opts, 10, 29)
    if _coin(rng) or not (opts.allow_ivector and opts.allow_multiple_inputs):
        iv = 0
    final_nonlin = opts.allow_final_nonlinearity and _coin(rng)
    batch_norm = _coin(rng)
    L = [f"component name=affine1 type=NaturalGradientAffineComponent "
         f"input-dim={i * len(ctx) + iv} output-dim={h}",
         f"component name=relu1 type=RectifiedLinearComponent dim={h}"]
    if batch_norm:
        bd = h // 2 if h % 2 == 0 else h
        L.append(f"component name=batch-norm type=BatchNormComponent dim={h} block-dim={bd} "
                 f"target-rms=2.0" + (" epsilon=3.0" if _coin(rng) else ""))
    L.append(f"component name=final_affine type=NaturalGradientAffineComponent "
             f"input-dim={h} output-dim={o}")
    if final_nonlin:
        t = "SoftmaxComponent" if _coin(rng) else "LogSoftmaxComponent"
        L.append(f"component name=logsoftmax type={t} dim={o}")
    L.append(f"input-node name=input dim={i}")
    if iv:
        L.append(f"input-node name=ivector dim={iv}")
    parts = ["ReplaceIndex(ivector, t, 0)"] if iv else []
    for off in ctx:
        parts.append(f"Offset(input, {off})" if _coin(rng)
                     else f"Scale(-1, Offset(input, {off}))")
    L.append(f"component-node name=affine1_node component=affine1 input=Append({', '.join(parts)})")
    r = int(rng.integers(0, 3))
    nonlin_in = ("affine1_node", "Scale(-1.0, affine1_node)",
                 f"Sum(Const(1.0, {h}), Scale(-1.0, affine1_node))")[r]
    L.append(f"component-node name=nonlin1 component=relu1 input={nonlin_in}")
    if batch_norm:
        L.append("component-node name=batch-norm component=batch-norm input=nonlin1")
        L.append("component-node name=final_affine component=final_affine input=batch-norm")
    else:
        L.append("component-node name=final_affine component=final_affine input=nonlin1")
    if final_nonlin:
        L.append("component-node name=output_nonlin component=logsoftmax input=final_affine")
        L.append("output-node name=output input=output_nonlin")
    else:
        L.append("output-node name=output input=final_affine")
    configs = ["\n".join(L) + "\n"]
    if _coin(rng):
        # A second config that inserts a layer and redefines final_affine, as
        # Kaldi does to exercise applying a config to an existing network.
        configs.append(
            f"component name=affine2 type=NaturalGradientAffineComponent input-dim={h} "
            f"output-dim={h}\ncomponent name=relu2 type=RectifiedLinearComponent dim={h}\n"
            f"component name=final_affine type=NaturalGradientAffineComponent input-dim={h} "
            f"output-dim={o}\ncomponent-node name=affine2 component=affine2 input=nonlin1\n"
            "component-node name=relu2 component=relu2 input=affine2\n"
            "component-node name=final_affine component=final_affine input=relu2\n")
    return RandomNetwork("simple", configs)


def gen_statistics(rng, opts) -> RandomNetwork:
    d = _dim(rng, opts, 10, 30)
    in_period = _ri(rng, 1, 3)
    stats_period = in_period * _ri(rng, 1, 3)
    lc, rc = stats_period * _ri(rng, 1, 10), stats_period * _ri(rng, 1, 10)
    log_count = _ri(rng, 0, 3)
    floor = _ri(rng, 1, 10) * 1.0e-10
    stddev = _coin(rng)
    raw = 1 + d + (d if stddev else 0)
    pooled = log_count + d + (d if stddev else 0)
    b = "true" if stddev else "false"
    return RandomNetwork("statistics", [
        f"input-node name=input dim={d}\n"
        f"component name=statistics-extraction type=StatisticsExtractionComponent "
        f"input-dim={d} input-period={in_period} output-period={stats_period} "
        f"include-variance={b}\n"
        f"component name=statistics-pooling type=StatisticsPoolingComponent input-dim={raw} "
        f"input-period={stats_period} left-context={lc} right-context={rc} "
        f"num-log-count-features={log_count} output-stddevs={b} variance-floor={floor:g}\n"
        f"component name=affine type=AffineComponent input-dim={d} output-dim={pooled}\n"
        "component-node name=statistics-extraction component=statistics-extraction "
        "input=input\n"
        "component-node name=statistics-pooling component=statistics-pooling "
        "input=statistics-extraction\n"
        "component-node name=affine component=affine input=input\n"
        f"output-node name=output input=Sum(affine, Round(statistics-pooling, "
        f"{stats_period}))\n"])


def _rnn_head(rng, opts, relu_only: bool) -> tuple[list[str], list[int], int, int, int]:
    """Component lines shared by the RNN and clockwork RNN, with (context,
    input dim, output dim, hidden dim)."""
    ctx = _splice_context(rng)
    i, o, h = _dim(rng, opts, 10, 29), _output_dim(rng, opts), _dim(rng, opts, 40, 89)
    nl = "RectifiedLinearComponent" if relu_only or _coin(rng) else "TanhComponent"
    L = [f"component name=affine1 type=NaturalGradientAffineComponent "
         f"input-dim={i * len(ctx)} output-dim={h}",
         f"component name=nonlin1 type={nl} dim={h}",
         f"component name=recurrent_affine1 type=NaturalGradientAffineComponent "
         f"input-dim={h} output-dim={h}"]
    return L, ctx, i, o, h


def gen_rnn(rng, opts) -> RandomNetwork:
    L, ctx, i, o, h = _rnn_head(rng, opts, relu_only=False)
    L += [f"component name=affine2 type=NaturalGradientAffineComponent input-dim={h} "
          f"output-dim={o}",
          f"component name=logsoftmax type=LogSoftmaxComponent dim={o}",
          f"input-node name=input dim={i}",
          f"component-node name=affine1_node component=affine1 "
          f"input=Append({_append_offsets('input', ctx)})",
          "component-node name=recurrent_affine1 component=recurrent_affine1 "
          "input=Offset(nonlin1, -1)",
          "component-node name=nonlin1 component=nonlin1 "
          "input=Sum(affine1_node, IfDefined(recurrent_affine1))",
          "component-node name=affine2 component=affine2 input=nonlin1",
          "component-node name=output_nonlin component=logsoftmax input=affine2",
          "output-node name=output input=output_nonlin"]
    return RandomNetwork("rnn", ["\n".join(L) + "\n"], recurrent=True)


def gen_rnn_clockwork(rng, opts) -> RandomNetwork:
    L, ctx, i, o, h = _rnn_head(rng, opts, relu_only=True)
    for k in range(3):
        L.append(f"component name=final_affine_{k} type=NaturalGradientAffineComponent "
                 f"input-dim={h} output-dim={o}")
    L += [f"component name=logsoftmax type=LogSoftmaxComponent dim={o}",
          f"input-node name=input dim={i}",
          f"component-node name=affine1_node component=affine1 "
          f"input=Append({_append_offsets('input', ctx)})",
          "component-node name=recurrent_affine1 component=recurrent_affine1 "
          "input=Offset(nonlin1, -1)",
          "component-node name=nonlin1 component=nonlin1 "
          "input=Sum(affine1_node, IfDefined(recurrent_affine1))",
          "component-node name=final_affine_0 component=final_affine_0 input=nonlin1",
          "component-node name=final_affine_1 component=final_affine_1 "
          "input=Offset(nonlin1, -1)",
          "component-node name=final_affine_2 component=final_affine_2 "
          "input=Offset(nonlin1, 1)",
          "component-node name=output_nonlin component=logsoftmax "
          "input=Switch(final_affine_0, final_affine_1, final_affine_2)",
          "output-node name=output input=output_nonlin"]
    return RandomNetwork("rnn_clockwork", ["\n".join(L) + "\n"], recurrent=True)


def _lstm_common(rng, opts, truncation: bool) -> RandomNetwork:
    ctx = _splice_context(rng)
    i, o = _dim(rng, opts, 10, 29), _output_dim(rng, opts)
    c = _dim(rng, opts, 40, 89)
    p = int(np.ceil(c / (int(rng.integers(0, 10)) + 1)))
    sx = i * len(ctx)
    L = [f"input-node name=input dim={i}"]
    if not truncation:
        L.append(f"component name=c0 type=ConstantComponent output-dim={c}")
    for g in "ifo":
        L.append(f"component name=W{g}-xr type=NaturalGradientAffineComponent "
                 f"input-dim={sx + p} output-dim={c}")
        L.append(f"component name=W{g}c type=PerElementScaleComponent dim={c}")
    L += [f"component name=Wc-xr type=NaturalGradientAffineComponent input-dim={sx + p} "
          f"output-dim={c}",
          f"component name=W-m type=NaturalGradientAffineComponent input-dim={c} "
          f"output-dim={2 * p}",
          f"component name=Wy- type=NaturalGradientAffineComponent input-dim={2 * p} "
          f"output-dim={c}",
          f"component name=final_affine type=NaturalGradientAffineComponent input-dim={c} "
          f"output-dim={o}",
          f"component name=logsoftmax type=LogSoftmaxComponent dim={o}"]
    for g, t in (("i", "Sigmoid"), ("f", "Sigmoid"), ("o", "Sigmoid"), ("g", "Tanh"),
                 ("h", "Tanh")):
        L.append(f"component name={g} type={t}Component dim={c}")
    for g in ("c1", "c2", "m"):
        L.append(f"component name={g} type=ElementwiseProductComponent input-dim={2 * c} "
                 f"output-dim={c}")
    exact = True
    if truncation:
        clip, zthr, zint = _ri(rng, 6, 50), _ri(rng, 1, 5), _ri(rng, 1, 5) * 10
        scale = 0.8 + 0.1 * _ri(rng, 0, 3)
        for name, d in (("c", c), ("r", p)):
            L.append(f"component name={name} type=BackpropTruncationComponent dim={d} "
                     f"scale={scale:g} clipping-threshold={clip} zeroing-threshold={zthr} "
                     f"zeroing-interval={zint} recurrence-interval=1")
        exact = False  # truncation scales, clips and zeroes derivatives on purpose
        off = _ri(rng, -3, 3) or -1
        c_prev = f"IfDefined(Offset(c_t, {off}))"
        r_prev = f"IfDefined(Offset(r_t, {off}))"
        L.append("component-node name=c_t component=c input=Sum(c1_t, c2_t)")
    else:
        c_prev = "Sum(Failover(Offset(c1_t, -1), c0), IfDefined(Offset(c2_t, -1)))"
        r_prev = "IfDefined(Offset(r_t, -1))"
        # c0 takes no input; it names itself to keep the node structure valid.
        L.append("component-node name=c0 component=c0 input=c0")
    spliced = _append_offsets("input", ctx)
    for g, w in (("i", "Wi-xr"), ("f", "Wf-xr"), ("o", "Wo-xr"), ("g", "Wc-xr")):
        L.append(f"component-node name={g}1 component={w} input=Append({spliced}, {r_prev})")
    L += [f"component-node name=i2 component=Wic input={c_prev}",
          "component-node name=i_t component=i input=Sum(i1, i2)",
          f"component-node name=f2 component=Wfc input={c_prev}",
          "component-node name=f_t component=f input=Sum(f1, f2)",
          "component-node name=o2 component=Woc input=Sum(c1_t, c2_t)",
          "component-node name=o_t component=o input=Sum(o1, o2)",
          "component-node name=h_t component=h input=Sum(c1_t, c2_t)",
          "component-node name=g_t component=g input=g1",
          f"component-node name=c1_t component=c1 input=Append(f_t, {c_prev})",
          "component-node name=c2_t component=c2 input=Append(i_t, g_t)",
          "component-node name=m_t component=m input=Append(o_t, h_t)",
          "component-node name=rp_t component=W-m input=m_t"]
    if truncation:
        L += [f"dim-range-node name=r_t_pretrunc input-node=rp_t dim-offset=0 dim={p}",
              "component-node name=r_t component=r input=r_t_pretrunc"]
    else:
        L.append(f"dim-range-node name=r_t input-node=rp_t dim-offset=0 dim={p}")
    L += ["component-node name=y_t component=Wy- input=rp_t",
          "component-node name=final_affine component=final_affine input=y_t",
          "component-node name=posteriors component=logsoftmax input=final_affine",
          "output-node name=output input=posteriors"]
    return RandomNetwork("lstm_truncation" if truncation else "lstm", ["\n".join(L) + "\n"],
                         recurrent=True, exact_derivatives=exact)


def gen_lstm(rng, opts) -> RandomNetwork:
    return _lstm_common(rng, opts, truncation=False)


def gen_lstm_truncation(rng, opts) -> RandomNetwork:
    return _lstm_common(rng, opts, truncation=True)


def gen_cnn(rng, opts) -> RandomNetwork:
    small = opts.dim_scale < 1.0
    xd = 10 + int(rng.integers(0, 20)) if not small else _ri(rng, 3, 8)
    yd = 10 + int(rng.integers(0, 20)) if not small else _ri(rng, 3, 8)
    zd = 3 + int(rng.integers(0, 10)) if not small else _ri(rng, 1, 4)
    fx, fy = 1 + int(rng.integers(0, xd)), 1 + int(rng.integers(0, yd))
    nf = 10 + int(rng.integers(0, 20)) if not small else _ri(rng, 2, 6)
    sx, sy = 1 + int(rng.integers(0, fx)), 1 + int(rng.integers(0, fy))
    xd -= (xd - fx) % sx
    yd -= (yd - fy) % sy
    vec = "yzx" if _coin(rng) else "zyx"
    ox, oy, oz = 1 + (xd - fx) // sx, 1 + (yd - fy) // sy, nf

    def pool(size_dim: int) -> tuple[int, int]:
        size = 1 + int(rng.integers(0, size_dim))
        while True:
            step = 1 + int(rng.integers(0, size))
            if (size_dim - size) % step == 0:
                return size, step
    (px, pxs), (py, pys), (pz, pzs) = pool(ox), pool(oy), pool(oz)
    # Kaldi's generator outputs conv_node and leaves maxpooling orphaned; half
    # of the time we output the pooled node so the maxpooling maths is run too.
    out = "maxpooling_node" if _coin(rng) else "conv_node"
    return RandomNetwork("cnn", [
        f"component name=conv type=ConvolutionComponent input-x-dim={xd} input-y-dim={yd} "
        f"input-z-dim={zd} filt-x-dim={fx} filt-y-dim={fy} filt-x-step={sx} "
        f"filt-y-step={sy} num-filters={nf} input-vectorization-order={vec}\n"
        f"component name=maxpooling type=MaxpoolingComponent input-x-dim={ox} "
        f"input-y-dim={oy} input-z-dim={oz} pool-x-size={px} pool-y-size={py} "
        f"pool-z-size={pz} pool-x-step={pxs} pool-y-step={pys} pool-z-step={pzs}\n"
        f"input-node name=input dim={xd * yd * zd}\n"
        "component-node name=conv_node component=conv input=input\n"
        "component-node name=maxpooling_node component=maxpooling input=conv_node\n"
        f"output-node name=output input={out}\n"],
        # max-pooling has kinks where two inputs tie; random data makes ties rare
        notes=[f"output={out}"])


def gen_cnn_new(rng, opts) -> RandomNetwork:
    height, nfilt, layers = _ri(rng, 5, 15), _ri(rng, 1, 3), _ri(rng, 0, 3)
    desc = "input"
    L = [f"input-node name=input dim={height * nfilt}"]
    for li in range(layers):
        next_nf = _ri(rng, 1, 10)
        padding = height < 5 or _coin(rng)
        sub = 1 if height < 4 else _ri(rng, 1, 2)
        nh = height if padding else height - 2
        nh = (nh + sub - 1) // sub
        if nh == height and _coin(rng):
            next_nf = nfilt
        r = _ri(rng, 0, 3)
        if r == 0:
            toff, req = "0", ("" if _coin(rng) else "0")
        elif _coin(rng):
            toff, req = "-1,0,1", ("" if _coin(rng) else "-1")
        else:
            toff, req = "-2,0,2", ("" if _coin(rng) else "0")
        s = (f"component type=TimeHeightConvolutionComponent name=layer{li}-conv "
             f"num-filters-in={nfilt} num-filters-out={next_nf} height-in={height} "
             f"height-out={nh} height-offsets={'-1,0,1' if padding else '0,1,2'} "
             f"time-offsets={toff}")
        if _coin(rng):
            s += " max-memory-mb=1.0e-04"
        if sub != 1 or _coin(rng):
            s += f" height-subsample-out={sub}"
        if req == "" and _coin(rng):
            req = toff
        if req:
            s += f" required-time-offsets={req}"
        for opt in (" param-stddev=0.1 bias-stddev=1", " use-natural-gradient=false",
                    " rank-in=4", " rank-out=4", " alpha-in=2.0", " alpha-out=2.0"):
            if _coin(rng):
                s += opt
        L.append(s)
        L.append(f"component-node name=layer{li}-conv component=layer{li}-conv input={desc}")
        if nh == height and next_nf == nfilt and _coin(rng):
            d = f"Sum({desc}, layer{li}-conv)"
        else:
            d = f"layer{li}-conv"
        desc = f"Round({d}, {_ri(rng, 2, 3)})" if _ri(rng, 0, 3) == 0 else d
        height, nfilt = nh, next_nf
    L.append(f"output-node name=output input={desc}")
    return RandomNetwork("cnn_new", ["\n".join(L) + "\n"])


def gen_attention(rng, opts) -> RandomNetwork:
    d = _dim(rng, opts, 100, 150)
    heads = _ri(rng, 1, 2)
    kd, vd = _dim(rng, opts, 20, 40), _dim(rng, opts, 20, 40)
    stride, nl, nr = _ri(rng, 1, 3), _ri(rng, 1, 4), _ri(rng, 0, 2)
    nlr, nrr = _ri(rng, 0, nl), _ri(rng, 0, nr)
    out_ctx = _coin(rng)
    qd = kd + nl + 1 + nr
    ad = heads * (kd + vd + qd)
    return RandomNetwork("attention", [
        f"input-node name=input dim={d}\n"
        f"component name=affine type=NaturalGradientAffineComponent input-dim={d} "
        f"output-dim={ad}\n"
        "component-node name=affine component=affine input=input\n"
        "component-node name=attention component=attention input=affine\n"
        f"component name=attention type=RestrictedAttentionComponent num-heads={heads} "
        f"key-dim={kd} value-dim={vd} time-stride={stride} num-left-inputs={nl} "
        f"num-right-inputs={nr} num-left-inputs-required={nlr} "
        f"num-right-inputs-required={nrr} output-context={'true' if out_ctx else 'false'}"
        + (" key-scale=1.0" if _coin(rng) else "") + "\n"
        "output-node name=output input=attention\n"])


def gen_distribute(rng, opts) -> RandomNetwork:
    o = opts.output_dim if opts.output_dim > 0 else _dim(rng, opts, 100, 100)
    xe, after = _ri(rng, 1, 5), _dim(rng, opts, 10, 20)
    # ReplaceIndex(affine, x, i) and Offset(affine, 0, i) name the same rows for
    # the x=0 outputs requested; mixing them exercises the x offset too.
    terms = [f"ReplaceIndex(affine, x, {k})" if _coin(rng) else f"Offset(affine, 0, {k})"
             for k in range(xe)]
    terms = [t.replace("Offset(affine, 0, 0)", "affine") for t in terms]
    return RandomNetwork("distribute", [
        f"input-node name=input dim={xe * after}\n"
        f"component name=distribute type=DistributeComponent input-dim={xe * after} "
        f"output-dim={after}\n"
        "component-node name=distribute component=distribute input=input\n"
        f"component name=affine type=AffineComponent input-dim={after} output-dim={o}\n"
        "component-node name=affine component=affine input=distribute\n"
        f"output-node name=output input=Sum({', '.join(terms)})\n"])


def gen_composite_block(rng, opts) -> RandomNetwork:
    n = _ri(rng, 1, 5)
    hi = 10 if opts.dim_scale >= 1.0 else max(1, int(round(10 * opts.dim_scale)))
    d = 10 * _ri(rng, 1, hi)
    s = (f"component name=composite1 type=CompositeComponent "
         f"max-rows-process={512 + 512 * _ri(rng, 1, 3)} num-components={n}")
    types = ("BlockAffineComponent", "RepeatedAffineComponent",
             "NaturalGradientRepeatedAffineComponent")
    last = d
    for k in range(1, n + 1):
        t = types[_ri(rng, 0, 2)]
        cur = 10 * _ri(rng, 1, hi)
        rep = "num-blocks" if t == "BlockAffineComponent" else "num-repeats"
        s += f" component{k}='type={t} input-dim={last} output-dim={cur} {rep}=10'"
        last = cur
    return RandomNetwork("composite_block", [
        s + "\n\n"
        f"input-node name=input dim={d}\n"
        "component-node name=composite1 component=composite1 input=input\n"
        "output-node name=output input=composite1\n"])


from engine.nnet._random_extra import (gen_fast_lstm, gen_gru, gen_multi_io,  # noqa: E402
                                       gen_simple_components, gen_tdnnf)

# (name, generator, needs) in Kaldi's order, then the extra architectures.
GENERATORS: list[tuple[str, Callable, tuple[str, ...]]] = [
    ("simplest", gen_simplest, ()),
    ("simple_context", gen_simple_context, ("context",)),
    ("simple", gen_simple, ("context", "nonlinearity")),
    ("rnn", gen_rnn, ("recursion", "context", "nonlinearity")),
    ("rnn_clockwork", gen_rnn_clockwork, ("recursion", "context", "nonlinearity",
                                          "clockwork")),
    ("lstm", gen_lstm, ("recursion", "context", "nonlinearity")),
    ("cnn", gen_cnn, ("nonlinearity",)),
    ("distribute", gen_distribute, ("use_of_x_dim",)),
    ("composite_block", gen_composite_block, ()),
    ("statistics", gen_statistics, ("statistics_pooling",)),
    ("lstm_truncation", gen_lstm_truncation, ("recursion", "context", "nonlinearity")),
    ("cnn_new", gen_cnn_new, ("nonlinearity", "context")),
    ("attention", gen_attention, ("nonlinearity", "context")),
    ("simple_components", gen_simple_components, ("nonlinearity",)),
    ("fast_lstm", gen_fast_lstm, ("recursion", "context", "nonlinearity")),
    ("gru", gen_gru, ("recursion", "context", "nonlinearity")),
    ("tdnnf", gen_tdnnf, ("context", "nonlinearity")),
    ("multi_io", gen_multi_io, ("context", "nonlinearity", "multiple_inputs")),
]
GENERATOR_NAMES = [g[0] for g in GENERATORS]


def _allowed(opts: GenerationOptions, needs: tuple[str, ...]) -> bool:
    return all(getattr(opts, f"allow_{n}") for n in needs)


def generate_config_sequence(rng: np.random.Generator,
                             opts: GenerationOptions = GenerationOptions(),
                             kind: str | None = None) -> RandomNetwork:
    """A random network (Kaldi's GenerateConfigSequence); ``kind`` forces one of
    ``GENERATOR_NAMES``.  The extra architectures get a share of the draws like
    Kaldi gives its most recently added types more."""
    if kind is not None:
        for name, fn, _ in GENERATORS:
            if name == kind:
                return fn(rng, opts)
        raise ValueError(f"unknown network kind {kind!r}; expected one of {GENERATOR_NAMES}")
    allowed = [(n, fn) for n, fn, needs in GENERATORS if _allowed(opts, needs)]
    if not allowed:
        raise ValueError("the generation options allow no network type")
    name, fn = allowed[int(rng.integers(0, len(allowed)))]
    return fn(rng, opts)


# -- requests and data ------------------------------------------------------------------------


def random_request(nnet: Nnet, rng: np.random.Generator, *, need_deriv: bool | None = None,
                   store_stats: bool = False) -> ComputationRequest:
    """Kaldi's ComputeExampleComputationRequestSimple: 1-4 sequences (n from 0 or
    1), 1-10 output frames starting at t in [0, 10), input frames covering the
    network's context plus up to 2 more each side (at least 3 frames), an
    i-vector at t=0 per sequence when the network has one; random deriv flags
    (``need_deriv`` forces them).  Outputs other than "output" are added with
    the same Indexes when they are computable from those inputs."""
    from engine.nnet.graph import compute_simple_context, evaluate_computability  # noqa: PLC0415
    left, right = compute_simple_context(nnet)
    nframes, start = 1 + int(rng.integers(0, 10)), int(rng.integers(0, 10))
    nseq = 1 + int(rng.integers(0, 4))
    end = start + nframes
    in_start = start - left - int(rng.integers(0, 3))
    in_end = end + right + int(rng.integers(0, 3))
    n0 = int(rng.integers(0, 2))
    if need_deriv is None:
        need_deriv = bool(rng.integers(0, 2) == 0)
    in_end = max(in_end, in_start + 3)
    ns = range(n0, n0 + nseq)
    in_ix = [Index(n, t, 0) for n in ns for t in range(in_start, in_end)]
    out_ix = [Index(n, t, 0) for n in ns for t in range(start, end)]
    out = IoSpecification("output", out_ix, need_deriv or rng.integers(0, 3) == 0)
    inputs = [IoSpecification("input", in_ix, need_deriv and rng.integers(0, 2) == 0)]
    if nnet.input_dim("ivector") != -1:
        inputs.append(IoSpecification("ivector", [Index(n, 0, 0) for n in ns],
                                      need_deriv and rng.integers(0, 2) == 0))
    outputs = [out]
    others = [nm for nm in nnet.output_names() if nm != "output"]
    if others:
        ok = evaluate_computability(nnet, {s.name: s.indexes for s in inputs},
                                    {nm: out_ix for nm in others})
        outputs += [IoSpecification(nm, out_ix, bool(out.has_deriv and rng.integers(0, 2) == 0))
                    for nm in others if all(ok[nm])]
    need_model = bool(need_deriv and rng.integers(0, 2) == 0)
    return ComputationRequest(inputs, outputs, need_model_derivative=need_model,
                              store_component_stats=store_stats)


def random_inputs(nnet: Nnet, request: ComputationRequest, rng: np.random.Generator
                  ) -> dict[str, np.ndarray]:
    """Standard-normal float32 matrices for every input of ``request``."""
    return {s.name: rng.standard_normal((len(s.indexes), nnet.node_dim(
        nnet.get_node_index(s.name)))).astype(np.float32) for s in request.inputs}


def random_output_derivs(nnet: Nnet, request: ComputationRequest, rng: np.random.Generator
                         ) -> dict[str, np.ndarray]:
    """Standard-normal float32 derivatives for every output with ``has_deriv``."""
    return {s.name: rng.standard_normal((len(s.indexes), nnet.output_dim(s.name))
                                        ).astype(np.float32)
            for s in request.outputs if s.has_deriv}


__all__ = ["GenerationOptions", "RandomNetwork", "GENERATORS", "GENERATOR_NAMES",
           "generate_config_sequence", "random_request", "random_inputs",
           "random_output_derivs"]
