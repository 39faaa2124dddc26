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
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import time  # noqa: E402

from absl import flags  # noqa: E402

from examples import common, japanese_vowel, toy2d  # noqa: E402


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the demo's flags on `fv`."""
    flags.DEFINE_string("out", "runs/demo", "Folder for the tables and figures.",
                        flag_values=fv)
    flags.DEFINE_integer("units", 64, "scoRNN hidden units (the paper: 512).", flag_values=fv)
    flags.DEFINE_integer("epochs", 40, "Japanese Vowels training epochs.", flag_values=fv)
    flags.DEFINE_float("lam", 0.5, "ROLL weight lambda for the RNN.", flag_values=fv)
    flags.DEFINE_float("C", 1.0, "ROLL hinge weight C for the RNN.", flag_values=fv)
    flags.DEFINE_integer("toy_epochs", 300, "Toy 2-D training epochs.", flag_values=fv)
    flags.DEFINE_integer("toy_points", 100, "Toy 2-D training points.", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "Random seed.", flag_values=fv)


def side_by_side(vanilla: dict, roll: dict) -> str:
    """The two rows of the Japanese Vowels result as a small text table."""
    cols = [("test accuracy", "acc", common.percent), ("#CLR", "clr", common.fmt)]
    cols += [(f"{n} P{q}", f"{n}_p{q}", common.fmt) for n in ("l1", "l2") for q in (25, 50, 75)]
    width = max(len(c[0]) for c in cols) + 2
    lines = [f"{'':<{width}}{'vanilla':>14}{'ROLL':>14}{'ROLL / vanilla':>16}"]
    for label, key, f in cols:
        a, b = vanilla.get(key), roll.get(key)
        r = "" if key in ("acc", "clr") else common.fmt(common.ratio(b, a))
        lines.append(f"{label:<{width}}{f(a):>14}{f(b):>14}{r:>16}")
    return "\n".join(lines)


def run(fv) -> dict:
    """Runs the demo with the parsed flags `fv`; returns the sub-results and figures."""
    start = time.perf_counter()
    out = common.output_dir(fv.out)
    print("== 1/2  Toy 2-D task: linear regions of a 4 x 100 ReLU network (Figure 1)\n",
          flush=True)
    toy = toy2d.run(common.parse_flags(toy2d.define_flags, [
        f"--out={out / 'toy2d'}", "--models=vanilla,roll", f"--n={fv.toy_points}",
        f"--epochs={fv.toy_epochs}", "--resolution=200", f"--seed={fv.seed}"]))
    print(f"\n== 2/2  Japanese Vowels: scoRNN({fv.units}) speaker classifier, vanilla and "
          f"exact ROLL (lam={fv.lam:g}, C={fv.C:g}) (Table 3, Figure 3)\n", flush=True)
    jv = japanese_vowel.run(common.parse_flags(japanese_vowel.define_flags, [
        f"--out={out / 'japanese_vowel'}", f"--units={fv.units}", f"--epochs={fv.epochs}",
        f"--lam={fv.lam}", f"--C={fv.C}", f"--seed={fv.seed}", "--noresume"]))
    vanilla = next(r for r in jv["rows"] if r["lam"] is None)
    roll = next(r for r in jv["rows"] if r["lam"] is not None)
    tv, tr = toy["rows"][0], toy["rows"][-1]
    print("\n" + "=" * 72)
    print(f"Toy 2-D task, {tv['n']} training points: ROLL's median l2 margin is "
          f"{common.fmt(common.ratio(tr['l2_p50'], tv['l2_p50']))} x vanilla's "
          f"({common.fmt(tr['l2_p50'])} vs {common.fmt(tv['l2_p50'])}), the points fall in "
          f"{tr['clr']} linear regions instead of {tv['clr']}, training accuracy "
          f"{common.percent(tr['acc'])} vs {common.percent(tv['acc'])}.\n")
    print(f"Japanese Vowels, {vanilla['n']} test sequences, scoRNN({fv.units}); margins in "
          f"the units of the LPC coefficients:\n")
    print(side_by_side(vanilla, roll))
    print("\nWith ROLL the certified regions around the test sequences are "
          f"{common.fmt(common.ratio(roll['l2_p50'], vanilla['l2_p50']))} x larger (median "
          f"l2 margin), at {100 * (roll['acc'] - vanilla['acc']):+.1f} points of accuracy.")
    print("\nFigures:")
    for path in toy["figures"]:
        print(f"  Figure 1 (linear regions, toy 2-D):   {path}")
    for path in jv["figures"]:
        print(f"  Figure 3 (stability bounds, vowels):  {path}")
    print(f"Tables (Markdown and JSON): {out / 'toy2d'}/table.md, "
          f"{out / 'japanese_vowel'}/table3.md")
    print(f"Done in {time.perf_counter() - start:.0f} s.")
    return {"toy2d": toy, "japanese_vowel": jv, "out": out}


if __name__ == "__main__":
    common.run_app(define_flags, run)
