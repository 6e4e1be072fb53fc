"""Several priors at once vs each alone, on the demo's recipe: accuracy at the budget and the speed-up over plain BYOL
(wall-clock and CPU time, every prior's precompute counted), with and without the standardisation, and the balancing
methods of multi-teacher students.

The recipe is the demo's (``accelerate_ssl/demo.py``: 20k Fashion-MNIST images, ConvNet 16/32/64, BYOL, batch 128,
AdamW 1e-3, ``switch`` planned for the budget, weak one-view steps while lambda = 1, 16 target components,
least-squares heads; linear probe on the 10k test images). A cell is ``PRIORS|STANDARDISATION|BALANCE``:

* priors: ``digits`` (``shipped:digits-byol``, BYOL on other data, the demo's), ``fmnist``
  (``shipped:fashion-mnist-byol``, BYOL 1000 steps on these images), ``random`` (``random:convnet``); ``a+b`` both;
* standardisation of each prior's rows: ``zscore`` (ReLA v2 Eq. 41, each store's own: the library's default), ``raw``
  (the rows as the prior wrote them, ``n_components=None``), ``phis`` (PHI-S, Ranzinger et al. 2024: centred, rotated
  onto the top principal axes and by a Hadamard matrix, one scale for every dimension);
* balance: ``equal`` (the priors' mean loss) or ``drop`` (UNIC's teacher dropping, Sariyildiz et al. ECCV 2024).

Units, each cached as one JSON under ``--cache`` when it ends (rerun the same command to resume): ``plain-<seed>``
(plain BYOL, ``--full-steps``), ``rela-<cell>-<seed>`` (``--budget`` steps), ``precompute-<mode>-<repeat>-<data>-<priors>``
(the priors of a cell precomputed from fresh folders, loading the priors included: ``separate``, one pass per prior,
or ``one-pass``, ``precompute_targets({...})``; the repeats alternate which mode runs first; a prior that is in no
multi-prior cell is timed alone). The precompute is timed on the training images (``fmnist``: an in-memory array,
nothing to decode) and, for the first multi-prior cell's priors, on ``jpeg``: ``--jpeg-images`` of them upscaled to
224 px and stored as JPEG files in an image folder (the priors resize them back to 28 px), where reading and decoding
an image costs what a photo's does. ``complementarity-<priors>`` measures, for each multi-prior cell's priors, what
each prior's own rows know of the labels (linear probe) alone and side by side, and how much of one prior's rows the
other's predict linearly.

    nice -n 5 python benchmarks/several_priors.py                  # the study (resumable)
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from accelerate_ssl.atomic import atomic_path, atomic_write_json, atomic_write_text  # noqa: E402
from accelerate_ssl.data import FashionMNIST  # noqa: E402
from accelerate_ssl.priors import create_prior  # noqa: E402
from accelerate_ssl.recipes import cost_speedup, mean_run, speedup  # noqa: E402
from accelerate_ssl.results import save_figure, write_results  # noqa: E402
from accelerate_ssl.targets.precompute import precompute_targets  # noqa: E402

PRIORS = {"digits": "shipped:digits-byol", "fmnist": "shipped:fashion-mnist-byol", "random": "random:convnet"}
CELLS = ["digits|zscore|equal", "fmnist|zscore|equal", "digits+fmnist|zscore|equal",
         "digits|raw|equal", "fmnist|raw|equal", "digits+fmnist|raw|equal",
         "digits+fmnist|zscore|drop", "digits+fmnist|phis|equal"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", nargs="+", default=CELLS, metavar="PRIORS|STD|BALANCE")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--budget", type=int, default=250)
    p.add_argument("--full-steps", type=int, default=1000)
    p.add_argument("--plain-probes", type=int, nargs="+", default=[0, 125, 250, 375, 500, 625, 750, 875, 1000])
    p.add_argument("--precompute-repeats", type=int, default=3)
    p.add_argument("--jpeg-images", type=int, default=4000, help="images of the JPEG folder the precompute is timed on")
    p.add_argument("--train-size", type=int, default=20000)
    p.add_argument("--test-size", type=int, default=10000)
    p.add_argument("--probe-epochs", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/several_priors"), help="stores and finished units")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/several_priors.json"))
    args = p.parse_args(argv)
    for cell in args.cells:
        priors, std, balance = (cell.split("|") + ["", ""])[:3]
        if not priors or any(x not in PRIORS for x in priors.split("+")) or std not in ("zscore", "raw", "phis") \
                or balance not in ("equal", "drop"):
            p.error(f"cell {cell!r}: PRIORS|STD|BALANCE with PRIORS from {list(PRIORS)} joined by '+', STD zscore / raw "
                    "/ phis, BALANCE equal / drop")
    return args


def settings(args) -> dict:
    """What changes a unit's numbers (a cached unit is re-used only when these match)."""
    return {k: getattr(args, k) for k in ("budget", "full_steps", "train_size", "test_size", "probe_epochs", "threads",
                                          "jpeg_images")}


# ---------------------------------------------------------------------------------------------- the recipe
def recipe(args) -> argparse.Namespace:
    from accelerate_ssl.demo import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    r = parser.parse_args([])
    r.budget, r.threads, r.train_size, r.test_size, r.probe_epochs = (args.budget, args.threads, args.train_size,
                                                                     args.test_size, args.probe_epochs)
    return r


def data(args):
    from accelerate_ssl.demo import _uint8_tensor
    from accelerate_ssl.recipes import images_to_tensor

    train, test = FashionMNIST("train", limit=args.train_size), FashionMNIST("test", limit=args.test_size)
    tensors = (images_to_tensor(train.data), train.targets, images_to_tensor(test.data), test.targets)
    train.transform = _uint8_tensor
    return train, tensors


def stores(args, names) -> dict:
    """The training stores of ``names``, computed once in one pass (not timed: the precompute units time it)."""
    train = FashionMNIST("train", limit=args.train_size)
    folders = {n: Path(args.cache) / f"store-{n}-{args.train_size}" for n in names}
    return precompute_targets({n: create_prior(PRIORS[n]) for n in names}, train, folders, progress=True)


def jpeg_folder(args) -> Path:
    """``--jpeg-images`` training images upscaled to 224 px, RGB JPEG files (quality 90) in one folder per class."""
    from PIL import Image


    root = Path(args.cache) / f"jpeg224-{args.jpeg_images}"
    if not (root / "done").is_file():
        train = FashionMNIST("train", limit=args.jpeg_images)
        for i, (image, label) in enumerate(zip(train.data.numpy(), train.targets.tolist())):
            file = root / f"class{label}" / f"{i:05d}.jpg"
            file.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(file, suffix=".jpg") as tmp:
                Image.fromarray(image).resize((224, 224), Image.BILINEAR).convert("RGB").save(tmp, "JPEG", quality=90)
        atomic_write_text(root / "done", "")
    return root


def hadamard(n: int) -> torch.Tensor:
    """The normalised ``n x n`` Hadamard matrix (Sylvester's construction; ``n`` a power of 2): orthogonal, every
    entry ``+-1 / sqrt(n)``."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"PHI-S needs a power-of-2 dimension (Sylvester's Hadamard matrix), got {n}.")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


def phi_s(store, n: int) -> torch.Tensor:
    """PHI-S (Ranzinger et al., *PHI-S: Distribution Balancing for Label-Free Multi-Teacher Distillation*, 2024,
    Sec. 2.4), on the top ``n`` principal axes as ReLA keeps them: ``y' = H U_n^T (y - mu) / phi``, ``U`` the centred
    PCA's eigenvectors (no per-column z-score), ``H`` a normalised Hadamard matrix and ``phi`` the root of the mean of
    the kept eigenvalues: every dimension the same variance, 1."""
    pca = store.pca(n, standardize=False)
    rows = pca.transform_blocks(store.decoded()).double()
    return (rows @ hadamard(n).T / math.sqrt(float(pca.eigenvalues.mean()))).float()


def cell_targets(args, cell: str, opened: dict):
    """The targets and extra ReLA arguments of a cell."""
    names, std, balance = cell.split("|")
    names = names.split("+")
    options = {"balance": balance}
    if std == "raw":
        options["n_components"] = None
    if std == "phis":  # rows reduced here: ReLA takes them as they are (the witness cannot re-embed into them)
        targets = {n: phi_s(opened[n], recipe(args).components) for n in names}
        options.update(n_components=None, witness=False)
    else:
        targets = {n: opened[n] for n in names}
    return (targets[names[0]] if len(names) == 1 else targets), options


# ---------------------------------------------------------------------------------------------- units
def run_unit(args, unit: tuple) -> dict:
    """``("plain", seed)``, ``("rela", cell, seed)``, ``("precompute", mode, repeat, data, priors)`` or
    ``("complementarity", priors)``."""
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    if unit[0] == "precompute":
        out = time_precompute(args, *unit[1:])
    elif unit[0] == "complementarity":
        out = complementarity(args, unit[1])
    else:
        from accelerate_ssl.demo import train_byol
        from accelerate_ssl.recipes import Probe

        train, tensors = data(args)
        probe = Probe(*tensors, epochs=args.probe_epochs, seed=unit[-1])
        if unit[0] == "plain":
            out = train_byol(recipe(args), train, probe, args.full_steps, args.plain_probes, desc=f"plain {unit[1]}",
                             seed=unit[1])
        else:
            _, cell, seed = unit
            targets, options = cell_targets(args, cell, stores(args, cell.split("|")[0].split("+")))
            out = train_byol(recipe(args), train, probe, args.budget, [args.budget], store=targets, seed=seed,
                             desc=f"{cell} {seed}", rela_options=options)
            lam = out.pop("lambda_per_step")
            out["switch_step"] = next((i for i, v in enumerate(lam) if v < 1.0), None)
    return {"unit": list(unit), "settings": settings(args), **out, "load_average_start": load,
            "load_average_end": os.getloadavg()}


def time_precompute(args, mode: str, repeat: int, kind: str, priors: str) -> dict:
    """Every prior of ``priors`` (``a+b``) precomputed over ``kind``'s images into fresh folders (loading each prior
    counted, opening the data set not: both ways open it), one pass per prior or one pass for all."""
    import warnings

    from accelerate_ssl.data.spec import open_data

    images = FashionMNIST("train", limit=args.train_size) if kind == "fmnist" else open_data(f"folder:{jpeg_folder(args)}")
    size = {} if kind == "fmnist" else {"size": 28}  # the JPEGs resized back to the priors' input
    folder = Path(args.cache) / "timing" / f"{mode}-{repeat}-{kind}"
    shutil.rmtree(folder, ignore_errors=True)
    order = priors.split("+") if repeat % 2 == 0 else priors.split("+")[::-1]
    warnings.filterwarnings("ignore", message=".*luminance.*")  # RGB JPEGs into the grayscale priors, said once each
    t, c, per = time.perf_counter(), time.process_time(), {}
    if mode == "one-pass":
        precompute_targets({n: create_prior(PRIORS[n], **size) for n in order}, images, {n: folder / n for n in order},
                           progress=False)
    else:
        for n in order:
            t1, c1 = time.perf_counter(), time.process_time()
            precompute_targets(create_prior(PRIORS[n], **size), images, folder / n, progress=False)
            per[n] = {"seconds": time.perf_counter() - t1, "cpu_seconds": time.process_time() - c1}
    out = {"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c, "order": order, "per_prior": per}
    shutil.rmtree(folder, ignore_errors=True)
    return out


def complementarity(args, priors: str) -> dict:
    """What each prior of ``priors`` knows of the labels and what the other adds: the linear probe (the benchmarks'
    protocol) on each prior's own rows and on the rows of all of them side by side (train rows from the training
    stores, test rows embedded once into ``--cache``), how much of each prior's rows the other's predict linearly
    (ridge, R^2 on the test rows, each side z-scored), and the spread of each store's raw rows (what the
    standardisation equalises)."""
    from accelerate_ssl.evaluate import linear_probe

    names = priors.split("+")
    train_rows = {n: torch.tensor(s.decoded()[:], dtype=torch.float32) for n, s in stores(args, names).items()}
    test = FashionMNIST("test", limit=args.test_size)
    test_stores = precompute_targets({n: create_prior(PRIORS[n]) for n in names}, test,
                                     {n: Path(args.cache) / f"store-{n}-test-{args.test_size}" for n in names},
                                     progress=False)
    test_rows = {n: torch.tensor(s.decoded()[:], dtype=torch.float32) for n, s in test_stores.items()}
    ytr, yte = FashionMNIST("train", limit=args.train_size).targets, test.targets
    probe = lambda a, b: linear_probe(a, ytr, b, yte, epochs=args.probe_epochs, seed=0)["top1"]  # noqa: E731
    out = {"probe_top1": {n: probe(train_rows[n], test_rows[n]) for n in names}}
    out["probe_top1"][priors] = probe(torch.cat([train_rows[n] for n in names], 1),
                                      torch.cat([test_rows[n] for n in names], 1))

    def z(a, ref):
        return (a - ref.mean(0)) / ref.std(0).clamp_min(1e-6)

    r2 = {}
    for a in names:
        for b in names:
            if a != b:
                xa, xb = z(train_rows[a], train_rows[a]), z(train_rows[b], train_rows[b])
                w = torch.linalg.solve(xa.T @ xa + 1e-3 * len(xa) * torch.eye(xa.shape[1]), xa.T @ xb)
                ta, tb = z(test_rows[a], train_rows[a]), z(test_rows[b], train_rows[b])
                r2[f"{b} from {a}"] = float(1 - ((ta @ w - tb) ** 2).sum() / ((tb - tb.mean(0)) ** 2).sum())
    out["r2"] = r2
    out["raw_spread"] = {n: {"total_variance": float(r.var(0).sum()), "mean_row_norm": float(r.norm(dim=1).mean()),
                             "dim": r.shape[1]} for n, r in train_rows.items()}
    return out


def timed_sets(args) -> list[str]:
    """The prior sets whose precompute is timed: each multi-prior cell's, then each prior in none of them, alone."""
    multi = list(dict.fromkeys(c.split("|")[0] for c in args.cells if "+" in c.split("|")[0]))
    covered = {n for m in multi for n in m.split("+")}
    return multi + list(dict.fromkeys(c.split("|")[0] for c in args.cells if c.split("|")[0] not in covered and
                                      "+" not in c.split("|")[0]))


def units_of(args) -> list[tuple]:
    out = []
    for i, priors in enumerate(timed_sets(args)):
        for kind in ("fmnist", "jpeg") if i == 0 and "+" in priors else ("fmnist",):
            for r in range(args.precompute_repeats):  # alternate which mode runs first
                modes = ("separate", "one-pass") if r % 2 == 0 else ("one-pass", "separate")
                out += [("precompute", m, r, kind, priors) for m in modes if "+" in priors or m == "separate"]
    out += [("complementarity", priors) for priors in timed_sets(args) if "+" in priors]
    out += [("plain", s) for s in args.seeds]
    out += [("rela", cell, s) for s in args.seeds for cell in args.cells]
    return out


# ---------------------------------------------------------------------------------------------- analysis
def precompute_costs(done: dict, priors: str, kind: str = "fmnist") -> dict:
    """Median seconds (wall, CPU) of each prior alone, of them one after another, and in one pass (several)."""
    runs = {m: [done[u] for u in done if u[0] == "precompute" and u[1] == m and u[3:] == (kind, priors)]
            for m in ("separate", "one-pass")}
    med = lambda rs, key: statistics.median(r[key] for r in rs)  # noqa: E731
    out = {"separate": {k: med(runs["separate"], k) for k in ("seconds", "cpu_seconds")}, "repeats": len(runs["separate"])}
    for n in priors.split("+"):
        out[n] = {k: statistics.median(r["per_prior"][n][k] for r in runs["separate"]) for k in ("seconds", "cpu_seconds")}
    if runs["one-pass"]:
        out["one-pass"] = {k: med(runs["one-pass"], k) for k in ("seconds", "cpu_seconds")}
        out["one_pass_saving"] = {k: 1 - out["one-pass"][k] / out["separate"][k] for k in ("seconds", "cpu_seconds")}
    return out


def cell_cost(cell: str, costs: dict) -> dict:
    """The precompute a cell pays: its prior alone (timed alone or in the first set holding it), or its priors in one
    pass."""
    priors = cell.split("|")[0]
    if "+" in priors:
        return costs[priors]["one-pass"]
    return next(c[priors] for c in costs.values() if priors in c)


def analyse(args, done: dict) -> dict:
    sets = timed_sets(args)
    costs = {priors: precompute_costs(done, priors) for priors in sets}
    plain = {s: done[("plain", s)] for s in args.seeds}
    mean_plain = mean_run(list(plain.values()))["curve"]
    curve = lambda run: [(c["step"], c["top1"]) for c in run]  # noqa: E731
    cells = {}
    for cell in args.cells:
        runs = {s: done[("rela", cell, s)] for s in args.seeds}
        cost = cell_cost(cell, costs)
        per_seed = []
        for s, r in runs.items():
            end = r["curve"][-1]
            per_seed.append({"seed": s, "top1": end["top1"], "switch_step": r["switch_step"],
                             "steps": speedup(curve(plain[s]["curve"]), end["top1"], args.budget),
                             "wall": cost_speedup(plain[s]["curve"], end["top1"], end["train_seconds"] + cost["seconds"]),
                             "cpu": cost_speedup(plain[s]["curve"], end["top1"],
                                                 end["train_cpu_seconds"] + cost["cpu_seconds"], "train_cpu_seconds")})
        acc = [p["top1"] for p in per_seed]
        m = statistics.fmean(acc)
        wall = statistics.fmean(r["curve"][-1]["train_seconds"] for r in runs.values()) + cost["seconds"]
        cpu = statistics.fmean(r["curve"][-1]["train_cpu_seconds"] for r in runs.values()) + cost["cpu_seconds"]
        cells[cell] = {"top1": m, "top1_std": statistics.pstdev(acc), "per_seed": per_seed, "precompute": cost,
                       "steps": speedup(curve(mean_plain), m, args.budget), "wall": cost_speedup(mean_plain, m, wall),
                       "cpu": cost_speedup(mean_plain, m, cpu, "train_cpu_seconds"),
                       "rela_train_seconds": wall - cost["seconds"], "rela_train_cpu_seconds": cpu - cost["cpu_seconds"]}
    jpeg = {sets[0]: precompute_costs(done, sets[0], "jpeg")} if "+" in sets[0] else {}
    comp = {u[1]: {k: v for k, v in done[u].items() if k in ("probe_top1", "r2", "raw_spread")}
            for u in done if u[0] == "complementarity"}
    return {"precompute": costs, "precompute_jpeg": jpeg, "complementarity": comp,
            "plain": {"mean_curve": mean_plain, "per_seed": {str(s): plain[s]["curve"] for s in plain}}, "cells": cells}


def _x(e: dict) -> str:
    return ("> " if e["lower_bound"] else "") + f"{e['speedup']:.2f}x"


def table(result: dict) -> str:
    plain = {c["step"]: c["top1"] for c in result["plain"]["mean_curve"]}
    budget, full = result["settings"]["budget"], result["settings"]["full_steps"]
    lines = [f"| priors | standardisation | balance | top-1 % at {budget} steps (seeds) | wall-clock speed-up, precompute "
             "incl. (seeds) | CPU-time speed-up | steps speed-up | switch step (seeds) |", "|" + "---|" * 8]
    for cell, c in result["cells"].items():
        priors, std, balance = cell.split("|")
        seeds = lambda f: ", ".join(f(p) for p in c["per_seed"])  # noqa: E731
        lines.append(f"| {priors.replace('+', ' + ')} | {std} | {balance} | **{c['top1']:.2f}** ± {c['top1_std']:.2f} "
                     f"({seeds(lambda p: format(p['top1'], '.2f'))}) | **{_x(c['wall'])}** ({seeds(lambda p: _x(p['wall']))}) "
                     f"| {_x(c['cpu'])} | {_x(c['steps'])} | {seeds(lambda p: str(p['switch_step']))} |")
    lines.append(f"\nPlain BYOL (mean of seeds {result['settings']['seeds']}): {plain.get(budget, float('nan')):.2f} % at "
                 f"{budget} steps, {plain[full]:.2f} % at {full}.")
    for key, what in (("precompute", f"the {result['settings']['train_size']} training images (in memory)"),
                      ("precompute_jpeg", f"{result['settings']['jpeg_images']} 224-px JPEG files")):
        for priors, pre in result[key].items():
            if "one-pass" in pre:
                lines.append(
                    f"Precompute of {priors.replace('+', ' and ')} over {what} ({pre['repeats']} repeats, medians): "
                    f"one prior after another {pre['separate']['seconds']:.1f} s wall / {pre['separate']['cpu_seconds']:.1f} "
                    f"s CPU, in one pass {pre['one-pass']['seconds']:.1f} s / {pre['one-pass']['cpu_seconds']:.1f} s: "
                    f"{100 * pre['one_pass_saving']['seconds']:.0f} % saved in wall-clock, "
                    f"{100 * pre['one_pass_saving']['cpu_seconds']:.0f} % in CPU time.")
    for priors, c in result.get("complementarity", {}).items():
        probes = ", ".join(f"{n.replace('+', ' + ')} {v:.2f} %" for n, v in c["probe_top1"].items())
        r2 = ", ".join(f"{k} {v:.2f}" for k, v in c["r2"].items())
        spread = ", ".join(f"{n} {v['total_variance']:.3g}" for n, v in c["raw_spread"].items())
        lines.append(f"The priors' own rows ({priors.replace('+', ' and ')}): linear probe {probes}; R^2 of one "
                     f"prior's rows predicted linearly from the other's: {r2}; total variance of the raw rows: "
                     f"{spread}.")
    return "\n".join(lines)


def figure(result: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    cells = list(result["cells"].items())
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, (cell, c) in enumerate(cells):
        for a, value in ((ax, lambda e: e["top1"]), (bx, lambda e: e["wall"]["speedup"])):
            a.bar(i, value(c), color="tab:orange" if "+" in cell else "tab:blue", alpha=0.7)
            a.plot([i] * len(c["per_seed"]), [value(p) for p in c["per_seed"]], "k.", ms=5)
    plain = {p["step"]: p["top1"] for p in result["plain"]["mean_curve"]}
    budget, full = result["settings"]["budget"], result["settings"]["full_steps"]
    ax.axhline(plain[budget], color="gray", ls="--", lw=1, label=f"plain BYOL, {budget} steps")
    ax.axhline(plain[full], color="gray", ls=":", lw=1, label=f"plain BYOL, {full} steps")
    low = min(min(p["top1"] for p in c["per_seed"]) for _, c in cells)
    ax.set_ylim(low - 1, max(plain[full], max(c["top1"] for _, c in cells)) + 1)
    bx.axhline(1.0, color="gray", ls="--", lw=1)
    for a, title in ((ax, f"linear-probe top-1 % at {budget} steps"),
                     (bx, "wall-clock speed-up over plain BYOL, precompute included")):
        a.set_xticks(range(len(cells)))
        a.set_xticklabels([c.replace("|", "\n") for c, _ in cells], fontsize=7)
        a.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------- main
def _unit_file(args, unit) -> Path:
    return Path(args.cache) / "runs" / ("-".join(str(x).replace("|", "_").replace("+", "-") for x in unit) + ".json")


def main(argv=None) -> int:
    import json

    args = parse_args(argv)
    t_start, load = time.perf_counter(), os.getloadavg()
    (Path(args.cache) / "runs").mkdir(parents=True, exist_ok=True)
    stores(args, list(dict.fromkeys(n for c in args.cells for n in c.split("|")[0].split("+"))))
    done, todo = {}, []
    for u in units_of(args):
        f = _unit_file(args, u)
        if f.is_file() and json.loads(f.read_text())["settings"] == settings(args):
            done[u] = json.loads(f.read_text())
        else:
            todo.append(u)
    print(f"{len(done)} of {len(done) + len(todo)} units done; {len(todo)} to run")
    for u in todo:
        torch.manual_seed(0)
        done[u] = run_unit(args, u)
        atomic_write_json(_unit_file(args, u), done[u], indent=1)
    result = {"command": " ".join(["python", "benchmarks/several_priors.py", *sys.argv[1:]]),
              "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform(),
                          "cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_average_start": load,
                          "load_average_end": os.getloadavg()},
              "settings": {**settings(args), "seeds": args.seeds, "cells": args.cells,
                           "priors": {n: PRIORS[n] for n in PRIORS}},
              **analyse(args, done),
              "units": {"-".join(map(str, u)): {k: r.get(k) for k in ("load_average_start", "load_average_end",
                                                                        "train_seconds", "train_cpu_seconds", "seconds")}
                        for u, r in done.items()},
              "study_wall_seconds_this_invocation": time.perf_counter() - t_start}
    result["table"] = table(result)
    write_results(Path(args.out), result, root=ROOT)
    figure(result, Path(args.out).with_suffix(".png"))
    print(result["table"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
