"""lightly's BYOL example, plus ReLA in one added line and one wrapped loss.

The structure is that of lightly's ``examples/pytorch/byol.py`` (a ``BYOL`` module with a backbone,
projection/prediction heads and frozen momentum copies, ``BYOLTransform`` views, a torchvision-style
dataset, ``cosine_schedule`` + ``update_momentum``, ``NegativeCosineSimilarity``). The only ReLA lines
are ``rela = attach_rela(...)`` and ``loss = rela.wrap(...)``; ``tests/test_integration_lightly.py``
checks that removing those two is the whole difference (imports aside). ``attach_rela`` precomputes
the prior's targets for the dataset once (cached under ``--targets``) and tracks the loader's indices.

    python examples/lightly_byol.py                                    # Fashion-MNIST, small ConvNet
    python examples/lightly_byol.py --no-rela                          # plain BYOL, for comparison
    python examples/lightly_byol.py --dataset cifar10 --data-root ~/data --backbone resnet18
    python examples/lightly_byol.py --dataset folder:path/to/images   # a LightlyDataset over a folder
"""

from __future__ import annotations

import argparse
import copy
import random
from pathlib import Path

import numpy as np
import torch
import torchvision
from lightly.loss import NegativeCosineSimilarity
from lightly.models.modules import BYOLPredictionHead, BYOLProjectionHead
from lightly.models.utils import deactivate_requires_grad, update_momentum
from lightly.transforms.byol_transform import BYOLTransform, BYOLView1Transform, BYOLView2Transform
from lightly.transforms.utils import IMAGENET_NORMALIZE
from lightly.utils.scheduler import cosine_schedule
from torch import nn

from accelerate_ssl.backbones import ConvNet
from accelerate_ssl.data import FashionMNIST
from accelerate_ssl.integrations.lightly import attach_rela


class BYOL(nn.Module):
    def __init__(self, backbone, feature_dim):
        super().__init__()
        self.backbone = backbone
        self.projection_head = BYOLProjectionHead(feature_dim, 1024, 256)
        self.prediction_head = BYOLPredictionHead(256, 1024, 256)
        self.backbone_momentum = copy.deepcopy(self.backbone)
        self.projection_head_momentum = copy.deepcopy(self.projection_head)
        deactivate_requires_grad(self.backbone_momentum)
        deactivate_requires_grad(self.projection_head_momentum)

    def forward(self, x):
        y = self.backbone(x).flatten(start_dim=1)
        z = self.projection_head(y)
        return self.prediction_head(z)

    def forward_momentum(self, x):
        y = self.backbone_momentum(x).flatten(start_dim=1)
        z = self.projection_head_momentum(y)
        return z.detach()


def make_backbone(name, in_channels):
    """(backbone, feature dim): our small ConvNet (CPU friendly) or torchvision's resnet18 without its fc."""
    if name == "convnet":
        backbone = ConvNet(in_channels=in_channels, widths=(32, 64, 128))
        return backbone, backbone.feature_dim
    resnet = torchvision.models.resnet18()
    if in_channels != 3:
        resnet.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return nn.Sequential(*list(resnet.children())[:-1]), 512


def make_dataset(args, transform):
    """The training dataset named by --dataset, with the BYOL views as its transform."""
    if args.dataset == "fashion-mnist":
        dataset = FashionMNIST("train", root=args.data_root, transform=transform, limit=args.limit)
        return dataset
    if args.dataset == "cifar10":
        root = Path(args.data_root or "datasets/cifar10")
        if not (root / "cifar-10-batches-py").is_dir():
            raise SystemExit(f"error: CIFAR-10 not found under {root} (no cifar-10-batches-py folder); this example never "
                             "downloads. Put the extracted python version there and pass --data-root.")
        dataset = torchvision.datasets.CIFAR10(str(root), train=True, download=False, transform=transform)
    else:
        from lightly.data import LightlyDataset

        dataset = LightlyDataset(input_dir=args.dataset[len("folder:"):], transform=transform)
    if args.limit:
        dataset = torch.utils.data.Subset(dataset, range(min(args.limit, len(dataset))))
    return dataset


DATA = {  # channels, input size, normalisation
    "fashion-mnist": (1, 28, {"mean": [0.2860], "std": [0.3530]}),
    "cifar10": (3, 32, {"mean": [0.4914, 0.4822, 0.4465], "std": [0.2470, 0.2435, 0.2616]}),
    "folder": (3, 32, IMAGENET_NORMALIZE),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="fashion-mnist",
                   help="fashion-mnist (default), cifar10 (from --data-root, never downloaded) or folder:<path>")
    p.add_argument("--data-root", default=None, help="where the data set lives")
    p.add_argument("--limit", type=int, default=None, help="train on the first N images only (quick runs)")
    p.add_argument("--backbone", choices=["convnet", "resnet18"], default="convnet")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.06)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prior", default=None,
                   help="prior spec for the ReLA targets (create_prior): a model trained on data like yours; default "
                        "for fashion-mnist shipped:digits-byol (trained on other data, measured to help); required "
                        "for other data sets")
    p.add_argument("--targets", default="rela-targets", help="folder caching the precomputed targets")
    p.add_argument("--log-every", type=int, default=10, help="print ReLA's lambda every N steps")
    p.add_argument("--no-rela", action="store_true", help="plain BYOL (the same loop, ReLA disabled)")
    args = p.parse_args(argv)
    if args.dataset not in ("fashion-mnist", "cifar10") and not args.dataset.startswith("folder:"):
        p.error(f"unknown --dataset {args.dataset!r}; use fashion-mnist, cifar10 or folder:<path>")
    if args.prior is None and not args.no_rela:
        if args.dataset != "fashion-mnist":
            p.error(f"--dataset {args.dataset} needs --prior: a model trained on data like it, e.g. "
                    "--prior timm:vit_small_patch14_dinov2.lvd142m (`accelerate-ssl priors list`)")
        args.prior = "shipped:digits-byol"
    return args


def main(argv=None):
    args = parse_args(argv)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    channels, input_size, normalize = DATA[args.dataset.split(":")[0]]

    backbone, feature_dim = make_backbone(args.backbone, channels)
    model = BYOL(backbone, feature_dim)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)

    transform = BYOLTransform(
        view_1_transform=BYOLView1Transform(input_size=input_size, gaussian_blur=0.0, normalize=normalize),
        view_2_transform=BYOLView2Transform(input_size=input_size, gaussian_blur=0.0, normalize=normalize),
    )
    dataset = make_dataset(args, transform)
    dataloader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
    )
    rela = attach_rela(model.backbone, dataloader, prior=args.prior, cache_dir=args.targets, log_every=args.log_every, enabled=not args.no_rela, total_steps=args.epochs * len(dataloader))

    criterion = NegativeCosineSimilarity()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    print("Starting Training")
    for epoch in range(args.epochs):
        total_loss = 0
        momentum_val = cosine_schedule(epoch, args.epochs, 0.996, 1)
        for batch in dataloader:
            x0, x1 = batch[0]
            update_momentum(model.backbone, model.backbone_momentum, m=momentum_val)
            update_momentum(model.projection_head, model.projection_head_momentum, m=momentum_val)
            x0 = x0.to(device)
            x1 = x1.to(device)

            def byol_loss():  # lightly's forward passes and loss; rela.wrap skips it while lambda is 1
                p0 = model(x0)
                z0 = model.forward_momentum(x0)
                p1 = model(x1)
                z1 = model.forward_momentum(x1)
                return 0.5 * (criterion(p0, z1) + criterion(p1, z0))

            loss = rela.wrap(byol_loss, inputs=x0)
            total_loss += loss.detach()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        avg_loss = total_loss / len(dataloader)
        print(f"epoch: {epoch:>02}, loss: {avg_loss:.5f}")
    return model


if __name__ == "__main__":
    main()
