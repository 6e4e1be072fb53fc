import torch
from torch import nn
from torch.utils.data import TensorDataset

from accelerate_ssl.evaluate import evaluate_backbone, extract_features, knn_accuracy, linear_probe


def _blobs(n, seed, dim=8, classes=3, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(99)) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    return centres[y] + noise * torch.randn(n, dim, generator=g), y


def test_linear_probe_and_knn_separate_blobs_not_noise():
    xtr, ytr = _blobs(300, 0)
    xte, yte = _blobs(200, 1)
    assert linear_probe(xtr, ytr, xte, yte, epochs=50, lr=1e-2, batch_size=64)["top1"] > 95
    assert knn_accuracy(xtr, ytr, xte, yte, k=20) > 95
    shuffled = ytr[torch.randperm(len(ytr), generator=torch.Generator().manual_seed(2))]
    assert linear_probe(xtr, shuffled, xte, yte, epochs=50, lr=1e-2, batch_size=64)["top1"] < 60  # labels carry the signal
    # deterministic given the seed, independent of the global RNG
    torch.manual_seed(5)
    a = linear_probe(xtr, ytr, xte, yte, epochs=3, seed=1)
    torch.manual_seed(6)
    assert a == linear_probe(xtr, ytr, xte, yte, epochs=3, seed=1)


def test_extract_features_eval_mode_no_grad_and_restores_mode():
    bb = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    bb.train()
    stats = bb[1].running_mean.clone()
    xtr, ytr = _blobs(50, 0)
    f, y = extract_features(bb, TensorDataset(xtr, ytr), batch_size=16)
    assert f.shape == (50, 4) and not f.requires_grad and torch.equal(y, ytr)
    assert torch.equal(bb[1].running_mean, stats) and bb.training
    res = evaluate_backbone(bb, TensorDataset(xtr, ytr), TensorDataset(*_blobs(40, 1)), epochs=5)
    assert set(res) == {"linear_top1", "knn_top1"}


def test_extract_features_on_the_librarys_pil_datasets():
    """The library's own datasets yield PIL images: evaluation takes them as they are (no transform needed)."""
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.data import Digits

    data = Digits("test")
    net = ConvNet(widths=(8,), in_channels=1)
    feats, labels = extract_features(net, data, batch_size=64)
    assert feats.shape == (len(data), net.feature_dim) and torch.isfinite(feats).all()
    assert torch.equal(labels, data.targets)
    x0 = data.data[0].float().div(255.0)[None, None]  # the PIL image as a float tensor in [0, 1]
    net.eval()
    with torch.no_grad():
        assert torch.allclose(feats[0], net(x0)[0], atol=1e-6)
    res = evaluate_backbone(net, data, data, epochs=100)
    assert res["linear_top1"] > 30 and res["knn_top1"] > 50  # 10 classes (chance 10 %); kNN of a set on itself


def test_few_label_probe_uses_k_labels_per_class_and_is_seeded():
    from accelerate_ssl.evaluate import few_label_probe

    xtr, ytr = _blobs(300, 0)
    xte, yte = _blobs(200, 1)
    out = few_label_probe(xtr, ytr, xte, yte, per_class=5, seed=0)
    assert out["labelled"] == 15 and out["top1"] > 90  # 5 labels per blob suffice
    assert few_label_probe(xtr, ytr, xte, yte, per_class=5, seed=0) == out
    noisy = ytr[torch.randperm(len(ytr), generator=torch.Generator().manual_seed(2))]
    assert few_label_probe(xtr, noisy, xte, yte, per_class=5, seed=0)["top1"] < 70
    import pytest

    with pytest.raises(ValueError, match="fewer than"):
        few_label_probe(xtr, ytr, xte, yte, per_class=1000)


def test_recipe_probe_reports_the_few_label_probe_when_asked():
    from accelerate_ssl.recipes import Probe

    g = torch.Generator().manual_seed(0)
    images = torch.randn(60, 1, 8, 8, generator=g)
    labels = torch.arange(60) % 3
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(64, 4))
    plain = Probe(images, labels, images[:30], labels[:30], epochs=2).evaluate(backbone)
    few = Probe(images, labels, images[:30], labels[:30], epochs=2, few_labels=5).evaluate(backbone)
    assert "few_label_top1" not in plain and 0 <= few["few_label_top1"] <= 100
    assert few["linear_top1"] == plain["linear_top1"]
