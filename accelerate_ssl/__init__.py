"""accelerate-ssl: make representation learning cheaper inside your own training loop.

Public API (kept small and stable)::

    from accelerate_ssl import create_prior, precompute_targets, TargetStore
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> defining module; resolved on first access so `import accelerate_ssl` stays fast.
_LAZY: dict[str, str] = {
    "create_prior": "accelerate_ssl.priors",
    "list_priors": "accelerate_ssl.priors",
    "precompute_targets": "accelerate_ssl.targets.precompute", "open_or_precompute": "accelerate_ssl.targets.cache",
    "TargetStore": "accelerate_ssl.targets.store",
    "precompute_sidecars": "accelerate_ssl.targets.sidecar", "ShardedTargets": "accelerate_ssl.targets.sidecar",
    "open_stream": "accelerate_ssl.data.streams", "decode_images": "accelerate_ssl.data.streams",
    "StoredViews": "accelerate_ssl.data.views", "ReplayViews": "accelerate_ssl.data.views",
    "RecordGeometry": "accelerate_ssl.targets.views", "record_geometry": "accelerate_ssl.targets.views",
    "synthesize": "accelerate_ssl.distill.synthesize", "warm_start": "accelerate_ssl.distill.warmstart",
    "ReLA": "accelerate_ssl.rela", "Witness": "accelerate_ssl.rela", "Handover": "accelerate_ssl.rela",
    "distill_compact": "accelerate_ssl.compact", "CompactDataset": "accelerate_ssl.compact", "pretrain_on_compact": "accelerate_ssl.compact",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'accelerate_ssl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
