"""lambda controllers for ReLA: how much of the loss is the ReLA term, step by step.

``L = lambda * L_rela + (1 - lambda) * L_ssl``. Every controller is a small stateful object with the
same interface:

- ``step(loss_rela: float) -> float``: feed the ReLA loss of one *optimiser* step (averaged over
  micro-batches and processes by :class:`accelerate_ssl.ReLA`), get lambda for the next step;
- ``value``: the current lambda; ``finished``: True once lambda is 0 for good (ReLA then stops
  computing its term and stops capturing features);
- ``end_step``: every controller takes it: after that many optimiser steps its term is over for good (lambda 0,
  ``finished``), whatever its rule says; ``ends_by`` is the step by which it is over for sure (``end_step``, an
  ``Epochs`` switch, or None when only the losses can end it);
- ``state_dict()`` / ``load_state_dict()``.

Controllers (the docs' "Schedules" page compares them on the budget study):

=================  =======================================================  =====================
name               rule                                                     source
=================  =======================================================  =====================
``Switch``         lambda 1 until the ReLA loss converges, then 0 for good  ReLA v1, App. J (default)
``Decay``          adaptive in [0, 0.8]: falls as the ReLA loss plateaus    ReLA v2, App. L, Alg. 1
``Constant(lam)``  fixed lambda                                             ablation
``Epochs(f, T)``   lambda 1 for the first fraction f of T steps, then 0     authors' ``--rela_conlam``
=================  =======================================================  =====================

Use :func:`create_schedule` to build one from a spec (``"switch"``, ``"switch:<end fraction>"``, ``"decay"``,
``"constant:<lambda>"``, ``"epochs:<fraction>"``), planned for ``total_steps``; ReLA, the CLI and the solo-learn mixin
all take that spec. The papers' ``Switch`` ends only when the ReLA loss converges and their ``Decay`` only approaches 0;
planned for a run (``total_steps``), each hands over by its ``end_fraction`` of the run at the latest (``Switch``:
:data:`SWITCH_END_FRACTION`; ``Decay``: 0.5), so your loss always takes over inside the run. ``end_step`` gives any of
them a planned end at a step you choose (e.g. to hand the run over to timm's mixup at a chosen epoch).

Why ``Switch`` is the default: a step with lambda 1 and the loss passed to ``wrap`` as a callable skips your SSL loss
(one view through the backbone and the transport head), so it costs a fraction of a plain step, while a step that
mixes both losses pays the full price. Measured at equal compute (the docs' "What it buys, by budget"), the cheap
phase held to late in the run ended at or near the top at every budget; the budget study's schedules are compared
there.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional


def check_steps(value: Any, name: str, minimum: int = 1) -> int:
    """``value`` as a number of optimiser steps (an int >= ``minimum``), or the error naming ``name`` and the fix: a
    bool (``total_steps=True`` would be a one-step run) and a non-integer (``40.5``, ``"40"``) are refused, not
    rounded."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "a bool" if isinstance(value, bool) else f"a {type(value).__name__}"
        raise ValueError(f"{name} is a number of optimiser steps, an int >= {minimum}; got {value!r} ({kind}). Pass "
                         f"the whole number of steps, e.g. {name}=epochs * len(loader) // accumulation_steps.")
    if value < minimum:
        raise ValueError(f"{name} is a number of optimiser steps, an int >= {minimum}; got {value}.")
    return int(value)


class Schedule:
    """Base class: a stateful lambda controller stepped once per optimiser step."""

    #: state entries saved by ``state_dict`` (subclasses extend).
    _state_keys: tuple[str, ...] = ("value", "steps", "finished")
    #: the run's optimiser steps this schedule was planned for (None: not planned for a run length)
    total_steps: Optional[int] = None

    def __init__(self, end_step: Optional[int] = None) -> None:
        self.value: float = 1.0
        self.steps: int = 0
        self.finished: bool = False
        end_step = None if end_step is None else check_steps(end_step, "end_step", 0)
        #: after this many optimiser steps the term is over for good, whatever the rule says (None: the rule decides)
        self.end_step = end_step
        if end_step == 0:
            self.value, self.finished = 0.0, True

    @property
    def needs_loss(self) -> bool:
        """Whether ``step`` reads its ``loss_rela`` argument (False once finished, or for time-based rules)."""
        return not self.finished

    @property
    def ends_by(self) -> Optional[int]:
        """The optimiser step by which the term is over for sure (``end_step``), or None when only the losses can end
        it."""
        return self.end_step

    def step(self, loss_rela: Optional[float] = None) -> float:
        """Advance by one optimiser step given that step's ReLA loss; return the new lambda (0 for good from
        ``end_step`` on)."""
        self.steps += 1
        if not self.finished:
            self._advance(loss_rela)
        if self.end_step is not None and self.steps >= self.end_step:
            self.value, self.finished = 0.0, True
        return self.value

    def _advance(self, loss_rela: Optional[float]) -> None:
        """The rule: update ``value`` (and ``finished``) from one more step's loss (``steps`` already counts it)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._state_keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in self._state_keys if k not in state]
        if missing:
            raise KeyError(
                f"{type(self).__name__}.load_state_dict: missing {missing}; was this state saved by a "
                f"different controller? (saved keys: {sorted(state)})"
            )
        for k in self._state_keys:
            setattr(self, k, state[k])
        if self.end_step is not None and self.steps >= self.end_step:  # resumed past this run's end
            self.value, self.finished = 0.0, True

    def __repr__(self) -> str:
        end = "" if self.end_step is None else f", end_step={self.end_step}"
        return f"{type(self).__name__}(value={self.value:.4f}, steps={self.steps}, finished={self.finished}{end})"


def planned_end(total_steps: Optional[int], end_fraction: Optional[float], end_step: Optional[int],
                earliest: float = 0.0) -> Optional[int]:
    """The optimiser step by which a schedule planned for ``total_steps`` ends ReLA's term for good: ``end_step`` when
    given, else ``end_fraction`` of the run (at least one step), else None (the rule alone decides). ``earliest``: the
    lowest fraction the rule allows (``Switch``'s first possible switch)."""
    if total_steps is None or end_step is not None or end_fraction is None:
        return end_step
    if not earliest <= end_fraction <= 1.0 or end_fraction <= 0.0:
        raise ValueError(f"end_fraction must be in ({earliest}, 1] (the fraction of the run by which lambda reaches 0), or "
                         f"None for no planned end; got {end_fraction}.")
    return max(1, round(end_fraction * total_steps))


def _check_loss(loss_rela: Optional[float], name: str) -> float:
    if loss_rela is None:
        raise ValueError(f"{name}.step needs the ReLA loss of the step; got None. Pass step(loss_rela=float).")
    loss = float(loss_rela)
    if not math.isfinite(loss):
        raise ValueError(f"{name}.step got a non-finite ReLA loss ({loss}); check the targets and features for NaN/inf.")
    return loss


class Decay(Schedule):
    """Continuous adaptive lambda, ReLA v2 App. L, Algorithm 1 (the default, planned for the run).

    State ``l_m = 2.0`` (EMA of the ReLA loss), ``rho_m = 0.0``. Per optimiser step with ReLA loss ``l_c``::

        rho    = exp(-max(l_m - l_c, 0) * sharpness)        # sharpness = 40
        rho_m  = rho_momentum * rho_m + (1 - rho_momentum) * rho      # 0.95
        l_m    = loss_momentum * l_m + (1 - loss_momentum) * l_c      # 0.999
        lambda = max_lambda - max_lambda * rho_m                      # 0.8

    lambda starts at ``max_lambda`` and falls toward 0 once the ReLA loss stops improving on its EMA.
    Before the first step ``value == max_lambda``. The controller never reports ``finished`` (lambda
    only approaches 0) unless ``finish_below`` is set: then lambda is set to 0 for good the first time
    it drops under that value, and ReLA stops computing its term. Neither is a planned end (the losses decide
    whether lambda ever drops that low); ``end_step`` is one: lambda 0 for good after that many steps. Planned for
    ``total_steps``, the run gets one at ``end_fraction`` of it (default 0.5; None: the paper's rule alone, which never
    reaches 0), so your loss carries the student the second half of the run.

    Run length: with the paper's constants the loss EMA moves at 0.001/step from 2.0, so lambda is
    still ~0.8 after 600 steps (ImageNet-length runs). Pass ``total_steps`` to scale the loss EMA to
    the planned run: ``loss_momentum = 1 - 6 / (decay_fraction * total_steps)`` (capped at the
    paper's 0.999), so the EMA closes 99.75 % of its initial gap (e^-6) within the first
    ``decay_fraction`` of the run; lambda then falls as fast as the ReLA loss plateaus (while the
    loss still drops fast, ``l_m - l_c`` stays large and lambda stays high: that is the rule). An
    explicit ``loss_momentum`` wins.
    """

    _state_keys = Schedule._state_keys + ("loss_ema", "rho_ema")

    def __init__(
        self,
        *,
        total_steps: Optional[int] = None,
        decay_fraction: float = 0.5,
        max_lambda: float = 0.8,
        sharpness: float = 40.0,
        rho_momentum: float = 0.95,
        loss_momentum: Optional[float] = None,
        initial_loss: float = 2.0,
        finish_below: Optional[float] = None,
        end_fraction: Optional[float] = 0.5,
        end_step: Optional[int] = None,
    ):
        total_steps = None if total_steps is None else check_steps(total_steps, "total_steps")
        super().__init__(planned_end(total_steps, end_fraction, end_step))
        self.total_steps = total_steps
        if not 0.0 < max_lambda <= 1.0:
            raise ValueError(f"max_lambda must be in (0, 1], got {max_lambda}.")
        if not 0.0 < decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must be in (0, 1], got {decay_fraction}.")
        if loss_momentum is None:
            loss_momentum = 0.999
            if total_steps is not None:
                loss_momentum = min(0.999, max(0.0, 1.0 - 6.0 / (decay_fraction * total_steps)))
        for name, m in (("loss_momentum", loss_momentum), ("rho_momentum", rho_momentum)):
            if not 0.0 <= m < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {m}.")
        self.max_lambda = float(max_lambda)
        self.sharpness = float(sharpness)
        self.rho_momentum = float(rho_momentum)
        self.loss_momentum = float(loss_momentum)
        self.finish_below = finish_below
        self.loss_ema = float(initial_loss)
        self.rho_ema = 0.0
        if not self.finished:
            self.value = self.max_lambda

    def _advance(self, loss_rela: Optional[float]) -> None:
        l_c = _check_loss(loss_rela, "Decay")
        rho = math.exp(-max(self.loss_ema - l_c, 0.0) * self.sharpness)
        self.rho_ema = self.rho_momentum * self.rho_ema + (1.0 - self.rho_momentum) * rho
        self.loss_ema = self.loss_momentum * self.loss_ema + (1.0 - self.loss_momentum) * l_c
        self.value = self.max_lambda - self.max_lambda * self.rho_ema
        if self.finish_below is not None and self.value < self.finish_below:
            self.value, self.finished = 0.0, True


#: the latest hand-over of a planned ``Switch`` (the default schedule): lambda 1 for at most this fraction of the run,
#: then your loss for the rest (the docs' "Schedules" gives the measurements it was chosen from)
SWITCH_END_FRACTION = 0.9


class Switch(Schedule):
    """Two-stage switch, ReLA v1 App. J, Algorithm 1: lambda = 1 (ReLA only), then 0 for good (SSL only).

    State ``l_s = 2.0``, ``l_f = 1.0``, ``lambda = 1``. Per optimiser step while lambda == 1, with ReLA loss ``l_c``::

        l_f = fast_momentum * l_f + (1 - fast_momentum) * l_c      # 0.999 ("short-term" in the paper)
        l_s = slow_momentum * l_s + (1 - slow_momentum) * l_f      # 0.99  ("long-term")
        if exp(-max(l_s - l_f, 0) * sharpness) >= threshold: lambda = 0 for good   # sharpness 1, 0.995

    Only one loss is computed at any step: while lambda == 1 ReLA skips the SSL loss when ``wrap`` gets
    a callable; after the switch the ReLA term is not computed.

    Facts to know: the paper (and the authors' code) apply the exponential with factor 1
    (``sharpness=1``), so the switch fires when ``l_s - l_f <= -ln(0.995) ~ 0.005``. ``l_s`` starts 1.0
    above ``l_f`` and closes that gap at ~1 %/step, so with these constants the switch can never come
    before ~500 optimiser steps (0.99^t <= 0.005 -> t >= 528 for a flat loss). For short runs pass
    ``total_steps``: both momenta are scaled so the earliest possible switch comes at
    ``min_switch_fraction * total_steps`` (default 0.25): ``slow_momentum = 0.005^(1/t_min)`` and
    ``fast_momentum = 1 - (1 - slow_momentum) / 10`` (the paper's 10:1 ratio of rates). Explicit
    momenta win.

    A planned run also has a latest switch: at ``end_fraction * total_steps`` (default :data:`SWITCH_END_FRACTION`)
    lambda goes to 0 whatever the losses say (``end_step``), so the run hands over inside itself (the spec
    ``"switch:<end fraction>"`` sets it). The rule alone seldom fires inside a planned run: ``l_f`` starts at 1.0 and
    approaches a ReLA loss that settles well below it over ~0.5 of the run, so the gap to ``l_s`` closes after the run
    would have ended; on the budget study's runs the switch came at the planned end on every run. An explicit
    ``end_step`` wins; ``end_fraction=None`` leaves the losses alone to decide.
    """

    _state_keys = Schedule._state_keys + ("loss_slow", "loss_fast")

    def __init__(
        self,
        *,
        total_steps: Optional[int] = None,
        min_switch_fraction: float = 0.25,
        end_fraction: Optional[float] = SWITCH_END_FRACTION,
        fast_momentum: Optional[float] = None,
        slow_momentum: Optional[float] = None,
        threshold: float = 0.995,
        sharpness: float = 1.0,
        initial_slow: float = 2.0,
        initial_fast: float = 1.0,
        end_step: Optional[int] = None,
    ):
        scaled_slow, scaled_fast = 0.99, 0.999
        if total_steps is not None:
            total_steps = check_steps(total_steps, "total_steps")
            if not 0.0 < min_switch_fraction <= 1.0:
                raise ValueError(f"min_switch_fraction must be in (0, 1], got {min_switch_fraction}.")
            end_step = planned_end(total_steps, end_fraction, end_step, earliest=min_switch_fraction)
            t_min = max(1.0, min_switch_fraction * total_steps)
            scaled_slow = min(0.99, 0.005 ** (1.0 / t_min))
            scaled_fast = 1.0 - (1.0 - scaled_slow) / 10.0
        super().__init__(end_step)
        self.total_steps = total_steps
        self.fast_momentum = float(scaled_fast if fast_momentum is None else fast_momentum)
        self.slow_momentum = float(scaled_slow if slow_momentum is None else slow_momentum)
        for name, m in (("fast_momentum", self.fast_momentum), ("slow_momentum", self.slow_momentum)):
            if not 0.0 <= m < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {m}.")
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}.")
        self.threshold = float(threshold)
        self.sharpness = float(sharpness)
        self.loss_slow = float(initial_slow)
        self.loss_fast = float(initial_fast)

    def _advance(self, loss_rela: Optional[float]) -> None:
        l_c = _check_loss(loss_rela, "Switch")
        self.loss_fast = self.fast_momentum * self.loss_fast + (1.0 - self.fast_momentum) * l_c
        self.loss_slow = self.slow_momentum * self.loss_slow + (1.0 - self.slow_momentum) * self.loss_fast
        if math.exp(-max(self.loss_slow - self.loss_fast, 0.0) * self.sharpness) >= self.threshold:
            self.value, self.finished = 0.0, True


class Constant(Schedule):
    """A fixed lambda (ablations; ``Constant(1.0)`` is pure feature regression onto the prior)."""

    _state_keys = Schedule._state_keys + ("lam",)

    def __init__(self, lam: float = 0.5, *, end_step: Optional[int] = None):
        super().__init__(end_step)
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {lam}.")
        self.lam = float(lam)
        if not self.finished:
            self.value = self.lam
            self.finished = self.lam == 0.0

    @property
    def needs_loss(self) -> bool:
        return False

    @property
    def ends_by(self) -> Optional[int]:
        return 0 if self.lam == 0.0 else self.end_step

    def _advance(self, loss_rela: Optional[float]) -> None:
        pass


class Epochs(Schedule):
    """lambda = 1 for the first ``fraction`` of the run, then 0 for good (the authors' ``--rela_conlam``).

    Give the run length as ``total_steps`` or as ``steps_per_epoch * epochs``; the switch happens after
    ``round(fraction * total_steps)`` optimiser steps.
    """

    _state_keys = Schedule._state_keys + ("switch_step",)

    def __init__(
        self,
        fraction: float,
        total_steps: Optional[int] = None,
        *,
        steps_per_epoch: Optional[int] = None,
        epochs: Optional[int] = None,
        end_step: Optional[int] = None,
    ):
        super().__init__(end_step)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}.")
        if total_steps is None:
            if steps_per_epoch is None or epochs is None:
                raise ValueError(
                    "Epochs needs the run length: pass total_steps=, or steps_per_epoch= and epochs= "
                    "(steps_per_epoch = len(dataloader) // accumulation_steps)."
                )
            total_steps = check_steps(steps_per_epoch, "steps_per_epoch") * check_steps(epochs, "epochs")
        self.total_steps = check_steps(total_steps, "total_steps")
        self.switch_step = int(round(fraction * self.total_steps))
        if self.switch_step == 0:
            self.value, self.finished = 0.0, True

    @property
    def needs_loss(self) -> bool:
        return False

    @property
    def ends_by(self) -> Optional[int]:
        return self.switch_step if self.end_step is None else min(self.switch_step, self.end_step)

    def _advance(self, loss_rela: Optional[float]) -> None:
        if self.steps >= self.switch_step:
            self.value, self.finished = 0.0, True


SCHEDULES = {"decay": Decay, "switch": Switch, "constant": Constant, "epochs": Epochs}
#: the schedule ReLA uses when none is given and your loss is a callable: ``Switch`` planned for the run (lambda 1, the
#: cheap phase: your loss skipped; then 0 for good by :data:`SWITCH_END_FRACTION` of the run, your loss carrying the
#: rest), chosen at equal compute (docs: "Schedules")
DEFAULT_SCHEDULE = "switch"
#: the schedule ReLA uses when none is given and your loss is computed before ``wrap`` (a tensor): such a step pays the
#: full price whatever lambda is, so holding lambda at 1 would only throw your loss's gradient away (a supervised
#: classifier untrained for most of the run); ``Decay`` mixes your loss in from the first step, the better schedule at
#: equal steps (docs: "Schedules at equal steps")
EAGER_DEFAULT_SCHEDULE = "decay"
#: the one grammar of a schedule spec, for Python, every CLI verb and the solo-learn ``cfg.rela.schedule``
SPEC_GRAMMAR = "'switch', 'switch:<end fraction>', 'decay', 'constant:<lambda>' or 'epochs:<fraction>'"
_VALUE = {"constant": "lam", "epochs": "fraction", "switch": "end_fraction"}  # what ':<value>' sets


def list_schedules() -> list[str]:
    """Names accepted by :func:`create_schedule`."""
    return sorted(SCHEDULES)


def _base(spec: str | None) -> str:
    """The schedule name of a spec: ``"Epochs:0.5"`` -> ``"epochs"``; ``None`` -> the default (:data:`DEFAULT_SCHEDULE`)."""
    return str(spec or DEFAULT_SCHEDULE).lower().partition(":")[0]


def takes_run_length(spec: str | None) -> bool:
    """Whether the schedule named by ``spec`` is planned with ``total_steps`` (``Decay``, ``Switch``, ``Epochs``)."""
    return _base(spec) in ("decay", "switch", "epochs")


def needs_run_length(spec: str | None) -> bool:
    """Whether it cannot run at all without ``total_steps`` (``Epochs``)."""
    return _base(spec) == "epochs"


def create_schedule(spec: str | Schedule | None = None, *, total_steps: Optional[int] = None, **kwargs) -> Schedule:
    """Build a controller from a spec: ``"switch"`` (default, :data:`DEFAULT_SCHEDULE`; ``"switch:<f>"``: the planned
    hand-over at fraction f of the run), ``"decay"``, ``"constant:<lambda>"`` (0.5 without a value) or
    ``"epochs:<fraction>"``; ``total_steps`` plans those that take the run length (ignored by
    ``Constant``); other keyword arguments go to the class (``end_step=`` to every one). A :class:`Schedule` instance
    is returned as is."""
    if isinstance(spec, Schedule):
        if kwargs or total_steps is not None:
            raise ValueError("create_schedule got a Schedule instance and keyword arguments; pass one or the other.")
        return spec
    text = DEFAULT_SCHEDULE if spec is None else str(spec)
    base, sep, value = text.lower().partition(":")
    if base not in SCHEDULES:
        raise ValueError(f"Unknown schedule {text!r}; use {SPEC_GRAMMAR}, or pass a Schedule instance.")
    if sep:
        if base not in _VALUE:
            raise ValueError(f"Schedule {base!r} takes no ':<value>' (got {text!r}); use {SPEC_GRAMMAR}.")
        try:
            kwargs[_VALUE[base]] = float(value)
        except ValueError:
            raise ValueError(f"Schedule {text!r}: {value!r} is not a number; use {SPEC_GRAMMAR}.") from None
    if base == "epochs" and "fraction" not in kwargs:
        raise ValueError(f"The epochs schedule needs the fraction of the run with lambda = 1: 'epochs:<fraction>' "
                         f"(e.g. 'epochs:0.5'), got {text!r}.")
    if total_steps is not None and takes_run_length(base):
        kwargs["total_steps"] = check_steps(total_steps, "total_steps")
    return SCHEDULES[base](**kwargs)
