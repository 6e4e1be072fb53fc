"""Dense targets: does pulling the student's feature map toward the prior's stored map help a dense task?

The task: Fashion-MNIST items on cluttered 48 px canvases (:class:`accelerate_ssl.data.Canvas`, the head-to-head
benchmark's scenes) with each item's exact mask. Each 8 px cell of a scene (a 6x6 grid, the student's last map) is
labelled with the item's class where the item covers at least half of the cell, else background: 11 classes. Probe:
the student's map of the training scenes, standardised, a linear classifier per location (all cells share it), the
mean IoU over the 11 classes on the test scenes; and the usual global linear probe.

Teacher: the head-to-head's (``benchmarks/teachers/canvas48-supervised.safetensors``, a ConvNet 32/64/128 trained
with labels on other scenes), its 6x6 map of every training scene in a spatial store, reduced at write as each
``--reductions`` entry says: ``K`` (every location to its top K PCA components, ``spatial=K``), ``all`` (every one of
the map's 128 channels, ``spatial=True``), each optionally ``:float16`` (``dtype=``); the ReLA methods run once per
reduction, so the accuracy each reduction costs is read beside its bytes per image.
Student: ConvNet 16/32/64, the same initialisation per seed. Methods, ``--steps`` optimiser steps each:

* ``plain``: VICReg alone;
* ``global``: ``rela.wrap(vicreg_loss)``, each view's target pooled from the stored map over its box;
* ``dense``: the same, with ``ReLA(dense=student.features)``: each location of the student's map pulled toward the
  stored map pooled over the view's box, through a 1x1 head;
* ``dense-only``: the same with ``dense_only=True``: the student pulled by the dense term alone;
* ``global-whole``: ``global`` without the views' geometry: every view gets its whole scene's row (the map's mean).

Cost: each run's CPU seconds, plus the precompute's for the ReLA methods; ``plain`` is also read at the seconds each
ReLA run took (equal CPU time). Every unit is one JSON under ``--cache`` (rerun to resume).

    nice -n 5 python benchmarks/dense.py          # 3 seeds (~25 min at one thread)
    nice -n 5 python benchmarks/dense.py --methods plain dense --reductions 2 4 16 all 16:float16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from accelerate_ssl.atomic import atomic_write_json  # noqa: E402
from accelerate_ssl.results import save_figure, write_results  # noqa: E402

METHODS = ("plain", "global", "dense", "dense-only", "global-whole")
LABEL = {"plain": "plain VICReg", "global": "ReLA, global (per view)", "dense": "ReLA, global + dense (per view)",
         "dense-only": "ReLA, dense only (per view)", "global-whole": "ReLA, global (whole image)"}
BACKGROUND = 10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--probes", type=int, nargs="+", default=[0, 100, 200])
    p.add_argument("--train-size", type=int, default=10000)
    p.add_argument("--test-size", type=int, default=2000)
    p.add_argument("--prior", default="checkpoint:benchmarks/teachers/canvas48-supervised.safetensors")
    p.add_argument("--reductions", nargs="+", default=["16"], type=reduction,
                   help="spatial store reductions: K (PCA components per location) or 'all', optionally ':float16'")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/dense"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/dense.json"))
    a = p.parse_args(argv)
    a.probes = sorted({s for s in a.probes if 0 <= s <= a.steps} | {0, a.steps})
    return a


def reduction(text: str) -> str:
    """``K``, ``all``, ``K:float16`` or ``all:float16`` (argparse type), returned as written."""
    k, _, dtype = text.partition(":")
    if not (k == "all" or (k.isdigit() and int(k) >= 1)) or dtype not in ("", "float16", "float32"):
        raise argparse.ArgumentTypeError(f"a reduction is K (an int >= 1) or 'all', optionally ':float16', got {text!r}")
    return text


def spatial_of(r: str):
    """The precompute's ``spatial=`` and ``dtype=`` of a reduction."""
    k, _, dtype = r.partition(":")
    return (True if k == "all" else int(k)), (dtype or "float32")


def tag(r: str) -> str:
    return "k" + r.replace(":", "-")


def settings(a, kind: str, r: str = None) -> dict:
    """What a unit's result depends on (plain runs: no prior, no reduction)."""
    s = {k: getattr(a, k) for k in ("steps", "probes", "train_size", "test_size", "threads")}
    return s if kind == "plain" else {**s, "prior": a.prior, "reduction": r}


# ---------------------------------------------------------------------------------------------- data and probes
def cell_labels(masks: torch.Tensor, labels: torch.Tensor, cell: int = 8) -> torch.Tensor:
    """``[N, H/cell, W/cell]`` classes: the item's where it covers at least half of the cell, else background."""
    cover = F.avg_pool2d(masks.float().unsqueeze(1), cell).squeeze(1)
    return torch.where(cover >= 0.5, labels.view(-1, 1, 1).long(), torch.full_like(cover, BACKGROUND).long())


def data(a):
    from accelerate_ssl.data import Canvas, FashionMNIST
    from accelerate_ssl.recipes import images_to_tensor

    train = Canvas(FashionMNIST("train", limit=a.train_size), size=48, seed=1)
    test = Canvas(FashionMNIST("test", limit=a.test_size), size=48, seed=2)
    return train, test, images_to_tensor(train.data), images_to_tensor(test.data)


def miou(pred: torch.Tensor, truth: torch.Tensor, classes: int = BACKGROUND + 1) -> float:
    """Mean over classes of TP / (TP + FP + FN), in % (classes absent from both are skipped)."""
    ious = []
    for c in range(classes):
        p, t = pred == c, truth == c
        union = (p | t).sum().item()
        if union:
            ious.append((p & t).sum().item() / union)
    return 100.0 * statistics.fmean(ious)


class DenseProbe:
    """A linear classifier shared by every location of the student's map (standardised by the training cells'
    statistics), trained with Adam on the training scenes' cells; the test scenes' mIoU."""

    def __init__(self, train, test, xtr, xte, seed: int, epochs: int = 8):
        self.xtr, self.xte, self.seed, self.epochs = xtr, xte, seed, epochs
        self.ytr, self.yte = cell_labels(train.masks, train.targets), cell_labels(test.masks, test.targets)

    @torch.no_grad()
    def maps(self, backbone, x):
        backbone.eval()
        out = torch.cat([backbone.features(x[i:i + 1024]) for i in range(0, len(x), 1024)])
        backbone.train()
        return out

    def __call__(self, backbone) -> float:
        ftr, fte = self.maps(backbone, self.xtr), self.maps(backbone, self.xte)
        if ftr.shape[-2:] != self.ytr.shape[-2:]:
            ftr = F.adaptive_avg_pool2d(ftr, self.ytr.shape[-2:])
            fte = F.adaptive_avg_pool2d(fte, self.yte.shape[-2:])
        rows = lambda f: f.permute(0, 2, 3, 1).reshape(-1, f.shape[1])  # noqa: E731
        ftr, fte = rows(ftr), rows(fte)
        mean, std = ftr.mean(0), ftr.std(0) + 1e-6
        ftr, fte = (ftr - mean) / std, (fte - mean) / std
        ytr = self.ytr.reshape(-1)
        g = torch.Generator().manual_seed(self.seed)
        with torch.random.fork_rng(devices=[]):  # the same start for every method of the seed
            torch.manual_seed(self.seed)
            head = torch.nn.Linear(ftr.shape[1], BACKGROUND + 1)
        opt = torch.optim.Adam(head.parameters(), lr=1e-2)
        with torch.enable_grad():
            for _ in range(self.epochs):
                for idx in torch.randperm(len(ftr), generator=g).split(4096):
                    loss = F.cross_entropy(head(ftr[idx]), ytr[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        with torch.no_grad():
            pred = head(fte).argmax(1)
        return miou(pred, self.yte.reshape(-1))


# ---------------------------------------------------------------------------------------------- units
def store(a, train, r: str):
    """The spatial store of reduction ``r`` (precomputed once) and its cost: seconds, CPU seconds, bytes per image."""
    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.targets.precompute import precompute_targets
    from accelerate_ssl.targets.store import TargetStore

    spatial, dtype = spatial_of(r)
    folder = Path(a.cache) / f"store-{a.train_size}-{tag(r)}"
    memo = folder.with_suffix(".json")
    if not memo.is_file():
        t, c = time.perf_counter(), time.process_time()
        precompute_targets(create_prior(a.prior), train, folder, progress=True, spatial=spatial, dtype=dtype)
        atomic_write_json(memo, {"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c})
    import numpy as np

    opened = TargetStore.open(folder, dataset=train)
    rows = np.load(folder / "targets.npy", mmap_mode="r")
    return opened, {**json.loads(memo.read_text()), "bytes_per_image": rows.nbytes / len(rows),
                    "grid": list(opened.grid), "channels": opened.dim, "dtype": opened.dtype}


def run_unit(a, kind: str, seed: int, r: str = None) -> dict:
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.recipes import Probe, create_method, shuffled_batches, tensor_batches, train_ssl
    from accelerate_ssl.rela import ReLA
    from accelerate_ssl.schedules import create_schedule

    torch.set_num_threads(a.threads)
    train, test, xtr, xte = data(a)
    torch.manual_seed(seed)
    backbone = ConvNet(widths=(16, 32, 64))
    method = create_method("vicreg", backbone, backbone.feature_dim)
    params, rela = [p for p in method.parameters() if p.requires_grad], None
    if kind != "plain":
        targets, _ = store(a, train, r)
        rela = ReLA(targets, backbone, dataset=train, schedule=create_schedule("switch", total_steps=a.steps),
                    feature_dim=backbone.feature_dim,
                    dense=backbone.features if kind.startswith("dense") else None, dense_only=kind == "dense-only")
        params += list(rela.parameters())  # the global head; the dense one is built at the first wrap (ReLA's AdamW)
    linear = Probe(xtr, train.targets, xte, test.targets, seed=seed)
    dense = DenseProbe(train, test, xtr, xte, seed)
    last: dict = {}

    def probe(b):
        last.clear()
        last["miou"] = dense(b)
        return linear(b)

    try:
        log = train_ssl(method, tensor_batches(xtr, shuffled_batches(len(xtr), 128, seed)), a.steps,
                        optimizer=torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
                        view_generator=torch.Generator().manual_seed(seed + 1), rela=rela, rela_views="weak",
                        per_view=rela is not None and kind != "global-whole", checkpoints=a.probes, probe=probe,
                        checkpoint_extras=lambda: dict(last), progress=f"{kind} {seed}")
    finally:
        if rela is not None:
            rela.close()
    return {"curve": log["curve"], "lambda_per_step": log["lambda_per_step"], "train_seconds": log["train_seconds"],
            "train_cpu_seconds": log["train_cpu_seconds"]}


# ---------------------------------------------------------------------------------------------- results
def at(xs, ys, x):
    pts = list(zip(xs, ys))
    return next((y0 + (x - x0) / (x1 - x0) * (y1 - y0) if x1 > x0 else y0
                 for (x0, y0), (x1, y1) in zip(pts, pts[1:]) if x0 <= x <= x1), None)


def runs_of(a) -> list[tuple[str, str]]:
    """Every (method, reduction) to run: plain once, each ReLA method once per reduction."""
    return [(m, None) for m in a.methods if m == "plain"] + [(m, r) for r in a.reductions for m in a.methods
                                                             if m != "plain"]


def name_of(a, m: str, r: str) -> str:
    return m if r is None or len(a.reductions) == 1 else f"{m} {r}"


def label_of(m: str, r: str, several: bool) -> str:
    return LABEL[m] + (f", {r}" if r is not None and several else "")


def analyse(a, done: dict, precompute: dict) -> dict:
    """Per run: accuracy at each probe, its CPU seconds (its store's precompute counted); each ReLA run against plain
    read at the same CPU seconds; per reduction, its store's bytes per image."""
    def stat(xs):
        xs = [x for x in xs if x is not None]
        return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)} if xs \
            else None

    out = {"at_steps": {}, "equal_cpu": {}, "labels": {}, "stores": precompute}
    for m, r in runs_of(a):
        key, cost = name_of(a, m, r), 0.0 if r is None else precompute[r]["cpu_seconds"]
        out["labels"][key] = label_of(m, r, len(a.reductions) > 1)
        runs = [done[(m, r, s)] for s in a.seeds]
        out["at_steps"][key] = {str(c["step"]): {"miou": stat([x["curve"][i]["miou"] for x in runs]),
                                                 "top1": stat([x["curve"][i]["top1"] for x in runs])}
                                for i, c in enumerate(runs[0]["curve"])}
        out["at_steps"][key]["cpu_seconds"] = stat([x["train_cpu_seconds"] + cost for x in runs])
        if r is None or "plain" not in a.methods:
            continue
        rows = []
        for s in a.seeds:
            x, p = done[(m, r, s)], done[("plain", None, s)]
            sec = x["train_cpu_seconds"] + cost
            xs = [c["train_cpu_seconds"] for c in p["curve"]]
            rows.append({"seconds": sec, **{k: (x["curve"][-1][k], at(xs, [c[k] for c in p["curve"]], sec))
                                            for k in ("miou", "top1")}})
        out["equal_cpu"][key] = {k: {"method": stat([x[k][0] for x in rows]), "plain": stat([x[k][1] for x in rows]),
                                     "difference": stat([None if x[k][1] is None else x[k][0] - x[k][1] for x in rows])}
                                 for k in ("miou", "top1")}
        out["equal_cpu"][key]["seconds"] = stat([x["seconds"] for x in rows])
    return out


def table(res: dict) -> str:
    an, s = res["analysis"], res["settings"]
    fmt = lambda x: "–" if x is None else f"{x['mean']:.2f} ± {x['sd']:.2f}"  # noqa: E731
    lines = ["| method | step | mIoU % (11 classes, per cell) | linear top-1 % | CPU s (precompute included) |",
             "|---|---:|---|---|---|"]
    for key, rows in an["at_steps"].items():
        for step, v in rows.items():
            if step != "cpu_seconds":
                lines.append(f"| {an['labels'][key]} | {step} | {fmt(v['miou'])} | {fmt(v['top1'])} | "
                             + (fmt(rows["cpu_seconds"]) if int(step) == s["steps"] else "") + " |")
    if an["equal_cpu"]:
        lines += ["", "At equal CPU time (plain read at each ReLA run's end, its seconds):", "",
                  "| method | s | mIoU: method, plain, difference | top-1: method, plain, difference |", "|---|---|---|---|"]
        for key, v in an["equal_cpu"].items():
            lines.append(f"| {an['labels'][key]} | {v['seconds']['mean']:.0f} | "
                         + " | ".join(f"{fmt(v[k]['method'])}, {fmt(v[k]['plain'])}, {fmt(v[k]['difference'])}"
                                      for k in ("miou", "top1")) + " |")
    if len(s["reductions"]) > 1:
        lines += ["", "Per reduction of the stored map (its bytes per image; the ReLA runs at their end):", "",
                  "| reduction | grid x channels, dtype | bytes per image | precompute CPU s | "
                  + " | ".join(f"{LABEL[m]}: mIoU, top-1" for m in s["methods"] if m != "plain") + " |",
                  "|---|---|---:|---:|" + "---|" * sum(m != "plain" for m in s["methods"])]
        for r in s["reductions"]:
            st = an["stores"][r]
            cells = []
            for m in s["methods"]:
                if m != "plain":
                    v = an["at_steps"][f"{m} {r}"][str(s["steps"])]
                    cells.append(f"{fmt(v['miou'])}, {fmt(v['top1'])}")
            lines.append(f"| {r} | {st['grid'][0]}x{st['grid'][1]} x {st['channels']}, {st['dtype']} | "
                         f"{st['bytes_per_image']:,.0f} | {st['cpu_seconds']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    an, st = res["analysis"], res["settings"]
    if len(st["reductions"]) > 1:  # accuracy at the end against the stored map's bytes per image, per method
        for ax, key, title in zip(axes, ("miou", "top1"), ("dense probe: mIoU %", "global linear probe: top-1 %")):
            for m in (m for m in st["methods"] if m != "plain"):
                pts = sorted((an["stores"][r]["bytes_per_image"], an["at_steps"][f"{m} {r}"][str(st["steps"])][key], r)
                             for r in st["reductions"])
                ax.errorbar([b for b, _, _ in pts], [v["mean"] for _, v, _ in pts], yerr=[v["sd"] for _, v, _ in pts],
                            marker="o", capsize=3, label=LABEL[m])
                for b, v, r in pts:
                    ax.annotate(r, (b, v["mean"]), textcoords="offset points", xytext=(4, -10), fontsize=7)
            ax.set(xscale="log", xlabel="stored map, bytes per image", title=f"{title} at step {st['steps']}")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        save_figure(fig, path)
        return
    for ax, key, title in zip(axes, ("miou", "top1"), ("dense probe: mIoU %", "global linear probe: top-1 %")):
        for name, rows in res["analysis"]["at_steps"].items():
            steps = [int(k) for k in rows if k != "cpu_seconds"]
            ax.errorbar(steps, [rows[str(k)][key]["mean"] for k in steps], yerr=[rows[str(k)][key]["sd"] for k in steps],
                        marker="o", capsize=3, label=res["analysis"]["labels"][name])
        ax.set(xlabel="optimiser step", title=title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    a = parse_args(argv)
    Path(a.cache).mkdir(parents=True, exist_ok=True)
    done = {}
    for s in a.seeds:
        for m, r in runs_of(a):
            f = Path(a.cache) / (f"{m}-{s}.json" if r is None else f"{m}-{tag(r)}-{s}.json")
            x = json.loads(f.read_text()) if f.is_file() else None
            if x is None or x.get("settings") != settings(a, m, r):
                x = {**run_unit(a, m, s, r), "settings": settings(a, m, r), "load_average_end": os.getloadavg()}
                atomic_write_json(f, x, indent=1)
            done[(m, r, s)] = x
    train = data(a)[0]
    precompute = {r: store(a, train, r)[1] for r in a.reductions}
    res = {"command": "python benchmarks/dense.py " + " ".join(sys.argv[1:]),
           "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform()},
           "settings": {**settings(a, "dense"), "reductions": a.reductions, "seeds": a.seeds, "methods": a.methods},
           "analysis": analyse(a, done, precompute)}
    res["table"] = table(res)
    write_results(Path(a.out), res, root=ROOT)
    figure(res, Path(a.out).with_suffix(".png"))
    print(res["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
