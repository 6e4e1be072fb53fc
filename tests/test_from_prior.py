"""ReLA.from_prior and the core's open_or_precompute: the set-up every recipe uses. One store per (prior, data) under the
cache folder, reopened after the first run; separate runs sharing the folder take turns (one computes, the other opens);
the clean view is found or refused with the fix; the loader's data set is checked; streams are pointed to sidecars."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from accelerate_ssl import ReLA
from accelerate_ssl.data import ArrayImageDataset
from accelerate_ssl.targets.cache import open_or_precompute, store_folder
from processes import cpu_process_env

ROOT = Path(__file__).resolve().parents[1]


def _to_tensor(image):
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).unsqueeze(0)


def _data(n=32, seed=0, transform=_to_tensor):
    images = np.random.default_rng(seed).integers(0, 256, (n, 8, 8), dtype=np.uint8)
    return ArrayImageDataset(images, np.arange(n), transform=transform)


def _backbone():
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8), torch.nn.Tanh())


def test_one_store_per_prior_and_data_reopened_and_checked(tmp_path):
    train = _data()
    loader = DataLoader(train, batch_size=8, shuffle=True)
    rela = ReLA.from_prior("random:convnet", _backbone(), loader, total_steps=4, cache_dir=tmp_path, progress=False)
    folder = Path(rela.store.path)
    assert folder.parent == tmp_path and folder.name.startswith("random-convnet-32-")
    assert rela.head is not None and rela.head.in_features == 8  # the feature dim, from the loader's items
    assert train.transform is _to_tensor  # the user's data set keeps its transform
    for x, own in loader:  # the loader is tracked: each batch's indices are its own
        rela.wrap(torch.tensor(0.0), features=rela.backbone(x))
        assert torch.equal(rela._current_index, own)
    mtime = (folder / "metadata.json").stat().st_mtime_ns
    again = ReLA.from_prior("random:convnet", _backbone(), DataLoader(train, batch_size=8), total_steps=4,
                            cache_dir=tmp_path, progress=False)
    assert Path(again.store.path) == folder and (folder / "metadata.json").stat().st_mtime_ns == mtime  # reopened
    other = ReLA.from_prior("random:convnet", _backbone(), DataLoader(_data(seed=1), batch_size=8), total_steps=4,
                            cache_dir=tmp_path, progress=False)
    assert Path(other.store.path) != folder  # other data: another folder, never a stale one
    from accelerate_ssl import create_prior

    with pytest.raises(ValueError, match="weights= is for a prior given as a spec"):
        open_or_precompute(create_prior("random:convnet"), train, tmp_path, weights="w.pt")


def test_a_spatial_store_for_view_and_dense_targets_gets_its_own_folder(tmp_path):
    """from_prior(spatial=k): a spatial store (the prior's maps, k components per location) in its own folder beside
    the pooled rows', reopened the second time; dense= without it is refused naming spatial=."""
    from accelerate_ssl import create_prior
    from accelerate_ssl.backbones import ConvNet

    prior = create_prior("random:convnet", size=24)  # the 8 px images resized: a 3x3 map (at 8 px it is one cell)

    train = _data(transform=lambda im: torch.from_numpy(np.kron(np.asarray(im, np.float32) / 255, np.ones((3, 3))))
                  .float().unsqueeze(0))  # 24 px views of the 8 px images
    loader = DataLoader(train, batch_size=8)
    student = ConvNet(widths=(8, 16))
    with pytest.raises(ValueError, match="dense=.*pass spatial=k too"):
        ReLA.from_prior(prior, student, loader, total_steps=4, cache_dir=tmp_path, dense=student.features)
    rela = ReLA.from_prior(prior, student, loader, total_steps=4, cache_dir=tmp_path, progress=False,
                           spatial=3, dense=student.features, witness=False)
    folder = Path(rela.store.path)
    assert folder.name.endswith("-spatial3") and rela.store.spatial["channels"] == 3 and rela.store.dim == 3
    assert list(rela.store.grid) == [3, 3]
    for x, _ in loader:
        assert torch.isfinite(rela.wrap(torch.tensor(0.0), features=student(x)))
    assert rela.priors["0"].dense.linear is not None  # the dense head was built and used
    mtime = (folder / "metadata.json").stat().st_mtime_ns
    again = ReLA.from_prior(prior, ConvNet(widths=(8, 16)), loader, total_steps=4, cache_dir=tmp_path,
                            progress=False, spatial=3)
    assert Path(again.store.path) == folder and (folder / "metadata.json").stat().st_mtime_ns == mtime
    pooled = ReLA.from_prior(prior, ConvNet(widths=(8, 16)), loader, total_steps=4, cache_dir=tmp_path,
                             progress=False)
    assert Path(pooled.store.path) != folder and pooled.store.spatial is None
    with pytest.raises(ValueError, match="spatial must be"):
        ReLA.from_prior(prior, student, loader, cache_dir=tmp_path, spatial=0)


class Augmenting(Dataset):
    """Augments inside __getitem__ with its augmentation in no transform attribute."""

    def __init__(self):
        self.images = torch.rand(16, 1, 8, 8)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i] + 0.01 * torch.randn(1, 8, 8), i


def test_what_from_prior_cannot_take_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(TypeError, match="none of the transform attributes.*transform_attr=.*dataset=clean_set"):
        ReLA.from_prior("random:convnet", _backbone(), DataLoader(Augmenting()), cache_dir=tmp_path)
    with pytest.raises(TypeError, match="needs the training DataLoader"):
        ReLA.from_prior("random:convnet", _backbone(), [torch.zeros(1, 8, 8)], cache_dir=tmp_path)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(1, 8, 8)

    with pytest.raises(TypeError, match="streamed data.*ShardedTargets.*webdataset.md.*At scale"):
        ReLA.from_prior("random:convnet", _backbone(), DataLoader(Stream()), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="not both"):
        ReLA.from_prior("random:convnet", _backbone(), DataLoader(_data()), dataset=_data(transform=None),
                        transform_attr="transform", cache_dir=tmp_path)
    # a clean set given explicitly that is not the loader's data: the loader's data set is refused before training
    with pytest.raises(ValueError, match="different content or another order|does not match"):
        ReLA.from_prior("random:convnet", _backbone(), DataLoader(_data()), dataset=_data(seed=3, transform=None),
                        cache_dir=tmp_path, progress=False)


WORKER = '''
import sys, time
import numpy as np, torch
sys.path.insert(0, sys.argv[2])
import accelerate_ssl.targets.precompute as precompute
from accelerate_ssl.data import ArrayImageDataset
from accelerate_ssl.targets.cache import open_or_precompute

class Slow(ArrayImageDataset):
    def __getitem__(self, i):
        time.sleep(0.02)  # long enough that the other run starts while this one computes
        return super().__getitem__(i)

real = precompute.precompute_targets
def counted(*args, **kwargs):
    print("computing", flush=True)
    return real(*args, **kwargs)
precompute.precompute_targets = counted
images = np.random.default_rng(0).integers(0, 256, (48, 8, 8), dtype=np.uint8)
from pathlib import Path
ready = Path(sys.argv[1] + "-ready")
ready.mkdir(parents=True, exist_ok=True)
(ready / str(__import__("os").getpid())).touch()
while len(list(ready.iterdir())) < 2:  # both runs reach open_or_precompute together
    time.sleep(0.01)
store = open_or_precompute("random:convnet", Slow(images, np.arange(48)), sys.argv[1], batch_size=8, progress=False)
print("rows", len(store), store.path, flush=True)
'''


def test_separate_runs_sharing_a_cache_folder_take_turns(tmp_path):
    """Two runs started together on one cache folder (no process group between them): one computes the store, the other
    waits for the folder's lock and opens the finished store."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = cpu_process_env(PYTHONPATH=str(ROOT))
    runs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "cache"), str(ROOT)], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = []
    for run in runs:
        out, err = run.communicate(timeout=240)
        assert run.returncode == 0, err[-3000:]
        outs.append(out)
    assert sum(out.count("computing") for out in outs) == 1, outs
    paths = {line.split()[2] for out in outs for line in out.splitlines() if line.startswith("rows 48 ")}
    assert len(paths) == 1 and len(list((tmp_path / "cache").glob("*/metadata.json"))) == 1


def test_the_folder_is_named_by_prior_and_fingerprint(tmp_path):
    fingerprint = {"length": 32, "sha256": "0123456789abcdef" * 4}
    assert store_folder("timm:vit_small_patch14_dinov2.lvd142m", fingerprint, tmp_path) == \
        tmp_path / "timm-vit_small_patch14_dinov2.lvd142m-32-0123456789ab"
