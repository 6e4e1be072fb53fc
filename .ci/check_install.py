"""Check an installed accelerate-ssl: every module imports, the core runs, a missing extra names its fix.

Run with the interpreter of the environment to check, from outside the source tree (so the installed
package is the one imported). ``--block-extras`` makes the optional dependencies unimportable first, to
check a core-only install inside a full environment (the test suite does this).
"""

import argparse
import importlib
import importlib.abc
import importlib.util
import pkgutil
import sys
import tempfile

class _Blocker(importlib.abc.MetaPathFinder):
    """Makes every optional dependency (accelerate_ssl.optional.EXTRAS, and Lightning for solo-learn) unimportable."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--block-extras", action="store_true")
    args = p.parse_args()
    from accelerate_ssl.optional import EXTRAS  # imports nothing optional itself

    if args.block_extras:
        sys.meta_path.insert(0, _Blocker([*EXTRAS, "lightning", "pytorch_lightning"]))
    import accelerate_ssl

    if "site-packages" not in accelerate_ssl.__file__ and not args.block_extras:
        raise SystemExit(f"accelerate_ssl imported from {accelerate_ssl.__file__}, not from an installed wheel")
    names = [m.name for m in pkgutil.walk_packages(accelerate_ssl.__path__, "accelerate_ssl.")]
    integrations = importlib.import_module("accelerate_ssl.integrations")  # its own folder in the source tree
    names += [m.name for m in pkgutil.walk_packages(integrations.__path__, "accelerate_ssl.integrations.")
              if m.name not in names]
    assert "accelerate_ssl.integrations.solo_learn" in names, names
    for name in names:
        importlib.import_module(name)
    for name in accelerate_ssl.__all__:
        getattr(accelerate_ssl, name)

    # the core path: a shipped prior, precompute, ReLA, without any extra
    import torch

    from accelerate_ssl import ReLA, create_prior, precompute_targets

    images = [torch.randint(0, 256, (1, 28, 28), dtype=torch.uint8) for _ in range(16)]
    with tempfile.TemporaryDirectory() as tmp:
        store = precompute_targets(create_prior("shipped:fashion-mnist-byol"), images, tmp, progress=False)
        backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 8))
        rela = ReLA(store, backbone, dataset=images, feature_dim=8, schedule="constant:1", n_components=4)
        backbone(torch.stack(images).float())
        rela.wrap(torch.zeros(()), index=torch.arange(16)).backward()
        rela.close()
    if args.block_extras or importlib.util.find_spec("timm") is None:
        try:
            create_prior("timm:resnet18")
        except ImportError as err:
            assert 'pip install "accelerate-ssl[timm]"' in str(err), err
        else:
            raise AssertionError("timm:<model> without timm did not raise")
    print(f"installed accelerate-ssl OK: {len(names)} modules import, core path runs"
          + (", missing extras name their pip install" if args.block_extras else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
