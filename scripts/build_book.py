#!/usr/bin/env python
"""Build the course book into ``_build/html``; any Sphinx warning fails the build.

The published book must render its math with no network access, so MathJax is not taken
from a CDN: it is installed once from the npm registry into a cache outside the repository
(``$MINIVLLM_CACHE``, default ``~/.cache/minivllm``), copied into ``_build/.static/mathjax``,
and ``_config.yml`` points Sphinx there (``html_static_path`` + ``mathjax_path``), so every
page loads ``_static/mathjax/tex-mml-chtml.js`` from the site itself. On a machine without
npm, set ``MATHJAX_DIR`` to an unpacked MathJax 3 ``es5`` folder instead.

Running it again is cheap: the MathJax copy is kept, and Sphinx rebuilds only what changed.
Notebooks are never executed; they carry their own outputs.

    python scripts/build_book.py            # incremental build
    python scripts/build_book.py --clean    # rebuild every page from scratch
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "_build"
HTML = BUILD / "html"
STATIC = BUILD / ".static"  # listed in _config.yml as html_static_path
DOCTREES = BUILD / ".doctrees"
# Written only after a clean build. Sphinx re-reads only changed pages, so after a failed
# build an unchanged page would not repeat its warning and the next build would pass;
# without this stamp the next build starts from scratch instead.
OK_STAMP = BUILD / ".book-ok"
MATHJAX_VERSION = "3.2.2"
MATHJAX_ENTRY = "tex-mml-chtml.js"  # the mathjax_path in _config.yml, relative to _static
# What a page needs: the combined TeX component, lazily loaded TeX extensions, the CHTML
# fonts, and the accessibility/menu pieces MathJax fetches when a reader uses its menu.
MATHJAX_PARTS = [MATHJAX_ENTRY, "input", "output/chtml", "output/chtml.js", "a11y", "ui", "sre"]
CDN_MATHJAX = re.compile(r"""(?:src|href)=["']?(?:https?:)?//[^"'\s>]*mathjax""", re.IGNORECASE)


def log(msg: str) -> None:
    print(f"build_book: {msg}", flush=True)


def cache_dir() -> Path:
    base = os.environ.get("MINIVLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minivllm"
    )
    return Path(base) / f"mathjax-{MATHJAX_VERSION}"


def mathjax_source() -> Path:
    """Return an ``es5`` folder of MathJax 3, installing it from npm if needed."""
    if os.environ.get("MATHJAX_DIR"):
        src = Path(os.environ["MATHJAX_DIR"])
        if not (src / MATHJAX_ENTRY).is_file():
            sys.exit(f"build_book: MATHJAX_DIR={src} has no {MATHJAX_ENTRY} (want MathJax 3's es5/)")
        return src
    prefix = cache_dir()
    src = prefix / "node_modules" / "mathjax" / "es5"
    if (src / MATHJAX_ENTRY).is_file():
        return src
    npm = shutil.which("npm")
    if npm is None:
        sys.exit(
            "build_book: MathJax is installed from the npm registry at build time, but npm is "
            "not on PATH. Install Node.js, or set MATHJAX_DIR to a MathJax 3 es5/ folder."
        )
    log(f"installing mathjax@{MATHJAX_VERSION} from npm into {prefix}")
    prefix.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [npm, "install", "--prefix", str(prefix), "--no-save", "--no-audit", "--no-fund",
         "--loglevel=error", f"mathjax@{MATHJAX_VERSION}"],
        check=True,
    )
    if not (src / MATHJAX_ENTRY).is_file():
        sys.exit(f"build_book: npm finished but {src / MATHJAX_ENTRY} is missing")
    return src


def stage_mathjax() -> None:
    """Copy the parts of MathJax the pages need into the static folder Sphinx publishes."""
    dest = STATIC / "mathjax"
    stamp = BUILD / ".mathjax-version"
    if (dest / MATHJAX_ENTRY).is_file() and stamp.is_file() and stamp.read_text().strip() == MATHJAX_VERSION:
        return
    src = mathjax_source()
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for part in MATHJAX_PARTS:
        s, d = src / part, dest / part
        if s.is_dir():
            shutil.copytree(s, d)
        elif s.is_file():
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, d)
    licence = src.parent / "LICENSE"
    if licence.is_file():
        shutil.copy2(licence, dest / "LICENSE")
    stamp.write_text(MATHJAX_VERSION + "\n")
    log(f"MathJax {MATHJAX_VERSION} staged in {dest.relative_to(ROOT)}")


def jupyter_book() -> str:
    exe = Path(sys.executable).with_name("jupyter-book")
    if exe.is_file():
        return str(exe)
    found = shutil.which("jupyter-book")
    if found is None:
        sys.exit("build_book: jupyter-book not found; run `make setup` (installs .[book])")
    return found


def check_no_cdn_mathjax() -> None:
    bad = [p.relative_to(HTML) for p in HTML.rglob("*.html") if CDN_MATHJAX.search(p.read_text("utf-8", "replace"))]
    if bad:
        sys.exit(f"build_book: pages load MathJax from the network: {', '.join(map(str, bad))}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clean", action="store_true", help="remove _build/html and rebuild every page")
    args = parser.parse_args()

    if args.clean:
        shutil.rmtree(HTML, ignore_errors=True)
        shutil.rmtree(BUILD / "jupyter_execute", ignore_errors=True)
    if args.clean or not OK_STAMP.is_file():
        shutil.rmtree(DOCTREES, ignore_errors=True)  # re-read every page
    OK_STAMP.unlink(missing_ok=True)
    stage_mathjax()
    # -W: warnings are errors; -n: nitpicky (broken cross-references warn);
    # --keep-going: report every warning before failing.
    cmd = [jupyter_book(), "build", str(ROOT), "-W", "-n", "--keep-going"]
    result = subprocess.run(cmd, cwd=ROOT)
    if result.returncode != 0:
        log("FAILED: the build reported warnings or errors (see above)")
        return result.returncode
    check_no_cdn_mathjax()
    OK_STAMP.write_text("")
    log(f"book built: {(HTML / 'index.html').relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
