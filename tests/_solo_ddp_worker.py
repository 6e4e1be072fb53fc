"""Run by tests/test_integration_solo_learn.py under `python -m torch.distributed.run --nproc_per_node 2`: solo-learn's
method contract with ReLAMixin, trained by Lightning's DDP strategy with find_unused_parameters=False (solo-learn's
setting) on 2 gloo CPU processes, through the end of every schedule. Writes what it saw as JSON (rank 0)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from solo_contract import IndexedTwoViews, make_methods, targets  # noqa: E402

from accelerate_ssl.schedules import Constant, Decay, Epochs, Switch  # noqa: E402

STEPS = 8


def schedules():
    return {
        "switch": Switch(fast_momentum=0.0, slow_momentum=0.0),  # switches after its first step
        "decay": Decay(loss_momentum=0.0, rho_momentum=0.5, finish_below=0.5),  # lambda 0.8 * 0.5^k: done at the first plateau
        "epochs": Epochs(0.5, total_steps=STEPS),  # lambda = 0 from step 4 on
        "constant0": Constant(0.0),  # finished from the start: the head never gets a ReLA gradient
    }


def main(out: str) -> None:
    torch.set_num_threads(1)
    head_grads: list = []
    counts = {"head_grad_all_reduce": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):  # ReLA's own averaging calls this on the head's .grad
        if any(tensor is g for g in head_grads):
            counts["head_grad_all_reduce"] += 1
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    results = {}
    for name, schedule in schedules().items():
        torch.manual_seed(0)
        _, _, BYOLReLA = make_methods(pl)
        model = BYOLReLA({"lr": 0.05}, rela_targets=targets(), rela_schedule=schedule)
        trained_after_finish = []

        class Watch(pl.Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                trained_after_finish.append(bool(module.rela.schedule.finished))

            def on_before_optimizer_step(self, trainer, module, optimizer):
                head_grads[:] = [p.grad for p in module.rela_head.parameters()]

        trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=2, num_nodes=1, logger=False,
                             strategy=DDPStrategy(find_unused_parameters=False, process_group_backend="gloo"),
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[Watch()])
        trainer.fit(model, DataLoader(IndexedTwoViews(), batch_size=4, shuffle=True))
        weights = [torch.zeros_like(model.rela_head.weight) for _ in range(dist.get_world_size())]
        dist.all_gather(weights, model.rela_head.weight.detach().contiguous())
        results[name] = {"steps": model.rela.steps, "finished": bool(model.rela.schedule.finished),
                         "steps_after_finish": sum(trained_after_finish), "global_step": trainer.global_step,
                         "head_equal_on_ranks": all(torch.equal(weights[0], w) for w in weights[1:])}
    results["head_grad_all_reduce_by_rela"] = counts["head_grad_all_reduce"]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # skip interpreter teardown of the gloo group (both ranks are done)
