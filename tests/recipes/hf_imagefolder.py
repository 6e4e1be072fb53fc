# The README's Hugging Face `datasets` lines for a data set without an id column (load_dataset("imagefolder")), in a
# training script written the way the transformers image-classification examples use `datasets` (with_transform
# making the augmented "pixel_values", a collate_fn, a torch DataLoader), at test size: 30 real Fashion-MNIST images as
# PNG files in class folders, a small ConvNet classifier, on the CPU. Run in the folder holding images/. ReLA's lines
# are marked "# ReLA: ..."; "# test" lines only observe the run (each image's number, from its file name).
import os

import torch
import torch.nn.functional as F
from datasets import load_dataset
from torch import nn
from torch.utils.data import DataLoader
from torchvision.transforms import Compose, RandomResizedCrop, ToTensor

from accelerate_ssl import ReLA, create_prior, open_stream, precompute_targets  # ReLA: added
from accelerate_ssl.backbones import ConvNet

dataset = load_dataset("imagefolder", data_dir="images", split="train")
targets = precompute_targets(create_prior("shipped:digits-byol"), open_stream(dataset), "targets/images")  # ReLA: added
numbers = []  # test: the number of each image of each batch, from its file name

train_transforms = Compose([RandomResizedCrop(28, scale=(0.5, 1.0)), ToTensor()])


def preprocess_train(example_batch):
    """Apply train_transforms across a batch."""
    example_batch["pixel_values"] = [train_transforms(image.convert("L")) for image in example_batch["image"]]
    example_batch["number"] = [int(os.path.basename(image.filename)[4:7]) for image in example_batch["image"]]  # test
    return example_batch


train = targets.column(dataset).with_transform(preprocess_train)  # ReLA: changed, was: train = dataset.with_transform(preprocess_train)


def collate_fn(examples):
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    labels = torch.tensor([example["label"] for example in examples])
    numbers.append([example["number"] for example in examples])  # test
    return {"pixel_values": pixel_values, "labels": labels, "target": torch.tensor([example["target"] for example in examples])}  # ReLA: changed, was: return {"pixel_values": pixel_values, "labels": labels}


dataloader = DataLoader(train, shuffle=True, collate_fn=collate_fn, batch_size=8)


class Classifier(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.backbone = ConvNet(in_channels=1, widths=(16, 32))
        self.classifier = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.classifier(self.backbone(x))


model = Classifier(num_classes=dataset.features["label"].num_classes)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
epochs = 2
rela = ReLA(targets, model.backbone, total_steps=epochs * len(dataloader))  # ReLA: added
seen = []  # test: the numbers of each batch's images and the target rows they carried

for epoch in range(epochs):
    for batch in dataloader:
        loss = rela.wrap(F.cross_entropy(model(batch["pixel_values"]), batch["labels"]), targets=batch["target"])  # ReLA: changed, was: loss = F.cross_entropy(model(batch["pixel_values"]), batch["labels"])
        seen.append((numbers[-1], batch["target"].clone()))  # test
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"epoch {epoch}: loss {loss.item():.4f}")
