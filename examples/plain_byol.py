"""BYOL in a plain PyTorch loop on Fashion-MNIST, accelerated by ReLA (two added lines, marked ReLA).

The loop is the familiar lightly BYOL example (lightly's heads, loss and momentum utilities) with a
small ConvNet from accelerate_ssl.backbones so it runs on a CPU. Targets come from a prior model
(default: a randomly initialised ConvNet, no download) precomputed once into a TargetStore.

    python examples/plain_byol.py --steps 200                       # ~1-2 min on 2 cores
    python examples/plain_byol.py --steps 20 --limit 512 --probe-limit 512   # seconds
    python examples/plain_byol.py --prior checkpoint:path/to/prior.safetensors --store targets/fm
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
import torchvision.transforms as T
from torch import nn
from torch.utils.data import DataLoader

from accelerate_ssl import ReLA, TargetStore, create_prior, precompute_targets
from accelerate_ssl.backbones import ConvNet
from accelerate_ssl.data import FashionMNIST
from accelerate_ssl.evaluate import evaluate_backbone


class TwoViews:
    def __init__(self, transform):
        self.transform = transform

    def __call__(self, image):
        return [self.transform(image), self.transform(image)]


class BYOL(nn.Module):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.models.modules import BYOLPredictionHead, BYOLProjectionHead
        from lightly.models.utils import deactivate_requires_grad

        super().__init__()
        self.backbone = backbone
        self.projection_head = BYOLProjectionHead(dim, 512, 128)
        self.prediction_head = BYOLPredictionHead(128, 512, 128)
        self.backbone_momentum = copy.deepcopy(backbone)
        self.projection_head_momentum = copy.deepcopy(self.projection_head)
        deactivate_requires_grad(self.backbone_momentum)
        deactivate_requires_grad(self.projection_head_momentum)

    def forward(self, x):
        return self.prediction_head(self.projection_head(self.backbone(x)))

    def forward_momentum(self, x):
        return self.projection_head_momentum(self.backbone_momentum(x)).detach()


def open_or_precompute(store_path: Path, prior_spec: str, clean_dataset):
    if (store_path / "metadata.json").exists():
        return TargetStore.open(store_path, dataset=clean_dataset)
    print(f"precomputing targets with prior {prior_spec!r} into {store_path} ...", flush=True)
    return precompute_targets(create_prior(prior_spec), clean_dataset, store_path, batch_size=256, progress=False)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimiser steps")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--limit", type=int, default=10000, help="training images used (first N of the train split)")
    p.add_argument("--probe-limit", type=int, default=2000, help="images for the linear probe (train and test)")
    p.add_argument("--prior", default="shipped:digits-byol",
                   help="prior spec for create_prior (default: the shipped BYOL ConvNet trained on other data, scikit-learn digits: measured to save steps on Fashion-MNIST; an untrained network saves nothing)")
    p.add_argument("--store", type=Path, default=None, help="TargetStore folder (default ./rela-targets/<prior>-<limit>)")
    p.add_argument("--schedule", default="decay", help="decay | switch | constant:<lambda> | epochs:<fraction>")
    p.add_argument("--no-rela", action="store_true", help="plain BYOL, for comparison")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    from lightly.loss import NegativeCosineSimilarity
    from lightly.models.utils import update_momentum
    from lightly.utils.scheduler import cosine_schedule

    torch.manual_seed(args.seed)
    clean = FashionMNIST("train", limit=args.limit)
    mean, std = clean.mean, clean.std
    view = T.Compose([T.RandomResizedCrop(28, scale=(0.5, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    train_set = FashionMNIST("train", limit=args.limit, transform=TwoViews(view))
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=args.workers,
                        persistent_workers=args.workers > 0)

    backbone = ConvNet(widths=(32, 64, 128))
    model = BYOL(backbone, backbone.feature_dim)
    rela = None
    if not args.no_rela:
        store_path = args.store or Path("rela-targets") / f"{args.prior.replace(':', '-').replace('/', '_')}-{args.limit}"
        store = open_or_precompute(store_path, args.prior, clean)
        rela = ReLA(store, model.backbone, dataset=clean, dataloader=loader, schedule=args.schedule,  # ReLA (1/2)
                    total_steps=args.steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    criterion = NegativeCosineSimilarity()

    step, t0 = 0, time.time()
    while step < args.steps:
        for (x0, x1), _ in loader:
            momentum = cosine_schedule(step, args.steps, 0.99, 1.0)
            update_momentum(model.backbone, model.backbone_momentum, m=momentum)
            update_momentum(model.projection_head, model.projection_head_momentum, m=momentum)
            p0, p1 = model(x0), model(x1)

            def byol_loss():
                z0, z1 = model.forward_momentum(x0), model.forward_momentum(x1)
                return 0.5 * (criterion(p0, z1) + criterion(p1, z0))

            loss = rela.wrap(byol_loss) if rela else byol_loss()  # ReLA (2/2)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.log_every == 0 or step == args.steps:
                s = rela.stats if rela else {"lambda": 0.0, "loss_rela": None}
                lr = s["loss_rela"]
                print(f"step {step:5d}  loss {loss.item():.4f}  lambda {s['lambda']:.3f}  "
                      f"loss_rela {'-' if lr is None else f'{lr:.4f}'}  {time.time() - t0:.1f}s", flush=True)
            if step >= args.steps:
                break

    probe_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    res = evaluate_backbone(model.backbone, FashionMNIST("train", limit=args.probe_limit, transform=probe_tf),
                            FashionMNIST("test", limit=args.probe_limit, transform=probe_tf), epochs=30)
    print(f"final: steps {step}  linear probe top-1 {res['linear_top1']:.2f}%  kNN top-1 {res['knn_top1']:.2f}%"
          f"  ({'plain BYOL' if rela is None else 'BYOL + ReLA'}, {time.time() - t0:.1f}s)")
    return res


if __name__ == "__main__":
    main()
