# The README's Quick start in a script written the way lightly's examples/pytorch/byol.py is (a BYOL module with a
# frozen momentum copy, BYOLTransform views of a torchvision-style data set, the cosine momentum schedule, SGD), at
# test size: real Fashion-MNIST images (accelerate_ssl.data) instead of CIFAR-10, a small ConvNet instead of a
# ResNet-18 and a few steps on the CPU. ReLA's lines are marked "# ReLA: ..."; "# test" lines only observe the run.

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

from accelerate_ssl import ReLA  # ReLA: added
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
rela = ReLA.from_prior("shipped:digits-byol", model.backbone, dataloader, total_steps=epochs * len(dataloader))  # ReLA: added
log = RecipeLog()  # test
log.watch(rela)  # test
log.count_calls(model.backbone_momentum, model.prediction_head)  # test: the SSL side, skipped while lambda is 1

print("Starting Training")
for epoch in range(epochs):
    total_loss = 0
    momentum_val = cosine_schedule(epoch, epochs, 0.996, 1)
    for batch in dataloader:
        x0, x1 = batch[0]
        update_momentum(model.backbone, model.backbone_momentum, m=momentum_val)
        update_momentum(
            model.projection_head, model.projection_head_momentum, m=momentum_val
        )
        x0 = x0.to(device)
        x1 = x1.to(device)

        def byol_loss():  # ReLA: added
            p0 = model(x0)
            z0 = model.forward_momentum(x0)
            p1 = model(x1)
            z1 = model.forward_momentum(x1)
            return 0.5 * (criterion(p0, z1) + criterion(p1, z0))  # ReLA: changed, was: loss = 0.5 * (criterion(p0, z1) + criterion(p1, z0))

        loss = rela.wrap(byol_loss, inputs=x0)  # ReLA: added
        log.step(rela, batch[1])  # test
        total_loss += loss.detach()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    avg_loss = total_loss / len(dataloader)
    print(f"epoch: {epoch:>02}, loss: {avg_loss:.5f}")
log.save()  # test
