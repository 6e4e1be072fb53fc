"""Head to head: ReLA's cached prior against online distillation with the same teacher, at equal wall-clock.

The benchmark (``--canvas``): Fashion-MNIST items at random position and scale on cluttered canvases
(:class:`accelerate_ssl.data.Canvas`; 10k training scenes, 5k test items on their own canvases), where the
untrained student probes at 40 %, so a prior has room to show what it adds. Same student (ConvNet 16/32/64, same initialisation per seed),
same teacher (``--prior``), same data, same batches; the methods, one unit per method and seed:

* ``plain``: the SSL method alone (``--ssl``), ``--steps`` steps;
* ``cached``: ``rela.wrap(ssl_loss)`` with the prior's targets precomputed once (a TargetStore over the clean training
  scenes; its precompute counted in the method's cost);
* ``online``: the same loss, head, schedule and PCA with the prior run on every view the student sees, every step
  (``train_ssl(..., teacher=)``: the one switch), its forward counted in the step;
* ``lightly-train``: lightly-train's own ``distillation`` with the prior as its custom teacher
  (``head_to_head_lightly_train.py``, run in a separate virtual environment given by ``--lightly-train-python``).

Every run is probed at ``--probes`` (linear probe, all training labels; kNN and a 100-labels-per-class probe besides).
Wall-clock: the three methods of the recipe are timed side by side in one process (``timing`` unit: their steps
interleaved one by one, the precompute interleaved in chunks of 1024 images), and each run's clock is the sum of the
median times of the steps it took (lambda = 1: a ReLA step of its kind; afterwards: a plain step), plus the precompute
for ``cached``. Each run's own measured seconds are kept too; lightly-train's clock is its own, measured.
Every unit is cached as one JSON in ``--runs`` when it ends (rerun the same command to resume).
``--device cuda`` runs the students, the teacher and the precompute on a GPU (the probes' linear fits stay on the
CPU). Several ``--prior``: plain against ReLA over every prior's store at once (``--methods plain cached``; one teacher
per online run, so no online or lightly-train unit), ``--raw`` without the standardisation of the rows.

    python benchmarks/head_to_head.py                          # plain, cached, online: 5 seeds (~1 h, one busy core)
    python benchmarks/head_to_head.py --methods lightly-train --lightly-train-python /path/to/venv/bin/python \
        --lightly-train-seeds 0 1 --out /tmp/lt.json              # lightly-train, seeds 0 and 1 (its units only)
    python benchmarks/head_to_head.py --methods plain cached online lightly-train --lightly-train-seeds 0 1 \
        --lightly-train-python /path/to/venv/bin/python           # every finished unit: the JSON and the PNG
    python benchmarks/head_to_head.py --tables benchmarks/results/head_to_head.json     # the README tables
    python benchmarks/head_to_head.py --student vit --canvas 0 --steps 400 --probes 0 100 200 400 \
        --cache benchmarks/cache/h2h_vit --out benchmarks/results/head_to_head_vit.json  # the ViT student (README)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import harness  # noqa: E402  (benchmarks/: the studies' one student and probe, shared with budget.py)
from accelerate_ssl.atomic import atomic_write_json  # noqa: E402
from accelerate_ssl.demo import prediction_interval  # noqa: E402
from accelerate_ssl.recipes import steps_to_reach  # noqa: E402
from accelerate_ssl.results import save_figure, write_results  # noqa: E402

METHODS = ("plain", "cached", "online", "lightly-train")
LABEL = {"plain": "plain SSL", "cached": "ReLA, cached targets", "online": "online teacher, same loss (our loop)",
         "lightly-train": "lightly-train distillation"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--prior", nargs="+", default=["shipped:fashion-mnist-byol-20k"],
                   help="the teacher; several: ReLA over each prior's store at once (plain and cached only)")
    p.add_argument("--raw", action="store_true", help="ReLA on the rows as the priors wrote them (no standardisation)")
    p.add_argument("--ssl", default="vicreg", help="the SSL objective (recipes.create_method)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=200, help="optimiser steps of every run")
    p.add_argument("--probes", type=int, nargs="+", default=[0, 50, 100, 200])
    p.add_argument("--canvas", type=int, default=48, help="canvas side in pixels (0: the plain 28 px images)")
    p.add_argument("--train-size", type=int, default=10000)
    p.add_argument("--test-size", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64], help="the ConvNet student's block widths")
    p.add_argument("--student", choices=("convnet", "vit"), default="convnet",
                   help="convnet: ConvNet --widths; vit: a 4-block ViT (timm; 4 px patches, width 64, 4 heads, mean pool)")
    p.add_argument("--components", type=int, default=16)
    p.add_argument("--schedule", default="switch", help="lambda schedule, planned for --steps")
    p.add_argument("--timing-steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="where the students, the teacher and the precompute run")
    p.add_argument("--lightly-train-python", help="python of a venv with lightly-train (else that method is skipped)")
    p.add_argument("--lightly-train-seeds", type=int, nargs="+", help="its seeds (default: --seeds)")
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/head_to_head"))
    p.add_argument("--runs", default=None, help="one JSON per finished unit (default: <cache>/runs)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/head_to_head.json"))
    p.add_argument("--worker", default="0/1", metavar="I/N",
                   help="run units I, I+N, ... only (N processes on N cores); the one that finds all done writes results")
    p.add_argument("--tables", metavar="JSON", help="print the README tables from a results JSON and exit")
    a = p.parse_args(argv)
    a.worker = tuple(map(int, a.worker.split("/")))
    a.runs = a.runs or str(Path(a.cache) / "runs")
    a.probes = sorted({s for s in a.probes if 0 <= s <= a.steps} | {0, a.steps})
    if "lightly-train" in a.methods and not a.lightly_train_python:
        a.methods = [m for m in a.methods if m != "lightly-train"]
    a.lightly_train_seeds = a.lightly_train_seeds or a.seeds
    a.priors, a.prior = a.prior, " + ".join(a.prior)
    if len(a.priors) > 1 and {"online", "lightly-train"} & set(a.methods):
        p.error("several --prior: only --methods plain cached (one teacher runs online)")
    return a


def numeric_settings(a) -> dict:
    """The settings that decide a unit's result (the device only when it is not the CPU)."""
    keys = ("prior", "ssl", "lr", "steps", "probes", "canvas", "train_size", "test_size", "batch_size", "widths",
            "components", "schedule", "threads") + (("device",) if a.device != "cpu" else ()) + (("raw",) if a.raw else ()) \
        + (("student",) if a.student != "convnet" else ())
    return {k: getattr(a, k) for k in keys}


# ---------------------------------------------------------------------------------------------- data, probe, prior
def untrained_file(a, seed: int) -> Path:
    """The probe of the seed's untrained student (same draw for every method), under the settings that decide it."""
    return harness.untrained_file(a, Path(a.runs), seed)


def store_dir(a, prior: str) -> Path:
    return Path(a.cache) / f"targets-{prior.replace(':', '-').replace('/', '-')}-c{a.canvas}-{a.train_size}"


def prior_name(prior: str) -> str:
    """A short name of a prior spec (its ReLA term's name)."""
    return Path(prior.split(":", 1)[-1]).stem


def prepare_targets(a, train) -> dict:
    """Each prior's store over the clean training scenes (once), with the precompute's measured cost (summed)."""
    from accelerate_ssl.targets.precompute import precompute_targets
    from accelerate_ssl.priors import create_prior

    infos = []
    for prior in a.priors:
        memo = store_dir(a, prior).with_suffix(".json")
        if not (memo.is_file() and (store_dir(a, prior) / "metadata.json").is_file()):
            torch.set_num_threads(a.threads)
            load, t, c = os.getloadavg(), time.perf_counter(), time.process_time()
            precompute_targets(create_prior(prior).to(a.device), train, store_dir(a, prior), progress=True,
                               command=f"head_to_head.py ({prior})")
            atomic_write_json(memo, {"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c,
                                     "load_average_start": load, "load_average_end": os.getloadavg()}, indent=1)
        infos.append(json.loads(memo.read_text()))
    if len(infos) == 1:
        return infos[0]
    return {"seconds": sum(i["seconds"] for i in infos), "cpu_seconds": sum(i["cpu_seconds"] for i in infos),
            "priors": dict(zip(a.priors, infos))}


# ---------------------------------------------------------------------------------------------- units
def build(a, kind: str, seed: int, train, xtr, schedule=None):
    """(method, rela, teacher, optimizer) of one run; every kind draws the student first from the same seed."""
    from accelerate_ssl.recipes import create_method, prior_teacher
    from accelerate_ssl.rela import ReLA
    from accelerate_ssl.schedules import create_schedule
    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.targets.store import TargetStore

    torch.manual_seed(seed)
    backbone = harness.student(a)
    method = create_method(a.ssl, backbone, backbone.feature_dim).to(a.device)
    rela = teacher = None
    params = [p for p in method.parameters() if p.requires_grad]
    if kind in ("cached", "online"):
        stores = {prior_name(p): TargetStore.open(store_dir(a, p), dataset=train) for p in a.priors}
        rela = ReLA(stores if len(stores) > 1 else next(iter(stores.values())), backbone, dataset=train,
                    schedule=schedule or create_schedule(a.schedule, total_steps=a.steps),
                    feature_dim=backbone.feature_dim, n_components=None if a.raw else a.components).to(a.device)
        params += list(rela.parameters())
        if kind == "online":
            teacher = prior_teacher(create_prior(a.prior).to(a.device))
    return method, rela, teacher, torch.optim.AdamW(params, lr=a.lr, weight_decay=0.01)


def train_unit(a, kind: str, seed: int, train, test, xtr, xte) -> dict:
    from accelerate_ssl.recipes import train_ssl

    method, rela, teacher, opt = build(a, kind, seed, train, xtr)
    probe = harness.Probe(train, test, xtr, xte, seed, untrained_file(a, seed))
    try:
        log = train_ssl(method, harness.batches(a, xtr, seed), a.steps, optimizer=opt,
                        view_generator=torch.Generator().manual_seed(seed + 1), rela=rela, rela_views="weak",
                        checkpoints=a.probes, probe=probe, checkpoint_extras=lambda: dict(probe.last), teacher=teacher,
                        progress=f"{kind} seed {seed}")
    finally:
        if rela is not None:
            rela.close()
    return {"curve": log["curve"], "lambda_per_step": log["lambda_per_step"], "train_seconds": log["train_seconds"],
            "train_cpu_seconds": log["train_cpu_seconds"]}


def lightly_train_unit(a, seed: int, train, test, xtr, xte) -> dict:
    """lightly-train in its own venv (its checkpoints every probe step), then our probe of each checkpoint."""
    from accelerate_ssl.recipes.views import FASHION_MNIST_MEAN, FASHION_MNIST_STD

    folder = Path(a.cache) / f"png-c{a.canvas}-{a.train_size}"
    if not (folder / "done").is_file():  # the training scenes as the image folder lightly-train reads
        from PIL import Image

        from accelerate_ssl.atomic import atomic_path, atomic_write_text

        folder.mkdir(parents=True, exist_ok=True)
        for i, image in enumerate(train.data.numpy()):
            with atomic_path(folder / f"{i:05d}.png", suffix=".png") as tmp:
                Image.fromarray(image, "L").save(tmp, format="PNG")
        atomic_write_text(folder / "done", str(len(train)))
    out = Path(a.cache) / f"lightly-train-{'' if a.student == 'convnet' else a.student + '-'}seed{seed}"
    every = math.gcd(*[s for s in a.probes if s > 0])
    cmd = [a.lightly_train_python, str(ROOT / "benchmarks/head_to_head_lightly_train.py"), "--data", str(folder),
           "--out", str(out), "--teacher", a.prior, "--widths", *map(str, a.widths), "--student", a.student,
           "--steps", str(a.steps),
           "--every", str(every), "--batch-size", str(a.batch_size), "--image-size", str(a.canvas or 28),
           "--mean", str(FASHION_MNIST_MEAN), "--std", str(FASHION_MNIST_STD), "--seed", str(seed),
           "--threads", str(a.threads)]
    load = os.getloadavg()
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    record = json.loads((out / "steps.json").read_text())
    probe = harness.Probe(train, test, xtr, xte, seed, untrained_file(a, seed))
    torch.manual_seed(seed)
    net = harness.student(a)
    curve = [{"step": 0, "top1": probe(net), "seconds": 0.0, "cpu_seconds": 0.0, **probe.last}]
    for c in record["checkpoints"]:
        if c["step"] in a.probes:
            net.load_state_dict(torch.load(out / f"step_{c['step']}.pt", map_location="cpu"))
            curve.append({"step": c["step"], "top1": probe(net), "seconds": c["seconds"],
                          "cpu_seconds": c["cpu_seconds"], **probe.last})
    return {"curve": curve, "lightly_train": {k: v for k, v in record.items() if k != "checkpoints"},
            "command": shlex.join(cmd), "load_average_before": load}


def timing_unit(a, train, xtr) -> dict:
    """Median step time of each kind, the kinds' steps interleaved one by one on the same batches
    (``harness.side_by_side``), and the precompute's time per image from chunks of 1024 training scenes between
    rounds."""
    from accelerate_ssl.recipes import train_ssl
    from accelerate_ssl.schedules import Constant
    from accelerate_ssl.priors import create_prior

    kinds = {k: (*build(a, k, 0, train, xtr, Constant(1.0)), harness.batches(a, xtr, 0))
             for k in ("plain", "cached", "online")[:3 if len(a.priors) == 1 else 2]}
    priors, per_image = [create_prior(p).to(a.device) for p in a.priors], []
    g = torch.Generator().manual_seed(1)

    def step(kind):
        method, rela, teacher, opt, source = kinds[kind]
        return lambda i: train_ssl(method, source, 1, optimizer=opt, view_generator=g, rela=rela, rela_views="weak",
                                   teacher=teacher)

    def between(i):  # several priors: one pass over the chunk, as precompute_targets does them
        per_image.append(harness.precompute_cost(priors if len(priors) > 1 else priors[0], train, i, 1024, a.device)[0])

    times = harness.side_by_side({k: step(k) for k in kinds}, a.timing_steps, between)
    for _, rela, *_ in kinds.values():
        if rela is not None:
            rela.close()
    return {"steps_each": a.timing_steps, "precompute_seconds_per_image": statistics.median(per_image),
            "kinds": {k: {"median_step_seconds": v["seconds"], "median_step_cpu_seconds": v["cpu_seconds"]}
                      for k, v in times.items()}}


# ---------------------------------------------------------------------------------------------- analysis
CLOCKS = {"side_by_side": "side-by-side wall-clock", "cpu": "CPU time", "wall": "each run's own wall-clock"}


def clocks(a, kind: str, run: dict, timing: dict, precompute: dict) -> dict:
    """Seconds at each probe, three ways (the precompute first for ``cached``, the teacher inside ``online``'s steps):
    ``side_by_side``, the interleaved median of each step the run took (lambda = 1: a ReLA step of its kind, else a
    plain step; not for lightly-train, which runs in its own process); ``cpu``, the run's CPU seconds (lightly-train:
    its process and loader worker, from its call on); ``wall``, the run's own measured seconds."""
    curve, pre = run["curve"], kind == "cached"
    if kind == "lightly-train":
        return {"cpu": [c["cpu_seconds"] for c in curve], "wall": [c["seconds"] for c in curve]}
    med = {k: v["median_step_seconds"] for k, v in timing["kinds"].items()}
    cost = [med[kind] if kind != "plain" and lam >= 1.0 else med["plain"] for lam in run["lambda_per_step"] or [0.0] * a.steps]
    start = timing["precompute_seconds_per_image"] * a.train_size if pre else 0.0
    return {"side_by_side": [start + sum(cost[:c["step"]]) for c in curve],
            "cpu": [(precompute["cpu_seconds"] if pre else 0.0) + c["train_cpu_seconds"] for c in curve],
            "wall": [(precompute["seconds"] if pre else 0.0) + c["train_seconds"] for c in curve]}


def at(xs: list[float], ys: list[float], x: float):
    """Linear interpolation of the curve (xs, ys) at x (None outside it)."""
    pts = list(zip(xs, ys))
    return next((y0 + (x - x0) / (x1 - x0) * (y1 - y0) if x1 > x0 else y0
                 for (x0, y0), (x1, y1) in zip(pts, pts[1:]) if x0 <= x <= x1), None)


def interval(values: list) -> dict:
    """Geometric mean and the 95 % prediction interval for one more run (Student's t on the logs; all seeds needed)."""
    ok = [v for v in values if v is not None and v > 0]
    if len(ok) < max(2, len(values)):
        return {"geomean": None, "reached": len(ok), "of": len(values)}
    lo, hi = prediction_interval(ok)
    return {"geomean": math.exp(statistics.fmean(math.log(v) for v in ok)), "low": lo, "high": hi,
            "reached": len(ok), "of": len(values)}


def analyse(a, units: dict, timing: dict, precompute: dict) -> dict:
    methods = [m for m in a.methods if all((m, s) in units for s in a.seeds)]
    curves = {m: {s: {**clocks(a, m, units[(m, s)], timing, precompute), "step": [c["step"] for c in units[(m, s)]["curve"]],
                      **{k: [c.get(k) for c in units[(m, s)]["curve"]] for k in ("top1", "knn_top1", "few_label_top1")}}
                  for s in a.seeds} for m in methods}
    plain, seeds = curves["plain"], a.seeds
    final = {s: plain[s]["top1"][-1] for s in seeds}
    out = {"methods": methods, "curves": {m: {str(s): c for s, c in v.items()} for m, v in curves.items()},
           "gap": {k: {"untrained": statistics.fmean(plain[s][k][0] for s in seeds),
                       "plain_final": statistics.fmean(plain[s][k][-1] for s in seeds),
                       "plain_final_sd": statistics.stdev(plain[s][k][-1] for s in seeds)}
                   for k in ("top1", "knn_top1", "few_label_top1")},
           "reach_plain_final": {}, "equal_clock": {}}
    for clock in CLOCKS:  # seconds to plain's final accuracy (first crossing), and the speed-up over plain, per seed
        for m in (m for m in methods if clock in curves[m][seeds[0]]):
            t = [steps_to_reach(list(zip(curves[m][s][clock], curves[m][s]["top1"])), final[s]) for s in seeds]
            tp = [steps_to_reach(list(zip(plain[s][clock], plain[s]["top1"])), final[s]) for s in seeds]
            up = [p / x if x and p else None for p, x in zip(tp, t)]
            out["reach_plain_final"].setdefault(clock, {})[m] = {
                "seconds": t, "seconds_interval": interval(t), "speedup": up, "speedup_interval": interval(up),
                "run_seconds": [curves[m][s][clock][-1] for s in seeds]}
        rows = []  # ReLA's effect at equal clock: every method read off at each probe of the cached run
        for i, step in enumerate(curves["cached"][seeds[0]]["step"] if "cached" in methods else []):
            x = [curves["cached"][s][clock][i] for s in seeds]
            acc = {m: [at(curves[m][s][clock], curves[m][s]["top1"], xs) for s, xs in zip(seeds, x)]
                   for m in methods if clock in curves[m][seeds[0]]}
            row = {"cached_step": step, "seconds": statistics.fmean(x),
                   "top1": {m: {"mean": statistics.fmean(v), "sd": statistics.stdev(v)} for m, v in acc.items() if None not in v}}
            if step and "plain" in row["top1"]:
                diff = [c - p for c, p in zip(acc["cached"], acc["plain"])]
                row["effect"] = {"mean": statistics.fmean(diff), "sd_of_difference": statistics.stdev(diff),
                                 "in_plain_sd": statistics.fmean(diff) / row["top1"]["plain"]["sd"],
                                 "in_difference_sd": statistics.fmean(diff) / statistics.stdev(diff)}
            if step and "online" in row["top1"]:
                diff = [c - o for c, o in zip(acc["cached"], acc["online"])]
                row["cached_minus_online"] = {"mean": statistics.fmean(diff), "sd_of_difference": statistics.stdev(diff),
                                              "per_seed": diff}
            rows.append(row)
        out["equal_clock"][clock] = rows
    lt_seeds = [s for s in seeds if ("lightly-train", s) in units]
    if lt_seeds and "lightly-train" not in methods:  # run on fewer seeds than the others: per seed, beside them
        lt = {s: {**clocks(a, "lightly-train", units[("lightly-train", s)], timing, precompute),
                  "step": [c["step"] for c in units[("lightly-train", s)]["curve"]],
                  **{k: [c.get(k) for c in units[("lightly-train", s)]["curve"]] for k in ("top1", "knn_top1", "few_label_top1")}}
              for s in lt_seeds}
        out["lightly_train"] = {"seeds": lt_seeds, "curves": {str(s): c for s, c in lt.items()}, "per_seed": {}}
        for s in lt_seeds:
            row = {"top1_end": lt[s]["top1"][-1], "steps": lt[s]["step"][-1]}
            for clock in ("cpu", "wall"):
                end = lt[s][clock][-1]
                row[clock] = {"seconds_end": end,
                              "seconds_to_plain_final": steps_to_reach(list(zip(lt[s][clock], lt[s]["top1"])), final[s]),
                              "others_at_its_end": {m: at(curves[m][s][clock], curves[m][s]["top1"], end) for m in methods},
                              "others_to_plain_final": {m: steps_to_reach(list(zip(curves[m][s][clock], curves[m][s]["top1"])),
                                                                          final[s]) for m in methods}}
            out["lightly_train"]["per_seed"][str(s)] = row
    return out


def tables(result: dict) -> str:
    an, s = result["analysis"], result["settings"]
    lines = ["| probe | untrained % | plain SSL at its end % (sd) | gap, points |", "|---|---:|---:|---:|"]
    for k, name in (("top1", "linear, all labels"), ("knn_top1", "kNN (k = 20)"), ("few_label_top1", "linear, 100 labels/class")):
        g = an["gap"][k]
        lines.append(f"| {name} | {g['untrained']:.2f} | {g['plain_final']:.2f} ({g['plain_final_sd']:.2f}) | "
                     f"{g['plain_final'] - g['untrained']:+.2f} |")
    for clock in ("side_by_side", "cpu"):
        ms = [m for m in an["methods"] if m in an["reach_plain_final"][clock]]
        lines += ["", f"Equal {CLOCKS[clock]}: top-1 % (mean ± sd over seeds) at the seconds of each probe of the cached run",
                  "", "| ReLA steps | s | " + " | ".join(LABEL[m] for m in ms) + " | cached - plain | in plain's sd | "
                  "in the sd of the difference |", "|---" * (5 + len(ms)) + "|"]
        for r in an["equal_clock"][clock]:
            e = r.get("effect")
            lines.append(f"| {r['cached_step']} | {r['seconds']:.0f} | " + " | ".join(
                f"{r['top1'][m]['mean']:.2f} ± {r['top1'][m]['sd']:.2f}" if m in r["top1"] else "–" for m in ms) + " | " +
                (f"{e['mean']:+.2f} | {e['in_plain_sd']:.1f} | {e['in_difference_sd']:.1f} |" if e else " | | |"))
    lines += ["", "Cached against online, same teacher, at equal clock (the seconds of each probe of the cached run):", "",
              "| clock | ReLA steps | s | cached - online, points (mean ± sd of the difference) | seeds |",
              "|---|---:|---:|---:|---|"]
    for clock in ("side_by_side", "cpu"):
        for r in an["equal_clock"][clock]:
            if "cached_minus_online" in r:
                d = r["cached_minus_online"]
                lines.append(f"| {CLOCKS[clock]} | {r['cached_step']} | {r['seconds']:.0f} | {d['mean']:+.2f} ± "
                             f"{d['sd_of_difference']:.2f} | {', '.join(f'{v:+.1f}' for v in d['per_seed'])} |")
    lines += ["", "| method | clock | s to plain's final accuracy (seeds) | speed-up over plain (seeds) | geometric mean | "
              "95 % interval for one more run |", "|---|---|---|---|---|---|"]
    for clock, per in an["reach_plain_final"].items():
        for m, r in per.items():
            iv = r["speedup_interval"]
            lines.append(f"| {LABEL[m]} | {CLOCKS[clock]} | {', '.join('–' if t is None else f'{t:.0f}' for t in r['seconds'])} | "
                         f"{', '.join('not reached' if v is None else f'{v:.2f}x' for v in r['speedup'])} | " +
                         (f"{iv['geomean']:.2f}x | {iv['low']:.2f}-{iv['high']:.2f}x |" if iv["geomean"]
                          else f"{iv['reached']} of {iv['of']} reached | |"))
    if "lightly_train" in an:
        lt = an["lightly_train"]
        ms = an["methods"]
        lines += ["", f"lightly-train distillation ({len(lt['seeds'])} seed{'s' if len(lt['seeds']) > 1 else ''}), against "
                  "the other methods of the same seed at its CPU / wall seconds", "",
                  "| seed | clock | its end: s, top-1 % | " + " | ".join(f"{LABEL[m]} at those s" for m in ms) +
                  " | s to plain's final: lightly-train | " + " | ".join(ms) + " |", "|---" * (4 + 2 * len(ms)) + "|"]
        fmt = lambda v, f: "not reached" if v is None else format(v, f)  # noqa: E731
        for sd, r in lt["per_seed"].items():
            for clock in ("cpu", "wall"):
                c = r[clock]
                lines.append(f"| {sd} | {CLOCKS[clock]} | {c['seconds_end']:.0f}, {r['top1_end']:.2f} | " +
                             " | ".join("past its end" if c["others_at_its_end"][m] is None else
                                        f"{c['others_at_its_end'][m]:.2f}" for m in ms) + " | " +
                             fmt(c["seconds_to_plain_final"], ".0f") + " | " +
                             " | ".join(fmt(c["others_to_plain_final"][m], ".0f") for m in ms) + " |")
    k = result["timing"]["kinds"]
    lines += ["", "| step (interleaved, medians) | ms | CPU ms | / plain step | / online step |", "|---|---:|---:|---:|---:|"]
    for n in k:
        lines.append(f"| {n} | {k[n]['median_step_seconds'] * 1e3:.0f} | {k[n]['median_step_cpu_seconds'] * 1e3:.0f} | "
                     f"{k[n]['median_step_seconds'] / k['plain']['median_step_seconds']:.2f} | "
                     + (f"{k[n]['median_step_seconds'] / k['online']['median_step_seconds']:.2f} |" if "online" in k else "– |"))
    pre = result["timing"]["precompute_seconds_per_image"]
    lines.append(f"\nPrecompute: {pre * 1e3:.2f} ms per image side by side ({pre * s['train_size']:.1f} s for "
                 f"{s['train_size']} scenes); alone {result['precompute']['seconds']:.1f} s wall, "
                 f"{result['precompute']['cpu_seconds']:.1f} s CPU.")
    return "\n".join(lines)


def figure(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    an, s = result["analysis"], result["settings"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, clock in zip(axes, ("side_by_side", "cpu")):
        for i, m in enumerate(an["methods"]):
            runs = list(an["curves"][m].values())
            if clock not in runs[0]:
                continue
            for r in runs:
                ax.plot(r[clock], r["top1"], color=f"C{i}", alpha=0.25, lw=0.8)
            mean = [[statistics.fmean(r[k][j] for r in runs) for j in range(len(runs[0]["step"]))] for k in (clock, "top1")]
            sd = [statistics.stdev(r["top1"][j] for r in runs) for j in range(len(runs[0]["step"]))]
            ax.errorbar(*mean, yerr=sd, color=f"C{i}", marker="o", ms=3, capsize=2, label=LABEL[m])
        if clock in ("cpu",) and "lightly_train" in an:
            for j, r in enumerate(an["lightly_train"]["curves"].values()):
                ax.plot(r[clock], r["top1"], color="C3", marker="s", ms=3, lw=1,
                        label=f"{LABEL['lightly-train']} (seed {an['lightly_train']['seeds'][j]})")
        ax.axhline(an["gap"]["top1"]["plain_final"], color="gray", ls=":", lw=1)
        where = s.get("device", "cpu")
        where = f"{s['threads']} thread(s)" if where == "cpu" else result["machine"].get("device", where)
        ax.set_xlabel(f"{CLOCKS[clock]}, s ({where}; precompute / teacher forward included)")
    axes[0].set_ylabel("linear probe top-1 % (test scenes)")
    axes[1].legend(fontsize=8, loc="lower right")
    data = f"on {s['canvas']} px cluttered canvases" if s["canvas"] else "(28 px images)"
    net = (f"ConvNet {'/'.join(map(str, s['widths']))}" if s.get("student", "convnet") == "convnet"
           else "ViT (4 blocks, width 64, 4 px patches)")
    fig.suptitle(f"Fashion-MNIST {data}: {s['ssl']}, student {net}, teacher {s['prior']}, {len(s['seeds'])} seeds "
                 "(mean ± sd, thin: seeds)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    a = parse_args(argv)
    if a.tables:
        print(tables(json.loads(Path(a.tables).read_text())))
        return 0
    t_start, load = time.perf_counter(), os.getloadavg()
    torch.set_num_threads(a.threads)
    Path(a.runs).mkdir(parents=True, exist_ok=True)
    train, test, xtr, xte = harness.data(a)  # on --canvas canvases
    while a.worker[0] and not all(store_dir(a, p).with_suffix(".json").is_file() for p in a.priors):
        time.sleep(10)  # worker 0 makes the store
    precompute = prepare_targets(a, train)
    units = [("timing", 0)] + [(m, s) for s in a.seeds for m in a.methods
                               if m != "lightly-train" or s in a.lightly_train_seeds]

    def cached(u):
        f = Path(a.runs) / f"{u[0]}-{u[1]}.json"
        r = json.loads(f.read_text()) if f.is_file() else None
        return r if r is not None and r["settings"] == numeric_settings(a) else None

    while a.worker[0] and cached(("timing", 0)) is None:
        time.sleep(5)  # the step times are measured alone, before the other workers start

    for i, u in enumerate(units):
        f = Path(a.runs) / f"{u[0]}-{u[1]}.json"
        if cached(u) is not None or i % a.worker[1] != a.worker[0]:
            continue
        unit_load = os.getloadavg()
        if u[0] == "timing":
            r = timing_unit(a, train, xtr)
        elif u[0] == "lightly-train":
            r = lightly_train_unit(a, u[1], train, test, xtr, xte)
        else:
            r = train_unit(a, u[0], u[1], train, test, xtr, xte)
        r.update(unit=list(u), settings=numeric_settings(a), load_average_start=unit_load,
                 load_average_end=os.getloadavg())
        atomic_write_json(f, r, indent=1)
    done = {u: r for u in units if (r := cached(u)) is not None}  # this worker's units and the others' finished ones
    if len(done) < len(units):
        print(f"{len(units) - len(done)} units left to the other workers; rerun when they are done")
        return 0
    if "plain" not in a.methods:
        print("every unit of these methods is done; the results compare against plain SSL: rerun with --methods plain ...")
        return 0
    result = {"command": shlex.join(["python", "benchmarks/head_to_head.py", *sys.argv[1:]]),
              "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform(),
                          "cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_average_start": load,
                          "device": torch.cuda.get_device_name(a.device) if torch.device(a.device).type == "cuda" else "cpu",
                          "cuda": torch.version.cuda,
                          "load_average_end": os.getloadavg()},
              "settings": {**numeric_settings(a), "seeds": a.seeds, "methods": a.methods},
              "precompute": precompute, "timing": done[("timing", 0)],
              "analysis": analyse(a, done, done[("timing", 0)], precompute),
              "units": {f"{u[0]}-{u[1]}": {k: r.get(k) for k in ("load_average_start", "load_average_end", "train_seconds",
                                                                  "lightly_train", "command")}
                        for u, r in done.items() if u[0] != "timing"},
              "study_wall_seconds_this_invocation": time.perf_counter() - t_start}
    result["table"] = tables(result)
    write_results(Path(a.out), result, root=ROOT)
    figure(result, Path(a.out).with_suffix(".png"))
    print(result["table"])
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
