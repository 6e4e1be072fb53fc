"""The cluttered-canvas data set: seeded, the item's own pixels placed whole, clutter from other items, labels kept."""

import pytest
import torch

from accelerate_ssl.data import ArrayImageDataset, Canvas, dataset_fingerprint, make_canvases


def _items(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.zeros(n, 28, 28, dtype=torch.uint8)
    images[:, 6:22, 6:22] = torch.randint(100, 256, (n, 16, 16), generator=g, dtype=torch.int64).to(torch.uint8)
    return ArrayImageDataset(images.numpy(), (torch.arange(n) % 10).numpy(), name="squares")


def test_same_seed_same_canvases_other_seed_other_canvases():
    items = _items()
    a, b, c = Canvas(items, seed=1), Canvas(items, seed=1), Canvas(items, seed=2)
    assert a.data.shape == (64, 48, 48) and a.data.dtype == torch.uint8
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)
    assert torch.equal(a.targets, items.targets)
    assert dataset_fingerprint(a) == dataset_fingerprint(b) != dataset_fingerprint(c)
    image, label = a[3]
    assert image.size == (48, 48) and label == 3


def test_without_clutter_each_item_is_placed_whole_at_its_scale():
    items = _items(16)
    plain = make_canvases(items.data, size=48, scale=(1.0, 1.0), fragments=0, seed=0)
    for item, canvas in zip(items.data, plain):  # scale 1: the item's 16 px square, shifted, on a black canvas
        on = torch.nonzero(canvas > 0)
        rows, cols = on[:, 0], on[:, 1]
        assert 15 <= int(rows.max() - rows.min()) + 1 <= 17 and 15 <= int(cols.max() - cols.min()) + 1 <= 17
        assert abs(canvas.float().sum() / item.float().sum() - 1) < 0.05
    small = make_canvases(items.data, size=48, scale=(0.6, 0.6), fragments=0, seed=0)
    assert (small > 0).sum(dim=(1, 2)).float().mean() < 0.5 * (plain > 0).sum(dim=(1, 2)).float().mean()


def test_fragments_add_clutter_outside_the_item():
    items = _items(32)
    clean = make_canvases(items.data, fragments=0, seed=0)
    cluttered = make_canvases(items.data, fragments=3, seed=0)
    assert (cluttered.int() >= clean.int()).all()  # laid over by maximum: the item's own pixels stay
    assert ((cluttered > 0).sum() - (clean > 0).sum()) > 32 * 50  # most scenes gain other items' pixels


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="fit"):
        make_canvases(_items(4).data, size=32, scale=(0.6, 1.2))
    with pytest.raises(ValueError, match="uint8"):
        make_canvases(torch.zeros(4, 28, 28))
    with pytest.raises(ValueError, match="fragment"):
        make_canvases(_items(4).data, fragment_size=0)


def test_masks_are_the_items_visible_pixels_and_leave_the_canvases_unchanged():
    items = _items(32)
    plain = make_canvases(items.data, size=48, seed=4)
    canvases, masks = make_canvases(items.data, size=48, seed=4, masks=True)
    assert torch.equal(canvases, plain) and masks.dtype == torch.bool and masks.shape == canvases.shape
    alone = make_canvases(items.data, size=48, seed=4, fragments=0)  # the same draws up to the clutter
    # without clutter the mask is the item's pixels; clutter only hides some of them, never adds any
    _, alone_masks = make_canvases(items.data, size=48, seed=4, fragments=0, masks=True)
    assert (alone_masks == (alone >= 26)).float().mean() > 0.999  # intensity >= 0.1 (up to the uint8 rounding)
    assert not (masks & ~alone_masks).any() and (alone_masks & ~masks).any()
    assert torch.equal(Canvas(items, seed=4).masks, masks)
