"""Build the documentation site offline: `python docs/build.py` (what `make docs` runs) writes `site/`.

1. Every notebook under nbs/ runs in a real Jupyter kernel (nbclient; a fork of a warm process that imported torch and
   transformers once, docs/warm_kernels.py) with its own folder as cwd, skipping the cells
   nbdev_test skips (`#| eval: false`, the `tst_flags` of settings.ini that this machine cannot run, `nbdev_export()`).
   Two notebooks run at a time; an executed notebook is cached in .docs-cache/ under the hash of its text, the library,
   the data and the installed versions of the packages it imports, so a local rerun only executes what changed (CI is
   a clean clone and executes everything). `make test` fills the same cache (tests/test_notebooks.py calls
   `executed`), so `make docs` after it executes nothing. One line
   is printed per notebook as it finishes (cached or executed, seconds). No cell has a time limit unless `--timeout`
   (`make docs TIMEOUT=seconds`) sets one: a slow machine is not failed, and the pytest path has pytest-timeout.
   Kernels talk to this process over CurveZMQ-encrypted sockets where pyzmq and the kernelspec support it.
2. The executed notebooks become pages: `#| hide` cells are dropped, directive lines and top-level checks (`assert`,
   fastcore's `test_*`: they run in the suite) are stripped from the code shown, long lines wrap,
   plotly figures (also those inside widgets, as they were when the notebook ended) become interactive divs that draw
   with the site's one copy of plotly.js (a widget's controls need a kernel and are not shown), and links to notebooks
   point at their pages.
3. An API reference is written from the docments of every name in each module's `__all__` (fastcore.docments).
4. mkdocs-material renders it all with the README as the home page; the nav lists whatever notebooks exist.
Nothing is loaded from a network at build or view time: plotly.js and MathJax are copied from installed packages.
"""
import argparse
import ast
import fcntl
import hashlib
import html
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ProcessPoolExecutor, as_completed
from configparser import ConfigParser
from pathlib import Path

import nbformat
import plotly
import plotly.io as pio
import yaml

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("warm_kernels", Path(__file__).with_name("warm_kernels.py"))
warm_kernels = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(warm_kernels)
NBS = ROOT / "nbs"
BUILD = ROOT / ".docs-build"  # generated mkdocs sources and config (ignored)
CACHE = ROOT / ".docs-cache"  # executed notebooks keyed by content hash (ignored)
SITE = ROOT / "site"
PLOTLY_MIME, WIDGET_MIME = "application/vnd.plotly.v1+json", "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
DIRECTIVE_LINES = re.compile(r"\A(?:[ \t]*#[ \t]*\|.*(?:\n|\Z))+")  # nbdev's `#| ...` lines at a cell's top
HIDE_CELLS = {"hide"}  # directives whose whole cell stays off the page (it still runs)


def notebooks() -> list[Path]:
    "The notebooks `tests/test_notebooks.py` runs: every .ipynb under nbs/ not starting with `_`."
    return sorted(p for p in NBS.rglob("*.ipynb") if not p.name.startswith("_") and ".ipynb_checkpoints" not in p.parts)


def skip_flags() -> set[str]:
    "The `tst_flags` of settings.ini whose cells nbdev_test skips here (`cuda` without a GPU, `slow` always)."
    import torch
    cfg = ConfigParser(); cfg.read(ROOT / "settings.ini")
    return {f for f in cfg["DEFAULT"]["tst_flags"].split()
            if f == "slow" or (f == "cuda" and not torch.cuda.is_available())}


def directives(cell) -> dict:
    "nbdev's directives of a code cell (`#| name args` lines at its top), without changing the cell."
    from nbdev.process import extract_directives
    return extract_directives(cell, remove=False) if cell.cell_type == "code" else {}


def runs(cell, flags: set[str]) -> bool:
    "Whether nbdev_test would execute `cell` (its `_no_eval` rule): not `eval: false`, no skipped flag, no export call."
    d = directives(cell)
    return cell.cell_type == "code" and "nbdev_export(" not in cell.source and \
        d.get("eval:", [""])[0].lower() != "false" and not (flags & d.keys())


NOTEBOOK_EXTRAS = ("peft", "deepspeed")  # optional packages (pyproject's extras) that notebooks import
# the project's own dependencies (fixed here: a test may point ROOT at a scratch tree)
PYPROJECT = ROOT / "pyproject.toml"


def keyed_packages() -> list[str]:
    "The packages whose installed versions key the cache: pyproject's dependencies and `NOTEBOOK_EXTRAS`."
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return sorted({re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in deps} | set(NOTEBOOK_EXTRAS))


def installed_version(name: str) -> str:
    "`name`'s installed version ('not installed' when it is not)."
    try: return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError: return "not installed"


def cache_key(nb_path: Path, flags: set[str]) -> str:
    """Hash of everything an execution reads: the notebook, the library, the shipped data, the installed versions of the
    packages it imports (an upgrade in place executes it again), the skipped flags, the executor."""
    executor = inspect.getsource(execute) + inspect.getsource(kernel_config)  # how the kernel is run
    versions = " ".join(f"{p}=={installed_version(p)}" for p in keyed_packages())
    h = hashlib.sha256(nb_path.read_bytes() + " ".join(sorted(flags)).encode() + executor.encode() + versions.encode())
    for p in sorted([*(ROOT / "workbench").rglob("*.py"), *(ROOT / "data_samples").rglob("*")]):
        if p.is_file(): h.update(str(p.relative_to(ROOT)).encode() + p.read_bytes())
    return h.hexdigest()[:20]


def kernel_config():
    """nbclient's kernel manager settings: CurveZMQ transport encryption when pyzmq and the kernelspec support it (the
    kernel then does not warn that it runs over TCP in plain text, and no other local user can read its traffic)."""
    import zmq
    from traitlets.config import Config
    c = Config()
    if zmq.has("curve"): c.KernelManager.transport_encryption = "auto"  # used when the kernelspec declares curve
    return c


def execute(nb_path: Path, flags: set[str], timeout: float | None = None) -> tuple[nbformat.NotebookNode, float]:
    """Run `nb_path` in a fresh python3 kernel (a fork of a warm process: docs/warm_kernels.py) from its own folder;
    cells nbdev_test skips are not run. Raises on an error. `timeout`: seconds a cell may run (None: no limit; the
    pytest path is bounded by pytest-timeout per notebook)."""
    from nbclient import NotebookClient
    nb = nbformat.read(nb_path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and not runs(cell, flags):
            cell.metadata.setdefault("tags", []).append("skip-execution")  # nbclient's own skip tag
    # Not pytest's variables: with PYTEST_CURRENT_TEST set, ipykernel leaves fd 1 and 2 alone, so what the notebook's
    # subprocesses and C code print would be missing from a notebook tests/test_notebooks.py executed for the pages.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PLOTLY_RENDERER": "plotly_mimetype",  # figures as JSON only: the page draws them with the site's plotly.js
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    start = time.monotonic()
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=True, config=kernel_config(),
                            kernel_manager_class=warm_kernels.kernel_manager_class(env),
                            resources={"metadata": {"path": str(nb_path.parent)}})
    client.execute(env=env)  # the kernel's environment (not a NotebookClient option: traitlets warns and prints it all)
    for cell in nb.cells:
        if "skip-execution" in cell.metadata.get("tags", []): cell.metadata.tags.remove("skip-execution")
    return nb, time.monotonic() - start


def cache_path(nb_path: Path, flags: set[str]) -> Path:
    "Where the executed `nb_path` is cached: its name and the hash of its inputs (`cache_key`)."
    return CACHE / f"{nb_path.stem}-{cache_key(nb_path, flags)}.ipynb"


def executed(nb_path: Path, flags: set[str], timeout: float | None = None) -> tuple[nbformat.NotebookNode, float]:
    """The executed notebook, from .docs-cache/ when its inputs are unchanged; seconds spent (0 from the cache).
    One process at a time per notebook: under `make test` the site test's build and the notebook items run side by
    side, and whichever asks second waits for the first's execution and reads it from the cache."""
    cached = cache_path(nb_path, flags)
    CACHE.mkdir(exist_ok=True)
    with open(CACHE / f"{nb_path.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if cached.exists(): return nbformat.read(cached, as_version=4), 0.0
        nb, seconds = execute(nb_path, flags, timeout)
        for old in CACHE.glob(f"{nb_path.stem}-*.ipynb"): old.unlink()
        partial = cached.with_suffix(".partial")
        nbformat.write(nb, partial)
        partial.replace(cached)  # a reader never sees half a notebook
        return nb, seconds


# ---------------------------------------------------------------- executed notebook -> page

def figure_html(fig: dict) -> dict:
    "A plotly figure as an interactive div drawn by the site-wide plotly.js (no script of its own, no cloud button)."
    div = pio.to_html(fig, include_plotlyjs=False, full_html=False, validate=False,
                      config={"displaylogo": False, "responsive": True})
    return {"text/html": div}


def widget_html(model_id: str, state: dict) -> str:
    "A widget drawn without a kernel, from its last state: its plotly figures, its HTML, the same for a box's children."
    model = state.get(model_id, {})
    if model.get("model_name") == "HTMLModel": return model["state"].get("value", "")
    if "figure" in model.get("state", {}): return figure_html(model["state"]["figure"])["text/html"]  # a PlotView
    if model.get("model_name") == "OutputModel":  # a dashboard's figure: the outputs it last held
        outputs = model["state"].get("outputs", [])
        return "\n".join(figure_html(o["data"][PLOTLY_MIME])["text/html"]
                         for o in outputs if PLOTLY_MIME in o.get("data", {}))
    children = [c.removeprefix("IPY_MODEL_") for c in model.get("state", {}).get("children", [])]
    return "\n".join(h for h in (widget_html(c, state) for c in children) if h)


def page_output(out, state: dict):
    """One output as the page shows it: plotly JSON and widgets
    become figure divs; a widget without figures shows its text."""
    data = out.get("data", {})
    if PLOTLY_MIME in data: out["data"] = figure_html(data[PLOTLY_MIME])
    elif WIDGET_MIME in data:
        drawn = widget_html(data[WIDGET_MIME]["model_id"], state)
        out["data"] = {"text/html": drawn} if drawn else {"text/plain": data.get("text/plain", "")}
    return out


def link_pages(md: str) -> str:
    "Relative links to notebooks and markdown files point at their pages (`x.ipynb` -> `x.html`)."
    return re.sub(r"\]\((?!https?:)([^)#\s]+)\.(?:ipynb|md)(#[^)]*)?\)", lambda m: f"]({m[1]}.html{m[2] or ''})", md)


def _is_check(node: ast.stmt) -> bool:
    "An `assert` or a call of fastcore's `test_*` at a cell's top level."
    if isinstance(node, ast.Assert): return True
    call = node.value if isinstance(node, ast.Expr) else None
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id.startswith("test_")


def shown_code(source: str) -> str:
    "The code a page shows: the cell without its top-level checks, which stay in the notebook and run in the suite."
    try: tree = ast.parse(source)
    except SyntaxError: return source  # IPython syntax (a magic, a shell line): shown as written
    checks, code = set(), set()
    for node in tree.body:
        lines = range(node.lineno - 1, node.end_lineno)
        if _is_check(node): checks.update(lines)
        else: code.update(lines)
    drop = checks - code  # a line that also holds other code (`x = f(); assert x`) stays
    kept = [line for i, line in enumerate(source.splitlines()) if i not in drop]
    return "\n".join(kept).strip("\n")


def page(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    "The executed notebook as a page: hidden cells dropped, directives stripped, figures drawable, links to pages."
    state = nb.metadata.pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})  # no CDN widget manager on the page
    cells = []
    for cell in nb.cells:
        if cell.cell_type == "markdown": cell.source = link_pages(cell.source)
        if cell.cell_type != "code": cells.append(cell); continue
        d = directives(cell)
        if HIDE_CELLS & d.keys(): continue
        cell.source = shown_code(DIRECTIVE_LINES.sub("", cell.source))
        if d.get("output:", [""])[0].lower() == "false": cell.outputs = []
        cell.outputs = [page_output(o, state) for o in cell.outputs]
        if d.get("echo:", [""])[0].lower() == "false" or not cell.source.strip():
            cell.metadata.setdefault("tags", []).append("hide-input")
        if not cell.source.strip() and not cell.outputs: continue  # a `default_exp` cell is only its directive
        cells.append(cell)
    heading = next((c for c in cells if c.cell_type == "markdown" and c.source.startswith("# ")), None)
    nb.cells = [heading] * bool(heading) + [c for c in cells if c is not heading]  # the title first, as nbdev's pages
    return nb


# ---------------------------------------------------------------- API reference from docments

def cell_text(s) -> str:
    "Text for one cell of a markdown table."
    return str(s).replace("|", "\\|").replace("\n", " ")


def params_table(f) -> str:
    "nbdev's show_doc table: each parameter with its type, default and its docment (the comment beside it)."
    from fastcore.docments import docments
    try: docs = docments(f, full=True)
    except (TypeError, ValueError, OSError): return ""
    rows = [(k, v) for k, v in docs.items() if k not in ("self", "cls") and (k != "return" or v["docment"])]
    if not rows: return ""
    # a `|` in backticks breaks the table
    def code(x): return f"<code>{html.escape(str(x)).replace('|', '&#124;')}</code>"
    def anno(x): return "" if x is inspect.Parameter.empty else code(x.__name__ if isinstance(x, type) else x)
    def default(x): return "" if x is inspect.Parameter.empty else code(repr(x))
    lines = ["| | Type | Default | Details |", "| --- | --- | --- | --- |"]
    lines += [f"| **{k}** | {anno(v['anno'])} | {default(v['default']) if k != 'return' else ''} "
              f"| {cell_text(v['docment'] or '')} |"
              for k, v in rows]
    return "\n".join(lines) + "\n"


def signature(name: str, obj) -> str:
    try: return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError): return name


def doc_entry(qualname: str, obj, level: int = 3) -> str:
    "One name's entry: heading (its anchor), signature, docstring, parameter table."
    kind = "class" if inspect.isclass(obj) else ""
    out = [f"{'#' * level} {qualname.split('.')[-1]}"
           + (" {#" + qualname.replace(".", "-") + "}" if "." in qualname else ""),
           "", f"```python\n{kind + ' ' if kind else ''}{signature(qualname.split('.')[-1], obj)}\n```", ""]
    if inspect.getdoc(obj): out += [inspect.getdoc(obj), ""]
    table = params_table(obj)  # a class: its dataclass fields' comments, else those of its own __init__
    if not table and inspect.isclass(obj) and "__init__" in vars(obj): table = params_table(obj.__init__)
    if table: out += [table]
    return "\n".join(out)


def module_page(modname: str) -> str:
    "The API page of one module: every name of its `__all__` in source order, a class with its public methods."
    mod = importlib.import_module(modname)
    nb = next((p for p in notebooks() if f"default_exp {modname.split('.', 1)[1]}" in p.read_text()), None)
    out = [f"# {modname}", "", (inspect.getdoc(mod) or "").strip(), ""]
    if nb: out += [f"Source notebook: [{nb.relative_to(ROOT)}](../{nb.relative_to(ROOT)})", ""]
    for name in getattr(mod, "__all__", []):
        obj = getattr(mod, name)
        if inspect.isclass(obj) or callable(obj):
            out.append(doc_entry(name, obj))
            if inspect.isclass(obj):
                for mname, m in vars(obj).items():
                    if mname.startswith("_") or not (inspect.isfunction(m)
                                                     or isinstance(m, (property, classmethod, staticmethod))):
                        continue
                    f = m.fget if isinstance(m, property) else getattr(m, "__func__", m)
                    if inspect.getdoc(f): out.append(doc_entry(f"{name}.{mname}", f, level=4))
        else:
            out += [f"### {name}", "", f"```python\n{name} = {repr(obj)[:300]}\n```", ""]
    return "\n".join(out)


def api_modules() -> list[str]:
    "Every exported module, read from nbdev's index (workbench/_modidx.py)."
    from workbench._modidx import d
    return sorted(m for m in d["syms"] if m.startswith("workbench."))  # sub-packages too (workbench.sp.ring)


# ---------------------------------------------------------------- assets, config, build

def title(path: Path) -> str:
    "A page's nav title: the notebook's first `# heading`, else its file name."
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        m = cell.cell_type == "markdown" and re.search(r"^# (.+)$", cell.source, re.M)
        if m: return m[1].strip()
    return path.stem


def write_sources(pages: dict[Path, nbformat.NotebookNode]):
    "The mkdocs docs folder: README as index, the notebook pages mirrored at their repo paths, API pages, assets."
    src = BUILD / "src"
    shutil.rmtree(BUILD, ignore_errors=True)
    (src / "api").mkdir(parents=True)
    shutil.copy(ROOT / "README.md", src / "index.md")
    for md in [ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "docs").glob("*.png")]:
        (src / md.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(md, src / md.relative_to(ROOT))
    for path, nb in pages.items():
        (src / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, src / path.relative_to(ROOT))
    mods = api_modules()
    for m in mods: (src / "api" / f"{m}.md").write_text(module_page(m))
    assets = src / "assets"
    assets.mkdir()
    shutil.copy(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", assets / "plotly.min.js")
    import jupyter_server_mathjax
    shutil.copytree(Path(jupyter_server_mathjax.__file__).parent / "static", assets / "mathjax")
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    rel = lambda p: str(p.relative_to(ROOT))
    cfg.update(docs_dir=str(src), site_dir=str(SITE), nav=[
        {"Home": "index.md"},
        *({title(p): rel(p)} for p in pages if p.parent == NBS),  # the architecture page
        {"Tutorials": [{title(p): rel(p)} for p in sorted((p for p in pages if p.parent.name == "tutorials"),
                                                          key=reading_order)]},
        *chapters(p for p in pages if p.parent not in (NBS, NBS / "tutorials")),
        {"API reference": [{m: f"api/{m}.md"} for m in mods]},
        {"Notes": [{"Benchmarks": "BENCHMARKS.md"},
                   *({title_md(p): rel(p)} for p in sorted((ROOT / "docs").glob("*.md"), key=notes_order))]},
    ])
    cfg["theme"]["custom_dir"] = str(ROOT / cfg["theme"]["custom_dir"])  # paths of mkdocs.yml are relative to the repo
    cfg["hooks"] = [str(ROOT / h) for h in cfg.get("hooks", [])]
    (BUILD / "mkdocs.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def chapter_title(folder: Path) -> str:
    "A chapter's nav title from its folder: `02_sequence_parallel` -> `2. Sequence parallel`."
    number, name = folder.name.split("_", 1)
    return f"{int(number)}. {name.replace('_', ' ').capitalize()}"


def chapters(module_pages) -> list[dict]:
    "The module notebooks as nav sections, one per chapter folder of nbs/, each in its notebooks' reading order."
    by_folder = {}
    for p in sorted(module_pages): by_folder.setdefault(p.parent, []).append(p)
    return [{chapter_title(folder): [{title(p): str(p.relative_to(ROOT))} for p in nbs]}
            for folder, nbs in by_folder.items()]


TUTORIALS = ["pack_a_dataset", "explore_masks", "doctor_your_model", "launch_sp", "your_own_trainer"]  # reading order


def reading_order(p: Path) -> tuple:
    "Tutorials in reading order; one not listed in TUTORIALS comes after them, by name."
    return (TUTORIALS.index(p.stem), "") if p.stem in TUTORIALS else (len(TUTORIALS), p.stem)


# docs/*.md in the order of the README's chapter lines, then the notes that are not chapters
NOTES = ["packing", "trainer", "training", "memory", "cost", "ring", "engines", "cluster", "inside", "site_and_lab",
         "floors", "family_matrix"]


def notes_order(p: Path) -> tuple:
    "docs/*.md in NOTES order; one not listed there comes after them, by name."
    return (NOTES.index(p.stem), "") if p.stem in NOTES else (len(NOTES), p.stem)


def title_md(p: Path) -> str:
    m = re.search(r"^# (.+)$", p.read_text(), re.M)
    return m[1].strip() if m else p.stem


def _run_one(path: Path, flags: set[str], timeout: float | None):
    "One notebook in a worker: (executed notebook, seconds, whether it came from the cache)."
    try:
        nb, seconds = executed(path, flags, timeout)
        return nb, seconds, seconds == 0.0  # 0.0: read from the cache (perhaps after another process executed it)
    except Exception as e:  # name the notebook; the cell's traceback is in e
        raise RuntimeError(f"{path.relative_to(ROOT)} failed to execute:\n{e}") from None


def execute_all(paths: list[Path], flags: set[str], jobs: int = 2, timeout: float | None = None) -> dict:
    """Execute (or reuse) `paths`, `jobs` at a time, printing one
    line per notebook as it finishes; {path: (nb, seconds)}."""
    fresh = sum(not cache_path(p, flags).exists() for p in paths)
    limit = f"{timeout:g} s per cell" if timeout else "no per-cell time limit"
    print(f"{len(paths)} notebook{'s' * (len(paths) != 1)}: {len(paths) - fresh} "
          f"cached, {fresh} to execute ({jobs} at a time, {limit})", flush=True)
    results, failed, width = {}, [], max((len(str(p.relative_to(ROOT))) for p in paths), default=0)
    # each kernel its share of the cores (an explicit OMP_NUM_THREADS is kept): `jobs` kernels with every core's threads
    # each oversubscribe the machine, as two pytest workers did (tests/conftest.py)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // jobs)))
    with ProcessPoolExecutor(jobs) as pool:  # the slowest notebooks first, so two workers finish together
        futures = {pool.submit(_run_one, p, flags, timeout): p for p in sorted(paths, key=lambda p: -p.stat().st_size)}
        for i, done in enumerate(as_completed(futures), 1):
            p, rel = futures[done], str(futures[done].relative_to(ROOT))
            try: nb, seconds, cached = done.result()
            except Exception as e:
                failed.append(str(e)); print(f"[{i}/{len(paths)}] {rel:<{width}}  FAILED", flush=True); continue
            results[p] = nb, seconds
            print(f"[{i}/{len(paths)}] {rel:<{width}}  " + ("cached" if cached else f"executed in {seconds:.1f} s"),
                  flush=True)
    if failed: raise RuntimeError(f"{len(failed)} of {len(paths)} notebooks failed:\n\n" + "\n\n".join(failed))
    return results


def build(jobs: int = 2, only: str = "*", timeout: float | None = None) -> dict[str, float]:
    """Execute (or reuse) the notebooks (`only`: a glob on their names), write the sources, run mkdocs; seconds spent.
    `timeout`: seconds a cell may run (None: no limit)."""
    flags, paths, times = skip_flags(), [p for p in notebooks() if p.match(only)], {}
    start = time.monotonic()
    results = execute_all(paths, flags, jobs, timeout)
    for p in paths: times[str(p.relative_to(ROOT))] = round(results[p][1], 1)
    times["execute"] = round(time.monotonic() - start, 1)
    t = time.monotonic()
    write_sources({p: page(results[p][0]) for p in paths})
    # No fixed time limit (the pages took ~3 min on a loaded 2-core box); in CI tests/test_docs.py bounds the whole
    # build.
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f", str(BUILD / "mkdocs.yml")],
                   check=True, cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    times["render"] = round(time.monotonic() - t, 1)
    return times


def screenshot(page_path: str = "nbs/tutorials/explore_masks.html", out: Path = ROOT / "docs" / "mask_figure.png"):
    "The README's picture: the first mask (heatmap) figure of a built page, as headless Chromium draws it."
    import functools, threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
    from playwright.sync_api import sync_playwright
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(SimpleHTTPRequestHandler, directory=str(SITE)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000}, device_scale_factor=1)
            page.goto(f"http://127.0.0.1:{httpd.server_port}/{page_path}", wait_until="load")
            figure = page.locator(".plotly-graph-div:has(g.heatmaplayer)").first  # the first mask figure
            figure.wait_for(); page.wait_for_timeout(500)
            figure.screenshot(path=str(out))
            browser.close()
    finally:
        httpd.shutdown(); httpd.server_close()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="notebooks executed at once")
    ap.add_argument("--only", default="*", help="build with only the notebooks matching this glob (a quick look)")
    ap.add_argument("--screenshot", action="store_true", help="then rewrite docs/mask_figure.png from the built site")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds one cell may run before its notebook "
                         "fails (default: no limit; `make docs TIMEOUT=...`)")
    args = ap.parse_args()
    times = build(args.jobs, args.only, args.timeout)
    if args.screenshot: print(f"screenshot: {screenshot()}")
    print(f"notebooks: {times['execute']} s, pages: {times['render']} s")
    print(f"site: {SITE / 'index.html'}")
