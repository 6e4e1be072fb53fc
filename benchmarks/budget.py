"""The budget study, in the shape of ReLA v1 Table 1: accuracy at 10 / 20 / 50 % of a full plain SSL run's steps.

For each budget B (a fraction of ``--full`` steps) and seed: **plain SSL** planned for B steps, and **ReLA + SSL**
(``rela.wrap(ssl_loss)``, the schedule planned for B steps, the prior early and the SSL loss after the hand-over) with
each prior; beside them the **full-budget plain run**. Every run has its own learning-rate schedule planned for its
own length (linear warm-up over 10 %, cosine to 0), as a run of that budget would. Priors:

* ``random``: an untrained ConvNet 64/128/256 (``random:convnet``): no data, no labels;
* ``other``: ``shipped:digits-byol``, BYOL on scikit-learn's digits (other data, no labels): a user's situation;
* ``indomain``: the student's own architecture trained here with plain SSL for the full budget on these very images
  (another seed): the papers' "CF10-T", an **upper bound** (a user with that model would need no ReLA).

Students (``--student``): ``vit`` (the benchmark with room: a 4-block ViT from timm at 28 px, VICReg, 10k training
images, probing at ~40 % untrained) and ``convnet`` (the demo's ConvNet 16/32/64, BYOL, 20k images). Each run is
probed at its end (linear on all labels, kNN k = 20, 100 labels per class); the full run also at every budget's
step, the untrained student once per seed. Compute: each run's own CPU seconds of training (steps only, probes
excluded), plus for ReLA the precompute of its prior's targets (loading the prior included); the in-domain prior's
own training is not counted (it is an upper bound).

One JSON per finished run in ``--runs`` (committed; rerun the same command to resume; ``--worker I/N`` splits the runs
over N processes), then the results JSON and PNG::

    python benchmarks/budget.py --student vit --worker 0/2 & python benchmarks/budget.py --student vit --worker 1/2
    python benchmarks/budget.py --student vit --gather            # the results JSON + PNG from every finished run
    python benchmarks/budget.py --student vit --tables benchmarks/results/budget_vit.json     # the tables, from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from accelerate_ssl.atomic import atomic_write_json  # noqa: E402
from accelerate_ssl.results import code_commit, save_figure, write_results  # noqa: E402

PRIORS = {"random": "random:convnet", "other": "shipped:digits-byol", "indomain": None}  # indomain: trained here
PRIOR_LABEL = {"random": "untrained ConvNet", "other": "digits BYOL (other data)",
               "indomain": "in-domain SSL, full budget (upper bound)"}
STUDENTS = {  # the settings each student's study runs with unless given
    "vit": {"ssl": "vicreg", "train_size": 10000, "test_size": 5000, "full": 1000},
    "convnet": {"ssl": "byol", "train_size": 20000, "test_size": 10000, "full": 1000},
}
INDOMAIN_SEED = 1000  # the in-domain prior's own seed, distinct from every student's
#: ReLA v1 Table 1, CIFAR-10, BYOL, ResNet-18, linear probe top-1 %: plain BYOL, ReLA with a random prior, with a
#: BYOL prior trained on CIFAR-100 (other data) and on CIFAR-10 itself (CF10-T, in-domain), and full-budget BYOL
PAPER_CIFAR10 = {0.1: {"plain": 58.3, "random": 71.4, "other": 78.2, "indomain": 81.1},
                 0.2: {"plain": 70.1, "random": 77.1, "other": 81.4, "indomain": 83.6},
                 0.5: {"plain": 77.9, "random": 82.7, "other": 86.2, "indomain": 86.5}, 1.0: {"plain": 82.7}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", choices=sorted(STUDENTS), default="vit")
    p.add_argument("--full", type=int, help="steps of the full plain run (default: the student's, see STUDENTS)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2, 0.5], help="fractions of --full")
    p.add_argument("--longer", type=float, nargs="*", default=[2.0],
                   help="plain runs this many times --full, on --longer-seeds: how much plain SSL gains past --full")
    p.add_argument("--longer-seeds", type=int, nargs="*", default=[0, 1])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--priors", nargs="+", default=list(PRIORS), choices=list(PRIORS))
    p.add_argument("--methods", nargs="+", default=["plain", "rela"], choices=["plain", "rela"])
    p.add_argument("--schedule", default="decay",
                   help="lambda schedule spec, planned for each budget (ReLA's default: decay, 0 by half the run); "
                        "'<spec>@<f>': ReLA's term ends for good at fraction f of the run (ReLA(end_step=))")
    p.add_argument("--handover", default="momentum,warm-heads=auto",
                   help="ReLA's hand-over, as Handover.from_spec reads it ('momentum' resets the method's momentum copies)")
    p.add_argument("--rela-views", choices=("weak", "byol"), default="weak",
                   help="the student's one view per step while lambda is 1: ReLA v1's weak views or the SSL views")
    p.add_argument("--ssl", help="the SSL objective (default: the student's)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate of every run")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--train-size", type=int)
    p.add_argument("--test-size", type=int)
    p.add_argument("--components", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--runs", help="one JSON per finished run (default: benchmarks/runs/budget/<student>)")
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/budget"), help="target stores, the in-domain prior")
    p.add_argument("--out", help="results JSON (default: benchmarks/results/budget_<student>.json)")
    p.add_argument("--worker", default="0/1", metavar="I/N", help="run units I, I+N, ... only")
    p.add_argument("--gather", action="store_true",
                   help="run nothing: write the results of the runs finished so far (marked incomplete if some are not)")
    p.add_argument("--tables", metavar="JSON", help="print the tables from a results JSON and exit")
    a = p.parse_args(argv)
    for k, v in STUDENTS[a.student].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.worker = tuple(map(int, a.worker.split("/")))
    a.runs = a.runs or str(ROOT / "benchmarks/runs/budget" / a.student)
    a.out = a.out or str(ROOT / f"benchmarks/results/budget_{a.student}.json")
    a.canvas, a.widths = 0, [16, 32, 64]  # what head_to_head's data and student read
    return a


def budget_steps(a) -> list[int]:
    return [round(f * a.full) for f in a.budgets]


def settings(a) -> dict:
    keys = ("student", "ssl", "full", "budgets", "lr", "batch_size", "train_size", "test_size", "components",
            "schedule", "handover", "rela_views", "threads") + (("device",) if a.device != "cpu" else ())
    return {k: getattr(a, k) for k in keys}


# ---------------------------------------------------------------------------------------------- runs
def train_run(a, data, seed: int, steps: int, prior: str | None = None, checkpoints=()) -> dict:
    """One run of ``steps`` steps: plain SSL, or ReLA + SSL with ``prior``'s store; the student drawn from ``seed``."""
    import head_to_head as h2h

    from accelerate_ssl.recipes import (cosine_momentum, create_method, shuffled_batches, tensor_batches, train_ssl,
                                        warmup_cosine_lr)

    train, test, xtr, xte = data
    torch.manual_seed(seed)
    backbone = h2h.student(a)
    method = create_method(a.ssl, backbone, backbone.feature_dim).to(a.device)
    params, rela = [p for p in method.parameters() if p.requires_grad], None
    if prior is not None:
        from accelerate_ssl.rela import Handover, ReLA
        from accelerate_ssl.targets.store import TargetStore

        spec, _, end = (a.schedule or "").partition("@")  # "<schedule>@<f>": its term over for good at f of the run
        options = {"schedule": spec} if spec else {}
        if end:
            options["end_step"] = round(float(end) * steps)
        if a.handover:
            options["handover"] = Handover.from_spec(a.handover, momentum=method.momentum_pairs())
        rela = ReLA(TargetStore.open(store_dir(a, prior), dataset=train), backbone, dataset=train, total_steps=steps,
                    feature_dim=backbone.feature_dim, n_components=a.components, **options).to(a.device)
        params += list(rela.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.01)
    probe = h2h.Probe(train, test, xtr, xte, seed, h2h.untrained_file(a, seed))
    losses: list[float] = []
    try:
        log = train_ssl(method, tensor_batches(xtr.to(a.device), shuffled_batches(len(xtr), a.batch_size, seed)), steps,
                        optimizer=opt, view_generator=torch.Generator().manual_seed(seed + 1), rela=rela,
                        rela_views=a.rela_views, lr=warmup_cosine_lr(a.lr, steps), momentum=cosine_momentum(steps),
                        checkpoints=sorted({0, steps, *checkpoints}), probe=probe, checkpoint_extras=lambda: dict(probe.last),
                        on_step=lambda step, loss: losses.append(loss), progress=f"{'plain' if prior is None else prior} "
                                                                                 f"{steps} seed {seed}")
    finally:
        if rela is not None:
            rela.close()
    return {"curve": log["curve"], "lambda_per_step": log["lambda_per_step"], "loss_per_step": losses,
            "rela": None if rela is None else {"schedule": repr(rela.schedule), "handover": rela.handover.state_dict()},
            "train_seconds": log["train_seconds"], "train_cpu_seconds": log["train_cpu_seconds"],
            "handover_step": next((i for i, lam in enumerate(log["lambda_per_step"]) if lam == 0.0), None)}


def store_dir(a, prior: str) -> Path:
    return Path(a.cache) / f"{a.student}-{a.train_size}-{prior}"


def indomain_checkpoint(a) -> Path:
    return Path(a.cache) / f"{a.student}-{a.ssl}-{a.full}-{a.train_size}-indomain.safetensors"


def prepare_prior(a, data, prior: str) -> dict:
    """The prior's store over the clean training images (once; its CPU cost recorded beside it). ``indomain``: the
    student's architecture trained with plain SSL for the full budget first (seed INDOMAIN_SEED)."""
    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.targets.precompute import precompute_targets

    memo = store_dir(a, prior).with_suffix(".json")
    if memo.is_file() and (store_dir(a, prior) / "metadata.json").is_file():
        return json.loads(memo.read_text())
    record = {}
    spec = PRIORS[prior]
    if prior == "indomain":
        spec = f"checkpoint:{indomain_checkpoint(a)}"
        record["training"] = (train_indomain(a, data) if not indomain_checkpoint(a).is_file() else
                              {"steps": a.full, "seed": INDOMAIN_SEED, "checkpoint": indomain_checkpoint(a).name})
    torch.set_num_threads(a.threads)
    load, t, c = os.getloadavg(), time.perf_counter(), time.process_time()
    precompute_targets(create_prior(spec).to(a.device), data[0], store_dir(a, prior), progress=True,
                       command=f"budget.py ({prior})")
    record.update({"spec": spec, "seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c,
                   "load_average": [load, os.getloadavg()]})
    atomic_write_json(memo, record, indent=1)
    return record


def prior_probe(a, data, prior: str) -> dict:
    """The prior itself, probed as the students are (its embeddings of the clean train and test images, the same
    linear / kNN / few-label probes, seed 0): what the student is pulled toward. Once per prior, kept beside its
    store."""
    import head_to_head as h2h

    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.recipes.views import FASHION_MNIST_MEAN, FASHION_MNIST_STD

    memo = Path(f"{store_dir(a, prior)}-probe.json")
    if memo.is_file():
        return json.loads(memo.read_text())
    model = create_prior(PRIORS[prior] or f"checkpoint:{indomain_checkpoint(a)}").eval()

    class Embed(torch.nn.Module):  # the probe's normalised images -> pixels -> the prior's own preprocessing
        def __init__(self):
            super().__init__()
            self.prior = model

        def forward(self, x):
            return self.prior(self.prior.preprocess.batch((x * FASHION_MNIST_STD + FASHION_MNIST_MEAN).clamp(0, 1)))

    train, test, xtr, xte = data
    torch.set_num_threads(a.threads)
    out = dict(h2h.Probe(train, test, xtr, xte, 0).inner.evaluate(Embed()))
    atomic_write_json(memo, out, indent=1)
    return out


def train_indomain(a, data) -> dict:
    """The in-domain prior: plain SSL for the full budget (seed INDOMAIN_SEED), saved as a checkpoint prior."""
    import head_to_head as h2h

    from accelerate_ssl.priors.registry import save_prior_checkpoint
    from accelerate_ssl.recipes import create_method, shuffled_batches, tensor_batches, train_ssl, warmup_cosine_lr
    from accelerate_ssl.recipes import cosine_momentum
    from accelerate_ssl.recipes.views import FASHION_MNIST_MEAN, FASHION_MNIST_STD

    train, test, xtr, xte = data
    torch.manual_seed(INDOMAIN_SEED)
    backbone = h2h.student(a)
    method = create_method(a.ssl, backbone, backbone.feature_dim).to(a.device)
    opt = torch.optim.AdamW([p for p in method.parameters() if p.requires_grad], lr=a.lr, weight_decay=0.01)
    probe = h2h.Probe(train, test, xtr, xte, INDOMAIN_SEED)
    log = train_ssl(method, tensor_batches(xtr.to(a.device), shuffled_batches(len(xtr), a.batch_size, INDOMAIN_SEED)),
                    a.full, optimizer=opt, view_generator=torch.Generator().manual_seed(INDOMAIN_SEED + 1),
                    lr=warmup_cosine_lr(a.lr, a.full), momentum=cosine_momentum(a.full), checkpoints=[a.full],
                    probe=probe, checkpoint_extras=lambda: dict(probe.last), progress="in-domain prior")
    if a.student == "vit":
        arch, kwargs = "timm:vit_tiny_patch16_224", {"img_size": 28, "patch_size": 4, "in_chans": 1, "embed_dim": 64,
                                                    "depth": 4, "num_heads": 4, "num_classes": 0, "global_pool": "avg"}
    else:
        arch, kwargs = "convnet", backbone.config
    save_prior_checkpoint(backbone.cpu(), indomain_checkpoint(a), arch, kwargs,
                          {"channels": 1, "mean": [FASHION_MNIST_MEAN], "std": [FASHION_MNIST_STD]})
    return {"steps": a.full, "seed": INDOMAIN_SEED, "probe": log["curve"][-1], "train_cpu_seconds": log["train_cpu_seconds"]}


def units(a) -> list[tuple]:
    """Every run of the study, in the order they are run: per seed, plain at each budget and in full, then ReLA."""
    out = []
    for seed in a.seeds:
        if "plain" in a.methods:
            out += [("plain", None, s, seed) for s in [*budget_steps(a), a.full]]
            out += [("plain", None, round(m * a.full), seed) for m in a.longer if seed in a.longer_seeds]
        if "rela" in a.methods:
            out += [("rela", prior, s, seed) for prior in a.priors for s in budget_steps(a)]
    return out


def unit_file(a, unit: tuple) -> Path:
    """A run's JSON: named by what decides it (a ReLA run also by its schedule, hand-over and views)."""
    kind, prior, steps, seed = unit
    if prior is None:
        return Path(a.runs) / f"{kind}-{steps}-seed{seed}.json"
    recipe = "-".join(re.sub(r"[^a-z0-9.=]+", "_", str(v).lower()) for v in (a.schedule, a.handover, a.rela_views))
    return Path(a.runs) / f"{kind}-{prior}-{steps}-seed{seed}-{recipe}.json"


def run_unit(a, data, unit: tuple, path: Path | None = None, checkpoints=None, label=None) -> None:
    """Run ``unit`` and write its JSON to ``path`` (default :func:`unit_file`), unless it is there (a rerun resumes).
    ``checkpoints``: the steps probed besides the end (default: every budget's, on the full plain run); ``label``: the
    unit as the record names it (another study's own, for ``handover.py``)."""
    kind, prior, steps, seed = unit
    path = Path(path or unit_file(a, unit))
    if path.is_file():
        return
    torch.set_num_threads(a.threads)
    pre = prepare_prior(a, data, prior) if prior else None
    load = os.getloadavg()
    if checkpoints is None:
        checkpoints = budget_steps(a) if kind == "plain" and steps == a.full else ()
    run = train_run(a, data, seed, steps, prior, checkpoints)
    run.update(unit=dict(zip(("kind", "prior", "steps", "seed"), unit)) if label is None else label,
               settings=settings(a), precompute=pre, load_average=[load, os.getloadavg()],
               commit=code_commit(ROOT)["commit"])
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, run, indent=1)


# ---------------------------------------------------------------------------------------------- analysis
def analyse(a, data, runs: dict) -> dict:
    """Per budget: each method's end accuracy (mean, sd, per seed) on three probes, its compute relative to the same
    seed's full plain run, and whether lambda reached 0 (the hand-over) and where; each prior's own probe."""
    seeds = [s for s in a.seeds if ("plain", None, a.full, s) in runs]
    full = {s: runs[("plain", None, a.full, s)] for s in seeds}
    probes = ("top1", "knn_top1", "few_label_top1")

    def end(run):
        c = run["curve"][-1]
        return {k: c[k] for k in probes}

    def summary(rs: list[dict], costs: list[float]) -> dict:
        out = {k: {"per_seed": [end(r)[k] for r in rs], "mean": statistics.fmean(end(r)[k] for r in rs),
                   "sd": statistics.stdev(end(r)[k] for r in rs) if len(rs) > 1 else None} for k in probes}
        return {**out, "compute": {"per_seed": costs, "mean": statistics.fmean(costs)}, "seeds": len(rs)}

    table = {"full": summary(list(full.values()), [1.0] * len(seeds)), "budgets": {}}
    for steps in budget_steps(a):
        row = {}
        plain = [runs[("plain", None, steps, s)] for s in seeds if ("plain", None, steps, s) in runs]
        if plain:
            row["plain"] = summary(plain, [r["train_cpu_seconds"] / full[r["unit"]["seed"]]["train_cpu_seconds"]
                                           for r in plain])
        for prior in a.priors:
            rs = [runs[("rela", prior, steps, s)] for s in seeds if ("rela", prior, steps, s) in runs]
            if rs:
                row[prior] = summary(rs, [(r["train_cpu_seconds"] + r["precompute"]["cpu_seconds"])
                                          / full[r["unit"]["seed"]]["train_cpu_seconds"] for r in rs])
                row[prior]["handover_step"] = [r["handover_step"] for r in rs]
        table["budgets"][str(steps)] = row
    priors = {}
    for prior in a.priors:
        memo = store_dir(a, prior).with_suffix(".json")
        if memo.is_file():
            priors[prior] = {**json.loads(memo.read_text()), "probe": prior_probe(a, data, prior)}
    longer = {}
    for steps in sorted({k[2] for k in runs if k[0] == "plain" and k[2] > a.full}):
        rs = [end(r) for k, r in runs.items() if k[0] == "plain" and k[2] == steps]
        same = [end(full[k[3]]) for k in runs if k[0] == "plain" and k[2] == steps]  # the full runs of those seeds
        longer[str(steps)] = {"seeds": len(rs), **{q: statistics.fmean(r[q] for r in rs) for q in probes},
                              "full_same_seeds": {q: statistics.fmean(r[q] for r in same) for q in probes}}
    return {"seeds": seeds, "table": table, "priors": priors, "longer_plain": longer,
            "full_curve": {str(s): r["curve"] for s, r in full.items()}}


def mean_sd_text(v: dict) -> str:
    """``{"mean", "sd"}`` as "mean ± sd" (the mean alone when one seed gives no sd)."""
    return f"{v['mean']:.2f}" + (f" ± {v['sd']:.2f}" if v["sd"] is not None else "")


def seeds_text(n: int) -> str:
    return f"{n} seed{'s' if n > 1 else ''}"


def fmt(cell: dict | None, key: str = "top1") -> str:
    if not cell:
        return "–"
    return mean_sd_text(cell[key]) + (f" ({seeds_text(cell['seeds'])})" if cell["seeds"] < 5 else "")


PROBES = {"top1": "linear probe, all labels", "knn_top1": "kNN, k = 20", "few_label_top1": "linear probe, 100 labels per class"}


def tables(result: dict) -> dict[str, str]:
    """The study's tables by name: ``top1`` (with the paper's CIFAR-10 rows), ``knn_top1``, ``few_label_top1``,
    ``compute`` (each run's cost against the full plain run, and where lambda reached 0) and ``longer`` (what plain
    SSL gains past the full budget)."""
    an, s = result["analysis"], result["settings"]
    priors = [p for p in PRIORS if any(p in row for row in an["table"]["budgets"].values())]
    out = {}
    for key in PROBES:
        lines = ["| budget | plain SSL | " + " | ".join(f"ReLA + SSL, {PRIOR_LABEL[p]}" for p in priors) +
                 " | plain SSL, full budget |", "|---" * (3 + len(priors)) + "|"]
        for steps, row in an["table"]["budgets"].items():
            frac = int(steps) / s["full"]
            lines.append(f"| {round(100 * frac)} % ({steps} steps) | {fmt(row.get('plain'), key)} | " +
                         " | ".join(fmt(row.get(p), key) for p in priors) + f" | {fmt(an['table']['full'], key)} |")
            paper = PAPER_CIFAR10.get(round(frac, 2))
            if key == "top1" and paper:
                lines.append(f"| *paper, CIFAR-10, {round(100 * frac)} %* | *{paper['plain']}* | " +
                             " | ".join(f"*{paper[p]}*" if p in paper else "–" for p in priors) +
                             f" | *{PAPER_CIFAR10[1.0]['plain']}* |")
        own = {p: an["priors"].get(p, {}).get("probe") for p in priors}
        if any(own.values()):
            probe_key = "linear_top1" if key == "top1" else key
            lines.append("| *the prior itself* | – | " + " | ".join(f"*{own[p][probe_key]:.2f}*" if own[p] else "–"
                                                                  for p in priors) + " | – |")
        out[key] = "\n".join(lines)
    lines = ["| budget | plain SSL: compute | " + " | ".join(f"ReLA, {PRIOR_LABEL[p]}: compute; hand-over step per seed"
                                                           for p in priors) + " |", "|---" * (2 + len(priors)) + "|"]
    for steps, row in an["table"]["budgets"].items():
        cells = ["–" if p not in row else f"{row[p]['compute']['mean']:.3f}; " +
                 ", ".join("never" if h is None else str(h) for h in row[p]["handover_step"]) for p in priors]
        plain = f"{row['plain']['compute']['mean']:.3f}" if "plain" in row else "–"
        lines.append(f"| {steps} steps | {plain} | " + " | ".join(cells) + " |")
    out["compute"] = "\n".join(lines)
    out["summary"] = goals(an, s)
    runs = result["runs"].values()
    train = sum(r["train_cpu_seconds"] for r in runs)
    probe = sum(c.get("probe_seconds", 0.0) for r in runs for c in r["curve"])
    pre = sum(v.get("cpu_seconds", 0.0) for v in an["priors"].values())
    out["cost"] = (f"The study: {len(result['runs'])} runs, {train / 3600:.1f} CPU-hours of training, "
                   f"{pre / 60:.1f} CPU-minutes of precompute and {probe / 3600:.1f} hours of probing (wall-clock), "
                   f"one torch thread per run.")
    longer = an.get("longer_plain") or {}
    out["longer"] = "\n".join(
        ["| plain SSL steps | seeds | linear % | kNN % | 100 labels/class % | the same seeds' full runs: linear % |",
         "|---:|---:|---:|---:|---:|---:|"] +
        [f"| {k} | {v['seeds']} | " + " | ".join(f"{v[q]:.2f}" for q in PROBES) +
         f" | {v['full_same_seeds']['top1']:.2f} ({s['full']} steps) |"
         for k, v in sorted(longer.items(), key=lambda kv: int(kv[0]))])
    return out


def goals(an: dict, s: dict) -> str:
    """The study's two goals, read off its table: with the prior trained on other data, full-budget plain SSL's
    linear-probe accuracy reached by ReLA + SSL within 50 % of its compute (precompute counted); with an untrained
    prior, the 10 % budget improved over plain SSL at that budget."""
    full = an["table"]["full"]["top1"]["mean"]
    rows = {int(k): v for k, v in an["table"]["budgets"].items()}
    lines = []
    other = [(k, v["other"]) for k, v in sorted(rows.items()) if "other" in v]
    within = [(k, c) for k, c in other if c["compute"]["mean"] <= 0.5]
    if within:
        k, c = within[-1]
        met = c["top1"]["mean"] >= full
        lines.append(f"With the prior trained on other data, ReLA + SSL reaches {c['top1']['mean']:.2f} % at "
                     f"{round(100 * k / s['full'])} % of the steps ({c['compute']['mean']:.2f} of the full run's compute, "
                     f"precompute included) against full-budget plain SSL's {full:.2f} %: the goal of reaching it within "
                     f"half the compute is **{'met' if met else 'not met'}**"
                     + ("." if met else f" ({c['top1']['mean'] - full:+.2f} points)."))
        later = [(k2, c2) for k2, c2 in other if k2 > k and c2["top1"]["mean"] >= full]
        if not met and later:
            k2, c2 = later[0]
            lines.append(f"It gets there at {round(100 * k2 / s['full'])} % of the steps ({c2['top1']['mean']:.2f} %), "
                         f"at {c2['compute']['mean']:.2f} of the full run's compute.")
    first = rows.get(min(rows)) if rows else None
    if first and "random" in first and "plain" in first:
        d = first["random"]["top1"]["mean"] - first["plain"]["top1"]["mean"]
        lines.append(f"With an untrained prior at {round(100 * min(rows) / s['full'])} % of the steps: "
                     f"{first['random']['top1']['mean']:.2f} % against plain SSL's {first['plain']['top1']['mean']:.2f} % "
                     f"({d:+.2f} points): the goal of improving the smallest budget is "
                     f"**{'met' if d > 0 else 'not met'}**.")
    return " ".join(lines)


def figure(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    an, s = result["analysis"], result["settings"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = [int(k) for k in an["table"]["budgets"]]
    for i, m in enumerate(["plain", *PRIORS]):
        pts = [(st / s["full"], an["table"]["budgets"][str(st)][m]["top1"]) for st in steps
               if m in an["table"]["budgets"][str(st)]]
        if pts:
            ax.errorbar([x for x, _ in pts], [v["mean"] for _, v in pts], yerr=[v["sd"] or 0 for _, v in pts],
                        marker="o", capsize=3, color=f"C{i}",
                        label="plain SSL" if m == "plain" else f"ReLA + SSL, {PRIOR_LABEL[m]}")
    full = an["table"]["full"]["top1"]
    ax.axhline(full["mean"], color="gray", ls=":", label=f"plain SSL, full budget ({s['full']} steps)")
    ax.set_xlabel("budget, fraction of the full run's steps")
    ax.set_ylabel("linear probe top-1 %")
    ax.set_title(f"{s['student']} student, {s['ssl']}: accuracy at each budget")
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path)


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.tables:
        print("\n\n".join(tables(json.loads(Path(a.tables).read_text())).values()))
        return
    import head_to_head as h2h

    data = h2h.data(a)
    todo = units(a)
    mine = [] if a.gather else todo[a.worker[0]::a.worker[1]]
    for unit in sorted(mine, key=lambda u: u[0] == "rela" and u[1] == "indomain"):  # the in-domain prior last
        run_unit(a, data, unit)
    if a.worker[1] > 1:
        print("budget.py: this worker's runs are done; `--gather` (or the command without --worker) writes the results.")
        return
    runs = {u: json.loads(unit_file(a, u).read_text()) for u in todo if unit_file(a, u).is_file()}
    if len(runs) < len(todo):
        print(f"budget.py: {len(runs)} of {len(todo)} runs done; rerun to finish.")
    if not any(u[0] == "plain" and u[2] == a.full for u in runs):
        print("budget.py: no full plain run among these runs, nothing to compare with: no results file written.")
        return
    result = {"command": "python benchmarks/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "complete": len(runs) == len(todo), "runs_done": len(runs), "runs_planned": len(todo),
              "settings": settings(a), "analysis": analyse(a, data, runs),
              "runs": {unit_file(a, u).stem: r for u, r in runs.items()}}
    write_results(a.out, result, device=a.device if a.device != "cpu" else None,
                  per_seed=["runs.*.curve", "analysis.table.budgets.*.*.top1.per_seed"])
    figure(result, Path(a.out).with_suffix(".png"))
    print("\n\n".join(tables(result).values()))


if __name__ == "__main__":
    main()
