"""Prior models for ReLA-D targets: a registry of frozen feature extractors, each with its own preprocessing.

A *prior* (ReLA v2, Sec. 4 / ReLA-D) is any frozen network psi whose pooled features become the
per-sample targets. ``create_prior(spec)`` builds one from a readable spec, one grammar for Python
and every CLI verb (``--prior SPEC [--weights FILE]``):

=========================================  ===================================================================
``timm:<model>[.<tag>]``                   timm weights by name, e.g. ``timm:vit_small_patch14_dinov2.lvd142m``;
``timm:hf-hub:<org>/<repo>``               also a timm repository on the Hugging Face hub.
``open_clip:<arch>/<tag>``                 a CLIP image tower, e.g. ``open_clip:ViT-B-32/laion2b_s34b_b79k``;
``open_clip:hf-hub:<org>/<repo>``          also an open_clip repository on the hub.
``torchvision:<arch>[/<weights member>]``  e.g. ``torchvision:resnet50/IMAGENET1K_V2`` (default ``DEFAULT``).
``shipped:<name>``                         a prior that ships inside this package (:data:`SHIPPED_PRIORS`), e.g.
                                           ``shipped:fashion-mnist-byol``.
``random:<arch>``                          randomly initialised (seeded, ``seed=0``) torchvision arch or one of
                                           :mod:`accelerate_ssl.backbones` (``convnet``, ``resnet_small``;
                                           ``in_channels=1`` by default). Input kept at the data's **native
                                           size**: a random network has no training resolution to match.
                                           Normalised with the **data set's own** mean/std
                                           (``precompute_targets`` takes them from ``dataset.mean``/``.std``).
``checkpoint:<path>``                      a safetensors state_dict written by :func:`save_prior_checkpoint`
                                           whose metadata names the arch (your own class through
                                           :func:`register_architecture`); a TorchScript file only while the
                                           installed PyTorch reads them (:func:`load_torchscript`).
=========================================  ===================================================================

The zoo families (timm, open_clip, torchvision) load through each zoo's own mechanism and caches,
offline-first, with the weights' own preprocessing: see :mod:`accelerate_ssl.priors.zoo`. An
explicit ``weights=<file>`` always wins over the caches.

Every prior outputs pooled features with the classifier removed (``output_dim``); for ViTs that is
the pooled token the zoo defines (timm's ``num_classes=0`` features, CLIP's ``encode_image``).
Grayscale input is repeated to 3 channels when the network wants RGB (and RGB is converted to
luminance for a 1-channel network).
"""

from __future__ import annotations

import difflib
import json
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from ..optional import require
from ..atomic import atomic_path
from ..launch import warn_once
from ..checksum import file_sha256

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_CHECKPOINT_META_KEY = "accelerate_ssl_prior"
_LUMA = (0.299, 0.587, 0.114)  # ITU-R 601, as PIL's convert("L")


# ----------------------------------------------------------------------------------------------
# preprocessing
# ----------------------------------------------------------------------------------------------
class Preprocess:
    """A prior's own input pipeline, as batched tensor ops (so per-image and batched calls agree).

    Steps: to float in [0, 1] -> channel adapt (1->3 repeat, 3->1 luminance) -> resize the shorter
    side to ``resize`` (antialiased, ``interpolation``) -> centre crop ``crop`` x ``crop`` ->
    ``(x - mean) / std``. ``resize``/``crop`` ``None`` keep the input size. A 1-value mean/std is
    broadcast over channels.

    Args:
        channels: channels the network expects.
        resize, crop: see above.
        mean, std: normalisation statistics.
        interpolation: ``"bilinear"`` or ``"bicubic"``.
        stats: where mean/std came from (``"imagenet"``, ``"clip"``, ``"dataset"``, ``"custom"``,
            ``"default"`` = placeholder 0.5/0.5 that ``precompute_targets`` replaces by the data set's).
    """

    def __init__(self, channels: int = 3, resize: Optional[int] = None, crop: Optional[int] = None,
                 mean: Sequence[float] = (0.5,), std: Sequence[float] = (0.5,), interpolation: str = "bilinear",
                 stats: str = "custom"):
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels}.")
        if interpolation not in ("bilinear", "bicubic"):
            raise ValueError(f"interpolation must be 'bilinear' or 'bicubic', got {interpolation!r}.")
        mean, std = [float(m) for m in mean], [float(s) for s in std]
        for name, v in (("mean", mean), ("std", std)):
            if len(v) not in (1, channels):
                raise ValueError(f"{name} must have 1 or {channels} values for a {channels}-channel prior, got {v}.")
        if any(s <= 0 for s in std):
            raise ValueError(f"std values must be positive, got {std}.")
        self.channels, self.resize, self.crop = int(channels), resize, crop
        self.mean, self.std, self.interpolation, self.stats = mean, std, interpolation, stats

    @property
    def config(self) -> dict:
        return {"channels": self.channels, "resize": self.resize, "crop": self.crop, "mean": self.mean,
                "std": self.std, "interpolation": self.interpolation, "stats": self.stats}

    @classmethod
    def from_config(cls, config: dict) -> "Preprocess":
        allowed = {"channels", "resize", "crop", "mean", "std", "interpolation", "stats"}
        unknown = set(config) - allowed
        if unknown:
            raise ValueError(f"Unknown preprocess_config keys {sorted(unknown)}; allowed: {sorted(allowed)}.")
        return cls(**config)

    def with_stats(self, mean: Sequence[float], std: Sequence[float], stats: str) -> "Preprocess":
        """A copy with other normalisation statistics (channel count of the stats may be 1)."""
        return Preprocess(**{**self.config, "mean": list(mean), "std": list(std), "stats": stats})

    @staticmethod
    def to_tensor(image: Any) -> torch.Tensor:
        """PIL image / ndarray / tensor -> tensor ``[C, H, W]`` (uint8 kept as uint8; floats in [0, 1])."""
        if hasattr(image, "mode") and hasattr(image, "convert"):  # PIL
            if image.mode not in ("L", "RGB"):
                image = image.convert("RGB")
            image = np.array(image)  # a writable copy
        if isinstance(image, np.ndarray):
            image = torch.from_numpy(np.ascontiguousarray(image) if image.flags.writeable else image.copy())
            if image.ndim == 3 and image.shape[-1] in (1, 3) and image.shape[0] not in (1, 3):
                image = image.permute(2, 0, 1)  # HWC -> CHW
        if not isinstance(image, torch.Tensor):
            raise TypeError(f"Cannot preprocess a {type(image).__name__}; pass a PIL image, a numpy array or a tensor.")
        if image.ndim == 2:
            image = image.unsqueeze(0)
        if image.ndim != 3 or image.shape[0] not in (1, 3):
            raise ValueError(f"Expected an image [C, H, W] with 1 or 3 channels, got shape {tuple(image.shape)}.")
        return image

    def batch(self, x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Preprocess a batch ``[B, C, H, W]`` (uint8 0..255 or float 0..1) on the device it is on -> ``[B, channels,
        h, w]``. The arithmetic is float32 on every device (the weights' own resize, crop and normalisation, so a batch
        preprocessed on a GPU gives the rows of one preprocessed on the CPU to float rounding); the result is returned
        as ``dtype`` (default float32; the precompute passes its precision's, the dtype autocast would cast the
        prior's input to anyway). The precompute hands this uint8 images already on the prior's device: a quarter of
        float32's bytes cross, and the float work runs there, batched.
        Float images outside [0, 1] (0..255 floats, or images already normalised) are refused: the prior would
        embed them as they are and every target would be wrong."""
        if x.dtype == torch.uint8:
            x = x.float().div_(255.0)
        elif not x.dtype.is_floating_point:
            raise ValueError(
                f"Images must be uint8 (0..255) or float (0..1), got {x.dtype}: integer pixels in a wider type (a "
                "Hugging Face numpy / torch format widens uint8 to int64) are 0..255 values or 16-bit ones, which "
                "cannot be told apart. Convert 8-bit pixels with .astype(np.uint8) / .to(torch.uint8) (Hugging Face: "
                "with_format('numpy', columns=['<image column>'], dtype='uint8', output_all_columns=True)), or scale "
                "others to float in [0, 1].")
        else:
            x = x.float()
            lo, hi = (float(v) for v in torch.aminmax(x)) if x.numel() else (0.0, 0.0)
            if lo < -1e-3 or hi > 1 + 1e-3:
                raise ValueError(
                    f"Float images must hold values in [0, 1], got values in [{lo:.3g}, {hi:.3g}]: "
                    + ("0..255 values as floats? Divide by 255 or pass uint8 images." if hi > 2 else
                       "images normalised already? Pass them before normalisation: the prior applies its own "
                       f"({self.stats} statistics).")
                )
        c = x.shape[1]
        if c != self.channels:
            if c == 3 and self.channels == 1:
                warn_once(
                    "This prior takes 1-channel (grayscale) images: your RGB images are converted to luminance "
                    "(ITU-R 601, as PIL's convert('L')) before it embeds them, so its targets ignore colour. Use a "
                    "3-channel prior for colour data (accelerate-ssl priors list).", UserWarning, stacklevel=2)
                x = (x * torch.tensor(_LUMA, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)).sum(1, keepdim=True)
            elif not (c == 1 and self.channels == 3):  # 1 -> 3 is repeated after the resize: the same values, 1/3 the work
                raise ValueError(f"Cannot adapt {c}-channel images to a {self.channels}-channel prior.")
        if self.resize is not None:
            h, w = x.shape[-2:]
            short = min(h, w)
            size = (int(round(h * self.resize / short)), int(round(w * self.resize / short)))
            if size != (h, w):
                x = torch.nn.functional.interpolate(x, size=size, mode=self.interpolation, align_corners=False, antialias=True)
                if self.interpolation == "bicubic":
                    x = x.clamp_(0.0, 1.0)
        if self.crop is not None:
            h, w = x.shape[-2:]
            if h < self.crop or w < self.crop:
                raise ValueError(f"Image {h}x{w} is smaller than the crop {self.crop}; set resize >= crop.")
            top, left = (h - self.crop) // 2, (w - self.crop) // 2
            x = x[..., top : top + self.crop, left : left + self.crop]
        if x.shape[1] != self.channels:
            x = x.expand(-1, self.channels, -1, -1)
        mean, std = self._statistics(x.device)
        out = ((x - mean) / std).contiguous()
        return out if dtype is None else out.to(dtype)

    def _statistics(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``mean`` and ``std`` as float32 ``[1, C, 1, 1]`` on ``device``, made once per device (a tensor made from a
        list on a GPU is a copy the host waits for: once, not per batch)."""
        cache = self.__dict__.setdefault("_on_device", {})
        if device not in cache:
            cache[device] = tuple(torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1).to(device)
                                  for v in (self.mean, self.std))
        return cache[device]

    def __call__(self, image: Any) -> torch.Tensor:
        """One image (PIL, uint8/float tensor or ndarray) -> float tensor ``[channels, h, w]``."""
        return self.batch(self.to_tensor(image).unsqueeze(0))[0]

    def __repr__(self) -> str:
        return f"Preprocess({self.config})"


# ----------------------------------------------------------------------------------------------
# the prior module
# ----------------------------------------------------------------------------------------------
class Prior(nn.Module):
    """A frozen feature extractor with its own preprocessing (contract: ``accelerate_ssl.priors``).

    Attributes:
        spec: the spec it was created from (``"random:resnet18"``).
        output_dim: feature dim of ``forward``.
        preprocess: :class:`Preprocess` (PIL image / tensor -> ``[C, H, W]`` float).
        preprocess_config: JSON-able dict of the preprocessing.
    """

    def __init__(self, model: nn.Module, spec: str, preprocess: Preprocess, info: dict):
        super().__init__()
        self.model = model
        self.spec = spec
        self.preprocess = preprocess
        self.info = dict(info)
        self.model.eval()
        for p in self.model.parameters():  # (Module.requires_grad_ is missing on TorchScript modules)
            p.requires_grad_(False)
        self.output_dim = int(info["output_dim"])

    @property
    def preprocess_config(self) -> dict:
        return self.preprocess.config

    def train(self, mode: bool = True) -> "Prior":  # a prior is always frozen / in eval mode
        return super().train(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).flatten(1)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """The prior's last spatial feature map of preprocessed images ``x``: ``[B, C, h, w]``, the map before the
        pooling that makes ``forward``'s rows (:func:`feature_map_of`; cell ``(i, j)`` covers the input pixels
        ``[i s, (i + 1) s) x [j s, (j + 1) s)`` with ``s`` = :attr:`map_stride`). Spatial targets store it."""
        return feature_map_of(self.model, x)[0]

    @property
    def map_stride(self) -> int:
        """Input pixels per cell of :meth:`feature_map` (a ViT's patch size, a CNN's total down-sampling)."""
        return feature_map_of(self.model, None)[1]

    def describe(self) -> dict:
        """JSON-able description recorded in a TargetStore's metadata."""
        return {"spec": self.spec, **self.info, "preprocess": self.preprocess_config}

    def extra_repr(self) -> str:
        return f"spec={self.spec!r}, output_dim={self.output_dim}"


_FAMILIES: dict[str, Callable[..., Prior]] = {}


def register_prior(family: str):
    """Decorator registering ``builder(arch: str, weights: str | None, **overrides) -> Prior`` for ``family:``."""

    def decorator(builder):
        _FAMILIES[family] = builder
        return builder

    return decorator


def list_priors() -> list[str]:
    """The registered prior families (``["checkpoint", "open_clip", "random", "shipped", "timm", "torchvision"]``)."""
    return sorted(_FAMILIES)


_PREPROCESS_OVERRIDES = {"size", "resize", "crop", "mean", "std", "interpolation"}


def create_prior(spec: str, weights: Optional[str] = None, offline: Optional[bool] = None, **overrides) -> Prior:
    """Build a frozen prior from ``"<family>:<name>"`` (see the module docstring).

    Args:
        spec: e.g. ``"timm:resnet50.a1_in1k"``, ``"open_clip:ViT-B-32/laion2b_s34b_b79k"``,
            ``"torchvision:resnet50/IMAGENET1K_V2"``, ``"shipped:fashion-mnist-byol"``, ``"random:resnet18"``,
            ``"checkpoint:prior.safetensors"``.
        weights: a local weights file (``.safetensors`` or a ``torch.save``-d state_dict); wins over any cache.
        offline: never download (default: ``HF_HUB_OFFLINE`` / ``ACCELERATE_SSL_OFFLINE`` from the
            environment). Cached zoo weights are used without the network either way.
        **overrides: preprocessing (``size`` = resize and crop to this, ``resize``, ``crop``, ``mean``,
            ``std``, ``interpolation``); for random priors also ``seed`` (default 0) and, for the
            backbones ``convnet``/``resnet_small``, ``in_channels`` (default 1).
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"Prior spec must look like '<family>:<name>' with family in {list_priors()}, got {spec!r} "
                         "(e.g. 'timm:resnet50.a1_in1k', 'shipped:fashion-mnist-byol', 'random:resnet18'); "
                         "`accelerate-ssl priors list` shows recommended ones.")
    family, arch = spec.split(":", 1)
    if family not in _FAMILIES:
        raise ValueError(f"Unknown prior family {family!r} in {spec!r}; choose one of {list_priors()}.")
    if not arch:
        raise ValueError(f"Prior spec {spec!r} names no model; e.g. '{family}:resnet18'.")
    if weights is not None:
        _check_file(weights, "weights file")
    return _FAMILIES[family](arch, weights, offline=offline, **overrides)


#: the fields of a recorded prior that name its weights' bytes: a rebuilt prior must match each one recorded
WEIGHT_DIGESTS = ("weights_sha256", "checkpoint_sha256")


def rebuild_prior(recorded: dict, offline: Optional[bool] = None) -> Prior:
    """The prior a store recorded (``prior.describe()`` in its metadata), built again to embed more images the way the
    rows were made: the same spec, weights file, seed and input channels, the recorded preprocessing (with the data
    set's statistics), and the same weights, byte for byte (each recorded sha256 compared).

    Raises ValueError naming what differs or what is missing (a weights file moved, another version in the cache)."""
    spec = recorded.get("spec")
    if not spec:
        raise ValueError("the store records no prior spec (targets made outside precompute_targets)")
    family = recorded.get("family")
    options: dict = {}
    if family == "random":
        from .. import backbones

        options["seed"] = int(recorded.get("seed") or 0)
        if recorded.get("arch") in backbones.BACKBONES:
            options["in_channels"] = int((recorded.get("preprocess") or {}).get("channels", 1))
    crop = (recorded.get("preprocess") or {}).get("crop")
    if family == "timm" and crop:
        options["size"] = int(crop)  # a ViT is built for the input size its rows were made at
    if recorded.get("checkpoint"):
        spec = f"checkpoint:{recorded['checkpoint']}"  # the absolute path recorded (the spec's may be relative)
    weights = recorded.get("weights")
    if weights and not Path(weights).is_file():
        raise ValueError(f"its weights file {weights!r} is not there any more")
    prior = create_prior(spec, weights=weights or None, offline=offline, **options)
    built = prior.describe()
    for key in WEIGHT_DIGESTS:
        if recorded.get(key) and built.get(key) != recorded[key]:
            raise ValueError(f"the weights of {recorded['spec']!r} found now have {key} {str(built.get(key))[:12]}..., "
                             f"the store recorded {recorded[key][:12]}... (other weights than the rows were made with)")
    if int(built["output_dim"]) != int(recorded.get("output_dim", built["output_dim"])):
        raise ValueError(f"{recorded['spec']!r} now outputs {built['output_dim']} values, the store recorded "
                         f"{recorded['output_dim']}")
    if recorded.get("preprocess"):
        prior.preprocess = Preprocess.from_config(recorded["preprocess"])
    return prior


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _check_file(path, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"{what} {str(p)!r} does not exist. Pass the path of a local file (accelerate-ssl never downloads "
            "weights: fetch them on a machine with network access and copy them here)."
        )
    return p




def load_state_dict_file(path) -> dict[str, torch.Tensor]:
    """A state_dict from ``.safetensors`` or a ``torch.save`` file (unwrapping ``state_dict``/``model``
    entries and ``module.`` prefixes). Loaded with ``weights_only=True``: no code is executed."""
    path = _check_file(path, "weights file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as err:
            raise ValueError(f"Cannot read weights file {str(path)!r} ({err}); pass a .safetensors or torch.save-d "
                             "state_dict file.") from err
        for key in ("state_dict", "model", "model_state_dict"):
            if isinstance(state, dict) and isinstance(state.get(key), dict):
                state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"Weights file {str(path)!r} does not hold a state_dict of tensors.")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def load_weights(model: nn.Module, state: dict, source: str, ignore_prefixes: Sequence[str] = ()) -> None:
    state = {k: v for k, v in state.items() if not any(k == p or k.startswith(p + ".") for p in ignore_prefixes)}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatches
        raise ValueError(f"Weights {source} do not fit the architecture ({str(err).splitlines()[1].strip()} ...). "
                         "Pass weights saved from the same architecture as the spec.") from err
    if missing or unexpected:
        raise ValueError(
            f"Weights {source} do not fit the architecture: missing {list(missing)[:6]}{'...' if len(missing) > 6 else ''}, "
            f"unexpected {list(unexpected)[:6]}{'...' if len(unexpected) > 6 else ''}. Pass weights saved from the same "
            "architecture as the spec."
        )


def strip_classifier(model: nn.Module) -> list[str]:
    """Replace the final classifier of a torchvision-style model by Identity; return the removed prefixes."""
    removed = []
    if isinstance(getattr(model, "fc", None), nn.Linear):
        model.fc = nn.Identity()
        removed.append("fc")
    elif isinstance(getattr(model, "classifier", None), nn.Linear):
        model.classifier = nn.Identity()
        removed.append("classifier")
    elif isinstance(getattr(model, "classifier", None), nn.Sequential):
        seq = model.classifier
        for i in range(len(seq) - 1, -1, -1):
            if isinstance(seq[i], nn.Linear):
                seq[i] = nn.Identity()
                removed.append(f"classifier.{i}")
                break
    elif isinstance(getattr(model, "heads", None), nn.Sequential) and hasattr(model.heads, "head"):
        model.heads.head = nn.Identity()
        removed.append("heads.head")
    elif isinstance(getattr(model, "head", None), nn.Linear):
        model.head = nn.Identity()
        removed.append("head")
    return removed


def fixed_input_size(model: nn.Module) -> Optional[int]:
    """The one input side ``model`` accepts (a timm ViT built for a fixed patch grid, e.g. ``img_size=28``), or None
    when it takes any size."""
    embed = getattr(model, "patch_embed", None)
    size = getattr(embed, "img_size", None)
    if size is None or getattr(embed, "dynamic_img_size", False) or not getattr(embed, "strict_img_size", True):
        return None
    return int(size[0] if isinstance(size, (tuple, list)) else size)


def probe_dim(model: nn.Module, channels: int, size: int) -> int:
    model.eval()
    with torch.inference_mode():
        out = model(torch.zeros(1, channels, size, size))
    if isinstance(out, (tuple, list)):
        raise ValueError("The prior's forward returns a tuple; wrap it so that it returns pooled features [B, D].")
    return int(out.flatten(1).shape[1])


def preprocess_with(defaults: dict, overrides: dict) -> Preprocess:
    cfg = dict(defaults)
    if "size" in overrides:
        size = overrides.pop("size")
        cfg["resize"], cfg["crop"] = size, size
    for key in ("resize", "crop", "interpolation"):
        if key in overrides:
            cfg[key] = overrides.pop(key)
    if "mean" in overrides or "std" in overrides:
        if not ("mean" in overrides and "std" in overrides):
            raise ValueError("Pass both mean= and std= to override a prior's normalisation.")
        cfg["mean"], cfg["std"], cfg["stats"] = list(overrides.pop("mean")), list(overrides.pop("std")), "custom"
    return Preprocess(**cfg)


def reject_unknown(overrides: dict, spec: str, extra: Sequence[str] = ()) -> None:
    if overrides:
        raise TypeError(f"Unknown option(s) {sorted(overrides)} for prior {spec!r}; allowed: "
                        f"{sorted(_PREPROCESS_OVERRIDES | set(extra))}.")


class _Features(nn.Module):
    """Calls ``forward_features`` (pooled) when the backbone has one, else ``forward``."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        f = getattr(self.net, "forward_features", None)
        return f(x) if f is not None and not hasattr(self.net, "reset_classifier") else self.net(x)


NO_FEATURE_MAP = ("spatial targets need the prior's feature map before pooling, which accelerate-ssl reads from timm "
                  "models (a ViT's patch tokens, a CNN's last map), torchvision ResNets and the ConvNet / ResNetSmall "
                  "backbones (random:, shipped:, checkpoint: priors); use one of those, or global targets")


def feature_map_of(model: nn.Module, x: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], int]:
    """``(map [B, C, h, w], stride)`` of a prior's network for preprocessed images ``x`` (``x=None``: the stride only),
    the map being the one its pooled features are the average of (or, for a ViT, the patch tokens beside its pooled
    token):

    - a timm ViT (``forward_features`` gives tokens ``[B, T, C]``): the tokens without the ``num_prefix_tokens``
      prefix (class / register tokens), after the final norm, reshaped to the patch grid; stride = the patch size;
    - a timm CNN (``forward_features`` gives ``[B, C, h, w]``): that map; stride = ``feature_info[-1]["reduction"]``;
    - a torchvision ResNet: the output of ``layer4`` (stride 32);
    - the backbones :class:`~accelerate_ssl.backbones.ConvNet` (its conv blocks before the global pool; stride
      2^blocks) and :class:`~accelerate_ssl.backbones.ResNetSmall` (its last stage; stride 2^(stages - 1)).

    Anything else is refused, naming the priors that have a map."""
    from .. import backbones

    net = model.net if isinstance(model, _Features) else model
    if isinstance(net, backbones.ConvNet):
        return (None if x is None else net.features(x)), 2 ** len(net.config["widths"])
    if isinstance(net, backbones.ResNetSmall):
        return (None if x is None else net.stages(net.stem(x))), 2 ** (len(net.config["widths"]) - 1)
    if hasattr(net, "forward_features") and hasattr(net, "reset_classifier"):  # timm
        patch = getattr(getattr(net, "patch_embed", None), "patch_size", None)
        if patch is not None:  # a ViT: tokens
            ph, pw = (patch, patch) if isinstance(patch, int) else tuple(patch)
            if ph != pw:
                raise ValueError(f"a ViT with non-square patches ({ph}x{pw}) is not supported for spatial targets")
            if x is None:
                return None, int(ph)
            tokens = net.forward_features(x)
            h, w = x.shape[-2] // ph, x.shape[-1] // pw
            if tokens.ndim != 3 or tokens.shape[1] - int(getattr(net, "num_prefix_tokens", 0)) != h * w:
                raise ValueError(f"the ViT's forward_features gave {tuple(tokens.shape)}, not the {h}x{w} patch "
                                 "tokens (plus its prefix tokens) its patch size implies")
            grid = tokens[:, int(getattr(net, "num_prefix_tokens", 0)):]
            return grid.reshape(len(x), h, w, -1).permute(0, 3, 1, 2), int(ph)
        info = getattr(net, "feature_info", None)
        if info:
            if x is None:
                return None, int(info[-1]["reduction"])
            out = net.forward_features(x)
            if out.ndim == 4 and out.shape[1] == net.num_features:
                return out, int(info[-1]["reduction"])
            raise ValueError(f"the timm model's forward_features gave {tuple(out.shape)}, not a [B, C, h, w] map")
    if all(hasattr(net, name) for name in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer4")):  # torchvision
        if x is None:
            return None, 32
        y = net.maxpool(net.relu(net.bn1(net.conv1(x))))
        return net.layer4(net.layer3(net.layer2(net.layer1(y)))), 32
    raise ValueError(f"{type(net).__name__} gives no feature map: {NO_FEATURE_MAP}")


def prior_info(family: str, arch: str, weights, output_dim: int, **extra) -> dict:
    info = {"family": family, "arch": arch, "output_dim": output_dim,
            "weights": str(Path(weights).resolve()) if weights else None,
            "weights_sha256": file_sha256(weights) if weights else None}
    info.update(extra)
    return info


# ----------------------------------------------------------------------------------------------
# families
# ----------------------------------------------------------------------------------------------
@register_prior("random")
def _random_prior(arch: str, weights: Optional[str] = None, offline: Optional[bool] = None, seed: int = 0,
                  in_channels: Optional[int] = None, **overrides) -> Prior:
    from .. import backbones

    spec = f"random:{arch}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        if arch in backbones.BACKBONES:
            channels = 1 if in_channels is None else int(in_channels)
            kwargs = {"in_channels": channels}
            if arch == "resnet_small":
                kwargs["num_classes"] = 0
            model: nn.Module = _Features(backbones.create_backbone(arch, **kwargs))
            prefix = "net."
        else:
            if in_channels not in (None, 3):
                raise ValueError(f"in_channels={in_channels} is only for the backbones {sorted(backbones.BACKBONES)}; "
                                 f"torchvision's {arch} takes 3 channels (grayscale is repeated).")
            channels = 3
            model = torchvision_model(arch, spec)
            strip_classifier(model)
            prefix = ""
    if weights:
        state = load_state_dict_file(weights)
        if prefix and not any(k.startswith(prefix) for k in state):
            state = {prefix + k: v for k, v in state.items()}
        load_weights(model, state, repr(weights), ignore_prefixes=("fc", "classifier", "head", "heads.head", "net.fc"))
    pre = preprocess_with({"channels": channels, "mean": [0.5], "std": [0.5], "stats": "default"}, overrides)
    reject_unknown(overrides, spec, ("seed", "in_channels"))
    dim = probe_dim(model, channels, pre.crop or 32)
    return Prior(model, spec, pre, prior_info("random", arch, weights, dim, seed=int(seed)))


def torchvision_model(arch: str, spec: str, **kwargs) -> nn.Module:
    """A randomly initialised torchvision classification model (``kwargs`` to its constructor), or an error
    naming the closest architecture names."""
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)
    if arch not in names:
        close = difflib.get_close_matches(arch, names, n=5, cutoff=0.5)
        raise ValueError(f"Unknown architecture {arch!r} in {spec!r}: not in accelerate_ssl.backbones or torchvision "
                         f"classification models ({'close matches: ' + ', '.join(close) if close else 'e.g. resnet18, resnet50'}).")
    return torchvision.models.get_model(arch, weights=None, **kwargs)


#: architectures of your own that a checkpoint may name (:func:`register_architecture`): name -> builder
_ARCHITECTURES: dict[str, Callable[..., nn.Module]] = {}


def register_architecture(name: str, builder: Callable[..., nn.Module]) -> None:
    """Let prior checkpoints name ``name`` as their architecture: ``builder(**arch_kwargs)`` builds the network that
    :func:`save_prior_checkpoint` saved (your own class, or a function returning one). Register it in every process
    that loads such a checkpoint, before ``create_prior("checkpoint:<file>")``. A checkpoint names one of the
    architectures this process knows; it never names code to import, so loading one runs none."""
    from .. import backbones

    if not isinstance(name, str) or not name or ":" in name or name in backbones.BACKBONES:
        raise ValueError(f"register_architecture: the name must be a non-empty string without ':' and not one of "
                         f"{sorted(backbones.BACKBONES)}, got {name!r}.")
    if not callable(builder):
        raise TypeError(f"register_architecture({name!r}, ...): the builder must be callable (a class or a function "
                        f"returning an nn.Module), got {type(builder).__name__}.")
    _ARCHITECTURES[name] = builder


def _build_arch(arch: str, arch_kwargs: dict) -> nn.Module:
    from .. import backbones

    if arch in _ARCHITECTURES:
        return _ARCHITECTURES[arch](**arch_kwargs)
    if arch in backbones.BACKBONES:
        return backbones.create_backbone(arch, **arch_kwargs)
    if arch.startswith("torchvision:"):
        import torchvision

        return torchvision.models.get_model(arch.split(":", 1)[1], weights=None, **arch_kwargs)
    if arch.startswith("timm:"):
        require("timm", "timm:<model> priors")
        import timm

        return timm.create_model(arch.split(":", 1)[1], pretrained=False, **arch_kwargs)
    raise ValueError(f"Unknown checkpoint arch {arch!r}; use one of {sorted(backbones.BACKBONES)}, "
                     "'torchvision:<arch>', 'timm:<name>', or a class of yours registered first with "
                     f"register_architecture({arch!r}, YourClass)" + (f" (registered here: {sorted(_ARCHITECTURES)})"
                                                                       if _ARCHITECTURES else "") + ".")


def save_prior_checkpoint(model: nn.Module, path, arch: str, arch_kwargs: Optional[dict] = None,
                          preprocess_config: Optional[dict] = None) -> Path:
    """Save ``model`` as a prior loadable by ``create_prior("checkpoint:<path>")`` (safetensors, atomic).

    The safetensors header metadata holds JSON ``{"arch", "arch_kwargs", "preprocess_config"}``;
    ``arch`` is a :mod:`accelerate_ssl.backbones` name, ``"torchvision:<arch>"``/``"timm:<name>"``, or a name given
    to :func:`register_architecture` (a network of your own), rebuilt with ``arch_kwargs``. ``preprocess_config``
    holds :class:`Preprocess` keys (default: native size, 1 channel for backbones else 3, mean/std 0.5). The file
    holds tensors and JSON only: loading it runs no code (the way to save a prior that replaces TorchScript).
    """
    from safetensors.torch import save_file

    arch_kwargs = dict(arch_kwargs or {})
    default_channels = arch_kwargs.get("in_channels", 3)
    pre = Preprocess.from_config({"channels": default_channels, **(preprocess_config or {})})
    _build_arch(arch, arch_kwargs)  # fail now, not at load time
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"Prior checkpoints are safetensors files; name it '*.safetensors', got {str(path)!r}.")
    meta = {"arch": arch, "arch_kwargs": arch_kwargs, "preprocess_config": pre.config, "format": 1}
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata={_CHECKPOINT_META_KEY: json.dumps(meta)})
    return path


#: how to save a prior instead of as TorchScript (named by :func:`load_torchscript`'s notice and errors)
SAFE_PRIOR_FILE = ("save_prior_checkpoint(model, 'prior.safetensors', arch) (arch: an accelerate_ssl.backbones name, "
                   "'torchvision:<arch>', 'timm:<name>', or your own class after register_architecture(name, "
                   "YourClass)), then 'checkpoint:prior.safetensors'")


def load_torchscript(path, what: str = "prior", instead: str = SAFE_PRIOR_FILE) -> nn.Module:
    """A TorchScript file (``torch.jit.save``), on the CPU, read only while the installed PyTorch reads them (it
    deprecates ``torch.jit.load``). Its deprecation notice is replaced by one that names the replacement, ``instead``
    (weights and a named architecture, whose file holds tensors and JSON only), said once per process. Raises
    ValueError when the file is not TorchScript, or when this PyTorch no longer reads TorchScript."""
    path = Path(path)
    if not hasattr(torch.jit, "load"):
        raise ValueError(f"{what} {str(path)!r} is not a safetensors checkpoint, and this PyTorch "
                         f"({torch.__version__}) no longer reads TorchScript files. Save the network as weights and a "
                         f"named architecture instead: {instead}.")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.load.*deprecated", category=FutureWarning)
            model = torch.jit.load(str(path), map_location="cpu")
    except Exception as err:
        raise ValueError(f"{what} {str(path)!r} is neither a safetensors checkpoint nor a TorchScript file "
                         f"({str(err).splitlines()[0] if str(err) else type(err).__name__}). Save the network as "
                         f"weights and a named architecture: {instead}.") from err
    warn_once(f"{what} {str(path)!r} is TorchScript, read with torch.jit.load, which PyTorch deprecates: "
              "accelerate-ssl reads TorchScript files only as long as the installed PyTorch does. Save the network as "
              f"weights and a named architecture instead: {instead}. That file holds tensors and JSON only, so "
              "loading it runs no code; a TorchScript file is a program: load only those you trust.",
              FutureWarning, stacklevel=3, key="torchscript")
    return model


@register_prior("checkpoint")
def _checkpoint_prior(arch: str, weights: Optional[str] = None, offline: Optional[bool] = None, **overrides) -> Prior:
    return _load_checkpoint(_check_file(arch, "checkpoint"), f"checkpoint:{arch}", weights, overrides)


def _load_checkpoint(path: Path, spec: str, weights: Optional[str], overrides: dict, provenance: str = "path") -> Prior:
    if weights is not None:
        raise ValueError(f"{spec} already holds its weights; drop weights=.")
    sidecar = path.with_name(path.name + ".json")
    meta = json.loads(sidecar.read_text()) if sidecar.is_file() else None
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
        if _CHECKPOINT_META_KEY in header:
            meta = json.loads(header[_CHECKPOINT_META_KEY])
        if meta is None or "arch" not in meta:
            raise ValueError(f"{str(path)!r} names no architecture: write it with save_prior_checkpoint(...) or put "
                             f"{{'arch': ..., 'arch_kwargs': ..., 'preprocess_config': ...}} in {str(sidecar)!r}.")
        net = _build_arch(meta["arch"], dict(meta.get("arch_kwargs") or {}))
        load_weights(net, load_state_dict_file(path), repr(str(path)))
        if hasattr(net, "reset_classifier"):
            net.reset_classifier(0)
        else:
            strip_classifier(net)
        model: nn.Module = _Features(net)
        arch_name = meta["arch"]
    else:
        model = load_torchscript(path, "TorchScript prior")
        arch_name = "torchscript"
        if meta is None and not {"mean", "std"} <= set(overrides):
            raise ValueError(f"TorchScript prior {str(path)!r} has no preprocessing: pass mean=, std= (and size=) or "
                             f"write {{'preprocess_config': {{...}}}} to {str(sidecar)!r}.")
    pre_cfg = dict((meta or {}).get("preprocess_config") or {"channels": 3})
    pre = preprocess_with(Preprocess.from_config(pre_cfg).config, overrides)
    reject_unknown(overrides, spec)
    dim = probe_dim(model, pre.channels, pre.crop or fixed_input_size(getattr(model, "net", model)) or 32)
    where = {"checkpoint": str(path.resolve())} if provenance == "path" else {}
    return Prior(model, spec, pre, prior_info(spec.split(":", 1)[0], arch_name, None, dim, **where,
                                         checkpoint_sha256=file_sha256(path)))


# ----------------------------------------------------------------------------------------------
# priors that ship with the package
# ----------------------------------------------------------------------------------------------
ASSETS = Path(__file__).resolve().parents[1] / "assets"

#: name -> (file in ``accelerate_ssl/assets``, what it is). ``shipped:<name>`` loads it anywhere a prior is named.
SHIPPED_PRIORS: dict[str, tuple[str, str]] = {
    "fashion-mnist-byol": (
        "demo_prior_convnet.safetensors",
        "BYOL ConvNet 32/64/128, 1000 steps on the unlabelled Fashion-MNIST train images (no label seen; "
        "benchmarks/train_demo_prior.py); 128-d, 28 px grayscale"),
    "fashion-mnist-byol-20k": (
        "fashion_mnist_byol_20k.safetensors",
        "the same BYOL ConvNet 32/64/128 trained 20,000 steps on the unlabelled Fashion-MNIST train images "
        "(no label seen; `python benchmarks/train_demo_prior.py --steps 20000 --cache "
        "benchmarks/prior_runs/byol_convnet_long`, resumable); 128-d, 28 px grayscale"),
    "fashion-mnist-supervised": (
        "fashion_mnist_supervised.safetensors",
        "ConvNet 32/64/128 trained WITH the Fashion-MNIST training labels (cross-entropy, 7000 steps: "
        "`python benchmarks/train_demo_prior.py --objective supervised --steps 7000 --cache "
        "benchmarks/prior_runs/supervised_convnet`, resumable): the stand-in for a public model trained with "
        "labels, not a label-free prior; linear probe 89.12 %; 128-d, 28 px grayscale"),
    "digits-byol": (
        "digits_byol.safetensors",
        "BYOL ConvNet 32/64/128, 2000 steps on scikit-learn's 1797 unlabelled digits resized to 28 px "
        "(`python benchmarks/train_demo_prior.py --data digits --steps 2000 --cache "
        "benchmarks/prior_runs/digits_byol`): a prior from other data; Fashion-MNIST linear probe "
        "84.27 %; 128-d, 28 px grayscale"),
}


def shipped_prior_file(name: str) -> Path:
    """The file of shipped prior ``name``; a clear error for unknown names or a broken install."""
    if name not in SHIPPED_PRIORS:
        close = difflib.get_close_matches(name, list(SHIPPED_PRIORS), n=3, cutoff=0.4)
        raise ValueError(f"Unknown shipped prior {name!r}; shipped: {', '.join(sorted(SHIPPED_PRIORS))}"
                         + (f" (close: {', '.join(close)})" if close else "") + ".")
    path = ASSETS / SHIPPED_PRIORS[name][0]
    if not path.is_file():
        raise FileNotFoundError(f"Shipped prior {name!r} is missing from the installed package ({path}): re-install "
                                "accelerate-ssl.")
    return path


@register_prior("shipped")
def _shipped_prior(arch: str, weights: Optional[str] = None, offline: Optional[bool] = None, **overrides) -> Prior:
    spec = f"shipped:{arch}"
    if weights is not None:
        raise ValueError(f"{spec} ships with its weights; drop weights=.")
    return _load_checkpoint(shipped_prior_file(arch), spec, None, overrides, provenance="name")

