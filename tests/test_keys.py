"""Sample keys -> target rows: recorded at precompute, looked up by rela.wrap(keys=), every row the sample's own."""

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from _index_prior import DIM, Spy, index_dataset, index_prior, own_row
from accelerate_ssl import ReLA
from accelerate_ssl.targets.keys import TargetKeyError, dataset_keys
from accelerate_ssl.targets.precompute import precompute_targets
from accelerate_ssl.targets.store import TargetStore

N = 60


def _key(i: int) -> str:
    return f"shard-{i % 4:02d}/{(i * 37) % 101:04d}-{i}"  # not sorted like the rows: the map is not the identity


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "store"
    return precompute_targets(index_prior(), index_dataset(N), path, batch_size=16, chunk_size=25, progress=False,
                              keys=[_key(i) for i in range(N)])


class KeyedItems(Dataset):
    """A loader that carries keys, not indices (an untrackable pipeline: the index stays hidden in the test)."""

    def __init__(self, order):
        self.order = order

    def __len__(self):
        return len(self.order)

    def __getitem__(self, j):
        i = int(self.order[j])
        return torch.full((4,), float(i)), _key(i), i


def test_keys_are_saved_as_plain_arrays_and_map_to_their_rows(keyed):
    meta = keyed.metadata["keys"]
    assert meta["kind"] == "user" and meta["count"] == N
    for name in (meta["sorted_file"], meta["rows_file"]):
        np.load(keyed.path / name, allow_pickle=False)  # never a pickle
    again = TargetStore.open(keyed.path)
    assert again.keys.in_row_order() == [_key(i) for i in range(N)]
    idx = [17, 3, 59, 0]
    assert again.key_rows([_key(i) for i in idx]).tolist() == idx
    assert torch.equal(again[again.key_rows([_key(i) for i in idx])], own_row(idx))
    assert again.verify()["keys"] == N


def test_wrap_keys_trains_every_sample_on_its_own_row(keyed):
    torch.manual_seed(0)
    student = torch.nn.Linear(4, 6)
    rela = ReLA(keyed, student, schedule="constant:1", n_components=None, feature_dim=6)
    rela.targets = spy = Spy(rela.targets)
    opt = torch.optim.SGD(list(student.parameters()) + list(rela.parameters()), lr=0.01)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(KeyedItems(order), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))
    for epoch in range(2):
        for x, keys, true_index in loader:
            student(x)
            rela.wrap(torch.zeros(()), keys=keys).backward()
            opt.step()
            opt.zero_grad()
            # the row used for every sample is the prior's row of the sample actually in the batch
            assert torch.equal(spy.rows[-1], own_row(true_index))
    assert len(spy.rows) == 2 * len(loader)
    # an id column collated as an int tensor works too (ints are recorded in decimal)
    with pytest.raises(TargetKeyError, match=r"Key '5' is not in the target store's key list"):
        rela.wrap(torch.zeros(()), keys=torch.tensor([5, 6]), features=torch.zeros(2, 6))


def test_int_id_column_and_callable_keys(tmp_path):
    ids = np.arange(N) * 10 + 7
    store = precompute_targets(index_prior(), index_dataset(N), tmp_path / "ids", batch_size=32, progress=False,
                               keys=lambda i: ids[i])
    assert store.key_rows(torch.tensor([ids[4], ids[0]])).tolist() == [4, 0]
    assert store.key_rows(["17"]).tolist() == [1]


def test_missing_key_names_the_key_and_the_store(keyed):
    rela = ReLA(keyed, torch.nn.Linear(4, 6), schedule="constant:1", n_components=None, feature_dim=6)
    with pytest.raises(TargetKeyError) as err:
        rela.wrap(torch.zeros(()), keys=[_key(1), "shard-99/nope"], features=torch.zeros(2, 6))
    text = str(err.value)
    assert "'shard-99/nope'" in text and str(keyed.path) in text and "1 of the batch's 2 keys missing" in text
    with pytest.raises(ValueError, match="not both"):
        rela.wrap(torch.zeros(()), keys=[_key(1)], index=[1], features=torch.zeros(1, 6))


def test_duplicated_keys_are_refused_before_anything_is_computed(tmp_path):
    keys = [_key(i) for i in range(N)]
    keys[41] = keys[7]
    with pytest.raises(ValueError, match=r"duplicated sample key.*at rows \[7, 41\]"):
        precompute_targets(index_prior(), index_dataset(N), tmp_path / "dup", progress=False, keys=keys)
    assert not (tmp_path / "dup").exists()
    with pytest.raises(ValueError, match="holds 3 keys but the data set has 60 items"):
        precompute_targets(index_prior(), index_dataset(N), tmp_path / "short", progress=False, keys=["a", "b", "c"])
    with pytest.raises(TypeError, match="must be a str .* or an int"):
        precompute_targets(index_prior(), index_dataset(N), tmp_path / "float", progress=False,
                           keys=[0.5] * N)


def test_store_without_keys_says_how_to_get_them(tmp_path):
    store = precompute_targets(index_prior(), index_dataset(N), tmp_path / "plain", progress=False)
    assert store.keys is None  # an array data set has no file names
    rela = ReLA(store, torch.nn.Linear(4, 6), schedule="constant:1", n_components=None, feature_dim=6)
    with pytest.raises(ValueError, match=r"records no sample keys.*keys=<one key per item>"):
        rela.wrap(torch.zeros(()), keys=["a"], features=torch.zeros(1, 6))
    # a finished store is not silently reused for a call that asks for keys
    with pytest.raises(ValueError, match="no sample keys than the ones given now"):
        precompute_targets(index_prior(), index_dataset(N), tmp_path / "plain", progress=False,
                           keys=[_key(i) for i in range(N)])


def test_folder_keys_are_file_names_relative_to_the_root_also_through_a_subset(tmp_path):
    from PIL import Image
    from torch.utils.data import Subset
    from torchvision.datasets import ImageFolder

    for i in range(6):
        (tmp_path / f"c{i % 2}").mkdir(exist_ok=True)
        Image.fromarray(np.full((4, 4), i, np.uint8)).save(tmp_path / f"c{i % 2}" / f"{i}.png")
    folder = ImageFolder(str(tmp_path))
    names = dataset_keys(folder)
    assert names == ["c0/0.png", "c0/2.png", "c0/4.png", "c1/1.png", "c1/3.png", "c1/5.png"]
    assert dataset_keys(Subset(Subset(folder, [5, 3, 1, 0]), [2, 0])) == ["c0/2.png", "c1/5.png"]


def test_lightly_reads_a_filenames_sidecar_of_an_older_cache(tmp_path):
    from accelerate_ssl.integrations.lightly import FILENAMES_SIDECAR, FilenameIndex

    store = precompute_targets(index_prior(), index_dataset(N), tmp_path / "old", progress=False)
    names = [f"img{i:03d}.png" for i in range(N)]
    (tmp_path / "old" / FILENAMES_SIDECAR).write_text(json.dumps({"filenames": names}))
    index = FilenameIndex.for_store(store)
    assert index.filenames == names and index.rows(["img009.png", "img002.png"]).tolist() == [9, 2]
    with pytest.raises(KeyError, match="File 'x.png' is not in the target store's file list"):
        index.rows(["x.png"])
    assert DIM == store.dim
