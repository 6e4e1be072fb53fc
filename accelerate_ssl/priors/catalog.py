"""What a prior spec names, before loading it: recommended priors, their size, and whether they are cached here.

``describe_prior(spec)`` answers without downloading anything and without allocating the weights
(the network is built on PyTorch's ``meta`` device to count parameters and the output dim).
``accelerate-ssl priors list | show <spec> | fetch <spec>`` prints the same, ``--json`` for machines.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

import torch

from ..optional import require
from . import zoo
from .registry import SHIPPED_PRIORS, create_prior, list_priors, shipped_prior_file, strip_classifier

#: Priors we recommend, with the licence of their weights (timm's own pretrained config names it for timm).
RECOMMENDED: list[tuple[str, str, Optional[str]]] = [
    ("timm:vit_small_patch14_dinov2.lvd142m", "DINOv2 ViT-S/14, self-supervised on LVD-142M", None),
    ("open_clip:ViT-B-32/laion2b_s34b_b79k", "CLIP ViT-B/32 image tower, LAION-2B", "MIT"),
    ("torchvision:resnet50/IMAGENET1K_V2", "ResNet-50, supervised on ImageNet-1k",
     "BSD-3-Clause (torchvision); ImageNet terms of use"),
    ("timm:resnet50.a1_in1k", "ResNet-50 (timm A1 recipe), supervised on ImageNet-1k", None),
    # the priors that ship with the package (ConvNets for 28 px grayscale images such as Fashion-MNIST)
    ("shipped:digits-byol", "BYOL ConvNet, unlabelled scikit-learn digits: other data (ships; the demo's default)",
     "Apache-2.0"),
    ("shipped:fashion-mnist-byol-20k", "BYOL ConvNet, unlabelled Fashion-MNIST, 20,000 steps (ships; in-domain: an "
     "upper bound on Fashion-MNIST)", "Apache-2.0"),
    ("shipped:fashion-mnist-byol", "BYOL ConvNet, unlabelled Fashion-MNIST, 1000 steps (ships; in-domain: an upper "
     "bound on Fashion-MNIST)", "Apache-2.0"),
    ("shipped:fashion-mnist-supervised", "ConvNet trained WITH the Fashion-MNIST labels (ships; labelled: an upper "
     "bound on Fashion-MNIST)",
     "Apache-2.0"),
]


def _params(model: torch.nn.Module) -> int:
    return int(sum(p.numel() for p in model.parameters()))


def describe_prior(spec: str) -> dict:
    """Family, source (hub id / URL / file), cache location and whether it is cached, output dim,
    parameters, input size and licence of ``spec``; never downloads, never loads zoo weights."""
    if ":" not in spec:
        create_prior(spec)  # raises the grammar error
    family, name = spec.split(":", 1)
    out: dict = {"spec": spec, "family": family}
    if family == "timm":
        require("timm", "timm:<model> priors")
        import timm

        if name.startswith("hf-hub:"):
            repo = name[len("hf-hub:"):]
            out.update(source=repo, cache=str(zoo.hf_repo_dir(repo)), cached=_hf_cached(repo, zoo.TIMM_HUB_FILES))
            return out
        full = zoo.timm_name(name, spec)
        with torch.device("meta"):
            model = timm.create_model(full, pretrained=False, num_classes=0)
        kind, where, files = zoo.timm_weights_source(full)
        cache = zoo.hf_repo_dir(where) if kind == "hf" else zoo.torch_hub_file(where)
        cached = _hf_cached(where, files) if kind == "hf" else cache.is_file()
        out.update(name=full, source=where, cache=str(cache), cached=cached, output_dim=int(model.num_features),
                   params=_params(model), input_size=int(model.pretrained_cfg["input_size"][-1]),
                   license=model.pretrained_cfg.get("license"))
    elif family == "open_clip":
        require("open_clip", "open_clip:<model> priors")
        import open_clip

        if name.startswith("hf-hub:"):
            repo = name[len("hf-hub:"):]
            out.update(source=repo, cache=str(zoo.hf_repo_dir(repo)), cached=_hf_cached(repo, zoo.OPEN_CLIP_HUB_FILES))
            return out
        arch, tag = zoo.open_clip_name(name, spec, need_tag=True)
        kind, where, files, _ = zoo.open_clip_tag_source(arch, tag)
        cache = zoo.hf_repo_dir(where) if kind == "hf" else zoo.open_clip_url_file(where)
        clip = zoo.quiet_open_clip(open_clip.create_model, arch, pretrained=None, device="meta")
        size = clip.visual.image_size
        out.update(name=f"{arch}/{tag}", source=where, cache=str(cache),
                   cached=_hf_cached(where, files) if kind == "hf" else cache.is_file(),
                   output_dim=int(clip.visual.output_dim), params=_params(clip.visual),
                   input_size=int(size[0] if isinstance(size, (tuple, list)) else size))
    elif family == "torchvision":
        import torchvision

        arch, _, member = name.partition("/")
        weights = zoo.torchvision_weights(arch, member, spec)
        with torch.device("meta"):
            model = torchvision.models.get_model(arch, weights=None)
        head = getattr(model, "fc", None) or getattr(model, "classifier", None)
        dim = head.in_features if isinstance(head, torch.nn.Linear) else None
        strip_classifier(model)
        cache = zoo.torch_hub_file(weights.url)
        out.update(name=f"{arch}/{str(weights).split('.', 1)[1]}", source=weights.url, cache=str(cache),
                   cached=cache.is_file(), output_dim=dim, params=_params(model),
                   input_size=int(weights.transforms().crop_size[0]))
    elif family == "shipped":
        prior = create_prior(spec)
        out.update(name=name, source=str(shipped_prior_file(name)), cache=None, cached=True,
                   output_dim=prior.output_dim, params=_params(prior.model),
                   input_size=int(prior.preprocess_config["crop"] or 28), about=SHIPPED_PRIORS[name][1])
    else:  # random / checkpoint: local by nature
        prior = create_prior(spec)
        out.update(name=name, source="local", cache=None, cached=True, output_dim=prior.output_dim,
                   params=_params(prior.model), input_size=prior.preprocess_config["crop"])
    return out


def _hf_cached(repo: str, files) -> bool:
    try:
        zoo.resolve_hf_file(repo, repo, files, offline=True)
        return True
    except FileNotFoundError:
        return False


def recommended() -> list[dict]:
    """``describe_prior`` of every recommended prior, with its one-line summary and licence."""
    rows = []
    for spec, about, licence in RECOMMENDED:
        row = describe_prior(spec)
        row["about"] = about
        row["license"] = licence or row.get("license")
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------
# CLI: accelerate-ssl priors
# ------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("list", "show", "fetch"),
                        help="list: families and recommended priors; show SPEC: what SPEC names; "
                             "fetch SPEC: download SPEC's weights into the zoo's cache (needs network)")
    parser.add_argument("spec", nargs="?", help="prior spec (show, fetch), e.g. timm:vit_small_patch14_dinov2.lvd142m")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _human_size(n: Optional[int]) -> str:
    if n is None:
        return "?"
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.0f}K"


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "list":
            if args.spec:
                raise ValueError("`priors list` takes no spec; use `priors show SPEC`.")
            rows = recommended()
            if args.json:
                print(json.dumps({"families": list_priors(), "recommended": rows}, indent=1))
                return 0
            print(f"families: {', '.join(list_priors())}   (grammar: accelerate-ssl priors show SPEC; "
                  "docs: accelerate_ssl.priors)")
            print(f"{'spec':42s} {'dim':>5s} {'params':>7s} {'input':>5s} {'cached':>6s}  about")
            for r in rows:
                print(f"{r['spec']:42s} {r['output_dim'] or '?':>5} {_human_size(r['params']):>7s} "
                      f"{r['input_size']:>5} {'yes' if r['cached'] else 'no':>6s}  {r['about']} [{r['license']}]")
            return 0
        if not args.spec:
            raise ValueError(f"`priors {args.action}` needs a SPEC, e.g. `accelerate-ssl priors {args.action} "
                             "timm:resnet50.a1_in1k`.")
        if args.action == "show":
            info = describe_prior(args.spec)
            print(json.dumps(info, indent=1) if args.json else
                  "\n".join(f"{k:12s} {v}" for k, v in info.items()))
            return 0
        prior = create_prior(args.spec, offline=False)  # fetch: the zoo's own download into its cache
        info = {**describe_prior(args.spec), "loaded": prior.describe()}
        print(json.dumps(info, indent=1) if args.json else
              f"cached {args.spec} in {info['cache']} (sha256 {prior.describe().get('weights_sha256') or '-'}); "
              "it now loads offline here, and on another machine once that folder is copied to the same place.")
        return 0
    except (ValueError, FileNotFoundError) as err:
        print(f"accelerate-ssl priors: error: {err}", file=sys.stderr)
        return 2
