"""Distilled warm-start sets from a teacher classifier: SRe2L recover core, DWA, FADRM.

    from accelerate_ssl.distill import synthesize, warm_start
    distilled = synthesize(teacher, method="dwa", ipc=10, real=FashionMNIST(), mean=(0.286,), std=(0.353,), out_dir="distilled")
    warm_start(student, distilled, teacher=teacher, epochs=20)
"""

from .dataset import DistilledSet
from .dwa import DWAConfig, directed_weight_perturbation
from .fadrm import FADRMConfig, mro_cost_ratio, residual_inject, segment_schedule
from .recover import BNStatistics, RecoverConfig, TeacherWithoutBatchNormError
from .relabel import SoftLabelStore, kd_loss, train_student
from .synthesize import create_config, list_methods, synthesize
from .warmstart import warm_start

__all__ = [
    "BNStatistics",
    "DWAConfig",
    "DistilledSet",
    "FADRMConfig",
    "RecoverConfig",
    "SoftLabelStore",
    "TeacherWithoutBatchNormError",
    "create_config",
    "directed_weight_perturbation",
    "kd_loss",
    "list_methods",
    "mro_cost_ratio",
    "residual_inject",
    "segment_schedule",
    "synthesize",
    "train_student",
    "warm_start",
]
