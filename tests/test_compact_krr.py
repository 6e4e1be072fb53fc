import pytest
import torch
from torch import nn

from accelerate_ssl.compact import ModelPool, krr_predict, krr_predict_primal
from accelerate_ssl.compact.krr import PoolModel


def test_dual_and_primal_krr_agree():
    f_s, y_s, f_t = (torch.randn(20, 6, dtype=torch.float64), torch.randn(20, 3, dtype=torch.float64),
                     torch.randn(15, 6, dtype=torch.float64))
    for reg in (1e-6, 1e-2):
        torch.testing.assert_close(krr_predict(f_s, y_s, f_t, reg), krr_predict_primal(f_s, y_s, f_t, reg), rtol=1e-7, atol=1e-8)
    # also when m < p (dual system smaller than primal)
    f_s, y_s = torch.randn(4, 9, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    torch.testing.assert_close(krr_predict(f_s, y_s, f_t[:, :1].repeat(1, 9), 1e-3),
                               krr_predict_primal(f_s, y_s, f_t[:, :1].repeat(1, 9), 1e-3), rtol=1e-7, atol=1e-8)


def test_krr_has_bias_column_and_lambda_relative_to_trace():
    # a constant target is fitted exactly by the bias column even with zero features
    f_s, f_t = torch.zeros(5, 3, dtype=torch.float64), torch.zeros(4, 3, dtype=torch.float64)
    y_s = torch.full((5, 2), 2.5, dtype=torch.float64)
    pred = krr_predict(f_s, y_s, f_t, reg=1e-9)
    torch.testing.assert_close(pred, torch.full((4, 2), 2.5, dtype=torch.float64), rtol=1e-6, atol=0)
    # lambda = reg * trace(K_ss) with K_ss over the bias-augmented features: compare with an explicit solve
    f_s, y_s, f_t = torch.randn(6, 10, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64), torch.randn(3, 10, dtype=torch.float64)
    phi_s, phi_t = torch.cat([f_s, torch.ones(6, 1, dtype=f_s.dtype)], 1), torch.cat([f_t, torch.ones(3, 1, dtype=f_t.dtype)], 1)
    k = phi_s @ phi_s.T
    expected = phi_t @ phi_s.T @ torch.linalg.inv(k + 0.1 * torch.trace(k) * torch.eye(6, dtype=k.dtype)) @ y_s
    torch.testing.assert_close(krr_predict(f_s, y_s, f_t, reg=0.1), expected)
    # a fixed (absolute) lambda would not give this: the result differs from lambda = 0.1
    absolute = phi_t @ phi_s.T @ torch.linalg.inv(k + 0.1 * torch.eye(6, dtype=k.dtype)) @ y_s
    assert not torch.allclose(krr_predict(f_s, y_s, f_t, reg=0.1), absolute)


def _factory():
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return PoolModel(net, 4, 3)


def test_model_pool_counters_and_reset():
    pool = ModelPool(_factory, size=3, max_steps=4, generator=torch.Generator().manual_seed(1))
    x, y = torch.randn(6, 1, 5, 5), torch.randn(6, 3)
    pool.initialize(x, y)
    assert all(1 <= z <= 4 for z in pool.steps)
    j = 0
    pool.steps[j] = 3
    before = [p.clone() for p in pool.models[j].parameters()]
    pool.inner_step(j, x, y)
    assert pool.steps[j] == 4
    assert any(not torch.equal(a, b) for a, b in zip(before, pool.models[j].parameters()))
    assert all(p.grad is None for p in pool.models[j].parameters())
    old = pool.models[j]
    pool.inner_step(j, x, y)  # z_j == Z: re-initialise
    assert pool.steps[j] == 0 and pool.models[j] is not old


def test_model_pool_state_dict_round_trip():
    pool = ModelPool(_factory, size=2, max_steps=3, generator=torch.Generator().manual_seed(2))
    x, y = torch.randn(6, 1, 5, 5), torch.randn(6, 3)
    pool.initialize(x, y)
    state = pool.state_dict()
    other = ModelPool(_factory, size=2, max_steps=3, generator=torch.Generator().manual_seed(99))
    other.load_state_dict(state)
    assert other.steps == pool.steps and other.sample() == pool.sample()
    for a, b in zip(pool.models, other.models):
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
            assert ka == kb and torch.equal(va, vb)
    with pytest.raises(ValueError, match="size"):
        ModelPool(_factory, size=5).load_state_dict(state)
