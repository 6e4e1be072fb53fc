"""Targets for the view in the demo's recipe: the whole image's target for every crop, against each crop's target
pooled from the prior's stored feature map, at the demo's budget; accuracy and the speed-up over plain BYOL.

The recipe is the demo's (``accelerate_ssl/demo.py``: 20k Fashion-MNIST images, ConvNet 16/32/64, BYOL, batch 128,
AdamW 1e-3, ``switch`` planned for the budget, weak one-view steps while lambda = 1, 16 components, least-squares head,
its prior ``shipped:digits-byol``; linear probe on the 10k test images). Variants, one run per seed each:

* ``plain``: plain BYOL, ``--full-steps`` (the curve the speed-ups are read from);
* ``whole``: ReLA on a store of the prior's pooled rows (its output for the whole clean image): today's default;
* ``whole-map``: ReLA on a spatial store of the same prior (its 3x3 feature map of the clean image, every channel),
  every view given the map's mean (the whole image's target, from the map);
* ``per-view``: the same spatial store, each view's target pooled from the map over the view's crop box (RoIAlign,
  mirrored for a flip): ``train_ssl(per_view=True)``, which hands ``rela.wrap(..., geometry=)`` the views' boxes.

``whole`` against ``whole-map`` isolates the store; ``whole-map`` against ``per-view`` the pooling. Every unit is one
JSON under ``--cache`` when it ends (rerun to resume); costs are each run's own (CPU and wall seconds), every
store's precompute counted.

    nice -n 5 python benchmarks/per_view.py           # 3 seeds (~25 min at one thread)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from accelerate_ssl.atomic import atomic_write_json  # noqa: E402
from accelerate_ssl.results import save_figure, write_results  # noqa: E402

VARIANTS = ("whole", "whole-map", "per-view")
LABEL = {"plain": "plain BYOL", "whole": "whole image (pooled rows)", "whole-map": "whole image (map mean)",
         "per-view": "pooled per view"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--budget", type=int, default=250)
    p.add_argument("--full-steps", type=int, default=1000)
    p.add_argument("--plain-probes", type=int, nargs="+", default=[0, 125, 250, 375, 500, 625, 750, 875, 1000])
    p.add_argument("--train-size", type=int, default=20000)
    p.add_argument("--test-size", type=int, default=10000)
    p.add_argument("--probe-epochs", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/per_view"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/per_view.json"))
    return p.parse_args(argv)


def settings(a) -> dict:
    return {k: getattr(a, k) for k in ("budget", "full_steps", "plain_probes", "train_size", "test_size",
                                       "probe_epochs", "threads")}


def stores(a, r) -> dict:
    """The prior's two stores over the training images (pooled rows; its map, every channel), each precompute timed."""
    from accelerate_ssl.data import FashionMNIST
    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.targets.precompute import precompute_targets
    from accelerate_ssl.targets.store import TargetStore

    out = {}
    for kind, spatial in (("rows", False), ("map", True)):
        folder = Path(a.cache) / f"store-{kind}-{a.train_size}"
        memo = folder.with_suffix(".json")
        if not memo.is_file():
            train = FashionMNIST("train", limit=a.train_size)
            t, c = time.perf_counter(), time.process_time()
            precompute_targets(create_prior(r.prior), train, folder, progress=True, spatial=spatial)
            atomic_write_json(memo, {"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c})
        import json

        out[kind] = (TargetStore.open(folder), json.loads(memo.read_text()))
    return out


def run_unit(a, unit: tuple) -> dict:
    from accelerate_ssl.demo import train_byol
    from accelerate_ssl.recipes import Probe
    from several_priors import data, recipe

    torch.set_num_threads(a.threads)
    r = recipe(a)
    train, tensors = data(a)
    kind, seed = unit
    probe = Probe(*tensors, epochs=a.probe_epochs, seed=seed)
    if kind == "plain":
        return train_byol(r, train, probe, a.full_steps, a.plain_probes, desc=f"plain {seed}", seed=seed)
    store, _ = stores(a, r)["rows" if kind == "whole" else "map"]
    out = train_byol(r, train, probe, a.budget, [a.budget], store=store, seed=seed, desc=f"{kind} {seed}",
                     per_view=kind == "per-view")
    lam = out.pop("lambda_per_step")
    out["switch_step"] = next((i for i, v in enumerate(lam) if v < 1.0), None)
    return out


def analyse(a, done: dict, precompute: dict) -> dict:
    from accelerate_ssl.demo import _summarise

    per_seed = {v: [_summarise(s, done[("plain", s)], done[(v, s)], a.budget, precompute["rows" if v == "whole" else "map"])
                    for s in a.seeds] for v in VARIANTS}

    def stats(xs):
        return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0, "seeds": xs}

    plain_final = [done[("plain", s)]["curve"][-1]["top1"] for s in a.seeds]
    out = {"plain_final": stats(plain_final),
           "plain_at_budget": stats([p["plain_top1_at_budget"] for p in per_seed["whole"]])}
    for v, rows in per_seed.items():
        out[v] = {"top1": stats([p["rela_top1"] for p in rows]),
                  "speedup_steps": stats([p["speedup"]["speedup"] for p in rows]),
                  "speedup_wall": stats([p["speedup_wall"]["speedup"] for p in rows]),
                  "speedup_cpu": stats([p["speedup_cpu"]["speedup"] for p in rows]),
                  "lower_bound": any(p[k]["lower_bound"] for p in rows for k in ("speedup", "speedup_wall", "speedup_cpu")),
                  "step_cpu_ratio": stats([p["step_cpu_ratio"] for p in rows]),
                  "switch_step": [done[(v, s)]["switch_step"] for s in a.seeds]}
    for v in ("whole-map", "per-view"):
        base = "whole" if v == "whole-map" else "whole-map"
        diff = [x - y for x, y in zip(out[v]["top1"]["seeds"], out[base]["top1"]["seeds"])]
        out[v]["minus_" + base] = stats(diff)
    return out


def table(res: dict) -> str:
    an = res["analysis"]
    lines = ["| targets | top-1 % at the budget (mean ± sd) | vs the row before, points (sd of the difference) | "
             "speed-up: steps | wall-clock | CPU time | CPU per step / plain |", "|---|---|---|---|---|---|---|"]
    for v in VARIANTS:
        r = an[v]
        prev = next((r[k] for k in r if k.startswith("minus_")), None)
        lines.append(f"| {LABEL[v]} | {r['top1']['mean']:.2f} ± {r['top1']['sd']:.2f} | "
                     + (f"{prev['mean']:+.2f} ({prev['sd']:.2f})" if prev else "") + " | "
                     + " | ".join(f"{r[k]['mean']:.2f}x ± {r[k]['sd']:.2f}" for k in ("speedup_steps", "speedup_wall",
                                                                                   "speedup_cpu"))
                     + f" | {r['step_cpu_ratio']['mean']:.2f} |")
    lines.append(f"\nPlain BYOL: {an['plain_at_budget']['mean']:.2f} ± {an['plain_at_budget']['sd']:.2f} % at the budget, "
                 f"{an['plain_final']['mean']:.2f} ± {an['plain_final']['sd']:.2f} % at its end. Precompute: pooled rows "
                 f"{res['precompute']['rows']['cpu_seconds']:.0f} CPU s, map {res['precompute']['map']['cpu_seconds']:.0f} "
                 f"CPU s; map store {res['bytes_per_image']['map']} bytes per image, pooled rows "
                 f"{res['bytes_per_image']['rows']}.")
    return "\n".join(lines)


def figure(res: dict, done: dict, a, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = [c["step"] for c in done[("plain", a.seeds[0])]["curve"]]
    curves = [[c["top1"] for c in done[("plain", s)]["curve"]] for s in a.seeds]
    ax.plot(steps, [statistics.fmean(x) for x in zip(*curves)], marker="o", label=LABEL["plain"], color="0.4")
    for i, v in enumerate(VARIANTS):
        r = res["analysis"][v]["top1"]
        ax.errorbar([a.budget + (i - 1) * 12], [r["mean"]], yerr=[r["sd"]], fmt="s", capsize=3, label=LABEL[v])
    ax.set(xlabel="optimiser step", ylabel="linear probe top-1 %",
           title=f"Targets for the view, demo recipe, {len(a.seeds)} seeds (mean ± sd)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    import json

    a = parse_args(argv)
    Path(a.cache).mkdir(parents=True, exist_ok=True)
    units = [(k, s) for s in a.seeds for k in ("plain", *VARIANTS)]
    done = {}
    for u in units:
        f = Path(a.cache) / f"{u[0]}-{u[1]}.json"
        r = json.loads(f.read_text()) if f.is_file() else None
        if r is None or r.get("settings") != settings(a):
            load = os.getloadavg()
            r = {**run_unit(a, u), "settings": settings(a), "load_average_start": load,
                 "load_average_end": os.getloadavg()}
            atomic_write_json(f, r, indent=1)
        done[u] = r
    from several_priors import recipe

    opened = stores(a, recipe(a))
    precompute = {k: v[1] for k, v in opened.items()}
    res = {"command": "python benchmarks/per_view.py " + " ".join(sys.argv[1:]),
           "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform(),
                       "cpu_capability": torch.backends.cpu.get_cpu_capability()},
           "settings": {**settings(a), "seeds": a.seeds, "prior": recipe(a).prior},
           "precompute": precompute,
           "bytes_per_image": {k: int((v[0].path / "targets.npy").stat().st_size // len(v[0])) for k, v in opened.items()},
           "spatial": {k: v for k, v in opened["map"][0].spatial.items() if k != "fit_images"},
           "analysis": analyse(a, done, precompute)}
    res["table"] = table(res)
    write_results(Path(a.out), res, root=ROOT)
    figure(res, done, a, Path(a.out).with_suffix(".png"))
    print(res["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
