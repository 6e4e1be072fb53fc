"""A folder data set is identified by its files' contents, not only their names (accelerate_ssl/data/fingerprint.py,
targets/store.py): images regenerated, resized, re-exported or swapped under the same names are refused at open,
naming the files and the fix; a copied folder (same bytes, new times) opens; `store verify --data` compares every
file's bytes; stores written before the contents were recorded keep opening."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import accelerate_ssl.data.fingerprint as fp
from accelerate_ssl import ReLA, create_prior, precompute_targets
from accelerate_ssl.cli import main
from accelerate_ssl.data.datasets import image_folder
from accelerate_ssl.targets.format import TargetStoreMismatchError
from accelerate_ssl.targets.store import TargetStore

pytestmark = pytest.mark.usefixtures("cpu_one_thread")
N = 12


def write_folder(root, seed: int = 0, size: int = 16):
    """``N`` RGB PNGs in two class folders; ``seed`` draws their pixels (the same names for every seed)."""
    rng = np.random.default_rng(seed)
    for i in range(N):
        folder = root / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / f"{i:03d}.png")
    return root


def _store(tmp_path, data):
    return precompute_targets(create_prior("random:convnet", in_channels=3), image_folder(data), tmp_path / "store",
                              batch_size=4, progress=False)


def _student():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten())


def test_precompute_records_each_rows_file_by_size_time_and_digest(tmp_path):
    data = write_folder(tmp_path / "data")
    store = _store(tmp_path, data)
    contents = np.load(store.path / "contents.npy")
    paths = fp.file_paths(image_folder(data))
    assert contents.shape == (N, 6) and store.metadata["contents"]["fields"] == list(fp.CONTENT_FIELDS)
    for i in (0, 5, N - 1):
        raw, st = open(paths[i], "rb").read(), os.stat(paths[i])
        assert contents[i].tolist() == [len(raw), st.st_mtime_ns, *fp.file_digest(raw), st.st_ctime_ns, st.st_ino]
    # the digest is blake2b-128 of the bytes, pinned: a one-line change of it would pass every other check
    assert fp.file_digest(b"accelerate-ssl") == (-2037013950636582584, 4995266345377466614)


def test_images_regenerated_under_the_same_names_are_refused_naming_them(tmp_path):
    """Before: the fingerprint and each row's digest covered the file names only, so every row was silently stale."""
    data = write_folder(tmp_path / "data")
    store = _store(tmp_path, data)
    write_folder(data, seed=1)  # a re-export: the same names, other pixels
    with pytest.raises(TargetStoreMismatchError, match=r"(?s)other contents of this data set's files.*12 file\(s\) hold "
                                                       r"other bytes.*class0/000\.png.*`rm -r .*store`, then "
                                                       r"`precompute_targets"):
        ReLA(TargetStore.open(store.path), _student(), dataset=image_folder(data), feature_dim=4)
    with pytest.raises(TargetStoreMismatchError, match="other bytes"):
        TargetStore.open(store.path, dataset=image_folder(data))


def test_two_files_swapped_in_place_are_refused_even_with_their_sizes_and_times(tmp_path):
    """Two files of the same size swapped, their times put back: only their bytes tell (the sample every open reads)."""
    data = write_folder(tmp_path / "data")
    a, b = data / "class0" / "000.png", data / "class0" / "002.png"
    Image.new("RGB", (16, 16), (10, 20, 30)).save(a)
    Image.new("RGB", (16, 16), (30, 20, 10)).save(b)
    assert a.stat().st_size == b.stat().st_size
    store = _store(tmp_path, data)
    times = {p: (p.stat().st_atime_ns, p.stat().st_mtime_ns) for p in (a, b)}
    ta, tb = a.read_bytes(), b.read_bytes()
    a.write_bytes(tb)
    b.write_bytes(ta)
    for p, t in times.items():
        os.utime(p, ns=t)
    with pytest.raises(TargetStoreMismatchError, match=r"2 file\(s\) hold other bytes.*000\.png \(other bytes\)"):
        TargetStore.open(store.path, dataset=image_folder(data))


def test_a_copied_folder_opens_and_a_large_retouch_says_what_was_read(tmp_path, monkeypatch):
    data = write_folder(tmp_path / "data")
    store = _store(tmp_path, data)
    copy = tmp_path / "copy"
    shutil.copytree(data, copy, copy_function=shutil.copyfile)  # the bytes, new modification times
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TargetStore.open(store.path, dataset=image_folder(copy))  # every retouched file read: the same bytes
    monkeypatch.setattr(fp, "CONTENT_BUDGET", 3)
    monkeypatch.setattr(fp, "CONTENT_SAMPLE", 2)
    with pytest.warns(UserWarning, match=r"12 of this data set's files are not the files the targets were computed "
                                         r"from by their stat.*3 of them were read.*store verify"):
        TargetStore.open(store.path, dataset=image_folder(copy))


def test_a_missing_file_is_named(tmp_path):
    data = write_folder(tmp_path / "data")
    store = _store(tmp_path, data)
    listed = image_folder(data)  # its file list, made before the file goes
    (data / "class1" / "003.png").unlink()
    with pytest.raises(TargetStoreMismatchError, match=r"1 file\(s\) are gone: .*003\.png \(missing\)"):
        TargetStore.open(store.path, dataset=listed)


def test_store_verify_data_compares_every_files_bytes(tmp_path, capsys):
    data = write_folder(tmp_path / "data")
    store = _store(tmp_path, data)
    assert main(["store", "verify", str(store.path), "--data", f"folder:{data}", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "compared by file name and bytes, 12 files read" in out
    write_folder(data, seed=2)
    assert main(["store", "verify", str(store.path), "--data", f"folder:{data}", "--no-progress"]) == 1
    assert "12 file(s) hold other bytes" in capsys.readouterr().err


def test_stores_written_before_contents_were_recorded_keep_opening(tmp_path, capsys):
    data = write_folder(tmp_path / "data")
    store = _store(tmp_path, data)
    meta = json.loads((store.path / "metadata.json").read_text())
    del meta["contents"]
    (store.path / "metadata.json").write_text(json.dumps(meta))
    (store.path / "contents.npy").unlink()
    TargetStore.open(store.path, dataset=image_folder(data))  # names only, as before
    assert main(["store", "verify", str(store.path), "--data", f"folder:{data}", "--no-progress"]) == 0
    assert "compared by file names only: this store records no file contents" in capsys.readouterr().out


def test_from_prior_refuses_its_cached_store_after_the_images_changed(tmp_path):
    """The issue's case: ReLA.from_prior reopened the cached store of the old images (the cache is keyed by the data
    set's fingerprint: the same names)."""
    data = write_folder(tmp_path / "data")
    loader = torch.utils.data.DataLoader(image_folder(data, transform=lambda im: torch.zeros(3, 16, 16)), batch_size=4)
    spec = create_prior("random:convnet", in_channels=3)
    ReLA.from_prior(spec, _student(), loader, cache_dir=tmp_path / "cache", total_steps=3, progress=False,
                    witness=False)
    write_folder(data, seed=1)
    loader = torch.utils.data.DataLoader(image_folder(data, transform=lambda im: torch.zeros(3, 16, 16)), batch_size=4)
    with pytest.raises(TargetStoreMismatchError, match=r"other contents of this data set's files.*ReLA\.from_prior"):
        ReLA.from_prior(spec, _student(), loader, cache_dir=tmp_path / "cache", total_steps=3, progress=False,
                        witness=False)


@pytest.mark.parametrize("kind", ["file_names", "lightly"])
def test_other_file_lists_are_identified_by_content_too(tmp_path, kind):
    """Accelerate's cv_example keeps its files in .file_names (joined paths, no root); lightly's LightlyDataset lists
    names under .input_dir: each row's file is found and its bytes checked."""
    data = write_folder(tmp_path / "data")
    if kind == "file_names":
        from pets import PetsDataset, make_pet_images

        files = make_pet_images(tmp_path / "pets", N, size=16)  # as the example lists its folder
        dataset = lambda: PetsDataset(files, items="tuple")  # noqa: E731  (dict items: a field said once per process)
    else:
        lightly = pytest.importorskip("lightly.data")
        flat = tmp_path / "flat"
        flat.mkdir()
        for p in sorted(data.rglob("*.png")):
            shutil.copyfile(p, flat / f"{p.parent.name}-{p.name}")
        data = flat
        dataset = lambda: lightly.LightlyDataset(input_dir=str(flat))  # noqa: E731
    paths = fp.file_paths(dataset())
    assert len(paths) == N and all(os.path.isabs(p) and os.path.isfile(p) for p in paths)
    store = precompute_targets(create_prior("random:convnet", in_channels=3), dataset(), tmp_path / "store",
                               batch_size=4, progress=False, image_key=0 if kind == "lightly" else None)
    assert store.metadata["contents"] and store.metadata["dataset"]["fingerprint"]["kind"] == "files"
    TargetStore.open(store.path, dataset=dataset())
    victim = paths[5]
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(victim)  # one image re-exported in place
    with pytest.raises(TargetStoreMismatchError, match=rf"1 file\(s\) hold other bytes .*{os.path.basename(victim)}"):
        TargetStore.open(store.path, dataset=dataset())


# ------------------------------------------------------------------------------------------ without trusting times
SAME_TIME = 1_700_000_000_000_000_000  # every file of the folder gets this modification time (an extracted archive's)


def same_size_folder(root, pool=None):
    """``N`` bitmaps of one size (a flat colour each: one byte size) in two class folders, every file's modification
    time the same; with ``pool``, each is a symlink to its file in ``pool`` (a folder of links, as a data set's view of
    a shared store)."""
    for i in range(N):
        folder = root / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        target = (pool or folder) / f"{i:03d}.bmp"
        target.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 16), (10 * i, 255 - 10 * i, 7 * i)).save(target)
        if pool is not None:
            (folder / f"{i:03d}.bmp").symlink_to(target)
    every_time_alike(root, pool)
    return root


def every_time_alike(*roots):
    for root in roots:
        for p in (root.rglob("*.bmp") if root is not None else ()):
            os.utime(p, ns=(SAME_TIME, SAME_TIME))


def edit_in_place(data, pool):
    """One image re-exported into its own file (the same size), its time put back."""
    victim = data / "class1" / "003.bmp"
    with open(victim, "r+b") as f:
        raw = bytearray(f.read())
        raw[-20] ^= 0xFF  # a changed pixel (the file stays its size)
        f.seek(0)
        f.write(raw)
    every_time_alike(data)
    return ["003.bmp"]


def swap_by_rename(data, pool):
    """Two files of one size swapped under their names (mv a t; mv b a; mv t b), their times alike."""
    a, b = data / "class0" / "000.bmp", data / "class0" / "002.bmp"
    tmp = data / "swap.tmp"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    every_time_alike(data)
    return ["000.bmp", "002.bmp"]


def swap_by_copy(data, pool):
    """Two files' bytes exchanged in place (their inodes kept), their times put back."""
    a, b = data / "class0" / "000.bmp", data / "class0" / "002.bmp"
    ta, tb = a.read_bytes(), b.read_bytes()
    a.write_bytes(tb)
    b.write_bytes(ta)
    every_time_alike(data)
    return ["000.bmp", "002.bmp"]


def retarget_link(data, pool):
    """A symlinked image pointed at another file of the same size and time."""
    link = data / "class1" / "005.bmp"
    link.unlink()
    link.symlink_to(pool / "007.bmp")
    return ["005.bmp"]


CHANGES = {"edited in place, its time put back": edit_in_place, "two files swapped by rename": swap_by_rename,
           "two files' bytes swapped, times put back": swap_by_copy, "a symlink retargeted": retarget_link}


@pytest.mark.parametrize("change", CHANGES)
def test_changes_that_keep_every_size_and_time_stop_training_at_the_open(tmp_path, monkeypatch, change):
    """Before: with every file's modification time alike, only the 32 files an open reads could tell these apart from
    the files the targets were computed on (a folder of 12 files was read whole; 100,000 files would almost never be).
    The change time and the inode the store records tell them at every open: here no file is sampled at all."""
    pool = tmp_path / "pool" if change == "a symlink retargeted" else None
    data = same_size_folder(tmp_path / "data", pool)
    store = _store(tmp_path, data)
    changed = CHANGES[change](data, pool)
    monkeypatch.setattr(fp, "CONTENT_SAMPLE", 0)  # the stat alone
    paths = fp.file_paths(image_folder(data))
    assert len({os.stat(p).st_size for p in paths}) == 1 and {os.stat(p).st_mtime_ns for p in paths} == {SAME_TIME}
    names = ".*".join(rf"{n} \(other bytes\)" for n in changed)
    with pytest.raises(TargetStoreMismatchError, match=rf"{len(changed)} file\(s\) hold other bytes.*{names}"):
        ReLA(TargetStore.open(store.path), _student(), dataset=image_folder(data), feature_dim=4)  # training stops


@pytest.mark.parametrize("change", CHANGES)
def test_a_store_that_records_sizes_and_times_only_misses_them_unless_sampled(tmp_path, monkeypatch, change):
    """The same changes against the record stores wrote before (size, modification time, digest): they pass an open
    that samples no file; so it is the change time and the inode that catch them above, not the sample."""
    pool = tmp_path / "pool" if change == "a symlink retargeted" else None
    data = same_size_folder(tmp_path / "data", pool)
    store = _store(tmp_path, data)
    meta = json.loads((store.path / "metadata.json").read_text())
    meta["contents"]["fields"] = list(fp.CONTENT_FIELDS_V1)
    (store.path / "metadata.json").write_text(json.dumps(meta))
    np.save(store.path / "contents.npy", np.load(store.path / "contents.npy")[:, :4])
    CHANGES[change](data, pool)
    monkeypatch.setattr(fp, "CONTENT_SAMPLE", 0)
    TargetStore.open(store.path, dataset=image_folder(data))  # accepted: nothing it looks at changed
    monkeypatch.setattr(fp, "CONTENT_SAMPLE", 32)  # the random sample reads all 12 files here: caught
    with pytest.raises(TargetStoreMismatchError, match="hold other bytes"):
        TargetStore.open(store.path, dataset=image_folder(data))


def test_a_folder_copied_with_its_times_opens_by_reading_what_changed(tmp_path, monkeypatch):
    """cp -a keeps modification times but every file is a new inode: the open reads them (the same bytes: it opens);
    more of them than an open reads is said, as for new times."""
    data = same_size_folder(tmp_path / "data")
    store = _store(tmp_path, data)
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)  # copy2: contents and times
    assert os.stat(copy / "class0" / "000.bmp").st_mtime_ns == SAME_TIME
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TargetStore.open(store.path, dataset=image_folder(copy))
    monkeypatch.setattr(fp, "CONTENT_BUDGET", 3)
    with pytest.warns(UserWarning, match=r"12 of this data set's files are not the files the targets were computed "
                                         r"from by their stat \(another modification time, change time or inode"):
        TargetStore.open(store.path, dataset=image_folder(copy))
