"""Random architectures beyond Kaldi's GenerateConfigSequence, so that the
generator (engine/nnet/random_config.py) runs every component type and every
descriptor type the compiler supports:

- ``simple_components``: a chain of random components from Kaldi's
  GenerateRandomComponentConfig list (nnet-test-utils.cc), with an affine
  adapter wherever a component needs a particular input dimension;
- ``fast_lstm``: the xconfig "fast-lstm" layer (LstmNonlinearityComponent,
  optionally with a DropoutMaskComponent feeding its dropout inputs);
- ``gru``: GruNonlinearityComponent followed by OutputGruNonlinearityComponent;
- ``tdnnf``: a factored TDNN (TDNN-F) with batch-norm, general dropout and
  SpecAugment in test mode, NoOp and bypass ``Sum(Scale(..), ..)``;
- ``multi_io``: input plus i-vector, dim-range nodes of an input and of a
  component, Failover at the edge, Const, and a second output.

Self-repair and clipping are configured so that they never fire and the
derivatives stay exact.
"""

from __future__ import annotations

from engine.nnet._random_base import (RandomNetwork, _append_offsets, _coin, _dim, _output_dim,
                                      _ri, _splice_context)

# -- the simple-component chain --------------------------------------------------------------------


def _divisor(rng, d: int, max_value: int | None = None) -> int:
    divs = [k for k in range(1, d + 1) if d % k == 0 and (max_value is None or k <= max_value)]
    return divs[int(rng.integers(0, len(divs)))]


def _c_pnorm(rng, d):
    g = _divisor(rng, d, 6)
    return f"PnormComponent input-dim={d} output-dim={d // g}", d, d // g


def _c_normalize(rng, d):
    # A block of one element normalises to its sign: no derivative, and a jump
    # at zero (Kaldi's generator avoids dim=1 for the same reason).
    d = d if d >= 2 else _ri(rng, 2, 10)
    bd = _divisor(rng, d)
    if bd == 1:
        bd = d
    add = _coin(rng)
    out = d + (d // bd if add else 0)
    return (f"NormalizeComponent dim={d} block-dim={bd} target-rms={_ri(rng, 1, 200) / 100:g} "
            f"add-log-stddev={'true' if add else 'false'}", d, out)


def _c_dim_only(type_name):
    def f(rng, d):
        return f"{type_name} dim={d}", d, d
    f.__name__ = f"_c_{type_name}"
    return f


def _c_affine(type_name):
    def f(rng, d):
        o = _ri(rng, 2, 30)
        lr = 0.001 * _ri(rng, 1, 100)
        extra = "" if type_name == "FixedAffineComponent" else f" learning-rate={lr:g}"
        return f"{type_name} input-dim={d} output-dim={o}{extra}", d, o
    return f


def _c_sumgroup_sizes(rng, d):
    sizes = [_ri(rng, 1, 5) for _ in range(_ri(rng, 1, 12))]
    return f"SumGroupComponent sizes={','.join(map(str, sizes))}", sum(sizes), len(sizes)


def _c_sumgroup_dims(rng, d):
    g = _divisor(rng, d, 8)
    return f"SumGroupComponent input-dim={d} output-dim={d // g}", d, d // g


def _c_per_element_scale(type_name):
    def f(rng, d):
        return f"{type_name} dim={d} learning-rate={0.001 * _ri(rng, 1, 100):g}", d, d
    return f


def _c_elementwise_product(rng, d):
    m = _ri(rng, 2, 4)
    o = max(1, d // m)
    return f"ElementwiseProductComponent input-dim={o * m} output-dim={o}", o * m, o


def _c_permute(rng, d):
    cm = rng.permutation(d)
    return f"PermuteComponent column-map={','.join(map(str, cm))}", d, d


def _c_per_element_offset(rng, d):
    bd = _divisor(rng, d)
    pc = " param-mean=0.0 param-stddev=0.0" if _coin(rng) else " param-mean=1.0 param-stddev=1.0"
    return (f"PerElementOffsetComponent dim={d} block-dim={bd} use-natural-gradient="
            f"{'true' if _coin(rng) else 'false'} learning-rate={0.001 * _ri(rng, 1, 100):g}"
            + pc, d, d)


def _c_composite(rng, d):
    n, cur = _ri(rng, 1, 3), d
    s = f"CompositeComponent num-components={n} max-rows-process={_ri(rng, 1, 30)}"
    for k in range(1, n + 1):
        r = _ri(rng, 1, 3)
        if r == 1:
            s += f" component{k}='type=RectifiedLinearComponent dim={cur}'"
        elif r == 2:
            s += f" component{k}='type=TanhComponent dim={cur}'"
        else:
            nxt = _ri(rng, 5, 20)
            s += f" component{k}='type=AffineComponent input-dim={cur} output-dim={nxt}'"
            cur = nxt
    return s, d, cur


def _c_repeated(type_name, opt):
    def f(rng, d):
        r = _divisor(rng, d, 10)
        o = r * _ri(rng, 1, 4)
        return f"{type_name} input-dim={d} output-dim={o} {opt}={r}", d, o
    return f


def _c_maxpooling(rng, d):
    dims = [_ri(rng, 2, 5) for _ in range(3)]
    sizes, steps = [], []
    for k in range(3):
        size = _ri(rng, 1, dims[k])
        step = _ri(rng, 1, size)
        dims[k] -= (dims[k] - size) % step
        sizes.append(size)
        steps.append(step)
    x, y, z = dims
    return (f"MaxpoolingComponent input-x-dim={x} input-y-dim={y} input-z-dim={z} "
            f"pool-x-size={sizes[0]} pool-y-size={sizes[1]} pool-z-size={sizes[2]} "
            f"pool-x-step={steps[0]} pool-y-step={steps[1]} pool-z-step={steps[2]}",
            x * y * z, _pool_out(dims, sizes, steps))


def _pool_out(dims, sizes, steps) -> int:
    out = 1
    for d, s, st in zip(dims, sizes, steps):
        out *= 1 + (d - s) // st
    return out


def _c_constant_function(rng, d):
    o = _ri(rng, 1, 20)
    return (f"ConstantFunctionComponent input-dim={d} output-dim={o} "
            f"learning-rate={0.001 * _ri(rng, 1, 100):g} "
            f"is-updatable={'true' if _coin(rng) else 'false'} "
            f"use-natural-gradient={'true' if _coin(rng) else 'false'} output-stddev=1.0",
            d, o)


def _c_clip_gradient(rng, d):
    # a threshold far above any derivative here: the clipping never fires
    return (f"ClipGradientComponent dim={d} clipping-threshold=1e6 norm-based-clipping="
            f"{'true' if _coin(rng) else 'false'} self-repair-scale=0.0", d, d)


def _c_backprop_truncation(rng, d):
    return (f"BackpropTruncationComponent dim={d} scale=1.0 clipping-threshold=1e6 "
            f"zeroing-threshold=1e6 zeroing-interval={_ri(rng, 1, 5) * 10} "
            "recurrence-interval=1", d, d)


def _c_dropout(rng, d):
    return f"DropoutComponent dim={d} dropout-proportion={rng.uniform():.3f} test-mode=true", d, d


def _c_general_dropout(rng, d):
    bd = _divisor(rng, d)
    return (f"GeneralDropoutComponent dim={d} block-dim={bd} dropout-proportion="
            f"{rng.uniform(0.0, 0.5):.3f} continuous={'true' if _coin(rng) else 'false'} "
            "test-mode=true", d, d)


def _c_specaugment(rng, d):
    return (f"SpecAugmentTimeMaskComponent dim={d} zeroed-proportion=0.25 "
            f"time-mask-max-frames={_ri(rng, 2, 6)}", d, d)


def _c_batchnorm(rng, d):
    bd = _divisor(rng, d)
    return (f"BatchNormComponent dim={d} block-dim={bd} target-rms={_ri(rng, 1, 4)} "
            f"test-mode=true epsilon={'0.1' if _coin(rng) else '1.0'}", d, d)


def _c_sum_block(rng, d):
    o = _divisor(rng, d, 10)
    o = d // o
    return f"SumBlockComponent input-dim={d} output-dim={o} scale={0.5 * _ri(rng, 1, 3):g}", d, o


def _c_scale_and_offset(rng, d):
    bd = _divisor(rng, d)
    return (f"ScaleAndOffsetComponent dim={d} block-dim={bd} use-natural-gradient="
            f"{'true' if _coin(rng) else 'false'}", d, d)


def _c_tdnn0(rng, d):
    o = _ri(rng, 2, 30)
    return (f"TdnnComponent input-dim={d} output-dim={o} time-offsets=0 learning-rate="
            f"{0.001 * _ri(rng, 1, 100):g} use-natural-gradient="
            f"{'true' if _coin(rng) else 'false'} use-bias={'true' if _coin(rng) else 'false'}",
            d, o)


def _c_noop(rng, d):
    return f"NoOpComponent dim={d}", d, d


SIMPLE_COMPONENT_BUILDERS = [
    _c_pnorm, _c_normalize, _c_dim_only("SigmoidComponent"), _c_dim_only("TanhComponent"),
    _c_dim_only("RectifiedLinearComponent"), _c_dim_only("SoftmaxComponent"),
    _c_dim_only("LogSoftmaxComponent"), _c_noop, _c_affine("FixedAffineComponent"),
    _c_affine("AffineComponent"), _c_affine("NaturalGradientAffineComponent"),
    _c_sumgroup_sizes, _c_dim_only("FixedScaleComponent"), _c_dim_only("FixedBiasComponent"),
    _c_per_element_scale("NaturalGradientPerElementScaleComponent"),
    _c_per_element_scale("PerElementScaleComponent"), _c_elementwise_product, _c_permute,
    _c_per_element_offset, _c_composite, _c_sumgroup_dims,
    _c_repeated("RepeatedAffineComponent", "num-repeats"),
    _c_repeated("BlockAffineComponent", "num-blocks"),
    _c_repeated("NaturalGradientRepeatedAffineComponent", "num-repeats"), _c_maxpooling,
    _c_constant_function, _c_clip_gradient, _c_dropout, _c_batchnorm, _c_sum_block,
    _c_scale_and_offset, _c_affine("LinearComponent"), _c_tdnn0, _c_general_dropout,
    _c_specaugment, _c_backprop_truncation,
]


def gen_simple_components(rng, opts) -> RandomNetwork:
    d0 = _dim(rng, opts, 10, 40)
    d = d0
    comps, nodes = [], []
    prev = "input"
    n = _ri(rng, 2, 6)
    for k in range(n):
        build = SIMPLE_COMPONENT_BUILDERS[int(rng.integers(0, len(SIMPLE_COMPONENT_BUILDERS)))]
        spec, need_in, out = build(rng, d)
        if need_in != d:
            comps.append(f"component name=adapt{k} type=AffineComponent input-dim={d} "
                         f"output-dim={need_in}")
            nodes.append(f"component-node name=adapt{k} component=adapt{k} input={prev}")
            prev = f"adapt{k}"
        comps.append(f"component name=c{k} type={spec}")
        nodes.append(f"component-node name=c{k} component=c{k} input={prev}")
        prev, d = f"c{k}", out
    o = _output_dim(rng, opts)
    comps.append(f"component name=final type=AffineComponent input-dim={d} output-dim={o}")
    nodes.append(f"component-node name=final component=final input={prev}")
    text = "\n".join([f"input-node name=input dim={d0}"] + comps + nodes
                     + ["output-node name=output input=final"]) + "\n"
    return RandomNetwork("simple_components", [text])


# -- recurrent layers on the fused nonlinearities -----------------------------------------------------


def gen_fast_lstm(rng, opts) -> RandomNetwork:
    ctx = _splice_context(rng)
    i, o, c = _dim(rng, opts, 10, 29), _output_dim(rng, opts), _dim(rng, opts, 20, 60)
    delay = -_ri(rng, 1, 3)
    dropout = _coin(rng)
    p = _ri(rng, max(2, c // 4), c)  # recurrent projection
    spliced = _append_offsets("input", ctx)
    c_prev = (f"IfDefined(Offset(c, {delay}))" if _coin(rng)
              else f"Failover(Offset(c, {delay}), Const(0.0, {c}))")
    L = [f"input-node name=input dim={i}",
         f"component name=W_all type=NaturalGradientAffineComponent "
         f"input-dim={i * len(ctx) + p} output-dim={4 * c}",
         f"component name=lstm_nonlin type=LstmNonlinearityComponent cell-dim={c} "
         f"self-repair-scale=0.0 use-dropout={'true' if dropout else 'false'}",
         f"component name=W_r type=LinearComponent input-dim={c} output-dim={p}",
         f"component name=final_affine type=NaturalGradientAffineComponent input-dim={p} "
         f"output-dim={o}",
         f"component name=logsoftmax type=LogSoftmaxComponent dim={o}",
         f"dim-range-node name=c input-node=lstm_nonlin dim-offset=0 dim={c}",
         f"dim-range-node name=m input-node=lstm_nonlin dim-offset={c} dim={c}",
         f"component-node name=W_all component=W_all input=Append({spliced}, "
         f"IfDefined(Offset(r, {delay})))"]
    nl_in = f"Append(W_all, {c_prev}"
    if dropout:
        L += ["component name=dropout_mask type=DropoutMaskComponent output-dim=3 "
              f"dropout-proportion={rng.uniform(0.0, 0.5):.3f} test-mode=true",
              # the mask takes no input rows; it names itself, like Kaldi's c0
              "component-node name=dropout_mask component=dropout_mask input=dropout_mask"]
        nl_in += ", dropout_mask"
    L += [f"component-node name=lstm_nonlin component=lstm_nonlin input={nl_in})",
          "component-node name=r component=W_r input=m",
          "component-node name=final_affine component=final_affine input=r",
          "component-node name=posteriors component=logsoftmax input=final_affine",
          "output-node name=output input=posteriors"]
    return RandomNetwork("fast_lstm", ["\n".join(L) + "\n"], recurrent=True)


def gen_gru(rng, opts) -> RandomNetwork:
    ctx = _splice_context(rng)
    i, o, c = _dim(rng, opts, 10, 29), _output_dim(rng, opts), _dim(rng, opts, 10, 30, 4)
    r = c if _coin(rng) else _ri(rng, 2, c - 1)
    sx = i * len(ctx)
    spliced = _append_offsets("input", ctx)
    s_name = "c_t" if r == c else "s_t"
    L = [f"input-node name=input dim={i}",
         f"component name=W_zr type=NaturalGradientAffineComponent input-dim={sx + r} "
         f"output-dim={c + r}",
         f"component name=sig_zr type=SigmoidComponent dim={c + r}",
         f"component name=W_h type=NaturalGradientAffineComponent input-dim={sx} "
         f"output-dim={c}",
         f"component name=gru type=GruNonlinearityComponent cell-dim={c} recurrent-dim={r} "
         "self-repair-scale=0.0",
         f"dim-range-node name=h_t input-node=gru dim-offset=0 dim={c}",
         f"dim-range-node name=c_t input-node=gru dim-offset={c} dim={c}",
         f"component-node name=zr component=W_zr input=Append({spliced}, "
         f"IfDefined(Offset({s_name}, -1)))",
         "component-node name=zr_t component=sig_zr input=zr",
         f"component-node name=hpart component=W_h input=Append({spliced})"]
    gru_in = "Append(zr_t, hpart, IfDefined(Offset(c_t, -1))"
    if r != c:
        L += [f"component name=W_s type=LinearComponent input-dim={c} output-dim={r}",
              "component-node name=s_t component=W_s input=c_t"]
        gru_in += ", IfDefined(Offset(s_t, -1))"
    L.append(f"component-node name=gru component=gru input={gru_in})")
    # second layer: the output-GRU (diagonal recurrence)
    L += [f"component name=W2_z type=NaturalGradientAffineComponent input-dim={c} "
          f"output-dim={c}",
          f"component name=sig2 type=SigmoidComponent dim={c}",
          f"component name=W2_h type=NaturalGradientAffineComponent input-dim={c} "
          f"output-dim={c}",
          f"component name=ogru type=OutputGruNonlinearityComponent cell-dim={c} "
          "self-repair-scale=0.0",
          f"dim-range-node name=h2 input-node=ogru dim-offset=0 dim={c}",
          f"dim-range-node name=c2 input-node=ogru dim-offset={c} dim={c}",
          "component-node name=z2a component=W2_z input=h_t",
          "component-node name=z2 component=sig2 input=z2a",
          "component-node name=hpart2 component=W2_h input=h_t",
          "component-node name=ogru component=ogru input=Append(z2, hpart2, "
          "IfDefined(Offset(c2, -1)))",
          f"component name=final_affine type=NaturalGradientAffineComponent input-dim={c} "
          f"output-dim={o}",
          "component-node name=final_affine component=final_affine input=h2",
          "output-node name=output input=final_affine"]
    return RandomNetwork("gru", ["\n".join(L) + "\n"], recurrent=True)


# -- TDNN-F and multiple inputs/outputs ------------------------------------------------------------


def gen_tdnnf(rng, opts) -> RandomNetwork:
    i, o = _dim(rng, opts, 10, 29), _output_dim(rng, opts)
    h, b = _dim(rng, opts, 40, 80), _dim(rng, opts, 10, 20)
    iv = _dim(rng, opts, 5, 15) if _coin(rng) and opts.allow_ivector else 0
    lda_in = 3 * i + iv
    parts = "Offset(input, -1), input, Offset(input, 1)" + (
        ", ReplaceIndex(ivector, t, 0)" if iv else "")
    L = [f"input-node name=input dim={i}"] + ([f"input-node name=ivector dim={iv}"] if iv else [])
    L += [f"component name=specaug type=SpecAugmentTimeMaskComponent dim={i} "
          "zeroed-proportion=0.2 time-mask-max-frames=5",
          "component-node name=specaug component=specaug input=input",
          f"component name=lda type=FixedAffineComponent input-dim={lda_in} "
          f"output-dim={lda_in}",
          f"component-node name=lda component=lda input=Append({parts})".replace(
              "Offset(input, -1), input, Offset(input, 1)",
              "Offset(specaug, -1), specaug, Offset(specaug, 1)"),
          f"component name=tdnn1.affine type=NaturalGradientAffineComponent "
          f"input-dim={lda_in} output-dim={h}",
          f"component name=tdnn1.relu type=RectifiedLinearComponent dim={h}",
          f"component name=tdnn1.batchnorm type=BatchNormComponent dim={h} epsilon=1.0 "
          "test-mode=true",
          "component-node name=tdnn1.affine component=tdnn1.affine input=lda",
          "component-node name=tdnn1.relu component=tdnn1.relu input=tdnn1.affine",
          "component-node name=tdnn1.batchnorm component=tdnn1.batchnorm input=tdnn1.relu"]
    prev = "tdnn1.batchnorm"
    for k in range(2, 2 + _ri(rng, 1, 3)):
        n = f"tdnnf{k}"
        s = _ri(rng, 1, 3)
        bypass = 0.66
        L += [f"component name={n}.linear type=TdnnComponent input-dim={h} output-dim={b} "
              f"time-offsets={-s},0 use-bias=false use-natural-gradient="
              f"{'true' if _coin(rng) else 'false'} orthonormal-constraint=-1.0",
              f"component name={n}.affine type=TdnnComponent input-dim={b} output-dim={h} "
              f"time-offsets=0,{s} use-natural-gradient={'true' if _coin(rng) else 'false'}",
              f"component name={n}.relu type=RectifiedLinearComponent dim={h}",
              f"component name={n}.batchnorm type=BatchNormComponent dim={h} epsilon=1.0 "
              "test-mode=true",
              f"component name={n}.dropout type=GeneralDropoutComponent dim={h} "
              f"dropout-proportion=0.2 continuous=true test-mode=true",
              f"component name={n}.noop type=NoOpComponent dim={h}",
              f"component-node name={n}.linear component={n}.linear input={prev}",
              f"component-node name={n}.affine component={n}.affine input={n}.linear",
              f"component-node name={n}.relu component={n}.relu input={n}.affine",
              f"component-node name={n}.batchnorm component={n}.batchnorm input={n}.relu",
              f"component-node name={n}.dropout component={n}.dropout input={n}.batchnorm",
              f"component-node name={n}.noop component={n}.noop "
              f"input=Sum(Scale({bypass}, {prev}), {n}.dropout)"]
        prev = f"{n}.noop"
    L += [f"component name=prefinal type=LinearComponent input-dim={h} output-dim={b}",
          f"component name=output.affine type=NaturalGradientAffineComponent input-dim={b} "
          f"output-dim={o}",
          f"component name=output.log-softmax type=LogSoftmaxComponent dim={o}",
          f"component-node name=prefinal component=prefinal input={prev}",
          "component-node name=output.affine component=output.affine input=prefinal",
          "component-node name=output.log-softmax component=output.log-softmax "
          "input=output.affine",
          "output-node name=output input=output.log-softmax objective=linear"]
    return RandomNetwork("tdnnf", ["\n".join(L) + "\n"])


def gen_multi_io(rng, opts) -> RandomNetwork:
    i = _dim(rng, opts, 10, 29, 4)
    v, h, o = _dim(rng, opts, 5, 15), _dim(rng, opts, 20, 50, 4), _output_dim(rng, opts)
    k = _ri(rng, 1, i - 1)
    c1, c2 = _splice_context(rng), _splice_context(rng)
    lo_terms = _append_offsets("input_lo", c1)
    hi_terms = ", ".join(
        f"Failover(Offset(input_hi, {off}), input_hi)" if off > 0 and _coin(rng)
        else f"Offset(input_hi, {off})" for off in c2)
    mix = ("Sum(a1, Scale(0.5, a2))" if _coin(rng)
           else f"Sum(a1, Sum(a2, Const(0.5, {h})))")
    part = _ri(rng, 1, h - 1)
    L = [f"input-node name=input dim={i}",
         f"input-node name=ivector dim={v}",
         f"dim-range-node name=input_lo input-node=input dim-offset=0 dim={k}",
         f"dim-range-node name=input_hi input-node=input dim-offset={k} dim={i - k}",
         f"component name=a1 type=AffineComponent input-dim={k * len(c1) + v} output-dim={h}",
         f"component name=a2 type=AffineComponent input-dim={(i - k) * len(c2)} "
         f"output-dim={h}",
         f"component name=nl type=TanhComponent dim={h}",
         f"component name=final type=AffineComponent input-dim={h} output-dim={o}",
         f"component-node name=a1 component=a1 input=Append({lo_terms}, "
         "ReplaceIndex(ivector, t, 0))",
         f"component-node name=a2 component=a2 input=Append({hi_terms})",
         f"component-node name=nl component=nl input={mix}",
         f"dim-range-node name=nl_part input-node=nl dim-offset={h - part} dim={part}",
         "component-node name=final component=final input=nl",
         "output-node name=output input=final"]
    if opts.allow_multiple_outputs:
        L.append("output-node name=output2 input=nl_part objective=quadratic")
    return RandomNetwork("multi_io", ["\n".join(L) + "\n"])


__all__ = ["SIMPLE_COMPONENT_BUILDERS", "gen_simple_components", "gen_fast_lstm", "gen_gru",
           "gen_tdnnf", "gen_multi_io"]
