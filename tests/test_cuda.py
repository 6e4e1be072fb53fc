"""The same guarantees as tests/test_gpu_ready.py on a CUDA device (skipped where there is none): bf16 / fp16
autocast with a GradScaler, torch.compile, and a step that never synchronises (torch's sync debug mode raises on any
synchronising call). The GPU throughput and overhead figures are measured by benchmarks/gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accelerate_ssl import ReLA

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)")]

N, D = 256, 64


def _net():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                         nn.Flatten(), nn.Linear(64, D)).cuda()


def _targets():
    return torch.randn(N, 48, generator=torch.Generator().manual_seed(1))


def _step(net, rela, dtype, scaler=None, opt=None, idx=None):
    x = torch.rand(32, 3, 16, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    idx = torch.arange(32) if idx is None else idx
    with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
        f = net(x)
        loss = rela.wrap(lambda: f.float().pow(2).mean(), index=idx)
    (scaler.scale(loss) if scaler else loss).backward()
    if opt is not None:
        (scaler.step(opt) if scaler else opt.step())
        if scaler:
            scaler.update()
        opt.zero_grad()
    return loss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_autocast_matches_fp32(dtype):
    grads = {}
    for d in (None, dtype):
        torch.manual_seed(0)
        net = _net()
        rela = ReLA(_targets(), net, feature_dim=D, schedule="constant")
        loss = _step(net, rela, d)
        assert torch.isfinite(loss)
        grads[d] = torch.cat([p.grad.flatten().float() for p in net.parameters()])
    assert F.cosine_similarity(grads[dtype], grads[None], dim=0) > 0.99


def test_cuda_fp16_with_grad_scaler_trains():
    torch.manual_seed(0)
    net = _net()
    rela = ReLA(_targets(), net, feature_dim=D)
    opt = torch.optim.SGD([*net.parameters(), *rela.parameters()], lr=0.05)
    scaler = torch.amp.GradScaler("cuda")
    for s in range(5):
        assert torch.isfinite(_step(net, rela, torch.float16, scaler, opt, idx=torch.arange(32) + 32 * s))
    assert rela.steps == 5


def test_cuda_compile_matches_eager():
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        net = _net()
        rela = ReLA(_targets(), net, feature_dim=D, schedule="decay")
        model = torch.compile(net) if compiled else net
        opt = torch.optim.SGD([*net.parameters(), *rela.parameters()], lr=0.05)
        out = []
        for s in range(4):
            x = torch.rand(32, 3, 16, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(s))
            f = model(x)
            loss = rela.wrap(lambda: f.pow(2).mean(), index=torch.arange(32) + 32 * s)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[compiled] = out
    assert losses[True] == pytest.approx(losses[False], rel=1e-3, abs=1e-4)


@pytest.mark.parametrize("targets_on_device", [False, True])
def test_cuda_step_never_synchronises_after_warm_up(targets_on_device):
    torch.manual_seed(0)
    net = _net()
    rela = ReLA(_targets(), net, feature_dim=D, sync_every=1000, targets_on_device=targets_on_device)
    opt = torch.optim.AdamW([*net.parameters(), *rela.parameters()], lr=1e-3, capturable=True)
    for s in range(10):  # warm-up: head fit, index checks
        _step(net, rela, torch.bfloat16, opt=opt, idx=torch.randperm(N)[:32])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in range(10):
            _step(net, rela, torch.bfloat16, opt=opt, idx=torch.randperm(N)[:32])
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_witnessed_steps_never_synchronise():
    """The witness on every step (two views, the prior on the device) adds no host synchronisation: its statistics are
    read back once their copy has completed."""
    from accelerate_ssl.rela import Witness
    from accelerate_ssl.priors import Preprocess, Prior

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(3 * 16 * 16, 48)

        def forward(self, x):
            return self.proj(x.flatten(1))

    prior = Prior(Flat(), "test:flat", Preprocess(channels=3, mean=[0.5], std=[0.5]),
                  {"family": "test", "arch": "flat", "output_dim": 48, "weights": None, "weights_sha256": None})
    torch.manual_seed(0)
    net = _net()
    rela = ReLA(_targets(), net, feature_dim=D, sync_every=1000, witness=Witness(prior=prior, every=1))
    opt = torch.optim.AdamW([*net.parameters(), *rela.parameters()], lr=1e-3, capturable=True)

    def step():
        idx = torch.randperm(N)[:32]
        x = torch.rand(32, 3, 16, 16, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            net(x), net(x.flip(3))
            loss = rela.wrap(torch.zeros((), device="cuda"), index=idx)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(10):  # warm-up: head fit, index checks, the prior moved to the device
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rela.witness._judge_ready(None, wait=True)
    assert rela.witness.last is not None and rela.witness.status != "not attached"
