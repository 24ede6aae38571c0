"""The built book renders: every page of _toc.yml, opened in a real browser.

A Sphinx build can succeed while the published page is broken: an image whose file was not
copied, math that MathJax never typesets because its script failed to load (or would have
to come from a CDN the reader cannot reach). So this test serves ``_build/html`` on
127.0.0.1, opens each page in headless Chromium, lets the page's JavaScript run, and reads
back the rendered DOM. A small probe script, added to each page by the test's own server
(the files on disk are not touched), waits for the page's load event and MathJax's
startup, then records every image's natural size as attributes the dumped DOM carries.

For each page it checks: the page's title is its source's first heading; every image
from the notebook's outputs is present and loads with a non-zero size; and, where the
page has math, every formula has been typeset by MathJax, without errors. Separately,
no page may load MathJax from the network.

Needs ``/usr/bin/chromium`` (``bash scripts/install_test_deps.sh``). Builds the book with
``scripts/build_book.py`` if ``_build/html`` does not exist or its last build failed.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from bs4 import BeautifulSoup

ROOT = Path(__file__).resolve().parents[2]
HTML = ROOT / "_build" / "html"
VIRTUAL_TIME_BUDGET_MS = 20_000  # page JS time, fast-forwarded while the page is idle
PAGE_TIMEOUT_S = 120

# The order in which myst-nb picks one MIME type per output for HTML (its default
# render priority); an output is drawn as an <img> when the first type it has is an image.
RENDER_PRIORITY = [
    "application/vnd.jupyter.widget-view+json",
    "application/javascript",
    "text/html",
    "image/svg+xml",
    "image/png",
    "image/jpeg",
    "image/gif",
    "text/markdown",
    "text/latex",
    "text/plain",
]
REMOVED_OUTPUT_TAGS = {"remove-cell", "remove_cell", "remove-output", "remove_output"}

PROBE = """
<script>
(function () {
  document.querySelectorAll('img[loading="lazy"]').forEach(function (img) { img.loading = 'eager'; });
  function finish(state) {
    document.querySelectorAll('img').forEach(function (img) {
      img.setAttribute('data-probe-complete', img.complete ? '1' : '0');
      img.setAttribute('data-probe-width', String(img.naturalWidth));
      img.setAttribute('data-probe-height', String(img.naturalHeight));
    });
    document.documentElement.setAttribute('data-probe', state);
  }
  window.addEventListener('load', function () {
    var mj = window.MathJax;
    if (!(mj && mj.startup && mj.startup.promise)) { finish('no-mathjax'); return; }
    mj.startup.promise.then(function () { finish('mathjax-done'); },
                            function (err) { finish('mathjax-failed: ' + err); });
  });
})();
</script>
"""


# --------------------------------------------------------------------------- the pages


def toc_files() -> list[str]:
    """Every document of _toc.yml, in reading order (without suffix)."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                files.append(entry["file"])
            walk(entry.get("sections"))
            walk(entry.get("chapters"))

    for part in toc.get("parts", []):
        walk(part.get("chapters"))
    walk(toc.get("chapters"))
    return files


def source_of(doc: str) -> Path:
    for suffix in (".ipynb", ".md", ".rst"):
        path = ROOT / (doc + suffix)
        if path.is_file():
            return path
    raise AssertionError(f"{doc}: listed in _toc.yml but no {doc}.ipynb/.md/.rst exists")


def strip_markup(text: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # [text](link) -> text
    text = text.replace("`", "").replace("**", "").strip()
    return " ".join(text.split())


def expected_title(source: Path) -> str:
    if source.suffix == ".ipynb":
        nb = json.loads(source.read_text("utf-8"))
        lines = [
            line
            for cell in nb["cells"]
            if cell["cell_type"] == "markdown"
            for line in "".join(cell["source"]).splitlines()
        ]
    else:
        lines = source.read_text("utf-8").splitlines()
    for line in lines:
        m = re.match(r"#\s+(.+?)\s*#*\s*$", line)
        if m:
            return strip_markup(m.group(1))
    raise AssertionError(f"{source.relative_to(ROOT)}: no top-level '# ' heading to use as the page title")


def expected_output_images(source: Path) -> int:
    """How many <img> the notebook's outputs should render to."""
    if source.suffix != ".ipynb":
        return 0
    nb = json.loads(source.read_text("utf-8"))
    count = 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        if REMOVED_OUTPUT_TAGS & set(cell.get("metadata", {}).get("tags", [])):
            continue
        for output in cell.get("outputs", []):
            if output.get("output_type") not in ("display_data", "execute_result"):
                continue
            data = output.get("data", {})
            chosen = next((m for m in RENDER_PRIORITY if m in data), None)
            if chosen is not None and chosen.startswith("image/"):
                count += 1
    return count


PAGES = toc_files()


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def site() -> Path:
    # Build when there is no site, or when the last build did not finish cleanly
    # (scripts/build_book.py writes _build/.book-ok only after a build without warnings).
    if not (HTML / "index.html").is_file() or not (ROOT / "_build" / ".book-ok").is_file():
        result = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_book.py")], cwd=ROOT)
        assert result.returncode == 0, "scripts/build_book.py failed; see its output above"
    return HTML


class ProbingHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the built site; HTML pages get the probe script before </body>."""

    def do_GET(self):  # noqa: N802 (http.server's naming)
        path = Path(self.translate_path(self.path))
        if path.is_dir():
            path = path / "index.html"
        if path.suffix != ".html" or not path.is_file():
            return super().do_GET()
        page = path.read_text("utf-8")
        page = page.replace("</body>", PROBE + "</body>", 1) if "</body>" in page else page + PROBE
        body = page.encode("utf-8")
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # keep pytest's output readable
        pass


@pytest.fixture(scope="session")
def server(site):
    handler = functools.partial(ProbingHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def chromium() -> str:
    candidates = [os.environ.get("CHROMIUM"), "/usr/bin/chromium"]
    candidates += [shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")]
    for exe in candidates:
        if exe and os.access(exe, os.X_OK):
            return exe
    pytest.fail("headless Chromium not found: run `bash scripts/install_test_deps.sh` (or set CHROMIUM)")


def chromium_dump_dom(chromium: str, url: str, profile: Path) -> tuple[str | None, str]:
    """Load url in headless Chromium, run its JavaScript, return (DOM or None, error)."""
    cmd = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--disable-extensions", "--disable-dev-shm-usage",
        f"--user-data-dir={profile}", "--window-size=1280,2000",
        f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}",
        "--dump-dom", url,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"Chromium did not finish rendering the page in {PAGE_TIMEOUT_S} s"
    if proc.returncode != 0 or not proc.stdout.strip():
        return None, f"Chromium failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc.stdout, ""


class Rendered(dict):
    """doc -> (rendered DOM or None, error); a short repr keeps failure reports readable."""

    def __repr__(self) -> str:
        return f"<rendered DOM of {len(self)} pages>"


@pytest.fixture(scope="session")
def rendered(site, server, chromium, tmp_path_factory) -> Rendered:
    """The rendered DOM of every page, loaded a few at a time (Chromium's start-up dominates)."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("chromium")

    def one(item):
        i, doc = item
        return doc, chromium_dump_dom(chromium, f"{server}/{doc}.html", root / f"profile{i}")

    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return Rendered(pool.map(one, enumerate(PAGES)))


# --------------------------------------------------------------------------- the checks


def test_toc_lists_the_chapters():
    chapters = [d for d in PAGES if d.startswith("notebooks/")]
    assert chapters, "_toc.yml lists no chapter notebooks"
    assert chapters == sorted(chapters), f"chapters out of reading order in _toc.yml: {chapters}"


@pytest.mark.parametrize("doc", PAGES)
def test_page_renders(doc, site, rendered):
    source = source_of(doc)
    built = site / f"{doc}.html"
    assert built.is_file(), f"{doc}: {built.relative_to(ROOT)} was not built (is the book stale? run make book)"
    static = BeautifulSoup(built.read_text("utf-8"), "html.parser")
    html, error = rendered[doc]
    assert html is not None, f"{doc}: {error}"
    dom = BeautifulSoup(html, "html.parser")

    state = dom.html.get("data-probe") if dom.html else None
    assert state is not None, (
        f"{doc}: the page never finished loading in the browser (no load event within "
        f"{VIRTUAL_TIME_BUDGET_MS} ms of page time)"
    )
    assert not state.startswith("mathjax-failed"), f"{doc}: MathJax failed to start: {state}"

    # The title: the source's first heading is the page's <h1> and starts its <title>.
    title = expected_title(source)
    main = dom.find("main") or dom
    h1 = main.find("h1")
    assert h1 is not None, f"{doc}: the rendered page has no <h1> title (expected {title!r})"
    for link in h1.select("a.headerlink"):
        link.decompose()
    shown = " ".join(h1.get_text(" ", strip=True).split())
    assert strip_markup(shown) == title, f"{doc}: page title is {shown!r}, expected {title!r}"
    page_title = " ".join((dom.title.get_text() if dom.title else "").split())
    assert page_title.startswith(title), f"{doc}: <title> is {page_title!r}, expected it to start with {title!r}"

    # The images: every notebook output figure is there, and every <img> loaded.
    want = expected_output_images(source)
    output_imgs = [img for img in dom.select(".cell_output img")]
    assert len(output_imgs) == want, (
        f"{doc}: {want} image output(s) in {source.name} but {len(output_imgs)} <img> in the page's cell outputs"
    )
    for img in dom.find_all("img"):
        src = img.get("src", "")
        if src.startswith("data:"):
            continue
        on_disk = (built.parent / src.split("?")[0].split("#")[0]).resolve()
        assert on_disk.is_file() and on_disk.stat().st_size > 0, f"{doc}: image {src} is missing from the built site"
        w, h = int(img.get("data-probe-width", 0)), int(img.get("data-probe-height", 0))
        assert img.get("data-probe-complete") == "1" and w > 0 and h > 0, (
            f"{doc}: image {src} did not load in the browser (natural size {w}x{h})"
        )

    # The math: where the page has formulas, MathJax typeset every one of them.
    formulas = static.select(".math")
    if not formulas:
        return
    assert state == "mathjax-done", f"{doc}: the page has {len(formulas)} formula(s) but MathJax never ran ({state})"
    rendered = dom.select(".math")
    untypeset = [f.get_text()[:60] for f in rendered if f.find("mjx-container") is None]
    assert not untypeset, f"{doc}: {len(untypeset)} formula(s) not typeset by MathJax, e.g. {untypeset[0]!r}"
    assert len(dom.find_all("mjx-container")) >= len(formulas), (
        f"{doc}: {len(formulas)} formula(s) but only {len(dom.find_all('mjx-container'))} typeset"
    )
    errors = [e.get_text(" ", strip=True)[:80] for e in dom.find_all("mjx-merror")]
    assert not errors, f"{doc}: MathJax reports TeX errors: {errors}"


CDN = re.compile(r"""https?://[^"'\s<>]*mathjax""", re.IGNORECASE)
MATHJAX_SRC = re.compile(r"""<script[^>]*\ssrc=["']([^"']*mathjax[^"']*)["']""", re.IGNORECASE)


def test_mathjax_is_served_locally(site):
    pages = sorted(site.rglob("*.html"))
    assert pages, f"no HTML pages in {site}"
    remote = [str(p.relative_to(site)) for p in pages if CDN.search(p.read_text("utf-8", "replace"))]
    assert not remote, f"pages reference MathJax over http(s), which an offline reader cannot load: {remote}"
    for doc in PAGES:
        page = site / f"{doc}.html"
        for src in MATHJAX_SRC.findall(page.read_text("utf-8")):
            local = (page.parent / src.split("?")[0]).resolve()
            assert local.is_file() and local.stat().st_size > 0, f"{doc}: MathJax script {src} is missing from the site"
