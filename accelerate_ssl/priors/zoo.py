"""Priors named the way the model zoos name them, loaded through each zoo's own mechanism, offline-first.

=========================================  =====================================================================
``timm:<model>[.<tag>]``                   ``timm.create_model(name, pretrained=True, num_classes=0)``; no tag:
                                           timm's default tag for that model (``resnet50`` -> ``resnet50.a1_in1k``).
``timm:hf-hub:<org>/<repo>``               a timm model repository (``config.json`` + weights) on the Hugging Face hub.
``open_clip:<arch>/<tag>``                 the image tower of ``open_clip.create_model(arch, pretrained=tag)``
                                           (``encode_image`` features), e.g. ``open_clip:ViT-B-32/laion2b_s34b_b79k``.
``open_clip:hf-hub:<org>/<repo>``          an open_clip repository (``open_clip_config.json`` + weights).
``torchvision:<arch>[/<weights member>]``  ``torchvision.models.get_model(arch)`` with the weights enum member
                                           (default ``DEFAULT``), e.g. ``torchvision:resnet50/IMAGENET1K_V2``.
=========================================  =====================================================================

**Where weights come from.** The caches the zoos use themselves: the Hugging Face hub cache
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``) for timm and open_clip,
the torch hub cache (``$TORCH_HOME/hub/checkpoints``) for torchvision and URL-only timm weights,
``~/.cache/clip`` for URL-only open_clip weights. A cached file is used without touching the network
(offline-first); a missing one is downloaded the way the zoo downloads it, unless offline
(``offline=True``, or ``HF_HUB_OFFLINE=1`` / ``ACCELERATE_SSL_OFFLINE=1`` in the environment). Weights
that are neither cached nor downloadable raise :class:`PriorWeightsNotFoundError`: the spec, the cache
location looked in, the command that fills the cache on a machine with network
(``accelerate-ssl priors fetch <spec>``) and the ``weights=`` / ``--weights`` alternative.
An explicit ``weights=<file>`` always wins; the spec still chooses the architecture and preprocessing.

**Preprocessing** is the weights' own: timm's pretrained config for that tag (size, crop_pct,
interpolation, mean/std), open_clip's preprocess config for that tag (CLIP mean/std, bicubic),
torchvision's ``weights.transforms()`` (resize, crop, mean/std, interpolation). Grayscale images are
repeated to 3 channels (see :class:`~accelerate_ssl.priors.Preprocess`).

**Provenance** (``Prior.describe()``, recorded in every TargetStore): hub id, tag, revision, the
weights file name and the sha256 of the bytes actually loaded.
"""

from __future__ import annotations

import difflib
import logging
import os
import shlex
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..optional import require
from ..checksum import file_sha256
from .registry import (IMAGENET_MEAN, Preprocess, Prior, load_state_dict_file, load_weights, preprocess_with, prior_info,
                       probe_dim, register_prior, reject_unknown, strip_classifier, torchvision_model)

# Weights file names, in the order the zoos themselves prefer them.
TIMM_HUB_FILES = ("model.safetensors", "pytorch_model.bin")
OPEN_CLIP_HUB_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
_TRUE = {"1", "true", "yes", "on"}
# A .bin weights file's safetensors twin, tried first as timm and open_clip do (other ``X.bin``: ``X.safetensors``).
_SAFE_TWIN = {"pytorch_model.bin": "model.safetensors", "open_clip_pytorch_model.bin": "open_clip_model.safetensors"}


def _hub_files(filename: Optional[str], default: Sequence[str]) -> list[str]:
    """The files to look for in a hub repo: the zoo's named file (its safetensors twin first), else ``default``."""
    if not filename:
        return list(default)
    if filename.endswith(".bin"):
        return [_SAFE_TWIN.get(filename, filename[: -len(".bin")] + ".safetensors"), filename]
    return [filename]


class PriorWeightsNotFoundError(FileNotFoundError):
    """A named prior's weights are neither in the local cache nor downloadable (offline, or no network)."""


# ----------------------------------------------------------------------------------------------
# caches
# ----------------------------------------------------------------------------------------------
def is_offline(offline: Optional[bool] = None) -> bool:
    """``offline`` if given, else whether ``HF_HUB_OFFLINE`` or ``ACCELERATE_SSL_OFFLINE`` is set to a true value."""
    if offline is not None:
        return bool(offline)
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "ACCELERATE_SSL_OFFLINE"))


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment at call time (``HF_HUB_CACHE``, ``HF_HOME``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def hf_repo_dir(repo_id: str) -> Path:
    """Where the hub cache keeps ``repo_id`` (``models--<org>--<repo>``)."""
    return hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def torch_hub_file(url: str) -> Path:
    """Where torch hub caches a downloaded checkpoint (``torch.hub.get_dir()/checkpoints/<file name>``)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)


def open_clip_url_file(url: str) -> Path:
    """Where open_clip caches weights it downloads from a URL (``~/.cache/clip/<file name>``)."""
    return Path("~/.cache/clip").expanduser() / os.path.basename(url)


def _fetch_hint(spec: str, where: str) -> str:
    return (f"Fix: on a machine with network run `accelerate-ssl priors fetch {shlex.quote(spec)}` and copy {where} "
            "to the same place here (or point HF_HOME / TORCH_HOME at the copy); or pass a local weights file: "
            "create_prior(spec, weights=FILE) / --weights FILE.")


def _unavailable(spec: str, where: str, looked_for: str, offline: bool, reason: str = "") -> PriorWeightsNotFoundError:
    why = ("offline (offline=True, HF_HUB_OFFLINE or ACCELERATE_SSL_OFFLINE), so nothing was downloaded" if offline
           else f"the download failed: {reason}")
    return PriorWeightsNotFoundError(
        f"Prior {spec!r}: weights not found in the local cache ({looked_for} under {where}) and {why}. "
        + _fetch_hint(spec, where))


def resolve_hf_file(spec: str, repo_id: str, filenames: Sequence[str], offline: Optional[bool] = None,
                    revision: Optional[str] = None) -> Path:
    """The first of ``filenames`` in hub repo ``repo_id``: from the cache if there (no network), else downloaded
    (unless offline). Raises :class:`PriorWeightsNotFoundError` naming the cache folder and the fix."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    cache = hf_cache_dir()
    offline = is_offline(offline)
    for name in filenames:  # offline-first: the cache, in the zoo's order of preference
        try:
            return Path(hf_hub_download(repo_id, name, revision=revision, cache_dir=str(cache), local_files_only=True))
        except Exception:  # noqa: BLE001 - any miss here means "not cached"
            continue
    looked_for = " or ".join(filenames)
    if offline:
        raise _unavailable(spec, str(hf_repo_dir(repo_id)), looked_for, True)
    reason = ""
    for name in filenames:
        try:
            return Path(hf_hub_download(repo_id, name, revision=revision, cache_dir=str(cache)))
        except LocalEntryNotFoundError as err:  # (a subclass of EntryNotFoundError) the hub could not be reached
            reason = f"the Hugging Face hub could not be reached ({str(err).splitlines()[0][:200]})"
            break
        except EntryNotFoundError:
            reason = f"{repo_id} has no {looked_for}"
            continue
        except Exception as err:  # noqa: BLE001 - network, auth, missing repo: one clear error instead
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            break
    raise _unavailable(spec, str(hf_repo_dir(repo_id)), looked_for, False, reason)


def resolve_url_file(spec: str, url: str, target: Path, offline: Optional[bool] = None) -> Path:
    """``target`` (a zoo's cache file for ``url``) if present, else downloaded there (unless offline)."""
    if target.is_file():
        return target
    offline = is_offline(offline)
    if offline:
        raise _unavailable(spec, str(target.parent), target.name, True)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        match = torch.hub.HASH_REGEX.search(target.name)
        torch.hub.download_url_to_file(url, str(target), hash_prefix=match.group(1) if match else None, progress=True)
    except Exception as err:  # noqa: BLE001
        raise _unavailable(spec, str(target.parent), target.name, False, f"{type(err).__name__}: {err}") from err
    return target


def _revision(path: Path) -> Optional[str]:
    """The snapshot (commit) a hub-cache file belongs to: ``.../snapshots/<revision>/<file>``."""
    parts = Path(path).parts
    return parts[-2] if len(parts) >= 3 and parts[-3] == "snapshots" else None


def _provenance(path: Path, hub_id: str, tag: Optional[str], source: str) -> dict:
    return {"source": source, "hub_id": hub_id, "tag": tag, "revision": _revision(path),
            "weights_file": Path(path).name, "weights_sha256": file_sha256(path)}


def _close(name: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=5, cutoff=0.5)
    return f"close matches: {', '.join(close)}" if close else "no close match"


# ----------------------------------------------------------------------------------------------
# timm
# ----------------------------------------------------------------------------------------------
def timm_name(arch: str, spec: str) -> str:
    """``<model>[.<tag>]`` -> the full ``<model>.<tag>`` timm knows (default tag when none is given)."""
    require("timm", "timm:<model> priors")
    import timm

    base, _, tag = arch.partition(".")
    if not timm.is_model(base):
        raise ValueError(f"Unknown timm model {base!r} in {spec!r} ({_close(base, timm.list_models())}); "
                         "see timm.list_models().")
    tags = timm.list_pretrained(f"{base}.*")
    if tag:
        if arch not in tags:
            raise ValueError(f"timm has no pretrained tag {tag!r} for {base!r} in {spec!r}; its tags: "
                             f"{', '.join(t.split('.', 1)[1] for t in tags) or 'none (random init only: random:<arch>)'}.")
        return arch
    if not tags:
        raise ValueError(f"timm has no pretrained weights for {base!r} ({spec!r}); pass weights=<file> or use a "
                         "model with weights (timm.list_pretrained()).")
    require("timm", "timm:<model> priors")
    from timm.models import get_pretrained_cfg

    default = get_pretrained_cfg(base)
    return f"{base}.{default.tag}" if default is not None and default.tag else tags[0]


def timm_weights_source(name: str) -> tuple[str, str, Sequence[str]]:
    """(``"hf"`` repo id + file names) or (``"url"``, url, ()) for timm model ``name`` (``<model>.<tag>``)."""
    require("timm", "timm:<model> priors")
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name)
    if cfg.hf_hub_id:
        repo = cfg.hf_hub_id if not cfg.hf_hub_id.endswith("/") else cfg.hf_hub_id + name
        return "hf", repo, _hub_files(cfg.hf_hub_filename, TIMM_HUB_FILES)
    if cfg.url:
        return "url", cfg.url, ()
    raise ValueError(f"timm lists no download location for {name!r}; pass weights=<file>.")


def _timm_preprocess(model, overrides: dict) -> Preprocess:
    require("timm", "timm:<model> priors")
    from timm.data import resolve_data_config

    data_cfg = resolve_data_config({}, model=model)
    size = int(data_cfg["input_size"][-1])
    crop_pct = float(data_cfg.get("crop_pct") or 1.0)
    mean = list(data_cfg["mean"])
    stats = "imagenet" if tuple(round(m, 3) for m in mean) == tuple(round(m, 3) for m in IMAGENET_MEAN) else "model"
    interp = data_cfg.get("interpolation")
    return preprocess_with({"channels": 3, "resize": int(size / crop_pct), "crop": size, "mean": mean,
                        "std": list(data_cfg["std"]), "interpolation": interp if interp in ("bilinear", "bicubic")
                        else "bicubic", "stats": stats}, overrides)


def _create_timm(name: str, size: Optional[int], spec: str, file: Optional[str] = None):
    """``timm.create_model(name, pretrained=True, num_classes=0)`` through timm's own loader (its checkpoint
    filters, classifier removal). ``size``: build the model for that input size where timm allows it
    (ViTs: position embeddings resampled by timm as it loads), so ``create_prior(spec, size=224)`` runs."""
    require("timm", "timm:<model> priors")
    import timm

    kwargs = {"pretrained": True, "num_classes": 0}
    if file is not None:
        kwargs["pretrained_cfg_overlay"] = {"file": file}
    try:
        if size is not None:
            try:
                return timm.create_model(name, img_size=int(size), **kwargs)
            except TypeError:  # a model without a fixed input size (CNNs): nothing to change
                pass
        return timm.create_model(name, **kwargs)
    except RuntimeError as err:  # state_dict shape / key mismatches
        first = str(err).splitlines()[0][:300]
        raise ValueError(f"Weights {file!r} do not fit {spec!r} ({first}). Pass weights saved from the same "
                         "architecture as the spec.") from err


@register_prior("timm")
def _timm_prior(arch: str, weights: Optional[str] = None, offline: Optional[bool] = None, **overrides) -> Prior:
    spec = f"timm:{arch}"
    if arch.startswith("hf-hub:"):
        repo = arch[len("hf-hub:"):]
        if weights is not None:
            raise ValueError(f"{spec} takes its weights from the hub repository; to load a local file name the "
                             "architecture instead: timm:<model>[.<tag>] with weights=<file>.")
        config = resolve_hf_file(spec, repo, ["config.json"], offline)
        path = resolve_hf_file(spec, repo, TIMM_HUB_FILES, offline)
        model = _create_timm(f"local-dir:{config.parent}", overrides.get("size"), spec)
        prov = _provenance(path, repo, None, "hf-hub")
        name = model.pretrained_cfg.get("architecture", repo)
    else:
        name = timm_name(arch, spec)
        if weights is not None:
            state = load_state_dict_file(weights)  # a readable state_dict, or a clear error
            model = _create_timm(name, overrides.get("size"), spec, file=weights)
            # timm loads non-strictly once it drops the classifier: check the file covered the whole backbone
            missing = sorted(k for k in model.state_dict() if k not in state)
            if missing:
                raise ValueError(f"Weights {weights!r} do not fit {spec!r}: no values for {missing[:6]}"
                                 f"{'...' if len(missing) > 6 else ''}. Pass a state_dict saved from the same timm "
                                 "architecture (timm's key names).")
            prov = {"source": "file", "hub_id": None, "tag": name.split(".", 1)[1]}
        else:
            kind, where, files = timm_weights_source(name)
            if kind == "hf":
                path = resolve_hf_file(spec, where, files, offline)
            else:
                path = resolve_url_file(spec, where, torch_hub_file(where), offline)
            model = _create_timm(name, overrides.get("size"), spec, file=str(path))
            prov = _provenance(path, where, name.split(".", 1)[1], "hf-hub" if kind == "hf" else "url")
    pre = _timm_preprocess(model, overrides)
    reject_unknown(overrides, spec)
    return Prior(model, spec, pre, prior_info("timm", name, weights, int(model.num_features), **prov))


# ----------------------------------------------------------------------------------------------
# open_clip
# ----------------------------------------------------------------------------------------------
def quiet_open_clip(fn, *args, **kwargs):
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # open_clip logs at INFO/WARNING while it builds a model
    try:
        return fn(*args, **kwargs)
    finally:
        root.setLevel(level)


def open_clip_tag_source(arch: str, tag: str) -> tuple[str, str, Sequence[str], dict]:
    """(``"hf"``, repo, file names, tag config) or (``"url"``, url, (), tag config) for an open_clip arch/tag."""
    require("open_clip", "open_clip:<model> priors")
    import open_clip

    cfg = open_clip.get_pretrained_cfg(arch, tag)
    hub = cfg.get("hf_hub") or ""
    if hub:
        parts = hub.split("/")
        repo, filename = "/".join(parts[:2]), "/".join(p for p in parts[2:] if p)
        return "hf", repo, _hub_files(filename, OPEN_CLIP_HUB_FILES), cfg
    if cfg.get("url"):
        return "url", cfg["url"], (), cfg
    raise ValueError(f"open_clip lists no download location for {arch}/{tag}; pass weights=<file>.")


def open_clip_name(arch: str, spec: str, need_tag: bool) -> tuple[str, Optional[str]]:
    require("open_clip", "open_clip:<model> priors")
    import open_clip

    name, _, tag = arch.partition("/")
    if name not in open_clip.list_models():
        raise ValueError(f"Unknown open_clip architecture {name!r} in {spec!r} ({_close(name, open_clip.list_models())}); "
                         "see open_clip.list_models().")
    tags = open_clip.list_pretrained_tags_by_model(name)
    if tag and tag not in tags:
        raise ValueError(f"open_clip has no pretrained tag {tag!r} for {name!r} in {spec!r}; its tags: "
                         f"{', '.join(tags) or 'none'}.")
    if not tag and need_tag:
        raise ValueError(f"{spec!r} names no pretrained tag; use open_clip:{name}/<tag> with one of: "
                         f"{', '.join(tags) or 'none'} (or pass weights=<file>).")
    return name, tag or None


@register_prior("open_clip")
def _open_clip_prior(arch: str, weights: Optional[str] = None, offline: Optional[bool] = None, **overrides) -> Prior:
    require("open_clip", "open_clip:<model> priors")
    import open_clip

    spec = f"open_clip:{arch}"
    tag_cfg: dict = {}
    if arch.startswith("hf-hub:"):
        repo = arch[len("hf-hub:"):]
        if weights is not None:
            raise ValueError(f"{spec} takes its weights from the hub repository; to load a local file name the "
                             "architecture instead: open_clip:<arch>[/<tag>] with weights=<file>.")
        config = resolve_hf_file(spec, repo, ["open_clip_config.json"], offline)
        path = resolve_hf_file(spec, repo, OPEN_CLIP_HUB_FILES, offline)
        clip = quiet_open_clip(open_clip.create_model, f"local-dir:{config.parent}")
        name, prov = repo, _provenance(path, repo, None, "hf-hub")
    else:
        name, tag = open_clip_name(arch, spec, need_tag=weights is None)
        if tag:
            tag_cfg = open_clip.get_pretrained_cfg(name, tag)
        quick_gelu = bool(tag_cfg.get("quick_gelu", False))
        if weights is not None:
            clip = quiet_open_clip(open_clip.create_model, name, pretrained=None, force_quick_gelu=quick_gelu)
            state = load_state_dict_file(weights)
            if any(k.startswith("visual.") for k in state):
                state = {k[len("visual."):]: v for k, v in state.items() if k.startswith("visual.")}
            load_weights(clip.visual, state, repr(weights))
            prov = {"source": "file", "hub_id": None, "tag": tag}
        else:
            kind, where, files, tag_cfg = open_clip_tag_source(name, tag)
            if kind == "hf":
                path = resolve_hf_file(spec, where, files, offline)
            else:
                path = resolve_url_file(spec, where, open_clip_url_file(where), offline)
            clip = quiet_open_clip(open_clip.create_model, name, pretrained=str(path), force_quick_gelu=quick_gelu)
            prov = _provenance(path, where, tag, "hf-hub" if kind == "hf" else "url")
    visual = clip.visual
    cfg = dict(getattr(visual, "preprocess_cfg", {}) or {})
    cfg.update({k: tag_cfg[k] for k in ("mean", "std", "interpolation") if k in tag_cfg})
    size = cfg.get("size", visual.image_size)
    size = int(size[0] if isinstance(size, (tuple, list)) else size)
    interp = cfg.get("interpolation", "bicubic")
    pre = preprocess_with({"channels": 3, "resize": size, "crop": size,
                       "mean": list(cfg.get("mean", open_clip.OPENAI_DATASET_MEAN)),
                       "std": list(cfg.get("std", open_clip.OPENAI_DATASET_STD)),
                       "interpolation": interp if interp in ("bilinear", "bicubic") else "bicubic", "stats": "clip"},
                      overrides)
    reject_unknown(overrides, spec)
    return Prior(visual, spec, pre, prior_info("open_clip", name, weights, int(visual.output_dim), **prov))


# ----------------------------------------------------------------------------------------------
# torchvision
# ----------------------------------------------------------------------------------------------
def torchvision_weights(arch: str, member: Optional[str], spec: str):
    """The weights enum member ``member`` (default ``DEFAULT``) of torchvision model ``arch``."""
    import torchvision

    enum = torchvision.models.get_model_weights(arch)
    member = member or "DEFAULT"
    if member not in enum.__members__:
        raise ValueError(f"torchvision has no weights {member!r} for {arch!r} in {spec!r}; choose one of "
                         f"{', '.join(enum.__members__)}.")
    return enum[member]


@register_prior("torchvision")
def _torchvision_prior(arch: str, weights: Optional[str] = None, offline: Optional[bool] = None, **overrides) -> Prior:
    spec = f"torchvision:{arch}"
    name, _, member = arch.partition("/")
    model = torchvision_model(name, spec)
    enum_member = torchvision_weights(name, member, spec)
    if weights is None:
        path = resolve_url_file(spec, enum_member.url, torch_hub_file(enum_member.url), offline)
        prov = _provenance(path, enum_member.url, str(enum_member).split(".", 1)[1], "url")
        weights_file = str(path)
    else:
        prov, weights_file = {"source": "file", "hub_id": None, "tag": str(enum_member).split(".", 1)[1]}, weights
    removed = strip_classifier(model)
    load_weights(model, load_state_dict_file(weights_file), repr(weights_file), ignore_prefixes=removed)
    t = enum_member.transforms()
    interp = getattr(t.interpolation, "value", str(t.interpolation))
    pre = preprocess_with({"channels": 3, "resize": int(t.resize_size[0]), "crop": int(t.crop_size[0]),
                       "mean": list(t.mean), "std": list(t.std),
                       "interpolation": interp if interp in ("bilinear", "bicubic") else "bilinear",
                       "stats": "imagenet" if tuple(t.mean) == IMAGENET_MEAN else "model"}, overrides)
    reject_unknown(overrides, spec)
    dim = probe_dim(model, 3, pre.crop or 224)
    return Prior(model, spec, pre, prior_info("torchvision", name, weights, dim, **prov))
