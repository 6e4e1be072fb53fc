"""The writer's parts that stores (:mod:`.precompute`) and sidecars (:mod:`.sidecar`) share: which process does what,
how an item's image is read, decoded and preprocessed, the prior's forward over a batch with its checks, and how a
run's settings are compared with an earlier run's.

- :func:`process_state`: the processes of an initialised ``torch.distributed`` group, or accelerate's ``PartialState``
  under ``accelerate launch`` (the work is sharded), else one
  process; :data:`PRECISIONS` and :func:`default_batch_size`.
- :func:`image_tensor` / :func:`check_first_item`: the image of a data set item (dict field, tuple position) as a
  tensor, refused with the fix when the prior cannot take it.
- **The input pipeline** a store's precompute reads (each stage where it is cheapest):

  1. :func:`input_batches`, the loader (:class:`_Images`, workers sized from the machine by :func:`loader_workers` /
     :func:`loader_prefetch`): each item read once with its row identity digest and the digest of the bytes it was
     read from (:func:`direct_source`: a folder's files read and digested by the pipeline itself, JPEGs decoded by
     ``torchvision.io`` (:func:`decode_file`, PIL the fallback) or, for a GPU, left encoded; an in-memory array's batch
     read as one block; anything else as ``dataset[i]``), no float work; batches stay uint8 (:class:`Packed` when
     their images differ in size), pinned for a GPU;
  2. :func:`prior_batches`, the staging thread: each batch copied to the prior's device, its JPEGs decoded there
     (:func:`decode_on`, nvJPEG on a GPU) and the prior's own preprocessing run there, batched, in the precision's
     dtype (:func:`preprocess_images`, ``Preprocess.batch``), up to :data:`STAGED_BATCHES` ahead of the forward;
  3. :func:`forward_rows`, the forward: queued with its NaN/Inf flags and a non-blocking copy of the rows to pinned
     memory (:class:`PendingRows`), so the next batch's forward is queued before this one is waited for;
     :func:`embed` is the same, waited for (the sidecars' pass, the map PCA's fit).
- :func:`map_geometry`: what a spatial store or sidecar folder records of the prior's feature maps;
  :func:`check_grid` that a map lies on it; :func:`fit_map_pca` the PCA every location of those maps is reduced with.
- :func:`settings_diff`: what differs between a folder's recorded settings and a new run's.
"""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import torch

from ..data.fingerprint import read_file

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


# ---------------------------------------------------------------------------------------------- reading and decoding
#: JPEG frames torchvision.io decodes as PIL does (libjpeg-turbo both): Huffman-coded baseline, extended, progressive
_JPEG_FRAMES = (0xC0, 0xC1, 0xC2)


def jpeg_frame(data) -> Optional[tuple[int, bool]]:
    """``(components, adobe)`` of a JPEG's frame when ``data`` is a Huffman-coded 8-bit JPEG with 1 or 3 components
    (``adobe``: it carries an Adobe APP14 marker, whose colour transform only libjpeg is trusted with); None for any
    other file (PNG, CMYK, 12-bit, arithmetic-coded, truncated headers), which PIL decodes."""
    if len(data) < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    i, adobe = 2, False
    while i + 9 < len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        if marker == 0xEE and bytes(data[i + 4 : i + 9]) == b"Adobe":
            adobe = True
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a start of frame
            precision, components = data[i + 4], data[i + 9]
            ok = marker in _JPEG_FRAMES and precision == 8 and components in (1, 3)
            return (int(components), adobe) if ok else None
        if marker == 0xDA:  # a scan before any frame: not a JPEG we read
            return None
        i += 2 + ((data[i + 2] << 8) | data[i + 3])
    return None


def decode_file(data: bytearray, keep_jpeg: bool = False, where: str = "a file") -> torch.Tensor:
    """A file's bytes as the image ``PIL.Image.open(file).convert("RGB")`` gives (what torchvision's ImageFolder and
    :class:`~accelerate_ssl.data.datasets.ImageFiles` read), uint8 ``[3, H, W]``: JPEGs of :func:`jpeg_frame` through
    ``torchvision.io.decode_jpeg`` (the same libjpeg-turbo decode, bit for bit, at about 1.6x PIL's speed), anything
    else through PIL. ``keep_jpeg=True``: such a JPEG (without an Adobe marker) is returned undecoded, its bytes as a
    1-D uint8 tensor, for :func:`preprocess_images` to decode on the GPU in one batched call."""
    from torchvision.io import ImageReadMode, decode_jpeg

    frame = jpeg_frame(data)
    if frame is not None:
        encoded = torch.frombuffer(data, dtype=torch.uint8)
        if keep_jpeg and not frame[1]:
            return encoded
        try:
            return decode_jpeg(encoded, mode=ImageReadMode.RGB)
        except RuntimeError:
            pass  # PIL decodes it, or names what is wrong with it
    import io

    from PIL import Image

    from ..data.items import UnreadableItemError
    from ..priors import Preprocess

    try:
        with Image.open(io.BytesIO(data)) as im:
            image = im.convert("RGB")
    except Exception as err:  # noqa: BLE001 - PIL raises many kinds for a broken file
        raise UnreadableItemError(f"Cannot decode {where}: {type(err).__name__}: {err}. Replace or remove the file "
                                  "(the data set lists it, so training would fail on it too).") from None
    return Preprocess.to_tensor(image)


def decode_on(images: list, device: torch.device) -> list:
    """A batch's images (uint8 ``[C, H, W]``, or JPEG bytes :func:`decode_file` kept) as uint8 images on ``device``:
    the kept JPEGs decoded there in one ``torchvision.io.decode_jpeg`` call (nvJPEG on a GPU), the others copied."""
    device = torch.device(device)
    out = list(images)
    kept = [j for j, im in enumerate(images) if im.ndim == 1]
    if kept:
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            decoded = decode_jpeg([images[j] for j in kept], mode=ImageReadMode.RGB, device=device)
        except RuntimeError:  # a file nvJPEG refuses: the CPU decoder (or PIL, naming it) for this batch
            decoded = [decode_file(bytearray(images[j].numpy().tobytes()), where=f"image {j} of a batch") for j in kept]
        for j, image in zip(kept, decoded):
            out[j] = image
    return [im.to(device, non_blocking=True) for im in out]


class _Direct:
    """Where item i's image is read without ``dataset[i]`` (:func:`direct_source`): ``kind`` ``"files"`` (``store``
    the data set's ``(path, label)`` list) or ``"array"`` (``store`` its array of images); ``rows`` maps positions to
    them through Subsets (None: position = row)."""

    def __init__(self, kind: str, store, rows: Optional[np.ndarray]):
        self.kind, self.store, self.rows = kind, store, rows

    def row(self, i: int) -> int:
        return int(i if self.rows is None else self.rows[i])

    def path(self, i: int) -> str:
        return self.store[self.row(i)][0]

    def block(self, positions: list[int]) -> torch.Tensor:
        """The images of ``positions`` as one tensor ``[B, C, H, W]`` in the layout :meth:`Preprocess.to_tensor
        <accelerate_ssl.priors.Preprocess.to_tensor>` gives each (uint8 stays uint8), a copy of those rows only."""
        rows = [self.row(i) for i in positions]
        data = self.store
        if rows == list(range(rows[0], rows[0] + len(rows))):
            x = data[rows[0] : rows[0] + len(rows)]
        else:
            x = data[np.asarray(rows)] if isinstance(data, np.ndarray) else data[torch.as_tensor(rows)]
        x = torch.from_numpy(np.array(x)) if isinstance(x, np.ndarray) else x.clone()
        if x.ndim == 3:
            x = x.unsqueeze(1)
        elif x.ndim == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):  # HWC rows -> CHW
            x = x.permute(0, 3, 1, 2)
        return x.contiguous()


def direct_source(dataset, image_key=None) -> Optional[_Direct]:
    """How the precompute reads item i's image itself, where the data set's own ``__getitem__`` is known to give
    exactly that (transform-free, under any ``Subset`` s): the file ``samples[i][0]`` opened with PIL and converted to
    RGB (torchvision's ``ImageFolder`` / ``DatasetFolder`` with its default loader,
    :class:`~accelerate_ssl.data.datasets.ImageFiles`), each file's bytes then read once, digested and decoded
    (:func:`decode_file`); or row i of an in-memory array (the ``.data`` of
    :class:`~accelerate_ssl.data.datasets.ArrayImageDataset` and of torchvision's MNIST and CIFAR families, a
    ``TensorDataset``'s first tensor), a batch then read as one block. The first item read that way must equal the
    item ``dataset`` gives, else (and for any other data set) None: items are read as ``dataset[i]``."""
    from torch.utils.data import Subset, TensorDataset

    from ..data.datasets import ArrayImageDataset, ImageFiles
    from ..data.items import dataset_name, is_image, unchanged

    if image_key not in (None, 0) or len(dataset) == 0:
        return None
    chain, base = [], dataset
    while isinstance(base, Subset):
        chain.append(np.asarray(base.indices, dtype=np.int64))
        base = base.dataset
    if getattr(base, "transform", None) not in (None, unchanged):  # (clean_view's identity, when None cannot do)
        return None
    rows = None
    for indices in reversed(chain):  # innermost first: position -> row of the base data set
        rows = indices if rows is None else rows[indices]

    def own(kind) -> bool:  # the class's __getitem__ is the known one (a subclass may override it)
        return isinstance(base, kind) and type(base).__getitem__ is kind.__getitem__

    folder, array = own(ImageFiles), own(ArrayImageDataset)
    if type(base).__module__.split(".")[0] == "torchvision":  # (imported already, then: nothing more to import)
        import torchvision
        from torchvision.datasets import CIFAR10, MNIST, DatasetFolder
        from torchvision.datasets.folder import default_loader, pil_loader

        folder = (own(DatasetFolder) and getattr(base, "loader", None) in (default_loader, pil_loader)
                  and torchvision.get_image_backend() == "PIL")
        array = own(MNIST) or own(CIFAR10)
    direct = None
    if folder and isinstance(getattr(base, "samples", None), list):
        direct = _Direct("files", base.samples, rows)
    elif array and isinstance(getattr(base, "data", None), (torch.Tensor, np.ndarray)) and len(base.data) == len(base):
        direct = _Direct("array", base.data, rows)
    elif own(TensorDataset) and base.tensors and is_image(base.tensors[0][0]):
        direct = _Direct("array", base.tensors[0], rows)
    if direct is None:
        return None
    if direct.kind == "files":
        mine = decode_file(read_file(direct.path(0))[0], where=repr(direct.path(0)))
    else:
        mine = direct.block([0])[0]
    theirs = image_tensor(dataset[0], image_key, f"item 0 of {dataset_name(dataset)}")
    same = mine.shape == theirs.shape and mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    return direct if same else None


#: the file record of an item that is not a file (an array row, a ``dataset[i]`` item): none
NO_RECORD = torch.empty(0, dtype=torch.int64)


class _Block(tuple):
    """A batch an array source read as one block: ``(images [B, C, H, W], row digests, file records [B, 0])``."""


class _Images(torch.utils.data.Dataset):
    """Item i as ``(image, row digest, file record)``: the image uint8 ``[C, H, W]`` (any other dtype as the item
    holds it; ``keep_jpeg``: a JPEG file's bytes, decoded on the GPU by :func:`preprocess_images`); the row digest
    (:class:`~accelerate_ssl.data.fingerprint.RowIdentity` under the fingerprint ``like``, written to
    ``identity.npy``); for a folder's file, its record (size, modification time, digest of its bytes:
    :func:`~accelerate_ssl.data.fingerprint.read_file`, written to ``contents.npy``), from the one read whose bytes are
    decoded, :data:`NO_RECORD` for any other item. Read as :func:`direct_source` says: a folder's file once; an
    in-memory array's batch as one block (:meth:`__getitems__`). Any other item is read as ``dataset[i]``.
    No float work here: the prior's preprocessing runs batched, on its device."""

    def __init__(self, dataset, image_key=None, like: Optional[dict] = None, keep_jpeg: bool = False):
        from ..data.fingerprint import RowIdentity
        from ..data.items import dataset_name

        self.dataset, self.image_key, self.name = dataset, image_key, dataset_name(dataset)
        self.identity = RowIdentity(dataset, like=like)
        self.direct = direct_source(dataset, image_key)
        self.keep_jpeg = keep_jpeg

    @property
    def reads(self) -> str:
        """``"files"``, ``"array"`` or ``"items"`` (``dataset[i]``)."""
        return "items" if self.direct is None else self.direct.kind

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        if self.reads == "files":
            path = self.direct.path(i)
            data, record = read_file(path)
            return (decode_file(data, self.keep_jpeg, f"item {i} of {self.name} ({path})"), self.identity(i),
                    torch.from_numpy(record))
        if self.reads == "array":
            return self.direct.block([i])[0], self.identity(i), NO_RECORD
        item = self.dataset[i]
        return image_tensor(item, self.image_key, f"item {i} of {self.name}"), self.identity(i, item), NO_RECORD

    def __getitems__(self, positions: list[int]):
        """A batch (the DataLoader's batched read): an array's rows as one :class:`_Block`, else item by item."""
        if self.reads != "array":
            return [self[i] for i in positions]
        rows = torch.tensor([self.identity(i) for i in positions], dtype=torch.int64)
        return _Block((self.direct.block(positions), rows, NO_RECORD.expand(len(positions), 0)))


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
                        "`accelerate-ssl precompute --prior SPEC --data solo:<data.train_path> --out DIR`.")
    if isinstance(first, (list, tuple)):
        raise TypeError(f"{type(dataset).__name__} yields a list of {len(first)} images per item (augmented views?); "
                        "precompute needs one clean image per sample: pass the same data set without its multi-view "
                        "transform (targets describe the unaugmented image).")
    where = f"item 0 of {dataset_name(dataset)}"
    key = image_location(item, image_key, where)
    image_tensor(item, key, where)  # an image the prior can take
    announce_image_field(dataset_name(dataset), item, key, image_key)
    return key



class Packed(NamedTuple):
    """A batch's uint8 images of several shapes (decoded ``[C, H, W]``, or a JPEG's bytes ``[n]``) in one flat
    buffer: one shared-memory hand-over from a loader worker and one pinned copy to the device, instead of one of each
    per image (which cost more than the decode on a 2-core machine)."""

    data: torch.Tensor
    shapes: list

    @classmethod
    def of(cls, images: list) -> "Packed":
        return cls(torch.cat([im.reshape(-1) for im in images]), [tuple(im.shape) for im in images])

    def images(self, device=None) -> list:
        """The images as views of the buffer; decoded ones on ``device`` (the buffer copied there once), JPEG bytes
        where the buffer is (the decoder reads them from the host)."""
        here = self.data
        if device is not None and torch.device(device) != here.device and any(len(s) == 3 for s in self.shapes):
            here = here.to(device, non_blocking=True)
        out, start = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            out.append((here if len(shape) == 3 else self.data)[start : start + n].view(*shape))
            start += n
        return out


class _Collate:
    """A batch of :class:`_Images` items as ``(images, row digests, file records)``: images of one shape and dtype
    stacked into one block, uint8 images of several shapes (and JPEG bytes) :class:`Packed` into one buffer, else
    (float images of several shapes) the list of them."""

    def __call__(self, items) -> tuple[Any, torch.Tensor, torch.Tensor]:
        if isinstance(items, _Block):
            return tuple(items)
        images = [im for im, _, _ in items]
        rows = torch.tensor([r for _, r, _ in items], dtype=torch.int64)
        content = torch.stack([c for _, _, c in items])
        first = images[0]
        if first.ndim == 3 and all(im.shape == first.shape and im.dtype == first.dtype for im in images):
            return torch.stack(images), rows, content
        if all(im.dtype == torch.uint8 for im in images):
            return Packed.of(images), rows, content
        return images, rows, content


def preprocess_images(images, preprocess, where: str = "", device=None, dtype: Optional[torch.dtype] = None):
    """One batch of the prior's inputs on ``device`` (default: the images'), from a batch as the loader yields it
    (a stacked ``[B, C, H, W]`` tensor, a :class:`Packed` batch, or a list of images of any sizes and kept JPEGs): the
    images cross to the device as they are (uint8), JPEGs are decoded there (:func:`decode_on`), and
    ``preprocess.batch`` runs there, once per group of images of one size, returning ``dtype``. ``preprocess`` may be
    a list (several priors reading one pass): the images cross and are decoded once, and a list of inputs is returned,
    one per entry. Images the preprocessing leaves at different sizes are refused naming the fix (``where`` says
    which, for a message)."""
    pres = list(preprocess) if isinstance(preprocess, (list, tuple)) else [preprocess]
    if isinstance(images, torch.Tensor):
        x = images.to(images.device if device is None else device, non_blocking=True)
        outs = [pre.batch(x, dtype) for pre in pres]
    else:
        if isinstance(images, Packed):
            device = images.data.device if device is None else device
            images = images.images(device)
        images = decode_on(images, images[0].device if device is None else device)
        groups: dict[tuple, list[int]] = {}
        for j, im in enumerate(images):
            groups.setdefault((tuple(im.shape), im.dtype), []).append(j)
        outs = [_grouped(images, groups, pre, dtype, where) for pre in pres]
    return outs if isinstance(preprocess, (list, tuple)) else outs[0]


def _grouped(images: list, groups: dict, pre, dtype, where: str) -> torch.Tensor:
    """``pre.batch`` of each group of same-shape images, put back in the batch's order."""
    if len(groups) == 1:
        return pre.batch(torch.stack(images), dtype)
    parts = [(idx, pre.batch(torch.stack([images[j] for j in idx]), dtype)) for idx in groups.values()]
    if len({tuple(p.shape[1:]) for _, p in parts}) > 1:
        raise ValueError(f"Images of different sizes{where} give different input sizes for this prior: create it with "
                         "size=<pixels> (e.g. create_prior(spec, size=224)) so they are resized and cropped.")
    out = parts[0][1].new_empty((len(images), *parts[0][1].shape[1:]))
    for idx, p in parts:
        out.index_copy_(0, torch.tensor(idx).to(out.device, non_blocking=True), p)
    return out


class _ChunkBatches(torch.utils.data.Sampler):
    """Batches of consecutive rows that never cross a chunk boundary, over the given chunks (made as they are
    iterated: holding every row index as a Python int would cost ~80 MB per million rows)."""

    def __init__(self, chunks: list[tuple[int, int]], batch_size: int):
        self.chunks, self.batch_size = list(chunks), batch_size

    def spans(self):
        """``(chunk position, first row, end row)`` of each batch, in the order the batches come."""
        for c, (a, b) in enumerate(self.chunks):
            for s in range(a, b, self.batch_size):
                yield c, s, min(s + self.batch_size, b)

    def __iter__(self):
        for _, s, e in self.spans():
            yield list(range(s, e))

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



#: loader workers at most, whatever the machine (each holds its batches in shared memory)
MAX_WORKERS = 16


def loader_workers(device, batches: int, reads: str = "items") -> int:
    """Loader worker processes sized from the machine: the CPUs this process may use (its share when several
    processes of a launch share the machine, ``LOCAL_WORLD_SIZE``), less the one of :func:`prior_batches`' staging
    thread, which reads the batches itself when there are no workers, and less the forward's: on a GPU the one thread
    driving it (so 14 workers on 16 CPUs, up to :data:`MAX_WORKERS`); on a CPU torch's threads, one worker per 4 CPUs
    at most. None for an in-memory array on a CPU (``reads="array"``: a batch is one memory copy and a small digest
    per row, which the staging thread does at less cost than a worker's hand-over), and none for fewer than 4
    batches, whose start-up would cost more than it saves."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cpus //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    cuda = torch.device(device).type == "cuda"
    if batches < 4 or (reads == "array" and not cuda):
        return 0
    spare = cpus - 1 - (1 if cuda else torch.get_num_threads())
    return int(max(0, min(spare, MAX_WORKERS if cuda else cpus // 4, batches)))


def _shared_memory_bytes() -> Optional[int]:
    """Free bytes of ``/dev/shm``, where workers hand their batches over (None: not there to measure)."""
    import shutil

    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return None


def loader_prefetch(workers: int, batch_bytes: int) -> tuple[int, int]:
    """``(workers, prefetch_factor)`` that fit in half the free shared memory: up to 4 batches ahead per worker (2,
    torch's default, when the machine does not say), fewer workers when not even one batch each fits."""
    free = _shared_memory_bytes()
    if not workers:
        return 0, 0
    if free is None:
        return workers, 2
    fit = int(free // 2 // max(1, batch_bytes))
    workers = max(1, min(workers, fit)) if fit else 0
    return (workers, max(1, min(4, fit // workers))) if workers else (0, 0)


def input_batches(dataset, batch_size: int, num_workers: Optional[int] = None, device="cpu",
                  ranges: Optional[list[tuple[int, int]]] = None, image_key=None,
                  fingerprint: Optional[dict] = None) -> torch.utils.data.DataLoader:
    """The loader precompute reads: ``(images, row digests, file records)`` batches (:class:`_Images`,
    :class:`_Collate`) over the rows ``[a, b)`` of each of ``ranges`` (default: every row), a batch never crossing a
    range. The workers read, digest and decode; the images stay uint8, pinned for a GPU ``device``, where JPEG files
    are left for it to decode. ``num_workers``: None sizes them from the machine (:func:`loader_workers`,
    :func:`loader_prefetch`). ``image_key``: where each item's image is; ``fingerprint``: the data set's, whose
    definition the row digests follow. :func:`prior_batches` turns the batches into the prior's inputs."""
    device = torch.device(device)
    sampler = _ChunkBatches(ranges or [(0, len(dataset))], batch_size)
    images = _Images(dataset, image_key, fingerprint, keep_jpeg=device.type == "cuda")
    workers = loader_workers(device, len(sampler), images.reads) if num_workers is None else num_workers
    prefetch = 2
    if workers and num_workers is None:
        probe = images[next(sampler.spans())[1]][0]
        workers, prefetch = loader_prefetch(workers, probe.numel() * probe.element_size() * batch_size)
    return torch.utils.data.DataLoader(
        images, batch_sampler=sampler, num_workers=workers, collate_fn=_Collate(), pin_memory=device.type == "cuda",
        prefetch_factor=prefetch if workers else None, persistent_workers=False,
    )


#: batches the staging thread of :func:`prior_batches` keeps ready ahead of the forward
STAGED_BATCHES = 2


def prior_batches(loader, preprocess, device, dtype: Optional[torch.dtype] = None):
    """The loader's batches as ``(inputs, row digests, file records)``, the inputs the prior's on ``device``
    (:func:`preprocess_images`, one per entry when ``preprocess`` is a list), staged by a background thread up to
    :data:`STAGED_BATCHES` batches ahead of the consumer: while the forward of batch k runs, the thread takes batch
    k+1 from the loader, copies it to the device, decodes and preprocesses it there (on a GPU on a side stream, which
    the consumer's stream then waits for; on a CPU on another core: torch's kernels run outside the GIL). An error in
    the thread is raised in the consumer; the thread stops when the consumer does."""
    import queue
    import threading

    device = torch.device(device)
    batches = iter(loader)  # made here: the loader's workers are started from the calling thread
    staged: queue.Queue = queue.Queue(maxsize=STAGED_BATCHES)
    stop = threading.Event()
    end = object()

    def hand_over(item) -> bool:
        while not stop.is_set():
            try:
                staged.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def stage() -> None:
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        try:
            for images, rows, content in batches:
                if side is None:
                    item = (preprocess_images(images, preprocess, device=device, dtype=dtype), rows, content, None)
                else:
                    with torch.cuda.stream(side):
                        xs = preprocess_images(images, preprocess, device=device, dtype=dtype)
                        done = torch.cuda.Event()
                        done.record(side)
                    item = (xs, rows, content, done)
                if not hand_over(item):
                    return
        except BaseException as err:  # noqa: BLE001 - raised again in the consumer's thread
            hand_over(err)
            return
        hand_over(end)

    thread = threading.Thread(target=stage, name="precompute-stage", daemon=True)
    thread.start()
    try:
        while True:
            item = staged.get()
            if item is end:
                return
            if isinstance(item, BaseException):
                raise item
            yield _on_current_stream(*item, device)
    finally:
        stop.set()
        thread.join()


def _on_current_stream(xs, rows, content, done, device):
    """A staged batch, handed to the current stream: it waits for the side stream's work, and the allocator keeps the
    inputs' memory until the current stream is done with them."""
    if done is not None:
        current = torch.cuda.current_stream(device)
        current.wait_event(done)
        for x in xs if isinstance(xs, list) else [xs]:
            x.record_stream(current)
    return xs, rows, content


def sample_batches(dataset, preprocess, rows, batch_size: int, image_key=None, device=None):
    """The images of ``dataset``'s items ``rows`` (any order, not contiguous), preprocessed on ``device`` (default
    CPU), ``batch_size`` at a time (the sample a spatial store's PCA is fitted on)."""
    from ..data.items import dataset_name

    collate, name = _Collate(), dataset_name(dataset)
    for a in range(0, len(rows), batch_size):
        images = [image_tensor(dataset[int(i)], image_key, f"item {int(i)} of {name}") for i in rows[a : a + batch_size]]
        yield preprocess_images(collate([(im, 0, NO_RECORD) for im in images])[0], preprocess, device=device)


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
            f"Use another --out / path, or replace it with this computation: `rm -r {shlex.quote(str(path))}`, then run "
            "this precompute again.")


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class PendingRows:
    """A batch's rows on their way to the host (:func:`forward_rows`): the forward and a non-blocking copy into pinned
    memory are queued; :meth:`result` waits for them, refuses NaN/Inf rows and returns the float32 rows on the CPU."""

    def __init__(self, prior, out: torch.Tensor, finite: torch.Tensor, precision: str):
        self.spec, self.precision = prior.spec, precision
        self.event = None
        if out.device.type == "cuda":
            self.rows = torch.empty(out.shape, dtype=out.dtype, pin_memory=True).copy_(out, non_blocking=True)
            self.finite = torch.empty(finite.shape, dtype=finite.dtype, pin_memory=True).copy_(finite, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.rows, self.finite = out.cpu(), finite.cpu()

    def result(self, where: Callable[[list[int]], str] = lambda rows: f"rows {rows}") -> torch.Tensor:
        """The rows ``[B, ...]`` on the CPU; NaN/Inf rows refused, ``where(positions)`` naming them."""
        if self.event is not None:
            self.event.synchronize()
        bad = (~self.finite).nonzero().flatten()
        if len(bad):
            cause = ("fp16 overflow is the usual cause: rerun with --precision bf16 or fp32" if self.precision == "fp16"
                     else "check the prior's weights and these samples")
            raise ValueError(f"Prior {self.spec} gave NaN/Inf features for {len(bad)} row(s), e.g. "
                             f"{where([int(i) for i in bad[:10]])} ({self.precision}); {cause}. Nothing was written "
                             "for them.")
        return self.rows


def forward_rows(prior, x: torch.Tensor, precision: str, device: torch.device, spatial: bool = False,
                 reduce=None) -> PendingRows:
    """Queue ``prior(x)`` for one batch of preprocessed images, in inference mode (under ``precision``'s autocast):
    float32 rows ``[B, prior.output_dim]``; ``spatial=True``: the prior's feature map instead
    (:meth:`~accelerate_ssl.priors.Prior.feature_map`), channels last, ``[B, h, w, C]``, each location reduced by the
    PCA ``reduce`` when given (on the device). A wrong output shape is refused now; each row's finiteness is computed
    on the device and read with the rows (:class:`PendingRows`), so the host can queue the next batch's forward before
    it waits for this one's."""
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
        finite = torch.isfinite(out).flatten(1).all(dim=1)
        if reduce is not None:  # every location of the map [B, h, w, C] -> k components
            out = reduce.transform(out.reshape(-1, out.shape[-1])).reshape(*out.shape[:-1], -1)
        return PendingRows(prior, out, finite, precision)


def embed(prior, x: torch.Tensor, precision: str, device: torch.device,
          where: Callable[[list[int]], str] = lambda rows: f"rows {rows}", spatial: bool = False) -> torch.Tensor:
    """``prior(x)`` for one batch of preprocessed images, waited for (:func:`forward_rows`): float32 rows
    ``[B, prior.output_dim]`` on the CPU (``spatial=True``: the maps ``[B, h, w, C]``). A wrong output shape or
    NaN/Inf rows are refused, ``where(positions)`` naming those rows for the message (dataset indices, keys)."""
    return forward_rows(prior, x, precision, device, spatial).result(where)
