import math

import pytest
import torch
from torch import nn

from accelerate_ssl.backbones import ConvNet
from accelerate_ssl.distill.recover import (
    BatchAugment,
    BNStatistics,
    RecoverConfig,
    TeacherWithoutBatchNormError,
    default_jitter,
    frozen_teacher,
    recover_batch,
    recover_loss,
    valid_range,
)
from accelerate_ssl.distill.synthesize import synthesize
from accelerate_ssl.recipes import cosine_lr
from distill_helpers import CLASSES, MEAN, SIZE, STD, assert_bit_identical, one_thread, state_copy, tiny_real, tiny_teacher

_one_thread = pytest.fixture(autouse=True)(one_thread)


def test_bn_loss_is_zero_when_batch_stats_equal_running_stats():
    teacher = tiny_teacher()
    x = torch.randn(8, 1, SIZE, SIZE)
    bns = [m for m in teacher.modules() if isinstance(m, nn.BatchNorm2d)]
    recorded = {}

    def rec(i):
        def hook(module, inputs, output):
            v = inputs[0]
            recorded[i] = (v.mean(dim=(0, 2, 3)), v.var(dim=(0, 2, 3), unbiased=False))
        return hook

    handles = [m.register_forward_hook(rec(i)) for i, m in enumerate(bns)]
    with torch.no_grad():
        for _ in range(len(bns) + 1):  # each pass fixes at least one more layer (topological order)
            teacher(x)
            for i, m in enumerate(bns):
                m.running_mean.copy_(recorded[i][0])
                m.running_var.copy_(recorded[i][1])
    for h in handles:
        h.remove()
    with BNStatistics(teacher, r_var=11.0) as stats, torch.no_grad():
        teacher(x)
        assert float(stats.loss()) < 1e-4  # float rounding only (the other-data loss below is > 1)
    # and it is clearly positive for other data
    with BNStatistics(teacher) as stats, torch.no_grad():
        teacher(x * 3 + 1)
        assert float(stats.loss()) > 1.0


def test_bn_loss_weights_first_layer_and_variance():
    teacher = tiny_teacher()
    x = torch.randn(4, 1, SIZE, SIZE)
    with BNStatistics(teacher, r_var=0.0, first_bn_multiplier=1.0) as s, torch.no_grad():
        teacher(x)
        base = float(s.loss())
        first = float(s.layer_losses()[0])
    with BNStatistics(teacher, r_var=0.0, first_bn_multiplier=10.0) as s, torch.no_grad():
        teacher(x)
        assert math.isclose(float(s.loss()), base + 9 * first, rel_tol=1e-5)


def test_teacher_without_batchnorm_is_refused_with_a_clear_error():
    teacher = nn.Sequential(ConvNet(1, (4, 8), norm="group"), nn.Linear(8, CLASSES))
    with pytest.raises(TeacherWithoutBatchNormError, match="no BatchNorm2d"):
        synthesize(teacher, method="sre2l", ipc=1, image_size=SIZE, channels=1, mean=MEAN, std=STD, iterations=2, progress=False)


def test_recover_loss_decreases_and_pixels_stay_in_range():
    teacher = tiny_teacher()
    x0 = torch.randn(CLASSES, 1, SIZE, SIZE)
    labels = torch.arange(CLASSES)
    cfg = RecoverConfig(iterations=60, init="noise", crop_scale=(0.5, 1.0))
    with frozen_teacher(teacher):
        x, hist = recover_batch(teacher, x0, labels, cfg, torch.Generator().manual_seed(0), MEAN, STD)
        with BNStatistics(teacher) as stats, torch.no_grad():
            before = recover_loss(teacher, stats, x0.clamp(*valid_range(MEAN, STD)), labels, cfg)[0]
            after = recover_loss(teacher, stats, x, labels, cfg)[0]
    assert float(after) < 0.6 * float(before)
    assert len(hist["loss"]) == 60
    low, high = valid_range(MEAN, STD)
    assert float(x.min()) >= float(low) - 1e-6 and float(x.max()) <= float(high) + 1e-6


def test_teacher_bit_identical_after_every_method_and_flags_restored():
    teacher = tiny_teacher()
    second = tiny_teacher(seed=1, widths=(4, 4, 8))
    teacher.train()  # synthesis must switch to eval itself and restore the mode
    before, before2 = state_copy(teacher), state_copy(second)
    real = tiny_real()
    for method in ("sre2l", "sre2l++", "dwa", "fadrm"):
        synthesize(teacher, method=method, ipc=2, real=real, mean=MEAN, std=STD, iterations=4, progress=False)
        assert_bit_identical(teacher, before)
    synthesize([teacher, second], method="fadrm+", ipc=1, real=real, mean=MEAN, std=STD, iterations=4, progress=False)
    assert_bit_identical(teacher, before)
    assert_bit_identical(second, before2)
    assert teacher.training and all(p.requires_grad for p in teacher.parameters())
    assert all(p.grad is None for p in teacher.parameters())


def test_schedule_augmentation_and_bf16_precision():
    lr = cosine_lr(0.25, 100)  # SRe2L's schedule of the recovered images: 0.5 (1 + cos(pi t / T)) lr
    assert lr(0) == 0.25 and abs(lr(100)) < 1e-12 and math.isclose(lr(50), 0.125)
    assert default_jitter(28) == 4 and default_jitter(32) == 4 and default_jitter(224) == 32
    aug = BatchAugment()
    x = torch.randn(3, 1, SIZE, SIZE, requires_grad=True)
    y = aug(x, torch.Generator().manual_seed(0))
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad is not None
    teacher = tiny_teacher()
    d = synthesize(teacher, method="sre2l++", ipc=1, real=tiny_real(), mean=MEAN, std=STD, iterations=3,
                   precision="bf16", progress=False)
    assert d.images.dtype == torch.float32 and torch.isfinite(d.images).all()
    with pytest.raises(ValueError, match="CUDA"):
        synthesize(teacher, method="sre2l++", ipc=1, real=tiny_real(), mean=MEAN, std=STD, iterations=3,
                   precision="fp16", device="cpu", progress=False)


def test_matrix_augmentation_equals_crop_resize_flip_roll():
    """BatchAugment.apply (separable matrices) == slice + F.interpolate + flip + roll, for every kind of draw."""
    from accelerate_ssl.distill.recover import crop_resize

    aug = BatchAugment(crop_scale=(0.08, 1.0), jitter=3)
    g = torch.Generator().manual_seed(0)
    seen_flip = 0
    for size in (SIZE, 13, 28):
        for _ in range(60):
            x = torch.randn(3, 2, size, size, dtype=torch.float64)
            p = aug.sample((size, size), g)
            ref = crop_resize(x, p["box"], (size, size))
            ref = ref.flip(-1) if p["flip"] else ref
            ref = torch.roll(ref, p["shift"], dims=(2, 3))
            assert torch.allclose(BatchAugment.apply(x, p), ref, atol=1e-12)
            seen_flip += p["flip"]
        full = {"box": (0, 0, size, size), "flip": False, "shift": (0, 0)}
        assert torch.equal(BatchAugment.apply(x, full), x)
    assert seen_flip > 0


def test_channel_stats_gradient_matches_autograd():
    from accelerate_ssl.distill.recover import channel_stats

    x = torch.randn(3, 4, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: channel_stats(t), (x,))
    mean, var = channel_stats(x)
    assert torch.allclose(mean, x.mean(dim=(0, 2, 3))) and torch.allclose(var, x.var(dim=(0, 2, 3), unbiased=False))


def test_bn_loss_gradient_matches_the_plain_per_layer_formula():
    """The vectorised loss (one padded norm over all layers) equals the per-layer sum, value and pixel gradient."""
    teacher = tiny_teacher()
    bns = [m for m in teacher.modules() if isinstance(m, nn.BatchNorm2d)]
    x = torch.randn(4, 1, SIZE, SIZE, requires_grad=True)
    with frozen_teacher(teacher), BNStatistics(teacher, r_var=3.0, first_bn_multiplier=10.0) as stats:
        teacher(x)
        fast = stats.loss()
        (g_fast,) = torch.autograd.grad(fast, x)
        inputs = []
        handles = [m.register_forward_hook(lambda mod, i, o: inputs.append(i[0])) for m in bns]
        teacher(x)
        for h in handles:
            h.remove()
        plain = 0.0
        for l, (m, v) in enumerate(zip(bns, inputs)):
            term = torch.linalg.vector_norm(v.mean(dim=(0, 2, 3)) - m.running_mean) + 3.0 * torch.linalg.vector_norm(
                v.var(dim=(0, 2, 3), unbiased=False) - m.running_var)
            plain = plain + (10.0 if l == 0 else 1.0) * term
        (g_plain,) = torch.autograd.grad(plain, x)
    assert torch.allclose(fast, plain, rtol=1e-5)
    assert torch.allclose(g_fast, g_plain, rtol=1e-4, atol=1e-6)


def test_manifest_records_wall_and_cpu_seconds():
    d = synthesize(tiny_teacher(), method="sre2l++", ipc=1, real=tiny_real(), mean=MEAN, std=STD, iterations=3, progress=False)
    m = d.manifest
    assert m["cpu_seconds"] > 0 and m["seconds"] > 0
    assert math.isclose(m["cpu_seconds_per_image"], m["cpu_seconds"] / CLASSES)


def test_pixel_adam_follows_the_plain_adam_update():
    from accelerate_ssl.distill.recover import pixel_adam

    torch.manual_seed(0)
    a = torch.randn(2, 1, 5, 5, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    fast, plain = pixel_adam(a, 0.25, (0.5, 0.9)), torch.optim.Adam([b], lr=0.25, betas=(0.5, 0.9), eps=1e-8, foreach=False)
    for step in range(5):
        g = torch.randn(2, 1, 5, 5)
        for opt, x in ((fast, a), (plain, b)):
            opt.param_groups[0]["lr"] = cosine_lr(0.25, 5)(step)
            x.grad = g.clone()
            opt.step()
    assert torch.allclose(a, b, atol=1e-6) and not torch.equal(a, torch.zeros_like(a))
