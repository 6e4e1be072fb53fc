"""ReLA's two in-training checks of target rows: the witness (``rela/witness.py``) and the head check (``rela/guard.py``).

Every run is BYOL + ReLA on 28-px grayscale images with a small student (ConvNet 8/16/32, half the demo's widths: the
whole study runs in minutes on one core), the demo's prior (``shipped:digits-byol``, trained on other data), 16 target
components, the least-squares head, AdamW 1e-3, batch 64, ``--steps`` optimiser steps; the recipe is ``two-view`` (the ``decay`` schedule: BYOL's two views on
every step, lambda in (0, 1)) unless the case says ``one-view`` (the demo's: ``switch``, one weak view while
lambda = 1). Both checks run with their defaults, the witness set to warn instead of stopping, so every run goes to its
end and both detection steps are recorded.

Aligned runs (every alarm is a false alarm), over data of decreasing diversity: Fashion-MNIST (5000 images),
scikit-learn digits (1797), one Fashion-MNIST class (trousers, 4000), near-duplicates (10 images, each 300 times with
pixel noise and 1-px shifts), and Fashion-MNIST from WebDataset shards with the rows joined from sidecars
(``wrap(targets=)``). Misaligned runs on Fashion-MNIST: the store's rows under a random permutation of all, 10 % or
one pair of them; a class-shifted pairing (rows of class c given to class c + 1: wrong from step 0 and learnable by
the head); every step looking up the previous batch's indices (``stale``); and a memorised wrong pairing (a random
permutation on 512 images, trained 200 steps with both checks off, then continued with them on, the run planned
for 2 (200 + ``--steps``) steps so that lambda is still above 0 at the resume). And where the
witness cannot separate: a random prior (``random:convnet``) and heavy augmentation (crops down to 8 % of the image,
strong jitter), aligned and fully shuffled.

Per-view targets (``per-view``): a spatial store of the same prior (its 3x3 map of each image, every channel), each
view's row pooled over the view's crop box (``wrap(geometry=)``), BYOL's two views per step: aligned; the two views'
boxes given in the other order (``swapped boxes``: the geometry's view blocks swapped against the features); every
row another image's (``shuffled-100%``: the indices permuted); and the maps of another data set (``other data's
maps``: the loop trains on scikit-learn digits, its indices looked up in the Fashion-MNIST store, no ``dataset=``
given), at batches of 4 and 16 (few views per step, where the witness's calibration takes several steps). One-view
loops (one weak view per step while lambda = 1) are where nothing calibrates the witness: it must confirm aligned rows
and say, without stopping, when it cannot; the step it says so is recorded. Short loops (``10 steps``) end before the
head check's first window (batch 12) and within the witness's first steps.

Each case runs ``--steps`` optimiser steps (80) unless it says otherwise, at batch 64 unless it says otherwise; the
step at which the witness stops each misaligned run is recorded (``detections``).

Cost: the two-view step with both checks on vs off, interleaved step by step over ``--cost-steps`` steps, with the
demo's student (ConvNet 16/32/64) at batch 128.

    nice -n 5 python benchmarks/alignment.py             # the study in benchmarks/README.md (runs cached, resumable)
    python benchmarks/alignment.py --cases fashion-mnist:aligned --seeds 0    # a quick look

Writes ``benchmarks/results/alignment.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accelerate_ssl.atomic import atomic_path, atomic_write_json  # noqa: E402
from accelerate_ssl.results import save_figure, write_results  # noqa: E402

VERSION = 8  # bump when a change invalidates cached runs
PRIOR = "shipped:digits-byol"
#: the study's student (ConvNet widths) and batch unless a case says: small, so that the ~100 runs take minutes
WIDTHS, BATCH = (8, 16, 32), 64
#: case -> (data, rows, recipe, seeds[, options]); rows: how the store's rows are given to the samples; options:
#: ``batch`` (default :data:`BATCH`) and ``steps`` (default ``--steps``)
CASES = {
    "fashion-mnist:aligned": ("fashion-mnist", "aligned", "two-view", 4),
    "digits:aligned": ("digits", "aligned", "two-view", 4),
    "one-class:aligned": ("one-class", "aligned", "two-view", 4),
    "near-duplicates:aligned": ("near-duplicates", "aligned", "two-view", 4),
    "webdataset:aligned": ("webdataset", "aligned", "two-view", 4),
    "per-view:aligned": ("fashion-mnist", "aligned", "per-view", 4),
    "per-view:aligned (batch 4)": ("fashion-mnist", "aligned", "per-view", 4, {"batch": 4}),
    "fashion-mnist:aligned (one-view)": ("fashion-mnist", "aligned", "one-view", 4),
    "digits:aligned (one-view)": ("digits", "aligned", "one-view", 4),
    "fashion-mnist:aligned (10 steps)": ("fashion-mnist", "aligned", "two-view", 4, {"steps": 10}),
    "fashion-mnist:aligned (one-view, 10 steps)": ("fashion-mnist", "aligned", "one-view", 4, {"steps": 10}),
    "per-view:aligned (10 steps)": ("fashion-mnist", "aligned", "per-view", 4, {"steps": 10}),
    "fashion-mnist:shuffled-100%": ("fashion-mnist", "shuffled-100%", "two-view", 2),
    "fashion-mnist:shuffled-10%": ("fashion-mnist", "shuffled-10%", "two-view", 2),
    "fashion-mnist:swapped pair": ("fashion-mnist", "swapped pair", "two-view", 2),
    "fashion-mnist:class-shifted": ("fashion-mnist", "class-shifted", "two-view", 2),
    "fashion-mnist:stale": ("fashion-mnist", "stale", "two-view", 2),
    "fashion-mnist:memorised": ("fashion-mnist", "memorised", "two-view", 2),
    "fashion-mnist:shuffled-100% (one-view)": ("fashion-mnist", "shuffled-100%", "one-view", 2),
    "per-view:swapped boxes": ("fashion-mnist", "swapped boxes", "per-view", 2),
    "per-view:shuffled-100%": ("fashion-mnist", "shuffled-100%", "per-view", 2),
    "per-view:other data's maps (batch 4)": ("digits", "other data's maps", "per-view", 4, {"batch": 4}),
    "per-view:other data's maps (batch 16)": ("digits", "other data's maps", "per-view", 4, {"batch": 16}),
    "random prior:aligned": ("fashion-mnist", "aligned", "random prior", 2),
    "random prior:shuffled-100%": ("fashion-mnist", "shuffled-100%", "random prior", 2),
    "heavy augmentation:aligned": ("fashion-mnist", "aligned", "heavy augmentation", 2),
    "heavy augmentation:shuffled-100%": ("fashion-mnist", "shuffled-100%", "heavy augmentation", 2),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds of every case (default: each case's count)")
    p.add_argument("--steps", type=int, default=80, help="optimiser steps per run, unless a case says (default 80)")
    p.add_argument("--cost-steps", type=int, default=100, help="interleaved steps of the cost measurement (0: skip)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/alignment"), help="per-run JSON cache, stores, shards")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/alignment.json"))
    return p


# ---------------------------------------------------------------------------------------------- data and rows
def images_of(data: str):
    """A data set (PIL-free ``ArrayImageDataset``) of 28-px grayscale images, and its labels."""
    from accelerate_ssl.data import FashionMNIST
    from accelerate_ssl.data.datasets import ArrayImageDataset, Digits

    if data == "digits":
        return Digits()
    full = FashionMNIST("train", limit=None if data in ("one-class", "near-duplicates") else 5000)
    images, labels = np.asarray(full.data), np.asarray(full.targets)
    if data == "one-class":
        keep = np.flatnonzero(labels == 1)[:4000]
        return ArrayImageDataset(images[keep], labels[keep], name="fashion-mnist-trousers")
    if data == "near-duplicates":
        g = np.random.default_rng(0)
        base = images[[int(np.flatnonzero(labels == c)[0]) for c in range(10)]].astype(np.float32)
        out = []
        for i in range(3000):
            im = np.roll(base[i % 10], tuple(g.integers(-1, 2, 2)), axis=(0, 1)) + g.normal(0, 8, (28, 28))
            out.append(np.clip(im, 0, 255).astype(np.uint8))
        return ArrayImageDataset(np.stack(out), np.arange(3000) % 10, name="near-duplicates")
    return ArrayImageDataset(images, labels, name="fashion-mnist-5000")


def wrong_rows(rows: torch.Tensor, labels: np.ndarray, kind: str, seed: int) -> torch.Tensor:
    """The store's rows given to other samples: a random permutation of all or 10 % of them, one swapped pair, or
    class c's rows given to class c + 1 (each sample a random row of that class)."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = rows.clone()
    if kind.startswith("shuffled") or kind == "memorised":
        fraction = 1.0 if kind in ("memorised", "shuffled-100%") else 0.1
        chosen = torch.randperm(len(rows), generator=g)[: round(fraction * len(rows))]
        out[chosen] = rows[chosen[torch.randperm(len(chosen), generator=g)]]
    elif kind == "swapped pair":
        i, j = torch.randperm(len(rows), generator=g)[:2].tolist()
        out[i], out[j] = rows[j], rows[i]
    elif kind == "class-shifted":
        labels = torch.as_tensor(labels)
        for c in range(int(labels.max()) + 1):
            mine, theirs = (labels == c).nonzero().flatten(), (labels == (c + 1) % 10).nonzero().flatten()
            out[mine] = rows[theirs[torch.randint(len(theirs), (len(mine),), generator=g)]]
    return out


# ---------------------------------------------------------------------------------------------- one run
def make_rela(targets, backbone, recipe: str, steps: int, prior_spec: str, checks: bool = True):
    from accelerate_ssl.rela import ReLA, Witness
    from accelerate_ssl.priors import create_prior

    given = None if hasattr(targets, "metadata") else create_prior(prior_spec)  # in-memory rows record no prior
    witness = Witness(prior=given, on_misalignment="warn") if checks else False
    return ReLA(targets, backbone, schedule="switch" if recipe == "one-view" else "decay", total_steps=steps,
                feature_dim=backbone.feature_dim, n_components=16, alignment_check=checks, witness=witness)


def train(model, rela, batches, steps: int, recipe: str, seed: int, on_step=None) -> dict:
    from accelerate_ssl.recipes import BYOL_VIEWS, train_ssl
    from accelerate_ssl.recipes.views import ViewConfig

    views = ViewConfig(scale=(0.08, 1.0), jitter=0.8) if recipe == "heavy augmentation" else BYOL_VIEWS
    opt = torch.optim.AdamW([*(p for p in model.parameters() if p.requires_grad), *rela.parameters()], lr=1e-3,
                            weight_decay=0.01)
    return train_ssl(model, batches, steps, optimizer=opt, view_generator=torch.Generator().manual_seed(seed + 1),
                     views=views, rela=rela, rela_views="weak" if recipe == "one-view" else "byol",
                     rela_step="one-view" if recipe == "one-view" else "two-view", on_step=on_step)


class Said:
    """Records the step of each warning the checks give during a run (the witness's WitnessWarning, the head check's
    and the witness's MisalignmentWarning), instead of printing them."""

    def __init__(self):
        self.rela, self.seen = None, []

    def __enter__(self):
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        return self

    def _record(self, message, category, *args, **kwargs):
        if category.__name__ in ("WitnessWarning", "MisalignmentWarning"):
            step = None if self.rela is None else self.rela.steps
            self.seen.append({"step": step, "category": category.__name__, "message": str(message)[:400]})

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)

    def first(self, category: str, contains: str = "") -> dict | None:
        return next((w for w in self.seen if w["category"] == category and contains in w["message"]), None)


def options(case: str, args) -> tuple[int, int]:
    """A case's batch size and optimiser steps (``args.steps`` unless the case says)."""
    extra = CASES[case][4] if len(CASES[case]) > 4 else {}
    return extra.get("batch", BATCH), extra.get("steps", None if args is None else args.steps)


def run_one(case: str, seed: int, args, stores: dict) -> dict:
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.recipes import BYOL, images_to_tensor, shuffled_batches, tensor_batches

    data, kind, recipe = CASES[case][:3]
    if data == "webdataset":
        return run_webdataset(seed, args, stores)
    if recipe == "per-view":
        return run_per_view(case, kind, seed, args, stores)
    batch, steps = options(case, args)
    prior_spec = "random:convnet" if recipe == "random prior" else PRIOR
    dataset, store = stores[(data, prior_spec)]
    images = images_to_tensor(dataset.data)
    rows = torch.as_tensor(np.array(store.array), dtype=torch.float32)
    targets = store if kind in ("aligned", "stale") else wrong_rows(rows, np.asarray(dataset.targets), kind, seed)
    torch.manual_seed(seed)
    backbone = ConvNet(widths=WIDTHS)
    model = BYOL(backbone, backbone.feature_dim)
    # memorised: the first 200 steps of a run planned for 2 (200 + steps), so that the decay schedule's end (half the
    # plan) is the last step and lambda is still above 0 where the checks are switched on, at the resume
    memorised = 200 if kind == "memorised" else 0
    plan = 2 * (memorised + steps) if memorised else steps
    if kind == "memorised":  # 200 steps on 512 images with the wrong pairing and no check, then on with the checks
        images, targets = images[:512], targets[:512]
        rela = make_rela(targets, backbone, recipe, plan, prior_spec, checks=False)
        train(model, rela, tensor_batches(images, shuffled_batches(512, BATCH, seed=seed)), memorised, recipe, seed)
        state = rela.state_dict()
        rela.close()
    order = shuffled_batches(len(images), batch, seed=seed)
    batches = tensor_batches(images, order)
    if kind == "stale":  # the images of batch t with the indices of batch t - 1
        def lagged(order=order):
            previous = next(order)
            for current in order:
                yield images[current], previous
                previous = current
        batches = lagged()
    rela = make_rela(targets, backbone, recipe, plan, prior_spec)
    if kind == "memorised":
        rela.load_state_dict({**state, "alignment_check": None, "witness": None})
    t0 = time.perf_counter()
    with Said() as said:
        said.rela = rela
        train(model, rela, batches, steps, recipe, seed)
    return summary_of(rela, case, seed, time.perf_counter() - t0, said)


def run_per_view(case: str, kind: str, seed: int, args, stores: dict) -> dict:
    """BYOL's two views per step, each view's row pooled from the spatial store over its crop box
    (``wrap(geometry=)``); ``swapped boxes``: the geometry's two view blocks in the other order than the features;
    ``shuffled-100%``: every batch's indices mapped through a random permutation (another image's map); ``other data's
    maps``: the loop trains on another data set (digits), its indices looked up in the store of Fashion-MNIST's maps."""
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.recipes import BYOL, BYOL_VIEWS, images_to_tensor, random_views, shuffled_batches

    dataset, store = stores["per-view"]
    batch, steps = options(case, args)
    images = images_to_tensor((images_of("digits") if kind == "other data's maps" else dataset).data)
    permutation = torch.randperm(len(images), generator=torch.Generator().manual_seed(1000 + seed))
    torch.manual_seed(seed)
    backbone = ConvNet(widths=WIDTHS)
    model = BYOL(backbone, backbone.feature_dim)
    rela = make_rela(store, backbone, "two-view", steps, PRIOR)
    opt = torch.optim.AdamW([*(p for p in model.parameters() if p.requires_grad), *rela.parameters()], lr=1e-3,
                            weight_decay=0.01)
    g = torch.Generator().manual_seed(seed + 1)
    order = shuffled_batches(len(images), batch, seed=seed)
    t0 = time.perf_counter()
    with Said() as said:
        said.rela = rela
        for _ in range(steps):
            index = next(order)
            drawn = [random_views(images[index], BYOL_VIEWS, g, geometry=True) for _ in range(2)]
            views, boxes = [v for v, _ in drawn], [b for _, b in drawn]
            features = [backbone(v) for v in views]
            geometry = torch.cat(boxes[::-1] if kind == "swapped boxes" else boxes)
            rows = permutation[index] if kind == "shuffled-100%" else index
            loss = rela.wrap(lambda: model.step_loss(features, views, None), index=rows, geometry=geometry)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            model.update_momentum(0.99)
    return summary_of(rela, case, seed, time.perf_counter() - t0, said)


def run_webdataset(seed: int, args, stores: dict) -> dict:
    """The same two-view recipe on WebDataset shards, each sample's row joined from its sidecar (``targets=``)."""
    import webdataset as wds

    from accelerate_ssl import ShardedTargets, decode_images
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.recipes import BYOL, BYOL_VIEWS, images_to_tensor, random_views

    urls, folder = stores["webdataset"]
    targets = ShardedTargets.open(folder)
    data = (wds.WebDataset(urls, shardshuffle=len(urls), seed=seed, empty_check=False).compose(targets.join())
            .map(decode_images()).shuffle(1000, seed=seed)
            .map_dict(png=lambda a: torch.from_numpy(np.array(a))).to_tuple("png", "target"))
    torch.manual_seed(seed)
    backbone = ConvNet(widths=WIDTHS)
    model = BYOL(backbone, backbone.feature_dim)
    rela = make_rela(targets, backbone, "two-view", args.steps, PRIOR)
    opt = torch.optim.AdamW([*(p for p in model.parameters() if p.requires_grad), *rela.parameters()], lr=1e-3,
                            weight_decay=0.01)
    g = torch.Generator().manual_seed(seed + 1)
    t0, step = time.perf_counter(), 0
    with Said() as said:
        said.rela = rela
        while step < args.steps:
            for x, t in torch.utils.data.DataLoader(data, batch_size=BATCH):
                if step == args.steps:
                    break
                views = [random_views(images_to_tensor(x), BYOL_VIEWS, g) for _ in range(2)]
                features = [backbone(v) for v in views]
                loss = rela.wrap(lambda: model.step_loss(features, views, None), targets=t)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                model.update_momentum(0.99)
                step += 1
    return summary_of(rela, "webdataset:aligned", seed, time.perf_counter() - t0, said)


def summary_of(rela, case: str, seed: int, seconds: float, said: Said) -> dict:
    with said:  # the last reads' verdicts (and their warnings) at the run's end
        rela.witness._judge_ready(None, wait=True)
        rela.guard._poll(wait=True)
    rela.close()
    told = said.first("WitnessWarning", "cannot refute")
    return {"case": case, "seed": seed, "seconds": seconds, "batch": options(case, None)[0], "steps": rela.steps,
            "guard": {"alarm": rela.guard.alarm, "windows": [dict(w) for w in rela.guard.history]},
            "witness": {"alarm": rela.witness.alarm, "status": rela.witness.status, "last": rela.witness.last,
                        "said_one_view_step": None if told is None else told["step"]},
            "warnings": said.seen}


# ---------------------------------------------------------------------------------------------- cost
def cost(args, stores: dict) -> dict:
    """Step time of the two-view recipe with both checks on and off, the two runs' steps interleaved one by one."""
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.recipes import BYOL, images_to_tensor, shuffled_batches, tensor_batches

    dataset, store = stores[("fashion-mnist", PRIOR)]
    images = images_to_tensor(dataset.data)
    runs = {}
    for checks in (True, False):
        torch.manual_seed(0)
        backbone = ConvNet(widths=(16, 32, 64))
        model = BYOL(backbone, backbone.feature_dim)
        rela = make_rela(store, backbone, "two-view", args.cost_steps, PRIOR, checks=checks)
        runs[checks] = (model, rela, tensor_batches(images, shuffled_batches(len(images), 128, seed=0)), [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(args.cost_steps):
            for checks, (model, rela, batches, times) in runs.items():
                times.append(train(model, rela, batches, 1, "two-view", 0)["step_seconds"][0])
    on, off = (runs[c][3][2:] for c in (True, False))
    return {"steps": len(on), "mean_on": statistics.fmean(on), "mean_off": statistics.fmean(off),
            "median_on": statistics.median(on), "median_off": statistics.median(off),
            "ratio_of_means": statistics.fmean(on) / statistics.fmean(off)}


# ---------------------------------------------------------------------------------------------- the report
def summarise(runs: list[dict]) -> list[dict]:
    out = []
    for case in CASES:
        rs = [r for r in runs if r["case"] == case]
        if not rs:
            continue
        wit = [r["witness"]["alarm"]["step"] for r in rs if r["witness"]["alarm"]]
        head = [r["guard"]["alarm"]["batch"] for r in rs if r["guard"]["alarm"]]
        ranks = [(r["witness"]["last"] or {}).get("rows_rank") for r in rs]
        views = [(r["witness"]["last"] or {}).get("view_rank") for r in rs]
        boxes = [(r["witness"]["last"] or {}).get("own_box") for r in rs]
        said = [r["witness"].get("said_one_view_step") for r in rs if r["witness"].get("said_one_view_step") is not None]
        statuses = sorted({r["witness"]["status"] for r in rs})
        out.append({"case": case, "runs": len(rs), "witness_alarms": len(wit), "head_alarms": len(head),
                    "witness_median_step": statistics.median(wit) if wit else None,
                    "head_median_batch": statistics.median(head) if head else None,
                    "witness_said": len(said), "witness_said_median_step": statistics.median(said) if said else None,
                    "rows_rank": statistics.fmean([x for x in ranks if x is not None] or [float("nan")]),
                    "view_rank": statistics.fmean([x for x in views if x is not None] or [float("nan")]),
                    "own_box": statistics.fmean([x for x in boxes if x is not None] or [float("nan")]),
                    "witness_status": ", ".join(statuses)})
    return out


def false_alarms(summary: list[dict]) -> dict:
    """Every alarm on an aligned case is a false one: counted over the aligned runs, for each check (and over the
    one-view, per-view and short aligned loops among them)."""
    aligned = [s for s in summary if ":aligned" in s["case"]]

    def runs(words):
        return sum(s["runs"] for s in aligned if any(w in s["case"] for w in words))
    return {"aligned_runs": sum(s["runs"] for s in aligned),
            "one_view_runs": runs(["one-view"]), "per_view_runs": runs(["per-view"]), "short_runs": runs(["10 steps"]),
            "witness_stops": sum(s["witness_alarms"] for s in aligned),
            "head_warnings": sum(s["head_alarms"] for s in aligned)}


def detections(runs: list[dict]) -> dict:
    """The step at which the witness stopped each misaligned run (None: it did not), and the batch the head check
    warned at, by case."""
    out: dict = {}
    for r in runs:
        if ":aligned" in r["case"]:
            continue
        w, g = r["witness"]["alarm"], r["guard"]["alarm"]
        out.setdefault(r["case"], []).append({"seed": r["seed"], "witness_step": None if w is None else w["step"],
                                              "head_batch": None if g is None else g["batch"]})
    return out


def table(summary: list[dict], cost_result: dict) -> str:
    lines = ["| case | runs | witness: stops | median step | says it cannot refute | median step | head check: warns | "
             "median batch | own row's rank | another view's rank | own box closer | witness status |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in summary:
        def med(v):
            return "" if v is None else f"{v:.0f}"

        def num(v):
            return "" if v is None or v != v else f"{v:.3f}"
        lines.append(f"| {s['case']} | {s['runs']} | {s['witness_alarms']} | {med(s['witness_median_step'])} | "
                     f"{s['witness_said']} | {med(s['witness_said_median_step'])} | "
                     f"{s['head_alarms']} | {med(s['head_median_batch'])} | {num(s['rows_rank'])} | "
                     f"{num(s['view_rank'])} | {num(s['own_box'])} | {s['witness_status']} |")
    fa = false_alarms(summary)
    lines.append(f"\nfalse alarms over {fa['aligned_runs']} aligned runs ({fa['one_view_runs']} one-view, "
                 f"{fa['per_view_runs']} per-view, {fa['short_runs']} of 10 steps): witness {fa['witness_stops']}, head "
                 f"check {fa['head_warnings']}")
    if cost_result:
        lines.append(f"\nstep with both checks / without (two-view recipe, {cost_result['steps']} interleaved steps, "
                     f"mean): {cost_result['ratio_of_means']:.4f} ({cost_result['mean_on'] * 1000:.1f} vs "
                     f"{cost_result['mean_off'] * 1000:.1f} ms)")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    cases = list(dict.fromkeys(r["case"] for r in runs))
    for i, case in enumerate(cases):
        pts = [(r["witness"]["last"] or {}) for r in runs if r["case"] == case]
        pts = [p for p in pts if p.get("view_rank") is not None]
        ax.scatter([p["view_rank"] for p in pts], [p["rows_rank"] for p in pts], s=18, color=f"C{i % 10}",
                   marker="o" if "aligned" in case else "x", label=case)
    xs = np.linspace(0, 0.5, 50)
    ax.plot(xs, (0.5 + xs) / 2, "k--", lw=0.8, label="stop above (+ 3 se)")
    ax.axhline(0.5, color="gray", lw=0.6)
    ax.set_xlabel("another view's mean rank among the witnessed views (0 = recognised)")
    ax.set_ylabel("own row's mean rank among the batch's rows")
    ax.set_title("ReLA's witness: the last verdict of each run (o aligned, x misaligned)", fontsize=10)
    ax.legend(fontsize=6, ncol=2, loc="upper right")
    per_view = [c for c in cases if c.startswith("per-view")]
    for i, case in enumerate(per_view):
        shares = [(r["witness"]["last"] or {}).get("own_box") for r in runs if r["case"] == case]
        shares = [s for s in shares if s is not None]
        bx.scatter([i] * len(shares), shares, s=22, marker="o" if "aligned" in case else "x")
    bx.axhline(0.5, color="gray", lw=0.6)
    bx.set_xticks(range(len(per_view)), [c.split(":", 1)[1] for c in per_view], fontsize=8)
    bx.set_ylim(0, 1)
    bx.set_ylabel("share of samples whose views are closer to their own box")
    bx.set_title("per-view rows: each view against its own box and the other's", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def prepare(args, cases: list[str]) -> dict:
    """The stores (one per data set and prior) and the WebDataset shards with their sidecars, cached (the per-view
    store is Fashion-MNIST's maps, whatever data its case trains on)."""
    from accelerate_ssl import precompute_sidecars
    from accelerate_ssl.targets.precompute import precompute_targets
    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.targets.store import TargetStore

    cache, stores = Path(args.cache), {}
    for case in cases:
        data, _, recipe = CASES[case][:3]
        if data == "webdataset":
            data = "fashion-mnist"
            urls = write_shards(images_of(data), cache / "shards")
            folder = cache / "sidecars"
            if not (folder / "sidecars.json").is_file():
                spec = f"wds:{cache}/shards/shard-{{000000..{len(urls) - 1:06d}}}.tar"
                precompute_sidecars(create_prior(PRIOR), spec, folder, progress=False)
            stores["webdataset"] = (urls, folder)
        if recipe == "per-view":  # the prior's 3x3 map of each image, every channel
            if "per-view" not in stores:
                dataset = images_of("fashion-mnist")
                path = cache / f"store-fashion-mnist-{PRIOR.replace(':', '_')}-map"
                store = TargetStore.open(path, dataset=dataset) if (path / "metadata.json").is_file() else \
                    precompute_targets(create_prior(PRIOR), dataset, path, progress=False, spatial=True)
                stores["per-view"] = (dataset, store)
            continue
        prior = "random:convnet" if recipe == "random prior" else PRIOR
        if (data, prior) not in stores:
            dataset = images_of(data)
            path = cache / f"store-{data}-{prior.replace(':', '_')}"
            store = TargetStore.open(path, dataset=dataset) if (path / "metadata.json").is_file() else \
                precompute_targets(create_prior(prior), dataset, path, progress=False)
            stores[(data, prior)] = (dataset, store)
    return stores


def write_shards(dataset, folder: Path, per_shard: int = 1000) -> list[str]:
    import io
    import tarfile

    from PIL import Image

    urls = []
    for s in range(0, len(dataset), per_shard):
        path = folder / f"shard-{s // per_shard:06d}.tar"
        urls.append(str(path))
        if path.is_file():
            continue
        with atomic_path(path) as tmp, tarfile.open(tmp, "w") as tar:
            for i in range(s, min(s + per_shard, len(dataset))):
                buf = io.BytesIO()
                Image.fromarray(np.asarray(dataset.data[i])).save(buf, format="png")
                info = tarfile.TarInfo(f"{i:06d}.png")
                info.size = buf.tell()
                buf.seek(0)
                tar.addfile(info, buf)
    return urls


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    load_start, started = os.getloadavg(), time.strftime("%Y-%m-%dT%H:%M:%S")
    torch.set_num_threads(args.threads)
    stores = prepare(args, args.cases + ["fashion-mnist:aligned"])
    settings = {"steps": args.steps, "batch": BATCH, "student_widths": list(WIDTHS), "threads": args.threads,
                "prior": PRIOR, "version": VERSION}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    runs = []
    for case in args.cases:
        for seed in (args.seeds if args.seeds is not None else range(CASES[case][3])):
            path = Path(args.cache) / f"run-{hashlib.sha256(case.encode()).hexdigest()[:8]}-{seed}-{key}.json"
            if not path.is_file():
                print(f"{case}, seed {seed} ...", flush=True)
                atomic_write_json(path, run_one(case, seed, args, stores))
            runs.append(json.loads(path.read_text()))
    cost_result = cost(args, stores) if args.cost_steps else {}
    summary = summarise(runs)
    result = {"command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/alignment.py", *sys.argv[1:]]),
              "started": started,
              "threads": args.threads, "load_average_start": load_start,
              "settings": settings, "summary": summary, "false_alarms": false_alarms(summary),
              "detections": detections(runs), "cost": cost_result,
              "table": table(summary, cost_result),
              "runs": runs}
    out = Path(args.out)
    write_results(out, result, root=ROOT)
    plot(runs, out.with_suffix(".png"))
    print(result["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
