"""A target row is the sample's own, or training stops with the reason.

Each test is a way a user could train on another sample's targets (or be refused for a wrong reason) with
the library's own calls on small real data (scikit-learn's digits), and checks the message names the real
problem; the last group checks the values rows take on their way to the loss, so a misaligned lookup fails.
"""

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from accelerate_ssl import ReLA
from accelerate_ssl.cli import main as cli_main
from accelerate_ssl.data import ArrayImageDataset, Digits, dataset_fingerprint
from accelerate_ssl.data.fingerprint import RowIdentity
from accelerate_ssl.targets.precompute import precompute_targets
from accelerate_ssl.priors import create_prior
from accelerate_ssl.targets.store import TargetStoreMismatchError


def _digits():
    return Digits("train", size=8)  # 1438 real 8x8 digits


def _precompute(dataset, path, spec="random:convnet", **kw):
    prior = create_prior(spec, in_channels=1, **kw)
    return precompute_targets(prior, dataset, path, batch_size=256, progress=False)


@pytest.fixture(scope="module")
def digits_store(tmp_path_factory):
    return _precompute(_digits(), tmp_path_factory.mktemp("identity") / "digits")


def _swapped(ds, a=1, b=2):
    images = ds.data.numpy().copy()
    labels = np.asarray(ds.targets if hasattr(ds, "targets") else [ds[i][1] for i in range(len(ds))]).copy()
    images[[a, b]], labels[[a, b]] = images[[b, a]], labels[[b, a]]
    return ArrayImageDataset(images, labels, name="digits-swapped")


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 16))

    def forward(self, x):
        return self.net(x)


def _tensor_transform(image):
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).unsqueeze(0)


# ----------------------------------------------------------------------------------------------- open time
def test_loader_over_another_dataset_is_refused_without_dataset_argument(digits_store):
    """ReLA(store_of_A, backbone, dataloader=loader_over_B): the loader's dataset is checked, not just its length."""
    other = _swapped(_digits(), 0, 700)
    other.transform = _tensor_transform
    loader = DataLoader(other, batch_size=32, shuffle=True)
    with pytest.raises(TargetStoreMismatchError, match="same length \\(1438\\) but different content or another order"):
        ReLA(digits_store.path, Backbone(), dataloader=loader)
    same = _digits()
    same.transform = _tensor_transform
    ReLA(digits_store.path, Backbone(), dataloader=DataLoader(same, batch_size=32))  # the right data: accepted


def test_loader_dataset_is_checked_besides_dataset_argument(digits_store):
    swapped = _swapped(_digits())
    swapped.transform = _tensor_transform
    with pytest.raises(TargetStoreMismatchError, match="different content or another order"):
        ReLA(digits_store.path, Backbone(), dataset=_digits(), dataloader=DataLoader(swapped, batch_size=32))


def test_a_loader_tracked_later_is_checked_too(digits_store):
    """rela.track(loader) after construction (a prepared / rebuilt loader) checks that loader's data set."""
    rela = ReLA(digits_store.path, Backbone(), dataset=_digits())
    swapped = _swapped(_digits())
    swapped.transform = _tensor_transform
    with pytest.raises(TargetStoreMismatchError, match="different content or another order"):
        rela.track(DataLoader(swapped, batch_size=32))
    same = _digits()
    same.transform = _tensor_transform
    loader = DataLoader(same, batch_size=32)
    assert rela.track(loader) is loader


def test_two_swapped_items_are_refused_and_located(digits_store):
    """Rows 1 and 2 of 1438 swapped: every array byte is fingerprinted, and verify names the rows."""
    swapped = _swapped(_digits())
    with pytest.raises(TargetStoreMismatchError, match="different content or another order.*every array row"):
        ReLA(digits_store.path, Backbone(), dataset=swapped)
    with pytest.raises(TargetStoreMismatchError, match="2 of 1438 rows.*item 1 has the target of row 2; item 2 has the "
                                                       "target of row 1.*same samples in another order"):
        digits_store.verify_rows(swapped)
    assert digits_store.verify_rows(_digits()) == {"rows_checked": 1438, "kind": "array"}


def test_store_verify_cli_checks_every_item(digits_store, tmp_path, capsys):
    from PIL import Image

    ds = _digits()
    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(12):
        Image.fromarray(ds.data[i].numpy(), mode="L").save(flat / f"{i:03d}.png")
    folder_store = tmp_path / "folder-store"
    assert cli_main(["precompute", "--prior", "random:convnet", "--data", f"folder:{flat}", "--out", str(folder_store),
                     "--no-progress"]) == 0
    capsys.readouterr()
    assert cli_main(["store", "verify", str(folder_store), "--data", f"folder:{flat}", "--no-progress"]) == 0
    assert "every row belongs to its item" in capsys.readouterr().out
    (flat / "000.png").rename(flat / "zzz.png")  # the listing order changes: row 0 is now the last file
    assert cli_main(["store", "verify", str(folder_store), "--data", f"folder:{flat}", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "do not belong to this dataset's items (compared by files)" in err and "item 0 is not in the store" not in err
    # the 8 px digits store against the 28 px digits spec: same length, other images
    assert cli_main(["store", "verify", str(digits_store.path), "--data", "digits", "--no-progress"]) == 1
    assert "1438 of 1438 rows do not belong" in capsys.readouterr().err


def test_labels_do_not_change_the_identity(digits_store):
    """The same images yielded as (img, 0) and as img fingerprint the same: a label is not the sample."""

    class Items(Dataset):
        def __init__(self, images, with_label):
            self.images, self.with_label = images, with_label

        def __len__(self):
            return len(self.images)

        def __getitem__(self, i):
            img = torch.from_numpy(self.images[i]).unsqueeze(0)
            return (img, 0) if self.with_label else img

    images = _digits().data.numpy()
    plain, labelled = Items(images, False), Items(images, True)
    assert dataset_fingerprint(plain) == dataset_fingerprint(labelled)
    assert np.array_equal(RowIdentity(plain).all()[:50], RowIdentity(labelled).all()[:50])


def test_items_fingerprint_ignores_the_transform_and_says_what_it_covers():
    class Files(Dataset):  # a user's data set: no .data, no .samples, the augmentation in .transform
        def __init__(self, images, transform=None):
            self.images, self.transform = images, transform

        def __len__(self):
            return len(self.images)

        def __getitem__(self, i):
            img = torch.from_numpy(self.images[i]).float().div(255).unsqueeze(0)
            return (self.transform(img) if self.transform else img), 0

    images = _digits().data.numpy()
    clean = dataset_fingerprint(Files(images))
    augmented = Files(images, transform=lambda x: x + 0.1 * torch.rand_like(x))
    assert dataset_fingerprint(augmented) == clean
    assert augmented.transform is not None  # restored after reading
    assert clean["kind"] == "items" and clean["coverage"] == "sampled 64 of 1438 items"


# ----------------------------------------------------------------------------------------------- each step
def _batches(ds, batch_size=32, seed=0):
    return DataLoader(ds, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))


def test_a_loader_rebuilt_without_tracking_is_refused(digits_store):
    """A loop that rebuilds its DataLoader each epoch without tracking it would reuse the last tracked batch's
    indices: a second wrap on one published batch is refused."""
    ds = _digits()
    ds.transform = _tensor_transform
    model = Backbone()
    tracked = _batches(ds)
    rela = ReLA(digits_store.path, model, dataloader=tracked, total_steps=10)
    opt = torch.optim.SGD(list(model.parameters()), lr=0.01)
    x, _ = next(iter(tracked))
    model(x).sum()
    rela.wrap(torch.tensor(0.0)).backward()
    opt.step()
    for x, _ in _batches(ds, seed=3):  # a new, untracked loader
        model(x)
        with pytest.raises(RuntimeError, match="no tracked loader has yielded a batch since the last wrap.*rela.track"):
            rela.wrap(torch.tensor(0.0))
        break


def test_float_indexes_are_refused():
    t = torch.randn(40, 8)
    model = Backbone()
    rela = ReLA(t, model, feature_dim=16, total_steps=5)
    model(torch.rand(4, 1, 8, 8))
    with pytest.raises(TypeError, match="must be integers.*float32.*truncated"):
        rela.wrap(torch.tensor(0.0), index=torch.tensor([0.0, 1.5, 2.7, 3.0]))
    model(torch.rand(4, 1, 8, 8))
    with pytest.raises(TypeError, match="must be integers"):
        rela.wrap(torch.tensor(0.0), index=np.array([0.2, 1.0, 2.0, 3.0]))


def test_checkpoint_from_another_priors_store_is_refused(digits_store, tmp_path):
    """A head trained on another prior's store (same target dim) maps into another space: refused on load."""
    other = _precompute(_digits(), tmp_path / "other", spec="random:convnet", seed=1)
    assert other.dim == digits_store.dim
    ds = _digits()
    ds.transform = _tensor_transform
    model = Backbone()
    rela = ReLA(other.path, model, dataset=ds, total_steps=10)
    x, _ = next(iter(rela.track(_batches(ds))))
    model(x)
    rela.wrap(torch.tensor(0.0)).backward()
    state = rela.state_dict()
    resumed = ReLA(digits_store.path, Backbone(), dataset=ds, total_steps=10)
    with pytest.raises(ValueError, match="trained on another target store.*targets_sha256"):
        resumed.load_state_dict(state)
    again = ReLA(other.path, Backbone(), dataset=ds, total_steps=10)
    again.load_state_dict(state)  # the same store: accepted
    assert torch.equal(again.head.weight, rela.head.weight)


# ----------------------------------------------------------------------------------------------- bad stores
def test_identical_rows_are_refused(tmp_path):
    same = torch.ones(60, 8)
    with pytest.raises(ValueError, match="Every target row is the same"):
        ReLA(same, Backbone(), feature_dim=16)  # PCA to 8 components (z-scored)
    with pytest.raises(ValueError, match="Every target row is the same"):
        ReLA(same, Backbone(), feature_dim=16, n_components=None)  # raw rows
    one_image = ArrayImageDataset(np.repeat(_digits().data.numpy()[:1], 30, axis=0), np.zeros(30, dtype=np.int64))
    store = _precompute(one_image, tmp_path / "one")
    with pytest.raises(ValueError, match="Every target row is the same.*one\\s+repeated image"):
        ReLA(store.path, Backbone(), dataset=one_image)


def test_float_images_in_0_255_are_refused(tmp_path):
    class Floats(Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return torch.full((1, 8, 8), float(10 * i)), 0  # 0..190 as float

    with pytest.raises(ValueError, match="must hold values in \\[0, 1\\].*0..255 values as floats"):
        _precompute(Floats(), tmp_path / "floats")


def test_integer_images_wider_than_uint8_are_refused_with_the_conversion(tmp_path):
    """int64 pixels (what a Hugging Face numpy/torch format makes of a uint8 column) are 0..255 or 16-bit values:
    refused, naming the dtype and the conversion, not read as out-of-range floats."""
    class Wide(Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return np.full((8, 8, 1), 10 * i, dtype=np.int64), 0

    with pytest.raises(ValueError, match="uint8 \\(0..255\\) or float \\(0..1\\), got torch.int64.*astype\\(np.uint8\\)"):
        _precompute(Wide(), tmp_path / "wide")


def test_nan_rows_name_the_store_not_the_student(tmp_path):
    store = _precompute(_digits(), tmp_path / "nan")
    rows = np.load(store.path / "targets.npy", mmap_mode="r+")
    rows[[5, 900]] = np.nan
    rows.flush()
    del rows
    with pytest.raises(ValueError, match="Target store .* NaN/Inf values in row\\(s\\) \\[5, 900\\].*Recompute it: `rm -r "):
        ReLA(store.path, Backbone(), dataset=_digits())
    from accelerate_ssl.targets.pca import TargetPCA

    with pytest.raises(ValueError, match="NaN/Inf values in row\\(s\\) \\[5, 900\\].*target store is broken \\(not the "
                                         "student\\)"):
        TargetPCA.fit(store.array, 16)  # the fit reads every row, sampled or not
    with pytest.raises(ValueError, match="NaN/Inf values in 1 row"):
        ReLA(torch.cat([torch.randn(10, 4), torch.full((1, 4), float("nan"))]), Backbone(), feature_dim=16)


# ----------------------------------------------------------------------------------------------- values
def _reduced(raw: np.ndarray, n: int) -> np.ndarray:
    """Eq. 41 by hand: z-score each column, project on the top-n eigenvectors of the correlation matrix."""
    z = (raw - raw.mean(0)) / raw.std(0, ddof=1)
    values, vectors = np.linalg.eigh(np.cov(z, rowvar=False))
    return z @ vectors[:, np.argsort(values)[::-1][:n]]


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("n", ["full", 5])
def test_looked_up_rows_are_the_samples_reduced_targets(on_device, n):
    """The row a batch gets is the z-scored, projected target of that very sample (up to each component's sign),
    on the host and on the device path, also when n_components equals the target dim."""
    raw = torch.randn(200, 12, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.5, 4, 12) + 3.0
    k = 12 if n == "full" else n
    rela = ReLA(raw, Backbone(), feature_dim=16, n_components=k, targets_on_device=on_device)
    idx = torch.tensor([7, 3, 199, 0, 3])
    got = rela.targets(idx, "cpu").numpy()
    want = _reduced(raw.double().numpy(), k)[idx.numpy()]
    signs = np.sign((got * want).sum(0))
    assert np.allclose(got, want * signs, atol=1e-4), "rows are not the samples' own reduced targets"
    assert not np.allclose(got, raw[idx].numpy()[:, :k], atol=1e-2)


@pytest.mark.parametrize("make", ["array", "items", "subset", "files"])
def test_every_fingerprint_sees_order(make, tmp_path):
    """A reversed copy of a data set never fingerprints like the original, whatever the kind."""
    images = _digits().data.numpy()[:80]
    if make == "array":
        a, b = ArrayImageDataset(images, np.zeros(80)), ArrayImageDataset(images[::-1].copy(), np.zeros(80))
    elif make == "items":
        a = [torch.from_numpy(im) for im in images]
        b = a[::-1]
    elif make == "subset":
        base = ArrayImageDataset(images, np.zeros(80))
        a, b = Subset(base, list(range(80))), Subset(base, list(range(79, -1, -1)))
    else:
        from accelerate_ssl.data import image_folder
        from PIL import Image

        for i in range(6):
            Image.fromarray(images[i], mode="L").save(tmp_path / f"{i}.png")
        a = image_folder(str(tmp_path))
        b = image_folder(str(tmp_path))
        b.samples = b.samples[::-1]
    assert dataset_fingerprint(a)["sha256"] != dataset_fingerprint(b)["sha256"]
    assert not np.array_equal(RowIdentity(a).all(), RowIdentity(b).all())


def test_targets_carried_by_the_batch_get_the_stores_checks_and_reduction():
    """wrap(targets=): rows carried by the batch (a sidecar field) are reduced like stored rows, and checked."""
    raw = torch.randn(100, 12, generator=torch.Generator().manual_seed(4)) * torch.linspace(1, 3, 12)
    model = Backbone()
    rela = ReLA(raw, model, feature_dim=16, n_components=6, total_steps=5)
    idx = torch.tensor([4, 9, 50, 77])
    assert torch.allclose(rela.targets.reduce_rows(raw[idx], "cpu"), rela.targets(idx, "cpu"))
    x = torch.rand(4, 1, 8, 8)
    model(x)
    carried = rela.wrap(torch.tensor(0.0), targets=raw[idx])
    model(x)
    assert carried.requires_grad and torch.isfinite(carried)
    with pytest.raises(ValueError, match="rows have dim 8 but the targets ReLA was opened on have dim 12"):
        rela.wrap(torch.tensor(0.0), targets=torch.randn(4, 8))
    model(x)
    with pytest.raises(ValueError, match="index= .* or targets= .* not both"):
        rela.wrap(torch.tensor(0.0), targets=raw[idx], index=idx)
    model(x)
    bad = raw[idx].clone()
    bad[1, 3] = float("nan")
    with pytest.raises(RuntimeError, match="NaN/Inf in the batch's target rows"):
        rela.wrap(torch.tensor(0.0), targets=bad)


def test_a_checked_data_sets_id_reused_by_another_object_is_checked_again(digits_store):
    import weakref

    rela = ReLA(digits_store.path, Backbone(), dataset=_digits())
    swapped = _swapped(_digits())

    class Gone:
        pass

    rela._checked_datasets[id(swapped)] = weakref.ref(Gone())  # what a freed data set at the same address leaves
    with pytest.raises(TargetStoreMismatchError, match="different content or another order"):
        rela.check_dataset(swapped)


def test_index_without_any_checked_data_set_warns(digits_store):
    model = Backbone()
    rela = ReLA(digits_store.path, model, feature_dim=16, total_steps=5)
    model(torch.rand(8, 1, 8, 8))
    with pytest.warns(UserWarning, match="no data set was checked against this target store"):
        rela.wrap(torch.tensor(0.0), index=torch.arange(8))


class _AugmentsInside(Dataset):
    """A user's data set that augments inside __getitem__ (no .transform attribute to switch off)."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x = _tensor_transform(self.base.data[i].numpy())
        return x + 0.01 * torch.rand_like(x), 0


def test_loader_data_set_that_cannot_be_identified(digits_store):
    """Refused with the fixes when nothing proves its items: a clean dataset= of another object does not vouch."""
    loader = DataLoader(_AugmentsInside(_digits()), batch_size=32)
    with pytest.raises(ValueError, match="Cannot identify.*dataset=accelerate_ssl.data.clean_view.*keys=batch_keys"):
        ReLA(digits_store.path, Backbone(), dataloader=loader)
    with pytest.raises(ValueError, match="No data set checked so far lists the same items in the same order"):
        ReLA(digits_store.path, Backbone(), dataset=_digits(), dataloader=loader)


class _Jittered(Dataset):
    """Augments inside __getitem__ through an attribute of its own name (``jitter``), no file list, no .data."""

    def __init__(self, images, jitter):
        self.images, self.jitter = images, jitter

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.jitter(_tensor_transform(self.images[i])), 0


def _jitter(x):
    return x + 0.01 * torch.rand_like(x)


@pytest.mark.parametrize("n", [40, 100])
def test_a_clean_view_of_the_very_object_vouches_for_it_and_says_what_its_check_covered(n, tmp_path):
    """dataset=clean_view(train_set) proves the training set's items (the same object, its transform off); a check
    of sampled items is never called full: the warning says what it covered."""
    import warnings

    from accelerate_ssl.data import clean_view

    images = _digits().data.numpy()[:n]
    train = _Jittered(images, _jitter)
    clean = clean_view(train, transform_attr="jitter")
    store = _precompute(clean, tmp_path / "s")
    coverage = store.metadata["dataset"]["fingerprint"]["coverage"]
    assert coverage == ("every item" if n <= 64 else f"sampled 64 of {n} items")
    loader = DataLoader(train, batch_size=8, shuffle=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ReLA(store.path, Backbone(), dataset=clean, dataloader=loader)
    said = [str(w.message) for w in caught if "cannot identify" in str(w.message)]
    if n <= 64:
        assert not said  # every item of the clean view was checked, and the view is proven to be the training set's
    else:
        assert len(said) == 1 and f"fingerprinted from sampled 64 of {n} items, not every item" in said[0]
        assert "full check" not in said[0] and "store verify" in said[0]
    reordered = DataLoader(_Jittered(images[::-1].copy(), _jitter), batch_size=8)  # same class, other order
    with pytest.raises(ValueError, match="No data set checked so far lists the same items"):
        ReLA(store.path, Backbone(), dataset=clean, dataloader=reordered)


def test_an_augmenting_data_set_is_identified_by_its_file_list_so_another_order_is_refused(tmp_path):
    """Accelerate's cv_example.py way (files in .file_names, augmentation inside __getitem__ from .image_transform),
    with a clean set listing the same files in another order: refused, every file name compared; the clean view of
    the training set itself is accepted without a warning."""
    import warnings

    from torchvision.transforms import Compose, RandomResizedCrop, ToTensor

    from accelerate_ssl.backbones import ConvNet
    from pets import PetsDataset, make_pet_images

    files = make_pet_images(tmp_path / "pets", 48)
    augment = Compose([RandomResizedCrop(16, scale=(0.5, 1.0)), ToTensor()])
    train = PetsDataset(files, image_transform=augment, items="tuple")
    reordered = PetsDataset(sorted(files) if sorted(files) != files else files[::-1], items="tuple")
    prior = create_prior("random:convnet", in_channels=3)
    store = precompute_targets(prior, reordered, tmp_path / "reordered", batch_size=16, progress=False)
    loader = DataLoader(train, batch_size=8, shuffle=True)
    with pytest.raises(TargetStoreMismatchError, match="the same 48 files in another order"):
        ReLA(store, Backbone(), dataset=reordered, dataloader=loader)

    from accelerate_ssl.data import clean_view

    clean = clean_view(train)
    store = precompute_targets(prior, clean, tmp_path / "clean", batch_size=16, progress=False)
    assert store.metadata["dataset"]["fingerprint"]["coverage"] == "every file name"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ReLA(store, ConvNet(in_channels=3, widths=(8,)), dataset=clean, dataloader=loader)


def test_a_transform_called_unconditionally_and_a_label_tensor_first():
    class Calls(Dataset):  # `self.transform(x)` without a None test; dict items with the label first
        def __init__(self, transform, offset=0.0):
            self.transform, self.offset = transform, offset

        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"label": torch.tensor(i % 2), "image": self.transform(torch.full((1, 4, 4), i / 10 + self.offset))}

    clean, augmented = Calls(lambda x: x), Calls(lambda x: x + torch.rand_like(x))
    assert dataset_fingerprint(clean) == dataset_fingerprint(augmented)  # the image is the sample, not the label
    assert augmented.transform(torch.zeros(1)).item() != 0.0  # the user's transform is back after reading
    other_images = Calls(lambda x: x, offset=0.05)  # same labels, other images
    assert dataset_fingerprint(other_images)["sha256"] != dataset_fingerprint(clean)["sha256"]
