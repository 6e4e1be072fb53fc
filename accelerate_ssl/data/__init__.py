"""Data helpers: real data sets without network, dataset fingerprints, and (ReLA) index tracking and
the per-epoch subset sampler."""

from .canvas import Canvas, make_canvases
from .datasets import ArrayImageDataset, Digits, FashionMNIST, ImageFiles, image_folder, load_fashion_mnist, read_idx
from .fingerprint import dataset_fingerprint, describe_fingerprint_mismatch
from .items import clean_view, item_image
from .indexing import IndexTracker, track_indices
from .subset import DynamicSubsetSampler
from .views import ReplayViews, StoredViews, apply_view

__all__ = [
    "ArrayImageDataset",
    "Canvas",
    "make_canvases",
    "Digits",
    "FashionMNIST",
    "ImageFiles",
    "image_folder",
    "load_fashion_mnist",
    "read_idx",
    "dataset_fingerprint",
    "describe_fingerprint_mismatch",
    "clean_view",
    "item_image",
    "IndexTracker",
    "track_indices",
    "DynamicSubsetSampler",
    "ReplayViews",
    "StoredViews",
    "apply_view",
]
