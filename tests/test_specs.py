"""One grammar for data (``--data``) and for networks (prior specs, distillation teachers) on every verb."""

import argparse

import pytest
import torch
from PIL import Image

from accelerate_ssl.data.spec import data_spec, open_data
from accelerate_ssl.distill.cli import create_teacher


# ---------------------------------------------------------------------------------------------- data
def test_data_spec_canonical_forms_and_errors(tmp_path):
    assert data_spec("fashion-mnist") == "fashion-mnist" and data_spec("digits") == "digits"
    assert data_spec(f"folder:{tmp_path}") == f"folder:{tmp_path}"
    assert data_spec(str(tmp_path)) == f"folder:{tmp_path}"  # a bare folder path is a folder spec
    assert data_spec("solo-no-labels:/x") == "solo-no-labels:/x"
    with pytest.raises(argparse.ArgumentTypeError, match="neither a known data set nor an existing folder"):
        data_spec(str(tmp_path / "missing"))
    with pytest.raises(argparse.ArgumentTypeError, match="unknown data kind 'cifar'"):
        data_spec("cifar:/x")


def test_open_data_same_images_for_a_folder_spec_and_its_path(tmp_path):
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        for i in range(2):
            Image.new("L", (6, 6), color=40 * i + (100 if cls == "b" else 0)).save(tmp_path / cls / f"{i}.png")
    by_spec, by_path = open_data(f"folder:{tmp_path}"), open_data(str(tmp_path))
    assert len(by_spec) == len(by_path) == 4 and by_spec.classes == ["a", "b"] and by_spec.name == by_path.name
    digits = open_data("digits", limit=7)
    assert len(digits) == 7 and digits[6][1] == int(digits.targets[6])
    with pytest.raises(ValueError, match="limit .* is for fashion-mnist and digits"):
        open_data(str(tmp_path), limit=2)
    with pytest.raises(ValueError, match="needs the data spec solo:"):
        open_data("digits", fraction=0.5)


# ---------------------------------------------------------------------------------------------- teachers
def test_teacher_specs_random_with_weights_torchscript_and_bad_names(tmp_path):
    from accelerate_ssl.backbones import ResNetSmall

    torch.manual_seed(0)
    net = ResNetSmall(1, 10, (4, 4, 8))
    torch.save(net.state_dict(), tmp_path / "t.pt")
    loaded = create_teacher("random:resnet_small", str(tmp_path / "t.pt"), {"widths": [4, 4, 8]})
    x = torch.randn(2, 1, 16, 16)
    net.eval(), loaded.eval()
    assert torch.equal(loaded(x), net(x))  # the trained weights, classifier included
    torch.jit.save(torch.jit.trace(net, x), str(tmp_path / "t.ts"))
    assert torch.equal(create_teacher(f"checkpoint:{tmp_path / 't.ts'}")(x), net(x))
    with pytest.raises(ValueError, match="random:resnet_small --weights FILE"):
        create_teacher("resnet_small")  # the old bare name: the message gives the spec to write
    with pytest.raises(ValueError, match="family in"):
        create_teacher("timm:resnet18")
    with pytest.raises(FileNotFoundError, match="Teacher weights"):
        create_teacher("random:resnet_small", str(tmp_path / "missing.pt"))


def test_torchvision_teacher_keeps_its_classifier_from_the_hub_cache_offline(tmp_path, monkeypatch):
    import torchvision

    from accelerate_ssl.priors.zoo import PriorWeightsNotFoundError, torch_hub_file

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PriorWeightsNotFoundError):
        create_teacher("torchvision:resnet18")  # nothing cached, offline: a clear error, no download
    w = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    torch.manual_seed(0)
    net = torchvision.models.resnet18(weights=None).eval()
    path = torch_hub_file(w.url)
    path.parent.mkdir(parents=True)
    torch.save(net.state_dict(), path)
    teacher = create_teacher("torchvision:resnet18/IMAGENET1K_V1").eval()
    x = torch.randn(1, 3, 32, 32)
    assert teacher(x).shape == (1, 1000) and torch.equal(teacher(x), net(x))
