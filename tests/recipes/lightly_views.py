# The README's "Per-view targets with lightly's transforms" recipe in lightly's examples/pytorch/byol.py (as
# tests/recipes/quickstart_byol.py has it: Fashion-MNIST, a small ConvNet, a few CPU steps): the BYOL views recorded
# with their crop boxes, a spatial store of the prior's maps, and each view's target pooled from its own box.
# ReLA's lines are marked "# ReLA: ..."; "# test" lines only observe the run.

import copy

import torch
from torch import nn

from lightly.loss import NegativeCosineSimilarity
from lightly.models.modules import BYOLPredictionHead, BYOLProjectionHead
from lightly.models.utils import deactivate_requires_grad, update_momentum
from lightly.transforms.byol_transform import (
    BYOLTransform,
    BYOLView1Transform,
    BYOLView2Transform,
)
from lightly.utils.scheduler import cosine_schedule

from accelerate_ssl import ReLA, record_geometry  # ReLA: added
from accelerate_ssl.backbones import ConvNet
from accelerate_ssl.data import FashionMNIST
from recipe_check import RecipeLog  # test


class BYOL(nn.Module):
    def __init__(self, backbone):
        super().__init__()

        self.backbone = backbone
        self.projection_head = BYOLProjectionHead(32, 64, 16)
        self.prediction_head = BYOLPredictionHead(16, 64, 16)

        self.backbone_momentum = copy.deepcopy(self.backbone)
        self.projection_head_momentum = copy.deepcopy(self.projection_head)

        deactivate_requires_grad(self.backbone_momentum)
        deactivate_requires_grad(self.projection_head_momentum)

    def forward(self, x):
        y = self.backbone(x).flatten(start_dim=1)
        z = self.projection_head(y)
        p = self.prediction_head(z)
        return p

    def forward_momentum(self, x):
        y = self.backbone_momentum(x).flatten(start_dim=1)
        z = self.projection_head_momentum(y)
        z = z.detach()
        return z


backbone = ConvNet(in_channels=1, widths=(16, 32))
model = BYOL(backbone)

device = "cuda" if torch.cuda.is_available() else "cpu"
model.to(device)

# We disable gaussian blur for Fashion-MNIST.
normalize = {"mean": [0.2860], "std": [0.3530]}
transform = BYOLTransform(
    view_1_transform=BYOLView1Transform(input_size=28, gaussian_blur=0.0, normalize=normalize),
    view_2_transform=BYOLView2Transform(input_size=28, gaussian_blur=0.0, normalize=normalize),
)
transform = record_geometry(transform)  # ReLA: added
dataset = FashionMNIST("train", transform=transform, limit=256)
dataset.targets = torch.arange(len(dataset))  # test: each batch's labels say which samples it holds

dataloader = torch.utils.data.DataLoader(
    dataset,
    batch_size=64,
    shuffle=True,
    drop_last=True,
    num_workers=2,
)

criterion = NegativeCosineSimilarity()
optimizer = torch.optim.SGD(model.parameters(), lr=0.06)

epochs = 2
rela = ReLA.from_prior("shipped:digits-byol", model.backbone, dataloader, total_steps=epochs * len(dataloader), spatial=16)  # ReLA: added
log = RecipeLog()  # test
log.watch(rela)  # test

print("Starting Training")
for epoch in range(epochs):
    total_loss = 0
    momentum_val = cosine_schedule(epoch, epochs, 0.996, 1)
    for batch in dataloader:
        (x0, g0), (x1, g1) = batch[0]  # ReLA: changed, was: x0, x1 = batch[0]
        update_momentum(model.backbone, model.backbone_momentum, m=momentum_val)
        update_momentum(
            model.projection_head, model.projection_head_momentum, m=momentum_val
        )
        x0 = x0.to(device)
        x1 = x1.to(device)
        p0 = model(x0)
        z0 = model.forward_momentum(x0)
        p1 = model(x1)
        z1 = model.forward_momentum(x1)
        loss = rela.wrap(0.5 * (criterion(p0, z1) + criterion(p1, z0)), geometry=torch.cat([g0, g1]))  # ReLA: changed, was: loss = 0.5 * (criterion(p0, z1) + criterion(p1, z0))
        log.step(rela, batch[1])  # test
        total_loss += loss.detach()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    avg_loss = total_loss / len(dataloader)
    print(f"epoch: {epoch:>02}, loss: {avg_loss:.5f}")
log.save()  # test
