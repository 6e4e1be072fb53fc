"""What identifying a folder data set by its files' contents costs: at precompute and at every open, on large folders.

A store of a folder data set records each row's file by its size, modification time, the blake2b-128 digest of its
bytes, change time and inode (``contents.npy``, ``accelerate_ssl/data/fingerprint.py``). This measures, on folders of
``--sizes`` small PNG files (Fashion-MNIST images, 28 px grayscale, ~0.5 KB each, in 10 class folders: an
ImageFolder):

- **precompute**: the whole ``precompute_targets`` of the store (the demo's prior, ``shipped:fashion-mnist-byol``,
  batch 256, 1 thread), which records each file from the one read its loader decodes (the digest of those bytes and
  the ``fstat`` of the open file: no file is read twice);
- **open**: ``TargetStore.open(path, dataset=folder)`` with the contents check (the ``stat`` of every file: size,
  modification time, change time and inode, and the bytes of a random sample), beside the same open of the same store
  with its record cut to size, time and digest (as stores written before the change time and inode were recorded),
  beside that store opened by the code at ``--before`` (a commit: today's rule, run from ``git archive`` of it in a
  subprocess that times its own opens), and beside the store with no contents record (names only), ``--repeats``
  times interleaved; and the open of a copied folder (new modification times and inodes: every file stat-ed, 256 of
  them read, a warning);
- **full check**: ``store verify --data``'s comparison of every file's bytes.

The files were just written or read, so they are in the page cache: these are warm-cache numbers (a cold disk adds the
reads of the sample and, for the full check, of every file).

    nice -n 5 python benchmarks/folder_identity.py --before 5eaa691  # 20k and 100k files (~15 min, 1 thread)
    python benchmarks/folder_identity.py --sizes 2000 --repeats 2    # a quick look

Writes ``benchmarks/results/folder_identity.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accelerate_ssl.results import save_figure, write_results  # noqa: E402

PRIOR = "shipped:fashion-mnist-byol"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[20000, 100000], help="files per folder")
    p.add_argument("--repeats", type=int, default=5, help="interleaved opens with and without the contents check")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--before", default=None, help="a commit whose code opens the size-and-time store too (today's "
                   "rule beside the new one); needs git")
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/folder_identity"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/folder_identity.json"))
    return p


def write_folder(root: Path, n: int) -> Path:
    """``n`` Fashion-MNIST images as PNG files, ``class<k>/<i>.png`` (written once, then reused)."""
    from PIL import Image

    from accelerate_ssl.data import FashionMNIST

    done = root / "done.txt"
    if done.is_file() and int(done.read_text()) == n:
        return root
    shutil.rmtree(root, ignore_errors=True)
    data = FashionMNIST("train", limit=None)
    images, labels = np.asarray(data.data), np.asarray(data.targets)
    for k in range(10):
        (root / f"class{k}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        j = i % len(images)
        Image.fromarray(images[j]).save(root / f"class{labels[j]}" / f"{i:06d}.png")
    done.write_text(str(n))
    return root


def timed(fn):
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t, time.process_time() - c


def before_code(rev: str, cache: Path) -> Path:
    """The package as it was at commit ``rev`` (``git archive``), extracted once under ``cache``."""
    import io
    import subprocess
    import tarfile

    out = cache / f"before-{rev}"
    if not (out / "accelerate_ssl" / "__init__.py").is_file():
        archive = subprocess.run(["git", "archive", rev, "accelerate_ssl"], cwd=ROOT, capture_output=True, check=True)
        out.mkdir(parents=True, exist_ok=True)
        tarfile.open(fileobj=io.BytesIO(archive.stdout)).extractall(out)
    return out


BEFORE_OPEN = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(int(sys.argv[4]))
from accelerate_ssl.data.datasets import image_folder
from accelerate_ssl.targets.store import TargetStore
fresh = image_folder(sys.argv[3])
t, c = time.perf_counter(), time.process_time()
TargetStore.open(sys.argv[2], dataset=fresh)
print(json.dumps({"wall": time.perf_counter() - t, "cpu": time.process_time() - c}))
"""


def open_before(code: Path, store: Path, folder: Path, threads: int) -> dict:
    """One open of ``store`` over ``folder`` by the package in ``code``, timed inside its own process."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", BEFORE_OPEN, str(code), str(store), str(folder), str(threads)],
                          capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(code)})
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(n: int, args) -> dict:
    import accelerate_ssl.data.fingerprint as fp
    import accelerate_ssl.targets.precompute as pc
    from accelerate_ssl.checksum import file_sha256
    from accelerate_ssl import create_prior
    from accelerate_ssl.data.datasets import image_folder
    from accelerate_ssl.targets.store import TargetStore

    cache = Path(args.cache)
    folder = write_folder(cache / f"folder-{n}", n)
    dataset = image_folder(folder)
    store_path = cache / f"store-{n}"
    shutil.rmtree(store_path, ignore_errors=True)
    _, pre_wall, pre_cpu = timed(lambda: pc.precompute_targets(create_prior(PRIOR), dataset, store_path,
                                                               batch_size=256, progress=False))

    # the same store without its contents record: how stores written before it open (names only)
    names_only = cache / f"store-{n}-names-only"
    shutil.rmtree(names_only, ignore_errors=True)
    shutil.copytree(store_path, names_only)
    meta = json.loads((names_only / "metadata.json").read_text())
    del meta["contents"]
    (names_only / "metadata.json").write_text(json.dumps(meta))
    (names_only / "contents.npy").unlink()

    # the same store recording size, time and digest only (as stores written before the change time and inode)
    size_time = cache / f"store-{n}-size-time"
    shutil.rmtree(size_time, ignore_errors=True)
    shutil.copytree(store_path, size_time)
    meta = json.loads((size_time / "metadata.json").read_text())
    meta["contents"]["fields"] = list(fp.CONTENT_FIELDS_V1)
    np.save(size_time / "contents.npy", np.load(size_time / "contents.npy")[:, :4])
    meta["contents"]["sha256"] = file_sha256(size_time / "contents.npy")
    (size_time / "metadata.json").write_text(json.dumps(meta))

    code = before_code(args.before, Path(args.cache)) if args.before else None
    opens = {"contents": [], "size and time": [], "names only": [], **({"before": []} if code else {})}
    for _ in range(args.repeats):  # interleaved: the machine's noise falls on every kind alike
        for kind, path in (("contents", store_path), ("size and time", size_time), ("names only", names_only)):
            fresh = image_folder(folder)  # a new data set object (its file list made again, as a new run does)
            _, wall, cpu = timed(lambda: TargetStore.open(path, dataset=fresh))
            opens[kind].append({"wall": wall, "cpu": cpu})
        if code is not None:  # the code at --before opening the size-and-time store: today's rule as it ran
            opens["before"].append(open_before(code, size_time, folder, args.threads))

    # a copied folder: the same bytes, every modification time new (every file stat-ed, 256 read, a warning)
    copy = cache / f"folder-{n}-copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(folder, copy, copy_function=shutil.copyfile)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        moved = image_folder(copy)
        store = TargetStore.open(store_path)
        _, copy_wall, copy_cpu = timed(lambda: store.check_dataset(moved))
    shutil.rmtree(copy, ignore_errors=True)

    paths = fp.file_paths(dataset)
    contents = np.load(store_path / "contents.npy")
    full, full_wall, full_cpu = timed(lambda: fp.check_contents(paths, contents, full=True))
    stats, stat_wall, _ = timed(lambda: fp.check_contents(paths, contents, full=False))
    fingerprint, fp_wall, _ = timed(lambda: fp.dataset_fingerprint(image_folder(folder)))
    bytes_total = int(contents[:, 0].sum())
    med = {k: statistics.median(r["wall"] for r in v) for k, v in opens.items()}
    before = med.get("before", med["size and time"])
    return {
        "files": n, "bytes": bytes_total, "mean_file_bytes": bytes_total / n,
        "precompute": {"wall": pre_wall, "cpu": pre_cpu},
        "open": {"runs": opens, "median_wall_contents": med["contents"], "median_wall_names_only": med["names only"],
                 "median_wall_size_and_time": med["size and time"], "median_wall_before": med.get("before"),
                 "before_rev": args.before,
                 "added_wall": med["contents"] - med["names only"],
                 "added_us_per_file": 1e6 * (med["contents"] - med["names only"]) / n,
                 "added_over_before_wall": med["contents"] - before,
                 "added_over_before_us_per_file": 1e6 * (med["contents"] - before) / n,
                 "check_alone_wall": stat_wall, "files_read_at_open": stats.read,
                 "files_stat_changed_at_open": len(stats.retouched)},
        "copied_folder_open": {"wall": copy_wall, "cpu": copy_cpu, "files_read": min(n, fp.CONTENT_BUDGET),
                               "warned": any("not the files the targets" in str(w.message) for w in said)},
        "full_check": {"wall": full_wall, "cpu": full_cpu, "us_per_file": 1e6 * full_wall / n, "files_read": full.read,
                       "ok": full.ok},
        "fingerprint_of_names_wall": fp_wall, "fingerprint_kind": fingerprint["kind"],
    }


def table(results: list[dict]) -> str:
    lines = ["| files | precompute | open, names only | open before (size, time) | open now (+ ctime, inode) | "
             "now - before per file | copied folder's open | every file's bytes (verify) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        p, o, f = r["precompute"], r["open"], r["full_check"]
        before = o["median_wall_before"] if o.get("median_wall_before") is not None else o["median_wall_size_and_time"]
        lines.append(f"| {r['files']} | {p['wall']:.1f} s | {o['median_wall_names_only']:.2f} s | "
                     f"{before:.2f} s | {o['median_wall_contents']:.2f} s | "
                     f"{o['added_over_before_us_per_file']:.1f} us | {r['copied_folder_open']['wall']:.2f} s | "
                     f"{f['wall']:.2f} s |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    n = [r["files"] for r in results]
    ax.plot(n, [r["open"]["median_wall_names_only"] for r in results], "o-", label="open, names only")
    ax.plot(n, [r["open"]["median_wall_before"] or r["open"]["median_wall_size_and_time"] for r in results], "o-",
            label="open before: size and time of all, read 32")
    ax.plot(n, [r["open"]["median_wall_contents"] for r in results], "o-",
            label="open now: size, times and inode of all, read 32")
    ax.plot(n, [r["full_check"]["wall"] for r in results], "^:", label="verify --data: every file's bytes")
    ax.set_xlabel("files in the folder")
    ax.set_ylabel("seconds (warm page cache, 1 thread)")
    ax.set_title("What content identity of a folder costs", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start, started = os.getloadavg(), time.strftime("%Y-%m-%dT%H:%M:%S")
    results = []
    for n in args.sizes:
        print(f"{n} files ...", flush=True)
        results.append(measure(n, args))
    result = {"command": shlex.join(["python", "benchmarks/folder_identity.py", *sys.argv[1:]]),
              "started": started,
              "threads": args.threads, "load_average_start": load_start,
              "settings": {"sizes": args.sizes, "repeats": args.repeats, "prior": PRIOR, "batch_size": 256,
                           "before": args.before},
              "results": results, "table": table(results)}
    out = Path(args.out)
    write_results(out, result, root=ROOT)
    plot(results, out.with_suffix(".png"))
    print(result["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
