"""What a prior is worth: ReLA's speed-up over plain BYOL for five priors of increasing strength.

On real Fashion-MNIST (the demo's recipe: 20k train images, a 16/32/64 GroupNorm ConvNet student,
batch 128, AdamW 1e-3, linear probe on 10k test images), for every prior of the ladder and every seed:

* **plain BYOL** for the full budget (``--full-steps``), probed at enough steps to interpolate its
  accuracy-vs-steps and accuracy-vs-seconds curves;
* **BYOL + ReLA** (the demo's defaults: ``switch`` planned for the run, weak views, 16 PCA components,
  least-squares head) for 10, 20 and 50 % of that budget, one run per budget (the schedule is planned
  for the run's own length), probed at its end;
* **an online teacher**: the same prior used the way online distillation uses it, a teacher forward on
  every augmented view at every step, the same linear head (least-squares start), PCA and cosine loss,
  probed along the way, so its accuracy at ReLA's wall-clock can be read off.

Speed-up in steps = steps plain BYOL needs to reach the ReLA student's accuracy / ReLA's steps (">N"
where plain never gets there within the full budget). Speed-up in compute = plain's training seconds
to that accuracy / (ReLA's training seconds + the one-time target precompute), every time measured in
this run on this machine. Each prior's own training cost (from its training record) is reported
beside it: the cost that reusing the prior amortises.

Every unit of work (one run of one seed) is written to ``--runs`` when it ends, so an interrupted
study resumes where it stopped (rerun the same command); ``--jobs 2`` runs two units at a time, one
CPU thread each. Output: ``benchmarks/results/prior_strength.json`` and ``prior_strength.png``.

    .venv/bin/python benchmarks/prior_strength.py --jobs 2
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
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from accelerate_ssl.atomic import atomic_write_json  # noqa: E402
from accelerate_ssl.recipes import mean_run, steps_to_reach  # noqa: E402
from accelerate_ssl.results import write_results  # noqa: E402

#: the ladder: name -> (prior spec, where its training record lives, what it is)
LADDER: dict[str, tuple[str, str | None, str]] = {
    "random": ("random:convnet", None, "random initialisation (ConvNet 64/128/256, never trained)"),
    "byol-1k": ("shipped:fashion-mnist-byol", "benchmarks/results/train_demo_prior.json",
                "BYOL, 1000 steps on unlabelled Fashion-MNIST (the shipped default)"),
    "byol-20k": ("shipped:fashion-mnist-byol-20k", "benchmarks/prior_runs/byol_convnet_long/train_20k.json",
                 "BYOL, 20,000 steps on unlabelled Fashion-MNIST"),
    "digits": ("shipped:digits-byol", "benchmarks/prior_runs/digits_byol/train.json",
               "BYOL on scikit-learn digits (other data)"),
    "supervised": ("shipped:fashion-mnist-supervised", "benchmarks/prior_runs/supervised_convnet/train.json",
                   "trained WITH Fashion-MNIST labels (stand-in for a public labelled model)"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--priors", nargs="+", default=list(LADDER), choices=list(LADDER), help="rungs of the ladder to run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--full-steps", type=int, default=1000, help="plain BYOL's full budget in optimiser steps (default 1000)")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2, 0.5],
                   help="ReLA budgets as fractions of the full budget (default 0.1 0.2 0.5)")
    p.add_argument("--plain-probes", type=int, nargs="+", default=[0, 50, 100, 150, 200, 300, 400, 500, 650, 800, 1000],
                   help="steps at which plain BYOL is probed (the full budget is always included)")
    p.add_argument("--online-probes", type=int, nargs="+", default=[25, 50, 100, 150, 200, 300],
                   help="steps at which the online-teacher run is probed (its length is the largest)")
    p.add_argument("--no-online", action="store_true", help="skip the online-teacher runs")
    p.add_argument("--views", type=int, nargs="*", default=[1, 2, 4],
                   help="stored views per image to compare (accelerate_ssl.data.views; 1: the clean image); none: skip")
    p.add_argument("--views-prior", default="byol-20k", choices=list(LADDER), help="the prior of the stored-views runs")
    p.add_argument("--views-fraction", type=float, default=0.2, help="budget of the stored-views runs (default 0.2)")
    p.add_argument("--train-size", type=int, default=20000)
    p.add_argument("--test-size", type=int, default=10000)
    p.add_argument("--probe-epochs", type=int, default=30)
    p.add_argument("--jobs", type=int, default=1, help="units run at a time, one CPU thread each (default 1)")
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/prior_strength"),
                   help="target stores (made once per prior, re-used)")
    p.add_argument("--runs", default=str(ROOT / "benchmarks/prior_runs/prior_strength"),
                   help="one small JSON per finished run (the study resumes from here; committed)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/prior_strength.json"))
    args = p.parse_args(argv)
    for name in ("full_steps", "train_size", "test_size", "probe_epochs", "jobs"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if any(not 0 < f <= 1 for f in args.fractions):
        p.error(f"--fractions must lie in (0, 1], got {args.fractions}")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds must be distinct, got {args.seeds}")
    args.plain_probes = sorted({s for s in args.plain_probes if 0 <= s <= args.full_steps} | {0, args.full_steps})
    args.budgets = sorted({max(1, round(f * args.full_steps)) for f in args.fractions})
    args.views_budget = max(1, round(args.views_fraction * args.full_steps))
    if args.views and args.views_prior not in args.priors:
        p.error(f"--views-prior {args.views_prior} is not among --priors {args.priors}")
    if any(k < 1 for k in args.views):
        p.error(f"--views must be >= 1, got {args.views}")
    return args


# ---------------------------------------------------------------------------------------------- one worker
_DATA: dict = {}


def _recipe_args(args, budget: int) -> argparse.Namespace:
    """The demo's settings (its parser's defaults) for a run of ``budget`` steps."""
    from accelerate_ssl.demo import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    recipe = parser.parse_args([])
    recipe.budget = budget
    recipe.train_size, recipe.test_size, recipe.probe_epochs = args.train_size, args.test_size, args.probe_epochs
    return recipe


def _data(args):
    """Train set (uint8 tensors per item), probe tensors: loaded once per worker process."""
    if "train" not in _DATA:
        from accelerate_ssl.data import FashionMNIST
        from accelerate_ssl.demo import _uint8_tensor
        from accelerate_ssl.recipes import images_to_tensor

        train = FashionMNIST("train", limit=args.train_size)
        test = FashionMNIST("test", limit=args.test_size)
        _DATA["probe_tensors"] = (images_to_tensor(train.data), train.targets, images_to_tensor(test.data), test.targets)
        train.transform = _uint8_tensor
        _DATA["train"] = train
    return _DATA["train"], _DATA["probe_tensors"]


def _probe(args, seed: int):
    from accelerate_ssl.recipes import Probe

    _, (trx, try_, tex, tey) = _data(args)
    return Probe(trx, try_, tex, tey, epochs=args.probe_epochs, seed=seed)


def _store_dir(args, prior: str, views: int | None = None) -> Path:
    return Path(args.cache) / "targets" / (f"{prior}-{args.train_size}" + (f"-views{views}" if views else ""))


def _replay(args, views):
    """The training images as stored views (raw PIL in, the recipe's uint8 tensors out)."""
    from accelerate_ssl.data import FashionMNIST, ReplayViews
    from accelerate_ssl.demo import _uint8_tensor

    return ReplayViews(FashionMNIST("train", limit=args.train_size), views, transform=_uint8_tensor)


class TeacherOnViews(torch.nn.Module):
    """The prior applied to the recipe's normalised images, in the prior's own normalisation (as at precompute)."""

    def __init__(self, prior, mean, std):
        super().__init__()
        from accelerate_ssl.recipes.views import FASHION_MNIST_MEAN, FASHION_MNIST_STD

        self.prior, self.shift = prior, (FASHION_MNIST_MEAN, FASHION_MNIST_STD)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, x):
        raw = x * self.shift[1] + self.shift[0]
        return self.prior((raw - self.mean) / self.std)


class OnlineTeacher(torch.nn.Module):
    """Online distillation as a method of the recipe: every step the teacher embeds the very view the
    student sees (one view); the student's features go through a linear head (least-squares start, as
    ReLA's) and are pulled to the PCA-reduced teacher embedding by the cosine loss (ReLA v2 Eq. 9).
    ``teacher_seconds`` adds up the teacher's share of the steps."""

    n_views = 1

    def __init__(self, backbone, teacher, pca):
        super().__init__()
        self.backbone, self.pca = backbone, pca
        self.head = torch.nn.Linear(backbone.feature_dim, pca.n_components)
        self.teacher = teacher
        self.fitted, self.teacher_seconds = False, 0.0

    def train(self, mode: bool = True):  # the teacher stays frozen in eval mode
        super().train(mode)
        self.teacher.eval()
        return self

    def step_loss(self, features, views, index):
        from accelerate_ssl.rela import fit_transport_head, rela_loss

        t = time.perf_counter()
        with torch.no_grad():  # the teacher sees the very view, in its own normalisation
            target = self.pca.transform(self.teacher(views[0]))
        self.teacher_seconds += time.perf_counter() - t
        if not self.fitted:
            fit_transport_head(self.head, features[0], target)
            self.fitted = True
        return rela_loss(self.head(features[0]), target)

    def update_momentum(self, m: float) -> None:
        return None


def train_online(recipe, train, probe, teacher, pca, steps: int, checkpoints: list[int], seed: int,
                 desc: str) -> dict:
    """Online distillation of ``teacher`` into the student (:class:`OnlineTeacher`) through the recipe's loop,
    on ReLA v1's weak views; seeds, data order, views and initialisation as in
    :func:`accelerate_ssl.demo.train_byol`."""
    from torch.utils.data import DataLoader

    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.recipes import BYOL, WEAK_VIEWS, images_to_tensor, loader_batches, train_ssl

    torch.manual_seed(seed)
    backbone = ConvNet(widths=tuple(recipe.widths))
    BYOL(backbone, backbone.feature_dim)  # same random-number draws as the BYOL runs: same initial backbone
    method = OnlineTeacher(backbone, teacher, pca)
    loader = DataLoader(train, batch_size=recipe.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW([*backbone.parameters(), *method.head.parameters()], lr=recipe.lr, weight_decay=0.01)
    log = train_ssl(method, loader_batches(loader, lambda images: images_to_tensor(images.squeeze(1))), steps,
                    optimizer=opt, view_generator=torch.Generator().manual_seed(seed + 1), views=WEAK_VIEWS,
                    checkpoints=checkpoints, probe=probe, progress=desc,
                    checkpoint_extras=lambda: {"teacher_seconds": method.teacher_seconds})
    return {"curve": log["curve"], "train_seconds": log["train_seconds"], "teacher_seconds": method.teacher_seconds}


def run_unit(args, unit: tuple) -> dict:
    """One run: ``("plain", seed)``, ``("rela", prior, seed, budget)``, ``("online", prior, seed)`` or
    ``("views", k, seed)`` (ReLA on ``k`` stored views per image of ``--views-prior``, the student seeing
    exactly the stored views while lambda == 1)."""
    torch.set_num_threads(1)
    from accelerate_ssl.demo import train_byol
    from accelerate_ssl.targets.store import TargetStore

    train, _ = _data(args)
    kind, seed = unit[0], unit[-2] if unit[0] == "rela" else unit[-1]
    if kind == "views":
        k, store = unit[1], TargetStore.open(_store_dir(args, args.views_prior, unit[1]))
        recipe = _recipe_args(args, args.views_budget)
        recipe.rela_views = "clean"  # the replayed view is the student's input: its target is exactly that view's
        out = train_byol(recipe, _replay(args, store), _probe(args, seed), args.views_budget, [args.views_budget],
                         store=store, desc=f"ReLA views {k} seed {seed}", seed=seed)
        return {"unit": list(unit), "top1": out["curve"][-1]["top1"], "train_seconds": out["train_seconds"],
                "lambda_mean": statistics.fmean(out["lambda_per_step"])}
    if kind == "plain":
        recipe = _recipe_args(args, args.full_steps)
        out = train_byol(recipe, train, _probe(args, seed), args.full_steps, args.plain_probes,
                         desc=f"plain seed {seed}", seed=seed)
        return {"unit": list(unit), "curve": out["curve"], "train_seconds": out["train_seconds"]}
    prior = unit[1]
    store = TargetStore.open(_store_dir(args, prior))
    if kind == "rela":
        budget = unit[3]
        recipe = _recipe_args(args, budget)
        out = train_byol(recipe, train, _probe(args, seed), budget, [budget], store=store,
                         desc=f"ReLA {prior} seed {seed} {budget}", seed=seed)
        end = out["curve"][-1]
        return {"unit": list(unit), "top1": end["top1"], "train_seconds": out["train_seconds"],
                "lambda_end": out["lambda_per_step"][-1], "lambda_mean": statistics.fmean(out["lambda_per_step"])}
    if kind == "online":
        from accelerate_ssl.targets.priors import create_prior

        spec = LADDER[prior][0]
        teacher = create_prior(spec)
        pre = store.metadata["prior"]["preprocess"]
        recipe = _recipe_args(args, max(args.online_probes))
        pca = store.pca(recipe.components)
        out = train_online(recipe, train, _probe(args, seed), TeacherOnViews(teacher, pre["mean"], pre["std"]), pca,
                           max(args.online_probes), args.online_probes, seed, f"online {prior} seed {seed}")
        return {"unit": list(unit), **out}
    raise ValueError(f"unknown unit {unit!r}")


def _unit_file(args, unit: tuple) -> Path:
    return Path(args.runs) / ("_".join(str(u) for u in unit) + ".json")


_COMMON = ("train_size", "test_size", "probe_epochs")
#: the settings each kind of run depends on (its unit names the rest: prior, seed, budget, k)
_DEPENDS = {"plain": _COMMON + ("full_steps", "plain_probes"), "rela": _COMMON, "online": _COMMON + ("online_probes",),
            "views": _COMMON + ("views_prior", "views_budget")}


def _settings_key(args, kind: str | None = None) -> dict:
    """What a run depends on (``kind`` None: everything); a cached run made with other settings is not re-used."""
    names = sorted({n for v in _DEPENDS.values() for n in v}) if kind is None else _DEPENDS[kind]
    return json.loads(json.dumps({k: getattr(args, k) for k in names}))


def _run_and_save(args, unit: tuple) -> dict:
    result = run_unit(args, unit)
    result["settings"] = _settings_key(args, unit[0])
    atomic_write_json(_unit_file(args, unit), result, indent=1)
    return result


# ---------------------------------------------------------------------------------------------- analysis
def interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` (clamped to the ends)."""
    if x <= xs[0]:
        return ys[0]
    for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]):
        if x <= x1:
            return y0 + (x - x0) / (x1 - x0) * (y1 - y0) if x1 > x0 else y1
    return ys[-1]


def speedups(plain_curve: list[dict], acc: float, steps: int, seconds: float) -> dict:
    """Speed-up in steps and in training seconds of a ReLA result (``acc`` after ``steps`` / ``seconds``)."""

    s_steps = [c["step"] for c in plain_curve]
    s_acc = [c["top1"] for c in plain_curve]
    s_sec = [c["train_seconds"] for c in plain_curve]
    reach = steps_to_reach(list(zip(s_steps, s_acc)), acc)
    if reach is None:
        return {"plain_steps_needed": None, "speedup_steps": s_steps[-1] / steps, "speedup_seconds": s_sec[-1] / seconds,
                "lower_bound": True}
    return {"plain_steps_needed": reach, "speedup_steps": reach / steps,
            "speedup_seconds": interpolate(s_steps, s_sec, reach) / seconds, "lower_bound": False}


def _fmt(x: float, lower: bool) -> str:
    return (">" if lower else "") + f"{x:.1f}x"


def analyse(args, units: dict, ladder_info: dict) -> dict:
    plain = {s: units[("plain", s)] for s in args.seeds}
    mean_plain = [{"step": c["step"], "top1": c["top1"], "top1_std": c.get("top1_std", 0.0),
                   "train_seconds": c["train_seconds"]} for c in mean_run([plain[s] for s in args.seeds])["curve"]]
    plain_full = mean_plain[-1]["top1"]
    priors = {}
    for name in args.priors:
        info = ladder_info[name]
        budgets = {}
        for b in args.budgets:
            per_seed = []
            for s in args.seeds:
                r = units[("rela", name, s, b)]
                seconds = r["train_seconds"] + info["precompute_seconds"]
                per_seed.append({"seed": s, "top1": r["top1"], "train_seconds": r["train_seconds"],
                                 "lambda_end": r["lambda_end"], "lambda_mean": r["lambda_mean"],
                                 "plain_top1_same_steps": interpolate([c["step"] for c in plain[s]["curve"]],
                                                                      [c["top1"] for c in plain[s]["curve"]], b),
                                 **speedups(plain[s]["curve"], r["top1"], b, seconds)})
            acc = statistics.fmean(p["top1"] for p in per_seed)
            seconds = statistics.fmean(p["train_seconds"] for p in per_seed)
            mean = speedups(mean_plain, acc, b, seconds + info["precompute_seconds"])
            budgets[str(b)] = {"steps": b, "fraction": b / args.full_steps, "top1": acc,
                               "top1_std": statistics.pstdev(p["top1"] for p in per_seed),
                               "train_seconds": seconds, "beats_plain_full_budget": acc >= plain_full,
                               **mean, "per_seed": per_seed}
        entry = {**info, "budgets": budgets}
        if not args.no_online:
            entry["online"] = online_comparison(args, units, name, budgets, info)
        priors[name] = entry
    views = {}
    for k in args.views:
        runs = [units[("views", k, s)] for s in args.seeds]
        views[str(k)] = {"views_per_image": k, **ladder_info[f"views{k}"],
                         "top1": statistics.fmean(r["top1"] for r in runs),
                         "top1_std": statistics.pstdev(r["top1"] for r in runs),
                         "train_seconds": statistics.fmean(r["train_seconds"] for r in runs),
                         "seconds_per_step": statistics.fmean(r["train_seconds"] for r in runs) / args.views_budget,
                         "per_seed": [{"seed": s, "top1": r["top1"], "train_seconds": r["train_seconds"]}
                                      for s, r in zip(args.seeds, runs)]}
        if not args.no_online:
            o_runs = [units[("online", args.views_prior, s)] for s in args.seeds]
            o_step = statistics.fmean(r["train_seconds"] / max(args.online_probes) for r in o_runs)
            views[str(k)]["step_time_ratio_to_online"] = views[str(k)]["seconds_per_step"] / o_step
            per_seed = views[str(k)]["per_seed"]
            views[str(k)]["online_top1_at_equal_train_seconds"] = _online_at(units, o_runs, per_seed, 0.0)
            views[str(k)]["online_top1_at_equal_seconds_with_precompute"] = _online_at(
                units, o_runs, per_seed, ladder_info[f"views{k}"]["precompute_seconds"])
    if views:
        b = str(args.views_budget)
        ref = priors.get(args.views_prior, {})
        views = {"prior": args.views_prior, "steps": args.views_budget, "by_k": views,
                 "weak_views_on_clean_targets_top1": ref.get("budgets", {}).get(b, {}).get("top1"),
                 "online_top1_at_equal_train_seconds": ref.get("online", {}).get("budgets", {}).get(b, {}).get(
                     "online_top1_at_equal_train_seconds")}
    smallest = min(args.budgets)
    strongest = max(priors, key=lambda n: priors[n]["probe_top1"])
    at_smallest = priors[strongest]["budgets"][str(smallest)]
    goals = {"strongest_prior": strongest,
             "strongest_prior_at_smallest_budget_reaches_plain_full_budget": {
                 "budget_steps": smallest, "rela_top1": at_smallest["top1"], "plain_full_budget_top1": plain_full,
                 "pass": at_smallest["top1"] >= plain_full}}
    online = [(n, b, p["online"]["budgets"][b]) for n, p in priors.items() if "online" in p for b in p["online"]["budgets"]]
    if online:
        goals["rela_step_at_most_0.6x_online_step"] = {
            f"{n}@{b}": {"ratio": o["step_time_ratio"], "pass": o["step_time_ratio"] <= 0.6} for n, b, o in online}
        goals["rela_at_least_online_at_equal_wall_clock"] = {
            f"{n}@{b}": {"rela": o["rela_top1"], "online": o["online_top1_at_equal_train_seconds"],
                         "pass": o["rela_top1"] >= o["online_top1_at_equal_train_seconds"]}
            for n, b, o in online if o["online_top1_at_equal_train_seconds"] is not None}
    return {"goals": goals, "stored_views": views, "plain": {"mean_curve": mean_plain, "per_seed": {str(s): plain[s]["curve"] for s in args.seeds},
                      "full_budget_top1": plain_full},
            "priors": priors}


def _online_at(units: dict, runs: list, per_seed: list, extra_seconds: float):
    """Mean online-teacher accuracy at each seed's ReLA time (+ ``extra_seconds``); None when any online run
    stopped before that time (it is then not compared, rather than read off its last probe)."""
    accs = []
    for r, p in zip(runs, per_seed):
        seconds = p["train_seconds"] + extra_seconds
        xs = [0.0] + [c["train_seconds"] for c in r["curve"]]
        if seconds > xs[-1]:
            return None
        ys = [units[("plain", p["seed"])]["curve"][0]["top1"]] + [c["top1"] for c in r["curve"]]
        accs.append(interpolate(xs, ys, seconds))
    return statistics.fmean(accs)


def online_comparison(args, units: dict, name: str, budgets: dict, info: dict) -> dict:
    """Per-step time ratio (ReLA / online) and the online run's accuracy at ReLA's wall-clock, per budget, mean
    over seeds: at ReLA's training time (the store re-used, as across runs) and with the precompute added."""
    runs = [units[("online", name, s)] for s in args.seeds]
    online_step = statistics.fmean(r["train_seconds"] / max(args.online_probes) for r in runs)
    teacher_share = statistics.fmean(r["teacher_seconds"] / r["train_seconds"] for r in runs)
    out = {"seconds_per_step": online_step, "teacher_share_of_step": teacher_share, "budgets": {}}
    for key, b in budgets.items():
        rela_step = b["train_seconds"] / b["steps"]
        out["budgets"][key] = {
            "rela_seconds_per_step": rela_step, "step_time_ratio": rela_step / online_step, "rela_top1": b["top1"],
            "online_top1_at_equal_train_seconds": _online_at(units, runs, b["per_seed"], 0.0),
            "online_top1_at_equal_seconds_with_precompute": _online_at(units, runs, b["per_seed"],
                                                                      info["precompute_seconds"])}
    out["curve"] = [{"step": c["step"], "top1": c["top1"], "train_seconds": c["train_seconds"]}
                    for c in mean_run(runs)["curve"]]
    return out


def table(result: dict, budgets: list[int]) -> str:
    head = ("| prior | its probe % | its training | " + " | ".join(f"ReLA @{b} steps %" for b in budgets)
            + " | " + " | ".join(f"speed-up @{b} (steps / time)" for b in budgets) + " |")
    lines = [head, "|" + "---|" * (3 + 2 * len(budgets))]
    for name, p in result["priors"].items():
        cost = "none" if not p["training_seconds"] else f"{p['training_steps']} steps, {p['training_seconds'] / 60:.0f} min"
        accs = [f"{p['budgets'][str(b)]['top1']:.2f} ± {p['budgets'][str(b)]['top1_std']:.2f}" for b in budgets]
        sps = []
        for b in budgets:
            e = p["budgets"][str(b)]
            sps.append(f"{_fmt(e['speedup_steps'], e['lower_bound'])} / {_fmt(e['speedup_seconds'], e['lower_bound'])}")
        lines.append(f"| {name} | {p['probe_top1']:.2f} | {cost} | " + " | ".join(accs) + " | " + " | ".join(sps) + " |")
    return "\n".join(lines)


def write_png(result: dict, path: Path, budgets: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from accelerate_ssl.results import save_figure

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, b in enumerate(budgets):
        xs, ys, lower = [], [], []
        for name, p in result["priors"].items():
            e = p["budgets"][str(b)]
            xs.append(p["probe_top1"])
            ys.append(e["speedup_steps"])
            lower.append(e["lower_bound"])
            ax.annotate(name, (p["probe_top1"], e["speedup_steps"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.plot(xs, ys, "o", color=f"C{i}", label=f"ReLA at {b} steps")
        for x, y, lo in zip(xs, ys, lower):
            if lo:
                ax.annotate("", (x, y * 1.25), (x, y), arrowprops={"arrowstyle": "->", "color": f"C{i}"})
    ax.axhline(1, color="gray", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("prior's own linear-probe top-1 (%)")
    ax.set_ylabel("speed-up in steps over plain BYOL (arrow: lower bound)")
    ax.set_title("Speed-up vs prior strength (mean of seeds)", fontsize=10)
    ax.legend(fontsize=8)
    mc = result["plain"]["mean_curve"]
    ax2.errorbar([c["step"] for c in mc], [c["top1"] for c in mc], yerr=[c["top1_std"] for c in mc], fmt="k-o",
                 ms=3, capsize=2, label="plain BYOL")
    for j, (name, p) in enumerate(result["priors"].items()):
        ax2.errorbar(budgets, [p["budgets"][str(b)]["top1"] for b in budgets],
                     yerr=[p["budgets"][str(b)]["top1_std"] for b in budgets], fmt="s--", ms=4, capsize=2,
                     color=f"C{j}", label=f"ReLA, {name} prior")
    ax2.set_xlabel("training steps")
    ax2.set_ylabel("linear-probe top-1 (%)")
    ax2.set_title("Accuracy vs steps (Fashion-MNIST, 20k images)", fontsize=10)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------- main
def ladder_info(args, name: str, precompute_seconds: float) -> dict:
    spec, record, what = LADDER[name]
    steps = seconds = None
    if record:
        rec = json.loads((ROOT / record).read_text())
        steps, seconds = rec["steps"], rec["train_seconds"]
    return {"spec": spec, "what": what, "training_steps": steps, "training_seconds": seconds,
            "training_record": record, "precompute_seconds": precompute_seconds}


def prepare_targets(args, name: str) -> dict:
    """The prior's target store over the training images (timed; re-used when it exists) and its own probe."""
    from accelerate_ssl.targets.precompute import precompute_targets
    from accelerate_ssl.targets.priors import create_prior
    from accelerate_ssl.targets.store import TargetStore

    torch.set_num_threads(1)
    memo = Path(args.cache) / "targets" / f"{name}-{args.train_size}.json"
    if memo.is_file() and (_store_dir(args, name) / "metadata.json").is_file():
        return json.loads(memo.read_text())
    from accelerate_ssl.data import FashionMNIST

    train = FashionMNIST("train", limit=args.train_size)
    prior = create_prior(LADDER[name][0])
    t = time.perf_counter()
    precompute_targets(prior, train, _store_dir(args, name), progress=True, command=f"prior_strength.py ({name})")
    seconds = time.perf_counter() - t
    store = TargetStore.open(_store_dir(args, name))
    pre = store.metadata["prior"]["preprocess"]
    # the prior's own linear probe, by the students' protocol (same images, same probe)
    probe = _probe(args, 0)(TeacherOnViews(prior, pre["mean"], pre["std"]))
    info = {"precompute_seconds": seconds, "probe_top1": probe, "store_bytes": store.metadata.get("file_bytes"),
            "probe_protocol": f"frozen prior features, {args.train_size} train -> {args.test_size} test, "
                              f"{args.probe_epochs} epochs (the students' protocol)"}
    atomic_write_json(memo, info, indent=1)
    return info


def prepare_views(args, k: int) -> dict:
    """A store of ``k`` views per training image for ``--views-prior`` (timed, re-used when it exists)."""
    from accelerate_ssl.data import StoredViews
    from accelerate_ssl.targets.precompute import precompute_targets
    from accelerate_ssl.targets.priors import create_prior

    torch.set_num_threads(1)
    path = _store_dir(args, args.views_prior, k)
    memo = path.with_suffix(".json")
    if memo.is_file() and (path / "metadata.json").is_file():
        return json.loads(memo.read_text())
    replay = _replay(args, StoredViews(k=k, seed=0))
    replay.transform = None  # the prior gets the raw view, in its own preprocessing
    t = time.perf_counter()
    store = precompute_targets(create_prior(LADDER[args.views_prior][0]), replay, path, progress=True,
                               command=f"prior_strength.py (views {k})")
    info = {"precompute_seconds": time.perf_counter() - t, "store_bytes": store.metadata["file_bytes"],
            "rows": len(store)}
    atomic_write_json(memo, info, indent=1)
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    Path(args.runs).mkdir(parents=True, exist_ok=True)
    info = {}
    for name in args.priors:
        info[name] = {**ladder_info(args, name, 0.0), **prepare_targets(args, name)}
    for k in args.views:
        info[f"views{k}"] = prepare_views(args, k)
    units = [("plain", s) for s in args.seeds]
    units += [("rela", n, s, b) for n in args.priors for s in args.seeds for b in args.budgets]
    if not args.no_online:
        units += [("online", n, s) for n in args.priors for s in args.seeds]
    units += [("views", k, s) for k in args.views for s in args.seeds]
    done, todo = {}, []
    for u in units:
        f = _unit_file(args, u)
        if f.is_file():
            r = json.loads(f.read_text())
            saved = r.get("settings", {})
            if {k: saved.get(k) for k in _DEPENDS[u[0]]} == _settings_key(args, u[0]):
                done[u] = r
                continue
        todo.append(u)
    print(f"{len(done)} of {len(units)} runs already done in {args.runs}; {len(todo)} to run, {args.jobs} at a time")
    todo.sort(key=lambda u: ({"plain": 0, "rela": 1, "online": 2, "views": 3}[u[0]], -(u[3] if u[0] == "rela" else 0)))
    bar = tqdm(total=len(units), initial=len(done), desc="prior study", unit="run", position=0)
    if args.jobs == 1:
        for u in todo:
            done[u] = _run_and_save(args, u)
            bar.update(1)
    else:
        import multiprocessing as mp

        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(_run_and_save, args, u): u for u in todo}
            for fut in as_completed(futures):
                done[futures[fut]] = fut.result()
                bar.update(1)
    bar.close()

    result = analyse(args, done, info)
    result = {
        "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/prior_strength.py", *sys.argv[1:]]),
        "library_version": __import__("accelerate_ssl").__version__,
        "machine": {"cpu_count": os.cpu_count(), "torch_threads_per_run": 1, "runs_at_a_time": args.jobs,
                    "torch": torch.__version__, "platform": platform.platform(), "python": platform.python_version()},
        "settings": {**_settings_key(args), "seeds": args.seeds, "budgets": args.budgets, "priors": args.priors,
                     "recipe": "accelerate-ssl demo defaults (switch, weak views, 16 components, head fit, lr 1e-3, batch 128, "
                               "ConvNet 16/32/64)"},
        **result,
        "study_wall_seconds_this_invocation": time.perf_counter() - t_start,
    }
    result["table"] = table(result, args.budgets)
    out = Path(args.out)
    write_results(out, result)
    write_png(result, out.with_suffix(".png"), args.budgets)
    print(result["table"])
    print(f"plain BYOL at the full budget ({args.full_steps} steps): {result['plain']['full_budget_top1']:.2f} %")
    for name, p in result["priors"].items():
        for b in args.budgets:
            e = p["budgets"][str(b)]
            seeds = ", ".join(_fmt(s["speedup_steps"], s["lower_bound"]) for s in e["per_seed"])
            line = f"{name:>10} @{b}: {e['top1']:.2f} %  speed-up {_fmt(e['speedup_steps'], e['lower_bound'])} (seeds {seeds})"
            if "online" in p:
                o = p["online"]["budgets"][str(b)]
                at = o["online_top1_at_equal_train_seconds"]
                line += (f"  online teacher at equal training time {'(ran shorter)' if at is None else f'{at:.2f} %'}, "
                         f"step time ReLA/online {o['step_time_ratio']:.2f}")
            print(line)
    if result["stored_views"]:
        sv = result["stored_views"]
        ref = sv["weak_views_on_clean_targets_top1"]  # None when the views' budget is not a ReLA budget of this run
        print(f"stored views ({sv['prior']} prior, {sv['steps']} steps, one replayed view per step): weak views on "
              f"clean targets {'not run' if ref is None else f'{ref:.2f} %'}")
        for k, e in sv["by_k"].items():
            print(f"  k={k}: {e['top1']:.2f} ± {e['top1_std']:.2f} %, store {e['store_bytes'] / 2**20:.1f} MiB, "
                  f"precompute {e['precompute_seconds']:.0f} s, {e['seconds_per_step'] * 1000:.0f} ms/step "
                  f"({e.get('step_time_ratio_to_online', float('nan')):.2f}x the online step), online at equal training "
                  f"time {e.get('online_top1_at_equal_train_seconds')}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
