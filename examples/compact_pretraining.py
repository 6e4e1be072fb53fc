"""Compact pretraining on Fashion-MNIST (Yu et al. (2025)): teacher -> compact store -> student -> linear probe.

1. Load a teacher: by default the library's shipped BYOL ConvNet (trained on unlabelled
   Fashion-MNIST) through ``load_teacher("checkpoint:<path>")``, which takes any prior checkpoint;
   ``--teacher train`` trains a small Barlow Twins one here instead (fast, but weak: in
   benchmarks/compact.py a 400-step one transferred nothing to the student).
2. Distil the images into a store of at most N = 100 images' worth of floats (bases +
   coefficients + approximation nets; resumable through ``checkpoint=``). U = V = 64 bases and
   H = 64 approximation nets, as benchmarks/compact.py measured best on 28 px images (the paper's
   rules give full-rank bases there and H = 4 nets that miss half of the rotated targets).
3. Save/load the store, decode it into (image, target) pairs (rotations included) and pretrain a
   fresh student on them by MSE regression.
4. Linear-probe the student on frozen features.

    .venv/bin/python examples/compact_pretraining.py --steps 100
    .venv/bin/python examples/compact_pretraining.py --teacher train --teacher-steps 200
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from accelerate_ssl.backbones import ConvNet
from accelerate_ssl.compact import CompactDataset, distill_compact, load_teacher, pretrain, train_teacher
from accelerate_ssl.data import load_fashion_mnist
from accelerate_ssl.evaluate import extract_features, linear_probe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-real", type=int, default=10000)
    p.add_argument("--teacher", default="shipped",
                   help="'shipped': the shipped prior shipped:fashion-mnist-byol; 'train': Barlow Twins here; "
                        "or any prior spec, e.g. checkpoint:<path>")
    p.add_argument("--teacher-steps", type=int, default=200, help="with --teacher train")
    p.add_argument("--steps", type=int, default=100, help="outer distillation steps")
    p.add_argument("--images", type=int, default=100, help="storage budget: the floats of N images")
    p.add_argument("--epochs", type=int, default=30, help="student pretraining epochs")
    p.add_argument("--pool-max-steps", type=int, default=100, help="training steps of each model in KRR-ST's pool")
    p.add_argument("--out", default="compact_fmnist.safetensors")
    args = p.parse_args()
    torch.manual_seed(0)

    images, _ = load_fashion_mnist("train")
    x = torch.from_numpy(images[: args.n_real]).float().div(255).unsqueeze(1)
    mean, std = x.mean(), x.std()
    x = (x - mean) / std

    if args.teacher == "train":
        teacher = train_teacher(x, method="barlow_twins", steps=args.teacher_steps, batch_size=128, widths=(16, 32, 64))
    else:
        teacher = load_teacher("shipped:fashion-mnist-byol" if args.teacher == "shipped" else args.teacher)
    teacher.standardize(x)  # unit-scale regression targets

    compact = distill_compact(x, teacher, budget_images=args.images, steps=args.steps, real_batch=256, pool_size=4,
                              pool_max_steps=args.pool_max_steps, pool_width=16, U=64, V=64, approx_hidden=64,
                              checkpoint=Path(args.out).with_suffix(".ckpt"))
    print("approximation nets miss", compact.metadata["approx_unexplained"], "of the rotated targets' variance")
    print(compact, compact.metadata["plan"]["counts"])
    compact.save(args.out)

    images, targets = CompactDataset.load(args.out).decode()  # X~ = {X_s, rot90, rot180, rot270}, Y~ via Q_a
    print("decoded pairs:", tuple(images.shape), tuple(targets.shape))
    student = ConvNet(1, widths=(16, 32, 64))
    pretrain(student, (images, targets), epochs=args.epochs)

    # linear probe on frozen features (the library's protocol: standardised features, Adam, 30 epochs)
    tr_x, tr_y = load_fashion_mnist("train")
    te_x, te_y = load_fashion_mnist("test")
    prep = lambda a: (torch.from_numpy(a).float().div(255).unsqueeze(1) - mean) / std  # noqa: E731 (the distilled space)
    f_tr, y_tr = extract_features(student, TensorDataset(prep(tr_x[:5000]), torch.from_numpy(tr_y[:5000])))
    f_te, y_te = extract_features(student, TensorDataset(prep(te_x), torch.from_numpy(te_y)))
    acc = linear_probe(f_tr, y_tr, f_te, y_te)["top1"]
    print(f"linear probe on the compact-pretrained student: {acc:.2f}%")


if __name__ == "__main__":
    main()
