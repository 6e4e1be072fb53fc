"""The Quick start (the README's, the docs' front page's and the lightly page's): its lines in a script written the way lightly's examples/pytorch/byol.py is
(tests/recipes/quickstart_byol.py), run as written on Fashion-MNIST with every row read checked to be the sample's own
and the lines counted; and what ``total_steps`` does in that loop (digits, a random ConvNet prior, BYOL from the demo
recipe): with it lambda falls within the 300 steps; without it ReLA warns that lambda will stay high, and it does."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from accelerate_ssl import ReLA
from accelerate_ssl.backbones import ConvNet
from accelerate_ssl.data import Digits
from accelerate_ssl.recipes import BYOL, BYOL_VIEWS, random_views
from processes import cpu_process_env
from recipe_check import assert_every_row_is_the_samples_own, assert_hands_over, check_recipe, read_logs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "recipes" / "quickstart_byol.py"
EPOCHS = 5


def recipe_env(log: Path) -> dict:
    """A recipe script's environment: this checkout's package and the tests' helpers, one thread, its log folder."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return cpu_process_env(PYTHONPATH=path, PYTHONUNBUFFERED="1", RECIPE_LOG=str(log))


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "hosts" / "lightly.md"],
                         ids=["README", "docs-index", "docs-lightly"])
def test_the_quick_start_is_lightlys_byol_example_with_four_added_and_one_changed_line(page):
    assert check_recipe(SCRIPT, "## Quick start", page) == (4, 1)


def test_the_quick_start_runs_as_written_and_every_row_is_the_samples_own(tmp_path, fashion_mnist_available):
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, env=recipe_env(tmp_path / "log"), text=True,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "epoch: 01, loss:" in done.stdout and "precompute shipped:digits-byol" in done.stderr
    steps = read_logs(tmp_path / "log")[0]
    assert len(steps) == 2 * 4  # 256 images in batches of 64, two epochs, two loader workers
    assert_every_row_is_the_samples_own(steps)
    for epoch in (0, 1):  # each epoch the shuffled loader visits every sample once
        assert sorted(i for s in steps[4 * epoch:4 * epoch + 4] for i in s["own"]) == list(range(256))
    # while lambda is 1 byol_loss is never called: no momentum network, no prediction head (the SSL side); after the
    # hand-over it runs in full: the prediction head on both views, the momentum backbone on both
    cheap = [s for s in steps if s["lambda"] >= 1.0]
    assert cheap and [s["ssl_calls"] for s in cheap] == [0] * len(cheap)
    full = [s for s in steps if s["lambda"] < 1.0]
    assert full and [s["ssl_calls"] for s in full] == [4] * len(full)
    assert steps.index(full[0]) == len(cheap)  # lambda 1 first, then your loss
    assert len(list((tmp_path / "rela-targets").glob("shipped-digits-byol-256-*/metadata.json"))) == 1


def _run(tmp_path, with_length: bool):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    train_set = Digits("all", size=12, transform=lambda image: (_tensor(image), _tensor(image)))
    loader = torch.utils.data.DataLoader(train_set, batch_size=30, shuffle=True, drop_last=True)  # 59 steps/epoch
    backbone = ConvNet(widths=(8, 16, 16), in_channels=1)
    model = BYOL(backbone, backbone.feature_dim, hidden_dim=64, out_dim=32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    extra = {"total_steps": EPOCHS * len(loader)} if with_length else {}
    rela = ReLA.from_prior("random:convnet", model.backbone, loader, cache_dir=tmp_path / "targets", progress=False,
                           **extra)
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


def _tensor(image):
    import numpy as np

    return torch.from_numpy(np.asarray(image, dtype="float32") / 255.0)[None]


def test_with_the_run_length_lambda_falls(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        rela, lambdas = _run(tmp_path, with_length=True)
    assert rela.steps == len(lambdas) >= 290
    # the loss is computed before wrap: the default is decay, the loss mixed in from the first step and lambda 0 for
    # good by half the planned run
    assert type(rela.schedule).__name__ == "Decay" and 0 < lambdas[0] <= 0.8
    end = lambdas.index(0.0)
    assert 0 < end <= round(len(lambdas) / 2) and set(lambdas[end:]) == {0.0}


def test_without_the_run_length_it_warns_and_lambda_stays_high(tmp_path):
    with pytest.warns(UserWarning, match="not told the run length.*total_steps="):
        rela, lambdas = _run(tmp_path, with_length=False)
    assert min(lambdas) > 0.6
