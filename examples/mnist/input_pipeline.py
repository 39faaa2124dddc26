"""The data of the MNIST example: the paper's split (`examples.common.data`) with the
model's input normalisation that `--normalize` asks for.

Example:

```python
data = load_data(config)
data.name, data.classes, data.normalize          # 'MNIST', 10, (0.1307, 0.3081)
(x, y), (xv, yv), (xt, yt) = data.train, data.val, data.test
```
"""

from __future__ import annotations

from examples.common.data import Data, load_split
from examples.mnist.configs.default import Config, parse_normalize

__all__ = ["load_data"]


def load_data(config: Config) -> Data:
    """The paper's split (`examples.common.data.load_split`), with the normalisation
    `--normalize` asks for.

    Raises:
        UsageError: no data set where `--data_dir` points, or too few images for
            `--val_size`.
    """
    return load_split(config, parse_normalize(config.normalize))
