"""Compact target stores: bytes per sample, lookup time and the demo's ReLA accuracy, float32 vs float16 vs bfloat16
vs PCA-at-write, each store written by ``precompute_targets`` (``accelerate-ssl precompute --dtype / --components``).

Stores: the demo's prior (the shipped BYOL ConvNet, 128-d) over the demo's 20k Fashion-MNIST train images.

- **bytes per sample**: the targets file's bytes / rows (the .npy header included);
- **lookup time**: ``TargetLookup`` of a 256-row random batch on the CPU (read, decode to float32, reduce to the
  demo's 16 components: the PCA of Eq. 41 for full rows, a column slice for a store reduced at write), median
  of ``--lookups``; warm (page cache) and cold (the file dropped from the page cache before every read with
  ``madvise`` + ``posix_fadvise(DONTNEED)``, so each read goes to the disk);
- **accuracy**: the demo's ReLA run (``accelerate_ssl.demo.train_byol``: its defaults, budget 250, linear probe at
  the end only) per store and seed. Each run is cached in ``--cache`` (rerunning resumes; the JSON reports what
  finished).

    nice -n 5 python benchmarks/compact_store.py     # writes benchmarks/results/compact_store.json + .png
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> precompute_targets(dtype=, components=)
    "float32": ("float32", None),
    "float16": ("float16", None),
    "bfloat16": ("bfloat16", None),
    "pca16": ("float32", 16),
    "pca16-float16": ("float16", 16),
}


def drop_cache(store) -> None:
    """Evict the store's file from the page cache: drop its pages from both of the store's mappings (the kernel keeps
    mapped pages whatever is advised), then DONTNEED the file."""
    for mm in (getattr(store.array, "_mmap", None), getattr(store._random_rows, "base", None)):
        if isinstance(mm, mmap.mmap):
            mm.madvise(mmap.MADV_DONTNEED)
    fd = os.open(store.path / store.metadata["file"], os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def lookup_ms(store, components: int, lookups: int, batch: int, cold: bool) -> float:
    from accelerate_ssl.rela.lookup import TargetLookup

    lookup = TargetLookup(store)
    lookup.reduce_to(components)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(lookups):
        idx = torch.from_numpy(rng.choice(len(store), batch, replace=False))
        if cold:
            drop_cache(store)
        t = time.perf_counter()
        lookup(idx, "cpu")
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def demo_args(budget: int, components: int):
    from accelerate_ssl import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(["--budget", str(budget), "--components", str(components)])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--budget", type=int, default=250)
    p.add_argument("--lookups", type=int, default=200)
    p.add_argument("--no-train", action="store_true", help="stores and lookups only (report cached runs)")
    p.add_argument("--cache", type=Path, default=ROOT / "benchmarks" / "cache" / "compact_store")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compact_store.json")
    args = p.parse_args(argv)

    from accelerate_ssl.data import FashionMNIST
    from accelerate_ssl.demo import DEFAULT_PRIOR, _uint8_tensor, train_byol
    from accelerate_ssl.recipes import Probe, images_to_tensor
    from accelerate_ssl.results import write_results
    from accelerate_ssl.targets.precompute import precompute_targets
    from accelerate_ssl.priors import create_prior

    settings = demo_args(args.budget, 16)
    train = FashionMNIST("train", limit=settings.train_size)
    test = FashionMNIST("test", limit=settings.test_size)
    prior = create_prior(DEFAULT_PRIOR)
    stores, rows = {}, []
    for name in args.variants:
        dtype, k = VARIANTS[name]
        t = time.perf_counter()
        stores[name] = store = precompute_targets(prior, train, args.cache / "stores" / name, dtype=dtype, components=k,
                                                  progress=False)
        file_bytes = (store.path / store.metadata["file"]).stat().st_size
        rows.append({"store": name, "dtype": store.dtype, "components": store.components, "dim": store.dim,
                     "bytes_per_sample": file_bytes / len(store), "file_bytes": file_bytes,
                     "write_seconds": time.perf_counter() - t,
                     "lookup_ms_warm": lookup_ms(store, settings.components, args.lookups, 256, cold=False),
                     "lookup_ms_cold": lookup_ms(store, settings.components, args.lookups, 256, cold=True)})
        print(json.dumps(rows[-1]), flush=True)

    train.transform = _uint8_tensor
    train_x, test_x = images_to_tensor(train.data), images_to_tensor(test.data)
    (args.cache / "runs").mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:  # seed-major: an interrupted benchmark has every store at the first seeds
        for row in rows:
            file = args.cache / "runs" / f"{row['store']}-b{args.budget}-s{seed}.json"
            if not file.is_file() and not args.no_train:
                probe = Probe(train_x, train.targets, test_x, test.targets, epochs=settings.probe_epochs, seed=seed)
                run = train_byol(settings, train, probe, args.budget, [args.budget], store=stores[row["store"]],
                                 desc=f"ReLA {row['store']} s{seed}", seed=seed)
                top1 = next(c["top1"] for c in run["curve"] if c["step"] == args.budget)
                file.write_text(json.dumps({"seed": seed, "top1": top1, "train_seconds": run["train_seconds"]}))
            if file.is_file():
                row.setdefault("runs", []).append(json.loads(file.read_text()))
    for row in rows:
        row.setdefault("runs", [])
        accs = [r["top1"] for r in row["runs"]]
        row["top1_mean"] = statistics.mean(accs) if accs else None
        row["top1_std"] = statistics.stdev(accs) if len(accs) > 1 else None
        print(row["store"], accs, flush=True)
    base = next((r for r in rows if r["store"] == "float32"), None)
    for row in rows:
        if base and base["top1_mean"] is not None and row["top1_mean"] is not None:
            row["top1_minus_float32"] = row["top1_mean"] - base["top1_mean"]
            row["bytes_vs_float32"] = row["bytes_per_sample"] / base["bytes_per_sample"]

    result = {
        "command": " ".join(["python", "benchmarks/compact_store.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "numpy": np.__version__, "platform": platform.platform()},
        "settings": {"prior": DEFAULT_PRIOR, "train_size": settings.train_size, "budget": args.budget,
                     "components": settings.components, "schedule": settings.schedule, "seeds": args.seeds,
                     "lookup_batch": 256, "lookups": args.lookups, "probe_epochs": settings.probe_epochs},
        "stores": rows,
        "table": table(rows),
    }
    write_results(args.out, result, ROOT)
    plot(rows, args.out.with_suffix(".png"))
    print(result["table"])
    return result


def table(rows) -> str:
    lines = ["| store | dtype | values / row | bytes / sample | lookup ms (warm / cold) | ReLA top-1 % (seeds) |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        acc = "not run" if r["top1_mean"] is None else (
            f"{r['top1_mean']:.2f}" + (f" ± {r['top1_std']:.2f}" if r["top1_std"] is not None else "") + f" ({len(r['runs'])})")
        lines.append(f"| {r['store']} | {r['dtype']} | {r['dim']} | {r['bytes_per_sample']:.0f} | "
                     f"{r['lookup_ms_warm']:.2f} / {r['lookup_ms_cold']:.2f} | {acc} |")
    return "\n".join(lines)


def plot(rows, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from accelerate_ssl.results import save_figure

    names = [r["store"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.bar(names, [r["bytes_per_sample"] for r in rows], color="C0")
    a.set_ylabel("bytes per sample")
    a.set_title("store size")
    done = [r for r in rows if r["top1_mean"] is not None]
    b.errorbar([r["store"] for r in done], [r["top1_mean"] for r in done], yerr=[r["top1_std"] or 0 for r in done],
               fmt="o", capsize=4)
    for r in done:
        b.scatter([r["store"]] * len(r["runs"]), [x["top1"] for x in r["runs"]], color="gray", s=10, zorder=3)
    b.set_ylabel("linear probe top-1 % (ReLA, budget)")
    b.set_title("demo accuracy (mean ± std over seeds)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    save_figure(fig, png)


if __name__ == "__main__":
    main()
