import json

import numpy as np
import pytest
import torch
from PIL import Image

from accelerate_ssl.backbones import ConvNet, ResNetSmall
from accelerate_ssl.priors import SHIPPED_PRIORS, Preprocess, create_prior, list_priors, save_prior_checkpoint
from accelerate_ssl.priors.registry import IMAGENET_MEAN


def _gray(size=28, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size), dtype=np.uint8), mode="L")


def _features(prior, images):
    x = torch.stack([prior.preprocess(im) for im in images])
    with torch.inference_mode():
        return prior(x)


def test_families_registered():
    assert list_priors() == ["checkpoint", "open_clip", "random", "shipped", "timm", "torchvision"]


@pytest.mark.parametrize("spec,dim,channels", [("random:convnet", 256, 1), ("random:resnet_small", 128, 1),
                                               ("random:resnet18", 512, 3)])
def test_random_priors_native_size_and_dim(spec, dim, channels):
    prior = create_prior(spec)
    assert prior.output_dim == dim
    x = prior.preprocess(_gray())
    assert x.shape == (channels, 28, 28)  # native size kept, no upscaling
    out = _features(prior, [_gray(), _gray(seed=1)])
    assert out.shape == (2, dim) and torch.isfinite(out).all()
    assert json.loads(json.dumps(prior.describe()))["spec"] == spec


def test_random_prior_is_seeded():
    a, b, c = create_prior("random:convnet"), create_prior("random:convnet"), create_prior("random:convnet", seed=1)
    im = [_gray()]
    assert torch.equal(_features(a, im), _features(b, im))
    assert not torch.allclose(_features(a, im), _features(c, im))


def test_torchvision_prior_loads_local_weights(tmp_path):
    import torchvision

    net = torchvision.models.resnet18(weights=None)
    torch.nn.init.normal_(net.conv1.weight)
    torch.save(net.state_dict(), tmp_path / "r18.pth")
    prior = create_prior("torchvision:resnet18", weights=str(tmp_path / "r18.pth"))
    assert prior.output_dim == 512
    assert prior.preprocess_config["stats"] == "imagenet" and prior.preprocess_config["mean"] == list(IMAGENET_MEAN)
    x = prior.preprocess(_gray())
    assert x.shape == (3, 224, 224)
    assert torch.equal(x[0] * 0.229 + 0.485, x[1] * 0.224 + 0.456) or torch.allclose(x[0] * 0.229 + 0.485, x[1] * 0.224 + 0.456, atol=1e-6)
    net.fc = torch.nn.Identity()
    net.eval()
    with torch.inference_mode():
        assert torch.allclose(prior(x[None]), net(x[None]), atol=1e-5)
    import hashlib

    assert prior.describe()["weights_sha256"] == hashlib.sha256((tmp_path / "r18.pth").read_bytes()).hexdigest()


def test_timm_prior(tmp_path):
    import timm

    net = timm.create_model("resnet18", pretrained=False)  # with its classifier, as a downloaded file would be
    torch.save(net.state_dict(), tmp_path / "timm_r18.pth")
    prior = create_prior("timm:resnet18", weights=str(tmp_path / "timm_r18.pth"))
    assert prior.output_dim == 512
    cfg = prior.preprocess_config
    assert cfg["crop"] == 224 and cfg["interpolation"] == "bicubic" and cfg["stats"] == "imagenet"
    assert _features(prior, [_gray()]).shape == (1, 512)


def test_open_clip_prior_uses_clip_stats(tmp_path):
    import open_clip
    from safetensors.torch import save_file

    clip = open_clip.create_model("ViT-S-32", pretrained=None)
    save_file({f"visual.{k}": v.contiguous() for k, v in clip.visual.state_dict().items()}, str(tmp_path / "clip.safetensors"))
    prior = create_prior("open_clip:ViT-S-32", weights=str(tmp_path / "clip.safetensors"))
    assert prior.output_dim == 384
    cfg = prior.preprocess_config
    assert cfg["stats"] == "clip" and cfg["mean"] == pytest.approx(list(open_clip.OPENAI_DATASET_MEAN))
    assert cfg["mean"] != pytest.approx(list(IMAGENET_MEAN))
    x = prior.preprocess(_gray())
    clip.visual.eval()
    with torch.inference_mode():
        assert torch.allclose(prior(x[None]), clip.visual(x[None]), atol=1e-5)


def test_checkpoint_prior_from_save_prior_checkpoint(tmp_path):
    net = ResNetSmall(in_channels=1, num_classes=10, widths=(8, 16, 32))
    net.eval()
    path = save_prior_checkpoint(net, tmp_path / "teacher.safetensors", "resnet_small",
                                 {"in_channels": 1, "num_classes": 10, "widths": [8, 16, 32]},
                                 {"channels": 1, "mean": [0.3], "std": [0.35]})
    prior = create_prior(f"checkpoint:{path}")
    assert prior.output_dim == 32
    x = prior.preprocess(_gray())
    assert x.shape == (1, 28, 28) and prior.preprocess_config["mean"] == [0.3]
    with torch.inference_mode():
        assert torch.allclose(prior(x[None]), net.forward_features(x[None]), atol=1e-6)


def test_checkpoint_prior_torchscript(tmp_path):
    net = ConvNet(in_channels=1, widths=(8, 16)).eval()
    torch.jit.script(net).save(str(tmp_path / "net.pt"))
    with pytest.raises(ValueError, match="preprocess"):
        create_prior(f"checkpoint:{tmp_path / 'net.pt'}")
    (tmp_path / "net.pt.json").write_text(json.dumps({"preprocess_config": {"channels": 1, "mean": [0.5], "std": [0.5]}}))
    prior = create_prior(f"checkpoint:{tmp_path / 'net.pt'}")
    assert prior.output_dim == 16
    assert _features(prior, [_gray()]).shape == (1, 16)


def test_missing_weights_file_names_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-cache"))
    missing = tmp_path / "nope.pth"
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        create_prior("timm:resnet18", weights=str(missing))
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        create_prior(f"checkpoint:{tmp_path / 'nope.safetensors'}")
    with pytest.raises(FileNotFoundError, match="priors fetch timm:resnet18"):  # offline (conftest), not cached
        create_prior("timm:resnet18", offline=True)


def test_bad_specs_and_weights_are_explained(tmp_path):
    with pytest.raises(ValueError, match="family"):
        create_prior("hub:resnet18")
    with pytest.raises(ValueError, match="'<family>:<name>'"):
        create_prior("resnet18")
    with pytest.raises(ValueError, match="Unknown architecture"):
        create_prior("random:resnet999")
    with pytest.raises(TypeError, match="allowed"):
        create_prior("random:convnet", colour=True)
    torch.save(ConvNet(widths=(8,)).state_dict(), tmp_path / "wrong.pth")
    with pytest.raises(ValueError, match="do not fit"):
        create_prior("random:convnet", weights=str(tmp_path / "wrong.pth"))


def test_preprocess_grayscale_batch_and_overrides():
    pre = Preprocess(channels=3, resize=40, crop=32, mean=[0.5], std=[0.25], interpolation="bicubic")
    img = _gray(28)
    one = pre(img)
    assert one.shape == (3, 32, 32)
    assert torch.equal(one[0], one[1]) and torch.equal(one[1], one[2])  # channel repeat
    batch = pre.batch(torch.from_numpy(np.array(img))[None, None])
    assert torch.allclose(batch[0], one)
    assert torch.allclose(pre(torch.from_numpy(np.array(img))), one)  # uint8 tensor input
    rgb = Image.new("RGB", (20, 30), (255, 0, 0))
    assert Preprocess(channels=1).to_tensor(rgb).shape == (3, 30, 20)
    assert Preprocess(channels=1)(rgb).shape == (1, 30, 20)  # RGB -> luminance for a 1-channel prior
    prior = create_prior("random:resnet18", size=32, mean=[0.1], std=[0.2])
    assert prior.preprocess(img).shape == (3, 32, 32) and prior.preprocess_config["stats"] == "custom"
    with pytest.raises(ValueError, match="both mean= and std="):
        create_prior("random:convnet", mean=[0.1])


@pytest.mark.parametrize("name", sorted(SHIPPED_PRIORS))
def test_every_shipped_prior_loads_by_name_and_embeds_28px_images(name):
    prior = create_prior(f"shipped:{name}")
    out = prior(prior.preprocess.batch(torch.rand(2, 1, 28, 28)))
    assert out.shape == (2, prior.output_dim) and torch.isfinite(out).all()
    about = SHIPPED_PRIORS[name][1]
    assert ("WITH the Fashion-MNIST training labels" in about) == ("supervised" in name)  # labelled as such


def test_a_recorded_timm_vit_is_rebuilt_at_the_size_its_rows_were_made_at(tmp_path):
    """A ViT's position embeddings depend on its input size: a prior made with size=32 (default 160) is rebuilt at 32,
    with the recorded preprocessing, and embeds as the original did."""
    import timm
    from safetensors.torch import save_file

    from accelerate_ssl.priors import rebuild_prior

    torch.manual_seed(0)
    net = timm.create_model("test_vit", pretrained=False, num_classes=0, img_size=32)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(tmp_path / "w.safetensors"))
    prior = create_prior("timm:test_vit", weights=str(tmp_path / "w.safetensors"), size=32)
    again = rebuild_prior(prior.describe())
    x = torch.rand(2, 3, 32, 32)
    with torch.inference_mode():
        assert torch.equal(again(again.preprocess.batch(x)), prior(prior.preprocess.batch(x)))
    assert again.preprocess.config == prior.preprocess.config


def test_a_checkpoint_prior_of_a_vit_built_for_small_images_loads_at_its_own_size(tmp_path):
    """A timm ViT saved at 28 px (a fixed patch grid, no crop in its preprocessing) is sized at that grid, not at a
    default side it refuses."""
    timm = pytest.importorskip("timm")
    kwargs = {"img_size": 28, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2,
              "num_classes": 0, "global_pool": "avg"}
    net = timm.create_model("vit_tiny_patch16_224", **kwargs)
    path = save_prior_checkpoint(net, tmp_path / "vit28.safetensors", "timm:vit_tiny_patch16_224", kwargs,
                                 {"channels": 1, "mean": [0.3], "std": [0.35]})
    prior = create_prior(f"checkpoint:{path}")
    assert prior.output_dim == 32
    x = torch.rand(2, 1, 28, 28)
    torch.testing.assert_close(prior(prior.preprocess.batch(x)), net.eval()(prior.preprocess.batch(x)))
