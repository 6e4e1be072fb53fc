"""What ReLA saves over plain BYOL, in wall-clock, CPU time and steps: priors x budgets x seeds.

The demo's recipe (``accelerate_ssl/demo.py``: 20k Fashion-MNIST training images, GroupNorm ConvNet 16/32/64,
BYOL with lightly's heads, batch 128, AdamW 1e-3, ``switch`` planned for each run, weak views, 16 target
components, least-squares head; linear probe on the 10k test images). Units, each cached as one JSON in
``--runs`` when it ends, one at a time (rerun the same command to resume):

* ``plain``: plain BYOL for ``--full-steps``, probed at ``--plain-probes``;
* ``rela``: BYOL + ReLA with one prior for one budget (a ``--cells`` entry), probed at its end, with the recipe's step
  while lambda == 1 (``--rela-steps``: ``one-view``, the default, or ``two-view``, the former one);
* ``timing``: one process, the steps of plain BYOL, ReLA (one and two views) and an online teacher (the same ReLA
  step with the prior run on the student's view every step, ``train_ssl(..., teacher=)``, as online distillation
  does it) interleaved one by one: median step times measured side by side, the most load-robust ratios on a
  shared machine.

Speed-ups (per seed, and on the mean curves): wall-clock = plain's training seconds to reach ReLA's accuracy /
(ReLA's training seconds + the precompute of the prior's targets); CPU = the same in process CPU seconds; steps =
plain's steps to that accuracy / the budget. Every unit records the load average at its start and end. The plain
runs and the demo's own ReLA cell are imported from ``accelerate-ssl demo``'s JSON where its settings match.

    python benchmarks/speedup.py                                # the study (resumable)
    python benchmarks/speedup.py --tables benchmarks/results/speedup.json   # the README tables from its JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from accelerate_ssl.atomic import atomic_write_json  # noqa: E402
from accelerate_ssl.recipes import cost_speedup, mean_run, speedup  # noqa: E402
from accelerate_ssl.results import write_results  # noqa: E402

#: name -> (spec, what it is, its training cost where this project trained it)
PRIORS = {
    "random": ("random:convnet", "untrained ConvNet 64/128/256", None),
    "digits": ("shipped:digits-byol", "BYOL on scikit-learn digits (other data; the demo's default)",
               "2000 steps, 28 min, 1 thread"),
    "byol-20k": ("shipped:fashion-mnist-byol-20k", "BYOL, 20,000 steps on these images (upper bound)",
                 "20,000 steps, 90 min, 1 thread"),
    "supervised": ("shipped:fashion-mnist-supervised", "trained WITH these images' labels (upper bound)",
                   "7000 steps, 33 min, 1 thread"),
    # the same recipe at the student's width (16/32/64): a quarter of the FLOPs, half the measured precompute
    "supervised-small": ("checkpoint:benchmarks/prior_runs/supervised_small/prior.safetensors",
                         "ConvNet 16/32/64 trained WITH these images' labels (upper bound)", "7000 steps, 6 min, 1 thread"),
}


#: the published study: the demo's prior at three lengths, each other prior where it crosses plain BYOL's curve
CELLS = ["digits:100", "digits:250", "digits:450", "byol-20k:100", "byol-20k:250", "supervised:100", "supervised:150",
         "supervised:250", "supervised:400", "supervised-small:100", "supervised-small:150", "supervised-small:200",
         "supervised-small:250", "random:250"]


def prior_spec(prior: str) -> str:
    """The prior's spec, a ``checkpoint:`` path taken relative to the repository (whatever the working folder)."""
    spec = PRIORS[prior][0]
    return f"checkpoint:{ROOT / spec.split(':', 1)[1]}" if spec.startswith("checkpoint:") else spec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=CELLS, metavar="PRIOR:BUDGET",
                   help=f"the ReLA runs, a prior ({', '.join(PRIORS)}) and a length in steps each (default: the "
                        "published study)")
    p.add_argument("--rela-steps", nargs="+", default=["one-view"], choices=["one-view", "two-view"])
    p.add_argument("--compare", nargs="*", default=["digits:250"],
                   help="PRIOR:BUDGET cells also run with the other --rela-step (the step comparison)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--full-steps", type=int, default=1000, help="plain BYOL's run (default 1000)")
    p.add_argument("--plain-probes", type=int, nargs="+", default=[0, 125, 250, 375, 500, 625, 750, 875, 1000],
                   help="steps at which plain BYOL is probed (default: the demo's, so its runs can be imported)")
    p.add_argument("--timing-steps", type=int, default=20, help="interleaved steps per kind of the timing unit (0: none)")
    p.add_argument("--train-size", type=int, default=20000)
    p.add_argument("--test-size", type=int, default=10000)
    p.add_argument("--probe-epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--threads", type=int, default=1, help="torch threads per unit (default 1, as the demo)")
    p.add_argument("--demo-json", nargs="*", default=[str(ROOT / "benchmarks/results/demo.json")],
                   help="demo.json files whose plain and ReLA runs are units of this study when their settings match "
                        "(default: the committed demo's)")
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/speedup"), help="target stores")
    p.add_argument("--runs", default=str(ROOT / "benchmarks/runs/speedup"), help="one JSON per finished unit")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/speedup.json"))
    p.add_argument("--tables", metavar="JSON", help="print the README tables from a results JSON and exit")
    args = p.parse_args(argv)
    args.plain_probes = sorted({s for s in args.plain_probes if 0 <= s <= args.full_steps} | {0, args.full_steps})
    def pairs(specs):
        out = [(c.split(":")[0], int(c.split(":")[1])) for c in specs if c.count(":") == 1 and c.split(":")[1].isdigit()]
        if len(out) != len(specs) or any(prior not in PRIORS for prior, _ in out):
            p.error(f"cells are PRIOR:STEPS with PRIOR one of {', '.join(PRIORS)}; got {' '.join(specs)}")
        return out

    args.compare = pairs(args.compare)
    args.cells = pairs(args.cells)
    args.priors = list(dict.fromkeys([c[0] for c in args.cells]))
    return args


# ---------------------------------------------------------------------------------------------- units
def recipe(args, budget: int, rela_step: str = "one-view") -> argparse.Namespace:
    """The demo's settings (its parser's defaults) for a run of ``budget`` steps."""
    from accelerate_ssl.demo import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    r = parser.parse_args([])
    r.budget, r.rela_step, r.threads = budget, rela_step, args.threads
    r.train_size, r.test_size, r.probe_epochs = args.train_size, args.test_size, args.probe_epochs
    r.batch_size, r.widths = args.batch_size, args.widths
    return r


def numeric_settings(args) -> dict:
    """What changes a unit's numbers (a cached unit is re-used only when these match)."""
    return {k: getattr(args, k) for k in ("train_size", "test_size", "probe_epochs", "batch_size", "widths", "threads",
                                          "full_steps")}


def data(args):
    from accelerate_ssl.data import FashionMNIST
    from accelerate_ssl.demo import _uint8_tensor
    from accelerate_ssl.recipes import images_to_tensor

    train, test = FashionMNIST("train", limit=args.train_size), FashionMNIST("test", limit=args.test_size)
    tensors = (images_to_tensor(train.data), train.targets, images_to_tensor(test.data), test.targets)
    train.transform = _uint8_tensor
    return train, tensors


def store_dir(args, prior: str) -> Path:
    return Path(args.cache) / f"{prior}-{args.train_size}"


def prepare_targets(args, prior: str) -> dict:
    """The prior's target store over the training images, its precompute timed (wall, CPU) once and re-used."""
    from accelerate_ssl.data import FashionMNIST
    from accelerate_ssl.targets.precompute import precompute_targets
    from accelerate_ssl.priors import create_prior

    memo = store_dir(args, prior).with_suffix(".json")
    if memo.is_file() and (store_dir(args, prior) / "metadata.json").is_file():
        return json.loads(memo.read_text())
    torch.set_num_threads(args.threads)
    train = FashionMNIST("train", limit=args.train_size)  # both runs read the data: not ReLA's cost
    load, t, c = os.getloadavg(), time.perf_counter(), time.process_time()  # loading the prior + the precompute, as the demo
    precompute_targets(create_prior(prior_spec(prior)), train, store_dir(args, prior), progress=True,
                       command=f"speedup.py ({prior})")
    info = {"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c, "threads": args.threads,
            "load_average_start": load, "load_average_end": os.getloadavg()}
    atomic_write_json(memo, info, indent=1)
    return info


def run_unit(args, unit: tuple) -> dict:
    """``("plain", seed)``, ``("rela", prior, budget, step, seed)`` or ``("timing", prior)``."""
    torch.set_num_threads(args.threads)
    from accelerate_ssl.demo import train_byol
    from accelerate_ssl.recipes import Probe
    from accelerate_ssl.targets.store import TargetStore

    load = os.getloadavg()
    train, tensors = data(args)
    if unit[0] == "timing":
        out = timing(args, train, unit[1])
    elif unit[0] == "plain":
        seed = unit[1]
        out = train_byol(recipe(args, args.full_steps), train, Probe(*tensors, epochs=args.probe_epochs, seed=seed),
                         args.full_steps, args.plain_probes, desc=f"plain seed {seed}", seed=seed)
    else:
        _, prior, budget, step, seed = unit
        store = TargetStore.open(store_dir(args, prior), dataset=train)
        out = train_byol(recipe(args, budget, step), train, Probe(*tensors, epochs=args.probe_epochs, seed=seed),
                         budget, [budget], store=store, desc=f"ReLA {prior} {budget} {step} seed {seed}", seed=seed)
        out["lambda_end"] = out.pop("lambda_per_step")[-1]
    return {"unit": list(unit), "settings": numeric_settings(args), **out, "load_average_start": load,
            "load_average_end": os.getloadavg()}


def timing(args, train, prior: str) -> dict:
    """Median step time of each kind, the kinds' steps interleaved one by one in this process (same batches)."""
    from torch.utils.data import DataLoader

    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.recipes import BYOL, images_to_tensor, loader_batches, prior_teacher, train_ssl
    from accelerate_ssl.rela import ReLA
    from accelerate_ssl.schedules import Constant
    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.targets.store import TargetStore

    store = TargetStore.open(store_dir(args, prior), dataset=train)
    r = recipe(args, 1)
    kinds = {}
    for kind in ("plain", "one-view", "two-view", "online"):
        torch.manual_seed(0)
        backbone = ConvNet(widths=tuple(args.widths))
        method = BYOL(backbone, backbone.feature_dim)
        loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(0))
        rela = teacher = None
        if kind != "plain":  # online: the same ReLA term, its rows from the prior run on the step's view
            rela = ReLA(store, backbone, dataloader=loader, schedule=Constant(1.0), feature_dim=backbone.feature_dim,
                        n_components=r.components)
            teacher = prior_teacher(create_prior(prior_spec(prior))) if kind == "online" else None
        params = [p for p in method.parameters() if p.requires_grad] + (list(rela.parameters()) if rela else [])
        batches = loader_batches(loader, lambda images: images_to_tensor(images.squeeze(1)))
        kinds[kind] = (method, rela, teacher, batches, torch.optim.AdamW(params, lr=r.lr), [], [])
    g = torch.Generator().manual_seed(1)
    for i in range(args.timing_steps + 2):
        for kind, (method, rela, teacher, batches, opt, wall, cpu) in kinds.items():
            log = train_ssl(method, batches, 1, optimizer=opt, view_generator=g, rela=rela, rela_views="weak",
                            rela_step="two-view" if kind == "two-view" else "one-view", teacher=teacher)
            if i >= 2:  # warm-up steps excluded
                wall.append(log["step_seconds"][0])
                cpu.append(log["step_cpu_seconds"][0])
    out = {k: {"median_step_seconds": statistics.median(v[5]), "median_step_cpu_seconds": statistics.median(v[6])}
           for k, v in kinds.items()}
    for _, rela, *_ in kinds.values():
        if rela is not None:
            rela.close()
    return {"steps_each": args.timing_steps, "kinds": out}


def import_demo(args, path: str) -> tuple[dict, dict]:
    """``({unit: record}, {prior: precompute})`` from a demo.json whose settings match this study's: its plain and
    ReLA runs, and the precompute its ReLA runs paid (so the demo's cell costs here what it cost there)."""
    d = json.loads(Path(path).read_text())
    s = d["settings"]
    prior = next((n for n, p in PRIORS.items() if p[0] == s["prior_spec"]), None)
    same = all(s.get(k) == v for k, v in numeric_settings(args).items() if k != "full_steps")
    plain_steps = round(s["plain_multiple"] * s["budget"])
    if prior is None or not same or plain_steps != args.full_steps or s["weights"] is not None:
        print(f"{path}: settings differ from this study's, not imported")
        return {}, {}
    out = {}
    for r in d["per_seed"] or [{"seed": s["seeds"][0], "plain": d["plain"], "rela": d["rela"]}]:
        extra = {"settings": numeric_settings(args), "imported_from": path,
                 "load_average_start": d["machine"]["load_average_start"],
                 "load_average_end": d["machine"]["load_average_end"]}
        out[("plain", r["seed"])] = {"unit": ["plain", r["seed"]], **r["plain"], **extra}
        rela = {k: v for k, v in r["rela"].items() if k != "lambda_per_step"}
        unit = ("rela", prior, s["budget"], s["rela_step"], r["seed"])
        out[unit] = {"unit": list(unit), **rela, "lambda_end": r["rela"]["lambda_per_step"][-1], **extra}
    return out, {prior: {**d["targets"]["precompute"], "imported_from": path}}


# ---------------------------------------------------------------------------------------------- analysis
def analyse(args, units: dict, precompute: dict) -> dict:
    plain = {s: units[("plain", s)] for s in args.seeds}
    mean_plain = mean_run(list(plain.values()))
    full = next(c for c in mean_plain["curve"] if c["step"] == args.full_steps)
    cells = {}
    order = list(PRIORS)
    for prior, budget, step in sorted({u[1:4] for u in units if u[0] == "rela"}, key=lambda c: (order.index(c[0]), *c[1:])):
        runs = {s: units.get(("rela", prior, budget, step, s)) for s in args.seeds}
        if any(r is None for r in runs.values()):
            continue
        pre = precompute[prior]
        per_seed = []
        for s, r in runs.items():
            acc, end = r["curve"][-1]["top1"], r["curve"][-1]
            per_seed.append({"seed": s, "top1": acc, "steps": speedup([(c["step"], c["top1"]) for c in plain[s]["curve"]], acc, budget),
                             "wall": cost_speedup(plain[s]["curve"], acc, end["train_seconds"] + pre["seconds"]),
                             "cpu": cost_speedup(plain[s]["curve"], acc, end["train_cpu_seconds"] + pre["cpu_seconds"],
                                                 "train_cpu_seconds", "CPU s"),
                             "step_time_ratio": r["median_step_seconds"] / plain[s]["median_step_seconds"],
                             "step_cpu_ratio": r["median_step_cpu_seconds"] / plain[s]["median_step_cpu_seconds"],
                             "train_seconds": end["train_seconds"], "lambda_end": r["lambda_end"]})
        accs = [p["top1"] for p in per_seed]
        m = statistics.fmean(accs)
        rela_cost = statistics.fmean(p["train_seconds"] for p in per_seed) + pre["seconds"]
        rela_cpu = statistics.fmean(runs[s]["curve"][-1]["train_cpu_seconds"] for s in runs) + pre["cpu_seconds"]
        cells[f"{prior}|{budget}|{step}"] = {
            "prior": prior, "budget": budget, "rela_step": step, "top1": m, "top1_std": statistics.pstdev(accs),
            "per_seed": per_seed, "precompute": pre,
            "steps": speedup([(c["step"], c["top1"]) for c in mean_plain["curve"]], m, budget),
            "wall": cost_speedup(mean_plain["curve"], m, rela_cost),
            "cpu": cost_speedup(mean_plain["curve"], m, rela_cpu, "train_cpu_seconds", "CPU s"),
            "step_time_ratio": statistics.fmean(p["step_time_ratio"] for p in per_seed),
            "step_cpu_ratio": statistics.fmean(p["step_cpu_ratio"] for p in per_seed),
            # the goal: plain's full-budget accuracy within 1/10 of plain's full-budget wall-clock, precompute included
            "reaches_plain_full": m >= full["top1"], "cost_fraction_of_plain_full": rela_cost / full["train_seconds"],
            "cpu_fraction_of_plain_full": rela_cpu / full["train_cpu_seconds"]}
    return {"plain": {"mean_curve": mean_plain["curve"], "full_top1": full["top1"], "full_seconds": full["train_seconds"],
                      "per_seed": {str(s): plain[s]["curve"] for s in args.seeds}}, "cells": cells}


def _x(e: dict) -> str:
    return ("> " if e["lower_bound"] else "") + f"{e['speedup']:.2f}x"


def tables(result: dict) -> str:
    """The README / benchmarks README tables, from a results JSON."""
    lines = ["| prior | its training | ReLA steps | step | ReLA top-1 % | plain at equal steps % | speed-up in wall-clock "
             "(precompute incl.) | CPU time | steps | step time ReLA / plain |", "|" + "---|" * 10]
    for c in result["cells"].values():
        plain = next((p["top1"] for p in result["plain"]["mean_curve"] if p["step"] == c["budget"]), None)
        what = PRIORS[c["prior"]]
        lines.append(f"| `{what[0]}` ({what[1]}) | {what[2] or 'none'} | {c['budget']} | {c['rela_step']} | "
                     f"{c['top1']:.2f} ± {c['top1_std']:.2f} | {'' if plain is None else f'{plain:.2f}'} | "
                     f"**{_x(c['wall'])}** (seeds {', '.join(_x(p['wall']) for p in c['per_seed'])}) | {_x(c['cpu'])} | "
                     f"{_x(c['steps'])} | {c['step_time_ratio']:.2f} |")
    p = result["plain"]
    lines.append(f"\nPlain BYOL, {result['settings']['full_steps']} steps: {p['full_top1']:.2f} % "
                 f"({p['full_seconds']:.0f} s of training, mean of seeds {result['settings']['seeds']}).")
    for c in result["cells"].values():
        lines.append(f"- {c['prior']} @ {c['budget']} ({c['rela_step']}): {c['top1']:.2f} % vs plain's {p['full_top1']:.2f} % "
                     f"at {result['settings']['full_steps']} steps, at {c['cost_fraction_of_plain_full']:.3f} of its "
                     f"wall-clock / {c['cpu_fraction_of_plain_full']:.3f} of its CPU time, precompute included")
    if result.get("timing"):
        k = result["timing"]["kinds"]
        ratio = {n: (k[n]["median_step_seconds"] / k["plain"]["median_step_seconds"],
                     k[n]["median_step_cpu_seconds"] / k["plain"]["median_step_cpu_seconds"]) for n in k}
        online = {n: k[n]["median_step_seconds"] / k["online"]["median_step_seconds"] for n in k}
        lines.append("\n| step (interleaved, medians) | ms | / plain BYOL step (wall, CPU) | / online-teacher step |")
        lines.append("|---|---|---|---|")
        for n in k:
            lines.append(f"| {n} | {k[n]['median_step_seconds'] * 1000:.0f} | {ratio[n][0]:.2f}, {ratio[n][1]:.2f} | "
                         f"{online[n]:.2f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main
def _unit_file(args, unit) -> Path:
    return Path(args.runs) / ("-".join(map(str, unit)) + ".json")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tables:
        print(tables(json.loads(Path(args.tables).read_text())))
        return 0
    t_start, load = time.perf_counter(), os.getloadavg()
    Path(args.runs).mkdir(parents=True, exist_ok=True)
    done, paid = {}, {}
    for path in args.demo_json:
        units, costs = import_demo(args, path)
        done.update(units)
        paid.update(costs)
    precompute = {p: prepare_targets(args, p) for p in args.priors}  # the stores every ReLA unit reads
    precompute.update({p: cost for p, cost in paid.items() if p in precompute})  # the demo's prior: what the demo paid
    units = [("plain", s) for s in args.seeds]
    units += [("rela", p, b, st, s) for p, b in args.cells for st in args.rela_steps for s in args.seeds]
    other = {"one-view": "two-view", "two-view": "one-view"}
    units += [("rela", p, b, other[st], s) for p, b in args.compare for st in args.rela_steps for s in args.seeds
              if p in args.priors and other[st] not in args.rela_steps]
    if args.timing_steps:
        units.append(("timing", "digits" if "digits" in args.priors else args.priors[0]))
    todo = []
    for u in units:
        f = _unit_file(args, u)
        if u not in done and f.is_file() and json.loads(f.read_text())["settings"] == numeric_settings(args):
            done[u] = json.loads(f.read_text())
        elif u not in done:
            todo.append(u)
    print(f"{len(units) - len(todo)} of {len(units)} units done; {len(todo)} to run")
    for u in todo:
        r = run_unit(args, u)
        atomic_write_json(_unit_file(args, u), r, indent=1)
        done[u] = r
    result = {"command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/speedup.py", *sys.argv[1:]]),
              "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform(),
                          "cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_average_start": load,
                          "load_average_end": os.getloadavg()},
              "settings": {**numeric_settings(args), "seeds": args.seeds, "cells": [f"{c}:{b}" for c, b in args.cells],
                           "plain_probes": args.plain_probes},
              **analyse(args, done, precompute),
              "timing": next((r for u, r in done.items() if u[0] == "timing"), None),
              "units": {"-".join(map(str, u)): {k: r.get(k) for k in ("load_average_start", "load_average_end",
                                                                        "train_seconds", "train_cpu_seconds")}
                        for u, r in done.items() if u[0] != "timing"},
              "study_wall_seconds_this_invocation": time.perf_counter() - t_start}
    result["table"] = tables(result)
    write_results(Path(args.out), result)
    print(result["table"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
