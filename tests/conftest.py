import os

import pytest
import torch

# Two cores: keep every test process to a predictable thread count.
torch.set_num_threads(min(2, os.cpu_count() or 1))

# Tests never touch the network: zoo priors read only the caches the tests build (see tests/test_zoo.py).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["ACCELERATE_SSL_OFFLINE"] = "1"


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Empty HF and torch hub caches in tmp_path, offline through the environment (filled with tests/hub_cache.py)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _fresh_once_warnings(monkeypatch):
    """Each test starts as a fresh process does for the warnings said once per process (launch.warn_once): a test
    that expects one is not silenced by an earlier test that met the same cause."""
    from accelerate_ssl import launch

    monkeypatch.setattr(launch, "_WARNED", set())


@pytest.fixture(scope="session")
def fashion_mnist_available():
    from accelerate_ssl.data.datasets import fashion_mnist_dir, _find_idx

    try:
        _find_idx(fashion_mnist_dir(), "t10k-images-idx3-ubyte")
    except FileNotFoundError as err:
        pytest.fail(f"Fashion-MNIST is required for this test (run `make data`): {err}")
    return True


@pytest.fixture
def cpu_one_thread(monkeypatch):
    """The CPU path with one thread, for tests that compare stored bytes (a CUDA device, or another thread count,
    rounds differently): ``pytestmark = pytest.mark.usefixtures("cpu_one_thread")``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_spatial_store(tmp_path_factory):
    """A spatial store of 24 random 16 px images (``_precompute_worker.tiny_dataset(24)``) by a random ConvNet
    64/128/256 prior: a 2x2 map of stride 8, reduced to 5 components, computed on the CPU path."""
    import accelerate_ssl.targets.precompute as pc
    from _precompute_worker import tiny_dataset
    from accelerate_ssl.priors import create_prior

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        return pc.precompute_targets(create_prior("random:convnet"), tiny_dataset(24),
                                     tmp_path_factory.mktemp("spatial") / "s", batch_size=8, progress=False, spatial=5)
