# The README's Hugging Face `datasets` lines for a data set with an id column, in a training loop written the way the
# datasets documentation's "Use with PyTorch" page writes one (load_from_disk, Dataset.with_format("torch"), a torch
# DataLoader), at test size: 30 real Fashion-MNIST images with an "id" and a "label" column, a small ConvNet classifier,
# on the CPU. Run in the folder holding data/train and targets/hf (the README's precompute command writes it). ReLA's
# lines are marked "# ReLA: ..."; "# test" lines only observe the run.
import torch
import torch.nn.functional as F
from datasets import load_from_disk
from torch import nn
from torch.utils.data import DataLoader

from accelerate_ssl import ReLA, ShardedTargets  # ReLA: added
from accelerate_ssl.backbones import ConvNet

dataset = load_from_disk("data/train")
targets = ShardedTargets.open("targets/hf")  # ReLA: added
train = targets.column(dataset, key_column="id").with_format("torch")  # ReLA: changed, was: train = dataset.with_format("torch")
dataloader = DataLoader(train, batch_size=8, shuffle=True)


class Classifier(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.backbone = ConvNet(in_channels=1, widths=(16, 32))
        self.classifier = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.classifier(self.backbone(x))


model = Classifier(num_classes=10)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
epochs = 2
rela = ReLA(targets, model.backbone, total_steps=epochs * len(dataloader))  # ReLA: added
seen = []  # test: the ids of each batch's rows and the target rows they carried

for epoch in range(epochs):
    for batch in dataloader:
        images = batch["image"].reshape(-1, 1, 28, 28).float() / 255
        loss = rela.wrap(F.cross_entropy(model(images), batch["label"]), targets=batch["target"])  # ReLA: changed, was: loss = F.cross_entropy(model(images), batch["label"])
        seen.append((list(batch["id"]), batch["target"].clone()))  # test
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"epoch {epoch}: loss {loss.item():.4f}")
