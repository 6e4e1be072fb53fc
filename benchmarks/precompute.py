"""Precompute vs the prior's bare forward, with its input pipeline alone, side by side in one run.

For each data set (an in-memory array, a folder of JPEGs) and each prior (a small and a large one), three
measurements, ``--rounds`` times (default 3; medians reported); each round times (a) just before and just after (c),
so that both see the same load of a shared machine:

(a) **bare forward**: the prior's forward over the same images already preprocessed, on the device, batched as the
    precompute batches them (under its precision's autocast; nothing read, decoded, identified or written);
(b) **input pipeline**: the precompute's own loader and device stage alone (``input_batches`` + ``prior_batches``:
    each item read, digested and decoded in the workers, the uint8 batch copied to the device and preprocessed
    there), no forward: the ceiling the data side puts on (c);
(c) **precompute**: ``precompute_targets`` with its defaults (loader workers sized from the machine): fingerprint,
    manifest, the pass, every chunk written, the store consolidated and checksummed.

Reported per case: images/s of each, the ratio c / a (goal >= 0.9 on a CPU; also in CPU seconds of this process and
its loader workers, which other processes' load barely moves), the pipeline's share of the per-image cost (``(1/b) / (1/a + 1/b)``: its share if nothing overlapped), the loader workers used, and the pipeline's parts
per image measured one at a time in this process (read, content digest, decode, row identity digest, the data set's
fingerprint, the preprocessing), with what limits a ratio below the goal.

    .venv/bin/python benchmarks/precompute.py                 # the default run, ~25 min on 2 cores
    .venv/bin/python benchmarks/precompute.py --images 512 --rounds 1 --priors small   # a quick look

Data: ``array`` is Fashion-MNIST train (the first ``--images`` 28-px images, ``FashionMNIST``: the in-memory array
the demo precomputes); ``folder`` is ``--images`` photo-like colour JPEGs (smooth fields, shapes and sensor-like
noise, quality 90) of 200x150, 150x200 and 176x176 px, written once under ``benchmarks/cache/``. Priors, random
weights (timing does not depend on the values): ``small`` = ``random:resnet18`` at 64 px, ``large`` = a DINOv2
ViT-S/14-sized timm ViT at 112 px (its weights saved as a local weights file, as a user's would be). One torch thread
(``--threads``), batch 32 (the CPU default), fp32. Results: ``benchmarks/results/precompute.json`` + ``.png``.

``--sweep`` measures instead what sets the CPU default batch size (``DEFAULT_BATCH_SIZE``): ``precompute_targets``
images/s at each ``--batch-sizes`` value for a small ConvNet at 28 px (``shipped:digits-byol``, ``--limit`` images)
and a ResNet-18 at 224 px (``random:resnet18``, size 224, 256 images), batch sizes interleaved per round, best of the
rounds (results/precompute_batch.json + .png):

    .venv/bin/python benchmarks/precompute.py --sweep --limit 20000 --threads 1

``benchmarks/gpu.py`` runs :func:`measure` at 224 px on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accelerate_ssl.results import save_figure, write_results  # noqa: E402

#: the precompute's goal against the bare forward, per device type
GOAL = {"cpu": 0.9, "cuda": 0.8}
#: the folder's image sizes (width, height), cycled
CPU_SIZES = [(200, 150), (150, 200), (176, 176)]


# ---------------------------------------------------------------------------------------------- data and priors
def photo_like(seed: int, width: int, height: int) -> np.ndarray:
    """A deterministic photo-like uint8 ``[height, width, 3]`` image: a smooth colour field, eight filled shapes and
    Gaussian noise (sigma 12), so its JPEG carries about as much detail per pixel as a camera's."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(8):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        box = [x0, y0, x0 + int(rng.integers(width // 10, width // 2)), y0 + int(rng.integers(height // 10, height // 2))]
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    noisy = np.asarray(image, dtype=np.int16) + rng.normal(0, 12, (height, width, 3)).astype(np.int16)
    return noisy.clip(0, 255).astype(np.uint8)


def _write_jpeg(job: tuple) -> None:
    """One image of the folder (a plain write: the folder counts as written once its ``done.json`` is, last)."""
    from PIL import Image

    path, seed, width, height = job
    Image.fromarray(photo_like(seed, width, height)).save(path, "JPEG", quality=90)


def photo_folder(root: Path, n: int, sizes: list[tuple[int, int]], processes: int = 1) -> Path:
    """A flat folder of ``n`` photo-like JPEGs (:func:`photo_like`, image i seeded by i, sizes cycled), written once
    by ``processes`` processes; ``done.json``, written atomically after every image, marks it complete (reused then;
    an interrupted folder is written again)."""
    folder = Path(root) / f"photos-{n}-{'-'.join(f'{w}x{h}' for w, h in sizes)}"
    marker = folder / "done.json"
    if marker.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [(folder / f"{i:06d}.jpg", i, *sizes[i % len(sizes)]) for i in range(n)]
    if processes > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(processes) as pool:
            pool.map(_write_jpeg, jobs, chunksize=64)
    else:
        for job in jobs:
            _write_jpeg(job)
    from accelerate_ssl.atomic import atomic_write_text

    atomic_write_text(marker, json.dumps({"images": n, "sizes": sizes}))
    return folder


def photo_array(n: int, size: int) -> torch.utils.data.TensorDataset:
    """``n`` photo-like uint8 images ``[3, size, size]`` in memory, as a ``TensorDataset`` (image, index)."""
    data = torch.from_numpy(np.stack([photo_like(i, size, size) for i in range(n)])).permute(0, 3, 1, 2).contiguous()
    return torch.utils.data.TensorDataset(data, torch.arange(n))


def random_weights_prior(name: str, arch: str, size: int, work: Path):
    """``create_prior("timm:<arch>", weights=<file>, size=size)`` with random weights saved as the user's file: the
    user's path for local weights, with nothing downloaded."""
    import timm
    from safetensors.torch import save_file

    from accelerate_ssl import create_prior

    path = Path(work) / f"{name}-{size}.safetensors"
    if not path.is_file():
        torch.manual_seed(0)
        net = timm.create_model(arch, pretrained=False, num_classes=0, img_size=size)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return create_prior(f"timm:{arch}", weights=str(path), size=size)


# ---------------------------------------------------------------------------------------------- the measurements
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_inputs(prior, dataset, batch: int, device: torch.device, precision: str, limit: int | None = None) -> list:
    """The prior's inputs for the first ``limit`` batches (default: all) of ``dataset``, on ``device``, exactly as the
    precompute makes them (its loader and device stage), kept for the bare forward."""
    from accelerate_ssl.targets.write import PRECISIONS, input_batches, prior_batches, resolve_preprocess

    loader = input_batches(dataset, batch, None, device)
    out = []
    for x, _, _ in prior_batches(loader, resolve_preprocess(prior, dataset), device, PRECISIONS[precision]):
        out.append(x.clone())
        if limit is not None and len(out) == limit:
            break
    _sync(device)
    return out


def bare_forward(prior, inputs: list, n: int, device: torch.device, precision: str) -> tuple[float, float]:
    """``(images/s wall, images/s of CPU time)`` of the prior's forward alone over ``n`` images' inputs already on
    the device (``inputs`` cycled), under the precision's autocast and inference mode; one warm-up batch first."""
    from accelerate_ssl.targets.write import PRECISIONS

    amp = PRECISIONS[precision]
    net = prior.to(device).eval()
    with torch.inference_mode(), torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        net(inputs[0])
        _sync(device)
        done, start, cpu, i = 0, time.perf_counter(), cpu_seconds(), 0
        while done < n:
            x = inputs[i % len(inputs)][: n - done]
            net(x)
            done, i = done + len(x), i + 1
        _sync(device)
    return n / (time.perf_counter() - start), n / max(cpu_seconds() - cpu, 1e-6)


def input_pipeline(prior, dataset, batch: int, device: torch.device, precision: str) -> tuple[float, dict]:
    """Images/s of the precompute's loader and device stage alone (every batch read, digested, decoded, copied and
    preprocessed; no forward), and the loader's workers and prefetch."""
    from accelerate_ssl.targets.write import PRECISIONS, input_batches, prior_batches, resolve_preprocess

    _sync(device)
    start = time.perf_counter()
    loader = input_batches(dataset, batch, None, device)
    n = 0
    for x, _, _ in prior_batches(loader, resolve_preprocess(prior, dataset), device, PRECISIONS[precision]):
        n += len(x)
    _sync(device)
    seconds = time.perf_counter() - start
    return n / seconds, {"num_workers": loader.num_workers, "prefetch_factor": loader.prefetch_factor,
                         "reads": loader.dataset.reads}


def cpu_seconds() -> float:
    """CPU seconds of this process (every thread) and of its finished children (the loader's workers, once joined)."""
    children = os.times()
    return time.process_time() + children.children_user + children.children_system


def full_precompute(prior, dataset, batch: int, device: torch.device, precision: str, work: Path) -> tuple[float, float]:
    """``(images/s wall, images/s of CPU time)`` of ``precompute_targets`` with its defaults (the CPU time of this
    process and of its loader workers)."""
    from accelerate_ssl import precompute_targets

    out = Path(work) / "store"
    shutil.rmtree(out, ignore_errors=True)
    _sync(device)
    start, cpu = time.perf_counter(), cpu_seconds()
    store = precompute_targets(prior, dataset, out, batch_size=batch, precision=precision, progress=False)
    _sync(device)
    seconds, cpu_seconds_ = time.perf_counter() - start, max(cpu_seconds() - cpu, 1e-6)
    assert len(store) == len(dataset)
    shutil.rmtree(out, ignore_errors=True)
    return len(dataset) / seconds, len(dataset) / cpu_seconds_


def per_image_costs(prior, dataset, batch: int, device: torch.device, sample: int = 256) -> dict:
    """Microseconds per image of each part of the input pipeline, measured one at a time in this process on the
    first ``sample`` items: ``read`` (a file's bytes, an array block's copy, or ``dataset[i]`` and its image),
    ``content_digest`` (the digest of a file's bytes the store records), ``decode`` (on the CPU, as the workers do), ``decode_on_device`` (a GPU's
    batched nvJPEG decode of the JPEGs, as the staging thread does there), ``row_digest`` (the identity digest written
    to ``identity.npy``), ``fingerprint`` (the data set's, once per precompute, per image) and ``preprocess`` (the
    prior's resize / crop / normalisation, batched, on ``device``)."""
    from accelerate_ssl.data import dataset_fingerprint
    from accelerate_ssl.data.fingerprint import RowIdentity, file_digest
    from accelerate_ssl.targets.write import (decode_file, decode_on, direct_source, image_tensor, preprocess_images,
                                              read_file, resolve_preprocess)

    n = min(sample, len(dataset))
    direct, identity = direct_source(dataset), RowIdentity(dataset)
    cost: dict = {}

    def timed(name, fn):
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        cost[name] = (time.perf_counter() - start) / n * 1e6
        return out

    if direct is not None and direct.kind == "files":
        raw = timed("read", lambda: [read_file(direct.path(i))[0] for i in range(n)])
        timed("content_digest", lambda: [file_digest(r) for r in raw])
        images = timed("decode", lambda: [decode_file(r) for r in raw])
        if device.type == "cuda":
            kept = [decode_file(r, keep_jpeg=True) for r in raw]
            decode_on(kept[:batch], device)  # nvJPEG's start-up, not timed
            timed("decode_on_device", lambda: [decode_on(kept[a : a + batch], device) for a in range(0, n, batch)])
    elif direct is not None:
        images = list(timed("read", lambda: torch.cat([direct.block(list(range(a, min(a + batch, n))))
                                                       for a in range(0, n, batch)])))
    else:
        images = timed("read", lambda: [image_tensor(dataset[i]) for i in range(n)])
    timed("row_digest", lambda: [identity(i) for i in range(n)])
    start = time.perf_counter()
    dataset_fingerprint(dataset)
    cost["fingerprint"] = (time.perf_counter() - start) / len(dataset) * 1e6
    pre = resolve_preprocess(prior, dataset)
    preprocess_images(images[:batch], pre, device=device)  # the kernels' first call, not timed
    timed("preprocess", lambda: [preprocess_images(images[a : a + batch], pre, device=device)
                                 for a in range(0, n, batch)])
    cost["source"] = "items" if direct is None else direct.kind
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in cost.items()}


def measure(prior, dataset, batch: int, device: torch.device, precision: str, work: Path, rounds: int = 3,
            bare_batches: int | None = None) -> dict:
    """(a) bare forward, (b) input pipeline and (c) precompute of ``prior`` on ``dataset``, ``rounds`` times; each
    round times (a) just before and just after (c), so that both see the same load of a shared machine, and its ratio
    is (c) over the mean of those two (a). Reported: the medians over the rounds (wall clock, and CPU time of this
    process and its loader workers, which the load of other processes barely moves), the pipeline's share of the
    per-image cost and its parts. ``bare_batches``: how many distinct batches the bare forward cycles through
    (default: every image's). One untimed precompute of the first batches first, as the bare forward has one untimed
    batch."""
    inputs = device_inputs(prior, dataset, batch, device, precision, bare_batches)
    warm_up = torch.utils.data.Subset(dataset, range(min(len(dataset), 4 * batch)))  # as the bare forward's batch:
    full_precompute(prior, warm_up, batch, device, precision, work)  # first-call costs of the process, not timed
    runs, loader = [], {}
    for _ in range(rounds):
        run = {"load_avg_1min": round(os.getloadavg()[0], 2)}
        before = bare_forward(prior, inputs, len(dataset), device, precision)
        run["precompute"], run["precompute_cpu"] = full_precompute(prior, dataset, batch, device, precision, work)
        after = bare_forward(prior, inputs, len(dataset), device, precision)
        run["bare"], run["bare_cpu"] = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
        run["pipeline"], loader = input_pipeline(prior, dataset, batch, device, precision)
        run["ratio"], run["ratio_cpu_time"] = run["precompute"] / run["bare"], run["precompute_cpu"] / run["bare_cpu"]
        runs.append({k: round(v, 3) for k, v in run.items()})
    del inputs
    med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    t_forward, t_pipeline, t_precompute = (1e6 / med[k] for k in ("bare", "pipeline", "precompute"))
    row = {"images": len(dataset), "batch": batch, "precision": precision, "loader": loader,
           "bare_forward_img_s": round(med["bare"], 1), "input_pipeline_img_s": round(med["pipeline"], 1),
           "precompute_img_s": round(med["precompute"], 1), "ratio": round(med["ratio"], 3),
           "bare_forward_img_per_cpu_s": round(med["bare_cpu"], 1),
           "precompute_img_per_cpu_s": round(med["precompute_cpu"], 1),
           "ratio_cpu_time": round(med["ratio_cpu_time"], 3),
           "pipeline_share": round(t_pipeline / (t_pipeline + t_forward), 3),
           "us_per_image": {"forward": round(t_forward, 1), "pipeline": round(t_pipeline, 1),
                            "precompute": round(t_precompute, 1)},
           "parts_us_per_image": per_image_costs(prior, dataset, batch, device), "rounds": runs,
           "load_avg_1min": [r["load_avg_1min"] for r in runs]}
    goal = GOAL.get(device.type, 0.9)
    row["goal"] = goal
    if row["ratio"] < goal:
        row["limit"] = limit(row)
    return row


def limit(row: dict) -> str:
    """What holds a ratio below the goal, from the row's own numbers."""
    us, parts = row["us_per_image"], row["parts_us_per_image"]
    named = ", ".join(f"{k} {v:.0f}" for k, v in parts.items() if isinstance(v, float) and v >= 1)
    if row["input_pipeline_img_s"] < row["bare_forward_img_s"]:
        return (f"the input pipeline: {row['input_pipeline_img_s']:.0f} img/s against the forward's "
                f"{row['bare_forward_img_s']:.0f} img/s (per image, us: {named})")
    forward_cpu, precompute_cpu = 1e6 / row["bare_forward_img_per_cpu_s"], 1e6 / row["precompute_img_per_cpu_s"]
    return (f"CPU work: {precompute_cpu:.0f} us of CPU per image against the forward's {forward_cpu:.0f} us (the "
            f"pipeline's parts, us per image: {named}), which overlaps the forward only on a core the forward leaves "
            f"free (loader workers: {row['loader']['num_workers']}, plus the staging thread; 1-min load average "
            f"{row['load_avg_1min']}); wall: {us['precompute']:.0f} us per image against {us['forward']:.0f}")


# ---------------------------------------------------------------------------------------------- the run
def cpu_priors(work: Path) -> dict:
    from accelerate_ssl import create_prior

    return {"small": ("random:resnet18 at 64 px", lambda: create_prior("random:resnet18", size=64)),
            "large": ("DINOv2 ViT-S/14-sized (timm vit_small_patch14_dinov2, random weights) at 112 px",
                      lambda: random_weights_prior("vit_s14", "vit_small_patch14_dinov2", 112, work))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2048, help="images per data set (default 2048)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per case; medians are reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--priors", nargs="+", choices=["small", "large"], default=["small", "large"])
    parser.add_argument("--data", nargs="+", choices=["array", "folder"], default=["array", "folder"])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "precompute.json"))
    parser.add_argument("--cache", default=str(ROOT / "benchmarks" / "cache" / "precompute"),
                        help="where the JPEG folder and the weights files are written (reused)")
    parser.add_argument("--sweep", action="store_true", help="measure precompute speed per batch size instead")
    parser.add_argument("--limit", type=int, default=20000, help="with --sweep: images for the ConvNet")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32, 64, 256], help="with --sweep")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    if args.sweep:
        return batch_sweep(args)
    from accelerate_ssl.data import FashionMNIST, image_folder

    device = torch.device("cpu")
    cache = Path(args.cache)
    data = {"array": lambda: FashionMNIST("train", limit=args.images),
            "folder": lambda: image_folder(photo_folder(cache, args.images, CPU_SIZES))}
    report = {"command": "python benchmarks/precompute.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": "cpu", "rounds": args.rounds,
              "data": {"array": f"Fashion-MNIST train, first {args.images} images (28 px, in memory)",
                       "folder": f"{args.images} photo-like JPEGs, {CPU_SIZES} px, quality 90"},
              "priors": {k: v[0] for k, v in cpu_priors(cache).items() if k in args.priors}, "results": []}
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as tmp:
        for prior_name in args.priors:
            prior = cpu_priors(cache)[prior_name][1]()
            for data_name in args.data:
                row = {"prior": prior_name, "data": data_name,
                       **measure(prior, data[data_name](), 32, device, "fp32", Path(tmp), args.rounds)}
                print(json.dumps(row), flush=True)
                report["results"].append(row)
    report["machine"]["load_average_end"] = os.getloadavg()
    out = Path(args.out)
    write_results(out, report, ROOT, indent=1)
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(report: dict, png: Path) -> None:
    """Bare forward, input pipeline and precompute per case, the ratio over each precompute bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    fig, ax = plt.subplots(figsize=(2.2 * len(rows) + 2, 3.8))
    x = np.arange(len(rows))
    for j, (key, label) in enumerate([("bare_forward_img_s", "bare forward (inputs on the device)"),
                                      ("input_pipeline_img_s", "input pipeline alone"),
                                      ("precompute_img_s", "precompute_targets")]):
        ax.bar(x + (j - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
    for i, r in enumerate(rows):
        ax.text(i + 0.27, r["precompute_img_s"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(x, [f"{r['prior']} prior\n{r['data']}" for r in rows], fontsize=8)
    ax.set_ylabel("images / s (log)")
    ax.legend(fontsize=7)
    m = report["machine"]
    fig.suptitle(f"{report['command']} ({m['device']}, {m.get('torch_threads')} thread(s), commit "
                 f"{str(m['commit'])[:10]})", fontsize=8)
    fig.tight_layout()
    save_figure(fig, png, dpi=110)


def batch_sweep(args) -> None:
    """precompute_targets throughput per batch size, two priors (module docstring), written as JSON + PNG."""
    from accelerate_ssl import create_prior
    from accelerate_ssl.data import FashionMNIST

    device = torch.device("cpu")
    cases = [("shipped:digits-byol", {}, args.limit), ("random:resnet18", {"size": 224}, 256)]
    report = {"command": "python benchmarks/precompute.py " + " ".join(sys.argv[1:]),
              "rounds": args.rounds, "results": []}
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as tmp:
        for spec, options, n in cases:
            prior, dataset = create_prior(spec, **options), FashionMNIST("train", limit=n)
            best = {b: (0.0, 0.0) for b in args.batch_sizes}
            for _ in range(args.rounds):
                for b in args.batch_sizes:
                    wall, cpu = full_precompute(prior, dataset, b, device, "fp32", Path(tmp))
                    best[b] = (max(best[b][0], wall), max(best[b][1], cpu))
            for b, (wall, cpu) in best.items():
                row = {"prior": spec, "options": options, "n": n, "batch_size": b, "img_s": round(wall, 1),
                       "img_per_cpu_s": round(cpu, 1), "vs_fastest": round(wall / max(w for w, _ in best.values()), 3)}
                print(json.dumps(row), flush=True)
                report["results"].append(row)
    report["machine"]["load_average_end"] = os.getloadavg()
    out = Path(args.out).with_name("precompute_batch.json")
    write_results(out, report, ROOT, indent=1)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(4.5 * len(cases), 3.5))
    for ax, (spec, options, n) in zip(axes, cases):
        rows = [r for r in report["results"] if r["prior"] == spec]
        ax.bar([str(r["batch_size"]) for r in rows], [r["img_s"] for r in rows])
        ax.set_title(f"{spec} {options.get('size', 28)} px, {n} images", fontsize=8)
        ax.set_xlabel("batch size")
        ax.set_ylabel("images / s (wall)")
    fig.suptitle(f"precompute_targets on CPU, {args.threads} thread(s): {report['command']}", fontsize=8)
    fig.tight_layout()
    save_figure(fig, out.with_suffix(".png"), dpi=110)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
