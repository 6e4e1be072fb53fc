"""The README's "API in one screen" loop, run as written (digits, a random ConvNet prior, BYOL from the demo recipe):
with ``total_steps`` lambda falls within the 300 steps; without it ReLA warns that lambda will stay high, and it does."""

from __future__ import annotations

import warnings

import pytest
import torch

from accelerate_ssl import ReLA, create_prior, precompute_targets
from accelerate_ssl.backbones import ConvNet
from accelerate_ssl.data import Digits
from accelerate_ssl.recipes import BYOL, BYOL_VIEWS, random_views

EPOCHS = 5


def _two_views(image):
    x = torch.from_numpy(__import__("numpy").asarray(image, dtype="float32") / 255.0)[None]
    return x, x


def _run(tmp_path, with_length: bool):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    clean_train_set = Digits("all", size=12)
    train_set = Digits("all", size=12, transform=_two_views)
    loader = torch.utils.data.DataLoader(train_set, batch_size=30, shuffle=True, drop_last=True)  # 59 steps/epoch
    backbone = ConvNet(widths=(8, 16, 16), in_channels=1)
    model = BYOL(backbone, backbone.feature_dim, hidden_dim=64, out_dim=32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    prior = create_prior("random:convnet", in_channels=1)
    store = precompute_targets(prior, clean_train_set, tmp_path / "targets", progress=False)
    extra = {"total_steps": EPOCHS * len(loader)} if with_length else {}
    rela = ReLA(store, model.backbone, dataset=clean_train_set, dataloader=loader, **extra)
    g = torch.Generator().manual_seed(0)
    lambdas = []
    for epoch in range(EPOCHS):
        for (x0, x1), _ in loader:
            ssl_loss = model.loss(random_views(x0, BYOL_VIEWS, g), random_views(x1, BYOL_VIEWS, g))
            loss = rela.wrap(ssl_loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            model.update_momentum(0.99)
            lambdas.append(rela.stats["lambda"])
    return rela, lambdas


def test_quick_start_with_the_run_length_lambda_falls(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        rela, lambdas = _run(tmp_path, with_length=True)
    assert rela.steps == len(lambdas) >= 290
    assert lambdas[0] == pytest.approx(0.8)
    assert lambdas[-1] < 0.5, lambdas[::30]  # measured: 0.8 until ~step 75, then 0.61 (100), 0.39 (150), 0.31 (275)


def test_quick_start_without_the_run_length_warns_and_lambda_stays_high(tmp_path):
    with pytest.warns(UserWarning, match="not told the run length.*total_steps="):
        rela, lambdas = _run(tmp_path, with_length=False)
    assert min(lambdas) > 0.6
