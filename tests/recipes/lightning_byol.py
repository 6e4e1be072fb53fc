# The README's Lightning lines in a script written the way lightly's examples/pytorch_lightning/byol.py is (a BYOL
# LightningModule with a frozen momentum copy, BYOLTransform views of a torchvision-style data set, pl.Trainer.fit), at
# test size: real Fashion-MNIST images (accelerate_ssl.data) instead of CIFAR-10, a small ConvNet instead of a
# ResNet-18, 64 images, on the CPU. ReLA's lines are marked "# ReLA: ..."; "# test" lines only observe the run.

import copy

import pytorch_lightning as pl
import torch

from lightly.loss import NegativeCosineSimilarity
from lightly.models.modules import BYOLPredictionHead, BYOLProjectionHead
from lightly.models.utils import deactivate_requires_grad, update_momentum
from lightly.transforms.byol_transform import (
    BYOLTransform,
    BYOLView1Transform,
    BYOLView2Transform,
)
from lightly.utils.scheduler import cosine_schedule

from accelerate_ssl.backbones import ConvNet
from accelerate_ssl.data import FashionMNIST
from accelerate_ssl.integrations.lightning import ReLACallback  # ReLA: added
from recipe_check import RecipeLog  # test

log = RecipeLog()  # test


class BYOL(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.backbone = ConvNet(in_channels=1, widths=(16, 32))
        self.projection_head = BYOLProjectionHead(32, 64, 16)
        self.prediction_head = BYOLPredictionHead(16, 64, 16)

        self.backbone_momentum = copy.deepcopy(self.backbone)
        self.projection_head_momentum = copy.deepcopy(self.projection_head)

        deactivate_requires_grad(self.backbone_momentum)
        deactivate_requires_grad(self.projection_head_momentum)

        self.criterion = NegativeCosineSimilarity()

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

    def training_step(self, batch, batch_idx):
        momentum = cosine_schedule(self.current_epoch, 10, 0.996, 1)
        update_momentum(self.backbone, self.backbone_momentum, m=momentum)
        update_momentum(self.projection_head, self.projection_head_momentum, m=momentum)
        (x0, x1) = batch[0]

        def byol_loss():  # ReLA: added
            p0 = self.forward(x0)
            z0 = self.forward_momentum(x0)
            p1 = self.forward(x1)
            z1 = self.forward_momentum(x1)
            return 0.5 * (self.criterion(p0, z1) + self.criterion(p1, z0))  # ReLA: changed, was: loss = 0.5 * (self.criterion(p0, z1) + self.criterion(p1, z0))

        loss = self.rela.wrap(byol_loss, inputs=x0)  # ReLA: added
        log.step(self.rela, batch[1])  # test
        return loss

    def on_train_start(self):  # test
        log.watch(self.rela)  # test

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.06)


model = BYOL()

# We disable gaussian blur for Fashion-MNIST.
normalize = {"mean": [0.2860], "std": [0.3530]}
transform = BYOLTransform(
    view_1_transform=BYOLView1Transform(input_size=28, gaussian_blur=0.0, normalize=normalize),
    view_2_transform=BYOLView2Transform(input_size=28, gaussian_blur=0.0, normalize=normalize),
)
dataset = FashionMNIST("train", transform=transform, limit=64)
dataset.targets = torch.arange(len(dataset))  # test: each batch's labels say which samples it holds

dataloader = torch.utils.data.DataLoader(
    dataset,
    batch_size=32,
    shuffle=True,
    drop_last=True,
    num_workers=0,
)

accelerator = "gpu" if torch.cuda.is_available() else "cpu"

trainer = pl.Trainer(max_epochs=10, devices=1, accelerator=accelerator, callbacks=[ReLACallback.from_prior("shipped:digits-byol")])  # ReLA: changed, was: trainer = pl.Trainer(max_epochs=10, devices=1, accelerator=accelerator)
trainer.fit(model=model, train_dataloaders=dataloader)
log.save(trainer.global_rank)  # test
