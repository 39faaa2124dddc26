"""Every public call on the CNNs people use: time per image, first-call time, peak memory.

Models: CNN-S and CNN-L (`benchmarks/cnn_models.py`, MNIST-shaped, inputs 0..255 through
a `Rescaling` named "rescale") and the ResNet-18 of `keras_roll.models` at 32x32x3 with 10
classes (inputs in [0, 1]). All are randomly initialised with a fixed seed (untrained).
Inputs are MNIST test images (`--data`) or, without MNIST and for the ResNet, uniform
random images; labels are the model's own predictions.

Each call runs in a subprocess of its own, so that its peak resident set size
(`resource.getrusage(...).ru_maxrss`) is its own: the subprocess builds the model, runs
the call once on one image (the first call, tracing included), then on `--images`
images (warm: the per-image time). The parent kills a call that runs past
`--time_limit` seconds or past `--rss_limit_gib` resident memory and reports it as
"over N s" / "over N GiB" with what it had measured.

The calls: `certify` (default rigor and "float32"), `robust_radius` (l_inf, l2),
`saliency`, exact `integrated_gradients`, expected and worst-case `gradient_distortion`
(the README's settings: eps 8/256 in [0, 1] pixels, 8000 samples; population 4800 and 30
generations), and the training steps (`steps`): the ratios to a vanilla step of sampled
ROLL (3 and 16 axes), IBP, CROWN-IBP and MMR, all through `keras_roll.wrap` and Keras'
`train_on_batch`, timed interleaved in one process.

`--widths=1,2,4` adds the memory sweep: every call's peak RSS on CNN-S with its hidden
channels and units multiplied by each width, against the model's neurons, so that the
memory of a call can be predicted from the model's size (docs/guide.md, "Memory").

    python -m benchmarks.cnn [--models=cnn_s,cnn_l,resnet18] [--calls=certify,...]
        [--images=2] [--time_limit=600] [--rss_limit_gib=8] [--generations=30]
        [--widths=1,2,4] [--data=/path/to/mnist.npz] [--quick]

`--quick`: CNN-S only, 1 image, 2 generations, 60 s per call.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_roll  # noqa: E402
from benchmarks._util import interleaved_medians  # noqa: E402
from benchmarks.cnn_models import CNNS  # noqa: E402
from benchmarks.roll_steps import weight_reset  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["cnn_s", "cnn_l", "resnet18"], "Models: cnn_s, cnn_l, resnet18.")
flags.DEFINE_list("calls", None, "Calls to run (default: all of CALLS and 'steps').")
flags.DEFINE_integer("images", 2, "Images of the warm call (the per-image time).")
flags.DEFINE_integer("time_limit", 600, "Seconds a call (its subprocess) may run.")
flags.DEFINE_float("rss_limit_gib", 8.0, "Resident memory a call may reach, in GiB.")
flags.DEFINE_integer("population", 4800, "Population of the worst-case distortion.")
flags.DEFINE_integer("generations", 30, "Generations of the worst-case distortion.")
flags.DEFINE_integer("samples", 8000, "Draws per image of the expected distortion.")
flags.DEFINE_integer("batch", 32, "Batch of the training steps.")
flags.DEFINE_integer("repeats", 5, "Interleaved repetitions of the training steps.")
flags.DEFINE_list("widths", [], "Width multipliers of CNN-S for the memory sweep (e.g. 1,2,4).")
flags.DEFINE_string("data", "/work/shared/data/mnist.npz", "mnist.npz (absent: random images).")
flags.DEFINE_bool("quick", False, "CNN-S only, 1 image, 2 generations, 60 s per call.")
flags.DEFINE_bool("warm", True, "Also the warm call after the first (--nowarm: the first "
                  "call only, for models where one call takes minutes).")
flags.DEFINE_string("json", None, "Also write every call's records to this JSON file.")
flags.DEFINE_string("worker", None, "Internal: 'model:call' to run in this process.")

EPS_PIXELS = 8 / 256  # the README's distortion radius, in [0, 1] pixels


def build(name: str) -> keras.Model:
    """`cnn_s`, `cnn_l`, `cnn_s_x2` (CNN-S at width 2) or `resnet18` (32x32x3, 10 classes)."""
    if name == "resnet18":
        keras.utils.set_random_seed(0)
        return keras_roll.models.resnet18(input_shape=(32, 32, 3), classes=10)
    base, _, width = name.partition("_x")
    return CNNS[base](width=float(width or 1))


def data(model: keras.Model, n: int):
    """`(x, y)`: `n` inputs in the model's range and its predicted labels."""
    shape = tuple(model.input_shape[1:])
    if shape == (28, 28, 1) and os.path.exists(FLAGS.data):
        with np.load(FLAGS.data) as f:
            x = f["x_test"][:n].reshape(n, *shape).astype("float32")
    else:
        scale = 255.0 if shape == (28, 28, 1) else 1.0
        x = np.random.default_rng(0).uniform(0, scale, (n, *shape)).astype("float32")
    y = np.argmax(model.predict(x, verbose=0), axis=-1)
    return x, y


def _units(model) -> dict:
    """The distortion's units: [0, 1] pixels behind "rescale", else the input's."""
    if any(layer.name == "rescale" for layer in model.layers):
        return {"wrt": "rescale", "domain": (0.0, 1.0)}
    return {"domain": (0.0, 1.0)}


def _distortion(mode):
    def call(m, x, y):
        kw = dict(eps=EPS_PIXELS, mode=mode, seed=0, verbose=False, **_units(m))
        if mode == "max":
            kw.update(population=FLAGS.population, generations=FLAGS.generations)
        else:
            kw.update(samples=FLAGS.samples)
        keras_roll.gradient_distortion(m, x, y, **kw)
    return call


def _robust(m, x, y, p) -> None:
    """`robust_radius` at its defaults in one norm; prints the intermediate bounds taken."""
    rr = keras_roll.robust_radius(m, x, y, norms=(p,), verbose=False)
    _emit(stage="intermediate", choices=[str(c) for c in rr.intermediate],
          lower=[float(v) for v in np.asarray(rr.lower[p]).ravel()],
          upper=[float(v) for v in np.asarray(rr.upper[p]).ravel()])


CALLS = {
    "certify": lambda m, x, y: keras_roll.certify(m, x, verbose=False),
    "certify_float32": lambda m, x, y: keras_roll.certify(m, x, rigor="float32", verbose=False),
    "robust_linf": lambda m, x, y: _robust(m, x, y, np.inf),
    "robust_l2": lambda m, x, y: _robust(m, x, y, 2),
    "saliency": lambda m, x, y: keras_roll.saliency(m, x, y),
    "ig_exact": lambda m, x, y: keras_roll.integrated_gradients(m, x, y, verbose=False),
    "distortion_expected": _distortion("expected"),
    "distortion_max": _distortion("max"),
}


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _emit(**record) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def run_call(model_name: str, call: str) -> None:
    """The worker: one call on one model, its records printed as `RESULT {json}` lines."""
    model = build(model_name)
    x, y = data(model, max(1, FLAGS.images))
    lin = keras_roll.linearize(model)
    _emit(stage="model", neurons=lin.num_neurons(x.shape[1:]),
          weights=int(model.count_params()), rss_gib=_rss_gib())
    if call == "steps":
        return run_steps(model, x, y)
    fn = CALLS[call]
    stages = (("first", x[:1], y[:1]), ("warm", x, y))
    for stage, xs, ys in stages[:2 if FLAGS.warm else 1]:
        start, cpu = time.perf_counter(), time.process_time()
        fn(model, xs, ys)
        _emit(stage=stage, seconds=(time.perf_counter() - start) / len(xs),
              cpu=(time.process_time() - cpu) / len(xs), rss_gib=_rss_gib())


def regularized(wrt: str | None) -> dict:
    """`keras_roll.wrap` arguments of the timed regularizers (IBP's eps in `wrt`'s units)."""
    return {
        "ROLL, 3 sampled axes": dict(lam=1.0, C=1.0, samples=3),
        "ROLL, 16 sampled axes": dict(lam=1.0, C=1.0, samples=16),
        "IBP, eps 0.1": dict(regularizer=keras_roll.IBPConfig(eps=0.1, kappa=0.5, wrt=wrt)),
        "CROWN-IBP, eps 0.1": dict(regularizer=keras_roll.CrownIBPConfig(
            eps=0.1, kappa=0.5, beta=1.0, wrt=wrt)),
        "MMR, l_inf": dict(regularizer=keras_roll.MMRConfig(p="inf")),
    }


def run_steps(model: keras.Model, x, y) -> None:
    """Training steps of every regularizer against vanilla, interleaved (`train_on_batch`,
    SGD, the weights put back before every step)."""
    rng = np.random.default_rng(0)
    classes = int(model.output_shape[-1])
    xb = x[rng.integers(0, len(x), FLAGS.batch)]
    yb = rng.integers(0, classes, FLAGS.batch)
    wrt = _units(model).get("wrt")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.SGD(0.01), loss)
    models = {"vanilla": model}
    for name, kw in regularized(wrt).items():
        models[name] = keras_roll.wrap(model, **kw)
        models[name].compile(keras.optimizers.SGD(0.01), loss)
    reset = weight_reset(model)
    first, once = {}, {}
    for times in (first, once):  # the first step traces; the second is warm
        for name, m in models.items():
            reset()
            start = time.perf_counter()
            m.train_on_batch(xb, yb)
            times[name] = time.perf_counter() - start
            _emit(stage="steps", batch=FLAGS.batch, seconds=once, first=first,
                  rss_gib=_rss_gib())  # after every step: a killed run keeps what it had
    fast = {k: (lambda m=m: m.train_on_batch(xb, yb)) for k, m in models.items()
            if once[k] < STEP_REPEAT_LIMIT}  # slower steps keep their one warm time
    once.update(interleaved_medians(fast, repeats=FLAGS.repeats, warmup=0, setup=reset))
    _emit(stage="steps", batch=FLAGS.batch, seconds=once, first=first, rss_gib=_rss_gib())


STEP_REPEAT_LIMIT = 2.0  # seconds: steps slower than this are timed once, not repeated


# ---------------------------------------------------------------------- the parent


def _vm_rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def spawn(model_name: str, call: str) -> dict:
    """Runs one call in a subprocess under the time and memory limits; its records and
    `limit` ("over N s", "over N GiB", "failed: ...") when it did not finish."""
    argv = [sys.executable, "-m", "benchmarks.cnn", f"--worker={model_name}:{call}"] + [
        f"--{k}={getattr(FLAGS, k)}" for k in ("images", "population", "generations",
                                                "samples", "batch", "repeats", "data", "warm")]
    err_file = tempfile.TemporaryFile("w+")  # a pipe would fill up and block the worker
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err_file, text=True,
                            start_new_session=True)
    start, peak, limit = time.perf_counter(), 0.0, None
    while proc.poll() is None:
        peak = max(peak, _vm_rss_gib(proc.pid))
        if time.perf_counter() - start > FLAGS.time_limit:
            limit = f"over {FLAGS.time_limit} s"
        elif peak > FLAGS.rss_limit_gib:
            limit = f"over {FLAGS.rss_limit_gib:g} GiB"
        if limit:
            os.killpg(proc.pid, 9)
            break
        time.sleep(0.2)
    out, _ = proc.communicate()
    err_file.seek(0)
    err = err_file.read()
    err_file.close()
    record = {"peak_polled_gib": peak, "wall": time.perf_counter() - start}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            rec = json.loads(line[7:])
            record[rec.pop("stage")] = rec
    if limit is None and proc.returncode != 0:
        limit = "failed: " + (err.strip().splitlines() or ["?"])[-1][:120]
    record["limit"] = limit
    return record


def _fmt_call(rec: dict) -> str:
    first, warm = rec.get("first"), rec.get("warm")
    peak = max([rec["peak_polled_gib"]] + [r["rss_gib"] for r in (first, warm) if r])
    cells = [f"{first['seconds']:.1f}" if first else "-",
             f"{warm['seconds']:.2f}" if warm else "-",
             f"{warm['cpu']:.2f}" if warm else "-", f"{peak:.2f}"]
    return " | ".join(cells + [rec["limit"] or ""])


def report_model(model_name: str, calls) -> dict:
    """Runs and prints the calls of one model; returns their records."""
    records = {}
    print(f"\n{model_name}: call | first call s (1 image, tracing included) | warm s / image "
          f"({FLAGS.images} images) | warm CPU s / image | peak RSS GiB | limit", flush=True)
    for call in calls:
        records[call] = rec = spawn(model_name, call)
        if call == "steps":
            print(f"  steps (batch {FLAGS.batch}) | {_fmt_steps(rec)}", flush=True)
        else:
            print(f"  {call} | {_fmt_call(rec)}", flush=True)
    return records


def _fmt_steps(rec: dict) -> str:
    steps = rec.get("steps")
    if not steps:
        return rec["limit"] or "no result"
    t = steps["seconds"]
    if "vanilla" in t:
        parts = [f"vanilla {1e3 * t['vanilla']:.0f} ms"]
        parts += [f"{k} {v / t['vanilla']:.1f} x" for k, v in t.items() if k != "vanilla"]
    else:  # killed before the warm steps: the first (tracing) steps it finished
        parts = [f"first step, tracing included: {k} {v:.1f} s"
                 for k, v in steps["first"].items()]
    return (", ".join(parts) + f"; peak {steps['rss_gib']:.2f} GiB"
            + (f"; {rec['limit']}" if rec["limit"] else ""))


def memory_sweep(widths, calls) -> dict:
    """Peak RSS of every call on CNN-S at each width, above the model's own footprint."""
    rows = {w: report_model("cnn_s" if float(w) == 1 else f"cnn_s_x{w}", calls)
            for w in widths}
    print("\nmemory sweep (CNN-S widths): width, hidden neurons, then per call the peak "
          "RSS above the process after building the model (GiB)")
    for w, recs in rows.items():
        model = next((r["model"] for r in recs.values() if "model" in r), None)
        if model is None:
            continue
        cells = []
        for call, r in recs.items():
            peaks = [r["peak_polled_gib"]] + [r[s]["rss_gib"] for s in ("first", "warm",
                                                                         "steps") if s in r]
            cells.append(f"{call} {max(peaks) - model['rss_gib']:.2f}")
        print(f"  x{w}: {model['neurons']} neurons, base {model['rss_gib']:.2f} GiB; "
              + ", ".join(cells))
    return rows


def main(argv):
    del argv
    if FLAGS.worker:
        model_name, call = FLAGS.worker.split(":")
        return run_call(model_name, call)
    if FLAGS.quick:  # flags given on the command line win
        for name, value in (("models", ["cnn_s"]), ("images", 1), ("generations", 2),
                            ("time_limit", 60)):
            if not FLAGS[name].present:
                setattr(FLAGS, name, value)
    calls = FLAGS.calls or [*CALLS, "steps"]
    unknown = [c for c in calls if c not in CALLS and c != "steps"]
    if unknown:
        raise app.UsageError(f"unknown calls {unknown}; choose from {[*CALLS, 'steps']}")
    print(f"machine: {os.cpu_count()} CPU cores; limits {FLAGS.time_limit} s and "
          f"{FLAGS.rss_limit_gib:g} GiB per call; distortion: population {FLAGS.population}, "
          f"{FLAGS.generations} generations, {FLAGS.samples} samples; random weights",
          flush=True)
    records = {name: report_model(name, calls) for name in FLAGS.models}
    if FLAGS.widths:
        records["sweep"] = memory_sweep(FLAGS.widths, [c for c in calls if c != "steps"])
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    app.run(main)
