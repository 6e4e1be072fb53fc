"""Stored views: K targets per image, replayed exactly (accelerate_ssl.data.views)."""

import numpy as np
import pytest
import torch
from PIL import Image

from accelerate_ssl import ReLA, ReplayViews, StoredViews, create_prior, precompute_targets
from accelerate_ssl.data.views import apply_view
from accelerate_ssl.targets.store import TargetStoreMismatchError


class Pictures(torch.utils.data.Dataset):
    """Distinct 28 px grayscale images with a label, as PIL (what precompute and replay both see)."""

    def __init__(self, n=24, seed=0):
        g = np.random.default_rng(seed)
        self.data = g.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        self.data[:, :, :14] //= 3  # left half darker: a flip changes the image
        self.targets = list(range(n))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return Image.fromarray(self.data[i]), self.targets[i]


def test_view_parameters_are_a_pure_function_of_seed_index_and_view():
    views = StoredViews(k=4, seed=3)
    again = StoredViews(k=4, seed=3)
    params = [views.params(i, v, 28, 28) for i in range(20) for v in range(4)]
    assert params == [again.params(i, v, 28, 28) for i in range(20) for v in range(4)]
    assert all(p == (0, 0, 28, 28, False) for p in params[::4])  # view 0: the whole image
    crops = [p for j, p in enumerate(params) if j % 4]
    assert len(set(crops)) > 50  # the other views differ
    for top, left, h, w, _ in crops:
        assert 0 <= top and top + h <= 28 and 0 <= left and left + w <= 28
        assert 0.5 * 784 * 0.85 <= h * w <= 784  # area in scale (0.5, 1), up to rounding
    assert 0.3 < np.mean([p[4] for p in crops]) < 0.7
    assert [StoredViews(k=4, seed=4).params(i, 1, 28, 28) for i in range(20)] != [views.params(i, 1, 28, 28) for i in range(20)]


def test_bad_view_settings_are_refused_with_the_rule():
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        StoredViews(k=0)
    with pytest.raises(ValueError, match="scale"):
        StoredViews(scale=(0.5, 1.5))
    with pytest.raises(ValueError, match="flip"):
        StoredViews(flip=2)


def test_replay_layout_and_exact_views():
    data = Pictures(6)
    views = ReplayViews(data, StoredViews(k=3, seed=0))
    assert len(views) == 18
    for j in range(18):
        i, v = divmod(j, 3)
        image, label = views[j]
        assert label == i
        expected = apply_view(data[i][0], StoredViews(k=3, seed=0).params(i, v, 28, 28))
        assert np.array_equal(np.asarray(image), np.asarray(expected))
        assert np.array_equal(np.asarray(views[j][0]), np.asarray(image))  # the same view every read
    assert np.array_equal(np.asarray(views[3][0]), data.data[1])  # view 0 is the clean image
    assert not np.array_equal(np.asarray(views[4][0]), data.data[1])
    full_flips = [j for j in range(18) if views.params(j) == (0, 0, 28, 28, True)]
    for j in full_flips:  # a full-size flipped view is exactly the mirror image
        assert np.array_equal(np.asarray(views[j][0]), data.data[j // 3][:, ::-1])
    mirrored = ReplayViews(data, StoredViews(k=2, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=1.0))
    assert np.array_equal(np.asarray(mirrored[1][0]), data.data[0][:, ::-1])
    with pytest.raises(IndexError):
        views[18]


def test_tensor_images_replay_like_pil():
    data = Pictures(4)
    spec = StoredViews(k=2, seed=1, scale=(0.6, 0.6))
    for i in range(4):
        p = spec.params(i, 1, 28, 28)
        pil = np.asarray(apply_view(data[i][0], p), dtype=np.float32)
        ten = apply_view(torch.from_numpy(data.data[i]).unsqueeze(0).float(), p)[0].numpy()
        assert ten.shape == (28, 28)
        assert np.abs(pil - ten).mean() < 6  # same crop, resampled by two backends (PIL vs torch)


def test_store_over_views_holds_each_views_target_and_records_the_views(tmp_path):
    data = Pictures(12)
    spec = StoredViews(k=4, seed=0)
    prior = create_prior("random:convnet", in_channels=1)
    store = precompute_targets(prior, ReplayViews(data, spec), tmp_path / "k4", progress=False)
    assert len(store) == 48 and store.metadata["views"] == spec.to_dict()
    replay = ReplayViews(data, store)  # the views come back from the store's record
    assert replay.views == spec
    pre = prior.preprocess.with_stats(store.metadata["preprocess"]["mean"], store.metadata["preprocess"]["std"], "dataset")
    with torch.no_grad():
        for j in (0, 5, 30, 47):
            row = prior(pre(replay[j][0]).unsqueeze(0))[0]
            assert torch.allclose(row, store[[j]][0], atol=1e-4), j
    clean = precompute_targets(prior, data, tmp_path / "clean", progress=False)
    assert clean.metadata["views"] is None
    assert torch.allclose(store[list(range(0, 48, 4))], clean[list(range(12))], atol=1e-5)  # view 0 = clean image
    assert not torch.allclose(store[[1]], clean[[0]], atol=1e-3)
    with pytest.raises(ValueError, match="not stored views"):
        ReplayViews(data, clean)


def test_a_store_of_other_views_or_of_the_images_is_refused(tmp_path):
    data = Pictures(12)
    store = precompute_targets(create_prior("random:convnet", in_channels=1), ReplayViews(data, StoredViews(k=2)),
                               tmp_path / "k2", progress=False)
    store.check_dataset(ReplayViews(data, store, transform=lambda im: torch.zeros(1)))  # transform: no effect on identity
    with pytest.raises(TargetStoreMismatchError, match="other stored views"):
        store.check_dataset(ReplayViews(data, StoredViews(k=2, seed=9)))
    with pytest.raises(TargetStoreMismatchError, match="24 rows but the dataset has 12"):
        store.check_dataset(data)
    with pytest.raises(TargetStoreMismatchError):
        store.check_dataset(ReplayViews(Pictures(12, seed=1), StoredViews(k=2)))


def test_rela_trains_on_replayed_views_through_the_tracked_loader(tmp_path):
    data = Pictures(16)
    store = precompute_targets(create_prior("random:convnet", in_channels=1), ReplayViews(data, StoredViews(k=2)),
                               tmp_path / "k2", progress=False)

    def to_tensor(im):
        return torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).unsqueeze(0)

    train = ReplayViews(data, store, transform=to_tensor)
    loader = torch.utils.data.DataLoader(train, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 16))
    rela = ReLA(store, backbone, dataset=train, dataloader=loader, schedule="constant:1", n_components=8)
    opt = torch.optim.SGD([*backbone.parameters(), *rela.parameters()], lr=0.1)
    seen = []
    for x, _ in loader:
        seen.extend(rela._current_index.tolist())
        backbone(x)
        loss = rela.wrap(torch.zeros((), requires_grad=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert sorted(seen) == list(range(32))  # one epoch = every stored view once, each with its own row
    assert rela.steps == 4
