"""Compact stores (float16 / bfloat16 rows, PCA at write) and the prefetching lookup: every row read is the sample's
own, the store's checks hold for every dtype, bad inputs are refused with the fix."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from _index_prior import DIM, Spy, index_dataset, index_prior, own_row
from accelerate_ssl import ReLA
from accelerate_ssl.rela.lookup import RowPrefetcher
from accelerate_ssl.targets.pca import TargetPCA
from accelerate_ssl.targets.precompute import precompute_targets
from accelerate_ssl.targets.store import TargetStore, TargetStoreCorruptError

N = 50
ROUND = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("compact")
    out = {dtype: precompute_targets(index_prior(), index_dataset(N), root / dtype, batch_size=16, chunk_size=20,
                                     progress=False, dtype=dtype) for dtype in ROUND}
    out["pca4"] = precompute_targets(index_prior(), index_dataset(N), root / "pca4", batch_size=16, chunk_size=20,
                                     progress=False, components=4)
    out["pca4-bfloat16"] = precompute_targets(index_prior(), index_dataset(N), root / "pca4b", batch_size=16,
                                              chunk_size=20, progress=False, components=4, dtype="bfloat16")
    return out


@pytest.mark.parametrize("dtype", list(ROUND))
def test_every_row_is_the_samples_own_in_every_dtype(stores, dtype):
    store = TargetStore.open(stores[dtype].path, dataset=index_dataset(N))
    idx = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    rows = store[idx]
    assert rows.dtype == torch.float32
    # exactly the prior's row of that sample, rounded to the stored dtype (round to nearest even, as torch)
    assert torch.equal(rows, own_row(idx).to(ROUND[dtype]).float())
    assert torch.equal(store[7], own_row(7)[0].to(ROUND[dtype]).float())  # int index: the other mapping, same row
    assert torch.equal(store[10:13], own_row(range(10, 13)).to(ROUND[dtype]).float())
    file_bytes = (store.path / "targets.npy").stat().st_size
    assert file_bytes == 128 + N * DIM * (4 if dtype == "float32" else 2)  # header + rows
    assert store.verify()["dtype"] == dtype and store.verify_rows(index_dataset(N))["rows_checked"] == N


def test_identity_tells_the_stores_apart_and_checks_hold_for_compact_dtypes(stores, tmp_path):
    identities = [stores[k].identity() for k in stores]
    assert len({(i["dtype"], i["components"], i["targets_sha256"]) for i in identities}) == len(stores)
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(stores["bfloat16"].path, broken)
    data = bytearray((broken / "targets.npy").read_bytes())
    data[-2:] = np.array([0x7FC0], np.uint16).tobytes()  # a bfloat16 NaN in the last row
    (broken / "targets.npy").write_bytes(bytes(data))
    store = TargetStore.open(broken)
    with pytest.raises(TargetStoreCorruptError, match=r"NaN/Inf values in row\(s\) \[49\]"):
        store[[49]]
    with pytest.raises(TargetStoreCorruptError, match="sha256"):
        store.verify()


def test_float16_overflow_is_refused_with_the_bfloat16_advice_and_the_chunks_are_kept(tmp_path):
    path = tmp_path / "big"
    with pytest.raises(ValueError, match=r"beyond float16's range.*dtype='bfloat16'"):
        precompute_targets(index_prior(scale=1e4), index_dataset(N), path, chunk_size=20, progress=False,
                           dtype="float16")
    assert len(list((path / "chunks").glob("chunk-*.npy"))) == 3 and not (path / "metadata.json").exists()
    store = precompute_targets(index_prior(scale=1e4), index_dataset(N), path, chunk_size=20, progress=False,
                               dtype="bfloat16")  # resumes: only the consolidation runs again
    assert torch.equal(store[[3, 40]], own_row([3, 40], 1e4).to(torch.bfloat16).float())
    with pytest.raises(ValueError, match=r"dtype: 'bfloat16' in the store vs 'float16' now"):
        precompute_targets(index_prior(scale=1e4), index_dataset(N), path, progress=False, dtype="float16",
                           chunk_size=20)
    with pytest.raises(ValueError, match="dtype must be one of"):
        precompute_targets(index_prior(), index_dataset(N), tmp_path / "x", progress=False, dtype="int8")


def test_pca_at_write_stores_eq41_rows_and_relas_use_them_without_reducing_twice(stores):
    store = stores["pca4"]
    assert store.dim == 4 and store.components == 4 and store.source_dim == DIM
    assert (store.path / "targets.npy").stat().st_size == 128 + N * 4 * 4
    reference = TargetPCA.fit(own_row(range(N)), 4)  # Eq. 41 over every row of the full-width store
    expected = reference.transform(own_row(range(N)))
    assert torch.allclose(store[list(range(N))], expected, atol=1e-4)
    with pytest.raises(ValueError, match="reduce twice"):
        store.pca(2)
    # n_components <= k: the leading columns (the same eigenvectors), no second PCA
    rela = ReLA(store, torch.nn.Linear(3, 5), schedule="constant:1", n_components=2, feature_dim=5)
    rela.targets = spy = Spy(rela.targets)
    idx = torch.tensor([9, 1, 33])
    rela.wrap(torch.zeros(()), index=idx, features=torch.randn(3, 5))
    assert rela.head.out_features == 2 and torch.allclose(spy.rows[-1], expected[idx, :2], atol=1e-4)
    # raw prior rows carried by the batch get the store's write-time PCA
    rela.wrap(torch.zeros(()), targets=own_row(idx), features=torch.randn(3, 5))
    assert torch.allclose(spy.rows[-1], expected[idx, :2], atol=1e-4)
    with pytest.raises(ValueError, match=r"n_components=6 but the target store was reduced at write to its top 4"):
        ReLA(store, torch.nn.Linear(3, 5), n_components=6, feature_dim=5)
    # a bfloat16 store of the same reduced rows holds them rounded to bfloat16
    assert torch.equal(stores["pca4-bfloat16"][idx], store[idx].to(torch.bfloat16).float())
    with pytest.raises(ValueError, match=r"components must be an int in \[1, 8\]"):
        precompute_targets(index_prior(), index_dataset(N), store.path.parent / "k9", progress=False, components=9)


def _pixels(image):
    return torch.from_numpy(np.array(image, dtype=np.float32))


def _sample_index(x: torch.Tensor) -> torch.Tensor:
    """The index a batch's images encode (first two pixels): which samples are really in the batch."""
    return (x[:, 0, 0] + 256 * x[:, 0, 1]).long()


@pytest.mark.parametrize("workers", [0, 2])
def test_prefetched_rows_are_each_batchs_own(stores, workers):
    torch.manual_seed(0)
    student = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 6))
    loader = DataLoader(index_dataset(N, transform=_pixels), batch_size=8, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(3))
    rela = ReLA(stores["bfloat16"], student, dataloader=loader, schedule="constant:1", n_components=None,
                feature_dim=6, prefetch=True)
    rela.targets = spy = Spy(rela.targets)
    opt = torch.optim.SGD(list(student.parameters()) + list(rela.parameters()), lr=0.01)
    steps = 0
    for epoch in range(3):
        for b, (x, _) in enumerate(loader):
            i = _sample_index(x)
            student(x)
            rela.wrap(torch.zeros(()), features=None).backward()
            opt.step()
            opt.zero_grad()
            assert torch.equal(spy.rows[-1], own_row(i).to(torch.bfloat16).float())  # the batch's own rows
            steps += 1
            if epoch == 1 and b == 2:
                break  # an epoch cut short: its drawn-ahead batches are never used
    prefetcher = rela.targets.prefetcher
    # every lookup found its rows read ahead, except (with workers, which draw batches ahead) the first one after the
    # cut-short epoch, whose read queued behind the abandoned batches: read directly then, the same rows
    assert prefetcher.hits + prefetcher.misses == steps and prefetcher.misses <= (0 if workers == 0 else 1)


def test_prefetcher_hands_rows_only_to_the_identical_index(stores):
    store = stores["float32"]
    pre = RowPrefetcher(store)
    a, b, c = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]), torch.tensor([7, 8, 9])
    pre.announce(a)
    pre.announce(b)
    assert pre.take(torch.tensor([3, 2, 1])) is None  # same rows, another order: not the same batch
    assert torch.equal(pre.take(b), own_row(b))  # a was drawn but never looked up: dropped
    assert pre.take(a) is None and pre.take(c) is None and (pre.hits, pre.misses) == (1, 3)
    pre.announce(torch.tensor([0, N]))  # out of range: not read ahead; the lookup itself refuses it
    assert pre.take(torch.tensor([0, N])) is None
    pre.close()
