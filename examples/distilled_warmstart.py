"""Warm-start a backbone on a distilled set (DWA), then continue with your own training loop.

    .venv/bin/python examples/distilled_warmstart.py            # ~2-4 min on 2 CPU cores
    .venv/bin/python examples/distilled_warmstart.py --method fadrm --ipc 5 --iterations 300

Steps: (1) a small BatchNorm teacher (trained here for one short epoch, or --weights), (2)
``synthesize`` IPC images per class (PNG class folders + manifest in --out), (3) ``warm_start`` a fresh
GroupNorm ConvNet (a feature backbone: it gets a temporary linear head) by KD from the teacher, (4) your
own loop carries on from the warmed-up weights -- here a few supervised steps on real data; it could
equally be an SSL loop with ``rela.wrap(loss)``. The script prints the test accuracy after the same
loop from the warm start and from scratch (same initial weights, same batches).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from accelerate_ssl.backbones import ConvNet, ResNetSmall
from accelerate_ssl.data import FashionMNIST
from accelerate_ssl.distill import synthesize, warm_start


def as_tensor(ds, n, mean, std):
    return (ds.data[:n].float().div(255).unsqueeze(1) - mean[0]) / std[0], ds.targets[:n]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="dwa", choices=["sre2l", "sre2l++", "dwa", "fadrm"])
    p.add_argument("--ipc", type=int, default=5)
    p.add_argument("--iterations", type=int, default=150)
    p.add_argument("--weights", help="state_dict of ResNetSmall(1, 10, (16, 32, 64)); trained here if omitted")
    p.add_argument("--out", default="runs/distilled-warmstart")
    p.add_argument("--main-steps", type=int, default=100, help="steps of the 'user loop' after the warm start")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    train, test = FashionMNIST("train"), FashionMNIST("test")
    mean, std = train.mean, train.std
    x_tr, y_tr = as_tensor(train, 5000, mean, std)
    x_te, y_te = as_tensor(test, 2000, mean, std)

    # (1) teacher with BatchNorm
    teacher = ResNetSmall(1, 10, (16, 32, 64))
    if args.weights:
        teacher.load_state_dict(torch.load(args.weights, map_location="cpu", weights_only=True))
    else:
        opt = torch.optim.Adam(teacher.parameters(), lr=2e-3)
        for i in range(0, len(x_tr), 64):
            loss = F.cross_entropy(teacher(x_tr[i : i + 64]), y_tr[i : i + 64])
            opt.zero_grad(), loss.backward(), opt.step()
    teacher.eval()

    # (2) the distilled set (resumable: re-running continues where it stopped)
    distilled = synthesize(teacher, method=args.method, ipc=args.ipc, real=train, mean=mean, std=std,
                           iterations=args.iterations, out_dir=args.out, teacher_spec="resnet_small(16,32,64)")
    print(f"{len(distilled)} images in {args.out} ({distilled.manifest['seconds_per_image']:.2f} s/image)")

    def user_loop(backbone):
        """Stand-in for *your* training loop (supervised here; an SSL loop with ReLA works the same)."""
        torch.manual_seed(2)  # same head init and batches for both runs
        head = nn.Linear(backbone.feature_dim, 10)
        opt = torch.optim.AdamW(list(backbone.parameters()) + list(head.parameters()), lr=1e-3)
        backbone.train()
        for step in range(args.main_steps):
            idx = torch.randint(0, len(x_tr), (64,))
            loss = F.cross_entropy(head(backbone(x_tr[idx])), y_tr[idx])
            opt.zero_grad(), loss.backward(), opt.step()
        backbone.eval()
        with torch.no_grad():
            return float((head(backbone(x_te)).argmax(1) == y_te).float().mean())

    # (3) warm start, (4) the user's loop continues from the warmed-up weights
    torch.manual_seed(1)
    warmed = ConvNet(1, (32, 64, 128))
    scratch = ConvNet(1, (32, 64, 128))
    scratch.load_state_dict(warmed.state_dict())
    warm_start(warmed, distilled, teacher=teacher, epochs=30, batch_size=16, temperature=4.0)
    acc_warm, acc_scratch = user_loop(warmed), user_loop(scratch)
    print(f"after {args.main_steps} steps of the main loop: warm-started {acc_warm:.3f} vs from scratch {acc_scratch:.3f}")


if __name__ == "__main__":
    main()
