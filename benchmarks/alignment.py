"""ReLA's alignment check (:mod:`accelerate_ssl.rela.guard`): its false-alarm and miss rates on the demo.

The demo's ReLA run (``accelerate-ssl demo``: Fashion-MNIST 20k train images, the shipped prior
``shipped:fashion-mnist-byol-20k``, the 16/32/64 ConvNet student, BYOL + ReLA with ``switch``, weak views while
lambda == 1, 16 PCA components, the least-squares head, AdamW 1e-3, batch 128, 250 steps), seeded, once per
condition and seed, with the store's rows:

- ``aligned``: as computed (every alarm here is a false alarm);
- ``shuffled-1%`` / ``-10%`` / ``-100%``: a random permutation applied to that fraction of the rows;
- ``stale``: the right store, but every step looks up the *previous* batch's indices.

The same with two variants of the recipe (``--variants``): ``decay`` (the library's default schedule, the
ReLA term on for the whole run) and ``random head`` (the papers' random head instead of the least-squares fit).

Per run: whether the check warned and at which step, and every tested window's gap and t statistic. A run
stops at its alarm (a misaligned run's later steps tell nothing more). The check's own cost is timed apart, per
call, at the demo's shape and at a larger one. Each finished run is cached as JSON under ``--cache``, so a rerun
resumes. Writes ``benchmarks/results/alignment.json`` and ``alignment.png``.

    nice -n 5 .venv/bin/python benchmarks/alignment.py                    # the study in benchmarks/README.md
    .venv/bin/python benchmarks/alignment.py --seeds 0 --conditions aligned shuffled-100%   # a quick look
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accelerate_ssl.atomic import atomic_write_json  # noqa: E402
from accelerate_ssl.results import save_figure, write_results  # noqa: E402

VERSION = 1  # bump when a change invalidates cached runs
CONDITIONS = ("aligned", "shuffled-1%", "shuffled-10%", "shuffled-100%", "stale")
#: the demo's recipe, and two changes of it that change how the head learns: the library's default schedule
#: (ReLA's term stays on all run, lambda decaying) and the papers' random head (no least-squares start)
VARIANTS = {"demo": [], "decay": ["--schedule", "decay"], "random head": ["--head-init", "random"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS))
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="recipes: the demo's, and the variants (aligned, 100 %% shuffled and stale only)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(12)),
                   help="seeds of the demo's aligned runs (default 0-11)")
    p.add_argument("--misaligned-seeds", type=int, nargs="+", default=list(range(5)),
                   help="seeds of the demo's other conditions (default 0-4)")
    p.add_argument("--variant-seeds", type=int, nargs="+", default=list(range(4)),
                   help="seeds of the variants' runs (default 0-3)")
    p.add_argument("--steps", type=int, default=250, help="optimiser steps per run (the demo's budget, 250)")
    p.add_argument("--train-size", type=int, default=20000)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/alignment"), help="per-run JSON cache and the store")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/alignment.json"))
    return p


def demo_settings(args, variant: str = "demo") -> argparse.Namespace:
    """The demo's own defaults (``accelerate-ssl demo``), with this study's steps and train size."""
    from accelerate_ssl.demo import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--budget", str(args.steps), "--train-size", str(args.train_size), *VARIANTS[variant]])


def misaligned_rows(rows: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """``rows`` with a random permutation applied to a random ``fraction`` of them."""
    g = torch.Generator().manual_seed(1000 + seed)
    chosen = torch.randperm(len(rows), generator=g)[: round(fraction * len(rows))]
    out = rows.clone()
    out[chosen] = rows[chosen[torch.randperm(len(chosen), generator=g)]]
    return out


class _Alarm(Exception):
    pass


def run_one(demo, condition: str, seed: int, images: torch.Tensor, rows: torch.Tensor, desc: str = "") -> dict:
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.demo import parse_schedule
    from accelerate_ssl.rela import ReLA
    from accelerate_ssl.recipes import BYOL, shuffled_batches, tensor_batches, train_ssl

    targets = rows if not condition.startswith("shuffled") else \
        misaligned_rows(rows, float(condition.split("-")[1].rstrip("%")) / 100, seed)
    torch.manual_seed(seed)
    backbone = ConvNet(widths=tuple(demo.widths))
    model = BYOL(backbone, backbone.feature_dim)
    rela = ReLA(targets, backbone, schedule=parse_schedule(demo.schedule, demo.budget), feature_dim=backbone.feature_dim,
                n_components=demo.components, head_init=demo.head_init)
    opt = torch.optim.AdamW([*(p for p in model.parameters() if p.requires_grad), *rela.parameters()],
                            lr=demo.lr, weight_decay=0.01)
    order = shuffled_batches(len(images), demo.batch_size, seed=seed)
    if condition == "stale":  # the images of batch t with the indices of batch t - 1
        def lagged(order=order):
            previous = next(order)
            for current in order:
                yield images[current], previous
                previous = current
        batches = lagged()
    else:
        batches = tensor_batches(images, order)
    fired = {}

    def on_step(step, loss):
        if rela.guard.alarm is not None:
            fired["step"] = step
            raise _Alarm

    t0 = time.perf_counter()
    log = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            log = train_ssl(model, batches, demo.budget, optimizer=opt, view_generator=torch.Generator().manual_seed(seed + 1),
                            rela=rela, rela_views=demo.rela_views, on_step=on_step, progress=f"{desc}{condition} seed {seed}")
        except _Alarm:
            pass
    rela.close()
    windows = [dict(w) for w in rela.guard.history]
    return {"condition": condition, "seed": seed, "fired": "step" in fired, "fired_step": fired.get("step"),
            "steps_run": fired.get("step", demo.budget), "alarm": rela.guard.alarm, "windows": windows,
            "min_t": min((w["t"] for w in windows), default=None),
            "mean_step_seconds": None if log is None else log["train_seconds"] / max(1, len(log["step_seconds"])),
            "wall_seconds": time.perf_counter() - t0}


def check_cost(batch: int, views: int, dim: int, calls: int = 2000) -> dict:
    """Seconds per :meth:`AlignmentGuard.observe` call on ``[views * batch, dim]`` predictions (CPU)."""
    from accelerate_ssl.rela.guard import AlignmentGuard

    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(views * batch, dim, generator=g), torch.randn(views * batch, dim, generator=g)
    guard = AlignmentGuard(warmup=0, window=10**9)
    for _ in range(50):
        guard.observe(pred, target, batch)
    t = time.perf_counter()
    for _ in range(calls):
        guard.observe(pred, target, batch)
    return {"batch": batch, "views": views, "dim": dim, "seconds_per_call": (time.perf_counter() - t) / calls}


def summarise(runs: list[dict]) -> list[dict]:
    out = []
    for variant, cond in ((v, c) for v in VARIANTS for c in CONDITIONS):
        rs = [r for r in runs if r["condition"] == cond and r["variant"] == variant]
        if not rs:
            continue
        fired = [r["fired_step"] for r in rs if r["fired"]]
        ts = [r["min_t"] for r in rs if r["min_t"] is not None]
        out.append({"variant": variant, "condition": cond, "runs": len(rs), "alarms": len(fired), "alarm_rate": len(fired) / len(rs),
                    "median_alarm_step": round(statistics.median(fired)) if fired else None,
                    "min_t": min(ts) if ts else None,
                    "first_window_gap": statistics.mean([r["windows"][0]["gap"] for r in rs if r["windows"]] or [math.nan])})
    return out


def table(summary: list[dict], cost: list[dict], step_seconds: float) -> str:
    lines = ["| recipe | store rows | runs | alarms | alarm rate | median step of the alarm | lowest window t | mean gap, first window |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        lines.append(f"| {s['variant']} | {s['condition']} | {s['runs']} | {s['alarms']} | {s['alarm_rate']:.0%} | "
                     f"{'' if s['median_alarm_step'] is None else s['median_alarm_step']} | "
                     f"{'' if s['min_t'] is None else format(s['min_t'], '.1f')} | {s['first_window_gap']:+.3f} |")
    lines.append("")
    for c in cost:
        lines.append(f"check cost, [{c['views']} x {c['batch']}, {c['dim']}] predictions: "
                     f"{c['seconds_per_call'] * 1e6:.0f} us per batch (CPU)"
                     + (f", {c['seconds_per_call'] / step_seconds:.2%} of the demo's step" if c["dim"] == 16 else ""))
    return "\n".join(lines)


def plot(runs: list[dict], z: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, cond in enumerate(CONDITIONS):
        for j, r in enumerate(r for r in runs if r["condition"] == cond and r["variant"] == "demo"):
            ax.plot([w["batch"] for w in r["windows"]], [w["t"] for w in r["windows"]], "o-", ms=3, lw=1,
                    color=f"C{i}", alpha=0.5, label=cond if j == 0 else None)
    ax.axhline(z, color="k", ls="--", lw=0.8, label=f"alarm below t = {z:g}")
    ax.set_yscale("symlog", linthresh=5)
    ax.set_xlabel("batches observed (end of the tested window)")
    ax.set_ylabel("window t statistic of the cosine gap")
    ax.set_title("ReLA alignment check on the demo (Fashion-MNIST, BYOL + ReLA)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from accelerate_ssl.data import FashionMNIST
    from accelerate_ssl.demo import DEFAULT_PRIOR
    from accelerate_ssl.recipes import images_to_tensor
    from accelerate_ssl.rela.guard import AlignmentGuard
    from accelerate_ssl.targets.precompute import precompute_targets
    from accelerate_ssl.targets.priors import create_prior
    from accelerate_ssl.targets.store import TargetStore

    demo = demo_settings(args)
    runs_todo = [(v, c, s) for v in args.variants for c in args.conditions
                 if v == "demo" or c in ("aligned", "shuffled-100%", "stale")
                 for s in (args.variant_seeds if v != "demo" else args.seeds if c == "aligned" else args.misaligned_seeds)]
    cache = Path(args.cache)
    train = FashionMNIST("train", limit=args.train_size)
    store_dir = cache / f"targets-{args.train_size}"
    store = TargetStore.open(store_dir, dataset=train) if (store_dir / "metadata.json").is_file() else \
        precompute_targets(create_prior(DEFAULT_PRIOR), train, store_dir, progress=True)
    rows = store[torch.arange(len(store))].float()
    images = images_to_tensor(train.data)
    guard = AlignmentGuard()
    settings = {"prior": DEFAULT_PRIOR, "steps": args.steps, "train_size": args.train_size, "threads": args.threads,
                "demo": {k: v for k, v in vars(demo).items() if k not in ("out", "json")}, "variants": VARIANTS,
                "check": {"warmup": guard.warmup, "window": guard.window, "z": guard.z}, "version": VERSION}
    runs = []
    for variant, cond, seed in runs_todo:
        key = hashlib.sha256(json.dumps({**settings, "variant": variant}, sort_keys=True).encode()).hexdigest()[:12]
        path = cache / f"run-{variant.replace(' ', '_')}-{cond.replace('%', 'pct')}-{seed}-{key}.json"
        if not path.is_file():
            atomic_write_json(path, {"variant": variant, **run_one(demo_settings(args, variant), cond, seed, images, rows,
                                                                      desc=f"{variant}: ")})
        runs.append(json.loads(path.read_text()))
    cost = [check_cost(demo.batch_size, 2, demo.components), check_cost(256, 2, 256)]
    step_seconds = statistics.mean(r["mean_step_seconds"] for r in runs if r["mean_step_seconds"] and r["variant"] == "demo")
    summary = summarise(runs)
    result = {"command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/alignment.py", *sys.argv[1:]]),
              "machine": {"torch": torch.__version__, "platform": platform.platform(), "threads": args.threads},
              "settings": settings, "summary": summary, "check_cost": cost, "mean_step_seconds": step_seconds,
              "table": table(summary, cost, step_seconds), "runs": runs}
    out = Path(args.out)
    write_results(out, result, root=ROOT)
    plot(runs, guard.z, out.with_suffix(".png"))
    print(result["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
