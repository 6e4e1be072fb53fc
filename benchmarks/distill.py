"""Distilled warm-start sets on Fashion-MNIST: random real vs SRe2L, SRe2L++, DWA, FADRM, FADRM+ at IPC 10.

Protocol (identical for every row):
  * teacher A: ResNetSmall (BatchNorm, widths 16/32/64) trained here for --teacher-epochs on --teacher-train
    images (cached in benchmarks/cache/); teacher B for FADRM+: a BatchNorm ConvNet + linear classifier.
  * synthesis: --iterations recover steps per batch for every method (FADRM: the same budget B, k = 3,
    alpha = 0.5, MRO with D_ds = --ds-size; "FADRM (no MRO)" is the same budget at 28 px, for the cost ratio).
    Recover crop: RandomResizedCrop area --recover-crop-min..1 for every method. Default 0.5, not SRe2L's
    ImageNet value 0.08: at 28 px an 8 % crop is an 8x8-pixel patch blown up to 28x28, so the teacher is fed
    mostly blur and the loss stops preserving the real initialisation (with 0.08, SRe2L++ and DWA end
    *below* random real images here). SRe2L's CIFAR/Tiny recipes likewise use milder crops than ImageNet's.
  * student: a fresh ResNetSmall (8/16/32) trained by online KD (KL, T = --temperature, CutMix, AdamW
    lr --student-lr (3e-3) / wd 0.01, cosine) on the 100 images for --student-epochs, evaluated on the 10k test split;
    3 student seeds -> mean +- std. Soft labels: teacher A (FADRM+: mean logits of A and B, as the paper).
  * cost: synthesis seconds per image of the full run; cost *ratios* from a separate interleaved pass
    (--timing-rounds rounds, each times one 10-image batch of every method in turn, order rotated), median
    of the per-round ratios. What is timed: the batch function only (the recover/DWA/FADRM loop; not the
    initial image loading, teacher probing or saving), as CPU time of this process (time.process_time; what
    the paper's cost model, Eq. 8, counts: compute, unaffected by waiting for a core on a shared machine) and
    as wall-clock time, both reported; the goals use the CPU-time ratios.
  * MRO cost section (the issue's goal "FADRM with MRO costs <= the cost model, Eq. 8"): FADRM vs FADRM
    (no MRO), same budget, interleaved over --timing-rounds rounds, with --mro-batch-group batches of 10
    images per teacher call (RecoverConfig.batch_group: per-batch statistics/loss/augmentation, the same
    images up to rounding), at 28 px and at --mro-timing-size (Fashion-MNIST resized bilinearly, D_ds scaled
    alike, the same fully convolutional teacher A; timing only, no accuracy). Why: Eq. 8 assumes cost ~ D^2
    with no fixed per-step costs; on this CPU a 10-image step has ~5 ms of them at any size (a oneDNN
    convolution call costs ~0.3 ms forward+backward even at 7 px), so the 14-px step costs ~55 % of the
    28-px one instead of 25 %. Grouping amortises them; at 28 px the convolutions themselves still scale
    worse than D^2 (7x7 and 4x4 maps), at 56 px they do not.
  * memory: peak RSS above the RSS before the run, sampled every 2 ms by a thread
    (tracemalloc does not see torch's CPU allocator). On CUDA also max_memory_allocated, and FADRM with
    and without mixed precision.

Run:  .venv/bin/python benchmarks/distill.py              (15 min on 2 CPU cores)
      .venv/bin/python benchmarks/distill.py --quick      (a few minutes, smoke test)
Scale up: --iterations 1000 --student-epochs 300 --teacher-epochs 10 --teacher-train 60000.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from accelerate_ssl.backbones import ConvNet, ResNetSmall  # noqa: E402
from accelerate_ssl.data import FashionMNIST  # noqa: E402
from accelerate_ssl.distill import DistilledSet, mro_cost_ratio, synthesize, train_student  # noqa: E402
from accelerate_ssl.results import save_figure, write_results  # noqa: E402
from measure import PeakRSS  # noqa: E402
from accelerate_ssl.atomic import atomic_path  # noqa: E402

# bump when a change to the synthesis code changes the images, so cached sets are not reused
SYNTH_VERSION = 3  # 2: augmentation as separable matrices, MRO roll scaled to the low resolution; 3: batch_group in the manifest

ROWS = ["random real", "SRe2L", "SRe2L++", "DWA", "FADRM", "FADRM (no MRO)", "FADRM+ (2 teachers)"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--ipc", type=int, default=10)
    p.add_argument("--iterations", type=int, default=300, help="recover steps per batch, same for every method")
    p.add_argument("--ds-size", type=int, default=14, help="FADRM's MRO resolution D_ds at 28 px")
    p.add_argument("--recover-crop-min", type=float, default=0.5,
                   help="lower area bound of the recover RandomResizedCrop for every method (default 0.5 for 28-px "
                        "images; SRe2L's ImageNet 0.08 crops 8x8-pixel patches at 28 px, see the protocol above)")
    p.add_argument("--mro-batch-group", type=int, default=10,
                   help="MRO cost section: batches per teacher call (= IPC timed per round); 0 skips the section")
    p.add_argument("--mro-timing-size", type=int, default=56,
                   help="MRO cost section: also at images resized to this size (D_ds scaled alike); 0: 28 px only")
    p.add_argument("--mro-timing-iterations", type=int, default=100,
                   help="MRO cost section: budget B (a multiple of 4 keeps b/B = 1/4 as in the main runs)")
    p.add_argument("--teacher-epochs", type=int, default=2)
    p.add_argument("--teacher-train", type=int, default=20000, help="training images for the teachers")
    p.add_argument("--student-epochs", type=int, default=60)
    p.add_argument("--student-batch", type=int, default=20)
    p.add_argument("--student-lr", type=float, default=3e-3, help="AdamW lr (3e-3 beat the paper's 1e-3 for this short schedule)")
    p.add_argument("--temperature", type=float, default=4.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="student seeds")
    p.add_argument("--timing-rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest on a shared machine)")
    p.add_argument("--fresh", action="store_true", help="re-synthesise even when a cached set exists")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny budgets (numbers not meaningful)")
    p.add_argument("--out", default=str(ROOT / "results" / "distill.json"))
    p.add_argument("--cache", default=str(ROOT / "cache" / "distill"))
    args = p.parse_args(argv)
    if args.quick:
        args.iterations, args.teacher_epochs, args.teacher_train = 20, 1, 3000
        args.student_epochs, args.seeds, args.timing_rounds, args.ipc = 4, [0], 1, 2
        args.mro_timing_iterations, args.mro_batch_group = 8, 2
    return args


# ------------------------------------------------------------------------------------------------ memory


# ------------------------------------------------------------------------------------------------ models


class ConvNetClassifier(nn.Sequential):
    def __init__(self):
        super().__init__(ConvNet(1, (16, 32, 64), norm="batch"), nn.Linear(64, 10))


def normalise(images_u8: torch.Tensor, mean, std) -> torch.Tensor:
    return (images_u8.float().div(255.0).unsqueeze(1) - mean[0]) / std[0]


def train_teacher(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int) -> nn.Module:
    """Supervised training of a classifier teacher through the library's recipe (``recipes.Supervised`` on the
    network's own logits): Adam 2e-3, 10 % warm-up then cosine, batches of 128, resized crops (area 0.8-1) + flips."""
    from accelerate_ssl.recipes import Supervised, ViewConfig, shuffled_batches, tensor_batches, train_ssl, warmup_cosine_lr

    steps = epochs * (len(x) // 128)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    train_ssl(Supervised(model, None, y), tensor_batches(x, shuffled_batches(len(x), 128, seed)), steps, optimizer=opt,
              view_generator=torch.Generator().manual_seed(seed), views=ViewConfig(scale=(0.8, 1.0), jitter=0.0),
              lr=warmup_cosine_lr(2e-3, steps), progress=f"teacher {type(model).__name__}")
    return model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), 1000):
        correct += int((model(x[i : i + 1000]).argmax(1) == y[i : i + 1000]).sum())
    return correct / len(x)


def cached_teacher(name, factory, x, y, epochs, seed, cache: Path):
    key = hashlib.sha256(json.dumps([name, epochs, seed, len(x), "recipe"]).encode()).hexdigest()[:12]
    path = cache / f"teacher_{name}_{key}.pt"
    torch.manual_seed(seed)  # the teacher's initial weights
    model = factory()
    if path.exists():
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval(), True, path
    t0 = time.perf_counter()
    train_teacher(model, x, y, epochs, seed)
    print(f"trained {name} in {time.perf_counter() - t0:.0f} s")
    with atomic_path(path) as tmp:
        torch.save(model.state_dict(), tmp)
    return model, False, path


# ------------------------------------------------------------------------------------------------ methods


def method_specs(args, teacher_a, teacher_b):
    """row name -> (synthesize method, teachers, hyper-parameters); one shared iteration budget."""
    base = {"iterations": args.iterations, "crop_scale": (args.recover_crop_min, 1.0)}
    return {
        "SRe2L": ("sre2l", teacher_a, dict(base)),
        "SRe2L++": ("sre2l++", teacher_a, dict(base)),
        "DWA": ("dwa", teacher_a, dict(base)),
        "FADRM": ("fadrm", teacher_a, dict(base, ds_size=args.ds_size)),
        "FADRM (no MRO)": ("fadrm", teacher_a, dict(base, ds_size=None)),
        "FADRM+ (2 teachers)": ("fadrm+", [teacher_a, teacher_b], dict(base, ds_size=args.ds_size)),
    }


def random_real(train: FashionMNIST, ipc: int, seed: int, mean, std) -> DistilledSet:
    g = torch.Generator().manual_seed(seed)
    idx = []
    for c in range(10):
        pool = torch.nonzero(train.targets == c).flatten()
        idx += pool[torch.randperm(len(pool), generator=g)[:ipc]].tolist()
    idx = torch.tensor(idx)
    return DistilledSet(normalise(train.data[idx], mean, std), train.targets[idx],
                        {"mean": list(mean), "std": list(std), "num_classes": 10, "method": "random real"})


def interleaved_timing(specs, real, mean, std, args, label="", ipc=1) -> dict:
    """Wall and CPU seconds per image of ``ipc`` batches (10 images each) of every method, interleaved over rounds."""
    names = [n for n in specs]
    wall, cpu = {n: [] for n in names}, {n: [] for n in names}
    for r in range(args.timing_rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            method, teachers, hp = specs[n]
            d = synthesize(teachers, method=method, ipc=ipc, real=real, mean=mean, std=std, seed=1000 + r,
                           progress=False, **hp)
            wall[n].append(d.manifest["seconds_per_image"])
            cpu[n].append(d.manifest["cpu_seconds_per_image"])
            print(f"  timing round {r}{label}: {n:22s} cpu {cpu[n][-1]:.3f} s/image, wall {wall[n][-1]:.3f}", flush=True)
    return {"cpu": cpu, "wall": wall}


def median_ratio(per_round: dict, a: str, b: str) -> float:
    return statistics.median([x / y for x, y in zip(per_round[a], per_round[b])])


def resized_real(train: FashionMNIST, size: int, n: int = 2000):
    """``n`` random training images resized bilinearly to ``size`` px (in [0, 1]) and their labels."""
    pick = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:n]
    x = train.data[pick].float().div(255.0).unsqueeze(1)
    if size != x.shape[-1]:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).clamp(0, 1)
    return x, train.targets[pick]


def mro_section(teacher_a, train, mean, std, args) -> dict:
    """FADRM vs FADRM (no MRO) with --mro-batch-group batches per teacher call, at 28 px and --mro-timing-size
    (images resized, D_ds scaled alike), interleaved over --timing-rounds rounds; timing only."""
    out = {"batch_group": args.mro_batch_group, "iterations": args.mro_timing_iterations, "ipc": args.mro_batch_group,
           "sizes": {}}
    sizes = [28] + ([args.mro_timing_size] if args.mro_timing_size and args.mro_timing_size != 28 else [])
    for size in sizes:
        ds = int(round(args.ds_size * size / 28))
        real = resized_real(train, size)
        base = {"iterations": args.mro_timing_iterations, "crop_scale": (args.recover_crop_min, 1.0),
                "batch_group": args.mro_batch_group}
        specs = {"FADRM": ("fadrm", teacher_a, dict(base, ds_size=ds)),
                 "FADRM (no MRO)": ("fadrm", teacher_a, dict(base, ds_size=None))}
        timing = interleaved_timing(specs, real, mean, std, args, label=f" @{size}px group {args.mro_batch_group}",
                                    ipc=args.mro_batch_group)
        out["sizes"][str(size)] = {
            "ds_size": ds,
            "fadrm_mro_over_no_mro_cpu": median_ratio(timing["cpu"], "FADRM", "FADRM (no MRO)"),
            "fadrm_mro_over_no_mro_wall": median_ratio(timing["wall"], "FADRM", "FADRM (no MRO)"),
            "fadrm_cost_model": mro_cost_ratio(args.mro_timing_iterations, 3, ds, size),
            "per_round_seconds_per_image": timing}
    return out


@torch.no_grad()
def accuracy_at_size(model, x, y, size) -> float:
    """Teacher accuracy on test images resampled to ``size`` px (what the teacher sees in MRO's low-res phase)."""
    return accuracy(model, F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False), y)


def cuda_section(teacher_a, train, mean, std, args) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine; on a GPU this section reports FADRM seconds/image and "
                           "peak GPU memory with and without mixed precision (fp16 autocast + GradScaler)."}
    import copy

    dev = torch.device("cuda")
    t = copy.deepcopy(teacher_a).to(dev)
    out = {"device": torch.cuda.get_device_name(dev)}
    for precision in ("fp32", "fp16"):
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        d = synthesize(t, method="fadrm", ipc=max(1, args.ipc), real=train, mean=mean, std=std, seed=0,
                       iterations=args.iterations, ds_size=args.ds_size, precision=precision, device=dev, progress=False)
        out[precision] = {"seconds_per_image": d.manifest["seconds_per_image"],
                          "peak_memory_mb": (torch.cuda.max_memory_allocated(dev) - base) / 2**20}
    out["speedup_mixed_precision"] = out["fp32"]["seconds_per_image"] / out["fp16"]["seconds_per_image"]
    return out


# ------------------------------------------------------------------------------------------------ main


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)

    train = FashionMNIST("train")
    test = FashionMNIST("test")
    mean, std = train.mean, train.std
    g = torch.Generator().manual_seed(0)
    sub = torch.randperm(len(train), generator=g)[: args.teacher_train]
    x_tr, y_tr = normalise(train.data[sub], mean, std), train.targets[sub]
    x_te, y_te = normalise(test.data, mean, std), test.targets

    teacher_a, cached_a, file_a = cached_teacher("resnet_small", lambda: ResNetSmall(1, 10, (16, 32, 64)), x_tr, y_tr, args.teacher_epochs, 0, cache)
    teacher_b, cached_b, file_b = cached_teacher("convnet_bn", ConvNetClassifier, x_tr, y_tr, args.teacher_epochs, 1, cache)
    teacher_acc = {"A resnet_small(16,32,64)": accuracy(teacher_a, x_te, y_te), "B convnet_bn(16,32,64)+linear": accuracy(teacher_b, x_te, y_te),
                   f"A on test images resampled to D_ds = {args.ds_size} px": accuracy_at_size(teacher_a, x_te, y_te, args.ds_size)}
    print("teacher test accuracy:", teacher_acc, flush=True)

    specs = method_specs(args, teacher_a, teacher_b)
    teacher_digest = [hashlib.sha256(f.read_bytes()).hexdigest() for f in (file_a, file_b)]
    sets, synth = {}, {}
    sets["random real"] = random_real(train, args.ipc, 0, mean, std)
    for name, (method, teachers, hp) in specs.items():
        # a cached set belongs to the exact teachers it was distilled from (their files' bytes are in the key)
        key = hashlib.sha256(json.dumps([SYNTH_VERSION, name, method, hp, args.ipc, teacher_digest]).encode()).hexdigest()[:12]
        out_dir = cache / f"set_{method}_{key}"
        was_cached = (out_dir / "manifest.json").exists() and not args.fresh
        if args.fresh and out_dir.exists():
            import shutil

            shutil.rmtree(out_dir)
        with PeakRSS() as mem:
            d = synthesize(teachers, method=method, ipc=args.ipc, real=train, mean=mean, std=std, seed=0,
                           out_dir=str(out_dir), teacher_spec=["resnet_small", "convnet_bn"][: 2 if method == "fadrm+" else 1],
                           **hp)
        sets[name] = d
        synth[name] = {"seconds_per_image": d.manifest["seconds_per_image"], "peak_rss_mb": None if was_cached else mem.mib,
                       "from_cache": was_cached, "hparams": d.manifest["hparams"], "folder": str(out_dir)}
        print(f"{name}: {synth[name]['seconds_per_image']:.3f} s/image (cached={was_cached})", flush=True)

    print("interleaved timing pass", flush=True)
    timing = interleaved_timing(specs, train, mean, std, args)
    cpu, wall = timing["cpu"], timing["wall"]
    cost = {
        "measured": "CPU seconds (time.process_time) of the batch function; *_wall: the same from wall-clock time",
        "dwa_over_sre2lpp": median_ratio(cpu, "DWA", "SRe2L++"),
        "dwa_over_sre2lpp_wall": median_ratio(wall, "DWA", "SRe2L++"),
        "fadrm_mro_over_no_mro": median_ratio(cpu, "FADRM", "FADRM (no MRO)"),
        "fadrm_mro_over_no_mro_wall": median_ratio(wall, "FADRM", "FADRM (no MRO)"),
        "fadrm_cost_model": mro_cost_ratio(args.iterations, 3, args.ds_size, 28),
        "fadrm_plus_over_fadrm": median_ratio(cpu, "FADRM+ (2 teachers)", "FADRM"),
        "per_round_seconds_per_image": timing,
    }
    if args.mro_batch_group:
        print(f"MRO timing with {args.mro_batch_group} batches per teacher call", flush=True)
        cost["mro_grouped"] = mro_section(teacher_a, train, mean, std, args)

    results = {}
    for name in ROWS:
        accs = []
        for seed in args.seeds:
            torch.manual_seed(seed)
            student = ResNetSmall(1, 10, (8, 16, 32))
            teachers = [teacher_a, teacher_b] if name.startswith("FADRM+") else teacher_a
            train_student(student, sets[name], teachers=teachers, epochs=args.student_epochs, batch_size=args.student_batch,
                          temperature=args.temperature, lr=args.student_lr, mix="cutmix", crop_scale=(0.25, 1.0), seed=seed,
                          progress=False)
            accs.append(accuracy(student, x_te, y_te))
        results[name] = {"accuracy_mean": float(np.mean(accs)), "accuracy_std": float(np.std(accs)), "accuracies": accs,
                         **synth.get(name, {})}
        print(f"{name:22s} acc {np.mean(accs) * 100:.2f} +- {np.std(accs) * 100:.2f}", flush=True)

    acc = {n: results[n]["accuracy_mean"] for n in ROWS}
    goals = {
        "dwa_beats_sre2lpp": {"met": acc["DWA"] > acc["SRe2L++"], "margin_pts": 100 * (acc["DWA"] - acc["SRe2L++"])},
        "dwa_beats_random_real": {"met": acc["DWA"] > acc["random real"], "margin_pts": 100 * (acc["DWA"] - acc["random real"])},
        "sre2lpp_beats_random_real": {"met": acc["SRe2L++"] > acc["random real"], "margin_pts": 100 * (acc["SRe2L++"] - acc["random real"])},
        "dwa_cost_le_1.10x_sre2lpp": {"met": cost["dwa_over_sre2lpp"] <= 1.10, "ratio": cost["dwa_over_sre2lpp"]},
        "fadrm_mro_cost_le_model": {"met": cost["fadrm_mro_over_no_mro"] <= cost["fadrm_cost_model"],
                                    "ratio": cost["fadrm_mro_over_no_mro"], "model": cost["fadrm_cost_model"], "size": 28},
    }
    for size, m in cost.get("mro_grouped", {}).get("sizes", {}).items():
        goals[f"fadrm_mro_cost_le_model_{size}px_group{cost['mro_grouped']['batch_group']}"] = {
            "met": m["fadrm_mro_over_no_mro_cpu"] <= m["fadrm_cost_model"], "ratio": m["fadrm_mro_over_no_mro_cpu"],
            "ratio_wall": m["fadrm_mro_over_no_mro_wall"], "model": m["fadrm_cost_model"], "size": int(size),
            "ds_size": m["ds_size"]}
    report = {
        "command": "python " + " ".join([sys.argv[0]] + (sys.argv[1:] if argv is None else list(argv))),
        "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "platform": platform.platform(), "cuda": torch.cuda.is_available()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "cache")},
        "protocol": {"student": "ResNetSmall(8,16,32), online KD (KL, T=%g), CutMix, crop 0.25-1, AdamW lr %g wd 0.01 cosine, "
                                "batch %d, %d epochs over the 100 images; test accuracy on the 10k test split" % (
                                    args.temperature, args.student_lr, args.student_batch, args.student_epochs),
                     "memory": "peak RSS above the RSS at the start of each full synthesis, sampled every 2 ms (MB); "
                               "None when the set came from the cache",
                     "cost_ratios": "median of per-round ratios in the interleaved timing pass (one 10-image batch per method per round)"},
        "teacher_accuracy": teacher_acc,
        "teachers_from_cache": {"A": cached_a, "B": cached_b},
        "rows": results,
        "cost": cost,
        "goals": goals,
        "cuda": cuda_section(teacher_a, train, mean, std, args),
        "wall_seconds": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_results(out, report, ROOT.parent, sort_keys=True)
    plot(report, sets, out.with_suffix(".png"))
    print(json.dumps({"goals": goals, "cost": {k: v for k, v in cost.items() if k != "per_round_seconds_per_image"}}, indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')} in {report['wall_seconds']:.0f} s")


def plot(report, sets, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ROWS
    fig = plt.figure(figsize=(13, 9))
    gs = fig.add_gridspec(2, 2, height_ratios=[1, 1.3])
    ax = fig.add_subplot(gs[0, 0])
    m = [100 * report["rows"][r]["accuracy_mean"] for r in rows]
    s = [100 * report["rows"][r]["accuracy_std"] for r in rows]
    ax.barh(rows, m, xerr=s, color="tab:blue")
    ax.set_xlim(min(m) - 10, max(m) + 5)
    ax.invert_yaxis()
    ax.set_xlabel("student test accuracy (%)")
    ax.set_title(f"Fashion-MNIST IPC {report['settings']['ipc']}, {len(report['settings']['seeds'])} seeds")
    ax = fig.add_subplot(gs[0, 1])
    t = {r: statistics.median(report["cost"]["per_round_seconds_per_image"]["cpu"][r]) for r in rows[1:]}
    ax.barh(list(t), list(t.values()), color="tab:orange")
    ax.invert_yaxis()
    ax.set_xlabel("synthesis CPU s / image (interleaved, median)")
    ax.set_title(f"CPU-time ratios: DWA/SRe2L++ {report['cost']['dwa_over_sre2lpp']:.2f}x\nFADRM MRO/no-MRO 28 px, 1 batch/call: "
                 f"{report['cost']['fadrm_mro_over_no_mro']:.2f}x (model {report['cost']['fadrm_cost_model']:.3f})"
                 + "".join(f"\n{size} px, {report['cost']['mro_grouped']['batch_group']} batches/call: "
                           f"{m['fadrm_mro_over_no_mro_cpu']:.2f}x (model {m['fadrm_cost_model']:.3f})"
                           for size, m in report["cost"].get("mro_grouped", {}).get("sizes", {}).items()), fontsize=9)
    ax = fig.add_subplot(gs[1, :])
    grid = []
    for r in rows:
        d = sets[r]
        first = torch.stack([d.images_01()[(d.labels == c).nonzero()[0, 0]] for c in range(10)])
        grid.append(torch.cat(list(first[:, 0]), dim=1))
    ax.imshow(torch.cat(grid, 0).numpy(), cmap="gray", vmin=0, vmax=1)
    ax.set_yticks([14 + 28 * i for i in range(len(rows))], rows)
    ax.set_xticks([14 + 28 * c for c in range(10)], [str(c) for c in range(10)])
    ax.set_title("first image of every class")
    fig.tight_layout()
    save_figure(fig, path, dpi=90)


if __name__ == "__main__":
    main()
