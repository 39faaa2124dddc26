"""Model builders for the paper's experiments.

* :func:`fc`: the fully connected MNIST network (784-300x4-10 by default).
* :func:`scornn_classifier`: Masking + scoRNN (LeakyReLU, 512 units) + Dense, the
  Japanese Vowels model.
* :func:`resnet18`: ResNet-18 for Caltech-256 (average pooling after the stem),
  layer for layer like torchvision's, and :func:`load_torchvision_resnet18` to load
  torchvision weights exported to ``.npz``.

Every model puts its input normalisation inside the network, so margins come out in
the units of the data as loaded (``[0, 1]`` pixels).

Example:

```python
import keras_roll
mlp = keras_roll.models.fc()                              # MNIST, inputs in [0, 1]
net = keras_roll.models.resnet18((299, 299, 3), classes=256)
```
"""

from keras_roll.models.fc import fc
from keras_roll.models.preprocessing import input_normalization
from keras_roll.models.resnet import resnet18
from keras_roll.models.rnn import scornn_classifier
from keras_roll.models.torchvision_weights import TorchvisionWeights, load_torchvision_resnet18

__all__ = [
    "TorchvisionWeights",
    "fc",
    "input_normalization",
    "load_torchvision_resnet18",
    "resnet18",
    "scornn_classifier",
]
