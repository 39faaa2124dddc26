"""ROLL's machinery: the regularizer of Eq. 9 / 10 (`roll_loss`), its config
(`RollConfig`), its twin-based estimators and its exact and sampled passes, and
`MarginMonitor`. The layer that trains with it, `wrap` and the other
regularizers are `keras_roll.regularizers`. docs/design.md, section "Data flow
of a ROLL training step".
"""

from keras_roll.roll.callbacks import MarginMonitor
from keras_roll.roll.chunks import sum_squares
from keras_roll.roll.config import RollConfig, resolve_config
from keras_roll.roll.entry import roll_plan
from keras_roll.roll.factored import factored_entry, gram_factor
from keras_roll.roll.loss import loss_from_config, neuron_grad_sq, roll_loss

__all__ = ["MarginMonitor", "RollConfig", "factored_entry", "gram_factor", "loss_from_config",
           "neuron_grad_sq", "resolve_config", "roll_loss", "roll_plan", "sum_squares"]
