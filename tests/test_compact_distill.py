import pytest
import torch
from torch import nn

from accelerate_ssl.compact import (
    CompactDataset, DistillConfig, Distiller, StorageBudgetError, Teacher, distill_compact, fit_approx_net, plan_storage,
    pretrain, pixel_compact, pixel_images_for_budget,
)


def _teacher():
    torch.manual_seed(123)
    net = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())  # 24-d
    return Teacher(net, 24, {"source": "test"})


def _images(n=64, size=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, size, size, generator=g)


def _config(**kw):
    base = dict(budget_images=12, steps=6, real_batch=16, pool_size=2, pool_max_steps=3, pool_width=4, pool_depth=2,
                approx_steps=50, approx_hidden=2, U=8, V=8, seed=0)
    return DistillConfig(**{**base, **kw})


def test_one_outer_step_gives_every_trained_tensor_a_gradient_and_pool_models_none():
    d = Distiller(_images(), _teacher(), _config(), progress=False)
    names = dict(d.synthetic.named_parameters())
    assert set(names) == {"image_basis", "image_coeffs", "target_basis", "target_coeffs", "aug_target_coeffs"}
    d.outer_update()
    for name, p in names.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        if name == "aug_target_coeffs":  # each augmentation's own coefficients receive gradient
            assert all(p.grad[a].abs().sum() > 0 for a in range(p.shape[0]))
    for model in d.pool.models:
        assert all(p.grad is None or p.grad.abs().sum() == 0 for p in model.parameters())
        assert all(p.requires_grad for p in model.parameters())  # restored for the inner step


def test_pixel_krr_st_trains_images_and_targets():
    d = Distiller(_images(), _teacher(), _config(parameterize=False, augmentations="none"), progress=False)
    d.outer_update()
    for name, p in d.synthetic.named_parameters():
        if p.numel():
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_storage_count_within_budget_and_refusal():
    for n, shape, dy, A in [(100, (1, 28, 28), 128, 3), (100, (3, 32, 32), 512, 3), (10, (1, 28, 28), 64, 5), (40, (1, 8, 8), 24, 3)]:
        plan = plan_storage(n, shape, dy, num_augmentations=A)
        assert plan.m >= 1 and plan.total_floats <= plan.budget_floats
        # m is the largest that fits
        with pytest.raises(StorageBudgetError):
            plan_storage(n, shape, dy, num_augmentations=A, m=plan.m + 1)
    cifar = plan_storage(100, (3, 32, 32), 512)  # Yu et al. (2025) Table 5 at CIFAR-100 N = 100: U = V = 200
    assert (cifar.U, cifar.V, cifar.m) == (200, 200, 114)
    fmnist = plan_storage(100, (1, 28, 28), 64)  # the benchmark's geometry: full-rank 196-dim image basis
    assert (fmnist.U, fmnist.V, fmnist.m) == (196, 64, 131) and fmnist.total_floats <= 100 * 784
    with pytest.raises(StorageBudgetError, match="allow_over_budget"):
        plan_storage(100, (1, 28, 28), 128, m=1000)
    over = plan_storage(100, (1, 28, 28), 128, m=1000, allow_over_budget=True)
    assert over.total_floats > over.budget_floats


def test_pixel_sets_fit_the_same_budget_targets_included():
    # the benchmark's geometry: 100 x 784 = 78,400 floats; 92 images + 92 64-d targets = 78,016
    assert pixel_images_for_budget(100, (1, 28, 28), 64) == 92
    for n, shape, dy, sets in [(100, (1, 28, 28), 64, 1), (100, (3, 32, 32), 512, 1), (7, (1, 8, 8), 24, 4)]:
        m = pixel_images_for_budget(n, shape, dy, sets)
        pixels = shape[0] * shape[1] * shape[2]
        per, budget = pixels + sets * dy, n * pixels
        assert m * per <= budget < (m + 1) * per  # the largest m that fits
        with pytest.raises(StorageBudgetError, match="allow_over_budget"):
            pixel_images_for_budget(n, shape, dy, sets, m=m + 1)
        assert pixel_images_for_budget(n, shape, dy, sets, m=m + 1, allow_over_budget=True) == m + 1
    # KRR-ST distillation fits too: with and without per-augmentation targets
    for aug in ("none", "rotate"):
        d = Distiller(_images(), _teacher(), _config(parameterize=False, augmentations=aug, steps=1), progress=False)
        d.run(progress=False)
        store = d.result()
        assert store.num_floats == store.metadata["stored_floats"] <= store.metadata["budget_floats"] == 12 * 64
        assert store.num_images == pixel_images_for_budget(12, (1, 8, 8), 24, 1 if aug == "none" else 4)
    with pytest.raises(StorageBudgetError, match="pass m <="):
        Distiller(_images(), _teacher(), _config(parameterize=False, augmentations="none", m=12), progress=False)


def test_distilled_store_counts_match_plan_and_fit_budget(tmp_path):
    compact = distill_compact(_images(), _teacher(), _config(), progress=False)
    plan = compact.metadata["plan"]
    assert compact.num_floats == plan["total_floats"] <= plan["budget_floats"]
    assert "aug_target_coeffs" not in compact.tensors  # replaced by the approximation nets


def test_approx_net_reaches_near_zero_error_on_linear_shift():
    g = torch.Generator().manual_seed(0)
    c = torch.randn(200, 6, generator=g)
    shift = c @ torch.randn(6, 6, generator=g) * 0.5 + 0.3
    _, mse = fit_approx_net(c, c + shift, hidden=12, steps=500)  # H = 2V represents any linear map
    assert mse < 1e-6 * float(shift.var())
    # the paper's tiny hidden size cannot represent a full-rank map exactly, but a rank-1 shift it can (H = 2)
    low_rank = (c @ torch.randn(6, 1, generator=g)) @ torch.randn(1, 6, generator=g)
    _, mse = fit_approx_net(c, c + low_rank, hidden=2, steps=500)
    assert mse < 1e-4 * float(low_rank.var())


def test_save_load_decode_round_trips_exactly(tmp_path):
    compact = distill_compact(_images(), _teacher(), _config(), progress=False)
    path = compact.save(tmp_path / "c.safetensors")
    loaded = CompactDataset.load(path)
    assert loaded.metadata == compact.metadata
    x1, y1 = compact.decode()
    x2, y2 = loaded.decode()
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    m = compact.num_images
    assert x1.shape == (4 * m, 1, 8, 8) and y1.shape == (4 * m, 24)
    torch.testing.assert_close(x1[m : 2 * m], torch.rot90(x1[:m], 1, dims=(-2, -1)), rtol=0, atol=0)
    # pixel kind too
    pix = pixel_compact(torch.randn(3, 1, 8, 8), torch.randn(3, 5), {"note": "x"})
    again = CompactDataset.load(pix.save(tmp_path / "p.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(pix.decode(), again.decode()))
    with pytest.raises(FileNotFoundError, match="compact distill"):
        CompactDataset.load(tmp_path / "missing.safetensors")


def test_resume_after_interruption_equals_uninterrupted(tmp_path):
    images, teacher = _images(), _teacher()
    full = distill_compact(images, teacher, _config(), progress=False)
    ckpt = tmp_path / "run.pt"
    d = Distiller(images, teacher, _config(), progress=False)
    d.run(checkpoint=ckpt, checkpoint_every=2, progress=False, stop_after=3)  # "interrupted" after 3 steps
    del d
    resumed = distill_compact(images, teacher, _config(), checkpoint=ckpt, checkpoint_every=2, progress=False)
    assert resumed.metadata["distill"]["steps_done"] == 6
    for k in full.tensors:
        assert torch.equal(full.tensors[k], resumed.tensors[k]), k
    with pytest.raises(ValueError, match="different settings"):
        distill_compact(images, teacher, _config(lr=0.5), checkpoint=ckpt, progress=False)


def test_pretrain_regresses_decoded_pairs():
    x, y = torch.randn(32, 1, 8, 8), torch.randn(32, 5)
    torch.manual_seed(0)
    student = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
    before = [p.clone() for p in student.parameters()]
    hist = pretrain(student, (x, y), epochs=30, batch_size=16, lr=0.05, progress=False)
    assert hist["steps"] == 60 and hist["losses"][-1] < hist["losses"][0]
    assert all(not torch.equal(a, b) for a, b in zip(before, student.parameters()))
    with pytest.raises(ValueError, match="matching"):
        pretrain(student, (x, y[:3]), epochs=1, progress=False)


def test_poor_approximation_nets_warn_and_are_recorded():
    from accelerate_ssl.compact import ApproxFitWarning
    from accelerate_ssl.compact.approx import unexplained_fraction

    g = torch.Generator().manual_seed(0)
    c = torch.randn(200, 6, generator=g)
    unrelated = torch.randn(200, 6, generator=g) * 3  # no function of c: a 1-unit net cannot fit it
    _, mse = fit_approx_net(c, unrelated, hidden=1, steps=100)
    assert unexplained_fraction(mse, unrelated) > 0.5
    linear = c @ torch.randn(6, 6, generator=g)
    _, mse = fit_approx_net(c, linear, hidden=12, steps=500)
    assert unexplained_fraction(mse, linear) < 1e-4

    # the distiller measures every net, stores the fractions and warns when one is poor (H = 1 here)
    d = Distiller(_images(), _teacher(), _config(approx_hidden=1, steps=2), progress=False)
    d.run(progress=False)
    with torch.no_grad():
        d.synthetic.aug_target_coeffs.copy_(torch.randn(d.synthetic.aug_target_coeffs.shape, generator=g) * 5)
    with pytest.warns(ApproxFitWarning, match="approx_hidden"):
        compact = d.result()
    fractions = compact.metadata["approx_unexplained"]
    assert len(fractions) == 3 and all(f > 0.2 for f in fractions)
