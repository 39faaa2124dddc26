"""The lines the certificates' `summary()` adds below their tables: what the rounding
guard guarantees (`rigor_line`). `Summary`, the object every `summary()` returns, and
`format_table` live in `keras_roll.summary` (`Summary` re-exported here).

Example:

```python
rigor_line(Rigor.FLOAT64, "float32")   # 'Rounding guard: probabilistic, ...'
cert.summary()            # a Summary: shows the table in a notebook or a REPL
```
"""

from __future__ import annotations

from keras_roll.options import Rigor
from keras_roll.rounding.noise import FAILURE_PROBABILITY, KAPPA, LAMBDA, SAMPLES
from keras_roll.summary import Summary

__all__ = ["Summary", "rigor_line"]


def rigor_line(rigor: Rigor, evaluation: str) -> str:
    """The summary line that says what a certificate's rounding guard guarantees.

    Example:

    ```python
    rigor_line(Rigor.FLOAT64, "float32")   # 'Rounding guard: probabilistic, ...'
    ```
    """
    rigor = Rigor.parse(rigor)
    if rigor is Rigor.FLOAT32:
        return (f"Rigor float32: the float32 twin's radii, not guarded against rounding "
                f"(the model evaluates in {evaluation}).")
    if rigor is Rigor.STRICT:
        return (f"Rounding guard: worst case (rigor 'strict'): radii shrunk by a rigorous "
                f"bound on rounding; sound for the model evaluated in {evaluation}.")
    return (f"Rounding guard: probabilistic (rigor 'float64'): radii shrunk by "
            f"{LAMBDA:g} x {KAPPA:g} estimated standard deviations of the rounding of the "
            f"model evaluated in {evaluation} (Higham & Mary's model; {SAMPLES} Gaussian "
            f"probes), or by the worst-case bound where smaller; a neuron of a point fails "
            f"with probability < {FAILURE_PROBABILITY:.1e}. rigor='strict' for the worst "
            f"case alone.")
