"""Keras layers shipped with keras_roll (each with a registered linearization rule).

* `ScoRNN` / `ScoRNNCell`: the scaled-Cayley orthogonal RNN (Helfrich, Willmott
  & Ye, ICML 2018), the recurrent model of the ROLL paper's Japanese Vowels
  experiment.
"""

from keras_roll.layers.scornn import CayleyInitializer, ScoRNN, ScoRNNCell

__all__ = ["CayleyInitializer", "ScoRNN", "ScoRNNCell"]
