"""Floating-point rounding guards of certificates (the three rigors).

docs/design.md, section "The rounding bound".
"""
