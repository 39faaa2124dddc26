"""Keras callbacks: monitor the l2 margin of the linear regions during training."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_roll.certification import l2_margins
from keras_roll.compile.twin import Linearized, linearize, unwrap
from keras_roll.compile.units import resolve_units
from keras_roll.inputs import is_stream, stream_elements
from keras_roll.options import Rigor

PERCENTILES = (25, 50, 75, 100)


def _write_scalar(tag, value, step):
    """`tf.summary.scalar` without needing the tensorboard package installed.

    Writes the tensor summary with the "scalars" plugin metadata, exactly what
    TensorBoard's own scalar summary writes.
    """
    from tensorflow.core.framework import summary_pb2

    meta = summary_pb2.SummaryMetadata()
    meta.plugin_data.plugin_name = "scalars"
    tf.summary.write(tag, tf.constant(value, tf.float32), step=step,
                     metadata=meta.SerializeToString())


class MarginMonitor(keras.callbacks.Callback):
    """Logs percentiles of the l2 margin of the linear regions on `x_val`.

    Every `every` epochs it computes, for each example of `x_val`, the radius
    of the largest l2 ball around it inside its linear region (Lee et al.,
    ICLR 2019, Prop. 6: `min_j |z_j| / ||grad_x z_j||_2`, exact gradients from the
    frozen-pattern twin, `keras_roll.l2_margins`) of the plain model (a model made by
    `keras_roll.roll.loss.wrap` is unwrapped), and adds `margin_l2_p25`,
    `margin_l2_p50`, `margin_l2_p75` and `margin_l2_p100` to the epoch `logs`,
    so they appear in `History` (one entry per monitored epoch; nearest-rank
    percentiles, numpy `method="nearest"`, so infinite margins never turn into
    NaN). With `log_dir`
    they are also written to TensorBoard (`tf.summary`, step = epoch).

    Args:
        x_val: `[B, *input_shape]` examples, or a stream of batches (a
            `tf.data.Dataset` or `keras.utils.PyDataset`, re-read at every
            monitored epoch; a generator or iterator, read once here and kept)
            of `x`, `(x, y)` or `(x, y, w)`, batched or not.
        every: monitor every `every` epochs (1 = every epoch).
        log_dir: optional TensorBoard log directory.
        batch_size: examples per margin computation.
        rigor: "float32" (default: a training-time indicator, at half the
            cost) or "float64" (the certified radii of `keras_roll.certify`).
        wrt: None (margins in the model's input units), or the name of a leading
            Rescaling / Normalization layer with a scalar scale: margins in its
            output's units (as `keras_roll.certify`'s `wrt`), e.g. [0, 1] pixels
            for a model that takes 0-255 pixels behind `Rescaling(1 / 255)`.

    Example:

    ```python
    monitor = keras_roll.roll.callbacks.MarginMonitor(x_val, every=5)
    history = wrapped.fit(x, y, epochs=50, callbacks=[monitor])
    history.history["margin_l2_p50"]
    MarginMonitor(x_val, wrt="rescaling")     # margins in the Rescaling's output units
    ```
    """

    def __init__(self, x_val, every: int = 1, log_dir: str | None = None,
                 batch_size: int = 256, rigor: str = "float32", wrt: str | None = None):
        super().__init__()
        if not isinstance(every, (int, np.integer)) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be a positive int, got every={every!r}.")
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got batch_size={batch_size!r}.")
        self.rigor = Rigor.parse(rigor)
        if wrt is not None and not isinstance(wrt, str):
            raise TypeError(f"wrt must be a layer name (str) or None, got {wrt!r}.")
        self.wrt = wrt
        if isinstance(x_val, (tf.data.Dataset, keras.utils.PyDataset)):
            self.x_val = x_val  # re-iterable: read at every monitored epoch
        elif is_stream(x_val):  # a generator can be read once: keep its batches
            self.x_val = [xe for xe, _ in stream_elements(x_val)]
            if not self.x_val:
                raise ValueError("x_val is an empty stream; pass at least one example.")
        else:
            self.x_val = np.asarray(x_val)
            if len(self.x_val) == 0:
                raise ValueError("x_val is empty; pass at least one example.")
        self.every = int(every)
        self.log_dir = log_dir
        self.batch_size = int(batch_size)
        self._lin = None
        self._lin_model = None
        self._writer = None

    def _linearized(self):
        plain = unwrap(self.model)
        if self._lin is None or self._lin_model is not plain:
            for layer in getattr(self.model, "layers", []):
                twin = getattr(layer, "linearized", None)  # a RollRegularizer's
                if isinstance(twin, Linearized) and getattr(layer, "inner_model", None) is plain:
                    self._lin = twin  # reuse the twin of the regularizer
                    break
            else:
                self._lin = linearize(plain)
            self._lin_model = plain
        return self._lin

    def margins(self) -> np.ndarray:
        """The current l2 margins of `x_val`, `[B]` (numpy), in the units of `wrt`."""
        lin = self._linearized()
        units = resolve_units(lin.program, self.wrt)
        x = iter(self.x_val) if isinstance(self.x_val, list) else self.x_val  # kept elements
        return units.to_units(l2_margins(lin, x, batch_size=self.batch_size, rigor=self.rigor))

    def on_train_begin(self, logs=None):
        resolve_units(self._linearized().program, self.wrt)  # a bad wrt fails at once

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every:
            return
        values = np.percentile(self.margins(), PERCENTILES, method="nearest")
        stats = {f"margin_l2_p{q}": float(v) for q, v in zip(PERCENTILES, values)}
        if logs is not None:
            logs.update(stats)
        if self.log_dir is not None:
            if self._writer is None:
                self._writer = tf.summary.create_file_writer(self.log_dir)
            with self._writer.as_default():
                for key, value in stats.items():
                    _write_scalar(key, value, epoch)
            self._writer.flush()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
