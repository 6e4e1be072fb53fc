"""The GPU benchmark: what only a CUDA device can show, in one command that ends within 8 minutes.

    python benchmarks/gpu.py --out DIR            # on one CUDA GPU (about 7 min on an H100 / H200)
    python benchmarks/gpu.py --smoke --out DIR    # the same code path on the CPU at toy sizes (a test runs it)

Sections, in this order; ``DIR/gpu.json`` is rewritten after each one, so a run cut short keeps what it measured
(a section that raises records its error and the next one runs):

1. **tests**: ``pytest -m cuda`` over the CUDA tests, then the device-relevant files of the fast suite, with the GPU
   visible (logs in ``DIR/pytest_*.log``).
2. **precompute**: ``precompute_targets`` throughput (bf16, batch 256, 224 px, 8 loader workers, synthetic uint8
   images) for a DINOv2 ViT-S/14- and a ViT-B/14-sized prior (timm's architectures with random weights loaded as a
   user's local weights file: timing does not depend on the values), against the same network's bare forward over
   batches already on the device (goal >= 0.9x).
3. **steps** at the sizes users train (ResNet-50 student, batch 256 per view, 224 px, bf16 autocast, channels_last,
   AdamW): plain BYOL (the recipe's, 4096 / 256 heads), ReLA mixed (0 < lambda < 1, targets on the device), ReLA
   at lambda = 1 on two views and on one view, ReLA mixed from the precomputed store on the host with the
   prefetcher (tracked loader, 8 workers, pinned memory; against plain BYOL on the same loader), and online
   distillation with each prior run on both views every step. Median step time, peak memory; each ratio to plain
   BYOL set against the FLOP ratio ``benchmarks/cost_model.py`` counted for the same step (error = measured /
   counted - 1). Plain BYOL is timed again at the end: the difference is the timing noise.
4. **no host synchronisation**: 20 ReLA steps after warm-up under ``torch.cuda.set_sync_debug_mode("error")``
   (any synchronising call raises), targets on the device, and from the host store through the prefetcher.
5. **study**: ``accelerate-ssl demo --device cuda`` (the demo's recipe, Fashion-MNIST, 3 seeds): absolute
   wall-clock of both runs, the precompute, and the speed-up.
6. **compiled**: plain BYOL and ReLA mixed under ``torch.compile`` (inductor; its compile time reported apart).

``--smoke``: 32 px, batch 4, a ResNet-18 student, timm's tiny test ViTs as the priors, 2 timed steps, the demo at 4 steps on 64
images, ``torch.compile``
with the ``eager`` backend (dynamo traces the ReLA hook; no C++ compiler needed), the tests section on
``tests/test_cuda.py`` only (skipped without a device). Without CUDA the sync and memory figures are ``None``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
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

#: the priors timed, by the names ``benchmarks/cost_model.py`` counts them under -> timm architecture
PRIORS = {"dinov2_vit_s14": "vit_small_patch14_dinov2", "dinov2_vit_b14": "vit_base_patch14_dinov2"}
#: the same names at --smoke size: timm's own tiny test ViTs (the code path of a ViT prior, in seconds on a CPU)
SMOKE_PRIORS = {"dinov2_vit_s14": "test_vit", "dinov2_vit_b14": "test_vit2"}
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_guard.py"]
#: the fast suite's files whose code paths change with a device (autocast, compile, lookup, store, precompute)
DEVICE_TESTS = ["tests/test_gpu_ready.py", "tests/test_rela.py", "tests/test_guard.py", "tests/test_precompute.py",
                "tests/test_store.py"]


@dataclass
class Size:
    image: int
    batch: int
    images: int  # synthetic images precomputed (and rows of the host store)
    steps: int  # timed steps per kind
    warmup: int
    student: str
    workers: int
    sync_steps: int
    compile_backend: str
    tests: list
    priors: dict = field(default_factory=lambda: dict(PRIORS))  # cost-model name -> timm architecture
    study: list = field(default_factory=list)  # extra demo arguments
    budget_s: float = 400.0  # a section is skipped when less than its estimate is left of this


SIZES = {
    "full": Size(image=224, batch=256, images=4096, steps=15, warmup=3, student="resnet50", workers=8, sync_steps=20,
                 compile_backend="inductor", tests=[CUDA_TESTS, DEVICE_TESTS], study=["--seeds", "0", "1", "2"]),
    "smoke": Size(image=32, batch=4, images=32, steps=2, warmup=1, student="resnet18", workers=0, sync_steps=2,
                  compile_backend="eager", tests=[["tests/test_cuda.py"]], priors=dict(SMOKE_PRIORS),
                  study=["--budget", "4", "--probes", "1", "--train-size", "64", "--test-size", "64", "--batch-size",
                         "16", "--probe-epochs", "1"], budget_s=1e9),
}
#: rough seconds each section needs at full size (skipped, and said so, when the rest of the budget is shorter)
ESTIMATE_S = {"tests": 100, "precompute": 40, "steps": 60, "no_host_sync": 20, "study": 110, "compiled": 120}


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


def random_weights_prior(name: str, arch: str, size: int, work: Path):
    """``create_prior("timm:<arch>", weights=<file>, size=size)`` with random weights saved as the user's file: the
    user's path for local weights, with nothing downloaded."""
    import timm
    from safetensors.torch import save_file

    from accelerate_ssl import create_prior

    path = work / f"{name}-{size}.safetensors"
    if not path.is_file():
        torch.manual_seed(0)
        net = timm.create_model(arch, pretrained=False, num_classes=0, img_size=size)
        save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return create_prior(f"timm:{arch}", weights=str(path), size=size)


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
def precompute_vs_bare_forward(size: Size, device: torch.device, work: Path) -> dict:
    from accelerate_ssl import precompute_targets

    data = SyntheticImages(size.images, size.image)
    out = {"images": size.images, "batch": size.batch, "image_size": size.image, "precision": "bf16",
           "num_workers": size.workers, "goal": 0.9, "priors": {}}
    for name, arch in size.priors.items():
        prior = random_weights_prior(name, arch, size.image, work)
        _sync(device)
        t = time.perf_counter()
        store = precompute_targets(prior, data, work / f"store-{name}", batch_size=size.batch, precision="bf16",
                                   num_workers=size.workers, progress=False)
        _sync(device)
        precompute_s = time.perf_counter() - t
        net = prior.model.to(device).eval()
        x = torch.rand(size.batch, 3, size.image, size.image, device=device)
        with torch.inference_mode(), _autocast(device):
            net(x)
            _sync(device)
            t = time.perf_counter()
            for _ in range(size.images // size.batch):
                net(x)
            _sync(device)
        bare = size.images // size.batch * size.batch / (time.perf_counter() - t)
        done = size.images / precompute_s
        out["priors"][name] = {"arch": arch, "dim": store.dim, "precompute_seconds": precompute_s,
                               "precompute_img_per_s": done, "bare_forward_img_per_s": bare, "ratio": done / bare,
                               "input_pipeline_img_per_s": input_pipeline_rate(prior, data, size, device)}
        net.cpu()
        del net, prior
    return out


def input_pipeline_rate(prior, data, size: Size, device: torch.device) -> float:
    """Images/s of precompute's own input pipeline alone (the same DataLoader: each sample's identity digest and the
    prior's preprocessing in the workers, pinned batches copied to the device), with no forward: the ceiling the
    data side puts on precompute."""
    from accelerate_ssl.targets.write import input_batches

    loader = input_batches(data, prior.preprocess, size.batch, size.workers, pin_memory=device.type == "cuda")
    t = time.perf_counter()
    n = 0
    for x, _ in loader:
        x.to(device, non_blocking=True)
        n += len(x)
    _sync(device)
    return n / (time.perf_counter() - t)


# ---------------------------------------------------------------------------------------------- 3. steps
class OnlineTeacherStep(nn.Module):
    """Online distillation's step: the frozen prior embeds both views every step (no grad), the student's features
    of each view go through a linear head and the cosine loss (ReLA v2 Eq. 9) pulls them to it; no SSL branch
    (lightly-train's ``distillation`` shape, the cost model's ``online_teacher``)."""

    def __init__(self, backbone: nn.Module, teacher: nn.Module, teacher_dim: int):
        super().__init__()
        self.backbone, self.teacher = backbone, teacher.eval().requires_grad_(False)
        self.head = nn.Linear(backbone.feature_dim, teacher_dim)

    def loss(self, v0, v1):
        from accelerate_ssl.rela import rela_loss

        with torch.no_grad():
            t0, t1 = self.teacher(v0), self.teacher(v1)
        return 0.5 * (rela_loss(self.head(self.backbone(v0)), t0.float())
                      + rela_loss(self.head(self.backbone(v1)), t1.float()))


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


def step_kind(kind: str, size: Size, device: torch.device, work: Path, compiled: bool = False) -> dict:
    """Build the kind's networks, time its steps, free them. Kinds: plain, rela_mixed, rela_lambda1,
    rela_lambda1_one_view, plain_loader, rela_mixed_host_prefetch, online_teacher:<prior>."""
    from accelerate_ssl import ReLA
    from accelerate_ssl.schedules import Constant

    rela, loader, extra = None, None, {}
    n_rows = size.images
    if kind.startswith("online_teacher:"):
        name = kind.split(":", 1)[1]
        prior = random_weights_prior(name, size.priors[name], size.image, work)
        torch.manual_seed(0)
        model = OnlineTeacherStep(_student(size.student), prior.model, prior.model.num_features).to(device).to(
            memory_format=torch.channels_last)
        forward = model.loss
        opt = _optimizer(model)
    else:
        model = _byol(size, device)
        params = [model]
        if kind in ("rela_mixed", "rela_lambda1", "rela_lambda1_one_view"):
            lam = 0.5 if kind == "rela_mixed" else 1.0
            targets = torch.randn(n_rows, 384, generator=torch.Generator().manual_seed(0))
            rela = ReLA(targets, model.backbone, feature_dim=model.backbone.feature_dim, schedule=Constant(lam),
                        targets_on_device=True, sync_every=50)
            params.append(rela.parameters())
        elif kind in ("plain_loader", "rela_mixed_host_prefetch"):
            data = SyntheticImages(size.images, size.image)
            loader = _loader(data, size, device)
            if kind == "rela_mixed_host_prefetch":
                rela = ReLA(str(work / "store-dinov2_vit_s14"), model.backbone, dataset=data, dataloader=loader,
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
            if kind == "rela_lambda1_one_view":
                backbone(v0)
                loss = rela.wrap(lambda: None, index=index)
            elif kind == "rela_lambda1":
                backbone(v0), backbone(v1)
                loss = rela.wrap(lambda: None, index=index)
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
    ``benchmarks/cost_model.py`` counted for this student and these priors (batch 256, 224 px)."""
    path = ROOT / "benchmarks" / "results" / "cost_model.json"
    model = json.loads(path.read_text())["model"]
    out = {}
    for pair in model["pairs"]:
        if pair["student"] != size.student or pair["prior"] not in PRIORS:
            continue
        steps = pair["steps"]
        plain = steps["plain"]["flops"]
        for kind in ("rela_mixed", "rela_lambda1", "rela_lambda1_one_view"):
            out[kind] = steps[kind]["flops"] / plain
        out[f"online_teacher:{pair['prior']}"] = steps["online_teacher"]["flops"] / plain
        out[f"precompute_image:{pair['prior']}"] = (model["priors"][pair["prior"]]["precompute_flops_per_image"]
                                                    / (plain / model_batch(path)))
    return out


def model_batch(path: Path) -> int:
    return int(json.loads(path.read_text())["batch"])


def steps_section(size: Size, device: torch.device, work: Path) -> dict:
    kinds = ["plain", "rela_mixed", "rela_lambda1", "rela_lambda1_one_view", "plain_loader",
             "rela_mixed_host_prefetch", *[f"online_teacher:{p}" for p in size.priors], "plain"]
    measured: dict = {}
    for i, kind in enumerate(kinds):
        key = "plain_again" if (kind == "plain" and i > 0) else kind
        try:
            measured[key] = step_kind(kind, size, device, work)
        except Exception as err:  # one kind failing must not cost the others
            measured[key] = {"error": f"{type(err).__name__}: {err}"[:800], "traceback": traceback.format_exc()[-2000:]}
        print(f"  step {key}: {measured[key].get('step_s', measured[key].get('error'))}", flush=True)
    plain = measured.get("plain", {}).get("step_s")
    out = {"batch_per_view": size.batch, "image_size": size.image, "student": size.student, "autocast": "bf16",
           "channels_last": True, "kinds": measured}
    if plain:
        out["time_ratio_to_plain"] = {k: v["step_s"] / plain for k, v in measured.items() if "step_s" in v}
        if measured["plain"].get("peak_bytes"):
            out["memory_ratio_to_plain"] = {k: v["peak_bytes"] / measured["plain"]["peak_bytes"]
                                            for k, v in measured.items() if v.get("peak_bytes")}
        if "plain_again" in measured and "step_s" in measured["plain_again"]:
            out["plain_repeat_spread"] = measured["plain_again"]["step_s"] / plain - 1
        if "step_s" in measured.get("plain_loader", {}) and "step_s" in measured.get("rela_mixed_host_prefetch", {}):
            out["host_prefetch_over_plain_loader"] = (measured["rela_mixed_host_prefetch"]["step_s"]
                                                      / measured["plain_loader"]["step_s"])
    return out


def against_cost_model(size: Size, result: dict) -> dict:
    """Measured time ratios next to the counted FLOP ratios, with the error (measured / counted - 1)."""
    counted = cost_model_ratios(SIZES["full"]) if size is SIZES["smoke"] else cost_model_ratios(size)
    measured = dict(result.get("steps", {}).get("time_ratio_to_plain", {}))
    plain = result.get("steps", {}).get("kinds", {}).get("plain", {}).get("step_s")
    for name, p in result.get("precompute", {}).get("priors", {}).items():
        if plain:
            measured[f"precompute_image:{name}"] = (1 / p["precompute_img_per_s"]) / (plain / size.batch)
    rows = {k: {"counted_flops": c, "measured_time": measured.get(k),
                "error": None if measured.get(k) is None else measured[k] / c - 1} for k, c in counted.items()}
    errors = [abs(r["error"]) for r in rows.values() if r["error"] is not None]
    return {"rows": rows, "mean_abs_error": statistics.fmean(errors) if errors else None,
            "note": "counted at 224 px, batch 256, ResNet-50; a smoke run's sizes differ, so its errors mean nothing"
            if size is SIZES["smoke"] else "same sizes as counted"}


# ---------------------------------------------------------------------------------------------- 4. no host sync
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
            rela = ReLA(str(work / "store-dinov2_vit_s14"), model.backbone, dataset=data, dataloader=loader,
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


# ---------------------------------------------------------------------------------------------- 5. study
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
    per_seed = result["per_seed"] or [{"seed": result["settings"]["seeds"][0], **result}]

    def brief(r):
        rela_end = next(c for c in r["rela"]["curve"] if c["step"] == result["settings"]["budget"])
        plain_end = r["plain"]["curve"][-1]
        return {"seed": r.get("seed"), "rela_top1": r["rela_top1"], "plain_top1_at_budget": r["plain_top1_at_budget"],
                "plain_final_top1": plain_end["top1"], "plain_final_step": plain_end["step"],
                "rela_train_seconds": rela_end["train_seconds"], "plain_train_seconds": plain_end["train_seconds"],
                "plain_seconds_to_rela_accuracy": r["speedup_wall"].get("cost_plain"),
                "speedup_wall": r["speedup_wall"]["text"], "speedup_steps": r["speedup"]["text"],
                "step_time_ratio": r["step_time_ratio"]}

    return {"argv": argv, "seconds": seconds, "precompute_seconds": result["targets"]["seconds"],
            "machine": result["machine"], "mean": brief(result), "per_seed": [brief(r) for r in per_seed],
            "json": "demo_gpu.json", "png": "demo_gpu.png"}


# ---------------------------------------------------------------------------------------------- 6. compiled
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
    from accelerate_ssl import __version__

    cuda = device.type == "cuda"
    return {"library_version": __version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
            "torch": torch.__version__, "platform": platform.platform(), "cpu_count": os.cpu_count(),
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
    fig, (ax, axm) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax.barh(names, [kinds[k]["step_s"] * 1000 for k in names], color="C0")
    ax.set_xlabel("median step (ms)")
    ax.invert_yaxis()
    rows = result.get("cost_model", {}).get("rows", {})
    pts = [(r["counted_flops"], r["measured_time"], k) for k, r in rows.items() if r["measured_time"] is not None]
    if pts:
        axm.scatter([p[0] for p in pts], [p[1] for p in pts])
        for x, y, k in pts:
            axm.annotate(k.replace("online_teacher:", "online ").replace("precompute_image:", "precompute "), (x, y),
                         fontsize=7)
        hi = max(max(p[0] for p in pts), max(p[1] for p in pts)) * 1.1
        axm.plot([0, hi], [0, hi], "k--", lw=0.8)
    axm.set_xlabel("counted FLOP ratio to plain BYOL (cost model)")
    axm.set_ylabel("measured time ratio")
    fig.suptitle(f"{result['device']}, torch {result['torch']}, CUDA {result['cuda']}: batch "
                 f"{result.get('steps', {}).get('batch_per_view')} x 2 views, "
                 f"{result.get('steps', {}).get('image_size')} px, bf16", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                   help="folder for gpu.json, gpu.png, the pytest logs and the study's demo JSON/PNG")
    p.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "cache" / "gpu",
                   help="scratch folder (weights files, stores, the demo's targets); emptied first")
    p.add_argument("--smoke", action="store_true", help="toy sizes on whatever device there is (CPU included)")
    p.add_argument("--sections", nargs="+", choices=list(ESTIMATE_S), default=list(ESTIMATE_S),
                   help="run only these sections (default: all, in order)")
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
    result = {"command": " ".join([sys.executable, *sys.argv]), "size": "smoke" if args.smoke else "full",
              **_versions(device), "sections_seconds": {}, "skipped": {}}
    runners = {"tests": lambda: run_tests(size, args.out),
               "precompute": lambda: precompute_vs_bare_forward(size, device, args.work),
               "steps": lambda: steps_section(size, device, args.work),
               "no_host_sync": lambda: no_sync_steps(size, device, args.work),
               "study": lambda: study(size, device, args.work, args.out),
               "compiled": lambda: compiled_section(size, device, args.work)}
    for name in args.sections:
        left = size.budget_s - (time.perf_counter() - t_start)
        if left < ESTIMATE_S[name]:
            result["skipped"][name] = f"{left:.0f} s left of the {size.budget_s:.0f} s budget, ~{ESTIMATE_S[name]} s needed"
            print(f"[gpu.py] skip {name}: {result['skipped'][name]}", flush=True)
            continue
        print(f"[gpu.py] {name} ...", flush=True)
        t = time.perf_counter()
        try:
            result[name] = runners[name]()
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
        lines.append(f"precompute {name}: {pr['precompute_img_per_s']:.0f} img/s, bare forward "
                     f"{pr['bare_forward_img_per_s']:.0f} img/s, ratio {pr['ratio']:.3f}; input pipeline alone "
                     f"{pr.get('input_pipeline_img_per_s', 0):.0f} img/s")
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
        lines.append(f"study ({st['seconds']:.0f} s): ReLA {m['rela_top1']:.2f} % at the budget in "
                     f"{m['rela_train_seconds']:.1f} s + precompute {st['precompute_seconds']:.1f} s; plain "
                     f"{m['plain_final_top1']:.2f} % at {m['plain_final_step']} steps in {m['plain_train_seconds']:.1f} s; "
                     f"speed-up {m['speedup_wall']}")
    comp = result.get("compiled", {})
    for k, v in comp.get("kinds", {}).items():
        lines.append(f"compiled {k}: " + (f"{v['step_s'] * 1000:.1f} ms (compile + 2 steps "
                                          f"{v['compile_and_first_steps_s']:.0f} s)" if "step_s" in v else str(v.get("error"))))
    for name in ("precompute", "steps", "no_host_sync", "study", "compiled", "tests"):
        if isinstance(result.get(name), dict) and "error" in result[name]:
            lines.append(f"{name} FAILED: {result[name]['error']}")
    if result.get("skipped"):
        lines.append(f"skipped: {result['skipped']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
