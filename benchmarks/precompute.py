"""Precompute throughput vs the bare prior forward, and peak RSS vs N.

On Fashion-MNIST (train) with ``random:resnet18`` (torchvision resnet18, random seeded weights, the
prior's own preprocessing at the data's native 28 px, the data set's mean/std), in one process:

(a) bare forward: ``prior(x)`` under ``torch.inference_mode`` over the same preprocessed batches,
    already in memory (no data loading, no preprocessing, no writing);
(b) ``precompute_targets``: data loading + preprocessing + forward + NaN check + chunk writes +
    consolidation into the memory-mapped store.

Reports images/s of both (wall clock, and per second of process CPU time, which is less
sensitive to other jobs on a shared machine), the ratio b/a (goal >= 0.9), and the peak RSS during (b) (psutil, sampled
every 10 ms in a thread) for N and N/4, to show RSS does not grow with N. Runs alternate (b) and
(a) per N so that the load of a shared machine hits both alike.

    .venv/bin/python benchmarks/precompute.py [--limit 4000] [--batch-size 256] [--threads 2]

``--sweep`` measures instead what sets the CPU default batch size (``DEFAULT_BATCH_SIZE``): ``precompute_targets``
images/s at each ``--batch-sizes`` value for a small ConvNet at 28 px (``shipped:digits-byol``, ``--limit`` images)
and a ResNet-18 at 224 px (``random:resnet18``, size 224, 256 images), batch sizes interleaved per round, best of the
rounds (results/precompute_batch.json + .png):

    .venv/bin/python benchmarks/precompute.py --sweep --limit 20000 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accelerate_ssl.data import FashionMNIST  # noqa: E402
from accelerate_ssl.results import save_figure, write_results  # noqa: E402
from measure import PeakRSS  # noqa: E402
from accelerate_ssl.targets.precompute import precompute_targets  # noqa: E402
from accelerate_ssl.priors import create_prior  # noqa: E402


def bare_forward(prior, dataset, batch_size: int) -> tuple[float, float]:
    """(images/s wall, images/s of process CPU time) of the forward alone over preprocessed in-memory batches."""
    pre = prior.preprocess.with_stats(dataset.mean, dataset.std, "dataset")
    batches = [pre.batch(dataset.data[a : a + batch_size].unsqueeze(1)) for a in range(0, len(dataset), batch_size)]
    with torch.inference_mode():
        prior(batches[0][:8])  # warm-up
        start, cpu = time.perf_counter(), time.process_time()
        for x in batches:
            prior(x)
        return len(dataset) / (time.perf_counter() - start), len(dataset) / (time.process_time() - cpu)


def full_precompute(prior, dataset, batch_size: int, num_workers: int, workdir: Path):
    """(images/s wall, images/s of CPU time, peak RSS, RSS before) of precompute_targets."""
    out = workdir / f"store-{len(dataset)}"
    shutil.rmtree(out, ignore_errors=True)
    with PeakRSS() as rss:
        start, cpu = time.perf_counter(), time.process_time()
        store = precompute_targets(prior, dataset, out, batch_size=batch_size, num_workers=num_workers, progress=False)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    assert len(store) == len(dataset)
    shutil.rmtree(out, ignore_errors=True)
    return len(dataset) / seconds, len(dataset) / cpu_seconds, rss.peak, rss.base


def batch_sweep(args) -> None:
    """precompute_targets throughput per batch size, two priors (module docstring), written as JSON + PNG."""
    cases = [("shipped:digits-byol", {}, args.limit), ("random:resnet18", {"size": 224}, 256)]
    report = {"command": "python benchmarks/precompute.py " + " ".join(sys.argv[1:]),
              "machine": {"cpu_count": os.cpu_count(), "torch_threads": args.threads, "torch": torch.__version__,
                          "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                          "load_average_start": os.getloadavg()},
              "rounds": args.rounds, "results": []}
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as tmp:
        for spec, options, n in cases:
            prior, dataset = create_prior(spec, **options), FashionMNIST("train", limit=n)
            best = {b: (0.0, 0.0) for b in args.batch_sizes}
            for _ in range(args.rounds):
                for b in args.batch_sizes:
                    wall, cpu, _, _ = full_precompute(prior, dataset, b, args.num_workers, Path(tmp))
                    best[b] = (max(best[b][0], wall), max(best[b][1], cpu))
            for b, (wall, cpu) in best.items():
                row = {"prior": spec, "options": options, "n": n, "batch_size": b, "img_s": round(wall, 1),
                       "img_per_cpu_s": round(cpu, 1), "vs_fastest": round(wall / max(w for w, _ in best.values()), 3)}
                print(json.dumps(row), flush=True)
                report["results"].append(row)
    report["machine"]["load_average_end"] = os.getloadavg()
    out = Path(args.out).with_name("precompute_batch.json")
    write_results(out, report, ROOT, indent=1)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(4.5 * len(cases), 3.5))
    for ax, (spec, options, n) in zip(axes, cases):
        rows = [r for r in report["results"] if r["prior"] == spec]
        ax.bar([str(r["batch_size"]) for r in rows], [r["img_s"] for r in rows])
        ax.set_title(f"{spec} {options.get('size', 28)} px, {n} images", fontsize=8)
        ax.set_xlabel("batch size")
        ax.set_ylabel("images / s (wall)")
    fig.suptitle(f"precompute_targets on CPU, {args.threads} thread(s): {report['command']}", fontsize=8)
    fig.tight_layout()
    save_figure(fig, out.with_suffix(".png"), dpi=110)
    print(f"wrote {out} and {out.with_suffix('.png')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=4000, help="N (first N training images; 60000 = all)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="alternating repetitions per N (best is kept)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "precompute.json"))
    parser.add_argument("--sweep", action="store_true", help="measure precompute speed per batch size instead")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32, 64, 256], help="with --sweep")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    if args.sweep:
        return batch_sweep(args)
    prior = create_prior("random:resnet18")
    sizes = [max(1, args.limit // 4), args.limit]
    results = []
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as tmp:
        for n in sizes:
            dataset = FashionMNIST("train", limit=n)
            b = b_cpu = a = a_cpu = 0.0
            peak = start = 0
            for _ in range(args.rounds):  # alternate (b) and (a); best of the rounds (a shared machine is noisy)
                rb, rb_cpu, rpeak, rstart = full_precompute(prior, dataset, args.batch_size, args.num_workers, Path(tmp))
                ra, ra_cpu = bare_forward(prior, dataset, args.batch_size)
                b, b_cpu, a, a_cpu = max(b, rb), max(b_cpu, rb_cpu), max(a, ra), max(a_cpu, ra_cpu)
                peak, start = max(peak, rpeak), rstart if not start else start
            row = {"n": n, "bare_forward_img_s": round(a, 1), "precompute_img_s": round(b, 1),
                   "ratio": round(b / a, 3), "bare_forward_img_per_cpu_s": round(a_cpu, 1),
                   "precompute_img_per_cpu_s": round(b_cpu, 1), "ratio_cpu_time": round(b_cpu / a_cpu, 3),
                   "peak_rss_mb": round(peak / 2**20, 1),
                   "rss_before_mb": round(start / 2**20, 1), "rss_growth_mb": round((peak - start) / 2**20, 1)}
            print(json.dumps(row), flush=True)
            results.append(row)
    report = {
        "command": "python benchmarks/precompute.py " + " ".join(sys.argv[1:]),
        "prior": "random:resnet18", "input": "28x28 native, 3 channels (repeated), Fashion-MNIST mean/std",
        "dataset": "fashion-mnist train", "batch_size": args.batch_size, "num_workers": args.num_workers,
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": args.threads, "torch": torch.__version__,
                    "python": platform.python_version(), "load_avg_1min": round(os.getloadavg()[0], 2)},
        "results": results,
        "goal": "precompute >= 0.9 x bare forward; peak RSS flat in N",
        "rss_ratio_large_over_small": round(results[-1]["peak_rss_mb"] / results[0]["peak_rss_mb"], 3),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_results(out, report, ROOT, indent=1)
    plot_report(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot_report(report: dict, png: Path) -> None:
    """Throughput (bare forward vs precompute) and peak RSS per N, from a report written by main()."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    ns = [str(r["n"]) for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.bar([i - 0.2 for i in x], [r["bare_forward_img_s"] for r in rows], 0.4, label="bare prior forward")
    ax1.bar([i + 0.2 for i in x], [r["precompute_img_s"] for r in rows], 0.4, label="precompute_targets")
    for i, r in zip(x, rows):
        ax1.text(i + 0.2, r["precompute_img_s"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(list(x), ns)
    ax1.set_xlabel("N images")
    ax1.set_ylabel("images / s")
    ax1.legend(fontsize=8)
    ax2.bar(list(x), [r["peak_rss_mb"] for r in rows], 0.5)
    ax2.set_xticks(list(x), ns)
    ax2.set_xlabel("N images")
    ax2.set_ylabel("peak RSS (MB)")
    fig.suptitle(f"{report['prior']} on {report['dataset']}: {report['command']}", fontsize=8)
    fig.tight_layout()
    save_figure(fig, png, dpi=110)


if __name__ == "__main__":
    main()
