"""Room to move: which benchmark leaves a prior something to add? Plain SSL's long curves and teachers' probes.

A benchmark can show a saving only where plain SSL climbs well above the untrained student (the head-to-head
study asks for >= 15 points) and where a teacher knows more than the student does at the budget. This sweep
measures both on Fashion-MNIST items on cluttered canvases (:class:`accelerate_ssl.data.Canvas`; the student's
10,000 training scenes are the first 10,000 training images, the 5,000 test scenes the first test images):

* ``plain`` units: one SSL run per setting (canvas side, SSL objective, learning rate, student widths), probed
  along a long curve (linear on all labels, kNN k = 20, linear on 100 labels per class);
* ``teacher`` units: candidate teachers trained on canvases of the *other* 50,000 training images (never the
  student's scenes): ConvNet 32/64/128 with the labels (cross-entropy) or without them (VICReg); each saved as a
  prior checkpoint (``checkpoint:<file>``) and probed frozen on the benchmark, like the shipped priors;
* ``cached`` units: ReLA (``rela.wrap(vicreg_loss)``, targets precomputed over the student's clean scenes) with
  each teacher, to see how far each one pulls the student within the same steps.

Every unit is one JSON in ``--runs`` when it ends (rerun to resume); ``--worker I/N`` runs units I, I+N, ...
(N processes; a ``cached`` unit waits for its teacher's checkpoint). Without ``--worker`` all units run in turn.
``--device cuda`` runs the training on a GPU (the probes' linear fits stay on the CPU).

    python benchmarks/room.py --steps 3000                       # every unit, in turn
    python benchmarks/room.py --steps 3000 --worker 0/4 & ...    # four processes
    python benchmarks/room.py --steps 3000 --collect             # every finished unit into results/room.json + .png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from accelerate_ssl.atomic import atomic_write_json  # noqa: E402
from accelerate_ssl.results import write_results  # noqa: E402

TEACHER_WIDTHS = (32, 64, 128)
#: name -> (kind, settings); the order is the order the units are handed to workers
PLAIN = {
    "c48-vicreg-lr1e-3": dict(canvas=48, ssl="vicreg", lr=1e-3, widths=(16, 32, 64)),
    "c48-vicreg-lr3e-3": dict(canvas=48, ssl="vicreg", lr=3e-3, widths=(16, 32, 64)),
    "c48-simclr-lr1e-3": dict(canvas=48, ssl="simclr", lr=1e-3, widths=(16, 32, 64)),
    "c48-byol-lr1e-3": dict(canvas=48, ssl="byol", lr=1e-3, widths=(16, 32, 64)),
    "c36-vicreg-lr1e-3": dict(canvas=36, ssl="vicreg", lr=1e-3, widths=(16, 32, 64)),
    "c48-vicreg-lr1e-3-w8": dict(canvas=48, ssl="vicreg", lr=1e-3, widths=(8, 16, 32)),
}
TEACHERS = {"canvas-supervised": "supervised", "canvas-vicreg": "vicreg"}
PRIORS = ["shipped:fashion-mnist-byol-20k", "shipped:fashion-mnist-supervised"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000, help="optimiser steps of every plain and cached run")
    p.add_argument("--probes", type=int, nargs="+", default=[0, 250, 500, 1000, 2000, 3000])
    p.add_argument("--teacher-steps", type=int, default=3000, help="optimiser steps of each canvas teacher")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--train-size", type=int, default=10000)
    p.add_argument("--test-size", type=int, default=5000)
    p.add_argument("--teacher-size", type=int, default=50000, help="canvases of training images after the student's")
    p.add_argument("--few-labels", type=int, default=100, help="labels per class of the few-label probe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", nargs="+", help="run only these units (names as in the JSON)")
    p.add_argument("--runs", default=str(ROOT / "benchmarks/cache/room/runs"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/room.json"))
    p.add_argument("--worker", metavar="I/N", help="run units I, I+N, ... only")
    p.add_argument("--collect", action="store_true", help="write the results JSON + PNG from the finished units")
    a = p.parse_args(argv)
    a.probes = sorted({s for s in a.probes if 0 <= s <= a.steps} | {0, a.steps})
    return a


def units(a) -> list[dict]:
    out = [{"name": f"teacher-{t}", "kind": "teacher", "objective": o} for t, o in TEACHERS.items()]
    out += [{"name": f"plain-{n}", "kind": "plain", **s} for n, s in PLAIN.items()]
    out += [{"name": f"cached-{t}", "kind": "cached", "teacher": t, **PLAIN["c48-vicreg-lr1e-3"]}
            for t in [*TEACHERS, *PRIORS]]
    out += [{"name": f"prior-{p}", "kind": "prior", "prior": p} for p in PRIORS]
    return [u for u in out if not a.only or u["name"] in a.only]


# ---------------------------------------------------------------------------------------------- data
_DATA: dict = {}


def scenes(a, canvas: int):
    """(train, test, xtr, xte): the student's canvases and their normalised tensors."""
    if canvas not in _DATA:
        from accelerate_ssl.data import Canvas, FashionMNIST
        from accelerate_ssl.recipes import images_to_tensor

        train = Canvas(FashionMNIST("train", limit=a.train_size), size=canvas, seed=1)
        test = Canvas(FashionMNIST("test", limit=a.test_size), size=canvas, seed=2)
        _DATA[canvas] = (train, test, images_to_tensor(train.data), images_to_tensor(test.data))
    return _DATA[canvas]


def probe_for(a, canvas: int):
    from accelerate_ssl.recipes import Probe

    train, test, xtr, xte = scenes(a, canvas)
    return Probe(xtr, train.targets, xte, test.targets, seed=a.seed, few_labels=a.few_labels)


def teacher_file(a, name: str) -> Path:
    return Path(a.runs) / f"{name}-{a.teacher_steps}.safetensors"


def prior_spec(a, teacher: str) -> str:
    return teacher if ":" in teacher else f"checkpoint:{teacher_file(a, teacher)}"


class Frozen(torch.nn.Module):
    """A prior as a backbone of the student's inputs (for probing it like a student)."""

    def __init__(self, prior):
        super().__init__()
        from accelerate_ssl.recipes import prior_teacher

        self.prior, self.embed = prior, prior_teacher(prior)

    def forward(self, x):
        return self.embed(x)


# ---------------------------------------------------------------------------------------------- units
def run_unit(a, u: dict) -> dict:
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.recipes import create_method, shuffled_batches, tensor_batches, train_ssl

    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    t0 = time.perf_counter()
    if u["kind"] == "prior":
        from accelerate_ssl.priors import create_prior

        prior = Frozen(create_prior(u["prior"])).to(dev)
        return {"probe": probe_for(a, 48).evaluate(prior), "seconds": time.perf_counter() - t0}
    if u["kind"] == "teacher":
        return train_teacher(a, u, dev, t0)
    train, test, xtr, xte = scenes(a, u["canvas"])
    torch.manual_seed(a.seed)
    backbone = ConvNet(widths=tuple(u["widths"]))
    method = create_method(u["ssl"], backbone, backbone.feature_dim).to(dev)
    params, rela = [p for p in method.parameters() if p.requires_grad], None
    if u["kind"] == "cached":
        from accelerate_ssl.priors import create_prior
        from accelerate_ssl.rela import ReLA
        from accelerate_ssl.schedules import create_schedule
        from accelerate_ssl.targets.precompute import precompute_targets
        from accelerate_ssl.targets.store import TargetStore

        spec = prior_spec(a, u["teacher"])
        while spec.startswith("checkpoint:") and not Path(spec.split(":", 1)[1]).is_file():
            time.sleep(5)  # the teacher is still training in another worker
        store = Path(a.runs) / f"store-{u['name']}-{a.teacher_steps}"
        if not (store / "metadata.json").is_file():
            precompute_targets(create_prior(spec).to(dev), train, store, progress=False)
        rela = ReLA(TargetStore.open(store, dataset=train), backbone, dataset=train,
                    schedule=create_schedule("switch", total_steps=a.steps), feature_dim=backbone.feature_dim,
                    n_components=16).to(dev)
        params += list(rela.parameters())
    probe = probe_for(a, u["canvas"])
    last: dict = {}

    def probed(b):
        last.clear()
        last.update(probe.evaluate(b))
        return last["linear_top1"]

    log = train_ssl(method, tensor_batches(xtr.to(dev), shuffled_batches(len(xtr), a.batch_size, a.seed)), a.steps,
                    optimizer=torch.optim.AdamW(params, lr=u["lr"], weight_decay=0.01),
                    view_generator=torch.Generator().manual_seed(a.seed + 1), rela=rela, rela_views="weak",
                    checkpoints=a.probes, probe=probed, checkpoint_extras=lambda: dict(last), progress=u["name"])
    if rela is not None:
        rela.close()
    return {"curve": log["curve"], "train_seconds": log["train_seconds"], "seconds": time.perf_counter() - t0}


def train_teacher(a, u: dict, dev, t0: float) -> dict:
    """ConvNet 32/64/128 on canvases of the training images the student never sees; saved as a prior checkpoint."""
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.data import Canvas, FashionMNIST
    from accelerate_ssl.priors.registry import save_prior_checkpoint
    from accelerate_ssl.recipes import Supervised, create_method, images_to_tensor, shuffled_batches, tensor_batches, train_ssl
    from accelerate_ssl.recipes.views import FASHION_MNIST_MEAN, FASHION_MNIST_STD

    items = FashionMNIST("train", limit=a.train_size + a.teacher_size)
    items.data, items.targets = items.data[a.train_size:], items.targets[a.train_size:]
    scenes_ = Canvas(items, size=48, seed=3)
    x = images_to_tensor(scenes_.data).to(dev)
    torch.manual_seed(a.seed + 100)
    backbone = ConvNet(widths=TEACHER_WIDTHS)
    if u["objective"] == "supervised":
        method = Supervised(backbone, backbone.feature_dim, scenes_.targets)
    else:
        method = create_method(u["objective"], backbone, backbone.feature_dim)
    method = method.to(dev)
    train_ssl(method, tensor_batches(x, shuffled_batches(len(x), 256, a.seed + 100)), a.teacher_steps,
              optimizer=torch.optim.AdamW([p for p in method.parameters() if p.requires_grad], lr=1e-3,
                                          weight_decay=0.01),
              view_generator=torch.Generator().manual_seed(a.seed + 101), progress=u["name"])
    path = teacher_file(a, u["name"].removeprefix("teacher-"))
    save_prior_checkpoint(backbone, path, "convnet", {"widths": list(TEACHER_WIDTHS), "in_channels": 1},
                          {"channels": 1, "mean": [FASHION_MNIST_MEAN], "std": [FASHION_MNIST_STD]})
    backbone.eval()
    return {"probe": probe_for(a, 48).evaluate(backbone), "file": path.name, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------- results
def collect(a) -> dict:
    done = {u["name"]: json.loads((Path(a.runs) / f"{u['name']}.json").read_text())
            for u in units(a) if (Path(a.runs) / f"{u['name']}.json").is_file()}
    table = ["| unit | untrained (linear / kNN / 100 per class) % | end | gap, points (linear / kNN / 100) |",
             "|---|---|---|---|"]
    for name, r in done.items():
        if "curve" in r:
            c0, c1 = r["curve"][0], r["curve"][-1]
            keys = ("top1", "knn_top1", "few_label_top1")
            table.append(f"| {name} | {' / '.join(f'{c0[k]:.1f}' for k in keys)} | "
                         f"{' / '.join(f'{c1[k]:.1f}' for k in keys)} (step {c1['step']}) | "
                         f"{' / '.join(f'{c1[k] - c0[k]:+.1f}' for k in keys)} |")
        else:
            pr = r["probe"]
            table.append(f"| {name} (frozen) | | {pr['linear_top1']:.1f} / {pr['knn_top1']:.1f} / "
                         f"{pr['few_label_top1']:.1f} | |")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and a.device.startswith("cuda") else "cpu"
    return {"command": "python " + " ".join(sys.argv), "settings": {k: v for k, v in vars(a).items()
                                                                     if k not in ("runs", "out", "worker", "collect")},
            "machine": {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
                        "cpu_count": os.cpu_count(), "platform": platform.platform()},
            "units": done, "table": "\n".join(table)}


def figure(res: dict, path: Path) -> None:
    from accelerate_ssl.results import save_figure
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in zip(axes, ("top1", "knn_top1", "few_label_top1"),
                              ("linear, all labels", "kNN k = 20", "linear, --few-labels per class")):
        for name, r in res["units"].items():
            if "curve" in r:
                ax.plot([c["step"] for c in r["curve"]], [c[key] for c in r["curve"]], marker="o", ms=3,
                        ls="--" if name.startswith("cached") else "-", label=name)
        ax.set(title=title, xlabel="optimiser step", ylabel="top-1 %")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> None:
    a = parse_args(argv)
    Path(a.runs).mkdir(parents=True, exist_ok=True)
    if a.collect:
        res = collect(a)
        write_results(Path(a.out), res, root=ROOT)
        figure(res, Path(a.out).with_suffix(".png"))
        print(res["table"])
        return
    todo = units(a)
    if a.worker:
        i, n = map(int, a.worker.split("/"))
        todo = todo[i::n]
    for u in todo:
        path = Path(a.runs) / f"{u['name']}.json"
        if path.is_file():
            continue
        r = run_unit(a, u)
        atomic_write_json(path, {**u, **r}, indent=1)
        print(f"{u['name']}: done in {r['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
