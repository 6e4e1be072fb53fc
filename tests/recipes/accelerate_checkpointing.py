"""The README's Accelerate resume lines in a script written the way Hugging Face Accelerate's
``examples/by_feature/checkpointing.py`` is (``accelerator.prepare``, ``save_state`` every N steps, ``load_state`` and
``accelerator.skip_first_batches`` to resume mid-epoch), at test size: 48 random 8x8 images, a small classifier, the
CPU, for tests/test_integration_accelerate.py under ``accelerate launch`` (2 gloo processes). ReLA's lines are marked
``# ReLA: ...`` (the test checks that they are the README's, verbatim, and counts them); ``# test`` lines only observe.

    accelerate launch ... accelerate_checkpointing.py OUT [--checkpointing_steps N [--hold]] [--resume_from_checkpoint DIR]

``images.npy`` is in the working directory; ReLA makes its targets under ``rela-targets`` there (the first run, both
processes together) and reopens them in the others. Item i of the training set carries i as its label, so each step
compares the rows ReLA read with the store's rows of the batch's own samples. Every step is appended to
``OUT/steps-<rank>.jsonl`` as it ends. ``--hold``: after the first checkpoint, rank 0 writes ``OUT/saved`` and every
process waits to be killed (a job preempted right after its checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader

from accelerate_ssl import ReLA  # ReLA: added
from accelerate_ssl.data import ArrayImageDataset
from recipe_check import ReadSpy  # test

BATCH_SIZE = 4


def to_tensor(image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).unsqueeze(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh())
        self.classifier = nn.Linear(16, 48)  # one class per image

    def forward(self, x):
        return self.classifier(self.backbone(x))


def training_function(args) -> None:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    num_epochs = 2
    set_seed(0)
    images = np.load("images.npy")
    train_dataset = ArrayImageDataset(images, np.arange(len(images)), transform=to_tensor)
    train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=BATCH_SIZE)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    rela = ReLA.from_prior("shipped:digits-byol", accelerator.unwrap_model(model).backbone, train_dataloader,  # ReLA: added
                           total_steps=num_epochs * len(train_dataloader))  # ReLA: added
    accelerator.register_for_checkpointing(rela)  # ReLA: added
    spy = rela.targets.store = ReadSpy(rela.targets.store)  # test

    out = Path(args.out)
    (out / f"pid-{accelerator.process_index}").write_text(str(os.getpid()))
    log = open(out / f"steps-{accelerator.process_index}.jsonl", "a")

    overall_step, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        resume_step = int(Path(args.resume_from_checkpoint).name.replace("step_", ""))
        starting_epoch = resume_step // len(train_dataloader)
        resume_step -= starting_epoch * len(train_dataloader)
        overall_step = starting_epoch * len(train_dataloader)
        assert rela.steps == overall_step + resume_step  # test: lambda, step count and head came back with the state

    for epoch in range(starting_epoch, num_epochs):
        model.train()
        train_dataloader.set_epoch(epoch)
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            # we need to skip steps until we reach the resumed step
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
            overall_step += resume_step
        else:
            active_dataloader = train_dataloader
        for step, batch in enumerate(rela.track(active_dataloader)):  # ReLA: changed, was: for step, batch in enumerate(active_dataloader):
            images, labels = batch
            reads = len(spy.reads)  # test
            loss = rela.wrap(F.cross_entropy(model(images), labels))  # ReLA: changed, was: loss = F.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            overall_step += 1
            own = labels.cpu()  # test
            read = spy.reads[-1] if len(spy.reads) == reads + 1 else None  # test
            log.write(json.dumps({"step": overall_step, "epoch": epoch, "own": own.tolist(),  # test
                                  "read_is_own": read is not None and torch.equal(read, torch.as_tensor(spy.store[own])),  # test
                                  "handed_over": rela.stats["loss_rela"] is None and read is None,  # test
                                  "loss": float(loss.detach())}) + "\n")  # test
            log.flush()  # test
            if args.checkpointing_steps and overall_step % args.checkpointing_steps == 0:
                accelerator.save_state(str(out / "ckpt" / f"step_{overall_step}"))
                accelerator.wait_for_everyone()
                if args.hold:
                    if accelerator.is_main_process:
                        (out / "saved").write_text(f"step_{overall_step}")
                    while True:  # preempted here: the test kills every process
                        time.sleep(0.1)
    log.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--checkpointing_steps", type=int, default=None)
    p.add_argument("--hold", action="store_true")
    p.add_argument("--resume_from_checkpoint", default=None)
    training_function(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
