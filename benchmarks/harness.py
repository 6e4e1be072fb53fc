"""The one harness every training study runs: a recipe, a schedule, a prior and a run length, probed along the way,
with what each probe point cost.

A **recipe** is a student and its data (:data:`RECIPES`: ``vit``, a 4-block timm ViT at 28 px with VICReg on 10k
Fashion-MNIST images; ``convnet``, the demo's ConvNet 16/32/64 with BYOL on 20k), an AdamW learning rate planned for
each run's own length (linear warm-up over 10 %, cosine to 0) and the probes (linear on all labels, kNN k = 20, linear
on 100 labels per class). A **run** (:class:`Run`) adds what varies: plain SSL or ``rela.wrap(ssl_loss)`` with a prior
(``random``: an untrained ConvNet; ``other``: ``shipped:digits-byol``, trained on other data; ``indomain``: the
student's own architecture trained here with plain SSL, an upper bound), the schedule spec planned for the run
(``"<spec>@<f>"``: its term ends for good at fraction ``f`` of the run), the run's length and seed, and **how the loop
writes the loss**:

* ``callable`` (the README's recipe): the SSL loss passed to ``wrap`` as a callable, so a step with lambda 1 forwards
  one view of the SSL augmentation and skips the SSL side (no second view, no momentum network);
* ``eager``: the SSL loss computed before ``wrap``: every step at the full price of a plain step.

**Compute.** Every probe point records the run's CPU seconds of training up to it (the training process, all its
threads, steps only: batches and probes excluded) and its wall-clock; a run with a prior also records what its prior's
targets cost to precompute once (loading the prior included: ``precompute``), which the studies add to every point of
the run. The in-domain prior's own training is not counted (it is an upper bound). On a shared machine a run's own CPU
seconds move with the load (other jobs evict its caches), so the studies also model each run's compute from what it
did, step by step (:func:`step_kinds`), at the cost of each kind of step and of the precompute measured side by side in
one process (:func:`timing`, :func:`modelled_compute`).

Each run is one JSON (:func:`run_unit`; a rerun of the same study resumes by skipping the runs that are there),
written atomically with its commit, settings, load average and precompute.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from accelerate_ssl.atomic import atomic_write_json  # noqa: E402
from accelerate_ssl.results import code_commit  # noqa: E402

#: the priors of the studies: name -> spec (``indomain`` is trained here, :func:`train_indomain`)
PRIORS = {"random": "random:convnet", "other": "shipped:digits-byol", "indomain": None}
PRIOR_LABEL = {"random": "untrained ConvNet", "other": "digits BYOL (other data)",
               "indomain": "in-domain SSL (upper bound)"}
#: each recipe's settings
RECIPES = {
    "vit": {"student": "vit", "ssl": "vicreg", "train_size": 10000, "test_size": 5000, "full": 1000},
    "convnet": {"student": "convnet", "ssl": "byol", "train_size": 20000, "test_size": 10000, "full": 1000},
}
#: the settings every recipe shares; ``components``: the target's PCA components, ReLA's own default ("auto": the
#: student's feature dim, capped by the prior's)
COMMON = {"lr": 1e-3, "batch_size": 128, "components": "auto", "threads": 1, "device": "cpu", "canvas": 0,
          "widths": [16, 32, 64]}
INDOMAIN_SEED = 1000  # the in-domain prior's own seed, distinct from every student's
LOSS_FORMS = ("callable", "eager")
PROBES = {"top1": "linear probe, all labels", "knn_top1": "kNN, k = 20", "few_label_top1": "linear probe, 100 labels per class"}


def recipe(student: str, **overrides) -> SimpleNamespace:
    """The recipe's settings (:data:`RECIPES` + :data:`COMMON`), ``overrides`` winning (None: keep the default)."""
    out = {**COMMON, **RECIPES[student]}
    out.update({k: v for k, v in overrides.items() if v is not None})
    return SimpleNamespace(**out)


def recipe_settings(r, run: Optional["Run"] = None) -> dict:
    """The settings that decide a run of the recipe (a plain run's: all but ReLA's ``components``)."""
    keys = ("student", "ssl", "full", "lr", "batch_size", "train_size", "test_size", "components", "threads") + \
        (("device",) if r.device != "cpu" else ()) + (("canvas",) if r.canvas else ())
    return {k: getattr(r, k) for k in keys if not (k == "components" and run is not None and run.prior is None)}


@dataclass(frozen=True)
class Run:
    """One training run of a recipe (module docstring)."""

    prior: Optional[str]  # None: plain SSL; else a key of PRIORS
    steps: int
    seed: int
    schedule: Optional[str] = None  # the spec ReLA plans for ``steps`` ("<spec>@<f>": its term over at f of the run)
    loss: str = "callable"  # how the loop passes its SSL loss to wrap (LOSS_FORMS)
    handover: str = "warm-heads=auto"  # Handover.from_spec (this default: ReLA's own; "momentum": reset the method's copies)
    views: str = "byol"  # the student's view while lambda is 1: one of the SSL views, or ReLA v1's weak ones
    probes: tuple = field(default=())  # steps probed besides 0 and the end

    def __post_init__(self):
        if self.loss not in LOSS_FORMS:
            raise ValueError(f"Run(loss=) is one of {LOSS_FORMS}, got {self.loss!r}.")
        if (self.prior is None) != (self.schedule is None):
            raise ValueError("Run: a plain run has neither prior nor schedule; a ReLA run has both.")

    @property
    def kind(self) -> str:
        return "plain" if self.prior is None else "rela"

    def name(self) -> str:
        """The run's file name: what decides it, nothing else (the probes do not change the training)."""
        if self.prior is None:
            return f"plain-{self.steps}-seed{self.seed}"
        parts = [self.prior, self.schedule, str(self.steps), f"seed{self.seed}", self.loss, self.handover, self.views]
        return "rela-" + "-".join(re.sub(r"[^a-z0-9.=@:]+", "_", p.lower()) for p in parts).replace(":", "~")

    def checkpoints(self) -> list[int]:
        return sorted({0, self.steps, *(p for p in self.probes if 0 < p < self.steps)})


def probes_along(steps: int, fractions=(0.25, 0.5, 0.75)) -> tuple:
    """Probe points along a run: these fractions of it (the short runs' too: one run gives a curve)."""
    return tuple(sorted({round(f * steps) for f in fractions if round(f * steps) > 0}))


# ---------------------------------------------------------------------------------------------- data, student, probe
def data(r):
    """(train, test, train images, test images) of the recipe: Fashion-MNIST, on canvases when ``r.canvas``."""
    from accelerate_ssl.data import Canvas, FashionMNIST
    from accelerate_ssl.recipes import images_to_tensor

    train, test = FashionMNIST("train", limit=r.train_size), FashionMNIST("test", limit=r.test_size)
    if r.canvas:
        train, test = Canvas(train, size=r.canvas, seed=1), Canvas(test, size=r.canvas, seed=2)
    return train, test, images_to_tensor(train.data), images_to_tensor(test.data)


def student(r):
    """The student network, drawn from the current torch seed (``.feature_dim`` set)."""
    from accelerate_ssl.backbones import ConvNet

    if r.student == "convnet":
        return ConvNet(widths=tuple(r.widths))
    from accelerate_ssl.optional import require

    timm = require("timm", "the ViT student of the benchmarks")
    net = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=r.canvas or 28, patch_size=4,
                            in_chans=1, embed_dim=64, depth=4, num_heads=4, num_classes=0, global_pool="avg")
    net.feature_dim = net.num_features
    return net


#: the ViT student as a checkpoint prior (the in-domain prior)
VIT_PRIOR = ("timm:vit_tiny_patch16_224", {"img_size": 28, "patch_size": 4, "in_chans": 1, "embed_dim": 64, "depth": 4,
                                           "num_heads": 4, "num_classes": 0, "global_pool": "avg"})


class Probe:
    """The recipe's probe: linear on all training labels (the curve's number); kNN and 100 labels per class beside."""

    def __init__(self, train, test, xtr, xte, seed: int, untrained: Path | None = None):
        from accelerate_ssl.recipes import Probe as RecipeProbe

        self.inner, self.last = RecipeProbe(xtr, train.targets, xte, test.targets, seed=seed, few_labels=100), {}
        self.untrained, self.calls = untrained, 0

    def __call__(self, backbone) -> float:
        """The first call probes the seed's untrained student, the same network for every run of the seed: its numbers
        are kept in ``untrained`` and read back by the seed's other runs instead of probing it again."""
        first, self.calls = self.calls == 0, self.calls + 1
        if first and self.untrained is not None and self.untrained.is_file():
            self.last = json.loads(self.untrained.read_text())
        else:
            self.last = self.inner.evaluate(backbone)
            if first and self.untrained is not None:
                atomic_write_json(self.untrained, self.last)
        self.last = dict(self.last)
        return self.last.pop("linear_top1")


def untrained_file(r, runs: Path, seed: int) -> Path:
    """The probe of the seed's untrained student (the same draw for every run of the seed)."""
    net = f"w{'-'.join(map(str, r.widths))}" if r.student == "convnet" else r.student
    return Path(runs) / f"untrained-c{r.canvas}-{r.train_size}-{r.test_size}-{net}-seed{seed}.json"


# ---------------------------------------------------------------------------------------------- priors
def store_dir(r, cache: Path, prior: str) -> Path:
    return Path(cache) / f"{r.student}-{r.train_size}-{prior}"


def indomain_checkpoint(r, cache: Path) -> Path:
    return Path(cache) / f"{r.student}-{r.ssl}-{r.full}-{r.train_size}-indomain.safetensors"


def prior_spec(r, cache: Path, prior: str) -> str:
    return PRIORS[prior] or f"checkpoint:{indomain_checkpoint(r, cache)}"


def prepare_prior(r, data_, cache: Path, prior: str) -> dict:
    """The prior's store over the clean training images (once; its CPU and wall seconds recorded beside it, loading
    the prior included). ``indomain``: the student's architecture trained with plain SSL for the full run first."""
    import fcntl

    memo = store_dir(r, cache, prior).with_suffix(".json")
    memo.parent.mkdir(parents=True, exist_ok=True)
    with open(memo.with_suffix(".lock"), "a") as lock:  # the study's workers take turns: one precomputes, the others read
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if memo.is_file() and (store_dir(r, cache, prior) / "metadata.json").is_file():
            return json.loads(memo.read_text())
        return _precompute(r, data_, cache, prior, memo)


def _precompute(r, data_, cache: Path, prior: str, memo: Path) -> dict:
    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.targets.precompute import precompute_targets

    record = {}
    if prior == "indomain":
        record["training"] = (train_indomain(r, data_, cache) if not indomain_checkpoint(r, cache).is_file() else
                              {"steps": r.full, "seed": INDOMAIN_SEED, "checkpoint": indomain_checkpoint(r, cache).name})
    torch.set_num_threads(r.threads)
    load, t, c = os.getloadavg(), time.perf_counter(), time.process_time()
    spec = prior_spec(r, cache, prior)
    precompute_targets(create_prior(spec).to(r.device), data_[0], store_dir(r, cache, prior), progress=True,
                       command=f"harness.py ({prior})")
    record.update({"spec": spec, "seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c,
                   "load_average": [load, os.getloadavg()]})
    atomic_write_json(memo, record, indent=1)
    return record


def prior_probe(r, data_, cache: Path, prior: str) -> dict:
    """The prior itself, probed as the students are (seed 0), on its full embedding and on the rows the student is
    trained toward (the store's ``components``-column PCA with z-scoring, ReLA v2 Eq. 41, fitted on the training
    rows): ``{"full": {...}, "reduced": {...}}``. Once per prior, kept beside its store."""
    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.recipes.views import FASHION_MNIST_MEAN, FASHION_MNIST_STD
    from accelerate_ssl.targets.store import TargetStore

    memo = Path(f"{store_dir(r, cache, prior)}-probe.json")
    if memo.is_file():
        record = json.loads(memo.read_text())
        if "reduced" in record:
            return record
    model = create_prior(prior_spec(r, cache, prior)).eval()

    def embed(x):  # the probe's normalised images -> pixels -> the prior's own preprocessing
        with torch.no_grad():
            return torch.cat([model(model.preprocess.batch((b * FASHION_MNIST_STD + FASHION_MNIST_MEAN).clamp(0, 1)))
                              for b in x.split(512)]).float()

    train, test, xtr, xte = data_
    torch.set_num_threads(r.threads)
    ftr, fte = embed(xtr), embed(xte)
    store = TargetStore.open(store_dir(r, cache, prior), dataset=train)
    torch.manual_seed(0)
    n = min(student(r).feature_dim, store.dim) if r.components == "auto" else r.components  # what ReLA reduces to
    pca = store.pca(n)
    probe = Probe(train, test, xtr, xte, 0).inner
    out = {}
    for name, (a, b) in {"full": (ftr, fte), "reduced": (pca.transform(ftr), pca.transform(fte))}.items():
        lin = probe._linear(a, b)
        from accelerate_ssl.evaluate import few_label_probe, knn_accuracy

        out[name] = {"linear_top1": lin, "knn_top1": knn_accuracy(a, probe.train_y, b, probe.test_y, k=probe.knn_k),
                     "few_label_top1": few_label_probe(a, probe.train_y, b, probe.test_y, per_class=100,
                                                       seed=0)["top1"], "dim": int(a.shape[1])}
    atomic_write_json(memo, out, indent=1)
    return out


def train_indomain(r, data_, cache: Path) -> dict:
    """The in-domain prior: plain SSL for the recipe's full run (seed :data:`INDOMAIN_SEED`), saved as a checkpoint
    prior."""
    from accelerate_ssl.priors.registry import save_prior_checkpoint
    from accelerate_ssl.recipes.views import FASHION_MNIST_MEAN, FASHION_MNIST_STD

    log, backbone = train(r, data_, Run(None, r.full, INDOMAIN_SEED), cache, progress="in-domain prior")
    arch, kwargs = VIT_PRIOR if r.student == "vit" else ("convnet", backbone.config)
    save_prior_checkpoint(backbone.cpu(), indomain_checkpoint(r, cache), arch, kwargs,
                          {"channels": 1, "mean": [FASHION_MNIST_MEAN], "std": [FASHION_MNIST_STD]})
    return {"steps": r.full, "seed": INDOMAIN_SEED, "probe": log["curve"][-1],
            "train_cpu_seconds": log["train_cpu_seconds"]}


# ---------------------------------------------------------------------------------------------- a run
def build(r, data_, run: Run, cache: Path):
    """(method, rela, optimizer) of ``run``: the student drawn from its seed first, then the SSL method, then ReLA."""
    from accelerate_ssl.recipes import create_method

    train = data_[0]
    torch.manual_seed(run.seed)
    backbone = student(r)
    method = create_method(r.ssl, backbone, backbone.feature_dim).to(r.device)
    params, rela = [p for p in method.parameters() if p.requires_grad], None
    if run.prior is not None:
        from accelerate_ssl.rela import Handover, ReLA
        from accelerate_ssl.targets.store import TargetStore

        spec, _, end = run.schedule.partition("@")
        options = {"schedule": spec} if spec else {}
        if end:
            options["end_step"] = round(float(end) * run.steps)
        rela = ReLA(TargetStore.open(store_dir(r, cache, run.prior), dataset=train), backbone, dataset=train,
                    total_steps=run.steps, feature_dim=backbone.feature_dim, n_components=r.components,
                    handover=Handover.from_spec(run.handover, momentum=method.momentum_pairs()), **options).to(r.device)
        params += list(rela.parameters())
    return method, rela, torch.optim.AdamW(params, lr=r.lr, weight_decay=0.01)


def batches(r, xtr, seed: int):
    from accelerate_ssl.recipes import shuffled_batches, tensor_batches

    return tensor_batches(xtr.to(r.device), shuffled_batches(len(xtr), r.batch_size, seed))


def train(r, data_, run: Run, cache: Path, runs: Optional[Path] = None, progress: Optional[str] = None):
    """Train ``run``; return (its log, the trained backbone). The log: the probe curve (each point with its step,
    lambda, the three probes, the training's CPU and wall seconds up to it), lambda and the ReLA loss per step."""
    from accelerate_ssl.recipes import cosine_momentum, train_ssl, warmup_cosine_lr

    train_, test, xtr, xte = data_
    method, rela, opt = build(r, data_, run, cache)
    probe = Probe(train_, test, xtr, xte, run.seed, untrained_file(r, runs, run.seed) if runs else None)
    losses: list[float] = []
    torch.set_num_threads(r.threads)
    try:
        log = train_ssl(method, batches(r, xtr, run.seed), run.steps, optimizer=opt,
                        view_generator=torch.Generator().manual_seed(run.seed + 1), rela=rela, rela_views=run.views,
                        rela_step="eager" if run.loss == "eager" else "one-view",
                        lr=warmup_cosine_lr(r.lr, run.steps), momentum=cosine_momentum(run.steps),
                        checkpoints=run.checkpoints(), probe=probe, checkpoint_extras=lambda: dict(probe.last),
                        on_step=lambda step, loss: losses.append(loss) if rela is not None else None,
                        progress=progress or f"{run.prior or 'plain'} {run.schedule or ''} {run.steps} seed {run.seed}")
    finally:
        if rela is not None:
            rela.close()
    lambdas = log["lambda_per_step"]
    out = {"curve": log["curve"], "lambda_per_step": lambdas, "loss_per_step": losses,
           "train_seconds": log["train_seconds"], "train_cpu_seconds": log["train_cpu_seconds"],
           "rela_steps": sum(1 for lam in lambdas if lam >= 1.0) if run.loss == "callable" else 0,
           "handover_step": next((i for i, lam in enumerate(lambdas) if lam == 0.0), None),
           "rela": None if rela is None else {"schedule": repr(rela.schedule), "handover": rela.handover.state_dict()}}
    return out, method.backbone


def run_unit(r, data_, run: Run, runs: Path, cache: Path, path: Optional[Path] = None, label=None) -> dict:
    """Train ``run`` and write its JSON to ``path`` (default ``runs/<run.name()>.json``) unless it is there (a rerun
    resumes); return the record. ``label``: the run as another study names it (kept in the record)."""
    path = Path(path or Path(runs) / f"{run.name()}.json")
    if path.is_file():
        record = json.loads(path.read_text())
        expected = recipe_settings(r, run)
        if record.get("recipe") is not None and {k: record["recipe"].get(k) for k in expected} != expected:
            raise ValueError(f"{path} is a run of another recipe ({record['recipe']}, not {expected}): move it away, or "
                             "run this study into another --runs folder.")
        return record
    pre = prepare_prior(r, data_, cache, run.prior) if run.prior else None
    load = os.getloadavg()
    record, _ = train(r, data_, run, cache, runs)
    record.update(run={**asdict(run), "probes": list(run.checkpoints())}, label=label, recipe=recipe_settings(r, run),
                  precompute=pre, load_average=[load, os.getloadavg()], commit=code_commit(ROOT)["commit"])
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record, indent=1)
    return record


# ---------------------------------------------------------------------------------------------- cost of a step
#: the kinds of step a run is made of, by what a step computes: ``plain`` (the SSL loss alone: plain SSL, and every
#: step after ReLA's hand-over), ``mixed`` (both losses: lambda between 0 and 1), ``callable`` (lambda 1, the loss a
#: callable: one view, the SSL side skipped), ``eager`` (lambda 1, the loss computed before wrap)
STEP_KINDS = ("plain", "mixed", "callable", "eager")


def step_kinds(record: dict) -> list[str]:
    """The kind of each step of a finished run (:data:`STEP_KINDS`), from its lambda per step and its loss form."""
    lam, run = record["lambda_per_step"], record["run"]
    if not lam:
        return ["plain"] * run["steps"]
    one = "callable" if run["loss"] == "callable" else "eager"
    return [one if v >= 1.0 else "mixed" if v > 0.0 else "plain" for v in lam]


def side_by_side(steps: dict, rounds: int, between=None, every: int = 3, warmup: int = 2) -> dict:
    """The medians of each kind of step's wall and CPU seconds, the kinds' steps interleaved one by one in this
    process, so that a shared machine's load moves every kind alike and their ratios hold.

    ``steps``: kind -> a function of the round ``i`` that takes one step of that kind and returns its
    ``train_ssl`` log (its ``step_seconds`` and ``step_cpu_seconds`` are read). ``warmup`` rounds are not counted;
    ``between(i)`` (the precompute's chunks, :func:`precompute_cost`) runs after every ``every``-th counted round.
    Returns ``{kind: {"seconds": median, "cpu_seconds": median}}``. Every study's timing is this loop (the budget
    study's :func:`timing`, ``head_to_head.py``'s and ``timm_kd.py``'s units)."""
    wall: dict = {k: [] for k in steps}
    cpu: dict = {k: [] for k in steps}
    for i in range(rounds + warmup):
        for kind, step in steps.items():
            log = step(i)
            if i >= warmup:
                wall[kind].append(log["step_seconds"][0])
                cpu[kind].append(log["step_cpu_seconds"][0])
        if between is not None and i >= warmup and (i - warmup) % every == 0:
            between(i)
    return {k: {"seconds": statistics.median(wall[k]), "cpu_seconds": statistics.median(cpu[k])} for k in steps}


def precompute_cost(model, train, i: int, chunk: int, device: str = "cpu") -> tuple[float, float]:
    """Wall and CPU seconds per image of ``model``'s precompute (``precompute_targets``, a temporary store) over a
    chunk of ``chunk`` training images, which chunk moving with the round ``i`` (:func:`side_by_side`'s ``between``).
    ``model``: one prior, or a list of priors written in one pass over the chunk as ``precompute_targets`` does."""
    import tempfile

    from accelerate_ssl.data import ArrayImageDataset
    from accelerate_ssl.targets.precompute import precompute_targets

    lo = (i * chunk) % (len(train) - chunk)
    part = ArrayImageDataset(train.data[lo:lo + chunk].numpy(), train.targets[lo:lo + chunk].numpy())
    with tempfile.TemporaryDirectory() as tmp:
        many = isinstance(model, list)
        t, c = time.perf_counter(), time.process_time()
        precompute_targets(model, part, [Path(tmp) / f"s{j}" for j in range(len(model))] if many else Path(tmp) / "s",
                           progress=False)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / chunk, (time.process_time() - c) / chunk


def timing(r, data_, cache: Path, priors=("other",), steps: int = 30, chunk: int = 512) -> dict:
    """The CPU and wall seconds of each kind of step (:data:`STEP_KINDS`) side by side (:func:`side_by_side`, the
    same batches) and of each prior's precompute per image, in chunks of ``chunk`` training images between the
    rounds: the costs a run's compute is modelled with (side by side, the ratios hold on a shared machine whose load
    moves every run's own CPU seconds)."""
    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.recipes import train_ssl

    prior = priors[0]
    kinds = {"plain": Run(None, steps, 0), "mixed": Run(prior, steps, 0, "constant:0.5"),
             "callable": Run(prior, steps, 0, "constant:1"), "eager": Run(prior, steps, 0, "constant:1", loss="eager")}
    built = {k: (*build(r, data_, run, cache), batches(r, data_[2], 0)) for k, run in kinds.items()}
    models = {p: create_prior(prior_spec(r, cache, p)).to(r.device) for p in priors}
    per_image: dict[str, list[tuple[float, float]]] = {p: [] for p in priors}
    g = torch.Generator().manual_seed(1)
    torch.set_num_threads(r.threads)
    load = os.getloadavg()

    def step(kind):
        method, rela, opt, source = built[kind]
        return lambda i: train_ssl(method, source, 1, optimizer=opt, view_generator=g, rela=rela, rela_views="byol",
                                   rela_step="eager" if kind == "eager" else "one-view")

    def between(i):
        for p, model in models.items():
            per_image[p].append(precompute_cost(model, data_[0], i, chunk, r.device))

    times = side_by_side({k: step(k) for k in built}, steps, between)
    for _, rela, *_ in built.values():
        if rela is not None:
            rela.close()
    med = {k: {"step_seconds": v["seconds"], "step_cpu_seconds": v["cpu_seconds"]} for k, v in times.items()}
    pre = {p: {"seconds_per_image": statistics.median(w for w, _ in v),
               "cpu_seconds_per_image": statistics.median(c for _, c in v)} for p, v in per_image.items()}
    return {"steps_each": steps, "kinds": med, "precompute": pre, "load_average": [load, os.getloadavg()],
            "relative_cpu": {k: v["step_cpu_seconds"] / med["plain"]["step_cpu_seconds"] for k, v in med.items()}}


def modelled_compute(record: dict, timing_: dict, train_size: int) -> list[float]:
    """A run's compute at each of its probe points, in CPU seconds as :func:`timing` measured each kind of step side by
    side: the steps taken up to the point, each at its kind's cost, plus its prior's precompute (once)."""
    cost = {k: v["step_cpu_seconds"] for k, v in timing_["kinds"].items()}
    prior = record["run"]["prior"]
    pre = timing_["precompute"][prior]["cpu_seconds_per_image"] * train_size if prior else 0.0
    total, sums = 0.0, [0.0]
    for kind in step_kinds(record):
        total += cost[kind]
        sums.append(total)
    return [pre + sums[c["step"]] for c in record["curve"]]


# ---------------------------------------------------------------------------------------------- numbers
def mean_sd(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else None,
            "per_seed": values}


def mean_sd_text(v: dict) -> str:
    """``{"mean", "sd"}`` as "mean ± sd" (the mean alone when one seed gives no sd)."""
    return f"{v['mean']:.2f}" + (f" ± {v['sd']:.2f}" if v["sd"] is not None else "")


def seeds_text(n: int) -> str:
    return f"{n} seed{'s' if n > 1 else ''}"
