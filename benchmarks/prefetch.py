"""Lookup that hides the disk: step time of a training loop whose target rows are not in the page cache, with and
without ``ReLA(prefetch=True)``, side by side in one run.

A store larger than RAM cannot be written on this machine, so the benchmark makes every read go to the disk the
same way: before every step the store's file is dropped from the page cache (``madvise(MADV_DONTNEED)`` on the
mapping + ``posix_fadvise(DONTNEED)``, not timed), so the batch's 256 random rows are read from the disk. The loop
is a user's: a tracked DataLoader (2 workers, which draw 4 batches ahead; shuffled), a student MLP, ``loss = rela.wrap(loss)``,
backward, AdamW step. With prefetch, the rows of a batch are read on a background thread from the moment the loader
draws its indices (with workers, batches ahead), while the loop runs the steps before it; without,
``wrap`` reads them. Rounds of ``--steps`` steps alternate the two loops (A B B A ...), first with the page cache
dropped before every step, then with the whole file cached, and the medians are compared (the rows are identical either way:
``tests/test_compact_store.py`` checks them row by row). Also measured: one cold read of 256 random rows through the
store's default mapping (the kernel's read-ahead around every fault) and through ``store[idx]`` (a mapping advised
``MADV_RANDOM``).

    nice -n 5 python benchmarks/prefetch.py        # writes benchmarks/results/prefetch.json + .png
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

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


class Items(torch.utils.data.Dataset):
    """Item i: a 64-d input made from i (cheap), and i itself (to check the rows)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randn(64, generator=g), i


def make_rela(store, prefetch: bool, batch: int, n_items: int, seed: int):
    from accelerate_ssl import ReLA

    torch.manual_seed(seed)
    student = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256))
    loader = torch.utils.data.DataLoader(Items(n_items), batch_size=batch, shuffle=True, drop_last=True, num_workers=2,
                                         persistent_workers=True, generator=torch.Generator().manual_seed(seed))
    rela = ReLA(store, student, dataloader=loader, schedule="constant:0.5", n_components=None, feature_dim=256,
                prefetch=prefetch)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    return {"rela": rela, "student": student, "loader": loader, "opt": opt, "it": iter(loader), "times": []}


def steps(run: dict, store, k: int, drop) -> None:
    rela, student, opt = run["rela"], run["student"], run["opt"]
    for _ in range(k):
        drop(store)
        t = time.perf_counter()
        try:
            x, idx = next(run["it"])
        except StopIteration:
            run["it"] = iter(run["loader"])
            x, idx = next(run["it"])
        feats = student(x)
        loss = rela.wrap(lambda: feats.pow(2).mean())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        run["times"].append(time.perf_counter() - t)
        assert torch.equal(rela._current_index, idx)  # the batch ReLA looked up is the one the loop holds


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="store rows (256-d float32: 1 KiB each)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="steps per round")
    p.add_argument("--rounds", type=int, default=8, help="rounds per page-cache state; each runs both loops")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", type=Path, default=ROOT / "benchmarks" / "cache" / "prefetch")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefetch.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from compact_store import drop_cache
    from scale import phase_write_store

    from accelerate_ssl import TargetStore
    from accelerate_ssl.atomic import atomic_write_text
    from accelerate_ssl.data import dataset_fingerprint
    from accelerate_ssl.results import write_results

    path = args.cache / f"store-{args.rows}"
    if not (path / "metadata.json").is_file():
        phase_write_store(args.rows, path)  # random rows written directly (a prior over 1 M items takes too long)
        meta = json.loads((path / "metadata.json").read_text())
        meta["dataset"]["fingerprint"] = dataset_fingerprint(Items(args.rows))  # the loop's data set, as precompute
        atomic_write_text(path / "metadata.json", json.dumps(meta))
    store = TargetStore.open(path)
    rng, reads = np.random.default_rng(0), {"store.array[idx] (read-ahead)": [], "store[idx] (MADV_RANDOM)": []}
    for _ in range(10):  # one cold read of 256 random rows through each mapping
        idx = rng.choice(len(store), args.batch, replace=False)
        for name, read in zip(reads, (lambda: np.array(store.array[idx]), lambda: store[idx])):
            drop_cache(store)
            t = time.perf_counter()
            read()
            reads[name].append(time.perf_counter() - t)
    runs = {name: make_rela(store, name == "prefetch", args.batch, args.rows, seed=0) for name in ("direct", "prefetch")}
    for run in runs.values():  # warm-up: the head's fit, the first batches
        steps(run, store, 3, lambda s: None)
    times = {(name, cache): [] for cache in ("cold", "warm") for name in runs}
    for cache in ("cold", "warm"):
        if cache == "warm":  # every page of the file in the page cache (1 sequential read), kept there
            for a in range(0, len(store), 1 << 16):
                np.asarray(store.array[a : a + (1 << 16)]).sum()
        for r in range(args.rounds):  # the two loops alternate, A B B A ...
            for name in (["direct", "prefetch"] if r % 2 == 0 else ["prefetch", "direct"]):
                runs[name]["times"] = times[(name, cache)]
                steps(runs[name], store, args.steps, drop_cache if cache == "cold" else lambda s: None)
    cold = {n: times[(n, "cold")] for n in runs}

    result = {
        "command": " ".join(["python", "benchmarks/prefetch.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "platform": platform.platform()},
        "settings": {"rows": args.rows, "dim": store.dim, "store_bytes": (path / "targets.npy").stat().st_size,
                     "batch": args.batch, "steps_per_round": args.steps, "rounds": args.rounds,
                     "cache": "dropped before every step (madvise + posix_fadvise DONTNEED)"},
        "cold_read_ms": {n: 1e3 * statistics.median(t) for n, t in reads.items()},
        "step_ms_cold": {n: 1e3 * statistics.median(t) for n, t in cold.items()},
        "step_ms_cold_p90": {n: 1e3 * float(np.percentile(t, 90)) for n, t in cold.items()},
        "step_ms_warm": {n: 1e3 * statistics.median(times[(n, "warm")]) for n in runs},
        "prefetch_hits": runs["prefetch"]["rela"].targets.prefetcher.hits,
        "prefetch_misses": runs["prefetch"]["rela"].targets.prefetcher.misses,
    }
    c = result["step_ms_cold"]
    result["cold_ratio_prefetch_to_direct"] = c["prefetch"] / c["direct"]
    write_results(args.out, result, ROOT)
    plot(cold, result, args.out.with_suffix(".png"))
    print(result)
    return result


def plot(cold, result, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from accelerate_ssl.results import save_figure

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.boxplot([1e3 * np.asarray(cold[n]) for n in ("direct", "prefetch")], showfliers=False)
    ax.set_xticks([1, 2], ["rows read in wrap", "rows prefetched"])
    for i, n in enumerate(("direct", "prefetch"), 1):
        ax.scatter([i], [result["step_ms_warm"][n]], marker="x", color="C3", zorder=3,
                   label="median, store in page cache" if i == 1 else None)
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"{result['settings']['rows']:,} x {result['settings']['dim']} store, page cache dropped every step",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, png)


if __name__ == "__main__":
    main()
