"""No code from a data file: nothing in the package loads a file through pickle (a scan of its source that fails on a
new unsafe load), the compact distillation's checkpoint is safetensors + JSON and a checkpoint carrying a pickled
payload is refused without running it, and a scripted prior has a lasting, code-free format (TorchScript is read only
while PyTorch reads it, and says so once)."""

from __future__ import annotations

import ast
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from accelerate_ssl.compact import DistillConfig, Distiller, Teacher, distill_compact
from accelerate_ssl.priors import create_prior, register_architecture, save_prior_checkpoint
from accelerate_ssl.statefile import read_state

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = [ROOT / "accelerate_ssl", ROOT / "integrations"]

#: loads that read a file through pickle, or that can: module attribute -> what the scan says
PICKLE_LOADS = {"pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads", "cPickle.load",
                "dill.load", "dill.loads", "joblib.load", "cloudpickle.load", "cloudpickle.loads", "marshal.load",
                "marshal.loads", "shelve.open", "yaml.load", "yaml.unsafe_load", "torch.export.load",
                "torch._C._pickle_load_obj", "pandas.read_pickle", "pd.read_pickle"}
#: the places that may call torch.jit.load, and why: TorchScript is read only there, while PyTorch reads it
ALLOWED = {("accelerate_ssl/priors/registry.py", "torch.jit.load"):
           "load_torchscript: a TorchScript prior or teacher the user names, read while PyTorch reads TorchScript"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def unsafe_loads(source: str, name: str) -> list[str]:
    """Each load in ``source`` that could unpickle a file: ``weights_only=False`` / ``allow_pickle=True`` (or a value
    that is not a literal), ``torch.load`` without ``weights_only=True``, ``np.load`` without ``allow_pickle=False``,
    the pickle readers of :data:`PICKLE_LOADS` (called, or imported by name), ``torch.jit.load`` outside
    :data:`ALLOWED`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [f"{name}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if f"{node.module}.{a.name}" in PICKLE_LOADS]
        if not isinstance(node, ast.Call):
            continue
        called = _dotted(node.func)
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        where = f"{name}:{node.lineno}: {called}(...)"
        for key, safe in (("weights_only", True), ("allow_pickle", False)):
            if key in keywords and not (isinstance(keywords[key], ast.Constant) and keywords[key].value is safe):
                found.append(f"{where} with {key}={ast.unparse(keywords[key])}")
        if called == "torch.load" and "weights_only" not in keywords:
            found.append(f"{where} without weights_only=True")
        if called in ("np.load", "numpy.load") and "allow_pickle" not in keywords:
            found.append(f"{where} without allow_pickle=False")
        if called in PICKLE_LOADS:
            found.append(where)
        if called == "torch.jit.load" and (name, called) not in ALLOWED:
            found.append(f"{where}: TorchScript outside load_torchscript")
    return found


def test_the_scan_finds_every_kind_of_unsafe_load():
    """The scan below is only as good as its patterns: each one, in a snippet, is found."""
    snippet = """
import torch, pickle, numpy as np, yaml
from pickle import loads
torch.load(p, map_location="cpu", weights_only=False)
torch.load(p)
torch.load(p, weights_only=flag)
np.load(p, allow_pickle=True)
np.load(p)
pickle.load(f)
yaml.load(f)
torch.export.load(p)
torch.jit.load(p)
torch.load(p, weights_only=True)
np.load(p, allow_pickle=False)
"""
    found = unsafe_loads(snippet, "snippet.py")
    assert [f.split(": ", 1)[1] for f in found] == [
        "from pickle import loads",
        "torch.load(...) with weights_only=False",
        "torch.load(...) without weights_only=True",
        "torch.load(...) with weights_only=flag",
        "np.load(...) with allow_pickle=True",
        "np.load(...) without allow_pickle=False",
        "pickle.load(...)",
        "yaml.load(...)",
        "torch.export.load(...)",
        "torch.jit.load(...): TorchScript outside load_torchscript",
    ], found


def test_nothing_in_the_package_loads_a_file_through_pickle():
    files = [f for root in PACKAGE for f in sorted(root.rglob("*.py"))]
    assert len(files) > 50
    found = [hit for f in files for hit in unsafe_loads(f.read_text(), f.relative_to(ROOT).as_posix())]
    assert found == [], "loads that could run code from a file:\n" + "\n".join(found)
    # and the one allowed TorchScript reader is where the scan expects it (an allow-list entry that matches nothing
    # would let the scan pass while TorchScript is read somewhere else)
    for (name, called) in ALLOWED:
        assert called in (ROOT / name).read_text()


# ---------------------------------------------------------------------------------------------- the distillation
def _teacher():
    torch.manual_seed(123)
    net = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
    return Teacher(net, 24, {"source": "test"})


def _images():
    return torch.randn(64, 1, 8, 8, generator=torch.Generator().manual_seed(0))


def _config():
    return DistillConfig(budget_images=12, steps=6, real_batch=16, pool_size=2, pool_max_steps=3, pool_width=4,
                         pool_depth=2, approx_steps=50, approx_hidden=2, U=8, V=8, seed=0, augmentations="none")


class Payload:
    """Unpickled, it creates ``marker`` (a folder): what any code in a checkpoint could do instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_the_checkpoint_is_safetensors_and_json_and_resumes_exactly(tmp_path):
    images, teacher = _images(), _teacher()
    full = distill_compact(images, teacher, _config(), progress=False)
    ckpt = tmp_path / "run.ckpt"
    Distiller(images, teacher, _config(), progress=False).run(checkpoint=ckpt, checkpoint_every=2, progress=False,
                                                              stop_after=3)
    header = int.from_bytes(ckpt.read_bytes()[:8], "little")
    assert ckpt.read_bytes()[8:9] == b"{" and header < ckpt.stat().st_size  # a safetensors header, no pickle
    assert read_state(ckpt, "compact-distill")["step"] == 3
    resumed = distill_compact(images, teacher, _config(), checkpoint=ckpt, checkpoint_every=2, progress=False)
    assert resumed.metadata["distill"]["steps_done"] == 6
    assert all(torch.equal(full.tensors[k], resumed.tensors[k]) for k in full.tensors)


def test_an_earlier_versions_pickled_checkpoint_resumes_when_it_holds_only_tensors_and_plain_values(tmp_path):
    images, teacher = _images(), _teacher()
    full = distill_compact(images, teacher, _config(), progress=False)
    d = Distiller(images, teacher, _config(), progress=False).run(progress=False, stop_after=3)
    torch.save(d.state_dict(), tmp_path / "old.pt")  # what an earlier version wrote
    resumed = distill_compact(images, teacher, _config(), checkpoint=tmp_path / "old.pt", progress=False)
    assert all(torch.equal(full.tensors[k], resumed.tensors[k]) for k in full.tensors)
    assert read_state(tmp_path / "old.pt", "compact-distill")["step"] == 6  # rewritten as safetensors on the way


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_a_checkpoint_carrying_a_pickled_payload_is_refused_without_running_it(tmp_path, writer):
    images, teacher = _images(), _teacher()
    marker = tmp_path / "ran"
    state = {**Distiller(images, teacher, _config(), progress=False).state_dict(), "extra": Payload(marker)}
    ckpt = tmp_path / "run.ckpt"
    if writer == "torch.save":
        torch.save(state, ckpt)
    else:
        ckpt.write_bytes(pickle.dumps(state))
    pickle.loads(pickle.dumps(Payload(marker)))  # the payload is live: unpickled, it runs
    assert marker.is_dir()
    marker.rmdir()
    written = ckpt.read_bytes()
    with pytest.raises(ValueError, match=r"it is a pickle \(torch\.save\) that cannot be read without running code "
                                         r"from it .* nothing was read from it and it was left as it is") as err, \
            warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        distill_compact(images, teacher, _config(), checkpoint=ckpt, progress=False)
    assert not marker.exists()  # refused without running it
    assert not [w for w in seen if "pickle" in str(w.message)]  # the error says it all, no note of torch's before it
    assert ckpt.read_bytes() == written
    # the fix it names, as written: a new checkpoint path starts over and writes a checkpoint reading never runs
    assert "pass checkpoint= a new path" in str(err.value)
    fresh = tmp_path / "fresh.ckpt"
    out = distill_compact(images, teacher, _config(), checkpoint=fresh, progress=False)
    assert out.metadata["distill"]["steps_done"] == 6 and read_state(fresh, "compact-distill")["step"] == 6
    assert not marker.exists()


def test_a_file_that_is_no_checkpoint_is_refused_naming_the_fix(tmp_path):
    images, teacher = _images(), _teacher()
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"is not a state file of accelerate-ssl .* or a path that does not exist yet"):
        distill_compact(images, teacher, _config(), checkpoint=tmp_path / "notes.txt", progress=False)
    assert (tmp_path / "notes.txt").read_text() == "not a checkpoint"


# ---------------------------------------------------------------------------------------------- scripted priors
class MyNet(nn.Module):
    """A network of the user's own: no backbones / torchvision / timm name describes it."""

    def __init__(self, width: int = 6):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x):
        return self.body(x)


@pytest.fixture()
def my_net():
    torch.manual_seed(0)
    return MyNet(width=6).eval()


def test_a_torchscript_prior_is_read_while_torch_reads_it_and_says_once_what_replaces_it(tmp_path, my_net):
    """Before: torch's own deprecation warning on every load, naming torch.export (whose archives load through pickle).
    Now: one notice per process naming the lasting format, which the next test follows."""
    import accelerate_ssl.launch as launch

    launch._WARNED.discard("torchscript")  # (this process may have said it already)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(my_net).save(str(tmp_path / "net.pt"))
    meta = '{"preprocess_config": {"channels": 1, "mean": [0.5], "std": [0.5]}}'
    (tmp_path / "net.pt.json").write_text(meta)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        create_prior(f"checkpoint:{tmp_path / 'net.pt'}")
        create_prior(f"checkpoint:{tmp_path / 'net.pt'}")
    said = [str(w.message) for w in seen]
    assert len(said) == 1 and issubclass(seen[0].category, FutureWarning), said
    assert "only as long as the installed PyTorch does" in said[0]
    assert "save_prior_checkpoint(model, 'prior.safetensors', arch)" in said[0] and "register_architecture" in said[0]


def test_the_notices_fix_saves_a_prior_of_your_own_class_that_loads_without_code_and_embeds_alike(tmp_path, my_net,
                                                                                                  monkeypatch):
    import accelerate_ssl.priors.registry as registry

    monkeypatch.setattr(registry, "_ARCHITECTURES", {})  # (this process's registrations, for this test only)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(my_net).save(str(tmp_path / "net.pt"))
    (tmp_path / "net.pt.json").write_text('{"preprocess_config": {"channels": 1, "mean": [0.5], "std": [0.5]}}')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scripted = create_prior(f"checkpoint:{tmp_path / 'net.pt'}")
    with pytest.raises(ValueError, match=r"Unknown checkpoint arch 'my-net'.*register_architecture\('my-net', "):
        save_prior_checkpoint(my_net, tmp_path / "prior.safetensors", "my-net", {"width": 6})
    register_architecture("my-net", MyNet)  # the notice's fix, as written
    save_prior_checkpoint(my_net, tmp_path / "prior.safetensors", "my-net", {"width": 6},
                          {"channels": 1, "mean": [0.5], "std": [0.5]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation on this path
        prior = create_prior(f"checkpoint:{tmp_path / 'prior.safetensors'}")
    x = torch.rand(5, 1, 12, 12)
    with torch.inference_mode():
        assert torch.allclose(prior(prior.preprocess.batch(x)), scripted(scripted.preprocess.batch(x)), atol=1e-6)
    # the file holds tensors and JSON: it names an architecture this process registered, never code to import
    from safetensors import safe_open

    with safe_open(str(tmp_path / "prior.safetensors"), framework="pt") as f:
        assert '"arch": "my-net"' in f.metadata()["accelerate_ssl_prior"]


def test_when_torch_no_longer_reads_torchscript_the_error_names_the_lasting_format(tmp_path, monkeypatch):
    (tmp_path / "net.pt").write_bytes(b"PK\x03\x04 a TorchScript archive")
    monkeypatch.delattr(torch.jit, "load")
    with pytest.raises(ValueError, match=r"no longer reads TorchScript files\. Save the network as weights and a named "
                                         r"architecture instead: save_prior_checkpoint"):
        create_prior(f"checkpoint:{tmp_path / 'net.pt'}", mean=[0.5], std=[0.5])
