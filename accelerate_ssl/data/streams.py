"""Streamed data sets as shards of keyed samples: WebDataset tar shards (``wds:<pattern>``) and Hugging Face
``datasets`` (``hf:<path or name>``), for precompute (:mod:`accelerate_ssl.targets.sidecar`).

A :class:`StreamSource` is an ordered list of shards, each an ordered list of ``(key, image, raw)`` samples, where
``raw`` is the bytes that identify the sample's image (its per-row content digest is taken of them):

- ``wds:<pattern>``: the tar files the pattern names (braces ``{000000..000063}`` and globs ``*`` expand, in
  sorted order); a sample's key is its WebDataset ``__key__`` (the file name up to the first dot, grouped the
  way ``webdataset`` groups them); the image is the field named by ``image_field`` (default: the first of
  :data:`~.items.IMAGE_FIELDS` the sample has). ``raw`` is that field's bytes.
- ``hf:<path or name>``: a folder written by ``Dataset.save_to_disk``, a ``.parquet`` file or folder of them, or a
  data set name ``load_dataset`` resolves (``split``); the image is column ``image_field`` (default: the first of
  :data:`~.items.IMAGE_FIELDS` it has, printed), the key column ``key_field`` (default: the row number); shards are
  ``shard_rows`` consecutive rows. ``raw`` is :func:`hf_content` of the row's image cell: an ``Image`` cell's encoded
  file bytes (read from its ``path`` when only the path is stored, as ``load_dataset("imagefolder")`` stores it), or an
  array's dtype, shape and values.

:meth:`StreamSource.contents` yields ``(key, raw)`` without decoding any image (what ``store verify --data`` and
``ShardedTargets.column`` check against the digests recorded at precompute).

**Nothing is unpickled.** Only the image field is read, with PIL (wds) or Arrow (hf); every other field of a
tar sample stays bytes and is dropped. WebDataset's default decoders unpickle ``.pyd`` / ``.pickle`` fields
(a shard from the web can run code that way); use :func:`decode_images` in your pipeline instead of
``.decode()`` to decode only image fields.
"""

from __future__ import annotations

import glob
import io
import os
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from ..optional import require
from .items import IMAGE_FIELDS, announce_once

__all__ = ["StreamSource", "open_stream", "decode_images", "hf_content", "IMAGE_FIELDS", "is_stream_spec"]

STREAM_KINDS = ("wds", "hf")
DEFAULT_HF_SHARD_ROWS = 10000


def is_stream_spec(spec) -> bool:
    return isinstance(spec, str) and spec.partition(":")[0] in STREAM_KINDS and ":" in spec


def decode_image(data: bytes):
    """One image field's bytes -> a PIL image (L or RGB), fully read (the only decoder our readers use)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        im.load()
        return im.convert("RGB") if im.mode not in ("L", "RGB") else im.copy()


def decode_images(fields=IMAGE_FIELDS):
    """A ``.map`` stage for a ``webdataset`` pipeline: decodes only the image ``fields`` with PIL and leaves every
    other field as bytes (never unpickles; a safe replacement for ``.decode("pil")``)."""
    wanted = set(fields)

    def decode(sample: dict) -> dict:
        return {k: decode_image(v) if k in wanted and isinstance(v, bytes) else v for k, v in sample.items()}

    return decode


def hf_content(cell) -> bytes:
    """The bytes identifying one image cell of a Hugging Face data set, as Arrow holds it (``with_format("arrow")``):
    an ``Image`` cell's encoded bytes, or the file at its ``path`` when it holds no bytes; any other cell (an image
    stored as an array or nested lists) its dtype, shape and values. A cell naming neither bytes nor a readable file
    is refused, naming the fix."""
    if isinstance(cell, dict) and ("bytes" in cell or "path" in cell):
        if cell.get("bytes") is not None:
            return bytes(cell["bytes"])
        path = cell.get("path")
        if not path:
            raise ValueError("an image cell of the data set holds neither bytes nor a path; fix the data set's image "
                             "column.")
        try:
            return Path(path).read_bytes()
        except OSError as err:
            raise FileNotFoundError(f"the data set's image file {path!r} cannot be read ({err}): the data set stores "
                                    "its images as paths, so the files must stay where they were; restore the file "
                                    "(or save the data set with its images embedded: Dataset.save_to_disk after "
                                    "cast_column(image_field, datasets.Image()) with the bytes).") from err
    array = np.asarray(cell)
    if array.dtype == object:
        raise TypeError(f"an image cell of the data set is a {type(cell).__name__} of uneven parts, not an image or an "
                        "array; name the image column with image_field= (--image-field).")
    return f"{array.dtype.str}{array.shape}".encode() + np.ascontiguousarray(array).tobytes()


def _expand(pattern: str) -> list[str]:
    braceexpand = require("braceexpand", "wds:<shard pattern> data").braceexpand
    out: list[str] = []
    for part in braceexpand(pattern):
        part = part[len("file:"):] if part.startswith("file:") else part
        matches = sorted(glob.glob(part)) if any(c in part for c in "*?[") else [part]
        out.extend(matches)
    return out


class StreamSource:
    """Shards of keyed samples (module docstring). ``shards``: the shard names (unique, the sidecars' names);
    :meth:`samples` iterates one shard."""

    def __init__(self, spec: str, shards: list[str], kind: str, image_field: Optional[str], key_field: Optional[str],
                 paths: Optional[list[str]] = None, hf=None, shard_rows: int = DEFAULT_HF_SHARD_ROWS,
                 from_object: bool = False):
        self.spec, self.shards, self.kind = spec, shards, kind
        self.image_field, self.key_field = image_field, key_field
        self._paths = dict(zip(shards, paths)) if paths is not None else {}
        self._hf, self.shard_rows = hf, shard_rows
        self.name = spec
        self.from_object = from_object  # a datasets.Dataset given as an object: ``spec`` names it, but opens nothing

    def reopen(self) -> str:
        """This source as Python, for a recorded ``precompute_sidecars(...)`` call: its spec, or ``<Dataset ...>`` for
        a Dataset given as an object (no string opens it: the caller puts theirs there), inside ``open_stream(...)``
        with the options it was opened with when they are not the defaults (the shards and keys depend on them)."""
        what = f"<Dataset {self.spec}>" if self.from_object else repr(self.spec)
        options = []
        auto = None if self._hf is None else next((f for f in IMAGE_FIELDS if f in self._hf.column_names), None)
        if self.image_field is not None and self.image_field != auto:
            options.append(f"image_field={self.image_field!r}")
        if self.key_field is not None:
            options.append(f"key_field={self.key_field!r}")
        if self.kind == "hf" and self.shard_rows != DEFAULT_HF_SHARD_ROWS:
            options.append(f"shard_rows={self.shard_rows}")
        return f"open_stream({', '.join([what, *options])})" if options or self.from_object else what

    def describe(self) -> dict:
        return {"spec": self.spec, "kind": self.kind, "image_field": self.image_field, "key_field": self.key_field,
                "shards": len(self.shards), **({"shard_rows": self.shard_rows} if self.kind == "hf" else {})}

    def samples(self, shard: str) -> Iterator[tuple[str, object, bytes]]:
        """``(key, image, raw)`` of every sample of ``shard``, in order (``raw``: module docstring)."""
        if self.kind == "wds":
            for key, raw in self._wds_contents(shard):
                yield key, decode_image(raw), raw
        else:
            yield from self._hf_rows(shard, decode=True)

    def contents(self, shard: str) -> Iterator[tuple[str, bytes]]:
        """``(key, raw)`` of every sample of ``shard``, in order, without decoding an image."""
        if self.kind == "wds":
            yield from self._wds_contents(shard)
        else:
            for key, _, raw in self._hf_rows(shard, decode=False):
                yield key, raw

    # ---------------------------------------------------------------- WebDataset
    def _wds_contents(self, shard: str):
        tariterators = require("webdataset.tariterators", "wds:<shard pattern> data")
        path = self._paths[shard]
        with open(path, "rb") as stream:
            files = tariterators.tar_file_expander([{"url": path, "stream": stream}])
            for sample in tariterators.group_by_keys(files):
                key = sample["__key__"]
                field = self.image_field or next((f for f in IMAGE_FIELDS if f in sample), None)
                if field is None or field not in sample:
                    fields = sorted(k for k in sample if not k.startswith("__"))
                    raise ValueError(f"wds shard {shard!r}: sample {key!r} has no image field "
                                     f"{field or ' / '.join(IMAGE_FIELDS)!r} (it has {fields}); name the image field "
                                     "with --image-field (image_field=).")
                yield key, sample[field]

    # ---------------------------------------------------------------- Hugging Face datasets
    def _hf_rows(self, shard: str, decode: bool):
        """``(key, image or None, raw)`` of the rows of ``shard`` (rows ``a:b`` of the data set as it is now: its
        indices mapping, if any, followed)."""
        a, b = (int(x) for x in shard.split("-")[1:3])
        ds = self._hf
        cells = ds.with_format("arrow")
        keys = cells[a:b].column(self.key_field).to_pylist() if self.key_field else [str(i) for i in range(a, b)]
        # pixels stored as an array column (Array2D / Array3D, nested lists) come back as nested Python lists unless
        # read as numpy, in the column's own dtype (datasets' numpy format would widen uint8 to int64)
        dtype = _array_column_dtype(ds, self.image_field)
        pixels = ds.with_format("numpy", columns=[self.image_field], dtype=dtype) if dtype else ds
        for off in range(0, b - a, 256):
            lo, hi = a + off, min(a + off + 256, b)
            raws = [hf_content(c) for c in cells[lo:hi].column(self.image_field).to_pylist()]
            images = pixels[lo:hi][self.image_field] if decode else [None] * len(raws)
            for j, (image, raw) in enumerate(zip(images, raws)):
                if decode and isinstance(image, dict):  # Image(decode=False): the cell's bytes (or file)
                    image = decode_image(raw)
                elif isinstance(image, bytes):  # an encoded image in a binary column (e.g. "jpg")
                    image = decode_image(image)
                yield str(keys[off + j]), image, raw


def _array_column_dtype(ds, field: str) -> Optional[str]:
    """The element dtype of column ``field`` of a Hugging Face data set when it holds pixels as an array
    (``Array2D`` ... ``Array5D``, or a ``Sequence`` / list of lists of values), else None (an ``Image``, bytes, a file)."""
    feature = ds.features.get(field) if getattr(ds, "features", None) else None
    if type(feature).__name__.startswith("Array"):
        return feature.dtype
    nested = False
    while isinstance(feature, list) or type(feature).__name__ in ("Sequence", "List", "LargeList"):
        feature, nested = (feature[0] if isinstance(feature, list) else feature.feature), True
    return feature.dtype if nested and type(feature).__name__ == "Value" else None


def load_hf(path_or_name: str, split: str = "train"):
    """A Hugging Face ``Dataset`` from a ``save_to_disk`` folder, a parquet file / folder, or a name (``split``)."""
    datasets = require("datasets", "hf:<path or name> data")
    p = Path(path_or_name)
    if p.is_dir() and ((p / "dataset_info.json").is_file() or (p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"hf:{path_or_name} holds splits {sorted(ds)}, not {split!r}; pass --split.")
            ds = ds[split]
        return ds
    files = sorted(glob.glob(str(p / "*.parquet"))) if p.is_dir() else [str(p)] if p.suffix == ".parquet" else []
    if files:
        return datasets.load_dataset("parquet", data_files=files, split="train")
    if p.exists():
        raise ValueError(f"hf:{path_or_name} is neither a Dataset.save_to_disk folder nor parquet file(s).")
    return datasets.load_dataset(path_or_name, split=split)


def open_stream(spec, split: str = "train", *, image_field: Optional[str] = None, key_field: Optional[str] = None,
                shard_rows: int = DEFAULT_HF_SHARD_ROWS) -> StreamSource:
    """The :class:`StreamSource` of ``wds:<pattern>`` or ``hf:<path or name>``, or of a Hugging Face ``Dataset``
    object (module docstring)."""
    if not isinstance(spec, str):
        if type(spec).__module__.startswith("datasets"):
            return _hf_source(spec, getattr(spec, "info", None) and f"hf:{spec.info.dataset_name or 'dataset'}",
                              image_field, key_field, shard_rows, from_object=True)
        raise TypeError(f"open_stream takes a 'wds:<shard pattern>' / 'hf:<path>' spec or a datasets.Dataset, got "
                        f"{type(spec).__name__}.")
    kind, _, rest = spec.partition(":")
    if kind not in STREAM_KINDS or not rest:
        raise ValueError(f"{spec!r} is not a stream spec; use wds:<shard pattern> or hf:<path or name>.")
    if kind == "wds":
        require("webdataset", "wds:<shard pattern> data")
        paths = _expand(rest)
        missing = [p for p in paths if not os.path.isfile(p)]
        if not paths or missing:
            raise FileNotFoundError(f"wds:{rest} names no tar shard" + (f" that exists (e.g. {missing[0]!r})" if missing else "")
                                    + "; give local shard paths, e.g. wds:data/shard-{000000..000063}.tar.")
        names = [Path(p).name for p in paths]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"wds:{rest} names several shards called {dupes[0]!r}; sidecars are named by shard file "
                             "name, so shard names must be unique.")
        return StreamSource(spec, names, "wds", image_field, None, paths=[os.path.abspath(p) for p in paths])
    return _hf_source(load_hf(rest, split), spec, image_field, key_field, shard_rows)


def _hf_source(ds, spec, image_field, key_field, shard_rows, from_object: bool = False) -> StreamSource:
    if not hasattr(ds, "__len__"):
        raise TypeError(f"{spec}: a streaming datasets.IterableDataset has no row count to cut into sidecar shards; "
                        "precompute over the same data as a Dataset (load_dataset without streaming=True, or "
                        "save_to_disk / parquet), or as WebDataset shards (wds:<pattern>).")
    found = image_field or next((f for f in IMAGE_FIELDS if f in ds.column_names), None)
    if found not in ds.column_names:
        raise ValueError(f"{spec}: no image column {image_field or ' / '.join(IMAGE_FIELDS)!r} (columns: "
                         f"{ds.column_names}); name it with --image-field (image_field=).")
    if image_field is None:
        announce_once(("image field", spec, found), f"{spec}: the image is column {found!r} of {ds.column_names} "
                                                    "(name another with --image-field / image_field=)")
    image_field = found
    if key_field is not None and key_field not in ds.column_names:
        raise ValueError(f"{spec}: no key column {key_field!r} (columns: {ds.column_names}).")
    if not isinstance(shard_rows, int) or shard_rows < 1:
        raise ValueError(f"shard_rows must be an int >= 1, got {shard_rows!r}.")
    n = len(ds)
    shards = [f"rows-{a:09d}-{min(a + shard_rows, n):09d}" for a in range(0, n, shard_rows)]
    return StreamSource(spec, shards, "hf", image_field, key_field, hf=ds, shard_rows=shard_rows,
                        from_object=from_object)
