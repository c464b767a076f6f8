"""The documentation site, built as `make docs` builds it and read in headless Chromium with the network cut off; its
report (a line per notebook) and optional cell time limit; the notebooks a reader opens (kernelspec); `make lab` as root
on 127.0.0.1 with its token URL printed."""
import functools
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urldefrag, urlparse

import nbformat
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from nbdev.clean import clean_nb

from browser_utils import CHROMIUM, browser_page, free_port

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "site"
NOTEBOOKS = sorted(p for p in (ROOT / "nbs").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
KERNELSPEC = {"display_name": "python3", "language": "python", "name": "python3"}
# pages known to hold plotly figures, and the fewest each holds: those drawn from widgets' state count too (a
# dashboard's six figures, an explorer's mask and layout)
FIGURE_PAGES = {"nbs/01_packing/07_viz.html": 1, "nbs/04_runtime/13_dashboard.html": 6,
                "nbs/04_runtime/15_explorer.html": 2,
                "nbs/tutorials/launch_sp.html": 6, "nbs/tutorials/explore_masks.html": 2, "nbs/architecture.html": 1}


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args): pass


@pytest.fixture(scope="module")
def site():
    """Build the site as `make docs` does (one notebook at a time beside another pytest worker), then serve it on
    127.0.0.1 from a thread; yields its base URL."""
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: apt-get install -y chromium (.ci/run does it)"
    jobs = "1" if "PYTEST_XDIST_WORKER" in os.environ else "2"  # beside another worker: one notebook at a time
    build = subprocess.run([sys.executable, str(ROOT / "docs" / "build.py"), "--jobs", jobs], cwd=ROOT,
                           capture_output=True, text=True, timeout=1200, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert build.returncode == 0, f"docs/build.py failed:\n{build.stdout[-3000:]}\n{build.stderr[-5000:]}"
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(SITE)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try: yield f"http://127.0.0.1:{httpd.server_port}/"
    finally:
        httpd.shutdown(); httpd.server_close(); thread.join(10)


class Ids(HTMLParser):
    "Every element id of a page (the targets of `page.html#id` links)."
    def __init__(self):
        super().__init__(); self.ids = set()
    def handle_starttag(self, tag, attrs):
        self.ids.update(v for k, v in attrs if k in ("id", "name") and v)


@functools.cache
def page_ids(path: Path) -> frozenset[str]:
    "A page's element ids, parsed once (every page links to the same API pages: 2,558 anchor links over 72 pages)."
    p = Ids(); p.feed(path.read_text(errors="replace")); return frozenset(p.ids)


DRAWN = """() => (!document.querySelector('script[src*="MathJax.js"]') || window.MathJax && MathJax.isReady
    && !MathJax.Hub.queue.running && MathJax.Hub.queue.pending === 0)
    && [...document.querySelectorAll('.plotly-graph-div')].every(d => d.querySelector('.main-svg'))"""
PROSE = """() => { const prose = document.querySelector('article').cloneNode(true);
    prose.querySelectorAll('pre, code, script, style, .MathJax, .MathJax_Preview, .MathJax_Display')\
.forEach(e => e.remove());
    return prose.textContent; }"""  # the text a reader sees, less code and the math MathJax typeset


@functools.cache
def math_delimiters() -> re.Pattern:
    """The TeX delimiters the site's MathJax typesets, as docs/hooks.py
    defines them (it decides which pages load MathJax)."""
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec); spec.loader.exec_module(hooks)
    return hooks.MATH


def read_pages(site: str, pages: list[str]) -> dict:
    """Every page in one headless Chromium tab with the network cut (no host name resolves; 127.0.0.1 is the site):
    {page: (console errors, requests made off the site, whether MathJax and every figure finished, whether each figure
    drew, its links, the TeX it shows untypeset)}."""
    offline = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"
    read, errors, refused = {}, [], []
    with browser_page(offline) as page:
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: None if r.url.startswith((site, "data:")) else refused.append(r.url))
        for rel in pages:
            page.goto(site + rel, wait_until="load")
            try: finished = bool(page.wait_for_function(DRAWN, timeout=10000))  # MathJax and plotly draw after load
            except PlaywrightTimeout: finished = False
            figures = page.eval_on_selector_all(".plotly-graph-div", "els => els.map(e => "
                                                                     "!!e.querySelector('.main-svg'))")
            links = page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")
            raw_tex = math_delimiters().findall(page.evaluate(PROSE))  # math left as TeX: a page with math, no MathJax
            read[rel] = (errors.copy(), refused.copy(), finished, figures, links, raw_tex)
            errors.clear(); refused.clear()
    return read


@pytest.mark.site  # `make test-site` (CI runs it after `make test`, which leaves it out)
# a clean build executes every notebook: 10 min measured on a loaded 2-core box, then ~1.5 min of pages
@pytest.mark.timeout(1500)
def test_site_reads_offline_in_chromium(site):
    """Every page loads with no console error and no request off 127.0.0.1; every figure draws; no math is left as TeX
    (a page loads MathJax and plotly.js only where it needs them); no internal link is broken."""
    pages = sorted(str(p.relative_to(SITE)) for p in SITE.rglob("*.html") if p.name != "404.html")
    for rel in ["index.html", *FIGURE_PAGES, "api/workbench.packing.html"]:
        assert rel in pages, f"{rel} is missing from the site: {pages}"
    src, build = ROOT / ".docs-build" / "src", load_build()
    for nb in NOTEBOOKS:  # every notebook has its page, and nothing a page cannot draw was left in it
        if nb.name.startswith("_"): continue
        rel = nb.relative_to(ROOT)
        assert str(rel.with_suffix(".html")) in pages, f"{rel} has no page"
        cells = [c for c in nbformat.reads((src / rel).read_text(), as_version=4).cells if c.cell_type == "code"]
        kinds = {kind for c in cells for out in c.outputs for kind in out.get("data", {})}  # what each output is
        assert not kinds & {build.PLOTLY_MIME, build.WIDGET_MIME}, f"{rel}: an undrawn figure ({sorted(kinds)})"
        shown = [c.source for c in cells]
        assert all(build.shown_code(s) == s for s in shown), f"{rel}: a page shows a check (assert / test_*)"
    problems, read = [], read_pages(site, pages)
    for rel, (errors, refused, finished, figures, _, raw_tex) in read.items():
        if not finished: problems.append(f"{rel}: MathJax or a figure had not finished drawing 10 s after load")
        if raw_tex: problems.append(f"{rel}: math shown as TeX, not typeset: {raw_tex[:3]}")
        problems += [f"{rel}: console error: {e}" for e in errors]
        problems += [f"{rel}: asked the network for {u}" for u in refused]
        if not all(figures): problems.append(f"{rel}: {figures.count(False)} of {len(figures)} figures did not draw")
        if len(figures) < FIGURE_PAGES.get(rel, 0): problems.append(f"{rel}: {len(figures)} figures, "
                                                                    f"not {FIGURE_PAGES[rel]}")
    for rel, (*_, links, _) in read.items():
        for url in links:
            if not url.startswith(site): continue
            target, anchor = urldefrag(url)
            path = SITE / urlparse(target).path.lstrip("/")
            if path.is_dir(): path = path / "index.html"
            if not path.is_file(): problems.append(f"{rel}: broken link {url}")
            elif anchor and path.suffix == ".html" and anchor not in page_ids(path):
                problems.append(f"{rel}: link {url} names no element of its page")
    assert not problems, "\n".join(sorted(set(problems)))
    with browser_page() as page:  # the search box finds an API name, on its API page
        page.goto(site + "index.html", wait_until="load")
        box = page.locator("input.md-search__input")
        box.click(); box.fill("FlatteningCollator")
        t0 = time.perf_counter()
        # the search worker indexes the 0.8 MB index before it answers; 15 s was exceeded once with both cores busy
        try:
            page.wait_for_function("""() => [...document.querySelectorAll('.md-search-result__item a')].some(
                a => a.href.includes('api/workbench.packing.html') && a.href.endsWith('#flatteningcollator'))""",
                                   timeout=60000)
        except PlaywrightTimeout:
            shown = page.evaluate("() => [...document.querySelectorAll('.md-search-result__item a')].map(a => a.href)")
            meta = page.evaluate("() => document.querySelector('.md-search-result__meta')?.textContent")
            raise AssertionError(f"the search box showed no FlatteningCollator result {time.perf_counter() - t0:.0f} "
                                 f"s after typing; it says {meta!r} and links {shown[:5]}") from None
    index = json.loads((SITE / "search" / "search_index.json").read_text())
    assert any(d["location"].startswith("api/workbench.packing.html#flatteningcollator") for d in index["docs"])
    # every module notebook opens so
    coded = [d["location"] for d in index["docs"] if "from __future__ import" in d["text"]]
    assert not coded, f"notebook code is in the search index (every page load fetches it): {coded[:3]}"


def test_every_notebook_has_a_kernelspec_that_nbdev_clean_keeps():
    "JupyterLab opens each notebook with its kernel (no kernel prompt, no autosave rewriting a tracked file)."
    assert NOTEBOOKS
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        assert nb["metadata"].get("kernelspec") == KERNELSPEC, (f"{path.relative_to(ROOT)}: kernelspec "
                                                                f"{nb['metadata'].get('kernelspec')}")
        clean_nb(nb)
        assert nb["metadata"]["kernelspec"] == KERNELSPEC, f"nbdev_clean changes the kernelspec of {path.name}"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # a markdown link's target, without its anchor


def broken_links(text: str, folder: Path) -> list[str]:
    "The relative link targets in markdown `text` that name no file or folder (resolved against `folder`)."
    targets = [t for t in LINK.findall(text) if not urlparse(t).scheme]
    return [t for t in targets if not (folder / t).exists()]


def test_every_relative_link_of_the_readme_docs_and_notebooks_resolves():
    "A reader who follows a link from the README, a docs page or a notebook's prose finds the file (chapters moved)."
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = {}
    for page in pages:
        broken[page] = broken_links(page.read_text(), page.parent)
    for path in NOTEBOOKS:
        prose = "\n".join("".join(c["source"])
                          for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
        broken[path] = broken_links(prose, path.parent)
    broken = {str(p.relative_to(ROOT)): b for p, b in broken.items() if b}
    assert not broken, broken
    # a moved notebook's old link is caught
    assert broken_links("[train](nbs/08_train.ipynb) [ok](README.md)", ROOT) == ["nbs/08_train.ipynb"]


def make_lab(*args) -> list[str]:
    "`make lab` against this interpreter's environment (its install stamp taken as up to date)."
    venv = Path(sys.prefix)
    return ["make", "-C", str(ROOT), "lab", f"VENV={venv}", "-o", str(venv / ".installed"), *args]


def test_make_lab_command_line():
    "127.0.0.1 and port 8888 by default, both overridable; --allow-root exactly when running as root."
    out = subprocess.run(make_lab("-n"), capture_output=True, text=True, timeout=30, check=True).stdout
    assert "--ServerApp.ip=127.0.0.1 --ServerApp.port=8888" in out, out
    assert ("--allow-root" in out) == (os.geteuid() == 0), out
    out = subprocess.run(make_lab("-n", "IP=0.0.0.0", "PORT=9000"), capture_output=True, text=True, timeout=30).stdout
    assert "--ServerApp.ip=0.0.0.0 --ServerApp.port=9000" in out, out


def test_make_lab_starts_and_prints_its_token_url(tmp_path):
    """The real `make lab` (as root here when the suite runs as
    root): it serves 127.0.0.1 and prints a URL that opens it."""
    port = free_port()
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}
    proc = subprocess.Popen(make_lab(f"PORT={port}"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    lines, url = [], None
    try:
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        deadline = time.monotonic() + 90
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            found = re.search(rf"http://127\.0\.0\.1:{port}/lab\?token=(\w+)", "".join(lines))
            url = found and found[0]
            time.sleep(0.3)
        assert url, f"no token URL printed:\n{''.join(lines)[-3000:]}"
        token = url.split("token=")[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=10) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as denied:  # the token is what guards it
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=10)
        assert denied.value.code == 403
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try: proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL); proc.wait(5)


def load_build():
    "docs/build.py as a module its process pool can pickle functions of (registered in sys.modules)."
    spec = importlib.util.spec_from_file_location("docs_build_progress", ROOT / "docs" / "build.py")
    module = importlib.util.module_from_spec(spec); sys.modules[spec.name] = module; spec.loader.exec_module(module)
    return module


def test_make_docs_reports_each_notebook_and_reuses_executions(tmp_path, monkeypatch, capsys):
    """One line per notebook as it finishes (executed, then cached on the next run); a per-cell limit only when asked
    for. The kernel gets no PYTEST_* variable, so it captures what subprocesses print, as under `make docs`."""
    build = load_build()
    monkeypatch.setattr(build, "ROOT", tmp_path); monkeypatch.setattr(build, "CACHE", tmp_path / ".docs-cache")
    (tmp_path / "nbs").mkdir()
    paths = []
    for name, code in [("quick", "import subprocess; print('quick', flush=True); subprocess.run(['echo', "
                                 "'from a subprocess'])"), ("slow", "import time; time.sleep(10)")]:
        nb = nbformat.v4.new_notebook(metadata={"kernelspec": KERNELSPEC}, cells=[nbformat.v4.new_code_cell(code)])
        nbformat.write(nb, tmp_path / "nbs" / f"{name}.ipynb"); paths.append(tmp_path / "nbs" / f"{name}.ipynb")
    with pytest.raises(RuntimeError, match=r"1 of 2 notebooks failed:\s+nbs/slow.ipynb "
                                           r"failed to execute:\s+A cell timed out"):
        build.execute_all(paths, set(), jobs=2, timeout=4)
    out = capsys.readouterr().out
    assert "2 notebooks: 0 cached, 2 to execute (2 at a time, 4 s per cell)" in out, out
    assert (re.search(r"\] nbs/quick.ipynb +executed in [\d.]+ s\n", out)
            and re.search(r"\] nbs/slow.ipynb +FAILED\n", out)), out
    results = build.execute_all(paths, set(), jobs=2)  # no limit: the slow one runs to its end
    out = capsys.readouterr().out
    assert "2 notebooks: 1 cached, 1 to execute (2 at a time, no per-cell time limit)" in out, out
    assert (re.search(r"\] nbs/quick.ipynb +cached\n", out)
            and re.search(r"\] nbs/slow.ipynb +executed in [\d.]+ s\n", out)), out
    assert "".join(o.get("text", "") for o in results[paths[0]][0].cells[0].outputs) == "quick\nfrom a subprocess\n"


def test_a_notebook_asked_for_twice_at_once_is_executed_once(tmp_path, monkeypatch):
    """The site test's build and a notebook item may ask for the same notebook together (`make test` runs them side by
    side): the second waits for the first's execution and reads it from the cache."""
    from concurrent.futures import ThreadPoolExecutor
    build = load_build()
    monkeypatch.setattr(build, "ROOT", tmp_path); monkeypatch.setattr(build, "CACHE", tmp_path / ".docs-cache")
    (tmp_path / "nbs").mkdir()
    runs = tmp_path / "runs.txt"  # one line per execution
    code = f"import time; open({str(runs)!r}, 'a').write('ran\\n'); time.sleep(2); print('done')"
    nb_path = tmp_path / "nbs" / "twice.ipynb"
    nbformat.write(nbformat.v4.new_notebook(metadata={"kernelspec": KERNELSPEC},
                                            cells=[nbformat.v4.new_code_cell(code)]), nb_path)
    # two threads: each takes the lock through its own open file, as two processes do
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: build.executed(nb_path, set()), range(2)))
    assert runs.read_text() == "ran\n", runs.read_text()
    assert sorted(seconds == 0.0 for _, seconds in both) == [False, True]  # one executed, one read the cache
    assert [nb.cells[0].outputs[0].text for nb, _ in both] == ["done\n", "done\n"]


def test_make_docs_timeout_is_optional():
    "`make docs` sets no cell time limit; `make docs TIMEOUT=900` passes one on."
    venv = Path(sys.prefix)
    make = ["make", "-C", str(ROOT), "docs", f"VENV={venv}", "-o", str(venv / ".installed"), "-n"]
    out = subprocess.run(make, capture_output=True, text=True, timeout=30, check=True).stdout
    assert "docs/build.py" in out and "--timeout" not in out, out
    out = subprocess.run([*make, "TIMEOUT=900"], capture_output=True, text=True, timeout=30, check=True).stdout
    assert "docs/build.py --timeout 900" in out, out


def test_pages_show_the_example_not_its_checks():
    """A page shows a cell's code and output without its top-level
    checks (they run in the suite); magics are left as written."""
    build = load_build()
    code = ("x = [1, 2]\ntest_eq(len(x),\n        2)  # a check over two "
            "lines\nassert x, 'empty'\ny = sum(x); assert y == 3\nprint(y)")
    assert build.shown_code(code) == "x = [1, 2]\ny = sum(x); assert y == 3\nprint(y)"  # a line shared with code stays
    assert build.shown_code("%time f()\nassert True") == "%time f()\nassert True"
    out = nbformat.v4.new_output("stream", text="3\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code, outputs=[out]),
                                         nbformat.v4.new_code_cell("test_eq(1, 1)"),  # nothing left to show: dropped
                                         # its output only
                                         nbformat.v4.new_code_cell("assert f() == 1", outputs=[out])])
    cells = build.page(nb).cells
    assert [c.source for c in cells] == ["x = [1, 2]\ny = sum(x); assert y == 3\nprint(y)", ""]
    assert "hide-input" in cells[1].metadata["tags"] and "hide-input" not in cells[0].metadata.get("tags", [])


LINE_LIMIT = 120  # the house style: a line a reader takes in at a glance


def nbdev_written(lines: list[str], i: int) -> bool:
    """Whether line `i` is one nbdev writes itself, not a notebook's cell: the module docstring (line 1, the notebook's
    one-line `> summary`) or the `__all__` list (wrapped at 120 before nbdev puts `__all__ = ` in front)."""
    if i == 0: return lines[0].startswith('"""') and any(l.startswith("# AUTOGENERATED!") for l in lines[1:3])
    return lines[i].startswith("__all__ = [") and lines[i - 1] == "# %% auto #0"


def long_lines(paths: list[Path], root: Path = ROOT) -> list[str]:
    "`file:line (length)` of every line of `paths` over `LINE_LIMIT` characters, but those nbdev writes itself."
    out = []
    for path in paths:
        lines = path.read_text().splitlines()
        out += [f"{path.relative_to(root)}:{i + 1} ({len(l)})" for i, l in enumerate(lines)
                if len(l) > LINE_LIMIT and not nbdev_written(lines, i)]
    return out


PLAIN_FILES = ("tests/*.py", "bench/*.py", "bench/*.sh", "docs/*.py", ".ci/*", "data_samples/*.py")  # not exported


def test_lines_fit_120_characters(tmp_path):
    """Every line of `workbench/` (the notebooks' exported cells; `_modidx.py` is nbdev's index) and of the plain Python
    and shell files beside it (tests, bench scripts, the docs build, CI, the sample makers) fits 120 characters."""
    library = [p for p in sorted((ROOT / "workbench").rglob("*.py")) if p.name != "_modidx.py"]
    plain = sorted(p for pattern in PLAIN_FILES for p in ROOT.glob(pattern) if p.is_file())
    assert len(library) > 40 and len(plain) > 60, (len(library), len(plain))
    assert not long_lines(library + plain), "\n".join(long_lines(library + plain))
    planted = tmp_path / "planted.py"
    planted.write_text(f'"""{"a summary " * 20}"""\n\n# AUTOGENERATED! DO NOT EDIT!\nx = 1\ny = "{"y" * 120}"\n')
    assert long_lines([planted], tmp_path) == ["planted.py:5 (126)"]  # nbdev's docstring line passes, the string fails
