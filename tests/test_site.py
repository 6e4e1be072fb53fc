"""The built documentation site as a reader gets it: every API entry rendered as Markdown (no reST role printed as
text), a figure on the home page and on every benchmark page, and code blocks that show their whole lines in a
1366 px wide browser window, in the light and the dark theme.

The site is built once for these tests (``mkdocs build --strict``, the docs extra: ``make docs`` installs it); the
browser tests drive a headless Chromium through chromedriver's WebDriver protocol (``apt-get install chromium
chromium-driver``), and are skipped without one unless ``ACCELERATE_SSL_REQUIRE_BROWSER=1``, as CI sets where it has
one. By hand::

    make docs && ACCELERATE_SSL_REQUIRE_BROWSER=1 .venv/bin/python -m pytest tests/test_site.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: a role as a reader would see it printed: as typed, or with its target already turned into code by Markdown
ROLE_TEXT = re.compile(r":(?:py:)?(?:class|func|meth|data|mod|attr|exc|obj|const|ref|term):(?:`|<code>)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra (make docs installs it)")
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def pages(site: Path) -> dict[str, Path]:
    """Every page of the built site by its source file (``benchmarks/cost.md`` -> ``benchmarks/cost/index.html``)."""
    out = {}
    for html in site.rglob("index.html"):
        rel = html.parent.relative_to(site).as_posix()
        if rel in ("", "."):
            out["index.md"] = html
        elif (ROOT / "docs" / f"{rel}.md").is_file():
            out[f"{rel}.md"] = html
        elif (ROOT / "docs" / rel / "index.md").is_file():
            out[f"{rel}/index.md"] = html
    return out


def test_no_page_prints_a_rest_role(site):
    """Sphinx roles in docstrings (``:class:`~x.Y```) are rendered as code or links, never shown as markup. A page
    written by hand may show the syntax in code (the contributing guide does); the API page may not, even there."""
    def text(name: str, path: Path) -> str:
        html = path.read_text()
        return html if name == "api.md" else re.sub(r"<code>.*?</code>", "", html, flags=re.S)

    raw = {name: ROLE_TEXT.findall(text(name, path)) for name, path in pages(site).items()}
    assert {name: hits for name, hits in raw.items() if hits} == {}
    api = (site / "api" / "index.html").read_text()
    assert "<autoref" not in api  # every cross-reference was resolved (a link) or shown as its code


def test_the_module_docstrings_the_api_entries_point_to_are_on_the_site(site):
    """An entry saying "module docstring" links to that module's entry on the API page."""
    api = (site / "api" / "index.html").read_text()
    links = re.findall(r'<a[^>]+href="#([\w.]+)"[^>]*>(?:the |this )?module docstring</a>', api)
    assert links, "no entry links its module docstring"
    for anchor in set(links):
        assert f'id="{anchor}"' in api, anchor


def test_relas_options_are_grouped_by_what_they_decide(site):
    api = (site / "api" / "index.html").read_text()
    start = api.index('id="accelerate_ssl.rela.ReLA"')
    entry = api[start:api.index('id="accelerate_ssl.rela.ReLA.', start)]
    for title in ("Targets and data", "Schedule and hand-over", "Head", "Checks", "Performance"):
        assert re.search(rf">\s*{title}\s*<", entry), title


def test_a_figure_on_the_home_page_and_on_every_benchmark_page(site):
    built = pages(site)
    wanted = ["index.md", "choosing.md", *sorted(f"benchmarks/{p.name}" for p in (ROOT / "docs/benchmarks").glob("*.md")
                                                 if p.name != "index.md")]
    missing = []
    for name in wanted:
        figures = re.findall(r'<img[^>]+src="([^"]*figures/[\w.-]+\.png)"', built[name].read_text())
        for src in figures:
            assert (built[name].parent / src).resolve().is_file(), (name, src)
        if not figures:
            missing.append(name)
    assert missing == [], f"pages without a figure: {missing}"
    broken = [(name, src) for name, path in built.items()
              for src in re.findall(r'<img[^>]+src="([^":]+)"', path.read_text())
              if not (path.parent / src).resolve().is_file()]
    assert broken == [], f"images that resolve to no file of the site: {broken}"


# ---------------------------------------------------------------------------------------------- in a browser
def chromium() -> tuple[str, str] | None:
    browser = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


class Browser:
    """A headless Chromium driven over chromedriver's W3C WebDriver HTTP protocol (no client library needed)."""

    def __init__(self, browser: str, driver: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.driver = subprocess.Popen([driver, f"--port={self.port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                self._call("GET", "/status")
                break
            except OSError:
                time.sleep(0.1)
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]
        caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome",
                                                 "goog:chromeOptions": {"binary": browser, "args": args}}}}
        self.session = self._call("POST", "/session", caps)["sessionId"]

    def _call(self, method: str, path: str, body: dict | None = None):
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["value"]

    def command(self, method: str, path: str, body: dict | None = None):
        return self._call(method, f"/session/{self.session}{path}", body)

    def run(self, script: str):
        return self.command("POST", "/execute/sync", {"script": script, "args": []})

    def close(self) -> None:
        try:
            self.command("DELETE", "")
        finally:
            self.driver.terminate()
            self.driver.wait(10)


@pytest.fixture(scope="module")
def browser():
    found = chromium()
    if found is None:
        if os.environ.get("ACCELERATE_SSL_REQUIRE_BROWSER") == "1":
            pytest.fail("no chromium + chromedriver on PATH, and ACCELERATE_SSL_REQUIRE_BROWSER=1")
        pytest.skip("no chromium + chromedriver on PATH (apt-get install chromium chromium-driver)")
    b = Browser(*found)
    b.command("POST", "/window/rect", {"width": 1366, "height": 768})
    yield b
    b.close()


#: the lines of every visible code block that do not fit it, in the theme ``{scheme}`` (set on the body, as the site's
#: toggle sets it)
OVERFLOW = """
document.body.setAttribute('data-md-color-scheme', '{scheme}');
return Array.from(document.querySelectorAll('.md-content pre > code')).filter(c => c.offsetParent !== null)
  .filter(c => c.scrollWidth > c.clientWidth + 1)
  .map(c => c.textContent.split('\\n').sort((a, b) => b.length - a.length)[0].slice(0, 120));
"""


def test_every_code_block_shows_its_whole_lines_at_1366_px(site, browser):
    """At a 1366 px window no code block hides the end of a line (the quick start's ``total_steps=`` included)."""
    width = browser.run("return window.innerWidth;")
    assert width >= 1300, width
    cut = {}
    for name, path in sorted(pages(site).items()):
        browser.command("POST", "/url", {"url": path.as_uri()})
        for scheme in ("default", "slate"):
            hidden = browser.run(OVERFLOW.replace("{scheme}", scheme))
            if hidden:
                cut[f"{name} ({scheme})"] = hidden
    assert cut == {}, f"code blocks that hide the end of a line: {cut}"
    browser.command("POST", "/url", {"url": pages(site)["index.md"].as_uri()})
    quick = browser.run("""return Array.from(document.querySelectorAll('.md-content pre > code'))
        .map(c => [c.textContent, c.getBoundingClientRect().right <= window.innerWidth]);""")
    assert any("total_steps=" in text and inside for text, inside in quick), quick


def test_figures_are_drawn_on_white_in_both_themes(site, browser):
    """A figure's background is white whatever the theme, so the plots' black text stays readable on the dark one."""
    path = pages(site)["benchmarks/checks.md"]
    browser.command("POST", "/url", {"url": path.as_uri()})
    for _ in range(100):  # every figure decoded (a busy machine may still be at it when the page reports loaded)
        if browser.run("""return Array.from(document.querySelectorAll('.md-content img[src*="figures/"]'))
                          .every(i => i.complete && i.naturalWidth > 0);"""):
            break
        time.sleep(0.1)
    for scheme in ("default", "slate"):
        colours = browser.run(f"""document.body.setAttribute('data-md-color-scheme', {scheme!r});
            return Array.from(document.querySelectorAll('.md-content img[src*="figures/"]'))
              .map(i => [getComputedStyle(i).backgroundColor, i.naturalWidth > 0,
                         i.getBoundingClientRect().right <= window.innerWidth]);""")
        assert colours and all(c == ["rgb(255, 255, 255)", True, True] for c in colours), (scheme, colours)
