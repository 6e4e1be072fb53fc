"""Against timm's own distillation: a supervised student on Fashion-MNIST taught by one frozen prior, two ways.

A user training a classifier with timm can already distil a frozen teacher: ``train.py --kd-model-name <teacher>
--kd-distill-type feature``, which is ``timm.task.FeatureDistillationTask``. This study puts that beside this library's
cached targets, with the same student, teacher, data, views, batches and optimiser; the methods, one run per method,
budget and seed:

* ``plain``: cross-entropy alone (``recipes.Supervised``), the supervised run a user has;
* ``timm``: ``FeatureDistillationTask`` at ``train.py``'s settings for ``--kd-distill-type feature`` (no loss weights
  given: task 1.0 + distillation 1.0; the MSE between the student's pooled features, through the linear projection
  timm adds when the widths differ, and the teacher's pooled features). Online: the teacher runs on every batch's
  augmented view, every step (the task's own forward, wrapped as ``DistillationTeacher``);
* ``cached``: ``rela.wrap(ce_loss)`` with ReLA over the prior's rows precomputed once on the clean training images
  (``precompute_targets``; the store opened as ``ReLA.from_prior`` opens it), ReLA's default schedule planned for the
  run (``total_steps``) and its default hand-over: no teacher forward during training. The recipe's loop passes the
  loss as a callable, for which the default is ``switch``: lambda held at 1 (the cross-entropy skipped) for most of
  the run;
* ``cached_decay``: the same with ``schedule="decay"``, under which the cross-entropy is computed on every step while
  lambda decays to 0 by half the run.

Every run has its own learning-rate schedule planned for its own length (AdamW, linear warm-up over 10 %, cosine to 0)
and is scored once at its end: the student classifier's top-1 on the test images.

**Compute.** One ``timing`` unit runs the kinds of step side by side in one process, interleaved one by one on the same
batches: a plain step, a timm step, a ReLA step while lambda is 1 (your loss skipped) and one with 0 < lambda < 1 (both
losses); and the precompute, in chunks of 1024 images between rounds. A run's compute is then what it did, step by
step (after ReLA hands over a step is a plain step), at those medians, plus for ``cached`` the precompute of every
training image: in side-by-side wall-clock and in CPU seconds. Each run's own measured seconds are kept too.

One JSON per finished run in ``--runs`` (rerun the same command to resume; ``--worker I/N`` splits the runs over N
processes), then the results JSON and PNG::

    python benchmarks/timm_kd.py                       # every run, then benchmarks/results/timm_kd.json (+ .png)
    python benchmarks/timm_kd.py --tables benchmarks/results/timm_kd.json    # the tables, from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import harness  # noqa: E402  (benchmarks/: the studies' batches and side-by-side timing)

from accelerate_ssl.atomic import atomic_write_json  # noqa: E402
from accelerate_ssl.results import code_commit, save_figure, write_results  # noqa: E402

METHODS = ("plain", "timm", "cached", "cached_decay")
LABEL = {"plain": "plain supervised", "timm": "timm FeatureDistillationTask (online teacher)",
         "cached": "ReLA, cached targets (switch schedule)", "cached_decay": "ReLA, cached targets (decay schedule)"}
#: the schedule each cached method runs (None: ReLA's default)
CACHED_SCHEDULES = {"cached": None, "cached_decay": "decay"}
SHORT = {"cached": "cached, switch", "cached_decay": "cached, decay"}
#: the kinds of step the timing unit measures, and the schedule each ReLA kind runs at
KINDS = ("plain", "timm", "cached_lambda1", "cached_mixed")
CLOCKS = {"side_by_side": "side-by-side wall-clock", "cpu": "CPU seconds"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--budgets", type=int, nargs="+", default=[50, 100, 200, 400], help="optimiser steps of the runs")
    p.add_argument("--prior", default="shipped:digits-byol", help="the frozen teacher of both distillations")
    p.add_argument("--train-size", type=int, default=5000)
    p.add_argument("--test-size", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64], help="the ConvNet student's block widths")
    p.add_argument("--timing-steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/timm_kd"), help="the prior's target store")
    p.add_argument("--runs", default=str(ROOT / "benchmarks/runs/timm_kd"), help="one JSON per finished run")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/timm_kd.json"))
    p.add_argument("--worker", default="0/1", metavar="I/N", help="run units I, I+N, ... only")
    p.add_argument("--tables", metavar="JSON", help="print the tables from a results JSON and exit")
    a = p.parse_args(argv)
    a.worker = tuple(map(int, a.worker.split("/")))
    a.budgets = sorted(set(a.budgets))
    a.device = "cpu"  # the study's runs are on the CPU; harness.batches puts each batch there
    return a


def settings(a) -> dict:
    from accelerate_ssl.schedules import DEFAULT_SCHEDULE, SWITCH_END_FRACTION

    keys = ("prior", "budgets", "train_size", "test_size", "batch_size", "lr", "widths", "threads")
    return {**{k: getattr(a, k) for k in keys}, "schedule": DEFAULT_SCHEDULE, "switch_end_fraction": SWITCH_END_FRACTION,
            "timm": timm_version()}


def timm_version() -> str:
    from accelerate_ssl.optional import require

    return require("timm", "timm's FeatureDistillationTask (benchmarks/timm_kd.py)").__version__


# ---------------------------------------------------------------------------------------------- student, teacher
class TimmNet(nn.Module):
    """A network with the interface timm's distillation tasks read: ``forward_features`` (here the pooled features),
    ``forward_head(x, pre_logits=)``, ``num_features``, ``num_classes``, ``in_chans`` and the normalisation in
    ``pretrained_cfg``."""

    def __init__(self, features: nn.Module, width: int, mean, std, num_classes: int = 0, in_chans: int = 1):
        super().__init__()
        self.features = features
        self.head = nn.Linear(width, num_classes) if num_classes else nn.Identity()
        self.num_features, self.num_classes, self.in_chans = width, num_classes, in_chans
        self.pretrained_cfg = {"mean": tuple(mean), "std": tuple(std)}

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def student(a) -> TimmNet:
    """The classifier every method trains, drawn from the current torch seed: the demo's ConvNet and a linear head."""
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.recipes.views import FASHION_MNIST_MEAN, FASHION_MNIST_STD

    net = ConvNet(widths=tuple(a.widths))
    return TimmNet(net, net.feature_dim, (FASHION_MNIST_MEAN,), (FASHION_MNIST_STD,), num_classes=10)


def teacher(a) -> TimmNet:
    """The prior as timm's teacher: its pooled embedding is the pre-logits feature, its own normalisation the
    ``pretrained_cfg`` timm converts the student's inputs to (as the precompute preprocesses them)."""
    from accelerate_ssl.priors import create_prior

    prior = create_prior(a.prior)
    pre = prior.preprocess_config
    return TimmNet(prior, prior.output_dim, pre["mean"], pre["std"])


class TimmTask(nn.Module):
    """timm's task as a method of the recipe's loop: the loop hands it the step's view and the batch's indices, the
    task runs the student and the teacher and returns its loss, as ``train.py`` does (``task(input, target)``)."""

    n_views = 1

    def __init__(self, task: nn.Module, labels: torch.Tensor):
        super().__init__()
        self.task, self.backbone = task, nn.Identity()
        self.register_buffer("labels", torch.as_tensor(labels).long(), persistent=False)

    def step_loss(self, features, views, index) -> torch.Tensor:
        return self.task(views[0], self.labels[index])["loss"]

    def update_momentum(self, momentum: float) -> None:
        pass


# ---------------------------------------------------------------------------------------------- runs
def data(a):
    from accelerate_ssl.data import FashionMNIST
    from accelerate_ssl.recipes import images_to_tensor

    train, test = FashionMNIST("train", limit=a.train_size), FashionMNIST("test", limit=a.test_size)
    return train, test, images_to_tensor(train.data), images_to_tensor(test.data)


def store_dir(a) -> Path:
    return Path(a.cache) / f"targets-{a.prior.replace(':', '-')}-{a.train_size}"


def prepare_targets(a, train) -> dict:
    """The prior's store over the clean training images (once), with what it cost (loading the prior included)."""
    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.targets.precompute import precompute_targets

    memo = store_dir(a).with_suffix(".json")
    if not (memo.is_file() and (store_dir(a) / "metadata.json").is_file()):
        torch.set_num_threads(a.threads)
        load, t, c = os.getloadavg(), time.perf_counter(), time.process_time()
        precompute_targets(create_prior(a.prior), train, store_dir(a), progress=True, command="timm_kd.py")
        atomic_write_json(memo, {"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c,
                                 "load_average": [load, os.getloadavg()]}, indent=1)
    return json.loads(memo.read_text())


def build(a, kind: str, seed: int, train, steps: int, schedule=None):
    """(method, rela, optimizer, classifier) of one run; every kind draws the student first from the same seed."""
    from accelerate_ssl.recipes import Supervised

    torch.manual_seed(seed)
    net, rela = student(a), None
    schedule = CACHED_SCHEDULES.get(kind) if schedule is None else schedule
    if kind == "timm":
        from timm.task import FeatureDistillationTask  # train.py --kd-distill-type feature, its default weights

        task = FeatureDistillationTask(net, teacher(a), criterion=nn.CrossEntropyLoss(), verbose=False)
        method = TimmTask(task, train.targets)
        params = list(task.trainable_module.parameters())
    else:
        method = Supervised(net, None, train.targets)
        params = list(net.parameters())
        if kind.startswith("cached"):
            from accelerate_ssl.rela import ReLA
            from accelerate_ssl.targets.store import TargetStore

            options = {} if schedule is None else {"schedule": schedule}  # None: ReLA's default, planned for the run
            rela = ReLA(TargetStore.open(store_dir(a), dataset=train), net.features, dataset=train, total_steps=steps,
                        feature_dim=net.num_features, **options)
            params += list(rela.parameters())
    return method, rela, torch.optim.AdamW(params, lr=a.lr, weight_decay=0.01), net


def top1(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    net.eval()
    with torch.no_grad():
        hits = sum(int((net(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum()) for i in range(0, len(x), 1000))
    return 100.0 * hits / len(x)


def train_run(a, kind: str, steps: int, seed: int, data_) -> dict:
    from accelerate_ssl.recipes import WEAK_VIEWS, train_ssl, warmup_cosine_lr

    train, test, xtr, xte = data_
    method, rela, opt, net = build(a, kind, seed, train, steps)
    try:
        log = train_ssl(method, harness.batches(a, xtr, seed), steps,
                        optimizer=opt, view_generator=torch.Generator().manual_seed(seed + 1), views=WEAK_VIEWS,
                        rela=rela, rela_views="weak", lr=warmup_cosine_lr(a.lr, steps), checkpoints=[steps],
                        probe=lambda _: top1(net, xte, test.targets), progress=f"{kind} {steps} seed {seed}")
    finally:
        if rela is not None:
            rela.close()
    return {"top1": log["curve"][-1]["top1"], "lambda_per_step": log["lambda_per_step"],
            "rela": None if rela is None else {"schedule": repr(rela.schedule)},
            "train_seconds": log["train_seconds"], "train_cpu_seconds": log["train_cpu_seconds"]}


def units(a) -> list[tuple]:
    # budgets outermost: an interrupted study has every seed of its smaller budgets
    return [("timing",)] + [(m, b, s) for b in a.budgets for s in a.seeds for m in a.methods]


def unit_file(a, unit: tuple) -> Path:
    return Path(a.runs) / ("timing.json" if unit == ("timing",) else f"{unit[0]}-{unit[1]}-seed{unit[2]}.json")


def run_unit(a, unit: tuple, data_) -> None:
    path = unit_file(a, unit)
    if path.is_file():
        return
    torch.set_num_threads(a.threads)
    load = os.getloadavg()
    record = timing(a, data_) if unit == ("timing",) else train_run(a, *unit, data_)
    record.update(unit=list(unit), settings=settings(a), load_average=[load, os.getloadavg()],
                  commit=code_commit(ROOT)["commit"])
    atomic_write_json(path, record, indent=1)


def timing(a, data_) -> dict:
    """Median time of each kind of step, the kinds' steps interleaved one by one (``harness.side_by_side``: same
    batches, and the same views in a round), and of the precompute per image, from chunks of 1024 training images
    between rounds."""
    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.recipes import WEAK_VIEWS, train_ssl
    from accelerate_ssl.schedules import Constant

    train, _, xtr, _ = data_
    schedules = {"cached_lambda1": Constant(1.0), "cached_mixed": Constant(0.5)}
    kinds = {}
    for kind in KINDS:
        method, rela, opt, _ = build(a, kind.split("_")[0], 0, train, 10 ** 6, schedules.get(kind))
        kinds[kind] = (method, rela, opt, harness.batches(a, xtr, 0))
    prior, pre = create_prior(a.prior), []
    g = torch.Generator()

    def step(kind):
        method, rela, opt, source = kinds[kind]

        def one(i):
            g.manual_seed(i)  # every kind the same views this round
            return train_ssl(method, source, 1, optimizer=opt, view_generator=g, views=WEAK_VIEWS, rela=rela,
                             rela_views="weak")
        return one

    times = harness.side_by_side({k: step(k) for k in kinds}, a.timing_steps,
                                 lambda i: pre.append(harness.precompute_cost(prior, train, i, 1024)), every=4)
    for _, rela, *_ in kinds.values():
        if rela is not None:
            rela.close()
    return {"steps_each": a.timing_steps,
            "precompute_per_image": {"seconds": statistics.median(w for w, _ in pre),
                                     "cpu_seconds": statistics.median(c for _, c in pre)},
            "kinds": times}


# ---------------------------------------------------------------------------------------------- analysis
def step_kinds(kind: str, run: dict) -> list[str]:
    """What each step of a run was, for the cost model: a ReLA step while lambda is 1 or between 0 and 1, else the
    method's own step (after the hand-over a cached run's step is a plain one)."""
    if not kind.startswith("cached"):
        return [kind] * len(run["lambda_per_step"] or [None] * run["unit"][1])
    return ["cached_lambda1" if lam >= 1.0 else "cached_mixed" if lam > 0.0 else "plain"
            for lam in run["lambda_per_step"]]


def compute(a, kind: str, run: dict, timing_: dict) -> dict:
    """A run's modelled compute at its end, each clock: its steps at the interleaved medians (+ the precompute)."""
    steps = step_kinds(kind, run)
    out = {}
    for clock, key in (("side_by_side", "seconds"), ("cpu", "cpu_seconds")):
        pre = timing_["precompute_per_image"][key] * a.train_size if kind.startswith("cached") else 0.0
        out[clock] = pre + sum(timing_["kinds"][s][key] for s in steps)
    return out


def mean_sd(values: list) -> dict:
    vals = [v for v in values if v is not None]
    return {"mean": statistics.fmean(vals) if vals else None, "sd": statistics.stdev(vals) if len(vals) > 1 else None,
            "per_seed": values}


def interpolate(points: list[tuple[float, float]], x: float):
    """The piecewise-linear curve through ``points`` at ``x`` (None outside it)."""
    pts = sorted(points)
    if pts and x == pts[0][0]:
        return pts[0][1]
    return next((y0 + (x - x0) / (x1 - x0) * (y1 - y0) for (x0, y0), (x1, y1) in zip(pts, pts[1:]) if x0 < x <= x1),
                None)


def analyse(a, runs: dict, timing_: dict) -> dict:
    seeds = [s for s in a.seeds if all((m, b, s) in runs for m in a.methods for b in a.budgets)]
    cost = {u: compute(a, u[0], r, timing_) for u, r in runs.items()}
    budgets = {}
    for b in a.budgets:
        budgets[str(b)] = {m: {"top1": mean_sd([runs[(m, b, s)]["top1"] for s in seeds]),
                               **{clock: mean_sd([cost[(m, b, s)][clock] for s in seeds]) for clock in CLOCKS},
                               "own_cpu_seconds": mean_sd([runs[(m, b, s)]["train_cpu_seconds"] for s in seeds]),
                               "handover_step": [next((i for i, lam in enumerate(runs[(m, b, s)]["lambda_per_step"])
                                                       if lam == 0.0), None) for s in seeds]
                               if m.startswith("cached") else None}
                           for m in a.methods}
    equal = {}
    for clock in CLOCKS:  # every method read at the cached run's compute at each budget
        points = []
        for b in a.budgets:
            x = budgets[str(b)]["cached"][clock]["mean"]
            per = {m: [interpolate([(cost[(m, c, s)][clock], runs[(m, c, s)]["top1"]) for c in a.budgets], x)
                       for s in seeds] for m in a.methods}
            diff = {m: mean_sd([c - t if c is not None and t is not None else None for c, t in zip(per[m], per["timm"])])
                    for m in a.methods if m.startswith("cached") and "timm" in per}
            points.append({"budget": b, "seconds": x, "top1": {m: mean_sd(v) for m, v in per.items()},
                           "minus_timm": diff})
        equal[clock] = points
    return {"seeds": seeds, "budgets": budgets, "equal": equal}


# ---------------------------------------------------------------------------------------------- tables, figure
def pm(v: dict) -> str:
    if v["mean"] is None:
        return "–"
    return f"{v['mean']:.2f} ± {v['sd']:.2f}" if v["sd"] is not None else f"{v['mean']:.2f}"


def tables(result: dict) -> dict[str, str]:
    """The study's tables by name: ``budgets`` (top-1 and compute at each budget), ``equal`` (at equal compute),
    ``steps`` (the cost of each kind of step) and ``verdict`` (who leads where, in words)."""
    an, s, t = result["analysis"], result["settings"], result["timing"]
    methods = [m for m in METHODS if m in next(iter(an["budgets"].values()))]
    n = len(an["seeds"])
    rows = ["| steps | " + " | ".join(f"{LABEL[m]}: top-1 %, CPU s" for m in methods) + " |",
            "|---:|" + "---:|" * len(methods)]
    for b, cell in an["budgets"].items():
        rows.append(f"| {b} | " + " | ".join(f"{pm(cell[m]['top1'])}, {cell[m]['cpu']['mean']:.0f}" for m in methods)
                    + " |")
    out = {"budgets": "\n".join(rows) + (
        f"\n\nTop-1 % of the student's classifier on {s['test_size']:,} test images at the end of each run (mean ± sd "
        f"over {n} seeds); CPU s: the run's steps at the interleaved medians below, the precompute of the "
        f"{s['train_size']:,} training images included for the cached targets. ReLA's schedules: `{s['schedule']}` "
        f"(lambda 1 until {s['switch_end_fraction']:.0%} of the run; ReLA's default for a loss passed as a callable, as "
        f"this loop passes it) and `decay` (its default for a loss computed before `wrap`), each planned for each run; "
        f"timm {s['timm']}." + handover_note(an, methods))}
    cached = [m for m in methods if m.startswith("cached")] if "timm" in methods else []
    rows = ["| at the cached run's compute of | clock | s | " + " | ".join(LABEL[m] for m in methods) + " | "
            + "".join(f"{SHORT[m]} - timm, points (per-seed differences) | " for m in cached).rstrip(),
            "|---:|:---|---:|" + "---:|" * (len(methods) + len(cached))]
    for clock in CLOCKS:
        for p in an["equal"][clock]:
            diffs = [p["minus_timm"][m] for m in cached]
            rows.append(f"| {p['budget']} steps | {CLOCKS[clock]} | {p['seconds']:.0f} | "
                        + " | ".join(pm(p["top1"][m]) for m in methods) + " | "
                        + "".join(f"{d['mean']:+.2f} ± {d['sd']:.2f} | " if d["mean"] is not None and d["sd"] is not None
                                  else "– | " for d in diffs).rstrip())
    out["equal"] = "\n".join(rows) + (
        "\n\nEach method's top-1 read off its own accuracy-against-compute curve (its runs at every budget, per seed, "
        "linear between them; – where its runs did not reach that compute), at the compute the cached run of each "
        "budget cost (under switch).")
    k, pre = t["kinds"], t["precompute_per_image"]
    names = {"plain": "plain supervised", "timm": "timm FeatureDistillationTask (student + teacher forward)",
             "cached_lambda1": "ReLA, lambda 1 (your loss skipped)", "cached_mixed": "ReLA, 0 < lambda < 1"}
    rows = ["| step (interleaved, medians) | ms | CPU ms | / plain step |", "|:---|---:|---:|---:|"]
    rows += [f"| {names[n]} | {v['seconds'] * 1e3:.1f} | {v['cpu_seconds'] * 1e3:.1f} | "
             f"{v['cpu_seconds'] / k['plain']['cpu_seconds']:.2f} |" for n, v in k.items()]
    out["steps"] = "\n".join(rows) + (
        f"\n\nThe precompute: {pre['seconds'] * 1e3:.2f} ms ({pre['cpu_seconds'] * 1e3:.2f} CPU ms) per training image, "
        f"once; {t['steps_each']} steps of each kind, batch {s['batch_size']}, {s['threads']} thread.")
    out["verdict"] = verdict(an, methods)
    return out


def handover_note(an: dict, methods: list[str]) -> str:
    """When each cached run handed over to the cross-entropy alone (its first step at lambda 0), per budget."""
    parts = []
    for m in (m for m in methods if m.startswith("cached")):
        steps = [(b, sorted(h for h in c[m]["handover_step"] if h is not None)) for b, c in an["budgets"].items()]
        parts.append(f"{SHORT[m].split(', ')[-1]}: " + ", ".join(
            f"{statistics.median(h):.0f} of {b}" if h else f"none of {b}" for b, h in steps))
    return (" Hand-over (the first step at lambda 0, median over the seeds): " + "; ".join(parts) + ".") if parts else ""


def paired(cells: list[dict], who: str, against: list[str]) -> tuple[int, int, int]:
    """Of the cells where every seed has ``who`` and each of ``against``: how many have ``who`` ahead of the best of
    them on every seed, behind it on every seed, and neither (the seeds split)."""
    ahead = behind = split = 0
    for c in cells:
        per = [c[m]["per_seed"] for m in (who, *against)]
        if any(v is None for values in per for v in values):
            continue
        diffs = [own - max(others) for own, *others in zip(*per)]
        ahead += all(d > 0 for d in diffs)
        behind += all(d < 0 for d in diffs)
        split += not (all(d > 0 for d in diffs) or all(d < 0 for d in diffs))
    return ahead, behind, split


def verdict(an: dict, methods: list[str]) -> str:
    """Who leads where, in words, from the numbers (so the page's sentence cannot drift from the file): a lead counts
    only where it holds on every seed (seeds are paired: same initialisation, batches and views)."""
    cached = [m for m in methods if m.startswith("cached")]
    if "timm" not in methods or not cached:
        return ""

    def counts(cells: list[dict], who: str, against: list[str], unit: str) -> str:
        a, b, c = paired(cells, who, against)
        return f"ahead at {a}, behind at {b} and split across the seeds at {c} of {a + b + c} {unit}"

    steps = [{m: c[m]["top1"] for m in methods} for c in an["budgets"].values()]
    text = []
    for m in cached:
        part = [f"ReLA's cached targets under the {SHORT[m].split(', ')[-1]} schedule, against timm's online "
                f"distillation: at equal steps {counts(steps, m, ['timm'], 'budgets')}"]
        for clock in CLOCKS:
            part.append(f"at equal {CLOCKS[clock]} {counts([p['top1'] for p in an['equal'][clock]], m, ['timm'], 'points')}")
        text.append("; ".join(part))
    if "plain" in methods:
        text.append("plain supervised training, against the best distillation of each seed: "
                    + counts(steps, "plain", ["timm", *cached], "budgets"))
    return ". ".join(t[0].upper() + t[1:] for t in text) + ". A lead counts where it holds on every seed."


def figure(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    an, s = result["analysis"], result["settings"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for i, m in enumerate(METHODS):
        cells = [(int(b), c[m]) for b, c in an["budgets"].items() if m in c]
        if not cells:
            continue
        for ax, x in ((axes[0], [b for b, _ in cells]), (axes[1], [c["cpu"]["mean"] for _, c in cells])):
            ax.errorbar(x, [c["top1"]["mean"] for _, c in cells], yerr=[c["top1"]["sd"] or 0 for _, c in cells],
                        marker="o", capsize=3, color=f"C{i}", label=LABEL[m])
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    axes[0].set_xscale("log")  # (the budgets double)
    axes[0].xaxis.set_major_formatter(ScalarFormatter())
    axes[0].xaxis.set_minor_formatter(NullFormatter())
    axes[0].minorticks_off()
    axes[0].set_xticks([int(b) for b in an["budgets"]], [str(b) for b in an["budgets"]])
    axes[0].set_xlabel("optimiser steps (one run per budget)")
    axes[1].set_xlabel("CPU seconds (interleaved step medians; precompute included)")
    axes[0].set_ylabel("test top-1 %")
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(f"Supervised ConvNet on Fashion-MNIST, teacher {s['prior']}: mean ± sd over {len(an['seeds'])} seeds")
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.tables:
        print("\n\n".join(tables(json.loads(Path(a.tables).read_text())).values()))
        return
    data_ = data(a)
    precompute = prepare_targets(a, data_[0]) if "cached" in a.methods else None
    todo = units(a)
    for unit in todo[a.worker[0]::a.worker[1]]:
        run_unit(a, unit, data_)
    if a.worker[1] > 1:
        print("timm_kd.py: this worker's runs are done; the command without --worker writes the results.")
        return
    runs = {tuple(u): json.loads(unit_file(a, u).read_text()) for u in todo if u != ("timing",)}
    timing_ = json.loads(unit_file(a, ("timing",)).read_text())
    result = {"command": "python benchmarks/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "settings": settings(a), "precompute": precompute, "timing": timing_,
              "analysis": analyse(a, runs, timing_), "runs": {unit_file(a, u).stem: r for u, r in runs.items()}}
    write_results(a.out, result, per_seed=["analysis.budgets.*.*.top1.per_seed"])
    figure(result, Path(a.out).with_suffix(".png"))
    print("\n\n".join(tables(result).values()))


if __name__ == "__main__":
    main()
