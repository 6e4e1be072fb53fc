"""ReLA.wrap in small training loops: head training, index/target alignment, controllers, checkpoints,
autocast, gradient accumulation and the bad-input errors."""

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from accelerate_ssl import ReLA
from accelerate_ssl.schedules import Constant, Decay, Schedule, Switch

N, D_IN, D_T = 48, 6, 5


class Encoded(Dataset):
    """Item i: (features-ish input whose first entry is i, label i % 3)."""

    def __init__(self, n=N):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, D_IN, generator=g)
        self.x[:, 0] = torch.arange(n, dtype=torch.float32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i % 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(D_IN, 8), nn.ReLU(), nn.Linear(8, 4))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.backbone(x))


def targets(n=N, d=D_T):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(1))


def train(model, rela, batches, opt, steps=None, accumulate=1, ssl=None):
    ssl = ssl or (lambda out: out.pow(2).mean())
    for k, (x, y, idx) in enumerate(batches):
        out0, out1 = model(x), model(x + 0.1)
        loss = rela.wrap(lambda: ssl(out0) + ssl(out1), index=idx) / accumulate
        loss.backward()
        if (k + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()


def fixed_batches(n_batches, bs=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ds = Encoded()
    out = []
    for _ in range(n_batches):
        idx = torch.randperm(N, generator=g)[:bs]
        out.append((ds.x[idx], idx % 3, idx))
    return out


@pytest.mark.parametrize("register", [True, False])
def test_head_is_trained_either_way(register):
    model = Net()
    rela = ReLA(targets(), model.backbone, feature_dim=4)
    params = list(model.parameters()) + (list(rela.parameters()) if register else [])
    opt = torch.optim.AdamW(params, lr=1e-2)
    w0 = rela.head.weight.detach().clone()
    train(model, rela, fixed_batches(5), opt)
    assert rela.head_mode == ("user" if register else "own")
    assert (rela.head.weight - w0).abs().max() > 1e-4
    assert rela.stats["step"] == 5 and rela.schedule.steps == 5
    assert (rela.transport.own_optimizer is None) == register


def test_indices_and_targets_align_over_shuffled_epochs_with_workers():
    ds = Encoded()
    t = targets()
    loader = DataLoader(ds, batch_size=5, shuffle=True, num_workers=2, drop_last=True)
    model = Net()
    rela = ReLA(t, model.backbone, dataloader=loader, n_components=None, schedule=Constant(0.5))
    assert rela.head.in_features == 4  # inferred by a dry forward of ds[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = 0
    for epoch in range(3):
        for b, (x, _) in enumerate(loader):
            idx = x[:, 0].long()
            assert torch.equal(rela._current_index, idx)
            assert torch.equal(rela.targets(rela._current_index, "cpu"), t[idx])  # raw rows, n_components=None
            feats = model.backbone(x)
            loss = rela.wrap(feats.sum() * 0)
            expected = 1 - torch.cosine_similarity(rela.head(feats), t[idx], dim=1).mean()
            assert torch.allclose(rela.last_wrap["loss_rela"], expected.detach(), atol=1e-6)
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen += 1
            if epoch == 1 and b == 2:
                break
    assert seen == 9 + 3 + 9


def test_views_share_target_and_are_averaged():
    t = targets()
    bb = nn.Linear(D_IN, 4)
    rela = ReLA(t, bb, feature_dim=4, n_components=None, head_init="random")  # (a fit scores its first loss on half)
    x, idx = torch.randn(3, D_IN), torch.tensor([4, 0, 7])
    f0, f1 = bb(x), bb(x * 2)
    out = rela.wrap(torch.tensor(0.0), index=idx)
    per_view = [1 - torch.cosine_similarity(rela.head(f), t[idx], dim=1).mean() for f in (f0, f1)]
    assert torch.allclose(rela.last_wrap["loss_rela"], (sum(per_view) / 2).detach(), atol=1e-6)
    # one call on the two views concatenated gives the same loss
    bb(torch.cat([x, x * 2]))
    rela.wrap(torch.tensor(0.0), index=idx)
    assert torch.allclose(rela.last_wrap["loss_rela"], (sum(per_view) / 2).detach(), atol=1e-6)
    assert out.requires_grad


def test_momentum_copy_no_grad_and_eval_calls_are_not_captured():
    model = Net()
    rela = ReLA(targets(), model.backbone, feature_dim=4)
    momentum = copy.deepcopy(model.backbone)  # a copy made after ReLA shares the hook function
    x = torch.randn(4, D_IN)
    momentum(x)
    with torch.no_grad():
        model.backbone(x)
    model.eval()
    model.backbone(x)
    model.train()
    assert rela.capture.captured == []
    model.backbone(x)
    assert len(rela.capture.captured) == 1


def test_callable_ssl_loss_skipped_while_lambda_is_one_and_rela_skipped_after_switch():
    calls = {"ssl": 0}
    model = Net()
    sched = Switch(fast_momentum=0.5, slow_momentum=0.5)  # switches after a few steps
    rela = ReLA(targets(), model.backbone, feature_dim=4, schedule=sched)
    opt = torch.optim.SGD(list(model.parameters()) + list(rela.parameters()), lr=0.01)
    lambdas = []
    for x, _, idx in fixed_batches(12):
        out = model(x)

        def ssl():
            calls["ssl"] += 1
            return out.pow(2).mean()

        lambdas.append(rela.lam)
        loss = rela.wrap(ssl, index=idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
    ones = lambdas.count(1.0)
    assert 0 < ones < 12 and lambdas[ones:] == [0.0] * (12 - ones)
    assert calls["ssl"] == 12 - ones  # never computed while lambda == 1
    assert rela.stats["loss_rela"] is None and rela.stats["lambda"] == 0.0  # ReLA term not computed
    assert rela.capture.captured == []
    x = torch.randn(2, D_IN)
    model.backbone(x)
    assert rela.capture.captured == []  # capture stopped for good


def test_gradient_accumulation_steps_controller_once_per_optimizer_step():
    fed = []

    class Recorder(Schedule):
        def step(self, loss_rela=None):
            fed.append(loss_rela)
            self.steps += 1
            self.value = 0.5
            return self.value

    model = Net()
    rela = ReLA(targets(), model.backbone, feature_dim=4, schedule=Recorder())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    micro_losses = []
    batches = fixed_batches(9)
    for k, (x, _, idx) in enumerate(batches):
        out = model(x)
        loss = rela.wrap(out.pow(2).mean(), index=idx) / 3
        micro_losses.append(float(rela.last_wrap["loss_rela"]))
        loss.backward()
        if (k + 1) % 3 == 0:
            opt.step()
            opt.zero_grad()
    assert rela.steps == 3 and len(fed) == 3
    assert fed == pytest.approx([np.mean(micro_losses[i : i + 3]) for i in (0, 3, 6)], rel=1e-6)


@pytest.mark.parametrize("register", [True, False])
def test_resume_matches_uninterrupted_run(tmp_path, register):
    batches = fixed_batches(8)

    def fresh():
        torch.manual_seed(123)
        model = Net()
        rela = ReLA(targets(), model.backbone, feature_dim=4, schedule=Decay(total_steps=8))
        params = list(model.parameters()) + (list(rela.parameters()) if register else [])
        return model, rela, torch.optim.AdamW(params, lr=1e-2)

    m_full, r_full, o_full = fresh()
    train(m_full, r_full, batches, o_full)

    m, r, o = fresh()
    train(m, r, batches[:4], o)
    torch.save({"model": m.state_dict(), "opt": o.state_dict(), "rela": r.state_dict()}, tmp_path / "ckpt.pt")
    m2, r2, o2 = fresh()
    ckpt = torch.load(tmp_path / "ckpt.pt")
    m2.load_state_dict(ckpt["model"]), o2.load_state_dict(ckpt["opt"]), r2.load_state_dict(ckpt["rela"])
    train(m2, r2, batches[4:], o2)

    for a, b in zip(m_full.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(r_full.head.weight, r2.head.weight) and torch.equal(r_full.head.bias, r2.head.bias)
    assert r_full.schedule.state_dict() == r2.schedule.state_dict()
    assert r_full.stats == r2.stats


def test_autocast_bf16_cpu():
    model = Net()
    rela = ReLA(targets(), model.backbone, feature_dim=4)
    opt = torch.optim.AdamW(list(model.parameters()) + list(rela.parameters()), lr=1e-2)
    w0 = rela.head.weight.detach().clone()
    for x, _, idx in fixed_batches(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            assert out.dtype == torch.bfloat16
            loss = rela.wrap(lambda: out.float().pow(2).mean(), index=idx)
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert (rela.head.weight - w0).abs().max() > 0


def test_dry_forward_restores_modes_and_batchnorm_stats():
    bb = nn.Sequential(nn.Linear(D_IN, 4), nn.BatchNorm1d(4))
    bb.train()
    bb[1].eval()  # a mixed state must come back exactly
    before = copy.deepcopy(bb[1].state_dict())
    rela = ReLA(targets(), bb, dataset=Encoded())
    assert rela.head.in_features == 4
    assert bb.training and not bb[1].training
    for k, v in before.items():
        assert torch.equal(bb[1].state_dict()[k], v)


def test_pca_default_uses_student_dim():
    rela = ReLA(targets(d=10), nn.Linear(D_IN, 4), feature_dim=4)
    assert (rela.head.in_features, rela.head.out_features) == (4, 4)
    y = rela.targets(torch.arange(N), "cpu")
    assert torch.allclose(y.mean(0), torch.zeros(4), atol=1e-5)  # z-scored then projected (Eq. 41)
    cov = y.T @ y / (N - 1)
    assert torch.allclose(cov, torch.diag(torch.diag(cov)), atol=1e-4)  # decorrelated components
    assert ReLA(targets(d=3), nn.Linear(D_IN, 4), feature_dim=4).head.out_features == 3  # capped


# ---------------------------------------------------------------- bad input
def test_wrong_length_targets():
    with pytest.raises(ValueError, match="48 samples"):
        ReLA(targets(n=40), Net().backbone, dataset=Encoded())
    with pytest.raises(ValueError, match="dataset"):
        ReLA(targets(n=40), Net().backbone, dataloader=DataLoader(Encoded()))


def test_unflattenable_backbone_output():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D_IN, 4)

        def forward(self, x):
            return self.lin(x), x

    bb = Pair()
    rela = ReLA(targets(), bb, feature_dim=4)
    bb(torch.randn(2, D_IN))
    with pytest.raises(ValueError, match="tuple.*features="):
        rela.wrap(torch.tensor(0.0), index=torch.tensor([0, 1]))
    # features= makes it work
    f = bb(torch.randn(2, D_IN))[0]
    assert torch.isfinite(rela.wrap(torch.tensor(0.0), index=torch.tensor([0, 1]), features=f))


@pytest.mark.parametrize("point", ["output of a frozen backbone", "input of a classifier on frozen features"])
def test_a_feature_point_nothing_trains_is_refused_naming_the_fix(point):
    """Features that do not require grad in a training step: nothing upstream trains, ReLA would train its head only
    (and scale the user's loss by 1 - lambda). Refused at the first wrap; unfreezing the backbone makes it train."""
    model = Net()
    model.backbone.requires_grad_(False)
    if point.startswith("output"):
        rela = ReLA(targets(), model.backbone, feature_dim=4)
        where = "Sequential's output"
    else:  # Accelerate's cv_example: every parameter frozen but the classifier's, whose input ReLA captures
        rela = ReLA(targets(), model.head, capture="input")
        where = "Linear's input"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, _, idx = fixed_batches(1)[0]
    loss = model(x).pow(2).mean()
    with pytest.raises(ValueError, match="do not require grad") as err:
        rela.wrap(loss, index=idx)
    assert where in str(err.value) and "Unfreeze" in str(err.value) and "hook a module" in str(err.value)
    assert rela.steps == 0

    model.backbone.requires_grad_(True)  # the fix: the backbone trains, and ReLA's loss reaches it
    before = model.backbone[0].weight.detach().clone()
    rela.wrap(model(x).pow(2).mean(), index=idx).backward()
    assert model.backbone[0].weight.grad is not None and model.backbone[0].weight.grad.abs().sum() > 0
    opt.step()
    assert rela.steps == 1 and not torch.equal(before, model.backbone[0].weight)


def test_no_recoverable_index_and_no_features():
    model = Net()
    rela = ReLA(targets(), model.backbone, feature_dim=4)
    model(torch.randn(2, D_IN))
    with pytest.raises(RuntimeError, match=r"rela.track\(dataloader\).*index="):
        rela.wrap(torch.tensor(0.0))
    with pytest.raises(RuntimeError, match="no backbone features"):
        rela.wrap(torch.tensor(0.0), index=torch.tensor([0, 1]))
    model(torch.randn(2, D_IN))
    with pytest.raises(IndexError, match="out of range"):
        rela.wrap(torch.tensor(0.0), index=torch.tensor([0, N]))


def test_double_registration_and_missing_registration():
    model = Net()
    rela = ReLA(targets(), model.backbone, feature_dim=4, head_optimizer="own")
    opt = torch.optim.SGD(list(model.parameters()) + list(rela.parameters()), lr=0.1)
    x, _, idx = fixed_batches(1)[0]
    model(x)
    rela.wrap(torch.tensor(0.0), index=idx).backward()
    with pytest.raises(RuntimeError, match="stepped twice"):
        opt.step()

    model = Net()
    rela = ReLA(targets(), model.backbone, feature_dim=4, head_optimizer="user")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x)
    rela.wrap(torch.tensor(0.0), index=idx).backward()
    with pytest.raises(RuntimeError, match="never be trained"):
        opt.step()

    model = Net()  # auto: head trained by ReLA's own optimiser, then added to the user's -> error
    rela = ReLA(targets(), model.backbone, feature_dim=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, rela, fixed_batches(2), opt)
    opt.add_param_group({"params": list(rela.parameters())})
    with pytest.raises(RuntimeError, match="before the first step"):
        train(model, rela, fixed_batches(1), opt)


def test_parameters_before_dims_known():
    rela = ReLA(targets(), nn.Linear(D_IN, 4))
    with pytest.raises(RuntimeError, match="feature_dim="):
        rela.parameters()


# ---------------------------------------------------------------- the real TargetStore
def _tiny_images(n, seed):
    from accelerate_ssl.data import ArrayImageDataset

    rng = np.random.default_rng(seed)
    return ArrayImageDataset(rng.integers(0, 255, (n, 12, 12), dtype=np.uint8), rng.integers(0, 10, n), name=f"tiny{seed}")


def test_real_store_and_mismatch(tmp_path):
    from accelerate_ssl import create_prior, precompute_targets
    from accelerate_ssl.targets.store import TargetStoreMismatchError
    from accelerate_ssl.backbones import ConvNet

    ds = _tiny_images(24, 0)
    prior = create_prior("random:convnet")
    store = precompute_targets(prior, ds, tmp_path / "store", batch_size=8, progress=False)
    import torchvision.transforms as T

    train_ds = _tiny_images(24, 0)
    train_ds.transform = T.ToTensor()
    student = ConvNet(widths=(8, 16))
    rela = ReLA(str(tmp_path / "store"), student, dataset=_tiny_images(24, 0))
    assert rela.head.in_features == 16 and rela.head.out_features == min(16, store.dim)
    loader = DataLoader(train_ds, batch_size=6, shuffle=True)
    rela.track(loader)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    for x, _ in loader:
        student(x)
        rela.wrap(torch.tensor(0.0)).backward()
        opt.step()
        opt.zero_grad()
    assert rela.stats["step"] == 4 and rela.stats["loss_rela"] is not None
    with pytest.raises(TargetStoreMismatchError):
        ReLA(str(tmp_path / "store"), student, dataset=_tiny_images(24, 1))  # another dataset, same length
    with pytest.raises(ValueError, match="24 rows"):
        ReLA(store, student, dataset=_tiny_images(30, 0))


def test_head_fit_is_the_ridge_solution_and_lowers_the_first_loss():
    from accelerate_ssl.rela import fit_transport_head, rela_loss

    g = torch.Generator().manual_seed(3)
    feats, tgt = torch.randn(64, 4, generator=g), torch.randn(64, D_T, generator=g)
    head = nn.Linear(4, D_T)
    fit_transport_head(head, feats, tgt, ridge=0.0)
    y = torch.nn.functional.normalize(tgt, dim=1)
    want = torch.linalg.lstsq(torch.cat([feats, torch.ones(64, 1)], 1).double(), y.double()).solution
    assert torch.allclose(head.weight.double(), want[:4].T, atol=1e-5)
    assert torch.allclose(head.bias.double(), want[4], atol=1e-5)

    # in ReLA: fitted at the first wrap on that batch (before the loss), only once, the first loss scored with the fit
    x, idx = fixed_batches(1, bs=16)[0][0], fixed_batches(1, bs=16)[0][2]
    for init in ("fit", "random"):
        torch.manual_seed(0)
        bb = nn.Linear(D_IN, 4)
        rela = ReLA(targets(), bb, feature_dim=4, n_components=None, head_init=init)
        w0 = rela.head.weight.detach().clone()
        f = bb(x)
        rela.wrap(torch.tensor(0.0), index=idx)
        first = rela.stats["loss_rela"]
        assert torch.equal(rela.head.weight, w0) == (init == "random")
        if init == "fit":
            ref = nn.Linear(4, D_T)
            fit_transport_head(ref, f, targets()[idx])
            assert torch.equal(rela.head.weight, ref.weight) and torch.equal(rela.head.bias, ref.bias)
            assert abs(first - float(rela_loss(ref(f), targets()[idx]))) < 1e-6
        w1 = rela.head.weight.detach().clone()
        bb(x * 2)
        rela.wrap(torch.tensor(0.0), index=idx)
        assert torch.equal(rela.head.weight, w1)  # not refitted at the second wrap


def test_head_fit_state_is_checkpointed():
    x, _, idx = fixed_batches(1)[0]
    bb = nn.Linear(D_IN, 4)
    before = ReLA(targets(), bb, feature_dim=4).state_dict()  # saved before the first wrap: still to be fitted
    assert before["head_needs_fit"] is True
    rela = ReLA(targets(), bb, feature_dim=4)
    bb(x)
    rela.wrap(torch.tensor(0.0), index=idx)
    after = rela.state_dict()
    assert after["head_needs_fit"] is False
    resumed = ReLA(targets(), bb, feature_dim=4)
    resumed.load_state_dict(after)
    w = resumed.head.weight.detach().clone()
    bb(x)
    resumed.wrap(torch.tensor(0.0), index=idx)
    assert torch.equal(resumed.head.weight, w)  # a resumed head is never refitted
    with pytest.raises(ValueError, match="head_init"):
        ReLA(targets(), bb, feature_dim=4, head_init="zeros")


# ---------------------------------------------------------------------------------------------- the cheap step
def test_a_callable_loss_is_skipped_while_lambda_is_1_and_inputs_give_the_features():
    """wrap(loss_fn, inputs=x0): while lambda is 1 the function is never called (no SSL side) and ReLA runs the backbone
    on x0 alone; from the hand-over on, the function runs first and its backbone calls are the step's features (both
    views: nothing counted twice, nothing left over for the next step)."""
    from accelerate_ssl.schedules import Epochs

    torch.manual_seed(0)
    model = Net()
    calls = {"loss": 0, "backbone": 0}
    model.backbone.register_forward_hook(lambda *a: calls.__setitem__("backbone", calls["backbone"] + 1))
    rela = ReLA(targets(), model.backbone, feature_dim=4, schedule=Epochs(0.5, total_steps=4), witness=False)
    opt = torch.optim.SGD(list(model.parameters()) + list(rela.parameters()), lr=0.1)
    seen = []
    for x, _, idx in fixed_batches(4):
        def ssl_loss(x=x):
            calls["loss"] += 1
            return (model(x).pow(2).mean() + model(x + 0.1).pow(2).mean()) / 2

        before = dict(calls)
        loss = rela.wrap(ssl_loss, index=idx, inputs=x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen.append((rela.stats["lambda"], calls["loss"] - before["loss"], calls["backbone"] - before["backbone"]))
    # lambda 1: no loss call, one backbone call (ReLA's own, on x); lambda 0: the loss, and its two backbone calls
    assert seen == [(1.0, 0, 1), (1.0, 0, 1), (0.0, 1, 2), (0.0, 1, 2)]
    assert rela.capture.captured == []


def test_with_both_losses_the_callable_runs_first_and_its_forwards_are_the_features():
    torch.manual_seed(0)
    model = Net()
    rela = ReLA(targets(), model.backbone, feature_dim=4, schedule=Constant(0.5), witness=False)
    x, _, idx = next(iter(fixed_batches(1)))
    loss = rela.wrap(lambda: model(x).pow(2).mean() + model(x + 0.1).pow(2).mean(), index=idx, inputs=x)
    assert rela.stats["lambda"] == 0.5 and rela.stats["loss_ssl"] is not None
    # the ReLA term averaged over the two views the callable ran: the same as passing those features
    ref = ReLA(targets(), model.backbone, feature_dim=4, schedule=Constant(0.5), witness=False)
    ref.head.load_state_dict(rela.head.state_dict())
    with torch.no_grad():
        feats = [model.backbone(x), model.backbone(x + 0.1)]
    expected = ref.wrap(torch.tensor(0.0), index=idx, features=feats)
    assert rela.stats["loss_rela"] == pytest.approx(ref.stats["loss_rela"], rel=1e-5)
    assert torch.isfinite(loss) and torch.isfinite(expected)


def test_inputs_are_refused_where_they_cannot_give_features():
    model = Net()
    x, _, idx = next(iter(fixed_batches(1)))
    hooked_input = ReLA(targets(), model.head, feature_dim=4, capture="input", schedule=Constant(1.0), witness=False)
    with pytest.raises(ValueError, match="capture='input'.*pass the loss as a tensor"):
        hooked_input.wrap(lambda: model(x).sum(), index=idx, inputs=x)
    hooked_input.close()
    rela = ReLA(targets(), model.backbone, feature_dim=4, schedule=Constant(1.0), witness=False)
    with pytest.raises(TypeError, match="image tensor of one view"):
        rela.wrap(lambda: model(x).sum(), index=idx, inputs=[x])
    model.eval()
    with pytest.raises(RuntimeError, match="training mode with grad enabled"):
        rela.wrap(lambda: model(x).sum(), index=idx, inputs=x)
    model.train()
    with pytest.raises(RuntimeError, match="pass inputs=<one view's images> too"):
        rela.wrap(lambda: model(x).sum(), index=idx)  # a callable skipped, nothing forwarded, no inputs
