"""What a data set's item holds, read by one rule everywhere: its image, and the data set without its transform.

**The image of an item** (:func:`item_image`; precompute, fingerprints, row identity digests, stored views and the
feature-dim dry forward all read it this way):

- an image itself (a PIL image, or an array / tensor of more than one value);
- a tuple or list: the element at position ``image_key`` (an int), by default the first element that is an image
  (``(image, label)`` -> ``image``);
- a dict: the field ``image_key`` (a str), by default the first of :data:`IMAGE_FIELDS` the item holds
  (``{"image": ..., "label": ...}`` -> ``"image"``). The same names are the default image field of streamed data
  (Hugging Face columns, WebDataset fields), so ``image_key=`` in Python and ``--image-field`` on the command line
  mean one thing for every kind of data. Where a field was found by default, :func:`announce_image_field` prints the
  choice once.

An item whose image cannot be found raises :class:`UnreadableItemError` naming the data set, the item's structure
(types, keys) and the argument that fixes it.

**The clean view of a data set** (:func:`clean_view`): a shallow copy (the data shared) with its transform off, found
under :data:`TRANSFORM_ATTRS` or named with ``transform_attr=``. :func:`same_items` proves that two data set objects
list the same items in the same order (one a clean view of the other: the same class and state but its transform).
"""

from __future__ import annotations

import copy
import os
import sys
import weakref
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np
import torch

from ..launch import is_main_process

__all__ = ["IMAGE_FIELDS", "TRANSFORM_ATTRS", "UnreadableItemError", "is_image", "describe_item", "image_location",
           "item_image", "image_or_item", "replace_image", "announce_once", "announce_image_field", "dataset_name", "transform_attrs",
           "switch_off", "clean_view", "same_items", "unchanged"]

#: the image field of a dict item, a Hugging Face column or a WebDataset field when none is named: the first present.
IMAGE_FIELDS = ("image", "img", "pixel_values", "png", "jpg", "jpeg", "webp", "ppm", "bmp", "tif", "tiff")
#: the attributes that hold a data set's transform (its augmentation), switched off by :func:`clean_view` and when
#: samples are read for identity. Only attributes holding a callable count (``augment=True`` flags do not).
TRANSFORM_ATTRS = ("transform", "transforms", "image_transform", "image_transforms", "img_transform", "train_transform",
                   "transform_fn", "augmentation", "augmentations", "augment", "aug")

ImageKey = Union[None, str, int]


class UnreadableItemError(TypeError):
    """An item whose image cannot be found or read; the message names the data set, the item and the fix."""


def is_image(x: Any) -> bool:
    """A PIL image, or a numpy array / tensor of more than one value (a 0-d or one-element tensor is a label)."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.ndim >= 1 and (x.numel() if isinstance(x, torch.Tensor) else x.size) > 1
    return hasattr(x, "getbands") and hasattr(x, "size") and hasattr(x, "mode")


def _describe_value(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor {str(x.dtype).replace('torch.', '')} {list(x.shape)}"
    if isinstance(x, np.ndarray):
        return f"ndarray {x.dtype} {list(x.shape)}"
    if hasattr(x, "getbands") and hasattr(x, "size"):
        return f"PIL.Image {getattr(x, 'mode', '?')} {x.size[0]}x{x.size[1]}"
    if isinstance(x, (list, tuple)):
        inner = ", ".join(_describe_value(v) for v in x[:4]) + (", ..." if len(x) > 4 else "")
        return f"{type(x).__name__} of {len(x)} [{inner}]"
    if isinstance(x, dict):
        return f"dict with keys {list(map(str, x))[:8]}"
    return type(x).__name__


def describe_item(item: Any) -> str:
    """An item's structure in words: ``dict {'image': PIL.Image RGB 32x32, 'label': int}``, ``tuple (str, int)``."""
    if isinstance(item, dict):
        fields = ", ".join(f"{k!r}: {_describe_value(v)}" for k, v in list(item.items())[:8])
        return f"a dict {{{fields}{', ...' if len(item) > 8 else ''}}}"
    if isinstance(item, (list, tuple)):
        inner = ", ".join(_describe_value(v) for v in item[:6]) + (", ..." if len(item) > 6 else "")
        return f"a {type(item).__name__} ({inner})"
    return f"a {_describe_value(item)}"


def dataset_name(dataset) -> str:
    """How messages name a data set: its ``.name`` when it has one, else its class."""
    name = getattr(dataset, "name", None)
    return name if isinstance(name, str) and name else type(dataset).__name__


def _fix(item: Any) -> str:
    if isinstance(item, dict):
        how = "image_key='<field>'"
        flag = "--image-field <field>"
    else:
        how = "image_key=<position>"
        flag = "--image-field <position>"
    return (f"Name where the image is: {how} (ReLA.from_prior, precompute_targets, open_or_precompute, dataset_fingerprint) or {flag} "
            "on the command line; that value must be a PIL image, a numpy array or a tensor (decode files and bytes in "
            "__getitem__).")


def _lists_hint(value: Any) -> str:
    """What to do when ``value`` looks like pixels held as nested Python lists of numbers, else ''."""
    depth, leaf = 0, value
    while isinstance(leaf, list) and leaf:
        depth, leaf = depth + 1, leaf[0]
    if depth < 2 or not isinstance(leaf, (int, float)) or isinstance(leaf, bool):
        return ""
    return (" (pixels as nested Python lists: a Hugging Face data set hands out an Array2D / Array3D column so; pass "
            "it .with_format('numpy', columns=['<image column>'], dtype='uint8', output_all_columns=True))")


def _unreadable(item: Any, where: str, problem: str) -> UnreadableItemError:
    return UnreadableItemError(f"Cannot read the image of {where}: it is {describe_item(item)}; {problem}. {_fix(item)}")


def image_location(item: Any, image_key: ImageKey = None, where: str = "an item") -> ImageKey:
    """Where ``item``'s image is (module docstring): ``None`` (the item is the image), a position or a field name.
    Raises :class:`UnreadableItemError` naming ``where`` (e.g. ``"item 0 of PetsDataset"``) and the fix."""
    if isinstance(item, dict):
        if image_key is not None:
            if image_key not in item:
                raise _unreadable(item, where, f"it has no field {image_key!r} (image_key)")
            key = image_key
        else:
            key = next((k for k in IMAGE_FIELDS if item.get(k) is not None), None)
            if key is None:
                raise _unreadable(item, where, f"none of its fields is one of the common image fields "
                                                f"({', '.join(IMAGE_FIELDS)})")
        if not is_image(item[key]):
            raise _unreadable(item, where, f"its field {key!r} holds a {_describe_value(item[key])}, not an image"
                                           + _lists_hint(item[key]))
        return key
    if isinstance(item, (list, tuple)):
        if image_key is not None:
            try:
                position = int(image_key)
            except (TypeError, ValueError):
                raise _unreadable(item, where, f"image_key={image_key!r} names a field, but tuple items have positions") from None
            if not -len(item) <= position < len(item) or not is_image(item[position]):
                raise _unreadable(item, where, f"position {position} (image_key) holds no image")
            return position
        position = next((j for j, x in enumerate(item) if is_image(x)), None)
        if position is None:
            raise _unreadable(item, where, "no element of it is an image")
        return position
    if image_key is not None:
        raise _unreadable(item, where, f"image_key={image_key!r} was given, but the item is not a dict or a tuple")
    if not is_image(item):
        raise _unreadable(item, where, "it is not an image" + _lists_hint(item))
    return None


def item_image(item: Any, image_key: ImageKey = None, where: str = "an item") -> Any:
    """The image of ``item`` (:func:`image_location`)."""
    key = image_location(item, image_key, where)
    return item if key is None else item[key]


def image_or_item(item: Any) -> Any:
    """The image of ``item`` by the default rule, or the item itself when none is found (never raises)."""
    try:
        return item_image(item)
    except UnreadableItemError:
        return item


def replace_image(item: Any, key: ImageKey, image: Any) -> Any:
    """``item`` with its image (at ``key``, from :func:`image_location`) replaced; the other values kept."""
    if key is None:
        return image
    if isinstance(item, dict):
        return {**item, key: image}
    out = list(item)
    out[key] = image
    return type(item)(out) if isinstance(item, tuple) else out


_ANNOUNCED: set = set()


def announce_once(what: Any, text: str) -> None:
    """Print ``text`` to stderr once per process for ``what`` (only on the main process of a distributed run)."""
    if what in _ANNOUNCED:
        return
    _ANNOUNCED.add(what)
    if is_main_process():
        print(f"accelerate-ssl: {text}", file=sys.stderr)


def announce_image_field(name: str, item: Any, key: ImageKey, given: ImageKey = None) -> None:
    """Say once which field of dict items was taken as the image when none was named."""
    if isinstance(item, dict) and given is None:
        announce_once(("image field", name, key), f"{name} items are {describe_item(item)[2:]}: the image is field "
                                                  f"{key!r} (name another with image_key= / --image-field)")


# ---------------------------------------------------------------------------------------------- clean views
def unchanged(*args: Any) -> Any:
    """The identity, for one argument or several (a torchvision ``transforms(image, target)``)."""
    return args[0] if len(args) == 1 else args


def transform_attrs(dataset, names: Sequence[str] = TRANSFORM_ATTRS) -> list[str]:
    """The attributes of ``dataset`` among ``names`` that hold a callable (its transform)."""
    return [a for a in names if callable(getattr(dataset, a, None)) and not isinstance(getattr(dataset, a), type)]


def switch_off(dataset, attrs: Iterable[str], off: Any = None):
    """A shallow copy of ``dataset`` with each of ``attrs`` set to ``off`` (a torchvision ``StandardTransform`` keeps
    its target transform). The data are shared; ``dataset`` is left as it is."""
    view = copy.copy(dataset)
    for attr in attrs:
        value = getattr(dataset, attr, None)
        if type(value).__name__ == "StandardTransform" and hasattr(value, "target_transform"):
            from torchvision.datasets.vision import StandardTransform

            setattr(view, attr, StandardTransform(None, value.target_transform))
        else:
            setattr(view, attr, off)
    return view


#: clean views made by clean_view: id(view) -> (weakref to the view, weakref to its source, attributes switched off)
_VIEWS: dict[int, tuple] = {}


def _record_view(view, source, attrs) -> None:
    try:
        refs = (weakref.ref(view), weakref.ref(source))
    except TypeError:  # not weakly referenceable: same_items compares the state instead
        return
    _VIEWS[id(view)] = (*refs, tuple(attrs))
    weakref.finalize(view, _VIEWS.pop, id(view), None)


def _registered(view) -> tuple:
    entry = _VIEWS.get(id(view))
    if entry is None or entry[0]() is not view:
        return ()
    return entry[2]


def _refuse_written_through(dataset, before: dict) -> None:
    """Switching a transform off on the copy must leave ``dataset`` as it was: an attribute that writes through to
    shared state (a property setting another object's transform) is put back and refused, naming the fix."""
    changed = [a for a, value in before.items() if value is not None and getattr(dataset, a, None) in (None, unchanged)]
    for attr in changed:
        setattr(dataset, attr, before[attr])
    if changed:
        raise TypeError(
            f"Cannot make a clean view of {dataset_name(dataset)}: setting {changed[0]!r} on a copy of it also switched "
            "off the original's transform (the attribute writes through to an object both share). Pass the clean data "
            "set itself (ReLA.from_prior(..., dataset=clean_set), or clean_view of the data set that holds the "
            "transform).")


def clean_view(dataset, transform_attr: Union[None, str, Sequence[str]] = None):
    """``dataset`` without its augmentation, the same items in the same order (a shallow copy; the data are shared
    and ``dataset`` is left as it is).

    Args:
        dataset: a map-style data set; a ``torch.utils.data.Subset`` gives a Subset of the clean inner data set; a
            wrapper whose transform is a property of the data set it holds in ``.dataset`` (lightly's
            ``LightlyDataset``) gives the clean view of that inner data set.
        transform_attr: the attribute(s) holding the transform. ``None`` (default): every attribute of
            :data:`TRANSFORM_ATTRS` the data set has (``transform``, ``image_transform``, ``transforms``, ...), set to
            ``None`` (a torchvision ``transforms`` keeps its target transform). A ``__getitem__`` that cannot read
            item 0 so (one that calls its transform without testing for ``None``) gets the identity instead.

    Raises a ``TypeError`` naming the fix when no transform attribute is found (or a named one is missing).
    """
    from torch.utils.data import Subset

    if isinstance(dataset, Subset):
        return Subset(clean_view(dataset.dataset, transform_attr), dataset.indices)
    inner = getattr(dataset, "dataset", None)
    forwarded = [a for a in TRANSFORM_ATTRS if isinstance(getattr(type(dataset), a, None), property)
                 and a not in getattr(dataset, "__dict__", {})]
    if transform_attr is None and inner is not None and forwarded and not transform_attrs(dataset, [
            a for a in TRANSFORM_ATTRS if a not in forwarded]):
        # a wrapper whose transform is a property of its inner data set (lightly's LightlyDataset): setting it on a
        # copy would switch off the shared inner one, so the clean view is the inner data set's
        return clean_view(inner)
    if transform_attr is not None:
        attrs = [transform_attr] if isinstance(transform_attr, str) else list(transform_attr)
        missing = [a for a in attrs if not hasattr(dataset, a)]
        if missing:
            raise TypeError(f"{dataset_name(dataset)} has no attribute {missing[0]!r} (transform_attr); its attributes: "
                            f"{sorted(a for a in vars(dataset) if not a.startswith('_'))[:20]}.")
    else:
        attrs = [a for a in TRANSFORM_ATTRS if hasattr(dataset, a)]
        if not attrs:
            raise TypeError(
                f"Cannot find the clean (un-augmented) samples of {dataset_name(dataset)}: it has none of the transform "
                f"attributes {', '.join(TRANSFORM_ATTRS)}. Name the attribute that holds its augmentation "
                "(clean_view(dataset, transform_attr='<attribute>')), or precompute the targets on a data set of the "
                "same items in the same order without augmentation and pass it as ReLA(..., dataset=clean_set).")
    before = {a: getattr(dataset, a, None) for a in attrs}
    view = switch_off(dataset, attrs, None)
    _refuse_written_through(dataset, before)
    if len(dataset):
        try:
            view[0]
        except Exception as err:  # noqa: BLE001 - e.g. `self.transform(x)` without a None test: the identity instead
            identity = switch_off(dataset, attrs, unchanged)
            _refuse_written_through(dataset, before)
            try:
                identity[0]
            except Exception:  # noqa: BLE001 - the data set fails either way: its own error is the one to see
                raise err from None
            view = identity
    _record_view(view, dataset, attrs)
    return view


def _equal_state(a: Any, b: Any, depth: int = 0) -> bool:
    """``a`` and ``b`` are the same object, or equal plain values (numbers, strings, paths, arrays, tensors, and
    lists / tuples / dicts of them)."""
    if a is b:
        return True
    if type(a) is not type(b) or depth > 3:
        return False
    if isinstance(a, (str, bytes, int, float, bool, complex, os.PathLike)) or a is None:
        return a == b
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_state(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal_state(a[k], b[k], depth + 1) for k in a)
    return False


def same_items(a, b) -> bool:
    """Whether ``a`` and ``b`` are proven to list the same items in the same order, transforms aside: the same
    class, and every attribute the same object or an equal plain value, except the transform attributes
    (:data:`TRANSFORM_ATTRS` and those a :func:`clean_view` switched off). Subsets: the same indices over such data
    sets. Anything else (another class, another list, a copied and reordered list) is not proven."""
    from torch.utils.data import Subset

    if a is b:
        return True
    if isinstance(a, Subset) or isinstance(b, Subset):
        return (isinstance(a, Subset) and isinstance(b, Subset) and _equal_state(list(a.indices), list(b.indices))
                and same_items(a.dataset, b.dataset))
    if type(a) is not type(b) or not hasattr(a, "__dict__") or not hasattr(b, "__dict__"):
        return False
    ignored = set(TRANSFORM_ATTRS) | set(_registered(a)) | set(_registered(b))
    state_a = {k: v for k, v in vars(a).items() if k not in ignored}
    state_b = {k: v for k, v in vars(b).items() if k not in ignored}
    return state_a.keys() == state_b.keys() and all(_equal_state(state_a[k], state_b[k]) for k in state_a)
