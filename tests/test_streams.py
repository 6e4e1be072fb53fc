"""Streamed data (WebDataset shards, Hugging Face datasets): sidecar precompute, the key join, the loops of the README.

Image n encodes n in its first pixels; each check compares a target row with the prior's own output for the image
actually in the batch (computed here, not read from a sidecar)."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

wds = pytest.importorskip("webdataset")
datasets = pytest.importorskip("datasets")

from accelerate_ssl import ReLA, ShardedTargets, create_prior, decode_images, precompute_sidecars  # noqa: E402
from accelerate_ssl.data.streams import open_stream  # noqa: E402
from accelerate_ssl.data.views import apply_view  # noqa: E402
from accelerate_ssl.targets.sidecar import SidecarError, key_index  # noqa: E402
from processes import assert_exited_cleanly, cpu_process_env, free_port  # noqa: E402
from recipe_check import HOSTS, check_recipe, page_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZE = 8


def image_of(n: int) -> np.ndarray:
    a = np.random.default_rng(n).integers(0, 256, (SIZE, SIZE), dtype=np.uint8)
    a[0, 0], a[0, 1] = n >> 8, n & 255
    return a


def number_of(x: torch.Tensor) -> torch.Tensor:
    return (x[:, 0, 0, 0].long() << 8) | x[:, 0, 0, 1].long()


def png(a: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="png")
    return buf.getvalue()


def write_shard(path: Path, entries) -> str:
    """entries: (key, n) -> a png of image n; or (key, n, {ext: bytes}) for extra fields."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for entry in entries:
            key, n, extra = (*entry, {})[:3]
            for ext, data in {"png": png(image_of(n)), **extra}.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def write_shards(folder: Path, sizes=(10, 7, 9)) -> list[str]:
    urls, n = [], 0
    for s, size in enumerate(sizes):
        urls.append(write_shard(folder / f"shard-{s:06d}.tar", [(f"k{i:05d}", i) for i in range(n, n + size)]))
        n += size
    return urls


@pytest.fixture(scope="module")
def prior():
    return create_prior("random:convnet", in_channels=1).eval()


def own(prior, images: torch.Tensor) -> torch.Tensor:
    """The prior's output for uint8 images [B, 1, H, W] (what each target row must equal)."""
    with torch.inference_mode():
        return prior(prior.preprocess.batch(images))


def as_tensor(sample):
    return torch.from_numpy(np.array(sample))[None]


@pytest.fixture(scope="module")
def stream(tmp_path_factory, prior):
    """Shards of 10, 7 and 9 samples and their sidecars, computed as the tests' child processes compute (the CPU, one
    thread), so that the sidecars of a precompute in child processes can be compared with them byte for byte."""
    root = tmp_path_factory.mktemp("wds")
    urls = write_shards(root / "data")
    spec = f"wds:{root}/data/shard-{{000000..000002}}.tar"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            targets = precompute_sidecars(prior, spec, root / "sidecars", batch_size=4, progress=False)
        finally:
            torch.set_num_threads(threads)
    return root, urls, spec, targets


def _same_sidecar(a: Path, b: Path) -> str:
    """'' when two sidecar files hold the same bytes, else what differs (the header or the rows, and by how much)."""
    if a.read_bytes() == b.read_bytes():
        return ""
    from safetensors import safe_open

    with safe_open(str(a), framework="pt") as fa, safe_open(str(b), framework="pt") as fb:
        if fa.metadata() != fb.metadata():
            return f"{a.name}: headers differ: {fa.metadata()} vs {fb.metadata()}"
        diffs = {k: float((fa.get_tensor(k).double() - fb.get_tensor(k).double()).abs().max()) for k in fa.keys()}
    return f"{a.name}: same header, largest differences {diffs}"


def joined(urls, targets, **kw):
    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False).compose(targets.join(**kw))
    return ds.map(decode_images())


# ------------------------------------------------------------------------------------------------ the loops
def test_a_webdataset_loop_trains_with_sidecar_targets_each_row_its_samples_own(stream, prior):
    root, urls, spec, _ = stream
    # a loop over the joined pipeline
    targets = ShardedTargets.open(root / "sidecars")
    data = (wds.WebDataset(urls, shardshuffle=2, empty_check=False, seed=0).compose(targets.join())
            .map(decode_images()).shuffle(8, seed=0).map_dict(png=as_tensor).to_tuple("png", "target"))
    loader = torch.utils.data.DataLoader(data, batch_size=5)
    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(SIZE * SIZE, 16))
    rela = ReLA(targets, backbone, feature_dim=16, total_steps=12)
    opt = torch.optim.SGD(backbone.parameters(), lr=0.1)
    w0 = rela.head.weight.detach().clone()
    seen = []
    for epoch in range(2):
        for x, t in loader:
            assert torch.allclose(t[:, :-1], own(prior, x), atol=1e-5)  # every row is the prior's output for that image
            assert (t[:, -1] == targets.tag).all()  # and carries its folder's tag
            seen += number_of(x).tolist()
            loss = rela.wrap(backbone(x.float() / 255).pow(2).mean(), targets=t)
            opt.zero_grad()
            loss.backward()
            opt.step()
            assert torch.isfinite(loss)
    assert sorted(seen) == sorted(list(range(26)) * 2)
    assert not torch.equal(rela.head.weight, w0) and rela.steps == 2 * 6  # 26 samples in batches of 5, twice
    state = rela.state_dict()
    assert state["store"] == targets.identity()


def test_a_datasets_loop_trains_with_a_target_column(tmp_path, prior):
    from PIL import Image

    ds = datasets.Dataset.from_dict({"image": [Image.fromarray(image_of(n)) for n in range(23)],
                                     "id": [f"img{n:03d}" for n in range(23)]},
                                    features=datasets.Features({"image": datasets.Image(), "id": datasets.Value("string")}))
    ds.save_to_disk(str(tmp_path / "hf"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "accelerate_ssl.cli", "precompute", "--prior", "random:convnet",
                          "--data", f"hf:{tmp_path / 'hf'}", "--key-field", "id", "--shard-rows", "10",
                          "--out", str(tmp_path / "side"), "--no-progress", "--json"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["shards"] == 3
    # a loop over the joined pipeline
    ds = datasets.load_from_disk(str(tmp_path / "hf"))
    targets = ShardedTargets.open(tmp_path / "side")
    train = targets.column(ds, key_column="id").with_format("torch")
    loader = torch.utils.data.DataLoader(train, batch_size=4, shuffle=True)
    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(SIZE * SIZE, 16))
    rela = ReLA(targets, backbone, feature_dim=16, total_steps=6)
    opt = torch.optim.SGD(backbone.parameters(), lr=0.1)
    seen = []
    for batch in loader:
        x = batch["image"].reshape(-1, 1, SIZE, SIZE)
        assert torch.allclose(batch["target"][:, :-1], own(prior, x), atol=1e-5)
        assert (batch["target"][:, -1] == targets.tag).all()
        assert [f"img{n:03d}" for n in number_of(x).tolist()] == list(batch["id"])
        seen += number_of(x).tolist()
        loss = rela.wrap(backbone(x.float() / 255).pow(2).mean(), targets=batch["target"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert sorted(seen) == list(range(23)) and rela.steps == 6
    swapped = ds.select([1, 0, *range(2, 23)])  # another row order: followed by key, each row its own
    column = targets.column(swapped, key_column="id").with_format("torch")[:]
    x = column["image"].reshape(-1, 1, SIZE, SIZE)
    assert number_of(x[:3]).tolist() == [1, 0, 2]
    assert torch.allclose(column["target"][:, :-1], own(prior, x), atol=1e-5)


# ------------------------------------------------------------------------------------------------ sharding, resuming
def test_two_processes_write_every_shard_once_identical_to_one(stream, tmp_path):
    """The sidecars of two gloo processes are the bytes of one process's, both computed on the CPU with one thread
    (the reference is computed as the children compute, the stream fixture). The launch takes a port of its own: on
    the default one, another run holding it made the launcher hang until the timeout."""
    root, urls, spec, one = stream
    env = cpu_process_env(PYTHONPATH=str(ROOT))
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), "-m", "accelerate_ssl.cli",
           "precompute", "--prior", "random:convnet", "--data", spec, "--out", str(tmp_path / "two"),
           "--batch-size", "4", "--no-progress"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert_exited_cleanly(out.returncode, out.stderr, env=env)
    meta = json.loads((tmp_path / "two" / "sidecars.json").read_text())
    assert meta["num_processes"] == 2 and [s["shard"] for s in meta["shards"]] == one.shards  # 3 shards on 2 ranks
    for name in one.shards:
        assert _same_sidecar(tmp_path / "two" / f"{name}.safetensors", root / "sidecars" / f"{name}.safetensors") == ""


@pytest.mark.usefixtures("cpu_one_thread")  # as the reference sidecars were computed, byte for byte
def test_a_killed_precompute_resumes_shard_by_shard_to_identical_sidecars(stream, prior, tmp_path, monkeypatch):
    root, urls, spec, full = stream
    source = open_stream(spec)
    original = type(source).samples

    def dies_on_the_last_shard(self, shard):
        if shard == "shard-000002.tar":
            raise KeyboardInterrupt("killed")
        yield from original(self, shard)

    monkeypatch.setattr(type(source), "samples", dies_on_the_last_shard)
    with pytest.raises(KeyboardInterrupt):
        precompute_sidecars(prior, source, tmp_path / "s", batch_size=4, progress=False)
    with pytest.raises(SidecarError, match="unfinished sidecar precompute"):
        ShardedTargets.open(tmp_path / "s")
    done = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "s").glob("*.safetensors")}
    assert sorted(done) == ["shard-000000.tar.safetensors", "shard-000001.tar.safetensors"]
    calls = []

    def counted(self, shard):
        calls.append(shard)
        yield from original(self, shard)

    monkeypatch.setattr(type(source), "samples", counted)
    precompute_sidecars(prior, source, tmp_path / "s", batch_size=4, progress=False)
    assert calls == ["shard-000002.tar"]  # the finished shards were kept, not recomputed
    for name in full.shards:
        assert (tmp_path / "s" / f"{name}.safetensors").read_bytes() == (root / "sidecars" / f"{name}.safetensors").read_bytes()
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "s").glob("shard-00000[01]*")} == done
    with pytest.raises(ValueError, match="other settings"):
        precompute_sidecars(prior, source, tmp_path / "s", batch_size=4, dtype="float16", progress=False)
    from accelerate_ssl import precompute_targets

    again = precompute_targets(prior, spec, tmp_path / "s", batch_size=3, progress=False)  # by spec; any batch size
    assert isinstance(again, ShardedTargets) and again.identity() == full.identity()
    with pytest.raises(ValueError, match="other settings"):  # the Python form passes dtype= on, as the CLI does
        precompute_targets(prior, spec, tmp_path / "s", dtype="float16", progress=False)
    with pytest.raises(ValueError, match="other settings"):
        precompute_targets(prior, spec, tmp_path / "s", components=4, progress=False)
    with pytest.raises(ValueError, match="keyed by each sample's __key__"):
        precompute_targets(prior, spec, tmp_path / "s", keys=False, progress=False)
    half = precompute_targets(prior, spec, tmp_path / "h", dtype="float16", components=4, progress=False)
    assert half.metadata["settings"]["dtype"] == "float16" and half.metadata["settings"]["components"] == 4
    assert half.dim == 4 and half.shard(half.shards[0])[1].shape[1] == 4


# ------------------------------------------------------------------------------------------------ bad inputs
def _drain(urls, targets):
    """Samples the join yields before it stops; each must carry its own row."""
    got = []
    with pytest.raises(SidecarError) as err:
        for s in joined(urls, targets):
            got.append(s)
    full = targets[np.arange(len(targets))]
    for s in got:
        assert torch.equal(s["target"], targets.carried(full[int(s["__key__"][1:])]))  # key k<n> is global row n
    return str(err.value), got


@pytest.mark.parametrize("case, entries, message", [
    ("key missing", [(f"k{i:05d}", i) for i in range(10, 17) if i != 12],
     r"shard 'shard-000001.tar': sample 2 has key 'k00013' but the sidecar's row 2 is for key 'k00012'"),
    ("reordered", [(f"k{i:05d}", i) for i in (10, 11, 13, 12, 14, 15, 16)],
     r"shard 'shard-000001.tar': sample 2 has key 'k00013' but the sidecar's row 2 is for key 'k00012' \('k00013' is its row 3\)"),
    ("duplicated key", [(f"k{i:05d}", i) for i in (10, 11, 12, 11, 13, 14, 15, 16)],
     r"shard 'shard-000001.tar': key 'k00011' appears twice"),
    ("sidecar shorter than its shard", [(f"k{i:05d}", i) for i in range(10, 17)] + [("k00100", 100)],
     r"shard 'shard-000001.tar': sample 7 \(key 'k00100'\) has no target row: the sidecar holds only 7 rows"),
    ("a key not in the store", [(f"k{i:05d}", i) for i in range(10, 13)] + [("k00999", 999)] + [(f"k{i:05d}", i) for i in range(14, 17)],
     r"shard 'shard-000001.tar': key 'k00999' \(sample 3\) is not in its sidecar"),
    ("shard truncated", [(f"k{i:05d}", i) for i in range(10, 15)],
     r"data shard 'shard-000001.tar' ended after 5 samples but its sidecar holds 7 \(next key 'k00015'\)"),
    ("image changed", [(f"k{i:05d}", i if i != 12 else 500) for i in range(10, 17)],
     r"shard 'shard-000001.tar': the image of key 'k00012' is not the one its target was computed from"),
])
def test_a_bad_shard_stops_the_join_naming_shard_and_key(stream, tmp_path, case, entries, message):
    root, urls, spec, targets = stream
    bad = write_shard(tmp_path / "shard-000001.tar", entries)
    text, got = _drain([urls[0], bad, urls[2]], targets)
    assert __import__("re").search(message, text), text
    assert all(s["__url__"] != urls[2] for s in got)


def test_a_missing_sidecar_or_shard_of_other_data_is_refused(stream, tmp_path):
    root, urls, spec, targets = stream
    other = write_shard(tmp_path / "shard-000009.tar", [("k00000", 0)])
    text, got = _drain([other], targets)
    assert "data shard 'shard-000009.tar' has no sidecar" in text and got == []
    import shutil

    shutil.copytree(root / "sidecars", tmp_path / "copy")
    (tmp_path / "copy" / "shard-000001.tar.safetensors").unlink()
    with pytest.raises(SidecarError, match=r"the sidecar of shard 'shard-000001.tar' \(shard-000001.tar.safetensors\) is missing"):
        ShardedTargets.open(tmp_path / "copy")


def test_a_duplicated_key_is_refused_at_precompute(tmp_path, prior):
    write_shard(tmp_path / "d" / "a.tar", [("x1", 1), ("x2", 2)])
    write_shard(tmp_path / "d" / "b.tar", [("x3", 3), ("x2", 4)])
    with pytest.raises(SidecarError, match=r"key 'x2' is in shard 'a.tar' and in shard 'b.tar'"):
        precompute_sidecars(prior, f"wds:{tmp_path}/d/*.tar", tmp_path / "s", progress=False)
    write_shard(tmp_path / "e" / "a.tar", [("x1", 1), ("x2", 2), ("x1", 3)])
    with pytest.raises(SidecarError, match=r"shard 'a.tar': key 'x1' appears twice \(samples 0 and 2\)"):
        precompute_sidecars(prior, f"wds:{tmp_path}/e/a.tar", tmp_path / "t", progress=False)


def test_readers_never_unpickle_a_shard_field(tmp_path, prior):
    marker = tmp_path / "pwned"

    class Trap:
        def __reduce__(self):
            return (Path.touch, (marker,))

    payload = pickle.dumps(Trap())
    write_shard(tmp_path / "d" / "a.tar", [(f"k{i}", i, {"pyd": payload, "pickle": payload}) for i in range(3)])
    targets = precompute_sidecars(prior, f"wds:{tmp_path}/d/a.tar", tmp_path / "s", progress=False)
    samples = list(joined([str(tmp_path / "d" / "a.tar")], targets))
    assert len(samples) == 3 and isinstance(samples[0]["pyd"], bytes) and not marker.exists()
    pickle.loads(payload)  # the trap is live: unpickling it does run code
    assert marker.exists()


def test_missing_extras_name_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "webdataset", None)
    with pytest.raises(ImportError, match=r'pip install "accelerate-ssl\[webdataset\]"'):
        open_stream(f"wds:{tmp_path}/a.tar")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r'pip install "accelerate-ssl\[hf\]"'):
        open_stream(f"hf:{tmp_path}")


def test_streams_are_refused_where_rows_are_by_position_with_the_fix(stream, prior):
    from accelerate_ssl import precompute_targets

    root, urls, spec, targets = stream
    loader = torch.utils.data.DataLoader(wds.WebDataset(urls, shardshuffle=False), batch_size=2)
    with pytest.raises(TypeError, match=r"ride in the batch.*rela.wrap\(loss, targets=batch_targets\)"):
        ReLA(targets, torch.nn.Linear(2, 2), dataloader=loader)
    net = torch.nn.Linear(4, 8)
    rela = ReLA(targets, net, feature_dim=8, total_steps=1)
    net(torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"these targets are sidecars of streamed data.*wrap\(targets=\)"):
        rela.wrap(torch.zeros((), requires_grad=True), keys=["a", "b"])
    with pytest.raises(TypeError, match=r"precompute_sidecars"):
        precompute_targets(prior, datasets.Dataset.from_dict({"image": [image_of(0)]}), root / "x")
    from accelerate_ssl.data.spec import open_data

    with pytest.raises(ValueError, match="streamed data set"):
        open_data(spec)


# ------------------------------------------------------------------------------------------------ compact rows, views
def test_float16_and_pca_at_write_sidecars(stream, prior, tmp_path):
    root, urls, spec, full = stream
    raw = full[np.arange(len(full))]
    half = precompute_sidecars(prior, spec, tmp_path / "h", batch_size=4, dtype="float16", progress=False)
    assert torch.equal(half[np.arange(len(half))], raw.half().float())
    assert half.metadata["bytes_per_sample"] < 0.6 * full.metadata["bytes_per_sample"]
    k = 4
    red = precompute_sidecars(prior, spec, tmp_path / "p", batch_size=4, components=k, progress=False)
    expected = full.pca(k).transform(raw)
    assert red.dim == k and torch.allclose(red[np.arange(len(red))], expected, atol=1e-4)
    assert torch.allclose(red.pca(2).transform(red[np.arange(3)]), expected[:3, :2], atol=1e-4)
    backbone = torch.nn.Linear(SIZE * SIZE, 8)
    rela = ReLA(str(tmp_path / "p"), backbone, feature_dim=8, total_steps=1)  # a sidecar folder by path
    assert isinstance(rela.store, ShardedTargets) and rela.store.identity() == red.identity()
    x = torch.from_numpy(np.stack([image_of(n) for n in range(4)])).float().reshape(4, -1) / 255
    assert torch.isfinite(rela.wrap(backbone(x).sum() * 0, targets=red.carried(red[np.arange(4)])))
    with pytest.raises(ValueError, match="dim 256 but the targets ReLA was opened on have dim 4"):
        backbone(x)
        rela.wrap(torch.zeros(()), targets=raw[:4])


def test_stored_views_are_replayed_with_their_own_rows(tmp_path, prior):
    from PIL import Image

    from accelerate_ssl import StoredViews

    urls = write_shards(tmp_path / "d", (6, 5))
    views = StoredViews(k=3, seed=1)
    targets = precompute_sidecars(prior, f"wds:{tmp_path}/d/*.tar", tmp_path / "s", views=views, progress=False)
    assert len(targets) == 33 and targets.views == views
    picked = set()
    for s in joined(urls, targets, view="random"):
        n, v = int(s["__key__"][1:]), s["view"]
        picked.add(v)
        expect = apply_view(Image.fromarray(image_of(n)), views.params(key_index(s["__key__"]), v, SIZE, SIZE))
        assert np.array_equal(np.array(s["png"]), np.array(expect))
        assert torch.allclose(s["target"][:-1], own(prior, as_tensor(expect)[None])[0], atol=1e-5)
        assert torch.equal(s["target"], targets.carried(targets[np.array([n * 3 + v])][0]))
    assert picked == {0, 1, 2}


def test_store_verify_checks_every_sidecar_checksum(stream, tmp_path, capsys):
    import shutil

    from accelerate_ssl.cli import main

    root, urls, spec, targets = stream
    shutil.copytree(root / "sidecars", tmp_path / "c")
    assert main(["store", "verify", str(tmp_path / "c"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shards"] == 3
    file = tmp_path / "c" / "shard-000001.tar.safetensors"
    data = bytearray(file.read_bytes())
    data[-1] ^= 1  # one flipped bit in the data: same size, so only the checksum sees it
    file.write_bytes(bytes(data))
    assert main(["store", "verify", str(tmp_path / "c"), "--json"]) == 1
    assert "the sidecar of shard 'shard-000001.tar' changed on disk" in capsys.readouterr().out


def test_a_checkpoint_names_its_sidecars_and_refuses_others(stream, prior, tmp_path):
    root, urls, spec, full = stream
    half = precompute_sidecars(prior, spec, tmp_path / "h", batch_size=4, dtype="float16", progress=False)
    state = ReLA(full, torch.nn.Linear(4, 8), feature_dim=8, total_steps=1).state_dict()
    assert state["store"]["dataset_sha256"] == half.identity()["dataset_sha256"]  # same keys, other rows
    ReLA(ShardedTargets.open(root / "sidecars"), torch.nn.Linear(4, 8), feature_dim=8, total_steps=1).load_state_dict(state)
    with pytest.raises(ValueError, match="trained on another target store"):
        ReLA(half, torch.nn.Linear(4, 8), feature_dim=8, total_steps=1).load_state_dict(state)


# ------------------------------------------------------------------------------------------------ datasets by content
def image_folder_dataset(root: Path, numbers) -> "datasets.Dataset":
    """What ``load_dataset("imagefolder")`` gives for a folder of class sub-folders: images stored as paths, a label
    column, no id column."""
    from PIL import Image

    for n in numbers:
        folder = root / "imgs" / ("even" if n % 2 == 0 else "odd")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image_of(n)).save(folder / f"{n:03d}.png")
    return datasets.load_dataset("imagefolder", data_dir=str(root / "imgs"), split="train", cache_dir=str(root / "cache"))


@pytest.fixture(scope="module")
def imagefolder(tmp_path_factory, prior):
    root = tmp_path_factory.mktemp("imagefolder")
    ds = image_folder_dataset(root, range(24))
    targets = precompute_sidecars(prior, open_stream(ds, shard_rows=10), root / "side", batch_size=4, progress=False)
    return root, ds, targets


def own_rows(targets, dataset, prior) -> list[int]:
    """Every row of a data set with a target column holds the prior's output for that row's image, and the folder's
    tag; returns the image numbers in row order."""
    rows = dataset.with_format("torch")[:]
    x = rows["image"].reshape(-1, 1, SIZE, SIZE)
    assert torch.allclose(rows["target"][:, : targets.dim], own(prior, x), atol=1e-5)
    assert rows["target"].shape[1] == targets.dim + 1 and (rows["target"][:, -1] == targets.tag).all()
    return number_of(x).tolist()


@pytest.mark.parametrize("how", ["as it is", "shuffled", "sorted", "selected in reverse", "filtered", "shuffled, saved"])
def test_a_datasets_column_follows_any_row_order_by_each_rows_image(imagefolder, prior, tmp_path, how):
    root, ds, targets = imagefolder
    changed = {"as it is": lambda d: d,
               "shuffled": lambda d: d.shuffle(seed=0),
               "sorted": lambda d: d.sort("label", reverse=True),
               "selected in reverse": lambda d: d.select(range(len(d) - 1, -1, -1)),
               "filtered": lambda d: d.filter(lambda r, i: i % 3 != 0, with_indices=True),
               "shuffled, saved": lambda d: (d.shuffle(seed=1).save_to_disk(str(tmp_path / "s")),
                                             datasets.load_from_disk(str(tmp_path / "s")))[1]}[how](ds)
    expected = number_of(torch.from_numpy(np.stack([np.array(im) for im in changed["image"]]))[:, None]).tolist()
    assert how in ("as it is", "filtered") or expected != sorted(expected)  # the order really changed
    assert own_rows(targets, targets.column(changed), prior) == expected


def test_a_datasets_column_refuses_another_data_set_swapped_or_changed_images(imagefolder, prior, tmp_path):
    from PIL import Image

    root, ds, targets = imagefolder
    other = image_folder_dataset(tmp_path / "other", range(100, 124))  # same length, other images
    with pytest.raises(SidecarError, match=r"row 0 of the data set: its image is not one the sidecars at .* were "
                                           r"computed from \(24 of 24 rows are not\): another data set"):
        targets.column(other)
    with pytest.raises(SidecarError, match=r"keyed by row number \(no --key-field\) at precompute; pass key_column=None"):
        targets.column(ds, key_column="label")
    # an id column: rows found by id, and each one's image checked
    images = [Image.fromarray(image_of(n)) for n in range(12)]
    ids = [f"img{n:03d}" for n in range(12)]
    features = datasets.Features({"image": datasets.Image(), "id": datasets.Value("string")})
    keyed = datasets.Dataset.from_dict({"image": images, "id": ids}, features=features)
    by_id = precompute_sidecars(prior, open_stream(keyed, key_field="id", shard_rows=5), tmp_path / "id", progress=False)
    shuffled = keyed.shuffle(seed=0)
    numbers = own_rows(by_id, by_id.column(shuffled), prior)
    assert [f"img{n:03d}" for n in numbers] == list(shuffled["id"][:]) and numbers != sorted(numbers)
    swapped = datasets.Dataset.from_dict({"image": [images[i] for i in (0, 1, 2, 5, 4, 3, *range(6, 12))], "id": ids},
                                         features=features)
    with pytest.raises(SidecarError, match=r"row 3 of the data set \(id 'img003'\): its image is not the one its target "
                                           r"was computed from; it is the image of id 'img005' \(images and ids swapped\); "
                                           r"2 row\(s\) differ"):
        by_id.column(swapped)
    changed = datasets.Dataset.from_dict({"image": [*images[:7], Image.fromarray(image_of(500)), *images[8:]], "id": ids},
                                         features=features)
    with pytest.raises(SidecarError, match=r"row 7 of the data set \(id 'img007'\): its image is not the one its target "
                                           r"was computed from \(the image changed since the precompute\)"):
        by_id.column(changed)
    with pytest.raises(SidecarError, match=r"row 0 of the data set has id 'new', which no row of the sidecars"):
        by_id.column(datasets.Dataset.from_dict({"image": images[:1], "id": ["new"]}, features=features))


def test_folders_written_before_datasets_rows_had_digests_are_refused_with_the_rebuild_command(imagefolder, tmp_path,
                                                                                               stream):
    import shutil

    from accelerate_ssl.cli import main

    root, ds, targets = imagefolder
    shutil.copytree(root / "side", tmp_path / "old")
    meta = json.loads((tmp_path / "old" / "sidecars.json").read_text())
    meta["format_version"] = 1  # what an older accelerate-ssl wrote (its datasets rows recorded digest 0)
    (tmp_path / "old" / "sidecars.json").write_text(json.dumps(meta))
    old = ShardedTargets.open(tmp_path / "old")
    with pytest.raises(SidecarError, match=r"recorded no image digest for datasets rows, so column\(\) cannot check .* "
                                           r"Recompute it: `rm -r .*`, then `precompute_sidecars\("):
        old.column(ds)
    with pytest.raises(SidecarError, match=r"so store verify --data cannot check"):
        old.verify_stream(ds)
    wds_root, urls, spec, wds_targets = stream
    with pytest.raises(SidecarError, match=r"computed on wds: shards; column\(\) attaches .*compose\(targets.join\(\)"):
        wds_targets.column(ds)


# ------------------------------------------------------------------------------------------------ sidecars read whole
def _rewrite_sidecar(file: Path, targets: torch.Tensor) -> None:
    """Rewrite one sidecar with other rows of the same shape, its keys, digests and metadata unchanged."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(file), framework="pt") as f:
        meta, digests = f.metadata(), f.get_tensor("digests")
    size = file.stat().st_size
    save_file({"targets": targets.contiguous(), "digests": digests}, str(file), metadata=meta)
    assert file.stat().st_size == size


def test_a_sidecar_changed_in_place_with_its_size_kept_is_refused_when_read(tmp_path, prior):
    import shutil

    from safetensors.torch import load_file

    urls = write_shards(tmp_path / "d", (6, 6, 5))
    spec = f"wds:{tmp_path}/d/*.tar"
    precompute_sidecars(prior, spec, tmp_path / "s", batch_size=4, progress=False)
    # two shards' rows swapped inside their files, keys and digests intact
    shutil.copytree(tmp_path / "s", tmp_path / "swapped")
    a, b = (tmp_path / "swapped" / f"shard-00000{i}.tar.safetensors" for i in (0, 1))
    rows_a, rows_b = load_file(str(a))["targets"], load_file(str(b))["targets"]
    _rewrite_sidecar(a, rows_b)
    _rewrite_sidecar(b, rows_a)
    swapped = ShardedTargets.open(tmp_path / "swapped")  # every file there with its recorded size
    with pytest.raises(SidecarError, match=r"the sidecar of shard 'shard-000000.tar' changed on disk since it was "
                                           r"written \(shard-000000.tar.safetensors: its sha256 is [0-9a-f]{16}\.\.\., "
                                           r"sidecars.json recorded [0-9a-f]{16}\.\.\.: bytes overwritten, or rows of "
                                           r"another shard copied in\)"):
        next(iter(joined(urls, swapped)))
    with pytest.raises(SidecarError, match="changed on disk"):
        swapped[np.arange(3)]
    with pytest.raises(SidecarError, match="changed on disk"):
        ReLA(str(tmp_path / "swapped"), torch.nn.Linear(SIZE * SIZE, 8), feature_dim=8, total_steps=1)  # its PCA fit
    # bytes overwritten in the middle of the rows
    shutil.copytree(tmp_path / "s", tmp_path / "flipped")
    c = tmp_path / "flipped" / "shard-000002.tar.safetensors"
    data = bytearray(c.read_bytes())
    data[len(data) - 100] ^= 0x40
    c.write_bytes(bytes(data))
    flipped = ShardedTargets.open(tmp_path / "flipped")
    got = []
    with pytest.raises(SidecarError, match=r"the sidecar of shard 'shard-000002.tar' changed on disk"):
        for s in joined(urls, flipped):
            got.append(s)
    assert [s["__key__"] for s in got] == [f"k{i:05d}" for i in range(12)]  # the intact shards' samples only
    intact = ShardedTargets.open(tmp_path / "s")
    for s in got:
        assert torch.equal(s["target"], intact.carried(intact[np.array([int(s["__key__"][1:])])][0]))


def test_store_verify_data_checks_a_sidecar_folder_against_its_stream(stream, imagefolder, tmp_path, capsys):
    from PIL import Image

    from accelerate_ssl.cli import main

    root, urls, spec, targets = stream

    def verify(*args):
        code = main(["store", "verify", *map(str, args), "--json", "--no-progress"])
        return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    bad = [
        ([(f"k{i:05d}", i if i != 12 else 500) for i in range(10, 17)],
         "shard 'shard-000001.tar': the image of key 'k00012' is not the one its target was computed from"),
        ([(f"k{i:05d}", i) for i in (10, 11, 13, 12, 14, 15, 16)],
         "shard 'shard-000001.tar': sample 2 has key 'k00013' but the sidecar's row 2 is for key 'k00012'"),
        ([(f"k{i:05d}", i) for i in range(10, 15)],
         "data shard 'shard-000001.tar' ended after 5 samples but its sidecar holds 7"),
    ]
    for n, (entries, message) in enumerate(bad):
        data = tmp_path / f"bad{n}"
        for u in (urls[0], urls[2]):
            (data / Path(u).name).parent.mkdir(parents=True, exist_ok=True)
            (data / Path(u).name).write_bytes(Path(u).read_bytes())
        write_shard(data / "shard-000001.tar", entries)
        code, out = verify(root / "sidecars", "--data", f"wds:{data}/shard-{{000000..000002}}.tar")
        assert code == 1 and message in out["error"], out
    code, out = verify(root / "sidecars", "--data", spec)
    assert code == 0 and out["samples_checked"] == 26 and out["ok"]
    code, out = verify(root / "sidecars", "--data", f"wds:{root}/data/shard-{{000000..000001}}.tar")
    assert code == 1 and "the stream lacks shard 'shard-000002.tar'" in out["error"]
    code, out = verify(root / "sidecars", "--data", "digits")
    assert code == 1 and "--data digits is not a stream" in out["error"]
    code, out = verify(root / "sidecars", "--data", spec, "--limit", "3")
    assert code == 1 and "--limit select items of a map-style data set" in out["error"]
    # datasets: the folder saved to disk, then the same rows with two images swapped
    hf_root, ds, hf_targets = imagefolder
    ds.save_to_disk(str(tmp_path / "hf"))
    side = tmp_path / "hf-side"
    precompute_sidecars(create_prior("random:convnet", in_channels=1), f"hf:{tmp_path / 'hf'}", side, progress=False)
    code, out = verify(side, "--data", f"hf:{tmp_path / 'hf'}")
    assert code == 0
    images = [Image.open(io.BytesIO(open(c["path"], "rb").read())) for c in ds.cast_column("image", datasets.Image(decode=False))["image"]]
    images[3], images[4] = images[4], images[3]
    datasets.Dataset.from_dict({"image": images, "label": ds["label"][:]},
                               features=ds.features).save_to_disk(str(tmp_path / "hf2"))
    code, out = verify(side, "--data", f"hf:{tmp_path / 'hf2'}")
    assert code == 1 and "shard 'rows-000000000-000000024': the image of key '3' is not the one its target" in out["error"]
    code, out = verify(side, "--data", f"hf:{tmp_path / 'hf'}")
    assert code == 0 and out["samples_checked"] == 24
    code, out = verify(side, "--data", spec)
    assert code == 1 and "computed on hf: data" in out["error"]


# ------------------------------------------------------------------------------------------------ rows carry their folder
def test_wrap_refuses_rows_of_another_priors_sidecars_reduced_to_the_same_width(stream, prior, tmp_path):
    root, urls, spec, _ = stream
    mine = precompute_sidecars(prior, spec, tmp_path / "mine", batch_size=4, components=4, progress=False)
    other_prior = create_prior("random:convnet", in_channels=1, seed=7).eval()
    other = precompute_sidecars(other_prior, spec, tmp_path / "other", batch_size=4, components=4, progress=False)
    assert mine.dim == other.dim == 4

    def batches(targets, **loader):  # the README's pipeline, through DataLoader workers and the default collate
        data = (wds.WebDataset(urls, shardshuffle=False, empty_check=False).compose(targets.join())
                .map(decode_images()).map_dict(png=as_tensor).to_tuple("png", "target", "__key__"))
        return torch.utils.data.DataLoader(data, batch_size=5, **loader)

    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(SIZE * SIZE, 16))
    rela = ReLA(mine, backbone, feature_dim=16, n_components=4, total_steps=20)
    for x, t, keys in batches(mine, num_workers=1):
        rows = torch.tensor([int(k[1:]) for k in keys])  # key k<n> is global row n
        assert torch.equal(rela.targets.reduce_rows(t, "cpu"), rela.targets(rows, "cpu"))  # the tag dropped, nothing else
        assert torch.isfinite(rela.wrap(backbone(x.float() / 255).pow(2).mean(), targets=t))
    x, t, _ = next(iter(batches(other, num_workers=1)))
    backbone(x.float() / 255)
    with pytest.raises(SidecarError, match=r"ReLA.wrap\(targets=\): 5 of 5 rows of this batch come from the sidecar "
                                           rf"targets '{re.escape(str(tmp_path / 'other'))}' \(prior random:convnet\), but ReLA was opened on "
                                           rf"'{re.escape(str(tmp_path / 'mine'))}' \(prior random:convnet\) \(tag \d+\)"):
        rela.wrap(torch.zeros(()), targets=t)
    assert mine.tag != other.tag
    x, t, _ = next(iter(batches(mine)))
    for bad, message in [(t[:, :-1], r"the rows have 4 columns, .* without the tag column that targets.join\(\) and "
                                     r"targets.column\(\) add"),
                         (t.half(), r"the rows are torch.float16, which cannot hold the tag column"),
                         (torch.cat([t[:3], next(iter(batches(other)))[1][:2]]), r"2 of 5 rows of this batch come from")]:
        backbone(x.float() / 255)
        with pytest.raises(SidecarError, match=message):
            rela.wrap(torch.zeros(()), targets=bad)


def test_wrap_refuses_a_datasets_column_of_another_folder(imagefolder, prior, tmp_path):
    root, ds, targets = imagefolder
    other = precompute_sidecars(create_prior("random:convnet", in_channels=1, seed=3), open_stream(ds, shard_rows=10),
                                tmp_path / "other", batch_size=4, progress=False)
    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(SIZE * SIZE, 16))
    rela = ReLA(targets, backbone, feature_dim=16, total_steps=10)
    for column, ok in ((targets.column(ds), True), (other.column(ds), False)):
        loader = torch.utils.data.DataLoader(column.with_format("torch"), batch_size=6, shuffle=True, num_workers=1)
        batch = next(iter(loader))
        backbone(batch["image"].reshape(-1, 1, SIZE, SIZE).float() / 255)
        if ok:
            assert torch.isfinite(rela.wrap(torch.zeros(()), targets=batch["target"]))
        else:
            with pytest.raises(SidecarError, match=rf"6 of 6 rows of this batch come from the sidecar targets "
                                                   rf"'{re.escape(str(tmp_path / 'other'))}'"):
                rela.wrap(torch.zeros(()), targets=batch["target"])


# ------------------------------------------------------------------------------------------------ the README's recipes
RECIPES = ROOT / "tests" / "recipes"
N_REAL = 30


@pytest.fixture(scope="module")
def fmnist(fashion_mnist_available):
    """30 real Fashion-MNIST images (uint8 [30, 28, 28]), their labels, and the shipped prior's output for each."""
    from accelerate_ssl.data import FashionMNIST

    data = FashionMNIST("train", limit=N_REAL)
    images = data.data.numpy()
    prior = create_prior("shipped:digits-byol").eval()
    return images, data.targets.numpy(), own(prior, torch.from_numpy(images)[:, None])


def _assert_own_rows(seen, expected, targets) -> None:
    """Every row a batch carried is the prior's output for that batch's own image, tagged with its folder."""
    assert seen
    for numbers, rows in seen:
        numbers = torch.as_tensor(numbers)
        assert torch.allclose(rows[:, :-1], expected[numbers], atol=1e-5)
        assert (rows[:, -1] == targets.tag).all()


def _run_recipe(name: str) -> dict:
    import runpy

    return runpy.run_path(str(RECIPES / name), run_name="__main__")


def test_the_webdataset_recipe_is_four_added_and_four_changed_lines():
    assert check_recipe(RECIPES / "webdataset_loop.py", "A WebDataset loop", HOSTS / "webdataset.md") == (4, 4)


def test_the_datasets_recipes_are_three_added_and_two_or_three_changed_lines():
    assert check_recipe(RECIPES / "hf_datasets.py", "A Hugging Face `datasets` loop over a data set with an id column",
                        HOSTS / "hf-datasets.md") == (3, 2)
    assert check_recipe(RECIPES / "hf_imagefolder.py", "Without an id column", HOSTS / "hf-datasets.md") == (3, 3)


def test_the_webdataset_recipe_runs_as_written(fmnist, tmp_path, monkeypatch):
    """The README's precompute command and loop, as written, over 3 shards of real images read by 2 loader workers:
    every row a batch carries is the prior's output for that batch's own image; lambda is planned for the run."""
    from accelerate_ssl.cli import main

    images, _, expected = fmnist
    for s in range(3):
        (tmp_path / "shards").mkdir(exist_ok=True)
        with tarfile.open(tmp_path / "shards" / f"train-{s:06d}.tar", "w") as tar:
            for n in range(10 * s, 10 * s + 10):
                for ext, data in (("png", png(images[n])), ("cls", str(n).encode())):
                    info = tarfile.TarInfo(f"s{n:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    monkeypatch.chdir(tmp_path)
    command = page_command("A WebDataset loop", HOSTS / "webdataset.md")
    assert command[:2] == ["accelerate-ssl", "precompute"]
    assert main(command[1:] + ["--no-progress"]) == 0
    run = _run_recipe("webdataset_loop.py")
    _assert_own_rows(run["seen"], expected, run["targets"])
    assert sorted(n for numbers, _ in run["seen"] for n in numbers.tolist()) == sorted(list(range(N_REAL)) * 2)
    # 2 workers: shards 0 and 2 (20 samples: 3 batches of 8) and shard 1 (10: 2 batches) each pass; planned 7
    assert run["rela"].steps == len(run["seen"]) == 2 * 5  # planned: 2 * 30 // 8 = 7, a plan, not a limit


def test_the_datasets_recipe_with_an_id_column_runs_as_written(fmnist, tmp_path, monkeypatch):
    from PIL import Image

    from accelerate_ssl.cli import main

    images, labels, expected = fmnist
    ds = datasets.Dataset.from_dict({"image": [Image.fromarray(a) for a in images], "id": [f"img{n:03d}" for n in range(N_REAL)],
                                     "label": labels.tolist()},
                                    features=datasets.Features({"image": datasets.Image(), "id": datasets.Value("string"),
                                                                "label": datasets.Value("int64")}))
    ds.shuffle(seed=0).save_to_disk(str(tmp_path / "data" / "train"))  # rows in another order than the numbers
    monkeypatch.chdir(tmp_path)
    command = page_command("A Hugging Face `datasets` loop over a data set with an id column", HOSTS / "hf-datasets.md")
    assert main(command[1:] + ["--no-progress"]) == 0
    run = _run_recipe("hf_datasets.py")
    seen = [([int(i[3:]) for i in ids], rows) for ids, rows in run["seen"]]
    _assert_own_rows(seen, expected, run["targets"])
    assert sorted(n for numbers, _ in seen for n in numbers) == sorted(list(range(N_REAL)) * 2)
    assert run["rela"].steps == 2 * 4


def test_the_datasets_recipe_without_an_id_column_runs_as_written(fmnist, tmp_path, monkeypatch):
    """load_dataset("imagefolder") has no id column: precompute keys the rows by row number and column() finds every
    row by its image; the loop's rows are each image's own."""
    from PIL import Image

    images, labels, expected = fmnist
    for n in range(N_REAL):
        folder = tmp_path / "images" / f"class{labels[n]}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[n]).save(folder / f"img_{n:03d}.png")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.chdir(tmp_path)
    run = _run_recipe("hf_imagefolder.py")
    _assert_own_rows(run["seen"], expected, run["targets"])
    assert sorted(n for numbers, _ in run["seen"] for n in numbers) == sorted(list(range(N_REAL)) * 2)
    assert run["rela"].steps == 2 * 4
    assert run["targets"].metadata["settings"]["data"].get("key_field") is None  # keyed by row number


def test_a_datasets_column_of_array_images_gives_each_row_its_own_target(prior, tmp_path):
    """Values pinned for images held as arrays (an Array3D column, read by the user with_format("numpy")): each row of
    a shuffled copy gets the prior's output for its own image. A digest of array cells that stopped telling images
    apart would give every row one row's target and pass every shape check."""
    from accelerate_ssl.data.streams import hf_content

    images = (np.stack([image_of(n) for n in range(20)])[..., None] / 255).astype(np.float32)
    features = datasets.Features({"image": datasets.Array3D(shape=(SIZE, SIZE, 1), dtype="float32"),
                                  "label": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"image": images, "label": list(range(20))}, features=features)
    cell = ds.with_format("arrow")[3:4].column("image").to_pylist()[0]
    assert hf_content(cell) == f"<f8{(SIZE, SIZE, 1)}".encode() + images[3].astype(np.float64).tobytes()
    targets = precompute_sidecars(prior, open_stream(ds.with_format("numpy"), shard_rows=7), tmp_path / "side",
                                  batch_size=4, progress=False)
    for user_format in ("numpy", None):
        shuffled = ds.shuffle(seed=0).with_format(user_format)
        rows = targets.column(shuffled).with_format("torch")[:]
        assert rows["label"].tolist() != list(range(20))  # the order really changed
        assert torch.allclose(rows["target"][:, : targets.dim], own(prior, rows["image"].permute(0, 3, 1, 2)), atol=1e-5)


@pytest.mark.parametrize("feature", ["Array3D", "Array2D", "nested lists"])
def test_uint8_pixel_columns_read_as_stored_give_each_row_its_own_target(prior, tmp_path, feature):
    """A data set whose uint8 pixels are an array column, passed as loaded (no with_format): datasets hands such a cell
    out as nested Python lists, and its numpy format widens uint8 to int64 (read as 0..255 floats and refused). The
    stream reads the column as numpy in its own dtype, so each row gets the prior's output for its own image."""
    images = np.stack([image_of(n) for n in range(12)])
    column, kind = {"Array3D": (images[..., None], datasets.Array3D(shape=(SIZE, SIZE, 1), dtype="uint8")),
                    "Array2D": (images, datasets.Array2D(shape=(SIZE, SIZE), dtype="uint8")),
                    "nested lists": (images, datasets.Sequence(datasets.Sequence(datasets.Value("uint8"))))}[feature]
    features = datasets.Features({"image": kind, "label": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"image": list(column), "label": list(range(12))}, features=features)
    assert isinstance(ds[0]["image"], list)  # what a reader of the cells gets without the fix
    ds.save_to_disk(str(tmp_path / "pixels"))
    targets = precompute_sidecars(prior, open_stream(f"hf:{tmp_path / 'pixels'}", shard_rows=5), tmp_path / "side",
                                  batch_size=4, progress=False)
    rows = targets.column(ds.shuffle(seed=1)).with_format("torch")[:]
    assert rows["label"].tolist() != list(range(12))
    expected = own(prior, torch.from_numpy(images[rows["label"].numpy()])[:, None])
    assert torch.allclose(rows["target"][:, : targets.dim], expected, atol=1e-5)
