"""Parameterized compact self-supervised data sets (Yu et al. (2025); KRR-ST core from Lee et al. 2024).

Distil unlabelled images into image/representation bases + coefficients + approximation nets,
decode them into (image, target) pairs and pretrain a student on them by regression::

    from accelerate_ssl.compact import distill_compact, pretrain, train_teacher, CompactDataset

    teacher = train_teacher(images, method="barlow_twins", steps=1000)
    compact = distill_compact(images, teacher, budget_images=100, steps=2000, checkpoint="run.pt")
    compact.save("fmnist_n100.safetensors")
    pretrain(student, CompactDataset.load("fmnist_n100.safetensors"), epochs=200)
"""

from .approx import ApproxFitWarning, ApproxNet, fit_approx_net
from .augment import Augmentation, create_augmentations, list_augmentations
from .bases import decode_images, decode_targets, downscale, pca_basis, project, upsample
from .budget import StorageBudgetError, StoragePlan, pixel_images_for_budget, pixel_storage_floats, plan_storage
from .codec import CompactDataset, pixel_compact
from .distill import DistillConfig, Distiller, distill_compact
from .krr import ModelPool, krr_predict, krr_predict_primal, outer_loss
from .pretrain import pretrain
from .teacher import Teacher, load_teacher, save_teacher, train_teacher

pretrain_on_compact = pretrain  # the name exported at the top level: accelerate_ssl.pretrain_on_compact

__all__ = [
    "ApproxFitWarning", "ApproxNet", "fit_approx_net", "Augmentation", "create_augmentations", "list_augmentations",
    "decode_images", "decode_targets", "downscale", "pca_basis", "project", "upsample",
    "StorageBudgetError", "StoragePlan", "pixel_images_for_budget", "pixel_storage_floats", "plan_storage", "CompactDataset", "pixel_compact",
    "DistillConfig", "Distiller", "distill_compact", "ModelPool", "krr_predict", "krr_predict_primal", "outer_loss",
    "pretrain", "pretrain_on_compact", "Teacher", "load_teacher", "save_teacher", "train_teacher",
]
