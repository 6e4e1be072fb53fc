"""Optional dependencies: each lives in a pip extra, and a missing one says which ``pip install`` fixes it.

The core (priors from checkpoints and the shipped ConvNets, precompute, TargetStore, ReLA) needs only
torch, torchvision, safetensors, numpy, tqdm and pillow. Everything else is an extra::

    pip install "accelerate-ssl[timm]"        # timm:<model> priors
    pip install "accelerate-ssl[clip]"        # open_clip:<model> priors
    pip install "accelerate-ssl[lightly]"     # the demo / benchmark BYOL recipe, compact teachers
    pip install "accelerate-ssl[accelerate]"  # multi-process precompute under `accelerate launch`
    pip install "accelerate-ssl[plots]"       # PNGs of the demo and benchmarks
    pip install "accelerate-ssl[sklearn]"     # the digits data set, solo-learn's data.fraction split
    pip install "accelerate-ssl[lightning]"   # ReLACallback for a Lightning Trainer
    pip install "accelerate-ssl[webdataset]"  # wds:<shards> data: precompute sidecars, join them in a pipeline
    pip install "accelerate-ssl[hf]"          # hf:<path or name> data (Hugging Face datasets)
    pip install "accelerate-ssl[all]"         # all of the above
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

#: importable module -> (pip extra, distribution name)
EXTRAS: dict[str, tuple[str, str]] = {
    "timm": ("timm", "timm"),
    "open_clip": ("clip", "open_clip_torch"),
    "lightly": ("lightly", "lightly"),
    "accelerate": ("accelerate", "accelerate"),
    "matplotlib": ("plots", "matplotlib"),
    "sklearn": ("sklearn", "scikit-learn"),
    "lightning": ("lightning", "lightning"),
    "webdataset": ("webdataset", "webdataset"),
    "braceexpand": ("webdataset", "webdataset"),
    "datasets": ("hf", "datasets"),
}


def _absent(top: str) -> bool:
    try:
        return importlib.util.find_spec(top) is None
    except (ImportError, ValueError):
        return True


def require(module: str, what: str) -> ModuleType:
    """Import ``module`` (e.g. ``"timm.data"``), or raise an ImportError naming ``what`` needs it and the fix."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if top not in EXTRAS or not _absent(top):
            raise  # installed but broken (or not one of ours): the original error says more
        extra, dist = EXTRAS[top]
        raise ImportError(f"{what} needs {dist}, which is not installed: pip install \"accelerate-ssl[{extra}]\" "
                          f"(or pip install {dist}).") from err
