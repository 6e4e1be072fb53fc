"""Numbers that cannot drift from their results: every committed result file says which code and which machine
measured it (and where its per-seed values are), and every benchmark table in the docs is what
``benchmarks/render.py`` renders from those files now."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from accelerate_ssl.results import claims_seeds, find, provenance_problems, write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json")) + sorted((ROOT / "benchmarks").glob("prior_runs/*/*.json"))


# ---------------------------------------------------------------------------------------------- provenance
def test_write_results_records_the_commit_and_the_machine(tmp_path):
    """A result written through write_results carries the checkout's commit and the full machine block."""
    write_results(tmp_path / "r.json", {"top1": 71.5, "provenance": {"stale": True}}, ROOT, per_seed=["top1"])
    block = json.loads((tmp_path / "r.json").read_text())["provenance"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout (CI's clean clone is one)
        assert block["commit"] == head.stdout.strip()
    assert "stale" not in block  # the block describes this write
    for field in ("device", "torch", "cuda", "cudnn", "cpu_capability", "load_average"):
        assert field in block["machine"]
    assert len(block["machine"]["load_average"]) == 3 and block["per_seed"] == ["top1"]
    assert provenance_problems(json.loads((tmp_path / "r.json").read_text())) == []
    # outside a git checkout (an installed wheel) the commit says it is not recorded, and why
    write_results(tmp_path / "w.json", {"x": 1}, tmp_path)
    commit = json.loads((tmp_path / "w.json").read_text())["provenance"]["commit"]
    assert commit.startswith("not recorded (accelerate-ssl ") or re.fullmatch(r"[0-9a-f]{40}", commit)


def test_provenance_problems_names_what_is_missing():
    machine = {"device": "cpu", "torch": "2.5", "cuda": None, "cudnn": "not recorded", "cpu_capability": "AVX2",
               "load_average": [1, 1, 1]}
    good = {"provenance": {"commit": "a" * 40, "commit_source": "git", "machine": {**machine, "cuda": "12.4"},
                           "machine_source": "read when written"}, "x": 1}
    assert provenance_problems(good) == []
    assert provenance_problems({"x": 1}) == ["no provenance block"]
    bad = json.loads(json.dumps(good))
    bad["provenance"].update(commit="HEAD", machine=machine)
    assert provenance_problems(bad) == ["commit: 'HEAD' is not a 40-digit git commit",
                                        "machine: no 'cuda' (a value, or 'not recorded')"]
    seeds = {**good, "settings": {"seeds": [0, 1, 2]}, "runs": [{"seed": 0, "top1": 70.0}]}
    assert claims_seeds(seeds) and not claims_seeds(good)
    assert claims_seeds({"a": {"mean": 1.0, "sd": 0.1, "n": 3}}) and not claims_seeds({"a": {"mean": 1.0, "n": 1}})
    assert "does not say where its per-seed values are" in provenance_problems(seeds)[0]
    seeds["provenance"]["per_seed"] = ["runs.*.accuracy"]
    assert provenance_problems(seeds) == ["per_seed: 'runs.*.accuracy' matches no values"]
    seeds["provenance"]["per_seed"] = ["runs.*.top1"]
    assert provenance_problems(seeds) == [] and find(seeds, "runs.*.top1") == [70.0]
    seeds["provenance"]["per_seed"] = "kept elsewhere"
    assert "say 'not recorded'" in provenance_problems(seeds)[0]
    seeds["provenance"]["per_seed"] = "not recorded: means only"
    assert provenance_problems(seeds) == []


@pytest.mark.parametrize("path", RESULTS, ids=[str(p.relative_to(ROOT / "benchmarks")) for p in RESULTS])
def test_every_committed_result_carries_its_provenance(path):
    """Commit, machine (device, torch, CUDA, cuDNN, CPU capability, load), and where the per-seed values are."""
    assert provenance_problems(json.loads(path.read_text())) == []


def test_there_are_results_to_check():
    assert len(RESULTS) >= 30


# ---------------------------------------------------------------------------------------------- generated blocks
def _render():
    from scripts import load_script

    return load_script("benchmarks/render.py", "_render_for_tests")


def test_every_generated_block_is_what_its_result_file_gives_now():
    """Every number in a generated block of README.md and docs/ is what benchmarks/render.py renders from the JSON."""
    assert _render().check() == []


def test_a_number_that_differs_from_its_file_is_caught(tmp_path, monkeypatch):
    render = _render()
    rendered = render.blocks()
    text = (ROOT / "README.md").read_text()
    assert render.render_page(text, rendered) == text
    body = render.parse_blocks(text)[0][0].text
    number = re.search(r"\d+\.\d\d", body).group(0)
    edited = text.replace(body, body.replace(number, f"{float(number) + 0.01:.2f}", 1))
    assert render.render_page(edited, rendered) != edited  # a hand-edited number
    # and a result file whose numbers moved: the page, unchanged, is now stale
    name = next(n for n in render.RENDERERS if n == "budget_vit.json")  # the README's blocks
    moved = json.loads((render.RESULTS / name).read_text())
    moved["analysis"]["target_top1"] += 1.0
    (tmp_path / name).write_text(json.dumps(moved))
    for other in render.RESULTS.glob("*.json"):
        if other.name != name:
            (tmp_path / other.name).write_text(other.read_text())
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    assert render.render_page(text, render.blocks()) != text


_RENDERED: dict = {}


def _page_with(tmp_path, monkeypatch, render, text: str) -> Path:
    """``text`` as one more page of the docs (the real pages stay, so every block is placed somewhere); the blocks
    rendered once for these tests."""
    if not _RENDERED:
        _RENDERED.update(render.blocks())
    monkeypatch.setattr(render, "blocks", lambda: dict(_RENDERED))
    page = tmp_path / "docs" / "extra.md"
    page.parent.mkdir()
    page.write_text(text)
    monkeypatch.setattr(render, "ROOT", tmp_path)
    monkeypatch.setattr(render, "PAGES", [tmp_path / p.relative_to(ROOT) for p in render.PAGES] + [page])
    for p in render.PAGES[:-1]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text((ROOT / p.relative_to(tmp_path)).read_text())
    return page


@pytest.mark.parametrize("opening", ["<!--  generated: {} -->", "<!-- generated:  {} -->", "<!--generated:{}-->",
                                     "<!-- Generated : {} -->"])
def test_a_hand_edited_number_is_caught_whatever_the_markers_spacing(tmp_path, monkeypatch, opening):
    """A block whose opening marker is spaced otherwise is checked all the same, even when the same block sits,
    correct, on another page (budget_vit.summary: on the README and on docs/index.md)."""
    render = _render()
    name = "budget_vit.summary"
    page = _page_with(tmp_path, monkeypatch, render, "")
    right = render.block_text(name, _RENDERED)
    assert right in (ROOT / "README.md").read_text() and right in (ROOT / "docs" / "index.md").read_text()
    number = re.search(r"\d+\.\d\d", _RENDERED[name]).group(0)
    edited = right.replace(number, f"{float(number) + 0.01:.2f}", 1).replace(f"<!-- generated: {name} -->",
                                                                            opening.format(name))
    page.write_text(f"# A page\n\n{edited}\n\nText after.\n")
    assert [b.name for b in render.parse_blocks(page.read_text())[0]] == [name]
    stale = [f"docs/extra.md: {name} differ from the result files (run: python benchmarks/render.py)"]
    assert render.check() == stale
    render.main([])  # rendering writes the block back, its markers as the script writes them
    assert page.read_text() == f"# A page\n\n{right}\n\nText after.\n" and render.check() == []
    # only the marker's spacing differs: still checked, and named, so that rendering normalises it
    page.write_text(f"# A page\n\n{right.replace(f'<!-- generated: {name} -->', opening.format(name))}\n")
    assert render.check() == stale


@pytest.mark.parametrize("text, problem", [
    ("<!-- generated: demo.seeds -->\n| 1.00 |\n", "block 'demo.seeds' has no closing '<!-- /generated -->'"),
    ("| 1.00 |\n<!-- /generated -->\n", "line 2: '<!-- /generated -->' closes no block"),
    ("<!-- generated: demo.seeds -->\n| 1.00 |\n<!-- generated: demo.wall -->\n| 2 |\n<!-- /generated -->\n",
     "line 1: block 'demo.seeds' has no closing '<!-- /generated -->' before the next block opens"),
    ("<!-- generated demo.seeds -->\n| 1.00 |\n<!-- /generated -->\n", "starts like a generated-block marker"),
    ("<!-- generated: no.such.block -->\n| 1.00 |\n<!-- /generated -->\n",
     "block 'no.such.block' is made by no renderer"),
])
def test_a_block_that_cannot_be_matched_to_its_source_fails_the_check(tmp_path, monkeypatch, text, problem):
    render = _render()
    _page_with(tmp_path, monkeypatch, render, text)
    problems = render.check()
    assert len(problems) >= 1 and all(p.startswith("docs/extra.md: ") for p in problems), problems
    assert any(problem in p for p in problems), problems
    with pytest.raises(KeyError, match="docs/extra.md"):
        render.main([])  # and rendering refuses the page rather than leave the block as it is


def test_markers_shown_as_code_are_text_not_blocks():
    render = _render()
    text = ("Tables sit between `<!-- generated: NAME -->` and `<!-- /generated -->`:\n\n```\n<!-- generated: x -->\n"
            "| 1.00 |\n<!-- /generated -->\n```\n")
    assert render.parse_blocks(text) == ([], [])


def test_every_result_file_has_a_renderer_and_no_file_without_provenance_is_rendered(tmp_path):
    render = _render()
    assert {p.name for p in (ROOT / "benchmarks" / "results").glob("*.json")} == set(render.RENDERERS)
    bare = tmp_path / "x.json"
    bare.write_text(json.dumps({"top1": 70.0}))
    with pytest.raises(ValueError, match="no provenance block"):
        render.Result(bare)


def test_no_table_of_numbers_outside_a_generated_block():
    """On the benchmark pages and the README, every table holding a number is a generated one."""
    render = _render()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]
    for page in pages:
        outside = render.strip_blocks(page.read_text())
        outside = re.sub(r"```.*?```", "", outside, flags=re.S)  # commands may hold numbers
        rows = [line for line in outside.splitlines() if line.startswith("|") and not set(line) <= set("|-: ")]
        numeric = [row for row in rows if re.search(r"\d", row)]
        assert numeric == [], f"{page.relative_to(ROOT)}: a table of numbers typed by hand: {numeric[:2]}"


# ---------------------------------------------------------------------------------------------- figures, source lines
def test_a_figure_block_shows_the_png_its_benchmark_drew_from_the_file():
    """``<stem>.figure`` is the PNG beside ``<stem>.json``, linked from the page to where it lies, with the file's
    source line; a figure nobody placed is no stale block."""
    render = _render()
    rendered = render.blocks()
    pngs = {p.stem for p in render.RESULTS.glob("*.png") if (render.RESULTS / f"{p.stem}.json").is_file()}
    assert {name[:-len(render.FIGURE)] for name in rendered if name.endswith(render.FIGURE)} == pngs
    page = "<!-- generated: alignment.figure -->\n<!-- /generated -->\n"
    for where, link in (("docs/benchmarks/checks.md", "../../benchmarks/results/alignment.png"),
                        ("docs/index.md", "../benchmarks/results/alignment.png"),
                        ("README.md", "benchmarks/results/alignment.png")):
        text = render.render_page(page, rendered, where)
        assert f"]({link})" in text and "*Source: `benchmarks/results/alignment.json`" in text, where
        assert (ROOT / Path(where).parent / link).resolve() == render.RESULTS / "alignment.png"
        assert render.render_page(text, rendered, where) == text  # rendered once, it stays
    assert not [p for p in render.check() if ".figure" in p]


def test_the_site_serves_each_figure_where_the_page_links_it():
    from scripts import load_script

    hooks = load_script("docs/hooks.py", "_hooks_for_tests")
    text = "![a](../../benchmarks/results/alignment.png) and ![b](../benchmarks/results/x.png) ![c](other.png)"
    out = hooks.figure_links(text, "benchmarks/checks.md")
    assert "](../figures/alignment.png)" in out
    assert "](../benchmarks/results/x.png)" in out and "](other.png)" in out  # not a file of benchmarks/results: as is
    assert "](figures/alignment.png)" in hooks.figure_links("![a](../benchmarks/results/alignment.png)", "index.md")


def test_every_source_line_on_a_page_names_a_command_that_runs():
    """The command closing a placed block is a benchmark script of this repository or an ``accelerate-ssl`` verb, as
    a reader would type it (a run started as ``.venv/bin/python benchmarks/x.py`` or inside another script is shown
    so)."""
    import shlex

    from accelerate_ssl.cli import build_parser

    render = _render()
    rendered = render.blocks()
    verbs = set(next(a for a in build_parser()._actions if a.choices and hasattr(a, "add_parser")).choices)
    placed = {b.name for page in render.PAGES for b in render.parse_blocks(page.read_text())[0]}
    wrong = []
    for name in sorted(placed):
        for line in re.findall(r"^\*Source: .*$", rendered[name], re.M):
            command = re.findall(r"`([^`]+)`\*", line)
            words = shlex.split(command[-1]) if command else []
            ok = (words[:1] == ["python"] and len(words) > 1 and (ROOT / words[1]).is_file()) or \
                 (words[:1] == ["accelerate-ssl"] and len(words) > 1 and words[1] in verbs)
            if command and not ok:
                wrong.append((name, command[-1]))
    assert wrong == []
    assert render.runnable(".venv/bin/python benchmarks/x.py --a 1") == "python benchmarks/x.py --a 1"
    assert render.runnable("benchmarks/x.py") == "python benchmarks/x.py"
    assert render.runnable("accelerate-ssl demo --seeds 0") == "accelerate-ssl demo --seeds 0"

