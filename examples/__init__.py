"""Runnable keras_roll examples (absl apps): `python -m examples.<name> --flagfile=...`."""
