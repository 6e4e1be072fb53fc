"""``synthesize``: the batch loop shared by SRe2L, SRe2L++, DWA, FADRM and FADRM+ (methods registry).

One batch holds one image per class (chunks of ``class_chunk`` classes), so IPC images per class need
``ipc * ceil(C / class_chunk)`` batches; ``batch_group`` batches of the same chunk share each teacher call
(a speed setting; every batch keeps its own statistics, loss and random numbers). Every batch draws its random numbers from generators seeded by
``(seed, batch index)``, and the real images used for initialisation are chosen once from the seed (per
class, without reuse), so a run interrupted after any batch and resumed gives exactly the images of an
uninterrupted run. Finished batches are kept in ``out_dir/.partial/`` until the set is complete.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import time
from dataclasses import fields
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from ..atomic import atomic_torch_save
from .dataset import MANIFEST, PARTIAL, DistilledSet, atomic_write_json
from .dwa import DWAConfig, dwa_batch
from .fadrm import FADRMConfig, fadrm_batch
from .recover import RecoverConfig, frozen_teacher, recover_batch


def _plain_batch(teachers, x_init, labels, config, generators, mean, std):
    if len(teachers) != 1:
        raise ValueError(f"SRe2L uses one teacher, got {len(teachers)}; pass a single model (or use method 'fadrm+').")
    return recover_batch(teachers[0], x_init, labels, config, generators["recover"], mean, std)


# name -> (config class, defaults, batch function, number of teachers: 1 or "2+")
METHODS: dict[str, tuple[type, dict, Callable, str]] = {
    "sre2l": (RecoverConfig, {"init": "noise"}, _plain_batch, "1"),
    "sre2l++": (RecoverConfig, {"init": "real"}, _plain_batch, "1"),
    "dwa": (DWAConfig, {}, dwa_batch, "1"),
    "fadrm": (FADRMConfig, {}, fadrm_batch, "1"),
    "fadrm+": (FADRMConfig, {}, fadrm_batch, "2+"),
}


def list_methods() -> list[str]:
    return list(METHODS)


def create_config(method: str, **overrides) -> RecoverConfig:
    """The configuration of ``method`` (see :data:`METHODS`) with ``overrides`` applied."""
    if method not in METHODS:
        raise ValueError(f"Unknown distillation method {method!r}; choose one of {list(METHODS)}.")
    cls, defaults, _, _ = METHODS[method]
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"Unknown hyper-parameter(s) {unknown} for method {method!r}; valid: {sorted(names)}.")
    return cls(**{**defaults, **overrides})


# ------------------------------------------------------------------------------------------------ helpers


def _seed_for(seed: int, *parts) -> int:
    digest = hashlib.sha256(json.dumps([seed, *parts]).encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def seeded_generator(seed: int, *parts) -> torch.Generator:
    """A CPU generator seeded by ``seed`` and the names of what it draws (``"perm"``, ``epoch``...): runs resume
    with the same draws."""
    return torch.Generator().manual_seed(_seed_for(seed, *parts))


def teacher_fingerprint(teacher: nn.Module) -> str:
    """SHA-256 over the teacher's state_dict (names, shapes, bytes): resuming with another teacher is refused."""
    h = hashlib.sha256()
    for name, value in teacher.state_dict().items():
        h.update(name.encode())
        h.update(str(tuple(value.shape)).encode())
        h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def real_labels(real) -> torch.Tensor:
    """Labels of a real data set: ``(images, labels)``, a data set with ``.targets``, or any data set."""
    if isinstance(real, (tuple, list)) and len(real) == 2 and torch.is_tensor(real[1]):
        return real[1].long()
    targets = getattr(real, "targets", None)
    if targets is not None:
        return torch.as_tensor(np.asarray(targets), dtype=torch.long)
    return torch.tensor([int(real[i][1]) for i in range(len(real))], dtype=torch.long)


def real_image(real, index: int) -> torch.Tensor:
    """One real image as float ``[C, H, W]`` in [0, 1] (PIL image, uint8 tensor or float tensor in [0, 1])."""
    if isinstance(real, (tuple, list)) and len(real) == 2 and torch.is_tensor(real[0]):
        img = real[0][index]
    else:
        img = real[index][0]
    if not torch.is_tensor(img):
        from torchvision.transforms.functional import pil_to_tensor

        img = pil_to_tensor(img)
    if img.dtype == torch.uint8:
        img = img.float() / 255.0
    img = img.float()
    if img.ndim == 2:
        img = img.unsqueeze(0)
    return img


def select_real(labels: torch.Tensor, classes: Sequence[int], ipc: int, seed: int) -> dict[int, list[int]]:
    """``ipc`` distinct random real indices per class (DWA Alg. 1 line 4: none reused)."""
    chosen = {}
    for c in classes:
        idx = torch.nonzero(labels == c).flatten()
        if len(idx) < ipc:
            raise ValueError(
                f"Class {c} has only {len(idx)} real image(s) but ipc={ipc} real initialisations are needed "
                f"(one distinct image per synthetic image); pass ipc <= {len(idx)}, add images of class {c}, "
                f"or use method 'sre2l' (noise initialisation)."
            )
        perm = torch.randperm(len(idx), generator=seeded_generator(seed, "select", c))
        chosen[c] = idx[perm[:ipc]].tolist()
    return chosen


def _probe_classes(teacher: nn.Module, shape: tuple[int, int, int], device) -> int:
    with torch.no_grad(), frozen_teacher(teacher):
        out = teacher(torch.zeros(2, *shape, device=device))
    if out.ndim != 2:
        raise ValueError(f"The teacher must return class logits [B, num_classes]; got output shape {tuple(out.shape)}.")
    return out.shape[1]


# ------------------------------------------------------------------------------------------------ main entry


def synthesize(
    teacher: nn.Module | Sequence[nn.Module],
    *,
    method: str = "dwa",
    ipc: int = 10,
    real=None,
    mean: Sequence[float] = (0.5,),
    std: Sequence[float] = (0.5,),
    image_size: Optional[int] = None,
    channels: Optional[int] = None,
    num_classes: Optional[int] = None,
    class_names: Optional[Sequence[str]] = None,
    out_dir: Optional[str] = None,
    seed: int = 0,
    teacher_spec: Optional[str | Sequence[str]] = None,
    device: Optional[str | torch.device] = None,
    progress: bool = True,
    callback: Optional[Callable[[int, torch.Tensor, dict], None]] = None,
    **hparams,
) -> DistilledSet:
    """Synthesise ``ipc`` images per class from a frozen BatchNorm teacher (or several for ``"fadrm+"``).

    Args:
        teacher: classifier(s) taking the *normalised* input ``(x01 - mean) / std`` and returning logits.
        method: ``"sre2l"`` (noise init), ``"sre2l++"`` (real init), ``"dwa"`` (DWA), ``"fadrm"``,
            ``"fadrm+"`` (FADRM; 2+ teachers round-robin).
        real: real images for initialisation: a data set of ``(PIL/tensor image in [0,1], label)`` (e.g.
            ``accelerate_ssl.data.FashionMNIST()``) or ``(images [N,C,H,W] in [0,1] or uint8, labels)``.
            Required by every method except ``"sre2l"``.
        mean, std: the teacher's input normalisation (per channel); pixels are clamped to its valid range.
        image_size, channels: needed only without ``real`` (noise init); otherwise read from the data.
        num_classes: defaults to the teacher's output size; must match it and the real labels.
        out_dir: save PNG class folders + ``images.pt`` + ``manifest.json`` there; resumes per batch.
        seed: all randomness (init choice, augmentation, noise) derives from it.
        teacher_spec: a string (or one per teacher) recorded in the manifest (e.g. ``"resnet_small:teacher.pt"``).
        callback: called as ``callback(batch_index, images, history)`` after each finished batch.
        **hparams: overrides of the method's config (:func:`create_config`), e.g. ``iterations=500, rho=0``.

    Returns:
        The :class:`DistilledSet` (also saved when ``out_dir`` is given). The teacher(s) are bit-identical
        afterwards (parameters and buffers). Its manifest records the synthesis cost of the batch function
        alone (per batch: initialisation, loading and saving excluded): ``seconds`` (wall clock, CUDA
        synchronised) and ``cpu_seconds`` (``time.process_time``: CPU time of all threads of this process,
        insensitive to waiting for a core on a shared machine), in total and per image.
    """
    config = create_config(method, **hparams)
    _, _, batch_fn, n_teachers = METHODS[method]
    teachers = list(teacher) if isinstance(teacher, (list, tuple)) else [teacher]
    if n_teachers == "1" and len(teachers) != 1:
        raise ValueError(f"Method {method!r} uses one teacher, got {len(teachers)}; pass one model or method 'fadrm+'.")
    if n_teachers == "2+" and len(teachers) < 2:
        raise ValueError(f"Method {method!r} needs at least two teachers (round-robin), got {len(teachers)}; pass a list of models or use 'fadrm'.")
    if ipc < 1:
        raise ValueError(f"ipc must be >= 1, got {ipc}.")
    device = torch.device(device) if device is not None else next(teachers[0].parameters()).device

    if config.init == "real" and real is None:
        raise ValueError(f"Method {method!r} initialises from real images; pass real=<data set or (images, labels)>, or use method 'sre2l'.")
    labels_all = real_labels(real) if real is not None else None
    if real is not None:
        sample = real_image(real, 0)
        channels, image_size = sample.shape[0], sample.shape[-1]
    if image_size is None or channels is None:
        raise ValueError("Without real images pass image_size= and channels= (the teacher's input shape).")
    if len(mean) != channels or len(std) != channels:
        raise ValueError(f"mean/std have {len(mean)}/{len(std)} entries but the images have {channels} channel(s); pass one per channel.")

    outputs = [_probe_classes(t, (channels, image_size, image_size), device) for t in teachers]
    if len(set(outputs)) != 1:
        raise ValueError(f"The teachers predict different numbers of classes {outputs}; pass teachers trained on the same label set.")
    n_out = outputs[0]
    num_classes = n_out if num_classes is None else num_classes
    if num_classes != n_out:
        raise ValueError(f"num_classes={num_classes} but the teacher predicts {n_out} classes; pass num_classes={n_out} or a matching teacher.")
    if labels_all is not None:
        present = int(labels_all.max()) + 1
        if present != num_classes or int(labels_all.min()) < 0:
            raise ValueError(
                f"The real data has labels 0..{present - 1} ({present} classes) but the teacher predicts {num_classes}; "
                "pass real data with the teacher's label set (same class count and order)."
            )
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(f"class_names has {len(class_names)} entries for {num_classes} classes; pass one name per class.")

    classes = list(range(num_classes))
    chunks = [classes[i : i + config.class_chunk] for i in range(0, num_classes, config.class_chunk)]
    n_batches = ipc * len(chunks)
    chosen = select_real(labels_all, classes, ipc, seed) if config.init == "real" else None

    specs = teacher_spec if isinstance(teacher_spec, (list, tuple)) else [teacher_spec] * len(teachers)
    run = {
        "method": method,
        "hparams": config.to_dict(),
        "seed": seed,
        "ipc": ipc,
        "num_classes": num_classes,
        "class_names": list(class_names) if class_names is not None else None,
        "mean": [float(m) for m in mean],
        "std": [float(s) for s in std],
        "image_size": image_size,
        "channels": channels,
        "teachers": [{"spec": s or type(t).__name__, "fingerprint": teacher_fingerprint(t)} for s, t in zip(specs, teachers)],
        "real_indices": {str(c): v for c, v in chosen.items()} if chosen else None,
    }
    run = json.loads(json.dumps(run))  # the form it has on disk (tuples -> lists), for resume comparisons

    out = Path(out_dir) if out_dir is not None else None
    partial = None
    if out is not None:
        if (out / MANIFEST).exists():
            existing = json.loads((out / MANIFEST).read_text())
            if {k: existing.get(k) for k in run} == run and existing.get("status") == "complete":
                return DistilledSet.load(out)
            raise ValueError(f"{out} already holds a different distilled set ({existing.get('method')}); pass a new out_dir, "
                             f"or replace it with this one: `rm -r {shlex.quote(str(out))}`, then run this again.")
        partial = out / PARTIAL
        partial.mkdir(parents=True, exist_ok=True)
        run_file = partial / "run.json"
        if run_file.exists():
            previous = json.loads(run_file.read_text())
            if previous != run:
                diff = sorted(k for k in run if previous.get(k) != run[k])
                raise ValueError(f"{out} holds an unfinished run with different settings ({diff}); pass a new out_dir, or "
                                 f"start this one over there: `rm -r {shlex.quote(str(partial))}`, then run this again.")
        else:
            atomic_write_json(run_file, run)

    results: list[Optional[dict]] = [None] * n_batches
    todo = []
    for b in range(n_batches):
        f = partial / f"batch_{b:05d}.pt" if partial is not None else None
        if f is not None and f.exists():
            results[b] = torch.load(f, map_location="cpu", weights_only=True)
        else:
            todo.append(b)

    from tqdm.auto import tqdm

    bar = tqdm(total=n_batches, initial=n_batches - len(todo), desc=f"distill {method}", unit="batch", disable=not progress)
    m = torch.tensor(list(mean)).view(1, -1, 1, 1)
    s = torch.tensor(list(std)).view(1, -1, 1, 1)

    def batch_init(b: int, gens: dict) -> torch.Tensor:
        i, chunk = divmod(b, len(chunks))
        cls = chunks[chunk]
        if config.init == "real":
            return ((torch.stack([real_image(real, chosen[c][i]) for c in cls]) - m) / s).to(device)
        return torch.randn(len(cls), channels, image_size, image_size, generator=gens["recover"]).to(device)

    # batches of the same class chunk, config.batch_group at a time (one teacher call per step for the group)
    by_chunk: dict[int, list[int]] = {}
    for b in todo:
        by_chunk.setdefault(b % len(chunks), []).append(b)
    groups = [bs[j : j + config.batch_group] for bs in by_chunk.values() for j in range(0, len(bs), config.batch_group)]
    groups.sort(key=lambda g: g[0])

    with frozen_teacher(*teachers):
        for group in groups:
            cls = chunks[group[0] % len(chunks)]
            gens = [{"recover": seeded_generator(seed, "recover", b), "perturb": seeded_generator(seed, "perturb", b)} for b in group]
            x_init = torch.cat([batch_init(b, g) for b, g in zip(group, gens)])
            labels = torch.tensor(cls * len(group), dtype=torch.long, device=device)
            if len(group) == 1:
                group_gens = gens[0]
            else:
                group_gens = {key: [g[key] for g in gens] for key in gens[0]}
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            x, history = batch_fn(teachers, x_init, labels, config, group_gens, mean, std)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            histories = [history] if len(group) == 1 else history
            for j, (b, hist) in enumerate(zip(group, histories)):
                images = x[j * len(cls) : (j + 1) * len(cls)].detach().cpu()
                # a group's cost is shared equally by its batches
                result = {"images": images, "labels": labels[: len(cls)].cpu(), "seconds": seconds / len(group),
                          "cpu_seconds": cpu_seconds / len(group), "final_loss": hist["loss"][-1]}
                results[b] = result
                if partial is not None:
                    atomic_torch_save(result, partial / f"batch_{b:05d}.pt")
                bar.update(1)
                bar.set_postfix(loss=f"{hist['loss'][-1]:.3f}")
                if callback is not None:
                    callback(b, result["images"], hist)
    bar.close()

    images = torch.cat([r["images"] for r in results])
    labels = torch.cat([r["labels"] for r in results])
    seconds = sum(float(r["seconds"]) for r in results)
    cpu_seconds = sum(float(r.get("cpu_seconds", float("nan"))) for r in results)
    manifest = dict(run, status="complete", seconds=seconds, seconds_per_image=seconds / len(images),
                    cpu_seconds=cpu_seconds, cpu_seconds_per_image=cpu_seconds / len(images), device=str(device))
    distilled = DistilledSet(images, labels, manifest)
    if out is not None:
        distilled.save(out)
        shutil.rmtree(partial, ignore_errors=True)
    return distilled
