"""Every error that names a fix as a command to run (or a call to make) is followed here as written, in the situation
that raised it, on the folder the user has: the one the precompute wrote, or a copy of it. The commands are taken from
the message itself (between backticks) and run as they are: ``accelerate-ssl ...`` through the CLI, ``rm ...`` on the
paths it names (which must lie inside the folder the error names), a ``precompute_targets(...)`` /
``precompute_sidecars(...)`` call with the data set in place of its ``<name>``. Then training runs, and every row it
reads is the sample's own (the rows of an independent precompute for that image, or the prior's output for it), and
nothing outside the named folder changed (every other file under the test's folder, the original of a copy included,
has its bytes and its modification time)."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader

from accelerate_ssl import ReLA, ShardedTargets, create_prior, precompute_sidecars, precompute_targets
from accelerate_ssl.cli import main
from accelerate_ssl.data.datasets import image_folder
from accelerate_ssl.data.streams import open_stream
from accelerate_ssl.targets.format import SidecarError, TargetStoreCorruptError, TargetStoreMismatchError
from accelerate_ssl.targets.store import TargetStore
from recipe_check import ReadSpy

import test_streams as ts

pytestmark = pytest.mark.usefixtures("cpu_one_thread")

N = 20  # images of the folder data set


# ---------------------------------------------------------------------------------------------- following a message
def commands(message: str) -> list[str]:
    """The commands and calls a message names, in order (its backticked parts)."""
    return re.findall(r"`([^`]+)`", message)


def follow(message: str, folder: Path, dataset=None) -> list:
    """Do what ``message`` says, as written: each backticked command or call in order. ``rm`` may only name paths
    inside ``folder``, the folder the error is about. Returns each command's exit status (the call's result)."""
    done = []
    assert commands(message), f"no command to follow in: {message}"
    for command in commands(message):
        if command.startswith(("precompute_targets(", "precompute_sidecars(")):
            call = re.sub(r"<[^<>]+>", "dataset", command)  # the data set the message names by its <name>
            names = {"precompute_targets": precompute_targets, "precompute_sidecars": precompute_sidecars,
                     "create_prior": create_prior, "open_stream": open_stream, "dataset": dataset}
            done.append(eval(call, names))
            continue
        words = shlex.split(command)
        if words[0] == "rm":
            paths = [Path(w) for w in words[1:] if not w.startswith("-")]
            outside = [p for p in paths if not p.resolve().is_relative_to(folder.resolve())]
            assert paths and not outside, f"{command!r} deletes outside {folder}: {outside}"
            for p in paths:
                if p.is_dir():
                    assert "-r" in words, command
                    shutil.rmtree(p)
                elif p.exists() or "-f" not in words:
                    p.unlink()
            done.append(0)
        elif words[0] == "accelerate-ssl":
            done.append(main(words[1:]))
        else:
            raise AssertionError(f"a command the message names that the test cannot run: {command!r}")
    return done


class Interrupted(Exception):
    """A run stopped half-way (a job preempted, a ctrl-C) by the test."""


def interrupted_at(monkeypatch, module, name: str, *command: str) -> None:
    """Run the CLI ``command`` with ``module.name`` (the step that finishes its folder) stopping it: the folder is left
    as an interrupted run leaves it."""
    def stop(*args, **kwargs):
        raise Interrupted

    with monkeypatch.context() as m:
        m.setattr(module, name, stop)
        with pytest.raises(Interrupted):
            main(list(command))


def _copy_says_resume(original: Path, copy: Path, error, match: str, opener) -> tuple[str, dict]:
    """The copy of an interrupted folder: the error opening it (which must name ``match``), and what lies outside
    it."""
    shutil.copytree(original, copy)
    with pytest.raises(error, match=match) as err:
        opener(copy)
    return str(err.value), snapshot(copy.parent, copy)


def snapshot(root: Path, but: Path) -> dict:
    """Every file and folder under ``root`` except ``but``, with its bytes (sha256), size and modification time."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.resolve().is_relative_to(but.resolve()):
            continue
        st = p.stat()
        out[str(p.relative_to(root))] = ("dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest(),
                                         st.st_size if p.is_file() else 0, st.st_mtime_ns if p.is_file() else 0)
    return out


# ---------------------------------------------------------------------------------------------- a folder data set
def write_images(folder: Path, numbers) -> None:
    """Grayscale PNG files ``NNN.png``, image n carrying its number in its first pixels (test_streams.image_of)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(numbers):
        Image.fromarray(ts.image_of(n)).save(folder / f"{i:03d}.png")


def precompute_command(images: Path, out: Path) -> list[str]:
    return ["precompute", "--prior", "random:convnet", "--data", f"folder:{images}", "--out", str(out), "--batch-size",
            "4", "--chunk-size", "8", "--no-progress"]


def rows_by_number(store_path: Path, images: Path) -> dict[int, np.ndarray]:
    """An image's row, by the number it carries: the rows of the store at ``store_path``, in its data set's order."""
    data = image_folder(images)
    rows = np.array(TargetStore.open(store_path).array, dtype=np.float32)
    return {ts.number_of(torch.from_numpy(np.array(data[i][0]))[None].permute(0, 3, 1, 2)).item(): rows[i]
            for i in range(len(data))}


def train_reads_own_rows(store_path: Path, images: Path, reference: dict[int, np.ndarray], **rela_kwargs) -> int:
    """Train on the folder with ReLA on ``store_path``: every row read is the reference row of the image it is read
    for (found by the number the image carries). Returns the steps trained."""
    from torchvision.transforms import PILToTensor

    data = image_folder(images, transform=PILToTensor())
    loader = DataLoader(data, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(0))
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(3 * ts.SIZE * ts.SIZE, 8))
    rela = ReLA(str(store_path), backbone, dataloader=loader, feature_dim=8, schedule="constant:1", witness=False,
                alignment_check=False, **rela_kwargs)
    spy = rela.targets.store = ReadSpy(rela.targets.store)
    opt = torch.optim.SGD([*backbone.parameters(), *rela.parameters()], lr=0.01)
    steps = 0
    for epoch in range(2):
        for x, _ in loader:
            loss = rela.wrap(backbone(x.float() / 255).pow(2).mean())
            loss.backward()
            opt.step()
            opt.zero_grad()
            expected = np.stack([reference[n] for n in ts.number_of(x).tolist()])
            assert torch.allclose(spy.reads[-1], torch.from_numpy(expected), atol=1e-5), "a row of another image"
            steps += 1
    assert steps == 2 * -(-N // 6)
    return steps


@pytest.fixture()
def folder_store(tmp_path, capsys):
    """A folder of images, its store written by the CLI (``original``), and a copy of that store (``copy``)."""
    images = tmp_path / "images"
    write_images(images, range(N))
    assert main(precompute_command(images, tmp_path / "original")) == 0
    shutil.copytree(tmp_path / "original", tmp_path / "copy")
    capsys.readouterr()
    return tmp_path, images, rows_by_number(tmp_path / "original", images)


def _flip_a_row_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # a row's bytes, the .npy header and the size kept
    path.write_bytes(bytes(raw))


def _nan_row(path: Path) -> None:
    rows = np.load(path, mmap_mode="r+")
    rows[3] = np.nan
    rows.flush()
    del rows


#: damage done to a store folder -> (how the user meets it, what the error says)
STORE_DAMAGE = {
    "rows changed on disk": (lambda f: _flip_a_row_byte(f / "targets.npy"), "verify", r"changed on disk"),
    "rows truncated": (lambda f: (f / "targets.npy").write_bytes((f / "targets.npy").read_bytes()[:-4]), "open",
                       r"truncated or replaced"),
    "rows missing": (lambda f: (f / "targets.npy").unlink(), "open", r"targets\.npy is missing"),
    "rows not an array": (lambda f: (f / "targets.npy").write_bytes(b"x" * (f / "targets.npy").stat().st_size), "open",
                          r"not a readable \.npy file"),
    "NaN rows": (lambda f: _nan_row(f / "targets.npy"), "train", r"NaN/Inf values in row"),
    "metadata not JSON": (lambda f: (f / "metadata.json").write_text("{"), "open", r"is not valid JSON"),
    "metadata of something else": (lambda f: (f / "metadata.json").write_text(json.dumps(
        {**json.loads((f / "metadata.json").read_text()), "format": "other"})), "open",
        r"not accelerate-ssl target-store"),
    "keys unreadable": (lambda f: (f / "keys-sorted.npy").write_bytes(b"broken"), "open",
                        r"sample keys .* are unreadable"),
    "contents record gone": (lambda f: (f / "contents.npy").unlink(), "train", r"recorded contents .* is missing"),
    "identity record gone": (lambda f: (f / "identity.npy").unlink(), "verify rows", r"records no per-row identity"),
}


def _train(folder: Path, images: Path) -> None:
    """Training with ReLA on the store at ``folder``, as a user's loop (no check of its own)."""
    from torchvision.transforms import PILToTensor

    loader = DataLoader(image_folder(images, transform=PILToTensor()), batch_size=6)
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(3 * ts.SIZE * ts.SIZE, 8))
    rela = ReLA(str(folder), backbone, dataloader=loader, feature_dim=8, schedule="constant:1", witness=False,
                alignment_check=False)
    for x, _ in loader:
        rela.wrap(backbone(x.float() / 255).pow(2).mean()).backward()


def _meet(how: str, folder: Path, images: Path, capsys) -> str:
    """The error the user meets on a damaged store ``folder`` the way ``how`` says: its message."""
    if how == "verify":
        assert main(["store", "verify", str(folder), "--no-progress"]) == 1
        return capsys.readouterr().err
    if how == "verify rows":
        assert main(["store", "verify", str(folder), "--data", f"folder:{images}", "--no-progress"]) == 1
        return capsys.readouterr().err
    with pytest.raises((TargetStoreCorruptError, TargetStoreMismatchError)) as err:
        if how == "open":
            TargetStore.open(folder)
        else:
            _train(folder, images)
    return str(err.value)


#: every damage on a copy of the store; two on the folder the precompute wrote (its --out, the same commands)
STORE_CASES = [(damage, "copy") for damage in sorted(STORE_DAMAGE)] + [("rows changed on disk", "original"),
                                                                       ("NaN rows", "original")]


@pytest.mark.parametrize("damage, where", STORE_CASES)
def test_a_damaged_stores_fix_followed_as_written_recomputes_that_folder(folder_store, damage, where, capsys):
    """Before: the fix named the precompute command as recorded, whose --out is the folder it first wrote; on a copy,
    "delete the folder and rerun" deleted the copy and recomputed nothing."""
    root, images, reference = folder_store
    folder = root / where
    spoil, how, said = STORE_DAMAGE[damage]
    spoil(folder)
    message = _meet(how, folder, images, capsys)
    assert re.search(said, message), message
    assert f"`rm -r {shlex.quote(str(folder))}`" in message  # this folder, whichever the command first wrote
    before = snapshot(root, folder)
    done = follow(message, folder)
    if damage == "metadata not JSON":  # the command was recorded in the broken file: the message says it in words
        assert done == [0] and f"then the precompute that wrote it, with its output (--out / path) {folder}" in message
        done.append(main(precompute_command(images, folder)))
    assert done == [0, 0]
    assert snapshot(root, folder) == before
    assert TargetStore.open(folder).verify()["checksum"] == "ok"
    train_reads_own_rows(folder, images, reference)


def test_every_store_error_names_its_fix_as_commands_on_that_folder(folder_store, capsys):
    """The damages above are every way the store's own files can be wrong that opening, reading and verifying find:
    each message ends in the commands (deleting the named folder, then the recorded precompute into it)."""
    root, images, _ = folder_store
    for damage, (spoil, how, said) in STORE_DAMAGE.items():
        folder = root / damage.replace(" ", "-")
        shutil.copytree(root / "original", folder)
        spoil(folder)
        message = _meet(how, folder, images, capsys)
        again = [c for c in commands(message) if c.startswith("accelerate-ssl precompute")]
        if damage == "metadata not JSON":  # its record of the command is the file that is broken: said in words
            assert not again and f"with its output (--out / path) {shlex.quote(str(folder))}" in message, message
        else:
            assert len(again) == 1 and shlex.split(again[0])[shlex.split(again[0]).index("--out") + 1] == str(folder)


def test_images_changed_under_their_names_fix_recomputes_the_folder_for_the_new_images(folder_store, capsys):
    root, images, _ = folder_store
    folder = root / "copy"
    ts_image = ts.image_of(100)
    Image.fromarray(ts_image).save(images / "004.png")  # another image under the same name
    with pytest.raises(TargetStoreMismatchError, match="other contents of this data set's files") as err:
        train_reads_own_rows(folder, images, {})
    before = snapshot(root, folder)
    assert follow(str(err.value), folder) == [0, 0]
    assert snapshot(root, folder) == before  # the original (stale too) is left as it is
    assert main(precompute_command(images, root / "fresh")) == 0  # an independent precompute of the new images
    train_reads_own_rows(folder, images, rows_by_number(root / "fresh", images))


def test_an_interrupted_precompute_resumes_into_the_folder_at_hand(tmp_path, monkeypatch, capsys):
    """A copy of an interrupted precompute: the command it names resumes that copy (the original stays unfinished)."""
    import accelerate_ssl.targets.precompute as precompute

    images = tmp_path / "images"
    write_images(images, range(N))
    interrupted_at(monkeypatch, precompute, "_consolidate", *precompute_command(images, tmp_path / "original"))
    folder = tmp_path / "copy"
    message, before = _copy_says_resume(tmp_path / "original", folder, TargetStoreCorruptError,
                                        "holds an unfinished precompute", TargetStore.open)
    assert follow(message, folder) == [0]
    assert snapshot(tmp_path, folder) == before
    assert main(precompute_command(images, tmp_path / "fresh")) == 0
    train_reads_own_rows(folder, images, rows_by_number(tmp_path / "fresh", images))


def test_a_store_of_other_settings_is_replaced_by_the_commands_named(folder_store, capsys):
    """A precompute into a folder that holds a store of other settings: "`rm -r FOLDER`, then run this precompute
    again" gives the store asked for."""
    root, images, reference = folder_store
    folder = root / "copy"
    again = precompute_command(images, folder) + ["--dtype", "float16"]
    assert main(again) == 2
    message = capsys.readouterr().err
    assert "holds a finished store with other settings" in message and "dtype: 'float32' in the store vs" in message
    before = snapshot(root, folder)
    assert follow(message, folder) == [0]
    assert main(again) == 0
    assert snapshot(root, folder) == before
    assert TargetStore.open(folder).dtype == "float16"
    half = {n: row.astype(np.float16).astype(np.float32) for n, row in reference.items()}
    train_reads_own_rows(folder, images, half)


def test_an_unreadable_fitted_pca_is_deleted_and_fitted_again(folder_store):
    root, images, reference = folder_store
    folder = root / "copy"
    train_reads_own_rows(folder, images, reference, n_components=4)  # fits and keeps pca/pca-n4-zscore.safetensors
    fitted = folder / "pca" / "pca-n4-zscore.safetensors"
    fitted.write_bytes(b"broken")
    with pytest.raises(TargetStoreCorruptError, match="a PCA fitted on this store's rows, kept to be reused") as err:
        train_reads_own_rows(folder, images, reference, n_components=4)
    before = snapshot(root, fitted)
    assert follow(str(err.value), fitted) == [0]
    train_reads_own_rows(folder, images, reference, n_components=4)
    assert fitted.is_file() and snapshot(root, fitted) == before


# ---------------------------------------------------------------------------------------------- sidecars
@pytest.fixture()
def sidecars(tmp_path, capsys):
    """WebDataset shards, their sidecars written by the CLI (``original``) and a copy of that folder (``copy``)."""
    urls = ts.write_shards(tmp_path / "data")
    spec = f"wds:{tmp_path}/data/shard-{{000000..000002}}.tar"
    assert main(["precompute", "--prior", "random:convnet", "--data", spec, "--out", str(tmp_path / "original"),
                 "--no-progress"]) == 0
    shutil.copytree(tmp_path / "original", tmp_path / "copy")
    capsys.readouterr()
    return tmp_path, urls, spec


def train_reads_own_carried_rows(folder: Path, urls) -> None:
    """A WebDataset loop joined with the sidecars at ``folder``: every row the batch carries is the prior's output for
    its own image and carries that folder's tag; ReLA trains on them."""
    prior = create_prior("random:convnet", in_channels=1).eval()
    targets = ShardedTargets.open(folder)
    data = ts.joined(urls, targets).map_dict(png=ts.as_tensor).to_tuple("png", "target")
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(ts.SIZE * ts.SIZE, 8))
    rela = ReLA(targets, backbone, feature_dim=8, total_steps=6, witness=False, alignment_check=False)
    seen = []
    for x, t in DataLoader(data, batch_size=5):
        assert torch.allclose(t[:, :-1], ts.own(prior, x), atol=1e-5) and (t[:, -1] == targets.tag).all()
        rela.wrap(backbone(x.float() / 255).pow(2).mean(), targets=t).backward()
        seen += ts.number_of(x).tolist()
    assert sorted(seen) == list(range(26))


def _flip_sidecar_row(folder: Path) -> None:
    file = sorted(folder.glob("*.safetensors"))[1]
    raw = bytearray(file.read_bytes())
    raw[-8] ^= 0xFF  # a row's bytes, the header intact
    file.write_bytes(bytes(raw))


SIDECAR_DAMAGE = {
    "sidecar changed on disk": (_flip_sidecar_row, "changed on disk since it was written"),
    "sidecar truncated": (lambda f: (lambda p: p.write_bytes(p.read_bytes()[:-16]))(
        sorted(f.glob("*.safetensors"))[1]), "truncated or replaced"),
    "sidecar missing": (lambda f: sorted(f.glob("*.safetensors"))[1].unlink(), "is missing from"),
}


@pytest.mark.parametrize("damage, where", [(damage, "copy") for damage in sorted(SIDECAR_DAMAGE)]
                         + [("sidecar changed on disk", "original")])
def test_a_damaged_sidecars_fix_followed_as_written_rewrites_that_folder(sidecars, damage, where, capsys):
    """Before: followed on a copied folder, the fix deleted the copy's damaged sidecar and record, then recomputed into
    the original folder (which was finished, so nothing was written), leaving the copy without a record."""
    root, urls, spec = sidecars
    folder = root / where
    spoil, said = SIDECAR_DAMAGE[damage]
    spoil(folder)
    with pytest.raises(SidecarError, match=said) as err:
        ShardedTargets.open(folder).verify()
    message = str(err.value)
    assert [c.split()[0] for c in commands(message)] == ["accelerate-ssl", "rm", "accelerate-ssl"], message
    before = snapshot(root, folder)
    verify, rm, again = follow(message, folder)
    assert (verify, rm, again) == (1, 0, 0)  # verify names the damaged sidecar (exit 1); the precompute writes it
    assert snapshot(root, folder) == before
    assert ShardedTargets.open(folder).verify()["shards"] == 3
    train_reads_own_carried_rows(folder, urls)


def test_an_interrupted_sidecar_precompute_resumes_into_the_folder_at_hand(tmp_path, monkeypatch, capsys):
    import accelerate_ssl.targets.sidecar as sidecar

    urls = ts.write_shards(tmp_path / "data")
    spec = f"wds:{tmp_path}/data/shard-{{000000..000002}}.tar"
    interrupted_at(monkeypatch, sidecar, "_finish", "precompute", "--prior", "random:convnet", "--data", spec, "--out",
                   str(tmp_path / "original"), "--no-progress")
    folder = tmp_path / "copy"
    message, before = _copy_says_resume(tmp_path / "original", folder, SidecarError,
                                        "holds an unfinished sidecar precompute", ShardedTargets.open)
    assert follow(message, folder) == [0]
    assert snapshot(tmp_path, folder) == before
    train_reads_own_carried_rows(folder, urls)


def test_a_copy_of_sidecars_older_than_image_digests_is_rebuilt_where_it_is(tmp_path):
    """A datasets folder written before rows recorded their image digest: the rebuild it names (a Python call) writes
    that folder, and the column it then attaches holds each row's own target."""
    import datasets

    prior = create_prior("random:convnet", in_channels=1).eval()
    ds = ts.image_folder_dataset(tmp_path, range(12))
    precompute_sidecars(prior, open_stream(ds, shard_rows=5), tmp_path / "original", batch_size=4, progress=False)
    shutil.copytree(tmp_path / "original", tmp_path / "old")
    folder = tmp_path / "old"
    meta = json.loads((folder / "sidecars.json").read_text())
    meta["format_version"] = 1  # what an older accelerate-ssl wrote (its datasets rows recorded digest 0)
    (folder / "sidecars.json").write_text(json.dumps(meta))
    with pytest.raises(SidecarError, match="recorded no image digest for datasets rows") as err:
        ShardedTargets.open(folder).column(ds)
    message = str(err.value)
    assert [c.split("(")[0].split()[0] for c in commands(message)] == ["rm", "precompute_sidecars"], message
    before = snapshot(tmp_path, folder)
    assert "open_stream(<Dataset hf:imagefolder>, shard_rows=5)" in message  # the Dataset object, with its options
    follow(message, folder, dataset=ds)
    assert snapshot(tmp_path, folder) == before
    with_targets = ShardedTargets.open(folder).column(ds)
    assert isinstance(with_targets, datasets.Dataset)
    ts.own_rows(ShardedTargets.open(folder), with_targets, prior)


# ---------------------------------------------------------------------------------------------- nothing there yet
def fill(message: str, **values: str) -> str:
    """``message`` with the placeholders of its commands (``SPEC``, ``NAME``, ``DIR``, ``<shards>``) given the values
    the user would type: the rest of each command is run as written."""
    def one(command: re.Match) -> str:
        words = [values.get(w, w) for w in shlex.split(command.group(1))]
        filled = (re.sub(r"<[^<>]+>", lambda m: values.get(m.group(0), m.group(0)), w) for w in words)
        return "`" + shlex.join(filled) + "`"

    return re.sub(r"`([^`]+)`", one, message)


def test_a_missing_store_is_made_by_the_command_its_error_names(folder_store, capsys):
    root, images, reference = folder_store
    (root / "empty").mkdir()
    for folder in (root / "new", root / "empty"):  # no folder at all; a folder without a store
        with pytest.raises(FileNotFoundError, match="create one with `accelerate-ssl precompute") as err:
            TargetStore.open(folder)
        before = snapshot(root, folder)
        assert follow(fill(str(err.value), SPEC="random:convnet", NAME=f"folder:{images}"), folder) == [0]
        assert snapshot(root, folder) == before
        train_reads_own_rows(folder, images, reference)


def test_a_missing_sidecar_folder_is_made_by_the_command_its_error_names(sidecars, capsys):
    root, urls, spec = sidecars
    folder = root / "new"
    with pytest.raises(FileNotFoundError, match="write one with `accelerate-ssl precompute") as err:
        ShardedTargets.open(folder)
    before = snapshot(root, folder)
    assert follow(fill(str(err.value), SPEC="random:convnet", **{"wds:<shards>": spec}), folder) == [0]
    assert snapshot(root, folder) == before
    train_reads_own_carried_rows(folder, urls)


def test_a_stream_opened_as_a_map_style_data_set_is_told_the_command_that_makes_its_sidecars(sidecars, capsys):
    from accelerate_ssl.data.spec import open_data

    root, urls, spec = sidecars
    folder = root / "new"
    with pytest.raises(ValueError, match="is a streamed data set: it has no dataset") as err:
        open_data(spec)
    before = snapshot(root, folder)
    assert follow(fill(str(err.value), SPEC="random:convnet", DIR=str(folder)), folder) == [0]
    assert snapshot(root, folder) == before
    train_reads_own_carried_rows(folder, urls)


# ---------------------------------------------------------------------------------------------- distilled sets
def _synthesize(out: Path, **changes):
    from accelerate_ssl.distill import synthesize
    from distill_helpers import MEAN, STD, tiny_real, tiny_teacher

    kw = dict(method="dwa", ipc=2, real=tiny_real(), mean=MEAN, std=STD, iterations=3, seed=2, progress=False)
    return synthesize(tiny_teacher(), out_dir=str(out), **{**kw, **changes})


def test_a_distilled_sets_folder_of_other_settings_is_replaced_by_the_commands_named(tmp_path):
    """Both refusals of synthesize() name `rm -r` of what stands in the way, then the same call again."""
    from accelerate_ssl.distill import DistilledSet

    out = tmp_path / "set"
    _synthesize(out)
    with pytest.raises(ValueError, match="already holds a different distilled set") as err:
        _synthesize(out, seed=9)
    before = snapshot(tmp_path, out)
    assert follow(str(err.value), out) == [0]
    wanted = _synthesize(out, seed=9)
    assert snapshot(tmp_path, out) == before
    assert torch.equal(DistilledSet.load(out).images, wanted.images)
    assert json.loads((out / "manifest.json").read_text())["seed"] == 9

    def stop(batch, images, history):
        if batch == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _synthesize(tmp_path / "partial", callback=stop)
    with pytest.raises(ValueError, match="unfinished run with different settings") as err:
        _synthesize(tmp_path / "partial", seed=9)
    before = snapshot(tmp_path, tmp_path / "partial")  # (the run writes its out_dir; nothing else changes)
    assert follow(str(err.value), tmp_path / "partial" / ".partial") == [0]
    wanted = _synthesize(tmp_path / "partial", seed=9)
    assert snapshot(tmp_path, tmp_path / "partial") == before
    assert torch.equal(DistilledSet.load(tmp_path / "partial").images, wanted.images)


def test_an_unfinished_distilled_set_resumes_by_running_again(tmp_path):
    """Before: an interrupted synthesis was told "No manifest.json ...; pass the output folder of `accelerate-ssl
    distill`", the folder it had passed."""
    from accelerate_ssl.distill import DistilledSet

    def stop(batch, images, history):
        if batch == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _synthesize(tmp_path / "set", callback=stop)
    with pytest.raises(ValueError, match=r"holds an unfinished synthesis .*: run synthesize\(\) / `accelerate-ssl "
                                         "distill` again with the same settings and out_dir / --out to resume it"):
        DistilledSet.load(tmp_path / "set")
    resumed = _synthesize(tmp_path / "set")  # the fix: the same call again
    assert torch.equal(DistilledSet.load(tmp_path / "set").images, resumed.images)
    assert torch.equal(resumed.images, _synthesize(tmp_path / "whole").images)
