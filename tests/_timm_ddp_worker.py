"""Helper for tests/test_integration_timm.py: a training script written the way timm's ``train.py`` is, with the
README's ReLA lines, for ``torchrun --nproc_per_node 2`` on the CPU (2 gloo processes).

It uses train.py's own pieces: ``utils.init_distributed_device`` (``--device cpu``: gloo), ``create_dataset``,
``create_loader(distributed=True)`` with the prefetcher, ``ClassificationTask`` and its ``prepare_distributed``,
``create_optimizer_v2``, ``_set_loader_epoch`` and ``train_one_epoch``'s ``_forward``. The one change from train.py:
``prepare_distributed(device_ids=None ...)`` on the CPU, where train.py passes ``[device]``, which DDP takes for GPU
modules only. Each image is a constant colour, 5 x its index, so the batch says which samples it holds.

Usage: torchrun --standalone --nproc_per_node 2 _timm_ddp_worker.py DATA_FOLDER OUT_FOLDER  (RELA_TARGETS=<store>)
Writes OUT_FOLDER/rank<k>.json: per step the samples of the batch and the rows ReLA looked up, lambda; the head after
training.
"""

import argparse
import json
import os
import sys

import torch
from timm import utils
from timm.data import create_dataset, create_loader
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import create_model
from timm.optim import create_optimizer_v2
from timm.task import ClassificationTask

from accelerate_ssl import ReLA                                     # with the imports


def decode(x: torch.Tensor) -> list:
    """The sample index of each image of a prefetched (normalised) batch: its colour / 5."""
    v = x[:, 0].mean(dim=(1, 2)).double() * IMAGENET_DEFAULT_STD[0] * 255 + IMAGENET_DEFAULT_MEAN[0] * 255
    return (v / 5).round().long().tolist()


class Recorder:
    """The rows ReLA looks up (its ``targets`` lookup, delegated)."""

    def __init__(self, lookup):
        self.lookup, self.index = lookup, None

    def __call__(self, index, device):
        self.index = torch.as_tensor(index).tolist()
        return self.lookup(index, device)

    def __getattr__(self, name):
        return getattr(self.lookup, name)


def _set_loader_epoch(loader, epoch: int) -> None:  # train.py's
    if hasattr(loader.dataset, 'set_epoch'):
        loader.dataset.set_epoch(epoch)
    if hasattr(loader.batch_sampler, 'set_epoch'):
        loader.batch_sampler.set_epoch(epoch)
    elif hasattr(loader.sampler, 'set_epoch'):
        loader.sampler.set_epoch(epoch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("out")
    cli = parser.parse_args()
    torch.set_num_threads(1)
    args = argparse.Namespace(device="cpu", dist_backend=None, dist_url=None, seed=0)
    device = utils.init_distributed_device(args)
    assert args.distributed and args.world_size == 2, "run under torchrun --nproc_per_node 2"
    utils.random_seed(args.seed, args.rank)
    model = create_model("test_resnet", pretrained=False, num_classes=2)
    dataset_train = create_dataset("", root=cli.data, split="train", is_training=True, batch_size=2)
    loader_train = create_loader(dataset_train, input_size=(3, 16, 16), batch_size=2, is_training=True, no_aug=True,
                                 num_workers=0, distributed=args.distributed, device=device, use_prefetcher=True)
    task = ClassificationTask(model=model, criterion=torch.nn.CrossEntropyLoss(), device=device)
    model = task.get_trainable_module()
    optimizer = create_optimizer_v2(model, opt="sgd", lr=0.05)
    task.prepare_distributed(device_ids=None if device.type == 'cpu' else [device])  # train.py: device_ids=[device]
    model = task.get_trainable_module()
    updates_per_epoch = len(loader_train)
    num_epochs, start_epoch, resume_epoch = 2, 0, None

    # in main(), after `start_epoch` is set: the README's lines
    global rela
    rela = ReLA(os.environ['RELA_TARGETS'], utils.unwrap_model(model).get_classifier(), capture='input',
                dataset=dataset_train, total_steps=num_epochs * updates_per_epoch)
    loader_train = rela.track(loader_train)     # timm's PrefetchLoader or a plain / multi-epochs DataLoader
    if resume_epoch is not None:
        rela.load_state_dict(torch.load(os.path.join(os.path.dirname(args.resume), f'rela-{resume_epoch - 1}.pth')))

    rela.targets = Recorder(rela.targets)
    steps = []
    for epoch in range(start_epoch, num_epochs):
        _set_loader_epoch(loader_train, epoch)
        task.get_trainable_module().train()
        for batch_idx, (input, target) in enumerate(loader_train):
            def _forward():
                result = task(input, target)
                _loss = rela.wrap(result['loss'])
                return _loss, result

            loss, result = _forward()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            ran = rela.stats["loss_rela"] is not None  # (after the hand-over no row is looked up)
            steps.append({"epoch": epoch, "samples": decode(input), "rows": rela.targets.index if ran else None,
                          "lambda": rela.stats["lambda"]})
        if args.rank == 0:  # train.py's saver exists on rank 0 only
            output_dir = cli.out
            if True:  # the README's line, at train.py's indentation after `saver.save_checkpoint(...)`
                torch.save(rela.state_dict(), os.path.join(output_dir, f'rela-{epoch}.pth'))
    record = {"rank": args.rank, "world_size": args.world_size, "steps": steps, "rela_steps": rela.steps,
              "updates_per_epoch": updates_per_epoch, "head": rela.head.weight.detach().tolist()}
    with open(os.path.join(cli.out, f"rank{args.rank}.json"), "w") as f:
        json.dump(record, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
