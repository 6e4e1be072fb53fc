import json

import numpy as np
import pytest
import torch

from _precompute_worker import tiny_dataset
from accelerate_ssl import __version__
from accelerate_ssl.data import ArrayImageDataset
from accelerate_ssl.targets.precompute import precompute_targets
from accelerate_ssl.priors import create_prior
from accelerate_ssl.targets.store import (TargetStore, TargetStoreCorruptError, TargetStoreIncompleteError,
                                          TargetStoreMismatchError)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "targets"
    precompute_targets(create_prior("random:convnet"), tiny_dataset(40), path, batch_size=8, chunk_size=16, progress=False)
    return path


def test_metadata_and_rows(store_dir):
    store = TargetStore.open(store_dir, dataset=tiny_dataset(40))
    assert len(store) == 40 and store.dim == 256
    meta = store.metadata
    assert meta["num_rows"] == 40 and meta["dim"] == 256 and meta["dtype"] == "float32"
    assert meta["prior"]["spec"] == "random:convnet" and meta["library_version"] == __version__
    assert meta["dataset"]["fingerprint"]["length"] == 40 and meta["created"]
    assert meta["preprocess"]["stats"] == "dataset"  # a random prior takes the dataset's own mean/std
    assert meta["preprocess"]["mean"] == pytest.approx(list(tiny_dataset(40).mean))
    rows = store[torch.tensor([3, 0, 39])]
    assert rows.dtype == torch.float32 and rows.shape == (3, 256)
    assert torch.equal(rows[1], store[0]) and torch.equal(store[[3]], store[np.array([3])])
    assert isinstance(store.array, np.memmap)
    with pytest.raises(IndexError):
        store[torch.tensor([40])]


def test_rows_are_the_priors_features(store_dir):
    store = TargetStore.open(store_dir)
    ds = tiny_dataset(40)
    prior = create_prior("random:convnet")
    pre = prior.preprocess.with_stats(ds.mean, ds.std, "dataset")
    with torch.inference_mode():
        expected = prior(torch.stack([pre(ds[i][0]) for i in (5, 17)]))
    # on a GPU the store was computed there, where cuDNN runs float32 convolutions in TF32 (10-bit mantissa)
    assert torch.allclose(store[[5, 17]], expected, atol=1e-5 if not torch.cuda.is_available() else 3e-3)


def test_mismatched_dataset_is_refused(store_dir):
    with pytest.raises(TargetStoreMismatchError, match="holds 40 rows but the dataset has 39") as err:
        TargetStore.open(store_dir, dataset=tiny_dataset(39))
    assert "Fix" in str(err.value)
    other = ArrayImageDataset(np.zeros((40, 16, 16), np.uint8), np.zeros(40, np.int64))
    with pytest.raises(TargetStoreMismatchError, match="same length \\(40\\) but different content"):
        TargetStore.open(store_dir).check_dataset(other)
    assert isinstance(TargetStoreMismatchError("x"), ValueError)


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_truncated_file_and_bad_json_are_detected(store_dir, tmp_path):
    broken = _copy(store_dir, tmp_path / "a")
    data = (broken / "targets.npy").read_bytes()
    (broken / "targets.npy").write_bytes(data[: len(data) // 2])
    with pytest.raises(TargetStoreCorruptError, match="targets.npy"):
        TargetStore.open(broken)
    bad = _copy(store_dir, tmp_path / "b")
    (bad / "metadata.json").write_text('{"format": "accelerate-ssl-tar')
    with pytest.raises(TargetStoreCorruptError, match="metadata.json"):
        TargetStore.open(bad)
    wrong = _copy(store_dir, tmp_path / "c")
    meta = json.loads((wrong / "metadata.json").read_text())
    meta["dim"] = 128
    (wrong / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(TargetStoreCorruptError, match="says float32 \\(40, 128\\)"):
        TargetStore.open(wrong)


def test_unfinished_and_missing_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="precompute"):
        TargetStore.open(tmp_path / "none")
    (tmp_path / "half" / "chunks").mkdir(parents=True)
    np.save(tmp_path / "half" / "chunks" / "chunk-00000.npy", np.zeros((4, 2), np.float32))
    with pytest.raises(TargetStoreIncompleteError, match="interrupted. Resume"):
        TargetStore.open(tmp_path / "half")


def test_pca_is_fitted_once_and_saved(store_dir, tmp_path, monkeypatch):
    from accelerate_ssl.targets.pca import TargetPCA

    path = _copy(store_dir, tmp_path / "p")
    store = TargetStore.open(path)
    pca = store.pca(16)
    assert pca.n_components == 16 and store.fitted_pca() == ["pca-n16-zscore.safetensors"]
    reference = TargetPCA.fit(store.array, 16)
    assert torch.allclose(pca.components, reference.components)

    def refit(*args, **kwargs):
        raise AssertionError("store.pca refitted instead of loading the saved state")

    monkeypatch.setattr(TargetPCA, "fit", refit)
    again = TargetStore.open(path).pca(16)
    x = store[[0, 1, 2]]
    assert torch.equal(again.transform(x), pca.transform(x))


def test_pca_n_components_capped(store_dir, tmp_path):
    store = TargetStore.open(_copy(store_dir, tmp_path / "q"))
    assert store.pca(10_000, standardize=False).n_components == 256


def test_nan_rows_are_refused_at_lookup_naming_rows_and_store(tmp_path):
    """A damaged row (disk fault, bad prior) is caught where it is read, not later as 'non-finite student features'."""
    import numpy as _np

    from accelerate_ssl.targets.precompute import precompute_targets
    from accelerate_ssl.priors import create_prior
    from accelerate_ssl.targets.store import TargetStore, TargetStoreCorruptError

    images = [torch.randint(0, 256, (1, 28, 28), dtype=torch.uint8) for _ in range(8)]
    store = precompute_targets(create_prior("random:convnet"), images, tmp_path / "s", progress=False)
    data = tmp_path / "s" / store.metadata["file"]
    arr = _np.load(data, mmap_mode="r+")
    arr[5, 3] = _np.nan
    arr[6, 0] = _np.inf
    arr.flush()
    del arr
    store = TargetStore.open(tmp_path / "s")
    assert torch.isfinite(store[[0, 1, 2]]).all()
    with pytest.raises(TargetStoreCorruptError, match=r"row\(s\) \[5, 6\].*random:convnet.*recompute") as err:
        store[torch.tensor([1, 5, 6])]
    assert str(tmp_path / "s") in str(err.value)
    with pytest.raises(TargetStoreCorruptError, match=r"\[5\]"):
        store[5]
    with pytest.raises(TargetStoreCorruptError, match=r"\[5, 6\]"):
        store[4:8]


def test_iterable_dataset_is_refused_with_the_reason(tmp_path):
    from accelerate_ssl.targets.precompute import precompute_targets
    from accelerate_ssl.priors import create_prior

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from (torch.zeros(1, 28, 28, dtype=torch.uint8) for _ in range(4))

    with pytest.raises(TypeError, match="map-style dataset.*Stream has no stable index"):
        precompute_targets(create_prior("random:convnet"), Stream(), tmp_path / "s", progress=False)
