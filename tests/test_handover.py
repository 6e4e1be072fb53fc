"""The hand-over (rela/handover.py): each of its parts runs at the optimiser step where lambda reaches 0, and only
then: the momentum copies reset to the online modules, the backbone frozen while the heads warm up, the learning rate
re-warmed (and restored for the scheduler), the callbacks called once; through a closure too (Lightning's way), and
across a checkpoint."""

import copy

import pytest
import torch
from torch import nn

from accelerate_ssl.rela import Handover, ReLA
from accelerate_ssl.schedules import Epochs

N, D_IN, D_T, SWITCH = 32, 6, 5, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(D_IN, 8), nn.ReLU(), nn.Linear(8, 4))
        self.head = nn.Linear(4, 3)
        self.backbone_momentum = copy.deepcopy(self.backbone).requires_grad_(False)


def setup(momentum=False, **handover):
    net = Net()
    rows = torch.randn(N, D_T, generator=torch.Generator().manual_seed(1))
    hand = Handover(momentum=[(net.backbone, net.backbone_momentum)] if momentum else (), **{"warm_heads": 0, **handover})
    rela = ReLA(rows, net.backbone, schedule=Epochs(SWITCH / 10, total_steps=10), feature_dim=4, handover=hand,
                witness=False)
    opt = torch.optim.AdamW([*net.backbone.parameters(), *net.head.parameters(), *rela.parameters()], lr=1e-2)
    return net, rela, opt


def one_step(net, rela, opt, step, closure=False):
    x = torch.randn(8, D_IN, generator=torch.Generator().manual_seed(100 + step))
    idx = torch.arange(8) + (step % 3) * 8

    def loss_fn():
        out = net.head(net.backbone(x))
        return rela.wrap(lambda: out.pow(2).mean(), index=idx)

    if closure:
        def closure_fn():
            opt.zero_grad()
            loss = loss_fn()
            loss.backward()
            return loss
        opt.step(closure_fn)
    else:
        opt.zero_grad()
        loss_fn().backward()
        opt.step()


def snapshot(module):
    return [p.detach().clone() for p in module.parameters()]


def moved(before, module):
    return any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))


def test_momentum_copy_reset_exactly_at_the_switch():
    net, rela, opt = setup(momentum=True)
    for step in range(SWITCH):
        assert rela.handover.switched_at is None
        one_step(net, rela, opt, step)
        online = [p for p in net.backbone.parameters()]
        same = all(torch.equal(a, b) for a, b in zip(online, net.backbone_momentum.parameters()))
        assert same == (step + 1 == SWITCH), f"step {step}: the copy must be reset at the switch, not before"
    assert rela.handover.switched_at == SWITCH and rela.lam == 0.0


def test_backbone_frozen_while_heads_warm_then_trains():
    net, rela, opt = setup(warm_heads=2)
    for step in range(SWITCH):
        one_step(net, rela, opt, step)
    for k in range(2):  # the two warm-up steps: the head learns, the backbone does not move
        bb, head = snapshot(net.backbone), snapshot(net.head)
        one_step(net, rela, opt, SWITCH + k)
        assert not moved(bb, net.backbone), f"the backbone moved at warm-up step {k}"
        assert moved(head, net.head)
    bb = snapshot(net.backbone)
    one_step(net, rela, opt, SWITCH + 2)
    assert moved(bb, net.backbone), "after the warm-up the backbone trains again"


def test_backbone_frozen_through_a_closure():
    net, rela, opt = setup(warm_heads=1)
    for step in range(SWITCH):
        one_step(net, rela, opt, step, closure=True)
    bb, head = snapshot(net.backbone), snapshot(net.head)
    one_step(net, rela, opt, SWITCH, closure=True)
    assert not moved(bb, net.backbone) and moved(head, net.head)


class RecordingAdamW(torch.optim.AdamW):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def step(self, closure=None):
        self.seen.append(self.param_groups[0]["lr"])
        return super().step(closure)


def test_learning_rate_rewarmed_after_the_warm_up_and_restored_for_the_scheduler():
    net, rela, _ = setup(warm_heads=1, rewarm=3)
    opt = RecordingAdamW([*net.backbone.parameters(), *net.head.parameters(), *rela.parameters()], lr=0.1)
    for step in range(SWITCH + 6):
        one_step(net, rela, opt, step)
        assert opt.param_groups[0]["lr"] == 0.1, "the scheduler's value is back after every step"
    # before the switch and during the warm-up: the lr as set; then 1/4, 2/4, 3/4 of it; then all of it again
    assert opt.seen == pytest.approx([0.1] * SWITCH + [0.1, 0.025, 0.05, 0.075, 0.1, 0.1])


def test_callbacks_called_once_at_the_switch():
    net, rela, opt = setup()
    calls = []
    rela.on_handover(lambda: calls.append(rela.steps))
    for step in range(SWITCH + 3):
        one_step(net, rela, opt, step)
    assert calls == [SWITCH]


def test_state_survives_a_checkpoint():
    net, rela, opt = setup(warm_heads=3)
    for step in range(SWITCH + 1):
        one_step(net, rela, opt, step)
    state = rela.state_dict()
    assert state["handover"]["switched_at"] == SWITCH
    net2, rela2, opt2 = setup(warm_heads=3)
    rela2.load_state_dict(state)
    net2.load_state_dict(net.state_dict())
    bb = snapshot(net2.backbone)
    one_step(net2, rela2, opt2, SWITCH + 1)  # the second warm-up step of the resumed run
    assert not moved(bb, net2.backbone)


@pytest.mark.parametrize("spec, expected", [
    ("none", (0, 0, 0)), (None, (0, 0, 0)), ("warm-heads=20", (0, 20, 0)), ("momentum,rewarm=5", (1, 0, 5)),
    ("Momentum, warm-heads=2, rewarm=3", (1, 2, 3)), ("momentum,warm-heads=auto", (1, 10, 0)),
])
def test_spec_does_what_it_says(spec, expected):
    """A part the spec does not name is off; ``warm-heads=auto`` is the planned default (5 % of a 200-step run)."""
    net = Net()
    h = Handover.from_spec(spec, momentum=[(net.backbone, net.backbone_momentum)])
    h.plan(200)
    assert (len(h.momentum), h.warm_heads, h.rewarm) == expected


def test_the_default_warms_the_heads_when_the_schedule_skipped_them():
    """A planned run whose schedule skipped your loss before the switch (lambda 1: switch, the default, and epochs)
    warms your heads for 5 % of it; one that mixed your loss in all along (decay) has warm heads already: no warm-up."""
    net = Net()
    rows = torch.randn(N, D_T)
    make = lambda **kw: ReLA(rows, net.backbone, feature_dim=4, witness=False, **kw)  # noqa: E731
    assert make(schedule="switch", total_steps=400).handover.warm_heads == 20
    assert make(schedule="epochs:0.3", total_steps=400).handover.warm_heads == 20
    assert make(total_steps=400).handover.warm_heads == 20  # the default, switch
    assert make(schedule="decay", total_steps=400).handover.warm_heads == 0  # lambda <= 0.8: your loss trained the heads
    assert make(schedule="switch").handover.warm_heads == 0  # no run length: none
    rela = make(schedule="switch")
    rela.set_total_steps(1000)  # (Lightning's callback plans the run this way)
    assert rela.handover.warm_heads == 50
    assert make(schedule="switch", total_steps=400, handover=Handover(warm_heads=3)).handover.warm_heads == 3  # kept


@pytest.mark.parametrize("spec", ["warm-heads", "momentum=3", "rewarm=-1", "heads=2", "rewarm=2,rewarm=3",
                                  "rewarm=auto", "warm-heads=1,warm-heads=2"])
def test_bad_spec_names_the_grammar(spec):
    with pytest.raises(ValueError, match="warm-heads=<steps>"):
        Handover.from_spec(spec)


def test_bad_arguments():
    with pytest.raises(ValueError, match="optimiser steps >= 0"):
        Handover(warm_heads=-1)
    with pytest.raises(TypeError, match="module pairs"):
        Handover(momentum=[nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="not a copy"):
        Handover(momentum=[(nn.Linear(2, 2), nn.Linear(3, 2))])
    with pytest.raises(TypeError, match="takes a Handover"):
        ReLA(torch.randn(N, D_T), Net().backbone, feature_dim=4, handover="momentum")
