"""No measured number is typed by hand: every one in README.md and docs/ sits in a block `benchmarks/render.py` writes
from a result file.

A *measured* number is one with the shape of a measurement: a percentage, a multiple (``3.29x``), a time, a size in
bytes, a throughput, points of accuracy, a decimal; or a quantity said in words ("about half a plain step"). Outside
the generated blocks, fenced code, code spans, links and the README's references, each one must be a fact of the code,
the papers or the tools, allowed below by rule or by its exact words, with the reason it cannot drift from a result.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

GENERATED = re.compile(r"<!-- generated: [\w.-]+ -->\n.*?<!-- /generated -->", re.S)
UNIT = (r"%|x(?![\w-])|×|µs|us\b|ms\b|s\b|sec\b|seconds?\b|min\b|minutes?\b|h\b|hours?\b|points?\b|[KMGT]i?B\b|"
        r"bytes?\b|img/s|images/s|rows/s|it/s")
#: a measured number: with a unit, or a decimal; or a quantity in words
MEASURED = [re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:" + UNIT + ")"),
            re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])"),
            re.compile(r"\b(?:about|roughly|nearly|almost) (?:half|twice|double|a third|a quarter)\b", re.I),
            re.compile(r"\b(?:twice|half|three times|ten times) as (?:fast|slow|much|costly|cheap|long|large)\b", re.I)]

#: facts allowed wherever they appear, and why none of them can drift from a measurement
RULES = [
    (r"\b(?:timm|PyTorch|torch|lightly-train|Python|CUDA|cuDNN|Material for MkDocs|MkDocs)\s?v?\d+(?:\.\d+)+",
     "a version of a tool the page names"),
    (r"\b[A-Z]+-\d+\.\d+\b", "a licence's name (AGPL-3.0)"),
    (r"\b(?:Eq|App|Alg|Fig|Sec)\.\s?\d+|\bTable \d+", "a place in a cited paper"),
    (r"\b\d+x\d+\b", "a grid or image shape (3x3 map, 56x56 image): a fact of the network or the data"),
    (r"(?:lambda|λ)\s?(?:=|is|of|at|to|reaches|starts at|between)?\s?\d(?:\.\d+)?", "a value of lambda: the schedules' "
     "definition (accelerate_ssl/schedules.py)"),
    (r"\bk\s?=\s?\d+", "a probe's setting (kNN's k)"),
]

#: the exact words allowed on one page, with the reason (a setting of the code or of a study, a tolerance a test
#: asserts, a target): page -> [(words, reason)]
ALLOWED = {
    "docs/benchmarks/checks.md": [
        ("of 10 % of them", "a case of the study, named so in its generated table (alignment.py: shuffled-10%)"),
        ("10 % shuffled", "the same case, named again"),
    ],
    "docs/benchmarks/several-priors.md": [
        ("0.5).", "ReLA's default dropping probability (ReLA(drop=0.5), accelerate_ssl/rela/rela.py)"),
    ],
    "docs/checks.md": [
        ("ranked 0.5", "chance for the witness's rank statistic (the mean rank of another sample's row), by its "
                       "definition in accelerate_ssl/rela/witness.py"),
        ("Near 0.5 (chance)", "the same chance level"),
    ],
    "docs/concepts/handover.md": [
        ("5 %", "the hand-over's default heads warm-up (WARM_HEADS_FRACTION, accelerate_ssl/rela/handover.py)"),
        ("still at 0.1 or above", "the lambda at which the end-of-run notice speaks (accelerate_ssl/rela/validate.py)"),
    ],
    "docs/benchmarks/budget.md": [
        ("warm-up over 10 % then cosine", "the study's learning-rate schedule (recipes.train, benchmarks/harness.py)"),
    ],
    "docs/concepts/schedules.md": [
        ("hands over at 0.9 of it", "Switch's planned end (SWITCH_END_FRACTION, accelerate_ssl/schedules.py)"),
        ("an EMA (0.95)", "Decay's rho momentum, the paper's constant (accelerate_ssl/schedules.py)"),
        ("stays near 0.8", "Decay's max_lambda, the paper's constant (accelerate_ssl/schedules.py)"),
        ("a fresh 10 %", "the subset fraction of ReLA Eq. 43 (accelerate_ssl/data/subset.py)"),
    ],
    "docs/concepts/targets.md": [
        ("2 bytes per value", "the width of float16 and bfloat16"),
    ],
    "docs/benchmarks/stores.md": [
        ("at least 0.9x as fast", "the precompute's goal, a target the table is read against, not a measurement"),
    ],
    "docs/precompute.md": [
        ("within 1e-6", "the tolerance tests/test_precompute_pipeline.py asserts"),
        ("a cosine above 0.999", "the agreement tests/test_precompute_pipeline.py asserts between the two decoders"),
    ],
    "docs/concepts/priors.md": [
        ("373 KB", "the size of each shipped prior's weights file (accelerate_ssl/assets/), a fact of the package"),
    ],
}


def _blank(match: re.Match) -> str:
    return "\n" * match.group(0).count("\n")


def prose(text: str) -> str:
    """The page's prose, line for line: generated blocks, fenced code, HTML comments, snippet includes, link targets,
    URLs, code spans and the README's references removed."""
    text = GENERATED.sub(_blank, text)
    text = re.sub(r"^(?P<f>```|~~~).*?^(?P=f)", _blank, text, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", _blank, text, flags=re.S)
    text = re.sub(r"^## References\n.*", _blank, text, flags=re.S | re.M)
    lines = []
    for line in text.splitlines():
        line = re.sub(r"^\s*--8<--.*", "", line)
        line = re.sub(r"`[^`]*`", "``", line)
        line = re.sub(r"\]\([^)]*\)", "]", line)
        line = re.sub(r"https?://\S+", "", line)
        lines.append(line)
    return "\n".join(lines)


def measured(line: str, page: str = "") -> list[str]:
    """The measured numbers of one line of prose, in order, once the rules and ``page``'s allowed words are taken out."""
    for words, _ in ALLOWED.get(page, []):
        line = line.replace(words, "")
    for rule, _ in RULES:
        line = re.sub(rule, "", line)
    spans = sorted({(m.start(), m.end()) for p in MEASURED for m in p.finditer(line)})
    return [line[a:b] for a, b in spans if not any(c <= a and b <= d and (c, d) != (a, b) for c, d in spans)]


def typed_numbers(page: Path) -> list[str]:
    """``page:line: number :: the line`` for each measured number typed by hand on ``page``."""
    rel = page.relative_to(ROOT).as_posix()
    return [f"{rel}:{i}: {number!r} :: {line.strip()}"
            for i, line in enumerate(prose(page.read_text()).splitlines(), 1) for number in measured(line, rel)]


def test_no_measured_number_is_typed_by_hand():
    """Every measured number of README.md and docs/ is in a generated block (or allowed above, with its reason)."""
    typed = [hit for page in PAGES for hit in typed_numbers(page)]
    assert typed == [], "measured numbers typed by hand (put them in a generated block):\n" + "\n".join(typed)


def test_every_allowed_phrase_is_still_on_its_page():
    """An allowance whose words left the page is removed, so the list stays the list of what is typed."""
    for page, allowed in ALLOWED.items():
        text = (ROOT / page).read_text()
        assert [words for words, _ in allowed if words not in text] == [], page


def test_the_check_catches_measurements_and_lets_facts_pass():
    typed = ("A cached step costs 0.36x a plain one, 12 ms, 3.1 points more; about half a plain step.\n"
             "It saved 40 % of the time.\n")
    facts = ("With timm 1.0.31, ReLA v2 Eq. 41, a 3x3 map, lambda 1 then lambda = 0, k = 20, 250 steps, 3 seeds.\n"
             "<!-- generated: x.y -->\n| 1.23 | 4.5x |\n<!-- /generated -->\n"
             "```bash\npython run.py --lr 0.001 --size 28\n```\nThe flag `--lr 0.001` and [a link](a/b-1.5.md).\n")
    found = [n for line in prose(typed + facts).splitlines() for n in measured(line)]
    assert found == ["0.36x", "12 ms", "3.1 points", "about half", "40 %"], found
