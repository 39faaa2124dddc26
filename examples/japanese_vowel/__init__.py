"""Japanese Vowels: Table 3 and Figure 3 of Lee, Alvarez-Melis & Jaakkola (ICLR 2019).

Trains the paper's recurrent classifier (`keras_roll.models.scornn_classifier`:
Masking + scoRNN with LeakyReLU, 512 hidden units + Dense(9)) on the UCI Japanese
Vowels data embedded in keras_roll (270 training / 370 test sequences of 7-29 frames
of 12 LPC cepstrum coefficients, 9 speakers), vanilla and with exact ROLL, with
AMSGrad (learning rate 0.001) and batch 32. A stratified `--val_fraction` of the
training sequences is held out for validation: each model keeps its best
validation-loss epoch, and ROLL models are selected on validation as for MNIST.
The data are used as loaded (no normalisation), so ROLL and the margins are in
the units of the LPC coefficients.

Writes to `--out`: `table3.md` / `.json` (ACC, #CLR bounds, P25 / P50 / P75 / P100 of
the l1 and l2 margins over the 370 test sequences, ratios to vanilla), `runs.md` /
`.json`, `summary.json`, `figure3_vanilla.png` and `figure3_roll.png` (Figure 3: the
per-coordinate stability bounds of one channel of one test sequence over time) and
`runs/<tag>.*`.

    python -m examples.japanese_vowel --flagfile=examples/configs/japanese_vowel_roll.flags
    python -m examples.japanese_vowel --flagfile=examples/configs/japanese_vowel_roll.flags \\
        --quick

Modules: `main` (flags, entry point), `train` (`train_and_evaluate(config, workdir)`),
`input_pipeline` (the validation split, length buckets), `configs/` (`default`,
`quick`).
"""
