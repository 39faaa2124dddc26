"""Summaries that cannot mislead, on hand-built results: nothing undefined is printed as
a number (misclassified inputs counted apart, NaN bounds named, ratios over a zero
lower bound left out), and one line per cause of zero radii. The expected numbers are
numpy's percentiles of the hand-picked values."""

import numpy as np
import pytest

from keras_roll.certification import Certificate, ZeroCause
from keras_roll.robust import RobustRadius
from keras_roll.summary import format_table, percentiles_of


def _row(text: str, label: str) -> list[str]:
    """The cells of the table row `label` (percentiles, zero count, count)."""
    line = next(line for line in text.splitlines() if line.startswith(label + " "))
    return line[len(label):].split()


def _radius(lower, upper, predicted, labels, method="best", nonfinite=None, norms=(2,)):
    b = len(lower)
    per = {"lower": np.asarray(lower, float), "upper": np.asarray(upper, float),
           "adversarial": np.full((b, 2), np.nan), "exact": np.zeros(b, bool),
           "runner_up": np.full(b, -1, np.int64),
           "lower_method": np.array(["region"] * b, object),
           "upper_method": np.array(["walk"] * b, object)}
    return RobustRadius(**{k: {p: v.copy() for p in norms} for k, v in per.items()},
                        predicted=np.asarray(predicted), labels=np.asarray(labels),
                        method=method, nonfinite=nonfinite)


def test_robust_summary_counts_misclassified_and_undefined_apart():
    # input 0 misclassified (radius 0 by definition), 1 has lower 0, 2 no upper bound
    lower = [0.0, 0.0, 0.3, 0.5, 1.0]
    upper = [0.0, 0.4, np.nan, 1.0, 1.5]
    rr = _radius(lower, upper, predicted=[1, 0, 0, 2, 1], labels=[0, 0, 0, 2, 1])
    text = str(rr.summary(percentiles=(10, 50, 90)))
    assert "inf" not in text.replace("linf", ""), text
    qs = (10, 50, 90)
    expected = {"l2 lower": [0.0, 0.3, 0.5, 1.0], "l2 upper": [0.4, 1.0, 1.5],
                "l2 upper / lower": [1.0 / 0.5, 1.5 / 1.0]}
    for label, values in expected.items():
        cells = _row(text, label)
        assert [float(c) for c in cells[:3]] == pytest.approx(
            np.percentile(values, qs), rel=1e-3), (label, cells)
        assert int(cells[3]) == sum(v == 0 for v in values)
        assert int(cells[4]) == len(values)
    assert "of the 4 correctly classified inputs of 5" in text
    assert "upper (l2): NaN (undefined) for 1 of 4: no adversarial point found" in text
    assert "upper / lower (l2): undefined for 1 of 4 whose lower bound is 0" in text
    assert "Accuracy 80.0%: 1 misclassified input(s), radius 0 by definition" in text


def test_interval_summary_names_its_missing_upper_bounds():
    """method='interval' finds no adversarial point: the upper row is n/a, not the 0 of
    the misclassified inputs."""
    rr = _radius([0.0, 0.2, 0.4, 0.6], [0.0, np.nan, np.nan, np.nan], predicted=[1, 0, 0, 0],
                 labels=[0, 0, 0, 0], method="interval", norms=(2, np.inf))
    text = str(rr.summary())
    assert _row(text, "l2 upper") == ["n/a", "n/a", "n/a", "0", "0"], text
    assert _row(text, "l2 upper / lower") == ["n/a", "n/a", "n/a", "0", "0"]
    assert "upper (l2, linf): NaN (undefined) for 3 of 3: method 'interval' bounds from " \
        "below only" in text
    assert text.count("NaN (undefined)") == 1  # one line for both norms
    assert [float(c) for c in _row(text, "l2 lower")[:3]] == pytest.approx(
        np.percentile([0.2, 0.4, 0.6], (10, 50, 90)))


def test_nonfinite_inputs_are_counted_apart():
    rr = _radius([0.1, np.nan, 0.3], [0.2, np.nan, 0.6], predicted=[0, -1, 0],
                 labels=[0, 0, 0], nonfinite=np.array([False, True, False]))
    text = str(rr.summary())
    table = text.split("=" * 20)[1].split("\n_")[0]
    assert "nan" not in table.lower() and "inf" not in table.lower(), text
    assert "1 input(s) with non-finite values: bounds NaN, counted apart" in text
    assert int(_row(text, "l2 lower")[-1]) == 2
    assert "misclassified" not in text


def test_certificate_summary_has_one_line_per_zero_cause():
    guard, tie = ZeroCause.ROUNDING_GUARD, ZeroCause.MAX_POOL_TIE
    none = ZeroCause.NONE
    causes = {1: [guard, guard, none, tie], 2: [guard, guard, none, tie],
              np.inf: [guard, none, none, tie]}
    margins = {p: np.array([0.0 if c is not none else 0.5 for c in cs])
               for p, cs in causes.items()}
    binding = {p: [("dense", (1,)), ("dense_1", (0,)), ("dense", (2,)), ("pool", (0,))]
               for p in causes}
    cert = Certificate(margins=margins, binding=binding,
                       binding_index={p: np.zeros(4, np.int64) for p in causes},
                       rigor="float64",
                       zero_cause={p: np.array(cs, object) for p, cs in causes.items()})
    lines = [line for line in str(cert.summary()).splitlines() if "Zero" in line]
    assert len(lines) == 2, lines
    guard_line = next(line for line in lines if "rounding guard" in line)
    assert guard_line.startswith("Zero radii: l1 2, l2 2, linf 1 of 4 from a neuron within")
    assert "(in dense: 1, dense_1: 1)" in guard_line
    tie_line = next(line for line in lines if "max-pooling" in line)
    assert tie_line.startswith("Zero radii: 1 of 4 (l1, l2, linf) from a tie")
    assert "(in pool: 1); remedy: average pooling" in tie_line


def test_tables_leave_nan_out_and_print_nothing_undefined_as_a_number():
    assert percentiles_of([1.0, 3.0, np.nan], (50,)) == [2.0]
    assert np.isnan(percentiles_of([np.nan], (50,))[0])
    assert percentiles_of([1.0, np.inf, np.inf], (100,)) == [np.inf]
    text = format_table("T", [("a", [0.0, 2.0, np.nan]), ("b", [])], (50,), count=True,
                        column="Bound")
    assert _row(text, "a") == ["1", "1", "2"] and _row(text, "b") == ["n/a", "0", "0"]
    assert text.splitlines()[2].split() == ["Bound", "P50", "zero", "n"]
