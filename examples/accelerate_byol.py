"""BYOL + ReLA under Hugging Face Accelerate (one machine or many; GPUs or CPU processes).

    accelerate launch --config_file integrations/accelerate_multi_gpu.yaml examples/accelerate_byol.py
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        examples/accelerate_byol.py --steps 20 --limit 1024        # 2 CPU processes (gloo)
    python examples/accelerate_byol.py --steps 20 --limit 1024      # a single process

What is distributed and how (see accelerate_ssl/integrations/accelerate.py):
- the targets are precomputed once, sharded across the processes (open_or_precompute -> precompute_targets);
- ``accelerator.prepare`` wraps model, optimiser and loader; ``rela.track(...)`` around the loader each epoch iterates
  gives ReLA the indices of each process's batches; with ``--fraction`` each epoch trains on a fresh subset (ReLA v2
  Eq. 43), identical on every process and split into per-process batches by accelerate;
- ReLA averages its head's gradients and its loss across processes: every process has the same lambda; the BYOL
  loss is a callable that ``wrap`` skips while lambda is 1, when ReLA runs the backbone on one view itself (outside
  the DDP wrapper) and averages the backbone's gradients of that step across the processes too;
- ``accelerator.save_state`` / ``load_state`` checkpoint ReLA (registered with ``register_for_checkpointing``); a
  resume in the middle of an epoch skips the batches already trained with ``accelerator.skip_first_batches``.
``--log-json DIR`` writes one JSON per process (per step: lambda, losses, process-averaged loss, indices).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

from accelerate_ssl.atomic import atomic_write_json
from accelerate_ssl.backbones import ConvNet
from accelerate_ssl.data import FashionMNIST
from accelerate_ssl.integrations.accelerate import subset_sampler
from accelerate_ssl import open_or_precompute
from accelerate_ssl.rela import ReLA


class BYOL(nn.Module):
    def __init__(self, backbone, feature_dim):
        from lightly.models.modules import BYOLPredictionHead, BYOLProjectionHead
        from lightly.models.utils import deactivate_requires_grad

        super().__init__()
        self.backbone = backbone
        self.projection_head = BYOLProjectionHead(feature_dim, 512, 128)
        self.prediction_head = BYOLPredictionHead(128, 512, 128)
        self.backbone_momentum = copy.deepcopy(backbone)
        self.projection_head_momentum = copy.deepcopy(self.projection_head)
        deactivate_requires_grad(self.backbone_momentum)
        deactivate_requires_grad(self.projection_head_momentum)

    def forward(self, x):
        return self.prediction_head(self.projection_head(self.backbone(x)))

    def forward_momentum(self, x):
        return self.projection_head_momentum(self.backbone_momentum(x)).detach()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimiser steps in total")
    p.add_argument("--batch-size", type=int, default=64, help="per-process batch size")
    p.add_argument("--limit", type=int, default=10000, help="first N Fashion-MNIST training images")
    p.add_argument("--fraction", type=float, default=1.0, help="fresh random share of the data per epoch (1 = all)")
    p.add_argument("--prior", default="shipped:digits-byol",
                   help="prior spec for create_prior (default: the shipped BYOL ConvNet trained on other data, scikit-learn digits: measured to save steps on Fashion-MNIST; an untrained network saves nothing)")
    p.add_argument("--targets", default="rela-targets", help="folder caching the precomputed targets")
    p.add_argument("--schedule", default=None,
                   help="lambda schedule spec (default: the library's; decay | switch | constant:<lambda> | "
                        "epochs:<fraction>)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-state", default=None, help="folder for accelerator.save_state")
    p.add_argument("--save-at", type=int, default=None, help="step after which to save the state (default: the end)")
    p.add_argument("--resume", default=None, help="folder written by --save-state to resume from")
    p.add_argument("--log-json", default=None, help="folder for per-process JSON logs (rank-<r>.json)")
    return p.parse_args(argv)


def rela_snapshot(rela) -> dict:
    """ReLA's state as JSON (exact: head weights as lists of floats)."""
    state = rela.state_dict()
    return {"steps": state["steps"], "lambda": rela.lam, "schedule": state["schedule"], "head_mode": state["head_mode"],
            "head": {k: v.tolist() for k, v in state["head"].items()},
            "backbone": [float(p.double().sum()) for p in rela.backbone.parameters()]}


def main(argv=None):
    import torchvision.transforms as T
    from lightly.loss import NegativeCosineSimilarity
    from lightly.models.utils import update_momentum
    from lightly.utils.scheduler import cosine_schedule

    args = parse_args(argv)
    # cpu=True without CUDA: `accelerate launch --multi_gpu` then runs gloo CPU processes
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    clean = FashionMNIST("train", limit=args.limit)
    store = open_or_precompute(args.prior, clean, args.targets, progress=accelerator.is_main_process)
    set_seed(args.seed)  # same seed everywhere: identical initial weights and ReLA head on every process

    view = T.Compose([T.RandomResizedCrop(28, scale=(0.5, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(),
                      T.Normalize(clean.mean, clean.std)])
    dataset = FashionMNIST("train", limit=args.limit, transform=lambda im: [view(im), view(im)])
    sampler = subset_sampler(dataset, args.fraction, seed=args.seed)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                                             num_workers=args.workers)

    backbone = ConvNet(widths=(32, 64, 128))
    model = BYOL(backbone, backbone.feature_dim)
    # the schedule planned for the run (the papers' constants need ~500+ steps)
    rela = ReLA(store, model.backbone, dataset=clean, schedule=args.schedule, total_steps=args.steps)
    optimizer = torch.optim.AdamW(list(model.parameters()) + list(rela.parameters()), lr=args.lr, weight_decay=0.01)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    accelerator.register_for_checkpointing(rela)
    criterion = NegativeCosineSimilarity()
    byol = accelerator.unwrap_model(model)

    step, resume_step = 0, None
    log = {"rank": accelerator.process_index, "world": accelerator.num_processes, "steps": []}
    if args.resume:
        accelerator.load_state(args.resume)
        step = rela.steps
        resume_step = step % len(dataloader)  # batches of the interrupted epoch trained already
        log["resumed"] = rela_snapshot(rela)
    epoch = step // max(len(dataloader), 1)
    while step < args.steps:
        dataloader.set_epoch(epoch)  # accelerate forwards it to the subset sampler: a fresh subset per epoch
        active = accelerator.skip_first_batches(dataloader, resume_step) if resume_step else dataloader
        resume_step = None
        batches = rela.track(active)  # publishes each yielded batch's indices (the prepared loader reads ahead)
        for (x0, x1), _ in batches:
            momentum = cosine_schedule(step, args.steps, 0.99, 1.0)
            update_momentum(byol.backbone, byol.backbone_momentum, m=momentum)
            update_momentum(byol.projection_head, byol.projection_head_momentum, m=momentum)

            def byol_loss():  # skipped while lambda is 1: then ReLA runs the backbone on x0 alone
                p0, p1 = model(x0), model(x1)
                z0, z1 = byol.forward_momentum(x0), byol.forward_momentum(x1)
                return 0.5 * (criterion(p0, z1) + criterion(p1, z0))

            loss = rela.wrap(byol_loss, inputs=x0)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            s = rela.stats
            mean_loss = accelerator.reduce(loss.detach(), reduction="mean")
            log["steps"].append({"step": step, "epoch": epoch, "lambda": s["lambda"], "lambda_next": rela.lam,
                                 "loss": float(loss.detach()), "loss_mean": float(mean_loss), "loss_rela": s["loss_rela"],
                                 "loss_ssl": s["loss_ssl"], "index": batches.tracker.current.tolist()})
            if accelerator.is_main_process and (step % 10 == 0 or step == args.steps):
                print(f"step {step:4d}  loss {float(mean_loss):.4f}  lambda {s['lambda']:.3f}", flush=True)
            if args.save_state and step == (args.save_at or args.steps):
                accelerator.save_state(args.save_state)
                log["saved"] = rela_snapshot(rela)
            if step >= args.steps:
                break
        epoch += 1

    log["final"] = rela_snapshot(rela)
    log["epoch_subsets"] = {str(e): sampler.subset(e).tolist() for e in range(epoch + 1)}
    if args.log_json:
        out = Path(args.log_json) / f"rank-{accelerator.process_index}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out, log)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return log


if __name__ == "__main__":
    main()
