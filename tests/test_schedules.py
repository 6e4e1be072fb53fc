"""Each controller against its recurrence written independently from the paper's text."""

import math

import pytest

from accelerate_ssl.schedules import Constant, Decay, Epochs, Switch, create_schedule


def _losses(n=6000):
    # a ReLA loss that falls quickly, then plateaus with small wiggles
    return [0.3 + 0.7 * math.exp(-t / 80) + 0.01 * math.sin(t / 3) for t in range(n)]


def test_decay_matches_paper_001_alg1():
    # ReLA v2 App. L, Alg. 1 as printed: l_m=2.0, rho_m=0.0
    l_m, rho_m, expected = 2.0, 0.0, []
    for l_c in _losses():
        rho = math.exp(-max(l_m - l_c, 0) * 40)
        rho_m = 0.95 * rho_m + 0.05 * rho
        l_m = 0.999 * l_m + 0.001 * l_c
        expected.append(0.8 - rho_m * 0.8)
    d = Decay()
    assert d.value == pytest.approx(0.8)
    got = [d.step(l) for l in _losses()]
    assert got == pytest.approx(expected, abs=1e-12)
    assert got[-1] < got[100] <= 0.8 and not d.finished


def test_decay_total_steps_reaches_low_lambda_within_run():
    losses = _losses(400)
    paper, scaled = Decay(), Decay(total_steps=400)
    for l in losses:
        paper.step(l), scaled.step(l)
    assert paper.value > 0.7  # the paper's constants barely move in 400 steps
    assert scaled.value < 0.35


def test_decay_finish_below():
    d = Decay(total_steps=1000, finish_below=0.2)
    for l in _losses(1000):
        d.step(l)
    assert d.finished and d.value == 0.0


def test_switch_matches_paper_000_appJ():
    # ReLA v1 App. J: l_s=2.0, l_f=1.0, lambda=1; while lambda == 1: update; exp(-max(l_s-l_f,0)) >= 0.995 -> 0
    l_s, l_f, lam, expected = 2.0, 1.0, 1.0, []
    for l_c in _losses():
        if lam == 1:
            l_f = 0.999 * l_f + 0.001 * l_c
            l_s = 0.99 * l_s + 0.01 * l_f
        if math.exp(-max(l_s - l_f, 0)) >= 0.995:
            lam = 0.0
        expected.append(lam)
    s = Switch()
    got = [s.step(l) for l in _losses()]
    assert got == expected
    first_zero = got.index(0.0)
    assert first_zero >= 500  # "can never switch before ~500 steps"
    assert s.finished


def test_switch_flat_loss_earliest_and_scaled():
    s = Switch()
    n = 0
    while not s.finished:
        s.step(1.0)
        n += 1
    assert 500 <= n <= 560
    s = Switch(total_steps=200, min_switch_fraction=0.25)
    n = 0
    while not s.finished:
        s.step(1.0)
        n += 1
    assert 40 <= n <= 60


def test_constant_and_epochs():
    c = Constant(0.3)
    assert [c.step(1.0) for _ in range(3)] == [0.3] * 3 and not c.finished
    assert Constant(0.0).finished
    e = Epochs(0.25, steps_per_epoch=10, epochs=4)
    seen = [e.value]
    for _ in range(12):
        seen.append(e.step())
    # lambda used at step t is the value before stepping: exactly 10 steps at lambda 1
    assert seen[:10] == [1.0] * 10 and seen[10:] == [0.0] * 3 and e.finished
    with pytest.raises(ValueError, match="run length"):
        Epochs(0.5)


@pytest.mark.parametrize("make", [Decay, Switch, lambda: Constant(0.4), lambda: Epochs(0.5, 100)])
def test_state_dict_roundtrip(make):
    a, b = make(), make()
    for l in _losses(300)[:150]:
        a.step(l)
    b.load_state_dict(a.state_dict())
    rest = _losses(300)[150:]
    assert [a.step(l) for l in rest] == [b.step(l) for l in rest]


def test_bad_inputs():
    with pytest.raises(ValueError, match="non-finite"):
        Decay().step(float("nan"))
    with pytest.raises(ValueError, match="Unknown schedule"):
        create_schedule("cosine")
    with pytest.raises(KeyError, match="different controller"):
        Decay().load_state_dict(Switch().state_dict())
    assert isinstance(create_schedule("switch", total_steps=100), Switch)


def test_one_spec_grammar():
    from accelerate_ssl.schedules import Constant, Decay, Epochs, Switch, create_schedule

    assert isinstance(create_schedule(None), Switch) and create_schedule("Decay", total_steps=100).loss_momentum < 0.999
    assert create_schedule("switch:0.75", total_steps=100).ends_by == 75  # ':<value>' sets the planned hand-over
    assert create_schedule("constant:0.3").value == pytest.approx(0.3) and create_schedule("constant").value == 0.5
    assert isinstance(create_schedule("constant:0.3", total_steps=10), Constant)  # the run length is not its business
    e = create_schedule("epochs:0.25", total_steps=40)
    assert isinstance(e, Epochs) and e.switch_step == 10
    for bad, words in [("cosine", "Unknown schedule 'cosine'; use 'switch', 'switch:<end fraction>', 'decay', "
                                  "'constant:<lambda>'"),
                       ("decay:3", "takes no ':<value>'"), ("switch:3", "end_fraction must be in"),
                       ("constant:high", "'high' is not a number"),
                       ("epochs", "needs the fraction.*'epochs:<fraction>'")]:
        with pytest.raises(ValueError, match=words):
            create_schedule(bad, total_steps=10)


def test_rela_takes_the_spec_and_epochs_waits_for_its_run_length():
    import torch
    from torch import nn

    from accelerate_ssl import ReLA

    rows = torch.randn(16, 4)
    rela = ReLA(rows, nn.Linear(3, 4), feature_dim=4, schedule="epochs:0.5")
    with pytest.raises(ValueError, match="'epochs:0.5' schedule needs the run length.*total_steps="):
        rela.wrap(torch.zeros(()), features=torch.randn(2, 4), index=torch.tensor([0, 1]))
    rela.set_total_steps(20)
    assert type(rela.schedule).__name__ == "Epochs" and rela.schedule.switch_step == 10
    assert ReLA(rows, nn.Linear(3, 4), feature_dim=4, schedule="epochs:0.5", total_steps=8).schedule.switch_step == 4
    with pytest.raises(ValueError, match="Unknown schedule"):
        ReLA(rows, nn.Linear(3, 4), feature_dim=4, schedule="epoch:0.5")


# ------------------------------------------------------------------------------------------ a planned end
@pytest.mark.parametrize("make, before", [
    (lambda end: Decay(total_steps=100, end_fraction=None, end_step=end), "rule"),
    (lambda end: Switch(total_steps=100, end_fraction=None, end_step=end), "rule"),
    (lambda end: Constant(0.4, end_step=end), [0.4] * 6),
    (lambda end: Epochs(0.9, 100, end_step=end), [1.0] * 6),
])
def test_end_step_ends_every_schedule_at_that_step(make, before):
    """Decay never finishes by itself and Switch only when the loss converges (not within 7 falling steps): end_step=7
    ends each for good after its 7th optimiser step, lambda 0 from the 8th, and leaves the rule alone before."""
    plain, ended = make(None), make(7)
    losses = _losses(12)
    got = [ended.value] + [ended.step(l) for l in losses]
    rule = [plain.value] + [plain.step(l) for l in losses]
    assert got[:7] == rule[:7] and (before == "rule" or got[:6] == before)
    assert all(v > 0 for v in got[:7]) and got[7:] == [0.0] * 6 and ended.finished and ended.ends_by == 7
    assert not plain.finished and plain.ends_by == (90 if isinstance(plain, Epochs) else None)
    assert "end_step=7" in repr(ended)


def test_a_planned_switch_hands_over_by_its_end_fraction_whatever_the_losses():
    """The rule alone may never fire in a short run (a ReLA loss still falling); planned for total_steps, the switch
    comes at the latest at end_fraction of it (default SWITCH_END_FRACTION). An explicit end_step wins; None: the rule
    only."""
    from accelerate_ssl.schedules import SWITCH_END_FRACTION

    falling = [1.0 - 0.004 * t for t in range(120)]  # never flat enough for the rule
    s = Switch(total_steps=100)
    end = round(SWITCH_END_FRACTION * 100)
    lams = [s.step(l) for l in falling[:100]]
    assert lams[:end - 1] == [1.0] * (end - 1) and lams[end - 1:] == [0.0] * (101 - end) and s.finished
    assert s.ends_by == end
    assert Switch(total_steps=100, end_fraction=0.8).ends_by == 80
    assert Switch(total_steps=100, end_step=30).ends_by == 30
    rule_only = Switch(total_steps=100, end_fraction=None)
    assert [rule_only.step(l) for l in falling] == [1.0] * 120 and rule_only.ends_by is None
    assert Switch().ends_by is None  # not planned: the paper's rule as printed
    with pytest.raises(ValueError, match="end_fraction must be in"):
        Switch(total_steps=100, min_switch_fraction=0.5, end_fraction=0.3)  # before the rule's earliest switch
    # Decay planned for a run hands over by the same fraction; unplanned, or end_fraction=None: the paper's rule
    d = Decay(total_steps=100)
    assert [d.step(l) for l in falling[:60]][49:] == [0.0] * 11 and d.ends_by == 50
    assert Decay().ends_by is None and Decay(total_steps=100, end_fraction=None).ends_by is None


def test_end_step_edge_cases_spec_and_resume():
    assert Epochs(0.2, 100, end_step=50).ends_by == 20 and Epochs(0.5, 100, end_step=10).ends_by == 10
    assert Constant(0.0).ends_by == 0 and Decay(end_step=0).finished and Decay(end_step=0).value == 0.0
    for bad in (-1, 2.5, True, "10"):
        with pytest.raises(ValueError, match="end_step is a number of optimiser steps, an int >= 0"):
            Decay(end_step=bad)
    d = create_schedule("decay", total_steps=100, end_step=5)
    assert isinstance(d, Decay) and d.end_step == 5 and create_schedule("epochs:0.5", total_steps=8, end_step=3).ends_by == 3
    # end_step is this run's plan, not saved state: a run resumed past its end is over
    a = Decay(total_steps=100)
    for l in _losses(9):
        a.step(l)
    b = Decay(total_steps=100, end_step=8)
    b.load_state_dict(a.state_dict())
    assert b.finished and b.value == 0.0 and b.steps == 9


def test_rela_end_step_under_the_default_schedule_and_the_mixing_policy():
    import torch
    from torch import nn

    from accelerate_ssl import ReLA

    rows = torch.randn(32, 4)
    backbone = nn.Linear(3, 4)
    rela = ReLA(rows, backbone, feature_dim=4, n_components=None, total_steps=40, end_step=3, witness=False)
    assert type(rela.schedule).__name__ == "Switch" and rela.end_step == 3 and rela.mixing_policy() == "hold"
    opt = torch.optim.SGD(backbone.parameters(), lr=0.1)
    for s in range(5):
        out = backbone(torch.randn(4, 3))
        loss = rela.wrap(out.pow(2).mean(), index=torch.arange(4 * s, 4 * s + 4))
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert rela.stats["finished"] == (s >= 2) and (rela.stats["lambda"] == 0.0) == (s >= 3)  # this wrap's lambda
    assert rela.mixing_policy() == "allow" and rela.steps == 5
    rela.set_total_steps(80)  # a later plan keeps the end
    assert rela.schedule.end_step == 3 and rela.schedule.finished
    assert ReLA(rows, nn.Linear(3, 4), feature_dim=4, total_steps=40, witness=False).mixing_policy() == "hold"  # by 36
    assert ReLA(rows, nn.Linear(3, 4), feature_dim=4, witness=False).mixing_policy() == "refuse"  # no planned end
    assert ReLA(rows, nn.Linear(3, 4), feature_dim=4, schedule=Decay(total_steps=40, end_fraction=None),
                witness=False).mixing_policy() == "refuse"  # the paper's decay: never 0 by itself
    assert ReLA(rows, nn.Linear(3, 4), feature_dim=4, schedule="epochs:0.5", total_steps=40,
                witness=False).mixing_policy() == "hold"
    with pytest.raises(ValueError, match=r"pass end_step=3 to it instead, e.g. Decay\(..., end_step=3\)"):
        ReLA(rows, nn.Linear(3, 4), feature_dim=4, schedule=Decay(), end_step=3)


# ------------------------------------------------------------------------------------------ the default, by loss form
def _default_rela(**kw):
    import torch
    from torch import nn

    from accelerate_ssl import ReLA

    backbone = nn.Linear(3, 4)
    rows = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))  # the same store for every ReLA
    return ReLA(rows, backbone, feature_dim=4, n_components=None, witness=False, **kw), backbone


def _steps(rela, backbone, n, as_callable, calls, start=0):
    import torch

    opt = torch.optim.SGD([*backbone.parameters(), *rela.parameters()], lr=0.1)
    for s in range(start, start + n):
        x = torch.randn(4, 3)

        def loss():
            calls.append(s)
            return backbone(x).pow(2).mean()

        out = rela.wrap(loss if as_callable else loss(), index=torch.arange(4 * s, 4 * s + 4) % 64,
                        inputs=x if as_callable else None)
        out.backward()
        opt.step()
        opt.zero_grad()


def test_the_default_is_settled_by_the_first_wraps_loss_form():
    """No schedule given: a callable loss gets switch (planned end 0.9 of the run; the loss not called while lambda is
    1), a loss computed before wrap gets decay planned for the same run (its step costs the same whatever lambda is: the
    user's loss mixed in from the first step, no warm-up of heads that were trained all along)."""
    from accelerate_ssl.schedules import SWITCH_END_FRACTION

    rela, backbone = _default_rela(total_steps=20)
    assert type(rela.schedule).__name__ == "Switch"  # before any wrap: the callable form's
    calls = []
    _steps(rela, backbone, 3, True, calls)
    assert type(rela.schedule).__name__ == "Switch" and rela.schedule.end_step == round(SWITCH_END_FRACTION * 20)
    assert calls == [] and rela.stats["lambda"] == 1.0  # the cheap step: the loss never called

    rela, backbone = _default_rela(total_steps=20)
    calls = []
    _steps(rela, backbone, 3, False, calls)
    assert type(rela.schedule).__name__ == "Decay" and rela.schedule.end_step == 10  # 0 by half the run
    assert 0 < rela.stats["lambda"] < 1  # mixed from the first step
    assert rela.handover.warm_heads == 0
    # a schedule given by name is kept whatever the loss form
    rela, backbone = _default_rela(total_steps=20, schedule="switch")
    _steps(rela, backbone, 2, False, [])
    assert type(rela.schedule).__name__ == "Switch" and rela.stats["lambda"] == 1.0


def test_the_settled_default_resumes_from_a_checkpoint_and_is_planned_by_set_total_steps():
    """A fresh ReLA without a schedule loads the checkpoint of an eager run (decay) as decay, before any wrap; a run
    length given later (Lightning's set_total_steps) plans the settled schedule."""
    rela, backbone = _default_rela(total_steps=20)
    _steps(rela, backbone, 4, False, [])
    state = rela.state_dict()
    again, backbone2 = _default_rela(total_steps=20)
    backbone2.load_state_dict(backbone.state_dict())
    again.load_state_dict(state)
    assert type(again.schedule).__name__ == "Decay" and again.schedule.state_dict() == rela.schedule.state_dict()
    _steps(again, backbone2, 1, True, [], start=4)  # a callable now does not undo the run's schedule
    assert type(again.schedule).__name__ == "Decay" and again.steps == 5

    late, backbone = _default_rela()
    _steps(late, backbone, 1, False, [])  # decay without a run length: the papers' constants, warned
    late.set_total_steps(30)
    assert type(late.schedule).__name__ == "Decay" and late.schedule.end_step == 15


# ------------------------------------------------------------------------------------------ the run's plan, checked
def _rela(**kw):
    import torch
    from torch import nn

    from accelerate_ssl import ReLA

    return ReLA(torch.randn(64, 4), nn.Linear(3, 4), feature_dim=4, n_components=None, witness=False,
                alignment_check=False, **kw)


@pytest.mark.parametrize("make, name", [
    (lambda v: _rela(total_steps=v), "total_steps"),
    (lambda v: _rela(total_steps=40, end_step=v), "end_step"),
    (lambda v: _rela(sync_every=v), "sync_every"),
    (lambda v: _rela(schedule="epochs:0.5").set_total_steps(v), "total_steps"),
    (lambda v: Decay(total_steps=v), "total_steps"),
    (lambda v: Switch(total_steps=v), "total_steps"),
    (lambda v: Epochs(0.5, total_steps=v), "total_steps"),
    (lambda v: Epochs(0.5, steps_per_epoch=v, epochs=3), "steps_per_epoch"),
    (lambda v: create_schedule("decay", total_steps=v), "total_steps"),
])
@pytest.mark.parametrize("bad", [True, False, 40.0, 2.5, "40"])
def test_bools_and_non_integers_are_refused_as_step_counts(make, name, bad):
    """Before: total_steps=True was a one-step run (True == 1) and 40.7 was rounded down silently."""
    with pytest.raises(ValueError, match=rf"{name} is a number of optimiser steps, an int >= [01]; got {bad!r} "
                                         rf"\(a {type(bad).__name__}\)"):
        make(bad)


def test_whole_step_counts_of_any_integer_type_are_taken():
    import numpy as np

    rela = _rela(total_steps=np.int64(40), end_step=np.int32(10), sync_every=np.int64(2))
    assert rela.schedule.end_step == 10 and rela.sync_every == 2 and type(rela.sync_every) is int
    assert Decay(total_steps=np.int64(100)).total_steps == 100 and Epochs(0.5, 10).total_steps == 10


def test_a_schedule_planned_for_another_run_length_than_total_steps_is_refused_with_both_numbers():
    """Before: Decay(total_steps=1000) passed to ReLA(total_steps=40) silently planned the hand-over of a 1000-step
    run (lambda ~0.8 at the end of the 40 steps)."""
    with pytest.raises(ValueError, match=r"ReLA\(total_steps=40\) and your Decay schedule, planned for 1000 optimiser "
                                         r"steps.*Decay\(total_steps=40, \.\.\.\).*schedule='decay'"):
        _rela(schedule=Decay(total_steps=1000), total_steps=40)
    rela = _rela(schedule=Switch(total_steps=1000))
    with pytest.raises(ValueError, match=r"rela\.set_total_steps\(40\) and your Switch schedule, planned for 1000"):
        rela.set_total_steps(40)  # as Lightning's callback plans it
    assert _rela(schedule=Decay(total_steps=40), total_steps=40).schedule.total_steps == 40  # they agree
    assert _rela(schedule=Decay(), total_steps=40).schedule.total_steps is None  # not planned: nothing to disagree
    with pytest.raises(ValueError, match=r"ReLA\(total_steps=40\) but your Decay schedule ends ReLA's term after "
                                         r"optimiser step 100: after the run's last step"):
        _rela(schedule=Decay(end_step=100), total_steps=40)
    with pytest.raises(ValueError, match=r"ReLA\(end_step=100\) is after the run's last step \(total_steps=40\)"):
        _rela(total_steps=40, end_step=100)
    assert _rela(total_steps=40, end_step=40).end_step == 40


def _train(rela, steps: int):
    import torch

    backbone = rela.backbone
    opt = torch.optim.SGD([*backbone.parameters(), *rela.parameters()], lr=0.01)
    g = torch.Generator().manual_seed(0)
    for s in range(steps):
        out = backbone(torch.randn(8, 3, generator=g))
        loss = rela.wrap(out.pow(2).mean(), index=torch.arange(8 * (s % 8), 8 * (s % 8) + 8))
        opt.zero_grad()
        loss.backward()
        opt.step()


def _notices(record) -> list[str]:
    return [str(w.message) for w in record if type(w.message).__name__ == "HandoverWarning"]


def test_a_loop_that_stops_long_before_total_steps_gets_one_notice_at_its_end():
    """Before: 10 steps of a run planned for 1000 ended at lambda ~0.8 (distillation) without a word. The end of a loop
    that stops early is when ReLA is closed: rela.close(), its garbage collection, or the interpreter's exit."""
    import gc
    import warnings

    rela = _rela(total_steps=1000)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _train(rela, 10)
        assert _notices(record) == []  # nothing while it trains
        lam = rela.lam
        rela.close()
        rela.close()
        del rela
        gc.collect()
    (notice,) = _notices(record)  # once
    assert lam > 0.5 and (f"the run ended after 10 of its planned 1000 optimiser steps (total_steps=1000) with lambda "
                          f"still {lam:.2f}") in notice and "your own loss never took over" in notice
    with warnings.catch_warnings(record=True) as record:  # garbage collection alone says it too
        warnings.simplefilter("always")
        unplanned = _rela()
        _train(unplanned, 3)
        del unplanned
        gc.collect()
    assert len(_notices(record)) == 1 and "was not told the run length" in _notices(record)[0]


def test_a_run_that_reaches_total_steps_with_lambda_high_is_told_at_that_step():
    import warnings

    rela = _rela(schedule=Decay(total_steps=20, end_fraction=None), total_steps=20)  # the paper's rule: no planned end
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _train(rela, 19)
        assert _notices(record) == []
        _train(rela, 1)
        assert len(_notices(record)) == 1  # at the 20th step, not at close
        rela.close()
    (notice,) = _notices(record)
    assert f"reached its planned end (total_steps=20) with lambda still {rela.lam:.2f}" in notice


@pytest.mark.parametrize("kw", [{"total_steps": 20}, {"total_steps": 40, "end_step": 5},
                                {"schedule": "constant:0.5", "total_steps": 1000}])
def test_no_notice_for_a_run_that_handed_over_or_a_fixed_lambda(kw):
    import warnings

    rela = _rela(**kw)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _train(rela, 12)
        rela.close()
    assert _notices(record) == []


def test_a_script_that_ends_before_its_plan_is_told_once_at_exit(tmp_path):
    import subprocess
    import sys

    from processes import cpu_process_env

    script = tmp_path / "short.py"
    script.write_text("import sys\nsys.path.insert(0, %r)\nfrom test_schedules import _rela, _train\n"
                      "rela = _rela(total_steps=500)\n_train(rela, 6)\nprint('loop done')\n"
                      % str(__import__("pathlib").Path(__file__).parent))
    done = subprocess.run([sys.executable, str(script)], env=cpu_process_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "loop done" and done.stderr.count("HandoverWarning") == 1, done.stderr[-2000:]
    assert "the run ended after 6 of its planned 500 optimiser steps" in done.stderr
