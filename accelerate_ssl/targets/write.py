"""The writer's parts that stores (:mod:`.precompute`) and sidecars (:mod:`.sidecar`) share: which process does what,
how an item's image is read and preprocessed, the prior's forward over a batch with its checks, and how a run's
settings are compared with an earlier run's.

- :func:`process_state`: the processes of an initialised ``torch.distributed`` group, or accelerate's ``PartialState``
  under ``accelerate launch`` (the work is sharded), else one
  process; :data:`PRECISIONS` and :func:`default_batch_size`.
- :func:`image_tensor` / :func:`check_first_item`: the image of a data set item (dict field, tuple position) as a
  tensor, refused with the fix when the prior cannot take it; :func:`input_batches`: the DataLoader a store's
  precompute reads, each batch's images preprocessed in the workers with each row's identity digest.
- :func:`embed`: one batch of preprocessed images through the prior, under the precision's autocast, checked for
  shape and NaN/Inf (the one forward both writers run).
- :func:`map_geometry`: what a spatial store or sidecar folder records of the prior's feature maps;
  :func:`check_grid` that a map lies on it; :func:`fit_map_pca` the PCA every location of those maps is reduced with.
- :func:`settings_diff`: what differs between a folder's recorded settings and a new run's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

PRECISIONS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}

#: images per prior forward when ``batch_size`` is not given. A GPU wants large batches; on CPU small ones are faster,
#: their activations staying in cache (``python benchmarks/precompute.py --sweep``, 1 thread: at 32, 0.97x the fastest
#: batch size's images/s for a 32/64/128 ConvNet at 28 px and 0.91x for a ResNet-18 at 224 px; at 256, 0.68x and 0.63x).
DEFAULT_BATCH_SIZE = {"cuda": 256, "cpu": 32}

#: images whose feature-map locations a spatial store's (or sidecar folder's) PCA is fitted on (evenly spaced)
SPATIAL_FIT_IMAGES = 256


def default_batch_size(device: torch.device) -> int:
    """:data:`DEFAULT_BATCH_SIZE` for ``device`` (CPU's for any device without an entry)."""
    return DEFAULT_BATCH_SIZE.get(torch.device(device).type, DEFAULT_BATCH_SIZE["cpu"])



def image_tensor(item: Any, image_key=None, where: str = "an item") -> torch.Tensor:
    """The image of a data set item (:func:`~accelerate_ssl.data.items.item_image`: ``image_key``, else the common
    fields of dict items, the first image of a tuple) as a tensor ``[C, H, W]`` (uint8 stays uint8); an image the
    prior cannot take is refused naming ``where``, the item's structure and the fix."""
    from ..data.items import UnreadableItemError, describe_item, item_image
    from ..priors import Preprocess

    image = item_image(item, image_key, where)
    try:
        return Preprocess.to_tensor(image)
    except (TypeError, ValueError) as err:
        raise UnreadableItemError(f"Cannot read the image of {where}: it is {describe_item(item)}; {err} Name the "
                                  "value that holds the image with image_key= / --image-field.") from None


def image_channels(dataset, image_key=None) -> int:
    """Channels of the image of ``dataset[0]`` (to build a random backbone prior that matches the data)."""
    from ..data.items import dataset_name

    return int(image_tensor(dataset[0], image_key, f"item 0 of {dataset_name(dataset)}").shape[0])


class _Images(torch.utils.data.Dataset):
    """Yields the image of each item (``image_key``, :func:`image_tensor`) as a tensor ``[C, H, W]`` (uint8 stays
    uint8: cheap to ship) and the row's identity digest (:class:`~accelerate_ssl.data.fingerprint.RowIdentity` under
    the fingerprint ``like``, written to ``identity.npy``)."""

    def __init__(self, dataset, image_key=None, like: Optional[dict] = None):
        from ..data.fingerprint import RowIdentity
        from ..data.items import dataset_name

        self.dataset, self.image_key, self.name = dataset, image_key, dataset_name(dataset)
        self.identity = RowIdentity(dataset, like=like)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        item = self.dataset[i]
        return image_tensor(item, self.image_key, f"item {i} of {self.name}"), self.identity(i, item)



def check_first_item(dataset, image_key=None):
    """Where the image of the items is (:func:`~accelerate_ssl.data.items.image_location` on item 0; a dict field
    found by default is printed once), refusing with the fix what precompute cannot read: solo-learn's
    ``(index, views, label)`` items (whose first element is the index), a list of views per item, an item without an
    image (naming the data set, the item's structure and ``image_key=``)."""
    from ..data.items import announce_image_field, dataset_name, image_location

    item = dataset[0]
    first = item[0] if isinstance(item, (tuple, list)) and item else item
    if isinstance(first, (int, np.integer)) and isinstance(item, (tuple, list)) and len(item) == 3:
        raise TypeError(f"{type(dataset).__name__} yields (index, views, label) items like solo-learn's training data "
                        "set: precompute needs the clean images in the same order. Pass "
                        "accelerate_ssl.integrations.solo_learn.precompute_dataset(train_dataset), or use "
                        "`accelerate-ssl precompute --data solo:<data.train_path>`.")
    if isinstance(first, (list, tuple)):
        raise TypeError(f"{type(dataset).__name__} yields a list of {len(first)} images per item (augmented views?); "
                        "precompute needs one clean image per sample: pass the same data set without its multi-view "
                        "transform (targets describe the unaugmented image).")
    where = f"item 0 of {dataset_name(dataset)}"
    key = image_location(item, image_key, where)
    image_tensor(item, key, where)  # an image the prior can take
    announce_image_field(dataset_name(dataset), item, key, image_key)
    return key



class _Collate:
    """Stacks images and applies the prior's preprocessing as one batched tensor op (in the loader
    workers when ``num_workers > 0``); images of different sizes are preprocessed one by one. Given a list of
    preprocessings (several priors reading one pass), the batch holds a list of tensors, one per preprocessing."""

    def __init__(self, preprocess):
        self.preprocess = preprocess

    def __call__(self, items: list[tuple[torch.Tensor, int]]) -> tuple[Any, torch.Tensor]:
        images = [im for im, _ in items]
        digests = torch.tensor([digest for _, digest in items], dtype=torch.int64)
        if isinstance(self.preprocess, (list, tuple)):
            return [preprocess_images(images, pre) for pre in self.preprocess], digests
        return preprocess_images(images, self.preprocess), digests


def preprocess_images(images: list[torch.Tensor], preprocess, where: str = "") -> torch.Tensor:
    """One batch of the prior's inputs from images of any sizes (``preprocess.batch`` each, stacked); images the
    preprocessing leaves at different sizes are refused naming the fix (``where`` says which, for a message)."""
    if all(im.shape == images[0].shape and im.dtype == images[0].dtype for im in images):
        return preprocess.batch(torch.stack(images))
    out = [preprocess.batch(im.unsqueeze(0))[0] for im in images]
    if any(o.shape != out[0].shape for o in out):
        raise ValueError(f"Images of different sizes{where} give different input sizes for this prior: create it with "
                         "size=<pixels> (e.g. create_prior(spec, size=224)) so they are resized and cropped.")
    return torch.stack(out)


class _ChunkBatches(torch.utils.data.Sampler):
    """Batches of consecutive rows that never cross a chunk boundary, over the given chunks (made as they are
    iterated: holding every row index as a Python int would cost ~80 MB per million rows)."""

    def __init__(self, chunks: list[tuple[int, int]], batch_size: int):
        self.chunks, self.batch_size = list(chunks), batch_size

    def __iter__(self):
        for a, b in self.chunks:
            for s in range(a, b, self.batch_size):
                yield list(range(s, min(s + self.batch_size, b)))

    def __len__(self):
        return sum(-(-(b - a) // self.batch_size) for a, b in self.chunks)


def resolve_preprocess(prior, dataset):
    pre = prior.preprocess
    if pre.stats == "default" and getattr(dataset, "mean", None) is not None and getattr(dataset, "std", None) is not None:
        pre = pre.with_stats(list(dataset.mean), list(dataset.std), "dataset")
    return pre


class _OneProcess:
    """The part of accelerate's ``PartialState`` precompute uses, for a plain single-process run."""

    process_index, num_processes, is_main_process = 0, 1, True

    def __init__(self):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def wait_for_everyone(self) -> None:
        pass


class _ProcessGroup:
    """The same, for the processes of an initialised ``torch.distributed`` group (Lightning's DDP, ``torchrun``, an
    ``Accelerator`` already created): each process its rank's share, a barrier of the group."""

    def __init__(self):
        import torch.distributed as dist

        self.process_index, self.num_processes = dist.get_rank(), dist.get_world_size()
        self.is_main_process = self.process_index == 0
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def wait_for_everyone(self) -> None:
        import torch.distributed as dist

        dist.barrier()


def process_state():
    """The processes that share a precompute: those of an initialised ``torch.distributed`` group when there is one
    (Lightning's DDP, ``torchrun`` after ``init_process_group``, an ``Accelerator`` made earlier); else accelerate's
    ``PartialState`` when accelerate is installed (so ``accelerate launch`` shards the work); else a single process.
    Several processes with neither are refused with the fix."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return _ProcessGroup()
    try:
        from accelerate import PartialState
    except ImportError:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from ..optional import require

            require("accelerate", "precompute in several processes (or call torch.distributed.init_process_group first)")
        return _OneProcess()
    # cpu=True when there is no GPU: `accelerate launch --multi_gpu` then still runs gloo CPU processes
    # (accelerate would otherwise see no GPU and treat every process as a lone one).
    return PartialState(cpu=not torch.cuda.is_available())



def input_batches(dataset, preprocess, batch_size: int, num_workers: int = 0, pin_memory: bool = False,
                  ranges: Optional[list[tuple[int, int]]] = None, image_key=None,
                  fingerprint: Optional[dict] = None) -> torch.utils.data.DataLoader:
    """The loader precompute reads: ``(images preprocessed for the prior, each row's identity digest)`` batches over
    the rows ``[a, b)`` of each of ``ranges`` (default: every row), a batch never crossing a range; the images are
    stacked and preprocessed in the loader workers. ``preprocess`` may be a list (several priors in one pass): each
    batch's images are read once and preprocessed once per entry, ``([tensor per entry], digests)``. ``image_key``: where each item's image is; ``fingerprint``: the
    data set's, whose definition the identity digests follow. (``benchmarks/gpu.py`` times it alone.)"""
    return torch.utils.data.DataLoader(
        _Images(dataset, image_key, fingerprint), batch_sampler=_ChunkBatches(ranges or [(0, len(dataset))], batch_size),
        num_workers=num_workers, collate_fn=_Collate(preprocess), pin_memory=pin_memory, persistent_workers=False,
    )



def sample_batches(dataset, preprocess, rows, batch_size: int, image_key=None):
    """The images of ``dataset``'s items ``rows`` (any order, not contiguous), preprocessed, ``batch_size`` at a time
    (the sample a spatial store's PCA is fitted on)."""
    from ..data.items import dataset_name

    collate, name = _Collate(preprocess), dataset_name(dataset)
    for a in range(0, len(rows), batch_size):
        images = [image_tensor(dataset[int(i)], image_key, f"item {int(i)} of {name}") for i in rows[a : a + batch_size]]
        yield collate([(im, 0) for im in images])[0]


def check_spatial(spatial) -> None:
    """``spatial=`` is False, True (the whole map) or an int k >= 1 (each location reduced to k components)."""
    if not (spatial is None or isinstance(spatial, bool) or (isinstance(spatial, int) and spatial >= 1)):
        raise ValueError(f"spatial must be False, True (the whole feature map) or an int k >= 1 (each location reduced "
                         f"to k PCA components), got {spatial!r}.")


def map_geometry(prior, x: torch.Tensor, spatial, n: int) -> dict:
    """What a spatial store (or sidecar folder) records of its maps, read off the prior's map of ``x`` (one
    preprocessed image, ``[1, C, H, W]``): ``grid`` ``[h, w]``, ``stride`` (input pixels per cell), ``input_size``
    ``[H, W]`` (the preprocessed image), the prior's ``source_channels`` and the stored ``channels``, ``layout``
    (``"hwc"``), ``reduction`` (``"pca"`` with its ``fit_images``, at most :data:`SPATIAL_FIT_IMAGES` of the ``n``
    images, or ``"none"``); ``components`` = k for a reduced map."""
    device = next((p.device for p in prior.parameters()), None) if hasattr(prior, "parameters") else None
    try:
        stride = int(prior.map_stride)
        with torch.inference_mode():
            fmap = prior.feature_map(x if device is None else x.to(device))
    except (ValueError, AttributeError) as err:
        raise ValueError(f"Prior {prior.spec}: {err}") from None
    _, channels, h, w = fmap.shape
    geometry = {"grid": [int(h), int(w)], "stride": stride, "input_size": [int(x.shape[-2]), int(x.shape[-1])],
                "source_channels": int(channels), "layout": "hwc"}
    if spatial is True:
        return {**geometry, "channels": int(channels), "reduction": "none"}
    if spatial >= channels:
        raise ValueError(f"spatial={spatial} components but the prior's map has {channels} channels: pass k < "
                         f"{channels}, or spatial=True to keep every channel.")
    fit = min(n, SPATIAL_FIT_IMAGES)
    if fit * h * w < 2:
        raise ValueError(f"The map's PCA needs at least 2 locations; {fit} item(s) of a {h}x{w} map give {fit * h * w}.")
    return {**geometry, "channels": int(spatial), "reduction": "pca", "fit_images": fit, "components": int(spatial)}


def check_grid(maps: torch.Tensor, geometry: dict, where: str) -> None:
    """Maps (``[B, h, w, C]``, as :func:`embed` returns them) on the grid :func:`map_geometry` read off the first
    image, or the error naming the fix (images of different sizes under a prior that keeps their size)."""
    if list(maps.shape[1:3]) != list(geometry["grid"]):
        raise ValueError(f"spatial=: the prior's map of {where} is {maps.shape[1]}x{maps.shape[2]} but the first image "
                         f"gave {geometry['grid'][0]}x{geometry['grid'][1]}: images of different sizes give different "
                         "input sizes for this prior: create it with size=<pixels> (e.g. create_prior(spec, size=224)) "
                         "so they are resized and cropped.")


def fit_map_pca(prior, batches, geometry: dict, precision: str, device, where: str):
    """The PCA every location of a spatial target's maps is reduced with (Eq. 41, z-scored columns, ``geometry``'s
    ``channels`` components): fitted over every location of the prior's maps of the preprocessed ``batches`` (each map
    checked to lie on the recorded grid); ``where`` names them in messages."""
    from .pca import TargetPCA

    maps = []
    for x in batches:
        out = embed(prior, x, precision, device, lambda bad: f"{where}: rows {bad}", spatial=True)
        check_grid(out, geometry, where)
        maps.append(out.reshape(-1, out.shape[-1]).cpu())
    return TargetPCA.fit(torch.cat(maps), geometry["channels"], standardize=True)


def settings_diff(path: Path, old: dict, new: dict, finished: bool) -> str:
    """Which settings differ, down to the leaf keys, with the stored and the requested value of each."""

    def leaves(a, b, prefix):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                yield from leaves(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else str(k))
        elif a != b:
            yield f"{prefix}: {_short(a)} in the store vs {_short(b)} now"

    differ = list(leaves(old, new, ""))
    what = "a finished store" if finished else "an unfinished precompute"
    return (f"{str(path)!r} holds {what} with other settings ({'; '.join(differ[:6])}{'; ...' if len(differ) > 6 else ''}). "
            f"Use another --out / path, or delete {str(path)!r} to recompute it.")


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def embed(prior, x: torch.Tensor, precision: str, device: torch.device,
          where: Callable[[list[int]], str] = lambda rows: f"rows {rows}", spatial: bool = False) -> torch.Tensor:
    """``prior(x)`` for one batch of preprocessed images, in inference mode (under ``precision``'s autocast), as float32
    rows ``[B, prior.output_dim]`` on ``device``; ``spatial=True``: the prior's feature map instead
    (:meth:`~accelerate_ssl.priors.Prior.feature_map`), channels last, ``[B, h, w, C]``. A wrong output shape or
    NaN/Inf rows are refused, ``where(positions)`` naming those rows for the message (dataset indices, keys)."""
    amp = PRECISIONS[precision]
    x = x.to(device, non_blocking=True)
    forward = prior.feature_map if spatial else prior
    with torch.inference_mode():
        if amp is None:
            out = forward(x)
        else:
            with torch.autocast(device_type=torch.device(device).type, dtype=amp):
                out = forward(x)
    out = out.float()
    if spatial:
        if out.ndim != 4 or out.shape[0] != x.shape[0]:
            raise ValueError(f"Prior {prior.spec} returned a feature map of shape {tuple(out.shape)}, expected "
                             f"({x.shape[0]}, C, h, w).")
        out = out.permute(0, 2, 3, 1).contiguous()
    else:
        dim = int(prior.output_dim)
        if out.shape != (x.shape[0], dim):
            raise ValueError(f"Prior {prior.spec} returned shape {tuple(out.shape)}, expected ({x.shape[0]}, {dim}); "
                             "its output_dim is wrong.")
    bad = (~torch.isfinite(out).flatten(1).all(dim=1)).nonzero().flatten()
    if len(bad):
        cause = ("fp16 overflow is the usual cause: rerun with --precision bf16 or fp32" if precision == "fp16" else
                 "check the prior's weights and these samples")
        raise ValueError(f"Prior {prior.spec} gave NaN/Inf features for {len(bad)} row(s), e.g. "
                         f"{where([int(i) for i in bad[:10]])} ({precision}); {cause}. Nothing was written for them.")
    return out
