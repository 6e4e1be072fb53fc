"""Targets for the view: how close is a crop's target pooled from a spatial store to the prior run on that crop, against
the whole-image target a store of pooled rows gives every crop; and what a spatial store costs per sample.

For each image of a Fashion-MNIST test subset and each crop-scale range, random crops (``RandomResizedCrop`` at the
image's size, aspect 3/4-4/3, recorded by ``RecordGeometry``) and the same crops flipped are embedded live by the prior:
its feature map's mean over the crop, reduced through the spatial store's PCA (the space the ReLA head trains in).
That live target is compared (cosine) with:

- ``pooled``: the crop's box pooled from the store's reduced map (``view_targets``, RoIAlign);
- ``whole (store row)``: the same store's whole-image row (the map's mean; what every crop gets without geometry);
- ``whole (today)``: a store of the prior's pooled rows (``forward``'s output) of the whole image vs of the crop, both
  through the PCA ReLA fits on those rows (same number of components): today's default target.

A flipped crop has the same pooled target (a box's mean does not depend on the flip), so its rows measure what a
flip changes in the prior's own output. Priors: the shipped BYOL ConvNet (``shipped:fashion-mnist-byol-20k``, 28 px,
3x3 map of stride 8); a small timm ViT (28 px, 4 px patches: a 7x7 grid) trained here with the Fashion-MNIST training
labels (cached under ``--cache``); and timm's ``vit_small_patch14_dinov2`` architecture at 112 px (8x8 patch grid)
with **random weights** (no trained DINOv2 is available offline on this machine: those rows measure the geometry of
a ViT's token map, not what a trained DINOv2 gives). Bytes per sample: the ``targets.npy`` file of each spatial store over the
store's images (``--spatial K|all``, float32 / float16), plus a few images through the same ViT at 224 px (a 16x16
grid, as DINOv2 ViT-S/14 at 224 px). One torch thread.

    nice -n 5 python benchmarks/view_targets.py      # writes benchmarks/results/view_targets.json + .png

(~11 min at 1 thread on the busy 2-core machine, ~4 of them training the small ViT once; it is cached.)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCALES = [(0.08, 0.25), (0.25, 0.5), (0.5, 1.0)]


def vit_prior(size: int, work: Path):
    """timm's DINOv2 ViT-S/14 architecture with random weights (seed 0), given as the user's local weights file."""
    import timm
    from safetensors.torch import save_file

    from accelerate_ssl import create_prior

    path = work / f"vit_s14_random_{size}.safetensors"
    torch.manual_seed(0)
    net = timm.create_model("vit_small_patch14_dinov2", pretrained=False, num_classes=0, img_size=size)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return create_prior("timm:vit_small_patch14_dinov2.lvd142m", weights=str(path), size=size)


TINY_VIT = {"img_size": 28, "patch_size": 4, "in_chans": 1, "embed_dim": 64, "depth": 4, "num_heads": 2,
            "num_classes": 0}


def trained_vit(steps: int, cache: Path):
    """A small timm ViT (28 px, 4 px patches: a 7x7 grid, 64-d, 4 blocks) trained with the Fashion-MNIST training
    labels (``recipes.Supervised`` through ``train_ssl``, its random views, AdamW 1e-3, batch 64), cached by steps,
    as ``shipped:fashion-mnist-supervised`` is a ConvNet trained that way: ``(prior, test top-1 %)``."""
    import timm

    from accelerate_ssl import create_prior
    from accelerate_ssl.atomic import atomic_write_text
    from accelerate_ssl.data import FashionMNIST
    from accelerate_ssl.priors import save_prior_checkpoint
    from accelerate_ssl.recipes import Supervised, random_batches, tensor_batches, train_ssl
    from accelerate_ssl.recipes.views import FASHION_MNIST_MEAN, FASHION_MNIST_STD

    path = cache / f"tiny_vit_supervised_{steps}.safetensors"
    train, test = FashionMNIST("train"), FashionMNIST("test")
    norm = lambda d: d.data.float().div(255.0).sub(FASHION_MNIST_MEAN).div(FASHION_MNIST_STD).unsqueeze(1)  # noqa: E731
    torch.manual_seed(0)
    backbone = timm.create_model("vit_tiny_patch16_224", pretrained=False, **TINY_VIT)
    model = Supervised(backbone, backbone.num_features, train.targets)
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
        train_ssl(model, tensor_batches(norm(train), random_batches(len(train.data), 64, gen)), steps, optimizer=opt,
                  view_generator=gen, progress="supervised tiny ViT")
        save_prior_checkpoint(backbone, path, arch="timm:vit_tiny_patch16_224", arch_kwargs=TINY_VIT,
                              preprocess_config={"channels": 1, "resize": 28, "crop": 28, "mean": [FASHION_MNIST_MEAN],
                                                 "std": [FASHION_MNIST_STD], "stats": "dataset"})
        with torch.inference_mode():
            model.eval()
            top1 = float((model(norm(test)[:2000]).argmax(1) == test.targets[:2000]).float().mean()) * 100
        atomic_write_text(path.with_suffix(".json"), f"{top1}")
    return create_prior(f"checkpoint:{path}"), float(path.with_suffix(".json").read_text())


def live(prior, pre, images: list, batch: int = 64):
    """The prior's map mean and its pooled row for each (PIL or tensor) view: ``([V, C], [V, D])``."""
    maps, rows = [], []
    with torch.inference_mode():
        for a in range(0, len(images), batch):
            x = pre.batch(torch.stack([torch.as_tensor(np.array(im))[None] if not isinstance(im, torch.Tensor) else im
                                       for im in images[a : a + batch]]))
            maps.append(prior.feature_map(x).mean((2, 3)))
            rows.append(prior(x))
    return torch.cat(maps), torch.cat(rows)


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.float(), b.float(), dim=1).mean())


def fidelity(prior, data, store, crops: int, seed: int) -> dict:
    """Mean cosine to the live prior, per scale range, of the pooled / whole-image targets (module docstring)."""
    from torchvision import transforms as T

    from accelerate_ssl.targets.pca import TargetPCA
    from accelerate_ssl.targets.views import RecordGeometry, view_targets

    pre = prior.preprocess.with_stats(list(data.mean), list(data.std), "dataset") \
        if prior.preprocess.stats == "default" else prior.preprocess
    n, k = len(data), store.components
    reduce_map = store.written_pca()
    _, whole_rows = live(prior, pre, [data[i][0] for i in range(n)])
    today = TargetPCA.fit(whole_rows, k, standardize=True)  # what ReLA fits on a store of pooled rows
    out = {}
    size = data[0][0].size[::-1]
    for lo, hi in SCALES:
        torch.manual_seed(seed)
        recorder = RecordGeometry(T.RandomResizedCrop(list(size), scale=(lo, hi)))
        views, geometry, index = [], [], []
        for i in range(n):
            for _ in range(crops):
                view, g = recorder(data[i][0])
                views.append(view)
                geometry.append(g)
                index.append(i)
        geometry, index = torch.stack(geometry), torch.tensor(index)
        flipped = [T.functional.hflip(v) for v in views]
        result = {"views": len(views)}
        pooled, whole = view_targets(store, index, geometry), store[index]
        for name, vs in (("", views), ("_flip", flipped)):
            map_mean, rows = live(prior, pre, vs)
            target = reduce_map.transform(map_mean)
            result["pooled" + name] = cos(pooled, target)
            result["whole_store_row" + name] = cos(whole, target)
            result["whole_today" + name] = cos(today.transform(whole_rows[index]), today.transform(rows))
        out[f"{lo}-{hi}"] = result
    return out


def store_bytes(prior, data, work: Path, tag: str, variants) -> dict:
    from accelerate_ssl.targets.precompute import precompute_targets

    out = {}
    for spatial, dtype in variants:
        store = precompute_targets(prior, data, work / f"{tag}-{spatial}-{dtype}", batch_size=32, progress=False,
                                   spatial=spatial, dtype=dtype)
        out[f"{'all' if spatial is True else spatial} {dtype}"] = {
            "bytes_per_sample": store.array.nbytes / len(store),  # the rows (targets.npy adds a 128-byte header)
            "grid": list(store.grid), "channels": store.dim}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cnn-images", type=int, default=512, help="Fashion-MNIST test images in the ConvNet's stores")
    p.add_argument("--vit-images", type=int, default=48, help="... in the random ViT-S's (112 px)")
    p.add_argument("--vit-steps", type=int, default=1000, help="training steps of the small ViT (cached)")
    p.add_argument("--cache", type=Path, default=ROOT / "benchmarks" / "cache" / "view_targets")
    p.add_argument("--crops", type=int, default=4, help="random crops per image and scale range (each also flipped)")
    p.add_argument("--k", type=int, default=32, help="PCA components of the stores the fidelity is measured on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "view_targets.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from accelerate_ssl import create_prior
    from accelerate_ssl.data.spec import open_data
    from accelerate_ssl.results import write_results
    from accelerate_ssl.targets.precompute import precompute_targets

    result = {"command": " ".join(["python", "benchmarks/view_targets.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "torch": torch.__version__, "platform": platform.platform()},
              "settings": {"scales": SCALES, "crops_per_image_and_scale": args.crops, "k": args.k, "seed": args.seed,
                           "cnn": {"prior": "shipped:fashion-mnist-byol-20k", "images": args.cnn_images, "size": 28,
                                   "grid": [3, 3]},
                           "vit_trained": {"prior": f"timm ViT {TINY_VIT}, trained with labels", "steps": args.vit_steps,
                                           "images": args.cnn_images, "size": 28, "grid": [7, 7]},
                           "vit_random": {"prior": "timm vit_small_patch14_dinov2, RANDOM weights (seed 0)",
                                          "images": args.vit_images, "size": 112, "grid": [8, 8]}},
              "fidelity": {}, "bytes": {}}
    variants = [(8, "float16"), (32, "float16"), (32, "float32"), (True, "float16"), (True, "float32")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        vit, top1 = trained_vit(args.vit_steps, args.cache)
        result["settings"]["vit_trained"]["test_top1_first_2000"] = top1
        for name, prior, n in (("cnn", create_prior("shipped:fashion-mnist-byol-20k"), args.cnn_images),
                               ("vit_trained", vit, args.cnn_images), ("vit_random", vit_prior(112, work), args.vit_images)):
            data = open_data("fashion-mnist", "test", limit=n)
            store = precompute_targets(prior, data, work / f"{name}-fidelity", batch_size=32, progress=False,
                                       spatial=args.k, dtype="float16")
            result["fidelity"][name] = fidelity(prior, data, store, args.crops, args.seed)
            result["bytes"][name] = store_bytes(prior, data, work, name, variants)
            print(name, result["fidelity"][name], flush=True)
        big = open_data("fashion-mnist", "test", limit=8)
        result["bytes"]["vit_224"] = store_bytes(vit_prior(224, work), big, work, "vit224",
                                                 [(32, "float16"), (True, "float32")])
    write_results(args.out, result, ROOT)
    plot(result, args.out.with_suffix(".png"))
    print(result["bytes"])
    return result


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from accelerate_ssl.results import save_figure

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    kinds = [("pooled", "pooled from the map"), ("whole_store_row", "whole image (same store)"),
             ("whole_today", "whole image (pooled-row store)")]
    for ax, (name, title) in zip(axes, (("cnn", "shipped BYOL ConvNet, 28 px, 3x3 map"),
                                        ("vit_trained", "small ViT trained with labels, 28 px, 7x7 grid"),
                                        ("vit_random", "ViT-S/14 112 px, 8x8 grid, RANDOM weights"))):
        scales = list(result["fidelity"][name])
        x = np.arange(len(scales))
        for j, (key, label) in enumerate(kinds):
            ax.bar(x + (j - 1) * 0.27, [result["fidelity"][name][s][key] for s in scales], 0.25, label=label,
                   color=f"C{j}")
            ax.scatter(x + (j - 1) * 0.27, [result["fidelity"][name][s][key + "_flip"] for s in scales], marker="_",
                       s=200, color="k", zorder=3, label="the crop flipped" if j == 0 else None)
        ax.set_xticks(x, [f"scale {s}" for s in scales])
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel(f"cosine to the live prior on the crop (k={result['settings']['k']} PCA)")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save_figure(fig, png)


if __name__ == "__main__":
    main()
