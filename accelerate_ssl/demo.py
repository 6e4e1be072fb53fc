"""``accelerate-ssl demo`` (``make demo``): what ReLA saves over plain BYOL on real Fashion-MNIST, on CPU.

What it does, end to end:

1. **Targets**: embeds the training images once with a prior (default ``shipped:digits-byol``: a BYOL ConvNet
   trained on scikit-learn's *digits*, other data, no label: the situation of a user who takes a public model
   trained elsewhere) and writes a :class:`~accelerate_ssl.TargetStore` into the output folder (re-used by later
   runs; the time of loading the prior and the precompute is recorded with it and counted in every run's cost).
2. **Two BYOL runs** with the same seed, data order and initialisation (lightly's heads and
   ``NegativeCosineSimilarity``, a small GroupNorm ConvNet): plain BYOL, and BYOL with
   ``loss = rela.wrap(byol_loss)`` for ``--budget`` steps. Plain BYOL runs ``--plain-multiple`` times longer,
   so the demo can measure when it catches up.
3. **Linear probes** (:func:`accelerate_ssl.evaluate.linear_probe`) at checkpoints of both runs.
4. **Speed-up**, three ways, each read off the plain curve by linear interpolation (first crossing; "> X" if
   plain never gets there within its run): in wall-clock, plain BYOL's training seconds to reach ReLA's accuracy
   at the budget / (ReLA's training seconds + the precompute); the same in CPU seconds (robust to other jobs on
   the machine); and in optimiser steps. The step-time ratio (ReLA step / plain step, medians) is printed beside
   them, and the prior's own training cost, where this project trained it, on its own line.

The recipe (``switch`` planned for the budget, so lambda stays 1 while the ReLA loss still falls; then each ReLA
step forwards **one** weak view per image, ReLA v1's resized crop 0.5-1 + flip, and skips BYOL's heads, momentum
network and EMA update; 16 target components; the head fitted by least squares at the first batch; lr 1e-3 for
both runs, plain BYOL's best measured rate) is the one ``benchmarks/speedup.py`` measures. ``--rela-step
two-view`` runs the former step (two views, EMA kept) for comparison.

Reproducibility: ``--threads`` is fixed (default 1, whatever the machine), so the same command on the same
machine gives bit-identical numbers; another CPU can round differently (oneDNN picks kernels by instruction set, recorded in ``demo.json``)
and 1000 plain steps amplify that, like another seed. So a single run is not compared with one number: it is placed
in the 95 % prediction interval that the seeds measured for these settings give for one more run (:data:`REFERENCE`).

It prints a table, and writes ``demo.png`` (accuracy vs steps for both runs, and lambda) and ``demo.json``
(every number measured, the command, the machine and its load) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from .atomic import atomic_write_json
from .results import cpu_model, save_figure, write_results

DEFAULT_PRIOR = "shipped:digits-byol"  # trained on other data (scikit-learn digits), no label: a user's situation

#: what training a shipped prior cost this project (its record under ``benchmarks/prior_runs``): printed on its own
#: line, since a user who reuses the prior does not pay it (and it is not part of any speed-up)
PRIOR_TRAINING = {
    "shipped:digits-byol": "2000 BYOL steps on the 1797 scikit-learn digits (other data), 28 min on 1 CPU thread",
    "shipped:fashion-mnist-byol": "1000 BYOL steps on these Fashion-MNIST images, 37 min on 1 CPU thread",
    "shipped:fashion-mnist-byol-20k": "20,000 BYOL steps on these Fashion-MNIST images, 90 min on 1 CPU thread",
    "shipped:fashion-mnist-supervised": "7000 supervised steps WITH these images' labels, 33 min on 1 CPU thread",
}

#: settings whose values change the numbers; :data:`REFERENCE` holds for the defaults of all of them
NUMERIC_SETTINGS = ("budget", "plain_multiple", "probes", "prior", "weights", "schedule", "rela_views", "rela_step",
                    "components", "head_init", "train_size", "test_size", "batch_size", "lr", "widths",
                    "probe_epochs", "threads")

#: the default settings measured per seed: ``accelerate-ssl demo --seeds 0 1 2 3 4 5`` on near-idle cores
#: (``benchmarks/results/demo.json``): each seed's speed-up in CPU time (precompute included) and in steps, and the
#: mean curves'. A run is placed in the 95 % prediction interval these seeds give for one more run
#: (:func:`prediction_interval`): a rerun on the same machine is bit-identical in accuracy and moves only by timing
#: noise; another CPU rounds differently, which moves the curves like another seed.
REFERENCE: dict | None = {
    "seeds": [0, 1, 2, 3, 4, 5], "speedup_cpu": [4.14, 3.29, 2.77, 1.46, 3.81, 3.06], "mean_cpu": 3.29,
    "speedup_steps": [2.5, 2.14, 2.0, 0.97, 2.46, 2.03],
    "machine": "a 2-core AMD EPYC VM (AVX512), torch 2.15.0, near-idle", "torch": "2.15.0+cu132",
    "cpu_capability": "AVX512"}

#: two-sided 95 % quantiles of Student's t by degrees of freedom (for :func:`prediction_interval`)
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093}


def prediction_interval(values: list[float]) -> tuple[float, float]:
    """The 95 % prediction interval for one more draw of a speed-up, from ``values`` (earlier draws: seeds).

    Speed-ups are ratios of noisy costs, so their noise is multiplicative: the interval is Student's on the logs,
    ``exp(m +- t(0.975, n-1) * s * sqrt(1 + 1/n))`` with ``m``, ``s`` the mean and sample standard deviation of
    ``log(values)``: always positive, and wider above the geometric mean than below it."""
    import math
    import statistics

    n = len(values)
    if not 2 <= n <= 20 or min(values) <= 0:
        raise ValueError(f"prediction_interval: needs 2 to 20 positive values, got {values}.")
    logs = [math.log(v) for v in values]
    half = T_975[n - 1] * statistics.stdev(logs) * (1 + 1 / n) ** 0.5
    return math.exp(statistics.fmean(logs) - half), math.exp(statistics.fmean(logs) + half)


# ---------------------------------------------------------------------------------------------- arguments
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", type=int, default=250, help="training steps of the ReLA run (default 250)")
    parser.add_argument("--plain-multiple", type=float, default=4.0,
                        help="plain BYOL runs this many times the budget, to measure when it catches up (default 4)")
    parser.add_argument("--probes", type=int, default=2,
                        help="linear-probe checkpoints per budget length, for both curves (default 2)")
    parser.add_argument("--prior", default=DEFAULT_PRIOR,
                        help=f"prior spec, as everywhere (`accelerate-ssl priors list`); default {DEFAULT_PRIOR}: a "
                             "shipped BYOL ConvNet trained on other data (scikit-learn digits). Priors trained on "
                             "Fashion-MNIST itself (shipped:fashion-mnist-byol-20k, shipped:fashion-mnist-supervised) "
                             "give upper bounds, not a user's situation")
    parser.add_argument("--weights", default=None,
                        help="local weights file for the --prior (as on every verb; wins over the zoo caches)")
    parser.add_argument("--schedule", default="switch",
                        help="lambda controller: 'decay', 'switch' (default), 'constant:<lambda>' or 'epochs:<fraction>'; "
                             "decay/switch constants are scaled to --budget")
    parser.add_argument("--rela-views", choices=("byol", "weak", "clean"), default="weak",
                        help="images while lambda == 1 (ReLA term only): the BYOL views, ReLA v1's weak views "
                             "(resized crop scale 0.5-1 + flip, no colour jitter), or the clean images the targets "
                             "were computed on")
    parser.add_argument("--rela-step", choices=("one-view", "two-view"), default="one-view",
                        help="a step while lambda == 1: one view, no SSL branch (default), or two views with BYOL's "
                             "EMA update kept (the former recipe, for comparison)")
    parser.add_argument("--components", type=int, default=16,
                        help="PCA components of the targets (ReLA v2 Eq. 41; default 16); 0: the student feature dim")
    parser.add_argument("--head-init", choices=("fit", "random"), default="fit",
                        help="ReLA's transport head: least-squares fit at the first batch (default) or random (the papers)")
    parser.add_argument("--seed", "--seeds", dest="seeds", type=int, nargs="+", default=[0],
                        help="seed(s) (default 0); with several, both runs are repeated per seed and the table, the "
                             "plot and the speed-up use the mean curves (each seed's speed-up is reported too)")
    parser.add_argument("--out", default="demo-output", help="output folder (targets cache, demo.json, demo.png)")
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
                        help="print one JSON object (speed-up, accuracies, seeds, paths) after the table instead of the sentences")


def parse_schedule(spec: str, budget: int):
    """A ``--schedule`` spec (:data:`accelerate_ssl.schedules.SPEC_GRAMMAR`) -> a controller planned for ``budget``.
    The demo measures ReLA's first phase, the pull toward the prior, within its budget: a ``decay`` or ``switch`` here
    keeps the papers' rule alone (``end_fraction=None``: no hand-over planned at half the budget), as its reference
    numbers were measured; the hand-over and the budgets are the budget study's (``benchmarks/budget.py``)."""
    from .schedules import create_schedule

    try:
        if str(spec).lower() in ("decay", "switch"):
            return create_schedule(spec, total_steps=budget, end_fraction=None)
        return create_schedule(spec, total_steps=budget)
    except (ValueError, TypeError) as err:
        raise ValueError(f"--schedule {spec!r}: {err}") from err


def _check_args(args) -> None:
    for name in ("budget", "train_size", "test_size", "batch_size", "probes", "probe_epochs", "threads"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}.")
    if args.components < 0:
        raise ValueError(f"--components must be >= 0 (0: the student feature dim), got {args.components}.")
    if len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds must be distinct (a repeated seed repeats the same run), got {args.seeds}.")
    if args.plain_multiple < 1:
        raise ValueError(f"--plain-multiple must be >= 1 (plain BYOL must run at least the budget), got {args.plain_multiple}.")
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

    Both runs seed the same way, so they share the initial weights and the order of the batches; the
    only difference is ``rela.wrap`` around the BYOL loss. Returns the curve and per-step lambda.
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
        from .rela import Handover, ReLA

        options = {"schedule": parse_schedule(args.schedule, args.budget), "feature_dim": backbone.feature_dim,
                   "n_components": args.components or "auto", "head_init": args.head_init,
                   "handover": Handover(momentum=model.momentum_pairs()), **(rela_options or {})}
        rela = ReLA(store, backbone, dataloader=loader, **options)
        params += list(rela.parameters())  # the transport head trains with the model (same AdamW)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    try:
        log = train_ssl(model, loader_batches(loader, lambda images: images_to_tensor(images.squeeze(1)).to(device)), steps,
                        optimizer=opt, view_generator=torch.Generator().manual_seed(seed + 1), rela=rela,
                        rela_views=args.rela_views, rela_step=getattr(args, "rela_step", "one-view"),
                        checkpoints=checkpoints, probe=probe, progress=desc, per_view=per_view)
    finally:
        if rela is not None:
            rela.close()
    import statistics

    return {"curve": log["curve"], "lambda_per_step": log["lambda_per_step"], "train_seconds": log["train_seconds"],
            "train_cpu_seconds": log["train_cpu_seconds"],
            "median_step_seconds": statistics.median(log["step_seconds"]) if log["step_seconds"] else 0.0,
            "median_step_cpu_seconds": statistics.median(log["step_cpu_seconds"]) if log["step_cpu_seconds"] else 0.0}


def _summarise(seed, plain: dict, rela: dict, budget: int, precompute: dict) -> dict:
    """One seed's (or the mean curves') accuracies at the budget and the speed-ups they give: in wall-clock and
    CPU seconds (ReLA's cost includes the precompute) and in steps, with the step-time ratio."""
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


def _reference_line(args, result: dict) -> str:
    """Where this run's speed-ups fall against :data:`REFERENCE`: inside or outside the 95 % prediction interval its
    seeds give for one more run, and how many of those seeds it beats."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    d = vars(defaults.parse_args([]))
    if REFERENCE is None:
        return "reference: not measured yet for these settings"
    if any(getattr(args, k) != d[k] for k in NUMERIC_SETTINGS):
        return "reference: measured for the default settings only (these differ)"
    if args.device != "cpu":
        return f"reference: measured on the CPU only (this run is on {args.device})"

    def place(name: str, mine: float) -> str:
        seeds = REFERENCE[name]
        lo, hi = prediction_interval(seeds)
        where = "inside" if lo <= mine <= hi else ("below" if mine < lo else "above")
        beaten = sum(round(mine, 2) > v for v in seeds)  # at the precision printed and stored
        return (f"{mine:.2f}x, {where} the 95 % interval {lo:.2f}-{hi:.2f}x (above {beaten} of the {len(seeds)} seeds, "
                f"which gave {min(seeds):.2f}-{max(seeds):.2f}x)")

    text = (f"reference: seeds {', '.join(map(str, REFERENCE['seeds']))} on {REFERENCE['machine']} (mean curves "
            f"{REFERENCE['mean_cpu']:.2f}x in CPU time); this run in CPU time: "
            f"{place('speedup_cpu', result['speedup_cpu']['speedup'])}")
    if "speedup" in result:
        text += f"; in steps: {place('speedup_steps', result['speedup']['speedup'])}"
    # another torch or other CPU kernels round differently, which moves the curves like another seed: say so
    import torch

    here = result.get("machine", {})
    mine = {"torch": here.get("torch", torch.__version__),
            "cpu_capability": here.get("cpu_capability", torch.backends.cpu.get_cpu_capability())}
    differ = [f"{name.replace('_', ' ')} {mine[name]} here, {REFERENCE[name]} there" for name in ("torch", "cpu_capability")
              if name in REFERENCE and mine[name] != REFERENCE[name]]
    if differ:
        text += (f" (measured on another setup: {'; '.join(differ)}; kernels that round differently move the curves "
                 "like another seed, so read the placement as a rough guide)")
    return text


# ---------------------------------------------------------------------------------------------- outputs
def format_table(result: dict) -> str:
    plain = {c["step"]: c for c in result["plain"]["curve"]}
    rela = {c["step"]: c for c in result["rela"]["curve"]}
    lines = ["| steps | plain BYOL top-1 % | ReLA top-1 % | lambda | plain time s | ReLA time s |",
             "|---:|---:|---:|---:|---:|---:|"]
    def acc(c):
        return "" if c is None else f"{c['top1']:.2f}" + (f" ± {c['top1_std']:.2f}" if "top1_std" in c else "")

    for s in sorted(set(plain) | set(rela)):
        p, r = plain.get(s), rela.get(s)
        lines.append("| {} | {} | {} | {} | {} | {} |".format(
            s, acc(p), acc(r),
            f"{r['lambda']:.2f}" if r else "", f"{p['train_seconds']:.0f}" if p else "",
            f"{r['train_seconds']:.0f}" if r else ""))
    return "\n".join(lines)


def demo_figure(result: dict):
    """The demo's figure: both accuracy curves (mean +- std over the seeds), where ReLA's accuracy is reached, and
    lambda per step; its title wrapped to the figure's width."""
    from .optional import require

    require("matplotlib", "the demo's plot")
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget = result["settings"]["budget"]
    fig, (ax, axl) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for key, label, style in (("plain", "plain BYOL", "o-"), ("rela", "BYOL + ReLA", "s-")):
        c = result[key]["curve"]
        ax.errorbar([p["step"] for p in c], [p["top1"] for p in c], yerr=[p.get("top1_std", 0.0) for p in c],
                    fmt=style, capsize=3, label=label)
    seeds = result["settings"]["seeds"]
    sp = result["speedup"]
    ax.axhline(result["rela_top1"], color="gray", ls=":", lw=1)
    if sp["steps_plain"] is not None:
        ax.axvline(sp["steps_plain"], color="gray", ls=":", lw=1)
    ax.axvline(budget, color="k", ls="--", lw=0.8)
    ax.set_ylabel("linear probe top-1 (%)")
    over = f" (mean ± std of {len(seeds)} seeds)" if len(seeds) > 1 else ""
    title = (f"Fashion-MNIST, BYOL vs BYOL + ReLA ({result['settings']['prior_spec']}): speed-up "
             f"{result['speedup_wall']['text'].split(' (')[0]} wall-clock, {sp['text'].split(' (')[0]} in steps{over}")
    ax.legend(loc="lower right")
    lam = result["rela"]["lambda_per_step"]
    axl.plot(range(1, len(lam) + 1), lam, color="C1")
    axl.set_ylabel("lambda")
    axl.set_xlabel("training steps")
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




# ---------------------------------------------------------------------------------------------- main
def run(args) -> int:
    t_start, cpu_start, load_start = time.perf_counter(), time.process_time(), os.getloadavg()
    _check_args(args)
    torch.set_num_threads(args.threads)
    from .data import FashionMNIST
    from .recipes import Probe, images_to_tensor, mean_run
    from .targets.precompute import precompute_targets
    from .priors import create_prior
    from .targets.store import TargetStore

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seeds[0])

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
              f"{precompute['seconds']:.1f} s, counted in ReLA's cost)")
    else:
        t, c = time.perf_counter() - load_t, time.process_time() - load_c  # loading the prior + the precompute
        store = precompute_targets(prior, train, store_dir, progress=True,
                                   command=" ".join(shlex.quote(a) for a in ["accelerate-ssl", *sys.argv[1:]]))
        precompute = {"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c,
                      "threads": torch.get_num_threads(), "load_average": os.getloadavg()}
        atomic_write_json(memo, precompute, indent=1)
    targets_seconds = precompute["seconds"]

    # 2-3. the two runs per seed, probed on the same train subset / test set
    train.transform = _uint8_tensor  # training batches: uint8 [1, 28, 28] tensors; views are made per batch
    train_x, test_x = images_to_tensor(train.data), images_to_tensor(test.data)
    plain_steps = int(round(args.plain_multiple * args.budget))
    plain_ckpts = probe_steps(args.budget, plain_steps, args.probes)
    rela_ckpts = probe_steps(args.budget, args.budget, args.probes)
    per_seed = []
    for seed in args.seeds:
        probe = Probe(train_x, train.targets, test_x, test.targets, epochs=args.probe_epochs, seed=seed)
        tag = f" (seed {seed})" if len(args.seeds) > 1 else ""
        rela = train_byol(args, train, probe, args.budget, [s for s in rela_ckpts if s > 0], store=store,
                          desc="BYOL + ReLA" + tag, seed=seed)
        plain = train_byol(args, train, probe, plain_steps, plain_ckpts, desc="plain BYOL" + tag, seed=seed)
        # step 0 is the same network for both runs (same seed, same initialisation): probed once
        step0 = next(c for c in plain["curve"] if c["step"] == 0)
        rela["curve"].insert(0, {**step0, "lambda": rela["lambda_per_step"][0] if rela["lambda_per_step"] else 0.0})
        per_seed.append(_summarise(seed, plain, rela, args.budget, precompute))

    plain, rela = (mean_run([r[key] for r in per_seed]) for key in ("plain", "rela"))
    summary = _summarise(None, plain, rela, args.budget, precompute)
    result = {
        "command": " ".join(shlex.quote(a) for a in ["accelerate-ssl", *sys.argv[1:]]),
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(), "processor": cpu_model() or "unknown",
                    "platform": platform.platform(), "python": platform.python_version(), "device": args.device,
                    "gpu": torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else None,
                    "cuda": torch.version.cuda if args.device.startswith("cuda") else None,
                    "load_average_start": load_start},
        "settings": {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"},
        "prior": prior.describe(),
        "targets": {"path": str(store_dir), "rows": len(store), "dim": store.dim, "seconds": targets_seconds,
                    "precompute": precompute},
        "prior_training": PRIOR_TRAINING.get(spec) if args.weights is None else None,
        **summary,
        "per_seed": per_seed if len(per_seed) > 1 else [],
    }
    result["settings"]["prior_spec"] = spec
    result["wall_seconds"] = time.perf_counter() - t_start
    result["cpu_seconds"] = time.process_time() - cpu_start  # all threads of this process
    result["machine"]["load_average_end"] = os.getloadavg()
    result["reference"] = _reference_line(args, result)
    table = format_table(result)
    result["table"] = table
    png = out / "demo.png"
    write_png(result, png)
    write_results(out / "demo.json", result, device=args.device)

    if args.json:
        print(json.dumps({"speedup": result["speedup"], "speedup_wall": result["speedup_wall"],
                          "speedup_cpu": result["speedup_cpu"], "step_time_ratio": result["step_time_ratio"], "rela_top1": result["rela_top1"],
                          "plain_top1_at_budget": result["plain_top1_at_budget"], "budget": args.budget,
                          "per_seed": [{"seed": r["seed"], "speedup": r["speedup"], "speedup_wall": r["speedup_wall"],
                                        "speedup_cpu": r["speedup_cpu"]} for r in result["per_seed"]],
                          "reference": result["reference"],
                          "prior": spec, "seeds": args.seeds, "torch": torch.__version__,
                          "json": str(out / "demo.json"), "png": str(png)}))
        return 0
    print()
    print(table)
    print()
    means = f" (mean of {len(args.seeds)} seeds)" if len(args.seeds) > 1 else ""
    print(f"ReLA at {args.budget} steps: {result['rela_top1']:.2f} %   plain BYOL at {args.budget} steps: "
          f"{result['plain_top1_at_budget']:.2f} %{means}")
    print(f"speed-up in wall-clock: {result['speedup_wall']['text']}{means}")
    print(f"  in CPU time: {result['speedup_cpu']['text']}")
    print(f"  in steps: {result['speedup']['text']}; a ReLA step costs {result['step_time_ratio']:.2f}x a plain "
          f"step (wall, medians; CPU {result['step_cpu_ratio']:.2f}x)")
    for r in result["per_seed"]:
        print(f"  seed {r['seed']}: wall-clock {r['speedup_wall']['text']}; steps {r['speedup']['text']}")
    print(result["reference"])
    if result["prior_training"]:
        print(f"the prior's own training (once, by this project; not in the speed-up): {result['prior_training']}")
    n = len(args.seeds)
    print(f"wall time: {result['wall_seconds']:.0f} s, CPU time {result['cpu_seconds']:.0f} s (targets {targets_seconds:.0f} s, "
          f"plain {plain['train_seconds'] * n:.0f} s + ReLA {rela['train_seconds'] * n:.0f} s of training, the rest probes)")
    print(f"prior {spec}, seeds {' '.join(map(str, args.seeds))}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} CPU threads ({result['machine']['cpu_capability']}), load average "
          f"{load_start[0]:.1f} at start, {result['machine']['load_average_end'][0]:.1f} at end")
    print(f"wrote {png} and {out / 'demo.json'}")
    return 0


def _safe_name(spec: str) -> str:
    name = Path(spec.split(":", 1)[-1]).stem if ":" in spec else spec
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or "prior"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="accelerate-ssl demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
