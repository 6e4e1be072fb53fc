import pytest
import torch

from accelerate_ssl.compact import create_augmentations, decode_images, decode_targets, downscale, pca_basis, project, upsample


def test_pca_init_reconstructs_exactly_at_full_rank():
    # uncentred PCA (documented choice): at full rank C = X B^T and C B == X, with no mean term
    x = torch.randn(50, 12, dtype=torch.float64) + 3.0  # non-zero mean on purpose
    basis = pca_basis(x, 12)
    torch.testing.assert_close(project(x, basis) @ basis, x, rtol=0, atol=1e-10)


def test_pca_basis_is_orthonormal_and_ordered_and_deterministic():
    x = torch.randn(200, 10) * torch.linspace(5, 0.5, 10)
    basis = pca_basis(x, 4)
    torch.testing.assert_close(basis @ basis.T, torch.eye(4), atol=1e-5, rtol=0)
    energy = (project(x, basis) ** 2).sum(0)
    assert torch.all(energy[:-1] >= energy[1:])
    torch.testing.assert_close(pca_basis(x, 4), basis)
    assert torch.all(basis.gather(1, basis.abs().argmax(1, keepdim=True)) > 0)  # sign convention


def test_pca_truncated_is_best_rank_k_for_uncentred_data():
    x = torch.randn(100, 8, dtype=torch.float64)
    basis = pca_basis(x, 3)
    err = ((project(x, basis) @ basis - x) ** 2).sum()
    s = torch.linalg.svdvals(x)
    torch.testing.assert_close(err, (s[3:] ** 2).sum())


def test_pca_rejects_bad_rank():
    with pytest.raises(ValueError, match=r"\[1, 5\]"):
        pca_basis(torch.randn(10, 5), 6)


def test_decoding_shapes_fashion_mnist_geometry():
    # Fashion-MNIST 1x28x28 with s = 2 -> 196-dim bases
    m, U, V, dy = 7, 30, 9, 16
    images = decode_images(torch.randn(m, U), torch.randn(U, 196), (1, 14, 14), 2)
    assert images.shape == (m, 1, 28, 28)
    assert decode_targets(torch.randn(m, V), torch.randn(V, dy)).shape == (m, dy)
    with pytest.raises(ValueError, match="small_shape"):
        decode_images(torch.randn(m, U), torch.randn(U, 195), (1, 14, 14), 2)


def test_downscale_then_upsample_keeps_constant_images_and_rejects_bad_scale():
    x = torch.full((2, 1, 28, 28), 0.7)
    assert downscale(x, 2).shape == (2, 1, 14, 14)
    torch.testing.assert_close(upsample(downscale(x, 2), 2), x)
    with pytest.raises(ValueError, match="dividing"):
        downscale(x, 3)


def test_rotations_compose_to_identity_and_pass_gradients():
    rot90, rot180, rot270 = create_augmentations("rotate")
    x = torch.randn(3, 1, 6, 6, requires_grad=True)
    torch.testing.assert_close(rot90(rot90(rot90(rot90(x)))), x, rtol=0, atol=0)
    torch.testing.assert_close(rot90(rot90(x)), rot180(x))
    torch.testing.assert_close(rot90(rot180(x)), rot270(x))
    assert not torch.equal(rot90(x), x)
    w = torch.randn(3, 1, 6, 6)
    for tau in (rot90, rot180, rot270):
        (grad,) = torch.autograd.grad((tau(x) * w).sum(), x)
        # rotation is a permutation: the gradient is the inversely rotated weight, non-zero everywhere w is
        torch.testing.assert_close(grad, torch.rot90(w, -int(tau.name[6:]) // 90, dims=(-2, -1)))


@pytest.mark.parametrize("family,count", [("rotate", 3), ("jigsaw", 3), ("fivecrop", 5), ("none", 0)])
def test_augmentation_families_are_differentiable_and_shape_preserving(family, count):
    augs = create_augmentations(family)
    assert len(augs) == count
    x = torch.randn(2, 1, 8, 8, requires_grad=True)
    for tau in augs:
        y = tau(x)
        assert y.shape == x.shape and not torch.equal(y, x)
        (g,) = torch.autograd.grad(y.pow(2).sum(), x)
        assert g.abs().sum() > 0


def test_jigsaw_is_a_pixel_permutation_and_unknown_family_errors():
    x = torch.arange(16.0).view(1, 1, 4, 4)
    for tau in create_augmentations("jigsaw"):
        assert torch.equal(tau(x).flatten().sort().values, x.flatten())
    with pytest.raises(ValueError, match="choose one of"):
        create_augmentations("mixup")
