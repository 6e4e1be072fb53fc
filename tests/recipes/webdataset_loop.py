# The README's WebDataset lines in a training script written the way WebDataset's own README writes a pipeline (the
# fluid interface, WebDataset(url).shuffle(...).decode("pil").to_tuple(...).map_tuple(...), then a torch DataLoader
# with workers), at test size: 30 real Fashion-MNIST images in 3 tar shards, each sample's "cls" its own number (one
# class per image), a small ConvNet classifier, on the CPU. Run in the folder holding shards/ and targets/train (the
# README's precompute command writes it). ReLA's lines are marked "# ReLA: ..."; "# test" lines only observe the run.
import torch
import torch.nn.functional as F
import webdataset as wds
from torch import nn
from torchvision import transforms

from accelerate_ssl import ReLA, ShardedTargets  # ReLA: added
from accelerate_ssl.backbones import ConvNet

url = "shards/train-{000000..000002}.tar"
batch_size = 8
epochs = 2

preproc = transforms.Compose([transforms.Grayscale(), transforms.RandomResizedCrop(28, scale=(0.5, 1.0)), transforms.ToTensor()])

targets = ShardedTargets.open("targets/train")  # ReLA: added
dataset = (
    wds.WebDataset(url, shardshuffle=100)
    .compose(targets.join())  # ReLA: added
    .shuffle(1000)
    .decode("pil", partial=True)  # ReLA: changed, was: .decode("pil")
    .to_tuple("png", "cls", "target")  # ReLA: changed, was: .to_tuple("png", "cls")
    .map_tuple(preproc)
)
loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=2)


class Classifier(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.backbone = ConvNet(in_channels=1, widths=(16, 32))
        self.classifier = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.classifier(self.backbone(x))


model = Classifier(num_classes=30)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
rela = ReLA(targets, model.backbone, total_steps=epochs * len(targets) // batch_size)  # ReLA: added
seen = []  # test: the numbers of each batch's samples and the rows they carried

for epoch in range(epochs):
    for images, labels, rows in loader:  # ReLA: changed, was: for images, labels in loader:
        loss = rela.wrap(F.cross_entropy(model(images), labels), targets=rows)  # ReLA: changed, was: loss = F.cross_entropy(model(images), labels)
        seen.append((labels.clone(), rows.clone()))  # test
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"epoch {epoch}: loss {loss.item():.4f}")
