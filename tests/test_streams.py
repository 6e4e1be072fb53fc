"""Streamed data (WebDataset shards, Hugging Face datasets): sidecar precompute, the key join, the loops of the README.

Image n encodes n in its first pixels; each check compares a target row with the prior's own output for the image
actually in the batch (computed here, not read from a sidecar)."""

from __future__ import annotations

import io
import json
import os
import pickle
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
from processes import cpu_process_env  # noqa: E402

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
    root = tmp_path_factory.mktemp("wds")
    urls = write_shards(root / "data")
    spec = f"wds:{root}/data/shard-{{000000..000002}}.tar"
    targets = precompute_sidecars(prior, spec, root / "sidecars", batch_size=4, progress=False)
    return root, urls, spec, targets


def joined(urls, targets, **kw):
    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False).compose(targets.join(**kw))
    return ds.map(decode_images())


# ------------------------------------------------------------------------------------------------ the loops
def test_a_webdataset_loop_trains_with_sidecar_targets_each_row_its_samples_own(stream, prior):
    root, urls, spec, _ = stream
    # the README's lines
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
            assert torch.allclose(t, own(prior, x), atol=1e-5)  # every row is the prior's output for that image
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
    # the README's lines
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
        assert torch.allclose(batch["target"], own(prior, x), atol=1e-5)
        assert [f"img{n:03d}" for n in number_of(x).tolist()] == list(batch["id"])
        seen += number_of(x).tolist()
        loss = rela.wrap(backbone(x.float() / 255).pow(2).mean(), targets=batch["target"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert sorted(seen) == list(range(23)) and rela.steps == 6
    swapped = ds.select([1, 0, *range(2, 23)])  # another row order: refused by key, not joined by position
    with pytest.raises(SidecarError, match=r"shard 'rows-000000000-000000010': sample 0 has key 'img001' but the "
                                           r"sidecar's row 0 is for key 'img000'"):
        targets.column(swapped, key_column="id")


# ------------------------------------------------------------------------------------------------ sharding, resuming
def test_two_processes_write_every_shard_once_identical_to_one(stream, tmp_path):
    root, urls, spec, one = stream
    env = cpu_process_env(PYTHONPATH=str(ROOT))
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "accelerate_ssl.cli",
           "precompute", "--prior", "random:convnet", "--data", spec, "--out", str(tmp_path / "two"),
           "--batch-size", "4", "--no-progress"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    meta = json.loads((tmp_path / "two" / "sidecars.json").read_text())
    assert meta["num_processes"] == 2 and [s["shard"] for s in meta["shards"]] == one.shards  # 3 shards on 2 ranks
    for name in one.shards:
        assert (tmp_path / "two" / f"{name}.safetensors").read_bytes() == (root / "sidecars" / f"{name}.safetensors").read_bytes()


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


# ------------------------------------------------------------------------------------------------ bad inputs
def _drain(urls, targets):
    """Samples the join yields before it stops; each must carry its own row."""
    got = []
    with pytest.raises(SidecarError) as err:
        for s in joined(urls, targets):
            got.append(s)
    full = targets[np.arange(len(targets))]
    for s in got:
        assert torch.equal(s["target"], full[int(s["__key__"][1:])])  # key k<n> is global row n
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
    assert torch.isfinite(rela.wrap(backbone(x).sum() * 0, targets=red[np.arange(4)]))
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
        assert torch.allclose(s["target"], own(prior, as_tensor(expect)[None])[0], atol=1e-5)
        assert torch.equal(s["target"], targets[np.array([n * 3 + v])][0])
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
