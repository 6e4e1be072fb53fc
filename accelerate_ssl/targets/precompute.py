"""Run a prior over a dataset once and write a TargetStore (ReLA-D targets; ReLA v2, Sec. 4).

``precompute_targets(prior, dataset, path)``: eval + ``torch.inference_mode``, dataset order, batched,
tqdm progress, optional fp16/bf16 autocast (rows are stored as float32).

**Chunks and resuming.** Rows are cut into global chunks of ``chunk_size`` rows; chunk ``k`` covers
rows ``[k * chunk_size, min((k + 1) * chunk_size, N))`` and is written to ``chunks/chunk-0000k.npy``
through a temporary file and ``os.replace`` (:func:`accelerate_ssl.atomic.atomic_path`), so a chunk file on disk is
always complete. A small
``manifest.json`` records the run's settings (prior, preprocessing, dataset fingerprint, precision,
batch and chunk size); a rerun with the same settings keeps the complete chunks and computes only
the others (stale ``.tmp`` files are deleted); different settings are refused. At the end the
main process copies the chunks into ``targets.npy`` (memory-mappable) and writes ``metadata.json``
last: its atomic rename is the "finished" marker.

**Sharding.** Under ``accelerate launch`` every process (``PartialState``) takes a contiguous range
of chunks, writes them into the shared folder, then all wait at a barrier and the main process
consolidates. Batches never cross chunk boundaries, so every row is computed in the same batch
whatever the number of processes: the store is identical to a 1-process run (bitwise in fp32 on CPU).

**NaN/Inf** rows are rejected at write time with the row indices and the likely cause.

**Compact stores.** ``dtype="float16"`` / ``"bfloat16"`` stores each row in 2 bytes per value instead of 4
(bfloat16 as its uint16 bit patterns; values beyond float16's range are refused at write with the bfloat16
advice); ``components=k`` fits the batch PCA of :mod:`accelerate_ssl.targets.pca` (Eq. 41) over the finished rows
and stores them projected and z-scored, ``k`` values per row. Chunks are float32 either way, so both only change
the consolidation: a run interrupted (or refused for float16 overflow) resumes with another ``dtype``.

**Spatial stores.** ``spatial=True`` keeps the prior's feature map instead of its pooled row
(:meth:`~accelerate_ssl.priors.Prior.feature_map`: a ViT's patch tokens on their grid, a CNN's last map), row i being
item i's map flattened channels last (``[h, w, C]``); ``spatial=k`` reduces every location of it to ``k`` values: the
batch PCA of :mod:`accelerate_ssl.targets.pca` (Eq. 41, z-scored columns) is fitted over the locations of up to
:data:`SPATIAL_FIT_IMAGES` evenly spaced items **before** any chunk is written, saved in ``pca/`` (its sha256 recorded),
and each chunk is written reduced, so no full-width map ever reaches the disk (a DINOv2 ViT-S/14 map at 224 px: 256
locations x 384 values, 393 KB per image in float32; at ``k=32`` in float16, 16 KB). A resumed run reuses that fit.
Metadata ``spatial`` records the grid, the stride (input pixels per cell), the prior's input size, the channels and
the reduction (:meth:`TargetStore.spatial <accelerate_ssl.targets.store.TargetStore.spatial>`); the store's rows
(``store[i]``) are then the map's mean over its grid, and :mod:`accelerate_ssl.targets.views` pools a view's box.
Under ``accelerate launch`` the main process fits and every process writes in that one basis; the store then equals a
one-process store to float rounding (the fit's float64 Gram product may round differently in another process).
Several priors with ``spatial=`` are each a spatial job: each its own grid and its own fit, then the shared pass.

**Keys.** One key per row (the data set's file names, or ``keys=``) is recorded with the store
(:mod:`accelerate_ssl.targets.keys`); duplicated keys are refused before anything is computed.

**File contents.** For a data set that lists its files, each row's file is recorded by its size, modification time and
the digest of its bytes (``contents.npy``): for a folder the loader reads each file once, decodes those bytes and
records them (:func:`~accelerate_ssl.data.fingerprint.read_file`, a chunk's records written beside its rows); a data
set read through ``dataset[i]`` has its files read at consolidation. The store then refuses the same names holding
other bytes (checked at open, and byte for byte by ``accelerate-ssl store verify --data``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..atomic import atomic_path
from ..data.items import IMAGE_FIELDS
from ..data.spec import DATA_SPEC_HELP, data_spec, fraction_arg, open_data
from ..atomic import atomic_write_text
from ..checksum import file_sha256
from .format import (AT_WRITE_PCA, CHUNKS, CONTENTS, DTYPES, FORMAT, FORMAT_VERSION, IDENTITY, MANIFEST, METADATA, PCA_DIR,
                     TARGETS, encode_rows, read_json)
from .store import TargetStore
from .write import (PRECISIONS, SPATIAL_FIT_IMAGES, check_first_item, check_spatial, default_batch_size, fit_map_pca,
                    forward_rows, image_channels, image_tensor, input_batches, map_geometry, prior_batches,
                    process_state, resolve_preprocess, sample_batches, settings_diff)

DEFAULT_CHUNK_SIZE = 8192

def chunk_path(path: Path, k: int) -> Path:
    return Path(path) / CHUNKS / f"chunk-{k:05d}.npy"


def ids_path(path: Path, k: int) -> Path:
    """The row identity digests of chunk ``k`` (written before the chunk's rows, so a complete chunk has them)."""
    return Path(path) / CHUNKS / f"ids-{k:05d}.npy"


def _complete_array(file: Path, shape: tuple, dtype) -> bool:
    if not file.is_file():
        return False
    try:
        arr = np.load(file, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError):
        return False
    return arr.shape == shape and arr.dtype == dtype


def contents_path(path: Path, k: int) -> Path:
    """The file records of chunk ``k``'s rows (a folder's: size, mtime, digest of the bytes the loader read and
    decoded), written before the chunk's rows; a chunk of an earlier version's run has none."""
    return Path(path) / CHUNKS / f"contents-{k:05d}.npy"


def _chunk_is_complete(path: Path, k: int, rows: int, dim: int) -> bool:
    """Chunk ``k``'s identity digests and its ``[rows, dim]`` float32 rows are both on disk, whole."""
    return (_complete_array(ids_path(path, k), (rows,), np.int64)
            and _complete_array(chunk_path(path, k), (rows, dim), np.float32))


def _write_chunk(file: Path, rows: np.ndarray) -> None:
    """Write one finished chunk atomically."""
    with atomic_path(file, suffix=".npy") as tmp:  # (np.save appends .npy to any other name)
        np.save(tmp, rows, allow_pickle=False)


def _python_command(prior, dataset, path, image_key=None) -> str:
    named = "" if image_key is None else f", image_key={image_key!r}"
    return (f"precompute_targets(create_prior({prior.spec!r}), <{getattr(dataset, 'name', type(dataset).__name__)}>, "
            f"{str(path)!r}{named})")


def precompute_targets(prior, dataset, path, batch_size: Optional[int] = None, num_workers: Optional[int] = None,
                       precision: str = "fp32",
                       chunk_size: int = DEFAULT_CHUNK_SIZE, progress: bool = True,
                       command: Optional[str] = None, dtype: str = "float32", components: Optional[int] = None,
                       keys=None, image_key=None, spatial=False):
    """Compute ``prior(preprocess(image))`` for every item of ``dataset`` in order and write a TargetStore.

    Several priors in one pass: ``prior`` a list of priors and ``path`` a list of as many folders, or both mappings
    with the same names (``{"dino": prior_a, "clip": prior_b}`` and ``{"dino": "targets/dino", "clip":
    "targets/clip"}``). Each batch of items is then read, decoded and identified once, and each prior preprocesses it
    its own way and writes its own store: the same rows, files and checks as a run of that prior alone (each store
    resumes, is refused or is returned finished on its own). Returns the stores in the same shape (a list or a dict).
    Streamed data is precomputed one prior after another (one sidecar folder each).

    Args:
        prior: a :class:`~accelerate_ssl.priors.Prior` (``create_prior(...)``), or several (above). A random prior
            with default statistics is normalised with ``dataset.mean``/``dataset.std`` when present.
        dataset: map-style, yields ``image``, ``(image, label)`` or a dict holding the image (PIL, ndarray or
            tensor), untransformed (:func:`~accelerate_ssl.data.items.clean_view` removes a data set's transform); or
            streamed data, ``"wds:<shard pattern>"`` / ``"hf:<path or name>"`` / an ``open_stream(...)`` source: then
            one sidecar per data shard is written and a :class:`~accelerate_ssl.targets.sidecar.ShardedTargets` returned
            (:func:`~accelerate_ssl.targets.sidecar.precompute_sidecars` has the sidecar options).
        path: the store folder (created; resumed if it holds an unfinished run with the same settings); one per
            prior for several priors.
        batch_size: images per forward of the prior; ``None`` (default): 256 on a GPU, 32 on CPU
            (:data:`~accelerate_ssl.targets.write.DEFAULT_BATCH_SIZE`). It changes the rows by float rounding at most, so a run resumes with any
            batch size.
        num_workers: the loader's worker processes, which read, digest and decode the items (the prior's
            preprocessing runs batched on its device); ``None`` (default): sized from the machine
            (:func:`~accelerate_ssl.targets.write.loader_workers`: on a GPU every CPU but two, up to 16; on a CPU
            only CPUs torch's threads leave free, one per 4 at most, none for in-memory arrays); 0: the staging thread
            reads them.
        precision: ``"fp32"``, ``"fp16"`` or ``"bf16"`` (autocast of the prior's forward).
        dtype: how rows are stored: ``"float32"`` (default), ``"float16"`` or ``"bfloat16"`` (half the bytes; read
            back as float32).
        components: store the rows reduced to their top ``k`` principal components, z-scored (Eq. 41, fitted over
            every finished row); ReLA then uses them as they are (``n_components`` at most ``k``).
        keys: one key per item, recorded so rows can be found by key (``rela.wrap(keys=)``): ``None`` (default)
            the data set's file names when it has files; a list (an id column, WebDataset ``__key__`` s); a
            callable ``keys(i)``; ``False`` none. Duplicated keys are refused.
        image_key: where each item's image is: the field of dict items (default: the first of ``image``, ``img``,
            ``pixel_values``, ``png``, ``jpg``, ... present; the choice is printed), the position in tuple items
            (default: the first image); for streamed data given as a spec, its image field / column.
        spatial: ``False`` (default): one pooled row per item. ``True``: the prior's feature map per item (every
            channel); an int ``k``: the map with each location reduced to ``k`` PCA components (fitted before
            writing; module docstring, "Spatial stores"). The store's rows are then the map's mean over its grid and
            :func:`~accelerate_ssl.targets.views.view_targets` pools a view's crop box from it. Streamed data: sidecars
            holding each sample's map (:func:`~accelerate_ssl.targets.sidecar.precompute_sidecars`).
            With several priors every store is spatial alike, each on its own prior's grid with its own PCA (fitted
            on its own map before the shared pass); ``k`` must then be below every prior's channels.
        chunk_size: rows per resumable chunk file.
        progress: show a tqdm bar (main process only).
        command: how to reproduce this store, recorded in the metadata (the CLI fills it in).

    Returns:
        The opened :class:`TargetStore` (on every process); for several priors, the stores as a list or a dict.
    """
    from tqdm.auto import tqdm

    from .. import __version__

    named = _named_priors(prior, path)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}.")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} (how the rows are stored), got {dtype!r}.")
    for name, value, low in (("batch_size", batch_size, 1), ("chunk_size", chunk_size, 1), ("num_workers", num_workers, 0)):
        if (value is not None or name == "chunk_size") and (not isinstance(value, int) or value < low):
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
    from ..data.streams import StreamSource, is_stream_spec

    check_spatial(spatial)
    if spatial and components is not None:
        raise ValueError("components= reduces pooled rows; a spatial store is reduced by spatial=k (each location of "
                         "its map to k PCA components): pass one of them.")
    if is_stream_spec(dataset) or isinstance(dataset, StreamSource):  # streamed data: one sidecar per shard
        from ..data.streams import open_stream
        from .sidecar import precompute_sidecars

        if image_key is not None:
            if not is_stream_spec(dataset):
                raise ValueError("image_key= with a StreamSource: name the image field when opening it, "
                                 "open_stream(spec, image_field=...).")
            dataset = open_stream(dataset, image_field=str(image_key))

        if keys is not None or num_workers or chunk_size != DEFAULT_CHUNK_SIZE:
            raise ValueError("keys=, num_workers= and chunk_size= are for map-style data sets: a stream's rows are "
                             "keyed by each sample's __key__ and written one sidecar per shard. Leave them out.")
        done = {name: precompute_sidecars(p, dataset, out, batch_size=batch_size, precision=precision, dtype=dtype,
                                          components=components, progress=progress, command=command, spatial=spatial)
                for name, p, out in named}
        return _shaped(prior, done)
    module = type(dataset).__module__.split(".")[0]
    if module in ("datasets", "webdataset"):
        spec = "hf:<path or name>" if module == "datasets" else "wds:<shard pattern>"
        raise TypeError(f"A {type(dataset).__name__} is streamed data: its targets are sidecars joined by sample key, not "
                        "rows by position. Use accelerate_ssl.precompute_sidecars(prior, "
                        + ("open_stream(dataset, image_field='image')" if module == "datasets" else "'wds:<shard pattern>'")
                        + f", path) or `accelerate-ssl precompute --prior SPEC --data {spec} --out PATH`, then train with "
                        "rela.wrap(loss, targets=batch['target']) (docs/hosts/webdataset.md, 'At scale').")
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(f"precompute_targets needs a map-style dataset (len() and dataset[i]): target row i belongs to "
                        f"dataset[i], and a {type(dataset).__name__} has no stable index. Wrap the samples in a map-style "
                        "Dataset (e.g. a list of images, or an ImageFolder) and train on that same dataset.")
    n = len(dataset)
    if n == 0:
        raise ValueError("The dataset is empty; pass a dataset with at least one sample.")
    given, image_key = image_key, check_first_item(dataset, image_key)
    state = process_state()
    batch_size = batch_size or default_batch_size(state.device)
    from .keys import TargetKeys, resolve_keys

    key_list, key_kind = resolve_keys(keys, dataset)
    row_keys = None if key_list is None else TargetKeys.from_keys(key_list, key_kind)  # duplicates refused here
    wanted_keys = None if row_keys is None else TargetKeys.digest(key_list)
    options = dict(dataset=dataset, n=n, given=given, image_key=image_key, state=state, batch_size=batch_size,
                   precision=precision, chunk_size=chunk_size, dtype=dtype, components=components, command=command,
                   key_kind=key_kind, wanted_keys=wanted_keys, progress=progress, spatial=spatial)
    stores, jobs = {}, []
    for name, p, out in named:
        planned = _plan(name, p, Path(out), **options)
        if isinstance(planned, TargetStore):
            stores[name] = planned
        else:
            jobs.append(planned)

    # ---- compute: one pass over the data per fingerprint definition (all of them, unless a store resumes an older one)
    ranges = _chunk_ranges(n, chunk_size)
    groups: dict[str, list] = {}
    for job in jobs:
        groups.setdefault(json.dumps(job.fingerprint, sort_keys=True), []).append(job)
    for group in groups.values():
        if any(job.todo for job in group):
            _compute_chunks([job for job in group if job.todo], dataset, ranges, batch_size, num_workers, precision,
                            state.device, progress and state.is_main_process, tqdm, image_key, group[0].fingerprint)
    state.wait_for_everyone()

    # ---- consolidate (main process), metadata.json last
    if state.is_main_process:
        contents = _file_contents([job.path for job in jobs], dataset, ranges, progress) if jobs else None
        for job in jobs:
            metadata = {
                "format": FORMAT, "format_version": FORMAT_VERSION, **job.settings, "file": TARGETS,
                "preprocess": job.pre.config,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "library_version": __version__, "torch_version": torch.__version__,
                "num_processes": state.num_processes, "command": job.command,
            }
            if job.geometry is not None:  # rows are flattened maps; the PCA (if any) was applied as chunks were written
                metadata.update(dim=job.width, source_dim=job.dim)
                if job.reduce_map is not None:
                    metadata["pca_file"] = f"{PCA_DIR}/{AT_WRITE_PCA}"
                    metadata["spatial"]["pca_sha256"] = file_sha256(job.path / PCA_DIR / AT_WRITE_PCA)
            _consolidate(job.path, ranges, job.width, metadata, dtype=dtype,
                         components=None if job.geometry is not None else components, keys=row_keys,
                         contents=contents)
    state.wait_for_everyone()
    for job in jobs:
        stores[job.name] = TargetStore.open(job.path)
    return _shaped(prior, stores)


def _named_priors(prior, path) -> list[tuple[Any, Any, Any]]:
    """``(name, prior, path)`` of each prior to precompute: one, a list with a list of paths, or a mapping with a
    mapping of paths under the same names; several priors must write distinct folders."""
    if isinstance(prior, dict) or isinstance(prior, (list, tuple)):
        if isinstance(prior, dict) != isinstance(path, dict) or not isinstance(path, (dict, list, tuple)):
            raise TypeError("precompute_targets with several priors needs one folder per prior: a list of priors with "
                            "a list of paths, or a mapping name -> prior with a mapping name -> path.")
        names = list(prior) if isinstance(prior, dict) else list(range(len(prior)))
        if not names or (sorted(map(str, names)) != sorted(map(str, path)) if isinstance(prior, dict)
                         else len(path) != len(prior)):
            raise ValueError(f"precompute_targets: {len(prior)} priors but the paths "
                             f"{list(path) if isinstance(path, dict) else len(path)} do not match them one to one; give "
                             "one folder per prior (the same names for mappings).")
        outs = [Path(path[k]).resolve() for k in names]
        if len(set(outs)) != len(outs):
            raise ValueError("precompute_targets: several priors must write distinct folders, got the same path twice.")
        return [(k, prior[k], path[k]) for k in names]
    return [(None, prior, path)]


def _shaped(prior, stores: dict):
    """The finished stores in the shape the priors were given: one, a list, or a mapping."""
    if isinstance(prior, dict):
        return {k: stores[k] for k in prior}
    if isinstance(prior, (list, tuple)):
        return [stores[i] for i in range(len(prior))]
    return stores[None]


def _chunk_ranges(n: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(k * chunk_size, min((k + 1) * chunk_size, n)) for k in range(math.ceil(n / chunk_size))]


class _Job:
    """One prior's store to compute: its settings, preprocessing and the chunks this process still owes; ``dim`` the
    prior's output dim, ``width`` a chunk row's (``dim``, or a spatial store's flattened map), ``geometry`` a spatial
    store's map (:func:`_map_geometry`; None: pooled rows) and ``reduce_map`` its map's PCA (None: not reduced)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _plan(name, prior, path: Path, *, dataset, n, given, image_key, state, batch_size, precision, chunk_size, dtype,
          components, command, key_kind, wanted_keys, progress, spatial=False):
    """A prior's store at ``path``: the finished store when it is this very computation (refused when it is another),
    else a :class:`_Job` (its manifest written, its stale files removed, the chunks this process computes)."""
    from ..data import ReplayViews, dataset_fingerprint

    pre = resolve_preprocess(prior, dataset)
    prior_info = {**prior.describe(), "preprocess": pre.config}
    # a store (or an unfinished run) already at `path` continues under the fingerprint definition it was made with
    recorded = _recorded_fingerprint(path)
    fingerprint = dataset_fingerprint(dataset, image_key=image_key if isinstance(image_key, str) else given,
                                      like=recorded)
    dim = int(prior.output_dim)
    if components is not None and (not isinstance(components, int) or isinstance(components, bool)
                                   or not 1 <= components <= dim):
        raise ValueError(f"components must be an int in [1, {dim}] (the prior's output dim is {dim}), got {components!r}.")
    geometry = None
    if spatial:  # this prior's map: its grid, stride and channels (and k for a reduced map)
        geometry = _map_geometry(prior, dataset, pre, image_key, spatial, n)
        components = geometry.get("components")
    command = command or _python_command(prior, dataset, path, given)
    settings = {
        "prior": prior_info,
        "dataset": {"name": getattr(dataset, "name", type(dataset).__name__), "fingerprint": fingerprint,
                    # where the image was read: the field of dict items, a named position (absent otherwise)
                    **({"image_key": image_key} if isinstance(image_key, str) or given is not None else {})},
        # stored views (accelerate_ssl.data.views): row j = view j % k of image j // k; None: the images themselves
        "views": dataset.views.to_dict() if isinstance(dataset, ReplayViews) else None,
        "num_rows": n, "dim": dim, "dtype": dtype, "components": components, "precision": precision,
        "batch_size": batch_size, "chunk_size": chunk_size,
    }
    if geometry is not None:  # (a key only spatial stores have: global stores' settings are unchanged)
        settings["spatial"] = {k: v for k, v in geometry.items() if k != "components"}
    width = dim if geometry is None else int(np.prod(geometry["grid"])) * geometry["channels"]
    settings = json.loads(json.dumps(settings))  # as it reads back from JSON (lists, not tuples)

    # ---- a finished store at `path`: return it if it is this very computation, refuse otherwise
    if (path / METADATA).is_file():
        store = TargetStore.open(path)
        old = {k: store.metadata.get(k) for k in settings}
        old["dim"] = store.source_dim
        if _identity(old) != _identity(settings):
            raise ValueError(settings_diff(path, old, settings, finished=True))
        recorded = (store.metadata.get("keys") or {}).get("sha256")
        if recorded != wanted_keys and (key_kind == "user" or recorded is not None):
            raise ValueError(f"{str(path)!r} holds a finished store with {'other' if recorded else 'no'} sample keys than "
                             f"the ones given now. Use another --out / path, or replace it with this computation: "
                             f"`rm -r {shlex.quote(str(path))}`, then run this precompute again.")
        return store

    # ---- manifest: every process checks it, the main process writes it
    manifest_file = path / MANIFEST
    if manifest_file.is_file():
        old = read_json(manifest_file).get("settings")
        if _chunk_identity(old or {}) != _chunk_identity(settings):
            raise ValueError(settings_diff(path, old or {}, settings, finished=False))
    state.wait_for_everyone()
    if state.is_main_process:
        (path / CHUNKS).mkdir(parents=True, exist_ok=True)
        if not manifest_file.is_file():
            atomic_write_text(manifest_file, json.dumps({"settings": settings, "command": command}, indent=1))
    state.wait_for_everyone()
    reduce_map = None
    if geometry is not None and geometry["reduction"] == "pca":  # fitted once, before any chunk is written
        reduce_map = _spatial_pca(prior, dataset, pre, path, state, geometry, batch_size, precision, state.device,
                                  image_key, progress and state.is_main_process)

    # ---- this process's contiguous shard of chunks; skip the complete ones
    ranges = _chunk_ranges(n, chunk_size)
    num_chunks = len(ranges)
    first, last = num_chunks * state.process_index // state.num_processes, num_chunks * (state.process_index + 1) // state.num_processes
    todo = []
    for k in range(first, last):
        files = (chunk_path(path, k), ids_path(path, k))
        for file in files:
            for stale in file.parent.glob(f"{file.name}.*tmp*"):  # left by a write that was interrupted
                stale.unlink(missing_ok=True)
        if _chunk_is_complete(path, k, ranges[k][1] - ranges[k][0], width):
            continue
        for file in files:
            file.unlink(missing_ok=True)
        todo.append(k)
    if state.is_main_process and progress and last - first > len(todo):
        print(f"precompute: resuming {path}: {last - first - len(todo)} of {last - first} chunk(s) of this process "
              "already done", file=sys.stderr)
    return _Job(name=name, prior=prior, path=path, pre=pre, dim=dim, settings=settings, fingerprint=fingerprint,
                command=command, todo=todo, geometry=geometry, reduce_map=reduce_map, width=width)


def _map_geometry(prior, dataset, pre, image_key, spatial, n: int) -> dict:
    """:func:`~accelerate_ssl.targets.write.map_geometry` of the prior's map of item 0."""
    return map_geometry(prior, next(sample_batches(dataset, pre, [0], 1, image_key)), spatial, n)


def _spatial_pca(prior, dataset, pre, path: Path, state, geometry: dict, batch_size, precision, device, image_key, show):
    """The PCA every location of a spatial store's maps is reduced with (Eq. 41, z-scored columns), fitted by the main
    process over the locations of ``geometry["fit_images"]`` evenly spaced items and saved in ``pca/`` before any chunk
    is written; a resumed run loads it (chunks whose basis is gone are deleted first, so no chunk mixes two fits)."""
    from safetensors.torch import load_file, save_file

    from .pca import TargetPCA

    file = path / PCA_DIR / AT_WRITE_PCA
    if state.is_main_process and not file.is_file():
        for stale in (path / CHUNKS).glob("*.npy"):  # written in a basis that is gone: recompute them
            stale.unlink()
        rows = np.unique(np.linspace(0, len(dataset) - 1, geometry["fit_images"]).round().astype(np.int64))
        fitted = fit_map_pca(prior.to(device).eval(), sample_batches(dataset, pre, rows, batch_size, image_key, device),
                             geometry, precision, device, "the items of the map's PCA fit")
        if show:
            print(f"precompute: fitted the map's PCA over {len(rows)} items", file=sys.stderr)
        file.parent.mkdir(exist_ok=True)
        with atomic_path(file, suffix=".safetensors") as tmp:
            save_file(fitted.state_dict(), str(tmp), metadata={"n_components": str(geometry["channels"]),
                                                               "standardize": "True"})
    state.wait_for_everyone()
    return TargetPCA.from_state_dict(load_file(str(file)))


def _compute_chunks(jobs, dataset, ranges, batch_size, num_workers, precision, device, show, tqdm, image_key=None,
                    fingerprint=None):
    """Every job's missing chunks in one pass over the data: each batch of items is read, decoded and identified
    once by the loader (:func:`~accelerate_ssl.targets.write.input_batches`), crosses to the device as uint8 and is
    preprocessed there once per prior, batches ahead of the forward (:func:`~accelerate_ssl.targets.write.prior_batches`),
    and is embedded by each prior whose chunk it is: its pooled rows, or for a spatial job its feature map (channels
    last, each location reduced by the job's PCA if any). Batch k+1's forward is queued before batch k's rows are
    waited for, so the device does not idle on the host between batches."""
    todo = sorted(set().union(*(job.todo for job in jobs)))
    for job in jobs:
        job.prior = job.prior.to(device).eval()
    loader = input_batches(dataset, batch_size, num_workers, device, [ranges[k] for k in todo], image_key, fingerprint)
    batches = prior_batches(loader, [job.pre for job in jobs], device, PRECISIONS[precision])
    bar = tqdm(total=sum(ranges[k][1] - ranges[k][0] for k in todo),
               desc="precompute " + " + ".join(job.prior.spec for job in jobs), unit="img", disable=not show,
               dynamic_ncols=True)
    # chunk -> (rows per job, identity digests, file records, rows filled)
    filling: dict[int, tuple[dict, np.ndarray, np.ndarray, list]] = {}

    def settle(k: int, s: int, pending: dict, digests: torch.Tensor, records: torch.Tensor) -> None:
        """A batch's rows into its chunk; the chunk written once it is whole (its digests and file records first)."""
        a, b = ranges[k]
        if k not in filling:
            filling[k] = ({i: np.empty((b - a, jobs[i].width), dtype=np.float32) for i in pending},
                          np.empty(b - a, dtype=np.int64), np.empty((b - a, records.shape[1]), dtype=np.int64), [0])
        rows, ids, files, filled = filling[k]
        ids[s - a : s - a + len(digests)] = digests.numpy()
        files[s - a : s - a + len(digests)] = records.numpy()
        for i, rows_of in pending.items():
            out = rows_of.result(lambda bad: f"dataset indices {[s + j for j in bad]} (chunk {k})")
            rows[i][s - a : s - a + len(out)] = out.reshape(len(out), -1).numpy()
        filled[0] += len(digests)
        bar.update(len(digests))
        if filled[0] == b - a:
            for i in rows:
                _write_chunk(ids_path(jobs[i].path, k), ids)
                if files.shape[1]:
                    _write_chunk(contents_path(jobs[i].path, k), files)
                _write_chunk(chunk_path(jobs[i].path, k), rows[i])
            del filling[k]

    queued = None
    try:
        for (xs, digests, records), (c, s, e) in zip(batches, loader.batch_sampler.spans()):
            k = todo[c]
            if len(digests) != e - s:
                raise RuntimeError(f"precompute: the loader gave {len(digests)} rows for rows [{s}, {e}) (chunk {k}).")
            pending = {i: forward_rows(job.prior, xs[i], precision, device, spatial=job.geometry is not None,
                                       reduce=job.reduce_map)
                       for i, job in enumerate(jobs) if k in job.todo}
            if queued is not None:
                settle(*queued)
            queued = (k, s, pending, digests, records)
        if queued is not None:
            settle(*queued)
    finally:
        bar.close()


class _ChunkRows:
    """The finished float32 chunks as one ``[N, dim]`` array-like (``shape``, ``[a:b]``) for the batch PCA."""

    def __init__(self, path: Path, ranges):
        self.path, self.ranges = path, ranges
        self.shape = (ranges[-1][1], int(np.load(chunk_path(path, 0), mmap_mode="r", allow_pickle=False).shape[1]))

    def __getitem__(self, rows: slice) -> np.ndarray:
        a, b, _ = rows.indices(self.shape[0])
        parts = [np.load(chunk_path(self.path, k), mmap_mode="r", allow_pickle=False)[max(a, s) - s : min(b, e) - s]
                 for k, (s, e) in enumerate(self.ranges) if s < b and e > a]
        return np.concatenate(parts) if parts else np.empty((0, self.shape[1]), np.float32)


def _file_contents(paths_of_jobs: list[Path], dataset, ranges, progress: bool) -> Optional[np.ndarray]:
    """A folder data set's files as :data:`CONTENTS` records them (size, mtime, digest of the bytes, row by row), or
    None for data that lists no files: the records the loader made of each file as it read and decoded it (one read,
    kept beside any of the jobs' chunks), and, for chunks without them (written by an earlier version, or read through
    ``dataset[i]``), the files read now, once for every job (:func:`~accelerate_ssl.data.fingerprint.record_contents`)."""
    from ..data.fingerprint import CONTENT_FIELDS, file_paths, record_contents

    paths = file_paths(dataset)
    if paths is None:
        return None
    parts = []
    for k, (a, b) in enumerate(ranges):
        made = [f for f in (contents_path(p, k) for p in paths_of_jobs)
                if _complete_array(f, (b - a, len(CONTENT_FIELDS)), np.int64)]
        parts.append(np.load(made[0], allow_pickle=False) if made else record_contents(paths[a:b], progress=progress))
    return np.concatenate(parts) if parts else np.empty((0, len(CONTENT_FIELDS)), np.int64)


def _consolidate(path: Path, ranges, dim: int, metadata: dict, dtype: str = "float32", components: Optional[int] = None,
                 keys=None, contents: Optional[np.ndarray] = None) -> None:
    n = ranges[-1][1] if ranges else 0
    missing = [k for k, (a, b) in enumerate(ranges) if not _chunk_is_complete(path, k, b - a, dim)]
    if missing:
        raise RuntimeError(f"Chunks {missing[:10]} of {path} are missing after every process finished; rerun the same "
                           "command to compute them.")
    reduce = None
    if components is not None:  # Eq. 41 over every finished row (two streaming passes, App. N Alg. 2)
        from safetensors.torch import save_file

        from .pca import TargetPCA

        reduce = TargetPCA.fit(_ChunkRows(path, ranges), int(components), standardize=True)
        (path / PCA_DIR).mkdir(exist_ok=True)
        with atomic_path(path / PCA_DIR / AT_WRITE_PCA, suffix=".safetensors") as tmp:
            save_file(reduce.state_dict(), str(tmp), metadata={"n_components": str(components), "standardize": "True"})
        metadata.update(source_dim=dim, dim=int(components), pca_file=f"{PCA_DIR}/{AT_WRITE_PCA}")
    width = dim if reduce is None else int(components)
    final = path / TARGETS
    with atomic_path(final) as tmp:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=DTYPES[dtype], shape=(n, width))
        for k, (a, b) in enumerate(ranges):
            rows = np.load(chunk_path(path, k), mmap_mode="r", allow_pickle=False)
            if reduce is not None:
                rows = reduce.transform(torch.from_numpy(np.array(rows))).numpy()
            out[a:b] = encode_rows(rows, dtype, first_row=a)  # float16 overflow refused here, chunks kept
        out.flush()
        del out
    if keys is not None:
        metadata["keys"] = keys.save(path)
    with atomic_path(path / IDENTITY, suffix=".npy") as tmp:
        np.save(tmp, np.concatenate([np.load(ids_path(path, k), allow_pickle=False) for k in range(len(ranges))]), allow_pickle=False)
    if contents is not None:  # each row's file: size, mtime, digest of its bytes (checked at open and by verify)
        from ..data.fingerprint import CONTENT_FIELDS

        with atomic_path(path / CONTENTS, suffix=".npy") as tmp:
            np.save(tmp, contents, allow_pickle=False)
        metadata["contents"] = {"file": CONTENTS, "fields": list(CONTENT_FIELDS), "digest": "blake2b-128",
                                "sha256": file_sha256(path / CONTENTS)}
    metadata["file_bytes"] = final.stat().st_size
    metadata["file_sha256"] = file_sha256(final)
    metadata["identity_file"] = IDENTITY
    atomic_write_text(path / METADATA, json.dumps(metadata, indent=1))
    shutil.rmtree(path / CHUNKS, ignore_errors=True)
    (path / MANIFEST).unlink(missing_ok=True)


def _recorded_fingerprint(path: Path) -> Optional[dict]:
    """The data set fingerprint recorded by a finished store or an unfinished run at ``path`` (None: nothing there)."""
    for name, where in ((METADATA, ()), (MANIFEST, ("settings",))):
        if (Path(path) / name).is_file():
            recorded = read_json(Path(path) / name)
            for key in where:
                recorded = recorded.get(key) or {}
            fingerprint = (recorded.get("dataset") or {}).get("fingerprint")
            return fingerprint if isinstance(fingerprint, dict) else None
    return None


def _identity(settings: dict) -> dict:
    """The settings that decide a store's content: the dataset fingerprint counts by its identity (length, kind,
    sha256), not by the descriptive fields added to it for error messages (stores written before them stay valid);
    the batch size changes rows by float rounding at most, not which sample they describe."""
    settings = {k: v for k, v in settings.items() if k != "batch_size"}
    if isinstance(settings.get("spatial"), dict):  # the fit's checksum is recorded at the end, not a setting
        settings["spatial"] = {k: v for k, v in settings["spatial"].items() if k != "pca_sha256"}
    fp = (settings.get("dataset") or {}).get("fingerprint")
    if not isinstance(fp, dict):
        return settings
    return {**settings, "dataset": {**settings["dataset"],
                                    "fingerprint": {k: fp.get(k) for k in ("length", "kind", "sha256")}}}


def _chunk_identity(settings: dict) -> dict:
    """What the chunks depend on: not how the finished rows are stored (``dtype``, ``components``)."""
    return {k: v for k, v in _identity(settings).items() if k not in ("dtype", "components")}


# ------------------------------------------------------------------------------------------------
# CLI: accelerate-ssl precompute
# ------------------------------------------------------------------------------------------------
#: ``--image-field``: one grammar for every kind of data (``image_key=`` in Python)
IMAGE_FIELD_HELP = ("where each sample's image is: the field of dict items, the column of an hf: data set, the field "
                    "of a wds: sample (or the position in tuple items); default: the first present of "
                    + ", ".join(IMAGE_FIELDS) + " (the choice is printed), the first image of tuple items")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prior", required=True, help="prior spec, e.g. timm:vit_small_patch14_dinov2.lvd142m, "
                        "open_clip:ViT-B-32/laion2b_s34b_b79k, torchvision:resnet50/IMAGENET1K_V2, shipped:fashion-mnist-byol, "
                        "random:resnet18, checkpoint:<path> (`accelerate-ssl priors list`)")
    parser.add_argument("--weights", default=None, help="local weights file for the prior (wins over the zoo caches)")
    parser.add_argument("--offline", action="store_true",
                        help="never download zoo weights, use the local cache only (also: HF_HUB_OFFLINE=1)")
    parser.add_argument("--data", "--dataset", dest="data", required=True, type=data_spec, help=DATA_SPEC_HELP)
    parser.add_argument("--fraction", type=fraction_arg, default=None,
                        help="solo-learn's data.fraction, with solo:<path> (its class-stratified split of the class "
                        "folders) or solo-no-labels:<path> (its unstratified split of the folder's listing), both "
                        "train_test_split(..., random_state=42); <= 0 (its default -1) keeps every image")
    parser.add_argument("--split", default="train", help="train / test (fashion-mnist, digits), or all (digits)")
    parser.add_argument("--data-root", default=None, help="folder with the Fashion-MNIST idx files (default: system package)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N images (fashion-mnist)")
    parser.add_argument("--out", required=True, help="store folder to write (resumed if interrupted)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="images per forward of the prior (default 256 on a GPU, 32 on CPU, the faster sizes "
                             "there); it changes the rows by float rounding at most, so a run resumes with any batch size")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32",
                        help="autocast precision of the prior's forward (default fp32)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="how the rows are stored, in a store or in sidecars (default float32): float16 or bfloat16 "
                             "take half the bytes and are read back as float32; values beyond float16's range are "
                             "refused (use bfloat16)")
    parser.add_argument("--components", type=int, default=None, metavar="K",
                        help="store the rows reduced to their top K principal components, z-scored (batch PCA, ReLA "
                             "v2 Eq. 41, fitted over every row at the end): K values per row; ReLA then uses at most "
                             "K components")
    parser.add_argument("--spatial", type=_spatial_arg, default=None, metavar="K|all",
                        help="store each image's feature map instead of its pooled row (a ViT's patch tokens on their "
                             "grid, a CNN's last map), every location reduced to its top K principal components (PCA "
                             "fitted over the locations of up to %d evenly spaced images before writing), or 'all' "
                             "channels; the rows are then the maps' means, and a view's crop box can be pooled from the "
                             "map (accelerate_ssl.targets.views). Streamed data: sidecars of maps, the PCA fitted "
                             "on the first images of evenly spaced shards" % SPATIAL_FIT_IMAGES)
    parser.add_argument("--num-workers", type=int, default=None,
                        help="loader worker processes that read, digest and decode the images (default: sized from "
                             "the machine: on a GPU every CPU but two, up to 16; on a CPU only CPUs torch's threads "
                             "leave free, one per 4 at most, none for in-memory arrays); 0: a background thread of the "
                             "process reads them")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="rows per resumable chunk file")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--image-field", default=None, help=IMAGE_FIELD_HELP)
    streams = parser.add_argument_group("streamed data (wds:, hf:): one sidecar per data shard")
    streams.add_argument("--key-field", default=None, help="hf: the column naming each sample (default: the row number)")
    streams.add_argument("--shard-rows", type=int, default=10000, help="hf: rows per sidecar shard")
    streams.add_argument("--views", type=int, default=None,
                         help="k stored views per sample (view 0 the image, 1..k-1 random resized crops + flips)")
    streams.add_argument("--view-seed", type=int, default=0, help="the seed every stored view derives from")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (path, rows, dim, prior, sha256) instead of the sentence")


def _spatial_arg(text: str):
    """``--spatial``: ``all`` -> True (every channel), a positive int -> k components."""
    if text == "all":
        return True
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of components or 'all', got {text!r}")
    return k


def _command_line(args: argparse.Namespace) -> str:
    parts = ["accelerate-ssl", "precompute", "--prior", args.prior]
    if args.weights:
        parts += ["--weights", args.weights]
    parts += ["--data", args.data, "--split", args.split]
    if args.data_root:
        parts += ["--data-root", args.data_root]
    if args.limit is not None:
        parts += ["--limit", str(args.limit)]
    if args.fraction is not None:
        parts += ["--fraction", str(args.fraction)]
    parts += ["--out", args.out, "--precision", args.precision, "--chunk-size", str(args.chunk_size)]
    if args.batch_size is not None:
        parts += ["--batch-size", str(args.batch_size)]
    if args.dtype != "float32":
        parts += ["--dtype", args.dtype]
    if args.components is not None:
        parts += ["--components", str(args.components)]
    if args.spatial is not None:
        parts += ["--spatial", "all" if args.spatial is True else str(args.spatial)]
    if args.image_field is not None:
        parts += ["--image-field", args.image_field]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    from .. import backbones
    from ..priors import create_prior

    from ..data.streams import is_stream_spec

    if is_stream_spec(args.data):
        return _run_stream(args)
    try:
        dataset = open_data(args.data, args.split, root=args.data_root, limit=args.limit, fraction=args.fraction)
        overrides: dict[str, Any] = {}
        family, _, arch = args.prior.partition(":")
        if family == "random" and arch in backbones.BACKBONES:
            overrides["in_channels"] = image_channels(dataset, args.image_field)
        prior = create_prior(args.prior, weights=args.weights, offline=True if args.offline else None, **overrides)
        store = precompute_targets(prior, dataset, args.out, batch_size=args.batch_size, num_workers=args.num_workers,
                                   precision=args.precision, chunk_size=args.chunk_size,
                                   progress=not args.no_progress, command=_command_line(args), dtype=args.dtype,
                                   components=args.components, image_key=args.image_field,
                                   spatial=args.spatial or False)
    except (ValueError, FileNotFoundError, TypeError) as err:
        print(f"accelerate-ssl precompute: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"path": str(store.path), "rows": len(store), "dim": store.dim, "prior": prior.spec,
                          "precision": args.precision, "dtype": store.dtype, "components": store.components,
                          "keys": len(store.keys) if store.keys is not None else 0,
                          "spatial": store.spatial,
                          "file_sha256": store.metadata.get("file_sha256")}))
    else:
        how = "" if store.dtype == "float32" else f", stored as {store.dtype}"
        how += "" if store.components is None else f", reduced to {store.components} PCA components"
        how += "" if store.spatial is None else f", maps on a {store.grid[0]}x{store.grid[1]} grid"
        print(f"wrote {store.path}: {len(store)} rows x {store.dim} ({prior.spec}, {args.precision}{how})")
    return 0


def _run_stream(args: argparse.Namespace) -> int:
    """`accelerate-ssl precompute --data wds:... / hf:...`: sidecars (accelerate_ssl.targets.sidecar)."""
    from .. import backbones
    from ..data.streams import open_stream
    from ..data.views import StoredViews
    from ..priors import create_prior
    from .sidecar import SidecarError, precompute_sidecars

    try:
        source = open_stream(args.data, args.split, image_field=args.image_field, key_field=args.key_field,
                             shard_rows=args.shard_rows)
        overrides: dict[str, Any] = {}
        family, _, arch = args.prior.partition(":")
        if family == "random" and arch in backbones.BACKBONES:
            _, image, _ = next(source.samples(source.shards[0]))
            overrides["in_channels"] = int(image_tensor(image).shape[0])
        prior = create_prior(args.prior, weights=args.weights, offline=True if args.offline else None, **overrides)
        views = StoredViews(k=args.views, seed=args.view_seed) if args.views else None
        parts = ["accelerate-ssl", "precompute", "--prior", args.prior, "--data", args.data, "--out", args.out,
                 "--precision", args.precision, "--dtype", args.dtype]
        for flag, value in (("--batch-size", args.batch_size), ("--weights", args.weights), ("--image-field", args.image_field), ("--key-field", args.key_field),
                            ("--components", args.components), ("--views", args.views),
                            ("--spatial", "all" if args.spatial is True else args.spatial)):
            if value is not None:
                parts += [flag, str(value)]
        targets = precompute_sidecars(prior, source, args.out, batch_size=args.batch_size, precision=args.precision,
                                      dtype=args.dtype, components=args.components, views=views,
                                      progress=not args.no_progress, command=shlex.join(parts),
                                      spatial=args.spatial or False)
    except (ValueError, FileNotFoundError, TypeError, ImportError, SidecarError) as err:
        print(f"accelerate-ssl precompute: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"path": str(targets.path), "rows": len(targets), "dim": targets.dim, "prior": prior.spec,
                          "shards": len(targets.shards), "dtype": args.dtype,
                          "bytes_per_sample": targets.metadata["bytes_per_sample"],
                          **({"spatial": targets.spatial} if targets.spatial else {})}))
    else:
        grid = f" (maps on a {targets.grid[0]}x{targets.grid[1]} grid)" if targets.spatial else ""
        print(f"wrote {targets.path}: {len(targets.shards)} sidecar shard(s), {len(targets)} rows x {targets.dim}{grid} "
              f"({prior.spec}, {args.dtype})")
    return 0
