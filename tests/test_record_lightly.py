"""record_geometry on the view transforms users already have: lightly's (BYOL, SimCLR, DINO) and torchvision Composes
(v1 and v2). Each recorded view's pixels are the clean image's recorded box, resized (and mirrored when flipped); under
the same seeds the recorded transform gives lightly's own pixels; transforms that move pixels are refused."""

import numpy as np
import pytest
import torch
from lightly.transforms import BYOLView1Transform, DINOTransform, SimCLRTransform
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF
from torchvision.transforms import v2

from accelerate_ssl.targets.views import RecordGeometry, RecordViews, record_geometry

HEIGHT, WIDTH = 36, 44  # not square, so a box with x and y swapped would be caught


@pytest.fixture(scope="module")
def image():
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, size=(HEIGHT, WIDTH, 3), dtype=np.uint8))


def _seed(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)  # lightly's rotation, blur and solarization draw from numpy


def _expected(image, geometry, size, interpolation):
    """The clean image's box (``geometry``) resized to ``size`` and mirrored when flipped, as floats in [0, 1]."""
    x1, y1, x2, y2, flip, height, width = (int(v) for v in geometry.tolist())
    assert (height, width) == (HEIGHT, WIDTH) and 0 <= x1 < x2 <= WIDTH and 0 <= y1 < y2 <= HEIGHT
    region = TF.resized_crop(image, y1, x1, y2 - y1, x2 - x1, [size, size], interpolation)
    region = TF.hflip(region) if flip else region
    return TF.pil_to_tensor(region).float() / 255


# lightly's transforms with every pixel-preserving augmentation off (and no normalisation), and each view's
# (size, interpolation) as lightly documents them
PLAIN = {
    "byol_view": (lambda: BYOLView1Transform(input_size=32, cj_prob=0.0, random_gray_scale=0.0, gaussian_blur=0.0,
                                             solarization_prob=0.0, normalize=None),
                  [(32, InterpolationMode.BILINEAR)]),
    "simclr": (lambda: SimCLRTransform(input_size=32, cj_prob=0.0, random_gray_scale=0.0, gaussian_blur=0.0,
                                       normalize=None),
               [(32, InterpolationMode.BILINEAR)] * 2),
    "dino": (lambda: DINOTransform(global_crop_size=32, local_crop_size=16, n_local_views=2, cj_prob=0.0,
                                   random_gray_scale=0.0, gaussian_blur=(0.0, 0.0, 0.0), solarization_prob=0.0,
                                   normalize=None),
             [(32, InterpolationMode.BICUBIC)] * 2 + [(16, InterpolationMode.BICUBIC)] * 2),
}


@pytest.mark.parametrize("name", list(PLAIN))
def test_each_recorded_view_is_its_box_of_the_clean_image(name, image):
    make, views = PLAIN[name]
    lightly_transform = make()
    recorded = record_geometry(lightly_transform)
    flips = set()
    for seed in range(6):
        _seed(seed)
        theirs = lightly_transform(image)
        _seed(seed)
        ours = recorded(image)
        if len(views) == 1:
            assert isinstance(recorded, RecordGeometry)
            theirs, ours = [theirs], [ours]
        else:
            assert isinstance(recorded, RecordViews) and len(recorded) == len(views)
            assert isinstance(ours, list) and len(ours) == len(theirs) == len(views)
        for their_view, (view, geometry), (size, interpolation) in zip(theirs, ours, views):
            assert geometry.dtype == torch.float32 and geometry.shape == (7,)
            assert view.shape == their_view.shape == (3, size, size)
            assert torch.equal(view, their_view)  # the same random numbers: the same crop and flip as lightly's
            expected = _expected(image, geometry, size, interpolation)
            torch.testing.assert_close(view, expected, rtol=0, atol=1e-6)
            flips.add(int(geometry[4]))
            if int(geometry[4]):  # the check sees a flip the geometry would not record
                assert not torch.allclose(view, TF.hflip(expected), rtol=0, atol=1e-6)
    assert flips == {0, 1}  # both kinds of view were checked


@pytest.mark.parametrize("make", [lambda: BYOLView1Transform(input_size=24),
                                  lambda: DINOTransform(global_crop_size=24, local_crop_size=12, n_local_views=2)],
                         ids=["byol_view", "dino"])
def test_same_seeds_give_lightlys_own_pixels_with_every_augmentation_on(make, image):
    """Colour jitter, grayscale, blur, solarization and normalisation on. The placeholders that never fire
    (RandomVerticalFlip(p=0), RandomRotate(prob=0)) still draw a random number each, so record_geometry keeps them in
    `then`: dropping them would shift every later draw and the pixels would differ from lightly's."""
    lightly_transform = make()
    recorded = record_geometry(lightly_transform)
    for seed in range(3):
        _seed(seed)
        theirs = lightly_transform(image)
        _seed(seed)
        ours = recorded(image)
        theirs, ours = (theirs, ours) if isinstance(theirs, list) else ([theirs], [ours])
        assert len(ours) == len(theirs)
        for their_view, (view, _) in zip(theirs, ours):
            assert torch.equal(view, their_view)


class Shear:
    """A custom transform record_geometry cannot know moves no pixel."""

    def __call__(self, image):
        return image


CROP, FLIP = lambda: T.RandomResizedCrop(16), lambda: T.RandomHorizontalFlip()
REFUSED = {
    "rotation": (lambda: T.Compose([CROP(), FLIP(), T.RandomRotation(10), T.ToTensor()]), "RandomRotation"),
    "vertical_flip": (lambda: v2.Compose([v2.RandomResizedCrop(16), v2.RandomHorizontalFlip(),
                                          v2.RandomVerticalFlip(p=0.5), v2.ToImage()]), "RandomVerticalFlip"),
    "rotation_inside_random_apply": (lambda: T.Compose([CROP(), FLIP(), T.RandomApply([T.RandomRotation(10)], p=0.5)]),
                                     "RandomRotation"),
    "byol_rr_prob": (lambda: BYOLView1Transform(input_size=16, rr_prob=0.5), "RandomRotate"),
    "byol_rr_degrees": (lambda: BYOLView1Transform(input_size=16, rr_prob=0.5, rr_degrees=15), "RandomRotateDegrees"),
    "byol_vf_prob": (lambda: BYOLView1Transform(input_size=16, vf_prob=0.5), "RandomVerticalFlip"),
    "simclr_vf_prob": (lambda: SimCLRTransform(input_size=16, vf_prob=0.5), r"RandomVerticalFlip.*view 0 of"),
    "custom": (lambda: T.Compose([CROP(), FLIP(), Shear(), T.ToTensor()]), "Shear"),
    "center_crop": (lambda: T.Compose([T.CenterCrop(30), CROP(), FLIP()]), "CenterCrop"),
    "resize": (lambda: T.Compose([CROP(), FLIP(), T.Resize(8)]), "Resize"),
    "second_crop": (lambda: T.Compose([CROP(), FLIP(), CROP()]), "second RandomResizedCrop"),
    "flip_before_crop": (lambda: T.Compose([FLIP(), CROP(), T.ToTensor()]), "crop after the flip"),
    "between_crop_and_flip": (lambda: T.Compose([CROP(), T.ColorJitter(0.4), FLIP()]), "follow the crop"),
    "nested_crop": (lambda: T.Compose([T.Compose([CROP()]), FLIP()]), "nested"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_transform_that_moves_pixels_is_refused_by_name(name):
    make, match = REFUSED[name]
    with pytest.raises(TypeError, match=match) as error:
        record_geometry(make())
    assert "RecordGeometry(crop, flip, then=...)" in str(error.value)  # and says how to do it by hand


def test_placeholders_that_never_fire_and_pixel_preserving_transforms_are_accepted():
    recorded = record_geometry(T.Compose([
        T.RandomResizedCrop(8), T.RandomHorizontalFlip(), T.RandomVerticalFlip(p=0.0),
        T.RandomApply([T.RandomRotation(30)], p=0.0),
        T.RandomApply([T.Compose([T.ColorJitter(0.4, 0.4), T.RandomGrayscale()])], p=0.5),
        T.RandomPosterize(4), T.RandomAutocontrast(), T.ToTensor(), T.Normalize([0.5] * 3, [0.2] * 3)]))
    assert isinstance(recorded, RecordGeometry) and len(recorded.then.transforms) == 7
    with pytest.raises(TypeError, match="neither a torchvision Compose"):
        record_geometry(T.RandomResizedCrop(8))
    view = T.Compose([T.RandomResizedCrop(8), T.RandomHorizontalFlip(), T.ToTensor()])
    for container in (T.RandomChoice([view, view]), T.RandomApply([view], p=0.5), T.RandomOrder([view, view])):
        with pytest.raises(TypeError, match=f"{type(container).__name__}.*to one view .at random., not one view each"):
            record_geometry(container)  # not a multi-view transform, whatever its .transforms list


@pytest.mark.parametrize("api", [T, v2])
def test_torchvision_composes_v1_and_v2(api, image):
    """A v2 pipeline the way its docs write it (ToImage ahead of the crop: the crop runs on the tensor) and a v1 one
    (ToTensor after the flip): the same pixels as the Compose under the same seed, and the recorded box."""
    if api is v2:
        to_tensor = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
        compose = v2.Compose([to_tensor[0], v2.RandomResizedCrop(12, scale=(0.1, 0.6)), v2.RandomHorizontalFlip(),
                              to_tensor[1], v2.Normalize([0.5] * 3, [0.25] * 3)])
    else:
        compose = T.Compose([T.RandomResizedCrop(12, scale=(0.1, 0.6)), T.RandomHorizontalFlip(), T.ToTensor(),
                             T.Normalize([0.5] * 3, [0.25] * 3)])
    recorded = record_geometry(compose)
    assert isinstance(recorded, RecordGeometry) and type(recorded.then) is api.Compose
    tensor = TF.pil_to_tensor(image)
    flips = set()
    for seed in range(6):
        _seed(seed)
        theirs = compose(image)
        _seed(seed)
        view, geometry = recorded(image)
        assert torch.equal(view, theirs)
        x1, y1, x2, y2, flip, height, width = (int(v) for v in geometry.tolist())
        assert (height, width) == (HEIGHT, WIDTH)
        flips.add(flip)
        if api is v2:  # the crop ran on the uint8 tensor ToImage made
            region = v2.functional.resized_crop(tensor, y1, x1, y2 - y1, x2 - x1, [12, 12], antialias=True)
            region = region.flip(-1) if flip else region
            expected = (region.float() / 255 - 0.5) / 0.25
        else:
            expected = (_expected(image, geometry, 12, InterpolationMode.BILINEAR) - 0.5) / 0.25
        torch.testing.assert_close(view, expected, rtol=0, atol=1e-5)
    assert flips == {0, 1}


def test_record_views_reads_and_calls_like_lightlys_multi_view_transform(image):
    from lightly.transforms.multi_view_transform import MultiViewTransform

    multi = MultiViewTransform([T.Compose([T.RandomResizedCrop(16), T.PILToTensor()]),
                                BYOLView1Transform(input_size=8, normalize=None)])
    recorded = record_geometry(multi)
    text = repr(recorded)
    assert text.startswith("RecordViews([") and text.count("RecordGeometry(") == 2 and "size=(8, 8)" in text
    views = recorded(image)
    assert [tuple(v.shape) for v, _ in views] == [(3, 16, 16), (3, 8, 8)]
    assert views[0][1][4] == 0  # no flip in the first view's Compose: never flipped


# ---------------------------------------------------------------------------------------------- the README recipe
def test_lightlys_byol_example_with_per_view_targets_is_three_added_two_changed_and_reads_its_own_maps(
        tmp_path, fashion_mnist_available):
    """tests/recipes/lightly_views.py, lightly's examples/pytorch/byol.py with the README's lines: the recipe's count,
    then the script run as written; every step read its own samples' maps, once per view (two views)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from processes import cpu_process_env
    from recipe_check import HOSTS, assert_every_row_is_the_samples_own, check_recipe, read_logs

    root = Path(__file__).resolve().parents[1]
    script = root / "tests" / "recipes" / "lightly_views.py"
    assert check_recipe(script, "**With lightly's transforms.**", HOSTS / "lightly.md") == (3, 2)
    path = os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")])
    env = cpu_process_env(PYTHONPATH=path, PYTHONUNBUFFERED="1", RECIPE_LOG=str(tmp_path / "log"))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, text=True, capture_output=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = read_logs(tmp_path / "log")[0]
    assert len(steps) == 2 * 4
    assert_every_row_is_the_samples_own(steps)
    # each view's rows pooled from its own image's map, on every step before the hand-over
    assert all(s["views"] == 2 for s in steps if not s["handed_over"])
    assert len(list((tmp_path / "rela-targets").glob("shipped-digits-byol-256-*-spatial16/metadata.json"))) == 1
