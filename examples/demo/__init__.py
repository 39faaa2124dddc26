"""keras_roll demo: what the ROLL regularizer does to a network's linear regions.

A ReLU-family network is linear on a polyhedron around every input; keras_roll
certifies the radius of the largest ball inside it (the margin) and trains with the
ROLL regularizer (Lee, Alvarez-Melis & Jaakkola, ICLR 2019) to make these regions
larger at little cost in accuracy. In a few minutes on 2 CPU cores this demo:

1. trains a 4 x 100 ReLU network on a 2-D toy task, vanilla and with ROLL, and draws
   their linear regions with the certified l2 margin around each training point (the
   paper's Figure 1);
2. trains a scoRNN (LeakyReLU) speaker classifier on the Japanese Vowels sequences
   embedded in keras_roll, vanilla and with exact ROLL, and prints the two side by
   side: test accuracy, the number of complete linear regions (#CLR) among the test
   sequences, percentiles of the certified l1 / l2 margins and ROLL's gain; then draws
   how far each frame of one coefficient can move without leaving the linear region
   (the paper's Figure 3).

The RNN is smaller than the paper's (64 units instead of 512) so that the demo fits
its time; `python -m examples.japanese_vowel` runs the paper's setting.

    python -m examples.demo                   # or: make demo
    python -m examples.demo --out=/tmp/demo --units=128 --epochs=60

Modules: `main` (flags, the two runs and the summary).
"""
