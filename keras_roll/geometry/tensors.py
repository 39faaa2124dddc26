"""The numpy array of a tensor, for results that are numpy (docs/design.md, section
"Return types").

Example:

```python
to_numpy(tf.constant([1.0, 2.0]))      # array([1., 2.], dtype=float32)
```
"""

from __future__ import annotations

import numpy as np
from keras import ops

__all__ = ["to_numpy"]


def to_numpy(t) -> np.ndarray:
    """A numpy array of a tensor (or of an array, unchanged in dtype).

    Example:

    ```python
    to_numpy(tf.constant([1.0]))     # array([1.], dtype=float32)
    ```
    """
    return np.asarray(ops.convert_to_numpy(t))
