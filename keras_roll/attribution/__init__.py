"""Attributions for piecewise-linear networks: saliency maps, exact integrated
gradients, and the certified radius within which a saliency map is unchanged.

Example:

```python
sal = keras_roll.saliency(model, x, y, postprocess=True, radius=True)  # Appendix K maps
sal.radius[2]                                               # certified l2 radii
ig = keras_roll.integrated_gradients(model, x, y)           # exact, region by region
ig.regions                                                  # regions the path crosses
```
"""

from keras_roll.attribution.distortion import DistortionMode
from keras_roll.attribution.faithfulness import Faithfulness, Score, faithfulness
from keras_roll.attribution.gradients import LogitGradients
from keras_roll.attribution.integrated import (
    IntegratedGradients,
    PathMethod,
    RiemannRule,
    integrated_gradients,
)
from keras_roll.attribution.result import Attribution
from keras_roll.attribution.saliency import (
    Saliency,
    postprocess_saliency,
    saliency,
    stable_radius,
)
from keras_roll.attribution.smoothgrad import SmoothGrad, smoothgrad

__all__ = [
    "Attribution",
    "DistortionMode",
    "Faithfulness",
    "PathMethod",
    "RiemannRule",
    "Score",
    "IntegratedGradients",
    "LogitGradients",
    "Saliency",
    "SmoothGrad",
    "integrated_gradients",
    "faithfulness",
    "postprocess_saliency",
    "saliency",
    "smoothgrad",
    "stable_radius",
]
