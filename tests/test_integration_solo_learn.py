"""solo-learn adapter: ReLAMixin on a small LightningModule that follows solo-learn's method contract
(BaseMethod-style `learnable_params` + `configure_optimizers`, `forward` -> {"logits", "feats", "z", "p"},
batches `[indexes, [X1, X2], targets]`, concrete scalar `training_step`), trained with a real Trainer
under both `lightning.pytorch` and `pytorch_lightning`."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from accelerate_ssl.integrations.solo_learn import ReLAMixin

N, DIM, TARGET_DIM = 48, 16, 12
FLAVOURS = ["lightning.pytorch", "pytorch_lightning"]


class IndexedTwoViews(Dataset):
    """solo-learn's dataset_with_index: items ``(index, [view1, view2], target)``."""

    def __init__(self, n=N):
        g = torch.Generator().manual_seed(0)
        self.images = torch.rand(n, 1, 12, 12, generator=g)
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        x = self.images[i]
        return i, [x + 0.05 * torch.randn_like(x), x.flip(-1)], int(self.labels[i])


def make_methods(pl):
    """A BaseMethod / BYOL-like pair following solo-learn's contract, for the given lightning flavour."""

    class BaseMethod(pl.LightningModule):
        def __init__(self, cfg):
            super().__init__()
            self.lr = cfg["lr"]
            self.backbone = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                                          nn.Flatten(), nn.Linear(32, DIM))
            self.features_dim = DIM
            self.classifier = nn.Linear(DIM, 3)

        @property
        def learnable_params(self):
            return [{"name": "backbone", "params": self.backbone.parameters()},
                    {"name": "classifier", "params": self.classifier.parameters(), "lr": 0.1, "weight_decay": 0}]

        def configure_optimizers(self):
            return torch.optim.SGD(self.learnable_params, lr=self.lr, momentum=0.9, weight_decay=1e-5)

        def forward(self, X):
            feats = self.backbone(X)
            return {"logits": self.classifier(feats.detach()), "feats": feats}

        def training_step(self, batch, batch_idx):  # BaseMethod's returns a dict
            _, X, targets = batch
            outs = [self(x) for x in X]
            class_loss = sum(F.cross_entropy(o["logits"], targets) for o in outs) / len(outs)
            return {"loss": class_loss, **{k: [o[k] for o in outs] for k in outs[0]}}

    class BYOLLike(BaseMethod):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.projector = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 8))
            self.predictor = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))

        @property
        def learnable_params(self):
            return super().learnable_params + [{"name": "projector", "params": self.projector.parameters()},
                                               {"name": "predictor", "params": self.predictor.parameters()}]

        def forward(self, X):
            out = super().forward(X)
            z = self.projector(out["feats"])
            return {**out, "z": z, "p": self.predictor(z)}

        def training_step(self, batch, batch_idx):  # concrete methods return a scalar
            out = super().training_step(batch, batch_idx)
            (z1, z2), (p1, p2) = out["z"], out["p"]
            neg_cos = -(F.cosine_similarity(p1, z2.detach()).mean() + F.cosine_similarity(p2, z1.detach()).mean()) / 2
            self.log("train_neg_cos_sim", neg_cos)
            return neg_cos + out["loss"]

    class BYOLReLA(ReLAMixin, BYOLLike):
        pass

    return BaseMethod, BYOLLike, BYOLReLA


def _targets():
    return torch.randn(N, TARGET_DIM, generator=torch.Generator().manual_seed(1))


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
    assert 0.0 < float(trainer.logged_metrics["rela/lambda"]) <= 0.8 + 1e-6
    assert 0.0 <= float(trainer.logged_metrics["rela/loss_rela"]) <= 2.0
    assert len(seen) == 5 and all(s.dtype == torch.long for s in seen)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_wrapped_loss_is_lambda_mix_of_relas_term_and_the_methods_loss(flavour):
    pl = importlib.import_module(flavour)
    torch.manual_seed(0)
    _, BYOLLike, BYOLReLA = make_methods(pl)
    model = BYOLReLA({"lr": 0.05}, rela_targets=_targets(), rela_schedule="constant")
    plain = BYOLLike({"lr": 0.05})
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("rela_head")})
    model.log_dict = plain.log = model.log = lambda *a, **k: None  # no trainer attached here
    batch = next(iter(DataLoader(IndexedTwoViews(), batch_size=8)))
    torch.manual_seed(3)
    wrapped = model.training_step(batch, 0)
    torch.manual_seed(3)
    ssl = plain.training_step(batch, 0)
    lam = model.rela.stats["lambda"]
    assert 0 < lam < 1
    # ReLA term by hand: both views' feats through the head vs the PCA-reduced targets of batch[0]
    feats = torch.cat([model.backbone(x) for x in batch[1]])
    target = model.rela._lookup(batch[0], feats.device).repeat(2, 1)
    l_rela = (1 - F.cosine_similarity(model.rela_head(feats), target)).mean()
    assert wrapped.item() == pytest.approx(lam * l_rela.item() + (1 - lam) * ssl.item(), rel=1e-5)


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
    with pytest.raises(ValueError, match="dummy indexes.*DALI.*#222"):
        model.training_step([torch.zeros(4, dtype=torch.long), [x, x], torch.zeros(4, dtype=torch.long)], 0)
    with pytest.raises(ValueError, match=r"span \[0, 99\].*48 rows.*data.fraction"):
        model.training_step([torch.tensor([0, 1, 2, 99]), [x, x], torch.zeros(4, dtype=torch.long)], 0)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        model.training_step([torch.rand(4), [x, x], torch.zeros(4, dtype=torch.long)], 0)


def test_data_fraction_mismatch_is_refused_at_train_start(tmp_path):
    import lightning.pytorch as pl

    _, _, BYOLReLA = make_methods(pl)
    model = BYOLReLA({"lr": 0.05}, rela_targets=_targets())
    trainer = _trainer(pl, tmp_path, max_steps=2, enable_checkpointing=False)
    with pytest.raises(ValueError, match="training dataset has 24 samples but the target store has 48 rows"):
        trainer.fit(model, DataLoader(IndexedTwoViews(n=24), batch_size=8))


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
