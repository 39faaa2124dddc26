"""keras_roll: certify, train for and inspect the local linearity of
piecewise-linear Keras networks.

Reference: G.-H. Lee, D. Alvarez-Melis, T. S. Jaakkola, "Towards Robust, Locally
Linear Deep Networks", ICLR 2019.

Example:

```python
import keras_roll

cert = keras_roll.certify(model, x)          # l1 / l2 / l_inf margins per input
cert.summary()
wrapped = keras_roll.wrap(model, lam=2.0, C=1.0)
wrapped.compile("sgd", "sparse_categorical_crossentropy")
wrapped.fit(x_train, y_train)
```
"""

from keras_roll import attribution, callbacks, layers, models, plots, regularizers, testing
from keras_roll.attribution import (
    Faithfulness,
    IntegratedGradients,
    Saliency,
    SmoothGrad,
    faithfulness,
    integrated_gradients,
    saliency,
    smoothgrad,
    stable_radius,
)
from keras_roll.attribution.distortion import Distortion, gradient_distortion
from keras_roll.callbacks import MarginMonitor
from keras_roll.certification.certificates import Certificate, StabilityBounds
from keras_roll.certification.margins import certify, l2_margins, lp_margins
from keras_roll.certification.region_map import RegionMap, region_map
from keras_roll.certification.regions import RegionCount, count_regions
from keras_roll.certification.stability import stability_bounds
from keras_roll.certification.zero_radii import ZeroCause
from keras_roll.compile import rules
from keras_roll.compile.rules import register_rule
from keras_roll.compile.twin import Linearized, linearize, unwrap
from keras_roll.errors import UnsupportedModelError
from keras_roll.options import Rigor, RunOptions
from keras_roll.regularizers import (
    CrownIBPConfig,
    IBPConfig,
    InputGradientConfig,
    MMRConfig,
    RegularizerConfig,
    RollModel,
    RollRegularizer,
    SupervisedRegularizer,
    register_regularizer,
    regularizer_loss,
    worst_case_logits,
    wrap,
)
from keras_roll.robust import RobustRadius, robust_radius
from keras_roll.roll.config import RollConfig
from keras_roll.roll.loss import roll_loss

__version__ = "0.1.0"

__all__ = [
    "Certificate",
    "Distortion",
    "IntegratedGradients",
    "Saliency",
    "attribution",
    "gradient_distortion",
    "integrated_gradients",
    "plots",
    "saliency",
    "SmoothGrad",
    "smoothgrad",
    "Faithfulness",
    "faithfulness",
    "stable_radius",
    "MarginMonitor",
    "RollConfig",
    "RollModel",
    "RollRegularizer",
    "Linearized",
    "RegionCount",
    "Rigor",
    "RunOptions",
    "RegionMap",
    "RobustRadius",
    "StabilityBounds",
    "UnsupportedModelError",
    "ZeroCause",
    "certify",
    "count_regions",
    "region_map",
    "l2_margins",
    "linearize",
    "lp_margins",
    "register_rule",
    "robust_radius",
    "roll_loss",
    "rules",
    "stability_bounds",
    "unwrap",
    "wrap",
    "callbacks",
    "models",
    "layers",
    "testing",
    "regularizers",
    "MMRConfig",
    "InputGradientConfig",
    "IBPConfig",
    "CrownIBPConfig",
    "worst_case_logits",
    "SupervisedRegularizer",
    "RegularizerConfig",
    "register_regularizer",
    "regularizer_loss",
]
