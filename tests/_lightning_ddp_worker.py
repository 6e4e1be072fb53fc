"""Data, module and 2-process runs for tests/test_integration_lightning.py.

``python _lightning_ddp_worker.py lightning OUT_DIR``: a real ``lightning.Trainer(strategy="ddp", accelerator="cpu",
devices=2)`` (Lightning launches the second process by re-running this script) with ReLACallback, the distributed
sampler Lightning puts in, a new loader every epoch, gradient accumulation and clipping; each rank saves what it saw.

``python -m torch.distributed.run --nproc_per_node 2 _lightning_ddp_worker.py closure OUT_DIR``: a plain DDP loop
stepped with ``opt.step(closure)``, head in the user's optimiser and in ReLA's own; each rank saves the head after
every step.

The data: item i is ``([view0, view1], label)`` with no index in it, but ``view0[0, 0, 0] == i``, so a test can
read the sample's own index back out of the batch; targets are ``target_rows(N)``, a known function of the index.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipe_check import ReadSpy  # noqa: E402  (this folder is on the path when run as a script, and in the tests)

N, SIDE, DIM = 40, 6, 8


def target_rows(n: int = N) -> torch.Tensor:
    """Row i: a known function of i (distinct, finite)."""
    i = torch.arange(n, dtype=torch.float32)[:, None]
    return torch.cat([i, torch.sin(i), torch.cos(0.5 * i), (i % 7) - 3.0, torch.sqrt(i + 1.0)], dim=1)


class IndexImages(Dataset):
    """lightly-style items ``([view0, view1], label)``; view0's first pixel is the item's index."""

    def __init__(self, n: int = N):
        g = torch.Generator().manual_seed(0)
        self.images = torch.rand(n, 1, SIDE, SIDE, generator=g)
        self.images[:, 0, 0, 0] = torch.arange(n, dtype=torch.float32)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        x = self.images[i]
        return [x, 0.5 * x.flip(-1)], i % 3


def own_index(batch) -> torch.Tensor:
    """The dataset indices of the samples in a batch, read from the images themselves."""
    return batch[0][0][:, 0, 0, 0].round().long().cpu()


def make_module(pl, head_in_user_optimizer: bool = True):
    """A lightly-style LightningModule: ``backbone``, a projection, a two-view loss; ``training_step`` is the user's
    with ``loss = self.rela.wrap(loss)`` added, plus what the tests record about each step."""

    class Student(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Flatten(), nn.Linear(SIDE * SIDE, DIM), nn.Tanh())
            self.projection = nn.Linear(DIM, 4)
            self.steps_seen: list = []  # per batch: (own index, rows read, rows expected)

        def training_step(self, batch, batch_idx):
            (x0, x1), _ = batch
            p0, p1 = self.projection(self.backbone(x0)), self.projection(self.backbone(x1))
            loss = -F.cosine_similarity(p0, p1).mean()
            spy, lam = self.rela.targets.store, self.rela.lam
            reads = len(spy.reads)
            loss = self.rela.wrap(loss)
            own = own_index(batch)
            # the rows ReLA read for this batch (none once lambda is 0 for good) and the indices it was handed
            self.steps_seen.append({"own": own, "expected": target_rows()[own], "lambda": lam,
                                    "read": spy.reads[-1] if len(spy.reads) == reads + 1 else None,
                                    "n_new_reads": len(spy.reads) - reads,
                                    "published": self.rela._current_index.clone()})
            return loss

        def on_fit_start(self):
            if not isinstance(self.rela.targets.store, ReadSpy):
                self.rela.targets.store = ReadSpy(self.rela.targets.store)

        def configure_optimizers(self):
            params = list(self.parameters())
            if head_in_user_optimizer:
                params += list(self.rela.parameters())
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    return Student


# ---------------------------------------------------------------------------------------------- lightning DDP
def run_lightning(out: Path) -> None:
    import lightning.pytorch as pl
    import torch.distributed as dist

    from accelerate_ssl.integrations.lightning import ReLACallback

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    head_grads: list = []
    counts = {"head_all_reduce": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        # the head's gradients, averaged in one flattened all-reduce (weight and bias together)
        if head_grads and all(g is not None for g in head_grads) and \
                tensor.numel() == sum(g.numel() for g in head_grads) and \
                torch.equal(tensor, torch.cat([g.flatten() for g in head_grads])):
            counts["head_all_reduce"] += 1
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    record = {"head": [], "backbone": [], "lambda": [], "loaders": [], "optimizer_steps": 0,
              "steps_with_head_grad": 0}

    class Watch(pl.Callback):
        def on_train_epoch_start(self, trainer, module):
            record["loaders"].append(id(trainer.train_dataloader))

        def on_after_backward(self, trainer, module):
            head_grads[:] = [p.grad for p in module.rela.parameters()]

        def on_before_optimizer_step(self, trainer, module, optimizer):
            record["steps_with_head_grad"] += any(p.grad is not None for p in module.rela.parameters())

        def on_before_zero_grad(self, trainer, module, optimizer):
            record["optimizer_steps"] += 1

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            record["head"].append(torch.cat([p.detach().flatten() for p in module.rela.parameters()]).clone())
            record["backbone"].append(torch.cat([p.detach().flatten() for p in module.backbone.parameters()]).clone())
            record["lambda"].append(module.rela.lam)

    Student = make_module(pl, head_in_user_optimizer=True)
    model = Student()
    loader = DataLoader(IndexImages(), batch_size=4, shuffle=True)  # 40 items: 5 batches of 4 per rank
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                         use_distributed_sampler=True, reload_dataloaders_every_n_epochs=1, accumulate_grad_batches=2,
                         gradient_clip_val=0.05, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[ReLACallback(target_rows(), dataset=IndexImages(), schedule="epochs:0.5",
                                                 n_components=None), Watch()])
    trainer.fit(model, loader)
    rank = trainer.global_rank
    torch.save({**record, "steps_seen": model.steps_seen, "rela_steps": model.rela.steps,
                "global_step": trainer.global_step, "estimated": trainer.estimated_stepping_batches,
                "switch_step": model.rela.schedule.switch_step, "head_all_reduce": counts["head_all_reduce"],
                "world_size": trainer.world_size}, out / f"rank{rank}.pt")
    trainer.strategy.barrier()


# ---------------------------------------------------------------------------------------------- closure DDP
def run_closure(out: Path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accelerate_ssl.rela import ReLA

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = IndexImages()
    result = {}
    for mode in ("user", "own"):
        torch.manual_seed(0)  # the same initial weights on both ranks
        backbone = nn.Sequential(nn.Flatten(), nn.Linear(SIDE * SIDE, DIM), nn.Tanh())
        model = DDP(backbone)
        rela = ReLA(target_rows(), backbone, feature_dim=DIM, n_components=None, schedule="constant:0.5",
                    head_optimizer=mode)
        params = list(model.parameters()) + (list(rela.parameters()) if mode == "user" else [])
        opt = torch.optim.SGD(params, lr=0.5)
        heads = []
        for step in range(4):
            idx = torch.arange(4) + 4 * (2 * step + rank)  # each rank its own samples
            x = torch.stack([data[int(i)][0][0] for i in idx])

            def closure():
                opt.zero_grad()
                loss = rela.wrap(model(x).pow(2).mean(), index=idx)
                loss.backward()
                return loss

            opt.step(closure)
            heads.append(torch.cat([p.detach().flatten() for p in rela.parameters()]).clone())
        result[mode] = torch.stack(heads)
        rela.close()
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    {"lightning": run_lightning, "closure": run_closure}[mode](out)
    os._exit(0)  # skip interpreter teardown of the gloo group (both ranks are done)
