"""A training script written the way Hugging Face Accelerate's ``examples/cv_example.py`` is, with ReLA added as the
README's Accelerate section says, for tests/test_integration_accelerate.py.

    accelerate launch --multi_gpu --num_processes 2 ... _accelerate_cv_worker.py --data-dir DIR --out DIR [--clean reordered]

As in the example: the image files of a folder, split 80/20 by a seeded permutation, a ``PetsDataset`` (tests/pets.py:
``.file_names``, augmentation inside ``__getitem__`` from ``.image_transform``, dict items), a DataLoader with
``shuffle=True``, ``accelerator.prepare`` and a loop over ``batch["image"]`` / ``batch["label"]``. ReLA's lines:
the clean view of the training set, its targets (precomputed once, sharded over the processes), ``ReLA(...)``, the
prepared loader tracked, the loss wrapped.

``--clean reordered`` gives ReLA a clean data set of the same files in another order instead of the clean view (what a
user rebuilding the list would do); the run must stop before training.

Each rank writes ``rank-<r>.json``: per step, the number of the file each image of its batch was cut from (read off the
image's colour) and the number of the file whose target row ReLA read for it (the store's key of that row).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pets import PetsDataset, image_number, name_number, pet_label  # noqa: E402


def main(argv=None):
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torchvision.transforms import Compose, RandomResizedCrop, ToTensor

    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.integrations.lightly import open_or_precompute
    from accelerate_ssl.rela import ReLA

    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--clean", choices=["view", "reordered"], default="view")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)

    accelerator = Accelerator(cpu=True)
    file_names = [os.path.join(args.data_dir, f) for f in os.listdir(args.data_dir) if f.endswith(".png")]
    label_to_id = {label: i for i, label in enumerate(sorted({pet_label(f) for f in file_names}))}
    set_seed(0)
    order = np.random.permutation(len(file_names))
    train_files = [file_names[i] for i in order[: int(0.8 * len(file_names))]]
    train_dataset = PetsDataset(train_files, image_transform=Compose([RandomResizedCrop(16, scale=(0.5, 1.0)),
                                                                      ToTensor()]), label_to_id=label_to_id)
    train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=8)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = ConvNet(in_channels=3, widths=(8, 16))
            self.classifier = nn.Linear(16, len(label_to_id))

        def forward(self, x):
            return self.classifier(self.backbone(x))

    model = Model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    # ReLA: the clean view of the training set, its targets, ReLA on the backbone
    if args.clean == "view":
        from accelerate_ssl.data import clean_view

        clean = clean_view(train_dataset)
    else:
        clean = PetsDataset(sorted(train_files))
    store = open_or_precompute("random:convnet", clean, Path(args.out) / "targets", progress=False)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    rela = ReLA(store, accelerator.unwrap_model(model).backbone, dataset=clean, total_steps=args.steps)
    train_dataloader = rela.track(train_dataloader)

    read = []  # the rows ReLA looked up, step by step (the test's witness, not part of the recipe)

    class Recorded(type(rela.targets)):
        def __call__(self, index, device):
            read.append(torch.as_tensor(index).tolist())
            return super().__call__(index, device)

    rela.targets.__class__ = Recorded
    keys = store.keys.in_row_order()
    log = {"rank": accelerator.process_index, "world": accelerator.num_processes, "steps": [],
           "kind": store.metadata["dataset"]["fingerprint"]["kind"]}
    step = 0
    while step < args.steps:
        model.train()
        for batch in train_dataloader:
            outputs = model(batch["image"])
            loss = rela.wrap(F.cross_entropy(outputs, batch["label"]))
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            log["steps"].append({"images": image_number(batch["image"]),
                                 "rows": [name_number(keys[r]) for r in read[-1]], "lambda": rela.stats["lambda"]})
            if step >= args.steps:
                break
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank-{accelerator.process_index}.json").write_text(json.dumps(log))
    accelerator.end_training()


if __name__ == "__main__":
    main()
