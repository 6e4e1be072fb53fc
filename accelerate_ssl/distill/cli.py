"""`accelerate-ssl distill`: synthesise a distilled warm-start set from a BatchNorm teacher.

Example::

    accelerate-ssl distill --teacher random:resnet_small --weights teacher.pt --data fashion-mnist \\
        --method dwa --ipc 10 --iterations 1000 --out distilled/ [--relabel-epochs 20]

Teachers are classifiers named in the prior grammar (:func:`create_teacher`): ``random:<arch>`` (one of
accelerate_ssl.backbones or a torchvision architecture, ``--teacher-kwargs`` JSON for its arguments) with
``--weights`` the state_dict you trained; ``torchvision:<arch>[/<weights>]`` (torchvision's trained weights,
offline-first); ``checkpoint:<file>`` (TorchScript, read while the installed PyTorch reads it). Repeat ``--teacher``
(and ``--weights``) for FADRM+.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..data.spec import MAP_DATA_SPEC_HELP, map_data_spec, open_data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .synthesize import list_methods

    parser.add_argument("--teacher", action="append", required=True,
                        help="a classifier in the prior grammar: random:<arch> (accelerate_ssl.backbones or torchvision; "
                             "with --weights), torchvision:<arch>[/<weights>] or checkpoint:<TorchScript file> (read while "
                             "the installed PyTorch reads TorchScript); "
                             "repeat for several teachers (fadrm+)")
    parser.add_argument("--weights", "--teacher-weights", dest="teacher_weights", action="append", default=[],
                        help="local state_dict file per teacher (same order; wins over torchvision's cache)")
    parser.add_argument("--offline", action="store_true",
                        help="never download torchvision weights, use the local cache only (also: HF_HUB_OFFLINE=1)")
    parser.add_argument("--teacher-kwargs", action="append", default=[], help="JSON constructor arguments per teacher")
    parser.add_argument("--data", default="fashion-mnist", type=map_data_spec,
                        help=f"real labelled images for initialisation: {MAP_DATA_SPEC_HELP}")
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


TEACHER_FAMILIES = ("random", "torchvision", "checkpoint")
#: the teacher file to use instead of TorchScript: a state_dict (safetensors) of a named architecture
SAFE_TEACHER = ("save its state_dict with safetensors (save_file(model.state_dict(), 'teacher.safetensors')) and pass "
                "--teacher random:<arch> --weights teacher.safetensors (arch: an accelerate_ssl.backbones name or a "
                "torchvision architecture)")


def create_teacher(spec: str, weights: str | None = None, kwargs: dict | None = None,
                   offline: bool | None = None) -> torch.nn.Module:
    """A classifier teacher (its classifier kept: recover matches its logits) from a spec in the prior grammar.

    - ``random:<arch>``: one of :mod:`accelerate_ssl.backbones` (e.g. ``resnet_small``) or a torchvision
      architecture, built with ``kwargs``; ``weights`` is the state_dict you trained it to.
    - ``torchvision:<arch>[/<weights member>]``: torchvision's trained weights (default ``DEFAULT``) from
      the torch hub cache, downloaded only when missing and not ``offline``; ``weights`` wins over the cache.
    - ``checkpoint:<file>``: a TorchScript classifier (its weights inside), read only while the installed PyTorch
      reads TorchScript (it deprecates ``torch.jit.load``); a state_dict with ``random:<arch>`` is the lasting way.
    """
    kwargs = dict(kwargs or {})
    family, sep, name = spec.partition(":")
    if not sep or family not in TEACHER_FAMILIES or not name:
        hint = f"random:{spec} --weights FILE" if not sep else "random:resnet_small --weights FILE"
        raise ValueError(f"Unknown teacher {spec!r}: a teacher spec is '<family>:<name>' with family in "
                         f"{TEACHER_FAMILIES} (the prior grammar), e.g. {hint}, torchvision:resnet18 or "
                         "checkpoint:teacher.pt (TorchScript).")
    if weights is not None and not Path(weights).is_file():
        raise FileNotFoundError(f"Teacher weights {weights} not found; pass an existing state_dict file.")
    if family == "checkpoint":
        if weights is not None:
            raise ValueError(f"{spec} already holds its weights (TorchScript); drop --weights.")
        if not Path(name).is_file():
            raise FileNotFoundError(f"TorchScript teacher {name} not found; pass an existing file.")
        from ..priors.registry import load_torchscript

        return load_torchscript(name, "TorchScript teacher", instead=SAFE_TEACHER)
    from ..priors.registry import load_state_dict_file, torchvision_model

    if family == "random":
        from ..backbones import BACKBONES, create_backbone

        model = create_backbone(name, **kwargs) if name in BACKBONES else torchvision_model(name, spec, **kwargs)
        if weights is not None:
            model.load_state_dict(load_state_dict_file(weights))
        return model
    from ..priors.zoo import resolve_url_file, torch_hub_file, torchvision_weights

    arch, _, member = name.partition("/")
    model = torchvision_model(arch, spec, **kwargs)
    if weights is None:
        url = torchvision_weights(arch, member, spec).url
        weights = str(resolve_url_file(spec, url, torch_hub_file(url), offline))
    model.load_state_dict(load_state_dict_file(weights))
    return model


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
    offline = True if args.offline else None
    teachers = [create_teacher(s, w, k, offline).to(args.device) for s, w, k in zip(args.teacher, weights, kwargs)]
    specs = [f"{s}:{w}" if w else s for s, w in zip(args.teacher, weights)]
    data = open_data(args.data)
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
