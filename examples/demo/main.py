"""The demo: the toy 2-D example and the Japanese Vowels example, small, one after the
other, then what ROLL changed, side by side. It prints one line per trained model (no
per-epoch logs) and the tables; the "best validation loss at the last epoch" warning
only for the epochs the user chose (`--epochs`, `--toy_epochs`).

    python -m examples.demo [--out=/tmp/demo --units=128 --epochs=60]
"""

from __future__ import annotations

import dataclasses
import time

from absl import flags

from examples.common import app
from examples.common.tables import fmt, percent
from examples.japanese_vowel.configs import default as vowels_config
from examples.toy2d.configs import default as toy_config


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the demo's flags on `fv`."""
    d = dict(flag_values=fv)
    flags.DEFINE_string("out", "runs/demo", "Folder for the tables and figures.", **d)
    flags.DEFINE_integer("units", 64, "scoRNN hidden units (the paper: 512).", lower_bound=1,
                         **d)
    flags.DEFINE_integer("epochs", 40, "Japanese Vowels training epochs.", lower_bound=1, **d)
    flags.DEFINE_float("lam", 0.5, "ROLL weight lambda for the RNN.", lower_bound=0.0, **d)
    flags.DEFINE_float("C", 1.0, "ROLL hinge weight C for the RNN.", lower_bound=0.0, **d)
    flags.DEFINE_integer("toy_epochs", 300, "Toy 2-D training epochs.", lower_bound=1, **d)
    flags.DEFINE_integer("toy_points", 100, "Toy 2-D training points.", lower_bound=4, **d)
    flags.DEFINE_integer("seed", 0, "Random seed.", lower_bound=0, **d)


def side_by_side(vanilla: dict, roll: dict) -> str:
    """The two rows of the Japanese Vowels result as a small text table."""
    from examples.common.selection import ratio

    cols = [("test accuracy", "acc", percent), ("#CLR", "clr", fmt)]
    cols += [(f"{n} P{q}", f"{n}_p{q}", fmt) for n in ("l1", "l2") for q in (25, 50, 75)]
    width = max(len(c[0]) for c in cols) + 2
    lines = [f"{'':<{width}}{'vanilla':>14}{'ROLL':>14}{'ROLL / vanilla':>16}"]
    for label, key, f in cols:
        a, b = vanilla.get(key), roll.get(key)
        r = "" if key in ("acc", "clr") else fmt(ratio(b, a))
        lines.append(f"{label:<{width}}{f(a):>14}{f(b):>14}{r:>16}")
    return "\n".join(lines)


def main(fv: flags.FlagValues) -> dict:
    """Runs the demo with the parsed flags `fv`; returns the two examples' results."""
    from examples.common.selection import ratio
    from examples.japanese_vowel import train as vowels  # TensorFlow: once the flags are good
    from examples.toy2d import train as toy

    start = time.perf_counter()
    out = app.output_dir(fv.out)
    app.log("== 1/2  Toy 2-D task: linear regions of a 4 x 100 ReLU network (Figure 1)")
    toy_result = toy.train_and_evaluate(dataclasses.replace(
        toy_config.get_config(), models=("vanilla", "roll"), n=fv.toy_points,
        epochs=fv.toy_epochs, resolution=200, seed=fv.seed), out / "toy2d",
        logs=app.LogOptions(quiet=True, warn_last_epoch=fv["toy_epochs"].present))
    app.log(f"== 2/2  Japanese Vowels: scoRNN({fv.units}) speaker classifier, vanilla and "
            f"exact ROLL (lam={fv.lam:g}, C={fv.C:g}) (Table 3, Figure 3)")
    jv = vowels.train_and_evaluate(dataclasses.replace(
        vowels_config.get_config(), units=fv.units, epochs=fv.epochs, lam=(fv.lam,),
        C=(fv.C,), seed=fv.seed, resume=False), out / "japanese_vowel",
        logs=app.LogOptions(quiet=True, warn_last_epoch=fv["epochs"].present))
    vanilla = next(r for r in jv.rows if r["lam"] is None)
    roll = next(r for r in jv.rows if r["lam"] is not None)
    tv, tr = toy_result.rows[0], toy_result.rows[-1]
    app.log("\n" + "=" * 72)
    app.log(f"Toy 2-D task, {tv['n']} training points: ROLL's median l2 margin is "
            f"{fmt(ratio(tr['l2_p50'], tv['l2_p50']))} x vanilla's ({fmt(tr['l2_p50'])} vs "
            f"{fmt(tv['l2_p50'])}), the points fall in {tr['clr']} linear regions instead of "
            f"{tv['clr']}, training accuracy {percent(tr['acc'])} vs {percent(tv['acc'])}.\n")
    app.log(f"Japanese Vowels, {vanilla['n']} test sequences, scoRNN({fv.units}); margins in "
            f"the units of the LPC coefficients:\n")
    app.log(side_by_side(vanilla, roll))
    app.log("\nWith ROLL the certified regions around the test sequences are "
            f"{fmt(ratio(roll['l2_p50'], vanilla['l2_p50']))} x larger (median l2 margin), at "
            f"{100 * (roll['acc'] - vanilla['acc']):+.1f} points of accuracy.")
    app.log("\nFigures:")
    for path in toy_result.figures:
        app.log(f"  Figure 1 (linear regions, toy 2-D):   {path}")
    for path in jv.figures:
        app.log(f"  Figure 3 (stability bounds, vowels):  {path}")
    app.log(f"Tables (Markdown and JSON): {out / 'toy2d'}/table.md, "
            f"{out / 'japanese_vowel'}/table3.md")
    app.log(f"Done in {time.perf_counter() - start:.0f} s.")
    return {"toy2d": toy_result, "japanese_vowel": jv, "out": out}
