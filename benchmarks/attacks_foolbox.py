"""foolbox's FMN (l_inf, l2) and DDN (l2) on CNN-S with the weights of `benchmarks.attacks`.

Runs in a separate environment with PyTorch and foolbox (keras_roll does not depend on
them), on the `.npz` that `python -m benchmarks.attacks --save=cnn_s.npz` writes (the
weights, the images, their labels and the upper bounds of the walk and of the attack
started from its points, in 0-255 input units):

    python -m venv /tmp/peer-venv && /tmp/peer-venv/bin/pip install torch foolbox
    OMP_WAIT_POLICY=PASSIVE /tmp/peer-venv/bin/python benchmarks/attacks_foolbox.py \
        cnn_s.npz --threads=2

The Keras model's Rescaling(1/255) is folded into the inputs (foolbox sees [0, 1]
pixels); distances are converted back. Prints, per norm, the ratio of keras_roll's
upper bound to the best of foolbox's attacks: with the pixel box [0, 1] (against
`minimal_norm_attack(domain=(0, 255))`) and with a box wide enough to impose nothing
(against `robust_radius`, which imposes no domain).
"""

import argparse
import time

import foolbox as fb
import numpy as np
import torch


class CnnS(torch.nn.Module):
    """CNN-S on [0, 1] inputs, NCHW, flattened in Keras' NHWC order."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(1, 16, 4, stride=2, padding=1)  # Keras 'same', 28 -> 14
        self.c2 = torch.nn.Conv2d(16, 32, 4, stride=2, padding=1)  # 14 -> 7
        self.d1 = torch.nn.Linear(7 * 7 * 32, 100)
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("npz")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    d, net, x, y = load(args.npz)
    n = len(y)
    for lo, hi, tag, key in ((0.0, 1.0, "box [0, 1]", "attack_box"),
                             (-10.0, 11.0, "no box", "attack")):
        fm = fb.PyTorchModel(net, bounds=(lo, hi))
        for norm, label, attacks in (
                (np.inf, "linf", {"FMN": fb.attacks.LInfFMNAttack(steps=args.steps)}),
                (2, "l2", {"FMN": fb.attacks.L2FMNAttack(steps=args.steps),
                           "DDN": fb.attacks.DDNAttack(steps=args.steps)})):
            best = np.full(n, np.inf)
            for name, attack in attacks.items():
                start = time.perf_counter()
                _, adv, _ = attack(fm, x, y, epsilons=None)
                seconds = (time.perf_counter() - start) / n
                adv = adv.detach()
                flip = (net(adv).argmax(1) != y).numpy()
                dist = (adv - x).reshape(n, -1).norm(p=norm, dim=1).double().numpy() * 255.0
                best = np.minimum(best, np.where(flip, dist, np.inf))
                print(f"{tag} {label} {name}: {seconds:.2f} s/image", flush=True)
            r = d[f"{key}_{label}"] / best
            print(f"{tag} {label}: keras_roll / foolbox's best median {np.median(r):.3f}, max "
                  f"{np.max(r):.3f}, <= on {np.mean(r <= 1 + 1e-9):.0%}; walk / foolbox's best "
                  f"median {np.median(d[f'walk_{label}'] / best):.3f}", flush=True)


if __name__ == "__main__":
    main()
