"""Precompute throughput of the recommended priors on this CPU, at each prior's own input size.

For every prior of ``accelerate-ssl priors list``: the zoo's architecture with *random* weights
written to a temporary file and loaded through ``create_prior(spec, weights=FILE)`` (so the spec's
own preprocessing is used; timing does not depend on the weights' values, and nothing is
downloaded), then ``precompute_targets`` over the first N Fashion-MNIST training images
(grayscale repeated to RGB, resized to the prior's input size). The shipped prior uses its real
weights. Reports images/s of the whole precompute (loading, preprocessing, forward, writing).

    .venv/bin/python benchmarks/priors.py                # writes benchmarks/results/priors.json + .png

Numbers depend on the machine and on what else runs on it; the JSON records both.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accelerate_ssl import __version__  # noqa: E402
from accelerate_ssl.data import FashionMNIST  # noqa: E402
from accelerate_ssl.results import save_figure, write_results  # noqa: E402
from accelerate_ssl.priors.catalog import RECOMMENDED, describe_prior  # noqa: E402
from accelerate_ssl.targets.precompute import precompute_targets  # noqa: E402
from accelerate_ssl.priors import create_prior  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=96, help="images per zoo prior (224-518 px inputs)")
    p.add_argument("--small-images", type=int, default=4096, help="images for priors with inputs <= 64 px")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/priors.json"))
    return p.parse_args(argv)


def random_weights_file(spec: str, folder: Path) -> str | None:
    """A file of random weights for ``spec``'s architecture (None for priors that ship their weights)."""
    from safetensors.torch import save_file

    family, name = spec.split(":", 1)
    torch.manual_seed(0)
    if family == "timm":
        import timm

        state = timm.create_model(name, pretrained=False).state_dict()
    elif family == "open_clip":
        import open_clip

        state = open_clip.create_model(name.split("/")[0], pretrained=None).visual.state_dict()
    elif family == "torchvision":
        import torchvision

        state = torchvision.models.get_model(name.split("/")[0], weights=None).state_dict()
    else:
        return None
    path = folder / (spec.replace(":", "_").replace("/", "_") + ".safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return str(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for spec, about, _ in RECOMMENDED:
            info = describe_prior(spec)
            prior = create_prior(spec, weights=random_weights_file(spec, tmp))
            n = args.small_images if info["input_size"] <= 64 else args.images
            data = FashionMNIST("train", limit=n)
            t = time.perf_counter()
            precompute_targets(prior, data, tmp / (spec.replace(":", "_").replace("/", "_")), batch_size=args.batch_size,
                               progress=True)
            seconds = time.perf_counter() - t
            rows.append({"spec": spec, "about": about, "output_dim": info["output_dim"], "params": info["params"],
                         "input_size": info["input_size"], "images": n, "seconds": seconds,
                         "images_per_second": n / seconds, "weights": "random" if info["family"] != "shipped" else "real"})
            print(f"{spec:42s} {info['input_size']:4d} px  {n / seconds:8.1f} img/s")
    result = {
        "command": shlex.join(["python", "benchmarks/priors.py", *(argv if argv is not None else sys.argv[1:])]),
        "library_version": __version__,
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": args.threads, "torch": torch.__version__,
                    "platform": platform.platform(), "processor": platform.processor()},
        "dataset": "Fashion-MNIST train (grayscale -> RGB, resized to each prior's input)",
        "rows": rows,
    }
    out = Path(args.out)
    write_results(out, result, ROOT)
    write_png(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def write_png(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    names = [f"{r['spec']}\n({r['input_size']} px)" for r in rows]
    ax.barh(names, [r["images_per_second"] for r in rows], color="#4c72b0")
    ax.set_xscale("log")
    ax.set_xlabel("precompute images / s on this CPU (log scale)")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
