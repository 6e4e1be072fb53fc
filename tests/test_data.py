import gzip

import numpy as np
import pytest
import torch
from torch.utils.data import Subset, TensorDataset

from accelerate_ssl.data import Digits, FashionMNIST, dataset_fingerprint, describe_fingerprint_mismatch, read_idx
from accelerate_ssl.data.datasets import ArrayImageDataset


def test_fashion_mnist_real_files(fashion_mnist_available):
    test = FashionMNIST("test")
    assert len(test) == 10000
    assert test.data.shape == (10000, 28, 28) and test.data.dtype == torch.uint8
    assert sorted(torch.unique(test.targets).tolist()) == list(range(10))
    image, label = test[0]
    assert image.size == (28, 28) and 0 <= label < 10
    assert 0.2 < test.mean[0] < 0.4  # Fashion-MNIST's known mean pixel is about 0.286


def test_fashion_mnist_missing_folder_names_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        FashionMNIST("train", root=tmp_path)


def test_truncated_idx_file_is_rejected(tmp_path):
    header = bytes([0, 0, 0x08, 3]) + (10).to_bytes(4, "big") + (28).to_bytes(4, "big") + (28).to_bytes(4, "big")
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    with gzip.open(path, "wb") as f:
        f.write(header + bytes(100))
    with pytest.raises(ValueError, match="truncated"):
        read_idx(path)


def test_digits_splits_are_disjoint_and_cover_all():
    train, test, full = Digits("train"), Digits("test"), Digits("all")
    assert len(train) + len(test) == len(full) == 1797
    assert train.data.shape[1:] == (28, 28)


def test_fingerprint_ignores_transform_but_sees_content():
    images = np.random.default_rng(0).integers(0, 255, (50, 8, 8), dtype=np.uint8)
    labels = np.zeros(50, dtype=np.int64)
    clean = ArrayImageDataset(images, labels)
    augmented = ArrayImageDataset(images, labels, transform=lambda im: np.asarray(im) + np.random.rand())
    assert dataset_fingerprint(clean) == dataset_fingerprint(augmented)

    other = images.copy()
    other[49, 0, 0] ^= 1
    changed = dataset_fingerprint(ArrayImageDataset(other, labels))
    msg = describe_fingerprint_mismatch(dataset_fingerprint(clean), changed)
    assert msg is not None and "different content" in msg

    shorter = dataset_fingerprint(Subset(clean, list(range(40))))
    assert "40 samples" in describe_fingerprint_mismatch(dataset_fingerprint(clean), shorter)
    assert describe_fingerprint_mismatch(dataset_fingerprint(clean), dataset_fingerprint(clean)) is None


def test_fingerprint_of_random_items_asks_for_clean_dataset():
    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.rand(3)

    with pytest.raises(ValueError, match="random transform"):
        dataset_fingerprint(Noisy())
    assert dataset_fingerprint(TensorDataset(torch.arange(5.0)))["kind"] == "array"  # every value hashed


def test_subset_mismatch_says_what_differs():
    """Same data, other Subset indices (e.g. a subset that repeats rows): named as such, not 'different content'."""
    from accelerate_ssl.data import ArrayImageDataset
    from accelerate_ssl.data.fingerprint import describe_fingerprint_mismatch

    rng = np.random.default_rng(0)
    ds = ArrayImageDataset(rng.integers(0, 256, (100, 8, 8), dtype=np.uint8), np.zeros(100), name="arr")
    stored = dataset_fingerprint(Subset(ds, list(range(50))))
    repeating = dataset_fingerprint(Subset(ds, list(range(40)) + list(range(10))))
    msg = describe_fingerprint_mismatch(stored, repeating)
    assert "same underlying data set" in msg and "10 of them repeated rows" in msg and "50 indices, no repeats" in msg
    other = describe_fingerprint_mismatch(stored, dataset_fingerprint(Subset(ds, list(range(50, 100)))))
    assert "other indices" in other and "repeated" not in other
    plain = describe_fingerprint_mismatch(dataset_fingerprint(ds), dataset_fingerprint(Subset(ds, list(range(100)))))
    assert "plain data set" in plain and "Subset" in plain
    other_data = ArrayImageDataset(rng.integers(0, 256, (100, 8, 8), dtype=np.uint8), np.zeros(100), name="arr")
    assert "different content" in describe_fingerprint_mismatch(stored, dataset_fingerprint(Subset(other_data, list(range(50)))))
    assert describe_fingerprint_mismatch(stored, dataset_fingerprint(Subset(ds, list(range(50))))) is None
