"""The precompute's input pipeline: items read, digested and decoded in the loader, uint8 batches preprocessed on the
prior's device, the forward overlapped with the next batch (accelerate_ssl/targets/write.py).

Stated tolerance: on the CPU in fp32 the rows are the reference path's **exactly** (every item read through
``dataset[i]`` with PIL, preprocessed one image at a time in float32 as the weights define it, then the prior's forward
on the same batches), for a timm, an open_clip and a torchvision prior; under bf16 autocast within 1e-6 of the
reference run under the same autocast (the input is handed over in bf16, the dtype autocast casts it to). Stores the
earlier pipeline wrote (``tests/fixtures/precompute_v1``, made by its ``make_fixture.py`` at commit 1d6c1be) open, are
recognised as the same computation, resume, and hold the same rows.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from accelerate_ssl import TargetStore, create_prior, precompute_targets
from accelerate_ssl.data.datasets import ImageFiles
from accelerate_ssl.data.fingerprint import RowIdentity, file_record
from accelerate_ssl.targets import write
from hub_cache import hub_snapshot, randomise, save_state
from accelerate_ssl.targets.write import (Packed, decode_file, decode_on, direct_source, input_batches, jpeg_frame,
                                          loader_prefetch, loader_workers, preprocess_images, prior_batches, read_file)

FIXTURE = Path(__file__).parent / "fixtures" / "precompute_v1"
pytestmark = pytest.mark.usefixtures("cpu_one_thread")


class _CPUProcess:
    """One process on the CPU (what ``process_state()`` gives a single process without a GPU)."""

    process_index, num_processes, is_main_process, device = 0, 1, True, torch.device("cpu")

    def wait_for_everyone(self) -> None:
        pass


@pytest.fixture(autouse=True)
def _on_the_cpu(request, monkeypatch):
    """The exact comparisons are statements about the CPU: the precompute runs there even where a GPU is visible
    (accelerate's process state, made once per process, would otherwise put it on the GPU); the GPU's tolerance is
    the cuda test's."""
    if request.node.get_closest_marker("cuda") is None:
        import accelerate_ssl.targets.precompute as precompute

        monkeypatch.setattr(precompute, "process_state", _CPUProcess)


# ---------------------------------------------------------------------------------------------- the reference path
def reference_input(image, config: dict) -> torch.Tensor:
    """One image as the weights define its input, written out here apart from the library: float32 in [0, 1], grey
    repeated to 3 channels, the shorter side resized (antialiased), the centre crop, ``(x - mean) / std``."""
    if isinstance(image, torch.Tensor):  # an array's row, [C, H, W]
        x = image.float() / 255.0
    else:  # a PIL image, [H, W(, C)]
        x = torch.from_numpy(np.array(image)).float() / 255.0
        x = x[None] if x.ndim == 2 else x.permute(2, 0, 1)
    if x.shape[0] == 1 and config["channels"] == 3:
        x = x.expand(3, -1, -1)
    x = x[None]
    if config["resize"] is not None:
        h, w = x.shape[-2:]
        size = (round(h * config["resize"] / min(h, w)), round(w * config["resize"] / min(h, w)))
        if size != (h, w):
            x = F.interpolate(x, size=size, mode=config["interpolation"], align_corners=False, antialias=True)
            if config["interpolation"] == "bicubic":
                x = x.clamp(0, 1)
    if config["crop"] is not None:
        c, (h, w) = config["crop"], x.shape[-2:]
        x = x[..., (h - c) // 2 : (h - c) // 2 + c, (w - c) // 2 : (w - c) // 2 + c]
    mean = torch.tensor(config["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(config["std"]).view(1, -1, 1, 1)
    return ((x - mean) / std)[0]


def reference_rows(prior, dataset, batch: int, precision: str = "fp32") -> np.ndarray:
    """Every item through ``dataset[i]`` (its PIL image), :func:`reference_input`, then the prior on the same batches
    the precompute forms."""
    config = write.resolve_preprocess(prior, dataset).config
    rows = []
    for a in range(0, len(dataset), batch):
        items = [dataset[i] for i in range(a, min(a + batch, len(dataset)))]
        x = torch.stack([reference_input(item[0] if isinstance(item, tuple) else item, config) for item in items])
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            rows.append(prior(x).float())
    return torch.cat(rows).numpy()


# ---------------------------------------------------------------------------------------------- priors, offline
@pytest.fixture
def zoo(caches):
    """A timm, an open_clip and a torchvision prior from caches made here (random weights), at 32 px, offline."""
    import open_clip
    import timm
    import torchvision

    save_state(randomise(timm.create_model("test_vit", pretrained=False), 1).state_dict(),
               hub_snapshot(caches, "timm/test_vit.r160_in1k") / "model.safetensors")
    clip_cfg = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8,
                                                 "head_width": 16},
                "text_cfg": {"context_length": 8, "vocab_size": 50, "width": 16, "heads": 1, "layers": 1}}
    snapshot = hub_snapshot(caches, "someone/tiny-clip")
    save_state(randomise(open_clip.CLIP(**clip_cfg), 2).state_dict(), snapshot / "open_clip_model.safetensors")
    (snapshot / "open_clip_config.json").write_text(json.dumps({"model_cfg": clip_cfg, "preprocess_cfg": {
        "mean": [0.48, 0.46, 0.41], "std": [0.27, 0.26, 0.28], "interpolation": "bicubic"}}))
    weights = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    checkpoints = caches / "torch" / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    torch.manual_seed(3)
    torch.save(torchvision.models.resnet18().state_dict(), checkpoints / weights.url.rsplit("/", 1)[1])
    return {"timm": lambda: create_prior("timm:test_vit.r160_in1k", size=32),
            "open_clip": lambda: create_prior("open_clip:hf-hub:someone/tiny-clip"),
            "torchvision": lambda: create_prior("torchvision:resnet18/IMAGENET1K_V1", size=40)}


class PILItems(torch.utils.data.Dataset):
    """Images of several sizes and modes held as PIL images: read as ``dataset[i]`` (no direct source)."""

    def __init__(self, folder: Path):
        self.images = []
        for path in sorted(folder.iterdir()):
            with Image.open(path) as im:
                self.images.append(im.convert("RGB") if im.mode not in ("L", "RGB") else im.copy())

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], i


def datasets(tmp_path: Path) -> dict:
    folder = tmp_path / "images"
    shutil.copytree(FIXTURE / "images", folder)
    g = torch.Generator().manual_seed(0)
    array = torch.utils.data.TensorDataset(torch.randint(0, 256, (20, 3, 36, 44), dtype=torch.uint8, generator=g),
                                           torch.zeros(20))
    return {"folder": ImageFiles(folder), "array": array, "items": PILItems(folder)}


# ---------------------------------------------------------------------------------------------- rows = reference
@pytest.mark.parametrize("family", ["timm", "open_clip", "torchvision"])
def test_rows_are_the_reference_paths_for_every_prior_family(zoo, tmp_path, family):
    """Folder (files read and decoded by the pipeline, JPEG / greyscale / CMYK / PNG, four sizes), in-memory array (one
    block per batch) and PIL items (``dataset[i]``): the precompute's rows equal the reference path's exactly."""
    prior = zoo[family]()
    for name, dataset in datasets(tmp_path).items():
        store = precompute_targets(prior, dataset, tmp_path / f"{family}-{name}", batch_size=8, num_workers=0,
                                   progress=False)
        expected = reference_rows(prior, dataset, 8)
        assert store.array.shape == expected.shape, name
        np.testing.assert_array_equal(store.array[:], expected, err_msg=f"{family} prior, {name} data")


def test_bf16_rows_match_the_reference_under_the_same_autocast(zoo, tmp_path):
    prior = zoo["timm"]()
    dataset = datasets(tmp_path)["folder"]
    store = precompute_targets(prior, dataset, tmp_path / "bf16", batch_size=8, num_workers=0, precision="bf16",
                               progress=False)
    expected = reference_rows(prior, dataset, 8, "bf16")
    np.testing.assert_allclose(store.array[:], expected, rtol=0, atol=1e-6 * float(np.abs(expected).max()))


def test_loader_workers_give_the_same_store_as_the_main_process(zoo, tmp_path):
    prior = zoo["torchvision"]()
    dataset = datasets(tmp_path)["folder"]
    inline = precompute_targets(prior, dataset, tmp_path / "w0", batch_size=4, num_workers=0, progress=False)
    workers = precompute_targets(prior, dataset, tmp_path / "w2", batch_size=4, num_workers=2, progress=False)
    np.testing.assert_array_equal(workers.array[:], inline.array[:])
    np.testing.assert_array_equal(np.load(workers.path / "identity.npy"), np.load(inline.path / "identity.npy"))


# ---------------------------------------------------------------------------------------------- stores written before
@pytest.fixture
def old(tmp_path):
    folder = tmp_path / "old"
    shutil.copytree(FIXTURE, folder, ignore=shutil.ignore_patterns("*.py"))
    return folder


def _fixture_prior():
    return create_prior("random:convnet", in_channels=3, size=28)


def test_a_store_the_earlier_pipeline_wrote_opens_and_is_this_computation(old):
    before = TargetStore.open(old / "store")
    written = (old / "store" / "targets.npy").stat().st_mtime_ns
    again = precompute_targets(_fixture_prior(), ImageFiles(old / "images"), old / "store", batch_size=8, chunk_size=8,
                               progress=False)
    assert (old / "store" / "targets.npy").stat().st_mtime_ns == written  # recognised as done, nothing recomputed
    np.testing.assert_array_equal(again.array[:], before.array[:])
    assert again.verify_rows(ImageFiles(old / "images"))["rows_checked"] == 22


def test_the_new_pipeline_writes_the_earlier_rows_and_resumes_its_interrupted_run(old, tmp_path):
    earlier = TargetStore.open(old / "store")
    fresh = precompute_targets(_fixture_prior(), ImageFiles(old / "images"), tmp_path / "fresh", batch_size=8,
                               chunk_size=8, progress=False)
    # the fixture's rows were computed on another CPU, whose kernels may round the last bit differently: equal to
    # float32 rounding; the identities (hashes of the decoded images) are exact
    np.testing.assert_allclose(fresh.array[:], earlier.array[:], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.load(fresh.path / "identity.npy"), np.load(earlier.path / "identity.npy"))
    first_chunk = np.load(old / "unfinished" / "chunks" / "chunk-00000.npy")
    resumed = precompute_targets(_fixture_prior(), ImageFiles(old / "images"), old / "unfinished", batch_size=8,
                                 chunk_size=8, progress=False)
    np.testing.assert_array_equal(resumed.array[:8], first_chunk)  # the earlier run's chunk kept, not recomputed
    np.testing.assert_array_equal(resumed.array[8:], fresh.array[8:])  # the rest computed here, as a fresh run does


# ---------------------------------------------------------------------------------------------- reading, once
def count_reads(monkeypatch) -> dict:
    """Every file read (``read_file``, wherever the loader or the content record calls it), counted by path."""
    from accelerate_ssl.data import fingerprint

    reads: dict[str, int] = {}
    original = fingerprint.read_file

    def counting(path):
        reads[str(path)] = reads.get(str(path), 0) + 1
        return original(path)

    monkeypatch.setattr(write, "read_file", counting)
    monkeypatch.setattr(fingerprint, "read_file", counting)
    return reads


def test_each_file_is_read_once_and_yields_its_record(tmp_path, monkeypatch):
    """One read per file gives the bytes decoded and the record the store keeps of the file (size, mtime, digest of
    those bytes): the content identity costs no second read."""
    dataset = datasets(tmp_path)["folder"]
    loader = input_batches(dataset, 5, num_workers=0)
    expected = {path: file_record(path).tolist() for path, _ in dataset.samples}  # read here, before counting
    reads = count_reads(monkeypatch)
    identity = RowIdentity(dataset)
    seen = 0
    for images, rows, records in loader:
        for j in range(len(rows)):
            path = dataset.samples[seen + j][0]
            assert records[j].tolist() == expected[path]  # what the store's content check compares
            assert int(rows[j]) == identity(seen + j)
        seen += len(rows)
    assert seen == len(dataset) and sorted(reads) == sorted(p for p, _ in dataset.samples)
    assert set(reads.values()) == {1}


def test_a_folder_precompute_reads_each_file_once_for_its_rows_and_its_content_record(tmp_path, monkeypatch):
    """The store's content check needs every file's bytes digested: the loader's one read serves the decode and the
    record (no second read at consolidation), and the store holds exactly what a fresh read of each file gives. A run
    resumed from chunks without records (an earlier version's) reads only those chunks' files again."""
    from accelerate_ssl.data import fingerprint

    dataset = datasets(tmp_path)["folder"]
    reads = count_reads(monkeypatch)
    prior = create_prior("random:convnet", in_channels=3, size=28)
    store = precompute_targets(prior, dataset, tmp_path / "store", batch_size=4, chunk_size=8, num_workers=0,
                               progress=False)
    assert store.metadata["contents"]["digest"] == "blake2b-128" and len(store) == len(dataset)
    paths = [p for p, _ in dataset.samples]
    assert sorted(reads) == sorted(paths)
    # once each; the first once more, before the pass: the fast path's proof that it reads the data set's own item
    assert reads[paths[0]] == 2 and {reads[p] for p in paths[1:]} == {1}
    recorded = np.load(tmp_path / "store" / "contents.npy")
    assert recorded.tolist() == [fingerprint.file_record(p).tolist() for p in paths]
    assert TargetStore.open(tmp_path / "store", dataset=dataset) is not None  # its content check passes


def test_several_priors_over_a_folder_read_each_file_once_and_record_it_in_every_store(tmp_path, monkeypatch):
    """One pass serves every prior: each file is read once for all of them, and each store keeps its content record."""
    from accelerate_ssl.data import fingerprint

    dataset = datasets(tmp_path)["folder"]
    reads = count_reads(monkeypatch)
    priors = {name: create_prior("random:convnet", in_channels=3, size=28, seed=seed)
              for name, seed in (("a", 0), ("b", 1))}
    stores = precompute_targets(priors, dataset, {name: tmp_path / name for name in priors}, batch_size=4, chunk_size=8, num_workers=0,
                                progress=False)
    paths = [p for p, _ in dataset.samples]
    assert reads[paths[0]] == 2 and {reads[p] for p in paths[1:]} == {1}  # as with one prior
    for name in priors:
        recorded = np.load(stores[name].path / "contents.npy")
        assert recorded.tolist() == [fingerprint.file_record(p).tolist() for p in paths]


class FlippedFiles(ImageFiles):
    """A folder read through its own ``__getitem__`` (a transform): never bypassed, so no file is recorded as read."""

    def __getitem__(self, i):
        image, label = super().__getitem__(i)
        return image.transpose(Image.FLIP_LEFT_RIGHT), label


def test_several_priors_over_a_folder_read_through_getitem_record_each_file_once_for_every_store(tmp_path,
                                                                                                 monkeypatch):
    """The other way to the content records: items come from ``dataset[i]``, so the chunks carry no records and the
    files are read for them after the pass, once for all the priors, and every store keeps the same records."""
    from accelerate_ssl.data import fingerprint

    dataset = FlippedFiles(datasets(tmp_path)["folder"].root)
    assert direct_source(dataset) is None
    reads = count_reads(monkeypatch)
    priors = {name: create_prior("random:convnet", in_channels=3, size=28, seed=seed)
              for name, seed in (("a", 0), ("b", 1))}
    stores = precompute_targets(priors, dataset, {name: tmp_path / name for name in priors}, batch_size=4,
                                chunk_size=8, num_workers=0, progress=False)
    paths = [p for p, _ in dataset.samples]
    assert sorted(reads) == sorted(paths) and set(reads.values()) == {1}  # once each, not once per prior
    expected = [fingerprint.file_record(p).tolist() for p in paths]
    for name in priors:
        assert np.load(stores[name].path / "contents.npy").tolist() == expected
        assert TargetStore.open(stores[name].path, dataset=dataset) is not None  # its content check passes


def test_direct_sources_read_what_the_data_set_gives(tmp_path):
    from torchvision.datasets import ImageFolder

    data = datasets(tmp_path)
    assert direct_source(data["folder"]).kind == "files" and direct_source(data["array"]).kind == "array"
    assert direct_source(data["items"]) is None
    (tmp_path / "classes" / "a").mkdir(parents=True)
    for name in ("000.jpg", "007.jpg", "003.png"):
        shutil.copy(FIXTURE / "images" / name, tmp_path / "classes" / "a" / name)
    folder = ImageFolder(str(tmp_path / "classes"))
    subset = torch.utils.data.Subset(folder, [2, 0])
    source = direct_source(subset)
    assert source.kind == "files" and source.path(0) == folder.samples[2][0]
    flipped = ImageFolder(str(tmp_path / "classes"), transform=lambda im: im.transpose(Image.FLIP_LEFT_RIGHT))
    assert direct_source(flipped) is None  # a transform: read through dataset[i]

    class Cropped(ImageFiles):  # its own __getitem__: never bypassed
        def __getitem__(self, i):
            image, label = super().__getitem__(i)
            return image.crop((0, 0, 10, 10)), label

    assert direct_source(Cropped(tmp_path / "images")) is None


def test_jpegs_decode_as_pil_does_and_cmyk_or_png_go_through_pil(tmp_path):
    for path in sorted((FIXTURE / "images").iterdir()):
        data, record = read_file(path)
        assert record[0] == len(data) == path.stat().st_size
        with Image.open(path) as im:
            theirs = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)
            mode, fmt = im.mode, im.format
        frame = jpeg_frame(data)
        assert (frame is not None) == (fmt == "JPEG" and mode in ("L", "RGB")), path.name
        assert torch.equal(decode_file(data), theirs), path.name
        kept = decode_file(data, keep_jpeg=True)
        assert (kept.ndim == 1) == (frame is not None)
        assert torch.equal(decode_on([kept], torch.device("cpu"))[0], theirs)
    assert jpeg_frame(b"\xff\xd8\xff") is None and jpeg_frame(b"\x89PNG\r\n") is None
    with pytest.raises(TypeError, match="Cannot decode broken.jpg.*Replace or remove the file"):
        decode_file(bytearray(b"\xff\xd8\xff\xe0 not a jpeg"), where="broken.jpg")


def test_mixed_sizes_are_preprocessed_by_size_in_the_batch_order():
    pre = create_prior("random:convnet", in_channels=3, size=12).preprocess
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
              for shape in [(3, 20, 16), (1, 16, 20), (3, 20, 16), (3, 14, 14), (1, 16, 20)]]
    out = preprocess_images(images, pre)
    for j, image in enumerate(images):
        assert torch.equal(out[j], pre.batch(image[None])[0])
    packed = Packed.of(images)  # one buffer, as a loader worker hands a batch of several shapes over
    assert packed.data.shape == (sum(im.numel() for im in images),)
    assert torch.equal(preprocess_images(packed, pre), out)
    both = preprocess_images(images, [pre, pre.with_stats([0.3], [0.2], "custom")], dtype=torch.bfloat16)
    assert both[0].dtype == torch.bfloat16 and torch.equal(both[0], out.to(torch.bfloat16))
    with pytest.raises(ValueError, match="create_prior.*size="):
        preprocess_images(images, create_prior("random:convnet", in_channels=3).preprocess, " (batch 3)")


# ---------------------------------------------------------------------------------------------- the staging thread
def _stage_threads():
    return [t for t in threading.enumerate() if t.name == "precompute-stage"]


def test_a_read_error_stops_the_run_naming_the_file_and_no_thread_is_left(tmp_path):
    folder = tmp_path / "images"
    shutil.copytree(FIXTURE / "images", folder)
    (folder / "013.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    dataset = ImageFiles(folder)
    pre = create_prior("random:convnet", in_channels=3, size=28).preprocess
    with pytest.raises(TypeError, match=r"item 13 of .*013\.jpg.*Replace or remove the file"):
        for _ in prior_batches(input_batches(dataset, 4, num_workers=0), pre, "cpu"):
            pass
    assert not _stage_threads()
    batches = prior_batches(input_batches(datasets(tmp_path / "b")["array"], 4, num_workers=0), pre, "cpu")
    next(batches)
    batches.close()  # a consumer that stops early stops the thread
    assert not _stage_threads()


def test_batches_come_in_order_with_the_inputs_of_each_prior(tmp_path):
    data = datasets(tmp_path)["array"]
    small = create_prior("random:convnet", in_channels=3, size=28).preprocess
    other = small.with_stats([0.2], [0.3], "custom")
    seen = 0
    for (a, b), rows, records in prior_batches(input_batches(data, 6, num_workers=0), [small, other], "cpu"):
        images = data.tensors[0][seen : seen + len(rows)]
        assert torch.equal(a, small.batch(images)) and torch.equal(b, other.batch(images))
        assert records.shape == (len(rows), 0)  # an array row is no file: no file record
        seen += len(rows)
    assert seen == len(data)


# ---------------------------------------------------------------------------------------------- sized from the machine
def test_workers_and_prefetch_are_sized_from_the_machine(monkeypatch):
    monkeypatch.setattr(write.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    # a GPU: every CPU but the staging thread's and the one driving the GPU; a CPU: what torch's 8 threads leave
    assert loader_workers("cuda", 100, "files") == 14 and loader_workers("cpu", 100, "files") == 4
    assert loader_workers("cpu", 100, "array") == 0 and loader_workers("cuda", 100, "array") == 14
    assert loader_workers("cuda", 3, "files") == 0  # a few batches: no start-up
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert loader_workers("cpu", 100, "files") == 0  # the forward holds every CPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 4 processes share the machine: 4 CPUs each
    assert loader_workers("cuda", 100, "files") == 2
    monkeypatch.setattr(write.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert loader_workers("cpu", 100, "files") == 0  # 2 CPUs: the forward's and the staging thread's
    monkeypatch.setattr(write, "_shared_memory_bytes", lambda: 64 << 20)  # a container's 64 MiB /dev/shm
    assert loader_prefetch(15, 8 << 20) == (4, 1)  # 4 workers of one 8 MiB batch fit in half of it
    assert loader_prefetch(15, 64 << 20) == (0, 0)  # not one batch: read in the main process
    monkeypatch.setattr(write, "_shared_memory_bytes", lambda: 64 << 30)
    assert loader_prefetch(8, 8 << 20) == (8, 4)


# ---------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_jpegs_decode_there_and_rows_match_the_cpu_path(zoo, tmp_path):
    """nvJPEG and the GPU's kernels round differently from libjpeg and the CPU's: rows within cosine 0.999 (fp32)."""
    prior = zoo["timm"]()
    dataset = datasets(tmp_path)["folder"]
    loader = input_batches(dataset, 8, num_workers=0, device="cuda")
    images, _, _ = next(iter(loader))
    assert isinstance(images, Packed) and any(len(shape) == 1 for shape in images.shapes)  # JPEGs left for the GPU
    on_gpu = precompute_targets(prior.cuda(), dataset, tmp_path / "gpu", batch_size=8, num_workers=2, progress=False)
    on_cpu = reference_rows(prior.cpu(), dataset, 8)
    cos = F.cosine_similarity(torch.from_numpy(on_gpu.array[:]), torch.from_numpy(on_cpu), dim=1)
    assert float(cos.min()) > 0.999
