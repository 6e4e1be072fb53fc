import os

import pytest
import torch

# Two cores: keep every test process to a predictable thread count.
torch.set_num_threads(min(2, os.cpu_count() or 1))

# Tests never touch the network: zoo priors read only the caches the tests build (see tests/test_zoo.py).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["ACCELERATE_SSL_OFFLINE"] = "1"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def fashion_mnist_available():
    from accelerate_ssl.data.datasets import fashion_mnist_dir, _find_idx

    try:
        _find_idx(fashion_mnist_dir(), "t10k-images-idx3-ubyte")
    except FileNotFoundError as err:
        pytest.fail(f"Fashion-MNIST is required for this test (run `make data`): {err}")
    return True
