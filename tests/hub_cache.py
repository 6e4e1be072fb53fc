"""Model-hub caches built in a temp dir, laid out as huggingface_hub and torch.hub lay them out, so that the zoo's real
loading code (``pretrained=True``, ``hf-hub:``) runs offline on random weights. The fixture ``caches`` (conftest.py)
points the environment at them."""

from __future__ import annotations

from pathlib import Path

import torch

REV = "a" * 40  # the commit every snapshot here is at


def hub_snapshot(root: Path, repo_id: str, revision: str = REV) -> Path:
    """Create ``$HF_HOME/hub/models--<org>--<repo>`` with ``refs/main`` -> ``revision``; return the snapshot dir."""
    repo = root / "hf" / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snap


def randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with every parameter drawn from N(0, 0.05^2) under ``seed`` (weights that differ from its init)."""
    torch.manual_seed(seed)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return model


def save_state(state: dict, path) -> None:
    """A state dict as the safetensors file a hub snapshot holds."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
