"""The hand-over, measured: what each part of ``Handover`` buys at the switch, and which schedule hands over when.

Both studies run the harness's recipe (``harness.py``: its students, data, probes, learning-rate schedule planned for
each run), one prior (``--prior``, default ``other``: digits BYOL), with the student's one view per step while lambda
is 1 drawn as ``--views`` says (``weak``: ReLA v1's weak views, as these studies were run). They compare runs at equal
**steps**; the budget study (``budget.py``) compares them at equal compute.

``--study switch``: lambda 1 for the first ``--switch`` fraction of ``--steps`` then 0 (``epochs:<f>``, so every
variant switches at the same step), probed at the switch and densely after it. Variants of what happens there:
``none`` (nothing: the SSL heads as initialised, the momentum network where it was), ``momentum`` (the EMA network
reset to the student; BYOL), ``warm-heads=W`` (the backbone frozen W steps while the heads learn), ``rewarm=R`` (the
learning rate ramped back over R steps), ``same-views`` (the SSL views during the ReLA phase too, so the augmentation
does not change at the switch), ``all`` (momentum, warm heads and re-warm), beside plain SSL of the same length.

``--study schedules``: each ``--schedules`` spec planned for each ``--budgets`` length, with the hand-over ``--handover``:
whether and when lambda reaches 0, and the end accuracy, beside plain SSL of the same length.

    python benchmarks/handover.py --student convnet --study switch --seeds 0 1 2
    python benchmarks/handover.py --student convnet --study schedules --budgets 100 1000 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402
from harness import Run, mean_sd, mean_sd_text, seeds_text  # noqa: E402

from accelerate_ssl.results import save_figure, write_results  # noqa: E402

VARIANTS = {  # name -> (handover spec, views while lambda is 1); W and R from --warm-heads / --rewarm
    "none": ("none", "weak"), "momentum": ("momentum", "weak"), "warm-heads": ("warm-heads={W}", "weak"),
    "rewarm": ("rewarm={R}", "weak"), "same-views": ("none", "byol"),
    "all": ("momentum,warm-heads={W},rewarm={R}", "weak"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", choices=("switch", "schedules"), required=True)
    p.add_argument("--student", choices=sorted(harness.RECIPES), default="convnet")
    p.add_argument("--prior", choices=list(harness.PRIORS), default="other")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=1000, help="switch study: the run's length")
    p.add_argument("--switch", type=float, default=0.25, help="switch study: the fraction of the run with lambda 1")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--warm-heads", type=int, default=25)
    p.add_argument("--rewarm", type=int, default=50)
    p.add_argument("--after", type=int, nargs="+", default=[10, 25, 50, 100, 250, 500],
                   help="switch study: probes this many steps after the switch (and at the run's end)")
    p.add_argument("--budgets", type=int, nargs="+", default=[100, 1000], help="schedules study: run lengths")
    p.add_argument("--schedules", nargs="+", default=["switch", "decay", "constant:0.5", "epochs:0.25", "epochs:0.5"])
    p.add_argument("--handover", default="momentum,warm-heads=auto",
                   help="schedules study: the hand-over of every run (Handover.from_spec)")
    p.add_argument("--views", choices=("weak", "byol"), default="weak",
                   help="the student's one view per step while lambda is 1: ReLA v1's weak views or the SSL views")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/budget"), help="target stores, the in-domain prior")
    p.add_argument("--worker", default="0/1", metavar="I/N")
    p.add_argument("--gather", action="store_true", help="run nothing: the results of the runs finished so far")
    p.add_argument("--out", help="results JSON (default: benchmarks/results/handover_<study>_<student>_<prior>.json)")
    a = p.parse_args(argv)
    a.worker = tuple(map(int, a.worker.split("/")))
    a.out = a.out or str(ROOT / f"benchmarks/results/handover_{a.study}_{a.student}_{a.prior}.json")
    a.cache = Path(a.cache)
    a.recipe = harness.recipe(a.student, threads=a.threads)
    return a


def units(a) -> list[tuple]:
    out = []
    for seed in a.seeds:
        if a.study == "switch":
            out.append(("plain", None, a.steps, seed))
            out += [("variant", v, a.steps, seed) for v in a.variants]
        else:
            for steps in a.budgets:
                out.append(("plain", None, steps, seed))
                out += [("schedule", s, steps, seed) for s in a.schedules]
    return out


def recipe_of(a, unit) -> Run:
    """The harness's run of one of this study's units."""
    kind, name, steps, seed = unit
    probes = tuple(checkpoints(a, unit))
    if kind == "plain":
        return Run(None, steps, seed, probes=probes)
    if kind == "variant":
        handover, views = VARIANTS[name]
        return Run(a.prior, steps, seed, f"epochs:{a.switch}", handover=handover.format(W=a.warm_heads, R=a.rewarm),
                   views=a.views if views == "weak" else "byol", probes=probes)
    return Run(a.prior, steps, seed, name, handover=a.handover, views=a.views, probes=probes)


def checkpoints(a, unit) -> list[int]:
    kind, _, steps, _ = unit
    if a.study != "switch":
        return []
    at = round(a.switch * steps)
    return sorted({at, *(at + d for d in a.after if at + d < steps)}) if kind == "variant" else [at]


def unit_file(a, unit) -> Path:
    """A run's JSON, named by what decides it (the switch study's variants also by the switch, W and R)."""
    kind, name, steps, seed = unit
    tag = {"plain": "", "variant": f"-switch{a.switch}-W{a.warm_heads}-R{a.rewarm}",
           "schedule": f"-{a.handover}"}[kind] + (f"-probed{a.switch}" if kind == "plain" and a.study == "switch" else "")
    slug = re.sub(r"[^a-z0-9.=,]+", "_", f"{kind}-{name}-{steps}-seed{seed}{tag}".lower())
    return ROOT / "benchmarks/runs/handover" / f"{a.student}-{a.prior}" / f"{slug}.json"


def run(a, data, unit) -> dict:
    """One of this study's runs: the harness's run of its recipe (:func:`recipe_of`), kept under this study's name."""
    return harness.run_unit(a.recipe, data, recipe_of(a, unit), ROOT / "benchmarks/runs/handover", a.cache,
                            path=unit_file(a, unit), label=list(unit))


def analyse(a, runs: dict) -> dict:
    """Per variant (switch study) or schedule and budget: mean top-1 at each probe, the hand-over step, the end."""
    out = {}
    groups: dict[tuple, list] = {}
    for unit, r in runs.items():
        groups.setdefault(unit[:3], []).append(r)
    for (kind, name, steps), rs in groups.items():
        key = f"{kind}:{name}:{steps}" if kind != "plain" else f"plain:{steps}"
        probes = [c["step"] for c in rs[0]["curve"]]
        out[key] = {"steps": steps, "probes": probes,
                    "top1": [mean_sd([r["curve"][i]["top1"] for r in rs]) for i in range(len(probes))],
                    "end": {k: mean_sd([r["curve"][-1][k] for r in rs]) for k in ("top1", "knn_top1", "few_label_top1")},
                    "handover_step": [r.get("handover_step") for r in rs],
                    "lambda_end": [r["lambda_per_step"][-1] if r["lambda_per_step"] else None for r in rs]}
    return out


def tables(result: dict) -> str:
    an, s = result["analysis"], result["settings"]
    seeds = seeds_text(len(s["seeds"]))
    lines = []
    if s["study"] == "switch":
        at = round(s["switch"] * s["steps"])
        v = [k for k in an if k.startswith("variant:")]
        probes = [p for p in an[v[0]]["probes"] if p >= at]
        lines += [f"Top-1 % (linear probe), mean ± sd over {seeds}, from the switch (step {at} of {s['steps']}) on:", "",
                  "| what happens at the switch | " + " | ".join("at the switch" if p == at else f"+{p - at} steps"
                                                             for p in probes) + " |", "|---" * (1 + len(probes)) + "|"]
        for k in v:
            cells = [c for p, c in zip(an[k]["probes"], an[k]["top1"]) if p >= at]
            lines.append(f"| {k.split(':')[1]} | " + " | ".join(mean_sd_text(c) for c in cells) + " |")
        p = an[f"plain:{s['steps']}"]
        plain = dict(zip(p["probes"], p["top1"]))
        lines.append("| plain SSL, no prior | " + " | ".join(f"{plain[q]['mean']:.2f}" if q in plain else ""
                                                           for q in probes) + " |")
    else:
        lines += [f"Mean ± sd over {seeds}:", "",
                  "| run length | schedule | hand-over step (per seed) | top-1 % at the end | kNN % | 100 labels/class % |",
                  "|---:|---|---|---|---|---|"]
        for k, r in sorted(an.items(), key=lambda kv: (kv[1]["steps"], kv[0])):
            name = "plain SSL" if k.startswith("plain") else k.split(":", 1)[1].rsplit(":", 1)[0]
            n = len(r["handover_step"])
            name += f" ({seeds_text(n)})" if n < len(s["seeds"]) else ""
            hand = "" if k.startswith("plain") else ", ".join("never" if h is None else str(h) for h in r["handover_step"])
            e = r["end"]
            lines.append(f"| {r['steps']} | {name} | {hand} | " + " | ".join(
                mean_sd_text(e[q]) for q in ("top1", "knn_top1", "few_label_top1")) + " |")
    return "\n".join(lines)


def figure(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    an, s = result["analysis"], result["settings"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (k, r) in enumerate(sorted(an.items())):
        if k.startswith("plain"):
            continue
        ax.errorbar(r["probes"], [c["mean"] for c in r["top1"]], yerr=[c["sd"] or 0 for c in r["top1"]], marker="o",
                    ms=3, capsize=2, color=f"C{i}", label=k.split(":", 1)[1])
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("linear probe top-1 %")
    ax.set_title(f"{s['student']}: {s['study']}")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> None:
    a = parse_args(argv)
    data = harness.data(a.recipe)
    todo = units(a)
    runs = {}
    for i, unit in enumerate(todo):
        if a.gather:
            if unit_file(a, unit).is_file():
                runs[unit] = json.loads(unit_file(a, unit).read_text())
        elif i % a.worker[1] == a.worker[0]:
            runs[unit] = run(a, data, unit)
    if a.worker[1] > 1:
        print("handover.py: this worker's runs are done; --gather (or the command without --worker) writes the results.")
        return
    missing = [u for u in todo if u not in runs]
    if missing:
        print(f"handover.py: {len(missing)} of {len(todo)} runs not finished: the results hold the others.")
    settings = {k: getattr(a, k) for k in ("study", "student", "prior", "seeds", "steps", "switch", "variants",
                                           "warm_heads", "rewarm", "after", "budgets", "schedules", "handover", "views",
                                           "threads")}
    result = {"command": "python benchmarks/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "complete": not missing, "settings": settings, "recipe": harness.recipe_settings(a.recipe), "analysis": analyse(a, runs),
              "runs": {"-".join(map(str, u)): r for u, r in runs.items()}}
    write_results(a.out, result, per_seed=["runs.*.curve", "analysis.*.end.top1.per_seed"])
    figure(result, Path(a.out).with_suffix(".png"))
    print(tables(result))


if __name__ == "__main__":
    main()
