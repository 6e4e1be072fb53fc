"""What a training step costs at the scale users train, counted exactly on a CPU: FLOPs, bytes, memory.

    .venv/bin/python benchmarks/cost_model.py          # ~3 min on 2 cores

writes ``benchmarks/results/cost_model.json`` + ``.png``. Every count comes from running the step on the ``meta``
device under ``torch.utils.flop_counter.FlopCounterMode`` (nothing large is allocated): batch 256, 224 x 224,
students ResNet-18 / ResNet-50 / ViT-S/16, priors ResNet-50, DINOv2 ViT-S/14, ViT-B/14, ViT-L/14 (at 224 px) and
CLIP ViT-B/32. The steps (BYOL with lightly's head sizes: projector ``D -> 4096 -> 256``, predictor
``256 -> 4096 -> 256``):

- **plain**: BYOL on two views: online network forward + backward on both, momentum network forward on both;
- **rela_mixed** (0 < lambda < 1): plain + the transport head ``D -> n`` forward/backward on both views' features
  and the cached targets of the batch (ReLA's whole overhead);
- **rela_lambda1** (Switch's first stage, the SSL loss given as a callable): student forward + backward on both
  views + the head; no projector, predictor or momentum network;
- **rela_lambda1_one_view**: the same on one view per image (the demo's ``--rela-views clean``: the cached target
  describes the unaugmented image, so one forward of it is enough while lambda = 1);
- **online_teacher** (online distillation, lightly-train's ``distillation``): student forward + backward on both
  views + a projection head, and the frozen teacher's forward on both views, every step;
- **precompute**: the prior's forward on one (unaugmented) image, once per image.

Break-even: precompute costs ``P`` per image once; online distillation pays ``T`` (teacher forward, 2 views) per
image per epoch that ReLA does not. Cached targets are cheaper after ``P / T`` epochs (counting FLOPs).

Memory (per step, bytes): parameters, gradients and AdamW states of what trains, frozen weights once, plus the
tensors autograd saves for backward (the activation memory, counted by storage on ``meta``); a frozen network's
forward saves nothing. Stores: bytes per image of the raw prior output (fp32 / fp16) and of its PCA reduction to
the student's dim; lookup bytes per step = batch x row bytes.

**Validation** (``--no-validate`` skips it): the same step kinds at small scale (64 px, batch 16, ResNet-18 /
ResNet-50 students and priors) are timed on this CPU, and measured time ratios (each step / plain) are set
against counted FLOP ratios: their Pearson correlation is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from accelerate_ssl.results import save_figure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH, SIZE = 256, 224
STUDENTS = {"resnet18": ("torchvision", "resnet18"), "resnet50": ("torchvision", "resnet50"),
            "vit_s16": ("timm", "vit_small_patch16_224")}
PRIORS = {"resnet50": ("torchvision", "resnet50"), "dinov2_vit_s14": ("timm", "vit_small_patch14_dinov2"),
          "dinov2_vit_b14": ("timm", "vit_base_patch14_dinov2"), "dinov2_vit_l14": ("timm", "vit_large_patch14_dinov2"),
          "clip_vit_b32": ("timm", "vit_base_patch32_clip_224")}
KINDS = ("plain", "rela_mixed", "rela_lambda1", "rela_lambda1_one_view", "online_teacher")
GOALS = {"rela_mixed_over_plain_flops": 1.05, "rela_mixed_over_plain_memory": 1.05, "rela_lambda1_over_online": 0.6}


# ---------------------------------------------------------------------------------------------- networks
def backbone(source: str, name: str, size: int = SIZE) -> nn.Module:
    """A feature extractor ``[B, 3, size, size] -> [B, D]`` (random weights: costs do not depend on them)."""
    if source == "torchvision":
        import torchvision

        net = getattr(torchvision.models, name)()
        net.feature_dim = net.fc.in_features
        net.fc = nn.Identity()
        return net
    import timm

    kwargs = {"img_size": size} if "dinov2" in name or size != 224 else {}
    net = timm.create_model(name, pretrained=False, num_classes=0, **kwargs)
    net.feature_dim = net.num_features
    return net


def mlp(d_in: int, hidden: int, d_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def parameters_of(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


# ---------------------------------------------------------------------------------------------- one step, counted
class SavedBytes:
    """Bytes autograd saves for backward during a forward (unique storages, counted on meta)."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        self.storages[storage._cdata] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def run_step(kind: str, student: nn.Module, prior: nn.Module | None, batch: int, size: int, device: str = "meta",
             nets: dict | None = None) -> None:
    """One training step of ``kind`` (forward + backward; no optimiser arithmetic: it is O(parameters))."""
    nets = nets if nets is not None else make_heads(student, prior, device)
    views = [torch.randn(batch, 3, size, size, device=device) for _ in range(2)]
    loss = torch.zeros((), device=device)
    if kind in ("plain", "rela_mixed"):
        for v in views:
            f = student(v)
            loss = loss + nets["predictor"](nets["projector"](f)).sum()
            with torch.no_grad():
                nets["projector_m"](nets["student_m"](v))
            if kind == "rela_mixed":
                loss = loss + nets["rela_head"](f).sum() + nets["targets"].sum()
    elif kind in ("rela_lambda1", "rela_lambda1_one_view"):
        for v in views[: 1 if kind == "rela_lambda1_one_view" else 2]:
            loss = loss + nets["rela_head"](student(v)).sum() + nets["targets"].sum()
    elif kind == "online_teacher":
        for v in views:
            with torch.no_grad():
                prior(v)
            loss = loss + nets["distill_head"](student(v)).sum()
    elif kind == "precompute":
        with torch.no_grad():
            prior(views[0][:1].expand(batch, -1, -1, -1))
        return
    else:
        raise ValueError(kind)
    loss.backward()


def make_heads(student: nn.Module, prior: nn.Module | None, device: str) -> dict:
    import copy

    d = student.feature_dim
    n = min(d, prior.feature_dim) if prior is not None else d
    with torch.device(device):
        nets = {"projector": mlp(d, 4096, 256), "predictor": mlp(256, 4096, 256), "rela_head": nn.Linear(d, n),
                "distill_head": nn.Linear(d, prior.feature_dim if prior is not None else d)}
    nets["student_m"] = copy.deepcopy(student).requires_grad_(False)
    nets["projector_m"] = copy.deepcopy(nets["projector"]).requires_grad_(False)
    nets["targets"] = torch.zeros(BATCH, n, device=device)  # the batch's looked-up rows
    nets["n_components"] = n
    return nets


def count(kind: str, student: nn.Module, prior: nn.Module | None, nets: dict) -> dict:
    saved = SavedBytes()
    with FlopCounterMode(display=False) as fc, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        run_step(kind, student, prior, BATCH if kind != "precompute" else 1, SIZE, nets=nets)
    for m in (student, *[v for v in nets.values() if isinstance(v, nn.Module)]):
        m.zero_grad(set_to_none=True)
    trains = {"plain": (student, nets["projector"], nets["predictor"]),
              "rela_mixed": (student, nets["projector"], nets["predictor"], nets["rela_head"]),
              "rela_lambda1": (student, nets["rela_head"]), "rela_lambda1_one_view": (student, nets["rela_head"]),
              "online_teacher": (student, nets["distill_head"]),
              "precompute": ()}[kind]
    frozen = {"plain": (nets["student_m"], nets["projector_m"]), "rela_mixed": (nets["student_m"], nets["projector_m"]),
              "rela_lambda1": (), "rela_lambda1_one_view": (), "online_teacher": (prior,), "precompute": (prior,)}[kind]
    # fp32 weights; trained ones also hold a gradient and two AdamW moments
    state_bytes = 4 * (4 * parameters_of(*trains) + parameters_of(*frozen))
    extra = 0
    if kind in ("rela_mixed", "rela_lambda1", "rela_lambda1_one_view"):
        extra = BATCH * nets["n_components"] * 4  # the batch's target rows on the device
    return {"flops": int(fc.get_total_flops()), "activation_bytes": saved.total,
            "memory_bytes": state_bytes + saved.total + extra}


def model_costs() -> dict:
    from tqdm import tqdm

    rows, priors = [], {}
    with torch.device("meta"):
        built_priors = {k: backbone(*v) for k, v in PRIORS.items()}
    for k, p in built_priors.items():
        p.eval()
        priors[k] = {"params": parameters_of(p), "dim": p.feature_dim,
                     "precompute_flops_per_image": count("precompute", p, p, make_heads(p, p, "meta"))["flops"]}
    pairs = [(s, p) for s in STUDENTS for p in PRIORS]
    for s_name, p_name in tqdm(pairs, desc="cost model", unit="pair"):
        with torch.device("meta"):
            student = backbone(*STUDENTS[s_name])
        prior = built_priors[p_name]
        nets = make_heads(student, prior, "meta")
        costs = {kind: count(kind, student, prior, nets) for kind in KINDS}
        pre = priors[p_name]["precompute_flops_per_image"]
        teacher_per_image_epoch = 2 * pre  # the online teacher's forward on both views of every image, every epoch
        n = nets["n_components"]
        row = {
            "student": s_name, "prior": p_name, "student_params": parameters_of(student), "student_dim": student.feature_dim,
            "prior_params": priors[p_name]["params"], "prior_dim": priors[p_name]["dim"], "n_components": n,
            "prior_at_least_student": priors[p_name]["params"] >= parameters_of(student),
            "steps": costs,
            "ratios": {
                "rela_mixed_over_plain_flops": costs["rela_mixed"]["flops"] / costs["plain"]["flops"],
                "rela_mixed_over_plain_memory": costs["rela_mixed"]["memory_bytes"] / costs["plain"]["memory_bytes"],
                "rela_lambda1_over_plain_flops": costs["rela_lambda1"]["flops"] / costs["plain"]["flops"],
                "rela_lambda1_over_online": costs["rela_lambda1"]["flops"] / costs["online_teacher"]["flops"],
                "rela_lambda1_one_view_over_online": costs["rela_lambda1_one_view"]["flops"] / costs["online_teacher"]["flops"],
                "rela_mixed_over_online": costs["rela_mixed"]["flops"] / costs["online_teacher"]["flops"],
            },
            "precompute_flops_per_image": pre,
            "teacher_flops_per_image_per_epoch": teacher_per_image_epoch,
            "break_even_epochs": pre / teacher_per_image_epoch,
            "store_bytes_per_image": {"fp32": 4 * priors[p_name]["dim"], "fp16": 2 * priors[p_name]["dim"],
                                      "pca_fp32": 4 * n, "pca_fp16": 2 * n},
            "lookup_bytes_per_step": {"raw_fp32": BATCH * 4 * priors[p_name]["dim"], "pca_fp32": BATCH * 4 * n},
        }
        rows.append(row)
    return {"priors": priors, "pairs": rows}


# ---------------------------------------------------------------------------------------------- validation on this CPU
def validate(reps: int = 3) -> dict:
    """Small-scale runs on this CPU: measured time ratio vs counted FLOP ratio of each step kind over plain."""
    torch.set_num_threads(2)
    size, batch = 64, 16
    points = []
    for s_name in ("resnet18", "resnet50"):
        for p_name in ("resnet18", "resnet50"):
            torch.manual_seed(0)
            student = backbone("torchvision", s_name, size)
            prior = backbone("torchvision", p_name, size).eval()
            nets = make_heads(student, prior, "cpu")
            nets["targets"] = torch.zeros(batch, nets["n_components"])
            flops, seconds = {}, {}
            for kind in KINDS:
                with FlopCounterMode(display=False) as fc:
                    run_step(kind, student, prior, batch, size, device="cpu", nets=nets)
                flops[kind] = fc.get_total_flops()
                times = []
                for _ in range(reps + 1):
                    t = time.perf_counter()
                    run_step(kind, student, prior, batch, size, device="cpu", nets=nets)
                    times.append(time.perf_counter() - t)
                seconds[kind] = statistics.median(times[1:])
            for kind in KINDS[1:]:
                points.append({"student": s_name, "prior": p_name, "kind": kind,
                               "flop_ratio": flops[kind] / flops["plain"], "time_ratio": seconds[kind] / seconds["plain"],
                               "seconds": seconds[kind], "plain_seconds": seconds["plain"]})
    fr = [p["flop_ratio"] for p in points]
    tr = [p["time_ratio"] for p in points]
    return {"size": size, "batch": batch, "reps": reps, "points": points,
            "pearson_r_time_vs_flop_ratio": statistics.correlation(fr, tr)}


# ---------------------------------------------------------------------------------------------- report
def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    pairs = result["model"]["pairs"]
    kinds = KINDS
    labels = [f"{p['student']}\n{p['prior']}" for p in pairs]
    width = 0.16
    for i, kind in enumerate(kinds):
        axes[0].bar([j + i * width for j in range(len(pairs))], [p["steps"][kind]["flops"] / 1e12 for p in pairs],
                    width, label=kind)
    axes[0].set_xticks([j + 1.5 * width for j in range(len(pairs))], labels, rotation=90, fontsize=6)
    axes[0].set(ylabel="TFLOPs per step (batch 256, 224 px)", title="counted cost of one step")
    axes[0].legend(fontsize=7)
    if "validation" in result:
        pts = result["validation"]["points"]
        axes[1].scatter([p["flop_ratio"] for p in pts], [p["time_ratio"] for p in pts])
        lim = max(max(p["flop_ratio"] for p in pts), max(p["time_ratio"] for p in pts)) * 1.1
        axes[1].plot([0, lim], [0, lim], "k--", lw=0.8)
        axes[1].set(xlabel="counted FLOP ratio (step / plain)", ylabel="measured time ratio on this CPU",
                    title=f"validation, r = {result['validation']['pearson_r_time_vs_flop_ratio']:.3f}")
    fig.tight_layout()
    save_figure(fig, png, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cost_model.json")
    p.add_argument("--no-validate", action="store_true", help="skip the timed small-scale validation on this CPU")
    args = p.parse_args(argv)
    from accelerate_ssl import __version__
    from accelerate_ssl.results import write_results

    result = {"command": " ".join([sys.executable, *sys.argv]), "library_version": __version__,
              "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform()},
              "batch": BATCH, "image_size": SIZE, "goals": GOALS, "model": model_costs()}
    if not args.no_validate:
        result["validation"] = validate()
    pairs = result["model"]["pairs"]
    result["goals_met"] = {
        "rela_mixed_over_plain_flops": all(r["ratios"]["rela_mixed_over_plain_flops"] <= GOALS["rela_mixed_over_plain_flops"] for r in pairs),
        "rela_mixed_over_plain_memory": all(r["ratios"]["rela_mixed_over_plain_memory"] <= GOALS["rela_mixed_over_plain_memory"] for r in pairs),
        "rela_lambda1_over_online_when_prior_at_least_student": all(
            r["ratios"]["rela_lambda1_over_online"] <= GOALS["rela_lambda1_over_online"] for r in pairs if r["prior_at_least_student"]),
        "rela_lambda1_one_view_over_online_when_prior_at_least_student": all(
            r["ratios"]["rela_lambda1_one_view_over_online"] <= GOALS["rela_lambda1_over_online"]
            for r in pairs if r["prior_at_least_student"]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_results(args.out, result, ROOT)
    plot(result, args.out.with_suffix(".png"))
    print(f"{'student':9} {'prior':15} {'plain TF':>8} {'mixed/plain':>11} {'mem':>6} {'l1/online':>9} {'1view/online':>12} "
          f"{'break-even ep':>13}")
    for r in pairs:
        q = r["ratios"]
        print(f"{r['student']:9} {r['prior']:15} {r['steps']['plain']['flops'] / 1e12:8.2f} {q['rela_mixed_over_plain_flops']:11.4f} "
              f"{q['rela_mixed_over_plain_memory']:6.3f} {q['rela_lambda1_over_online']:9.3f} "
              f"{q['rela_lambda1_one_view_over_online']:12.3f} {r['break_even_epochs']:13.2f}")
    if "validation" in result:
        print(f"validation: Pearson r(time ratio, FLOP ratio) = {result['validation']['pearson_r_time_vs_flop_ratio']:.3f}")
    print("goals met:", json.dumps(result["goals_met"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
