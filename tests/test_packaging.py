"""Packaging: the core imports without any extra, a missing extra names its pip install, pyproject agrees."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from accelerate_ssl.optional import EXTRAS, require

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_imports_and_the_core_runs_with_every_extra_blocked(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "check_install.py"), "--block-extras"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "missing extras name their pip install" in out.stdout


def test_every_package_folder_is_listed_for_the_wheel():
    """The wheel ships exactly the packages pyproject lists: a new sub-package missing there imports from the
    source tree but not from an installed wheel."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "accelerate_ssl").rglob("__init__.py")}
    assert folders - listed == set(), f"add {sorted(folders - listed)} to [tool.setuptools] packages in pyproject.toml"


def test_core_dependencies_and_extras_in_pyproject_match_the_code():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0].strip().lower() for d in project["dependencies"]}
    assert core == {"torch", "torchvision", "safetensors", "tqdm", "numpy", "pillow"}
    extras = project["optional-dependencies"]
    for module, (extra, dist) in EXTRAS.items():
        assert any(req.lower().startswith(dist.lower()) for req in extras[extra]), (module, extra)
        assert extra in extras["all"][0], extra
    assert "accelerate-ssl[all]" in extras["test"]


def test_a_missing_extra_names_the_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightly", None)  # `import lightly` now raises ModuleNotFoundError
    with pytest.raises(ImportError, match=r'the BYOL recipe needs lightly, which is not installed: pip install '
                                          r'"accelerate-ssl\[lightly\]"'):
        require("lightly", "the BYOL recipe")
    from accelerate_ssl.recipes import BYOL

    with pytest.raises(ImportError, match=r"accelerate-ssl\[lightly\]"):
        BYOL(__import__("torch").nn.Linear(2, 2), 2)


def test_an_import_error_inside_an_installed_extra_is_not_disguised(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightly.loss", None)  # lightly is there, one of its modules is broken
    with pytest.raises(ImportError) as err:
        require("lightly.loss", "the BYOL recipe")
    assert "lightly.loss" in str(err.value)
