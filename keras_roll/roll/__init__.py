"""ROLL's machinery: the regularizer of Eq. 9 / 10 (`roll_loss`), its config
(`RollConfig`), its twin-based estimators and its exact and sampled passes, and
`MarginMonitor`. The layer that trains with it, `wrap` and the other
regularizers are `keras_roll.regularizers`. docs/design.md, section "Data flow
of a ROLL training step".
"""
