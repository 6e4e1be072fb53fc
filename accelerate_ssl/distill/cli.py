"""`accelerate-ssl distill`: synthesise a distilled warm-start set from a BatchNorm teacher.

Example::

    accelerate-ssl distill --teacher resnet_small --weights teacher.pt --data fashion-mnist \\
        --method dwa --ipc 10 --iterations 1000 --out distilled/ [--relabel-epochs 20]

Teachers: ``resnet_small`` (accelerate_ssl.backbones, ``--teacher-kwargs`` JSON for its arguments),
``torchvision:<arch>`` (e.g. resnet18, ``num_classes`` via ``--teacher-kwargs``), or ``torchscript:<file>``;
``--weights`` (or ``--teacher-weights``) is a local state_dict file. Repeat ``--teacher`` (and ``--weights``) for FADRM+.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .synthesize import list_methods

    parser.add_argument("--teacher", action="append", required=True,
                        help="resnet_small | torchvision:<arch> | torchscript:<file>; repeat for several teachers (fadrm+)")
    parser.add_argument("--teacher-weights", "--weights", dest="teacher_weights", action="append", default=[],
                        help="local state_dict file per teacher (same order); --weights as on the other verbs")
    parser.add_argument("--teacher-kwargs", action="append", default=[], help="JSON constructor arguments per teacher")
    parser.add_argument("--data", default="fashion-mnist",
                        help="real images for initialisation: fashion-mnist | digits | folder:<path> (class sub-folders)")
    parser.add_argument("--mean", type=float, nargs="+", help="teacher input mean per channel (default: the data set's)")
    parser.add_argument("--std", type=float, nargs="+", help="teacher input std per channel (default: the data set's)")
    parser.add_argument("--method", default="dwa", choices=list_methods())
    parser.add_argument("--ipc", type=int, default=10, help="images per class")
    parser.add_argument("--iterations", type=int, help="recover steps per batch (method default if omitted)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="other hyper-parameter, value parsed as JSON (e.g. --set rho=0.01 --set ds_size=20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", required=True, help="output folder (PNG class folders + manifest.json); resumes if present")
    parser.add_argument("--relabel-epochs", type=int, default=0,
                        help="also store FKD-style soft labels for this many epochs (soft_labels.pt in --out)")
    parser.add_argument("--relabel-batch-size", type=int, default=16)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object (images, output folder, timings) at the end")


def load_teacher(spec: str, weights: str | None = None, kwargs: dict | None = None) -> torch.nn.Module:
    """Build a teacher from ``spec`` and load a local state_dict (never any download)."""
    kwargs = dict(kwargs or {})
    if spec.startswith("torchscript:"):
        path = Path(spec.split(":", 1)[1])
        if not path.exists():
            raise FileNotFoundError(f"TorchScript teacher {path} not found; pass an existing file.")
        return torch.jit.load(str(path), map_location="cpu")
    if spec.startswith("torchvision:"):
        import torchvision

        model = torchvision.models.get_model(spec.split(":", 1)[1], weights=None, **kwargs)
    else:
        from ..backbones import BACKBONES, create_backbone

        if spec not in BACKBONES:
            raise ValueError(f"Unknown teacher {spec!r}; pass one of {sorted(BACKBONES)}, torchvision:<arch> or torchscript:<file>.")
        model = create_backbone(spec, **kwargs)
    if weights is not None:
        if not Path(weights).exists():
            raise FileNotFoundError(f"Teacher weights {weights} not found; pass an existing state_dict file.")
        state = torch.load(weights, map_location="cpu", weights_only=True)
        model.load_state_dict(state.get("state_dict", state) if isinstance(state, dict) else state)
    return model


def load_data(name: str):
    from ..data import Digits, FashionMNIST, image_folder

    if name == "fashion-mnist":
        return FashionMNIST("train")
    if name == "digits":
        return Digits("train")
    if name.startswith("folder:"):
        return image_folder(name.split(":", 1)[1])
    raise ValueError(f"Unknown --data {name!r}; pass fashion-mnist, digits or folder:<path>.")


def _parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}.")
        key, value = item.split("=", 1)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    from .relabel import SoftLabelStore
    from .synthesize import synthesize

    n = len(args.teacher)
    weights = args.teacher_weights + [None] * (n - len(args.teacher_weights))
    kwargs = [json.loads(k) for k in args.teacher_kwargs]
    kwargs = kwargs + [kwargs[-1] if kwargs else {}] * (n - len(kwargs))
    teachers = [load_teacher(s, w, k).to(args.device) for s, w, k in zip(args.teacher, weights, kwargs)]
    specs = [f"{s}:{w}" if w else s for s, w in zip(args.teacher, weights)]
    data = load_data(args.data)
    mean = args.mean or list(getattr(data, "mean", (0.5,)))
    std = args.std or list(getattr(data, "std", (0.5,)))
    hparams = _parse_set(args.set)
    if args.iterations is not None:
        hparams["iterations"] = args.iterations
    distilled = synthesize(teachers if n > 1 else teachers[0], method=args.method, ipc=args.ipc, real=data, mean=mean,
                           std=std, class_names=getattr(data, "classes", None), out_dir=args.out, seed=args.seed,
                           teacher_spec=specs, device=args.device, progress=not args.no_progress, **hparams)
    say = (lambda *a: None) if args.json else print
    say(f"wrote {len(distilled)} images ({distilled.manifest['seconds_per_image']:.3f} s/image) to {args.out}")
    soft_labels = None
    if args.relabel_epochs > 0:
        store = SoftLabelStore.build(distilled, teachers, epochs=args.relabel_epochs, batch_size=args.relabel_batch_size,
                                     seed=args.seed, progress=not args.no_progress)
        soft_labels = Path(args.out) / "soft_labels.pt"
        store.save(soft_labels)
        say(f"wrote soft labels for {args.relabel_epochs} epoch(s) to {soft_labels}")
    if args.json:
        print(json.dumps({"out": str(args.out), "images": len(distilled), "method": args.method,
                          "seconds_per_image": distilled.manifest["seconds_per_image"],
                          "soft_labels": None if soft_labels is None else str(soft_labels)}))
    return 0
