"""Targets for a view: geometry recorded by the crop/flip wrapper, boxes mapped onto a spatial store's map, RoIAlign
pooling (flip mirrored), and the pooled rows through rela.wrap(targets=)."""

import numpy as np
import pytest
import torch
from torchvision import transforms as T
from torchvision.transforms import v2

from _precompute_worker import tiny_dataset
from accelerate_ssl import ReLA
from accelerate_ssl.targets.views import RecordGeometry, grid_boxes, pool_boxes, view_targets, whole_image

N = 24


pytestmark = pytest.mark.usefixtures("cpu_one_thread")


@pytest.fixture(scope="module")
def store(tiny_spatial_store):
    return tiny_spatial_store


def _geometry(boxes, flips, size=16):
    return torch.tensor([[*b, float(f), size, size] for b, f in zip(boxes, flips)], dtype=torch.float32)


def test_a_whole_image_view_is_the_stores_own_row(store):
    idx = torch.tensor([3, 0, 17, 23])
    views = torch.stack([whole_image(16, 16, flip=bool(i % 2)) for i in range(4)])
    torch.testing.assert_close(view_targets(store, idx, views), store[idx], rtol=0, atol=1e-5)


def test_a_box_on_one_cell_is_that_cell_and_rows_are_the_indexed_ones(store):
    """Each box covering exactly map cell (r, c) (8x8 image pixels at stride 8) pools to that cell of that row's map."""
    cells = [(r, c) for r in range(2) for c in range(2)]

    def check(pool):
        idx = torch.tensor([5, 2, 11, 20])
        boxes = [(8 * c, 8 * r, 8 * c + 8, 8 * r + 8) for r, c in cells]
        got = pool(store, idx, _geometry(boxes, [0, 1, 0, 1]))
        want = torch.stack([store.maps(int(i))[:, r, c] for i, (r, c) in zip(idx, cells)])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    check(view_targets)
    # the same check catches a hand-made off-by-one row and an off-by-one cell
    with pytest.raises(AssertionError):
        check(lambda s, idx, g: view_targets(s, idx + 1, g))
    def next_column(g):  # the box one cell to the right (wrapping round)
        g = g.clone()
        g[:, [0, 2]] = (g[:, [0, 2]] + 8) % 16
        g[:, 2] = torch.where(g[:, 2] == 0, torch.full_like(g[:, 2], 16.0), g[:, 2])
        return g

    with pytest.raises(AssertionError):
        check(lambda s, idx, g: view_targets(s, idx, next_column(g)))


def test_a_flipped_box_pools_as_the_mirrored_box_of_the_mirrored_map():
    g = torch.Generator().manual_seed(0)
    maps = torch.randn(3, 4, 5, 7, generator=g)
    boxes = torch.tensor([[0.5, 1.0, 4.0, 4.5], [2.0, 0.0, 7.0, 5.0], [1.2, 2.2, 3.7, 4.1]])
    mirrored = torch.stack([7 - boxes[:, 2], boxes[:, 1], 7 - boxes[:, 0], boxes[:, 3]], 1)
    flipped = pool_boxes(maps, boxes, flips=[True, True, True], output_size=3)
    torch.testing.assert_close(flipped, pool_boxes(maps.flip(-1), mirrored, flips=None, output_size=3))
    plain = pool_boxes(maps, boxes, flips=[False, False, False], output_size=3)
    assert not torch.allclose(plain, flipped)  # the grid of a flipped view is mirrored ...
    torch.testing.assert_close(plain.mean((2, 3)), flipped.mean((2, 3)))  # ... its mean is not
    whole = pool_boxes(maps, torch.tensor([[0.0, 0.0, 7.0, 5.0]] * 3))
    torch.testing.assert_close(whole, maps.mean((2, 3)))  # a box equal to the map is the map's mean


def test_boxes_follow_the_priors_resize_and_centre_crop():
    # a 32x48 image, resized to a 16 px shorter side (16x24) and centre-cropped to 16x16 (4 px off each side),
    # seen by a 4x4 map of stride 4
    spatial, pre = {"grid": [4, 4], "stride": 4}, {"resize": 16, "crop": 16}
    geometry = torch.tensor([[8.0, 0.0, 40.0, 32.0, 0, 32, 48],  # the crop's region: the whole map
                             [8.0, 8.0, 16.0, 16.0, 0, 32, 48],  # pixels 4..8 of the input: cell 0..1
                             [0.0, 0.0, 8.0, 8.0, 1, 32, 48]])  # left of the crop: clamped to the map's edge
    boxes = grid_boxes(geometry, spatial, pre)
    torch.testing.assert_close(boxes[0], torch.tensor([0.0, 0.0, 4.0, 4.0]))
    torch.testing.assert_close(boxes[1], torch.tensor([0.0, 1.0, 1.0, 2.0]))
    assert boxes[2, 0] == 0 and boxes[2, 2] > 0  # a sliver at the edge, never an empty box
    native = grid_boxes(torch.tensor([[4.0, 8.0, 12.0, 16.0, 0, 28, 28]]), {"grid": [3, 3], "stride": 8}, {})
    torch.testing.assert_close(native[0], torch.tensor([0.5, 1.0, 1.5, 2.0]))  # a 28 px ConvNet map: 8 px a cell
    with pytest.raises(ValueError, match="not inside its 16x16 image"):
        grid_boxes(_geometry([(4, 4, 20, 8)], [0]), spatial, pre)
    with pytest.raises(ValueError, match=r"geometry is \[B, 7\]"):
        grid_boxes(torch.zeros(2, 5), spatial, pre)


@pytest.mark.parametrize("api", [T, v2])
def test_record_geometry_does_what_the_transforms_do_and_says_where(api):
    from PIL import Image

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, size=(30, 40, 3), dtype=np.uint8))
    crop, flip = api.RandomResizedCrop(12, scale=(0.1, 0.6)), api.RandomHorizontalFlip()
    to_tensor = T.PILToTensor()
    recorder = RecordGeometry(crop, flip, to_tensor)
    for seed in range(6):
        torch.manual_seed(seed)
        view, geometry = recorder(image)
        x1, y1, x2, y2, flipped, height, width = geometry.tolist()
        assert (height, width) == (30, 40) and 0 <= x1 < x2 <= 40 and 0 <= y1 < y2 <= 30
        # the pixels: the recorded box resized, flipped as recorded
        region = to_tensor(image)[:, int(y1):int(y2), int(x1):int(x2)][None].float()
        expected = torch.nn.functional.interpolate(region, size=(12, 12), mode="bilinear", antialias=True,
                                                   align_corners=False)[0]
        expected = expected.flip(-1) if flipped else expected
        assert view.shape == (3, 12, 12) and (view.float() - expected).abs().mean() < 2.0
        if api is T:  # the same random numbers and pixels as the transforms themselves
            torch.manual_seed(seed)
            assert torch.equal(view, T.Compose([crop, flip, to_tensor])(image))
    with pytest.raises(TypeError, match="RandomResizedCrop"):
        RecordGeometry(T.CenterCrop(8))


def test_pooled_view_rows_train_through_wrap_targets(store):
    """A user's loop: two recorded views per image, their pooled targets stacked as the views' features are."""
    data = tiny_dataset(N)
    recorder = RecordGeometry(T.RandomResizedCrop(16, scale=(0.2, 1.0)), T.RandomHorizontalFlip(), T.PILToTensor())
    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 12))
    rela = ReLA(store, backbone, feature_dim=12, n_components=4, total_steps=4)
    idx = torch.tensor([1, 6, 9, 14])
    from PIL import Image

    views = [[recorder(Image.fromarray(np.asarray(data[int(i)][0]))) for i in idx] for _ in range(2)]
    images = [torch.stack([v for v, _ in vs]).float() / 255 for vs in views]
    geometry = [torch.stack([g for _, g in vs]) for vs in views]
    backbone(torch.cat(images))  # both views in one call: rows [view 1's batch; view 2's batch], as the targets
    targets = torch.cat([view_targets(store, idx, g) for g in geometry])
    assert targets.shape == (8, 5)
    loss = rela.wrap(torch.tensor(0.0), targets=targets)
    assert torch.isfinite(loss) and loss.requires_grad
    with pytest.raises(ValueError, match="needs a spatial store"):
        view_targets(object(), idx, geometry[0])  # a store of pooled rows has no spatial metadata


def test_the_readme_block_is_lines_of_a_loop_that_runs(tmp_path, monkeypatch, fashion_mnist_available):
    """Every code line of the targets page's spatial-store block is a line of tests/recipes/spatial_views.py, which trains a
    few steps on real images: each step's targets are the stored maps pooled over that step's recorded boxes."""
    import runpy
    from pathlib import Path

    import accelerate_ssl.targets.views as views
    from recipe_check import DOCS, code

    script = Path(__file__).with_name("recipes") / "spatial_views.py"
    text = (DOCS / "concepts" / "targets.md").read_text()
    block = text[text.index("**Spatial stores: a target for any crop.**"):].split("```python\n", 1)[1].split("```")[0]
    lines = [code(line) for line in block.splitlines()]
    lines = [line for line in lines if line and not line.startswith(("#", "..."))]
    script_lines = {code(line) for line in script.read_text().splitlines()}
    assert len(lines) == 7 and [line for line in lines if line not in script_lines] == []
    pooled, real = [], views.view_targets
    monkeypatch.setattr(views, "view_targets", lambda *a, **k: pooled.append((a, real(*a, **k))) or pooled[-1][1])
    monkeypatch.chdir(tmp_path)
    run = runpy.run_path(str(script), run_name="__main__")
    assert len(run["losses"]) == 4 and all(np.isfinite(run["losses"]))
    store = run["store"]
    assert store.spatial["grid"] == [3, 3] and store.components == 32 and store.dtype == "float16"
    # wrap pooled the views of every step before the default schedule handed over (at half the run at the latest)
    assert len(run["carried"]) == 4 and run["ran"][0] and len(pooled) == sum(run["ran"]) >= 2
    ran = [c for c, r in zip(run["carried"], run["ran"]) if r]
    for (index, g1, g2), ((_, rows_index, geometry), targets) in zip(ran, pooled):
        assert torch.equal(rows_index, torch.cat([index, index])) and torch.equal(geometry, torch.cat([g1, g2]))
        maps = store.maps(index)
        assert targets.shape == (2 * len(index), 32)
        # each view's target is its own image's stored map pooled over its own recorded box
        for g, rows in ((g1, targets[: len(index)]), (g2, targets[len(index):])):
            torch.testing.assert_close(rows, pool_boxes(maps, grid_boxes(g, store.spatial, store.metadata["preprocess"])))
        assert not torch.allclose(targets[: len(index)], store[index], atol=1e-3)  # not the whole-image rows


def _rela(store, seed=0):
    torch.manual_seed(seed)
    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 12))
    return backbone, ReLA(store, backbone, dataset=tiny_dataset(N), feature_dim=12, n_components=4, total_steps=4,
                          witness=False)


def test_wrap_geometry_pools_each_views_rows_at_the_batchs_index(store):
    """wrap(index=, geometry=) is wrap(targets=) with the rows view_targets pools at that index, for two views stacked
    as the features are; whole-image views give the index path's loss; refusals name the fix."""
    idx = torch.tensor([2, 5, 11, 20])
    g = torch.cat([_geometry([(0, 0, 8, 16), (4, 4, 16, 16), (0, 8, 16, 16), (2, 2, 14, 14)], [0, 1, 0, 1]),
                   _geometry([(8, 0, 16, 16), (0, 0, 16, 8), (3, 1, 11, 9), (0, 0, 16, 16)], [1, 0, 0, 0])])
    x = torch.rand(8, 1, 16, 16)
    losses = {}
    for how in ("geometry", "targets"):
        backbone, rela = _rela(store)
        feats = backbone(x)
        kw = {"index": idx, "geometry": g} if how == "geometry" else {
            "targets": view_targets(store, idx.repeat(2), g)}
        losses[how] = rela.wrap(torch.tensor(0.0), features=feats, **kw)
    torch.testing.assert_close(losses["geometry"], losses["targets"])
    whole = torch.stack([whole_image(16, 16) for _ in range(4)])
    out = {}
    for how in ("geometry", "index"):
        backbone, rela = _rela(store)
        feats = backbone(x[:4])
        out[how] = rela.wrap(torch.tensor(0.0), features=feats, index=idx,
                             **({"geometry": whole} if how == "geometry" else {}))
    torch.testing.assert_close(out["geometry"], out["index"], rtol=1e-5, atol=1e-6)
    backbone, rela = _rela(store)
    with pytest.raises(ValueError, match="3 is not a whole number of views of the 4 samples"):
        rela.wrap(torch.tensor(0.0), features=backbone(x[:4]), index=idx, geometry=g[:3])
    flat = ReLA(torch.randn(N, 6), backbone, feature_dim=12, total_steps=4, witness=False)
    with pytest.raises(ValueError, match="spatial=k"):
        flat.wrap(torch.tensor(0.0), features=backbone(x[:4]), index=idx, geometry=g[:4])
    with pytest.raises(ValueError, match="these rows are pooled, one per sample: carry maps"):
        rela.wrap(torch.tensor(0.0), features=backbone(x[:4]), targets=store[idx], geometry=g[:4])


def test_random_views_geometry_is_the_box_the_view_shows():
    """The box random_views reports, sampled at the view's pixel centres (RoIAlign, one sample per bin: what the
    affine resample reads) and mirrored when flipped, is the view itself."""
    from torchvision.ops import roi_align

    from accelerate_ssl.recipes import ViewConfig, random_views

    x = torch.rand(6, 1, 32, 32)
    cfg = ViewConfig(scale=(0.3, 0.9), jitter=0.0)
    plain = random_views(x, cfg, torch.Generator().manual_seed(3))
    views, geometry = random_views(x, cfg, torch.Generator().manual_seed(3), geometry=True)
    assert torch.equal(views, plain) and geometry.shape == (6, 7)  # the same draws, the same views
    assert set(geometry[:, 4].tolist()) == {0.0, 1.0} and (geometry[:, 5:] == 32).all()
    rois = torch.cat([torch.arange(6.0)[:, None], geometry[:, :4]], 1)
    crops = roi_align(x, rois, output_size=32, spatial_scale=1.0, sampling_ratio=1, aligned=True)
    crops = torch.where(geometry[:, 4, None, None, None] > 0.5, crops.flip(-1), crops)
    torch.testing.assert_close(crops, views, rtol=0, atol=1e-5)
    assert (crops - views.flip(-1)).abs().max() > 0.1  # the comparison sees a wrong flip


def test_train_ssl_per_view_passes_each_views_pooled_rows(store, monkeypatch):
    """train_ssl(per_view=True) hands wrap the geometry of the views it drew, one row per view, and trains."""
    from accelerate_ssl.recipes import create_method, train_ssl

    seen = []
    real = ReLA.wrap

    def spy(self, loss, **kw):
        seen.append(kw)
        return real(self, loss, **kw)

    monkeypatch.setattr(ReLA, "wrap", spy)
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    method = create_method("vicreg", backbone, 8)
    rela = ReLA(store, backbone, dataset=tiny_dataset(N), feature_dim=8, n_components=4, total_steps=3, witness=False)
    x = torch.rand(N, 1, 16, 16)
    batches = iter([(x[i:i + 6], torch.arange(i, i + 6)) for i in (0, 6, 12)])
    log = train_ssl(method, batches, 3, optimizer=torch.optim.AdamW(list(method.parameters()) + list(rela.parameters())),
                    view_generator=torch.Generator().manual_seed(1), rela=rela, rela_views="weak", per_view=True)
    assert len(log["step_seconds"]) == 3 and len(seen) == 3
    for kw in seen:
        views = kw["geometry"].shape[0] // 6  # one view while lambda = 1 (one-view steps), else both
        assert kw["geometry"].shape == (6 * views, 7) and kw["features"].shape == (6 * views, 8)
        assert len(kw["index"]) == 6 and views in (1, 2)
        assert ((kw["geometry"][:, 2] - kw["geometry"][:, 0]) < 16).any()  # weak views crop: not every box is whole
    with pytest.raises(ValueError, match="Pass one"):
        train_ssl(method, batches, 1, optimizer=torch.optim.SGD(method.parameters(), lr=0.1),
                  view_generator=torch.Generator(), rela=rela, per_view=True, teacher=lambda v: v)
