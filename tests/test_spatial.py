"""Spatial target stores: the prior's feature map per item, reduced at write (precompute_targets(spatial=)), with every
check a store of pooled rows has."""

import json

import numpy as np
import pytest
import torch

import accelerate_ssl.targets.precompute as pc
from _precompute_worker import tiny_dataset
from accelerate_ssl.cli import main
from accelerate_ssl.priors import create_prior
from accelerate_ssl.priors.registry import feature_map_of
from accelerate_ssl.targets.format import TargetStoreCorruptError, TargetStoreIncompleteError
from accelerate_ssl.targets.pca import TargetPCA
from accelerate_ssl.targets.store import TargetStore

N, CHUNK, BATCH = 40, 16, 8


pytestmark = pytest.mark.usefixtures("cpu_one_thread")


def _run(path, n=N, prior=None, **kwargs):
    kwargs = {"batch_size": BATCH, "chunk_size": CHUNK, "progress": False, **kwargs}
    return pc.precompute_targets(prior or create_prior("random:convnet"), tiny_dataset(n), path, **kwargs)


def _live_maps(n=N):
    """The prior's maps of the tiny data set's items, channels last, computed here without precompute."""
    prior = create_prior("random:convnet")
    data = tiny_dataset(n)
    pre = prior.preprocess.with_stats(list(data.mean), list(data.std), "dataset")
    x = pre.batch(torch.stack([torch.tensor(np.asarray(data[i][0]))[None] for i in range(n)]))
    with torch.inference_mode():
        return prior.feature_map(x).permute(0, 2, 3, 1), prior(x)


def test_feature_maps_of_the_supported_priors_pool_to_their_rows():
    convnet = create_prior("shipped:fashion-mnist-byol-20k")
    x = convnet.preprocess.batch(torch.rand(2, 1, 28, 28))
    fmap = convnet.feature_map(x)
    assert fmap.shape == (2, 128, 3, 3) and convnet.map_stride == 8  # three 2x2 average pools
    torch.testing.assert_close(fmap.mean((2, 3)), convnet(x), rtol=0, atol=1e-6)  # the map its rows are the mean of
    resnet = create_prior("random:resnet18")
    x = resnet.preprocess.batch(torch.rand(2, 3, 64, 64))
    assert resnet.feature_map(x).shape == (2, 512, 2, 2) and resnet.map_stride == 32
    torch.testing.assert_close(resnet.feature_map(x).mean((2, 3)), resnet(x), rtol=0, atol=1e-5)
    timm = pytest.importorskip("timm")
    vit = timm.create_model("vit_small_patch14_dinov2", pretrained=False, num_classes=0, img_size=42)
    x = torch.randn(2, 3, 42, 42)
    fmap, stride = feature_map_of(vit, x)
    tokens = vit.forward_features(x)
    assert fmap.shape == (2, 384, 3, 3) and stride == 14
    # patch token (row r, column c) is token prefix + 3 r + c: the class token is dropped, the grid is row-major
    torch.testing.assert_close(fmap[:, :, 1, 2], tokens[:, vit.num_prefix_tokens + 3 * 1 + 2])
    with pytest.raises(ValueError, match="gives no feature map.*timm models"):
        feature_map_of(torch.nn.Linear(3, 3), None)


def test_a_full_map_store_holds_the_priors_maps_and_its_rows_are_their_means(tmp_path):
    store = _run(tmp_path / "s", spatial=True)
    maps, rows = _live_maps()
    meta = store.metadata["spatial"]
    assert meta["grid"] == [2, 2] and meta["stride"] == 8 and meta["input_size"] == [16, 16]
    assert meta["channels"] == meta["source_channels"] == 256 and meta["reduction"] == "none"
    assert store.array.shape == (N, 2 * 2 * 256) and store.dim == 256 and store.metadata["dim"] == 1024
    torch.testing.assert_close(store.maps(np.arange(N)), maps.permute(0, 3, 1, 2), rtol=0, atol=1e-5)
    torch.testing.assert_close(store[np.arange(N)], rows, rtol=0, atol=1e-5)  # the whole-image target
    assert store.maps(3).shape == (256, 2, 2) and store[3].shape == (256,)
    assert store.identity()["spatial"]["grid"] == [2, 2]


def test_a_reduced_store_writes_each_location_through_the_pca_fitted_before_the_chunks(tmp_path):
    store = _run(tmp_path / "s", spatial=6, dtype="float16")
    maps, _ = _live_maps()
    pca = store.written_pca()
    assert isinstance(pca, TargetPCA) and pca.dim == 256 and pca.n_components == 6 and pca.standardize
    assert store.components == 6 and store.dim == 6 and store.array.dtype == np.float16
    assert store.array.nbytes // N == 2 * 2 * 6 * 2  # 4 locations x 6 components x 2 bytes
    assert store.metadata["spatial"]["fit_images"] == N and store.metadata["dtype"] == "float16"
    expected = pca.transform(maps.reshape(-1, 256)).reshape(N, 2, 2, 6).permute(0, 3, 1, 2)
    torch.testing.assert_close(store.maps(np.arange(N)), expected, rtol=2e-3, atol=2e-3)  # float16 rounding
    # the rows are in the PCA's space: a raw pooled map reduces to the store's row (pooling commutes with Eq. 41)
    torch.testing.assert_close(pca.transform(maps.mean((1, 2))), store[np.arange(N)], rtol=2e-3, atol=2e-3)
    again = _run(tmp_path / "s", spatial=6, dtype="float16")  # a finished store is this very computation
    assert again.metadata["file_sha256"] == store.metadata["file_sha256"]
    with pytest.raises(ValueError, match="other settings.*spatial"):
        _run(tmp_path / "s", spatial=5, dtype="float16")


def test_rows_of_many_maps_are_read_a_block_at_a_time(tmp_path, monkeypatch):
    import accelerate_ssl.targets.store as store_module

    store = _run(tmp_path / "s", spatial=True)
    everything = store[np.arange(N)]
    monkeypatch.setattr(store_module, "MAP_BLOCK_VALUES", 3 * 1024)  # 3 maps a block
    torch.testing.assert_close(store[np.arange(N)], everything, rtol=0, atol=0)
    torch.testing.assert_close(store[torch.arange(N).flip(0)], everything.flip(0), rtol=0, atol=0)
    torch.testing.assert_close(store[5:17], everything[5:17], rtol=0, atol=0)
    assert store[np.arange(6).reshape(2, 3)].shape == (2, 3, 256)
    rows = np.load(tmp_path / "s" / "targets.npy", mmap_mode="r+")
    rows[31, 2] = np.inf
    rows.flush()
    with pytest.raises(TargetStoreCorruptError, match=r"row\(s\) \[31\]"):  # named in the block that holds it
        store[np.arange(N)]


def test_global_stores_keep_their_format(tmp_path):
    store = _run(tmp_path / "g")
    assert "spatial" not in store.metadata and store.spatial is None and "spatial" not in store.identity()
    assert store.array.shape == (N, 256) and store.dim == 256
    with pytest.raises(ValueError, match="pooled rows, not feature maps.*--spatial"):
        store.maps(0)


def test_bad_arguments_are_refused_naming_the_fix(tmp_path):
    with pytest.raises(ValueError, match="spatial must be"):
        _run(tmp_path / "a", spatial=0)
    with pytest.raises(ValueError, match="pass one of them"):
        _run(tmp_path / "b", spatial=4, components=4)
    with pytest.raises(ValueError, match="256 channels.*spatial=True"):
        _run(tmp_path / "c", spatial=256)
    prior = create_prior("random:convnet")
    prior.model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(8))  # a prior without a map
    with pytest.raises(ValueError, match="random:convnet.*gives no feature map"):
        _run(tmp_path / "d", prior=prior, spatial=True)



def test_several_priors_write_spatial_stores_in_one_pass_each_as_it_would_alone(tmp_path):
    priors = {"a": create_prior("random:convnet"), "b": create_prior("random:convnet", seed=1)}
    both = _run({n: tmp_path / n for n in priors}, prior=priors, spatial=6)
    assert list(both) == ["a", "b"]
    for name, prior in priors.items():  # each its own grid and its own PCA, the same files as a run of it alone
        alone = _run(tmp_path / f"alone-{name}", prior=prior, spatial=6)
        assert both[name].metadata["file_sha256"] == alone.metadata["file_sha256"]
        grid = {k: v for k, v in both[name].spatial.items() if k != "pca_sha256"}
        assert grid == {k: v for k, v in alone.spatial.items() if k != "pca_sha256"} and grid["grid"] == [2, 2]
        # the same fit (not compared by the file's sha256: safetensors may write its header's metadata in either order)
        assert all(torch.equal(a, b) for a, b in zip(both[name].written_pca().state_dict().values(),
                                                     alone.written_pca().state_dict().values()))
    assert not torch.equal(both["a"].written_pca().components, both["b"].written_pca().components)

def test_nan_maps_are_refused_at_write_naming_the_rows(tmp_path):
    prior = create_prior("random:convnet")
    real = prior.feature_map

    def poisoned(x):
        out = real(x).clone()
        if len(x) == BATCH and poisoned.calls == 1:  # the second batch of the chunks (rows 8..15)
            out[3, 0, 1, 1] = float("nan")
        poisoned.calls += len(x) == BATCH
        return out

    poisoned.calls = 0  # (spatial=True: no PCA fit; the geometry probe is a batch of 1)
    prior.feature_map = poisoned
    with pytest.raises(ValueError, match=r"NaN/Inf features for 1 row.*indices \[11\]"):
        _run(tmp_path / "bad", prior=prior, spatial=True, n=N)


def test_integrity_checks_of_a_spatial_store(tmp_path):
    path = tmp_path / "s"
    _run(path, spatial=4)
    # the PCA the rows were written with is part of the store: replaced or lost, the store is refused
    pca_file = path / "pca" / "at-write.safetensors"
    saved = pca_file.read_bytes()
    pca_file.write_bytes(saved[:-8] + bytes(8))
    with pytest.raises(TargetStoreCorruptError, match="not the file the rows were written with"):
        TargetStore.open(path)
    pca_file.unlink()
    with pytest.raises(TargetStoreCorruptError, match="missing"):
        TargetStore.open(path)
    pca_file.write_bytes(saved)
    # metadata that disagrees with the rows' width
    meta_file = path / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta["spatial"]["grid"] = [3, 2]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(TargetStoreCorruptError, match="3x2 grid of 4 channels.*16 values"):
        TargetStore.open(path)
    meta["spatial"]["grid"] = [2, 2]
    meta_file.write_text(json.dumps(meta))
    # a changed byte of the rows: verify() names the checksum; a NaN row is refused when read
    store = TargetStore.open(path)
    rows = np.load(path / "targets.npy", mmap_mode="r+")
    rows[7, 5] = np.nan
    rows.flush()
    with pytest.raises(TargetStoreCorruptError, match="sha256"):
        store.verify()
    with pytest.raises(TargetStoreCorruptError, match=r"NaN/Inf values in row\(s\) \[7\]"):
        store.maps([6, 7])
    with pytest.raises(TargetStoreCorruptError, match=r"row\(s\) \[7\]"):
        store[[7]]
    # a half-written file
    data = (path / "targets.npy").read_bytes()
    (path / "targets.npy").write_bytes(data[: len(data) // 2])
    with pytest.raises(TargetStoreCorruptError, match="truncated"):
        TargetStore.open(path)


def test_an_interrupted_spatial_run_resumes_in_the_same_basis(tmp_path, monkeypatch):
    reference = np.array(_run(tmp_path / "reference", spatial=4).array)
    path = tmp_path / "resume"
    real_write, written = pc._write_chunk, []

    def failing_write(file, rows):
        if file.name.startswith("chunk-") and len(written) == 1:
            raise KeyboardInterrupt("simulated interruption after 1 chunk")
        real_write(file, rows)
        written.append(file.name) if file.name.startswith("chunk-") else None

    monkeypatch.setattr(pc, "_write_chunk", failing_write)
    with pytest.raises(KeyboardInterrupt):
        _run(path, spatial=4)
    with pytest.raises(TargetStoreIncompleteError, match="interrupted"):
        TargetStore.open(path)
    assert (path / "pca" / "at-write.safetensors").is_file()  # fitted before the first chunk
    fitted = (path / "pca" / "at-write.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(pc, "_write_chunk", real_write)
    store = _run(path, spatial=4)
    assert (path / "pca" / "at-write.safetensors").stat().st_mtime_ns == fitted  # the same fit, not a new one
    assert np.array_equal(np.array(store.array), reference)

    # chunks whose basis was lost are recomputed, never mixed with a new fit
    other = tmp_path / "lost"
    monkeypatch.setattr(pc, "_write_chunk", failing_write)
    written.clear()
    with pytest.raises(KeyboardInterrupt):
        _run(other, spatial=4)
    (other / "pca" / "at-write.safetensors").unlink()
    counted = []
    monkeypatch.setattr(pc, "_write_chunk", lambda file, rows: (counted.append(file.name), real_write(file, rows)))
    store = _run(other, spatial=4)
    assert "chunk-00000.npy" in counted  # recomputed in the new fit's basis (equal to float rounding: a new fit)
    np.testing.assert_allclose(np.array(store.array), reference, rtol=0, atol=1e-4)


def test_two_processes_write_the_same_spatial_store(tmp_path):
    """Under `accelerate launch` the main process fits the map's PCA, every process writes its chunks in that basis,
    and the store is the one a single process writes. (To float rounding, not byte for byte: the fit's float64 Gram
    product can round differently in another process, as BLAS kernels depend on memory alignment.)"""
    import subprocess
    import sys
    from pathlib import Path

    from processes import cpu_process_env

    worker = str(Path(__file__).with_name("_precompute_worker.py"))
    reference = _run(tmp_path / "one", n=48, spatial=4)
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
           "no", "--dynamo_backend", "no", worker, str(tmp_path / "two"), "--n", "48", "--spatial", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cpu_process_env(PYTHONUNBUFFERED="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    store = TargetStore.open(tmp_path / "two", dataset=tiny_dataset(48))
    assert store.metadata["num_processes"] == 2
    assert {k: v for k, v in store.spatial.items() if reference.spatial[k] != v and k != "pca_sha256"} == {}
    torch.testing.assert_close(store.written_pca().components, reference.written_pca().components, rtol=0, atol=1e-9)
    np.testing.assert_allclose(np.array(store.array), np.array(reference.array), rtol=0, atol=1e-4)
    # every row, whichever process wrote it, is in the basis of the one fit the folder holds
    maps, _ = _live_maps(48)
    expected = store.written_pca().transform(maps.reshape(-1, 256)).reshape(48, 2, 2, 4).permute(0, 3, 1, 2)
    torch.testing.assert_close(store.maps(np.arange(48)), expected, rtol=0, atol=1e-4)


def test_cli_spatial_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["precompute", "--help"])
    help_text = capsys.readouterr().out
    assert "--spatial K|all" in help_text and "feature map" in help_text
    with pytest.raises(SystemExit):
        main(["precompute", "--prior", "random:convnet", "--data", "digits", "--out", str(tmp_path / "x"),
              "--spatial", "0"])
    assert "positive number of components or 'all'" in capsys.readouterr().err
    out = tmp_path / "cli"
    assert main(["precompute", "--prior", "random:convnet", "--data", "digits", "--limit", "24", "--out", str(out),
                 "--spatial", "3", "--dtype", "bfloat16", "--no-progress", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    store = TargetStore.open(out)
    assert printed["spatial"]["channels"] == 3 and store.dtype == "bfloat16" and store.components == 3
    assert "--spatial 3" in store.metadata["command"]
    assert main(["store", "verify", str(out), "--no-progress"]) == 0
    assert "24 rows x 3 (maps on a 3x3 grid), every row finite, checksum matches" in capsys.readouterr().out
    assert main(["store", "verify", str(out), "--data", "digits", "--limit", "24", "--no-progress"]) == 0
