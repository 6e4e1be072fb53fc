"""solo-learn adapter: ReLAMixin on LightningModules that follow solo-learn's method contract (tests/solo_contract.py:
BaseMethod / BaseMomentumMethod with online and momentum classifiers, batches `[indexes, [X1, X2], targets]`, concrete
scalar `training_step`), trained with a real Trainer under both `lightning.pytorch` and `pytorch_lightning`; its DALI
wrapper's index slot; its data sets (dataset_with_index, no_labels listing, data.fraction); 2-process gloo DDP with
find_unused_parameters=False through the end of every schedule."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from accelerate_ssl.integrations.solo_learn import precompute_dataset
from accelerate_ssl.targets.store import TargetStoreMismatchError
from processes import assert_exited_cleanly, cpu_process_env
from solo_contract import IndexedTwoViews, make_methods
from solo_contract import targets as _targets

FLAVOURS = ["lightning.pytorch", "pytorch_lightning"]


def _trainer(pl, tmp_path, max_steps, **kw):
    from importlib import import_module

    loggers = import_module(f"{pl.__name__}.loggers")
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=loggers.CSVLogger(str(tmp_path)),
                      enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                      default_root_dir=str(tmp_path), num_sanity_val_steps=0, **kw)


def _loader():
    return DataLoader(IndexedTwoViews(), batch_size=8, shuffle=True)


@pytest.fixture(autouse=True)
def _quiet():
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_trains_with_a_real_trainer_head_changes_and_lambda_is_logged(tmp_path, flavour):
    pl = importlib.import_module(flavour)
    torch.manual_seed(0)
    _, _, BYOLReLA = make_methods(pl)
    model = BYOLReLA({"lr": 0.05}, rela_targets=_targets(), rela_schedule="decay")
    names = [g["name"] for g in model.learnable_params]
    assert names[-1] == "rela_head" and "backbone" in names
    assert any(n.startswith("rela_head.") for n in model.state_dict())  # registered submodule
    head_before = model.rela_head.weight.detach().clone()
    seen = []

    class Spy(pl.Callback):  # indexes reaching ReLA are batch[0]
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.append(batch[0].clone())

    trainer = _trainer(pl, tmp_path, max_steps=5, callbacks=[Spy()], enable_checkpointing=False)
    trainer.fit(model, _loader())

    assert not torch.equal(model.rela_head.weight.detach(), head_before)  # solo-learn's optimiser trained the head
    assert model.rela.steps == 5 and model.rela.head_mode == "user"
    assert any(model.rela_head.weight is p for g in trainer.optimizers[0].param_groups for p in g["params"])
    for key in ("rela/lambda", "rela/loss_rela", "rela/loss_ssl", "train_neg_cos_sim"):
        assert key in trainer.logged_metrics and key in trainer.callback_metrics, key
    assert float(trainer.logged_metrics["rela/lambda"]) == pytest.approx(model.rela.stats["lambda"])
    import csv

    rows = list(csv.DictReader(open(next(Path(trainer.logger.log_dir).glob("metrics.csv")))))
    logged = [float(r["rela/lambda"]) for r in rows if r.get("rela/lambda")]
    assert len(logged) == 5 and 0.0 < logged[0] <= 0.8 + 1e-6  # every step logged; the decay starts below 1
    assert logged == sorted(logged, reverse=True) and logged[-1] == 0.0  # planned for 5 steps: handed over by half
    assert 0.0 <= float(trainer.logged_metrics["rela/loss_rela"]) <= 2.0
    assert len(seen) == 5 and all(s.dtype == torch.long for s in seen)


def _plain_and_rela(pl, schedule):
    _, BYOLLike, BYOLReLA = make_methods(pl)
    model = BYOLReLA({"lr": 0.05}, rela_targets=_targets(), rela_schedule=schedule)
    plain = BYOLLike({"lr": 0.05})
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("rela_head")})
    for m in (model, plain):  # no trainer attached here
        m.log_dict = m.log = lambda *a, **k: None
    return model, plain


def _classifier_losses(model, batch):
    """solo-learn's online + momentum classifier losses, as its BaseMethod / BaseMomentumMethod compute them."""
    _, X, targets = batch
    online = sum(F.cross_entropy(model(x)["logits"], targets, ignore_index=-1) for x in X) / len(X)
    momentum = sum(F.cross_entropy(model.momentum_classifier(model.momentum_backbone(x)), targets) for x in X) / len(X)
    return online + momentum


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_only_the_ssl_loss_is_weighed_the_online_classifiers_keep_theirs(flavour):
    pl = importlib.import_module(flavour)
    torch.manual_seed(0)
    model, plain = _plain_and_rela(pl, "constant")
    batch = next(iter(DataLoader(IndexedTwoViews(), batch_size=8)))
    torch.manual_seed(3)
    wrapped = model.training_step(batch, 0)
    torch.manual_seed(3)
    total = plain.training_step(batch, 0)
    lam = model.rela.stats["lambda"]
    assert 0 < lam < 1
    classifier = _classifier_losses(plain, batch)
    feats = torch.cat([model.backbone(x) for x in batch[1]])
    target = model.rela.targets(batch[0], feats.device).repeat(2, 1)
    l_rela = (1 - F.cosine_similarity(model.rela_head(feats), target)).mean()
    expected = lam * l_rela.item() + (1 - lam) * (total.item() - classifier.item()) + classifier.item()
    assert wrapped.item() == pytest.approx(expected, rel=1e-5)
    assert model.rela.stats["loss_ssl"] == pytest.approx(total.item() - classifier.item(), rel=1e-5)
    # the classifiers get exactly the gradient they get without ReLA
    wrapped.backward()
    total.backward()
    for name in ("classifier", "momentum_classifier"):
        ours, theirs = getattr(model, name).weight.grad, getattr(plain, name).weight.grad
        assert theirs.abs().sum() > 0 and torch.allclose(ours, theirs, atol=1e-6), name


def test_online_classifier_trains_while_switch_keeps_lambda_at_one():
    import lightning.pytorch as pl

    torch.manual_seed(0)
    model, plain = _plain_and_rela(pl, "switch")
    batch = next(iter(DataLoader(IndexedTwoViews(), batch_size=8)))
    model.training_step(batch, 0).backward()
    plain.training_step(batch, 0).backward()
    assert model.rela.stats["lambda"] == 1.0
    assert torch.allclose(model.classifier.weight.grad, plain.classifier.weight.grad, atol=1e-6)
    assert model.classifier.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_checkpoint_resume_restores_rela_state(tmp_path, flavour):
    pl = importlib.import_module(flavour)
    torch.manual_seed(0)
    _, _, BYOLReLA = make_methods(pl)
    model = BYOLReLA({"lr": 0.05}, rela_targets=_targets())
    trainer = _trainer(pl, tmp_path, max_steps=4, enable_checkpointing=False)
    trainer.fit(model, _loader())
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(str(ckpt))
    saved = torch.load(ckpt, weights_only=False)
    assert saved["rela"]["steps"] == 4

    fresh = BYOLReLA({"lr": 0.05}, rela_targets=_targets())
    assert fresh.rela.steps == 0
    fresh.on_load_checkpoint(saved)
    fresh.load_state_dict(saved["state_dict"])
    a, b = model.rela.state_dict(), fresh.rela.state_dict()
    assert a["schedule"] == b["schedule"] and a["steps"] == b["steps"] == 4
    assert torch.equal(a["head"]["weight"], b["head"]["weight"]) and fresh.rela.lam == model.rela.lam

    # Trainer resume continues the same ReLA run
    resumed = BYOLReLA({"lr": 0.05}, rela_targets=_targets())
    trainer2 = _trainer(pl, tmp_path / "resume", max_steps=6, enable_checkpointing=False)
    trainer2.fit(resumed, _loader(), ckpt_path=str(ckpt))
    assert resumed.rela.steps == 6


def test_dummy_and_out_of_range_indexes_are_refused():
    import lightning.pytorch as pl

    _, _, BYOLReLA = make_methods(pl)
    model = BYOLReLA({"lr": 0.05}, rela_targets=_targets())
    model.log_dict = lambda *a, **k: None
    model.log = lambda *a, **k: None
    x = torch.rand(4, 1, 12, 12)
    with pytest.raises(ValueError, match="dummy indexes.*DALI"):
        model.training_step([torch.zeros(4, dtype=torch.long), [x, x], torch.zeros(4, dtype=torch.long)], 0)
    with pytest.raises(ValueError, match=r"span \[0, 99\].*48 rows.*solo:<data.train_path>"):
        model.training_step([torch.tensor([0, 1, 2, 99]), [x, x], torch.zeros(4, dtype=torch.long)], 0)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        model.training_step([torch.rand(4), [x, x], torch.zeros(4, dtype=torch.long)], 0)


class DALIStyleLoader:
    """What solo-learn's DALI wrapper yields without encode_indexes_into_labels: real images and labels, and the
    index slot filled with ``arange(batch_size) + rank * batch_size`` on every step."""

    def __init__(self, batch_size=8, steps=4, rank=0):
        self.batch_size, self.steps, self.rank = batch_size, steps, rank
        self.data = IndexedTwoViews()

    def __len__(self):
        return self.steps

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(self.steps):
            real = torch.randint(len(self.data), (self.batch_size,), generator=g)
            items = [self.data[int(i)] for i in real]
            views = [torch.stack([it[1][v] for it in items]) for v in range(2)]
            labels = torch.tensor([it[2] for it in items])
            yield [torch.arange(self.batch_size) + self.rank * self.batch_size, views, labels]


def test_dali_placeholder_indexes_are_refused_in_a_real_trainer(tmp_path):
    import lightning.pytorch as pl

    _, _, BYOLReLA = make_methods(pl)
    model = BYOLReLA({"lr": 0.05}, rela_targets=_targets())
    trainer = _trainer(pl, tmp_path, max_steps=4, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"same on two consecutive steps \(\[0, 1, 2, 3, 4, 5\]\.\.\.\).*48 rows.*DALI"):
        trainer.fit(model, DALIStyleLoader(rank=0))
    assert model.rela.steps == 1  # refused at the second step, before training on wrong rows again


def test_repeated_indexes_are_fine_when_one_batch_is_the_whole_data_set(tmp_path):
    import lightning.pytorch as pl

    _, _, BYOLReLA = make_methods(pl)
    model = BYOLReLA({"lr": 0.05}, rela_targets=_targets()[:8])
    trainer = _trainer(pl, tmp_path, max_steps=3, enable_checkpointing=False)
    trainer.fit(model, DataLoader(IndexedTwoViews(n=8), batch_size=8, shuffle=False))
    assert model.rela.steps == 3


def test_data_fraction_mismatch_is_refused_at_train_start(tmp_path):
    import lightning.pytorch as pl

    _, _, BYOLReLA = make_methods(pl)
    model = BYOLReLA({"lr": 0.05}, rela_targets=_targets())
    trainer = _trainer(pl, tmp_path, max_steps=2, enable_checkpointing=False)
    with pytest.raises(ValueError, match="training dataset has 24 samples but the target store has 48 rows"):
        trainer.fit(model, DataLoader(IndexedTwoViews(n=24), batch_size=8))


@pytest.mark.parametrize("name", ["decay", "switch", "epochs:0.5"])
def test_the_trainers_run_length_plans_the_schedule(tmp_path, name):
    import lightning.pytorch as pl

    from accelerate_ssl.schedules import create_schedule

    _, _, BYOLReLA = make_methods(pl)
    model = BYOLReLA({"lr": 0.05}, rela_targets=_targets(), rela_schedule=name)
    default = create_schedule(name, total_steps=1 if name.startswith("epochs") else None)
    trainer = _trainer(pl, tmp_path, max_steps=-1, max_epochs=5, enable_checkpointing=False)
    trainer.fit(model, _loader())  # 48 samples / 8 = 6 steps per epoch -> 30 steps
    assert trainer.estimated_stepping_batches == 30
    planned = create_schedule(name, total_steps=30)
    key = {"decay": "loss_momentum", "switch": "slow_momentum", "epochs:0.5": "switch_step"}[name]
    assert getattr(model.rela.schedule, key) == getattr(planned, key) != getattr(default, key)
    assert model.rela.steps == 30


def test_missing_targets_and_cfg_section():
    import lightning.pytorch as pl

    _, _, BYOLReLA = make_methods(pl)
    with pytest.raises(ValueError, match="needs ReLA targets"):
        BYOLReLA({"lr": 0.05})
    model = BYOLReLA({"lr": 0.05, "rela": {"targets": _targets(), "schedule": "switch", "head_lr": 0.01}})
    assert type(model.rela.schedule).__name__ == "Switch"
    assert model.learnable_params[-1]["lr"] == 0.01
    with pytest.raises(ValueError, match="Unknown key"):
        BYOLReLA({"lr": 0.05, "rela": {"targets": _targets(), "lamda": 1}})


# ---------------------------------------------------------------------------------------------- the data set solo trains on
def _write_images(folder, names):
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(names):
        rng = np.random.default_rng(k)
        Image.fromarray(rng.integers(0, 255, (12, 12), dtype=np.uint8), mode="L").save(folder / name)


def dataset_with_index(cls):
    """solo-learn's dataset_with_index: items ``(index, *items of cls)``."""

    class DatasetWithIndex(cls):
        def __getitem__(self, index):
            return (index, *super().__getitem__(index))

    return DatasetWithIndex


class CustomDatasetWithoutLabels(Dataset):
    """solo-learn's no_labels data set: ``self.images = os.listdir(root)``, items ``(image, -1)``."""

    def __init__(self, root, transform=None):
        self.root = Path(root)
        self.transform = transform
        self.images = os.listdir(root)

    def __getitem__(self, index):
        x = Image.open(self.root / self.images[index]).convert("RGB")
        return (self.transform(x) if self.transform is not None else x), -1

    def __len__(self):
        return len(self.images)


def _two_views(image):
    x = torch.from_numpy(np.asarray(image.convert("L"), dtype=np.float32) / 255.0)[None]
    return [x + 0.01 * torch.randn_like(x), x.flip(-1)]


def _precompute(args):
    from accelerate_ssl.cli import main

    assert main(["precompute", "--prior", "random:convnet", "--no-progress", "--batch-size", "16", *args]) == 0


def _fit_on(tmp_path, train_dataset, store):
    import lightning.pytorch as pl

    _, _, BYOLReLA = make_methods(pl)
    model = BYOLReLA({"lr": 0.05}, rela_targets=str(store), rela_n_components=8)
    trainer = _trainer(pl, tmp_path / "run", max_steps=2, enable_checkpointing=False)
    trainer.fit(model, DataLoader(train_dataset, batch_size=8, shuffle=True))
    return model


def test_a_store_over_another_file_order_is_refused_and_solo_no_labels_matches(tmp_path):
    flat = tmp_path / "unlabelled"
    _write_images(flat, [f"img_{k:03d}.png" for k in range(40)])
    train = dataset_with_index(CustomDatasetWithoutLabels)(flat, transform=_two_views)
    train.images = sorted(train.images)[::-1]  # a file system whose listing is not sorted

    _precompute(["--data", f"folder:{flat}", "--out", str(tmp_path / "sorted")])  # a flat folder works, sorted
    with pytest.raises(TargetStoreMismatchError, match="the same 40 files in another order.*solo:<data.train_path>"):
        _fit_on(tmp_path, train, tmp_path / "sorted")

    # the same listing solo-learn makes (os.listdir) -> accepted, and so is the store made from solo's own object
    train_listdir = dataset_with_index(CustomDatasetWithoutLabels)(flat, transform=_two_views)
    _precompute(["--data", f"solo-no-labels:{flat}", "--out", str(tmp_path / "listdir")])
    model = _fit_on(tmp_path, train_listdir, tmp_path / "listdir")
    assert model.rela.steps == 2

    from accelerate_ssl import create_prior, precompute_targets

    store = precompute_targets(create_prior("random:convnet"), precompute_dataset(train), tmp_path / "python", progress=False)
    assert _fit_on(tmp_path, train, store.path).rela.steps == 2


def _solo_fraction(dataset, fraction):
    """solo-learn's data.fraction: a class-stratified train_test_split of .samples with random_state=42."""
    from sklearn.model_selection import train_test_split

    files = [f for f, _ in dataset.samples]
    labels = [label for _, label in dataset.samples]
    files, _, labels, _ = train_test_split(files, labels, train_size=fraction, stratify=labels, random_state=42)
    dataset.samples = [tuple(p) for p in zip(files, labels)]
    return dataset


def test_data_fraction_is_reproduced_by_the_cli_and_by_precompute_dataset(tmp_path):
    from torchvision.datasets import ImageFolder

    root = tmp_path / "train"
    for c in range(3):
        _write_images(root / f"class{c}", [f"{c}_{k:02d}.png" for k in range(16)])
    train = _solo_fraction(dataset_with_index(ImageFolder)(str(root), transform=_two_views), 0.5)
    assert len(train) == 24

    _precompute(["--data", f"solo:{root}", "--fraction", "0.5", "--out", str(tmp_path / "half")])
    assert _fit_on(tmp_path, train, tmp_path / "half").rela.steps == 2

    _precompute(["--data", f"solo:{root}", "--out", str(tmp_path / "all")])
    with pytest.raises(TargetStoreMismatchError, match="24 samples but the target store has 48 rows.*--fraction"):
        _fit_on(tmp_path, train, tmp_path / "all")

    # another fraction of the same size (a different split) is refused by content, not just length
    other = _solo_fraction(dataset_with_index(ImageFolder)(str(root), transform=_two_views), 0.5)
    other.samples = other.samples[::-1]
    with pytest.raises(TargetStoreMismatchError, match=r"files in another order|different content"):
        _fit_on(tmp_path, other, tmp_path / "half")

    # solo's dataset itself cannot be precomputed; its clean view can, and gives the CLI's rows
    from accelerate_ssl import TargetStore, create_prior, precompute_targets

    with pytest.raises(TypeError, match="precompute_dataset"):
        precompute_targets(create_prior("random:convnet"), train, tmp_path / "bad", progress=False)
    via_python = precompute_targets(create_prior("random:convnet", in_channels=3), precompute_dataset(train), tmp_path / "py",
                                    progress=False)
    assert np.array_equal(via_python.array, TargetStore.open(tmp_path / "half").array)


# ---------------------------------------------------------------------------------------------- any spelling of the folder
def _gray_images(folder, names, first=0):
    """Image k of ``names`` is a flat gray of value ``10 + 5 * (first + k)``: a sample is known from its pixels."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(names):
        Image.new("L", (12, 12), color=10 + 5 * (first + k)).save(folder / name)


def _reference_rows(tmp_path, folder, name):
    """{gray value: store row} from a store computed over ``folder:<folder>`` (sorted file names), by reading each
    file's pixels: what row each image must get, independently of solo-learn's order."""
    from accelerate_ssl import TargetStore
    from accelerate_ssl.data.spec import open_data

    _precompute(["--data", f"folder:{folder}", "--out", str(tmp_path / name)])
    rows = TargetStore.open(tmp_path / name).array
    images = open_data(f"folder:{folder}")
    grays = [int(np.asarray(images[i][0].convert("L"))[0, 0]) for i in range(len(images))]
    assert len(set(grays)) == len(grays)
    return {g: rows[i] for i, g in enumerate(grays)}


def _fit_checking_rows(tmp_path, train_dataset, store, reference, cfg=None, steps=3):
    """Train with a real Trainer; at every step, the store row read for each index in ``batch[0]`` must be the row of
    the image actually in the batch (known from its gray value)."""
    import lightning.pytorch as pl

    from accelerate_ssl import TargetStore

    rows = TargetStore.open(store).array
    checked = []

    class OwnRows(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            for index, view in zip(batch[0].tolist(), batch[1][1]):  # view 2 is the image flipped, without noise
                gray = int(round(float(view.mean()) * 255))
                assert np.array_equal(rows[index], reference[gray]), (index, gray)
                checked.append(index)

    _, _, BYOLReLA = make_methods(pl)
    model = BYOLReLA({"lr": 0.05, **(cfg or {})}, rela_targets=str(store), rela_n_components=8)
    trainer = _trainer(pl, tmp_path / "run", max_steps=steps, callbacks=[OwnRows()], enable_checkpointing=False)
    trainer.fit(model, DataLoader(train_dataset, batch_size=8, shuffle=True))
    assert model.rela.steps == steps and len(checked) == 8 * steps
    return model


def _refused(tmp_path, train_dataset, store, match=r"files in another order|different content"):
    import lightning.pytorch as pl

    _, _, BYOLReLA = make_methods(pl)
    model = BYOLReLA({"lr": 0.05}, rela_targets=str(store), rela_n_components=8)
    with pytest.raises(TargetStoreMismatchError, match=match):
        _trainer(pl, tmp_path / "run", max_steps=1, enable_checkpointing=False).fit(
            model, DataLoader(train_dataset, batch_size=8, shuffle=True))
    assert model.rela.steps == 0


@pytest.mark.parametrize("store_path, train_path", [("absolute", "./datasets/train"), ("./datasets/train", "absolute"),
                                                    ("datasets//train/", "./datasets/../datasets/train")])
def test_labelled_train_path_spelled_relative_or_absolute_matches_and_every_row_is_the_samples_own(
        tmp_path, monkeypatch, store_path, train_path):
    from torchvision.datasets import ImageFolder

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "datasets" / "train"
    _gray_images(folder / "a", [f"{k}.png" for k in range(12)])
    _gray_images(folder / "b", [f"{k}.png" for k in range(12)], first=12)
    reference = _reference_rows(tmp_path, folder, "reference")
    spell = lambda p: str(folder) if p == "absolute" else p  # noqa: E731
    _precompute(["--data", f"solo:{spell(store_path)}", "--out", str(tmp_path / "store")])

    train = dataset_with_index(ImageFolder)(spell(train_path), transform=_two_views)  # as solo-learn builds it
    _fit_checking_rows(tmp_path, train, tmp_path / "store", reference)

    # the same names in another order are still another data set
    swapped = dataset_with_index(ImageFolder)(spell(train_path), transform=_two_views)
    swapped.samples[1], swapped.samples[2] = swapped.samples[2], swapped.samples[1]
    _refused(tmp_path, swapped, tmp_path / "store")


@pytest.mark.parametrize("store_path, train_path", [("./datasets/flat", "absolute"), ("absolute", "datasets//flat/"),
                                                    ("./datasets//flat/", "datasets/flat")])
def test_no_labels_bare_names_match_a_store_over_any_spelling_of_the_folder_and_every_row_is_the_samples_own(
        tmp_path, monkeypatch, store_path, train_path):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "datasets" / "flat"
    _gray_images(folder, [f"img_{k:03d}.png" for k in range(24)])
    reference = _reference_rows(tmp_path, folder, "reference")
    spell = lambda p: str(folder) if p == "absolute" else p  # noqa: E731
    _precompute(["--data", f"solo-no-labels:{spell(store_path)}", "--out", str(tmp_path / "store")])

    train = dataset_with_index(CustomDatasetWithoutLabels)(spell(train_path), transform=_two_views)
    assert all(os.sep not in name for name in train.images)  # solo-learn's .images: bare names under .root
    _fit_checking_rows(tmp_path, train, tmp_path / "store", reference)

    reordered = dataset_with_index(CustomDatasetWithoutLabels)(spell(train_path), transform=_two_views)
    reordered.images = reordered.images[1:] + reordered.images[:1]
    _refused(tmp_path, reordered, tmp_path / "store")
    other = dataset_with_index(CustomDatasetWithoutLabels)(spell(train_path), transform=_two_views)
    other.images = [name.replace("img_000", "img_zzz") for name in other.images]  # one file renamed
    _refused(tmp_path, other, tmp_path / "store")


def test_file_name_fingerprints_are_the_same_for_every_spelling_and_differ_for_another_order(tmp_path, monkeypatch):
    from torchvision.datasets import ImageFolder

    from accelerate_ssl.data.datasets import ImageFiles
    from accelerate_ssl.data.fingerprint import dataset_fingerprint

    monkeypatch.chdir(tmp_path)
    _gray_images(tmp_path / "data" / "train" / "a", ["0.png", "1.png", "2.png"])
    _gray_images(tmp_path / "data" / "flat", ["0.png", "1.png", "2.png"])
    (tmp_path / "data" / "x").mkdir()
    spellings = [str(tmp_path / "data" / "train"), "data/train", "./data/train/", "data//train", "data/x/../train",
                 tmp_path / "data" / "train"]
    prints = {json.dumps(dataset_fingerprint(ImageFolder(s))) for s in spellings}
    assert len(prints) == 1
    flat = [ImageFiles(s, order="sorted") for s in ("data/flat", str(tmp_path / "data/flat"), "./data/flat/")]
    flat += [CustomDatasetWithoutLabels(s) for s in ("data/flat", str(tmp_path / "data/flat"), "./data//flat")]
    for d in flat[3:]:
        d.images = sorted(d.images)
    assert len({json.dumps(dataset_fingerprint(d)) for d in flat}) == 1
    reordered = CustomDatasetWithoutLabels("./data/flat")
    reordered.images = sorted(reordered.images)[::-1]
    assert dataset_fingerprint(reordered) != dataset_fingerprint(flat[0])
    other_folder = ImageFolder("data/train")  # same names relative to the root, but in a sub-folder 'a' vs none
    assert dataset_fingerprint(other_folder)["sha256"] != dataset_fingerprint(flat[0])["sha256"]


# ---------------------------------------------------------------------------------------------- data.fraction, both kinds
def test_no_labels_fraction_reproduces_solos_split_from_the_cli_and_python_and_the_fix_message_works(tmp_path):
    from sklearn.model_selection import train_test_split

    from accelerate_ssl import TargetStore, create_prior, precompute_targets
    from accelerate_ssl.cli import main
    from accelerate_ssl.data.solo import solo_image_dataset
    from accelerate_ssl.data.spec import open_data

    flat = tmp_path / "flat"
    _gray_images(flat, [f"img_{k:03d}.png" for k in range(40)])
    reference = _reference_rows(tmp_path, flat, "reference")
    # solo-learn, solo/data/pretrain_dataloader.py, prepare_datasets(): data_fraction > 0 on a CustomDatasetWithoutLabels
    # (whose .images is os.listdir(root)) splits its names exactly so
    expected, _ = train_test_split(os.listdir(flat), train_size=0.4, random_state=42)
    assert len(expected) == 16 and expected != sorted(expected)

    for ours in (solo_image_dataset(flat, no_labels=True, fraction=0.4), open_data(f"solo-no-labels:{flat}", fraction=0.4)):
        assert [os.path.basename(path) for path, _ in ours.samples] == expected

    train = dataset_with_index(CustomDatasetWithoutLabels)(flat, transform=_two_views)
    train.images = expected  # what solo-learn trains on
    cfg = {"data": {"dataset": "custom", "train_path": str(flat), "no_labels": True, "fraction": 0.4}}
    _precompute(["--data", f"solo-no-labels:{flat}", "--fraction", "0.4", "--out", str(tmp_path / "cli")])
    assert len(TargetStore.open(tmp_path / "cli")) == 16
    _fit_checking_rows(tmp_path, train, tmp_path / "cli", reference, cfg=cfg)
    via_python = precompute_targets(create_prior("random:convnet", in_channels=3), precompute_dataset(train),
                                    tmp_path / "py", progress=False)
    assert np.array_equal(via_python.array, TargetStore.open(tmp_path / "cli").array)

    # a store over the whole folder is refused, and the command the message offers builds the right one
    import lightning.pytorch as pl

    _precompute(["--data", f"solo-no-labels:{flat}", "--out", str(tmp_path / "all")])
    _, _, BYOLReLA = make_methods(pl)
    model = BYOLReLA({"lr": 0.05, **cfg}, rela_targets=str(tmp_path / "all"), rela_n_components=8)
    with pytest.raises(TargetStoreMismatchError, match="16 samples but the target store has 40 rows") as refused:
        _trainer(pl, tmp_path / "run", max_steps=1, enable_checkpointing=False).fit(model, DataLoader(train, batch_size=8))
    command = str(refused.value).split("`")[1]
    assert command == (f"accelerate-ssl precompute --prior random:convnet --data solo-no-labels:{flat} --fraction 0.4 "
                       "--out DIR")
    assert main([*shlex.split(command.replace("DIR", str(tmp_path / "fixed")))[1:], "--no-progress"]) == 0
    _fit_checking_rows(tmp_path, train, tmp_path / "fixed", reference, cfg=cfg)


def test_a_fraction_of_zero_or_below_is_all_data_and_one_or_more_is_refused(tmp_path, capsys):
    from accelerate_ssl import TargetStore
    from accelerate_ssl.cli import main
    from accelerate_ssl.data.solo import solo_image_dataset

    flat, labelled = tmp_path / "flat", tmp_path / "labelled"
    _gray_images(flat, [f"{k}.png" for k in range(10)])
    _gray_images(labelled / "a", [f"{k}.png" for k in range(5)])
    _gray_images(labelled / "b", [f"{k}.png" for k in range(5)], first=5)
    # solo-learn, solo/data/pretrain_dataloader.py, prepare_datasets(): `if data_fraction > 0:` splits; else all data
    for fraction in (-1, -0.5, 0, 0.0):
        assert [p for p, _ in solo_image_dataset(flat, no_labels=True, fraction=fraction).samples] == \
            [str(flat / name) for name in os.listdir(flat)]
        assert len(solo_image_dataset(labelled, fraction=fraction)) == 10
    _precompute(["--data", f"solo-no-labels:{flat}", "--out", str(tmp_path / "none")])
    for fraction in ("-1", "0"):
        _precompute(["--data", f"solo-no-labels:{flat}", f"--fraction={fraction}", "--out", str(tmp_path / fraction)])
        a, b = TargetStore.open(tmp_path / "none"), TargetStore.open(tmp_path / fraction)
        assert np.array_equal(a.array, b.array)
        assert a.metadata["dataset"] == b.metadata["dataset"]  # the same data set, name and fingerprint
    _precompute(["--data", f"solo:{labelled}", "--fraction", "0", "--out", str(tmp_path / "labelled")])
    assert len(TargetStore.open(tmp_path / "labelled")) == 10
    for bad in ("1", "1.5", "nan", "half"):
        with pytest.raises(SystemExit) as exit_:
            main(["precompute", "--prior", "random:convnet", "--data", f"solo-no-labels:{flat}", "--fraction", bad,
                  "--out", str(tmp_path / "bad")])
        assert exit_.value.code == 2 and "--fraction must be a number below 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="must be below 1"):
        solo_image_dataset(flat, no_labels=True, fraction=1)


# ---------------------------------------------------------------------------------------------- DDP to the end
def test_two_process_ddp_without_unused_parameters_runs_past_the_end_of_every_schedule(tmp_path):
    out = tmp_path / "ddp.json"
    worker = Path(__file__).resolve().parent / "_solo_ddp_worker.py"
    env = cpu_process_env(PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(worker), str(out)],
                          cwd=tmp_path, env=env, text=True, capture_output=True, timeout=240)
    assert_exited_cleanly(done.returncode, done.stderr, env=env)
    result = json.loads(out.read_text())
    for name in ("switch", "decay", "epochs", "constant0"):
        r = result[name]
        assert r["finished"] and r["steps"] == r["global_step"] == 8, (name, r)
        assert r["steps_after_finish"] >= 4, (name, r)  # kept training with lambda = 0 and the head unused by ReLA
        assert r["head_equal_on_ranks"], name
    assert result["head_grad_all_reduce_by_rela"] == 0  # DDP averages the registered head; ReLA does not again


def test_a_method_whose_classifier_loss_cannot_be_found_is_warned_about():
    import lightning.pytorch as pl

    from accelerate_ssl.integrations.solo_learn import ReLAMixin

    _, BYOLLike, _ = make_methods(pl)

    class Renamed(BYOLLike):  # a method that computes its classifier loss outside _base_shared_step
        def _base_shared_step(self, X, targets):
            return self(X) | {"loss": torch.zeros(())}

    class RenamedReLA(ReLAMixin, Renamed):
        pass

    model = RenamedReLA({"lr": 0.05}, rela_targets=_targets())
    model.log_dict = model.log = lambda *a, **k: None
    model._base_shared_step = lambda X, targets: Renamed._base_shared_step(model, X, targets)  # bypass the mixin's
    batch = next(iter(DataLoader(IndexedTwoViews(), batch_size=8)))
    with pytest.warns(UserWarning, match="no loss of it came through _base_shared_step"):
        model.training_step(batch, 0)


def test_a_data_set_whose_samples_cannot_be_identified_is_refused_and_a_checked_one_is_not_warned_about(tmp_path):
    """Two-view items with no image and no file list to identify them by: the mixin stops with the reason (it used to
    warn and train on length alone). A solo data set that passes the check counts as checked for wrap(index=): no
    'no data set was checked' warning."""
    from accelerate_ssl import create_prior, precompute_targets
    from solo_contract import IndexedTwoViews

    images = [Image.fromarray((torch.rand(12, 12, generator=torch.Generator().manual_seed(k)) * 255).byte().numpy())
              for k in range(48)]
    store = precompute_targets(create_prior("random:convnet"), images, tmp_path / "s", progress=False)
    with pytest.raises(TargetStoreMismatchError, match="cannot identify the samples of solo-learn's training data set"):
        _fit_on(tmp_path, IndexedTwoViews(n=48), store.path)

    flat = tmp_path / "unlabelled"
    _write_images(flat, [f"img_{k:03d}.png" for k in range(40)])
    train = dataset_with_index(CustomDatasetWithoutLabels)(flat, transform=_two_views)
    _precompute(["--data", f"solo-no-labels:{flat}", "--out", str(tmp_path / "listdir")])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = _fit_on(tmp_path, train, tmp_path / "listdir")
    assert model.rela.steps == 2
    assert not [w for w in seen if "no data set was checked" in str(w.message)]
