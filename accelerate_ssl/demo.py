"""``accelerate-ssl demo`` (``make demo``): the README's recipe against plain BYOL on real Fashion-MNIST, on CPU.

What it does, end to end:

1. **Targets**: embeds the training images once with a prior (default ``shipped:digits-byol``: a BYOL ConvNet
   trained on scikit-learn's *digits*, other data, no label: the situation of a user who takes a public model
   trained elsewhere) and writes a :class:`~accelerate_ssl.TargetStore` into the output folder (re-used by later
   runs; what loading the prior and the precompute cost is recorded with it and counted in ReLA's compute).
2. **Two BYOL runs** of ``--budget`` steps with the same seed, data order and initialisation (lightly's heads and
   ``NegativeCosineSimilarity``, a small GroupNorm ConvNet): plain BYOL, and the README's recipe: the library's default
   schedule planned for the run, the BYOL loss passed to ``rela.wrap`` as a callable with ``inputs=`` one view, so a
   step with lambda 1 runs the backbone on that view alone and skips the rest of BYOL.
3. **Linear probes** (:func:`accelerate_ssl.evaluate.linear_probe`) along both runs, each placed by its compute: the
   CPU seconds of training (and wall-clock), the precompute counted in ReLA's.
4. **At equal compute**: ReLA's accuracy at the end of its run against plain BYOL's at the same CPU seconds (read off
   plain's curve), and the compute at which ReLA's curve first reaches plain's full-run accuracy, as a fraction of
   plain's compute ("not reached" when it does not within the run).

Reproducibility: ``--threads`` is fixed (default 1, whatever the machine), so the same command on the same machine
gives bit-identical accuracies; another CPU can round differently (oneDNN picks kernels by instruction set, recorded in
``demo.json``), which moves the curves like another seed. So a run is placed among the seeds measured for these settings
(``benchmarks/results/demo.json``, read from a checkout of the repository): inside or outside the 95 % interval they
give for one more run.

Each seed's two finished runs are saved in ``--out/runs``: an interrupted multi-seed demo, run again with the same
settings, resumes at the first seed it had not finished.

It prints a table, and writes ``demo.png`` (accuracy against compute for both runs, and lambda) and ``demo.json``
(every number measured, the schedule, whether the recipe was the library's default, the command, the machine and its
load) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from .atomic import atomic_write_json
from .results import cpu_model, save_figure, write_results

DEFAULT_PRIOR = "shipped:digits-byol"  # trained on other data (scikit-learn digits), no label: a user's situation

#: the training record of each prior trained by this project (under ``benchmarks/``, read from a checkout of the
#: repository), with what it was trained on: what training it cost is printed on its own line (a user who reuses the
#: prior does not pay it, and it is part of no comparison) and rendered on the pages (benchmarks/render.py)
PRIOR_RECORDS = {
    "shipped:digits-byol": ("prior_runs/digits_byol/train.json", "scikit-learn's digits (other data), no labels"),
    "shipped:fashion-mnist-byol": ("results/train_demo_prior.json", "these Fashion-MNIST images, no labels"),
    "shipped:fashion-mnist-byol-20k": ("prior_runs/byol_convnet_long/train_20k.json",
                                       "these Fashion-MNIST images, no labels"),
    "shipped:fashion-mnist-supervised": ("prior_runs/supervised_convnet/train.json",
                                         "these Fashion-MNIST images WITH their labels"),
    "checkpoint:benchmarks/prior_runs/supervised_small/prior.safetensors": (
        "prior_runs/supervised_small/train.json", "these Fashion-MNIST images WITH their labels"),
}


def prior_training(spec: str) -> Optional[str]:
    """What training the prior ``spec`` cost this project, from its training record (None: no record, or the
    package is installed without the repository's ``benchmarks/``)."""
    if spec not in PRIOR_RECORDS:
        return None
    path, data = PRIOR_RECORDS[spec]
    file = REFERENCE_FILE.parents[1] / path
    if not file.is_file():
        return None
    rec = json.loads(file.read_text())
    threads = (rec.get("args") or {}).get("threads") or (rec.get("machine") or {}).get("torch_threads")
    return (f"{rec['steps']:,} training steps on {data}, {rec['train_seconds'] / 60:.0f} min on "
            f"{threads or 'its'} CPU thread{'s' if threads != 1 else ''} ({file.relative_to(REFERENCE_FILE.parents[2])})")


#: settings whose values change the numbers: a run is placed among the reference seeds only when all of them are the
#: reference's
NUMERIC_SETTINGS = ("budget", "probes", "prior", "weights", "schedule", "train_size", "test_size", "batch_size", "lr",
                    "widths", "probe_epochs", "threads")

#: the reference: ``accelerate-ssl demo --seeds ...`` with the default settings, committed with its provenance
REFERENCE_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "demo.json"

#: two-sided 95 % quantiles of Student's t by degrees of freedom (for :func:`prediction_interval`)
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093}


def prediction_interval(values: list[float]) -> tuple[float, float]:
    """The 95 % prediction interval for one more draw of a ratio (a speed-up, a fraction of compute), from ``values``
    (earlier draws: seeds).

    Ratios of noisy costs have multiplicative noise: the interval is Student's on the logs,
    ``exp(m +- t(0.975, n-1) * s * sqrt(1 + 1/n))`` with ``m``, ``s`` the mean and sample standard deviation of
    ``log(values)``: always positive, and wider above the geometric mean than below it."""
    n = len(values)
    if not 2 <= n <= 20 or min(values) <= 0:
        raise ValueError(f"prediction_interval: needs 2 to 20 positive values, got {values}.")
    logs = [math.log(v) for v in values]
    half = T_975[n - 1] * statistics.stdev(logs) * (1 + 1 / n) ** 0.5
    return math.exp(statistics.fmean(logs) - half), math.exp(statistics.fmean(logs) + half)


# ---------------------------------------------------------------------------------------------- arguments
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .schedules import DEFAULT_SCHEDULE

    parser.add_argument("--budget", type=int, default=1000,
                        help="optimiser steps of each run, plain BYOL and BYOL with ReLA (default 1000)")
    parser.add_argument("--probes", type=int, default=8,
                        help="linear-probe checkpoints along each run, evenly spaced (default 8)")
    parser.add_argument("--prior", default=DEFAULT_PRIOR,
                        help=f"prior spec, as everywhere (`accelerate-ssl priors list`); default {DEFAULT_PRIOR}: a "
                             "shipped BYOL ConvNet trained on other data (scikit-learn digits). Priors trained on "
                             "Fashion-MNIST itself (shipped:fashion-mnist-byol-20k, shipped:fashion-mnist-supervised) "
                             "give upper bounds, not a user's situation")
    parser.add_argument("--weights", default=None,
                        help="local weights file for the --prior (as on every verb; wins over the zoo caches)")
    parser.add_argument("--schedule", default=None,
                        help=f"lambda schedule spec, planned for --budget (default: the library's, {DEFAULT_SCHEDULE!r}; "
                             "any other spec is not the README's recipe, and demo.json says so)")
    parser.add_argument("--components", type=int, default=0,
                        help="PCA components of the targets (ReLA v2 Eq. 41); 0 (default): ReLA's own choice, the "
                             "student's feature dim")
    parser.add_argument("--seed", "--seeds", dest="seeds", type=int, nargs="+", default=[0],
                        help="seed(s) (default 0); with several, both runs are repeated per seed and the table and the "
                             "plot use the mean curves (each seed's numbers are reported too)")
    parser.add_argument("--out", default="demo-output", help="output folder (targets cache, each seed's finished runs: a rerun resumes, demo.json, demo.png)")
    parser.add_argument("--train-size", type=int, default=20000, help="Fashion-MNIST train images used (default 20000)")
    parser.add_argument("--test-size", type=int, default=10000, help="Fashion-MNIST test images for the probe (default 10000)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of both runs (and the ReLA head)")
    parser.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64], help="student ConvNet block widths (default 16 32 64)")
    parser.add_argument("--probe-epochs", type=int, default=30, help="linear-probe epochs (default 30)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1, fixed on every machine: the thread count changes float "
                             "rounding; one thread also keeps a shared or busy machine from being oversubscribed)")
    parser.add_argument("--device", default="cpu",
                        help="where the student trains and the targets are computed: 'cpu' (default; the reference "
                             "numbers are CPU numbers) or 'cuda' / 'cuda:<i>' (the probe's classifier stays on the CPU)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (the comparison, accuracies, seeds, paths) after the table instead "
                             "of the sentences")


def parse_schedule(spec: Optional[str], budget: int):
    """A ``--schedule`` spec (:data:`accelerate_ssl.schedules.SPEC_GRAMMAR`; None: the library's default) -> a
    controller planned for ``budget`` steps, as ``ReLA(total_steps=budget)`` plans it."""
    from .schedules import create_schedule

    try:
        return create_schedule(spec, total_steps=budget)
    except (ValueError, TypeError) as err:
        raise ValueError(f"--schedule {spec!r}: {err}") from err


def schedule_spec(spec: Optional[str]) -> str:
    """The spec a ``--schedule`` value runs (the library's default for None)."""
    from .schedules import DEFAULT_SCHEDULE

    return DEFAULT_SCHEDULE if spec is None else str(spec)


def is_default_recipe(args) -> bool:
    """Whether the ReLA run is the README's recipe as written: the library's default schedule and components."""
    from .schedules import DEFAULT_SCHEDULE

    return schedule_spec(args.schedule).lower() == DEFAULT_SCHEDULE and not args.components


def _check_args(args) -> None:
    for name in ("budget", "train_size", "test_size", "batch_size", "probes", "probe_epochs", "threads"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}.")
    if args.components < 0:
        raise ValueError(f"--components must be >= 0 (0: the student feature dim), got {args.components}.")
    if len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds must be distinct (a repeated seed repeats the same run), got {args.seeds}.")
    if args.batch_size > args.train_size:
        raise ValueError(f"--batch-size {args.batch_size} exceeds --train-size {args.train_size}; lower the batch size.")
    parse_schedule(args.schedule, args.budget)
    check_device(args.device)


def check_device(spec: str) -> torch.device:
    """``--device`` as a torch device, or an error naming what is missing (a CUDA device on a machine without one)."""
    try:
        device = torch.device(spec)
    except RuntimeError as err:
        raise ValueError(f"--device {spec!r} is not a device torch knows ({err}); use 'cpu' or 'cuda'.") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {spec!r}: the demo runs on 'cpu' or 'cuda', not {device.type!r}.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {spec!r}: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                         "run with --device cpu, or on a machine with a GPU and a CUDA build of torch.")
    return device


# ---------------------------------------------------------------------------------------------- measuring
def probe_steps(budget: int, total: int, per_budget: int) -> list[int]:
    """Checkpoints: 0, then ``per_budget`` evenly spaced per budget length up to ``total``."""
    every = max(1, budget // per_budget)
    steps = sorted({0, *range(every, total + 1, every), budget, total})
    return [s for s in steps if s <= total]


def _uint8_tensor(image):
    import numpy as np

    return torch.from_numpy(np.array(image, dtype=np.uint8)).unsqueeze(0)


def train_byol(args, train, probe, steps: int, checkpoints: list[int], store=None, desc: str = "BYOL",
               seed: int = 0, rela_options: Optional[dict] = None, per_view: bool = False) -> dict:
    """BYOL for ``steps`` steps (ReLA when ``store`` is given: a store, or several priors' as ``ReLA`` takes them),
    probing at ``checkpoints``; ``rela_options`` are more ``ReLA`` arguments (they win over the recipe's);
    ``per_view`` (a spatial store): each view's target pooled from the stored map over its crop box.

    ReLA is the README's recipe: ``ReLA(store, backbone, dataloader=loader, total_steps=steps)`` with the library's
    defaults (``args.schedule`` and ``args.components`` when set), and the BYOL loss a callable given to
    ``rela.wrap(..., inputs=)`` one view (``recipes.train_ssl``'s step). Both runs seed the same way, so they share the
    initial weights and the order of the batches; the only difference is ReLA. Returns the curve and per-step lambda.
    """
    from torch.utils.data import DataLoader

    from .backbones import ConvNet
    from .recipes import BYOL, images_to_tensor, loader_batches, train_ssl

    torch.manual_seed(seed)
    device = torch.device(args.device)
    backbone = ConvNet(widths=tuple(args.widths))
    model = BYOL(backbone, backbone.feature_dim).to(device)  # initialised on the CPU: the same weights on any device
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    params = [p for p in model.parameters() if p.requires_grad]
    rela = None
    if store is not None:
        from .rela import ReLA

        options = {"total_steps": steps, "feature_dim": backbone.feature_dim, **(rela_options or {})}
        if args.schedule is not None:
            options.setdefault("schedule", args.schedule)
        if args.components:
            options.setdefault("n_components", args.components)
        rela = ReLA(store, backbone, dataloader=loader, **options)
        params += list(rela.parameters())  # the transport head trains with the model (same AdamW)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    try:
        log = train_ssl(model, loader_batches(loader, lambda images: images_to_tensor(images.squeeze(1)).to(device)), steps,
                        optimizer=opt, view_generator=torch.Generator().manual_seed(seed + 1), rela=rela,
                        checkpoints=checkpoints, probe=probe, progress=desc, per_view=per_view)
        schedule = None if rela is None else repr(rela.schedule)
    finally:
        if rela is not None:
            rela.close()
    return {"curve": log["curve"], "lambda_per_step": log["lambda_per_step"], "train_seconds": log["train_seconds"],
            "train_cpu_seconds": log["train_cpu_seconds"], "schedule": schedule,
            "median_step_seconds": statistics.median(log["step_seconds"]) if log["step_seconds"] else 0.0,
            "median_step_cpu_seconds": statistics.median(log["step_cpu_seconds"]) if log["step_cpu_seconds"] else 0.0}


def _summarise(seed, plain: dict, rela: dict, budget: int, precompute: dict) -> dict:
    """One seed's accuracies at ``budget`` steps and the speed-ups they give over the plain curve: in wall-clock and CPU
    seconds (ReLA's cost includes the precompute) and in steps, with the step-time ratio (the studies that compare a
    ReLA run of ``budget`` steps against a longer plain run read it)."""
    from .recipes import cost_speedup, speedup

    rela_top1 = next(c["top1"] for c in rela["curve"] if c["step"] == budget)
    plain_at_budget = next(c["top1"] for c in plain["curve"] if c["step"] == budget)
    rela_end = next(c for c in rela["curve"] if c["step"] == budget)
    out = {"plain": plain, "rela": rela, "rela_top1": rela_top1, "plain_top1_at_budget": plain_at_budget,
           "speedup": speedup([(c["step"], c["top1"]) for c in plain["curve"]], rela_top1, budget),
           "speedup_wall": cost_speedup(plain["curve"], rela_top1, rela_end["train_seconds"] + precompute["seconds"]),
           "speedup_cpu": cost_speedup(plain["curve"], rela_top1,
                                       rela_end["train_cpu_seconds"] + precompute["cpu_seconds"], "train_cpu_seconds",
                                       "CPU s"),
           "step_time_ratio": rela["median_step_seconds"] / plain["median_step_seconds"],
           "step_cpu_ratio": rela["median_step_cpu_seconds"] / plain["median_step_cpu_seconds"]}
    return out if seed is None else {"seed": seed, **out}


#: the two clocks of the comparison: (the curve's key, the precompute's key, its unit)
CLOCKS = {"cpu": ("train_cpu_seconds", "cpu_seconds", "CPU s"), "wall": ("train_seconds", "seconds", "s")}


def compare(plain: dict, rela: dict, precompute: dict, clock: str = "cpu") -> dict:
    """ReLA against plain BYOL on one clock (:data:`CLOCKS`), precompute counted in ReLA's:

    - ``equal_compute``: ReLA's accuracy at the end of its run and plain's at the same seconds, read off plain's curve
      by linear interpolation (``gain`` = ReLA's minus plain's);
    - ``compute_to_plain``: the seconds at which ReLA's curve first reaches plain's accuracy at the end of plain's run,
      as a fraction of plain's seconds (None: not reached within ReLA's run)."""
    from .recipes import steps_to_reach, value_at

    key, pre_key, unit = CLOCKS[clock]
    pre = precompute[pre_key]
    plain_pts = [(c[key], c["top1"]) for c in plain["curve"]]
    rela_pts = [(pre + c[key], c["top1"]) for c in rela["curve"]]
    plain_cost, plain_top1 = plain_pts[-1]
    rela_cost, rela_top1 = rela_pts[-1]
    at = value_at(plain_pts, rela_cost)
    reach = steps_to_reach(rela_pts, plain_top1)
    return {"unit": unit, "rela_seconds": rela_cost, "plain_seconds": plain_cost, "compute_fraction": rela_cost / plain_cost,
            "rela_top1": rela_top1, "plain_top1_at_equal_compute": at, "gain": None if at is None else rela_top1 - at,
            "plain_top1": plain_top1, "seconds_to_plain": reach,
            "compute_to_plain": None if reach is None else reach / plain_cost}


def reference(args, result: dict) -> dict:
    """Where this run falls among the reference seeds (:data:`REFERENCE_FILE`, the default settings measured per seed):
    its CPU compute to plain's accuracy against the 95 % interval the seeds give for one more run, and its gain at
    equal compute against theirs. Only for the reference's settings, on the CPU."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    d = vars(defaults.parse_args([]))
    if not REFERENCE_FILE.is_file():
        return {"text": "reference: none here (benchmarks/results/demo.json is in a checkout of the repository)"}
    ref = json.loads(REFERENCE_FILE.read_text())
    if any(getattr(args, k) != d[k] for k in NUMERIC_SETTINGS):
        return {"text": "reference: measured for the default settings only (these differ)"}
    if args.device != "cpu":
        return {"text": f"reference: measured on the CPU only (this run is on {args.device})"}
    if any(ref["settings"].get(k) != d[k] for k in NUMERIC_SETTINGS):
        return {"text": "reference: benchmarks/results/demo.json was measured with other settings; rerun it"}
    seeds = [r["cpu"] for r in ref["per_seed"]]
    mine = result["cpu"]
    out = {"seeds": [r["seed"] for r in ref["per_seed"]], "commit": ref.get("provenance", {}).get("commit")}
    parts = []
    fractions = [r["compute_to_plain"] for r in seeds]
    if mine["compute_to_plain"] is not None and None not in fractions and len(fractions) >= 2:
        lo, hi = prediction_interval(fractions)
        where = "inside" if lo <= mine["compute_to_plain"] <= hi else "below" if mine["compute_to_plain"] < lo else "above"
        out["compute_to_plain"] = {"low": lo, "high": hi, "where": where}
        parts.append(f"compute to plain's accuracy {mine['compute_to_plain']:.2f}, {where} the 95 % interval "
                     f"{lo:.2f}-{hi:.2f} of the {len(fractions)} reference seeds ({min(fractions):.2f}-{max(fractions):.2f})")
    gains = [r["gain"] for r in seeds if r["gain"] is not None]
    if mine["gain"] is not None and gains:
        parts.append(f"gain at equal compute {mine['gain']:+.2f} points (reference seeds {min(gains):+.2f} to "
                     f"{max(gains):+.2f})")
    here = result.get("machine", {})
    differ = [f"{k.replace('_', ' ')} {here.get(k)} here, {ref['machine'].get(k)} there" for k in ("torch", "cpu_capability")
              if ref.get("machine", {}).get(k) not in (None, here.get(k))]
    text = "reference: " + "; ".join(parts) if parts else "reference: the seeds did not all reach plain's accuracy"
    if differ:
        text += (f" (measured on another setup: {'; '.join(differ)}; kernels that round differently move the curves "
                 "like another seed)")
    return {**out, "text": text}


# ---------------------------------------------------------------------------------------------- outputs
def format_table(result: dict) -> str:
    """Both curves, each probe point with its step and CPU seconds (ReLA's with its precompute)."""
    pre = result["targets"]["precompute"]["cpu_seconds"]
    lines = ["| run | step | CPU s | lambda | top-1 % |", "|---|---:|---:|---:|---:|"]
    for key, name in (("plain", "plain BYOL"), ("rela", "BYOL + ReLA")):
        for c in result[key]["curve"]:
            cpu = c["train_cpu_seconds"] + (pre if key == "rela" else 0.0)
            acc = f"{c['top1']:.2f}" + (f" ± {c['top1_std']:.2f}" if "top1_std" in c else "")
            lines.append(f"| {name} | {c['step']} | {cpu:.0f} | {c['lambda']:.2f} | {acc} |")
    return "\n".join(lines)


def demo_figure(result: dict):
    """The demo's figure: both accuracy curves against CPU seconds (ReLA's with its precompute), plain's full-run
    accuracy and where ReLA reaches it, and lambda per step."""
    from .optional import require

    require("matplotlib", "the demo's plot")
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pre = result["targets"]["precompute"]["cpu_seconds"]
    fig, (ax, axl) = plt.subplots(2, 1, figsize=(7, 6), gridspec_kw={"height_ratios": [3, 1]})
    for key, label, style, shift in (("plain", "plain BYOL", "o-", 0.0), ("rela", "BYOL + ReLA (the README's recipe)",
                                                                          "s-", pre)):
        c = result[key]["curve"]
        ax.errorbar([shift + p["train_cpu_seconds"] for p in c], [p["top1"] for p in c],
                    yerr=[p.get("top1_std", 0.0) for p in c], fmt=style, capsize=3, label=label)
    cmp_ = result["cpu"]
    ax.axhline(cmp_["plain_top1"], color="gray", ls=":", lw=1, label="plain BYOL at the end of its run")
    if cmp_["seconds_to_plain"] is not None:
        ax.axvline(cmp_["seconds_to_plain"], color="gray", ls=":", lw=1)
    ax.set_xlabel("CPU seconds of training (ReLA: precompute included)")
    ax.set_ylabel("linear probe top-1 (%)")
    seeds = result["settings"]["seeds"]
    over = f", mean of {len(seeds)} seeds" if len(seeds) > 1 else ""
    title = (f"Fashion-MNIST, BYOL and the README's recipe (prior {result['settings']['prior_spec']}, schedule "
             f"{result['schedule']}){over}")
    ax.legend(loc="lower right", fontsize=8)
    lam = result["rela"]["lambda_per_step"]
    axl.plot(range(1, len(lam) + 1), lam, color="C1")
    axl.set_ylabel("lambda")
    axl.set_xlabel("training steps of the ReLA run")
    axl.set_ylim(-0.05, 1.05)
    renderer = fig.canvas.get_renderer()
    for width in range(100, 19, -10):  # the widest wrap whose lines, as drawn, stay inside the figure
        ax.set_title("\n".join(textwrap.wrap(title, width, break_on_hyphens=False)), fontsize=9)
        fig.tight_layout()
        extent = ax.title.get_window_extent(renderer)
        if extent.x0 >= 0 and extent.x1 <= fig.bbox.width and extent.y1 <= fig.bbox.height:
            break
    return fig


def write_png(result: dict, path: Path) -> None:
    save_figure(demo_figure(result), path, dpi=110)


def sentences(result: dict) -> list[str]:
    """What the demo prints about the comparison, from its numbers."""
    out = []
    for clock in ("cpu", "wall"):
        c = result[clock]
        u = c["unit"]
        at = ("past the end of plain's run" if c["plain_top1_at_equal_compute"] is None else
              f"plain BYOL was at {c['plain_top1_at_equal_compute']:.2f} % at the same {u} ({c['gain']:+.2f} points)")
        reach = ("it did not reach plain's accuracy within its run" if c["compute_to_plain"] is None else
                 f"it reached plain's {c['plain_top1']:.2f} % at {c['compute_to_plain']:.2f} of plain's {u}")
        out.append(f"{'CPU time' if clock == 'cpu' else 'wall-clock'}: ReLA ended at {c['rela_top1']:.2f} % after "
                   f"{c['rela_seconds']:.0f} {u} ({c['compute_fraction']:.2f} of plain's {c['plain_seconds']:.0f} {u}, "
                   f"precompute included); {at}; {reach}.")
    return out


# ---------------------------------------------------------------------------------------------- main
def run(args) -> int:
    t_start, cpu_start, load_start = time.perf_counter(), time.process_time(), os.getloadavg()
    _check_args(args)
    torch.set_num_threads(args.threads)
    from .data import FashionMNIST
    from .priors import create_prior
    from .recipes import Probe, images_to_tensor, mean_run
    from .targets.precompute import precompute_targets
    from .targets.store import TargetStore

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train = FashionMNIST("train", limit=args.train_size)
    test = FashionMNIST("test", limit=args.test_size)

    # 1. targets from the prior (clean images, the prior's own preprocessing), cached in --out
    spec = args.prior
    load_t, load_c = time.perf_counter(), time.process_time()
    prior = create_prior(spec, weights=args.weights)
    load_t, load_c = time.perf_counter() - load_t, time.process_time() - load_c  # ReLA's cost too: counted below
    info = prior.describe()  # the store's folder names the weights, so other weights never re-use it
    sha = str(info.get("checkpoint_sha256") or info.get("weights_sha256") or "")[:10]
    store_dir = out / "targets" / "-".join(x for x in (_safe_name(args.prior), sha, str(args.train_size)) if x)
    memo = store_dir.parent / f"{store_dir.name}.precompute.json"  # the precompute's cost, counted by every run
    if (store_dir / "metadata.json").is_file() and memo.is_file():  # made by an earlier run with the same prior and data
        store = TargetStore.open(store_dir, dataset=train)
        precompute = json.loads(memo.read_text())
        print(f"targets: re-using {store_dir} ({len(store)} x {store.dim}; its precompute took "
              f"{precompute['cpu_seconds']:.1f} CPU s, counted in ReLA's compute)")
    else:
        t, c = time.perf_counter() - load_t, time.process_time() - load_c  # loading the prior + the precompute
        store = precompute_targets(prior, train, store_dir, progress=True,
                                   command=" ".join(shlex.quote(a) for a in ["accelerate-ssl", *sys.argv[1:]]))
        precompute = {"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c,
                      "threads": torch.get_num_threads(), "load_average": os.getloadavg()}
        atomic_write_json(memo, precompute, indent=1)

    # 2-3. the two runs per seed, probed on the same train subset / test set
    train.transform = _uint8_tensor  # training batches: uint8 [1, 28, 28] tensors; views are made per batch
    train_x, test_x = images_to_tensor(train.data), images_to_tensor(test.data)
    checkpoints = probe_steps(args.budget, args.budget, args.probes)
    per_seed = []
    for seed in args.seeds:
        probe = Probe(train_x, train.targets, test_x, test.targets, epochs=args.probe_epochs, seed=seed)
        tag = f" (seed {seed})" if len(args.seeds) > 1 else ""
        done = _finished_seed(out, args, seed)
        if done is not None:  # an interrupted multi-seed demo resumes at the first seed it had not finished
            rela, plain = done["rela"], done["plain"]
            print(f"seed {seed}: re-using its two finished runs in {_seed_file(out, seed)}")
        else:
            rela = train_byol(args, train, probe, args.budget, [s for s in checkpoints if s > 0], store=store,
                              desc="BYOL + ReLA" + tag, seed=seed)
            plain = train_byol(args, train, probe, args.budget, checkpoints, desc="plain BYOL" + tag, seed=seed)
            atomic_write_json(_seed_file(out, seed), {"settings": _numeric_settings(args), "torch": torch.__version__,
                                                      "rela": rela, "plain": plain}, indent=1)
        # step 0 is the same network for both runs (same seed, same initialisation): probed once
        step0 = next(c for c in plain["curve"] if c["step"] == 0)
        rela["curve"].insert(0, {**step0, "lambda": rela["lambda_per_step"][0] if rela["lambda_per_step"] else 0.0})
        per_seed.append({"seed": seed, "plain": plain, "rela": rela,
                         **{clock: compare(plain, rela, precompute, clock) for clock in CLOCKS}})

    plain, rela = (mean_run([r[key] for r in per_seed]) for key in ("plain", "rela"))
    result = {
        "command": " ".join(shlex.quote(a) for a in ["accelerate-ssl", *sys.argv[1:]]),
        "schedule": schedule_spec(args.schedule), "default": is_default_recipe(args),
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(), "processor": cpu_model() or "unknown",
                    "platform": platform.platform(), "python": platform.python_version(), "device": args.device,
                    "gpu": torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else None,
                    "cuda": torch.version.cuda if args.device.startswith("cuda") else None,
                    "load_average_start": load_start},
        "settings": {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"},
        "prior": prior.describe(),
        "targets": {"path": str(store_dir), "rows": len(store), "dim": store.dim, "precompute": precompute},
        "prior_training": prior_training(spec) if args.weights is None else None,
        "plain": plain, "rela": rela,
        **{clock: compare(plain, rela, precompute, clock) for clock in CLOCKS},  # the mean curves
        "per_seed": [{k: v for k, v in r.items() if k not in ("plain", "rela")} for r in per_seed]
        if len(per_seed) > 1 else [],
        "runs": [{"seed": r["seed"], "plain": r["plain"], "rela": r["rela"]} for r in per_seed],
    }
    result["settings"]["prior_spec"] = spec
    result["wall_seconds"] = time.perf_counter() - t_start
    result["cpu_seconds"] = time.process_time() - cpu_start  # all threads of this process
    result["machine"]["load_average_end"] = os.getloadavg()
    result["reference"] = reference(args, result)
    table = format_table(result)
    result["table"] = table
    png = out / "demo.png"
    write_png(result, png)
    write_results(out / "demo.json", result, device=args.device,
                  per_seed=["per_seed.*.cpu.compute_to_plain", "runs.*.rela.curve"] if len(per_seed) > 1 else None)

    if args.json:
        print(json.dumps({"schedule": result["schedule"], "default": result["default"], "cpu": result["cpu"],
                          "wall": result["wall"], "per_seed": result["per_seed"], "reference": result["reference"],
                          "prior": spec, "seeds": args.seeds, "torch": torch.__version__,
                          "json": str(out / "demo.json"), "png": str(png)}))
        return 0
    print()
    print(table)
    print()
    means = f" (the mean curves of {len(args.seeds)} seeds)" if len(args.seeds) > 1 else ""
    recipe = ("the README's recipe: the default schedule" if result["default"] else "schedule") + f" {result['schedule']!r}"
    print(f"BYOL + ReLA ({recipe}, prior {spec}) against plain BYOL, {args.budget} steps each{means}:")
    for line in sentences(result):
        print(f"  {line}")
    for r in result["per_seed"]:
        c = r["cpu"]
        print(f"  seed {r['seed']}: gain at equal CPU time "
              f"{'–' if c['gain'] is None else format(c['gain'], '+.2f')} points; compute to plain's accuracy "
              f"{'not reached' if c['compute_to_plain'] is None else format(c['compute_to_plain'], '.2f')}")
    print(result["reference"]["text"])
    if result["prior_training"]:
        print(f"the prior's own training (once, by this project; not counted): {result['prior_training']}")
    print(f"wall time: {result['wall_seconds']:.0f} s, CPU time {result['cpu_seconds']:.0f} s (the rest probes); prior "
          f"{spec}, seeds {' '.join(map(str, args.seeds))}, torch {torch.__version__}, {torch.get_num_threads()} CPU "
          f"threads ({result['machine']['cpu_capability']}), load average {load_start[0]:.1f} at start, "
          f"{result['machine']['load_average_end'][0]:.1f} at end")
    print(f"wrote {png} and {out / 'demo.json'}")
    return 0


def _numeric_settings(args) -> dict:
    return {k: getattr(args, k) for k in NUMERIC_SETTINGS}


def _seed_file(out: Path, seed: int) -> Path:
    return out / "runs" / f"seed{seed}.json"


def _finished_seed(out: Path, args, seed: int) -> Optional[dict]:
    """The two runs of ``seed`` an earlier demo finished in ``out`` with the same numeric settings and torch (else
    None: they are run again)."""
    path = _seed_file(out, seed)
    if not path.is_file():
        return None
    try:
        done = json.loads(path.read_text())
    except ValueError:  # written atomically, so only a hand-edited file is unreadable: run the seed again
        return None
    same = done.get("settings") == json.loads(json.dumps(_numeric_settings(args))) and done.get("torch") == torch.__version__
    return done if same else None


def _safe_name(spec: str) -> str:
    name = Path(spec.split(":", 1)[-1]).stem if ":" in spec else spec
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or "prior"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="accelerate-ssl demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
