"""Quiet by default: a warning is said once per process, however many paths meet its cause; and the checks page's
witness warning is tested on the run it describes (a MoCo loop written as lightly's example, the documented recipe):
rows the witness confirms get none, rows it cannot confirm get one."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import accelerate_ssl.launch as launch
from accelerate_ssl import ReLA, create_prior, precompute_targets
from accelerate_ssl.rela import Witness, WitnessWarning

pytestmark = pytest.mark.usefixtures("cpu_one_thread")


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """What this process has warned so far, forgotten for the test (each test is a run of its own)."""
    monkeypatch.setattr(launch, "_WARNED", set())


def test_the_grayscale_priors_warning_is_said_once_though_precompute_and_witness_both_meet_it(tmp_path):
    """Before: twice per process, once from the precompute's preprocessing and once from the witness's."""
    from torchvision.transforms import Compose, RandomResizedCrop, ToTensor

    from accelerate_ssl.backbones import ConvNet
    from pets import PetsDataset, make_pet_images

    files = make_pet_images(tmp_path / "images", 24, size=28)
    data = PetsDataset(files, image_transform=Compose([RandomResizedCrop(28, scale=(0.5, 1.0)), ToTensor()]))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    backbone = ConvNet(in_channels=3, widths=(8,))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # (Python's own filter would hide a repeat from the same line: not this one)
        rela = ReLA.from_prior("shipped:digits-byol", backbone, loader, total_steps=6, cache_dir=tmp_path / "cache",
                               progress=False, image_key="image", witness=Witness(every=1))
        for epoch in range(2):
            for batch in loader:
                x = batch["image"]
                rela.wrap((backbone(x).sum() + backbone(x.flip(-1)).sum()) * 0).backward()
    assert rela.witness.last is not None and rela.witness.last["rows_witnessed"] > 0  # the witness did embed
    said = [str(w.message) for w in seen if "luminance" in str(w.message)]
    assert len(said) == 1, said


class MoCo(nn.Module):
    """MoCo as lightly's examples/pytorch/moco.py writes it: the query encoder (the student) sees one view, a frozen
    momentum copy the other."""

    def __init__(self, backbone):
        super().__init__()
        from lightly.models.modules import MoCoProjectionHead
        from lightly.models.utils import deactivate_requires_grad

        self.backbone = backbone
        self.projection_head = MoCoProjectionHead(32, 64, 16)
        self.backbone_momentum = copy.deepcopy(self.backbone)
        self.projection_head_momentum = copy.deepcopy(self.projection_head)
        deactivate_requires_grad(self.backbone_momentum)
        deactivate_requires_grad(self.projection_head_momentum)

    def forward(self, x):
        return self.projection_head(self.backbone(x).flatten(start_dim=1))

    def forward_momentum(self, x):
        return self.projection_head_momentum(self.backbone_momentum(x).flatten(start_dim=1)).detach()


def _moco_run(tmp_path, shuffled_rows: bool):
    """lightly's MoCo loop at test size (256 Fashion-MNIST images, batches of 64, 2 epochs) with the documented recipe:
    ``ReLA.from_prior(prior, model.backbone, dataloader, total_steps=...)`` and the loss wrapped. ``shuffled_rows``:
    the same loop with ``ReLA(rows, ...)`` given rows of other samples (the prior named for the witness by hand)."""
    from lightly.loss import NTXentLoss
    from lightly.models.utils import update_momentum
    from lightly.transforms.moco_transform import MoCoV2Transform
    from lightly.utils.scheduler import cosine_schedule

    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.data import FashionMNIST

    torch.manual_seed(0)
    model = MoCo(ConvNet(in_channels=1, widths=(16, 32)))
    transform = MoCoV2Transform(input_size=28, gaussian_blur=0.0, normalize={"mean": [0.2860], "std": [0.3530]})
    dataset = FashionMNIST("train", transform=transform, limit=256)
    dataloader = DataLoader(dataset, batch_size=64, shuffle=True, drop_last=True)
    criterion = NTXentLoss(memory_bank_size=(512, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.06)
    epochs = 2
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if shuffled_rows:
            store = precompute_targets(create_prior("shipped:digits-byol"), FashionMNIST("train", limit=256),
                                       tmp_path / "store", progress=False)
            rows = torch.as_tensor(store[torch.randperm(len(store), generator=torch.Generator().manual_seed(1))])
            rela = ReLA(rows, model.backbone, dataloader=dataloader, total_steps=epochs * len(dataloader),
                        witness=Witness(prior=create_prior("shipped:digits-byol")), alignment_check=False)
        else:
            rela = ReLA.from_prior("shipped:digits-byol", model.backbone, dataloader,
                                   total_steps=epochs * len(dataloader), cache_dir=tmp_path / "cache", progress=False)
        for epoch in range(epochs):
            momentum_val = cosine_schedule(epoch, epochs, 0.996, 0.99)
            for batch in dataloader:
                x_query, x_key = batch[0]
                update_momentum(model.backbone, model.backbone_momentum, m=momentum_val)
                update_momentum(model.projection_head, model.projection_head_momentum, m=momentum_val)
                query = model(x_query)
                key = model.forward_momentum(x_key)
                loss = rela.wrap(criterion(query, key))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    return rela, [w for w in seen if issubclass(w.category, WitnessWarning)]


def test_a_moco_loop_with_its_own_rows_is_confirmed_in_silence(tmp_path, fashion_mnist_available):
    """The run the checks page describes, with the documented recipe: one view per step (the momentum encoder takes the
    other). Before, the page promised a WitnessWarning there; the witness confirms the rows instead, without a word."""
    rela, said = _moco_run(tmp_path, shuffled_rows=False)
    assert rela.witness.status == "aligned" and rela.witness.last["views_witnessed"] == 0  # one view: uncalibrated
    assert rela.witness.last["rows_rank"] < 0.2
    assert said == []


def test_a_moco_loop_on_rows_it_cannot_confirm_is_told_once_that_the_witness_cannot_judge(tmp_path,
                                                                                       fashion_mnist_available):
    """The warning the page promises, on that run: rows the witness has not confirmed by the end of its first burst
    (here other samples' rows), said once, with their rank near chance."""
    rela, said = _moco_run(tmp_path, shuffled_rows=True)
    assert rela.witness.status == "one view" and rela.witness.alarm is None
    assert len(said) == 1, [str(w.message) for w in said]
    assert "cannot refute these rows: the backbone sees one view per sample per step" in str(said[0].message)
    assert "that is chance" in str(said[0].message)
