"""Prior-model targets (ReLA-D): what the rows are (format), how they are written (write, precompute, sidecar) and read
(store, sidecar, keys), the batch PCA, and ``accelerate-ssl store verify``. The priors themselves live in
:mod:`accelerate_ssl.priors`.

Submodules are imported lazily by ``accelerate_ssl`` (``precompute_targets``, ``TargetStore``); import them directly:
``from accelerate_ssl.targets.store import TargetStore``.
"""
