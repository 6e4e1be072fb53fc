"""Overhead of ``rela.wrap``: one BYOL training step with and without ReLA, side by side in one run.

Same model, same batch, same optimiser; the two variants are interleaved (A B B A ...) for
``--repeats`` rounds after warm-up and the median step time of each is compared. ReLA runs in its most
expensive state: ``Decay`` lambda in (0, 1) so both losses are computed every step, targets looked
up from a memory-mapped TargetStore and PCA-transformed every step, the head trained by ReLA's own
AdamW, the controller stepped through the optimiser hook.

Memory measure (documented choice): PyTorch's CPU allocator has no peak counter and process RSS is
dominated by the library and too noisy on a shared machine, so the *training-step memory* of each
variant is counted exactly as: bytes of all tensors autograd saves for backward during the step
(``torch.autograd.graph.saved_tensors_hooks``; the activations, which set the peak) + parameters +
gradients + optimiser state (incl. ReLA's head and its AdamW state). Goal: time ratio <= 1.03,
memory ratio <= 1.05.

    .venv/bin/python benchmarks/overhead.py                     # writes benchmarks/results/overhead.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from accelerate_ssl.results import save_figure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += key[1]
    return total


def _state_bytes(modules, optimizers) -> int:
    ts = []
    for m in modules:
        for p in m.parameters():
            ts.append(p)
            if p.grad is not None:
                ts.append(p.grad)
    for o in optimizers:
        for st in o.state.values():
            ts += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return _tensor_bytes(ts)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=30, help="timed rounds (each times both variants once)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--widths", default="64,128,256", help="ConvNet widths (the calibration student)")
    p.add_argument("--store-rows", type=int, default=10000, help="Fashion-MNIST images in the target store")
    p.add_argument("--prior", default="random:convnet")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", type=Path, default=ROOT / "benchmarks" / "cache", help="where the target store is kept")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "overhead.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from accelerate_ssl import ReLA, TargetStore, create_prior, precompute_targets
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.data import FashionMNIST
    from accelerate_ssl.recipes import BYOL
    from accelerate_ssl.schedules import Decay
    from accelerate_ssl.results import write_results

    clean = FashionMNIST("train", limit=args.store_rows)
    store_dir = args.cache / f"overhead-{args.prior.replace(':', '-')}-{args.store_rows}"
    if (store_dir / "metadata.json").exists():
        store = TargetStore.open(store_dir, dataset=clean)
    else:
        store = precompute_targets(create_prior(args.prior), clean, store_dir, progress=True)

    widths = tuple(int(w) for w in args.widths.split(","))
    backbone = ConvNet(widths=widths)
    model = BYOL(backbone, widths[-1])  # the recipe's BYOL: lightly's heads 512 -> 128, negative cosine
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    rela = ReLA(store, backbone, feature_dim=widths[-1], schedule=Decay(max_lambda=0.5, loss_momentum=0.0, sharpness=0.0))
    # sharpness 0 -> rho = 1 -> lambda settles in (0, 0.5): never 0, never 1, both losses every step

    g = torch.Generator().manual_seed(args.seed)
    x0 = torch.randn(args.batch_size, 1, 28, 28, generator=g)
    x1 = torch.randn(args.batch_size, 1, 28, 28, generator=g)
    rows = torch.Generator().manual_seed(args.seed)  # a fresh batch of store rows every step, as in training

    saved = {"bytes": 0}

    def pack(t):
        saved["bytes"] += t.untyped_storage().nbytes()
        return t

    def step(with_rela: bool, measure: bool = False):
        model.update_momentum(0.99)
        if measure:
            ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            ctx.__enter__()
        loss = model.loss(x0, x1)
        if with_rela:
            loss = rela.wrap(loss, index=torch.randperm(len(store), generator=rows)[: args.batch_size])
        else:
            rela.capture.captured.clear()  # the hook still runs (it is installed), its captures are dropped
        if measure:
            ctx.__exit__(None, None, None)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    for _ in range(args.warmup):
        step(False), step(True)
    times = {False: [], True: []}
    for r in range(args.repeats):
        order = (False, True) if r % 2 == 0 else (True, False)
        for v in order:
            t = time.perf_counter()
            step(v)
            times[v].append(time.perf_counter() - t)

    mem = {}
    for v in (False, True):
        saved["bytes"] = 0
        step(v, measure=True)
        optimizers = [opt] + ([rela.transport.own_optimizer] if v and rela.transport.own_optimizer is not None else [])
        modules = [model] + ([rela.head] if v else [])
        mem[v] = saved["bytes"] + _state_bytes(modules, optimizers)

    t_plain, t_rela = statistics.median(times[False]), statistics.median(times[True])
    result = {
        "command": " ".join([".venv/bin/python", "benchmarks/overhead.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": args.threads, "torch": torch.__version__,
                    "python": platform.python_version(), "platform": platform.platform()},
        "settings": {"batch_size": args.batch_size, "widths": list(widths), "repeats": args.repeats,
                     "store_rows": len(store), "target_dim": store.dim, "head": [rela.head.in_features, rela.head.out_features],
                     "head_mode": rela.head_mode, "lambda_at_end": rela.lam},
        "step_seconds_median": {"plain": t_plain, "rela": t_rela},
        "step_seconds_all": {"plain": times[False], "rela": times[True]},
        "time_ratio": t_rela / t_plain,
        "memory_bytes": {"plain": mem[False], "rela": mem[True]},
        "memory_ratio": mem[True] / mem[False],
        "memory_measure": "saved-for-backward tensors of one step + params + grads + optimiser state",
        "goals": {"time_ratio": 1.03, "memory_ratio": 1.05},
    }
    result["meets_goals"] = result["time_ratio"] <= 1.03 and result["memory_ratio"] <= 1.05
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_results(args.out, result, ROOT)
    plot_report(result, args.out.with_suffix(".png"))
    print(f"step time  plain {t_plain * 1e3:.1f} ms  rela {t_rela * 1e3:.1f} ms  ratio {result['time_ratio']:.3f} (goal <= 1.03)")
    print(f"step memory plain {mem[False] / 2**20:.1f} MiB  rela {mem[True] / 2**20:.1f} MiB  ratio {result['memory_ratio']:.3f} (goal <= 1.05)")
    print(f"wrote {args.out}")
    return result


def plot_report(result: dict, png: Path) -> None:
    """Per-repeat step times (plain vs rela.wrap) and the two ratios, from a result written by main()."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("plain", "plain step"), ("rela", "rela.wrap step")):
        ax.plot(result["step_seconds_all"][key], marker="o", ms=3, label=label)
    ax.set_xlabel("repeat (interleaved)")
    ax.set_ylabel("seconds / step")
    ax.set_title(f"time ratio {result['time_ratio']:.3f} (goal <= 1.03), memory ratio {result['memory_ratio']:.3f} "
                 "(goal <= 1.05)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, png, dpi=110)


if __name__ == "__main__":
    main()
