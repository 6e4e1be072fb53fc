"""ReLA in any training loop: ``loss = rela.wrap(ssl_loss)`` (the ReLA papers).

The public surface of ReLA; what each part does lives in its own module:

- :mod:`.rela`: the :class:`ReLA` object (lambda, the loss mix, what is skipped; ``ReLA.from_prior``, the set-up);
- :mod:`.term`: one prior's targets, head and checks, and how several priors' losses combine;
- :mod:`.capture`: which forward outputs are the student's features; :mod:`.validate`: what enters ``wrap`` besides
  the rows' identity (views, geometry, the student's map, several stores), checked before any row is read;
- :mod:`.lookup`: target rows by sample index; :mod:`.head`: the transport head and the cosine loss;
- :mod:`.handover`: what happens when lambda reaches 0 and your loss takes over;
- :mod:`.dense`: the dense term; :mod:`.distributed`: what is averaged across processes;
- :mod:`.guard` and :mod:`.witness`: the two in-training checks that the rows are the samples' own.
"""

from .guard import MisalignmentWarning
from .handover import Handover
from .head import fit_transport_head, full_precision, rela_loss
from .lookup import INDEX_CHECK_STEPS
from .capture import MAX_CAPTURED
from .rela import ReLA
from .witness import MisalignmentError, Witness, WitnessWarning

__all__ = ["ReLA", "Handover", "fit_transport_head", "rela_loss", "full_precision", "INDEX_CHECK_STEPS", "MAX_CAPTURED",
           "MisalignmentWarning", "MisalignmentError", "Witness", "WitnessWarning"]
