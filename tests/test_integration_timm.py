"""timm: its real loaders (create_loader with and without the PrefetchLoader and the MultiEpochsDataLoader), its
mixing collate, its models' pooled features, with ReLA; plus the first-step, RNG, stats and prior-channel fixes.

Each sample's image is a constant colour equal to its index and its label is its index, so every batch says which
samples it holds; targets are a known function of the index, and every step checks the row ReLA looked up."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

timm = pytest.importorskip("timm")
from timm.data import FastCollateMixup, create_loader  # noqa: E402
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD  # noqa: E402

from accelerate_ssl.rela import ReLA  # noqa: E402
from accelerate_ssl.schedules import Constant  # noqa: E402

N, SIZE, DIM = 48, 16, 6


class IndexImages(Dataset):
    """Item i: a SIZE x SIZE RGB image of constant value i (survives resize / centre crop), label i."""

    def __init__(self, n=N):
        self.n, self.transform = n, None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        img = Image.fromarray(np.full((SIZE, SIZE, 3), i, dtype=np.uint8))
        return (self.transform(img) if self.transform is not None else img), i


def target_rows(n=N):
    """Row i: a fixed function of i (distinct, never parallel rows)."""
    i = torch.arange(n, dtype=torch.float32)[:, None]
    return torch.cat([torch.cos(i * torch.arange(1, DIM + 1)), torch.sin(i * 0.37 + torch.arange(DIM))], 1)


def decode(x: torch.Tensor, prefetcher: bool) -> torch.Tensor:
    """The sample index each row of a timm batch was made from (its pixel value before normalisation)."""
    v = x[:, 0].mean(dim=(1, 2)).double()
    m, s = IMAGENET_DEFAULT_MEAN[0], IMAGENET_DEFAULT_STD[0]
    v = v * s * 255 + m * 255 if prefetcher else (v * s + m) * 255
    return v.round().long()


def loader(prefetcher, multi_epochs, workers=0, **kw):
    return create_loader(IndexImages(), input_size=(3, SIZE, SIZE), batch_size=8, is_training=True, no_aug=True,
                         num_workers=workers, device=torch.device("cpu"), use_prefetcher=prefetcher,
                         use_multi_epochs_loader=multi_epochs, persistent_workers=False, **kw)


class Spy:
    """Records each index ReLA looks targets up for (and the rows it gets) while delegating everything."""

    def __init__(self, lookup):
        self.lookup, self.calls = lookup, []

    def __call__(self, index, device):
        rows = self.lookup(index, device)
        self.calls.append((torch.as_tensor(index).cpu().clone(), rows.detach().cpu().clone()))
        return rows

    def __getattr__(self, name):
        return getattr(self.lookup, name)


def model_and_rela(**kw):
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", pretrained=False, num_classes=5)
    rela = ReLA(target_rows(), model.get_classifier(), capture="input", n_components=None, schedule=Constant(0.5), **kw)
    rela.targets = Spy(rela.targets)
    return model, rela


@pytest.mark.parametrize("prefetcher,multi_epochs,workers", [
    (True, False, 0), (False, False, 0), (True, True, 0), (False, True, 0), (True, True, 1)])
def test_create_loader_every_row_is_the_samples_own(prefetcher, multi_epochs, workers):
    model, rela = model_and_rela()
    dl = rela.track(loader(prefetcher, multi_epochs, workers))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t, seen = target_rows(), []
    for epoch in range(2):
        for step, (x, label) in enumerate(dl):
            idx = decode(x, prefetcher)
            assert torch.equal(idx, label)  # the batch is what it says it is
            loss = rela.wrap(nn.functional.cross_entropy(model(x), label % 5))
            used, rows = rela.targets.calls[-1]
            assert torch.equal(used, idx) and torch.equal(rows, t[idx])  # this step's rows are these samples'
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen += idx.tolist()
            if epoch == 1 and step == 2:
                break
    assert len(seen) == 8 * (6 + 3) and sorted(seen[:N]) == list(range(N))
    assert rela.steps == 9  # the classifier's parameters identify timm's optimiser: every step counted


def test_tracking_the_prefetchers_inner_loader_is_refused():
    """The prefetcher reads one batch ahead: with its inner DataLoader tracked, the loop body would get the next
    batch's indices. The first wrap is refused (two batches of one pass published), before any wrong row is used."""
    model, rela = model_and_rela()
    pf = loader(True, False)
    rela.track(pf.loader)
    x, label = next(iter(pf))
    with pytest.raises(RuntimeError, match="yielded 2 batches since the last wrap"):
        rela.wrap(model(x).sum())
    assert rela.targets.calls == []


def test_known_wrapper_tracks_through_and_user_prefetcher_needs_inner():
    class DevicePrefetcher:  # a user's prefetcher: one batch ahead, one-to-one and in order
        def __init__(self, loader):
            self.loader = loader

        def __iter__(self):
            it = iter(self.loader)
            nxt = next(it)
            for b in it:
                cur, nxt = nxt, b
                yield cur
            yield nxt

    model, rela = model_and_rela()
    inner = DataLoader(IndexImages(), batch_size=8, shuffle=True,
                       collate_fn=lambda b: (torch.tensor([i for _, i in b]),) * 2)
    with pytest.raises(TypeError, match="inner=wrapper.loader"):
        rela.track(DevicePrefetcher(inner))
    dl = rela.track(DevicePrefetcher(inner), inner=inner)
    for idx, _ in dl:
        model(torch.rand(len(idx), 3, SIZE, SIZE))
        rela.wrap(torch.tensor(0.0))
        assert torch.equal(rela.targets.calls[-1][0], idx)
    assert len(rela.targets.calls) == 6


def test_multi_epochs_loader_iterated_before_tracking_is_refused():
    model, rela = model_and_rela()
    dl = loader(False, True)
    next(iter(dl))
    with pytest.raises(RuntimeError, match="before the first epoch"):
        rela.track(dl)


def test_fast_collate_mixup_is_refused_until_switched_off():
    model, rela = model_and_rela()
    mix = FastCollateMixup(mixup_alpha=1.0, cutmix_alpha=1.0, label_smoothing=0.0, num_classes=N)
    dl = rela.track(loader(True, False, collate_fn=mix))
    with pytest.raises(ValueError, match="mixes samples"):
        next(iter(dl))
    dl.mixup_enabled = False  # what timm's train.py does at --mixup-off-epoch (set on the PrefetchLoader)
    for x, label in dl:
        assert torch.equal(decode(x, True), label.argmax(1))  # unmixed one-hot labels
        rela.wrap(model(x).sum())
        assert torch.equal(rela.targets.calls[-1][0], decode(x, True))


def test_in_loop_mixup_is_refused_while_rela_trains():
    """timm's train.py without its prefetcher mixes in the loop: `input, target = mixup_fn(input, target)`."""
    from timm.data import Mixup

    model, rela = model_and_rela()
    mix = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.0, num_classes=N)
    x, y = torch.rand(4, 3, SIZE, SIZE), torch.arange(4)
    with pytest.raises(ValueError, match="Mixup called in the training loop mixes samples.*--mixup 0 --cutmix 0"):
        mix(x, y)
    mix.mixup_enabled = False  # --mixup-off-epoch
    mixed, target = mix(x, y)
    assert torch.equal(mixed, x)
    rela.schedule = Constant(0.0)  # ReLA has handed over for good: mixing is the user's again
    mix.mixup_enabled = True
    mix(x, y)


def test_module_without_parameters_is_refused_with_the_fix():
    model = timm.create_model("test_resnet", pretrained=False, num_classes=5)
    with pytest.raises(ValueError, match=r"get_classifier\(\), capture='input'"):
        ReLA(target_rows(), model.global_pool, feature_dim=model.num_features)


def test_pooled_features_are_the_classifiers_input():
    model, rela = model_and_rela()
    assert rela.head.in_features == model.num_features
    x = torch.rand(4, 3, SIZE, SIZE)
    model.train()
    model(x)
    captured = rela.capture.captured[-1]
    assert torch.allclose(captured, model.forward_head(model.forward_features(x), pre_logits=True))
    # a model built without a classifier: its output is the pooled feature; hook the model itself
    bare = timm.create_model("test_resnet", pretrained=False, num_classes=0)
    with pytest.raises(ValueError, match="no parameters"):
        ReLA(target_rows(), bare.get_classifier(), capture="input")
    assert ReLA(target_rows(), bare, dataset=IndexImages()).head.in_features == bare.num_features


# ------------------------------------------------------------------------------------------ first step, RNG, stats
def test_the_head_fitted_on_a_batch_smaller_than_the_features_still_trains_the_student():
    """With fewer samples than feature dims (a per-GPU batch under a wide timm model) the least-squares head
    interpolates its first batch: that one loss is ~0, and every later batch still gets a full gradient."""
    torch.manual_seed(0)
    backbone = nn.Linear(10, 32)
    rela = ReLA(torch.randn(N, 16), backbone, feature_dim=32, n_components=None, schedule=Constant(1.0))
    rela.wrap(backbone(torch.randn(8, 10)).sum() * 0, index=torch.arange(8))
    assert rela.stats["loss_rela"] < 0.05  # fitted and scored on the same 8 rows
    loss = rela.wrap(backbone(torch.randn(8, 10)).sum() * 0, index=torch.arange(8, 16))
    assert rela.stats["loss_rela"] > 0.3
    loss.backward()
    assert backbone.weight.grad.abs().sum() > 0


def test_building_rela_leaves_the_users_random_stream_alone():
    def run(with_rela):
        torch.manual_seed(0)
        model = timm.create_model("test_resnet", pretrained=False, num_classes=5)
        if with_rela:
            ReLA(target_rows(), model.get_classifier(), capture="input", dataset=IndexImages())
        dl = DataLoader(IndexImages(), batch_size=8, shuffle=True,
                        collate_fn=lambda b: torch.tensor([i for _, i in b]))
        first = next(iter(dl))
        after = nn.Linear(3, 3).weight.detach().clone()
        return first, [p.detach().clone() for p in model.parameters()], after, torch.rand(3)

    a, b = run(False), run(True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
    assert all(torch.equal(p, q) for p, q in zip(a[1], b[1]))


def test_stats_after_load_describe_the_loaded_state():
    def make():
        bb = nn.Linear(3, 4)
        return bb, ReLA(target_rows(), bb, feature_dim=4, n_components=None, schedule="epochs:0.5", total_steps=4)

    bb, trained = make()
    opt = torch.optim.SGD(bb.parameters(), lr=0.1)
    for s in range(3):
        out = bb(torch.randn(4, 3))
        trained.wrap(out.sum(), index=torch.arange(s * 4, s * 4 + 4)).backward()
        opt.step()
        opt.zero_grad()
    assert trained.lam == 0.0
    bb2, fresh = make()
    bb2(torch.randn(4, 3))
    fresh.wrap(torch.tensor(1.0), index=torch.arange(4))
    assert fresh.stats["lambda"] == 1.0 and fresh.stats["loss_rela"] is not None
    fresh.load_state_dict(trained.state_dict())
    assert fresh.stats == {"lambda": 0.0, "loss_rela": None, "loss_ssl": None, "step": 3, "finished": True}


def test_grayscale_prior_says_it_turns_rgb_into_luminance():
    from accelerate_ssl.priors import create_prior

    prior = create_prior("shipped:fashion-mnist-byol")
    assert prior.preprocess.channels == 1
    with pytest.warns(UserWarning, match="luminance"):
        out = prior.preprocess(Image.fromarray(np.full((28, 28, 3), 100, dtype=np.uint8)))
    assert out.shape[0] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prior.preprocess(Image.fromarray(np.full((28, 28), 100, dtype=np.uint8)))  # grayscale input: no warning
