"""Train a prior for Fashion-MNIST on CPU: the demo's label-free BYOL prior, and the other rungs of the prior ladder.

The prior that ``accelerate-ssl demo`` uses by default ships inside the package
(``accelerate_ssl/assets/``). It was made by this script and never saw a label: training reads only
the 60k train images; labels are used only afterwards, to report the prior's own linear-probe
accuracy (train split -> test split).

``--objective supervised`` trains the same ConvNet with a linear classifier on the Fashion-MNIST training
*labels* (the stand-in for "a strong public model trained with labels"); ``--data digits`` trains on
scikit-learn's 1797 digits resized to 28 px instead (a prior from other data). The probe is always
Fashion-MNIST's.

Every hyper-parameter is independent of the total number of steps (constant learning rate and
EMA momentum), so the checkpoint this script writes at step k is exactly the model a run with
``--steps k`` produces: the run is resumable from ``--cache`` and can be stopped at any checkpoint.

    .venv/bin/python benchmarks/train_demo_prior.py --steps 2000

writes ``accelerate_ssl/assets/demo_prior_convnet.safetensors`` (+ its JSON metadata) and
``benchmarks/results/train_demo_prior.json`` (command, machine, timings, probe accuracy).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accelerate_ssl.atomic import atomic_torch_save  # noqa: E402
from accelerate_ssl.backbones import ConvNet  # noqa: E402
from accelerate_ssl.data import Digits, FashionMNIST  # noqa: E402
from accelerate_ssl.recipes import BYOL, Probe, Supervised, random_batches, tensor_batches, train_ssl  # noqa: E402
from accelerate_ssl.recipes.views import FASHION_MNIST_MEAN, FASHION_MNIST_STD  # noqa: E402
from accelerate_ssl.results import write_results  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4000, help="BYOL optimiser steps")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant)")
    p.add_argument("--momentum", type=float, default=0.99, help="EMA momentum of the target network (constant)")
    p.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128], help="ConvNet block widths")
    p.add_argument("--objective", choices=("byol", "supervised"), default="byol",
                   help="byol: no label seen; supervised: cross-entropy on the training labels")
    p.add_argument("--data", choices=("fashion-mnist", "digits"), default="fashion-mnist",
                   help="training images (digits: scikit-learn's 1797, resized to 28 px: a prior from other data)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--checkpoint-every", type=int, default=250)
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/demo_prior"), help="resumable checkpoints")
    p.add_argument("--out", default=str(ROOT / "accelerate_ssl/assets/demo_prior_convnet.safetensors"))
    p.add_argument("--results", default=str(ROOT / "benchmarks/results/train_demo_prior.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)

    train = FashionMNIST("train")
    source = train if args.data == "fashion-mnist" else Digits("all", size=28)
    mean, std = (FASHION_MNIST_MEAN, FASHION_MNIST_STD) if args.data == "fashion-mnist" else (source.mean[0], source.std[0])
    images = source.data.float().div(255.0).sub(mean).div(std).unsqueeze(1)
    backbone = ConvNet(widths=tuple(args.widths))
    if args.objective == "byol":  # BYOL reads no label
        model = BYOL(backbone, backbone.feature_dim)
    else:
        model = Supervised(backbone, backbone.feature_dim, source.targets)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    step, elapsed = 0, 0.0
    ckpt = cache / "last.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        made = {k: state["args"].get(k, default) for k, default in (("widths", None), ("seed", None),
                                                                    ("objective", "byol"), ("data", "fashion-mnist"))}
        if made != {k: getattr(args, k) for k in made}:
            raise ValueError(f"{ckpt} was made with other settings ({state['args']}); delete it or pass --cache elsewhere.")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step, elapsed = state["step"], state["elapsed"]
        print(f"resumed from {ckpt} at step {step}")

    t0 = time.perf_counter() - elapsed

    def save(done: int, loss: float) -> None:
        if done % args.checkpoint_every == 0 or done == args.steps:
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": done,
                     "elapsed": time.perf_counter() - t0, "args": vars(args)}
            atomic_torch_save(state, ckpt)
            atomic_torch_save({"backbone": backbone.state_dict(), "step": done}, cache / f"backbone_{done:06d}.pt")

    # one generator for the batches and the views, saved with every checkpoint: a resumed run is the same run
    train_ssl(model, tensor_batches(images, random_batches(len(images), args.batch_size, gen)), args.steps,
              optimizer=opt, view_generator=gen, momentum=args.momentum, on_step=save, start_step=step,
              progress=f"{args.objective} prior")
    step = max(step, args.steps)
    train_time = time.perf_counter() - t0

    test = FashionMNIST("test")
    probe_n = 20000
    fm_train = train.data[:probe_n].float().div(255.0).sub(mean).div(std).unsqueeze(1)  # the prior's own normalisation
    fm_test = test.data.float().div(255.0).sub(mean).div(std).unsqueeze(1)
    acc = Probe(fm_train, train.targets[:probe_n], fm_test, test.targets, seed=args.seed)(backbone)
    print(f"prior linear probe (first {probe_n} train -> 10k test): {acc:.2f} %")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from accelerate_ssl.priors import save_prior_checkpoint

    preprocess = {"channels": 1, "mean": [float(mean)], "std": [float(std)], "stats": "dataset"}
    save_prior_checkpoint(backbone, out, arch="convnet", arch_kwargs=backbone.config, preprocess_config=preprocess)
    record = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": {"cpu_count": os.cpu_count(), "threads": args.threads, "torch": torch.__version__, "platform": platform.platform()},
        "args": vars(args), "train_seconds": train_time, "steps": step,
        "linear_probe_top1": acc, "probe_protocol": f"first {probe_n} train images -> 10k test, standardised features, Adam 1e-3, 30 epochs",
        "weights": str(out), "labels_used_for_training": args.objective == "supervised",
        "training_data": args.data,
    }
    res = Path(args.results)
    res.parent.mkdir(parents=True, exist_ok=True)
    write_results(res, record, ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
