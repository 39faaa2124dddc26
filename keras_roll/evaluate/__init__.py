"""Deprecated name of `keras_roll.attribution`; kept for one release.

`import keras_roll.evaluate` (and its submodules, say `keras_roll.evaluate.saliency`)
still works and warns with a `DeprecationWarning`; import from
`keras_roll.attribution` instead.
"""

import importlib
import pkgutil
import sys
import warnings

from keras_roll import attribution as _attribution
from keras_roll.attribution import *  # noqa: F403
from keras_roll.attribution import __all__  # noqa: F401

warnings.warn(
    "keras_roll.evaluate was renamed keras_roll.attribution; import from "
    "keras_roll.attribution (the old name goes in the next release).",
    DeprecationWarning, stacklevel=2)

for _info in pkgutil.iter_modules(_attribution.__path__):
    sys.modules[f"{__name__}.{_info.name}"] = importlib.import_module(
        f"keras_roll.attribution.{_info.name}")
