"""keras_roll.models: the paper's FC and ResNet-18 builders and the torchvision converter.

References are independent of the code under test: a numpy forward pass written from
torchvision's definition of resnet18 (NCHW, torch weight layout, explicit loops over
kernel offsets), tf.autodiff.ForwardAccumulator / tf.GradientTape derivatives of the
Keras model, and published figures (torchvision's parameter count, output sizes).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.models import fc, load_torchvision_resnet18, resnet18
from tests.model_zoo import randomize_batch_norm

RELU = keras.layers.ReLU

# --------------------------------------------------------------------------------- FC


def test_fc_default_architecture():
    model = fc()
    assert model.input_shape == (None, 784) and model.output_shape == (None, 10)
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    assert [d.units for d in dense] == [300, 300, 300, 300, 10]
    assert sum(isinstance(layer, RELU) for layer in model.layers) == 4
    assert model.get_layer("predictions").activation is keras.activations.softmax
    assert model.count_params() == 784 * 300 + 300 + 3 * (300 * 300 + 300) + 300 * 10 + 10


def _numpy_fc(model, x, mean, std):
    h = (x.reshape(len(x), -1).astype(np.float64) - mean) / std
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    for d in dense[:-1]:
        h = np.maximum(h @ d.kernel.numpy() + d.bias.numpy(), 0.0)
    return h @ dense[-1].kernel.numpy() + dense[-1].bias.numpy()


def test_fc_normalizes_inside_and_flattens(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(6, 28, 28)).astype("float32")
    model = fc((28, 28), depth=2, width=16, classes=4, normalize=(0.25, 0.5),
               classifier_activation=None)
    np.testing.assert_allclose(model(x).numpy(), _numpy_fc(model, x, 0.25, 0.5),
                               rtol=1e-4, atol=1e-4)
    model.save(tmp_path / "fc.keras")  # the normalisation statistics travel with the model
    loaded = keras.models.load_model(tmp_path / "fc.keras")
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=1e-6)


def test_fc_margins_are_in_pixel_units():
    """Normalisation inside: the certified margin is sigma x the normalised-input margin."""
    rng = np.random.default_rng(1)
    mean, std = 0.1307, 0.3081
    x = rng.uniform(size=(8, 20))
    keras.utils.set_random_seed(1)
    # float64: margins divide small |z|, keep float32 round-off out of the comparison
    inside = fc((20,), depth=2, width=12, classes=3, normalize=(mean, std), dtype="float64")
    bare = fc((20,), depth=2, width=12, classes=3, normalize=None, dtype="float64")
    bare.set_weights(inside.get_weights())
    pixel = keras_roll.certify(inside, x, verbose=0)
    normed = keras_roll.certify(bare, (x - mean) / std, verbose=0)
    for p in (1, 2, np.inf):
        assert pixel.margins[p].dtype == np.float64
        np.testing.assert_allclose(pixel.margins[p], std * normed.margins[p], rtol=1e-5)
    # and the twin's input gradients are the tape's (through the Normalization layer)
    lin = keras_roll.linearize(inside)
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        z = keras.Model(inside.input, inside.get_layer("relu_1").input)(xt)
    ref = tape.batch_jacobian(z, xt).numpy()
    rows = [i for i, (n, _) in enumerate(lin.neuron_names_for(x)) if n == "relu_1"]
    np.testing.assert_allclose(lin.jacobian(x)[:, rows], ref, rtol=1e-12, atol=1e-12)


def test_fc_errors():
    with pytest.raises(ValueError, match="depth.*-1"):
        fc(depth=-1)
    with pytest.raises(ValueError, match="width.*0"):
        fc(width=0)
    with pytest.raises(ValueError, match="input_shape.*'784'"):
        fc(input_shape="784")
    with pytest.raises(ValueError, match="normalize.*0.5"):
        fc(normalize=0.5)
    with pytest.raises(ValueError, match="std.*0.0"):
        fc(normalize=(0.1, 0.0))
    with pytest.raises(ValueError, match="'tanh'"):
        fc(activation="tanh")
    with pytest.raises(ValueError, match="classifier_activation.*'relu'"):
        fc(classifier_activation="relu")
    leaky = fc(depth=1, width=4, activation="leaky_relu")
    assert isinstance(leaky.get_layer("leaky_relu_1"), keras.layers.LeakyReLU)


# ---------------------------------------------------------------------------- ResNet-18


def test_resnet18_shapes_and_parameter_count():
    model = resnet18()  # the paper's 299 x 299 x 3, 256 classes
    assert model.input_shape == (None, 299, 299, 3) and model.output_shape == (None, 256)
    sizes = {name: model.get_layer(name).output.shape[1:] for name in
             ("conv1", "stem_avgpool", "layer1_1_relu2", "layer2_1_relu2", "layer3_1_relu2",
              "layer4_1_relu2", "avgpool")}
    assert sizes == {
        "conv1": (150, 150, 64), "stem_avgpool": (75, 75, 64), "layer1_1_relu2": (75, 75, 64),
        "layer2_1_relu2": (38, 38, 128), "layer3_1_relu2": (19, 19, 256),
        "layer4_1_relu2": (10, 10, 512), "avgpool": (512,),
    }
    assert isinstance(model.get_layer("normalize"), keras.layers.Normalization)
    # torchvision.models.resnet18() has 11,689,512 parameters (1000 classes).
    imagenet = resnet18((224, 224, 3), classes=1000, stem_pool="max")
    trainable = sum(int(np.prod(w.shape)) for w in imagenet.trainable_weights)
    assert trainable == 11_689_512
    assert imagenet.get_layer("maxpool").output.shape[1:] == (56, 56, 64)
    assert imagenet.get_layer("layer4_1_relu2").output.shape[1:] == (7, 7, 512)


def _conv_kernels(seed):
    keras.utils.set_random_seed(seed)
    model = resnet18((8, 8, 3), classes=2)
    return {layer.name: layer.kernel.numpy() for layer in model.layers
            if isinstance(layer, keras.layers.Conv2D)}


def test_resnet18_initialisation_follows_the_global_seed():
    """keras.utils.set_random_seed fixes the convolutions' initial kernels (a rerun in
    another process starts from the same weights), another seed changes them, and two
    convolutions of one shape start from different kernels."""
    first, again, other = _conv_kernels(0), _conv_kernels(0), _conv_kernels(1)
    assert sorted(first) == sorted(again) == sorted(other) and len(first) == 20
    for name in first:
        np.testing.assert_array_equal(first[name], again[name], err_msg=name)
        assert not np.allclose(first[name], other[name]), name
    assert first["layer1_0_conv1"].shape == first["layer1_0_conv2"].shape
    assert not np.allclose(first["layer1_0_conv1"], first["layer1_0_conv2"])
    # torchvision's kaiming_normal_(mode="fan_out", relu): std sqrt(2 / (3 * 3 * 512)).
    assert np.std(first["layer4_1_conv2"]) == pytest.approx(np.sqrt(2 / (9 * 512)), rel=0.01)


def _normalized(model, value=0.5):
    x = np.full((1, 8, 8, 3), value, np.float32)
    return model.get_layer("normalize")(x).numpy()[0, 0, 0]


def test_resnet18_normalization_options():
    imagenet = (0.5 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    np.testing.assert_allclose(_normalized(resnet18((8, 8, 3), classes=2)), imagenet, rtol=1e-5)
    paper = resnet18((8, 8, 3), classes=2, normalize="paper")
    np.testing.assert_allclose(_normalized(paper),
                               (0.5 - np.array([0.485, 0.456, 0.406])) / 0.225, rtol=1e-5)
    bare = resnet18((8, 8, 3), classes=2, normalize=False)
    assert not any(isinstance(layer, keras.layers.Normalization) for layer in bare.layers)


def test_resnet18_errors(tmp_path):
    with pytest.raises(ValueError, match="stem_pool.*'min'"):
        resnet18((32, 32, 3), stem_pool="min")
    with pytest.raises(ValueError, match="input_shape.*32, 32"):
        resnet18((32, 32))
    with pytest.raises(ValueError, match="3 per-channel values.*1 channels"):
        resnet18((32, 32, 1))
    with pytest.raises(ValueError, match="classes.*0"):
        resnet18((32, 32, 3), classes=0)
    with pytest.raises(ValueError, match="normalize.*'cifar'"):
        resnet18((32, 32, 3), normalize="cifar")
    with pytest.raises(ValueError, match="np.savez"):
        resnet18((32, 32, 3), weights="imagenet")
    with pytest.raises(FileNotFoundError, match="nothere.npz"):
        resnet18((32, 32, 3), weights=tmp_path / "nothere.npz")
    gray = resnet18((32, 32, 1), classes=3, normalize=(0.5, 0.2))
    assert gray.output_shape == (None, 3)
    x = np.full((1, 4, 4, 1), 0.9, np.float32)
    np.testing.assert_allclose(gray.get_layer("normalize")(x).numpy(), (0.9 - 0.5) / 0.2,
                               rtol=1e-5)


# ------------------------------------------------------ torchvision state dict, numpy net


def torchvision_state_dict(classes, seed=0):
    """A synthetic torchvision resnet18 state dict: torchvision's names, shapes, dtypes."""
    rng = np.random.default_rng(seed)
    sd = {}

    def conv(name, cout, cin, k):
        sd[f"{name}.weight"] = (rng.normal(size=(cout, cin, k, k))
                                * np.sqrt(2.0 / (cin * k * k))).astype(np.float32)

    def bn(name, c):
        sd[f"{name}.weight"] = rng.uniform(0.5, 1.5, c).astype(np.float32)
        sd[f"{name}.bias"] = rng.normal(0, 0.1, c).astype(np.float32)
        sd[f"{name}.running_mean"] = rng.normal(0, 0.1, c).astype(np.float32)
        sd[f"{name}.running_var"] = rng.uniform(0.5, 2.0, c).astype(np.float32)
        sd[f"{name}.num_batches_tracked"] = np.array(1000, np.int64)

    conv("conv1", 64, 3, 7)
    bn("bn1", 64)
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            p = f"layer{stage}.{block}"
            conv(f"{p}.conv1", cout, cin if block == 0 else cout, 3)
            bn(f"{p}.bn1", cout)
            conv(f"{p}.conv2", cout, cout, 3)
            bn(f"{p}.bn2", cout)
            if block == 0 and stage > 1:
                conv(f"{p}.downsample.0", cout, cin, 1)
                bn(f"{p}.downsample.1", cout)
        cin = cout
    sd["fc.weight"] = rng.normal(0, 0.05, (classes, 512)).astype(np.float32)
    sd["fc.bias"] = rng.normal(0, 0.05, classes).astype(np.float32)
    return sd


def _np_conv(x, w, stride, pad):
    """torch.nn.Conv2d (no bias) on NCHW float64 arrays, w [out, in, kh, kw]."""
    x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    kh, kw = w.shape[2:]
    h = (x.shape[2] - kh) // stride + 1
    wd = (x.shape[3] - kw) // stride + 1
    out = np.zeros((x.shape[0], w.shape[0], h, wd))
    for i in range(kh):
        for j in range(kw):
            rows = slice(i, i + stride * (h - 1) + 1, stride)
            cols = slice(j, j + stride * (wd - 1) + 1, stride)
            patch = x[:, :, rows, cols]
            out += np.einsum("bchw,oc->bohw", patch, w[:, :, i, j])
    return out


def _np_pool(x, kind):
    """MaxPool2d(3, 2, padding=1) (pads with -inf) or AvgPool2d(3, 2, padding=1)."""
    fill = -np.inf if kind == "max" else 0.0
    x = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=fill)
    h = (x.shape[2] - 3) // 2 + 1
    w = (x.shape[3] - 3) // 2 + 1
    windows = np.stack([x[:, :, i : i + 2 * (h - 1) + 1 : 2, j : j + 2 * (w - 1) + 1 : 2]
                        for i in range(3) for j in range(3)])
    return windows.max(axis=0) if kind == "max" else windows.sum(axis=0) / 9.0


def numpy_resnet18(sd, x, stem_pool, mean, std):
    """torchvision's resnet18 forward in numpy; x is NHWC in [0, 1], returns logits."""
    sd = {k: v.astype(np.float64) for k, v in sd.items()}

    def bn(h, name):
        shape = (1, -1, 1, 1)
        scale = sd[f"{name}.weight"] / np.sqrt(sd[f"{name}.running_var"] + 1e-5)
        return ((h - sd[f"{name}.running_mean"].reshape(shape)) * scale.reshape(shape)
                + sd[f"{name}.bias"].reshape(shape))

    relu = lambda h: np.maximum(h, 0.0)
    h = (x.astype(np.float64) - np.asarray(mean)) / np.asarray(std)
    h = h.transpose(0, 3, 1, 2)
    h = _np_pool(relu(bn(_np_conv(h, sd["conv1.weight"], 2, 3), "bn1")), stem_pool)
    for stage in range(1, 5):
        for block in range(2):
            p = f"layer{stage}.{block}"
            stride = 2 if (block == 0 and stage > 1) else 1
            out = relu(bn(_np_conv(h, sd[f"{p}.conv1.weight"], stride, 1), f"{p}.bn1"))
            out = bn(_np_conv(out, sd[f"{p}.conv2.weight"], 1, 1), f"{p}.bn2")
            if f"{p}.downsample.0.weight" in sd:
                h = bn(_np_conv(h, sd[f"{p}.downsample.0.weight"], stride, 0),
                       f"{p}.downsample.1")
            h = relu(out + h)
    features = h.mean(axis=(2, 3))
    return features @ sd["fc.weight"].T + sd["fc.bias"]


@pytest.mark.parametrize("stem_pool", ["avg", "max"])
def test_converted_weights_match_numpy_torchvision_forward(tmp_path, stem_pool):
    sd = torchvision_state_dict(classes=7, seed=1)
    np.savez(tmp_path / "rn18.npz", **sd)
    model = resnet18((37, 37, 3), classes=7, stem_pool=stem_pool, classifier_activation=None)
    report = load_torchvision_resnet18(model, tmp_path / "rn18.npz")
    # torchvision's resnet18 state dict has 122 entries, 20 of them num_batches_tracked.
    assert len(sd) == 122 and len(report.loaded) == 102 and len(report.skipped) == 20
    assert all(k.endswith("num_batches_tracked") for k in report.skipped)
    x = np.random.default_rng(2).uniform(size=(3, 37, 37, 3)).astype(np.float32)
    expected = numpy_resnet18(sd, x, stem_pool, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    actual = model(x).numpy()
    scale = np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4 * scale)
    assert np.ptp(expected) > 0.1 * scale  # logits differ between classes and images


def test_weights_argument_and_softmax(tmp_path):
    sd = torchvision_state_dict(classes=5, seed=3)
    np.savez(tmp_path / "rn18.npz", **{"module." + k: v for k, v in sd.items()})  # DataParallel
    model = resnet18((33, 33, 3), classes=5, normalize="paper", weights=tmp_path / "rn18.npz")
    x = np.random.default_rng(4).uniform(size=(2, 33, 33, 3)).astype(np.float32)
    logits = numpy_resnet18(sd, x, "avg", (0.485, 0.456, 0.406), 0.225)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    np.testing.assert_allclose(model(x).numpy(), probs, atol=2e-5)


def test_converter_fc_handling_and_errors(tmp_path):
    sd = torchvision_state_dict(classes=1000, seed=5)
    path = tmp_path / "imagenet.npz"
    np.savez(path, **sd)
    model = resnet18((32, 32, 3), classes=4)
    fc_before = model.get_layer("fc").kernel.numpy().copy()
    report = load_torchvision_resnet18(model, path)  # "auto": 1000 != 4 classes, fc skipped
    assert {"fc.weight", "fc.bias"} <= set(report.skipped)
    np.testing.assert_array_equal(model.get_layer("fc").kernel.numpy(), fc_before)
    np.testing.assert_array_equal(model.get_layer("conv1").kernel.numpy(),
                                  sd["conv1.weight"].transpose(2, 3, 1, 0))
    np.testing.assert_array_equal(model.get_layer("layer3_0_downsample_1").moving_variance.numpy(),
                                  sd["layer3.0.downsample.1.running_var"])
    with pytest.raises(ValueError, match=r"fc.weight: file \(1000, 512\), model expects \(4, "):
        load_torchvision_resnet18(model, path, load_fc=True)
    assert "fc.weight" in load_torchvision_resnet18(model, path, load_fc=False).skipped

    # Nothing is assigned unless everything fits.
    fresh = resnet18((32, 32, 3), classes=1000)
    conv1_before = fresh.get_layer("conv1").kernel.numpy().copy()
    bad = dict(sd)
    bad["layer2.1.conv2.weight"] = bad["layer2.1.conv2.weight"][:, :, :2, :2]
    np.savez(tmp_path / "bad_shape.npz", **bad)
    with pytest.raises(ValueError, match=r"layer2.1.conv2.weight: file \(128, 128, 2, 2\)"):
        load_torchvision_resnet18(fresh, tmp_path / "bad_shape.npz")
    np.testing.assert_array_equal(fresh.get_layer("conv1").kernel.numpy(), conv1_before)

    missing = {k: v for k, v in sd.items() if k != "layer4.1.bn2.running_var"}
    missing["layer5.0.conv1.weight"] = np.zeros((1,), np.float32)
    np.savez(tmp_path / "keys.npz", **missing)
    with pytest.raises(ValueError, match="missing keys.*layer4.1.bn2.running_var.*unexpected "
                                         "keys.*layer5.0.conv1.weight"):
        load_torchvision_resnet18(fresh, tmp_path / "keys.npz")
    with pytest.raises(ValueError, match="load_fc.*'yes'"):
        load_torchvision_resnet18(fresh, path, load_fc="yes")
    (tmp_path / "text.npz").write_text("not an archive")
    with pytest.raises(ValueError, match="text.npz.*np.savez"):
        load_torchvision_resnet18(fresh, tmp_path / "text.npz")
    with pytest.raises(FileNotFoundError, match="absent.npz.*torchvision.models.resnet18"):
        load_torchvision_resnet18(fresh, tmp_path / "absent.npz")
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="fc"),
                              keras.layers.LayerNormalization(name="ln")])
    with pytest.raises(ValueError, match="'ln'.*LayerNormalization"):
        load_torchvision_resnet18(other, path)


# ------------------------------------------------------------------- the compiled twin


@pytest.fixture(scope="module")
def small_resnet():
    """The paper's ResNet-18 (average-pool stem) at 32 x 32 with 5 classes, random BN."""
    keras.utils.set_random_seed(0)
    model = resnet18((32, 32, 3), classes=5)
    randomize_batch_norm(model, seed=1)
    return model


def _check_twin_against_forward_mode_autodiff(model):
    """Every ReLU pre-activation's derivative along random directions, and the logits'."""
    rng = np.random.default_rng(2)
    b, k = 2, 3
    x = rng.uniform(size=(b, 32, 32, 3)).astype(np.float32)
    v = rng.normal(size=(b, k, 32, 32, 3)).astype(np.float32)

    lin = keras_roll.linearize(model)
    assert lin.output_link == "softmax"
    jvp = lin.jvp(x, v)
    fwd = lin.forward(x)

    relus = [layer for layer in model.layers if isinstance(layer, RELU)]
    assert len(relus) == 17
    probe = keras.Model(model.input, [layer.input for layer in relus]
                        + [model.get_layer("avgpool").output])
    fc_layer = model.get_layer("fc")
    xs = tf.constant(np.repeat(x, k, axis=0))
    with tf.autodiff.ForwardAccumulator(xs, tf.constant(v.reshape(b * k, 32, 32, 3))) as acc:
        outs = probe(xs, training=False)
        logits = outs[-1] @ fc_layer.kernel + fc_layer.bias  # before the folded softmax
    layout = {name: np.arange(start, start + int(np.prod(shape)))
              for name, start, shape in lin.neuron_layout(x.shape[1:])}
    neurons = jvp.neurons.numpy()
    for layer, out in zip(relus, outs[:-1]):
        rows = layout[layer.name]
        ref = acc.jvp(out).numpy().reshape(b, k, -1)
        assert len(rows) == ref.shape[-1], layer.name
        scale = np.abs(ref).max()
        np.testing.assert_allclose(neurons[:, :, rows], ref, rtol=0, atol=2e-5 * scale,
                                   err_msg=layer.name)
        value = out.numpy()[::k].reshape(b, -1)
        np.testing.assert_allclose(fwd.neurons.z.numpy()[:, rows], value, rtol=0,
                                   atol=2e-5 * np.abs(value).max(), err_msg=layer.name)
    ref = acc.jvp(logits).numpy().reshape(b, k, -1)
    np.testing.assert_allclose(jvp.logits.numpy(), ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_resnet18_twin_matches_forward_mode_autodiff(small_resnet):
    _check_twin_against_forward_mode_autodiff(small_resnet)


@pytest.mark.slow
def test_resnet18_max_pool_stem_twin_matches_forward_mode_autodiff():
    keras.utils.set_random_seed(0)
    model = resnet18((32, 32, 3), classes=5, stem_pool="max")
    randomize_batch_norm(model, seed=1)
    _check_twin_against_forward_mode_autodiff(model)


@pytest.mark.slow  # sampled ROLL on small CNNs: test_roll.py; this twin: the test above
def test_resnet18_sampled_roll_loss_and_gradients(small_resnet):
    model = small_resnet
    x = np.random.default_rng(5).uniform(size=(2, 32, 32, 3)).astype(np.float32)
    with tf.GradientTape() as tape:
        loss = keras_roll.roll_loss(model, x, C=1.0, gamma=100.0, samples=6, strata="channel",
                                    seed=7)
        total = tf.reduce_mean(loss)
    assert loss.shape == (2,) and np.all(np.isfinite(loss.numpy())) and np.all(loss > 0)
    grads = tape.gradient(total, model.trainable_weights)
    named = dict(zip([w.path for w in model.trainable_weights], grads))
    # The regularizer involves every hidden neuron but not the logits: fc has no gradient.
    assert sorted(k for k, g in named.items() if g is None) == ["fc/bias", "fc/kernel"]
    for path, g in named.items():
        if g is not None:
            assert np.all(np.isfinite(g.numpy())) and np.abs(g.numpy()).max() > 0, path
    # the same seed gives the same estimate
    again = keras_roll.roll_loss(model, x, C=1.0, gamma=100.0, samples=6, strata="channel", seed=7)
    np.testing.assert_allclose(again.numpy(), loss.numpy(), rtol=1e-6)


@pytest.mark.slow
def test_resnet18_paper_size_compiles_and_samples_roll():
    """At 299 x 299 (4.19 M neurons per example) the sampled loss runs within a budget."""
    model = resnet18()
    x = np.random.default_rng(6).uniform(size=(2, 299, 299, 3)).astype(np.float32)
    lin = keras_roll.linearize(model, memory_budget=2**30)
    # ReLUs: stem 150^2*64, 4 per stage: 75^2*64, 38^2*128, 19^2*256, 10^2*512
    expected = 150**2 * 64 + 4 * (75**2 * 64 + 38**2 * 128 + 19**2 * 256 + 10**2 * 512)
    assert lin.num_neurons((299, 299, 3)) == expected == 4_193_792
    loss = keras_roll.roll_loss(lin, x, samples=4, strata="channel", seed=1)
    assert loss.shape == (2,) and np.all(np.isfinite(loss.numpy()))


@pytest.mark.parametrize("how", ["argument", pytest.param("global", marks=pytest.mark.slow)])
def test_resnet18_mixed_precision_has_a_float32_head(how):
    """Under mixed_float16 (as an argument or as the global policy) the body computes in
    float16 and the classifier in float32, as Keras' mixed-precision guide advises."""
    try:
        if how == "global":
            keras.mixed_precision.set_global_policy("mixed_float16")
            model = resnet18(input_shape=(32, 32, 3), classes=5)
        else:
            model = resnet18(input_shape=(32, 32, 3), classes=5, dtype="mixed_float16")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert model.get_layer("conv1").compute_dtype == "float16"
    assert model.get_layer("fc").compute_dtype == "float32"
    x = np.random.default_rng(0).uniform(0, 1, (2, 32, 32, 3)).astype("float32")
    out = model(x)
    assert out.dtype == tf.float32


@pytest.mark.slow
def test_resnet18_with_a_float16_body_is_certified():
    """The twin of a float16 body certifies (its guards: tests/test_soundness.py)."""
    model = resnet18(input_shape=(32, 32, 3), classes=5, dtype="mixed_float16")
    x = np.random.default_rng(0).uniform(0, 1, (2, 32, 32, 3)).astype("float32")
    cert = keras_roll.certify(model, x, verbose=False, norms=(2,), rigor="float32")
    assert cert.margins[2].shape == (2,) and np.all(cert.margins[2] >= 0)
