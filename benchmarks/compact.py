"""Compact self-supervised data sets (Yu et al. (2025)) on Fashion-MNIST at a storage budget of N images.

Students pretrained by regression on (a) random real images + teacher targets, (b) KRR-ST (no
parameterisation), (c) bases only (image and representation bases + coefficients, all trained: the
paper's "+parameterisation" row) and (c) full (bases + rotations + approximation nets), then
linear-probed on frozen features (Fashion-MNIST test split). Reference rows: the random-init student
and the teacher itself. Also distillation time and peak memory (RSS above the baseline), the
approximation nets' fit (share of each rotation's target variance they miss), and the paired per-seed
differences (every row of seed s starts from the same student init).

    .venv/bin/python benchmarks/compact.py          # defaults (see results/compact.json "total_seconds")
    .venv/bin/python benchmarks/compact.py --plot-only   # redraw the PNG from the JSON
    .venv/bin/python benchmarks/compact.py --teacher train --teacher-steps 400   # teacher trained here (Barlow Twins)
    .venv/bin/python benchmarks/compact.py --U 196 --V 128 --approx-hidden 4     # the paper's rules (m = 62)
    .venv/bin/python benchmarks/compact.py --student-loss mse                    # paper's MSE student loss

Storage (every row counted the same way, targets included; N = 100 -> 78,400 floats): (a) and
(b) hold floor(78,400 / (784 + d_y)) images with their targets (85 at d_y = 128: 77,520 floats);
(c) takes the largest m that fits next to its bases and nets: U = V = 64 -> m = 450 (bases only)
and m = 255 (full, three H = 64 approximation nets). The paper's rule U = V = 2N, capped by the
dimension, gives U = 196 (the whole 14x14 space: a full-rank basis that compresses nothing) and
V = 128 (= d_y), leaving m = 62 < 85. Yu et al. (2025) gives its Random/KMeans rows N images and does
not count their targets; here they are counted (budget.pixel_images_for_budget).

Settings, and why:

- Teacher: the shipped BYOL ConvNet 32/64/128 (``shipped:fashion-mnist-byol``, label-free, 128-d).
  A Barlow Twins teacher trained here for 400 steps (``--teacher train``) carries too little: its
  students do not rise above the random-init student, so nothing can be ranked.
- Student loss: cosine regression ``1 - cos(head(f(x)), y)`` for every row (``--student-loss mse``
  is the paper's; on 85 pairs it pulls the student below its random init). 200 epochs, SGD lr 0.1.
- Outer steps: 500 (paper: 30k), identical for (b) and (c); pool of 4 width-16 ConvNets, Z = 100,
  real batch 256. The KRR-ST init images of seed 0 are the (a) images of seed 0 (same draw).
- Approximation nets H = 64: the paper's H = 4 misses 46-55 % of the rotated targets' variance on
  this teacher (an ``ApproxFitWarning``); H = 64 misses 2.5-2.8 % for 24,960 floats.
- Probe: the library's (:class:`accelerate_ssl.recipes.Probe`: standardised features, Adam 1e-3,
  30 epochs), 10,000 labelled train images -> the 10,000 test images.

Result of the defaults (results/compact.json): (a) 76.09 +- 0.64, (b) 76.38 +- 0.33, (c) bases only
77.15 +- 0.29, (c) full 79.11 +- 0.02 (random-init student 76.76 +- 1.16, teacher 82.47); c > b > a,
full - bases only +1.96 on every seed. Open question: the x2-upsampled 14x14 images are blurred, so the
teacher's features of a decoded image differ from the stored target of its sharp original.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accelerate_ssl.backbones import ConvNet  # noqa: E402
from accelerate_ssl.compact import (  # noqa: E402
    CompactDataset, DistillConfig, Distiller, Teacher, load_teacher, pixel_compact, pixel_images_for_budget, pretrain,
    save_teacher, train_teacher,
)
from accelerate_ssl.data import load_fashion_mnist  # noqa: E402
from accelerate_ssl.recipes import Probe  # noqa: E402
from accelerate_ssl.results import save_figure, write_results  # noqa: E402
from accelerate_ssl.priors import shipped_prior_file  # noqa: E402
from measure import PeakRSS  # noqa: E402

CACHE = ROOT / "benchmarks" / "cache"
RESULTS = ROOT / "benchmarks" / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=int, default=100, help="storage budget N (images)")
    p.add_argument("--n-real", type=int, default=20000, help="unlabelled training images used for teacher + distillation")
    p.add_argument("--teacher", default="demo-prior",
                   help="demo-prior: the library's shipped BYOL ConvNet 32/64/128 (trained on unlabelled Fashion-MNIST by "
                        "benchmarks/train_demo_prior.py, 1000 steps); train: train one here with --teacher-method/-steps/-widths "
                        "(cached); or a path written by save_teacher")
    p.add_argument("--teacher-method", default="barlow_twins", choices=["barlow_twins", "byol"])
    p.add_argument("--teacher-steps", type=int, default=400)
    p.add_argument("--teacher-batch", type=int, default=128)
    p.add_argument("--teacher-widths", default="16,32,64")
    p.add_argument("--steps", type=int, default=500, help="outer distillation steps (identical for b and c)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW lr on the synthetic tensors (paper: 1e-3)")
    p.add_argument("--real-batch", type=int, default=256)
    p.add_argument("--pool-size", type=int, default=4)
    p.add_argument("--pool-max-steps", type=int, default=100)
    p.add_argument("--pool-width", type=int, default=16)
    p.add_argument("--augmentations", default="rotate", help="predefined augmentations of (c) full")
    p.add_argument("--approx-hidden", type=int, default=64,
                   help="hidden units H of (c) full's approximation nets (paper: 4, which leaves 46-55%% of the rotated "
                        "targets' variance unexplained here; 64: 5%%)")
    p.add_argument("--U", type=int, default=64, help="image bases of (c) (paper: min(2N, 196) = 196, full rank at 14x14: no compression)")
    p.add_argument("--V", type=int, default=64, help="representation bases of (c) (paper: min(2N, d_y) = 128, full rank)")
    p.add_argument("--distill-seeds", default="0", help="comma list; students of seed s use distill seed s if run, else the first")
    p.add_argument("--seeds", default="0,1,2", help="student seeds")
    p.add_argument("--student-widths", default="16,32,64")
    p.add_argument("--student-epochs", type=int, default=200)
    p.add_argument("--student-lr", type=float, default=0.1)
    p.add_argument("--student-wd", type=float, default=1e-3)
    p.add_argument("--student-batch", type=int, default=256)
    p.add_argument("--student-loss", default="cosine", choices=["mse", "cosine"],
                   help="regression loss of the students (all rows): mse = the paper's (accelerate_ssl.compact.pretrain); "
                        "cosine = 1 - cos(head(student(x)), y), scale-free in the targets")
    p.add_argument("--probe-train", type=int, default=10000, help="labelled training images for the linear probe")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-cache", action="store_true", help="recompute the teacher and distilled stores")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from the existing --out JSON and exit")
    p.add_argument("--out", default=str(RESULTS / "compact.json"))
    return p.parse_args(argv)


def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def key(d: dict) -> str:
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


DEMO_PRIOR = shipped_prior_file("fashion-mnist-byol")  # the library's shipped prior (accelerate_ssl/assets)


def demo_prior_teacher() -> Teacher:
    """The shipped demo prior as a frozen teacher: BYOL ConvNet 32/64/128 (GroupNorm, 128-d features)
    trained by ``benchmarks/train_demo_prior.py`` on unlabelled Fashion-MNIST train images (1000
    steps; results/train_demo_prior.json). Its input normalisation (mean 0.286, std 0.353) is the
    benchmark's (statistics of the first 20k train images: 0.286 / 0.353)."""
    from safetensors import safe_open

    with safe_open(str(DEMO_PRIOR), framework="pt") as f:
        meta = json.loads(f.metadata()["accelerate_ssl_prior"])
        state = {k: f.get_tensor(k) for k in f.keys()}
    net = ConvNet(**meta["arch_kwargs"])
    net.load_state_dict(state)
    return Teacher(net, net.feature_dim, {"source": "demo_prior", "path": str(DEMO_PRIOR.relative_to(ROOT)),
                                          "method": "byol", "steps": 1000, "arch_kwargs": meta["arch_kwargs"]})


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return 0
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    CACHE.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/compact.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    # -- data (labels only for the probe) -------------------------------------------------------
    tr_x, tr_y = load_fashion_mnist("train")
    te_x, te_y = load_fashion_mnist("test")
    to_t = lambda a: torch.from_numpy(a).float().div(255.0).unsqueeze(1)
    real = to_t(tr_x[: args.n_real])
    mean, std = float(real.mean()), float(real.std())
    norm = lambda t: (t - mean) / std
    real = norm(real)
    probe_x, probe_y = norm(to_t(tr_x[: args.probe_train])), torch.from_numpy(tr_y[: args.probe_train])
    test_x, test_y = norm(to_t(te_x)), torch.from_numpy(te_y)
    probe = Probe(probe_x, probe_y, test_x, test_y)  # the library's protocol: Adam 1e-3, 30 epochs

    # -- teacher ----------------------------------------------------------------------------------
    if args.teacher == "train":
        tcfg = {"method": args.teacher_method, "steps": args.teacher_steps, "batch": args.teacher_batch,
                "widths": ints(args.teacher_widths), "n_real": args.n_real, "seed": 0}
        tpath = CACHE / f"compact_teacher_{key(tcfg)}.safetensors"
        if tpath.exists() and not args.no_cache:
            teacher = load_teacher(str(tpath))
            teacher_seconds = teacher.describe().get("seconds")
        else:
            t0 = time.perf_counter()
            teacher = train_teacher(real, method=args.teacher_method, steps=args.teacher_steps,
                                    batch_size=args.teacher_batch, widths=ints(args.teacher_widths), seed=0)
            teacher_seconds = round(time.perf_counter() - t0, 1)
            teacher.description["seconds"] = teacher_seconds
            save_teacher(teacher, tpath)
    elif args.teacher == "demo-prior":
        teacher, tpath, teacher_seconds = demo_prior_teacher(), DEMO_PRIOR, None
        tcfg = teacher.describe()
    else:
        tpath = Path(args.teacher)
        teacher, teacher_seconds = load_teacher(str(tpath)), None
        tcfg = teacher.describe()
    teacher.standardize(real)  # z-scored targets (see Teacher.standardize)
    results = {"teacher": {"config": tcfg, "seconds": teacher_seconds, "probe_top1": probe(teacher)}}
    print(f"teacher probe {results['teacher']['probe_top1']:.2f}%")

    student_widths = ints(args.student_widths)

    def fresh_student(seed):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1000 + seed)
            return ConvNet(1, widths=student_widths, norm="group")

    seeds = ints(args.seeds)
    results["random_init"] = {"top1": [probe(fresh_student(s)) for s in seeds]}
    print("random-init student", results["random_init"]["top1"])

    # -- distillation: (b) KRR-ST, (c) full -------------------------------------------------------
    common = dict(budget_images=args.budget, steps=args.steps, lr=args.lr, real_batch=args.real_batch,
                  pool_size=args.pool_size, pool_max_steps=args.pool_max_steps, pool_width=args.pool_width)
    variants = {
        "b_krr_st": dict(parameterize=False, augmentations="none", augment_real=False),
        "c_param": dict(parameterize=True, augmentations="none", augment_real=False, U=args.U, V=args.V),
        "c_full": dict(parameterize=True, augmentations=args.augmentations, augment_real=True, U=args.U, V=args.V,
                       approx_hidden=args.approx_hidden),
    }
    budget_floats = args.budget * real[0].numel()
    stores: dict[str, dict[int, CompactDataset]] = {v: {} for v in variants}
    distill_stats: dict[str, list] = {v: [] for v in variants}
    for dseed in ints(args.distill_seeds):
        for name, extra in variants.items():
            cfg = DistillConfig(**common, **extra, seed=dseed)
            path = CACHE / f"compact_{name}_{key({**cfg.__dict__, 'teacher': tpath.name, 'accounting': 'targets-included'})}.safetensors"
            if path.exists() and not args.no_cache:
                store = CompactDataset.load(path)
            else:
                t0 = time.perf_counter()
                with PeakRSS() as mem:
                    d = Distiller(real, teacher, cfg, teacher.describe())
                    d.run(checkpoint=path.with_suffix(".ckpt"), checkpoint_every=50)
                    store = d.result()
                store.metadata["bench"] = {"wall_seconds": round(time.perf_counter() - t0, 1),
                                           "loop_seconds": round(d.elapsed, 1), "peak_rss_mib": round(mem.mib, 1)}
                store.save(path)
                path.with_suffix(".ckpt").unlink(missing_ok=True)
            stores[name][dseed] = store
            floats = store.num_floats  # every stored tensor, targets / bases / approximation nets included
            if floats > budget_floats:
                raise RuntimeError(f"{name} stores {floats} floats > budget {budget_floats}: stale cache? rerun with --no-cache.")
            distill_stats[name].append({"seed": dseed, **store.metadata["bench"], "m": store.num_images,
                                        "pairs": len(store.decode()[0]), "stored_floats": floats,
                                        "final_outer_loss": store.metadata["distill"]["final_outer_loss"],
                                        "approx_mse": store.metadata.get("approx_mse"),
                                        "approx_unexplained": store.metadata.get("approx_unexplained")})
            print(name, distill_stats[name][-1])

    # -- students ---------------------------------------------------------------------------------
    # (a) as many random real images + their teacher targets as fit the budget (targets counted, as for b and c)
    n_random = pixel_images_for_budget(args.budget, tuple(real.shape[1:]), teacher.output_dim)

    def random_real(seed):
        g = torch.Generator().manual_seed(seed)
        idx = torch.randperm(len(real), generator=g)[:n_random]
        return pixel_compact(real[idx], teacher(real[idx]))

    rows = {"a_random_real": [], "b_krr_st": [], "c_param": [], "c_full": []}
    first = ints(args.distill_seeds)[0]
    for method in rows:
        for s in seeds:
            store = random_real(s) if method == "a_random_real" else stores[method].get(s, stores[method][first])
            student = fresh_student(s)
            t0 = time.perf_counter()
            hist = pretrain(student, store, epochs=args.student_epochs, batch_size=args.student_batch,
                            lr=args.student_lr, weight_decay=args.student_wd, seed=s, loss=args.student_loss,
                            progress=False)
            acc = probe(student)
            rows[method].append({"seed": s, "top1": acc, "final_loss": hist["losses"][-1], "steps": hist["steps"],
                                 "pretrain_seconds": round(time.perf_counter() - t0, 1)})
            print(method, s, f"{acc:.2f}%")

    summary = {}
    for name, vals in [("random_init_student", results["random_init"]["top1"])] + [(m, [r["top1"] for r in rs]) for m, rs in rows.items()]:
        summary[name] = {"mean": float(np.mean(vals)), "std": float(np.std(vals)), "values": vals}
    summary["teacher"] = {"mean": results["teacher"]["probe_top1"], "std": 0.0, "values": [results["teacher"]["probe_top1"]]}
    # students of seed s start from the random-init student of seed s: the paired gain removes the init's variance
    init = results["random_init"]["top1"]
    for m, rs in rows.items():
        gains = [r["top1"] - init[seeds.index(r["seed"])] for r in rs]
        summary[m]["gain_over_init"] = {"mean": float(np.mean(gains)), "std": float(np.std(gains)), "values": gains}
    # paired differences between rows (same student init per seed): the comparisons the goal is about
    by_seed = {m: {r["seed"]: r["top1"] for r in rs} for m, rs in rows.items()}
    paired = {}
    for hi, lo in (("c_full", "b_krr_st"), ("c_param", "b_krr_st"), ("b_krr_st", "a_random_real"), ("c_full", "a_random_real"),
                   ("c_full", "c_param")):
        d = [by_seed[hi][s] - by_seed[lo][s] for s in seeds]
        paired[f"{hi}-{lo}"] = {"mean": float(np.mean(d)), "std": float(np.std(d)), "values": d, "wins": int(sum(v > 0 for v in d))}
    c, cp, b, a = (summary[k]["mean"] for k in ("c_full", "c_param", "b_krr_st", "a_random_real"))
    out = {
        "command": command,
        "machine": {"cpu_count": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
                    "python": platform.python_version(), "platform": platform.platform()},
        "args": vars(args),
        "storage": {"budget_floats": budget_floats,
                    "a_random_real_floats": random_real(seeds[0]).num_floats, "a_random_real_images": n_random,
                    "b_krr_st_floats": distill_stats["b_krr_st"][0]["stored_floats"],
                    "c_param_floats": distill_stats["c_param"][0]["stored_floats"],
                    "c_full_floats": distill_stats["c_full"][0]["stored_floats"]},
        "summary_top1": summary,
        "paired_differences": paired,
        "goal_c_gt_b_gt_a": bool(c > b > a),  # the goal, (c) = the full method
        "parameterised_gt_b_gt_a": bool(cp > b > a),  # Yu et al. (2025) Table's "+parameterisation" row in its place
        "distillation": distill_stats,
        "students": rows,
        "teacher": results["teacher"],
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_results(out_path, out, ROOT)
    plot(out, out_path.with_suffix(".png"))
    print(json.dumps({k: (round(v["mean"], 2), round(v["std"], 2)) for k, v in summary.items()}), "goal c > b > a:",
          out["goal_c_gt_b_gt_a"], "| c_param > b > a:", out["parameterised_gt_b_gt_a"])
    return 0


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = out["summary_top1"]
    names = ["a_random_real", "b_krr_st", "c_param", "c_full"]
    st = out["storage"]
    labels = [f"(a) random real\n+ teacher targets\n{st['a_random_real_floats']:,} floats", f"(b) KRR-ST\n\n{st['b_krr_st_floats']:,} floats",
              f"(c) bases only\n\n{st['c_param_floats']:,} floats",
              f"(c) full: + rotations,\napprox. nets\n{st['c_full_floats']:,} floats"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    ax.bar(range(4), [s[n]["mean"] for n in names], yerr=[s[n]["std"] for n in names], capsize=6, color=["#999", "#69c", "#e96", "#c63"])
    ax.axhline(s["random_init_student"]["mean"], ls="--", c="k", lw=1, label=f"random-init student {s['random_init_student']['mean']:.1f}%")
    ax.axhline(s["teacher"]["mean"], ls=":", c="g", lw=1, label=f"teacher {s['teacher']['mean']:.1f}%")
    vals = [s[n]["mean"] for n in names] + [s["random_init_student"]["mean"], s["teacher"]["mean"]]
    ax.set_ylim(min(vals) - 3, max(vals) + 2)
    ax.set_xticks(range(4), labels, fontsize=8)
    ax.set_ylabel("linear probe top-1 % (Fashion-MNIST test)")
    ax.set_title(f"Student pretrained on a compact set, budget N = {out['args']['budget']} images = {st['budget_floats']:,} floats "
                 f"(mean ± std, {len(out['students']['c_full'])} seeds)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    d = out["distillation"]
    dist = ["b_krr_st", "c_param", "c_full"]
    ax2.bar(range(3), [d[k][0]["loop_seconds"] for k in dist], color=["#69c", "#e96", "#c63"])
    ax2.set_xticks(range(3), ["(b) KRR-ST", "(c) bases only", "(c) full"], fontsize=8)
    ax2.set_ylabel("distillation loop seconds")
    for i, k in enumerate(dist):
        ax2.text(i, d[k][0]["loop_seconds"], f"{d[k][0]['peak_rss_mib']:.0f} MiB peak\nm={d[k][0]['m']}, pairs={d[k][0]['pairs']}",
                 ha="center", va="bottom", fontsize=8)
    ax2.set_ylim(0, 1.3 * max(d[k][0]["loop_seconds"] for k in dist))
    ax2.set_title(f"{out['args']['steps']} outer steps, shared CPU", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
