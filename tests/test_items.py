"""Dict and tuple items everywhere: the image of an item is found by one rule (precompute, fingerprints, row identity
digests, clean views), named with ``image_key=`` / ``--image-field`` (one grammar for map-style, hf: and wds: data),
the common names found by default and the choice printed; an item the library cannot read is refused naming the data
set, the item's structure and the fix. Data sets list their files under common names (``.file_names``); the clean
view of a data set finds its transform under common names, or takes the one named. Stores fingerprinted before still
open and are checked under their own definition.

The data set is written the way Accelerate's ``examples/cv_example.py`` writes its own (tests/pets.py), over real PNG
files."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, Subset
from torchvision.transforms import Compose, RandomResizedCrop, ToTensor

from accelerate_ssl.cli import main as cli_main
from accelerate_ssl.data import clean_view, dataset_fingerprint, describe_fingerprint_mismatch
from accelerate_ssl.data.fingerprint import RowIdentity
from accelerate_ssl.data.items import same_items
from accelerate_ssl.targets.precompute import precompute_targets
from accelerate_ssl.priors import create_prior
from accelerate_ssl.targets.store import TargetStore, TargetStoreMismatchError
from pets import PetsDataset, make_pet_images, name_number


@pytest.fixture()
def files(tmp_path):
    return sorted(make_pet_images(tmp_path / "pets", 12))


def _prior():
    return create_prior("random:convnet", in_channels=3)


def _augment():
    return Compose([RandomResizedCrop(16, scale=(0.5, 1.0)), ToTensor()])


def _rows(store):
    return store[np.arange(len(store))]


# ---------------------------------------------------------------------------------------------- dict items
def test_dict_items_are_precomputed_from_their_image_field_and_the_choice_is_said(files, tmp_path, capsys):
    """Accelerate's example items ({"image", "label"}) precompute as the same images in (image, label) tuples do, row
    for row; the field taken is printed once; the store's keys are the example's file names."""
    store = precompute_targets(_prior(), PetsDataset(files), tmp_path / "dict", batch_size=5, progress=False)
    said = capsys.readouterr().err
    assert said.count("the image is field 'image'") == 1 and "PetsDataset items are dict" in said
    reference = precompute_targets(_prior(), PetsDataset(files, items="tuple"), tmp_path / "tuple", batch_size=5,
                                   progress=False)
    assert np.array_equal(_rows(store), _rows(reference))  # row i is the prior's embedding of file i's image
    assert store.metadata["dataset"]["image_key"] == "image"
    assert store.metadata["dataset"]["fingerprint"]["kind"] == "files"
    assert [name_number(k) for k in store.keys.in_row_order()] == [name_number(f) for f in files]
    assert store.verify_rows(PetsDataset(files, image_transform=_augment()))["kind"] == "files"


class TwoImages(Dataset):
    """Dict items with two image fields and a label; no file list, so identified by its items."""

    def __init__(self, n=10, offset=0):
        rng = np.random.default_rng(offset)
        self.pictures = rng.integers(0, 256, (n, 3, 8, 8), dtype=np.uint8)
        self.masks = rng.integers(0, 256, (n, 3, 8, 8), dtype=np.uint8)

    def __len__(self):
        return len(self.pictures)

    def __getitem__(self, i):
        return {"label": i % 2, "image": torch.from_numpy(self.pictures[i]), "mask": torch.from_numpy(self.masks[i])}


class Masks(TwoImages):
    def __getitem__(self, i):
        return torch.from_numpy(self.masks[i])


def test_image_key_names_another_field_and_the_store_keeps_it(tmp_path):
    ds = TwoImages()
    store = precompute_targets(_prior(), ds, tmp_path / "mask", image_key="mask", progress=False)
    assert np.array_equal(_rows(store), _rows(precompute_targets(_prior(), Masks(), tmp_path / "ref", progress=False)))
    fingerprint = store.metadata["dataset"]["fingerprint"]
    assert fingerprint["image_key"] == "mask" and fingerprint["coverage"] == "every item"
    assert dataset_fingerprint(ds, image_key="mask")["sha256"] == fingerprint["sha256"]
    assert dataset_fingerprint(ds)["sha256"] != fingerprint["sha256"]  # by default the "image" field is read
    TargetStore.open(store.path, dataset=ds)  # the check reads the field the store recorded
    assert store.verify_rows(ds)["rows_checked"] == 10
    other = TwoImages()
    other.masks = other.masks[::-1].copy()  # the same pictures, other masks: other samples for this store
    with pytest.raises(TargetStoreMismatchError, match="different content or another order"):
        TargetStore.open(store.path, dataset=other)
    with pytest.raises(TargetStoreMismatchError, match="rows do not belong"):
        store.verify_rows(other)


class Encoded(Dataset):
    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 3

    def __getitem__(self, i):
        return self.item


@pytest.mark.parametrize("item, image_key, words", [
    ({"jpeg_bytes": b"\xff\xd8", "label": 3}, None,
     ["a dict {'jpeg_bytes': bytes, 'label': int}", "none of its fields is one of the common image fields",
      "image_key='<field>'", "--image-field <field>"]),
    ({"image": "tabby_1.png", "label": 0}, None, ["its field 'image' holds a str, not an image", "image_key='<field>'"]),
    ({"image": torch.zeros(3, 4, 4)}, "picture", ["it has no field 'picture' (image_key)"]),
    (("tabby_1.png", 0), None, ["a tuple (str, int)", "no element of it is an image", "image_key=<position>"]),
    ((torch.zeros(3, 4, 4), 0), "image", ["image_key='image' names a field, but tuple items have positions"]),
    ({"image": torch.zeros(5, 4, 4)}, None, ["Expected an image [C, H, W] with 1 or 3 channels", "image_key="]),
    ({"image": [[[0, 1, 2]] * 4] * 4, "label": 0}, None,  # a Hugging Face Array3D cell read without a format
     ["its field 'image' holds a list", "pixels as nested Python lists", "dtype='uint8', output_all_columns=True"]),
])
def test_an_item_the_library_cannot_read_names_the_data_set_its_structure_and_the_fix(tmp_path, item, image_key, words):
    named = {} if image_key is None else {"image_key": image_key}
    with pytest.raises(TypeError) as caught:
        precompute_targets(_prior(), Encoded(item), tmp_path / "x", progress=False, **named)
    message = str(caught.value)
    assert "Cannot read the image of item 0 of Encoded" in message
    for word in words:
        assert word in message, message
    assert not (tmp_path / "x").exists()  # refused before anything is written


class Squares(Dataset):
    """Item i: a 3x8x8 uint8 image of value 20 i."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.full((3, 8, 8), 20 * i, dtype=torch.uint8)


class LabelFirst(Squares):
    """``(label vector, image)``: the first image-like value is the label, so the image's position is named."""

    def __getitem__(self, i):
        return torch.tensor([i, -i]), super().__getitem__(i)


def test_tuple_items_take_a_position(tmp_path):
    store = precompute_targets(_prior(), LabelFirst(), tmp_path / "pos", image_key=1, progress=False)
    assert store.metadata["dataset"]["fingerprint"]["image_key"] == 1
    TargetStore.open(store.path, dataset=LabelFirst())
    assert np.array_equal(_rows(store), _rows(precompute_targets(_prior(), Squares(), tmp_path / "ref", progress=False)))


# ---------------------------------------------------------------------------------------------- one CLI grammar
def test_image_field_is_one_grammar_for_hf_columns_and_map_style_items(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in range(7)]
    ds = datasets.Dataset.from_dict({"img": pictures, "label": list(range(7))},
                                    features=datasets.Features({"img": datasets.Image(), "label": datasets.Value("int64")}))
    ds.save_to_disk(str(tmp_path / "hf"))
    # the common names are found in an hf data set's columns as in dict items ("img", like CIFAR-10 on the Hub)
    assert cli_main(["precompute", "--prior", "random:convnet", "--data", f"hf:{tmp_path / 'hf'}",
                     "--out", str(tmp_path / "hf-targets"), "--no-progress"]) == 0
    assert "the image is column 'img'" in capsys.readouterr().err
    assert cli_main(["precompute", "--prior", "random:convnet", "--data", f"hf:{tmp_path / 'hf'}", "--image-field",
                     "label", "--out", str(tmp_path / "bad"), "--no-progress"]) == 2
    capsys.readouterr()

    folder = tmp_path / "folder"
    make_pet_images(folder, 6)
    args = ["precompute", "--prior", "random:convnet", "--data", f"folder:{folder}", "--no-progress"]
    assert cli_main(args + ["--image-field", "image", "--out", str(tmp_path / "f1")]) == 2
    err = capsys.readouterr().err
    assert "image_key='image' names a field, but tuple items have positions" in err and f"item 0 of folder:{folder}" in err
    assert cli_main(args + ["--image-field", "0", "--out", str(tmp_path / "f2"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 6
    assert "--image-field 0" in TargetStore.open(tmp_path / "f2").metadata["command"]


# ---------------------------------------------------------------------------------------------- file lists
@pytest.mark.parametrize("attribute", ["file_names", "filenames", "files", "image_paths", "paths"])
def test_a_file_list_under_a_common_name_identifies_the_data_set(files, attribute):
    class Listed(Dataset):
        def __init__(self, names, augment=None):
            setattr(self, attribute, names)
            self.augment = augment

        def __len__(self):
            return len(getattr(self, attribute))

        def __getitem__(self, i):
            return torch.rand(3, 4, 4), 0  # never read: the file list is the identity

    fp = dataset_fingerprint(Listed(files))
    assert fp["kind"] == "files" and fp["coverage"] == "every file name"
    assert fp == dataset_fingerprint(Listed(list(files), augment=lambda x: x))
    reordered = dataset_fingerprint(Listed(files[1:] + files[:1]))
    assert "the same 12 files in another order" in describe_fingerprint_mismatch(fp, reordered)
    other = dataset_fingerprint(Listed(files[:-1] + [files[-1] + ".other.png"]))
    assert "different content or another order" in describe_fingerprint_mismatch(fp, other)
    assert np.array_equal(RowIdentity(Listed(files)).all()[::-1], RowIdentity(Listed(files[::-1])).all())


def test_a_list_that_is_not_one_path_per_item_is_not_a_file_list(files):
    class Shards(Dataset):  # .files names 2 shards, not the 12 items
        files = ["a.tar", "b.tar"]

        def __len__(self):
            return 12

        def __getitem__(self, i):
            return torch.full((3, 4, 4), i / 12), 0

    assert dataset_fingerprint(Shards())["kind"] == "items"


# ---------------------------------------------------------------------------------------------- clean views
def test_clean_view_finds_the_transform_under_its_common_names(files):
    from accelerate_ssl.integrations.lightly import clean_dataset

    augmented = PetsDataset(files, image_transform=_augment())
    view = clean_view(augmented)
    assert view.image_transform is None and augmented.image_transform is not None  # the user's object untouched
    assert view[0]["image"].size == (20, 20) and view.file_names is augmented.file_names
    assert same_items(view, augmented) and same_items(augmented, view)
    assert clean_dataset(augmented).image_transform is None  # lightly's helper is the same clean view

    from torchvision.datasets import ImageFolder  # .transform and torchvision's .transforms; the target one is kept

    folder = ImageFolder(str(files[0].rsplit("/", 2)[0]), transform=_augment(), target_transform=lambda y: y + 10)
    clean = clean_view(folder)
    assert clean.transform is None and clean.transforms.transform is None and clean[0][1] == 10

    subset = clean_view(Subset(augmented, [3, 1]))
    assert isinstance(subset, Subset) and subset.indices == [3, 1] and subset.dataset.image_transform is None


class Jittered(Dataset):
    """Its augmentation under a name of its own, called without a test for None."""

    def __init__(self, file_names, jitter):
        self.file_names, self.jitter = file_names, jitter

    def __len__(self):
        return len(self.file_names)

    def __getitem__(self, i):
        from PIL import Image

        with Image.open(self.file_names[i]) as opened:
            return {"image": self.jitter(opened.convert("RGB")), "label": 0}


def test_clean_view_takes_a_named_transform_and_says_what_to_do_without_one(files):
    jittered = Jittered(files, _augment())
    with pytest.raises(TypeError, match="none of the transform attributes transform, transforms, image_transform"):
        clean_view(jittered)
    with pytest.raises(TypeError, match="no attribute 'jiter'"):
        clean_view(jittered, transform_attr="jiter")
    view = clean_view(jittered, transform_attr="jitter")  # called unconditionally: the identity, not None
    assert view[0]["image"].size == (20, 20) and same_items(view, jittered)


def test_same_items_needs_proof_not_a_length(files):
    a = PetsDataset(files, image_transform=_augment())
    assert same_items(a, PetsDataset(list(files)))  # an equal list, the transform aside
    assert not same_items(a, PetsDataset(files[::-1]))  # the same files in another order
    assert not same_items(a, PetsDataset(files, label_to_id={"tabby": 0}))  # other state
    assert not same_items(a, PetsDataset(files, items="tuple"))
    assert not same_items(Subset(a, [0, 1]), Subset(a, [1, 0]))


# ---------------------------------------------------------------------------------------------- stores made before
#: what accelerate-ssl wrote for PetsDataset(sorted(make_pet_images(dir, 12)), items="tuple") before data sets were
#: identified by .file_names (fingerprint scheme 2: every item's image) and the sha256 of its identity.npy digests
SCHEME_2_SHA256 = "6a9f2ad6734f42d46be8a0fcd6c820a303af6e76199fd7f5977d60a13972ee62"
SCHEME_2_IDENTITY_SHA256 = "a808e9e31f9388d8904cbe131bb9275aab0cd032cfef384eb90eaddcc707819a"


def test_a_store_fingerprinted_before_opens_and_is_checked_under_its_own_definition(files, tmp_path):
    from accelerate_ssl.targets.store import IDENTITY, METADATA

    ds = PetsDataset(files, items="tuple")
    store = precompute_targets(_prior(), ds, tmp_path / "old", progress=False)
    # make it the store the previous version wrote: its fingerprint and identity digests
    old = {"scheme": 2, "length": 12, "kind": "items", "sha256": SCHEME_2_SHA256, "coverage": "every item"}
    assert dataset_fingerprint(ds, like=old) == old
    digests = RowIdentity(ds, like=old).all()
    assert hashlib.sha256(digests.tobytes()).hexdigest() == SCHEME_2_IDENTITY_SHA256
    metadata = json.loads((store.path / METADATA).read_text())
    metadata["dataset"]["fingerprint"] = old
    (store.path / METADATA).write_text(json.dumps(metadata))
    np.save(store.path / IDENTITY, digests)

    reopened = TargetStore.open(store.path, dataset=PetsDataset(files))  # dict items: the same samples
    assert reopened.verify_rows(ds)["rows_checked"] == 12
    assert precompute_targets(_prior(), ds, store.path, progress=False).path == store.path  # not "other settings"
    with pytest.raises(TargetStoreMismatchError, match="another order"):
        TargetStore.open(store.path, dataset=PetsDataset(files[::-1], items="tuple"))
    assert dataset_fingerprint(ds)["kind"] == "files"  # what a store written now records


# ---------------------------------------------------------------------------------------------- views, dry forward
def test_stored_views_of_dict_items_keep_the_dict(files, tmp_path):
    from accelerate_ssl.data import ReplayViews, StoredViews

    views = ReplayViews(PetsDataset(files), StoredViews(k=2, seed=0))
    item = views[3]  # view 1 of image 1: a crop, the label kept
    assert set(item) == {"image", "label"} and item["label"] == PetsDataset(files)[1]["label"]
    assert item["image"].size == (20, 20)
    store = precompute_targets(_prior(), views, tmp_path / "views", progress=False)
    assert len(store) == 24 and store.metadata["views"]["k"] == 2
    TargetStore.open(store.path, dataset=ReplayViews(PetsDataset(files), store))


def test_the_feature_dim_dry_forward_reads_the_items_image():
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.rela.capture import infer_feature_dim

    class SoftLabels(Dataset):  # a float label vector comes first: the image field is what the backbone takes
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return {"soft_label": torch.tensor([0.2, 0.8]), "image": torch.rand(3, 8, 8)}

    assert infer_feature_dim(ConvNet(in_channels=3, widths=(8, 12)), SoftLabels()) == 12
