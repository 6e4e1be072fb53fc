"""What every recipe test uses: the recipe's code block and its stated line count read from the page that shows it
(a host page under ``docs/hosts/``, the Quick start of the README and of ``docs/index.md``), the count measured on the
test script, and a log of the rows ReLA read at each step of the script's run.

**Markers.** A recipe test script is written the way the host's own example is; the lines ReLA adds end in
``# ReLA: added``, the lines it changes in ``# ReLA: changed, was: <the host's line>``, and lines that only observe the
run for the test (never part of a recipe) in ``# test``. :func:`plain_script` removes the added and test lines and
puts the host's lines back, so the difference between the host's script and the recipe is exactly the marked lines.

**The page.** Each recipe is introduced by a sentence stating ``N added, M changed`` and followed by its
````python`` block: the lines ReLA adds or changes, and the host's lines around them (``# yours``), each of which must
appear verbatim in the test script (comments and ``...`` aside). The host pages also include the whole script from its
file (``--8<--``), so what a reader sees is what the test runs.

**Rows.** :class:`RecipeLog` wraps the store ReLA reads, and after each ``wrap`` compares the rows read with the
store's rows of the samples the batch really holds (their indices, carried by the batch for the test).
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path
from typing import Optional, Union

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
HOSTS = DOCS / "hosts"
ADDED, CHANGED, TEST = "# ReLA: added", "# ReLA: changed, was: ", "# test"
COUNT = re.compile(r"\*\*(\d+)\s+added,\s+(\d+)\s+changed\*\*")

#: a page (read from its file) or its text
Page = Union[Path, str]


# ---------------------------------------------------------------------------------------------- the page
def code(line: str) -> str:
    """A line without its trailing comment (two spaces then ``#``) and surrounding white space."""
    return re.split(r"\s{2,}#", line, maxsplit=1)[0].strip()


def page_text(page: Page) -> tuple[str, str]:
    """``(name, text)`` of a page given as a path or as its text."""
    if isinstance(page, Path):
        return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page), page.read_text()
    return "the page", page


def page_recipe(anchor: str, page: Page) -> tuple[int, int, list[str]]:
    """``(added, changed, lines)`` of the recipe whose introduction contains ``anchor`` on ``page``: the first
    ``**N added, M changed**`` after it, and the code lines of the first ````python`` block after that (comments,
    blank lines and ``...`` lines left out)."""
    name, text = page_text(page)
    pattern = r"\s+".join(re.escape(word) for word in anchor.split())  # the anchor may be wrapped over lines
    found = list(re.finditer(pattern, text))
    assert len(found) == 1, f"{name}: {anchor!r} must occur exactly once, found {len(found)}"
    rest = text[found[0].end():]
    count = COUNT.search(rest)
    assert count is not None, f"{name}: no '**N added, M changed**' after {anchor!r}"
    block = rest[count.end():].split("```python\n", 1)[1].split("```", 1)[0]
    assert "```" not in rest[count.end():].split("```python\n", 1)[0], f"{name}: the count after {anchor!r} is not the next block's"
    lines = [code(line) for line in block.splitlines()]
    return int(count.group(1)), int(count.group(2)), [line for line in lines if line and not line.startswith(("#", "..."))]


def page_command(anchor: str, page: Page) -> list[str]:
    """The words of the first ``accelerate-ssl ...`` command of a ````bash`` block after ``anchor`` (its comment off)."""
    import shlex

    name, text = page_text(page)
    pattern = r"\s+".join(re.escape(word) for word in anchor.split())
    found = re.search(pattern, text)
    assert found is not None, f"{name}: {anchor!r} not found"
    for block in re.findall(r"```bash\n(.*?)```", text[found.end():], flags=re.S):
        for line in block.splitlines():
            if line.startswith("accelerate-ssl "):
                return shlex.split(line, comments=True)
    raise AssertionError(f"{name}: no accelerate-ssl command after {anchor!r}")


def includes(page: Path, script: Path) -> bool:
    """Whether ``page`` includes ``script`` whole from its file (``--8<-- "<path from the repository>"``)."""
    return f'--8<-- "{script.relative_to(ROOT).as_posix()}"' in page.read_text()


# ---------------------------------------------------------------------------------------------- the script
def comment(line: str) -> str:
    """A line's trailing comment (after two spaces), ``""`` when it has none."""
    parts = re.split(r"\s{2,}(?=#)", line.rstrip(), maxsplit=1)
    return parts[1] if len(parts) == 2 else ""


def kind(line: str) -> str:
    """``"added"``, ``"changed"``, ``"test"`` or ``""``, by the line's marker comment."""
    note = comment(line)
    if note.startswith(ADDED):
        return "added"
    if note.startswith(CHANGED):
        return "changed"
    return "test" if note.startswith(TEST) else ""


def marked(source: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The script's added lines and its changed lines with the host's line each replaced (code only)."""
    added, changed = [], []
    for line in source.splitlines():
        if kind(line) == "added":
            added.append(code(line))
        elif kind(line) == "changed":
            changed.append((code(line), comment(line)[len(CHANGED):].strip()))
    return added, changed


def indentation(line: str) -> int:
    return len(line) - len(line.lstrip())


def plain_script(source: str) -> str:
    """The host's script: the added and test lines removed, each changed line given back its host line (indentation
    kept). An added line that opens a block (``def ssl_loss():``, the recipe's loss moved into a function) takes the
    host's lines indented under it: they go back to the block's own indentation."""
    out, block = [], None  # block: (the added line's indentation, the extra indentation of the lines under it)
    for line in source.splitlines():
        if block is not None and line.strip() and indentation(line) <= block[0]:
            block = None
        if kind(line) == "added" and code(line).endswith(":"):
            block = (indentation(line), None)
        if kind(line) in ("added", "test"):
            continue
        if block is not None and line.strip():
            if block[1] is None:
                block = (block[0], indentation(line) - block[0])
            line = line[block[1]:]
        if kind(line) == "changed":
            line = line[: indentation(line)] + comment(line)[len(CHANGED):].strip()
        out.append(line)
    return "\n".join(out) + "\n"


RELA_NAMES = {"rela", "ReLA", "ReLACallback", "ShardedTargets"}


def check_recipe(script: Path, anchor: str, page: Page) -> tuple[int, int]:
    """The recipe introduced by ``anchor`` on ``page`` is what ``script`` adds and changes, and says so.

    - every code line of the page's block is a line of the script (verbatim, comments aside);
    - every line the script marks as added or changed is in the page's block (the page shows all of them);
    - the page's ``N added, M changed`` is the number of marked lines;
    - a host page (under ``docs/hosts/``) includes the script whole from its file;
    - without the marked lines (and the test's), the script is a valid script of the host with no ReLA left in it.

    Returns ``(added, changed)``."""
    name, _ = page_text(page)
    stated_added, stated_changed, block = page_recipe(anchor, page)
    source = script.read_text()
    lines = {code(line) for line in source.splitlines()}
    assert [line for line in block if line not in lines] == [], f"{name}: lines of {anchor!r} missing from {script.name}"
    added, changed = marked(source)
    shown = set(block)
    assert [line for line in added + [c for c, _ in changed] if line not in shown] == [], \
        f"lines {script.name} marks as ReLA's are not in the {anchor!r} block of {name}"
    assert (len(added), len(changed)) == (stated_added, stated_changed), (
        f"{name} says {stated_added} added, {stated_changed} changed for {anchor!r}; {script.name} marks "
        f"{len(added)} added, {len(changed)} changed")
    assert all(new != was for new, was in changed)
    if isinstance(page, Path) and page.is_relative_to(HOSTS):
        assert includes(page, script), f"{name} does not include {script.relative_to(ROOT)} from its file"
    plain = plain_script(source)
    tree = ast.parse(plain)  # the host's script is valid Python
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    left = names & RELA_NAMES
    assert not left, f"{script.name} without its marked lines still uses {sorted(left)}"
    assert "accelerate_ssl.integrations" not in plain and "from accelerate_ssl import" not in plain
    return len(added), len(changed)


# ---------------------------------------------------------------------------------------------- the run
class ReadSpy:
    """Wraps a target store and records every block of rows read from it (``rela.targets.store = ReadSpy(store)``)."""

    def __init__(self, store):
        self.store, self.reads = store, []

    def __getitem__(self, idx):
        import torch

        rows = self.store[idx]
        self.reads.append(torch.as_tensor(rows).clone())
        return rows

    def maps(self, idx):
        """A spatial store's maps (read to pool each view's box): recorded as the maps' means, the samples' rows."""
        out = self.store.maps(idx)
        self.reads.append(out.mean((2, 3)).clone())
        return out

    def __len__(self):
        return len(self.store)

    def __getattr__(self, name):
        if name in ("store", "reads"):
            raise AttributeError(name)
        return getattr(self.store, name)


class RecipeLog:
    """The rows a recipe's ReLA read, step by step, against the rows of the samples each batch holds.

    ``watch(rela)`` once ReLA exists; ``step(rela, own)`` right after each ``wrap``, ``own`` the batch's own dataset
    indices (or keys, with ``keys=``); ``save(rank)`` writes ``$RECIPE_LOG/rank-<rank>.json`` when ``RECIPE_LOG`` is set (the rank: ``$RANK`` when not
    given)."""

    def __init__(self):
        self.steps: list[dict] = []
        self.spy: Optional[ReadSpy] = None
        self._seen = 0
        self._calls = 0  # forward calls of the modules given to count_calls since the last step

    def count_calls(self, *modules) -> None:
        """Count the forward calls of ``modules`` (e.g. the SSL side: a momentum network, a prediction head) made in
        each step; :meth:`step` records them as ``"ssl_calls"``."""
        def hook(module, args, output):
            self._calls += 1

        for m in modules:
            m.register_forward_hook(hook)

    def watch(self, rela) -> None:
        if not isinstance(rela.targets.store, ReadSpy):
            rela.targets.store = ReadSpy(rela.targets.store)
        self.spy, self._seen = rela.targets.store, len(rela.targets.store.reads)

    def step(self, rela, own) -> None:
        import torch

        if self.spy is None or rela.targets.store is not self.spy:
            raise RuntimeError("RecipeLog.step before RecipeLog.watch(rela)")
        own = torch.as_tensor(own).reshape(-1).cpu().long()
        reads = self.spy.reads[self._seen:]
        self._seen = len(self.spy.reads)
        expected = torch.as_tensor(self.spy.store[own.numpy()])
        views = len(reads[0]) // max(len(own), 1) if len(reads) == 1 else 0  # per-view reads: the batch once per view
        same = torch.equal if views == 1 else lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-5)
        over = rela.stats["loss_rela"] is None and rela.stats["finished"]  # handed over: no row is needed, none read
        calls, self._calls = self._calls, 0
        self.steps.append({"own": own.tolist(), "reads": len(reads), "views": views, "lambda": float(rela.stats["lambda"]),
                           "handed_over": over, "ssl_calls": calls,
                           "own_rows": not reads if over else views >= 1 and len(reads[0]) == views * len(own)
                           and same(reads[0], expected.repeat(views, 1))})

    def save(self, rank: Optional[int] = None) -> None:
        folder = os.environ.get("RECIPE_LOG")
        if not folder:
            return
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) if rank is None else rank
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "steps": self.steps}))


def read_logs(folder: Path, ranks: int = 1) -> list[list[dict]]:
    """Each rank's steps, as :meth:`RecipeLog.save` wrote them."""
    return [json.loads((folder / f"rank-{r}.json").read_text())["steps"] for r in range(ranks)]


def assert_hands_over(lambdas: list[float], planned: int) -> None:
    """lambda under the default schedule planned for ``planned`` steps (``switch``): 1 (the cheap phase: your loss
    skipped) until it hands over, 0 for good from then on, handed over by its planned end at the latest."""
    from accelerate_ssl.schedules import SWITCH_END_FRACTION

    assert lambdas[0] == 1.0 and 0.0 in lambdas, lambdas
    end = lambdas.index(0.0)
    assert set(lambdas[:end]) == {1.0} and set(lambdas[end:]) == {0.0}, lambdas
    assert 0 < end <= round(SWITCH_END_FRACTION * planned), (end, planned)


def assert_every_row_is_the_samples_own(steps: list[dict]) -> None:
    """Every step before the hand-over read its samples' own rows (and at least one did); every step after it read
    none."""
    assert steps, "the recipe trained no step"
    assert any(not s.get("handed_over") for s in steps), "every step came after the hand-over: no row was checked"
    bad = [s for s in steps if not s["own_rows"]]
    assert not bad, f"{len(bad)} of {len(steps)} steps read rows that are not their samples' own: {bad[:2]}"
