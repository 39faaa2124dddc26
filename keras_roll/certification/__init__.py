"""Certificates: lp and directional margins, stability bounds, region counts,
and the bisection cross-check. docs/design.md, section "Data flow of certify".

The names below are the package's public face: the other jobs (`robust`,
`attribution`, `roll`) import only these (`tests/test_package_imports.py`).

Example:

```python
from keras_roll.certification import certify

cert = certify(model, x)
cert.margins["l2"]                   # [B] certified l2 radii
```
"""

from keras_roll.certification.certificates import Certificate, StabilityBounds
from keras_roll.certification.margin_math import directional_margins
from keras_roll.certification.margins import certify, l2_margins, lp_margins
from keras_roll.certification.region_map import RegionMap, region_map
from keras_roll.certification.regions import RegionCount, count_regions
from keras_roll.certification.stability import stability_bounds
from keras_roll.certification.zero_radii import ZeroCause

__all__ = [
    "Certificate",
    "RegionCount",
    "RegionMap",
    "StabilityBounds",
    "ZeroCause",
    "certify",
    "count_regions",
    "directional_margins",
    "l2_margins",
    "lp_margins",
    "region_map",
    "stability_bounds",
]
