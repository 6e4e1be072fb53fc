"""Accuracy at a budget: how much compute ReLA saves, measured like the papers' tables.

Side by side on real Fashion-MNIST, every cell a separate seeded run:

- **Step budgets** (ReLA v1): 10 / 20 / 50 / 100 % of ``--steps`` optimiser steps; the learning-rate
  (warm-up + cosine), EMA-momentum (cosine 0.99 -> 1) and lambda schedules (``Decay``/``Switch``
  ``total_steps``) are all set to the cell's own budget.
- **Data budgets** (ReLA v2, Eq. 43, Fig. 4a): 10 / 20 % of the training subset per epoch through
  :class:`accelerate_ssl.data.DynamicSubsetSampler` for as many epochs as the full budget has
  (so 10 % data = 10 % of the steps); ``dynamic`` = a fresh subset every epoch, ``static`` = one
  fixed subset for all epochs.
- **Rows**: plain SSL; ReLA with a random prior (same architecture, random init); ReLA with a
  cross-dataset prior (BYOL trained here on scikit-learn digits, unlabelled; never sees Fashion-MNIST);
  ReLA with a same-dataset prior (default ``--same-prior demo``: the demo's shipped BYOL ConvNet, trained
  on the unlabelled Fashion-MNIST train images; ``train``: a weaker one trained here for 600 steps).
  No prior ever sees a label or a test image.
- **ReLA recipe** (the demo's, each part measured there): ``Switch`` (ReLA v1 App. J) for the main
  rows, ``Decay`` (ReLA v2 App. L) and ``Constant(0.5)`` as an ablation with the same-dataset prior
  at two budgets; ReLA v1's weak views while lambda == 1; 16 PCA components of the targets; the
  transport head fitted by least squares at the first batch (``--head-init random``: the papers'
  random head, which made every ReLA row dip *below* the untrained network at 10-20 % of the steps).
- **Methods**: BYOL (core grid); ``--grid extended`` adds SimCLR, Barlow Twins, VICReg, SimSiam, MoCo,
  DINO (lightly's heads/losses, :mod:`accelerate_ssl.recipes.methods`), plain vs ReLA with the same-dataset prior.
- **Evaluation**: linear probe and kNN (:mod:`accelerate_ssl.evaluate`) on the Fashion-MNIST test split;
  every cell's wall time. Each cell is cached as JSON under ``--cache`` keyed by all of its settings,
  so an interrupted study resumes where it stopped and a larger one re-uses what exists.

Outputs: ``benchmarks/results/budget.json`` (every cell, mean +- std over seeds, the ReLA v2 Table-2
style table, the goals with pass/fail, the machine, the command, the time estimate of the core grid)
and ``benchmarks/results/budget_accuracy.png`` (accuracy vs compute = steps x batch).

    .venv/bin/python benchmarks/budget.py                      # the core grid, 3 seeds (CPU)
    .venv/bin/python benchmarks/budget.py --seeds 0            # one seed
    .venv/bin/python benchmarks/budget.py --device cuda --backbone resnet18 --train-size 60000 --steps 3000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from accelerate_ssl.schedules import create_schedule  # noqa: E402
from accelerate_ssl.results import save_figure  # noqa: E402
from accelerate_ssl.recipes import Probe  # noqa: E402

#: bump when the training/eval code changes in a way that invalidates cached cells.
CODE_VERSION = 1
STEP_FRACTIONS = (0.1, 0.2, 0.5, 1.0)
DATA_FRACTIONS = (0.1, 0.2)
PRIORS = ("random", "cross", "same")
PRIOR_LABELS = {
    "none": "plain",
    "random": "+ReLA random prior",
    "cross": "+ReLA cross-dataset prior (digits BYOL)",
    "same": "+ReLA same-dataset prior (Fashion-MNIST BYOL)",
}
EXTENDED_METHODS = ("simclr", "barlowtwins", "vicreg", "simsiam", "moco", "dino")


# ---------------------------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", choices=("core", "extended", "tiny"), default="core",
                   help="core: BYOL rows/budgets/controllers; extended: core + the other SSL methods; "
                        "tiny: 2 budgets x plain/same (tests)")
    p.add_argument("--methods", nargs="+", default=None,
                   help=f"extended-grid methods to run (default all: {' '.join(EXTENDED_METHODS)})")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default 0 1 2)")
    p.add_argument("--steps", type=int, default=300, help="the full (100 %%) step budget (default 300)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--train-size", type=int, default=6400,
                   help="Fashion-MNIST train images used for SSL and the probe (default 6400; 60000 = all)")
    p.add_argument("--test-size", type=int, default=10000, help="Fashion-MNIST test images for the probes (default all 10000)")
    p.add_argument("--backbone", choices=("convnet", "resnet18"), default="convnet",
                   help="student: the small GroupNorm ConvNet (CPU) or torchvision resnet18 with a 3x3 stem, no max-pool (GPU)")
    p.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64], help="ConvNet block widths (default 16 32 64)")
    p.add_argument("--prior-widths", type=int, nargs="+", default=None,
                   help="ConvNet widths of the priors (default: --widths; with --backbone resnet18 the priors stay ConvNets)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate (warm-up 10 %%, cosine to 0)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--probe-epochs", type=int, default=30, help="linear-probe epochs (Adam 1e-3)")
    p.add_argument("--knn-k", type=int, default=20)
    p.add_argument("--prior-steps-same", type=int, default=600, help="BYOL steps of the same-dataset prior (cached)")
    p.add_argument("--prior-steps-cross", type=int, default=300, help="BYOL steps of the digits prior (cached)")
    p.add_argument("--same-prior", choices=("train", "demo"), default="demo",
                   help="same-dataset prior: 'train' = BYOL trained by this study on unlabelled Fashion-MNIST "
                        "(cached); 'demo' = the demo's default prior (shipped in accelerate_ssl/assets)")
    p.add_argument("--main-schedule", choices=("decay", "switch"), default="switch",
                   help="lambda controller of the main ReLA rows (the other one and constant:0.5 are the ablation)")
    p.add_argument("--rela-views", choices=("byol", "weak"), default="weak",
                   help="views while lambda == 1 (ReLA term only): the BYOL views, or ReLA v1's weak views "
                        "(resized crop scale 0.5-1 + flip), as the demo recipe does")
    p.add_argument("--components", type=int, default=16,
                   help="target PCA components (ReLA v2 Eq. 41; default 16 as in the demo; 0: the student feature dim)")
    p.add_argument("--head-init", choices=("fit", "random"), default="fit",
                   help="ReLA transport head: least-squares fit at the first batch (the library's default) or "
                        "random as in the papers")
    p.add_argument("--device", default="cpu", help="cpu or cuda (results are labelled with the device)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads per process (default 1; part of the cache key: it changes float rounding)")
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/budget"), help="per-cell JSON cache and priors")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results"), help="folder for budget.json / budget_accuracy.png")
    p.add_argument("--name", default="budget", help="results file stem (default 'budget'; e.g. 'budget_cuda')")
    p.add_argument("--rows", nargs="+", choices=("plain",) + PRIORS, default=None,
                   help="only the cells of these rows (plain = no prior; default all): extend a study row by row")
    p.add_argument("--fractions", type=float, nargs="+", default=None,
                   help="only the cells at these budget fractions (e.g. 0.2 1.0; default all)")
    p.add_argument("--kinds", nargs="+", choices=("init", "steps", "data"), default=None,
                   help="only these budget kinds (default all)")
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="compute only every N-th missing cell starting at K (parallel workers sharing --cache)")
    p.add_argument("--workers", type=int, default=2,
                   help="worker processes (--threads each) computing the missing cells in parallel, after the priors "
                        "are cached (default 2 = the 2 cores of the CPU setting; 1 = in this process)")
    p.add_argument("--max-new-cells", type=int, default=None,
                   help="stop after computing this many new cells, in this process (run a long study in chunks; rerun to continue)")
    p.add_argument("--verify", type=int, default=0,
                   help="recompute this many cached cells from scratch and record whether the numbers reproduce")
    p.add_argument("--switch-timing-steps", type=int, default=20,
                   help="interleaved steps per kind for the Switch wall-time measurement (0: skip)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    return p


def check_args(args) -> None:
    for name in ("steps", "batch_size", "train_size", "test_size", "probe_epochs", "knn_k"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}.")
    if min(DATA_FRACTIONS) * args.train_size < args.batch_size and args.grid != "tiny":
        raise ValueError(
            f"--train-size {args.train_size} x {min(DATA_FRACTIONS)} data fraction is smaller than --batch-size "
            f"{args.batch_size}: the 10 % subset would not fill one batch; raise --train-size or lower --batch-size.")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device} but torch sees no CUDA device; run on a GPU machine or use --device cpu.")
    if args.same_prior == "demo" and not demo_prior_file().is_file():
        raise FileNotFoundError(f"--same-prior demo needs {demo_prior_file()} (not present); use --same-prior train.")
    if args.components < 0:
        raise ValueError(f"--components must be >= 0 (0: the student feature dim), got {args.components}.")
    parse_shard(args.shard)
    if args.methods:
        from accelerate_ssl.recipes import METHODS

        bad = [m for m in args.methods if m not in METHODS]
        if bad:
            raise ValueError(f"--methods: unknown {bad}; choose from {sorted(METHODS)}.")


def parse_shard(spec: Optional[str]) -> tuple[int, int]:
    if spec is None:
        return 0, 1
    try:
        k, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like K/N (e.g. 0/2), got {spec!r}.") from None
    if n < 1 or not 0 <= k < n:
        raise ValueError(f"--shard {spec}: need 0 <= K < N, e.g. 0/2 and 1/2 for two workers.")
    return k, n


def demo_prior_file() -> Path:
    """The file of the demo's default prior (a shipped one)."""
    from accelerate_ssl.demo import DEFAULT_PRIOR
    from accelerate_ssl.targets.priors import shipped_prior_file

    return shipped_prior_file(DEFAULT_PRIOR.split(":", 1)[1])


# ---------------------------------------------------------------------------------------------- the grid
def make_grid(args) -> list[dict]:
    """The cells of the study (without seeds). A cell: method, prior, schedule, budget kind/fraction, subset."""
    cells: list[dict] = []

    main = getattr(args, "main_schedule", "decay")

    def add(method="byol", prior="none", schedule=main, kind="steps", fraction=1.0, subset="full", group="main"):
        cells.append({"method": method, "prior": prior, "schedule": schedule if prior != "none" else "none",
                      "kind": kind, "fraction": fraction, "subset": subset, "group": group})

    if args.grid == "tiny":  # the machinery on a few cells (tests): step budgets 20/100 %, a data budget, Switch
        for f in (0.2, 1.0):
            add(fraction=f)
            add(prior="same", fraction=f)
        add(kind="data", fraction=0.2, subset="dynamic")
        add(prior="same", kind="data", fraction=0.2, subset="dynamic")
        add(prior="same", schedule="switch" if main != "switch" else "constant:0.5", fraction=1.0, group="controller")
        for m in args.methods or ():
            add(method=m, fraction=0.2, group="methods")
            add(method=m, prior="same", fraction=0.2, group="methods")
        return cells
    add(kind="init", fraction=0.0, group="init")  # the untrained network (step 0), probed once per seed
    for f in STEP_FRACTIONS:
        add(fraction=f)
        for prior in PRIORS:
            add(prior=prior, fraction=f)
    for f in DATA_FRACTIONS:
        add(kind="data", fraction=f, subset="dynamic")
        for prior in PRIORS:
            add(prior=prior, kind="data", fraction=f, subset="dynamic")
        add(kind="data", fraction=f, subset="static", group="static")
        add(prior="same", kind="data", fraction=f, subset="static", group="static")
    for sched in [x for x in ("decay", "switch", "constant:0.5") if x != main]:
        for f in (0.2, 0.5):
            add(prior="same", schedule=sched, fraction=f, group="controller")
    if args.grid == "extended":
        for m in args.methods or EXTENDED_METHODS:
            for f in (0.2, 1.0):
                add(method=m, fraction=f, group="methods")
            add(method=m, prior="same", fraction=0.2, group="methods")
    if args.rows:
        cells = [c for c in cells if (c["prior"] if c["prior"] != "none" else "plain") in args.rows]
    if getattr(args, "fractions", None):
        cells = [c for c in cells if any(abs(c["fraction"] - f) < 1e-9 for f in args.fractions)]
    if getattr(args, "kinds", None):
        cells = [c for c in cells if c["kind"] in args.kinds]
    return cells


def shared_settings(args) -> dict:
    """Every setting that changes a cell's numbers (part of each cell's cache key)."""
    settings = {"code_version": CODE_VERSION, "steps": args.steps, "batch_size": args.batch_size,
            "train_size": args.train_size, "test_size": args.test_size, "backbone": args.backbone,
            "widths": list(args.widths) if args.backbone == "convnet" else None, "lr": args.lr,
            "weight_decay": args.weight_decay, "probe_epochs": args.probe_epochs, "knn_k": args.knn_k,
            "prior_steps_same": args.prior_steps_same, "prior_steps_cross": args.prior_steps_cross,
            "same_prior": args.same_prior, "device": torch.device(args.device).type, "threads": args.threads}
    if args.backbone != "convnet" or prior_widths(args) != list(args.widths):  # else implied by "widths" (stable keys)
        settings["prior_widths"] = prior_widths(args)
    if args.rela_views != "byol":
        settings["rela_views"] = args.rela_views
    if args.components:  # 0 = the student feature dim (the key of cells cached before this option existed)
        settings["components"] = args.components
    if args.head_init != "random":  # cells cached before the fit existed used a random head: their keys stay valid
        settings["head_init"] = args.head_init
    return settings


#: settings that only change cells with a prior; a plain cell's key uses these values whatever was asked,
#: so plain cells are shared between studies that differ only in their priors / ReLA recipe.
RELA_ONLY_DEFAULTS = {"same_prior": "train", "prior_steps_same": 600, "prior_steps_cross": 300}
RELA_ONLY_OPTIONAL = ("prior_widths", "rela_views", "components", "head_init")


def prior_widths(args) -> list[int]:
    return list(args.prior_widths or args.widths)


def cell_key(cell: dict, seed: int, settings: dict) -> str:
    """Hash of the cell, its seed and every setting that changes its numbers (``CODE_VERSION`` included)."""
    if cell["prior"] == "none":
        settings = {k: v for k, v in settings.items() if k not in RELA_ONLY_OPTIONAL}
        settings.update(RELA_ONLY_DEFAULTS)
    blob = json.dumps({"cell": {k: v for k, v in cell.items() if k != "group"}, "seed": seed, "settings": settings},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cell_steps(cell: dict, total_steps: int) -> int:
    return 0 if cell["kind"] == "init" else max(1, int(round(cell["fraction"] * total_steps)))


# ---------------------------------------------------------------------------------------------- data, models
class Data:
    """Fashion-MNIST train subset and test split as uint8 ``[N, 1, 28, 28]`` plus normalised float tensors."""

    def __init__(self, train_size: int, test_size: int, device):
        from accelerate_ssl.data import FashionMNIST
        from accelerate_ssl.recipes import images_to_tensor

        train = FashionMNIST("train", limit=train_size)
        test = FashionMNIST("test", limit=test_size)
        self.train_u8 = torch.as_tensor(train.data).unsqueeze(1)
        self.train_x = images_to_tensor(torch.as_tensor(train.data)).to(device)
        self.train_y = torch.as_tensor(train.targets).long()
        self.test_u8 = torch.as_tensor(test.data).unsqueeze(1)
        self.test_x = images_to_tensor(torch.as_tensor(test.data)).to(device)
        self.test_y = torch.as_tensor(test.targets).long()
        self.fingerprint = {"train": len(self.train_y), "test": len(self.test_y)}


def make_backbone(args) -> tuple[torch.nn.Module, int]:
    """The student: ``ConvNet(widths)`` (GroupNorm) or torchvision resnet18 with a 3x3 stride-1 stem for
    1-channel 28 px images and no max-pool (the usual small-image ResNet-18)."""
    if args.backbone == "convnet":
        from accelerate_ssl.backbones import ConvNet

        net = ConvNet(widths=tuple(args.widths))
        return net, net.feature_dim
    import torchvision

    net = torchvision.models.resnet18(num_classes=10)
    net.conv1 = torch.nn.Conv2d(1, 64, 3, 1, 1, bias=False)
    net.maxpool = torch.nn.Identity()
    net.fc = torch.nn.Identity()
    return net, 512


def train_ssl(args, images: torch.Tensor, steps: int, seed: int, *, method: str = "byol", targets=None,
              schedule: str = "decay", fraction: float = 1.0, subset: str = "full", constant_schedules: bool = False,
              progress: Optional[str] = None, rela_views: str = "byol", components: Optional[int] = None):
    """One SSL run on ``images`` (normalised ``[N, 1, H, W]`` on the device) through the recipe's loop
    (:func:`accelerate_ssl.recipes.train_ssl`): returns the backbone and its log.

    With ``targets`` (``[N, d]`` prior embeddings of the clean images) the loss is
    ``rela.wrap(ssl_loss)`` = ``lambda L_rela + (1 - lambda) L_ssl`` (the ReLA papers). The learning rate
    warms up over 10 % of the run and decays by cosine to 0, the EMA momentum rises from 0.99 to 1 by
    cosine, both set to this run's length; ``constant_schedules``: constant lr and momentum (prior
    training, independent of the run length). ``log["lambda"]`` has one lambda per step (0 without ReLA).
    """
    from accelerate_ssl.recipes import (cosine_momentum, create_method, shuffled_batches, tensor_batches,
                                        warmup_cosine_lr)
    from accelerate_ssl.recipes import train_ssl as recipe_loop

    torch.manual_seed(seed)
    backbone, dim = make_backbone(args)
    model = create_method(method, backbone, dim).to(images.device)
    rela = None
    params = [p for p in model.parameters() if p.requires_grad]
    if targets is not None:
        from accelerate_ssl.rela import ReLA

        rela = ReLA(targets, backbone, schedule=create_schedule(schedule, total_steps=steps), feature_dim=dim,
                    n_components="auto" if components is None else min(components, targets.shape[1]),
                    head_init=args.head_init)
        rela.to(images.device)
        params += list(rela.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    batches = tensor_batches(images, shuffled_batches(len(images), args.batch_size, seed,
                                                      fraction if subset != "full" else 1.0, static=subset == "static"))
    try:
        log = recipe_loop(model, batches, steps, optimizer=opt, view_generator=torch.Generator().manual_seed(seed + 1),
                          rela=rela, rela_views=rela_views,
                          lr=None if constant_schedules else warmup_cosine_lr(args.lr, steps),
                          momentum=0.99 if constant_schedules else cosine_momentum(steps),
                          progress=None if args.no_progress else progress)
    finally:
        if rela is not None:
            rela.close()
    return backbone, {"step_seconds": log["step_seconds"], "lambda": log["lambda_per_step"] or [0.0] * steps}


# ---------------------------------------------------------------------------------------------- priors
def _prior_preprocess(mean: float, std: float) -> dict:
    return {"channels": 1, "mean": [mean], "std": [std], "stats": "dataset"}


def prior_file(args, kind: str) -> tuple[Path, str]:
    """``(checkpoint path, description)`` of a prior, training it (cached under ``--cache``/priors) if needed.

    - ``random``: the student architecture, randomly initialised (seed 12345), no training.
    - ``cross``: BYOL on scikit-learn digits (1797 images, 8 px upscaled to 28 px), unlabelled.
    - ``same``: BYOL on the 60k unlabelled Fashion-MNIST train images (or the demo's shipped prior).
    All are saved with :func:`accelerate_ssl.targets.save_prior_checkpoint` and loaded with
    ``create_prior("checkpoint:<path>")`` (the prior's own preprocessing: its training set's mean/std).
    """
    if kind == "same" and args.same_prior == "demo":
        return demo_prior_file(), "the demo's shipped BYOL ConvNet (unlabelled Fashion-MNIST), accelerate_ssl/assets"
    from accelerate_ssl.targets.priors import save_prior_checkpoint

    steps = {"random": 0, "cross": args.prior_steps_cross, "same": args.prior_steps_same}[kind]
    widths = prior_widths(args)
    spec = {"kind": kind, "steps": steps, "widths": widths, "batch_size": args.batch_size,
            "lr": args.lr, "code_version": CODE_VERSION}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    path = Path(args.cache) / "priors" / f"{kind}-{key}.safetensors"
    desc = {"random": f"random-init ConvNet{tuple(widths)} (seed 12345; the student's architecture for the ConvNet student)",
            "cross": f"BYOL ConvNet, {steps} steps on unlabelled scikit-learn digits (never Fashion-MNIST)",
            "same": f"BYOL ConvNet, {steps} steps on the 60k unlabelled Fashion-MNIST train images"}[kind]
    if path.is_file():
        return path, desc
    from accelerate_ssl.backbones import ConvNet

    if kind == "random":
        torch.manual_seed(12345)
        net, mean, std = ConvNet(widths=tuple(widths)), 0.2860, 0.3530
    else:
        if kind == "cross":
            from accelerate_ssl.data import Digits

            raw = torch.as_tensor(Digits("all", size=28).data).float().div(255)
        else:
            from accelerate_ssl.data import FashionMNIST

            raw = torch.as_tensor(FashionMNIST("train").data).float().div(255)
        mean, std = float(raw.mean()), float(raw.std())
        images = ((raw - mean) / std).unsqueeze(1).to(args.device)
        prior_args = argparse.Namespace(**{**vars(args), "backbone": "convnet", "widths": widths})
        t = time.perf_counter()
        net, _ = train_ssl(prior_args, images, steps, seed=12345, constant_schedules=True,
                           progress=f"prior {kind}")
        print(f"trained the {kind} prior: {steps} steps in {time.perf_counter() - t:.0f} s")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_prior_checkpoint(net.cpu(), path, "convnet", {"in_channels": 1, "widths": widths, "norm": "group"},
                          _prior_preprocess(mean, std))
    return path, desc


@torch.no_grad()
def prior_targets(path: Path, data: Data, split: str = "train") -> torch.Tensor:
    """The prior's embeddings of the clean training images ``[N, d]`` (its own preprocessing), row i = image i."""
    from accelerate_ssl.targets.priors import create_prior

    prior = create_prior(f"checkpoint:{path}")
    images = data.train_u8 if split == "train" else data.test_u8
    out = [prior(prior.preprocess.batch(images[i:i + 1024])) for i in range(0, len(images), 1024)]
    return torch.cat(out).float()


def prior_quality(args, path: Path, data: Data, train_features: torch.Tensor) -> dict:
    """The prior's own linear-probe / kNN top-1 on the same train subset -> test split (context for the
    ReLA rows; labels are used only here, after the prior was trained). Cached under ``--cache``/priors (never
    beside the prior file: the demo's prior lives inside the installed package)."""
    from accelerate_ssl.evaluate import knn_accuracy, linear_probe

    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    cached = (Path(args.cache) / "priors" / f"{path.stem}-{digest}.probe-{args.train_size}-{args.test_size}-"
              f"{args.probe_epochs}.json")
    cached.parent.mkdir(parents=True, exist_ok=True)
    if cached.is_file():
        return json.loads(cached.read_text())
    test_features = prior_targets(path, data, "test")
    out = {"linear_top1": linear_probe(train_features, data.train_y, test_features, data.test_y,
                                       epochs=args.probe_epochs, seed=0)["top1"],
           "knn_top1": knn_accuracy(train_features, data.train_y, test_features, data.test_y, k=args.knn_k)}
    _write_json(out, cached)
    return out


# ---------------------------------------------------------------------------------------------- cells
def run_cell(args, cell: dict, seed: int, data: Data, targets: dict) -> dict:
    steps = cell_steps(cell, args.steps)
    t, cpu = time.perf_counter(), time.process_time()
    if cell["kind"] == "init":
        torch.manual_seed(seed)
        backbone, _ = make_backbone(args)
        backbone.to(args.device)
        log = {"step_seconds": [], "lambda": []}
    else:
        tg = None if cell["prior"] == "none" else targets[cell["prior"]]
        backbone, log = train_ssl(args, data.train_x, steps, seed, method=cell["method"], targets=tg,
                                  schedule=cell["schedule"], fraction=cell["fraction"], subset=cell["subset"],
                                  rela_views=args.rela_views, components=args.components or None,
                                  progress=f"{cell['method']} {cell['prior']} {cell['kind']} {cell['fraction']:.0%} s{seed}")
    train_seconds, train_cpu = time.perf_counter() - t, time.process_time() - cpu
    cpu_probe = time.process_time()
    result = Probe(data.train_x, data.train_y, data.test_x, data.test_y, epochs=args.probe_epochs, seed=seed,
                   knn_k=args.knn_k).evaluate(backbone)
    probe_cpu = time.process_time() - cpu_probe
    lam = log["lambda"]
    sec = log["step_seconds"]
    rela_only = [s for s, l in zip(sec, lam) if l >= 1.0]
    mixed = [s for s, l in zip(sec, lam) if l < 1.0]
    return {**cell, "seed": seed, "steps": steps, "compute": steps * args.batch_size, **result,
            "train_seconds": train_seconds, "wall_seconds": time.perf_counter() - t,
            "train_cpu_seconds": train_cpu, "probe_cpu_seconds": probe_cpu,
            "mean_step_seconds": statistics.fmean(sec) if sec else None,
            "lambda_first": lam[0] if lam else None, "lambda_last": lam[-1] if lam else None,
            "lambda_mean": statistics.fmean(lam) if lam else None,
            "steps_lambda_1": len(rela_only),
            "median_step_seconds_lambda_1": statistics.median(rela_only) if rela_only else None,
            "median_step_seconds_lambda_lt_1": statistics.median(mixed) if mixed else None,
            "lambda_every_10": lam[::10]}


def _write_json(obj, path: Path) -> None:
    from accelerate_ssl.results import write_results

    path.parent.mkdir(parents=True, exist_ok=True)
    write_results(path, obj, ROOT)


def switch_timing(args, data: Data, target_rows: torch.Tensor, n: int) -> dict:
    """Wall time per step of a ReLA-only step (lambda == 1: the SSL loss callable is never called, as in
    Switch's first phase) vs a normal BYOL step, interleaved one by one in one process (same model, same
    batches), medians over ``n`` steps of each. ReLA v1 App. J: "no extra compute"."""
    from accelerate_ssl.recipes import BYOL, shuffled_batches, tensor_batches, train_ssl
    from accelerate_ssl.rela import ReLA
    from accelerate_ssl.schedules import Constant

    models = {}
    for kind in ("rela_only", "plain"):  # two identical students (same seed): one with ReLA, one without
        torch.manual_seed(0)
        backbone, dim = make_backbone(args)
        model = BYOL(backbone, dim).to(args.device)
        params = [p for p in model.parameters() if p.requires_grad]
        rela = None
        if kind == "rela_only":
            rela = ReLA(target_rows, backbone, schedule=Constant(1.0), feature_dim=dim).to(args.device)
            params += list(rela.parameters())
        models[kind] = (model, rela, torch.optim.AdamW(params, lr=args.lr))
    g = torch.Generator().manual_seed(0)
    batches = tensor_batches(data.train_x, shuffled_batches(len(data.train_x), args.batch_size, 0))
    times = {"rela_only": [], "plain": []}
    for i in range(2 * n + 4):
        kind = "rela_only" if i % 2 == 0 else "plain"
        model, rela, opt = models[kind]
        seconds = train_ssl(model, batches, 1, optimizer=opt, view_generator=g, rela=rela)["step_seconds"][0]
        if i >= 4:  # warm-up steps excluded
            times[kind].append(seconds)
    models["rela_only"][1].close()
    r, p = statistics.median(times["rela_only"]), statistics.median(times["plain"])
    return {"steps_each": n, "median_seconds_rela_only_step": r, "median_seconds_plain_step": p,
            "ratio": r / p, "saving_percent": 100 * (1 - r / p)}


# ---------------------------------------------------------------------------------------------- aggregate
def _ms(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values), "values": values}


def aggregate(results: list[dict]) -> dict:
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(row_id(r), []).append(r)
    out = {}
    for rid, rs in groups.items():
        first = rs[0]
        out[rid] = {k: first[k] for k in ("method", "prior", "schedule", "kind", "fraction", "subset", "group",
                                          "steps", "compute")}
        out[rid]["seeds"] = sorted(r["seed"] for r in rs)
        for m in ("linear_top1", "knn_top1", "wall_seconds", "train_seconds"):
            out[rid][m] = _ms([r[m] for r in sorted(rs, key=lambda r: r["seed"])])
    return out


def row_id(r: dict) -> str:
    return f"{r['method']}|{r['prior']}|{r['schedule']}|{r['kind']}|{r['fraction']}|{r['subset']}"


def _fmt(agg: dict, rid: str, metric: str = "linear_top1") -> str:
    a = agg.get(rid)
    if not a:
        return "not run"
    m = a[metric]
    return f"{m['mean']:.2f} ± {m['std']:.2f}" if m["n"] > 1 else f"{m['mean']:.2f} (1 seed)"


def paper_table(agg: dict, metric: str = "linear_top1", method: str = "byol", main: str = "decay",
                same_label: str = "F-MNIST BYOL") -> str:
    """Markdown in the layout of ReLA v2 Table 2: rows = budget, columns = plain, +ReLA priors, plain full."""
    name = method.upper() if method == "byol" else method
    head = (f"| budget | {name} | +ReLA random prior | +ReLA cross-dataset prior (digits) | "
            f"+ReLA same-dataset prior ({same_label}) | {name} full budget |")
    lines = [head, "|---|---|---|---|---|---|"]
    full = _fmt(agg, f"{method}|none|none|steps|1.0|full", metric)
    rows = [(f"{int(f * 100)} % data / epoch", "data", f, "dynamic") for f in DATA_FRACTIONS]
    rows += [(f"{int(f * 100)} % steps", "steps", f, "full") for f in STEP_FRACTIONS if f < 1.0]
    for label, kind, f, subset in rows:
        cells = [_fmt(agg, f"{method}|none|none|{kind}|{f}|{subset}", metric)]
        cells += [_fmt(agg, f"{method}|{p}|{main}|{kind}|{f}|{subset}", metric) for p in PRIORS]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {full} |")
    return "\n".join(lines)


def ablation_table(agg: dict, metric: str = "linear_top1", main: str = "decay") -> str:
    lines = ["| cell | plain | ReLA same-dataset prior |", "|---|---|---|"]
    for f in DATA_FRACTIONS:
        for subset in ("static", "dynamic"):
            lines.append(f"| {int(f * 100)} % data, {subset} subset | {_fmt(agg, f'byol|none|none|data|{f}|{subset}', metric)} | "
                         f"{_fmt(agg, f'byol|same|{main}|data|{f}|{subset}', metric)} |")
    for f in (0.2, 0.5):
        for sched in ("decay", "switch", "constant:0.5"):
            lines.append(f"| {int(f * 100)} % steps, {sched} | {_fmt(agg, f'byol|none|none|steps|{f}|full', metric)} | "
                         f"{_fmt(agg, f'byol|same|{sched}|steps|{f}|full', metric)} |")
    return "\n".join(lines)


def methods_table(agg: dict, metric: str = "linear_top1", main: str = "decay") -> str:
    lines = ["| method | plain 20 % steps | +ReLA same-dataset prior, 20 % steps | plain 100 % steps |", "|---|---|---|---|"]
    for m in ("byol",) + EXTENDED_METHODS:
        lines.append(f"| {m} | {_fmt(agg, f'{m}|none|none|steps|0.2|full', metric)} | "
                     f"{_fmt(agg, f'{m}|same|{main}|steps|0.2|full', metric)} | {_fmt(agg, f'{m}|none|none|steps|1.0|full', metric)} |")
    return "\n".join(lines)


def goals(agg: dict, timing: Optional[dict], main: str = "decay") -> dict:
    """The issue's three goals, from this run's measured numbers."""
    def mean(rid):
        return agg[rid]["linear_top1"]["mean"] if rid in agg else None

    out: dict = {}
    plain_full = mean("byol|none|none|steps|1.0|full")
    cand = {p: mean(f"byol|{p}|{main}|steps|0.2|full") for p in PRIORS}
    cand = {p: v for p, v in cand.items() if v is not None}
    if cand and plain_full is not None:
        best = max(cand, key=cand.get)
        out["best_prior"] = {"prior": best, "label": PRIOR_LABELS[best],
                             "rule": "highest mean linear top-1 at 20 % of the steps among the label-free priors"}
        v = cand[best]
        out["rela_20pct_steps_reaches_plain_100pct"] = {
            "rela_20pct": v, "plain_100pct": plain_full, "margin": v - plain_full, "pass": v >= plain_full}
        per = {}
        for kind, fractions, subset in (("steps", [f for f in STEP_FRACTIONS if f <= 0.5], "full"), ("data", DATA_FRACTIONS, "dynamic")):
            for f in fractions:
                r, p = mean(f"byol|{best}|{main}|{kind}|{f}|{subset}"), mean(f"byol|none|none|{kind}|{f}|{subset}")
                if r is not None and p is not None:
                    per[f"{int(f * 100)}% {kind}"] = {"rela": r, "plain": p, "margin": r - p, "pass": r > p}
        out["rela_beats_plain_every_budget_le_50pct"] = {"per_budget": per, "pass": bool(per) and all(x["pass"] for x in per.values())}
    if timing:
        out["switch_ssl_free_phase_saves_time"] = {**timing, "pass": timing["ratio"] < 1.0}
    return out


def goals_table(g: dict) -> str:
    """The goals as a Markdown table (measured values, margin, pass/fail)."""
    lines = ["| goal | measured | pass |", "|---|---|---|"]
    best = g.get("best_prior", {}).get("label", "?")
    a = g.get("rela_20pct_steps_reaches_plain_100pct")
    if a:
        lines.append(f"| ReLA ({best}) at 20 % of the steps >= plain BYOL at 100 % | {a['rela_20pct']:.2f} vs "
                     f"{a['plain_100pct']:.2f} (margin {a['margin']:+.2f} points) | {'pass' if a['pass'] else 'FAIL'} |")
    b = g.get("rela_beats_plain_every_budget_le_50pct")
    if b:
        parts = ", ".join(f"{k}: {v['rela']:.2f} vs {v['plain']:.2f} ({v['margin']:+.2f})" for k, v in b["per_budget"].items())
        lines.append(f"| ReLA ({best}) > plain at every budget <= 50 % | {parts} | {'pass' if b['pass'] else 'FAIL'} |")
    c = g.get("switch_ssl_free_phase_saves_time")
    if c:
        lines.append(f"| Switch's SSL-free phase (lambda = 1) saves wall time per step | {c['median_seconds_rela_only_step'] * 1000:.0f} ms "
                     f"vs {c['median_seconds_plain_step'] * 1000:.0f} ms per step (ratio {c['ratio']:.2f}, "
                     f"{c['saving_percent']:.0f} % saved; interleaved, medians of {c['steps_each']}) | {'pass' if c['pass'] else 'FAIL'} |")
    return "\n".join(lines)


def write_png(agg: dict, path: Path, batch_size: int, title: str, main: str = "decay") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = {"none": ("k", "o", "plain BYOL"), "random": ("C0", "s", PRIOR_LABELS["random"]),
              "cross": ("C1", "^", PRIOR_LABELS["cross"]), "same": ("C2", "D", PRIOR_LABELS["same"])}
    init = agg.get("byol|none|none|init|0.0|full")
    for ax, metric in zip(axes, ("linear_top1", "knn_top1")):
        for prior, (color, marker, label) in styles.items():
            sched = "none" if prior == "none" else main
            pts = sorted((a["compute"], a[metric]["mean"], a[metric]["std"]) for a in agg.values()
                         if a["method"] == "byol" and a["prior"] == prior and a["schedule"] == sched and a["kind"] == "steps")
            if pts:
                xs, ys, es = zip(*pts)
                ax.errorbar(xs, ys, yerr=es, color=color, marker=marker, label=f"{label} (step budget)", capsize=3)
            dpts = sorted((a["compute"], a[metric]["mean"], a[metric]["std"]) for a in agg.values()
                          if a["method"] == "byol" and a["prior"] == prior and a["schedule"] == sched and a["kind"] == "data"
                          and a["subset"] == "dynamic")
            if dpts:
                xs, ys, es = zip(*dpts)
                ax.errorbar(xs, ys, yerr=es, color=color, marker=marker, ls="none", mfc="none", ms=10, capsize=3,
                            label=f"{label} (data fraction, dynamic)")
        if init:
            ax.axhline(init[metric]["mean"], color="gray", ls=":", lw=1, label="untrained network")
        ax.set_xscale("log")
        ax.set_xlabel(f"compute = optimiser steps x batch ({batch_size})")
        ax.set_ylabel(f"{'linear probe' if metric == 'linear_top1' else 'kNN'} top-1 % (Fashion-MNIST test)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def run_workers(args, n_missing: int) -> int:
    """Compute the missing cells with ``--workers`` child processes (``--shard i/N`` each, same cache);
    returns how many cells they computed. A failed worker fails the study with its exit code."""
    import subprocess

    n = min(args.workers, n_missing)
    child = [a for a in args.argv]
    child += ["--workers", "1", "--switch-timing-steps", "0", "--verify", "0", "--no-progress",
              "--out", str(Path(args.cache) / "workers")]
    procs = []
    for i in range(n):
        log = open(Path(args.cache) / f"worker{i}.log", "w")
        cmd = [sys.executable, str(Path(__file__).resolve()), *child, "--shard", f"{i}/{n}", "--name", f"worker{i}"]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log, i))
    print(f"computing {n_missing} cells with {n} workers (logs: {Path(args.cache)}/worker*.log)")
    computed = 0
    for proc, log, i in procs:
        rc = proc.wait()
        log.close()
        if rc != 0:
            raise RuntimeError(f"budget worker {i} failed (exit {rc}); see {Path(args.cache) / f'worker{i}.log'}. "
                               "Rerun the same command: finished cells are cached.")
        result = json.loads((Path(args.cache) / "workers" / f"worker{i}.json").read_text())
        computed += result["cells_computed_this_run"]
    return computed


def core_grid_estimate(args, results: list[dict], todo: list) -> Optional[dict]:
    """Time of the whole grid from this run's cells: CPU seconds per optimiser step and per probe (process
    CPU time, independent of how loaded the machine is), so ``cpu_seconds / cores`` is the wall time on
    that many quiet cores running one shard each (``--shard K/N``)."""
    timed = [r for r in results if r.get("train_cpu_seconds") is not None and r["steps"] > 0]
    if not timed:
        return None
    cpu_per_step = sum(r["train_cpu_seconds"] for r in timed) / sum(r["steps"] for r in timed)
    cpu_per_probe = statistics.fmean(r["probe_cpu_seconds"] for r in results if r.get("probe_cpu_seconds") is not None)
    wall_per_step = sum(r["train_seconds"] for r in timed) / sum(r["steps"] for r in timed)
    total_steps = sum(cell_steps(c, args.steps) for c, _ in todo)
    cpu_total = total_steps * cpu_per_step + len(todo) * cpu_per_probe
    return {"cells": len(todo), "optimiser_steps": total_steps, "cpu_seconds_per_step": cpu_per_step,
            "cpu_seconds_per_probe": cpu_per_probe, "wall_seconds_per_step_this_run": wall_per_step,
            "cpu_seconds_total": cpu_total, "minutes_on_2_quiet_cores": cpu_total / 2 / 60,
            "threads_per_process": args.threads, "load_average_at_end": os.getloadavg(),
            "note": "prior training (cached once) not included; 2 quiet cores = two --shard workers with --threads 1"}


# ---------------------------------------------------------------------------------------------- main
def run(args) -> dict:
    check_args(args)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/budget.py", *args.argv])
    cache = Path(args.cache)
    settings = shared_settings(args)
    grid = make_grid(args)
    todo = [(c, s) for s in args.seeds for c in grid]
    data = Data(args.train_size, args.test_size, args.device)

    priors_needed = [p for p in PRIORS if any(c["prior"] == p for c in grid)]
    prior_info, targets = {}, {}
    loaded: dict[str, dict] = {}
    for c, s in todo:
        p = cache / "cells" / f"{cell_key(c, s, settings)}.json"
        if p.is_file():
            loaded[cell_key(c, s, settings)] = json.loads(p.read_text())
    missing = [(c, s) for c, s in todo if cell_key(c, s, settings) not in loaded]
    for kind in priors_needed:
        t = time.perf_counter()
        path, desc = prior_file(args, kind)
        prior_info[kind] = {"path": str(path), "description": desc, "label": PRIOR_LABELS[kind],
                            "seconds_to_get": time.perf_counter() - t}
        targets[kind] = prior_targets(path, data)
        prior_info[kind]["own_probe"] = prior_quality(args, path, data, targets[kind])
    n_cached = len(todo) - len(missing)
    k, n = parse_shard(args.shard)
    missing = missing[k::n]
    if args.max_new_cells is not None:
        missing = missing[: args.max_new_cells]
    print(f"{len(todo)} cells: {n_cached} cached, computing {len(missing)} (shard {k}/{n})")
    computed = 0
    if args.workers > 1 and args.shard is None and args.max_new_cells is None and len(missing) > 1:
        computed = run_workers(args, len(missing))
        for c, s in todo:
            p = cache / "cells" / f"{cell_key(c, s, settings)}.json"
            if p.is_file():
                loaded[cell_key(c, s, settings)] = json.loads(p.read_text())
        missing = []
    for c, s in missing:
        key = cell_key(c, s, settings)
        res = run_cell(args, c, s, data, targets)
        res["key"] = key
        _write_json(res, cache / "cells" / f"{key}.json")
        loaded[key] = res
        computed += 1
        print(f"  {row_id(c)} seed {s}: linear {res['linear_top1']:.2f} %, kNN {res['knn_top1']:.2f} %, "
              f"{res['wall_seconds']:.0f} s")

    verify = []
    if args.verify:
        pool = [(c, s) for c, s in todo if cell_key(c, s, settings) in loaded and c["kind"] != "init"]
        pool = sorted(pool, key=lambda cs: cell_steps(cs[0], args.steps))[: args.verify]
        for c, s in pool:
            old = loaded[cell_key(c, s, settings)]
            for kind in ([c["prior"]] if c["prior"] != "none" else []):
                if kind not in targets:
                    targets[kind] = prior_targets(Path(prior_info[kind]["path"]), data)
            new = run_cell(args, c, s, data, targets)
            verify.append({"cell": row_id(c), "seed": s, "cached_linear": old["linear_top1"], "rerun_linear": new["linear_top1"],
                           "cached_knn": old["knn_top1"], "rerun_knn": new["knn_top1"],
                           "identical": old["linear_top1"] == new["linear_top1"] and old["knn_top1"] == new["knn_top1"]})

    timing = None
    if args.switch_timing_steps and "same" in targets:
        timing = switch_timing(args, data, targets["same"], args.switch_timing_steps)

    results = [loaded[cell_key(c, s, settings)] for c, s in todo if cell_key(c, s, settings) in loaded]
    agg = aggregate(results)
    estimate = core_grid_estimate(args, results, todo)
    title = (f"Fashion-MNIST ({args.train_size} train imgs), {args.backbone}, BYOL, full budget {args.steps} steps, "
             f"device {settings['device']}, seeds {args.seeds}")
    out_dir = Path(args.out)
    png = out_dir / f"{args.name}_accuracy.png"
    out_dir.mkdir(parents=True, exist_ok=True)
    main = args.main_schedule
    write_png(agg, png, args.batch_size, title, main)
    same_label = "demo's shipped F-MNIST BYOL" if args.same_prior == "demo" else "F-MNIST BYOL"
    tables = {"paper001_table2_linear": paper_table(agg, main=main, same_label=same_label),
              "paper001_table2_knn": paper_table(agg, "knn_top1", main=main, same_label=same_label),
              "ablation_linear": ablation_table(agg, main=main), "methods_linear": methods_table(agg, main=main)}
    measured_goals = goals(agg, timing, main)
    tables["goals"] = goals_table(measured_goals)
    result = {
        "command": command,
        "device": {"type": settings["device"],
                   "name": torch.cuda.get_device_name() if settings["device"] == "cuda" else platform.processor() or "cpu"},
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "platform": platform.platform(), "python": platform.python_version(),
                    "load_average": os.getloadavg()},
        "settings": {**settings, "grid": args.grid, "seeds": args.seeds, "methods": args.methods},
        "priors": prior_info,
        "cells_total": len(todo), "cells_computed_this_run": computed, "cells_missing": len(todo) - len(results),
        "complete": len(results) == len(todo),
        "rows": agg, "cells": results, "tables": tables, "goals": measured_goals, "switch_timing": timing,
        "reproducibility": verify, "estimate": estimate, "wall_seconds": time.perf_counter() - t_start,
    }
    _write_json(result, out_dir / f"{args.name}.json")
    print()
    print("Linear probe top-1 % (Fashion-MNIST test), ReLA v2 Table 2 layout:")
    print(tables["paper001_table2_linear"])
    print()
    print("kNN top-1 %:")
    print(tables["paper001_table2_knn"])
    print()
    print(tables["goals"])
    print(f"wrote {out_dir / (args.name + '.json')} and {png}; {len(results)}/{len(todo)} cells present")
    return result


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
