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
                         use_multi_epochs_loader=multi_epochs, **{"persistent_workers": False, **kw})


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


REFUSAL = (r"mixes samples .*refuses mixed batches while its term runs, and under this schedule the term has no "
           r"planned end\. Either train without mixing \(timm's train\.py: --mixup 0 --cutmix 0, its defaults; "
           r"--mixup-off-epoch does not help: it turns mixing off only after that epoch\), or give ReLA's term an end, "
           r"ReLA\(\.\.\., end_step=N\) \(in timm's train\.py end_step=E \* updates_per_epoch")


def test_fast_collate_mixup_is_refused_under_a_schedule_without_an_end():
    model, rela = model_and_rela()  # Constant(0.5): a term without a planned end
    mix = FastCollateMixup(mixup_alpha=1.0, cutmix_alpha=1.0, label_smoothing=0.0, num_classes=N)
    dl = rela.track(loader(True, False, collate_fn=mix))
    with pytest.raises(ValueError, match=r"The tracked loader's collate function \(FastCollateMixup\) " + REFUSAL):
        next(iter(dl))
    dl.mixup_enabled = False  # switched off (before ReLA, or by the user): nothing mixed, nothing refused
    for x, label in dl:
        assert torch.equal(decode(x, True), label.argmax(1))  # unmixed one-hot labels
        rela.wrap(model(x).sum())
        assert torch.equal(rela.targets.calls[-1][0], decode(x, True))


def test_in_loop_mixup_is_refused_under_a_schedule_without_an_end():
    """timm's train.py without its prefetcher mixes in the loop: `input, target = mixup_fn(input, target)`."""
    from timm.data import Mixup

    model, rela = model_and_rela()
    mix = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.0, num_classes=N)
    x, y = torch.rand(4, 3, SIZE, SIZE), torch.arange(4)
    with pytest.raises(ValueError, match="timm's Mixup called in the training loop " + REFUSAL):
        mix(x, y)
    mix.mixup_enabled = False
    mixed, target = mix(x, y)
    assert torch.equal(mixed, x)
    rela.schedule = Constant(0.0)  # ReLA has handed over for good: mixing is the user's again
    mix.mixup_enabled = True
    mix(x, y)


def _hand_over_run(mixup_in_loop: bool, workers: int = 0, multi_epochs: bool = False, off_epoch: int = 99):
    """Three epochs of timm's train.py loop with mixup/cutmix on (--mixup 1 --cutmix 1) and ReLA's term ending after
    the first epoch (end_step=1 * updates_per_epoch, the default decay schedule). Returns per epoch whether each batch
    was mixed, and ReLA's lambda at each step."""
    from timm.data import Mixup

    torch.manual_seed(0)
    np.random.seed(0)  # timm's mixers draw from numpy
    model = timm.create_model("test_resnet", pretrained=False, num_classes=N)
    mix_args = dict(mixup_alpha=1.0, cutmix_alpha=1.0, label_smoothing=0.0, num_classes=N)
    mixup_fn = Mixup(**mix_args) if mixup_in_loop else None
    loader_train = loader(not mixup_in_loop, multi_epochs, workers, persistent_workers=workers > 0,
                          collate_fn=None if mixup_in_loop else FastCollateMixup(**mix_args))
    updates_per_epoch = len(loader_train)
    rela = ReLA(target_rows(), model.get_classifier(), capture="input", n_components=None, dataset=IndexImages(),
                schedule="decay", total_steps=3 * updates_per_epoch, end_step=1 * updates_per_epoch, witness=False)
    loader_train = rela.track(loader_train)
    rela.targets = Spy(rela.targets)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mixed, lambdas = [], []
    for epoch in range(3):
        if epoch >= off_epoch:  # train.py --mixup-off-epoch, as its train_one_epoch does it
            if mixup_fn is None:
                loader_train.mixup_enabled = False
            else:
                mixup_fn.mixup_enabled = False
        mixed.append([])
        for x, y in loader_train:
            if mixup_fn is not None:
                x0 = x
                x, y = mixup_fn(x, y)
                unmixed = torch.equal(x, x0) and torch.equal(y.argmax(1), decode(x0, False))
            else:
                unmixed = torch.equal(decode(x, True), y.argmax(1)) and bool((y.max(1).values == 1).all())
            mixed[-1].append(not unmixed)
            loss = rela.wrap(nn.functional.cross_entropy(model(x), y))
            if not rela.stats["finished"]:  # while the term runs: this batch's own rows
                used, _ = rela.targets.calls[-1]
                assert torch.equal(used, decode(x, not mixup_in_loop))
            lambdas.append(rela.stats["lambda"])
            loss.backward()
            opt.step()
            opt.zero_grad()
    return mixed, lambdas, updates_per_epoch


@pytest.mark.parametrize("mixup_in_loop, workers, multi_epochs", [
    (True, 0, False),  # --no-prefetcher: timm's Mixup in the loop
    (False, 0, False),  # the prefetcher's FastCollateMixup, collated in this process
    (False, 1, False),  # ... in a persistent worker process (timm's default with --workers > 0)
    (False, 1, True),  # ... in the one iterator of --use-multi-epochs-loader
])
def test_mixup_is_held_while_rela_runs_and_mixes_after_end_step(mixup_in_loop, workers, multi_epochs):
    """With an end step, timm's mixers are held off while ReLA's term runs (every batch unmixed, every row the
    sample's own), and mix from the first epoch after it, under the decay schedule (its lambda never 0 by itself, so
    the end step alone decides); timm's --mixup-off-epoch
    still turns them off later."""
    with pytest.warns(UserWarning, match=r"ReLA holds timm's .* off while its term runs .* after optimiser step 6"):
        mixed, lambdas, per_epoch = _hand_over_run(mixup_in_loop, workers, multi_epochs, off_epoch=2)
    assert per_epoch == 6 and not any(mixed[0])  # ReLA's epoch: nothing mixed
    assert all(lam > 0 for lam in lambdas[:6]) and lambdas[6:] == [0.0] * 12  # decay's lambda, then the end
    assert sum(mixed[1]) >= 5  # mixup / cutmix on again (a cut box can round to nothing)
    assert not any(mixed[2])  # --mixup-off-epoch 2: off again, in the worker processes too


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


# ------------------------------------------------------------------------------------------ AugMix (--aug-splits)
@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """timm's own data set over 16 PNG files (two class folders): image k, in timm's file order, is the constant colour
    5 * k; and targets precomputed over it (rows in that order, the file list recorded)."""
    from timm.data import create_dataset

    from accelerate_ssl.targets.precompute import precompute_targets
    from accelerate_ssl.priors import create_prior

    root = tmp_path_factory.mktemp("timm-folder")
    for k in range(16):
        (root / "train" / f"c{k // 8}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((SIZE, SIZE, 3), 5 * k, dtype=np.uint8)).save(root / "train" / f"c{k // 8}" / f"{k % 8}.png")
    clean = create_dataset("", root=str(root / "train"))
    store = precompute_targets(create_prior("random:convnet", in_channels=3), clean, root / "targets", progress=False)
    return root / "train", store


def test_augmix_splits_train_with_the_readme_lines_on_timms_augmix_dataset(image_folder):
    """train.py --aug-splits 2 wraps its data set in AugMixDataset (item i: item i's clean split plus an augmented one)
    and the prefetcher stacks the splits as blocks of the batch. `dataset=dataset_train` (the wrapper, as the README's
    lines pass it) is identified by the files underneath, and every split of a sample is pulled to that sample's row."""
    from timm.data import AugMixDataset, create_dataset

    folder, store = image_folder
    dataset_train = AugMixDataset(create_dataset("", root=str(folder)), num_splits=2)
    loader_train = create_loader(dataset_train, input_size=(3, SIZE, SIZE), batch_size=4, is_training=True,
                                 num_aug_splits=2, num_workers=0, device=torch.device("cpu"), use_prefetcher=True)
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", pretrained=False, num_classes=2)
    rela = ReLA(store.path, model.get_classifier(), capture="input", dataset=dataset_train, total_steps=4,
                witness=False)  # (the prior re-embedding inputs: its own tests; here the rows are read off the pixels)
    loader_train = rela.track(loader_train)
    rela.targets = Spy(rela.targets)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen, checked = [], 0
    for x, y in loader_train:
        assert len(x) == 8  # 4 samples x 2 splits, the clean split first
        clean = (decode(x[:4], True).double() / 5).round().long()
        calls = len(rela.targets.calls)
        loss = rela.wrap(nn.functional.cross_entropy(model(x), y))
        if rela.stats["loss_rela"] is not None:  # the term ran (until the default schedule hands over)
            used, _ = rela.targets.calls[-1]
            assert torch.equal(used, clean)  # each sample's own row, for both of its splits
            checked += 1
        else:
            assert len(rela.targets.calls) == calls  # handed over: no row read
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen += clean.tolist()
    assert sorted(seen) == list(range(16)) and rela.steps == 4 and checked >= 2


# ------------------------------------------------------------------------------------------ DDP on the CPU
def test_timm_style_ddp_on_the_cpu_under_two_gloo_processes(image_folder, tmp_path):
    """timm's train.py passes device_ids=[device] to DDP, which DDP refuses for a CPU module; with device_ids=None
    (the one change, tests/_timm_ddp_worker.py) a script built of train.py's own pieces runs the README's lines under
    torchrun on 2 gloo processes: each process trains its DistributedSampler's share, every row ReLA looks up is its
    sample's own, and lambda and the transport head are the same on both processes at every step."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from processes import assert_exited_cleanly, cpu_process_env

    folder, store = image_folder
    here = Path(__file__).resolve()
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = cpu_process_env(PYTHONPATH=str(here.parents[1]), RELA_TARGETS=str(store.path))
    done = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(here.with_name("_timm_ddp_worker.py")),
                           str(folder), str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert_exited_cleanly(done.returncode, done.stderr, env=env)
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]
    for r in ranks:
        assert r["world_size"] == 2 and r["updates_per_epoch"] == 4 and r["rela_steps"] == 8
        assert any(step["rows"] is not None for step in r["steps"])
        for step in r["steps"]:  # each process's rows are its own samples' (until ReLA hands over: none read)
            assert step["rows"] is None or step["rows"] == step["samples"]
    for epoch in (0, 1):  # the two processes share every epoch's samples, each sample once
        shares = [sum((s["samples"] for s in r["steps"] if s["epoch"] == epoch), []) for r in ranks]
        assert sorted(shares[0] + shares[1]) == list(range(16)) and not set(shares[0]) & set(shares[1])
    assert [s["lambda"] for s in ranks[0]["steps"]] == [s["lambda"] for s in ranks[1]["steps"]]
    assert ranks[0]["head"] == ranks[1]["head"]  # the head's gradients are averaged across the processes
    saved = torch.load(tmp_path / "rela-1.pth")  # the README's save line, on rank 0 after each epoch
    assert saved["steps"] == 8 and saved["store_rows"] == 16


def test_the_readme_lines_are_the_workers_and_their_count_is_stated():
    """Every line of the timm page's train.py block is a line of the worker that runs them under torchrun (above),
    which the page includes whole, and the page's count is the block's: one line changed (the loss), every other one
    added."""
    from pathlib import Path

    from recipe_check import HOSTS, code, includes, page_recipe

    added, changed, block = page_recipe("Then add these lines to `train.py`", HOSTS / "timm.md")
    worker_file = Path(__file__).with_name("_timm_ddp_worker.py")
    assert includes(HOSTS / "timm.md", worker_file)  # the page shows the script the test runs
    worker = {code(line) for line in (Path(__file__).with_name("_timm_ddp_worker.py")).read_text().splitlines()}
    assert [line for line in block if line not in worker] == []
    replaced = [line for line in block if line.startswith("_loss = ")]  # train.py's `_loss = result['loss']`
    assert (added, changed) == (len(block) - len(replaced), len(replaced)) == (8, 1)
