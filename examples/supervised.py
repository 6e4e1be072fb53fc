"""Supervised training with ReLA (ReLA v2, App. K): ``loss = rela.wrap(cross_entropy)``.

A ConvNet classifier on Fashion-MNIST; ReLA pulls the backbone's features toward a prior model's
precomputed targets while the cross-entropy takes over as lambda decays.

    python examples/supervised.py --steps 200
    python examples/supervised.py --steps 10 --limit 512 --test-limit 512      # seconds
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision.transforms as T
from torch import nn
from torch.utils.data import DataLoader

from accelerate_ssl import ReLA, TargetStore, create_prior, precompute_targets
from accelerate_ssl.backbones import ConvNet
from accelerate_ssl.data import FashionMNIST


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--limit", type=int, default=10000, help="training images (first N of the train split)")
    p.add_argument("--test-limit", type=int, default=2000)
    p.add_argument("--prior", default="shipped:digits-byol",
                   help="prior spec for create_prior (default: the shipped BYOL ConvNet trained on other data, scikit-learn digits: measured to save steps on Fashion-MNIST; an untrained network saves nothing)")
    p.add_argument("--store", type=Path, default=None, help="TargetStore folder (default ./rela-targets/<prior>-<limit>)")
    p.add_argument("--schedule", default=None,
                   help="decay | switch | constant:<lambda> | epochs:<fraction> (default: the library's, decay for a "
                        "loss computed before wrap, as here)")
    p.add_argument("--no-rela", action="store_true")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    clean = FashionMNIST("train", limit=args.limit)
    tf = T.Compose([T.RandomCrop(28, padding=2), T.ToTensor(), T.Normalize(clean.mean, clean.std)])
    loader = DataLoader(FashionMNIST("train", limit=args.limit, transform=tf), batch_size=args.batch_size,
                        shuffle=True, drop_last=True)
    backbone = ConvNet(widths=(32, 64, 128))
    classifier = nn.Linear(backbone.feature_dim, 10)
    params = list(backbone.parameters()) + list(classifier.parameters())

    rela = None
    if not args.no_rela:
        path = args.store or Path("rela-targets") / f"{args.prior.replace(':', '-').replace('/', '_')}-{args.limit}"
        if (path / "metadata.json").exists():
            store = TargetStore.open(path, dataset=clean)
        else:
            print(f"precomputing targets with prior {args.prior!r} into {path} ...", flush=True)
            store = precompute_targets(create_prior(args.prior), clean, path, progress=False)
        rela = ReLA(store, backbone, dataset=clean, dataloader=loader, schedule=args.schedule, total_steps=args.steps)
        params += list(rela.parameters())  # here the head is trained by our optimiser
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)

    step, t0 = 0, time.time()
    while step < args.steps:
        for x, y in loader:
            logits = classifier(backbone(x))
            # the features and the logits come from one forward: the loss is passed as it is (a callable would save
            # nothing here), so the default schedule mixes it in from the first step
            loss = rela.wrap(F.cross_entropy(logits, y)) if rela else F.cross_entropy(logits, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.log_every == 0 or step == args.steps:
                lam = rela.stats["lambda"] if rela else 0.0
                print(f"step {step:5d}  loss {loss.item():.4f}  lambda {lam:.3f}  {time.time() - t0:.1f}s", flush=True)
            if step >= args.steps:
                break

    test = FashionMNIST("test", limit=args.test_limit, transform=T.Compose([T.ToTensor(), T.Normalize(clean.mean, clean.std)]))
    backbone.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(test, batch_size=512):
            correct += (classifier(backbone(x)).argmax(1) == y).sum().item()
    acc = 100.0 * correct / len(test)
    print(f"final: steps {step}  test top-1 {acc:.2f}%  ({'supervised' if rela is None else 'supervised + ReLA'}, "
          f"{time.time() - t0:.1f}s)")
    return acc


if __name__ == "__main__":
    main()
