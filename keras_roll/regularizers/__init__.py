"""The regularizer family: ROLL, MMR, the input-gradient norm, IBP and CROWN-IBP,
each one registered config class, trained with `keras_roll.wrap(model,
regularizer=config)`.

* `base`: what the family shares (`RegularizerConfig`, `TermResult`, the labels
  of a step, the checks of the fields, the dual norm);
* `registry`: `register_regularizer`, how `wrap` finds a config;
* `supervised`: `SupervisedRegularizer`, the layer of every term but ROLL's;
* `roll`, `mmr`, `input_gradient`, `certified`: one module per regularizer
  (ROLL's machinery itself is `keras_roll.roll`);
* `ramps`: the schedules of certified training (`EpsilonRamp`, ...);
* `wrap`, `loss`: `wrap` / `RollModel` and `regularizer_loss`.

docs/design.md, section "Regularizers beside ROLL"; docs/guide.md shows a
regularizer of one's own.

Example:

```python
wrapped = keras_roll.wrap(model, regularizer=keras_roll.MMRConfig(p="inf", gamma_B=0.1))
```
"""

from keras_roll.regularizers.base import (
    RegularizerConfig,
    TermResult,
    current_labels,
    evaluating,
    labelled_step,
)
from keras_roll.regularizers.certified import (
    CrownIBPConfig,
    IBPConfig,
    certified_terms,
    worst_case_logits,
)
from keras_roll.regularizers.input_gradient import InputGradientConfig
from keras_roll.regularizers.loss import regularizer_loss
from keras_roll.regularizers.mmr import MMRConfig, mmr_distances
from keras_roll.regularizers.ramps import BetaRamp, EpsilonRamp, KappaRamp, LinearRamp
from keras_roll.regularizers.registry import (
    Registration,
    register_regularizer,
    registered_regularizers,
)
from keras_roll.regularizers.roll import RollRegularizer
from keras_roll.regularizers.supervised import SupervisedRegularizer
from keras_roll.regularizers.wrap import RollModel, wrap

__all__ = ["BetaRamp", "CrownIBPConfig", "EpsilonRamp", "IBPConfig", "InputGradientConfig",
           "KappaRamp", "LinearRamp", "MMRConfig", "Registration", "RegularizerConfig",
           "RollModel", "RollRegularizer", "SupervisedRegularizer", "TermResult",
           "certified_terms", "current_labels", "evaluating", "labelled_step",
           "mmr_distances", "register_regularizer", "registered_regularizers",
           "regularizer_loss", "worst_case_logits", "wrap"]
