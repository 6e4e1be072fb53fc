"""lightly-train's own ``distillation`` with our prior as its custom teacher: one run of ``head_to_head.py``.

Runs in a SEPARATE virtual environment that has ``lightly-train`` (AGPL-3.0: never a dependency of accelerate-ssl,
never imported by the package; this file only imports the package's backbone and prior code)::

    python3 -m venv /work/lt-venv && /work/lt-venv/bin/pip install lightly-train
    /work/lt-venv/bin/python benchmarks/head_to_head_lightly_train.py --data DIR --out DIR ...

``head_to_head.py`` calls it once per seed (``--lightly-train-python``). The student is the benchmark's (its ConvNet,
or its ViT: ``head_to_head.student``), initialised from the same seed as the other methods' students; the teacher is the prior's own network (our spec, our
weights), handed to lightly-train as a model wrapper (``forward_features``: the last feature map, ``forward_pool``:
its global average, as the prior's output). Everything else is lightly-train's default for ``method="distillation"``
(v3: global + local KL to a queue of teacher features, its views, its optimiser and schedule), except: the image
size, one input channel and our normalisation; full float32 on the CPU; the run length in optimiser steps
(``trainer_args.max_steps``); one loader worker. The student's weights are saved every ``--every`` steps, with the
seconds since ``pretrain`` was called, into ``--out/steps.json`` and ``--out/step_<k>.pt``, with the CPU seconds of the run's process and its loader
worker by then (sampled every 0.5 s); a finished run leaves
``steps.json`` with ``"finished": true`` (rerunning it then does nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402


class Wrapped(torch.nn.Module):
    """A ConvNet (``.features`` then global average pool) in lightly-train's model-wrapper protocol."""

    def __init__(self, net: torch.nn.Module, dim: int):
        super().__init__()
        self.net, self.dim = net, dim

    def forward_features(self, x):
        return {"features": self.net.features(x)}

    def forward_pool(self, out):
        return {"pooled_features": out["features"].mean((2, 3), keepdim=True)}

    def feature_dim(self) -> int:
        return self.dim

    def get_model(self):
        return self.net


class WrappedViT(Wrapped):
    """A timm ViT (mean-pooled patch tokens, then its ``fc_norm``) in the same protocol: its patch tokens as a map."""

    def forward_features(self, x):
        tokens = self.net.forward_features(x)[:, self.net.num_prefix_tokens:]
        side = int(round(tokens.shape[1] ** 0.5))
        return {"features": tokens.transpose(1, 2).reshape(len(x), -1, side, side)}

    def forward_pool(self, out):
        return {"pooled_features": self.net.fc_norm(out["features"].mean((2, 3)))[:, :, None, None]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="folder of the training images (PNG)")
    p.add_argument("--out", required=True)
    p.add_argument("--teacher", required=True, help="prior spec (create_prior)")
    p.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--student", choices=("convnet", "vit"), default="convnet")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--image-size", type=int, required=True)
    p.add_argument("--mean", type=float, required=True)
    p.add_argument("--std", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    out = Path(a.out)
    record = out / "steps.json"
    if record.is_file() and json.loads(record.read_text()).get("finished"):
        print(f"{record}: finished already")
        return 0
    torch.set_num_threads(a.threads)
    import lightly_train

    from accelerate_ssl.atomic import atomic_torch_save, atomic_write_json
    from accelerate_ssl.priors import create_prior
    from head_to_head import student as create_student

    torch.manual_seed(a.seed)
    student = create_student(argparse.Namespace(student=a.student, widths=a.widths, canvas=a.image_size))  # same draw
    prior = create_prior(a.teacher)
    teacher = Wrapped(prior.model.net, prior.output_dim)
    n_images = sum(1 for f in os.scandir(a.data) if f.name.endswith(".png"))
    epochs = math.ceil(a.steps / (n_images // a.batch_size))
    ckpt_dir = out / "lightly-train"
    import threading

    import psutil

    me, samples, running = psutil.Process(), [], threading.Event()

    def cpu() -> float:  # this process and its loader workers, all threads
        return sum(c.cpu_times().user + c.cpu_times().system for c in [me, *me.children(recursive=True)])

    def sample():
        while not running.wait(0.5):
            samples.append((time.time(), cpu()))

    running.clear()
    sampler = threading.Thread(target=sample, daemon=True)
    t0, c0 = time.time(), cpu()
    sampler.start()
    lightly_train.pretrain(
        out=str(ckpt_dir), data=a.data, model=(WrappedViT if a.student == "vit" else Wrapped)(student, student.feature_dim),
        method="distillation",
        method_args={"teacher": teacher}, epochs=epochs, batch_size=a.batch_size, num_workers=1, accelerator="cpu",
        devices=1, precision="32-true", seed=a.seed, overwrite=True,
        transform_args={"image_size": (a.image_size, a.image_size), "num_channels": 1,
                        "normalize": {"mean": [a.mean], "std": [a.std]}},
        trainer_args={"max_steps": a.steps},
        callbacks={"model_checkpoint": {"every_n_train_steps": a.every, "save_top_k": -1, "save_last": False,
                                        "filename": "{step}"}})
    wall = time.time() - t0
    running.set()
    sampler.join()

    def cpu_at(t: float) -> float:  # the sampled CPU seconds at wall time t, linearly interpolated
        before = max((x for x in samples if x[0] <= t), default=(t0, c0))
        after = min((x for x in samples if x[0] >= t), default=before)
        w = 0.0 if after[0] == before[0] else (t - before[0]) / (after[0] - before[0])
        return before[1] + w * (after[1] - before[1]) - c0
    steps = []
    prefix = "student_embedding_model.wrapped_model.net."
    for ckpt in sorted((ckpt_dir / "checkpoints").glob("step=*.ckpt"), key=lambda f: int(f.stem.split("=")[1])):
        k = int(ckpt.stem.split("=")[1])
        state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
        weights = {key[len(prefix):]: v for key, v in state.items() if key.startswith(prefix)}
        student.load_state_dict(weights)
        atomic_torch_save(student.state_dict(), out / f"step_{k}.pt")
        steps.append({"step": k, "seconds": ckpt.stat().st_mtime - t0, "cpu_seconds": cpu_at(ckpt.stat().st_mtime)})
    atomic_write_json(record, {"finished": True, "wall_seconds": wall, "epochs": epochs, "images": n_images,
                               "lightly_train": getattr(lightly_train, "__version__", None), "torch": torch.__version__,
                               "load_average_end": os.getloadavg(), "checkpoints": steps}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
