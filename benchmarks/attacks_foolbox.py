"""foolbox's FMN, DDN and PGD on CNN-S with the weights of `benchmarks.attacks`.

Runs in a separate environment with PyTorch and foolbox (keras_roll does not depend on
them), on the `.npz` that `python -m benchmarks.attacks --save=cnn_s.npz` writes (the
weights, the images, their labels and the upper bounds of the walk and of the attack
started from its points, in 0-255 input units):

    python -m venv /tmp/peer-venv && /tmp/peer-venv/bin/pip install torch foolbox
    OMP_WAIT_POLICY=PASSIVE /tmp/peer-venv/bin/python benchmarks/attacks_foolbox.py \
        cnn_s.npz --threads=2 [--out=foolbox.npz]

The Keras model's Rescaling(1/255) is folded into the inputs (foolbox sees [0, 1]
pixels); distances are converted back. Per norm: FMN (l1, l2, l_inf), DDN (l2), and
PGD at fixed radii bisected per image between half and all of the best distance so
far (`--bisections` halvings, `--pgd_steps` steps, a random start each). Prints, per
norm, the ratio of keras_roll's upper bound to the best of foolbox's attacks: with
the pixel box [0, 1] (against `minimal_norm_attack(domain=(0, 255))`) and with a box
wide enough to impose nothing (against `robust_radius`, which imposes no domain).
`--best=<an earlier --out>` only compares. `--out` keeps foolbox's best distances
(`best_<box>_<norm>`, 0-255 units), each attack's (`FMN_...`, `DDN_...`, `PGD_...`:
PGD's bisection includes the others' best) and the best points (`points_<box>_<norm>`,
NHWC, 0-255 units, as float64 of the float32 points foolbox evaluated), which
`python -m benchmarks.attacks --load=cnn_s.npz --foolbox=foolbox.npz` checks in the Keras
model under keras_roll's flip criterion.
"""

import argparse
import time

import foolbox as fb
import numpy as np
import torch

NORMS = {"linf": np.inf, "l2": 2, "l1": 1}
BOXES = {"box": (0.0, 1.0, "attack_box"), "none": (-10.0, 11.0, "attack")}


class CnnS(torch.nn.Module):
    """CNN-S (`benchmarks.cnn_models.cnn_s`) on [0, 1] inputs, NCHW, flattened in Keras'
    NHWC order."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(1, 16, 4, stride=2)  # Keras 'valid', 28 -> 13
        self.c2 = torch.nn.Conv2d(16, 32, 4, stride=2)  # 13 -> 5
        self.d1 = torch.nn.Linear(5 * 5 * 32, 100)
        self.d2 = torch.nn.Linear(100, 10)

    def forward(self, x):
        h = torch.relu(self.c2(torch.relu(self.c1(x))))
        h = h.permute(0, 2, 3, 1).reshape(x.shape[0], -1)
        return self.d2(torch.relu(self.d1(h)))


def load(path):
    d = np.load(path)
    w = [d[f"weight_{i}"] for i in range(8)]
    net = CnnS().eval()
    with torch.no_grad():
        for conv, k, b in ((net.c1, w[0], w[1]), (net.c2, w[2], w[3])):
            conv.weight.copy_(torch.tensor(k.transpose(3, 2, 0, 1)))
            conv.bias.copy_(torch.tensor(b))
        for lin, k, b in ((net.d1, w[4], w[5]), (net.d2, w[6], w[7])):
            lin.weight.copy_(torch.tensor(k.T))
            lin.bias.copy_(torch.tensor(b))
    x = torch.tensor(d["x"].transpose(0, 3, 1, 2) / 255.0, dtype=torch.float32)
    y = torch.tensor(d["y"], dtype=torch.int64)
    assert (net(x).argmax(1) == y).all(), "the transferred weights classify differently"
    return d, net, x, y


def distances(net, x, y, adv, norm):
    """Distances (0-255 units) of the points that flip, inf elsewhere."""
    adv = adv.detach()
    flip = (net(adv).argmax(1) != y).numpy()
    dist = (adv - x).reshape(len(y), -1).norm(p=norm, dim=1).double().numpy() * 255.0
    return np.where(flip, dist, np.inf)


def pgd_bisected(net, fm, attack, x, y, best, points, norm, bisections):
    """Per image: PGD at radii bisected in [best / 2, best] (0-255 units); updates
    `points` (`[n, C, H, W]`, [0, 1] units) where it finds a closer one."""
    out = best.copy()
    for i in np.flatnonzero(np.isfinite(best)):
        lo, hi = 0.5 * best[i] / 255.0, best[i] / 255.0
        for _ in range(bisections):
            eps = 0.5 * (lo + hi)
            _, adv, _ = attack(fm, x[i:i + 1], y[i:i + 1], epsilons=eps)
            d = distances(net, x[i:i + 1], y[i:i + 1], adv, norm)[0]
            if d < out[i]:
                out[i], points[i] = d, adv[0].detach()
            hi, lo = (eps, lo) if np.isfinite(d) else (hi, eps)
    return out


def report(d, best, tag, label):
    """keras_roll's upper bounds over foolbox's best: median, P90, max, and the shares
    at or below it (exactly, and within 1e-4: keras_roll's points win by a gap of
    2^-16 of the largest output, foolbox's by any)."""
    key = f"{BOXES[tag][2]}_{label}"
    if key not in d:
        return
    r = d[key] / best
    print(f"{tag} {label}: keras_roll / foolbox's best median {np.median(r):.4f}, "
          f"P90 {np.percentile(r, 90):.4f}, max {np.max(r):.4f}, <= on "
          f"{np.mean(r <= 1 + 1e-9):.0%} (within 1e-4: {np.mean(r <= 1 + 1e-4):.0%}); walk / "
          f"foolbox's best median {np.median(d[f'walk_{label}'] / best):.3f}", flush=True)


def attacks_of(label, steps, pgd_steps):
    fmn = {"linf": fb.attacks.LInfFMNAttack, "l2": fb.attacks.L2FMNAttack,
           "l1": fb.attacks.L1FMNAttack}[label](steps=steps)
    pgd = {"linf": fb.attacks.LinfPGD, "l2": fb.attacks.L2PGD,
           "l1": fb.attacks.L1PGD}[label](steps=pgd_steps)
    minimal = {"FMN": fmn}
    if label == "l2":
        minimal["DDN"] = fb.attacks.DDNAttack(steps=steps)
    return minimal, pgd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("npz")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--pgd_steps", type=int, default=100)
    parser.add_argument("--bisections", type=int, default=10)
    parser.add_argument("--norms", default="linf,l2,l1")
    parser.add_argument("--boxes", default="none,box")
    parser.add_argument("--out", default=None)
    parser.add_argument("--best", default=None, help="an earlier --out on the same weights "
                        "and images: compare with its distances, run no attack")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    d, net, x, y = load(args.npz)
    if args.best:
        known = np.load(args.best)
        for tag in args.boxes.split(","):
            for label in args.norms.split(","):
                if f"best_{tag}_{label}" in known:
                    report(d, known[f"best_{tag}_{label}"], tag, label)
        return
    n = len(y)
    saved = {}
    for tag in args.boxes.split(","):
        lo, hi, _ = BOXES[tag]
        fm = fb.PyTorchModel(net, bounds=(lo, hi))
        for label in args.norms.split(","):
            norm = NORMS[label]
            minimal, pgd = attacks_of(label, args.steps, args.pgd_steps)
            best, times, points = np.full(n, np.inf), [], x.clone()
            for name, attack in minimal.items():
                start = time.perf_counter()
                _, adv, _ = attack(fm, x, y, epsilons=None)
                found = saved[f"{name}_{tag}_{label}"] = distances(net, x, y, adv, norm)
                closer = torch.tensor(found < best)
                points[closer] = adv.detach()[closer]
                best = np.minimum(best, found)
                times.append(f"{name} {(time.perf_counter() - start) / n:.2f}")
            start = time.perf_counter()
            with_pgd = pgd_bisected(net, fm, pgd, x, y, best, points, norm, args.bisections)
            times.append(f"PGD {(time.perf_counter() - start) / n:.2f}")
            pgd_won = float(np.mean(with_pgd < best))
            saved[f"PGD_{tag}_{label}"] = with_pgd
            best = saved[f"best_{tag}_{label}"] = with_pgd
            # the best points, NHWC in 0-255 units (NaN where none), for
            # `python -m benchmarks.attacks --foolbox=...` (the Keras model's verdict)
            pts = points.permute(0, 2, 3, 1).double().numpy() * 255.0
            pts[~np.isfinite(best)] = np.nan
            saved[f"points_{tag}_{label}"] = pts
            print(f"{tag} {label}: s/image {', '.join(times)}; PGD improved "
                  f"{pgd_won:.0%}", flush=True)
            report(d, best, tag, label)
            if args.out:
                np.savez(args.out, **saved)


if __name__ == "__main__":
    main()
