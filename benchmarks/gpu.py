"""The GPU benchmark: what only a CUDA device can show, in one command that ends within 8 minutes.

    python benchmarks/gpu.py --out DIR            # on one CUDA GPU (about 7.5 min on an H100 / H200)
    python benchmarks/gpu.py --smoke --out DIR    # the same code path on the CPU at toy sizes (a test runs it)

Sections, in this order; ``DIR/gpu.json`` is rewritten after each one (every figure beside the code commit, device,
driver, torch, CUDA and cuDNN), so a run cut short keeps what it measured (a section that raises records its error
and the next one runs; one whose estimate no longer fits the 8 minutes is skipped, and said so):

1. **tests**: ``pytest -m cuda`` over the CUDA tests, then the device-relevant files of the fast suite, with the GPU
   visible (logs in ``DIR/pytest_*.log``).
2. **precompute**: for a DINOv2 ViT-S/14- and a ViT-B/14-sized prior at 224 px (timm's architectures with random
   weights loaded as a user's local weights file: timing does not depend on the values), bf16, batch 256, on a folder
   of photo-like JPEGs of ImageNet sizes (500x375, 375x500, 448x448) and on an in-memory uint8 array (256 px):
   the bare forward (inputs already on the GPU), the input pipeline alone and ``precompute_targets``, side by side
   (``benchmarks/precompute.py``'s :func:`measure`; goal >= 0.8x the bare forward for ViT-S/14).
3. **steps**, like for like, at the sizes users train (ResNet-50 student, batch 256 per view, 224 px, bf16 autocast,
   channels_last, AdamW): plain BYOL (the recipe's, 4096 / 256 heads) and ReLA mixed (0 < lambda < 1, targets on the
   device), then for each prior ReLA at lambda = 1 on one view beside the online teacher on one view (the prior run
   on that view every step), and ReLA at lambda = 1 on two views beside the online teacher on both; plain BYOL again
   at the end (the difference is the timing noise). Median step time, peak memory, each ratio to plain BYOL set
   against the FLOP ratio ``benchmarks/cost_model.py`` counted (error = measured / counted - 1), and ReLA / online
   per prior and view count.
4. **budget**: the budget study at GPU size (``benchmarks/budget.py``, :func:`budget_study`), in the time left.

Sections run only when asked (``--sections``): **no_host_sync** (20 ReLA steps under
``torch.cuda.set_sync_debug_mode("error")``, targets on the device and from a host store through the prefetcher),
**study** (``accelerate-ssl demo --device cuda``) and **compiled** (plain BYOL and ReLA mixed under
``torch.compile``); ``--steps`` adds the host-store kinds (``plain_loader``, ``rela_mixed_host_prefetch``).

``--smoke``: 32 px, batch 4, a ResNet-18 student, timm's tiny test ViTs as the priors, 2 timed steps, 32 images per
precompute case, ``torch.compile`` with the ``eager`` backend (dynamo traces the ReLA hook; no C++ compiler needed),
the tests section on ``tests/test_cuda.py`` only (skipped without a device). Without CUDA the sync and memory figures
are ``None``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from precompute import measure, photo_folder, random_weights_prior  # noqa: E402

#: the priors timed, by the names ``benchmarks/cost_model.py`` counts them under -> timm architecture
PRIORS = {"dinov2_vit_s14": "vit_small_patch14_dinov2", "dinov2_vit_b14": "vit_base_patch14_dinov2"}
#: the same names at --smoke size: timm's own tiny test ViTs (the code path of a ViT prior, in seconds on a CPU)
SMOKE_PRIORS = {"dinov2_vit_s14": "test_vit", "dinov2_vit_b14": "test_vit2"}
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_guard.py", "tests/test_precompute_inputs.py"]
#: the fast suite's files whose code paths change with a device (autocast, compile, lookup, store, precompute)
DEVICE_TESTS = ["tests/test_gpu_ready.py", "tests/test_rela.py", "tests/test_guard.py", "tests/test_precompute.py",
                "tests/test_store.py", "tests/test_precompute_inputs.py"]
#: the folder's JPEG sizes at full size (ImageNet's common shapes); the smoke run's
FOLDER_SIZES = [(500, 375), (375, 500), (448, 448)]
SMOKE_FOLDER_SIZES = [(48, 36), (36, 48), (40, 40)]


@dataclass
class Size:
    image: int
    batch: int
    images: int  # synthetic images of the host store (the host-store step kinds, no_host_sync)
    steps: int  # timed steps per kind
    warmup: int
    student: str
    workers: int
    sync_steps: int
    compile_backend: str
    tests: list
    precompute_images: int  # images of each precompute case (the folder's and the array's)
    array_size: int  # the in-memory array's images, px
    folder_sizes: list
    precision: str
    bare_batches: int  # distinct batches the bare forward cycles through
    priors: dict = field(default_factory=lambda: dict(PRIORS))  # cost-model name -> timm architecture
    study: list = field(default_factory=list)  # extra demo arguments
    budget_s: float = 470.0  # a section is skipped when less than its estimate is left of this


SIZES = {
    "full": Size(image=224, batch=256, images=4096, steps=15, warmup=3, student="resnet50", workers=8, sync_steps=20,
                 compile_backend="inductor", tests=[CUDA_TESTS, DEVICE_TESTS], precompute_images=8192, array_size=256,
                 folder_sizes=FOLDER_SIZES, precision="bf16", bare_batches=16,
                 study=["--seeds", "0", "1", "2"]),
    "smoke": Size(image=32, batch=4, images=32, steps=2, warmup=1, student="resnet18", workers=0, sync_steps=2,
                  compile_backend="eager", tests=[["tests/test_cuda.py"]], precompute_images=32, array_size=36,
                  folder_sizes=SMOKE_FOLDER_SIZES, precision="fp32", bare_batches=2, priors=dict(SMOKE_PRIORS),
                  study=["--budget", "4", "--probes", "1", "--train-size", "64", "--test-size", "64", "--batch-size",
                         "16", "--probe-epochs", "1"], budget_s=1e9),
}
#: rough seconds each section needs at full size (skipped, and said so, when the rest of the budget is shorter)
ESTIMATE_S = {"tests": 100, "precompute": 110, "steps": 90, "budget": 60, "no_host_sync": 20, "study": 110,
              "compiled": 120}
#: the sections a run makes unless ``--sections`` names others
DEFAULT_SECTIONS = ["tests", "precompute", "steps", "budget"]
#: seconds kept free at the end of the budget (the plot, the summary, the work folder's removal)
MARGIN_S = 15


# ---------------------------------------------------------------------------------------------- helpers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device):
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _autocast(device: torch.device):
    """bf16 autocast on a GPU; on the CPU (--smoke) the same context switched off: CPUs without bf16 units emulate it,
    at ~100x the time of float32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


class SyntheticImages(torch.utils.data.Dataset):
    """``n`` uint8 ``[3, size, size]`` images, item i seeded by i (so a store precomputed on it matches it)."""

    def __init__(self, n: int, size: int):
        self.n, self.size = n, size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(int(i))
        return torch.randint(0, 256, (3, self.size, self.size), dtype=torch.uint8, generator=g)


def _student(name: str) -> nn.Module:
    import torchvision

    net = getattr(torchvision.models, name)()
    net.feature_dim = net.fc.in_features
    net.fc = nn.Identity()
    return net


def _byol(size: Size, device: torch.device):
    """BYOL on the student with the paper's head sizes (4096 hidden, 256 out): the recipe's method."""
    from accelerate_ssl.recipes import BYOL

    torch.manual_seed(0)
    backbone = _student(size.student)
    return BYOL(backbone, backbone.feature_dim, hidden_dim=4096, out_dim=256).to(device).to(
        memory_format=torch.channels_last)


def _views(size: Size, device: torch.device, n: int = 2):
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.rand(size.batch, 3, size.image, size.image, device=device, generator=g).contiguous(
        memory_format=torch.channels_last) for _ in range(n)]


def _loader(data, size: Size, device: torch.device, seed: int = 0):
    return torch.utils.data.DataLoader(data, batch_size=size.batch, shuffle=True, drop_last=True,
                                       num_workers=size.workers, pin_memory=device.type == "cuda",
                                       persistent_workers=size.workers > 0,
                                       generator=torch.Generator().manual_seed(seed))


def _loader_views(x: torch.Tensor, device: torch.device):
    """A loader's uint8 batch as two views on the device (the image and its mirror)."""
    v = x.to(device, non_blocking=True).float().div_(255).contiguous(memory_format=torch.channels_last)
    return v, v.flip(3)


def _cycle(loader):
    while True:
        yield from loader


# ---------------------------------------------------------------------------------------------- 1. tests
def run_tests(size: Size, out: Path) -> dict:
    """pytest over each file list (``-m cuda`` for the first, the fast suite's markers for the rest)."""
    results = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for i, files in enumerate(size.tests):
        marker = "cuda" if i == 0 else "not slow"
        log = out / f"pytest_{'cuda' if i == 0 else 'device_files'}.log"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, *files]
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        log.write_text(proc.stdout + proc.stderr)
        tail = [line for line in proc.stdout.strip().splitlines() if line.strip()]
        summary = tail[-1] if tail else ""
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
        results.append({"marker": marker, "files": files, "returncode": proc.returncode, "summary": summary,
                        "counts": counts, "seconds": time.perf_counter() - t, "log": log.name})
    return {"runs": results, "passed": all(r["returncode"] == 0 for r in results)}


# ---------------------------------------------------------------------------------------------- 2. precompute
def precompute_data(size: Size, work: Path) -> dict:
    """The two data sets the precompute is measured on: a folder of photo-like JPEGs (written by every CPU but one)
    and an in-memory uint8 array (a ``TensorDataset``, seeded)."""
    from accelerate_ssl.data import image_folder

    n = size.precompute_images
    g = torch.Generator().manual_seed(0)
    array = torch.utils.data.TensorDataset(
        torch.randint(0, 256, (n, 3, size.array_size, size.array_size), dtype=torch.uint8, generator=g),
        torch.arange(n))
    folder = photo_folder(work, n, size.folder_sizes, processes=max(1, (os.cpu_count() or 2) - 1))
    return {"folder": image_folder(folder), "array": array}


def precompute_section(size: Size, device: torch.device, work: Path) -> dict:
    """Bare forward, input pipeline and precompute (``benchmarks/precompute.py``'s :func:`measure`, one round) for
    each prior on each data set."""
    t = time.perf_counter()
    data = precompute_data(size, work)
    out = {"images": size.precompute_images, "batch": size.batch, "image_size": size.image,
           "precision": size.precision, "data_seconds": time.perf_counter() - t, "goal": 0.8,
           "data": {"folder": f"{size.precompute_images} photo-like JPEGs, {size.folder_sizes} px, quality 90",
                    "array": f"{size.precompute_images} uint8 images of {size.array_size} px in memory"},
           "priors": {}}
    for name, arch in size.priors.items():
        prior = random_weights_prior(name, arch, size.image, work)
        out["priors"][name] = {"arch": arch, "dim": int(prior.output_dim)}
        for kind, dataset in data.items():
            row = measure(prior, dataset, size.batch, device, size.precision, work / "stores", rounds=1,
                          bare_batches=size.bare_batches)
            out["priors"][name][kind] = row
            print(f"  precompute {name} {kind}: {row['precompute_img_s']:.0f} img/s, bare forward "
                  f"{row['bare_forward_img_s']:.0f}, pipeline {row['input_pipeline_img_s']:.0f}, ratio "
                  f"{row['ratio']:.3f}", flush=True)
        prior.cpu()
        del prior
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def host_store(size: Size, work: Path) -> Path:
    """The ViT-S/14-sized prior's store of :class:`SyntheticImages` (the host-store step kinds and the no-sync
    check read it through the prefetcher), precomputed once."""
    from accelerate_ssl import precompute_targets

    path = work / "store-dinov2_vit_s14"
    if not (path / "metadata.json").is_file():
        name = "dinov2_vit_s14"
        prior = random_weights_prior(name, size.priors[name], size.image, work)
        precompute_targets(prior, SyntheticImages(size.images, size.image), path, batch_size=size.batch,
                           precision=size.precision, progress=False)
    return path


# ---------------------------------------------------------------------------------------------- 3. steps
class OnlineTeacherStep(nn.Module):
    """Online distillation's step: the frozen prior embeds each view every step (no grad), the student's features
    of each view go through a linear head and the cosine loss (ReLA v2 Eq. 9) pulls them to it; no SSL branch
    (lightly-train's ``distillation`` shape, the cost model's ``online_teacher`` on two views)."""

    def __init__(self, backbone: nn.Module, teacher: nn.Module, teacher_dim: int):
        super().__init__()
        self.backbone, self.teacher = backbone, teacher.eval().requires_grad_(False)
        self.head = nn.Linear(backbone.feature_dim, teacher_dim)

    def loss(self, v0, v1=None):
        """Both views (``v1`` given), or one view: the teacher runs on each view the student sees."""
        from accelerate_ssl.rela import rela_loss

        views = [v0] if v1 is None else [v0, v1]
        with torch.no_grad():
            targets = [self.teacher(v) for v in views]
        return sum(rela_loss(self.head(self.backbone(v)), t.float()) for v, t in zip(views, targets)) / len(views)


def _time_steps(step, size: Size, device: torch.device) -> dict:
    times = []
    _reset_peak(device)
    for i in range(size.warmup + size.steps):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        if i >= size.warmup:
            times.append(time.perf_counter() - t)
    return {"step_s": statistics.median(times), "step_s_min": min(times), "step_s_max": max(times),
            "steps_timed": len(times), "peak_bytes": _peak(device)}


def _optimizer(*modules_or_params):
    params = []
    for m in modules_or_params:
        params += [p for p in (m.parameters() if isinstance(m, nn.Module) else m) if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-4, capturable=any(p.is_cuda for p in params))


#: step kinds per prior, like for like: ReLA at lambda = 1 on the views an online teacher would embed
LIKE_FOR_LIKE = {"one_view": ("rela_lambda1_one_view", "online_teacher_one_view"),
                 "two_views": ("rela_lambda1", "online_teacher")}
#: the kinds that read the host store through a DataLoader (``--steps`` adds them)
HOST_STORE_KINDS = ["plain_loader", "rela_mixed_host_prefetch"]


def step_kind(kind: str, size: Size, device: torch.device, work: Path, compiled: bool = False) -> dict:
    """Build the kind's networks, time its steps, free them. Kinds: plain, rela_mixed; per prior ``<p>``:
    ``rela_lambda1:<p>`` / ``rela_lambda1_one_view:<p>`` (ReLA alone on two views / one view, targets of the
    prior's width on the device), ``online_teacher:<p>`` / ``online_teacher_one_view:<p>`` (the prior run on both
    views / one view every step); plain_loader, rela_mixed_host_prefetch (the host store of :func:`host_store`
    through the prefetcher, against plain BYOL on the same loader)."""
    from accelerate_ssl import ReLA
    from accelerate_ssl.schedules import Constant

    rela, loader, extra = None, None, {}
    n_rows = size.images
    base, _, name = kind.partition(":")
    one_view = base.endswith("_one_view")
    if base.startswith("online_teacher"):
        prior = random_weights_prior(name, size.priors[name], size.image, work)
        torch.manual_seed(0)
        model = OnlineTeacherStep(_student(size.student), prior.model, prior.output_dim).to(device).to(
            memory_format=torch.channels_last)
        forward = model.loss
        opt = _optimizer(model)
    else:
        model = _byol(size, device)
        params = [model]
        if base in ("rela_mixed", "rela_lambda1", "rela_lambda1_one_view"):
            lam = 0.5 if base == "rela_mixed" else 1.0
            width = random_weights_prior(name, size.priors[name], size.image, work).output_dim if name else 384
            targets = torch.randn(n_rows, width, generator=torch.Generator().manual_seed(0))
            rela = ReLA(targets, model.backbone, feature_dim=model.backbone.feature_dim, schedule=Constant(lam),
                        targets_on_device=True, sync_every=50)
            params.append(rela.parameters())
        elif base in HOST_STORE_KINDS:
            data = SyntheticImages(size.images, size.image)
            loader = _loader(data, size, device)
            if base == "rela_mixed_host_prefetch":
                rela = ReLA(str(host_store(size, work)), model.backbone, dataset=data, dataloader=loader,
                            feature_dim=model.backbone.feature_dim, schedule=Constant(0.5), sync_every=50,
                            prefetch=True)
                params.append(rela.parameters())
            batches = _cycle(loader)
        if compiled:  # a fresh compile per kind: dynamo must not reuse the code it built for the previous model
            torch._dynamo.reset()
        forward = torch.compile(model.loss, backend=size.compile_backend) if compiled else model.loss
        opt = _optimizer(*params)
    g = torch.Generator().manual_seed(1)
    views = _views(size, device)
    backbone = model.backbone

    def step():
        if loader is not None:
            x = next(batches)
            v0, v1 = _loader_views(x, device)
            index = None
        else:
            v0, v1 = views
            index = torch.randint(0, n_rows, (size.batch,), generator=g)
        with _autocast(device):
            if base in ("rela_lambda1", "rela_lambda1_one_view"):
                backbone(v0)
                if not one_view:
                    backbone(v1)
                loss = rela.wrap(lambda: None, index=index)
            elif base.startswith("online_teacher"):
                loss = forward(v0) if one_view else forward(v0, v1)
            else:
                loss = forward(v0, v1)
                if rela is not None:
                    loss = rela.wrap(loss) if index is None else rela.wrap(loss, index=index)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    t = time.perf_counter()
    if compiled:  # the first steps compile: timed apart
        for _ in range(2):
            step()
        _sync(device)
        extra["compile_and_first_steps_s"] = time.perf_counter() - t
    out = {**_time_steps(step, size, device), **extra}
    if rela is not None:
        rela.close()
    del model, opt, rela
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def cost_model_ratios(size: Size) -> dict:
    """The FLOP ratios (each step / plain BYOL, precompute per image / plain step per image) that
    ``benchmarks/cost_model.py`` counted for this student and these priors (batch 256, 224 px), under the step kinds'
    names (the cost model counts the online teacher on two views only)."""
    path = ROOT / "benchmarks" / "results" / "cost_model.json"
    model = json.loads(path.read_text())["model"]
    out = {}
    for pair in model["pairs"]:
        if pair["student"] != size.student or pair["prior"] not in PRIORS:
            continue
        steps, prior = pair["steps"], pair["prior"]
        plain = steps["plain"]["flops"]
        out["rela_mixed"] = steps["rela_mixed"]["flops"] / plain
        for kind in ("rela_lambda1", "rela_lambda1_one_view", "online_teacher"):
            out[f"{kind}:{prior}"] = steps[kind]["flops"] / plain
        out[f"precompute_image:{prior}"] = (model["priors"][prior]["precompute_flops_per_image"]
                                            / (plain / model_batch(path)))
    return out


def model_batch(path: Path) -> int:
    return int(json.loads(path.read_text())["batch"])


def steps_section(size: Size, device: torch.device, work: Path, extra_kinds: list = ()) -> dict:
    """Plain BYOL, ReLA mixed, then per prior ReLA beside the online teacher on one view and on two views
    (:data:`LIKE_FOR_LIKE`), ``extra_kinds``, and plain BYOL again."""
    kinds = ["plain", "rela_mixed", *[f"{kind}:{p}" for p in size.priors for pair in LIKE_FOR_LIKE.values()
                                      for kind in pair], *extra_kinds, "plain"]
    measured: dict = {}
    for i, kind in enumerate(kinds):
        key = "plain_again" if (kind == "plain" and i > 0) else kind
        try:
            measured[key] = step_kind(kind, size, device, work)
        except Exception as err:  # one kind failing must not cost the others
            measured[key] = {"error": f"{type(err).__name__}: {err}"[:800], "traceback": traceback.format_exc()[-2000:]}
        print(f"  step {key}: {measured[key].get('step_s', measured[key].get('error'))}", flush=True)
    plain = measured.get("plain", {}).get("step_s")
    out = {"batch_per_view": size.batch, "image_size": size.image, "student": size.student,
           "autocast": "bf16" if device.type == "cuda" else None, "channels_last": True, "kinds": measured}

    def step_s(kind):
        return measured.get(kind, {}).get("step_s")

    out["rela_over_online"] = {p: {views: step_s(f"{rela}:{p}") / step_s(f"{online}:{p}")
                                   for views, (rela, online) in LIKE_FOR_LIKE.items()
                                   if step_s(f"{rela}:{p}") and step_s(f"{online}:{p}")} for p in size.priors}
    if plain:
        out["time_ratio_to_plain"] = {k: v["step_s"] / plain for k, v in measured.items() if "step_s" in v}
        if measured["plain"].get("peak_bytes"):
            out["memory_ratio_to_plain"] = {k: v["peak_bytes"] / measured["plain"]["peak_bytes"]
                                            for k, v in measured.items() if v.get("peak_bytes")}
        if step_s("plain_again"):
            out["plain_repeat_spread"] = step_s("plain_again") / plain - 1
        if step_s("plain_loader") and step_s("rela_mixed_host_prefetch"):
            out["host_prefetch_over_plain_loader"] = step_s("rela_mixed_host_prefetch") / step_s("plain_loader")
    return out


def against_cost_model(size: Size, result: dict) -> dict:
    """Measured time ratios next to the counted FLOP ratios, with the error (measured / counted - 1)."""
    counted = cost_model_ratios(SIZES["full"]) if size is SIZES["smoke"] else cost_model_ratios(size)
    measured = dict(result.get("steps", {}).get("time_ratio_to_plain", {}))
    plain = result.get("steps", {}).get("kinds", {}).get("plain", {}).get("step_s")
    for name, p in result.get("precompute", {}).get("priors", {}).items():
        if plain and "precompute_img_s" in p.get("array", {}):  # the in-memory array: no decode in its time
            measured[f"precompute_image:{name}"] = (1 / p["array"]["precompute_img_s"]) / (plain / size.batch)
    rows = {k: {"counted_flops": c, "measured_time": measured.get(k),
                "error": None if measured.get(k) is None else measured[k] / c - 1} for k, c in counted.items()}
    errors = [abs(r["error"]) for r in rows.values() if r["error"] is not None]
    return {"rows": rows, "mean_abs_error": statistics.fmean(errors) if errors else None,
            "note": "counted at 224 px, batch 256, ResNet-50; a smoke run's sizes differ, so its errors mean nothing"
            if size is SIZES["smoke"] else "same sizes as counted"}


# ---------------------------------------------------------------------------------------------- 4. budget
def run_script(script, argv: list, out: Path, seconds: float) -> dict:
    """Another benchmark script as a section of this run: ``python <script> *argv`` (a path, or a name under
    ``benchmarks/``) in a child process running this checkout's code with the GPU visible, stopped after ``seconds``;
    its output goes to ``out/<script's stem>.log`` and the JSON it writes at the ``--out`` of ``argv`` (when ``argv``
    names one) is read back. Returns the command, exit code, seconds, the log's name and that JSON."""
    script = Path(script) if Path(script).is_absolute() else ROOT / "benchmarks" / script
    cmd = [sys.executable, str(script), *map(str, argv)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = out / f"{script.stem}.log"
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1.0, seconds))
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        code = None
        text = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (err.stdout, err.stderr))
        text += f"\n[gpu.py] stopped after {seconds:.0f} s\n"
    from accelerate_ssl.atomic import atomic_write_text

    atomic_write_text(log, text)
    result = {"command": " ".join(cmd), "returncode": code, "seconds": time.perf_counter() - t, "log": log.name}
    written = Path(argv[argv.index("--out") + 1]) if "--out" in argv else None
    if written is not None and written.is_file():
        result["json"] = json.loads(written.read_text())
    if code != 0:
        result["error"] = f"{script.name} exited with {code} (see {log.name}): {text.strip()[-600:]}"
    return result


#: THE BUDGET STUDY (item 4 of the GPU round), added by the lead: ``benchmarks/budget.py``'s arguments at each size
#: (the full plain run and the 10 / 20 / 50 % budgets with the handover, as many seeds as fit, on the benchmark the
#: CPU study uses, longer). :func:`budget_study` appends ``--out DIR/budget.json`` and gives it the time left.
BUDGET_SCRIPT = "budget.py"
#: the budget study on the GPU: the CPU study's ViT benchmark, its full run 4x longer (4000 steps: on the CPU, plain
#: SSL still gained 5.7 points from 1000 to 2000 steps), as many seeds as the workers finish in the time given;
#: smoke: a few steps of the ConvNet on 1200 images (100 labels per class for the few-label probe), on the CPU,
#: to rehearse the section
BUDGET_ARGV: dict = {
    "full": {"workers": 4, "timing_steps": 30,
             "argv": ["--student", "vit", "--full", "4000", "--tiers", "1", "--seeds", "0", "1", "2", "3",
                      "--device", "cuda"]},
    "smoke": {"workers": 2, "timing_steps": 2,
              "argv": ["--student", "convnet", "--full", "8", "--tiers", "1", "--seeds", "0", "--arms", "plain",
                       "other:default:callable", "--lengths", "0.15", "0.3", "1.0", "--train-size", "1200",
                       "--test-size", "300"]},
}


def budget_study(size: Size, out: Path, seconds: float) -> dict:
    """The budget study at this size (:data:`BUDGET_ARGV`) in ``seconds``: its workers (``--worker I/N``) side by side
    on the one device (the ViT student leaves most of a GPU idle), then :func:`run_script` gathers every finished run
    into ``out/budget.json`` (the runs cached under ``out/budget-runs``, so a rerun resumes)."""
    plan = BUDGET_ARGV["smoke" if size is SIZES["smoke"] else "full"]
    seconds = min(float(seconds), 3600.0)
    argv = [*plan["argv"], "--runs", str(out / "budget-runs"), "--cache", str(out / "budget-cache"),
            "--out", str(out / "budget.json")]
    script = ROOT / "benchmarks" / BUDGET_SCRIPT
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t = time.perf_counter()
    timing = run_script(BUDGET_SCRIPT, [*argv, "--timing", "--timing-steps", str(plan["timing_steps"])], out,
                        max(10.0, seconds / 4))  # the cost of each kind of step, side by side, on this device
    if timing.get("returncode") != 0:
        return {**timing, "error": timing.get("error") or "budget.py --timing failed"}
    logs = [open(out / f"budget-worker{i}.log", "w") for i in range(plan["workers"])]
    try:
        workers = [subprocess.Popen([sys.executable, str(script), *argv, "--worker", f"{i}/{plan['workers']}"],
                                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT) for i, log in enumerate(logs)]
        for w in workers:
            try:
                w.wait(timeout=max(1.0, seconds - 30 - (time.perf_counter() - t)))
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
    finally:
        for log in logs:
            log.close()
    result = run_script(BUDGET_SCRIPT, [*argv, "--gather"], out,
                        max(10.0, seconds - (time.perf_counter() - t)))
    codes = [w.returncode for w in workers]
    result["workers"] = {"count": plan["workers"], "returncodes": codes}
    failed = [i for i, c in enumerate(codes) if c not in (0, -9)]  # (-9: stopped when its time was up)
    if failed:
        tail = (out / f"budget-worker{failed[0]}.log").read_text()[-600:]
        result["error"] = f"budget worker(s) {failed} exited with {[codes[i] for i in failed]}: {tail}"
    if result.get("returncode") == 0 and "json" not in result:  # some runs were left: the gathering says how many
        result["partial"] = result.pop("error", None) or "not every run finished in the time given"
    return result


# ---------------------------------------------------------------------------------------------- no host sync (asked for)
def no_sync_steps(size: Size, device: torch.device, work: Path) -> dict:
    """``size.sync_steps`` ReLA steps under sync debug mode "error" after warm-up, for targets on the device (index
    on the host) and for the host store read through the prefetcher (a tracked loader)."""
    from accelerate_ssl import ReLA

    if device.type != "cuda":
        return {"skipped": "no CUDA device"}
    out = {}
    for path in ("targets_on_device", "host_store_prefetch"):
        model = _byol(size, device)
        g = torch.Generator().manual_seed(0)
        if path == "targets_on_device":
            rela = ReLA(torch.randn(size.images, 384), model.backbone, feature_dim=model.backbone.feature_dim,
                        targets_on_device=True, sync_every=1000)
            views = _views(size, device)
            batches = None
        else:
            data = SyntheticImages(size.images, size.image)
            loader = _loader(data, size, device, seed=1)
            rela = ReLA(str(host_store(size, work)), model.backbone, dataset=data, dataloader=loader,
                        feature_dim=model.backbone.feature_dim, sync_every=1000, prefetch=True)
            batches = _cycle(loader)
        opt = _optimizer(model, rela.parameters())

        def step():
            if batches is None:
                v0, v1 = views
                idx = torch.randint(0, size.images, (size.batch,), generator=g)
            else:
                v0, v1 = _loader_views(next(batches), device)
                idx = None
            with _autocast(device):
                loss = model.loss(v0, v1)
                loss = rela.wrap(loss) if idx is None else rela.wrap(loss, index=idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        for _ in range(10):  # warm-up: the head fit and the index checks read the host once
            step()
        torch.cuda.synchronize()
        error = None
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(size.sync_steps):
                step()
        except RuntimeError as err:
            error = f"{err}"[:800] + "\n" + traceback.format_exc()[-1500:]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        out[path] = {"steps": size.sync_steps, "passed": error is None, "error": error}
        rela.close()
        del model, opt, rela
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------- study (asked for)
def study(size: Size, device: torch.device, work: Path, out: Path) -> dict:
    """The demo's comparison on this device: ``accelerate-ssl demo --device <device>`` with its JSON."""
    import shutil

    from accelerate_ssl import demo

    demo_out = work / "demo"
    argv = ["--device", str(device), "--out", str(demo_out), "--json", "--threads", str(min(8, os.cpu_count() or 1)),
            *size.study]
    t = time.perf_counter()
    demo.main(argv)
    seconds = time.perf_counter() - t
    result = json.loads((demo_out / "demo.json").read_text())
    shutil.copy(demo_out / "demo.png", out / "demo_gpu.png")
    shutil.copy(demo_out / "demo.json", out / "demo_gpu.json")
    per_seed = result["per_seed"] or [{"seed": result["settings"]["seeds"][0], "wall": result["wall"]}]

    def brief(r):  # on the wall clock: what a GPU user pays
        w = r["wall"]
        return {"seed": r.get("seed"), "rela_top1": w["rela_top1"], "plain_top1": w["plain_top1"],
                "plain_top1_at_equal_compute": w["plain_top1_at_equal_compute"], "gain": w["gain"],
                "rela_seconds": w["rela_seconds"], "plain_seconds": w["plain_seconds"],
                "compute_fraction": w["compute_fraction"], "compute_to_plain": w["compute_to_plain"]}

    return {"argv": argv, "seconds": seconds, "precompute_seconds": result["targets"]["precompute"]["seconds"],
            "schedule": result["schedule"], "default": result["default"],
            "machine": result["machine"], "mean": brief(result), "per_seed": [brief(r) for r in per_seed],
            "json": "demo_gpu.json", "png": "demo_gpu.png"}


# ---------------------------------------------------------------------------------------------- compiled (asked for)
def compiled_section(size: Size, device: torch.device, work: Path) -> dict:
    out = {"backend": size.compile_backend, "kinds": {}}
    for kind in ("plain", "rela_mixed"):
        try:
            out["kinds"][kind] = step_kind(kind, size, device, work, compiled=True)
        except Exception as err:
            out["kinds"][kind] = {"error": f"{type(err).__name__}: {err}"[:800],
                                  "traceback": traceback.format_exc()[-2000:]}
    k = out["kinds"]
    if "step_s" in k.get("plain", {}) and "step_s" in k.get("rela_mixed", {}):
        out["time_ratio"] = k["rela_mixed"]["step_s"] / k["plain"]["step_s"]
        if k["plain"].get("peak_bytes"):
            out["memory_ratio"] = k["rela_mixed"]["peak_bytes"] / k["plain"]["peak_bytes"]
    return out


# ---------------------------------------------------------------------------------------------- main
def _versions(device: torch.device) -> dict:
    """The code commit, device, driver, torch, CUDA, cuDNN (``accelerate_ssl.results``) and the GPU's memory."""
    from accelerate_ssl import __version__
    from accelerate_ssl.results import code_commit, machine

    cuda = device.type == "cuda"
    return {"library_version": __version__, **code_commit(ROOT), **machine(str(device) if cuda else "cpu"),
            "gpu_memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None}


def write_png(result: dict, path: Path) -> None:
    from accelerate_ssl.optional import require

    require("matplotlib", "the GPU benchmark's plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from accelerate_ssl.results import save_figure

    kinds = result.get("steps", {}).get("kinds", {})
    names = [k for k, v in kinds.items() if "step_s" in v]
    fig, (axp, ax, axm) = plt.subplots(1, 3, figsize=(16, 4.6))
    cases = [(f"{p}\n{d}", r) for p, v in result.get("precompute", {}).get("priors", {}).items()
             for d, r in v.items() if isinstance(r, dict) and "ratio" in r]
    for j, (key, label) in enumerate([("bare_forward_img_s", "bare forward"), ("input_pipeline_img_s", "input pipeline"),
                                      ("precompute_img_s", "precompute")]):
        axp.bar([i + (j - 1) * 0.27 for i in range(len(cases))], [r[key] for _, r in cases], 0.27, label=label)
    for i, (_, r) in enumerate(cases):
        axp.text(i + 0.27, r["precompute_img_s"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=7)
    axp.set_xticks(range(len(cases)), [c for c, _ in cases], fontsize=7)
    axp.set_ylabel("images / s")
    axp.legend(fontsize=7)
    ax.barh(names, [kinds[k]["step_s"] * 1000 for k in names], color="C0")
    ax.set_xlabel("median step (ms)")
    ax.invert_yaxis()
    rows = result.get("cost_model", {}).get("rows", {})
    pts = [(r["counted_flops"], r["measured_time"], k) for k, r in rows.items() if r["measured_time"] is not None]
    if pts:
        axm.scatter([p[0] for p in pts], [p[1] for p in pts])
        for x, y, k in pts:
            axm.annotate(k.replace("online_teacher", "online").replace("precompute_image:", "precompute ")
                         .replace("rela_lambda1", "rela"), (x, y), fontsize=7)
        hi = max(max(p[0] for p in pts), max(p[1] for p in pts)) * 1.1
        axm.plot([0, hi], [0, hi], "k--", lw=0.8)
    axm.set_xlabel("counted FLOP ratio to plain BYOL (cost model)")
    axm.set_ylabel("measured time ratio")
    fig.suptitle(f"{result['device']}, torch {result['torch']}, CUDA {result['cuda']}, commit "
                 f"{str(result.get('commit'))[:10]}: batch {result.get('steps', {}).get('batch_per_view')} per view, "
                 f"{result.get('steps', {}).get('image_size')} px", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                   help="folder for gpu.json, gpu.png, the pytest logs and what the budget study writes")
    p.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "cache" / "gpu",
                   help="scratch folder (weights files, the JPEG folder, stores, the demo's targets); emptied first")
    p.add_argument("--smoke", action="store_true", help="toy sizes on whatever device there is (CPU included)")
    p.add_argument("--sections", nargs="+", choices=list(ESTIMATE_S), default=DEFAULT_SECTIONS,
                   help=f"run these sections, in this order (default: {' '.join(DEFAULT_SECTIONS)})")
    p.add_argument("--steps", nargs="*", choices=HOST_STORE_KINDS, default=[],
                   help="step kinds to add to the steps section (the host store read through the prefetcher)")
    args = p.parse_args(argv)
    size = SIZES["smoke" if args.smoke else "full"]
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA device (torch.cuda.is_available() is False); --smoke runs the same code "
              "on the CPU at toy sizes.", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # a rehearsal: one thread stays fast on a shared or busy machine
    import shutil

    from accelerate_ssl.results import write_results

    t_start = time.perf_counter()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / ("gpu_smoke.json" if args.smoke else "gpu.json")
    result = {"command": " ".join([sys.executable, *(sys.argv if argv is None else ["benchmarks/gpu.py", *argv])]),
              "size": "smoke" if args.smoke else "full", "sections": args.sections, **_versions(device),
              "sections_seconds": {}, "skipped": {}}
    runners = {"tests": lambda left: run_tests(size, args.out),
               "precompute": lambda left: precompute_section(size, device, args.work),
               "steps": lambda left: steps_section(size, device, args.work, args.steps),
               "budget": lambda left: budget_study(size, args.out, left - MARGIN_S),
               "no_host_sync": lambda left: no_sync_steps(size, device, args.work),
               "study": lambda left: study(size, device, args.work, args.out),
               "compiled": lambda left: compiled_section(size, device, args.work)}
    for name in args.sections:
        left = size.budget_s - (time.perf_counter() - t_start)
        if left < ESTIMATE_S[name]:
            result["skipped"][name] = f"{left:.0f} s left of the {size.budget_s:.0f} s budget, ~{ESTIMATE_S[name]} s needed"
            print(f"[gpu.py] skip {name}: {result['skipped'][name]}", flush=True)
            continue
        print(f"[gpu.py] {name} ...", flush=True)
        t = time.perf_counter()
        try:
            result[name] = runners[name](left)
        except Exception as err:
            result[name] = {"error": f"{type(err).__name__}: {err}"[:800], "traceback": traceback.format_exc()[-3000:]}
        result["sections_seconds"][name] = time.perf_counter() - t
        if name in ("precompute", "steps"):
            with contextlib.suppress(Exception):
                result["cost_model"] = against_cost_model(size, result)
        result["wall_seconds"] = time.perf_counter() - t_start
        write_results(json_path, result, ROOT)
        print(f"[gpu.py] {name} done in {result['sections_seconds'][name]:.0f} s", flush=True)
    with contextlib.suppress(Exception):
        write_png(result, json_path.with_suffix(".png"))
    shutil.rmtree(args.work, ignore_errors=True)
    print(summary(result))
    return 0


def summary(result: dict) -> str:
    lines = [f"{result['device']}, CUDA {result['cuda']}, cuDNN {result['cudnn']}, torch {result['torch']}, "
             f"{result.get('wall_seconds', 0):.0f} s"]
    for r in result.get("tests", {}).get("runs", []):
        lines.append(f"pytest -m '{r['marker']}' {len(r['files'])} files: {r['summary']}")
    for name, pr in result.get("precompute", {}).get("priors", {}).items():
        for data, r in pr.items():
            if isinstance(r, dict) and "ratio" in r:
                lines.append(f"precompute {name} {data}: {r['precompute_img_s']:.0f} img/s, bare forward "
                             f"{r['bare_forward_img_s']:.0f} img/s, ratio {r['ratio']:.3f}; input pipeline alone "
                             f"{r['input_pipeline_img_s']:.0f} img/s" + (f"; limit: {r['limit']}" if "limit" in r else ""))
    for prior, views in result.get("steps", {}).get("rela_over_online", {}).items():
        lines.append(f"ReLA / online teacher, {prior}: " + ", ".join(f"{k} {v:.3f}" for k, v in views.items()))
    steps = result.get("steps", {})
    for k, v in steps.get("kinds", {}).items():
        if "step_s" in v:
            mem = f", peak {v['peak_bytes'] / 2**30:.1f} GiB" if v.get("peak_bytes") else ""
            lines.append(f"step {k}: {v['step_s'] * 1000:.1f} ms ({steps['time_ratio_to_plain'][k]:.3f}x plain){mem}")
        else:
            lines.append(f"step {k}: {v.get('error')}")
    for k, r in result.get("cost_model", {}).get("rows", {}).items():
        if r["measured_time"] is not None:
            lines.append(f"cost model {k}: counted {r['counted_flops']:.3f}, measured {r['measured_time']:.3f}, "
                         f"error {r['error']:+.1%}")
    for k, v in result.get("no_host_sync", {}).items():
        lines.append(f"no host sync, {k}: {v if isinstance(v, str) else v.get('passed', v)}")
    st = result.get("study", {})
    if "mean" in st:
        m = st["mean"]
        reach = "not reached" if m["compute_to_plain"] is None else f"{m['compute_to_plain']:.2f}"
        lines.append(f"study ({st['seconds']:.0f} s, the demo's recipe, schedule {st['schedule']}): ReLA "
                     f"{m['rela_top1']:.2f} % in {m['rela_seconds']:.1f} s (precompute {st['precompute_seconds']:.1f} s "
                     f"included), plain {m['plain_top1']:.2f} % in {m['plain_seconds']:.1f} s; plain's accuracy reached "
                     f"at {reach} of its wall-clock")
    comp = result.get("compiled", {})
    for k, v in comp.get("kinds", {}).items():
        lines.append(f"compiled {k}: " + (f"{v['step_s'] * 1000:.1f} ms (compile + 2 steps "
                                          f"{v['compile_and_first_steps_s']:.0f} s)" if "step_s" in v else str(v.get("error"))))
    budget = result.get("budget", {})
    if budget:
        lines.append("budget: " + (budget["skipped"] if "skipped" in budget else
                                   f"exit {budget.get('returncode')} in {budget.get('seconds', 0):.0f} s"))
    for name in ("precompute", "steps", "budget", "no_host_sync", "study", "compiled", "tests"):
        if isinstance(result.get(name), dict) and "error" in result[name]:
            lines.append(f"{name} FAILED: {result[name]['error']}")
    if result.get("skipped"):
        lines.append(f"skipped: {result['skipped']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
