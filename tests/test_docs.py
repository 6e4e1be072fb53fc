"""What the docs and the command line tell a user agrees with the code: the demo's default prior is the one `priors
list` calls the demo's, the README stays short with links that resolve, every page is in the site's navigation, and
the CLI reference covers every parser."""

from __future__ import annotations

import re
from pathlib import Path

from accelerate_ssl import demo
from accelerate_ssl.priors.catalog import RECOMMENDED

ROOT = Path(__file__).resolve().parents[1]


def test_priors_list_names_the_demo_default_it_really_uses():
    named = [spec for spec, about, _ in RECOMMENDED if "demo" in about]
    assert named == [demo.DEFAULT_PRIOR], named
    # a prior trained on the benchmarks' own images is said to be an upper bound there
    for spec, about, _ in RECOMMENDED:
        if spec.startswith("shipped:fashion-mnist"):
            assert "upper bound" in about, spec


# ---------------------------------------------------------------------------------------------- the README and the site


def test_the_readme_is_short_and_its_links_resolve():
    """A newcomer's first page: at most 15,000 characters; every relative link names a file of the repository."""
    text = (ROOT / "README.md").read_text()
    assert len(text) <= 15_000, len(text)
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local and [link for link in local if not (ROOT / link).exists()] == []
    for host in ("lightly", "lightning", "solo-learn", "timm", "accelerate", "webdataset", "hf-datasets"):
        assert f"docs/hosts/{host}.md" in local, host


def test_every_page_of_the_site_is_in_its_navigation():
    import yaml

    def pages(nav):
        for item in nav:
            if isinstance(item, str):
                yield item
            else:
                for value in item.values():
                    yield from ([value] if isinstance(value, str) else pages(value))

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = set(pages(config["nav"]))
    present = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert listed == present


def _hooks():
    from scripts import load_script

    return load_script("docs/hooks.py", "_docs_hooks")


def test_the_cli_reference_is_written_from_every_parser():
    """docs/cli.md is generated from the argparse parsers: every command, subcommand and option appears."""
    import argparse

    from accelerate_ssl.cli import COMMANDS, build_parser

    reference = _hooks().cli_reference()

    def walk(parser, prog):
        assert f"`{prog}`" in reference, prog
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in reference, (prog, option)
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{prog} {name}")

    for name in COMMANDS:
        top = build_parser(name)
        sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        walk(sub, f"accelerate-ssl {name}")
    assert "<!-- cli-reference -->" in (ROOT / "docs" / "cli.md").read_text()
