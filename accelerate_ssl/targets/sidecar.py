"""Sidecar targets for streamed data: one keyed targets file per data shard, joined to the samples by key.

For WebDataset shards and Hugging Face ``datasets`` (:mod:`accelerate_ssl.data.streams`), targets travel with the
sample (DataCompDR-style): :func:`precompute_sidecars` writes, for every data shard, a sidecar
``<shard>.safetensors`` holding the shard's targets in its sample order and the list of its sample keys; a training
pipeline joins them back (:meth:`ShardedTargets.join` for a ``webdataset`` pipeline, :meth:`ShardedTargets.column`
for a ``datasets.Dataset``) and the loop passes the batch's rows: ``rela.wrap(loss, targets=batch_targets)``.

A sidecar folder::

    sidecars.json                  written last (its atomic rename marks the run finished): the settings, and per
                                   shard its file, rows, sha256 of the file and of its key list
    <shard>.safetensors            tensors ``targets`` [n, d] (or [n, k, d] with k stored views) in --dtype, and
                                   ``digests`` int64 [n] (first 8 bytes of blake2b of each sample's content: a wds
                                   sample's image bytes, a ``datasets`` row's image, :func:`~accelerate_ssl.data.
                                   streams.hf_content`); metadata: the shard name, its keys (JSON) and their sha256,
                                   the settings' sha256
    pca/                           the PCA fitted over every row (``ShardedTargets.pca``), or used at write (--components)

Sidecars are plain arrays (safetensors), never pickles, and nothing here unpickles a shard field.

**Identity.** What is checked, and when:

- *Every read of a sidecar* (the join, :meth:`ShardedTargets.column`, the PCA fit, ``store[rows]``): the file's bytes
  against the sha256 ``sidecars.json`` recorded (read whole once, hashed, then parsed from the same bytes), its key
  list against the recorded one, rows as many as keys, every row finite. Opening the folder checks that every file
  is there with its recorded size.
- *The join* walks each data shard in lockstep with its sidecar: sample j of a shard must carry the key of row j and
  the image-bytes digest of row j; a missing sidecar, a key missing, reordered or duplicated, a sidecar shorter or
  longer than its shard, or a key of another shard stops the pipeline with an error naming the shard and the key.
- *The column* (:meth:`ShardedTargets.column`) finds every row of the ``datasets.Dataset`` it is given by its key
  (an id column) or, without one, by its image's digest, whatever the row order (a shuffle, sort, select or filter
  is followed), and checks the row's image digest against the sidecar's: an image of another data set, or swapped
  between two ids, is refused naming the row.
- *Rows carry their folder*: the join and the column hand each row with one more float32 column, the folder's
  :attr:`ShardedTargets.tag` (an integer in [2^23, 2^24), exact in float32, derived from the folder's identity);
  ``rela.wrap(targets=)`` on ReLA over this folder checks it and drops it (:meth:`ShardedTargets.strip_tag`), so
  rows of another folder (another prior, other data) are refused naming both folders.
- ``accelerate-ssl store verify <folder> --data <the stream>`` (:meth:`ShardedTargets.verify_stream`) checks every
  shard, key and content digest against the stream, without training.

**Sharding and resuming.** Under ``accelerate launch`` process r computes data shards r, r + P, r + 2P, ...
(every shard exactly once, for any shard count); a sidecar is written atomically once its shard is done, so a
killed run resumes shard by shard. Rows are computed in batches that never cross a shard, so the files are
byte-identical whatever the number of processes or interruptions (fp32 on CPU).

**Compact rows.** ``dtype`` float16 / bfloat16 halves the bytes (:func:`cast_rows`); ``components=k`` stores the
top-k principal components of the z-scored rows (ReLA v2 Eq. 41, fitted over every row after the raw pass; the raw
sidecars are rewritten reduced). A reduced folder's ``pca(n)`` is the first n of those components.

**Spatial sidecars** (``spatial=True`` / ``spatial=k``): each sample's row is the prior's feature map, channels
last and flattened (``h w`` values of ``dim``), read off the stream's first sample for its grid and stride;
``spatial=k`` reduces every location to its top k PCA components, fitted before any sidecar is written over the
locations of up to 256 samples (the first ones of evenly spaced shards; no pass over the stream), saved in ``pca/``
with its sha256 in ``sidecars.json``'s ``spatial`` record: every sidecar is written reduced, so no full map reaches
the disk, and a run resumed without that file recomputes its sidecars rather than mix two fits. ``store[rows]`` gives the maps' means, :meth:`ShardedTargets.maps` the maps, and the join
hands each sample's map (with the tag): ``rela.wrap(loss, targets=..., geometry=...)`` pools each view's box from it
and ``ReLA(dense=)`` reads it, as from a map-style spatial store.

**Stored views** (``views=StoredViews(k=...)``): k targets per sample, view v of the image with key ``key`` is
``apply_view(image, views.params(key_index(key), v, H, W))`` — the parameterisation of
:mod:`accelerate_ssl.data.views` with the key hashed to the image index; the join replays a view and hands its row.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import random
import shlex
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import numpy as np
import torch

from ..atomic import atomic_path, atomic_write_text
from ..data.fingerprint import content_digest
from ..data.views import StoredViews, apply_view
from .pca import TargetPCA
from ..checksum import file_sha256
from .format import (TORCH_DTYPES, MapRows, SidecarError, cast_rows, recompute_fix, refuse_float16_overflow,
                     rerun_command)

__all__ = ["precompute_sidecars", "ShardedTargets", "key_index", "SIDECARS"]

SIDECARS = "sidecars.json"
MANIFEST = "sidecars-manifest.json"
PCA_DIR = "pca"
FORMAT = "accelerate-ssl-sidecars"
FORMAT_VERSION = 2  # 2: datasets rows carry a content digest (1: wds digests only; hf rows recorded 0)
TAG_LOW = 1 << 23  # store tags are integers in [2^23, 2^24): exact in float32, far from any target value


def key_index(key: str) -> int:
    """A sample key as the integer image index of :meth:`StoredViews.params` (40 bits of its blake2b)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=5).digest(), "big")


def _keys_sha256(keys: list[str]) -> str:
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()


def sidecar_name(shard: str) -> str:
    return f"{shard}.safetensors"


def _recompute_shard(file: Path, command: Optional[str]) -> str:
    """The fix of one damaged (or missing) sidecar: delete it and the folder's record, rerun the precompute into this
    folder (:func:`~accelerate_ssl.targets.format.rerun_command`: the folder at hand, even when it is a copy), which
    then writes that shard's sidecar again and keeps the others; ``store verify`` first names any other damaged one."""
    folder = file.parent
    rm = shlex.join(["rm", "-f", str(file), str(folder / SIDECARS)])
    again = rerun_command(command, folder)
    again = f"`{again}`" if again else f"the precompute that wrote the folder (the same --data and --prior) with --out " \
                                       f"{shlex.quote(str(folder))}"
    return (f"Recompute that shard: `accelerate-ssl store verify {shlex.quote(str(folder))}` names any other "
            f"damaged sidecar; then delete them and the folder's record (`{rm}`) and rerun {again}: it writes the "
            "missing sidecars again and keeps the others.")


def _read_sidecar(file: Path, sha256: Optional[str] = None, shard: Optional[str] = None,
                  command: Optional[str] = None) -> tuple[dict, dict]:
    """``(metadata, tensors)`` of one sidecar file, read whole once; with ``sha256`` (the one ``sidecars.json``
    recorded) the bytes are hashed and compared before they are parsed, so the rows returned are the bytes checked.
    Raises SidecarError when the file is unreadable or its bytes changed."""
    from safetensors.torch import load

    try:
        data = file.read_bytes()
    except OSError as err:
        raise SidecarError(f"sidecar {str(file)!r} cannot be read ({err}); copy it back, or: "
                           + _recompute_shard(file, command)) from err
    if sha256 is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise SidecarError(
                f"the sidecar of shard {shard!r} changed on disk since it was written ({file.name}: its sha256 is "
                f"{actual[:16]}..., {SIDECARS} recorded {sha256[:16]}...: bytes overwritten, or rows of another "
                "shard copied in), so its rows cannot be trusted. " + _recompute_shard(file, command))
    try:
        size = int.from_bytes(data[:8], "little")  # the safetensors header: its length, then JSON
        header = json.loads(data[8 : 8 + size])
        meta = json.loads((header.get("__metadata__") or {}).get(FORMAT, "{}"))
        tensors = load(data)
    except Exception as err:  # safetensors raises its own error types
        raise SidecarError(f"sidecar {str(file)!r} is unreadable ({err}). " + _recompute_shard(file, command)) from err
    if meta.get("format") != FORMAT:
        raise SidecarError(f"{str(file)!r} is not an accelerate-ssl sidecar. " + _recompute_shard(file, command))
    return meta, tensors


def _header(f) -> dict:
    """A sidecar's own metadata: one JSON entry of the safetensors header (one key, so the file's bytes do not depend
    on the order safetensors writes several keys in)."""
    return json.loads((f.metadata() or {}).get(FORMAT, "{}"))


def _sidecar_done(file: Path, settings_sha: str, stage: str) -> bool:
    if not file.is_file():
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            meta = _header(f)
    except Exception:
        return False
    return (meta.get("settings_sha256") == settings_sha and meta.get("stage") == stage
            and meta.get("version") == FORMAT_VERSION)


def _write_sidecar(file: Path, shard: str, keys: list[str], rows: torch.Tensor, digests: np.ndarray,
                   settings_sha: str, stage: str) -> None:
    from safetensors.torch import save_file

    meta = {"format": FORMAT, "version": FORMAT_VERSION, "shard": shard, "rows": len(keys), "keys": keys,
            "keys_sha256": _keys_sha256(keys), "settings_sha256": settings_sha, "stage": stage}
    with atomic_path(file) as tmp:
        save_file({"targets": rows, "digests": torch.from_numpy(np.asarray(digests, dtype=np.int64))}, str(tmp),
                  metadata={FORMAT: json.dumps(meta, sort_keys=True)})


# ------------------------------------------------------------------------------------------------ precompute
def precompute_sidecars(prior, source, path, *, batch_size: Optional[int] = None, precision: str = "fp32",
                        dtype: str = "float32", components: Optional[int] = None, views: Optional[StoredViews] = None,
                        progress: bool = True, command: Optional[str] = None, spatial=False) -> "ShardedTargets":
    """Run ``prior`` over every sample of a stream (``wds:`` / ``hf:`` spec or a :class:`StreamSource`) and write one
    sidecar per data shard into ``path`` (module docstring). Resumes an interrupted run with the same settings;
    refuses other settings (the batch size is free: ``None`` picks the device's default, as for a store). Returns the
    opened :class:`ShardedTargets` (on every process).

    ``spatial=True`` keeps each sample's feature map (channels last, flattened), ``spatial=k`` every location of it
    reduced to ``k`` PCA components (fitted before any sidecar is written, over the locations of up to
    :data:`~accelerate_ssl.targets.write.SPATIAL_FIT_IMAGES` samples from the starts of evenly spaced shards; every
    sidecar is written reduced), as a spatial store does (module docstring, "Spatial sidecars")."""
    from tqdm.auto import tqdm

    from .. import __version__
    from ..data.streams import StreamSource, open_stream
    from ..priors import Preprocess
    from .write import (PRECISIONS, SPATIAL_FIT_IMAGES, check_spatial, default_batch_size, map_geometry, process_state,
                        settings_diff)

    source = source if isinstance(source, StreamSource) else open_stream(source)
    check_spatial(spatial)
    if spatial and components is not None:
        raise ValueError("components= reduces pooled rows; spatial sidecars are reduced by spatial=k (each location of "
                         "the map to k PCA components): pass one of them.")
    if spatial and views is not None:
        raise ValueError("views= stores k crops of each sample; spatial sidecars pool any crop's target from the map "
                         "(wrap(geometry=)): pass one of them.")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}.")
    cast_rows(torch.zeros(1), dtype)  # the dtype name is checked now
    if components is not None and (not isinstance(components, int) or not 1 <= components <= prior.output_dim):
        raise ValueError(f"components must be an int in [1, {prior.output_dim}] (the prior's width), got {components!r}.")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}.")
    path = Path(path)
    state = process_state()
    batch_size = batch_size or default_batch_size(state.device)
    pre = prior.preprocess
    geometry = None
    if spatial:  # the prior's map of the stream's first sample: its grid, stride and channels (and k)
        first = next(iter(source.samples(source.shards[0])), None)
        if first is None:
            raise ValueError(f"spatial=: the stream's first shard {source.shards[0]!r} holds no sample to read the "
                             "prior's map from.")
        geometry = map_geometry(prior, pre.batch(Preprocess.to_tensor(first[1]).unsqueeze(0)), spatial,
                                SPATIAL_FIT_IMAGES)
    map_k = None if geometry is None else geometry.get("components")  # the map's PCA, fitted before the pass
    settings = json.loads(json.dumps({
        "prior": {**prior.describe(), "preprocess": pre.config},
        "data": {k: v for k, v in source.describe().items() if k != "spec"}, "shards": source.shards,
        "dim": int(prior.output_dim), "dtype": dtype, "components": components if geometry is None else map_k,
        "views": views.to_dict() if views is not None else None, "precision": precision,
        **({} if geometry is None else
           {"spatial": {k: v for k, v in geometry.items() if k not in ("components", "fit_images")}}),
    }))
    settings_sha = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    command = command or f"precompute_sidecars(create_prior({prior.spec!r}), {source.reopen()}, {str(path)!r})"

    for marker in (path / SIDECARS, path / MANIFEST):
        if marker.is_file():
            old = json.loads(marker.read_text()).get("settings", {})
            old.pop("batch_size", None)  # recorded by earlier versions; it does not change the rows
            if old != settings:
                raise ValueError(settings_diff(path, old, settings, finished=marker.name == SIDECARS))
    if (path / SIDECARS).is_file():
        return ShardedTargets.open(path)
    state.wait_for_everyone()
    if state.is_main_process and not (path / MANIFEST).is_file():
        atomic_write_text(path / MANIFEST, json.dumps({"settings": settings, "command": command}, indent=1))
    state.wait_for_everyone()

    device = state.device
    prior = prior.to(device).eval()
    reduce_map = None
    if map_k:  # the map's PCA, fitted before any sidecar is written (as a spatial store's): no full map on disk
        fit_file = path / PCA_DIR / f"write-n{map_k}-zscore.safetensors"
        if state.is_main_process and not fit_file.is_file():
            for stale in path.glob("*.safetensors"):  # sidecars written in a basis that is gone: recompute them
                stale.unlink()
            _save_pca(_fit_map_pca(prior, pre, source, geometry, batch_size, precision, device, progress), fit_file)
        state.wait_for_everyone()
        reduce_map = _load_pca(fit_file)

    mine = source.shards[state.process_index :: state.num_processes]  # every shard exactly once
    for shard in mine:
        for stale in path.glob(f"{sidecar_name(shard)}.*tmp*"):  # left by a write that was interrupted
            stale.unlink(missing_ok=True)
    raw_stage = "raw" if components else "final"  # components=: a raw pass, a fit over it, then rewritten reduced
    todo = [s for s in mine if not (_sidecar_done(path / sidecar_name(s), settings_sha, raw_stage)
                                    or (components and _sidecar_done(path / sidecar_name(s), settings_sha, "final")))]
    if state.is_main_process and progress and len(todo) < len(mine):
        print(f"precompute: resuming {path}: {len(mine) - len(todo)} of {len(mine)} shard(s) of this process already "
              "done", file=sys.stderr)
    bar = tqdm(total=len(todo), desc=f"precompute {prior.spec}", unit="shard", dynamic_ncols=True,
               disable=not (progress and state.is_main_process))
    for shard in todo:
        keys, rows, digests = _shard_rows(prior, pre, source, shard, batch_size, precision, views, device, geometry,
                                          reduce_map)
        _write_sidecar(path / sidecar_name(shard), shard, keys, rows if components else cast_rows(rows, dtype),
                       digests, settings_sha, raw_stage)
        bar.update()
    bar.close()
    state.wait_for_everyone()

    if components:  # PCA at write: fit over every raw row (main process), then each process reduces its shards
        fit_file = path / PCA_DIR / f"write-n{components}-zscore.safetensors"
        if state.is_main_process and not fit_file.is_file():
            raw = ShardedTargets(path, {"shards": [{"shard": s, "file": sidecar_name(s)} for s in source.shards],
                                        "dim": settings["dim"], "views": settings["views"]}, check=False)
            _save_pca(TargetPCA.fit(_AllRows(raw), components, standardize=True, progress=progress), fit_file)
        state.wait_for_everyone()
        fitted = _load_pca(fit_file)
        for shard in mine:
            file = path / sidecar_name(shard)
            if _sidecar_done(file, settings_sha, "final"):
                continue
            meta, tensors = _read_sidecar(file)
            rows = tensors["targets"].float()
            reduced = fitted.transform(rows.reshape(-1, rows.shape[-1])).reshape(*rows.shape[:-1], components)
            _write_sidecar(file, shard, meta["keys"], cast_rows(reduced, dtype), tensors["digests"].numpy(),
                           settings_sha, "final")
        state.wait_for_everyone()

    if state.is_main_process:
        _finish(path, source, settings, command, state.num_processes, __version__)
    state.wait_for_everyone()
    return ShardedTargets.open(path)


def _shard_rows(prior, pre, source, shard, batch_size, precision, views, device, geometry=None, reduce_map=None):
    """Keys, float32 rows ``[n, d]`` (``[n, k, d]`` with views; a spatial run's: ``[n, h w C]``, each map channels
    last, every location reduced by ``reduce_map`` when given) and image-bytes digests of one data shard."""
    from ..priors import Preprocess
    from .write import PRECISIONS, check_grid, forward_rows, preprocess_images

    keys: list[str] = []
    digests: list[int] = []
    seen: dict[str, int] = {}
    out: list[torch.Tensor] = []
    batch: list[torch.Tensor] = []
    k = views.k if views is not None else 1

    def flush():
        if not batch:
            return
        first = len(keys) - len(batch) // k  # the key of the batch's first row
        x = preprocess_images(batch, pre, f" (shard {shard!r}, from key {keys[first]!r})", device, PRECISIONS[precision])
        rows = forward_rows(prior, x, precision, device, spatial=geometry is not None, reduce=reduce_map).result(
            lambda bad: f"keys {[keys[first + i // k] for i in bad]} of shard {shard!r}")
        if geometry is not None:
            check_grid(rows, geometry, f"shard {shard!r}, keys {keys[first]!r}...")
        out.append(rows.reshape(len(x), -1))
        batch.clear()

    for key, image, raw in source.samples(shard):
        if key in seen:
            raise SidecarError(f"shard {shard!r}: key {key!r} appears twice (samples {seen[key]} and {len(keys)}); keys "
                               "name samples, so they must be unique within a shard: fix the shard.")
        seen[key] = len(keys)
        keys.append(key)
        digests.append(content_digest(raw) if raw is not None else 0)
        if views is None:
            batch.append(Preprocess.to_tensor(image))
        else:
            h, w = (image.size[1], image.size[0]) if hasattr(image, "size") and not hasattr(image, "shape") else image.shape[-2:]
            for v in range(k):
                batch.append(Preprocess.to_tensor(apply_view(image, views.params(key_index(key), v, h, w))))
        if len(batch) >= batch_size * k:
            flush()
    flush()
    dim = int(prior.output_dim) if geometry is None else int(np.prod(geometry["grid"])) * geometry["channels"]
    rows = torch.cat(out) if out else torch.zeros(0, dim)
    if views is not None:
        rows = rows.reshape(len(keys), k, dim)
    return keys, rows, np.asarray(digests, dtype=np.int64)


def _fit_map_pca(prior, pre, source, geometry: dict, batch_size: int, precision: str, device, show: bool) -> TargetPCA:
    """The map's PCA of a ``spatial=k`` run (Eq. 41, z-scored), fitted over every location of up to
    :data:`~accelerate_ssl.targets.write.SPATIAL_FIT_IMAGES` samples: the first samples of evenly spaced shards, as
    many from each (a stream is read from its shards' starts; no pass over it)."""
    from ..priors import Preprocess
    from .write import SPATIAL_FIT_IMAGES, fit_map_pca, preprocess_images

    want = SPATIAL_FIT_IMAGES
    picked = [source.shards[int(i)] for i in np.unique(np.linspace(0, len(source.shards) - 1,
                                                                   min(want, len(source.shards))).round())]
    per = -(-want // len(picked))
    images = []
    for shard in picked:
        for j, (_, image, _) in enumerate(source.samples(shard)):
            if j == per or len(images) == want:
                break
            images.append(Preprocess.to_tensor(image))
    if len(images) * int(np.prod(geometry["grid"])) < 2:
        raise ValueError(f"spatial={geometry['channels']}: the map's PCA needs at least 2 locations; the stream gave "
                         f"{len(images)} sample(s).")
    batches = (preprocess_images(images[a:a + batch_size], pre, " (the samples of the map's PCA fit)", device)
               for a in range(0, len(images), batch_size))
    fitted = fit_map_pca(prior, batches, geometry, precision, device, "the samples of the map's PCA fit")
    if show:
        print(f"precompute: fitted the map's PCA over {len(images)} samples of {len(picked)} shard(s)", file=sys.stderr)
    return fitted


def _finish(path: Path, source, settings: dict, command: str, processes: int, version: str) -> None:
    shards, owner = [], {}
    for shard in source.shards:
        file = path / sidecar_name(shard)
        if not file.is_file():
            raise RuntimeError(f"The sidecar of shard {shard!r} is missing after every process finished; rerun the same "
                               "command to compute it.")
        meta, tensors = _read_sidecar(file)
        for key in meta["keys"]:
            if key in owner:
                raise SidecarError(f"key {key!r} is in shard {owner[key]!r} and in shard {shard!r}: keys name samples, "
                                   "so they must be unique across the data set; fix the shards.")
            owner[key] = shard
        shards.append({"shard": shard, "file": file.name, "rows": int(meta["rows"]), "keys_sha256": meta["keys_sha256"],
                       "bytes": file.stat().st_size, "sha256": file_sha256(file)})
    k = (settings["views"] or {}).get("k", 1)
    samples = sum(s["rows"] for s in shards)
    spatial = settings.get("spatial")
    if spatial is not None and spatial["reduction"] == "pca":  # the samples its PCA was fitted on, and the fit file
        fit = path / PCA_DIR / f"write-n{spatial['channels']}-zscore.safetensors"
        fitted = _load_pca(fit)
        spatial = {**spatial, "fit_images": fitted.num_rows // int(np.prod(spatial["grid"])), "pca_sha256": file_sha256(fit)}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "settings": settings, "shards": shards,
            "num_samples": samples, "num_rows": samples * k,
            "dim": spatial["channels"] if spatial else settings["components"] or settings["dim"],
            **({"spatial": spatial} if spatial else {}),
            "dtype": settings["dtype"], "views": settings["views"],
            "bytes_per_sample": sum(s["bytes"] for s in shards) / max(samples, 1), "command": command,
            "num_processes": processes, "library_version": version,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    atomic_write_text(path / SIDECARS, json.dumps(meta, indent=1))
    (path / MANIFEST).unlink(missing_ok=True)


def _save_pca(fitted: TargetPCA, file: Path) -> None:
    from safetensors.torch import save_file

    with atomic_path(file) as tmp:
        save_file(fitted.state_dict(), str(tmp))


def _load_pca(file: Path) -> TargetPCA:
    from safetensors.torch import load_file

    return TargetPCA.from_state_dict(load_file(str(file)))


# ------------------------------------------------------------------------------------------------ reading
class _AllRows:
    """Every row of a sidecar folder as one ``[N, d]`` array-like (``shape``, ``[a:b]``) for the streaming PCA fit."""

    def __init__(self, targets: "ShardedTargets"):
        self.targets = targets
        self.shape = (len(targets), targets.dim)

    def __getitem__(self, s: slice) -> torch.Tensor:
        return self.targets[np.arange(*s.indices(self.shape[0]))]


#: the folders opened in this process, by tag: how an error names the folder rows of another folder came from
_OPENED: dict[float, str] = {}


class ShardedTargets(MapRows):
    """A sidecar folder opened for ReLA and for joining (module docstring): ``len`` (rows: samples x views),
    ``dim``, ``store[rows]`` (global rows, shards in order), ``pca(n)``, ``identity()``, :attr:`tag`, :meth:`join`,
    :meth:`column`, :meth:`strip_tag`, :meth:`verify`, :meth:`verify_stream`."""

    def __init__(self, path, metadata: dict, check: bool = True):
        self.path, self.metadata = Path(path), metadata
        self._shards = metadata["shards"]
        self._by_name = {s["shard"]: s for s in self._shards}
        self._cache: dict[str, tuple] = {}
        self.views = StoredViews.from_dict(metadata["views"]) if metadata.get("views") else None
        self._pca: dict = {}
        self._written_pca: Optional[TargetPCA] = None
        if check:
            self._offsets = np.cumsum([0] + [s["rows"] for s in self._shards])
            _OPENED[self.tag] = f"{str(self.path)!r} (prior {self.metadata.get('settings', {}).get('prior', {}).get('spec')})"
        else:  # (the raw pass of a --components run: read the files for the counts)
            command = self.metadata.get("command")
            self._offsets = np.cumsum([0] + [int(_read_sidecar(self.path / s["file"], command=command)[0]["rows"])
                                             for s in self._shards])

    @classmethod
    def open(cls, path) -> "ShardedTargets":
        """Open a sidecar folder; every listed sidecar must be there with its recorded size."""
        path = Path(path)
        meta_file = path / SIDECARS
        if not meta_file.is_file():
            if (path / MANIFEST).is_file():
                cmd = rerun_command(json.loads((path / MANIFEST).read_text()).get("command"), path)
                how = f"`{cmd}`" if cmd else f"its precompute with --out {shlex.quote(str(path))}"
                raise SidecarError(f"{str(path)!r} holds an unfinished sidecar precompute (no {SIDECARS}): it was "
                                   f"interrupted. Resume it by rerunning {how}; finished shards are kept.")
            raise FileNotFoundError(f"No sidecar folder at {str(path)!r} (no {SIDECARS}); write one with "
                                    "`accelerate-ssl precompute --prior SPEC --data wds:<shards> --out "
                                    f"{shlex.quote(str(path))}` (or --data hf:<path>).")
        metadata = json.loads(meta_file.read_text())
        if metadata.get("format") != FORMAT:
            raise SidecarError(f"{meta_file} is not accelerate-ssl sidecar metadata.")
        for s in metadata["shards"]:
            file = path / s["file"]
            if not file.is_file():
                raise SidecarError(f"the sidecar of shard {s['shard']!r} ({file.name}) is missing from {str(path)!r}; "
                                   "copy it back, or: " + _recompute_shard(file, metadata.get("command")))
            if file.stat().st_size != s["bytes"]:
                raise SidecarError(f"the sidecar of shard {s['shard']!r} has {file.stat().st_size} bytes but "
                                   f"{SIDECARS} recorded {s['bytes']} (truncated or replaced). "
                                   + _recompute_shard(file, metadata.get("command")))
        return cls(path, metadata)

    # ---------------------------------------------------------------- the store interface ReLA uses
    def __len__(self) -> int:
        return int(self._offsets[-1]) * (self.views.k if self.views else 1)

    @property
    def dim(self) -> int:
        """The width of a row ``store[i]`` (spatial sidecars': the map's channels; ``store[i]`` is the map's mean)."""
        return int(self.metadata["dim"])

    @property
    def spatial(self) -> Optional[dict]:
        """What spatial sidecars record of their maps (``grid``, ``stride``, ``input_size``, ``channels``,
        ``source_channels``, ``reduction``, ...; as :attr:`TargetStore.spatial
        <accelerate_ssl.targets.store.TargetStore.spatial>`), or None for sidecars of pooled rows."""
        return self.metadata.get("spatial")

    @property
    def preprocess(self) -> dict:
        """The prior's preprocessing as recorded (how a view's box maps onto the map's cells)."""
        return self.metadata.get("settings", {}).get("prior", {}).get("preprocess") or {}

    def maps(self, idx: Any) -> torch.Tensor:
        """Spatial sidecars' maps of the rows ``idx`` (global rows, shards in order) as float32 ``[B, C, h, w]``."""
        if self.spatial is None:
            raise SidecarError(f"the sidecars at {str(self.path)!r} hold pooled rows, not feature maps: precompute them "
                               "with spatial=True or spatial=k (`accelerate-ssl precompute --spatial K`).")
        return self.as_maps(self._rows(np.atleast_1d(np.asarray(idx, dtype=np.int64))))

    @property
    def shards(self) -> list[str]:
        return [s["shard"] for s in self._shards]

    @property
    def components(self) -> Optional[int]:
        """``k`` when the rows were PCA-reduced at write (``components=k``), as for a TargetStore; else None."""
        k = self.metadata.get("settings", {}).get("components")
        return int(k) if k else None

    def written_pca(self) -> Optional[TargetPCA]:
        """The PCA the rows were reduced with at write (raw prior outputs -> these rows), or None."""
        if self.components is None:
            return None
        if self._written_pca is None:
            file = self.path / PCA_DIR / f"write-n{self.components}-zscore.safetensors"
            recorded = (self.spatial or {}).get("pca_sha256")
            if recorded is not None and file.is_file() and file_sha256(file) != recorded:
                raise SidecarError(f"{file} is not the PCA the maps were reduced with (its sha256 differs from the one "
                                   f"{SIDECARS} recorded): a replaced file. " + self._fix())
            try:
                self._written_pca = _load_pca(file)
            except Exception as err:
                raise SidecarError(f"{file} (the PCA the rows were reduced with) is unreadable ({err}). "
                                   + self._fix()) from err
        return self._written_pca

    def _fix(self) -> str:
        """How to recompute this folder, as commands (:func:`~accelerate_ssl.targets.format.recompute_fix`): into this
        folder, whichever folder its command first wrote."""
        return recompute_fix(self.path, self.metadata.get("command"))

    def identity(self) -> dict:
        """What a ReLA checkpoint records of these targets (compared when it is loaded)."""
        prior = self.metadata.get("settings", {}).get("prior", {})
        return {"rows": len(self), "dim": self.dim,
                "targets_sha256": hashlib.sha256("".join(s.get("sha256", "") for s in self._shards).encode()).hexdigest(),
                "prior": prior.get("spec"),
                "prior_weights_sha256": prior.get("weights_sha256") or prior.get("checkpoint_sha256"),
                "dataset_sha256": hashlib.sha256("".join(s["keys_sha256"] for s in self._shards).encode()).hexdigest()}

    @functools.cached_property
    def tag(self) -> float:
        """This folder's store tag: an integer in [2^23, 2^24) (exact in float32) drawn from the sha256 of
        :meth:`identity`; the join and the column hand every row with it as one last column. Two folders share a
        tag only if their identities do (or with odds of 1 in 2^23)."""
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).digest()
        return float(TAG_LOW + int.from_bytes(digest[:8], "big") % TAG_LOW)

    def carried(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (``[..., dim]``) as the join and the column hand them: with this folder's :attr:`tag` as one more
        column, which ``rela.wrap(targets=)`` checks and drops."""
        return torch.cat([rows, rows.new_full((*rows.shape[:-1], 1), self.tag)], dim=-1)

    def strip_tag(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows a batch carried (``rela.wrap(targets=)``) without their tag column, after checking that every
        row carries this folder's :attr:`tag`: rows of another sidecar folder (another prior, other data), rows that
        never went through :meth:`join` / :meth:`column` (no tag column), and rows cast to a dtype that cannot hold
        the tag are refused, naming the folders and the fix. Rows on the CPU are checked on the host (the error
        names the other folder); rows on an accelerator are checked there, without waiting for it."""
        width = rows.shape[1]
        fix = ("Open ReLA on the sidecar folder the pipeline joins (ShardedTargets.open(path) for both), and pass the "
               "rows the join / column hand, as they are.")
        if width == self.width:
            raise SidecarError(
                f"ReLA.wrap(targets=): the rows have {width} columns, the width of the sidecars at {str(self.path)!r} "
                "without the tag column that targets.join() and targets.column() add to every row: nothing proves they "
                "are this folder's rows (rows read some other way, or the last column was cut off). " + fix)
        if width != self.width + 1:
            raise SidecarError(
                f"ReLA.wrap(targets=) rows have dim {width} but the targets ReLA was opened on have dim {self.width} (the "
                f"join hands {self.width} + 1, the tag column): they come from another prior (or were PCA-reduced "
                "already). " + fix)
        if rows.dtype not in (torch.float32, torch.float64):
            raise SidecarError(
                f"ReLA.wrap(targets=): the rows are {rows.dtype}, which cannot hold the tag column the join adds (an "
                "integer near 2^23): pass them as float32, as the join hands them (autocast and .half() on the batch's "
                "images are fine; leave its target rows alone).")
        tag = rows[:, -1]
        if tag.device.type == "cpu":
            wrong = tag != self.tag
            if bool(wrong.any()):
                others = sorted({float(t) for t in tag[wrong].tolist()})
                named = [_OPENED.get(t, f"a folder not opened in this process (tag {t:.0f})") if TAG_LOW <= t < 2 * TAG_LOW
                         and t == int(t) else f"no sidecar folder (its last column holds {t:g}, not a tag)"
                         for t in others[:3]]
                raise SidecarError(
                    f"ReLA.wrap(targets=): {int(wrong.sum())} of {len(tag)} rows of this batch come from the sidecar "
                    f"targets {'; '.join(named)}, but ReLA was opened on {_OPENED.get(self.tag, repr(str(self.path)))} "
                    f"(tag {self.tag:.0f}): another prior's or another data set's targets would train the student toward "
                    "the wrong space. " + fix)
        else:
            torch._assert_async((tag == self.tag).all(),
                                f"ReLA.wrap(targets=): rows of this batch carry another sidecar folder's tag than "
                                f"{str(self.path)!r} (tag {self.tag:.0f}), the folder ReLA was opened on: they were "
                                f"joined from other sidecars (another prior, other data). {fix} (Rows on the CPU get an "
                                "error naming both folders.)")
        return rows[:, :-1]

    def shard(self, name: str) -> tuple[list[str], torch.Tensor, np.ndarray]:
        """``(keys, float32 rows, digests)`` of one data shard's sidecar, checked against the folder's record: the
        file's sha256, its key list, rows as many as keys, every row finite (module docstring)."""
        if name in self._cache:
            return self._cache[name]
        record = self._by_name.get(name)
        if record is None:
            raise SidecarError(f"data shard {name!r} has no sidecar in {str(self.path)!r} (it holds {len(self._shards)} "
                               f"shards, e.g. {self.shards[:3]}): these targets were computed for other shards; "
                               "precompute them for this data.")
        file = self.path / record["file"]
        command = self.metadata.get("command")
        if not file.is_file():
            raise SidecarError(f"the sidecar of shard {name!r} ({file.name}) is missing from {str(self.path)!r}; copy it "
                               "back, or: " + _recompute_shard(file, command))
        meta, tensors = _read_sidecar(file, record.get("sha256"), name, command)
        keys = meta["keys"]
        rows = tensors["targets"].float()
        if "keys_sha256" in record and (meta["keys_sha256"] != record["keys_sha256"] or _keys_sha256(keys) != record["keys_sha256"]):
            raise SidecarError(f"the sidecar of shard {name!r} holds another key list than {SIDECARS} recorded (a stale "
                               "or replaced file). " + _recompute_shard(file, command))
        if len(rows) != len(keys):
            raise SidecarError(f"the sidecar of shard {name!r} holds {len(rows)} rows for {len(keys)} keys. "
                               + _recompute_shard(file, command))
        if rows.shape[-1] != self.width:
            raise SidecarError(f"the sidecar of shard {name!r} holds rows of {rows.shape[-1]} values but {SIDECARS} says "
                               f"{self.width} ({'a ' + 'x'.join(map(str, self.grid)) + ' map of ' if self.spatial else ''}"
                               f"{self.dim} values); the folder's files do not belong together. " + self._fix())
        if not bool(torch.isfinite(rows).all()):
            bad = (~torch.isfinite(rows.reshape(len(rows), -1)).all(1)).nonzero().flatten()[:5].tolist()
            raise SidecarError(f"the sidecar of shard {name!r} has NaN/Inf rows for keys {[keys[i] for i in bad]}. "
                               + _recompute_shard(file, command))
        self._cache = {name: (keys, rows, tensors["digests"].numpy())} if len(self._cache) >= 2 else {
            **self._cache, name: (keys, rows, tensors["digests"].numpy())}
        return self._cache[name]

    def __getitem__(self, idx: Any) -> torch.Tensor:
        """Global rows (shards in order; with k views row j is view j % k of sample j // k; spatial sidecars': each
        map's mean over its grid, the whole-image target)."""
        if isinstance(idx, torch.Tensor):
            idx = idx.detach().cpu().numpy()
        scalar = np.ndim(idx) == 0 and not isinstance(idx, slice)
        idx = np.arange(len(self))[idx] if isinstance(idx, slice) else np.atleast_1d(np.asarray(idx, dtype=np.int64))
        out = self._rows(idx)
        if self.spatial is not None:
            out = out.reshape(len(out), -1, self.dim).mean(1)
        return out[0] if scalar else out

    def _rows(self, idx: np.ndarray) -> torch.Tensor:
        """The stored rows of ``idx`` as they are in the sidecars (``[B, width]``)."""
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"Row index out of range for sidecar targets of {len(self)} rows.")
        k = self.views.k if self.views else 1
        sample, view = np.divmod(idx, k)
        which = np.searchsorted(self._offsets, sample, side="right") - 1
        out = torch.empty(len(idx), self.width)
        for s in np.unique(which):
            sel = np.flatnonzero(which == s)
            _, rows, _ = self.shard(self._shards[s]["shard"])
            local = torch.from_numpy(sample[sel] - self._offsets[s])
            out[torch.from_numpy(sel)] = rows[local, torch.from_numpy(view[sel])] if self.views else rows[local]
        return out

    def pca(self, n_components: Optional[int] = None, standardize: bool = True, progress: bool = False) -> TargetPCA:
        """ReLA v2 Eq. 41 over every row: fitted by streaming over the sidecars (saved in ``pca/``). For reduced
        sidecars (``components=k`` at write) the rows are already ``V_k^T (y - mu) / sigma``: the first n of them."""
        n = self.dim if n_components is None else min(int(n_components), self.dim)
        if self.metadata.get("settings", {}).get("components"):
            comps = torch.eye(self.dim, dtype=torch.float64)[:, :n]
            return TargetPCA(torch.zeros(self.dim), torch.ones(self.dim), comps, torch.ones(n), standardize, len(self))
        if (n, standardize) in self._pca:
            return self._pca[(n, standardize)]
        file = self.path / PCA_DIR / f"pca-n{n}-{'zscore' if standardize else 'centre'}.safetensors"
        if file.is_file():
            fitted = _load_pca(file)
        else:
            fitted = TargetPCA.fit(_AllRows(self), n, standardize=standardize, progress=progress)
            try:
                _save_pca(fitted, file)
            except OSError:  # a read-only folder still works, the fit is just not cached
                pass
        self._pca[(n, standardize)] = fitted
        return fitted

    def verify(self, progress: bool = False) -> dict:
        """Read every sidecar once with the checks of every read (its sha256 against the one recorded when the
        folder was finished, its key list, its row count, every row finite); raises SidecarError naming the shard."""
        from tqdm.auto import tqdm

        for s in tqdm(self._shards, desc="verify sidecars", unit="shard", disable=not progress):
            self._cache.pop(s["shard"], None)
            self.shard(s["shard"])
        return {"shards": len(self._shards), "rows": len(self), "dim": self.dim}

    def verify_stream(self, source, split: str = "train", progress: bool = False) -> dict:
        """Check the folder against the stream it was computed on (``wds:`` / ``hf:`` spec, a ``datasets.Dataset`` or a
        :class:`~accelerate_ssl.data.streams.StreamSource`), sample by sample, without decoding an image: the same
        shards, in each the same keys in the same order, and every sample's content digest equal to its row's (and
        every sidecar's checks on read). Raises SidecarError naming the shard and the key."""
        from tqdm.auto import tqdm

        from ..data.streams import StreamSource, open_stream

        data = self.metadata["settings"]["data"]
        if not isinstance(source, StreamSource):
            if isinstance(source, str) and source.partition(":")[0] != data.get("kind"):
                raise SidecarError(f"the sidecars at {str(self.path)!r} were computed on {data.get('kind')}: data, so "
                                   f"{source!r} cannot be theirs; pass the stream of `{self.metadata.get('command')}`.")
            source = open_stream(source, split, image_field=data.get("image_field"), key_field=data.get("key_field"),
                                 shard_rows=data.get("shard_rows") or 1)
        self._require_digests("store verify --data")
        if source.shards != self.shards:
            extra = [s for s in source.shards if s not in self._by_name]
            missing = [s for s in self.shards if s not in set(source.shards)]
            what = (f"shard {extra[0]!r} of the stream has no sidecar" if extra else
                    f"the stream lacks shard {missing[0]!r}" if missing else "the stream lists the shards in another order")
            raise SidecarError(f"{what}: the stream has {len(source.shards)} shard(s), the sidecars at "
                               f"{str(self.path)!r} are for {len(self.shards)} (computed by "
                               f"`{self.metadata.get('command')}`); pass that stream, or precompute sidecars for this one.")
        samples = 0
        for shard in tqdm(source.shards, desc="verify against the stream", unit="shard", disable=not progress):
            keys, _, digests = self.shard(shard)
            pos, seen = 0, {}
            for key, raw in source.contents(shard):
                _check_sample(shard, pos, key, keys, seen, digests[pos] if pos < len(keys) else 0, raw)
                pos += 1
            if pos < len(keys):
                _mismatch(shard, pos, None, keys)
            samples += pos
        return {"shards": len(self._shards), "rows": len(self), "dim": self.dim, "samples_checked": samples}

    def _require_digests(self, what: str) -> None:
        """Refuse a ``datasets`` folder written before rows recorded their image digests, with the rebuild command."""
        data = self.metadata["settings"]["data"]
        if data.get("kind") == "hf" and int(self.metadata.get("format_version", 1)) < 2:
            raise SidecarError(
                f"the sidecars at {str(self.path)!r} were written by an older accelerate-ssl that recorded no image "
                f"digest for datasets rows, so {what} cannot check that each row's image is the one its target was "
                f"computed from. {self._fix()}")

    # ---------------------------------------------------------------- joining
    def join(self, field: str = "target", image_field: Optional[str] = None, view: Any = "random", seed: int = 0,
             check_bytes: bool = True) -> "SidecarJoin":
        """A ``webdataset`` pipeline stage adding each sample's target row as ``sample[field]`` (float32 tensor
        ``[dim + 1]``: the row, then the folder's :attr:`tag`, which ``rela.wrap(targets=)`` checks and drops):
        ``wds.WebDataset(urls, shardshuffle=...).compose(targets.join())``, before any sample shuffle."""
        return SidecarJoin(self, field, image_field, view, seed, check_bytes)

    def column(self, dataset, key_column: Optional[str] = None, name: str = "target", progress: bool = False):
        """``dataset`` (a ``datasets.Dataset`` holding the rows these sidecars were computed on, in any order: shuffled,
        sorted, selected or filtered) with a column ``name`` holding each row's target: a float32 list of ``width + 1``
        (the last value is the folder's :attr:`tag`). Every row is found by its key (``key_column``, default the id
        column given at precompute) or, when the sidecars were keyed by row number, by its image's digest; then its
        image digest is checked against the sidecar's. Reads every row's image bytes once (no decoding). Refuses a
        row of another data set, an image swapped between two ids, and folders written before rows recorded their
        image digest (with the rebuild command)."""
        import pyarrow as pa
        from tqdm.auto import tqdm

        from ..data.streams import open_stream
        from ..optional import require

        datasets = require("datasets", "ShardedTargets.column")
        if self.views:
            raise SidecarError("column() attaches one target per row; these sidecars hold stored views: use join().")
        data = self.metadata["settings"]["data"]
        if data.get("kind") != "hf":
            raise SidecarError(f"the sidecars at {str(self.path)!r} were computed on {data.get('kind')}: shards; column() "
                               "attaches targets to a datasets.Dataset. Join them in the webdataset pipeline instead: "
                               "wds.WebDataset(urls, ...).compose(targets.join()).")
        recorded = data.get("key_field")
        if key_column is None:
            key_column = recorded
        elif key_column != recorded:
            raise SidecarError(f"column(key_column={key_column!r}), but the sidecars at {str(self.path)!r} were keyed by "
                               + (f"column {recorded!r}" if recorded else "row number (no --key-field)")
                               + f" at precompute; pass key_column={recorded!r}.")
        self._require_digests("column()")
        source = open_stream(dataset, image_field=data.get("image_field"), key_field=key_column,
                             shard_rows=data.get("shard_rows") or 1)
        keys, digests, parts = [], [], []
        for s in self._shards:
            k, rows, d = self.shard(s["shard"])
            keys += k
            digests.append(d)
            parts.append(rows.numpy())
        stored = np.concatenate(digests)
        if not len(stored):
            raise SidecarError(f"the sidecars at {str(self.path)!r} hold no rows; precompute them over a data set with "
                               "images.")
        have = np.empty(len(dataset), dtype=np.int64)
        have_keys: list[str] = []
        bar = tqdm(total=len(dataset), desc="check rows", unit="row", disable=not progress)
        i = 0
        for shard in source.shards:
            for key, raw in source.contents(shard):
                have[i] = content_digest(raw)
                have_keys.append(key)
                i += 1
            bar.update(i - bar.n)
        bar.close()
        fix = ("attach targets computed on this data set: precompute sidecars with --data naming it, into a new "
               f"folder (these were made by `{self.metadata.get('command')}`).")
        if key_column:
            where = {k: g for g, k in enumerate(keys)}
            found = np.array([where.get(k, -1) for k in have_keys], dtype=np.int64)
            if (found < 0).any():
                i = int(np.flatnonzero(found < 0)[0])
                raise SidecarError(f"row {i} of the data set has {key_column} {have_keys[i]!r}, which no row of the "
                                   f"sidecars at {str(self.path)!r} holds: another data set, or rows added since the "
                                   "precompute; " + fix)
            bad = np.flatnonzero(stored[found] != have)
            if bad.size:
                i = int(bad[0])
                other = np.flatnonzero(stored == have[i])
                raise SidecarError(
                    f"row {i} of the data set ({key_column} {have_keys[i]!r}): its image is not the one its target was "
                    "computed from" + (f"; it is the image of {key_column} {keys[int(other[0])]!r} (images and ids "
                                       "swapped)" if other.size else " (the image changed since the precompute)")
                    + f"; {len(bad)} row(s) differ. Fix the data set, or " + fix)
        else:
            order = np.argsort(stored, kind="stable")
            found = order[np.minimum(np.searchsorted(stored[order], have), len(order) - 1)]
            missing = np.flatnonzero(stored[found] != have)
            if missing.size:
                i = int(missing[0])
                raise SidecarError(
                    f"row {i} of the data set: its image is not one the sidecars at {str(self.path)!r} were computed "
                    f"from ({len(missing)} of {len(have)} rows are not): another data set, or images changed since the "
                    "precompute; " + fix)
        flat = self.carried(torch.from_numpy(np.concatenate(parts).astype(np.float32, copy=False))[found]).numpy()
        table = pa.table({name: pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), self.width + 1)})
        return datasets.concatenate_datasets([dataset, datasets.Dataset(table)], axis=1)

    def __repr__(self) -> str:
        return f"ShardedTargets({str(self.path)!r}, shards={len(self._shards)}, rows={len(self)}, dim={self.dim})"


def _check_sample(shard: str, pos: int, key: str, keys: list[str], seen: dict, digest: int, raw) -> None:
    """Sample ``pos`` of ``shard`` (``key``, content ``raw``) against row ``pos`` of its sidecar (``keys``, the row's
    ``digest``; 0: none recorded): a key seen before in this shard, a key out of place and content other than the
    row's are refused, naming shard and key. ``seen`` (key -> position) is updated."""
    if key in seen:
        raise SidecarError(f"shard {shard!r}: key {key!r} appears twice (samples {seen[key]} and {pos}); the "
                           "shard has a duplicated key: fix it and recompute its sidecar.")
    if pos >= len(keys) or keys[pos] != key:
        _mismatch(shard, pos, key, keys)
    if digest != 0 and raw is not None and content_digest(raw) != digest:
        raise SidecarError(f"shard {shard!r}: the image of key {key!r} is not the one its target was computed from "
                           "(its bytes changed); recompute the sidecar of this shard.")
    seen[key] = pos


def _mismatch(shard: str, j: int, key: Optional[str], stored: list[str]) -> None:
    """Raise the error for sample j of ``shard`` carrying ``key`` (None: the data shard ended) against ``stored``."""
    if key is None:
        raise SidecarError(f"data shard {shard!r} ended after {j} samples but its sidecar holds {len(stored)} (next "
                           f"key {stored[j]!r}): the shard was truncated or rewritten since the targets were computed; "
                           "recompute its sidecar.")
    if j >= len(stored):
        raise SidecarError(f"shard {shard!r}: sample {j} (key {key!r}) has no target row: the sidecar holds only "
                           f"{len(stored)} rows (shorter than its shard: truncated or stale); recompute it.")
    where = stored.index(key) if key in stored else None
    if where is None:
        raise SidecarError(f"shard {shard!r}: key {key!r} (sample {j}) is not in its sidecar, whose row {j} is for key "
                           f"{stored[j]!r}: the sidecar is stale or belongs to another shard; recompute it.")
    raise SidecarError(f"shard {shard!r}: sample {j} has key {key!r} but the sidecar's row {j} is for key {stored[j]!r} "
                       f"({key!r} is its row {where}): samples are reordered or missing relative to the sidecar (or were "
                       "shuffled before the join: put the join right after the shard reader); recompute the sidecar "
                       "for this shard order.")


class SidecarJoin:
    """The ``webdataset`` stage of :meth:`ShardedTargets.join`: walks each shard in lockstep with its sidecar (the
    key and the image bytes' digest of every sample checked against its row), adds ``sample[field]``; with stored
    views, replays view ``v`` of the image (``view``: ``"random"``, seeded per key and pass, or an int) and adds
    ``sample["view"]``. Never decodes anything but the image of a stored view, and never unpickles."""

    def __init__(self, targets: ShardedTargets, field, image_field, view, seed, check_bytes):
        self.targets, self.field, self.image_field = targets, field, image_field
        self.view, self.seed, self.check_bytes = view, int(seed), check_bytes
        self.passes = 0

    def __call__(self, samples: Iterable[dict]) -> Iterator[dict]:
        from ..data.streams import IMAGE_FIELDS, decode_image

        current, keys, rows, digests, pos, seen = None, [], None, None, 0, {}
        for sample in samples:
            key, url = sample["__key__"], sample.get("__url__")
            if url is None:
                raise SidecarError("ShardedTargets.join needs each sample's __url__ (its shard): put the join right after "
                                   "wds.WebDataset(...) / tarfile_to_samples(), before any map or shuffle.")
            shard = Path(str(url)).name
            if shard != current or (pos == len(keys) and keys and key == keys[0]):  # a new shard, or this one again
                if current is not None and pos < len(keys) and shard != current:
                    _mismatch(current, pos, None, keys)
                current, pos, seen = shard, 0, {}
                keys, rows, digests = self.targets.shard(shard)
                rows = self.targets.carried(rows)  # every row handed with the folder's tag (wrap checks it)
                self.passes += 1
            field = self.image_field or next((f for f in IMAGE_FIELDS if f in sample), None)
            raw = sample.get(field) if self.check_bytes and isinstance(sample.get(field), bytes) else None
            _check_sample(shard, pos, key, keys, seen, int(digests[pos]) if pos < len(keys) else 0, raw)
            row = rows[pos]
            if self.targets.views is not None:
                v = self._pick(key)
                image = sample[field]
                image = decode_image(image) if isinstance(image, bytes) else image
                h, w = image.size[1], image.size[0]
                sample[field] = apply_view(image, self.targets.views.params(key_index(key), v, h, w))
                sample["view"], row = v, row[v]
            sample[self.field] = row
            pos += 1
            yield sample
        if current is not None and pos < len(keys):
            _mismatch(current, pos, None, keys)

    def _pick(self, key: str) -> int:
        k = self.targets.views.k
        if self.view == "random":
            return random.Random(f"{self.seed}/{self.passes}/{key}").randrange(k)
        if not isinstance(self.view, int) or not 0 <= self.view < k:
            raise ValueError(f"view must be 'random' or an int in [0, {k}), got {self.view!r}.")
        return self.view
