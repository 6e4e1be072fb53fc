import numpy as np
import pytest
import torch

from accelerate_ssl.targets.pca import TargetPCA, canonical_signs


def _data(n=600, d=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, 6, generator=g, dtype=torch.float64)
    mix = torch.randn(6, d, generator=g, dtype=torch.float64)
    x = latent @ mix + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)
    return (x * torch.linspace(0.5, 5, d, dtype=torch.float64) + 3.0).to(torch.float32)


def _full_pca(x: torch.Tensor, n: int, standardize: bool):
    """Reference: the whole matrix at once (ReLA v2, Eq. 41), eigh of the full covariance."""
    x = x.to(torch.float64)
    mu = x.mean(0)
    sd = x.std(0, unbiased=True) if standardize else torch.ones(x.shape[1], dtype=torch.float64)
    z = (x - mu) / sd
    cov = z.T @ z / (x.shape[0] - 1)
    vals, vecs = torch.linalg.eigh(cov)
    order = torch.argsort(vals, descending=True)[:n]
    vecs = canonical_signs(vecs[:, order])
    return vals[order], vecs, z @ vecs


@pytest.mark.parametrize("standardize", [True, False])
def test_batch_pca_equals_full_pca(standardize):
    x = _data()
    pca = TargetPCA.fit(x.numpy(), n_components=8, standardize=standardize, block_size=37)
    vals, vecs, proj = _full_pca(x, 8, standardize)
    scale = vals[0].item()
    assert torch.allclose(pca.eigenvalues, vals, atol=1e-5 * scale, rtol=0)
    assert torch.allclose(pca.components, vecs, atol=1e-5)
    out = pca.transform_blocks(x.numpy(), block_size=50)
    assert out.dtype == torch.float32 and out.shape == (600, 8)
    assert torch.allclose(out.double(), proj, atol=1e-5 * max(1.0, proj.abs().max().item()))
    if standardize:  # z-scored columns: the covariance is a correlation matrix, eigenvalues sum to d
        full = TargetPCA.fit(x.numpy(), standardize=True)
        assert full.eigenvalues.sum().item() == pytest.approx(24.0, abs=1e-8)


def test_block_size_does_not_change_the_fit():
    x = _data(n=301)
    a = TargetPCA.fit(x, 5, block_size=7)
    b = TargetPCA.fit(x, 5, block_size=1000)
    assert torch.allclose(a.components, b.components, atol=1e-10)
    assert torch.allclose(a.eigenvalues, b.eigenvalues, rtol=1e-10)


def test_sign_convention_and_state_dict():
    x = _data()
    pca = TargetPCA.fit(x, 6)
    idx = pca.components.abs().argmax(0)
    assert (pca.components[idx, torch.arange(6)] > 0).all()
    again = TargetPCA.fit(-x, 6)  # flipping the data flips the mean, not the (sign-fixed) components
    assert torch.allclose(again.components, pca.components, atol=1e-10)
    clone = TargetPCA.from_state_dict(pca.state_dict())
    assert torch.equal(clone.transform(x[:5]), pca.transform(x[:5]))
    assert clone.n_components == 6 and clone.standardize


def test_components_capped_constant_columns_and_errors(tmp_path):
    x = _data(d=4).numpy().copy()
    x[:, 2] = 7.0  # a constant column: divided by 1, not by 0
    mm = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=x.shape)
    mm[:] = x
    mm.flush()
    pca = TargetPCA.fit(np.load(tmp_path / "x.npy", mmap_mode="r"), n_components=99)
    assert pca.n_components == 4
    assert torch.isfinite(pca.transform(torch.from_numpy(x))).all()
    with pytest.raises(ValueError, match="at least 2 rows"):
        TargetPCA.fit(x[:1], 2)
    with pytest.raises(ValueError, match="n_components"):
        TargetPCA.fit(x, 0)
    with pytest.raises(ValueError, match="fitted on 4-dim"):
        pca.transform(torch.zeros(2, 5))
