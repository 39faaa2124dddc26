"""ROLL training-step time in the paper's MNIST setting (784-300x4-10 ReLU, batch 64, SGD).

Times, in one run, tf.function-compiled train steps (cross-entropy + lam * ROLL,
then an SGD update; the ROLL term as `wrap(model).fit` computes it) for

* vanilla: cross-entropy only;
* exact ROLL through the perturbation (forward-mode) pass of `keras_roll.roll.loss`,
  along per-example factors of the Gram matrix of the first layer's active units
  (the default, `keras_roll.roll.active_factor`: the batch's largest number of
  active units, K, instead of 300 directions) and along the 784 input axes
  (`fewest_directions=False`, the reference path), each at budgets of 16, 64
  (the former default), 256 MiB and 1 GiB (one chunk), and along the active
  units with `memory_budget="auto"` (the default: the chunk size from a timed
  probe, `keras_roll.roll.autotune`); and along the 300 rows of a factor of the
  whole Gram matrix (`keras_roll.roll.factored`, the default before), "auto";
* the same exact loss through `tf.GradientTape.batch_jacobian` (the autodiff
  baseline: reverse mode per neuron, vectorized by pfor);
* sampled ROLL with 3 input axes per example (Eq. 10), and with 3 axes shared by
  the batch (`share_axes=True`: the first layer's tangents are then shared);

and prints the medians and the ratios: input axes / active units (the exact
step's speed-up, at each budget and best against best), H1 factor rows / active
units, "auto" / the best fixed budget, the former default step / the new default
step, sampled / vanilla, autodiff / perturbation, and the achieved GFLOP/s of the
exact steps beside float32 matmul rates measured in the same run. The variants
are timed round-robin (medians of interleaved repetitions), each from the same initial
weights (put back, untimed, before every step): on a machine shared with other work
only these ratios, measured side by side, mean anything, not the absolute times.

Then, on the paper's Japanese Vowels scoRNN(512) (real data, 32 training
sequences), on a batch padded to the split's longest sequence and on a batch of
similar lengths (as `examples/japanese_vowel.py` buckets them): the exact step
before (the recurrence run over every step for every chunk of directions) / now
(from each chunk's first nonzero step), and the exact step along every input axis /
along the valid axes only (padded steps skipped, `keras_roll.roll.exact.PackedAxes`);
on the padded batch, the default step against the same batch without padding (each
sequence's valid steps repeated over its padded ones: the padded / unpadded ratio,
target <= 0.59) and against the batch run whole instead of in length buckets
(`keras_roll.roll.buckets`).

    python -m benchmarks.step_time            # full run
    python -m benchmarks.step_time --quick    # a short run (16 and 64 MiB; scoRNN(64))
    python -m benchmarks.step_time --nomnist  # the scoRNN part only
    python -m benchmarks.step_time --nomnist --novowels   # the regularizers beside ROLL only
    python -m benchmarks.step_time --nomnist --novowels --norivals_mmr   # without MMR
    python -m benchmarks.step_time --quick --nomnist --novowels --norivals_mmr  # + IBP, CROWN-IBP

Last, the regularizers beside ROLL on the same MLP and batch, against vanilla in
the same interleaved run: MMR (`keras_roll.MMRConfig`, k_B = 100; l2 along the
300 rows of the first layer's Gram factor, l_inf along the 784 input axes, beside
exact ROLL along the input axes in one chunk) and the input-gradient norm
(`keras_roll.InputGradientConfig`, l2), each step cross-entropy + lam * the term
as `wrap(model, regularizer=...).fit` computes it, then SGD (targets: at most
3 x vanilla); and certified training (`keras_roll.IBPConfig`,
`keras_roll.CrownIBPConfig` at beta = 1, the start of its ramp, where the CROWN pass
runs; l_inf, eps = 0.1): cross-entropy + the term, the paper's
`kappa * CE + (1 - kappa) * CE(worst-case logits)` (targets: IBP at most 2 x, CROWN-IBP
at most 6 x vanilla); beside them, as the cost reference, the same two steps written
out by hand for this MLP in plain TensorFlow (`_hand_margin_bounds`: the same bounds
within float32 rounding, without the library's rounding safety, generic rules and
relative intervals).

FLOP count of the exact step (matmuls only, multiply-add = 2 FLOPs; B = 64,
D = 784 axes, H = 300, L = 10; k = D along the input axes, k = H along the H1
factor rows, k = K along the active units):

* forward of the twin (its logits also feed the cross-entropy) and its backward:
  `3 * 2B(DH + 3H^2 + HL) - 2BDH` (no input gradient);
* tangent forward: the first layer once for all examples (input axes: one-hot
  axes are shared until the first mask, `2 D D H`; factors: `W^T W`, `2 D H H`),
  then `2 B k H^2` per hidden layer 2..4 and `2 B k H L` for the logits' tangent
  (computed by the twin though unused);
* tangent backward: weight and input gradients of layers 2..4 (`2 * 2 B k H^2`
  each) and the first layer's weight gradient (input axes `2 D D H`; factors
  `4 D H H`: `L^-1 W^T` and `Q dR`, or `W P` and its transpose's share).

The elementwise work (masks, squares, reductions) and the active units' small
per-example Cholesky factors (`B K^3 / 3` in float64) are not counted.
"""

from __future__ import annotations

import os
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_roll  # noqa: E402
from benchmarks._util import interleaved_medians, matmul_rate  # noqa: E402
from benchmarks.roll_steps import (  # noqa: E402
    DEPTH,
    EXACT_BUDGETS_MIB,
    H1_FACTOR,
    LAM,
    C,
    D,
    H,
    L,
    build,
    compile_step,
    exact_name,
    exact_step_flops,
    make_steps,
    roll_step,
    sequence_steps,
    vanilla_step,
    vowels_batch,
    weight_reset,
)
from keras_roll.compile.twin import DEFAULT_MEMORY_BUDGET  # noqa: E402
from keras_roll.regularizers.base import labelled_step  # noqa: E402
from keras_roll.regularizers.certified import CrownIBPConfig, IBPConfig  # noqa: E402
from keras_roll.regularizers.input_gradient import InputGradientConfig  # noqa: E402
from keras_roll.regularizers.mmr import MMRConfig  # noqa: E402
from keras_roll.roll import loss as roll  # noqa: E402
from keras_roll.roll.config import RollConfig  # noqa: E402
from keras_roll.roll.estimators import estimator_for  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "A short run: fewer repetitions, budgets 16 and 64 MiB.")
flags.DEFINE_integer("batch", 64, "Batch size.")
flags.DEFINE_integer("samples", 3, "Axes per example of the sampled ROLL.")
flags.DEFINE_bool("mnist", True, "Time the MNIST MLP steps.")
flags.DEFINE_bool("vowels", True, "Time the Japanese Vowels scoRNN exact steps.")
flags.DEFINE_bool("rivals", True, "Time MMR and the input-gradient norm against vanilla.")
flags.DEFINE_bool("rivals_certified", True, "With --rivals, also time IBP and CROWN-IBP.")
flags.DEFINE_bool("rivals_mmr", True, "With --rivals, also time the MMR steps and exact ROLL "
                  "along the input axes (seconds per step on a CPU).")


def main(argv):
    del argv
    tf.get_logger().setLevel("ERROR")  # retracing notes of the per-budget twins
    print(f"machine: {os.cpu_count()} CPU cores, TensorFlow {tf.__version__}, "
          f"Keras {keras.__version__}")
    if FLAGS.mnist:
        _mnist()
    if FLAGS.vowels:
        _vowels(units=64 if FLAGS.quick else 512, repeats=2 if FLAGS.quick else 5)
    if FLAGS.rivals:
        _rivals()


ROLL_AXES = "exact ROLL, 784 input axes, 1 chunk"
RIVALS = {
    "MMR, l2, k_B = 100 (300 factor rows)": MMRConfig(p=2, k_B=100),
    "MMR, l_inf, k_B = 100": MMRConfig(p="inf", k_B=100, gamma_B=0.1, gamma_D=0.1),
    "MMR, l2, k_B = 100, 8 examples / batch": MMRConfig(p=2, k_B=100, examples=8),
    "MMR, l_inf, k_B = 100, 8 examples / batch": MMRConfig(p="inf", k_B=100, gamma_B=0.1,
                                                           gamma_D=0.1, examples=8),
    "input gradient, l2": InputGradientConfig(p=2, lam=0.1),
    "IBP, l_inf, eps = 0.1": IBPConfig(eps=0.1, kappa=0.5),
    "CROWN-IBP, l_inf, eps = 0.1, beta = 1": CrownIBPConfig(eps=0.1, kappa=0.5, beta=1.0),
}
CERTIFIED = ("IBP", "CROWN-IBP")
HAND = {False: "IBP written by hand (reference)", True: "CROWN-IBP written by hand (reference)"}


def _hand_margin_bounds(model: keras.Model, x, y, eps: float, crown: bool):
    """The logits and `[B, L-1]` lower bounds of `z_y - z_j` of the 784-300x4-10 MLP over
    the l_inf ball, written out in plain TensorFlow as the papers state them (no rounding
    safety, no generic rules): IBP (Gowal et al.: clean pass, then centre and radius
    products per layer, the first layer's radius `eps * sum |W|`, the margins folded into
    the last layer), and CROWN-IBP (Zhang et al.: on the same boxes, the chord above and
    the adaptive line below every unstable ReLU, pulled back to the input). The cost
    reference of the library's steps: the same products, the least elementwise work."""
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    ws, bs = [d.kernel for d in dense], [d.bias for d in dense]
    h, pre = x, []
    for w, b in zip(ws[:-1], bs[:-1]):
        pre.append(h @ w + b)
        h = tf.nn.relu(pre[-1])
    logits = h @ ws[-1] + bs[-1]
    r = eps * tf.reduce_sum(tf.abs(ws[0]), 0)[None]
    boxes = [(pre[0] - r, pre[0] + r)]
    for w, b in zip(ws[1:], bs[1:]):
        lo, hi = (tf.nn.relu(t) for t in boxes[-1])
        c, r = ((lo + hi) / 2) @ w + b, ((hi - lo) / 2) @ tf.abs(w)
        boxes.append((c - r, c + r))
    others = tf.one_hot((y[:, None] + tf.range(1, L)) % L, L)
    rows = tf.one_hot(y, L)[:, None] - others                               # [B, L-1, L]
    lo, hi = (tf.nn.relu(t) for t in boxes[-2])
    lam = tf.einsum("bkl,hl->bkh", rows, ws[-1])
    const = tf.einsum("bkl,l->bk", rows, bs[-1])
    ibp = (tf.einsum("bkh,bh->bk", lam, (lo + hi) / 2) + const
           - tf.einsum("bkh,bh->bk", tf.abs(lam), (hi - lo) / 2))
    if not crown:
        return logits, ibp
    for i in range(len(ws) - 2, -1, -1):
        lo, hi = boxes[i]
        unstable = (lo < 0) & (hi > 0)
        a_u = tf.where(hi <= 0, 0.0, tf.where(lo >= 0, 1.0, hi / tf.where(unstable, hi - lo, 1.0)))
        a_l = tf.where(hi <= 0, 0.0, tf.where(lo >= 0, 1.0, tf.cast(hi > -lo, x.dtype)))
        below = lam >= 0
        const += tf.reduce_sum(tf.where(below, 0.0, tf.where(unstable, -a_u * lo, 0.0)[:, None])
                               * lam, -1)
        lam = tf.where(below, a_l[:, None], a_u[:, None]) * lam
        const += tf.einsum("bkh,h->bk", lam, bs[i])
        lam = tf.einsum("bkh,dh->bkd", lam, ws[i])
    bound = tf.einsum("bkd,bd->bk", lam, x) + const - eps * tf.reduce_sum(tf.abs(lam), -1)
    return logits, tf.maximum(bound, ibp)


def _hand_certified_step(model: keras.Model, crown: bool):
    """`kappa CE + (1 - kappa) CE(worst-case logits)` of `_hand_margin_bounds` (eps 0.1,
    kappa 0.5, beta 1), then SGD as in `vanilla_step`."""
    variables = model.trainable_variables

    def step(x, y):
        with tf.GradientTape() as tape:
            logits, lower = _hand_margin_bounds(model, x, y, 0.1, crown)
            worst = tf.concat([tf.zeros_like(lower[:, :1]), -lower], 1)  # label first
            clean = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
            robust = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.zeros_like(y), worst)
            loss = tf.reduce_mean(0.5 * clean + 0.5 * robust)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(0.01 * g)
        return loss

    return step


def _term_step(model: keras.Model, config):
    """Cross-entropy + lam * the config's term, then SGD, as `fit` of the model
    `keras_roll.wrap(model, regularizer=config)` returns computes it (the term's
    outputs are the logits the cross-entropy reads)."""
    term, variables = config.term(model), model.trainable_variables
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.SGD(0.01)

    def step(x, y):
        with tf.GradientTape() as tape, labelled_step(y, ce):
            result = term(x, y, training=True)
            loss = ce(y, result.outputs) + config.lam * tf.reduce_mean(result.per_example)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    return step


def _rivals():
    """Step times of MMR, the input-gradient norm, IBP and CROWN-IBP against vanilla,
    interleaved."""
    b, quick = FLAGS.batch, FLAGS.quick
    model = build()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.uniform(0, 1, size=(b, D)).astype("float32"))
    y = tf.constant(rng.integers(0, L, size=b).astype("int32"))
    steps = {"vanilla": compile_step(vanilla_step(model), b)}
    rivals = {k: c for k, c in RIVALS.items() if FLAGS.rivals_mmr or not k.startswith("MMR")}
    rivals = {k: c for k, c in rivals.items()
              if FLAGS.rivals_certified or not k.startswith(CERTIFIED)}
    if FLAGS.rivals_mmr:
        one_chunk = keras_roll.linearize(model, memory_budget=2**30)
        steps[ROLL_AXES] = compile_step(roll_step(model, one_chunk, fewest_directions=False), b)
    steps.update({name: compile_step(_term_step(model, config), b)
                  for name, config in rivals.items()})
    if FLAGS.rivals_certified:
        for crown in (False, True):
            steps[HAND[crown]] = compile_step(_hand_certified_step(model, crown), b)
    reset = weight_reset(model)
    times = interleaved_medians({k: (lambda s=s: s(x, y).numpy()) for k, s in steps.items()},
                                repeats=5 if quick else 20, warmup=1, setup=reset)
    print(f"regularizers beside ROLL: {D}-{'-'.join([str(H)] * DEPTH)}-{L} ReLU, batch {b}, "
          f"SGD (median of interleaved repetitions)")
    for name, t in times.items():
        ratio = "" if name == "vanilla" else f"   {t / times['vanilla']:7.2f} x vanilla"
        print(f"  {name:<42} {1e3 * t:10.1f} ms/step{ratio}")
    print("targets: MMR and the input-gradient norm at most 3 x vanilla; IBP at most 2 x, "
          "CROWN-IBP at most 6 x")
    for crown, name in HAND.items():
        ours = next((t for k, t in times.items() if k.startswith(CERTIFIED[crown])), None)
        if name in times and ours is not None:
            print(f"ratio {CERTIFIED[crown]} / {name}: {ours / times[name]:6.2f}")
    for name in rivals:
        if name.startswith("MMR"):
            print(f"ratio {name} / {ROLL_AXES}: {times[name] / times[ROLL_AXES]:6.2f}")


def _unpadded(x):
    """`x` with every sequence's valid steps repeated over its padded ones: the batch of
    the same shape without padding (every step valid)."""
    x = x.numpy()
    lengths = np.any(x != 0, axis=-1).sum(axis=1)
    return tf.constant(np.stack([np.resize(seq[:n], seq.shape) for seq, n in zip(x, lengths)]))


def _whole_batch_step(units, shape, batch):
    """The default exact step with the padded batch run whole (before length buckets)."""
    keras.utils.set_random_seed(0)
    model = keras_roll.models.scornn_classifier(units=units)
    lin = keras_roll.linearize(model)
    variables = model.trainable_variables

    def step(x, y):
        with tf.GradientTape() as tape:
            reg, logits = roll.loss_from_config(lin, x, RollConfig(C=C), return_logits=True,
                                                precompute_gradient=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, logits, from_logits=True)) + LAM * tf.reduce_mean(reg)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(0.01 * g)
        return loss

    spec = [tf.TensorSpec([batch, *shape]), tf.TensorSpec([batch], tf.int32)]
    compiled = tf.function(step, input_signature=spec, autograph=False)
    with mock.patch.object(roll, "buckets_apply", lambda *args: False):
        compiled.get_concrete_function()  # traced without the buckets
    return compiled


def _vowels(units, repeats):
    """Exact scoRNN steps: every input axis / valid axes only, padded and bucketed; the
    padded batch against the same batch without padding."""
    now_name = "exact ROLL, every input axis"
    for bucketed in (False, True):
        x, y = vowels_batch(32, bucketed=bucketed)
        valid = float(np.mean(np.any(x.numpy() != 0, axis=-1)))
        steps = sequence_steps(units, tuple(x.shape[1:]), 32)
        fns = {k: (lambda s=s, x=x, y=y: s(x, y).numpy()) for k, s in steps.items()}
        if not bucketed:
            full = _unpadded(x)
            whole = _whole_batch_step(units, tuple(x.shape[1:]), 32)
            fns[f"{now_name}, whole batch"] = lambda s=whole, x=x, y=y: s(x, y).numpy()
            fns[f"{now_name}, unpadded batch"] = (
                lambda s=steps[now_name], x=full, y=y: s(x, y).numpy())
        times = interleaved_medians(fns, repeats=repeats, warmup=1)
        label = "similar lengths" if bucketed else "padded to the split's longest"
        print(f"Japanese Vowels scoRNN({units}), batch 32 {label}: {x.shape[1]} steps, "
              f"{100 * valid:.0f} % valid")
        for name, t in times.items():
            print(f"  {name:<46} {1e3 * t:10.1f} ms/step")
        now = times[now_name]
        before = times["exact ROLL, every axis and step (before)"]
        print(f"the step before / the step now (the loop from each chunk's first step): "
              f"{before / now:6.2f}" + ("  (target >= 1.7)" if not bucketed else ""))
        print(f"every axis / valid axes only: {now / times['exact ROLL, valid axes only']:6.2f}")
        if not bucketed:
            print(f"padded / unpadded batch (the default step; {100 * valid:.0f} % valid): "
                  f"{now / times[f'{now_name}, unpadded batch']:6.2f}  (target <= 0.59)")
            print(f"whole batch / length buckets (padded): "
                  f"{times[f'{now_name}, whole batch'] / now:6.2f}")


def _mnist():
    b, samples, quick = FLAGS.batch, FLAGS.samples, FLAGS.quick
    reps = 3 if quick else 10
    # matmul rates first, on a quiet machine
    mm = {"[2048x2048]^2": matmul_rate(2048, 2048, 2048, repeats=reps),
          f"[{b * D}x{H}]@[{H}x{H}]": matmul_rate(b * D, H, H, repeats=reps)}
    model = build()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.uniform(0, 1, size=(b, D)).astype("float32"))
    y = tf.constant(rng.integers(0, L, size=b).astype("int32"))
    budgets = EXACT_BUDGETS_MIB[:2] if quick else EXACT_BUDGETS_MIB
    fast, exact, slow, lins = make_steps(model, b, samples, budgets)
    reset = weight_reset(model)  # every step timed from the initial weights
    times = interleaved_medians({k: (lambda s=s: s(x, y).numpy()) for k, s in fast.items()},
                                repeats=10 if quick else 60, setup=reset)
    times.update(interleaved_medians({k: (lambda s=s: s(x, y).numpy())
                                      for k, s in exact.items()},
                                     repeats=3 if quick else 9, warmup=1, setup=reset))
    if not quick:
        times.update(interleaved_medians({k: (lambda s=s: s(x, y).numpy())
                                          for k, s in slow.items()}, repeats=3, warmup=1,
                                         setup=reset))
    reset()
    print(f"network: {D}-{'-'.join([str(H)] * DEPTH)}-{L} ReLU, batch {b}, SGD, "
          f"lam={LAM}, C={C}, gamma=100 (median of interleaved repetitions)")
    for name, t in times.items():
        print(f"  {name:<38} {1e3 * t:10.1f} ms/step")
    lin = lins["auto"]
    k = int(estimator_for(lin, x, RollConfig(), 0, trace=lin.primal(x).trace).total)
    print(f"active units of the first layer: at most {k} of {H} per example in this batch")
    _report_exact(times, budgets, lins, x)
    _report_sampled(times, samples)
    _report_rates(times, budgets, mm, b, reps, k)


def _report_exact(times, budgets, lins, x):
    """The active units' speed-up, and the chunk plans of both paths."""
    for mib in budgets:
        ratio = times[exact_name(False, mib)] / times[exact_name(True, mib)]
        print(f"ratio input axes / active units at {mib:4d} MiB: {ratio:6.2f}")
    old = min(budgets, key=lambda m: times[exact_name(False, m)])
    new = min(budgets, key=lambda m: times[exact_name(True, m)])
    print(f"ratio best input axes ({old} MiB) / best active units ({new} MiB): "
          f"{times[exact_name(False, old)] / times[exact_name(True, new)]:6.2f}  (target >= 3)")
    default = DEFAULT_MEMORY_BUDGET // 2**20
    auto = times[exact_name(True, "auto")]
    print(f"ratio H1 factor rows / active units, both 'auto': {times[H1_FACTOR] / auto:6.2f}")
    print(f"ratio input axes at the former default ({default} MiB) / active units with "
          f"'auto': {times[exact_name(False, default)] / auto:6.2f}  (the step before / after)")
    auto_plan = roll.memory_plan(lins["auto"], x)
    best_plan = roll.memory_plan(lins[new], x)
    same = (best_plan.chunks, best_plan.per_chunk) == (auto_plan.chunks, auto_plan.per_chunk)
    print(f"ratio active units 'auto' / best fixed budget ({new} MiB): "
          f"{auto / times[exact_name(True, new)]:6.3f}  (target <= 1.05; 'auto' chose "
          f"{auto_plan.memory_budget / 2**20:.2f} MiB, {auto_plan.chunks} chunk(s)"
          + (": the same chunks, so the ratio is timing noise)" if same else ")"))
    for mib in budgets:
        for fewest in (False, True):
            plan = roll.memory_plan(lins[mib], x, RollConfig(fewest_directions=fewest))
            print(f"  budget {mib:5d} MiB, {'active units' if fewest else 'input axes  '}: "
                  f"{plan.chunks:3d} chunk(s) of {plan.per_chunk} directions "
                  f"({plan.bytes_per_direction / 2**20:.2f} MiB per direction)")


def _report_sampled(times, samples):
    sampled = times[f"sampled ROLL, {samples} axes"]
    shared = times[f"sampled ROLL, {samples} shared axes"]
    print(f"ratio sampled({samples}) / vanilla:   {sampled / times['vanilla']:6.2f}  "
          f"(target <= 2.5; axes shared by the batch: {shared / times['vanilla']:.2f})")
    autodiff = times.get("exact ROLL, autodiff batch_jacobian")
    if autodiff is not None:
        best = min((k for k in times if k.startswith("exact ROLL, input")), key=times.get)
        print(f"ratio autodiff / perturbation along the input axes: "
              f"{autodiff / times[best]:6.2f}  (target >= 4; {best})")


def _report_rates(times, budgets, mm, b, reps, k):
    """Achieved GFLOP/s of the best exact step of each path beside matmul rates."""
    rates = {}
    for fewest in (False, True):
        mib = min(budgets, key=lambda m: times[exact_name(fewest, m)])
        flops = exact_step_flops(b, k if fewest else D)
        rates[fewest] = sum(flops.values()) / times[exact_name(fewest, mib)] / 1e9
        print(f"exact step, {f'active units (K = {k})' if fewest else 'input axes'}: "
              f"{sum(flops.values()) / 1e9:.1f} GFLOP ("
              + ", ".join(f"{name} {v / 1e9:.1f}" for name, v in flops.items())
              + f") -> {rates[fewest]:.1f} GFLOP/s at {mib} MiB")
    rows = b * (H // 4)
    mm[f"[{rows}x{H}]@[{H}x{H}]"] = matmul_rate(rows, H, H, repeats=reps)
    for name, r in mm.items():
        print(f"matmul {name:<24} {r:7.1f} GFLOP/s   exact step (input axes) / this: "
              f"{rates[False] / r:.2f}")
    print(f"exact step (input axes) / best measured matmul: "
          f"{rates[False] / max(mm.values()):.2f}  (target >= 0.50)")


if __name__ == "__main__":
    app.run(main)
