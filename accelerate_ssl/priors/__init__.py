"""Priors: the frozen networks that embed the training images once (``<family>:<name>`` specs).

``registry`` holds what a prior is (:class:`Prior`, its :class:`Preprocess`), the spec grammar and the families that
need nothing else (``random``, ``checkpoint``, ``shipped``); ``zoo`` adds the model zoos (``timm``, ``open_clip``,
``torchvision``) through their own caches, offline-first; ``catalog`` is ``accelerate-ssl priors`` (list, show, fetch).
Importing the package registers every family.
"""

from __future__ import annotations

from . import zoo as _zoo  # noqa: F401  (registers the timm / open_clip / torchvision families)
from .registry import (SHIPPED_PRIORS, WEIGHT_DIGESTS, Preprocess, Prior, create_prior, list_priors, load_state_dict_file,
                       rebuild_prior, register_architecture, register_prior, save_prior_checkpoint, shipped_prior_file)

__all__ = ["Prior", "Preprocess", "create_prior", "list_priors", "register_prior", "rebuild_prior", "WEIGHT_DIGESTS",
           "SHIPPED_PRIORS", "shipped_prior_file", "save_prior_checkpoint", "register_architecture", "load_state_dict_file"]
