"""Spatial sidecars: streamed data carries each sample's feature map, so a view's target is pooled from its own map
(``wrap(targets=, geometry=)``) and the dense term trains on it, exactly as from a map-style spatial store."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

wds = pytest.importorskip("webdataset")

from accelerate_ssl import ReLA, ShardedTargets, create_prior, decode_images, precompute_sidecars  # noqa: E402
from accelerate_ssl.backbones import ConvNet  # noqa: E402
from accelerate_ssl.targets.precompute import precompute_targets  # noqa: E402
from accelerate_ssl.targets.sidecar import SIDECARS, SidecarError  # noqa: E402
from accelerate_ssl.targets.views import RecordGeometry, view_targets  # noqa: E402

pytestmark = pytest.mark.usefixtures("cpu_one_thread")
SIZE, SIZES = 24, (10, 7, 9)  # 24 px images: a 3x3 map of the random ConvNet prior (stride 8)
N = sum(SIZES)


def image_of(n: int, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(1000 + n).integers(0, 256, (size, size), dtype=np.uint8)


def png(a: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="png")
    return buf.getvalue()


def write_shards(folder: Path, pixels=lambda shard: SIZE) -> list[str]:
    folder.mkdir(parents=True)
    urls, n = [], 0
    for s, size in enumerate(SIZES):
        path = folder / f"shard-{s:06d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(n, n + size):
                data = png(image_of(i, pixels(s)))
                info = tarfile.TarInfo(f"k{i:05d}.png")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        urls.append(str(path))
        n += size
    return urls


class Images(torch.utils.data.Dataset):
    """The same images as a map-style data set, in key order (row i = key k0000i)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return image_of(i)


@pytest.fixture(scope="module")
def prior():
    return create_prior("random:convnet", in_channels=1).eval()


@pytest.fixture(scope="module")
def data(tmp_path_factory, prior):
    root = tmp_path_factory.mktemp("spatial-wds")
    urls = write_shards(root / "data")
    spec = f"wds:{root}/data/shard-{{000000..000002}}.tar"
    sidecars = precompute_sidecars(prior, spec, root / "sidecars", batch_size=4, progress=False, spatial=3)
    store = precompute_targets(prior, Images(), root / "store", batch_size=4, progress=False, spatial=3)
    return root, urls, spec, sidecars, store


def live_maps(prior, idx) -> torch.Tensor:
    x = torch.from_numpy(np.stack([image_of(int(i)) for i in idx]))[:, None]
    with torch.inference_mode():
        return prior.feature_map(prior.preprocess.batch(x))


def test_spatial_sidecars_hold_each_samples_map_as_a_spatial_store_does(data, prior, tmp_path):
    root, urls, spec, sidecars, store = data
    idx = np.arange(N)
    full = precompute_sidecars(prior, spec, tmp_path / "full", batch_size=4, progress=False, spatial=True)
    live = live_maps(prior, idx)
    assert full.grid == (3, 3) and full.dim == 256 and full.width == 9 * 256
    torch.testing.assert_close(full.maps(idx), live, rtol=0, atol=1e-5)
    torch.testing.assert_close(full[idx], live.mean((2, 3)), rtol=0, atol=1e-5)  # rows: the maps' means
    # reduced: every location through the PCA fitted after the raw pass, over every sample here (26 < 256): the
    # same fit as the map-style store of the same images, so the same maps
    assert sidecars.dim == 3 and sidecars.spatial["fit_images"] == N and sidecars.components == 3
    torch.testing.assert_close(sidecars.maps(idx), store.maps(idx), rtol=0, atol=1e-4)
    pca = sidecars.written_pca()
    reduced = pca.transform(live.permute(0, 2, 3, 1).reshape(-1, 256)).reshape(N, 3, 3, 3).permute(0, 3, 1, 2)
    torch.testing.assert_close(sidecars.maps(idx), reduced, rtol=0, atol=1e-4)
    assert sidecars.metadata["bytes_per_sample"] < 0.05 * full.metadata["bytes_per_sample"]


def views_of(urls, sidecars, seed=0):
    """The joined stream, each image cropped and flipped by RecordGeometry, in batches of 6: (index, view, geometry,
    carried rows)."""
    import torchvision.transforms as T

    torch.manual_seed(seed)
    view = RecordGeometry(T.RandomResizedCrop(16, scale=(0.2, 0.8)), T.RandomHorizontalFlip(), None)

    def sample(s):
        x, g = view(torch.from_numpy(np.array(s["png"]))[None].float() / 255)
        return int(s["__key__"][1:]), x, g, s["target"]

    pipeline = wds.WebDataset(urls, shardshuffle=False, empty_check=False).compose(sidecars.join()) \
        .map(decode_images()).map(sample)
    return list(torch.utils.data.DataLoader(pipeline, batch_size=6))


def test_carried_maps_give_each_view_its_boxs_target_and_train_as_the_store_does(data):
    """wrap(targets=carried maps, geometry=) pools each view's box from the batch's own maps: the same rows as
    view_targets on the map-style store at the samples' indices, and the same losses (global and dense terms) as ReLA
    on that store, step for step."""
    root, urls, spec, sidecars, store = data
    batches = views_of(urls, sidecars)
    index, x, g, t = batches[0]
    term = ReLA(sidecars, ConvNet(widths=(8, 16)), feature_dim=16, n_components=3, witness=False).priors["0"]
    term.build(16, 3, "cpu")
    pooled = view_targets(store, index, g)
    torch.testing.assert_close(term.targets.reduce_rows(t, "cpu", g), term.targets.reduce_raw(pooled, "cpu"),
                               rtol=0, atol=1e-4)

    def train(targets, carried):
        torch.manual_seed(0)
        student = ConvNet(widths=(8, 16))
        rela = ReLA(targets, student, dense=student.features, feature_dim=16, n_components=3, total_steps=20,
                    schedule="constant:1", witness=False, alignment_check=False)
        opt = torch.optim.SGD(list(student.parameters()) + list(rela.parameters()), lr=0.05)
        losses = []
        for index, x, g, t in batches:
            student(torch.cat([x, x.flip(-1)]))  # two views of each sample: the crop and its mirror
            mirrored = g.clone()
            mirrored[:, 4] = 1 - g[:, 4]
            g2 = torch.cat([g, mirrored])
            loss = rela.wrap(torch.zeros(()), targets=t, geometry=g2) if carried else \
                rela.wrap(torch.zeros(()), index=index, geometry=g2)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    with pytest.warns(UserWarning, match="no data set was checked"):
        by_index = train(store, carried=False)
    carried = train(sidecars, carried=True)
    np.testing.assert_allclose(carried, by_index, rtol=1e-4, atol=1e-5)
    assert len(set(np.round(carried, 4))) == len(carried)  # (the batches differ: a real comparison)


def test_refusals_name_the_fix(data, prior, tmp_path):
    root, urls, spec, sidecars, store = data
    with pytest.raises(ValueError, match="pass one of them"):
        precompute_sidecars(prior, spec, tmp_path / "a", spatial=3, components=3, progress=False)
    from accelerate_ssl import StoredViews

    with pytest.raises(ValueError, match="views=.*pass one of them"):
        precompute_sidecars(prior, spec, tmp_path / "b", spatial=3, views=StoredViews(k=2), progress=False)
    pooled = precompute_sidecars(prior, spec, tmp_path / "pooled", batch_size=8, progress=False)
    batch = views_of(urls, pooled)[0]
    rela = ReLA(pooled, ConvNet(widths=(8, 16)), feature_dim=16, witness=False, total_steps=1)
    with pytest.raises(ValueError, match="these rows are pooled, one per sample: carry maps"):
        rela.priors["0"].build(16, "auto", "cpu")
        rela.wrap(torch.zeros(()), targets=batch[3], geometry=batch[2], features=torch.zeros(6, 16))
    with pytest.raises(ValueError, match="hold one row per image"):
        ReLA(pooled, ConvNet(widths=(8, 16)), dense=torch.nn.Identity(), feature_dim=16, witness=False)


def test_a_damaged_spatial_folder_is_refused(data, tmp_path):
    import shutil

    root, urls, spec, sidecars, store = data
    copy = tmp_path / "copy"
    shutil.copytree(sidecars.path, copy)
    meta = json.loads((copy / SIDECARS).read_text())
    meta["spatial"]["grid"] = [2, 2]  # the maps say 3x3
    (copy / SIDECARS).write_text(json.dumps(meta))
    with pytest.raises(SidecarError, match="rows of 27 values but .* says 12"):
        ShardedTargets.open(copy)[0]
    shutil.rmtree(copy)
    shutil.copytree(sidecars.path, copy)
    pca = next((copy / "pca").glob("write-*.safetensors"))
    other = next(f for f in (copy / "pca").iterdir() if f != pca) if len(list((copy / "pca").iterdir())) > 1 else None
    pca.write_bytes(pca.read_bytes()[:-8] + bytes(8)) if other is None else shutil.copy(other, pca)
    with pytest.raises(SidecarError, match="not the PCA the maps were reduced with"):
        ShardedTargets.open(copy).written_pca()


def test_cli_writes_spatial_sidecars(data, tmp_path, capsys):
    from accelerate_ssl.cli import main

    root, urls, spec, sidecars, store = data
    out = tmp_path / "cli"
    assert main(["precompute", "--prior", "random:convnet", "--data", spec, "--out", str(out), "--spatial", "3",
                 "--dtype", "float16", "--batch-size", "4", "--no-progress", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    opened = ShardedTargets.open(out)
    assert printed["dim"] == 3 and printed["spatial"]["grid"] == [3, 3] and opened.spatial["reduction"] == "pca"
    assert "--spatial 3" in opened.metadata["command"]
    torch.testing.assert_close(opened.maps(np.arange(N)), sidecars.maps(np.arange(N)), rtol=0, atol=2e-2)  # float16
    assert main(["store", "verify", str(out), "--data", spec, "--no-progress"]) == 0


def test_a_datasets_column_carries_each_rows_map(prior, tmp_path):
    """hf: sidecars with spatial=: the column hands each row its own map (any row order), and wrap pools views from
    it."""
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    ds = datasets.Dataset.from_dict({"image": [Image.fromarray(image_of(n)) for n in range(12)],
                                     "id": [f"img{n:03d}" for n in range(12)]},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "id": datasets.Value("string")}))
    ds.save_to_disk(str(tmp_path / "hf"))
    targets = precompute_sidecars(prior, f"hf:{tmp_path / 'hf'}", tmp_path / "side", batch_size=4, progress=False,
                                  spatial=True)
    order = [5, 0, 11, 3, 7, 1]
    column = targets.column(datasets.load_from_disk(str(tmp_path / "hf")).select(order)).with_format("torch")[:]
    carried = column["target"]
    assert carried.shape == (6, 9 * 256 + 1) and (carried[:, -1] == targets.tag).all()
    torch.testing.assert_close(targets.as_maps(carried[:, :-1]), live_maps(prior, order), rtol=0, atol=1e-5)
    rela = ReLA(targets, ConvNet(widths=(8, 16)), feature_dim=16, n_components=4, witness=False, total_steps=2)
    whole = torch.tensor([[0.0, 0.0, SIZE, SIZE, 0.0, SIZE, SIZE]]).repeat(6, 1)
    torch.testing.assert_close(rela.priors["0"].targets.reduce_rows(carried, "cpu", whole),
                               rela.priors["0"].targets.reduce_rows(carried, "cpu"), rtol=0, atol=1e-4)


def test_the_maps_pca_is_fitted_before_any_sidecar_and_a_lost_fit_recomputes_them(data, prior, tmp_path, monkeypatch):
    """spatial=k: the PCA is fitted first (no full map is ever written: every sidecar is as small as its reduced rows
    from the start), and a run resumed without its fit recomputes the sidecars rather than mix two bases."""
    import accelerate_ssl.targets.sidecar as sidecar

    root, urls, spec, sidecars, store = data
    written = []
    real = sidecar._write_sidecar
    monkeypatch.setattr(sidecar, "_write_sidecar", lambda file, shard, keys, rows, *a: written.append(
        (file.name, tuple(rows.shape))) or real(file, shard, keys, rows, *a))
    out = tmp_path / "k3"
    first = precompute_sidecars(prior, spec, out, batch_size=4, progress=False, spatial=3)
    assert sorted(written) == sorted((f"shard-{s:06d}.tar.safetensors", (n, 27)) for s, n in enumerate(SIZES))
    torch.testing.assert_close(first.maps(np.arange(N)), sidecars.maps(np.arange(N)), rtol=0, atol=1e-5)
    (out / SIDECARS).unlink()  # an unfinished run whose fit is gone, two of its sidecars written
    (out / "shard-000002.tar.safetensors").unlink()
    next((out / "pca").glob("write-*")).unlink()
    written.clear()
    again = precompute_sidecars(prior, spec, out, batch_size=4, progress=False, spatial=3)
    assert len(written) == 3  # every sidecar recomputed in the new fit's basis
    torch.testing.assert_close(again.maps(np.arange(N)), sidecars.maps(np.arange(N)), rtol=0, atol=1e-5)


def test_images_of_another_size_are_refused_naming_the_fix(tmp_path):
    """A prior that keeps the image's size (no resize) on shards whose images differ: refused at the fit and in the
    pass, naming the fix, instead of writing sidecars that cannot be read."""
    prior = create_prior("random:convnet", in_channels=1).eval()  # (its preprocessing keeps the input size)
    write_shards(tmp_path / "data", pixels=lambda shard: 24 if shard == 0 else 32)
    spec = f"wds:{tmp_path}/data/shard-{{000000..000002}}.tar"
    for spatial in (True, 3):
        with pytest.raises(ValueError, match=r"different sizes.*create it with size=<pixels>"):
            precompute_sidecars(prior, spec, tmp_path / f"s{spatial}", batch_size=8, progress=False, spatial=spatial)


def test_a_one_cell_map_is_carried_as_a_map(prior, tmp_path):
    """8 px images give a 1x1 map: carried rows are still maps (their mean is themselves), views pool from them."""
    write_shards(tmp_path / "data", pixels=lambda shard: 8)
    spec = f"wds:{tmp_path}/data/shard-{{000000..000002}}.tar"
    targets = precompute_sidecars(prior, spec, tmp_path / "side", batch_size=4, progress=False, spatial=3)
    assert targets.grid == (1, 1) and targets.width == targets.dim == 3
    carried = targets.carried(targets[np.arange(4)])
    rela = ReLA(targets, ConvNet(widths=(8, 16)), feature_dim=16, n_components=3, witness=False, total_steps=1)
    half = torch.tensor([[0.0, 0.0, 4.0, 8.0, 1.0, 8.0, 8.0]]).repeat(4, 1)
    torch.testing.assert_close(rela.priors["0"].targets.reduce_rows(carried, "cpu", half),
                               rela.priors["0"].targets.reduce_rows(carried, "cpu"), rtol=0, atol=1e-5)
