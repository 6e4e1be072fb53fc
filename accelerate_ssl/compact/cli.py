"""``accelerate-ssl compact``: distil an unlabelled image set into a compact store, or inspect one.

    accelerate-ssl compact distill --data fashion-mnist --train-teacher barlow_twins --images 100 \\
        --steps 2000 --out fmnist_n100.safetensors --checkpoint fmnist_n100.ckpt
    accelerate-ssl compact distill --data fashion-mnist --prior shipped:fashion-mnist-byol --out c.safetensors
    accelerate-ssl compact info fmnist_n100.safetensors

Images are scaled to [0, 1] and standardised with the data set's own mean/std (recorded in the
store's metadata); the teacher sees them in that space, and ``decode()`` returns images in it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

import torch

from ..data.spec import MAP_DATA_SPEC_HELP, map_data_spec
from .distill import DistillConfig


def load_images(data: str, limit: int | None = None, image_size: int | None = None) -> tuple[torch.Tensor, dict]:
    """Unlabelled images as a standardised float tensor ``[n, c, h, w]`` and their preprocessing record."""
    import numpy as np

    from ..data.spec import open_data

    if data in ("fashion-mnist", "digits"):
        x = open_data(data, limit=limit).data.float().div(255.0).unsqueeze(1)
    else:
        from torchvision import transforms

        if image_size is None:
            raise ValueError("an image folder needs --image-size (e.g. 32) so all images share one shape.")
        ds = open_data(data, transform=transforms.Compose([transforms.Resize(image_size), transforms.CenterCrop(image_size),
                                                           transforms.ToTensor()]))
        n = len(ds) if limit is None else min(limit, len(ds))
        x = torch.stack([ds[i][0] for i in range(n)])
    mean = x.mean(dim=(0, 2, 3), keepdim=True)
    std = x.std(dim=(0, 2, 3), keepdim=True)
    return (x - mean) / std, {"data": data, "limit": limit, "mean": mean.flatten().tolist(), "std": std.flatten().tolist(),
                              "scale_to_unit": True, "n": int(len(x)), "pixel_dtype": str(np.float32)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="compact_command", metavar="ACTION")
    d = sub.add_parser("distill", help="distil unlabelled images into a compact store (Yu et al. (2025))")
    d.add_argument("--data", default="fashion-mnist", type=map_data_spec, help=MAP_DATA_SPEC_HELP)
    d.add_argument("--limit", type=int, default=None, help="use only the first N images")
    d.add_argument("--image-size", type=int, default=None, help="resize image-folder images to this size")
    t = d.add_mutually_exclusive_group(required=True)
    t.add_argument("--prior", "--teacher", dest="prior",
                   help="the teacher: a prior spec (`accelerate-ssl priors list`, e.g. shipped:fashion-mnist-byol) or a "
                        "teacher .safetensors written by --save-teacher")
    d.add_argument("--weights", default=None, help="local weights file for the --prior (wins over the zoo caches)")
    t.add_argument("--train-teacher", choices=["barlow_twins", "byol"], help="train a ConvNet teacher self-supervised first")
    d.add_argument("--teacher-steps", type=int, default=1000)
    d.add_argument("--save-teacher", default=None, help="where to write the trained teacher (.safetensors)")
    d.add_argument("--images", "--budget", dest="images", type=int, default=100,
                   help="storage budget: the floats of N images, targets included (default 100)")
    d.add_argument("--no-parameterize", action="store_true", help="plain KRR-ST: store as many pixel images + targets as fit the budget")
    d.add_argument("--augmentations", default="rotate", help="rotate, jigsaw, fivecrop or none")
    for name, typ in (("steps", int), ("lr", float), ("real_batch", int), ("pool_size", int), ("pool_max_steps", int),
                      ("pool_width", int), ("pool_depth", int), ("scale", int), ("U", int), ("V", int), ("m", int),
                      ("approx_hidden", int), ("krr_reg", float), ("seed", int)):
        default = {f.name: f.default for f in fields(DistillConfig)}[name]
        d.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=default, help=f"(default {default})")
    d.add_argument("--allow-over-budget", action="store_true", help="store more floats than the budget allows")
    d.add_argument("--checkpoint", default=None, help="resumable state file (resumed if it exists)")
    d.add_argument("--checkpoint-every", type=int, default=100)
    d.add_argument("--out", required=True, help="output .safetensors")
    i = sub.add_parser("info", help="print a compact store's metadata and float count")
    i.add_argument("path")


def run(args: argparse.Namespace) -> int:
    from .codec import CompactDataset

    if args.compact_command == "info":
        print(json.dumps(CompactDataset.load(args.path).describe(), indent=2))
        return 0
    if args.compact_command != "distill":
        raise SystemExit("usage: accelerate-ssl compact {distill,info} ... (see --help)")
    from .distill import distill_compact
    from .teacher import load_teacher, save_teacher, train_teacher

    images, preprocessing = load_images(args.data, args.limit, args.image_size)
    if args.weights and not args.prior:
        raise ValueError("--weights belongs to a --prior; a teacher trained here (--train-teacher) has its own.")
    if args.prior:
        teacher = load_teacher(args.prior, weights=args.weights)
    else:
        teacher = train_teacher(images, method=args.train_teacher, steps=args.teacher_steps, seed=args.seed)
    teacher.standardize(images)  # z-scored targets (Teacher.standardize)
    if args.save_teacher:
        save_teacher(teacher, args.save_teacher)
    keys = {f.name for f in fields(DistillConfig)}
    settings = {k: v for k, v in vars(args).items() if k in keys}
    settings.update(budget_images=args.images, parameterize=not args.no_parameterize, allow_over_budget=args.allow_over_budget)
    config = DistillConfig(**settings)
    compact = distill_compact(images, teacher, config, checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every,
                              teacher_description=teacher.describe())
    compact.metadata["preprocessing"] = preprocessing
    compact.save(args.out)
    summary = {k: v for k, v in compact.describe().items() if k in ("kind", "num_images", "num_pairs", "num_floats")}
    if "approx_unexplained" in compact.metadata:  # share of each augmentation's target variance the nets miss
        summary["approx_unexplained"] = [round(u, 3) for u in compact.metadata["approx_unexplained"]]
    print(json.dumps(summary))
    return 0
