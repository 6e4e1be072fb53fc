"""Priors by zoo name (timm, open_clip, torchvision), from caches built here: never the network.

Each test points HF_HOME / TORCH_HOME at a temporary folder laid out the way the zoos' caches are
(``models--<org>--<repo>/snapshots/<rev>/`` + ``refs/main``; ``hub/checkpoints/<file>``), writes random
weights there, and checks that ``create_prior`` loads exactly those tensors, offline.
"""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from accelerate_ssl.cli import main as cli_main
from accelerate_ssl.targets.precompute import precompute_targets
from accelerate_ssl.priors import create_prior
from accelerate_ssl.priors.zoo import PriorWeightsNotFoundError
from hub_cache import REV, hub_snapshot, randomise, save_state


def _random_timm(name: str, seed: int):
    import timm

    return randomise(timm.create_model(name, pretrained=False), seed)


def _images(n=3, size=40, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size), dtype=np.uint8), mode="L") for _ in range(n)]


def _features(prior, images):
    with torch.inference_mode():
        return prior(torch.stack([prior.preprocess(im) for im in images]))


class _Images(torch.utils.data.Dataset):
    name = "tiny-gray"

    def __init__(self, n=6):
        self.images = _images(n, size=28)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], 0


# ------------------------------------------------------------------------------------------ timm
@pytest.mark.parametrize("name,pool", [("test_resnet.r160_in1k", "avg"), ("test_vit.r160_in1k", "token")])
def test_timm_name_loads_exactly_the_cached_weights(caches, name, pool):
    import timm

    model = _random_timm(name, seed=1)
    save_state(model.state_dict(), hub_snapshot(caches, f"timm/{name}") / "model.safetensors")

    prior = create_prior(f"timm:{name}")
    info = prior.describe()
    assert info["hub_id"] == f"timm/{name}" and info["tag"] == "r160_in1k" and info["revision"] == REV
    assert info["weights_file"] == "model.safetensors" and len(info["weights_sha256"]) == 64
    for key, value in model.state_dict().items():  # exactly those tensors (classifier dropped)
        if not key.startswith("head") and not key.startswith("fc"):
            assert torch.equal(prior.model.state_dict()[key], value), key
    # the weights' own preprocessing: timm's pretrained config for this tag
    cfg = timm.models.get_pretrained_cfg(name)
    assert prior.preprocess_config["crop"] == 160 and prior.preprocess_config["resize"] == int(160 / cfg.crop_pct)
    assert prior.preprocess_config["mean"] == list(cfg.mean) and prior.preprocess_config["interpolation"] == cfg.interpolation
    # pooled features as timm defines them (ViT: the class token after the final norm)
    model.reset_classifier(0)
    model.eval()
    x = torch.stack([prior.preprocess(im) for im in _images()])
    with torch.inference_mode():
        expected = model(x)
        got = prior(x)
    assert got.shape == (3, model.num_features) and torch.allclose(got, expected)
    if pool == "token":  # a ViT: timm pools the class token, and so does the prior
        assert model.global_pool == "token"


def test_timm_default_tag_and_explicit_file_wins(caches, tmp_path):
    model = _random_timm("test_resnet.r160_in1k", seed=2)
    save_state(model.state_dict(), hub_snapshot(caches, "timm/test_resnet.r160_in1k") / "model.safetensors")
    assert create_prior("timm:test_resnet").describe()["arch"] == "test_resnet.r160_in1k"  # timm's default tag
    other = _random_timm("test_resnet.r160_in1k", seed=3)
    torch.save(other.state_dict(), tmp_path / "mine.pth")
    prior = create_prior("timm:test_resnet.r160_in1k", weights=str(tmp_path / "mine.pth"))
    key = "conv1.weight" if "conv1.weight" in other.state_dict() else next(iter(other.state_dict()))
    assert torch.equal(prior.model.state_dict()[key], other.state_dict()[key])
    assert prior.describe()["source"] == "file" and prior.describe()["weights_sha256"]


def test_timm_hf_hub_repo(caches):
    model = _random_timm("test_vit.r160_in1k", seed=4)
    snap = hub_snapshot(caches, "someone/my-vit")
    save_state(model.state_dict(), snap / "model.safetensors")
    (snap / "config.json").write_text(json.dumps({
        "architecture": "test_vit", "num_classes": model.num_classes,
        "pretrained_cfg": {"input_size": [3, 160, 160], "crop_pct": 1.0, "interpolation": "bilinear",
                           "mean": [0.4, 0.4, 0.4], "std": [0.2, 0.2, 0.2], "num_classes": model.num_classes,
                           "classifier": "head"}}))
    prior = create_prior("timm:hf-hub:someone/my-vit")
    assert prior.describe()["hub_id"] == "someone/my-vit" and prior.describe()["revision"] == REV
    assert prior.preprocess_config["mean"] == [0.4, 0.4, 0.4] and prior.preprocess_config["resize"] == 160
    assert torch.equal(prior.model.state_dict()["cls_token"], model.state_dict()["cls_token"])
    assert prior.output_dim == model.num_features


def test_offline_overrides_env_and_env_is_honoured(caches, monkeypatch):
    with pytest.raises(PriorWeightsNotFoundError) as err:
        create_prior("timm:test_resnet.r160_in1k")  # HF_HUB_OFFLINE=1 from the fixture
    msg = str(err.value)
    assert "models--timm--test_resnet.r160_in1k" in msg and str(caches / "hf" / "hub") in msg
    assert "accelerate-ssl priors fetch timm:test_resnet.r160_in1k" in msg and "--weights" in msg
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(PriorWeightsNotFoundError, match="offline"):
        create_prior("timm:test_resnet.r160_in1k", offline=True)  # the argument alone, no network tried


# ------------------------------------------------------------------------------------------ open_clip
_TINY_CLIP = {"embed_dim": 16,
              "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
              "text_cfg": {"context_length": 8, "vocab_size": 50, "width": 16, "heads": 1, "layers": 1}}


def _tiny_clip(seed: int):
    import open_clip

    torch.manual_seed(seed)
    return open_clip.CLIP(**_TINY_CLIP)


def test_open_clip_hf_hub_repo(caches):
    clip = _tiny_clip(5)
    snap = hub_snapshot(caches, "someone/tiny-clip")
    save_state(clip.state_dict(), snap / "open_clip_model.safetensors")
    mean, std = [0.48, 0.46, 0.41], [0.27, 0.26, 0.28]
    (snap / "open_clip_config.json").write_text(json.dumps({
        "model_cfg": _TINY_CLIP, "preprocess_cfg": {"mean": mean, "std": std, "interpolation": "bicubic"}}))
    prior = create_prior("open_clip:hf-hub:someone/tiny-clip")
    assert prior.output_dim == 16 and prior.describe()["hub_id"] == "someone/tiny-clip"
    assert prior.preprocess_config["mean"] == mean and prior.preprocess_config["crop"] == 32
    clip.eval()
    x = torch.stack([prior.preprocess(im) for im in _images()])
    with torch.inference_mode():
        assert torch.allclose(prior(x), clip.encode_image(x), atol=1e-6)  # the image tower's encode_image


def test_open_clip_arch_and_tag(caches, monkeypatch):
    """``open_clip:<arch>/<tag>`` through open_clip's own registries (a tiny arch registered for the test)."""
    import open_clip
    from open_clip import factory, pretrained

    monkeypatch.setitem(factory._MODEL_CONFIGS, "Tiny-ViT", _TINY_CLIP)
    monkeypatch.setitem(pretrained._PRETRAINED, "Tiny-ViT", {"tinytag": {
        "hf_hub": "someone/tiny-clip-tag/", "mean": (0.1, 0.2, 0.3), "std": (0.3, 0.3, 0.3), "quick_gelu": False}})
    clip = _tiny_clip(6)
    save_state(clip.state_dict(), hub_snapshot(caches, "someone/tiny-clip-tag") / "open_clip_model.safetensors")
    prior = create_prior("open_clip:Tiny-ViT/tinytag")
    assert prior.preprocess_config["mean"] == [0.1, 0.2, 0.3] and prior.describe()["tag"] == "tinytag"
    assert torch.equal(prior.model.state_dict()["conv1.weight"], clip.visual.state_dict()["conv1.weight"])
    with pytest.raises(ValueError, match="no pretrained tag 'nope'.*tinytag"):
        create_prior("open_clip:Tiny-ViT/nope")
    with pytest.raises(ValueError, match="names no pretrained tag"):
        create_prior("open_clip:Tiny-ViT")
    assert "Tiny-ViT" in open_clip.list_models()


# ------------------------------------------------------------------------------------------ torchvision
def test_torchvision_member_from_torch_hub_cache(caches):
    import torchvision

    w = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    torch.manual_seed(7)
    net = torchvision.models.resnet18(weights=None)
    ckpt = caches / "torch" / "hub" / "checkpoints"
    ckpt.mkdir(parents=True)
    torch.save(net.state_dict(), ckpt / w.url.rsplit("/", 1)[1])
    prior = create_prior("torchvision:resnet18/IMAGENET1K_V1")
    assert torch.equal(prior.model.state_dict()["conv1.weight"], net.state_dict()["conv1.weight"])
    t = w.transforms()
    assert (prior.preprocess_config["resize"], prior.preprocess_config["crop"]) == (t.resize_size[0], t.crop_size[0])
    assert prior.describe()["tag"] == "IMAGENET1K_V1" and prior.describe()["hub_id"] == w.url
    assert create_prior("torchvision:resnet18").describe()["tag"] == "IMAGENET1K_V1"  # DEFAULT is V1 for resnet18
    with pytest.raises(ValueError, match="IMAGENET1K_V1"):
        create_prior("torchvision:resnet18/IMAGENET1K_V9")


# ------------------------------------------------------------------------------------------ every family offline
@pytest.mark.parametrize("spec,where", [
    ("timm:test_vit.r160_in1k", "models--timm--test_vit.r160_in1k"),
    ("open_clip:ViT-B-32/laion2b_s34b_b79k", "models--laion--CLIP-ViT-B-32-laion2B-s34B-b79K"),
    ("torchvision:resnet50/IMAGENET1K_V2", "checkpoints"),
    ("timm:hf-hub:someone/absent", "models--someone--absent"),
    ("open_clip:hf-hub:someone/absent", "models--someone--absent"),
])
def test_uncached_offline_is_one_clear_error(caches, spec, where):
    with pytest.raises(PriorWeightsNotFoundError) as err:
        create_prior(spec)
    msg = str(err.value)
    assert spec in msg and where in msg and f"accelerate-ssl priors fetch {spec}" in msg and "--weights" in msg
    assert "Traceback" not in msg and "huggingface_hub" not in msg


@pytest.mark.parametrize("spec,match", [
    ("timm:vit_smal_patch14_dinov2", "close matches: vit_small_patch14_dinov2"),
    ("timm:resnet50.not_a_tag", "no pretrained tag 'not_a_tag'.*a1_in1k"),
    ("open_clip:ViT-B-33/openai", "close matches: ViT-B-32"),
    ("torchvision:resnet51", "close matches: resnet50"),
])
def test_bad_names(caches, spec, match):
    with pytest.raises(ValueError, match=match):
        create_prior(spec)


# ------------------------------------------------------------------------------------------ end to end
def test_precompute_records_provenance_and_refuses_other_weights(caches, tmp_path, capsys):
    name = "test_resnet.r160_in1k"
    snap = hub_snapshot(caches, f"timm/{name}")
    save_state(_random_timm(name, seed=8).state_dict(), snap / "model.safetensors")
    data = _Images()
    store = precompute_targets(create_prior(f"timm:{name}"), data, tmp_path / "store", progress=False)
    prior_meta = store.metadata["prior"]
    assert prior_meta["hub_id"] == f"timm/{name}" and prior_meta["revision"] == REV
    first_sha = prior_meta["weights_sha256"]
    assert store.metadata["prior"]["preprocess"]["crop"] == 160 and store.array.shape == (6, 96)

    # the same name, other cached weights (a new revision of the repo): a mismatch naming both hashes
    (snap / "model.safetensors").unlink()
    save_state(_random_timm(name, seed=9).state_dict(), snap / "model.safetensors")
    prior2 = create_prior(f"timm:{name}")
    assert prior2.describe()["weights_sha256"] != first_sha
    with pytest.raises(ValueError) as err:
        precompute_targets(prior2, data, tmp_path / "store", progress=False)
    msg = str(err.value)
    assert first_sha[:12] in msg and prior2.describe()["weights_sha256"][:12] in msg and "weights_sha256" in msg

    # the CLI speaks the same grammar
    assert cli_main(["precompute", "--prior", f"timm:{name}", "--data", "digits", "--split", "test",
                     "--out", str(tmp_path / "cli"), "--no-progress"]) == 0
    assert cli_main(["precompute", "--prior", "timm:test_vit.r160_in1k", "--data", "digits",
                     "--out", str(tmp_path / "cli2"), "--no-progress"]) == 2
    err_text = capsys.readouterr().err
    assert "accelerate-ssl priors fetch timm:test_vit.r160_in1k" in err_text and "Traceback" not in err_text


# ------------------------------------------------------------------------------------------ accelerate-ssl priors
def test_priors_cli_list_show_fetch(caches, capsys):
    name = "test_resnet.r160_in1k"
    assert cli_main(["priors", "list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    specs = {r["spec"]: r for r in listing["recommended"]}
    assert {"timm:vit_small_patch14_dinov2.lvd142m", "open_clip:ViT-B-32/laion2b_s34b_b79k",
            "torchvision:resnet50/IMAGENET1K_V2", "shipped:fashion-mnist-byol"} <= set(specs)
    assert specs["timm:vit_small_patch14_dinov2.lvd142m"]["output_dim"] == 384
    assert specs["open_clip:ViT-B-32/laion2b_s34b_b79k"]["output_dim"] == 512
    assert specs["torchvision:resnet50/IMAGENET1K_V2"]["output_dim"] == 2048
    assert specs["shipped:fashion-mnist-byol"]["cached"] is True
    from accelerate_ssl.priors import SHIPPED_PRIORS

    assert {f"shipped:{n}" for n in SHIPPED_PRIORS} <= set(specs)  # every shipped prior is listed, the demo's too
    assert specs["timm:vit_small_patch14_dinov2.lvd142m"]["cached"] is False  # an empty cache here
    assert "shipped" in listing["families"]

    assert cli_main(["priors", "show", f"timm:{name}", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["cached"] is False and shown["source"] == f"timm/{name}" and shown["output_dim"] == 96
    save_state(_random_timm(name, seed=1).state_dict(), hub_snapshot(caches, f"timm/{name}") / "model.safetensors")
    assert cli_main(["priors", "show", f"timm:{name}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cached"] is True
    assert cli_main(["priors", "list"]) == 0 and "shipped:fashion-mnist-byol" in capsys.readouterr().out

    # fetch of a cached prior loads it from the cache (no download needed); an uncached one, offline: the error
    assert cli_main(["priors", "fetch", f"timm:{name}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loaded"]["revision"] == REV
    assert cli_main(["priors", "show"]) == 2 and "needs a SPEC" in capsys.readouterr().err
    assert cli_main(["priors", "show", "timm:resnet5"]) == 2 and "close matches" in capsys.readouterr().err


def test_timm_vit_at_another_input_size_and_wrong_file(caches, tmp_path):
    name = "test_vit.r160_in1k"
    save_state(_random_timm(name, seed=10).state_dict(), hub_snapshot(caches, f"timm/{name}") / "model.safetensors")
    prior = create_prior(f"timm:{name}", size=96)  # timm resamples the position embeddings as it loads
    assert prior.preprocess_config["crop"] == 96
    assert _features(prior, _images()).shape == (3, prior.output_dim)
    torch.save(_random_timm("test_resnet.r160_in1k", seed=0).state_dict(), tmp_path / "resnet.pth")
    with pytest.raises(ValueError, match="do not fit 'timm:test_vit.r160_in1k'"):
        create_prior(f"timm:{name}", weights=str(tmp_path / "resnet.pth"))
