"""Target stores at the sizes users train on: ImageNet-1K (1.28 M rows) and ImageNet-21K (14.2 M rows), on CPU.

    .venv/bin/python benchmarks/scale.py          # ~15 min on 2 cores, ~16 GB of disk in --work (deleted after)

writes ``benchmarks/results/scale.json`` + ``.png``. Every phase runs in its own subprocess; a sampler thread reads
``/proc/self/status`` every 20 ms for the peak anonymous memory (``RssAnon``: what the process allocated) and the
peak resident set (``VmHWM``, which also counts pages of the memory-mapped store: file cache the kernel can drop).

1. **precompute** ``N`` synthetic 8x8 images (deterministic per index) with a cheap prior (``random:convnet``,
   256-d) for N = 20 k, 160 k and 1.28 M: seconds, rows/s, peak memory, store bytes on disk. Flat memory in N is
   the goal: nothing may hold O(N) in memory.
2. **resume**: the 1.28 M precompute killed (SIGKILL) once half of its chunks exist, then the same call again: the
   rows it computed, and the final file's sha256 against the uninterrupted run's.
3. **lookup**: 256 random rows (``store[idx]`` + the PCA transform, what ReLA does per step) on the 1.28 M store and
   on a 14.2 M-row store of the same width written directly (a precompute at 14.2 M would take ~11x phase 1's
   1.28 M time, which phase 1 shows is linear), with the store's pages evicted first (``posix_fadvise``) and warm;
   set against one BYOL training step of the demo's ConvNet at batch 256 on 28 px, measured in the same run.
4. **PCA**: the batch PCA fit (ReLA v2 App. N, Alg. 2) at 1.28 M and 14.2 M rows: seconds and peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from accelerate_ssl.results import save_figure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IMAGENET_1K, IMAGENET_21K = 1_281_167, 14_197_122
SIZES = (20_000, 160_000, IMAGENET_1K)
PRIOR = "random:convnet"
DIM = 256
CHUNK = 8192


class SyntheticImages(torch.utils.data.Dataset):
    """N deterministic 8x8 grayscale images (uint8 tensors): image i is a hash pattern of i, no storage."""

    def __init__(self, n: int):
        self.n = n
        self._ramp = np.arange(64, dtype=np.uint64)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        pattern = (self._ramp * np.uint64((2654435761 * (i + 1)) & 0xFFFFFFFF)) >> np.uint64(13)
        return torch.from_numpy((pattern & np.uint64(255)).astype(np.uint8).reshape(1, 8, 8))


class PeakMemory:
    """Peak RssAnon and VmHWM of this process, sampled from /proc/self/status."""

    def __init__(self, every: float = 0.02):
        self.every, self.anon, self._stop = every, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _status() -> dict:
        out = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
        return out

    def _run(self):
        while not self._stop.is_set():
            self.anon = max(self.anon, self._status().get("RssAnon", 0))
            time.sleep(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.anon = max(self.anon, self._status().get("RssAnon", 0))
        self.hwm = self._status().get("VmHWM", 0)


# ---------------------------------------------------------------------------------------------- phases (subprocesses)
def phase_precompute(rows: int, out: Path) -> dict:
    from accelerate_ssl import create_prior, precompute_targets

    torch.set_num_threads(2)
    prior = create_prior(PRIOR, in_channels=1)
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        store = precompute_targets(prior, SyntheticImages(rows), out, batch_size=1024, chunk_size=CHUNK, progress=False)
        seconds = time.perf_counter() - t0
    return {"rows": rows, "seconds": seconds, "rows_per_second": rows / seconds, "peak_anon_bytes": mem.anon,
            "peak_rss_bytes": mem.hwm, "store_bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file()),
            "sha256": store.metadata["file_sha256"]}


def phase_write_store(rows: int, out: Path) -> dict:
    """A finished store of ``rows`` random rows written directly (no prior): what a 14.2 M precompute leaves."""
    from accelerate_ssl.atomic import atomic_write_text
    from accelerate_ssl.checksum import file_sha256
    from accelerate_ssl.targets.format import FORMAT, FORMAT_VERSION, METADATA, TARGETS

    out.mkdir(parents=True, exist_ok=True)
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        arr = np.lib.format.open_memmap(out / TARGETS, mode="w+", dtype=np.float32, shape=(rows, DIM))
        rng = np.random.default_rng(0)
        for a in range(0, rows, 1 << 18):
            b = min(rows, a + (1 << 18))
            arr[a:b] = rng.standard_normal((b - a, DIM), dtype=np.float32)
            arr.flush()
        del arr
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "num_rows": rows, "dim": DIM, "dtype": "float32",
                "file": TARGETS, "file_bytes": (out / TARGETS).stat().st_size, "file_sha256": file_sha256(out / TARGETS),
                "prior": {"spec": "synthetic"}, "dataset": {"name": "synthetic", "fingerprint": {"length": rows}}}
        atomic_write_text(out / METADATA, json.dumps(meta))
        seconds = time.perf_counter() - t0
    return {"rows": rows, "seconds": seconds, "store_bytes": meta["file_bytes"], "peak_anon_bytes": mem.anon}


def _evict(file: Path) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def phase_lookup(store_path: Path, batches: int = 200) -> dict:
    import gc

    from accelerate_ssl import TargetStore

    torch.set_num_threads(2)
    store = TargetStore.open(store_path)
    rows = len(store)
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        pca = store.pca(DIM)
        pca_seconds = time.perf_counter() - t0
    file = store_path / store.metadata["file"]
    del store  # unmap the file: the kernel keeps mapped pages cached whatever we advise
    gc.collect()
    g = np.random.default_rng(0)
    times = {}
    for state in ("cold", "warm"):
        if state == "cold":
            _evict(file)
        store = TargetStore.open(store_path)
        if state == "warm":  # every page cached: one sequential read of the whole file
            for a in range(0, len(store), 1 << 16):
                np.asarray(store.array[a : a + (1 << 16)]).sum()
        batch_times = []
        for _ in range(batches):
            idx = torch.from_numpy(g.integers(0, len(store), 256))
            t = time.perf_counter()
            pca.transform(store[idx])
            batch_times.append(time.perf_counter() - t)
        times[state] = float(np.median(batch_times))
        del store
        gc.collect()
    return {"rows": rows, "pca_seconds": pca_seconds, "pca_peak_anon_bytes": mem.anon,
            "pca_peak_rss_bytes": mem.hwm, "lookup_seconds_median": times, "batches": batches}


def phase_train_step(steps: int = 6) -> dict:
    """Median wall time of a BYOL step of the recipe (views, forward, backward, update) on a 256-image batch."""
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.recipes import BYOL, tensor_batches, train_ssl

    torch.set_num_threads(2)
    torch.manual_seed(0)
    backbone = ConvNet()
    model = BYOL(backbone, backbone.feature_dim)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.rand(256, 1, 28, 28)
    batches = tensor_batches(x, (torch.arange(256) for _ in range(steps)))
    times = train_ssl(model, batches, steps, optimizer=opt, view_generator=torch.Generator().manual_seed(0))["step_seconds"]
    return {"step_seconds_median": float(np.median(times[1:])), "batch": 256, "model": "demo ConvNet BYOL, 28 px"}


PHASES = {"precompute": phase_precompute, "write_store": phase_write_store, "lookup": phase_lookup,
          "train_step": phase_train_step}


# ---------------------------------------------------------------------------------------------- orchestration
def _run_phase(name: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--phase", name, *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        raise RuntimeError(f"phase {name} {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _killed_then_resumed(out: Path, rows: int, reference_sha: str) -> dict:
    """Start the precompute of ``rows``, SIGKILL it once half its chunks exist, rerun: rows recomputed, same bytes?"""
    chunks_total = -(-rows // CHUNK)
    proc = subprocess.Popen([sys.executable, __file__, "--phase", "precompute", str(rows), str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    chunk_dir = out / "chunks"
    while proc.poll() is None and len(list(chunk_dir.glob("chunk-*.npy")) if chunk_dir.is_dir() else []) < chunks_total // 2:
        time.sleep(0.2)
    if proc.poll() is not None:  # too small to catch mid-way: nothing was interrupted, say so
        raise RuntimeError(f"the {rows}-row precompute finished before half of its chunks could be seen; "
                           "pass a larger --sizes for the kill-and-resume measurement.")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = len(list(chunk_dir.glob("chunk-*.npy")))
    resumed = _run_phase("precompute", str(rows), str(out))
    return {"rows": rows, "chunks_total": chunks_total, "chunks_kept_after_kill": kept,
            "rows_recomputed": rows - min(kept * CHUNK, rows), "resume_seconds": resumed["seconds"],
            "same_sha256_as_uninterrupted": resumed["sha256"] == reference_sha}


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pre = result["precompute"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    n = [r["rows"] for r in pre]
    axes[0].plot(n, [r["peak_anon_bytes"] / 2**20 for r in pre], "o-", label="peak anonymous memory")
    axes[0].plot(n, [r["peak_rss_bytes"] / 2**20 for r in pre], "s--", label="peak RSS (incl. mapped store pages)")
    axes[0].plot(n, [r["store_bytes"] / 2**20 for r in pre], "^:", label="store on disk")
    axes[0].set(xscale="log", yscale="log", xlabel="rows", ylabel="MiB", title="precompute memory vs N")
    axes[0].legend(fontsize=8)
    look = result["lookup"]
    labels = [f"{r['rows'] / 1e6:.2f} M {s}" for r in look for s in ("cold", "warm")]
    values = [1e3 * r["lookup_seconds_median"][s] for r in look for s in ("cold", "warm")]
    axes[1].bar(labels, values)
    axes[1].axhline(1e3 * result["train_step"]["step_seconds_median"], color="k", ls="--", label="one training step")
    axes[1].set(ylabel="ms per batch of 256", yscale="log", title="target lookup + PCA per batch")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, png, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "cache" / "scale",
                   help="scratch folder for the stores (deleted at the end unless --keep)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scale.json")
    p.add_argument("--keep", action="store_true", help="keep the stores in --work")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                   help="precompute sizes; the largest is killed and resumed and its lookups timed (default: 20k 160k 1.28M)")
    p.add_argument("--big-rows", type=int, default=IMAGENET_21K, help="rows of the directly written store (ImageNet-21K)")
    p.add_argument("--phase", nargs="+", help=argparse.SUPPRESS)  # internal: run one phase, print its JSON
    args = p.parse_args(argv)
    if args.phase:
        name, *rest = args.phase
        fn = PHASES[name]
        conv = [int(r) if r.isdigit() else Path(r) for r in rest]
        print(json.dumps(fn(*conv)))
        return 0

    import shutil

    from tqdm import tqdm

    from accelerate_ssl import __version__
    from accelerate_ssl.results import write_results

    work = args.work
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    sizes = sorted(args.sizes)
    bar = tqdm(total=len(sizes) + 5, desc="scale benchmark", unit="phase")
    result: dict = {"command": " ".join([sys.executable, *sys.argv]), "library_version": __version__,
                    "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform()},
                    "prior": PRIOR, "dim": DIM, "chunk_size": CHUNK, "precompute": []}
    for n in sizes:
        result["precompute"].append(_run_phase("precompute", str(n), str(work / f"store-{n}")))
        bar.update()
    big = work / f"store-{sizes[-1]}"
    result["resume_after_kill"] = _killed_then_resumed(work / "killed", sizes[-1], result["precompute"][-1]["sha256"])
    shutil.rmtree(work / "killed")
    bar.update()
    result["write_big"] = _run_phase("write_store", str(args.big_rows), str(work / "store-21k"))
    bar.update()
    result["lookup"] = [_run_phase("lookup", str(big)), _run_phase("lookup", str(work / "store-21k"))]
    bar.update(2)
    result["train_step"] = _run_phase("train_step")
    bar.update()
    bar.close()
    step = result["train_step"]["step_seconds_median"]
    for r in result["lookup"]:
        r["lookup_fraction_of_step"] = {k: v / step for k, v in r["lookup_seconds_median"].items()}
    anon = [r["peak_anon_bytes"] for r in result["precompute"]]
    result["precompute_anon_growth_smallest_to_largest"] = anon[-1] / anon[0]
    if not args.keep:
        shutil.rmtree(work)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_results(args.out, result, ROOT)
    plot(result, args.out.with_suffix(".png"))
    for r in result["precompute"]:
        print(f"precompute {r['rows']:>9,} rows: {r['seconds']:6.1f} s ({r['rows_per_second']:,.0f}/s), peak anon "
              f"{r['peak_anon_bytes'] / 2**20:6.0f} MiB, peak RSS {r['peak_rss_bytes'] / 2**20:6.0f} MiB, "
              f"store {r['store_bytes'] / 2**20:7.0f} MiB")
    k = result["resume_after_kill"]
    print(f"killed at {k['chunks_kept_after_kill']}/{k['chunks_total']} chunks; resume recomputed {k['rows_recomputed']:,} "
          f"rows in {k['resume_seconds']:.1f} s; same bytes: {k['same_sha256_as_uninterrupted']}")
    for r in result["lookup"]:
        f = r["lookup_fraction_of_step"]
        print(f"{r['rows']:>10,} rows: lookup+PCA of 256 rows cold {1e3 * r['lookup_seconds_median']['cold']:.2f} ms "
              f"({100 * f['cold']:.2f} % of a step), warm {1e3 * r['lookup_seconds_median']['warm']:.2f} ms; PCA fit "
              f"{r['pca_seconds']:.1f} s, peak anon {r['pca_peak_anon_bytes'] / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
