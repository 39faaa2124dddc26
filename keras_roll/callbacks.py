"""Keras callbacks of keras_roll (as `keras.callbacks` is for Keras).

Example:

```python
from keras_roll.callbacks import MarginMonitor

model.fit(x, y, epochs=5, callbacks=[MarginMonitor(x_val[:256])])
```
"""

from keras_roll.regularizers.ramps import BetaRamp, EpsilonRamp, KappaRamp, LinearRamp
from keras_roll.roll.callbacks import MarginMonitor

__all__ = ["BetaRamp", "EpsilonRamp", "KappaRamp", "LinearRamp", "MarginMonitor"]
