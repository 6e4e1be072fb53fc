"""ReLACallback with a real Lightning Trainer (single process, and 2-process gloo DDP launched by Lightning itself), and
the head staying identical across processes when a plain DDP loop steps its optimiser with a closure. The README's
Lightning and Lightning DDP recipes run as written in scripts shaped like lightly's Lightning examples
(tests/recipes/lightning_byol.py, lightning_ddp_byol.py), their lines counted.

Every batch is checked: the images carry their own dataset index (tests/_lightning_ddp_worker.py), so each test
compares the indices ReLA was handed and the target rows it read with those of the samples actually in the batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Sampler

from accelerate_ssl.integrations.lightning import ReLACallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _lightning_ddp_worker import IndexImages, make_module, target_rows  # noqa: E402
from processes import assert_exited_cleanly, cpu_process_env  # noqa: E402
from recipe_check import HOSTS, assert_every_row_is_the_samples_own, assert_hands_over, check_recipe, read_logs  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_lightning_ddp_worker.py"
RECIPES = Path(__file__).resolve().parent / "recipes"


def _env():
    root = str(Path(__file__).resolve().parents[1])
    return cpu_process_env(PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))


def _assert_every_row_is_the_samples_own(steps_seen):
    assert steps_seen
    for s in steps_seen:
        assert torch.equal(s["published"], s["own"])  # the indices ReLA was handed are the batch's own
        if s["lambda"] > 0:
            assert s["n_new_reads"] == 1 and torch.equal(s["read"], s["expected"])  # ... and so are the rows it read
        else:
            assert s["n_new_reads"] == 0  # lambda 0 for good: no lookup


def _trainer(**kwargs):
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


class StopAfter(pl.Callback):
    """Interrupts the fit at the end of epoch ``epochs`` (None: runs to ``max_epochs``): the first part of a run that a
    checkpoint then resumes."""

    def __init__(self, epochs=None):
        self.epochs = epochs

    def on_train_epoch_end(self, trainer, module):
        if self.epochs is not None and trainer.current_epoch + 1 == self.epochs:
            trainer.should_stop = True


def test_single_process_a_fresh_loader_with_workers_every_epoch_and_accumulation():
    Student = make_module(pl, head_in_user_optimizer=False)

    class FreshLoaders(Student):  # a new DataLoader each time Lightning asks (reload_dataloaders_every_n_epochs=1)
        def train_dataloader(self):
            return DataLoader(IndexImages(), batch_size=6, shuffle=True, num_workers=2)

    model = FreshLoaders()
    loaders = []

    class Watch(pl.Callback):
        def on_train_epoch_start(self, trainer, module):
            loaders.append(trainer.train_dataloader)

    trainer = _trainer(max_epochs=3, reload_dataloaders_every_n_epochs=1, accumulate_grad_batches=2,
                       callbacks=[ReLACallback(target_rows(), schedule="epochs:0.5", n_components=None), Watch()])
    trainer.fit(model)
    assert len({id(dl) for dl in loaders}) == 3  # Lightning iterated a new loader every epoch
    _assert_every_row_is_the_samples_own(model.steps_seen)
    assert len(model.steps_seen) == 3 * 7  # 40 items in batches of 6
    # planned for the Trainer's run length: 3 epochs x 4 optimiser steps (7 batches, accumulating 2)
    assert trainer.estimated_stepping_batches == 12 == model.rela.steps
    assert model.rela.schedule.switch_step == 6
    assert [s["lambda"] for s in model.steps_seen].count(1.0) == 11  # steps 1-6: batches 0-10
    assert model.rela.head_mode == "own"
    metrics = trainer.callback_metrics  # logged through module.log
    assert {"rela/lambda", "rela/loss_ssl"} <= set(metrics) and isinstance(metrics["rela/lambda"], torch.Tensor)


class UnsizedShuffle(Sampler):
    """A fresh permutation each pass and no ``__len__``; counts the indices drawn in the current pass."""

    def __init__(self, n):
        self.n, self.passes, self.drawn = n, 0, 0

    def __iter__(self):
        self.passes, self.drawn = self.passes + 1, 0
        for i in torch.randperm(self.n, generator=torch.Generator().manual_seed(self.passes)).tolist():
            self.drawn += 1
            yield i


def test_batches_lightning_reads_ahead_are_popped_oldest_first():
    """Lightning's fetcher reads one batch ahead of a loader without a length, so two batches are queued at every pop;
    the first epoch is cut short (on_train_batch_start returns -1), leaving a yielded batch training never gets."""
    Student = make_module(pl, head_in_user_optimizer=False)
    sampler = UnsizedShuffle(40)
    ahead = []  # per training_step: indices drawn in this pass beyond the batches delivered so far

    class ReadAhead(Student):
        def train_dataloader(self):
            # 8 batches of 5: a batch popped from the wrong end is not caught by a size mismatch
            return DataLoader(IndexImages(), batch_size=5, sampler=sampler)

        def on_train_batch_start(self, batch, batch_idx):
            if self.current_epoch == 0 and batch_idx == 2:
                return -1  # the rest of this epoch is skipped
            self.delivered = (0 if batch_idx == 0 else self.delivered) + len(batch[1])
            ahead.append(sampler.drawn - self.delivered)

    model = ReadAhead()
    trainer = _trainer(max_epochs=2, callbacks=[
        ReLACallback(target_rows(), schedule="epochs:0.5", n_components=None, total_steps=10)])
    trainer.fit(model)
    # Lightning held the next batch whenever training_step ran, but for the last of the pass
    assert ahead == [5, 5] + [5] * 7 + [0]
    assert len(model.steps_seen) == 2 + 8 and model.rela.steps == 10 and sampler.passes == 2
    _assert_every_row_is_the_samples_own(model.steps_seen)


def test_two_process_ddp_distributed_sampler_reload_accumulation_clipping(tmp_path):
    # Lightning launches rank 1 itself by re-running the worker script
    env = _env()
    done = subprocess.run([sys.executable, str(WORKER), "lightning", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert_exited_cleanly(done.returncode, done.stderr, done.stdout, env=env)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    r0, r1 = ranks
    assert r0["world_size"] == 2
    for r in ranks:
        _assert_every_row_is_the_samples_own(r["steps_seen"])
        assert len(set(r["loaders"])) == 3  # a new loader each epoch, with Lightning's DistributedSampler
        # per-rank run length: 20 samples -> 5 batches -> 3 optimiser steps per epoch (the global loader would say 5)
        assert r["estimated"] == 9 == r["global_step"] == r["rela_steps"] == r["optimizer_steps"]
        assert r["switch_step"] == round(0.5 * 9)
        # the head's gradients were averaged exactly once per optimiser step that had them (weight and bias in one
        # flattened all-reduce)
        assert r["steps_with_head_grad"] == r["switch_step"] and r["head_all_reduce"] == r["steps_with_head_grad"]
    for epoch in range(3):  # the distributed sampler split every epoch between the ranks
        own = [torch.cat([s["own"] for s in r["steps_seen"][5 * epoch:5 * epoch + 5]]) for r in ranks]
        assert sorted(torch.cat(own).tolist()) == list(range(40))
    assert len(r0["head"]) == len(r1["head"]) == 15
    for h0, h1, b0, b1 in zip(r0["head"], r1["head"], r0["backbone"], r1["backbone"]):
        assert torch.equal(h0, h1) and torch.equal(b0, b1)  # bit-identical after every batch
    assert not torch.equal(r0["head"][0], r0["head"][-1])  # the user's optimiser trained the head


def test_checkpoint_resume_continues_lambda_and_the_head_exactly(tmp_path):
    Student = make_module(pl, head_in_user_optimizer=True)

    def run(max_epochs, stop_after=None, ckpt_path=None):
        torch.manual_seed(0)
        model = Student()

        callback = ReLACallback(target_rows(), dataset=IndexImages(), schedule="epochs:0.7", n_components=None)
        trainer = _trainer(max_epochs=max_epochs, callbacks=[callback, StopAfter(stop_after)])
        trainer.fit(model, DataLoader(IndexImages(), batch_size=8), ckpt_path=ckpt_path)
        return trainer, model

    _, whole = run(2)
    trainer, first = run(2, stop_after=1)
    assert first.rela.steps == 5
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    _, resumed = run(2, ckpt_path=str(tmp_path / "epoch1.ckpt"))
    _assert_every_row_is_the_samples_own(resumed.steps_seen)
    assert resumed.rela.steps == whole.rela.steps == 10
    assert [s["lambda"] for s in resumed.steps_seen] == [s["lambda"] for s in whole.steps_seen[5:]] == [1.0, 1.0, 0.0, 0.0, 0.0]
    for a, b in zip(resumed.rela.parameters(), whole.rela.parameters()):
        assert torch.equal(a, b)
    assert resumed.rela.schedule.state_dict() == whole.rela.schedule.state_dict()


def test_several_priors_are_logged_each_and_resume_exactly(tmp_path):
    """Two priors through one callback: each prior's loss, weight and lambda logged; the checkpoint holds both heads and
    the dropping draws, so a resumed run continues both exactly."""
    import torch.nn.functional as F
    from torch import nn

    from _lightning_ddp_worker import DIM, SIDE

    class Two(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Flatten(), nn.Linear(SIDE * SIDE, DIM), nn.Tanh())
            self.projection = nn.Linear(DIM, 4)

        def training_step(self, batch, batch_idx):
            (x0, x1), _ = batch
            loss = -F.cosine_similarity(self.projection(self.backbone(x0)), self.projection(self.backbone(x1))).mean()
            return self.rela.wrap(loss)

        def configure_optimizers(self):
            return torch.optim.SGD([*self.parameters(), *self.rela.parameters()], lr=0.1)

    rows = target_rows()
    priors = {"a": rows, "b": 10 * torch.stack([rows[:, 1] * rows[:, 2], rows[:, 3] - rows[:, 4]], 1) + 3}

    def run(stop_after=None, ckpt_path=None):
        torch.manual_seed(0)
        model = Two()

        callback = ReLACallback(priors, dataset=IndexImages(), schedule="epochs:0.7", n_components=None, balance="drop")
        trainer = _trainer(max_epochs=2, callbacks=[callback, StopAfter(stop_after)])
        trainer.fit(model, DataLoader(IndexImages(), batch_size=8), ckpt_path=ckpt_path)
        return trainer, model

    trainer, whole = run()
    metrics = trainer.callback_metrics
    assert {f"rela/{n}/{k}" for n in "ab" for k in ("loss_rela", "weight", "lambda")} <= set(metrics)
    assert abs(float(metrics["rela/a/weight"]) + float(metrics["rela/b/weight"]) - 1) < 1e-6
    trainer, first = run(stop_after=1)
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    _, resumed = run(ckpt_path=str(tmp_path / "epoch1.ckpt"))
    assert resumed.rela.steps == whole.rela.steps == 10
    for name in "ab":
        for p, q in zip(resumed.rela.priors[name].head.parameters(), whole.rela.priors[name].head.parameters()):
            assert torch.equal(p, q)
    assert resumed.rela.schedule.state_dict() == whole.rela.schedule.state_dict()


def test_closure_stepped_ddp_loop_keeps_the_head_identical_on_both_processes(tmp_path):
    env = _env()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(WORKER), "closure",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)
    assert_exited_cleanly(done.returncode, done.stderr, done.stdout, env=env)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for mode in ("user", "own"):  # the head in the user's optimiser, or in ReLA's own
        assert len(r0[mode]) == 4
        for h0, h1 in zip(r0[mode], r1[mode]):
            assert torch.equal(h0, h1)
        assert not torch.equal(r0[mode][0], r0[mode][-1])


def test_refused_without_a_trackable_loader():
    Student = make_module(pl)

    class Listed(Student):
        def train_dataloader(self):
            return [DataLoader(IndexImages(), batch_size=8), DataLoader(IndexImages(), batch_size=8)]

    with pytest.raises(ValueError, match="iterates 2 training loaders"):
        _trainer(max_epochs=1, callbacks=[ReLACallback(target_rows(), dataset=IndexImages())]).fit(Listed())


def test_the_loader_lightning_iterates_is_checked_against_the_store(tmp_path):
    """dataset= is the clean set, but train_dataloader() serves another order: refused before the first step."""
    import numpy as np

    from accelerate_ssl.data import ArrayImageDataset
    from accelerate_ssl.targets.precompute import precompute_targets
    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.targets.store import TargetStoreMismatchError

    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (40, 8, 8), dtype=np.uint8), np.zeros(40, dtype=np.int64)
    clean = ArrayImageDataset(images, labels)
    store = precompute_targets(create_prior("random:convnet"), clean, tmp_path / "store", batch_size=16, progress=False)
    to_tensor = lambda im: torch.from_numpy(np.asarray(im, dtype=np.float32) / 255).unsqueeze(0)  # noqa: E731
    reordered = ArrayImageDataset(images[::-1].copy(), labels, transform=to_tensor)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8))

        def training_step(self, batch, batch_idx):
            return self.rela.wrap(self.backbone(batch[0]).pow(2).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.backbone.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(reordered, batch_size=8)

    trainer = _trainer(max_epochs=1, callbacks=[ReLACallback(store, dataset=clean, feature_dim=8, total_steps=5)])
    with pytest.raises(TargetStoreMismatchError, match="different content or another order"):
        trainer.fit(Module())


# ---------------------------------------------------------------------------------------------- the README's recipes
def _recipe(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    env = cpu_process_env(PYTHONPATH=os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")]),
                          RECIPE_LOG=str(tmp_path / "log"))
    done = subprocess.run([sys.executable, str(RECIPES / script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def test_the_lightning_recipe_is_three_added_and_two_changed_lines_of_lightlys_example():
    assert check_recipe(RECIPES / "lightning_byol.py", "For lightly's `examples/pytorch_lightning/byol.py`",
                        HOSTS / "lightning.md") == (3, 2)


def test_the_lightning_ddp_recipe_is_two_added_and_one_changed_line_of_lightlys_example():
    assert check_recipe(RECIPES / "lightning_ddp_byol.py",
                        "For lightly's `examples/pytorch_lightning_distributed/byol.py`", HOSTS / "lightning.md") == (2, 1)


def test_the_lightning_recipe_runs_as_written(tmp_path, fashion_mnist_available):
    """lightly's Lightning BYOL example with the README's lines, on 64 Fashion-MNIST images: the callback made the
    targets of the loader's data set itself and every row read in the 10 epochs is the sample's own."""
    _recipe("lightning_byol.py", tmp_path)
    steps = read_logs(tmp_path / "log")[0]
    assert len(steps) == 10 * 2
    assert_every_row_is_the_samples_own(steps)
    assert_hands_over([s["lambda"] for s in steps], 20)  # planned for the Trainer's 20 steps
    assert len(list((tmp_path / "rela-targets").glob("shipped-digits-byol-64-*/metadata.json"))) == 1


def test_the_lightning_ddp_recipe_runs_as_written_on_two_processes(tmp_path, fashion_mnist_available):
    """lightly's distributed Lightning BYOL example with the README's lines, 2 gloo processes: the processes made the
    store together (one folder, both counted in it), each trained its half of every epoch on its own rows, with the
    same lambda."""
    from accelerate_ssl.targets.store import TargetStore

    _recipe("lightning_ddp_byol.py", tmp_path)
    ranks = read_logs(tmp_path / "log", ranks=2)
    for steps in ranks:
        assert len(steps) == 4 * 2  # 4 epochs of 128 images, 64 per process, batches of 32
        assert_every_row_is_the_samples_own(steps)
    assert [s["lambda"] for s in ranks[0]] == [s["lambda"] for s in ranks[1]]
    assert ranks[0][-1]["lambda"] < ranks[0][0]["lambda"]  # lambda moved (the same on both means something)
    for epoch in range(4):
        own = [i for steps in ranks for s in steps[2 * epoch:2 * epoch + 2] for i in s["own"]]
        assert sorted(own) == list(range(128))
    stores = [p.parent for p in (tmp_path / "rela-targets").glob("*/metadata.json")]
    assert len(stores) == 1 and TargetStore.open(stores[0]).metadata["num_processes"] == 2


def test_the_cheap_step_under_lightning_ddp_with_find_unused_parameters(tmp_path, fashion_mnist_available):
    """What the DDP section says keeps the cheap step: the recipe with its loss written as a callable (inputs=x0) and
    strategy="ddp_find_unused_parameters_true". While lambda is 1 neither process runs the momentum network or the
    prediction head; after the hand-over both run in full; every row is the sample's own; the two processes' backbones
    end identical (their gradients averaged whichever forward ran)."""
    source = (RECIPES / "lightning_ddp_byol.py").read_text()
    eager = """        p0 = self.forward(x0)
        z0 = self.forward_momentum(x0)
        p1 = self.forward(x1)
        z1 = self.forward_momentum(x1)
        loss = self.rela.wrap(0.5 * (self.criterion(p0, z1) + self.criterion(p1, z0)))"""
    callable_form = """        def byol_loss():
            p0 = self.forward(x0)
            z0 = self.forward_momentum(x0)
            p1 = self.forward(x1)
            z1 = self.forward_momentum(x1)
            return 0.5 * (self.criterion(p0, z1) + self.criterion(p1, z0))

        loss = self.rela.wrap(byol_loss, inputs=x0)"""
    assert eager in source and 'strategy="ddp",' in source and "model = BYOL()\n" in source
    source = source.replace(eager, callable_form).replace('strategy="ddp",', 'strategy="ddp_find_unused_parameters_true",')
    source = source.replace("model = BYOL()\n", "model = BYOL()\nlog.count_calls(model.backbone_momentum, model.prediction_head)\n")
    source += ("import os\ntorch.save(model.backbone.state_dict(), "
               "os.path.join(os.environ['RECIPE_LOG'], f'backbone-{trainer.global_rank}.pt'))\n")
    script = tmp_path / "lightning_ddp_byol_callable.py"
    script.write_text(source)
    root = Path(__file__).resolve().parents[1]
    env = cpu_process_env(PYTHONPATH=os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")]),
                          RECIPE_LOG=str(tmp_path / "log"))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    ranks = read_logs(tmp_path / "log", ranks=2)
    for steps in ranks:
        assert_every_row_is_the_samples_own(steps)
        assert_hands_over([s["lambda"] for s in steps], 8)
        cheap = [s for s in steps if s["lambda"] == 1.0]
        full = [s for s in steps if s["lambda"] == 0.0]
        assert cheap and {s["ssl_calls"] for s in cheap} == {0}  # the SSL side never ran while lambda was 1
        assert full and {s["ssl_calls"] for s in full} == {4}  # both views through both, once handed over
    b0, b1 = (torch.load(tmp_path / "log" / f"backbone-{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(b0[k], b1[k]) for k in b0)


def test_from_prior_makes_the_targets_of_the_loader_lightning_iterates_and_resumes_exactly(tmp_path):
    """ReLACallback.from_prior builds ReLA when Lightning hands over the training loader (the targets of its data set's
    clean view, made once under cache_dir), hands each step its batch's indices, and a checkpoint Lightning restores
    before that (trainer.fit(ckpt_path=...)) is applied once ReLA exists: lambda and the head continue exactly."""
    import numpy as np

    from accelerate_ssl.data import ArrayImageDataset

    images = np.random.default_rng(0).integers(0, 256, (40, 8, 8), dtype=np.uint8)
    to_tensor = lambda im: torch.from_numpy(np.asarray(im, dtype=np.float32) / 255).unsqueeze(0)  # noqa: E731
    data = ArrayImageDataset(images, np.arange(40), transform=to_tensor)  # label i: the item's own index

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8), torch.nn.Tanh())
            self.seen = []

        def training_step(self, batch, batch_idx):
            x, own = batch
            loss = self.rela.wrap(self.backbone(x).pow(2).mean())
            self.seen.append((self.rela._current_index.clone(), own.clone(), self.rela.stats["lambda"]))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.backbone.parameters(), lr=0.1)

    def run(max_epochs, stop_after=None, ckpt_path=None):
        torch.manual_seed(0)
        model = Module()

        callback = ReLACallback.from_prior("random:convnet", cache_dir=tmp_path / "cache", progress=False,
                                           schedule="epochs:0.7", n_components=None)
        assert callback.rela is None  # nothing is built before Lightning hands over the loader
        trainer = _trainer(max_epochs=max_epochs, callbacks=[callback, StopAfter(stop_after)])
        trainer.fit(model, DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
        return trainer, model

    _, whole = run(2)
    assert all(torch.equal(published, own) for published, own, _ in whole.seen) and len(whole.seen) == 10
    assert [lam for *_, lam in whole.seen] == [1.0] * 7 + [0.0] * 3  # planned for the Trainer's 10 steps
    assert len(list((tmp_path / "cache").glob("*/metadata.json"))) == 1
    trainer, first = run(2, stop_after=1)
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    _, resumed = run(2, ckpt_path=str(tmp_path / "epoch1.ckpt"))
    assert resumed.rela.steps == whole.rela.steps == 10
    assert [lam for *_, lam in resumed.seen] == [lam for *_, lam in whole.seen[5:]]
    for a, b in zip(resumed.rela.parameters(), whole.rela.parameters()):
        assert torch.equal(a, b)


def test_from_prior_makes_a_spatial_store_for_the_dense_term(tmp_path):
    """ReLACallback.from_prior(spatial=k) makes the spatial store ReLA.from_prior(spatial=k) makes, and the dense term
    trains on it. Before: spatial= went on to ReLA, which refused it with a raw TypeError once the pooled store had been
    precomputed at fit time."""
    import numpy as np

    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.data import ArrayImageDataset

    images = np.random.default_rng(0).integers(0, 256, (24, 16, 16), dtype=np.uint8)
    to_tensor = lambda im: torch.from_numpy(np.asarray(im, dtype=np.float32) / 255).unsqueeze(0)  # noqa: E731
    data = ArrayImageDataset(images, np.arange(24), transform=to_tensor)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = ConvNet(widths=(8, 16))  # .features: a [B, 16, 4, 4] map of a 16 px image

        def training_step(self, batch, batch_idx):
            x, _ = batch
            return self.rela.wrap(self.backbone(x).pow(2).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.backbone.parameters(), lr=0.1)

    torch.manual_seed(0)
    model = Module()
    with pytest.raises(ValueError, match=r"spatial must be False, True .* or an int k >= 1"):
        ReLACallback.from_prior("random:convnet", spatial="8")
    with pytest.raises(ValueError, match=r"dense=\) .* pass spatial=k too"):
        ReLACallback.from_prior("random:convnet", dense=model.backbone.features)
    callback = ReLACallback.from_prior("random:convnet", cache_dir=tmp_path / "cache", progress=False, spatial=3,
                                       dense=model.backbone.features, n_components=3, witness=False)
    _trainer(max_epochs=1, callbacks=[callback]).fit(model, DataLoader(data, batch_size=8))
    store = model.rela.store
    assert store.spatial["channels"] == 3 and list(store.grid) == [2, 2] and model.rela.steps == 3
    assert model.rela.priors["0"].dense.linear is not None  # the dense head was built and trained
