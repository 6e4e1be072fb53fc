"""Prior-model targets (ReLA-D): prior registry, precompute, TargetStore, batch PCA.

Submodules are imported lazily by ``accelerate_ssl`` (``create_prior``, ``precompute_targets``,
``TargetStore``); import them directly: ``from accelerate_ssl.targets.store import TargetStore``.
"""
