"""The progress bar shows an ETA, and the calls whose cost grows fast move it as they go.

Worst-case gradient distortion, exact integrated gradients and the robustness
radius can take minutes: their bar (`keras_roll.options.progress_bar`, the one bar
of the library) ends its line with the elapsed time and the time left, and it moves
during the run, not only at its end.
"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll.options import progress_bar

ETA = re.compile(r"\[\d\d:\d\d elapsed, ETA (\d\d:\d\d|\?), ")


def lines(err: str) -> list[str]:
    """The bar's successive states (tqdm redraws one line with carriage returns)."""
    return [s.strip() for s in re.split(r"[\r\n]", err) if s.strip()]


def test_a_bar_with_a_total_shows_the_time_left(capsys):
    with progress_bar(4, True, "gradient distortion (GA)", unit="grad") as bar:
        bar.update(1)
        bar.update(3)
    shown = lines(capsys.readouterr().err)
    assert all(ETA.search(s) for s in shown), shown
    assert shown[-1].startswith("gradient distortion (GA): 100%")
    assert "4/4 grad" in shown[-1] and "ETA 00:00" in shown[-1]


def test_a_bar_without_a_total_counts(capsys):
    with progress_bar(None, True, "certify") as bar:
        bar.update(3)
    shown = lines(capsys.readouterr().err)
    assert shown[-1].startswith("certify: 3 ex [") and "ETA" not in shown[-1]


def test_fractions_of_an_item_are_counted_and_shown_rounded_down(capsys):
    with progress_bar(2, True, "integrated gradients") as bar:
        bar.update(0.75)
        assert bar.n == pytest.approx(0.75)
        bar.refresh()
        assert "0/2 ex" in lines(capsys.readouterr().err)[-1]
        for _ in range(5):
            bar.update(0.25)  # 0.75 + 1.25: 2 up to rounding
    assert "2/2 ex" in lines(capsys.readouterr().err)[-1]


def test_quiet_and_auto_bars_print_nothing_for_short_runs(capsys):
    with progress_bar(3, False, "quiet") as bar:
        bar.update(3)
    with progress_bar(3, "auto", "short") as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def cnn():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6, 6, 1)), keras.layers.Rescaling(1 / 255),
        keras.layers.Conv2D(4, 3, activation="relu"), keras.layers.Flatten(),
        keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    x = np.random.default_rng(0).integers(0, 256, (3, 6, 6, 1)).astype("float32")
    return model, x, np.argmax(np.asarray(model(x)), axis=1)


def test_worst_case_distortion_shows_its_eta(cnn, capsys):
    model, x, y = cnn
    keras_roll.gradient_distortion(model, x, y, eps=8, domain=(0, 255), mode="max",
                                   population=40, generations=3, seed=0, verbose=True)
    shown = [s for s in lines(capsys.readouterr().err) if s.startswith("gradient distortion")]
    assert shown and all(ETA.search(s) for s in shown), shown
    assert "100%" in shown[-1] and f"{3 * (40 + 3 * 30)}/{3 * (40 + 3 * 30)} grad" in shown[-1]


def test_exact_integrated_gradients_move_the_bar_as_paths_are_walked(cnn, capsys):
    model, x, y = cnn
    keras_roll.integrated_gradients(model, x, y, verbose=True)
    shown = [s for s in lines(capsys.readouterr().err) if s.startswith("integrated")]
    assert all(ETA.search(s) for s in shown), shown
    assert "3/3 ex" in shown[-1] and "100%" in shown[-1]


def test_the_robustness_radius_shows_its_eta(cnn, capsys):
    model, x, y = cnn
    # one bar for every method: the region method, the quickest on this CNN
    keras_roll.robust_radius(model, x, y, norms=(2,), method="region", verbose=True)
    shown = [s for s in lines(capsys.readouterr().err) if s.startswith("robust radius")]
    assert shown and all(ETA.search(s) for s in shown), shown
    assert "3/3 ex" in shown[-1]
