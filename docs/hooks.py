"""mkdocs hooks of the documentation site (``mkdocs.yml``: ``hooks:``).

- Before the build: every generated benchmark block of the pages must be what ``benchmarks/render.py`` renders from
  the result files now; a stale block fails the build, naming the command that refreshes it.
- ``docs/cli.md``: the ``<!-- cli-reference -->`` marker becomes the reference of every ``accelerate-ssl`` command,
  written from the argparse parsers themselves (``accelerate_ssl.cli.build_parser``), so it cannot drift from
  ``--help``.
- Figures: a page links a benchmark's PNG where it lies in the repository (``../../benchmarks/results/x.png``, what
  ``benchmarks/render.py`` writes in a figure block, so the link works on GitHub too); the site serves each PNG of
  ``benchmarks/results/`` as ``figures/x.png`` and the links are pointed there.
"""

from __future__ import annotations

import argparse
import importlib.util
import posixpath
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI_MARKER = "<!-- cli-reference -->"
RESULTS = ROOT / "benchmarks" / "results"
FIGURES = "figures"  # where the site serves the PNGs of benchmarks/results
FIGURE_LINK = re.compile(r"\]\((?P<path>[^)\s]*benchmarks/results/(?P<name>[\w.-]+\.png))\)")


def _render_module():
    spec = importlib.util.spec_from_file_location("_docs_render", ROOT / "benchmarks" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_pre_build(config, **kwargs) -> None:
    from mkdocs.exceptions import PluginError

    problems = _render_module().check()
    if problems:
        raise PluginError("generated blocks differ from the result files:\n  " + "\n  ".join(problems))


def on_files(files, config, **kwargs):
    from mkdocs.structure.files import File

    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"{FIGURES}/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return figure_links(markdown, page.file.src_uri)


def figure_links(markdown: str, src_uri: str) -> str:
    """Links from the page ``src_uri`` (relative to docs/) to a PNG of ``benchmarks/results/``, pointed at the site's
    copy (``figures/``); a link that does not resolve to such a file is left alone (the strict build reports it)."""
    here = (ROOT / "docs" / src_uri).parent

    def point(m: re.Match) -> str:
        if (here / m.group("path")).resolve() != (RESULTS / m.group("name")).resolve():
            return m.group(0)
        return "](" + posixpath.relpath(f"{FIGURES}/{m.group('name')}", posixpath.dirname(src_uri) or ".") + ")"

    return FIGURE_LINK.sub(point, markdown)


# ---------------------------------------------------------------------------------------------- the CLI reference
def _cell(text: str) -> str:
    """Text for a table cell: one line, its pipes escaped, ``<`` and ``>`` outside code spans as entities."""
    import html

    parts = " ".join(str(text).split()).split("`")
    return "`".join(p if i % 2 else html.escape(p, quote=False) for i, p in enumerate(parts)).replace("|", "\\|")


def _help(action: argparse.Action, prog: str) -> str:
    """An argument's help as ``--help`` prints it (``%(default)s`` and the like expanded)."""
    text = action.help or ""
    if "%" in text:
        params = {k: v for k, v in dict(vars(action), prog=prog).items() if v is not argparse.SUPPRESS}
        params = {k: getattr(v, "__name__", v) for k, v in params.items()}
        if params.get("choices") is not None:
            params["choices"] = ", ".join(map(str, params["choices"]))
        text = text % params
    return text


def _arguments(parser: argparse.ArgumentParser, prog: str) -> str:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
        value = ""
        if action.nargs != 0 and action.option_strings:
            value = f"`{action.metavar or action.dest.upper()}`" if not action.choices else \
                ", ".join(f"`{c}`" for c in action.choices)
        default = "" if action.default in (None, argparse.SUPPRESS, False) or not action.option_strings \
            else f"`{action.default}`"
        rows.append(f"| {name} | {_cell(value)} | {_cell(_help(action, prog))} | {_cell(default)} |")
    if not rows:
        return ""
    return "| argument | value | what it does | default |\n|---|---|---|---|\n" + "\n".join(rows)


def _section(parser: argparse.ArgumentParser, prog: str, depth: int, recurse: bool = True) -> list[str]:
    out = [f"{'#' * depth} `{prog}`", ""]
    if parser.description:
        out += [" ".join(parser.description.split()), ""]
    out += ["```text", parser.format_usage().strip(), "```", ""]
    arguments = _arguments(parser, prog)
    if arguments:
        out += [arguments, ""]
    for action in parser._actions if recurse else []:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _section(sub, f"{prog} {name}", min(depth + 1, 4))
    return out


def cli_reference() -> str:
    """Markdown for every ``accelerate-ssl`` command and subcommand: description, usage and arguments."""
    import os

    sys.path.insert(0, str(ROOT))
    from accelerate_ssl.cli import COMMANDS, build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps usage to the terminal: one width, whatever builds the site

    lines = _section(build_parser(), "accelerate-ssl", 2, recurse=False)[:-1]
    for name in COMMANDS:
        top = build_parser(name)
        sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        lines += [""] + _section(sub, f"accelerate-ssl {name}", 2)
    return "\n".join(lines).rstrip() + "\n"
