"""solo-learn's method contract (no solo-learn code): the data set and the BaseMethod / BaseMomentumMethod / BYOL
structure its methods follow, for the mixin tests and the 2-process DDP worker."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from accelerate_ssl.integrations.solo_learn import ReLAMixin

N, DIM, TARGET_DIM = 48, 16, 12


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
    """BaseMethod / BaseMomentumMethod / BYOL following solo-learn's method contract for the given lightning flavour:
    ``_base_shared_step`` (online classifier on detached feats, cross-entropy with ignore_index=-1), ``training_step``
    averaging the classifier loss over the large crops and returning a dict, ``_shared_step_momentum`` with a momentum
    classifier whose averaged loss is added to ``outs["loss"]``, and a concrete ``training_step`` returning
    ``ssl + out["loss"]``."""

    class BaseMethod(pl.LightningModule):
        def __init__(self, cfg):
            super().__init__()
            self.cfg = cfg  # solo-learn's BaseMethod keeps its cfg (data.train_path, data.no_labels, data.fraction)
            self.lr = cfg["lr"]
            self.backbone = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                                          nn.Flatten(), nn.Linear(32, DIM))
            self.features_dim = DIM
            self.classifier = nn.Linear(DIM, 3)
            self.num_large_crops = 2

        @property
        def learnable_params(self):
            return [{"name": "backbone", "params": self.backbone.parameters()},
                    {"name": "classifier", "params": self.classifier.parameters(), "lr": 0.1, "weight_decay": 0}]

        def configure_optimizers(self):
            return torch.optim.SGD(self.learnable_params, lr=self.lr, momentum=0.9, weight_decay=1e-5)

        def forward(self, X):
            feats = self.backbone(X)
            return {"logits": self.classifier(feats.detach()), "feats": feats}

        def _base_shared_step(self, X, targets):
            out = self(X)
            return {**out, "loss": F.cross_entropy(out["logits"], targets, ignore_index=-1)}

        def training_step(self, batch, batch_idx):  # BaseMethod's returns a dict
            _, X, targets = batch
            outs = [self._base_shared_step(x, targets) for x in X[: self.num_large_crops]]
            outs = {k: [o[k] for o in outs] for k in outs[0]}
            outs["loss"] = sum(outs["loss"]) / self.num_large_crops
            self.log_dict({"train_class_loss": outs["loss"]}, on_epoch=True, sync_dist=True)
            return outs

    class BaseMomentumMethod(BaseMethod):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.momentum_backbone = copy.deepcopy(self.backbone).requires_grad_(False)
            self.momentum_classifier = nn.Linear(DIM, 3)

        @property
        def learnable_params(self):
            return super().learnable_params + [{"name": "momentum_classifier",
                                                "params": self.momentum_classifier.parameters(), "lr": 0.1}]

        @torch.no_grad()
        def momentum_forward(self, X):
            return {"feats": self.momentum_backbone(X)}

        def _shared_step_momentum(self, X, targets):
            out = self.momentum_forward(X)
            logits = self.momentum_classifier(out["feats"])
            out.update({"logits": logits, "loss": F.cross_entropy(logits, targets, ignore_index=-1)})
            return out

        def training_step(self, batch, batch_idx):
            outs = super().training_step(batch, batch_idx)
            _, X, targets = batch
            m = [self._shared_step_momentum(x, targets) for x in X[: self.num_large_crops]]
            m = {"momentum_" + k: [o[k] for o in m] for k in m[0]}
            m["momentum_loss"] = sum(m["momentum_loss"]) / self.num_large_crops
            outs["loss"] += m["momentum_loss"]
            return {**outs, **m}

    class BYOLLike(BaseMomentumMethod):
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
            class_loss = out["loss"]
            (z1, z2), (p1, p2) = out["z"], out["p"]
            neg_cos = -(F.cosine_similarity(p1, z2.detach()).mean() + F.cosine_similarity(p2, z1.detach()).mean()) / 2
            self.log("train_neg_cos_sim", neg_cos)
            return neg_cos + class_loss

    class BYOLReLA(ReLAMixin, BYOLLike):
        pass

    return BaseMethod, BYOLLike, BYOLReLA


def targets():
    return torch.randn(N, TARGET_DIM, generator=torch.Generator().manual_seed(1))
