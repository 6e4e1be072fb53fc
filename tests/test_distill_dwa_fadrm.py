import math

import pytest
import torch

import accelerate_ssl.distill.fadrm as fadrm_mod
from accelerate_ssl.distill.dwa import directed_weight_perturbation, restored
from accelerate_ssl.distill.fadrm import mro_cost_ratio, resample, residual_inject, schedule_cost_ratio, segment_schedule
from accelerate_ssl.distill.recover import frozen_teacher
from accelerate_ssl.distill.synthesize import synthesize
from distill_helpers import CLASSES, MEAN, SIZE, STD, assert_bit_identical, one_thread, state_copy, tiny_real, tiny_teacher

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _norm(x):
    return (x - MEAN[0]) / STD[0]


# ------------------------------------------------------------------------------------------------- DWA


def test_dwa_step_norms_equal_rho_over_k_and_ascend_the_loss():
    teacher = tiny_teacher()
    saved = state_copy(teacher)
    x, y = tiny_real(per_class=1)
    x = _norm(x)
    rho, k = 0.05, 6
    with frozen_teacher(teacher), torch.no_grad():
        before = torch.nn.functional.cross_entropy(teacher(x), y)
    with frozen_teacher(teacher), restored(teacher):
        norms = directed_weight_perturbation(teacher, x, y, rho, k)
        with torch.no_grad():
            after = torch.nn.functional.cross_entropy(teacher(x), y)
        moved = math.sqrt(sum(float((teacher.state_dict()[n] - saved[n]).double().pow(2).sum())
                              for n, _ in teacher.named_parameters()))
        buffers_same = all(torch.equal(b, saved[n]) for n, b in teacher.named_buffers())
    assert len(norms) == k
    for n in norms:
        assert math.isclose(n, rho / k, rel_tol=1e-4)
    assert float(after) > float(before)  # directed: up the loss of the real batch (DWA Eq. 12)
    assert moved <= rho * (1 + 1e-4) and moved > 0.5 * rho
    assert buffers_same
    assert_bit_identical(teacher, saved)  # exact restore


def test_restore_is_exact_even_when_the_batch_fails():
    teacher = tiny_teacher()
    saved = state_copy(teacher)
    with pytest.raises(RuntimeError):
        with restored(teacher):
            with torch.no_grad():
                for p in teacher.parameters():
                    p.add_(1.0)
            raise RuntimeError("interrupted")
    assert_bit_identical(teacher, saved)


def test_dwa_with_rho_zero_equals_sre2l_plus_plus_exactly():
    teacher = tiny_teacher()
    real = tiny_real()
    kw = dict(ipc=2, real=real, mean=MEAN, std=STD, iterations=6, r_var=11.0, seed=3, progress=False)
    a = synthesize(teacher, method="dwa", rho=0.0, **kw)
    b = synthesize(teacher, method="sre2l++", **kw)
    c = synthesize(teacher, method="dwa", rho=0.5, **kw)
    assert torch.equal(a.images, b.images)
    assert not torch.equal(a.images, c.images)  # the perturbation is really used during the batch


# ------------------------------------------------------------------------------------------------- FADRM


@pytest.mark.parametrize("budget,k", [(2000, 3), (100, 0), (101, 2), (7, 6), (1000, 4)])
def test_segment_schedule_sums_to_budget_with_k_injections(budget, k):
    for ds in (None, 20):
        segs = segment_schedule(budget, k, 28, ds)
        assert sum(s.steps for s in segs) == budget
        assert sum(s.inject_after for s in segs) == k and not segs[-1].inject_after
        b = budget // (k + 1)
        assert all(s.steps == b for s in segs[:-1]) and segs[-1].steps == budget - k * b
        if ds is None:
            assert all(s.size == 28 for s in segs)
        else:
            assert [s.size for s in segs] == [ds if i % 2 == 0 else 28 for i in range(k + 1)]
    with pytest.raises(ValueError, match="budget"):
        segment_schedule(3, 3, 28)


def test_mro_cost_model():
    assert round(mro_cost_ratio(2000, 3, 200, 224), 3) == 0.899
    for args in [(2000, 3, 200, 224), (300, 3, 20, 28), (300, 5, 14, 28)]:
        segs = segment_schedule(args[0], args[1], args[3], args[2])
        assert math.isclose(schedule_cost_ratio(segs, args[3]), mro_cost_ratio(*args), rel_tol=1e-12)


def test_residual_injection_alpha_one_and_zero():
    x = torch.randn(2, 1, 8, 8)
    patch = torch.randn(2, 1, 12, 12)
    assert torch.equal(residual_inject(x, patch, 1.0), x)
    assert torch.equal(residual_inject(x, patch, 0.0), resample(patch, 8))
    same = torch.randn(2, 1, 12, 12)
    assert torch.equal(residual_inject(same, patch, 0.0), patch)  # same size: exactly the patch


def test_fadrm_alpha_one_equals_no_injection(monkeypatch):
    teacher = tiny_teacher()
    kw = dict(ipc=1, real=tiny_real(), mean=MEAN, std=STD, iterations=8, injections=3, ds_size=8, progress=False)
    with_alpha_one = synthesize(teacher, method="fadrm", alpha=1.0, **kw)
    monkeypatch.setattr(fadrm_mod, "residual_inject", lambda x, patch, alpha: x)
    without = synthesize(teacher, method="fadrm", alpha=0.3, **kw)
    assert torch.equal(with_alpha_one.images, without.images)


def test_fadrm_alpha_zero_resets_to_the_patch_at_every_injection(monkeypatch):
    teacher = tiny_teacher()
    real = tiny_real()
    seen = []
    original = fadrm_mod.residual_inject

    def spy(x, patch, alpha):
        out = original(x, patch, alpha)
        seen.append((out, resample(patch, x.shape[-1]), x.shape[-1]))
        return out

    monkeypatch.setattr(fadrm_mod, "residual_inject", spy)
    d = synthesize(teacher, method="fadrm", alpha=0.0, ipc=1, real=real, mean=MEAN, std=STD, iterations=8,
                   injections=3, ds_size=8, progress=False)
    assert len(seen) == 3
    assert [s for _, _, s in seen] == [SIZE, 8, SIZE]  # MRO: ds -> orig -> ds -> orig
    for out, patch, _ in seen:
        assert torch.equal(out, patch)
    assert d.images.shape[-1] == SIZE


def test_fadrm_plus_uses_teachers_round_robin():
    t1, t2 = tiny_teacher(), tiny_teacher(seed=1, widths=(4, 4, 8))
    calls = {1: 0, 2: 0}
    h1 = t1.register_forward_hook(lambda *a: calls.__setitem__(1, calls[1] + 1))
    h2 = t2.register_forward_hook(lambda *a: calls.__setitem__(2, calls[2] + 1))
    synthesize([t1, t2], method="fadrm+", ipc=1, real=tiny_real(), mean=MEAN, std=STD, iterations=10, progress=False)
    h1.remove(), h2.remove()
    assert calls[1] - 1 == 5 and calls[2] - 1 == 5  # one probe forward each + 5 steps each
    with pytest.raises(ValueError, match="at least two teachers"):
        synthesize(t1, method="fadrm+", ipc=1, real=tiny_real(), mean=MEAN, std=STD, iterations=8, progress=False)


def test_mro_roll_is_scaled_to_the_low_resolution(monkeypatch):
    """At D_ds the circular roll moves the same fraction of the image as at D_orig (jitter 4 at 12 px -> 2 at 6 px);
    the first implementation rolled 4 px at both sizes, i.e. twice as far at half resolution."""
    from accelerate_ssl.distill.recover import BatchAugment

    shifts = {}
    original = BatchAugment.sample

    def spy(self, size_hw, generator):
        p = original(self, size_hw, generator)
        shifts.setdefault(size_hw[0], []).extend(abs(s) for s in p["shift"])
        return p

    monkeypatch.setattr(BatchAugment, "sample", spy)
    synthesize(tiny_teacher(), method="fadrm", ipc=1, real=tiny_real(), mean=MEAN, std=STD, iterations=200,
               injections=3, ds_size=SIZE // 2, jitter=4, progress=False)
    assert max(shifts[SIZE // 2]) == 2 and max(shifts[SIZE]) == 4
    aug = BatchAugment(jitter=None, jitter_reference=224)
    g = torch.Generator().manual_seed(0)
    assert max(max(abs(s) for s in aug.sample((112, 112), g)["shift"]) for _ in range(300)) == 16  # 32 px at 224


@pytest.mark.parametrize("method", ["sre2l", "sre2l++", "fadrm", "fadrm+"])
def test_batch_group_gives_the_images_of_one_batch_at_a_time(method):
    """batch_group only shares the teacher call: per-batch BN statistics, CE, augmentation and random numbers,
    so the images equal the ungrouped run's up to float rounding (and a group of 3 with ipc 4 leaves a group of 1)."""
    t1, t2 = tiny_teacher(), tiny_teacher(seed=1, widths=(4, 4, 8))
    teachers = [t1, t2] if method == "fadrm+" else t1
    extra = {"ds_size": 8} if method.startswith("fadrm") else {}
    kw = dict(ipc=4, real=tiny_real(per_class=4), mean=MEAN, std=STD, iterations=8, progress=False, **extra)
    one = synthesize(teachers, method=method, **kw)
    grouped = synthesize(teachers, method=method, batch_group=3, **kw)
    assert torch.equal(one.labels, grouped.labels)
    assert torch.allclose(one.images, grouped.images, atol=1e-4), float((one.images - grouped.images).abs().max())
    assert not torch.equal(one.images[:CLASSES], one.images[CLASSES : 2 * CLASSES])  # batches differ


def test_grouped_bn_loss_is_the_sum_of_the_batch_losses():
    from accelerate_ssl.distill.recover import BNStatistics

    teacher = tiny_teacher()
    a, b = torch.randn(CLASSES, 1, SIZE, SIZE), torch.randn(CLASSES, 1, SIZE, SIZE) * 2
    with frozen_teacher(teacher), BNStatistics(teacher) as stats, torch.no_grad():
        per = []
        for x in (a, b):
            teacher(x)
            per.append(float(stats.loss()))
        stats.groups = 2
        teacher(torch.cat([a, b]))
        assert torch.allclose(stats.group_losses(), torch.tensor(per), rtol=1e-5)


def test_dwa_refuses_batch_groups():
    with pytest.raises(ValueError, match="batch_group=1"):
        synthesize(tiny_teacher(), method="dwa", ipc=2, real=tiny_real(), mean=MEAN, std=STD, iterations=2,
                   batch_group=2, progress=False)
