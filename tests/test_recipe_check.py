"""The recipe check itself (tests/recipe_check.py) catches what it is there for: a wrong stated count, a line of the
page the script lacks, a line ReLA adds that the page does not show, a host page that does not include the script it
shows, and ReLA left in the host's script."""

from __future__ import annotations

import pytest

from recipe_check import check_recipe, plain_script

SCRIPT = '''import torch
from accelerate_ssl import ReLA  # ReLA: added

loader = torch.utils.data.DataLoader(range(8))
rela = ReLA.from_prior("shipped:digits-byol", model.backbone, loader)  # ReLA: added
seen = []  # test
for batch in loader:
    loss = rela.wrap(model(batch))  # ReLA: changed, was: loss = model(batch)
    loss.backward()
'''

README = '''## Recipe

Here: **{added} added, {changed} changed**.

```python
from accelerate_ssl import ReLA
rela = ReLA.from_prior("shipped:digits-byol", model.backbone, loader)
for batch in loader:          # yours
    ...
    loss = rela.wrap(model(batch))
```
'''


def test_a_true_readme_passes_and_the_plain_script_is_the_hosts(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    assert check_recipe(script, "## Recipe", README.format(added=2, changed=1)) == (2, 1)
    assert plain_script(SCRIPT) == ("import torch\n\nloader = torch.utils.data.DataLoader(range(8))\nfor batch in loader:\n"
                                    "    loss = model(batch)\n    loss.backward()\n")


def test_each_untruth_is_caught(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    with pytest.raises(AssertionError, match="the page says 1 added, 1 changed"):
        check_recipe(script, "## Recipe", README.format(added=1, changed=1))
    with pytest.raises(AssertionError, match="missing from s.py"):
        check_recipe(script, "## Recipe", README.format(added=2, changed=1).replace("for batch in loader:", "for b in loader:"))
    unshown = SCRIPT.replace("seen = []  # test", "rela.track(loader)  # ReLA: added")
    script.write_text(unshown)
    with pytest.raises(AssertionError, match="are not in the '## Recipe' block of the page"):
        check_recipe(script, "## Recipe", README.format(added=3, changed=1))
    unmarked = SCRIPT.replace("    loss.backward()", "    rela.step()")
    script.write_text(unmarked)
    with pytest.raises(AssertionError, match=r"still uses \['rela'\]"):
        check_recipe(script, "## Recipe", README.format(added=2, changed=1))


def test_a_host_page_must_include_the_script_it_shows(tmp_path, monkeypatch):
    """A page under docs/hosts/ shows the script the test runs whole, included from its file."""
    import recipe_check

    root = tmp_path
    (root / "docs" / "hosts").mkdir(parents=True)
    script = root / "s.py"
    script.write_text(SCRIPT)
    page = root / "docs" / "hosts" / "host.md"
    monkeypatch.setattr(recipe_check, "ROOT", root)
    monkeypatch.setattr(recipe_check, "DOCS", root / "docs")
    monkeypatch.setattr(recipe_check, "HOSTS", root / "docs" / "hosts")
    page.write_text(README.format(added=2, changed=1))
    with pytest.raises(AssertionError, match="does not include s.py from its file"):
        check_recipe(script, "## Recipe", page)
    page.write_text(README.format(added=2, changed=1) + '\n```python\n--8<-- "s.py"\n```\n')
    assert check_recipe(script, "## Recipe", page) == (2, 1)
