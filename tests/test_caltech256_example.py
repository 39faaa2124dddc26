"""The Caltech-256 example end to end on a tiny generated tree at 16 x 16.

Fast, on the example's two-convolution test network (`--model=tiny`): a vanilla run
(results.md / .json / figure / TensorBoard / checkpoint; P@1 and P@k against an
independent numpy argmax over the saved weights), `--eval_only`, resumption after an
interruption (final weights equal to an uninterrupted run's), refused reruns and the
bad-input errors, which absl reports while parsing the flags. Slow: ROLL with
`--compare_with`, mixed precision, a two-replica `MirroredStrategy` step (two logical
CPU devices, in a subprocess), two `MultiWorkerMirroredStrategy` workers on
127.0.0.1, and, on the paper's ResNet-18, the `--quick` command line and a `--quick`
training killed with SIGKILL mid-epoch and resumed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from absl import flags

from examples.caltech256 import main as ex
from examples.caltech256 import models, train
from examples.caltech256.configs import default
from examples.common import app
from examples.common.config_flags import parse_flags

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
TINY = ["--model=tiny", "--image_size=16", "--batch_size=8", "--epochs=1",
        "--val_per_class=2", "--test_per_class=3", "--num_eval=2", "--distortion_samples=8",
        "--population=8", "--generations=1", "--ig_steps=4", "--monitor_images=1",
        "--verbose=0"]
# Two epochs of 3 steps, the state saved every 2 steps: the interrupted runs compare with it.
RESUMABLE = ["--epochs=2", "--steps_per_epoch=3", "--save_freq=2"]


def _env(**extra):
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", **extra)


def _flags(*argv):
    return parse_flags(ex.define_flags, list(argv))


def _run(*argv, callbacks=()):
    return ex.main(_flags(*argv), callbacks=callbacks)


def _weights(path):
    """{dataset path: array} of a .weights.h5 file."""
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def _state_weights(out):
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    return state, _weights(out / "checkpoint" / state["weights"])


def _same_weights(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """3 classes x 14 generated JPEGs, plus one corrupt file (to be skipped)."""
    from keras_roll.data import make_synthetic_caltech256

    parent = tmp_path_factory.mktemp("caltech_tree")
    root = make_synthetic_caltech256(parent, classes=3, images_per_class=14, seed=1)
    (root / "002.american-flag" / "002_9999.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
    return parent


@pytest.fixture(scope="module")
def vanilla_run(tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("vanilla")
    result = _run(*TINY, *RESUMABLE, "--noroll", f"--data_dir={tree}", f"--out={out}")
    return out, result.summary


# ----------------------------------------------------------------------------- runs


def test_vanilla_run_writes_results(vanilla_run):
    out, results = vanilla_run
    saved = json.loads((out / "results.json").read_text())
    assert saved["roll"] is False and saved["model"] == "tiny"
    assert saved["data"]["skipped"] == 1  # the corrupt JPEG, counted
    assert saved["data"]["classes"] == 3 and saved["data"]["test"] == 9
    assert saved["training"]["epochs_trained"] == 2
    assert saved["training"]["steps_per_epoch"] == 3  # of 3 * (14 - 5) // 8 full batches
    assert saved["training"]["best_epoch"] in (1, 2)
    hist = saved["training"]["history"]
    assert [h["epoch"] for h in hist] == [1, 2]
    assert min(h["val_loss"] for h in hist) == pytest.approx(saved["training"]["best_val_loss"])
    d = saved["distortion"]
    assert d["images"] == 2 and len(d["per_image"]["max"]) == 2
    for mode in ("expected", "max"):
        pcts = [d[mode][f"P{q}"] for q in (25, 50, 75, 100)]
        assert pcts == sorted(pcts) and pcts[0] >= 0
        assert d[mode]["P100"] == pytest.approx(max(d["per_image"][mode]))
    assert d["changed"] == sum(d["per_image"]["changed"])
    assert (out / saved["figure"]["path"]).stat().st_size > 10_000
    md = (out / "results.md").read_text()
    assert "| P@1 | P@3 |" in md and "worst case (GA: population 8, 1 generations)" in md
    assert "![Figure 4](figure4.png)" in md
    assert json.loads((out / "checkpoint" / "state.json").read_text())["done"] is True
    record = json.loads((out / "run_config.json").read_text())
    assert record["model"] == "tiny" and record["lr_decay_epochs"] == [10.0]


def test_test_accuracy_matches_numpy_argmax(vanilla_run, tree):
    """P@1 / P@3 of results.json against the saved weights, decoded images and argmax."""
    from keras_roll.data import caltech256_dataset, index_caltech256

    out, results = vanilla_run
    index = index_caltech256(tree, val_per_class=2, test_per_class=3, seed=0, verbose=0)
    ds = caltech256_dataset(index.files["test"], index.labels["test"], image_size=16)
    x, y = map(np.stack, zip(*ds.as_numpy_iterator()))
    model = models.tiny((16, 16, 3), 3, default.Normalize.imagenet, default.StemPool.avg)
    model.load_weights(out / "best.weights.h5")
    logits = model.predict(x, verbose=0)
    top = np.argsort(-logits, axis=1)
    assert results["test"]["p_at_1"] == pytest.approx(np.mean(top[:, 0] == y))
    assert results["test"]["p_at_k"] == pytest.approx(np.mean((top[:, :3] == y[:, None]).any(1)))


def test_tensorboard_logs(vanilla_run):
    import tensorflow as tf

    pytest.importorskip("tensorboard")
    out, _ = vanilla_run
    tags = {}
    for split in ("train", "validation"):
        for f in (out / "tensorboard" / split).glob("events.out.tfevents.*"):
            for event in tf.compat.v1.train.summary_iterator(str(f)):
                for v in event.summary.value:
                    tags.setdefault(split, set()).add((v.tag, event.step))
    names = {t for t, _ in tags["train"]}
    assert {"epoch_loss", "epoch_accuracy", "epoch_step_time_ms", "epoch_learning_rate",
            "epoch_margin_l2_p50", "epoch_margin_l2_p100"} <= names
    assert {("epoch_loss", 0), ("epoch_loss", 1)} <= tags["train"]  # one point per epoch
    assert {"epoch_loss", "epoch_accuracy"} <= {t for t, _ in tags["validation"]}


def test_eval_only_from_saved_weights(vanilla_run, tree, tmp_path):
    out, results = vanilla_run
    weights = tmp_path / "model.weights.h5"
    shutil.copy(out / "best.weights.h5", weights)
    again = _run(*TINY, "--noroll", "--eval_only", "--num_eval=0", f"--weights={weights}",
                 f"--data_dir={tree}", f"--out={tmp_path / 'eval'}").summary
    assert again["training"] is None and again["distortion"] is None
    assert again["test"]["p_at_1"] == pytest.approx(results["test"]["p_at_1"])
    assert (tmp_path / "eval" / "results.md").exists()
    assert not (tmp_path / "eval" / "checkpoint").exists()


class _Interrupt(Exception):
    pass


def _stop_after(steps):
    """A Keras callback that raises after `steps` training steps (an interrupted run)."""
    import keras

    class Stop(keras.callbacks.Callback):
        seen = 0

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if self.seen == steps:
                raise _Interrupt(f"interrupted after {steps} steps")

    return Stop()


def test_resume_after_interruption(vanilla_run, tree, tmp_path, capsys):
    """Interrupted after 5 steps, another --lr refused, resumed: the final weights are
    the uninterrupted run's."""
    argv = [*TINY, *RESUMABLE, "--noroll", f"--data_dir={tree}", "--num_eval=0",
            "--monitor_images=0", f"--out={tmp_path}"]
    # Steps 1..5: saved at global step 2, after epoch 1 (3) and at 4 (epoch 2, step 1).
    with pytest.raises(_Interrupt):
        _run(*argv, callbacks=[_stop_after(5)])
    state, saved = _state_weights(tmp_path)
    assert (state["epoch"], state["step"], state["global_step"]) == (1, 1, 4)
    assert not (tmp_path / "results.json").exists()
    with pytest.raises(app.UsageError, match=r"--lr: 0\.005 in the checkpoint, 0\.01 now"):
        _run(*argv, "--lr=0.01")
    capsys.readouterr()
    _run(*argv)
    assert "at epoch 2, step 1 of 3 (global step 4; optimizer step 4)" in capsys.readouterr().out
    s_full, w_full = _state_weights(vanilla_run[0])
    s_cut, w_cut = _state_weights(tmp_path)
    assert s_cut["global_step"] == s_full["global_step"] == 6
    moved = max(float(np.max(np.abs(w_full[k] - saved[k]))) for k in w_full
                if w_full[k].dtype.kind == "f")
    assert moved > 1e-4  # the last two steps changed the weights
    _same_weights(w_cut, w_full)
    assert s_cut["best_epoch"] == s_full["best_epoch"]
    assert s_cut["best_val_loss"] == pytest.approx(s_full["best_val_loss"], rel=1e-5)


def test_finished_run_is_not_restarted(vanilla_run, tree, tmp_path, capsys):
    out = tmp_path / "copy"
    shutil.copytree(vanilla_run[0], out)
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    again = _run(*TINY, *RESUMABLE, "--noroll", "--num_eval=0", f"--data_dir={tree}",
                 f"--out={out}")
    assert "Training finished earlier" in capsys.readouterr().out
    assert json.loads((out / "checkpoint" / "state.json").read_text()) == state
    assert again.summary["test"]["p_at_1"] == vanilla_run[1]["test"]["p_at_1"]


@pytest.mark.slow
def test_roll_run_and_compare_with(vanilla_run, tree, tmp_path):
    """ROLL, then the figure with the vanilla model beside it (--compare_with)."""
    out = tmp_path / "roll"
    results = _run(*TINY, "--roll", "--samples=2", "--epochs=2", "--lr_decay_epochs=1",
                   f"--compare_with={vanilla_run[0]}", f"--data_dir={tree}",
                   f"--out={out}").summary
    hist = results["training"]["history"]
    assert len(hist) == 2 and all(h["roll_loss"] > 0 and h["val_roll_loss"] > 0 for h in hist)
    assert results["figure"]["models"] == ["ROLL", "vanilla"]
    assert (out / "figure4.png").exists()
    md = (out / "results.md").read_text()
    assert "ROLL: lam=0.001, C=8, gamma=100, samples=2 per channel, wrt=normalize" in md


@pytest.mark.slow
def test_roll_resume_after_interruption(tree, tmp_path):
    """The ROLL sampling counter is part of the state: the same axes after resuming."""
    argv = [*TINY, *RESUMABLE, "--roll", "--samples=2", f"--data_dir={tree}", "--num_eval=0",
            "--monitor_images=0"]
    _run(*argv, f"--out={tmp_path / 'full'}")
    with pytest.raises(_Interrupt):
        _run(*argv, f"--out={tmp_path / 'cut'}", callbacks=[_stop_after(5)])
    _run(*argv, f"--out={tmp_path / 'cut'}")
    _same_weights(_state_weights(tmp_path / "cut")[1], _state_weights(tmp_path / "full")[1])


@pytest.mark.slow
def test_mixed_precision_run(tree, tmp_path):
    """--mixed_precision (bfloat16 on CPUs): ROLL trains, evaluation runs in float32."""
    results = _run(*TINY, "--roll", "--samples=1", "--mixed_precision", "--steps_per_epoch=2",
                   "--num_eval=1", "--figure_percentiles=50", f"--data_dir={tree}",
                   f"--out={tmp_path}").summary
    assert results["settings"]["mixed_precision"] is True
    assert np.isfinite(results["training"]["history"][0]["loss"])
    assert results["distortion"]["max"]["P100"] >= 0


@pytest.mark.slow
def test_with_vanilla_trains_both_and_compares(tree, tmp_path):
    """--with_vanilla: the vanilla run, the ROLL run drawn beside it, the comparison of
    the two on the same test images."""
    result = _run(*TINY, "--roll", "--samples=1", "--with_vanilla", f"--data_dir={tree}",
                  f"--out={tmp_path}")
    assert [r["model"] for r in result.rows] == ["vanilla", "ROLL"]
    assert result.summary["vanilla"]["roll"] is False and result.summary["roll"]["roll"]
    assert result.summary["roll"]["figure"]["models"] == ["ROLL", "vanilla"]
    table = json.loads((tmp_path / "comparison.json").read_text())
    assert table["rows"][0]["p_at_1"] == result.summary["vanilla"]["test"]["p_at_1"]
    assert table["rows"][1]["max_p50"] == result.summary["roll"]["distortion"]["max"]["P50"]


# ----------------------------------------------------------------------------- bad input


def test_bad_flags_are_refused_while_parsing(tree, tmp_path, monkeypatch):
    copy = tmp_path / "tree"
    shutil.copytree(tree, copy)
    for f in (copy / "256_ObjectCategories" / "003.backpack").iterdir():
        f.unlink()
    (tmp_path / "empty").mkdir()
    monkeypatch.delenv("TF_CONFIG", raising=False)
    (tmp_path / "w.txt").write_text("")
    cases = [
        ([], "--data_dir is required (without --quick"),
        ([f"--data_dir={tmp_path / 'missing'}"], "is not a directory"),
        (["--quick", "--strategy=tpu"], "value should be one of <default|mirrored|multiworker>"),
        (["--quick", "--strategy=multiworker"], "needs TF_CONFIG"),
        (["--quick", "--lr_decay_epochs=2.5"], "--lr_decay_epochs takes whole epochs"),
        (["--quick", "--eps=8"], "flag --eps=8: 8.0 is not number <= 1.0"),
        (["--quick", "--figure_percentiles=50,101"], "101 is above the upper bound 100"),
        (["--quick", f"--weights={tmp_path / 'w.txt'}"], "expected a torchvision state dict"),
        (["--quick", f"--compare_with={tmp_path}"], "has no run_config.json"),
        (["--flagfile=examples/configs/nope.flags"], "Unable to open flagfile"),
    ]
    for argv, message in cases:
        with pytest.raises(flags.Error) as err:
            _flags("--model=tiny", *argv)
        assert message in str(err.value), (argv, str(err.value))
    # What needs keras_roll (the class folders, the layers of the built network) is
    # checked once the flags are good, before any training, with one line as well.
    after = [
        ([f"--data_dir={tmp_path / 'empty'}"], "No class folders (NNN.name)"),
        ([f"--data_dir={copy}"], "hold no image files: 003.backpack"),
        (["--quick", "--roll_wrt=stem"], "--roll_wrt=stem: tiny has no layer 'stem'"),
    ]
    for argv, message in after:
        with pytest.raises(app.UsageError) as err:
            ex.check_with_tensorflow(ex.get_config(_flags("--model=tiny", *argv)))
        assert message in str(err.value), (argv, str(err.value))


def test_batch_not_divisible_by_replicas():
    """The check comes before any model is built; the real two-replica case is slow."""
    config = ex.get_config(_flags(*TINY, "--quick", "--batch_size=9", "--strategy=mirrored"))
    with pytest.raises(app.UsageError, match=r"--batch_size=9 is the global batch and must be "
                                             r"divisible by the 4 replicas.*--batch_size=8"):
        train.steps_per_epoch(config, 100, replicas=4)


def test_refuses_checkpoint_without_run_config(tree, tmp_path):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "state.json").write_text("{}")
    with pytest.raises(app.UsageError, match="holds a checkpoint.*Delete the folder"):
        _run(*TINY, f"--data_dir={tree}", f"--out={tmp_path}")


def test_eval_only_without_weights(tree, tmp_path):
    with pytest.raises(app.UsageError, match="no weights at .*best.weights.h5; train first"):
        _run(*TINY, "--eval_only", f"--data_dir={tree}", f"--out={tmp_path}")


def test_flagfiles_hold_the_papers_settings(tree):
    for name, roll in (("caltech256_roll.flags", True), ("caltech256_vanilla.flags", False)):
        config = ex.get_config(_flags(f"--flagfile={CONFIGS / name}", f"--data_dir={tree}"))
        assert config.roll is roll
        assert (config.batch_size, config.lr, config.lr_decay_epochs, config.lr_decay_factor,
                config.momentum, config.nesterov, config.epochs, config.image_size) == (
            32, 0.005, (10.0,), 0.1, 0.5, True, 20, 299)
        assert (config.lam, config.C, config.gamma, config.samples, config.strata) == (
            0.001, 8, 100, 120, default.Strata.channel)
        assert (config.val_per_class, config.test_per_class, config.eps) == (5, 15, 8 / 256)
        assert config.model == default.Architecture.resnet18
        quick = ex.get_config(_flags(f"--flagfile={CONFIGS / name}", "--quick", "--epochs=3"))
        assert quick.image_size == 32 and quick.samples == 2 and quick.epochs == 3


# ----------------------------------------------------------------------------- distributed


def _subprocess(code, timeout=900):
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


MIRRORED = """
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import json
from examples.caltech256 import main as ex
from examples.common import app
from examples.common.config_flags import parse_flags
argv = {argv!r}
try:
    ex.main(parse_flags(ex.define_flags, argv + ["--batch_size=3"]))
except app.UsageError as e:
    print("ERROR:", e)
res = ex.main(parse_flags(ex.define_flags, argv))
print("RESULT:", json.dumps(res.summary["training"]))
"""


@pytest.mark.slow
def test_mirrored_two_replicas(tree, tmp_path):
    argv = [*TINY, "--roll", "--samples=1", "--strategy=mirrored", "--steps_per_epoch=1",
            "--num_eval=0", "--monitor_images=0", f"--data_dir={tree}", f"--out={tmp_path}"]
    out = _subprocess(MIRRORED.format(argv=argv))
    assert ("ERROR: --batch_size=3 is the global batch and must be divisible by the 2 "
            "replicas of --strategy=mirrored") in out
    training = json.loads(out.split("RESULT:")[1])
    assert training["replicas"] == 2 and training["epochs_trained"] == 1
    assert training["history"][0]["roll_loss"] > 0


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.slow
def test_multiworker_two_workers(tree, tmp_path):
    """Two MultiWorkerMirroredStrategy processes on 127.0.0.1: the chief writes results."""
    hosts = [f"127.0.0.1:{p}" for p in _free_ports(2)]
    argv = [sys.executable, "-m", "examples.caltech256", *TINY, "--noroll",
            "--strategy=multiworker", "--steps_per_epoch=2", "--num_eval=0",
            f"--data_dir={tree}", f"--out={tmp_path}"]
    procs = []
    for i in range(2):
        env = _env(TF_CONFIG=json.dumps(
            {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}}))
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    for p, o in zip(procs, outputs):
        assert p.returncode == 0, o[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["training"]["replicas"] == 2
    assert (tmp_path / "workers" / "worker_1" / "checkpoint" / "state.json").exists()
    assert "Test split" in outputs[0] and "Test split" not in outputs[1]


QUICK = [sys.executable, "-m", "examples.caltech256",
         "--flagfile=examples/configs/caltech256_roll.flags", "--quick", "--num_eval=0",
         "--nowith_vanilla"]


@pytest.mark.slow
def test_quick_command_line(tmp_path):
    """The documented --quick command, as a user runs it: vanilla, then ROLL, then both
    compared (about ten minutes on 2 cores)."""
    proc = subprocess.run(
        [sys.executable, "-m", "examples.caltech256",
         "--flagfile=examples/configs/caltech256_roll.flags", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name, roll in (("vanilla", False), ("roll", True)):
        results = json.loads((tmp_path / name / "results.json").read_text())
        assert results["settings"]["image_size"] == 32 and results["roll"] is roll
        assert results["model"] == "resnet18" and len(results["training"]["history"]) == 2
    assert (tmp_path / "roll" / "figure4.png").exists()
    table = json.loads((tmp_path / "comparison.json").read_text())
    assert [r["model"] for r in table["rows"]] == ["vanilla", "ROLL"]
    assert all(r["max_p50"] is not None and 0 <= r["p_at_1"] <= 1 for r in table["rows"])
    assert "vanilla and ROLL" in proc.stdout


@pytest.mark.slow
def test_sigkill_mid_epoch_and_resume(tmp_path):
    """A real --quick ResNet-18 ROLL training (2 epochs of 4 steps, saved every 2 steps)
    is killed with SIGKILL once it has saved step 2 of its first epoch, and rerun with
    the same command: it resumes there, and its final weights equal those of a run that
    was never interrupted."""
    from examples.caltech256.configs import quick
    from keras_roll.data import make_synthetic_caltech256

    full, cut = tmp_path / "full", tmp_path / "cut"
    make_synthetic_caltech256(tmp_path / "data", classes=quick.CLASSES,  # the --quick tree
                              images_per_class=quick.IMAGES_PER_CLASS, seed=0)
    data = [f"--data_dir={tmp_path / 'data'}"]
    subprocess.run([*QUICK, *data, f"--out={full}"], cwd=ROOT, env=_env(), check=True,
                   capture_output=True, timeout=1800)
    proc = subprocess.Popen([*QUICK, *data, f"--out={cut}"], cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state_file = cut / "checkpoint" / "state.json"
    deadline = time.time() + 1500
    while time.time() < deadline and proc.poll() is None:
        if state_file.exists() and json.loads(state_file.read_text())["global_step"] >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    state = json.loads(state_file.read_text())
    assert state["epoch"] == 0 and state["step"] == 2, state  # killed inside epoch 1
    assert not (cut / "results.json").exists()
    resumed = subprocess.run([*QUICK, *data, f"--out={cut}"], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=1800)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "Resuming" in resumed.stdout and "step 2 of 4" in resumed.stdout
    s_full, w_full = _state_weights(full)
    s_cut, w_cut = _state_weights(cut)
    assert s_cut["global_step"] == s_full["global_step"] == 8
    _same_weights(w_cut, w_full)
