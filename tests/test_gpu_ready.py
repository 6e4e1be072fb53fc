"""What breaks on a GPU, caught on the CPU: mixed precision (bf16 / fp16 autocast, GradScaler), torch.compile,
channels_last students, and a step that never waits for the host nor creates tensors on a hard-coded device
(run on the ``meta`` device, where any host read or any CPU tensor mixed in raises)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accelerate_ssl import ReLA

N, D_IN, D = 64, 12, 32


def targets():
    return torch.randn(N, 24, generator=torch.Generator().manual_seed(1))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                      nn.Linear(32, D))
        self.head = nn.Linear(D, 8)

    def forward(self, x):
        return self.head(self.backbone(x))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _batches(steps, device="cpu", batch=8):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        yield torch.randint(0, N, (batch,), generator=g), torch.rand(batch, 1, D_IN, D_IN, generator=g).to(device)


def _one_step(dtype):
    torch.manual_seed(0)
    net = Net()
    rela = ReLA(targets(), net.backbone, feature_dim=D, schedule="constant")
    idx, x = next(_batches(1))
    ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
    with ctx:
        out = net(x)
        loss = rela.wrap(lambda: out.float().pow(2).mean(), index=idx)
    loss.backward()
    return loss, net, rela


@pytest.mark.parametrize("dtype, loss_tolerance", [(torch.bfloat16, 5e-2), (torch.float16, 1e-2)])
def test_autocast_loss_and_gradients_match_fp32(dtype, loss_tolerance):
    """Stated tolerance: the loss within 5 % (bf16: 8-bit mantissa through conv + linear) or 1 % (fp16) of fp32, every
    gradient at cosine > 0.99 to fp32's."""
    loss32, net32, rela32 = _one_step(None)
    loss, net, rela = _one_step(dtype)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert loss.item() == pytest.approx(loss32.item(), rel=loss_tolerance)
    for (name, p), p32 in zip(net.named_parameters(), net32.parameters()):
        cos = F.cosine_similarity(p.grad.flatten().float(), p32.grad.flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))
    # the transport head runs in float32 under autocast: its weights, fit and gradient are fp32
    assert rela.head.weight.dtype == torch.float32 and rela.head.weight.grad.dtype == torch.float32
    assert F.cosine_similarity(rela.head.weight.grad.flatten(), rela32.head.weight.grad.flatten(), dim=0) > 0.99


def test_fp16_autocast_with_grad_scaler_on_cpu_trains_and_counts_steps():
    torch.manual_seed(0)
    net = Net()
    rela = ReLA(targets(), net.backbone, feature_dim=D, schedule="decay")
    opt = torch.optim.SGD([*net.parameters(), *rela.parameters()], lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for idx, x in _batches(6):
        with torch.autocast("cpu", dtype=torch.float16):
            out = net(x)
            loss = rela.wrap(lambda: out.float().pow(2).mean(), index=idx)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert torch.isfinite(loss)
    assert rela.steps == 6 and rela.head_mode == "user"


def test_precompute_under_autocast_writes_float32_rows_close_to_fp32(tmp_path):
    from accelerate_ssl import create_prior, precompute_targets
    from accelerate_ssl.data import Digits

    data = torch.utils.data.Subset(Digits("test"), range(96))
    ref = precompute_targets(create_prior("random:convnet", in_channels=1), data, tmp_path / "fp32", progress=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a user's global autocast must not change the store's dtype
        store = precompute_targets(create_prior("random:convnet", in_channels=1), data, tmp_path / "ac", progress=False)
    assert str(store.array.dtype) == str(ref.array.dtype) == "float32"
    rel = float(torch.linalg.norm(torch.from_numpy(store.array[:] - ref.array[:])) / torch.linalg.norm(torch.from_numpy(ref.array[:])))
    assert rel < 2e-2


@pytest.mark.parametrize("method", ["dwa", "fadrm"])
def test_distillation_bf16_runs_on_cpu_and_fp16_says_it_needs_cuda(method):
    from accelerate_ssl.distill import synthesize
    from distill_helpers import MEAN, STD, tiny_real, tiny_teacher

    teacher = tiny_teacher()
    out = synthesize(teacher, method=method, ipc=1, real=tiny_real(), mean=MEAN, std=STD, iterations=4, precision="bf16",
                     progress=False)
    assert torch.isfinite(out.images).all()
    with pytest.raises(ValueError, match="fp16' needs a CUDA device.*bf16"):
        synthesize(teacher, method=method, ipc=1, real=tiny_real(), mean=MEAN, std=STD, iterations=4, precision="fp16",
                   device="cpu", progress=False)


# ---------------------------------------------------------------------------------------------- torch.compile
def _train(model_fn, steps=5, channels_last=False):
    torch.manual_seed(0)
    net = Net()
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    rela = ReLA(targets(), net.backbone, feature_dim=D, schedule="decay")
    model = model_fn(net)
    opt = torch.optim.SGD([*net.parameters(), *rela.parameters()], lr=0.05)
    losses = []
    for idx, x in _batches(steps):
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        out = model(x)
        loss = rela.wrap(lambda: out.pow(2).mean(), index=idx)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, rela


def test_compiled_student_matches_eager_compiles_once_without_graph_breaks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, rela_e = _train(lambda net: net)
    compiled, rela_c = _train(torch.compile)
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)
    assert rela_c.lam == pytest.approx(rela_e.lam, rel=1e-4)
    assert counters["frames"]["total"] == 1 and counters["frames"]["ok"] == 1  # no recompile over 5 steps
    assert dict(counters["graph_break"]) == {}  # the feature hook traced into the graph
    torch._dynamo.reset()


def test_channels_last_student():
    standard, _ = _train(lambda net: net)
    last, rela = _train(lambda net: net, channels_last=True)
    assert last == pytest.approx(standard, rel=1e-4, abs=1e-5)
    assert rela.steps == 5


# ---------------------------------------------------------------------------------------------- no host sync, no "cpu"
@pytest.mark.parametrize("targets_on_device", [False, True])
@pytest.mark.parametrize("head_init", ["fit", "random"])
def test_the_step_runs_on_the_meta_device_without_reading_anything_on_the_host(targets_on_device, head_init):
    """On ``meta`` every host read (.item(), float(), bool(), .tolist(), .cpu() of data) raises, and so does any op
    mixing a tensor made on a hard-coded CPU device into the step: 12 steps pass only if neither happens."""
    torch.manual_seed(0)
    net = Net().to("meta")
    rela = ReLA(targets(), net.backbone, feature_dim=D, sync_every=100, targets_on_device=targets_on_device,
                head_init=head_init)
    opt = torch.optim.AdamW([*net.parameters(), *rela.parameters()], lr=1e-3)
    for idx, x in _batches(12, device="meta"):  # indices stay on the host, as a DataLoader yields them
        out = net(x)
        loss = rela.wrap(lambda: out.pow(2).mean(), index=idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.device.type == "meta" and rela.head.weight.device.type == "meta" and rela.steps == 12
    assert len(rela._pending_losses) == 12  # read on the host only at the 100th step


class _HostReads:
    """Counts host reads of floating-point tensors (.item, .tolist, float(), bool())."""

    def __init__(self):
        self.count = 0
        self._saved = {}

    def __enter__(self):
        for name in ("item", "tolist", "__float__", "__bool__"):
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counting(t, *a, _original=original, **k):
                if t.is_floating_point():
                    self.count += 1
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, counting)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


@pytest.mark.parametrize("sync_every, reads", [(1, 12), (4, 3), (12, 1)])
def test_the_loss_is_read_on_the_host_once_per_sync_interval(sync_every, reads):
    torch.manual_seed(0)
    net = Net()
    rela = ReLA(targets(), net.backbone, feature_dim=D, sync_every=sync_every)
    opt = torch.optim.SGD([*net.parameters(), *rela.parameters()], lr=0.05, foreach=False)
    batches = list(_batches(13))
    out = net(batches[0][1])  # warm-up step: the head fit
    rela.wrap(lambda: out.pow(2).mean(), index=batches[0][0]).backward()
    opt.step()
    opt.zero_grad()
    rela._feed_schedule()
    with _HostReads() as reads_seen:
        for idx, x in batches[1:]:
            out = net(x)
            loss = rela.wrap(lambda: out.pow(2).mean(), index=idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert reads_seen.count == reads
    assert rela.schedule.steps == 13


def test_sync_every_follows_the_same_lambda_trajectory_late():
    def lams(sync_every):
        torch.manual_seed(0)
        net = Net()
        rela = ReLA(targets(), net.backbone, feature_dim=D, sync_every=sync_every)
        opt = torch.optim.SGD([*net.parameters(), *rela.parameters()], lr=0.05)
        for idx, x in _batches(12):
            out = net(x)
            rela.wrap(lambda: out.pow(2).mean(), index=idx).backward()
            opt.step()
            opt.zero_grad()
        rela._feed_schedule()
        return rela.schedule.state_dict()

    assert lams(4) == lams(1)  # the same losses, fed in order: the same controller state once read


def test_bad_sync_every_is_refused():
    with pytest.raises(ValueError, match="sync_every is a number of optimiser steps, an int >= 1"):
        ReLA(targets(), Net().backbone, feature_dim=D, sync_every=0)
