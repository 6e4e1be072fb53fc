"""What enters ReLA.wrap besides the rows' identity (accelerate_ssl/rela/validate.py): views, geometry, the student's
map for the dense term, several stores. A property-based test over random shapes and orders shows every wrong
combination refused and every right one accepted; the cases a user meets are then tried through ReLA itself."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _precompute_worker import tiny_dataset
from accelerate_ssl import ReLA
from accelerate_ssl.backbones import ConvNet
from accelerate_ssl.rela.validate import Views, check_batch, check_student_maps, count_views
from accelerate_ssl.targets.views import whole_image

N = 24
pytestmark = pytest.mark.usefixtures("cpu_one_thread")
PROPERTY = settings(max_examples=300, deadline=None, database=None)

# the stores a batch meets, as validate sees them: a prior that keeps the image's size (28 px in, a 3x3 map), and
# one that resizes every image (any size maps through the resize)
KEEPS_SIZE = types.SimpleNamespace(spatial={"grid": [3, 3], "input_size": [28, 28], "stride": 8},
                                   preprocess={"resize": None, "crop": None})
RESIZES = types.SimpleNamespace(spatial={"grid": [7, 7], "input_size": [224, 224], "stride": 32},
                                preprocess={"resize": 256, "crop": 224})


def _terms(store, channels=None):
    dense = None if channels is None else types.SimpleNamespace(linear=types.SimpleNamespace(in_features=channels))
    return {"0": types.SimpleNamespace(store=store, dense=dense)}


def _boxes(draw, n: int, height: int, width: int) -> torch.Tensor:
    """``n`` random boxes inside a ``height x width`` image, with random flips, as RecordGeometry records them."""
    rows = []
    for _ in range(n):
        x1 = draw(st.integers(0, width - 2))
        y1 = draw(st.integers(0, height - 2))
        x2 = draw(st.integers(x1 + 1, width))
        y2 = draw(st.integers(y1 + 1, height))
        rows.append([x1, y1, x2, y2, draw(st.integers(0, 1)), height, width])
    return torch.tensor(rows, dtype=torch.float32)


WRONG_GEOMETRY = ("one view for all", "some of the views", "more views", "ragged", "same block twice",
                  "same boxes within a pixel", "views of other images", "another image size", "not 7 fields")


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two view blocks whose boxes are within a pixel of each other, flipped alike, for every sample."""
    return bool((((a[:, :4] - b[:, :4]).abs().amax(1) <= 1) & (a[:, 4:] == b[:, 4:]).all(1)).all())


@st.composite
def batches(draw):
    """A batch of ``n`` samples seen in ``v`` views (one backbone call per view, or all views in one call) and its
    geometry, right (stacked or as a list of blocks, in the features' order) or wrong in one way of
    :data:`WRONG_GEOMETRY`, against a store that keeps the image's size or one that resizes."""
    n, v = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    store = draw(st.sampled_from([KEEPS_SIZE, RESIZES]))
    sizes = [(28, 28)] * n if store is KEEPS_SIZE else [(draw(st.integers(8, 64)), draw(st.integers(8, 64)))
                                                         for _ in range(n)]
    blocks = [torch.cat([_boxes(draw, 1, h, w) for h, w in sizes]) for _ in range(v)]
    for j in range(1, v):  # random crops of several images never coincide all at once: keep the draws apart
        if any(_alike(blocks[j], blocks[k]) for k in range(j)):  # sample 0's box moved off the earlier views'
            h, w = sizes[0]
            blocks[j][0] = next(box for box in (torch.tensor([x, 0, x + 2, 2, f, h, w], dtype=torch.float32)
                                                for x in range(0, w - 1, 3) for f in (0, 1))
                                if not any(_alike(box[None], blocks[k][:1]) for k in range(j)))
    one_call = draw(st.booleans())
    features = [torch.zeros(v * n, 3)] if one_call else [torch.zeros(n, 3) for _ in range(v)]
    possible = [w for w in WRONG_GEOMETRY if not (
        (w in ("one view for all", "some of the views", "same block twice", "same boxes within a pixel",
               "views of other images") and v < 2)
        or (w in ("same block twice", "same boxes within a pixel") and n < 4)
        or (w == "ragged" and v * n < 2)
        or (w == "another image size" and store is RESIZES))]
    wrong = draw(st.sampled_from([None, None, *possible]))
    geometry = torch.cat(blocks)
    if wrong == "one view for all":
        geometry = blocks[0]
    elif wrong == "some of the views":
        geometry = torch.cat(blocks[: draw(st.integers(1, v - 1))])
    elif wrong == "more views":
        geometry = torch.cat(blocks + [blocks[0].flip(0) if n > 1 else blocks[0]])
    elif wrong == "ragged":
        geometry = geometry[:-1]
    elif wrong == "same block twice":
        j = draw(st.integers(1, v - 1))
        geometry = torch.cat([*blocks[:j], blocks[0], *blocks[j + 1:]])
    elif wrong == "same boxes within a pixel":  # view 0's boxes again, each side moved by at most a pixel
        j = draw(st.integers(1, v - 1))
        near = blocks[0].clone()
        near[:, :4] += torch.tensor([[draw(st.sampled_from([-1, 0, 1])) for _ in range(4)] for _ in range(n)])
        near[:, :4] = torch.minimum(near[:, :4].clamp_min(0), near[:, [6, 5, 6, 5]])
        if not bool(((near[:, 0] < near[:, 2]) & (near[:, 1] < near[:, 3])).all()):
            near = blocks[0]
        geometry = torch.cat([*blocks[:j], near, *blocks[j + 1:]])
    elif wrong == "views of other images":  # view j's rows come from another image (another size) for one sample
        j, i = draw(st.integers(1, v - 1)), draw(st.integers(0, n - 1))
        other = blocks[j].clone()
        other[i] = _boxes(draw, 1, int(other[i, 5]) + 4, int(other[i, 6]) + 4)[0]
        geometry = torch.cat([*blocks[:j], other, *blocks[j + 1:]])
    elif wrong == "another image size":
        h = draw(st.sampled_from([14, 27, 29, 56]))
        geometry = torch.cat([_boxes(draw, v * n, h, h)])
    elif wrong == "not 7 fields":
        geometry = geometry[:, :6]
    as_list = wrong is None and v > 1 and draw(st.booleans())
    return n, v, store, features, ([b for b in blocks] if as_list else geometry), wrong, blocks


@PROPERTY
@given(batches())
def test_every_wrong_geometry_is_refused_and_every_right_one_accepted(batch):
    n, v, store, features, geometry, wrong, blocks = batch
    index = {"0": torch.arange(n)}
    if wrong is None:
        views, g = check_batch(_terms(store), features, index=index, geometry=geometry)
        assert (views.n, views.views) == (n, v)
        assert torch.equal(g, torch.cat(blocks))  # the blocks in the features' order, as given
    else:
        with pytest.raises(ValueError, match=r"ReLA\.wrap\(geometry=\)|A view's geometry is \[B, 7\]"):
            check_batch(_terms(store), features, index=index, geometry=geometry)


@st.composite
def student_maps(draw):
    """The dense term's captured map for ``v`` views of ``n`` samples: channels first (right), or channels last (as
    Swin / NHWC ConvNeXt give it), one cell (pooled features), a map per sample only, or another channel count than
    the head was built for. Maps have more channels than cells per side (every student's last map)."""
    n, v = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    h = draw(st.integers(2, 8))
    w = draw(st.sampled_from([h, h, draw(st.integers(2, 8))]))
    c = draw(st.integers(max(h, w) + 1, 64))
    built = draw(st.sampled_from([None, c]))
    wrong = draw(st.sampled_from([None, None, "channels last", "one cell", "one view", "other channels"]))
    if wrong == "channels last" and built is None and h != w:  # a non-square NHWC map is told by the built head only
        built = c
    if wrong == "one view" and v == 1:
        wrong = None
    if wrong == "other channels":  # the head was built on another map
        built = c + 1
    shape = {"channels last": (v * n, h, w, c), "one cell": (v * n, c, 1, 1), "one view": (n, c, h, w)}.get(
        wrong, (v * n, c, h, w))
    return Views(n, v), torch.zeros(shape), built, wrong


@PROPERTY
@given(student_maps())
def test_every_wrong_student_map_is_refused_and_every_right_one_accepted(case):
    views, maps, built, wrong = case
    if wrong is None:
        check_student_maps(maps, views, built)
    else:
        with pytest.raises(ValueError, match=r"ReLA\(dense=\)"):
            check_student_maps(maps, views, built)


@PROPERTY
@given(st.integers(1, 8), st.lists(st.integers(1, 4), min_size=1, max_size=4), st.booleans(),
       st.sampled_from(["per sample", "per view", "other"]))
def test_views_of_indexed_and_carried_rows(n, views_per_call, carried, rows):
    """Features in calls of whole views of ``n`` samples are accepted for ``n`` indices, or for rows carried one per
    sample or one per view (equal calls); a call of part of the views, or another number of rows, is refused."""
    blocks = [k * n for k in views_per_call]
    total = sum(blocks)
    if not carried:
        assert count_views(blocks, samples=n) == Views(n, total // n)
        if n > 1:
            with pytest.raises(ValueError, match="whole views of the batch"):
                count_views(blocks + [n - 1], samples=n)
        return
    if rows == "per sample":
        assert count_views(blocks, carried=n) == Views(n, total // n)
    elif rows == "per view" and len(set(blocks)) == 1 and len(blocks) > 1:
        assert count_views(blocks, carried=total) == Views(blocks[0], len(blocks), per_view_rows=True)
    else:
        r = total + 1  # neither one per sample nor one per view
        with pytest.raises(ValueError, match=r"carries \d+ rows but the student's features hold"):
            count_views(blocks, carried=r)


# ---------------------------------------------------------------------------------------------- through ReLA
@pytest.fixture(scope="module")
def store(tiny_spatial_store):
    return tiny_spatial_store  # 24 random 16 px images, a random ConvNet prior that keeps their size: a 2x2 map


def images(idx):
    return torch.as_tensor(tiny_dataset(N).data[idx.numpy()], dtype=torch.float32).unsqueeze(1) / 255


def _rela(store, dense=False, **kw):
    torch.manual_seed(0)
    student = ConvNet(widths=(8, 16))  # .features: a [B, 16, 4, 4] map of a 16 px image
    kw = {"dataset": tiny_dataset(N), "feature_dim": 16, "n_components": 4, "total_steps": 50, "witness": False,
          "schedule": "constant:1", **kw}
    return student, ReLA(store, student, dense=student.features if dense else None, **kw)


def _crops(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x1, y1 = torch.randint(0, 7, (2,), generator=g).tolist()
        out.append([x1, y1, x1 + 9, y1 + 9, float(torch.rand(1, generator=g) < 0.5), 16, 16])
    return torch.tensor(out)


def test_geometry_of_one_view_for_two_or_some_of_four_views_is_refused_naming_the_fix(store):
    """Before: one view's boxes for two views' features trained both views toward view 0's box; two of four views failed
    with a raw torch shape error."""
    idx = torch.arange(6)
    student, rela = _rela(store)
    g0, g1 = _crops(6, 0), _crops(6, 1)
    student(images(idx)), student(images(idx).flip(-1))
    with pytest.raises(ValueError, match=r"one view's boxes for the features' 2 views.*torch\.cat\(\[g0, g1\]\)"):
        rela.wrap(torch.tensor(0.0), index=idx, geometry=g0)
    student(images(idx)), student(images(idx)), student(images(idx)), student(images(idx))
    with pytest.raises(ValueError, match=r"2 views' boxes for the features' 4 views"):
        rela.wrap(torch.tensor(0.0), index=idx, geometry=torch.cat([g0, g1]))


def test_the_same_block_twice_is_refused_and_whole_images_pass(store):
    idx = torch.arange(6)
    student, rela = _rela(store)
    g0 = _crops(6, 0)
    student(images(idx)), student(images(idx))
    with pytest.raises(ValueError, match=r"views 0 and 1 have the same geometry, box for box"):
        rela.wrap(torch.tensor(0.0), index=idx, geometry=torch.cat([g0, g0]))
    whole = torch.stack([whole_image(16, 16)] * 12)  # two views that are the whole image: legitimately the same
    student(images(idx)), student(images(idx))
    rela.wrap(torch.tensor(0.0), index=idx, geometry=whole)


def test_boxes_within_a_pixel_are_refused_from_four_samples_and_warned_below(store):
    """Before: the same block twice passed silently below 4 samples, and boxes a pixel apart at any batch size."""
    g0 = _crops(6, 0)
    near = g0.clone()
    near[:, 0] = (near[:, 0] + 1).clamp(max=6)  # every box's left edge a pixel further (still inside, still 9 px wide)
    for n, geometry in ((6, torch.cat([g0, near])), (6, torch.cat([g0, g0]))):
        idx = torch.arange(n)
        student, rela = _rela(store)
        student(images(idx)), student(images(idx))
        with pytest.raises(ValueError, match=r"views 0 and 1 have (boxes within 1 px of each other|the same geometry, "
                                             r"box for box), for all 6 sample\(s\).*geometry=torch\.cat\(\[g0, g1\]\)"):
            rela.wrap(torch.tensor(0.0), index=idx, geometry=geometry)
    for n in (1, 2, 3):  # two random crops of one image can coincide by chance: said, not refused
        idx = torch.arange(n)
        student, rela = _rela(store)
        student(images(idx)), student(images(idx))
        with pytest.warns(UserWarning, match=rf"views 0 and 1 have the same geometry, box for box, for all {n} "
                                             rf"sample\(s\).*not refused; from 4 samples on it is"):
            rela.wrap(torch.tensor(0.0), index=idx, geometry=torch.cat([g0[:n], g0[:n]]))
    idx = torch.arange(2)
    student, rela = _rela(store)
    student(images(idx)), student(images(idx))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # views of their own: nothing said
        rela.wrap(torch.tensor(0.0), index=idx, geometry=torch.cat([_crops(2, 0), _crops(2, 1)]))


def test_per_view_rows_passed_as_targets_get_the_checks_of_geometry(store):
    """Before: rows of boxes recorded on images of another size than the store's, made with view_targets and passed as
    wrap(targets=), skipped the image-size check that wrap(geometry=) makes; so did the same view's boxes twice."""
    from accelerate_ssl.targets.views import pool_views, view_targets

    idx = torch.arange(6)
    upscaled = torch.cat([_crops(6, 0), _crops(6, 1)]) * torch.tensor([2, 2, 2, 2, 1, 2, 2])
    with pytest.raises(ValueError, match=r"view_targets: view row 0's box was recorded on a 32x32 image, but the "
                                         r"store's prior saw images of 16x16.*create_prior\(spec, size=\.\.\.\)"):
        view_targets(store, idx.repeat(2), upscaled)
    with pytest.raises(ValueError, match=r"pool_views: view row 0's box was recorded on a 32x32 image"):
        pool_views(store.maps(idx.repeat(2)), upscaled, store.spatial, store.preprocess)
    g0 = _crops(6, 0)
    with pytest.raises(ValueError, match=r"view_targets: views 0 and 1 have the same geometry, box for box"):
        view_targets(store, idx.repeat(2), torch.cat([g0, g0]))
    with pytest.warns(UserWarning, match=r"view_targets: views 0 and 1 have the same geometry.*for all 2 sample"):
        view_targets(store, idx[:2].repeat(2), torch.cat([g0[:2], g0[:2]]))
    rows = view_targets(store, idx.repeat(2), torch.cat([g0, _crops(6, 1)]))  # right: rows as before
    student, rela = _rela(store)
    student(images(idx)), student(images(idx).flip(-1))
    assert torch.isfinite(rela.wrap(torch.tensor(0.0), targets=rows))


def test_a_list_of_blocks_is_the_views_in_order(store):
    """Before: torch.as_tensor of a list of tensors raised a raw ValueError."""
    idx = torch.arange(6)
    g0, g1 = _crops(6, 0), _crops(6, 1)
    losses = []
    for geometry in ([g0, g1], torch.cat([g0, g1])):
        student, rela = _rela(store)
        student(images(idx)), student(images(idx).flip(-1))
        losses.append(rela.wrap(torch.tensor(0.0), index=idx, geometry=geometry))
    torch.testing.assert_close(losses[0], losses[1])


def test_boxes_recorded_on_images_of_another_size_are_refused(store):
    """The store's prior kept its 16 px images' size: boxes on a 32 px copy would be clamped at the map's edge."""
    idx = torch.arange(6)
    student, rela = _rela(store)
    upscaled = _crops(12, 0) * torch.tensor([2, 2, 2, 2, 1, 2, 2])
    student(images(idx)), student(images(idx))
    with pytest.raises(ValueError, match=r"recorded on a 32x32 image, but the store's prior saw images of 16x16.*"
                                         r"create_prior\(spec, size=\.\.\.\)"):
        rela.wrap(torch.tensor(0.0), index=idx, geometry=upscaled)


class _Stage(torch.nn.Module):
    """The student's last stage as a model may give it: channels first, channels last (Swin, NHWC ConvNeXt), or pooled
    to one cell."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout

    def forward(self, x):
        return {"nchw": x, "nhwc": x.permute(0, 2, 3, 1), "pooled": x.mean((2, 3), keepdim=True)}[self.layout]


class _Student(torch.nn.Module):
    def __init__(self, layout: str):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 16, 3, stride=4, padding=1)  # a 16 px image -> a 4x4 map of 16 channels
        self.stage = _Stage(layout)

    def forward(self, x):
        m = self.stage(self.conv(x))
        return m.flatten(1, -2).mean(1) if self.stage.layout == "nhwc" else m.mean((2, 3))


@pytest.mark.parametrize("layout, message", [("nhwc", r"looks channels-last.*permute\(0, 3, 1, 2\)"),
                                             ("pooled", r"one cell: pooled features, not a map")])
def test_channels_last_and_one_cell_student_maps_are_refused(store, layout, message):
    """Before: a channels-last map was read as a few channels on a wrong grid, a [B, C, 1, 1] map pulled toward
    every cell of the stored map."""
    idx = torch.arange(6)
    student = _Student(layout)
    rela = ReLA(store, student, dense=student.stage, dataset=tiny_dataset(N), feature_dim=16, n_components=4,
                total_steps=10, witness=False)
    student(images(idx))
    with pytest.raises(ValueError, match=message):
        rela.wrap(torch.tensor(0.0), index=idx)
    right = _Student("nchw")
    rela = ReLA(store, right, dense=right.stage, dataset=tiny_dataset(N), feature_dim=16, n_components=4,
                total_steps=10, witness=False)
    right(images(idx))
    rela.wrap(torch.tensor(0.0), index=idx)


def test_a_map_coarser_than_the_stored_grid_is_compared_on_its_grid(store):
    """Before: a student map coarser than the stored grid was stretched over it. Now both are averaged onto the
    coarser grid: a 1x2 student map against the stored 2x2 maps' rows averaged (by hand)."""
    import torch.nn.functional as F

    class Wide(torch.nn.Module):  # a 1x2 map: a [B, 16, 4, 4] map pooled to one row of two cells
        def forward(self, x):
            return F.adaptive_avg_pool2d(x, (1, 2))

    idx = torch.tensor([1, 4, 9, 13, 20, 22])
    torch.manual_seed(0)
    conv, wide = torch.nn.Conv2d(1, 16, 3, stride=4, padding=1), Wide()
    student = torch.nn.Sequential(conv, wide, torch.nn.Flatten(), torch.nn.Linear(32, 16))
    rela = ReLA(store, student, dense=wide, dataset=tiny_dataset(N), feature_dim=16, n_components=4,
                schedule="constant:1", total_steps=10, witness=False, dense_only=True)
    captured = []
    wide.register_forward_hook(lambda m, a, out: captured.append(out))
    loss = rela.wrap(torch.tensor(0.0), index=idx, features=student(images(idx)))
    term = rela.priors["0"]
    assert term.dense.linear.weight.shape == (4, 16)
    target_maps = store.maps(idx).mean(2, keepdim=True)  # [B, 5, 1, 2]: the stored 2x2 maps' rows averaged
    target = term.targets.reduce_raw(target_maps.permute(0, 2, 3, 1).reshape(-1, 5), torch.device("cpu"))
    feats = captured[0].permute(0, 2, 3, 1).reshape(-1, 16)
    dense = (1 - F.cosine_similarity(term.dense.linear(feats), target, dim=1)).mean()
    torch.testing.assert_close(loss, dense, rtol=1e-5, atol=1e-6)


def test_a_one_cell_store_is_refused_for_the_dense_term_and_said_for_geometry(tmp_path):
    """A prior whose map is 1x1 at this input size (a ConvNet at 8 px): before, every per-view target was silently the
    whole image's row."""
    import numpy as np

    import accelerate_ssl.targets.precompute as pc
    from accelerate_ssl.data.datasets import ArrayImageDataset
    from accelerate_ssl.priors import create_prior

    small = ArrayImageDataset(np.random.default_rng(0).integers(0, 256, (12, 8, 8), dtype=np.uint8), np.zeros(12),
                              name="8px")
    one_cell = pc.precompute_targets(create_prior("random:convnet"), small, tmp_path / "s", batch_size=4,
                                     progress=False, spatial=True)
    assert one_cell.grid == (1, 1) or list(one_cell.grid) == [1, 1]
    student = ConvNet(widths=(8, 16))
    with pytest.raises(ValueError, match=r"map is one cell \(1x1.*create_prior\(spec, size=\.\.\.\)"):
        ReLA(one_cell, student, dense=student.features, dataset=small, feature_dim=16, witness=False)
    rela = ReLA(one_cell, student, dataset=small, feature_dim=16, n_components=4, total_steps=10, witness=False)
    idx = torch.arange(4)
    x = torch.as_tensor(small.data[:4], dtype=torch.float32).unsqueeze(1) / 255
    student(x), student(x.flip(-1))
    g = torch.tensor([[0, 0, 6, 6, 0, 8, 8], [1, 1, 7, 8, 1, 8, 8], [2, 0, 8, 5, 0, 8, 8], [0, 2, 5, 8, 1, 8, 8]] * 2,
                     dtype=torch.float32)
    g[4:, :2] += 2  # view 1: every box 2 px from view 0's (its own crop)
    with pytest.warns(UserWarning, match=r"the store's map is one cell \(1x1\).*as without geometry="):
        rela.wrap(torch.tensor(0.0), index=idx, geometry=g)


def test_per_view_rows_carried_after_one_backbone_call_per_view(store):
    """Before: view_targets of every view passed as targets=, after one backbone call per view, was refused with a
    question about an index= never passed. Now the rows are one per view, stacked as the features: the same loss as
    geometry= with index=, and the witness sees per-view rows."""
    from accelerate_ssl.targets.views import view_targets

    idx = torch.arange(6)
    g = torch.cat([_crops(6, 0), _crops(6, 1)])
    losses = []
    for how in ("targets", "geometry"):
        student, rela = _rela(store)
        student(images(idx)), student(images(idx).flip(-1))
        if how == "targets":
            losses.append(rela.wrap(torch.tensor(0.0), targets=view_targets(store, idx.repeat(2), g)))
        else:
            losses.append(rela.wrap(torch.tensor(0.0), index=idx, geometry=g))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    student, rela = _rela(store)
    student(images(idx)), student(images(idx).flip(-1))
    with pytest.raises(ValueError, match=r"carries 7 rows but the student's features hold 12 rows in 2 backbone calls "
                                         r"of \[6, 6\]: pass one row per sample.*or one row per view"):
        rela.wrap(torch.tensor(0.0), targets=view_targets(store, torch.arange(7), _crops(7, 0)))


# ---------------------------------------------------------------------------------------------- several stores
def test_the_same_store_under_two_names_is_refused(store, tmp_path):
    """Before: two heads were trained on one prior without a word."""
    import shutil

    from accelerate_ssl.targets.store import TargetStore

    student = ConvNet(widths=(8, 16))
    with pytest.raises(ValueError, match=r"same targets as prior 'a' and prior 'b'"):
        ReLA({"a": store, "b": store}, student, feature_dim=16, witness=False)
    with pytest.raises(ValueError, match=r"same targets as prior 'a' and prior 'b' \(folder"):
        ReLA({"a": str(store.path), "b": str(store.path)}, student, feature_dim=16, witness=False)
    shutil.copytree(store.path, tmp_path / "copy")
    with pytest.raises(ValueError, match=r"same targets as prior 'a' and prior 'b' \(targets_sha256"):
        ReLA({"a": store, "b": TargetStore.open(tmp_path / "copy")}, student, feature_dim=16, witness=False)
    rows = torch.randn(N, 6)
    with pytest.raises(ValueError, match=r"rows_sha256"):
        ReLA([rows, rows.clone()], student, feature_dim=16, witness=False)


def test_stores_of_different_lengths_are_refused_naming_the_priors(store):
    """Before: an IndexError at the first batch reaching past the shorter store, naming no prior."""
    student = ConvNet(widths=(8, 16))
    with pytest.raises(ValueError, match=r"different numbers of rows \('a': 24 rows, 'b': 20 rows\)"):
        ReLA({"a": store, "b": torch.randn(20, 6)}, student, feature_dim=16, witness=False)


def test_errors_of_one_priors_rows_name_the_prior(store):
    """An index past one prior's rows (a store of the same length as the other: another data set) is named."""
    student = ConvNet(widths=(8, 16))
    rela = ReLA({"a": torch.randn(N, 6), "b": torch.randn(N, 5)}, student, feature_dim=16, witness=False,
                total_steps=10)
    student(images(torch.arange(4)))
    with pytest.raises(IndexError, match=r"^Prior 'a' of this ReLA: Sample index out of range"):
        rela.wrap(torch.tensor(0.0), index=torch.tensor([0, 1, 2, N]))
