"""ROLL training: the regularizer (Eq. 9, 10), its estimators, the wrapped model
and callbacks. docs/design.md, section "Data flow of a ROLL training step".
"""
