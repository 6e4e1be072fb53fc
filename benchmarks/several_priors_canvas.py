"""Several priors at once on the head-to-head benchmark: each prior alone against both together, with and without the
standardisation of the rows, from runs of ``head_to_head.py`` (one runs folder per setting).

Each setting is one ``head_to_head.py --methods cached`` invocation with its own ``--runs`` folder (same seeds, steps
and probes as the plain runs it is compared with); this script reads their finished units, the plain runs' folder,
and each folder's ``timing-0.json`` (the steps of that setting timed side by side with plain steps), and writes the
table, JSON and PNG. Clock: plain's final accuracy reached, in side-by-side seconds, each setting's precompute of
every prior it uses counted::

    T=checkpoint:benchmarks/teachers/canvas48-supervised.safetensors; B=shipped:fashion-mnist-byol-20k
    A="--methods cached --seeds 0 1 2 --steps 3000 --probes 0 250 500 1000 2000 3000"
    python benchmarks/head_to_head.py $A --runs RUNS/both --prior $T $B           # both, standardised (default)
    python benchmarks/head_to_head.py $A --runs RUNS/both-raw --prior $T $B --raw # both, the rows as written
    python benchmarks/head_to_head.py $A --runs RUNS/byol --prior $B              # the shipped prior alone
    python benchmarks/head_to_head.py $A --runs RUNS/byol-raw --prior $B --raw
    python benchmarks/several_priors_canvas.py --plain H2H_RUNS --setting "teacher alone=H2H_RUNS" \\
        --setting "BYOL prior alone=RUNS/byol" ... --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accelerate_ssl.recipes import steps_to_reach  # noqa: E402
from accelerate_ssl.results import save_figure, write_results  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plain", required=True, help="runs folder holding plain-<seed>.json")
    p.add_argument("--setting", action="append", required=True, metavar="LABEL=FOLDER",
                   help="a runs folder holding cached-<seed>.json and timing-0.json (repeat)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/several_priors_canvas.json"))
    return p.parse_args(argv)


def stats(xs: list) -> dict:
    xs = [x for x in xs if x is not None]
    return {"mean": statistics.fmean(xs) if xs else None, "sd": statistics.stdev(xs) if len(xs) > 1 else None,
            "n": len(xs)}


def load(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def analyse(a) -> dict:
    plain = {s: load(Path(a.plain), f"plain-{s}.json") for s in a.seeds}
    final = {s: plain[s]["curve"][-1]["top1"] for s in a.seeds}
    steps = plain[a.seeds[0]]["settings"]["steps"]
    out = {"plain": {"final": stats(list(final.values())), "steps": steps,
                     "device": plain[a.seeds[0]]["settings"].get("device", "cpu"),
                     "curve": {str(c["step"]): stats([plain[s]["curve"][i]["top1"] for s in a.seeds])
                               for i, c in enumerate(plain[a.seeds[0]]["curve"])}},
           "settings": {}}
    for spec in a.setting:
        label, folder = spec.split("=", 1)
        folder = Path(folder)
        runs = {s: load(folder, f"cached-{s}.json") for s in a.seeds}
        timing = load(folder, "timing-0.json")
        med = {k: v["median_step_seconds"] for k, v in timing["kinds"].items()}
        settings = runs[a.seeds[0]]["settings"]
        train_size = settings["train_size"]
        plain_seconds = steps * med["plain"]
        reach, speedup = [], []
        for s in a.seeds:
            curve = [(c["step"], c["top1"]) for c in runs[s]["curve"]]
            k = steps_to_reach(curve, final[s])
            reach.append(k)
            lam = runs[s]["lambda_per_step"]
            if k is None:
                speedup.append(None)
                continue
            cost = timing["precompute_seconds_per_image"] * train_size + sum(
                med["cached"] if v >= 1.0 else med["plain"] for v in lam[:int(round(k))])
            speedup.append(plain_seconds / cost)
        out["settings"][label] = {
            "folder": folder.name, "prior": settings["prior"], "raw": settings.get("raw", False),
            "device": settings.get("device", "cpu"),
            "curve": {str(c["step"]): stats([runs[s]["curve"][i]["top1"] for s in a.seeds])
                      for i, c in enumerate(runs[a.seeds[0]]["curve"])},
            "steps_to_plain_final": reach, "speedup_side_by_side": speedup,
            "speedup_geomean": (statistics.geometric_mean(speedup) if all(speedup) else None),
            "cached_step_over_plain_step": med["cached"] / med["plain"],
            "switch_steps": [next((i for i, v in enumerate(runs[s]["lambda_per_step"]) if v < 1.0), None)
                             for s in a.seeds]}
    return out


def table(res: dict) -> str:
    an = res["analysis"]
    probes = list(next(iter(an["settings"].values()))["curve"])
    head = " | ".join(f"step {p}" for p in probes[1:])
    lines = [f"| setting | rows | run on | {head} | steps to plain's final (seeds) | speed-up, side by side | "
             "cached step / plain |", "|---|---|---|" + "---|" * (len(probes) - 1) + "---|---|---|"]
    plain = an["plain"]["curve"]
    lines.append(f"| plain VICReg | | {an['plain']['device']} | " + " | ".join(
        f"{plain[p]['mean']:.2f} ± {plain[p]['sd']:.2f}" if p in plain else "" for p in probes[1:]) + " | | 1.00x | 1.00 |")
    for label, r in an["settings"].items():
        c = r["curve"]
        reach = ", ".join("–" if k is None else f"{k:.0f}" for k in r["steps_to_plain_final"])
        sp = "not reached by every seed" if r["speedup_geomean"] is None else (
            f"{r['speedup_geomean']:.2f}x ({', '.join(f'{x:.1f}' for x in r['speedup_side_by_side'])})")
        lines.append(f"| {label} | {'as written' if r['raw'] else 'standardised'} | {r['device']} | "
                     + " | ".join(f"{c[p]['mean']:.2f} ± {c[p]['sd']:.2f}" for p in probes[1:])
                     + f" | {reach} | {sp} | {r['cached_step_over_plain_step']:.2f} |")
    lines.append(f"\nPlain VICReg's final accuracy: {an['plain']['final']['mean']:.2f} ± {an['plain']['final']['sd']:.2f} % "
                 f"({an['plain']['steps']} steps).")
    return "\n".join(lines)


def figure(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    an = res["analysis"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for label, curve, style in [("plain VICReg", an["plain"]["curve"], "k-")] + [
            (k, v["curve"], "--" if v["raw"] else "-") for k, v in an["settings"].items()]:
        x = [int(s) for s in curve]
        ax.errorbar(x, [curve[s]["mean"] for s in curve], yerr=[curve[s]["sd"] or 0 for s in curve], fmt=style,
                    marker="o", ms=3, capsize=2, label=label + ("" if style != "--" else " (rows as written)"))
    ax.set(xlabel="optimiser step", ylabel="linear probe top-1 % (test scenes)",
           title="Several priors on the head-to-head benchmark (mean ± sd over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> int:
    a = parse_args(argv)
    res = {"command": "python benchmarks/several_priors_canvas.py " + " ".join(sys.argv[1:]), "seeds": a.seeds,
           "analysis": analyse(a)}
    res["table"] = table(res)
    write_results(Path(a.out), res, root=ROOT)
    figure(res, Path(a.out).with_suffix(".png"))
    print(res["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
