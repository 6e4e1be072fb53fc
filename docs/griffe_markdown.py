"""The docstrings as the site renders them: a griffe extension of the API page (``mkdocs.yml``: the python handler's
``extensions``).

The package's docstrings are written for ``help()`` and for reST readers: Sphinx roles (``:class:`~pkg.Name```),
literal blocks introduced by ``::`` and simple tables framed by ``===``. The site renders Markdown, where those would
print as raw markup. When the package is loaded for the site, every docstring is rewritten, in memory only:

- a role becomes its target in a code span, a link where the target is on the site and plain code where it is not
  (an optional cross-reference: the text shows ``Name`` for ``~pkg.Name``, the path as written otherwise); a target
  is resolved the way Sphinx does, relative to the object whose docstring holds it, then through the package's
  aliases (``accelerate_ssl.ReLA`` is ``accelerate_ssl.rela.rela.ReLA``);
- "module docstring" becomes a link to the module's own entry, which must then be on the API page (the strict build
  fails on a link that resolves nowhere, so an entry never points at a text the site does not show);
- ``text::`` before a literal block becomes ``text:`` (the indented block is a code block in Markdown too);
- a simple table becomes a Markdown table.
"""

from __future__ import annotations

import html
import re
from typing import Any, Optional

from griffe import Extension

ROLE = re.compile(r":(?:py:)?(?P<role>class|func|meth|data|mod|attr|exc|obj|const):`(?P<target>[^`]+)`")
MODULE_DOCSTRING = re.compile(r"\b(?:the |this )?module docstring\b")
LITERAL = re.compile(r"(?<=\S)::$|\s+::$", re.M)
TABLE_RULE = re.compile(r"^ *=+(?: +=+)+ *$")


def resolve(obj: Any, target: str) -> Optional[str]:
    """The canonical path of ``target`` as written in ``obj``'s docstring, or None when the package does not hold it."""
    module = obj if obj.is_module else obj.module
    if target.startswith("."):  # relative to the module's package, as Sphinx reads ``.handover``
        base = module.path if module.is_package else module.path.rsplit(".", 1)[0]
        candidates = [f"{base}.{target.lstrip('.')}"]
    elif "." in target and target.split(".")[0] in (module.package.path, "integrations"):
        candidates = [target]
    else:  # a bare name: the object's own members, its parents', the module's
        scopes, scope = [], obj
        while scope is not None:
            scopes.append(scope.path)
            scope = scope.parent
        candidates = [f"{s}.{target}" for s in scopes] + [target]
    for path in candidates:
        found = lookup(module.package, path)
        if found is not None:
            return found
    return None


def lookup(package: Any, path: str) -> Optional[str]:
    """``path``'s canonical path in ``package`` (through aliases), or None."""
    head, _, rest = path.partition(".")
    if head != package.path:
        return None
    node = package
    for name in rest.split(".") if rest else []:
        try:
            node = node.members[name]
            if node.is_alias:
                node = node.final_target
        except Exception:  # an alias to another package, a name that is not there
            return None
    return node.path


def code_link(title: str, identifier: Optional[str], optional: bool = True) -> str:
    """A cross-reference the site resolves after rendering (mkdocs-autorefs): a link where ``identifier`` is on the
    site; when it is not, the title alone if ``optional``, else a build error."""
    if identifier is None:
        return title
    return (f'<autoref identifier="{html.escape(identifier)}"{" optional" if optional else ""}>'
            f"{title}</autoref>")


def roles(text: str, obj: Any) -> str:
    def role(m: re.Match) -> str:
        target = m.group("target").strip()
        short = target.startswith("~")
        target = target.lstrip("~").removesuffix("()")
        shown = target.split(".")[-1] if short else target.lstrip(".")
        return code_link(f"<code>{html.escape(shown)}</code>", resolve(obj, target))

    return ROLE.sub(role, text)


def module_links(text: str, obj: Any) -> str:
    module = obj if obj.is_module else obj.module
    if obj.is_module:
        return text
    return MODULE_DOCSTRING.sub(lambda m: code_link(m.group(0), module.path, optional=False), text)


def simple_tables(text: str) -> str:
    """reST simple tables (a rule of ``=`` runs, the header, a rule, the rows, a rule) as Markdown tables."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        end = next((j for j in range(i + 2, len(lines)) if TABLE_RULE.match(lines[j])), None) \
            if TABLE_RULE.match(lines[i]) else None
        last = next((j for j in range(end + 1, len(lines)) if TABLE_RULE.match(lines[j])), None) if end else None
        if last is None:
            out.append(lines[i])
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        spans = [(m.start(), m.end()) for m in re.finditer(r"=+", lines[i])]

        def cells(line: str) -> list[str]:
            bounds = [a for a, _ in spans] + [max(len(line), spans[-1][1])]
            return [line[a:b].strip().replace("|", "\\|") for a, b in zip(bounds, bounds[1:])]

        rows = [cells(line) for line in lines[i + 1:end]]
        out += [" " * indent + "| " + " | ".join(c if c else " " for c in r) + " |" for r in rows[:1]]
        out.append(" " * indent + "|" + "---|" * len(spans))
        out += [" " * indent + "| " + " | ".join(cells(line)) + " |" for line in lines[end + 1:last] if line.strip()]
        i = last + 1
    return "\n".join(out)


def to_markdown(text: str, obj: Any) -> str:
    return simple_tables(LITERAL.sub(":", module_links(roles(text, obj), obj)))


class SphinxToMarkdown(Extension):
    """Rewrites every docstring of a loaded package (see the module docstring), once each, whichever of the hook's
    names the installed griffe calls (``on_package`` from griffe 2, ``on_package_loaded`` before)."""

    def __init__(self) -> None:
        super().__init__()
        self._rewritten: set[int] = set()  # the docstrings already rewritten

    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        def walk(obj: Any) -> None:
            if obj.is_alias:
                return
            if obj.docstring is not None and id(obj.docstring) not in self._rewritten:
                self._rewritten.add(id(obj.docstring))
                obj.docstring.value = to_markdown(obj.docstring.value, obj)
            for member in list(obj.members.values()):
                walk(member)

        walk(pkg)

    on_package_loaded = on_package
