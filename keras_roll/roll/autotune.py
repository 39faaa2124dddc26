"""`memory_budget="auto"` for ROLL: the chunk size from a short timed probe.

The fastest chunk of ROLL's tangents depends on the machine (cache sizes,
memory bandwidth, threads): on one CPU 16 MiB chunks beat a single chunk, on
another the reverse. With the default `memory_budget` (None or "auto") and a
twin built with "auto" (`keras_roll.linearize(model)`), the first ROLL call on
a per-example shape times the step on random inputs of that shape under each
candidate budget of `keras_roll.compile.chunking.auto_candidates` (16, 64, 256
MiB and one chunk, within `AUTO_CAP`) and keeps the fastest for the model and
the shape (`remembered_budget`). Candidates that cut the work alike are one;
a step that fits one chunk under all of them is never probed. The probe runs
eagerly (`tf.init_scope`), also when the call is traced inside `fit`; a
dynamic batch is probed at `DEFAULT_EXAMPLES` examples; a variable
per-example shape, or a `tf.distribute` strategy (whose variables the probe
would read across replicas), keeps the twin's budget. docs/design.md, "Chunk
sizes by measurement".

Example:

```python
config = tuned_config(lin, x, RollConfig(), precompute=True, run=step_fn)
config.memory_budget      # bytes, the probe's choice (or the caller's fixed budget)
```
"""

from __future__ import annotations

import dataclasses
import time

import tensorflow as tf

from keras_roll.compile.chunking import (
    DEFAULT_EXAMPLES,
    auto_candidates,
    choose_budget,
    remembered_budget,
)
from keras_roll.options import fixed_budget
from keras_roll.roll.chunks import plan_directions_for
from keras_roll.roll.config import RollConfig, RollPlan
from keras_roll.roll.estimators import estimator_for

__all__ = ["tuned_config"]

_PROBE_FIELDS = ("samples", "strata", "estimator", "share_axes", "wrt", "tangent_dtype",
                 "fewest_directions", "skip_padded_steps")


def tuned_config(lin, x, config: RollConfig | RollPlan, precompute: bool, run
                 ) -> RollConfig | RollPlan:
    """`config` with a memory budget in bytes: its own, the twin's, or the probe's choice
    (a `RollPlan` gives a `RollPlan`, whose entry the probe reuses).

    Args:
        lin: the `Linearized` model.
        x: the batch (its static shape decides the probe's inputs).
        config: the ROLL hyperparameters, or their `RollPlan`; a fixed
            `memory_budget` is kept.
        precompute: whether the step differentiates the loss (a training
            step): the probe then times the loss and its weight gradient.
        run: `fn(config, x) -> [B]` the per-example loss the probe times
            (`keras_roll.roll.loss.loss_from_config` with the caller's flags).

    Example:

    ```python
    config = tuned_config(lin, x, config, True, lambda c, xb: loss_from_config(lin, xb, c))
    ```
    """
    plan = config if isinstance(config, RollPlan) else None
    config = config.config if plan is not None else config
    budget = fixed_budget(config.memory_budget)
    if budget is None:
        budget = lin.memory_budget
        shape = x.shape[1:]
        if getattr(lin, "auto_budget", False) and shape.is_fully_defined() \
                and not tf.distribute.has_strategy():
            batch = x.shape[0] or DEFAULT_EXAMPLES
            kept = tuple(getattr(config, name) for name in _PROBE_FIELDS)
            key = ("roll", lin.dtype, tuple(shape.as_list()), batch, kept, bool(precompute))
            budget = remembered_budget(lin.model, key, lambda: _probe(
                lin, [batch, *shape.as_list()], plan or config, precompute, run))
    tuned = dataclasses.replace(config, memory_budget=int(budget))
    return tuned if plan is None else plan.with_config(tuned)


def _probe(lin, shape, config, precompute, run) -> int:
    """The fastest candidate budget for a ROLL step on random inputs of `shape`
    (`config`: a `RollConfig` or its `RollPlan`)."""
    with tf.init_scope():
        x = tf.random.stateless_uniform(shape, [7, 11], -1.0, 1.0, dtype=lin.dtype)
        fwd = lin.primal(x)
        est = estimator_for(lin, x, config, 0, trace=fwd.trace)
        config = config.config if isinstance(config, RollPlan) else config
        plans = auto_candidates(lambda b: plan_directions_for(lin, fwd, x, est, b))
        variables = lin.model.trainable_variables
        steps = {}

        def step_for(budget):
            cfg = dataclasses.replace(config, memory_budget=budget)

            def step(xb):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(run(cfg, xb))
                if not precompute:
                    return loss
                grads = tape.gradient(loss, variables)
                return tf.add_n([loss] + [tf.reduce_sum(g) for g in grads if g is not None])

            fn = tf.function(step, input_signature=[tf.TensorSpec(x.shape, x.dtype)],
                             autograph=False)
            # Each budget is its own graph, traced once here: a concrete function keeps
            # these deliberate traces out of TensorFlow's retracing warning, which counts
            # the traces of every function made from `step` together.
            return fn if tf.config.functions_run_eagerly() else fn.get_concrete_function()

        def seconds(budget, plan):
            if budget not in steps:
                steps[budget] = step_for(budget)
            start = time.perf_counter()
            steps[budget](x).numpy()
            return time.perf_counter() - start

        return choose_budget(plans, seconds, min_chunks=2)
