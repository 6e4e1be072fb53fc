"""The training recipe: one SSL loop, its views, its methods and its probe.

Everything that trains a network in this project goes through here: ``accelerate-ssl demo``, every
benchmark, the compact data set's teacher (:func:`accelerate_ssl.compact.train_teacher`) and the
training of the shipped priors. Sized for small images on CPU, it runs on any device.

- :mod:`.views`: random views of in-memory batches (:func:`random_views`, :data:`BYOL_VIEWS`,
  :data:`WEAK_VIEWS`);
- :mod:`.methods`: BYOL and the other SSL objectives over lightly's heads, and a supervised one
  (:func:`create_method`);
- :mod:`.train`: the loop (:func:`train_ssl`), its batch sources and its lr/momentum schedules;
- :mod:`.probe`: :class:`Probe` (linear probe + kNN during a run) and the speed-up read off the curves.

Using ReLA in your own loop needs none of this: it is what the library's own measurements run on.
"""

from .methods import BYOL, METHODS, Supervised, create_method
from .probe import Probe, cost_speedup, mean_run, speedup, steps_to_reach, value_at
from .train import (cosine_lr, cosine_momentum, loader_batches, random_batches, shuffled_batches, tensor_batches,
                    train_ssl, warmup_cosine_lr)
from .views import BYOL_VIEWS, WEAK_VIEWS, ViewConfig, images_to_tensor, prior_teacher, random_views

__all__ = ["BYOL", "METHODS", "Supervised", "create_method", "Probe", "cost_speedup", "mean_run", "speedup", "steps_to_reach", "value_at",
           "cosine_lr", "cosine_momentum", "loader_batches", "random_batches", "shuffled_batches", "tensor_batches",
           "train_ssl", "warmup_cosine_lr", "BYOL_VIEWS", "WEAK_VIEWS", "ViewConfig", "images_to_tensor",
           "prior_teacher", "random_views"]
