"""The GPU benchmark: what only a CUDA device can show, in one command.

    .venv/bin/python benchmarks/gpu.py            # needs a CUDA device; ~5 min on one GPU

writes ``benchmarks/results/gpu.json`` (device name, CUDA, cuDNN and torch versions with every figure):

1. **precompute throughput** of a prior (ResNet-50, random weights, 224 px, bf16) over 8192 synthetic images,
   against the same prior's bare forward over the same batches already on the device: goal >= 0.9x.
2. **per-step overhead**: a ResNet-50 BYOL step (batch 128, 224 px, bf16 autocast) with and without ReLA
   (0 < lambda < 1, ``targets_on_device=True``, ``sync_every=50``), eager and under ``torch.compile``: the ReLA step's
   time over the plain step's, and peak memory over peak memory (goal <= 1.05x each).
3. **no host synchronisation**: 20 ReLA steps under ``torch.cuda.set_sync_debug_mode("error")`` after warm-up
   (any synchronising call would raise): whether they pass.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _resnet50():
    import torchvision

    net = torchvision.models.resnet50()
    net.fc = nn.Identity()
    return net


class _Images(torch.utils.data.Dataset):
    def __init__(self, n, size=224):
        self.n, self.size = n, size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (3, self.size, self.size), dtype=torch.uint8, generator=g)


def precompute_vs_bare_forward(tmp: Path, n: int = 8192, batch: int = 256) -> dict:
    from accelerate_ssl import create_prior, precompute_targets

    prior = create_prior("random:resnet50")
    net = prior.model.cuda().eval()
    data = _Images(n)
    t = time.perf_counter()
    precompute_targets(prior, data, tmp / "store", batch_size=batch, precision="bf16", num_workers=4, progress=False)
    torch.cuda.synchronize()
    precompute_s = time.perf_counter() - t
    x = torch.rand(batch, 3, 224, 224, device="cuda")
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        net(x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n // batch):
            net(x)
        torch.cuda.synchronize()
    bare_s = time.perf_counter() - t
    return {"images": n, "batch": batch, "precompute_img_per_s": n / precompute_s, "bare_forward_img_per_s": n / bare_s,
            "ratio": bare_s / precompute_s, "goal": 0.9}


def _byol():
    """BYOL on a ResNet-50 with the paper's head sizes (4096 hidden, 256 out): the recipe's method."""
    from accelerate_ssl.recipes import BYOL

    return BYOL(_resnet50(), 2048, hidden_dim=4096, out_dim=256)


def step_overhead(compiled: bool, steps: int = 20, batch: int = 128) -> dict:
    from accelerate_ssl import ReLA
    from accelerate_ssl.schedules import Constant

    out = {}
    for with_rela in (False, True):
        torch.manual_seed(0)
        model = _byol().cuda()
        rela = None
        if with_rela:
            rela = ReLA(torch.randn(10_000, 768), model.backbone, feature_dim=2048, schedule=Constant(0.5),
                        targets_on_device=True, sync_every=50)
        forward = torch.compile(model.loss) if compiled else model.loss
        params = [p for p in model.parameters() if p.requires_grad] + (list(rela.parameters()) if rela else [])
        opt = torch.optim.AdamW(params, lr=1e-4)
        v0, v1 = (torch.rand(batch, 3, 224, 224, device="cuda") for _ in range(2))
        idx = torch.randint(0, 10_000, (batch,))
        times = []
        torch.cuda.reset_peak_memory_stats()
        for i in range(steps + 3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward(v0, v1)
                if rela is not None:
                    loss = rela.wrap(loss, index=idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t)
        out["rela" if with_rela else "plain"] = {"step_s": statistics.median(times),
                                                 "peak_bytes": torch.cuda.max_memory_allocated()}
        del model, opt, rela
        torch.cuda.empty_cache()
    out["time_ratio"] = out["rela"]["step_s"] / out["plain"]["step_s"]
    out["memory_ratio"] = out["rela"]["peak_bytes"] / out["plain"]["peak_bytes"]
    out["goal"] = 1.05
    return out


def no_sync_steps(steps: int = 20) -> dict:
    from accelerate_ssl import ReLA

    torch.manual_seed(0)
    model = _byol().cuda()
    rela = ReLA(torch.randn(4096, 768), model.backbone, feature_dim=2048, targets_on_device=True, sync_every=1000)
    opt = torch.optim.AdamW([*[p for p in model.parameters() if p.requires_grad], *rela.parameters()], lr=1e-4,
                            capturable=True)
    v = torch.rand(32, 3, 224, 224, device="cuda")
    g = torch.Generator().manual_seed(0)

    def step():
        idx = torch.randint(0, 4096, (32,), generator=g)
        loss = rela.wrap(model.loss(v, v), index=idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(10):  # warm-up: the head fit and the index checks read the host once
        step()
    torch.cuda.synchronize()
    error = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            step()
    except RuntimeError as err:
        error = str(err)[:500]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"steps": steps, "passed": error is None, "error": error}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu.json")
    p.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "cache" / "gpu")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA device (torch.cuda.is_available() is False); the CPU parts of the same "
              "questions are in benchmarks/cost_model.py and tests/test_gpu_ready.py.", file=sys.stderr)
        return 2
    import shutil

    from accelerate_ssl import __version__
    from accelerate_ssl.results import write_results

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    result = {"command": " ".join([sys.executable, *sys.argv]), "library_version": __version__,
              "device": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
              "cudnn": torch.backends.cudnn.version(), "torch": torch.__version__, "platform": platform.platform(),
              "cpu_count": os.cpu_count()}
    result["precompute"] = precompute_vs_bare_forward(args.work)
    result["step_overhead_eager"] = step_overhead(compiled=False)
    result["step_overhead_compiled"] = step_overhead(compiled=True)
    result["no_host_sync"] = no_sync_steps()
    shutil.rmtree(args.work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_results(args.out, result, ROOT)
    print(f"{result['device']}, CUDA {result['cuda']}, torch {result['torch']}")
    print(f"precompute / bare forward: {result['precompute']['ratio']:.3f} (goal >= 0.9)")
    for k in ("step_overhead_eager", "step_overhead_compiled"):
        r = result[k]
        print(f"{k}: time {r['time_ratio']:.3f}, memory {r['memory_ratio']:.3f} (goal <= 1.05)")
    print(f"no host sync in 20 steps: {result['no_host_sync']['passed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
