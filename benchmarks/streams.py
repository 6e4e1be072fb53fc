"""Targets at web scale: sidecar precompute over a WebDataset, killed and resumed, and a streaming training loop.

A synthetic WebDataset (``--images`` 16x16 grayscale PNGs in ``--shards`` tar shards, written once into ``--work``;
pixels 0..2 of image n encode n, the rest is a seeded pattern). Measured:

1. ``accelerate launch --multi_gpu --num_processes 2`` (gloo on CPU) ``accelerate-ssl precompute --data wds:...``:
   uninterrupted, and again into another folder killed (SIGKILL to every rank and the launcher) once a third of the
   sidecars exist, then resumed: every sidecar file must be byte-identical to the uninterrupted run's.
2. Throughput of the precompute (one process) over ``--sub-shards`` shards, as a ratio to the bare prior forward over
   the same stream (tar read + PNG decode + preprocessing + forward, nothing written).
3. Bytes per sample of the sidecars: float32, float16, PCA-k float16 (``--components``).
4. A training loop streaming images (wds pipeline, 1 loader worker): step time with sidecar targets joined and
   ``rela.wrap(loss, targets=...)`` vs the same loop without targets; rounds alternate so a shared machine's load hits
   both. Every step (untimed) checks that each target row is the prior's output for the image in the batch.
5. Counted (not timed) extrapolation: disk and one-H100 GPU-hours for ImageNet-1K, -21K and a 1B-sample web set.

    nice -n 5 python benchmarks/streams.py [--images 204800 --shards 64 --work /tmp/streams-bench]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accelerate_ssl import ReLA, ShardedTargets, create_prior, decode_images, precompute_sidecars  # noqa: E402
from accelerate_ssl.atomic import atomic_path  # noqa: E402
from accelerate_ssl.backbones import ConvNet  # noqa: E402
from accelerate_ssl.data.streams import open_stream  # noqa: E402
from accelerate_ssl.results import save_figure, write_results  # noqa: E402
from accelerate_ssl.priors import Preprocess  # noqa: E402

PRIOR = "random:convnet"
# counted extrapolation: ViT FLOPs per 224 px image (2 FLOPs per multiply-add), data set sizes, H100 throughput
MODELS = {"dinov2_vitb14": dict(width=768, depth=12, patch=14, out_dim=768),
          "clip_vitl14": dict(width=1024, depth=24, patch=14, out_dim=768)}
DATASETS = {"imagenet-1k": 1_281_167, "imagenet-21k": 14_197_122, "web-1b": 1_000_000_000}
H100_BF16_DENSE_TFLOPS = 989.0  # H100 SXM peak, dense bf16
ASSUMED_MFU = 0.40  # fraction of peak a batched ViT inference reaches (assumed, not measured here)


def vit_flops(width: int, depth: int, patch: int, size: int = 224, **_) -> float:
    """Forward FLOPs of a ViT: patch embedding + per block QKV/proj (4 N d^2), MLP x4 (8 N d^2), attention (2 N^2 d)."""
    tokens = (size // patch) ** 2 + 1
    macs = (tokens - 1) * patch * patch * 3 * width + depth * (12 * tokens * width**2 + 2 * tokens**2 * width)
    return 2.0 * macs


def image_of(n: int, size: int) -> np.ndarray:
    a = np.random.default_rng(n).integers(0, 256, (size, size), dtype=np.uint8)
    a[0, 0], a[0, 1], a[0, 2] = n >> 16, (n >> 8) & 255, n & 255
    return a


def number_of(x: torch.Tensor) -> torch.Tensor:
    """The sample numbers encoded in a batch of uint8 images [B, 1, H, W]."""
    p = x[:, 0, 0, :3].long()
    return (p[:, 0] << 16) | (p[:, 1] << 8) | p[:, 2]


def make_shards(folder: Path, images: int, shards: int, size: int) -> list[str]:
    from PIL import Image
    from tqdm.auto import tqdm

    per = images // shards
    paths = [folder / f"shard-{s:06d}.tar" for s in range(shards)]
    for s, path in enumerate(tqdm(paths, desc="write shards", unit="shard")):
        if path.is_file():
            continue  # resumable: shards are written atomically
        with atomic_path(path) as tmp, tarfile.open(tmp, "w") as tar:
            for n in range(s * per, (s + 1) * per):
                buf = io.BytesIO()
                Image.fromarray(image_of(n, size)).save(buf, format="png")
                info = tarfile.TarInfo(f"{n:09d}.png")
                info.size = buf.tell()
                tar.addfile(info, io.BytesIO(buf.getvalue()))
    return [str(p) for p in paths]


def launch(spec: str, out: Path, args, kill_at: int = 0) -> float:
    """accelerate launch (2 gloo processes) of the precompute CLI; with kill_at, SIGKILL once that many sidecars exist."""
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "accelerate_ssl.cli",
           "precompute", "--prior", PRIOR, "--data", spec, "--out", str(out), "--batch-size", str(args.batch),
           "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    while proc.poll() is None:
        if kill_at and len(list(out.glob("*.tar.safetensors"))) >= kill_at:
            # the launcher starts each rank in a session of its own: kill every rank, then the launcher
            ranks = psutil.Process(proc.pid).children(recursive=True)
            for p in ranks:
                p.send_signal(signal.SIGKILL)
            psutil.wait_procs(ranks, timeout=30)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return -1.0
        time.sleep(0.2)
    if proc.returncode:
        raise RuntimeError(f"{cmd} failed ({proc.returncode})")
    return time.perf_counter() - start


def bare_forward(prior, source, shards, batch: int) -> float:
    """images/s of reading + decoding + preprocessing + the prior's forward over the shards, nothing kept."""
    start, n, xs = time.perf_counter(), 0, []
    with torch.inference_mode():
        for shard in shards:
            for _, image, _ in source.samples(shard):
                xs.append(Preprocess.to_tensor(image))
                if len(xs) == batch:
                    prior(prior.preprocess.batch(torch.stack(xs)))
                    n, xs = n + len(xs), []
            if xs:
                prior(prior.preprocess.batch(torch.stack(xs)))
                n, xs = n + len(xs), []
    return n / (time.perf_counter() - start)


def loader(urls, targets, batch: int):
    import webdataset as wds

    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    if targets is not None:
        ds = ds.compose(targets.join())  # right after the shard reader: lockstep with each sidecar
    ds = ds.map(decode_images()).map(lambda s: {**s, "png": torch.from_numpy(np.array(s["png"]))[None]})
    ds = ds.to_tuple("png", "target") if targets is not None else ds.to_tuple("png")
    return torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=1)


def train_round(urls, targets, prior, steps: int, batch: int, seed: int, rows=None) -> list[float]:
    """Step times (s) of a small BYOL-style loop (shared-weight, stop-grad): without targets, with ReLA on sidecar
    targets joined in the pipeline, or (``rows``: every row in memory, gathered by the image's number) with ReLA's
    term but no join, which splits the overhead into the join's and ReLA's own."""
    torch.manual_seed(seed)
    net = ConvNet(1, (32, 64, 128))
    head = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    rela = ReLA(targets, net, feature_dim=128, total_steps=steps) if targets is not None else None
    opt = torch.optim.SGD([*net.parameters(), *head.parameters(), *(rela.parameters() if rela else [])], lr=0.05)
    times, it = [], iter(loader(urls, targets if rows is None else None, batch))
    for step in range(steps):
        start = time.perf_counter()
        x, *t = next(it)
        t = [rows[number_of(x)]] if rows is not None else t
        x = x.float() / 255
        v1, v2 = x + 0.05 * torch.randn_like(x), x.flip(-1)
        p1, p2 = head(net(v1)), head(net(v2))
        ssl = 2 - torch.nn.functional.cosine_similarity(p1, p2.detach()).mean() \
            - torch.nn.functional.cosine_similarity(p2, p1.detach()).mean()
        loss = rela.wrap(ssl, targets=t[0]) if rela else ssl
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        if rela is not None:  # untimed: each row is the prior's output for the very image in the batch
            with torch.inference_mode():
                own = prior(prior.preprocess.batch((x * 255).round().to(torch.uint8)))
            assert torch.allclose(own, t[0][:, :-1], atol=1e-4), f"step {step}: a target row is not its sample's own"
    return times[3:]  # the loader worker's start-up is not a step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=204800)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--sub-shards", type=int, default=8, help="shards for the throughput and dtype runs")
    parser.add_argument("--components", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40, help="steps per training round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--work", default="/tmp/streams-bench")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "streams.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(args.work)
    urls = make_shards(work / "data", args.images, args.shards, args.size)
    spec = f"wds:{work}/data/shard-{{000000..{args.shards - 1:06d}}}.tar"
    cache = work / "phases.json"  # finished phases (resumable): precompute, throughput, sizes
    done = json.loads(cache.read_text()) if cache.is_file() else {}
    result: dict = {"settings": {**vars(args), "prior": PRIOR, "command": " ".join(["python", *sys.argv])}, **done}

    # 1. 2-process precompute, uninterrupted and killed + resumed: identical sidecars
    full, resumed = work / "sidecars-full", work / "sidecars-killed"
    timing = work / "full-seconds.json"
    if not (full / "sidecars.json").is_file():
        write_results(timing, {"seconds": launch(spec, full, args)})
    seconds = json.loads(timing.read_text())["seconds"]
    if not (resumed / "sidecars.json").is_file():
        killed = launch(spec, resumed, args, kill_at=args.shards // 3)
        left = len(list(resumed.glob("*.tar.safetensors")))
        alive = [p.pid for p in psutil.process_iter(["cmdline"]) if str(resumed) in " ".join(p.info["cmdline"] or [])]
        assert not alive, f"ranks still running after the kill: {alive}"
        launch(spec, resumed, args)
        result["kill"] = {"killed": killed < 0, "sidecars_when_killed": left, "processes_alive_after_kill": len(alive)}
        write_results(cache, {k: result[k] for k in ("kill",)})
    same = [(full / n.name).read_bytes() == n.read_bytes() for n in sorted(resumed.glob("*.tar.safetensors"))]
    result["precompute_2proc"] = {"seconds": seconds, "images_per_s": args.images / seconds if seconds else None,
                                  "sidecars": len(same), "identical_after_kill_and_resume": all(same) and len(same) == args.shards}
    print(result["precompute_2proc"], flush=True)

    # 2. throughput ratio and 3. bytes per sample, one process over --sub-shards shards
    prior = create_prior(PRIOR, in_channels=1).eval()
    sub = f"wds:{work}/data/shard-{{000000..{args.sub_shards - 1:06d}}}.tar"
    source = open_stream(sub)
    n_sub = args.images // args.shards * args.sub_shards
    if "throughput" not in result:
        bare = bare_forward(prior, source, source.shards, args.batch)
        sizes = {}
        for name, kw in (("float32", {}), ("float16", {"dtype": "float16"}),
                         (f"pca{args.components}-float16", {"dtype": "float16", "components": args.components})):
            out = work / f"sub-{name}"
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            t = precompute_sidecars(prior, source, out, batch_size=args.batch, progress=False, **kw)
            sizes[name] = {"bytes_per_sample": t.metadata["bytes_per_sample"],
                           "images_per_s": n_sub / (time.perf_counter() - start)}
        result["throughput"] = {"bare_forward_images_per_s": bare, "precompute_images_per_s": sizes["float32"]["images_per_s"],
                                "ratio": sizes["float32"]["images_per_s"] / bare}
        result["bytes_per_sample"] = {k: v["bytes_per_sample"] for k, v in sizes.items()}
        write_results(cache, {k: result[k] for k in ("kill", "throughput", "bytes_per_sample") if k in result})
    print(result["throughput"], result["bytes_per_sample"], flush=True)

    # 4. training step time, with vs without sidecar targets (alternating rounds)
    targets = ShardedTargets.open(full)
    targets.pca(128)  # (the student's width) fitted once over every row (cached in the folder), not inside a timed step
    rows = targets.carried(targets[np.arange(len(targets))])  # as the join hands them: with the folder's tag
    plain, joined, memory = [], [], []
    runs = [(plain, (None,), {}), (joined, (targets,), {}), (memory, (targets,), {"rows": rows})]
    for r in range(args.rounds):
        for times, (t,), kw in runs[r % 3:] + runs[: r % 3]:  # the order rotates: no loop always runs first
            times += train_round(urls, t, prior, args.steps, args.batch, r, **kw)
    result["training"] = {"step_s_without_targets": float(np.median(plain)), "step_s_with_targets": float(np.median(joined)),
                          "step_s_rela_rows_in_memory_no_join": float(np.median(memory)),
                          "ratio_median": float(np.median(joined) / np.median(plain)),
                          "ratio_rela_term_only_median": float(np.median(memory) / np.median(plain)),
                          "ratio_mean": float(np.mean(joined) / np.mean(plain)), "steps_each": len(plain),
                          "rows_checked_against_the_prior": (len(joined) + len(memory)) * args.batch}
    print(result["training"], flush=True)

    # 5. counted extrapolation (FLOPs and bytes are counted; H100 throughput is an assumption, stated)
    ratio = result["throughput"]["ratio"]
    per_sample = {"float32": lambda d: 4 * d, "float16": lambda d: 2 * d, "pca256-float16": lambda d: 2 * 256}
    key_overhead = result["bytes_per_sample"]["float16"] - 2 * prior.output_dim  # keys + digest per sample, measured
    result["extrapolation"] = {
        "assumptions": {"h100_bf16_dense_tflops": H100_BF16_DENSE_TFLOPS, "mfu": ASSUMED_MFU, "image_size": 224,
                        "precompute_efficiency": ratio, "key_overhead_bytes_per_sample": key_overhead,
                        "note": "one view per sample; image decoding assumed hidden by CPU loader workers"},
        "models": {}}
    for model, cfg in MODELS.items():
        flops = vit_flops(**cfg)
        rate = H100_BF16_DENSE_TFLOPS * 1e12 * ASSUMED_MFU / flops * ratio
        result["extrapolation"]["models"][model] = {
            "gflops_per_image": flops / 1e9, "images_per_s_one_h100": rate, "out_dim": cfg["out_dim"],
            "datasets": {ds: {"gpu_hours": n / rate / 3600,
                              "disk_gb": {k: n * (f(cfg["out_dim"]) + key_overhead) / 1e9 for k, f in per_sample.items()}}
                         for ds, n in DATASETS.items()}}
    write_results(args.out, result, root=ROOT)
    plot(result, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    t = result["training"]
    a.bar(["without targets", "sidecar targets"], [t["step_s_without_targets"] * 1e3, t["step_s_with_targets"] * 1e3])
    a.set_ylabel("median step time (ms)")
    a.set_title(f"streaming loop: ratio {t['ratio_median']:.3f}")
    bps = result["bytes_per_sample"]
    b.bar(list(bps), list(bps.values()))
    b.set_ylabel("bytes per sample")
    b.set_title("sidecar size (256-dim prior)")
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
