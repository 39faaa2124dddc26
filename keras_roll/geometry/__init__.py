"""lp geometry shared by every job: dual norms, steepest directions, dicts keyed by
norm, and the numpy of a tensor. It sits below the compiler (whose linear relaxation
minimises over an lp ball with `dual_norm`) and above the shared options (whose
`parse_norm` names the norms). docs/design.md, section "Module map".

Example:

```python
from keras_roll.geometry import NormDict, dual_norm, steepest_directions

dual_norm(np.array([3.0, -4.0]), np.inf)                   # 7.0 (||g||_1)
steepest_directions(np.array([[3.0, -4.0]]), 2, np.ones(1))  # [[0.6, -0.8]]
NormDict({2: 0.5})["l2"]                                   # 0.5
```
"""

from keras_roll.geometry.norm_dict import NORM_LABELS, NormDict
from keras_roll.geometry.norms import NORM_ORDER, dual_norm, norm_code, steepest_directions
from keras_roll.geometry.tensors import to_numpy

__all__ = ["NORM_LABELS", "NORM_ORDER", "NormDict", "dual_norm", "norm_code",
           "steepest_directions", "to_numpy"]
