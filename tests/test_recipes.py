"""The training recipe: views, the loop's contract (checkpoints, resume, ReLA-only steps, bad losses), the
supervised objective, and the speed-up arithmetic read off probe curves."""

import pytest
import torch
from torch import nn

from accelerate_ssl.backbones import ConvNet
from accelerate_ssl.recipes import (BYOL, BYOL_VIEWS, Supervised, ViewConfig, mean_run, random_batches, random_views,
                                    speedup, steps_to_reach, tensor_batches, train_ssl)
from accelerate_ssl.rela import ReLA
from accelerate_ssl.schedules import Constant


def _byol(seed=0):
    torch.manual_seed(seed)
    backbone = ConvNet(widths=(4, 8))
    model = BYOL(backbone, backbone.feature_dim, hidden_dim=16, out_dim=8)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


IMAGES = torch.randn(64, 1, 12, 12, generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------------------------- views
def test_views_are_seeded_random_and_reject_unknown_padding():
    a = random_views(IMAGES[:8], BYOL_VIEWS, torch.Generator().manual_seed(0))
    b = random_views(IMAGES[:8], BYOL_VIEWS, torch.Generator().manual_seed(0))
    c = random_views(IMAGES[:8], BYOL_VIEWS, torch.Generator().manual_seed(1))
    assert a.shape == (8, 1, 12, 12) and torch.equal(a, b) and not torch.equal(a, c)
    # no jitter, border padding: a view only resamples the image, so it stays within the image's value range
    plain = ViewConfig(jitter=0.0, padding="border")
    v = random_views(IMAGES[:8], plain, torch.Generator().manual_seed(0))
    assert v.min() >= IMAGES[:8].min() - 1e-5 and v.max() <= IMAGES[:8].max() + 1e-5
    with pytest.raises(ValueError, match="padding"):
        ViewConfig(padding="reflect")


# ---------------------------------------------------------------------------------------------- the loop
def test_loop_probes_at_checkpoints_and_reports_every_step():
    model, opt = _byol()
    seen = []
    probed = []

    def count(backbone):
        probed.append(backbone)
        return float(len(probed))

    log = train_ssl(model, tensor_batches(IMAGES, random_batches(64, 16, torch.Generator().manual_seed(0))), 4,
                    optimizer=opt, view_generator=torch.Generator().manual_seed(2), checkpoints=[0, 2, 4], probe=count,
                    on_step=lambda step, loss: seen.append((step, loss)))
    assert [c["step"] for c in log["curve"]] == [0, 2, 4] and [c["top1"] for c in log["curve"]] == [1.0, 2.0, 3.0]
    assert all(b is model.backbone for b in probed)
    assert [s for s, _ in seen] == [1, 2, 3, 4] and all(isinstance(loss, float) for _, loss in seen)
    assert len(log["step_seconds"]) == 4 and log["lambda_per_step"] == []  # no ReLA: no lambda


def test_resumed_run_is_the_same_run():
    """Stop after 2 steps, save model + optimiser + generator, resume to 4: the weights equal a 4-step run."""
    straight, opt = _byol()
    g = torch.Generator().manual_seed(0)
    train_ssl(straight, tensor_batches(IMAGES, random_batches(64, 16, g)), 4, optimizer=opt, view_generator=g)

    first, opt = _byol()
    g = torch.Generator().manual_seed(0)
    train_ssl(first, tensor_batches(IMAGES, random_batches(64, 16, g)), 2, optimizer=opt, view_generator=g)
    state = {"model": first.state_dict(), "opt": opt.state_dict(), "gen": g.get_state()}
    resumed, opt = _byol(seed=99)  # other initial weights: everything must come from the saved state
    resumed.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    g = torch.Generator()
    g.set_state(state["gen"])
    train_ssl(resumed, tensor_batches(IMAGES, random_batches(64, 16, g)), 4, optimizer=opt, view_generator=g,
              start_step=2)
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b)


def test_rela_only_steps_never_compute_the_ssl_loss():
    model, opt = _byol()
    calls = []
    original = model.step_loss
    model.step_loss = lambda *a: (calls.append(1), original(*a))[1]
    rela = ReLA(torch.randn(64, 6), model.backbone, schedule=Constant(1.0), feature_dim=model.backbone.feature_dim)
    opt.add_param_group({"params": list(rela.parameters())})
    log = train_ssl(model, tensor_batches(IMAGES, random_batches(64, 16, torch.Generator().manual_seed(0))), 3,
                    optimizer=opt, view_generator=torch.Generator().manual_seed(2), rela=rela, rela_views="clean")
    rela.close()
    assert calls == [] and log["lambda_per_step"] == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="rela_views"):
        train_ssl(model, iter(()), 1, optimizer=opt, view_generator=torch.Generator(), rela_views="strong")


def _count_calls(model):
    """Record the online and momentum backbones' forward calls and every EMA update's momentum."""
    calls = {"online": 0, "momentum": 0, "ema": []}
    model.backbone.register_forward_hook(lambda *a: calls.__setitem__("online", calls["online"] + 1))
    model.backbone_momentum.register_forward_hook(lambda *a: calls.__setitem__("momentum", calls["momentum"] + 1))
    original = model.update_momentum
    model.update_momentum = lambda m: (calls["ema"].append(m), original(m))[1]
    return calls


@pytest.mark.parametrize("views", ["weak", "clean"])
def test_one_view_rela_step_skips_the_ssl_branch_then_resyncs_the_ema(views):
    """While lambda == 1 the default step (the README's recipe: the SSL loss a callable, ``wrap(..., inputs=)``)
    forwards one view and never runs the momentum network; its EMA update runs every step, as a user's loop runs it. At
    the switch the hand-over copies the student into it (``Handover(momentum=method.momentum_pairs())``), then BYOL runs
    as usual. Without that hand-over the momentum network is the EMA's, not the student."""
    from accelerate_ssl.rela import Handover
    from accelerate_ssl.schedules import Epochs

    for reset in (True, False):
        model, opt = _byol()
        calls = _count_calls(model)
        momentum0 = [p.clone() for p in model.backbone_momentum.parameters()]
        rela = ReLA(torch.randn(64, 6), model.backbone, schedule=Epochs(0.5, total_steps=4),
                    feature_dim=model.backbone.feature_dim,
                    handover=Handover(momentum=model.momentum_pairs() if reset else ()))
        opt.add_param_group({"params": list(rela.parameters())})
        batches = tensor_batches(IMAGES, random_batches(64, 16, torch.Generator().manual_seed(0)))
        log = train_ssl(model, batches, 2, optimizer=opt, view_generator=torch.Generator().manual_seed(2), rela=rela,
                        rela_views=views)
        assert log["lambda_per_step"] == [1.0, 1.0]
        assert calls == {"online": 2, "momentum": 0, "ema": [0.99, 0.99]}  # one forward per step, no momentum forward
        now = [(p, q) for online, copy_ in model.momentum_pairs() for p, q in zip(online.parameters(), copy_.parameters())]
        # the switch came after step 2: the copy is the student (then one EMA update of a copy with itself: rounding)
        assert all(torch.allclose(p, q, rtol=0, atol=1e-6) for p, q in now) == reset
        assert not all(torch.equal(a, b) for a, b in zip(momentum0, model.backbone_momentum.parameters()))  # EMA moved it
        assert len(log["step_cpu_seconds"]) == 2 and log["train_cpu_seconds"] > 0
        train_ssl(model, batches, 4, optimizer=opt, view_generator=torch.Generator().manual_seed(3), rela=rela,
                  rela_views=views, start_step=2, momentum=0.9)
        rela.close()
        assert calls["online"] == 2 + 2 * 2 and calls["momentum"] == 2 * 2  # the full method: two views, momentum targets
        assert calls["ema"] == [0.99, 0.99, 0.9, 0.9]  # the EMA of every step


def test_two_view_rela_step_keeps_the_old_behaviour():
    model, opt = _byol()
    calls = _count_calls(model)
    rela = ReLA(torch.randn(64, 6), model.backbone, schedule=Constant(1.0), feature_dim=model.backbone.feature_dim)
    opt.add_param_group({"params": list(rela.parameters())})
    train_ssl(model, tensor_batches(IMAGES, random_batches(64, 16, torch.Generator().manual_seed(0))), 3,
              optimizer=opt, view_generator=torch.Generator().manual_seed(2), rela=rela, rela_views="weak",
              rela_step="two-view", momentum=0.9)
    rela.close()
    assert calls == {"online": 6, "momentum": 0, "ema": [0.9, 0.9, 0.9]}
    with pytest.raises(ValueError, match="rela_step"):
        train_ssl(model, iter(()), 1, optimizer=opt, view_generator=torch.Generator(), rela_step="three-view")


def test_a_non_finite_loss_stops_the_run_naming_the_step():
    model, opt = _byol()
    model.step_loss = lambda features, views, index: features[0].sum() * float("nan")
    with pytest.raises(FloatingPointError, match="at step 0"):
        train_ssl(model, tensor_batches(IMAGES, random_batches(64, 16, torch.Generator())), 2, optimizer=opt,
                  view_generator=torch.Generator())


def test_supervised_learns_labels_and_needs_indices():
    torch.manual_seed(0)
    labels = (IMAGES.mean(dim=(1, 2, 3)) > 0).long()
    backbone = ConvNet(widths=(4, 8))
    model = Supervised(backbone, backbone.feature_dim, labels)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    loss = lambda: nn.functional.cross_entropy(model(IMAGES), labels).item()  # noqa: E731
    before = loss()
    train_ssl(model, tensor_batches(IMAGES, random_batches(64, 32, torch.Generator().manual_seed(0))), 30,
              optimizer=opt, view_generator=torch.Generator().manual_seed(0), views=ViewConfig(scale=(1.0, 1.0), flip=0.0, jitter=0.0))
    assert loss() < 0.7 * before
    with pytest.raises(ValueError, match="indices"):
        model.step_loss([backbone(IMAGES[:2])], [IMAGES[:2]], None)
    # a network that is a classifier already (its outputs are the logits): no extra head
    logits_net = nn.Sequential(ConvNet(widths=(4, 8)), nn.Linear(8, 2))
    direct = Supervised(logits_net, None, labels)
    assert isinstance(direct.classifier, nn.Identity) and torch.equal(direct(IMAGES[:3]), logits_net(IMAGES[:3]))


# ---------------------------------------------------------------------------------------------- curves
def test_steps_to_reach_interpolates_first_crossing():
    curve = [(0, 81.0), (100, 79.0), (200, 80.0), (400, 84.0), (800, 83.0)]
    assert steps_to_reach(curve, 82.0) == pytest.approx(300.0)  # halfway between 80 @200 and 84 @400
    assert steps_to_reach(curve, 80.5) == 0.0  # already there at step 0: no speed-up to claim
    assert steps_to_reach(curve, 84.0) == pytest.approx(400.0)
    assert steps_to_reach(curve, 90.0) is None


def test_speedup_ratio_and_lower_bound():
    curve = [(0, 70.0), (100, 72.0), (200, 74.0), (400, 78.0)]
    sp = speedup(curve, 76.0, budget=100)
    assert sp["steps_plain"] == pytest.approx(300.0) and sp["speedup"] == pytest.approx(3.0)
    assert not sp["lower_bound"]
    never = speedup(curve, 79.0, budget=100)
    assert never["lower_bound"] and never["steps_plain"] is None and never["speedup"] == pytest.approx(4.0)
    assert never["text"].startswith("> 4.0x")


def test_mean_run_averages_checkpoints_and_refuses_misaligned_seeds():
    a = {"curve": [{"step": 0, "top1": 10.0, "train_seconds": 1.0}, {"step": 5, "top1": 20.0, "train_seconds": 3.0}],
         "train_seconds": 3.0, "lambda_per_step": [1.0, 0.5]}
    b = {"curve": [{"step": 0, "top1": 14.0, "train_seconds": 3.0}, {"step": 5, "top1": 30.0, "train_seconds": 5.0}],
         "train_seconds": 5.0, "lambda_per_step": [1.0, 0.0]}
    m = mean_run([a, b])
    assert m["curve"][1] == {"step": 5, "top1": 25.0, "top1_std": 5.0, "train_seconds": 4.0}
    assert m["lambda_per_step"] == [1.0, 0.25] and m["train_seconds"] == 4.0
    b["curve"][1]["step"] = 6
    with pytest.raises(ValueError, match="different steps"):
        mean_run([a, b])


# ---------------------------------------------------------------------------------------------- online teacher
def _indexed(batches, seen):
    """The batch source, recording each batch's indices (so a test teacher can return the store's rows)."""
    for x, index in batches:
        seen.append(index)
        yield x, index


def test_online_teacher_is_one_switch_away_from_the_cached_rows():
    """A teacher that returns exactly the store's rows of the batch trains the same weights as the cached lookup:
    the online path differs from the cached one only in where the rows come from."""
    store = torch.randn(64, 6, generator=torch.Generator().manual_seed(5))
    weights = {}
    for kind in ("cached", "online"):
        model, opt = _byol()
        rela = ReLA(store, model.backbone, schedule=Constant(1.0), feature_dim=model.backbone.feature_dim,
                    n_components=4)
        opt.add_param_group({"params": list(rela.parameters())})
        seen, views = [], []
        teacher = (lambda v: (views.append(v.shape), store[seen[-1]])[1]) if kind == "online" else None
        batches = _indexed(tensor_batches(IMAGES, random_batches(64, 16, torch.Generator().manual_seed(0))), seen)
        log = train_ssl(model, batches, 3, optimizer=opt, view_generator=torch.Generator().manual_seed(2), rela=rela,
                        rela_views="weak", teacher=teacher)
        rela.close()
        weights[kind] = [p.detach().clone() for p in model.backbone.parameters()]
        if kind == "online":
            assert views == [(16, 1, 12, 12)] * 3  # one view per ReLA-only step, each embedded once
        assert log["lambda_per_step"] == [1.0, 1.0, 1.0]
    for a, b in zip(*weights.values()):
        torch.testing.assert_close(a, b)


def test_online_teacher_embeds_every_view_until_the_schedule_finishes():
    from accelerate_ssl.schedules import Epochs

    model, opt = _byol()
    proj = torch.randn(144, 6, generator=torch.Generator().manual_seed(3))
    calls = []

    def teacher(v):
        calls.append(v.shape[0])
        return v.flatten(1) @ proj

    rela = ReLA(torch.randn(64, 6), model.backbone, schedule=Epochs(0.5, total_steps=4),
                feature_dim=model.backbone.feature_dim)
    opt.add_param_group({"params": list(rela.parameters())})
    batches = tensor_batches(IMAGES, random_batches(64, 16, torch.Generator().manual_seed(0)))
    train_ssl(model, batches, 4, optimizer=opt, view_generator=torch.Generator().manual_seed(2), rela=rela,
              rela_views="weak", rela_step="two-view", teacher=teacher)
    rela.close()
    assert calls == [16, 16, 16, 16]  # two views on each of the two ReLA steps; none once ReLA has finished
    with pytest.raises(ValueError, match="teacher"):
        train_ssl(model, iter(()), 1, optimizer=opt, view_generator=torch.Generator(), teacher=teacher)


def test_prior_teacher_gives_the_prior_its_own_normalisation():
    from accelerate_ssl.recipes import images_to_tensor, prior_teacher

    class Stub(nn.Module):
        preprocess_config = {"mean": [0.5], "std": [0.25]}

        def forward(self, x):
            return x.flatten(1)

    pixels = torch.randint(0, 256, (3, 5, 5), dtype=torch.uint8)
    got = prior_teacher(Stub())(images_to_tensor(pixels))
    torch.testing.assert_close(got, ((pixels.float() / 255 - 0.5) / 0.25).flatten(1), rtol=1e-5, atol=1e-5)
