"""Real-browser tests: the explorer notebook runs in JupyterLab and in Voila, driven by headless Debian chromium through
Playwright; a control change must redraw the mask with new content. Screenshots go to test-artifacts/.

Needs Debian's `chromium` (`.ci/run` installs it) and the `playwright` and `voila` Python packages; never
`playwright install` (its download fails here): the browser is launched from /usr/bin/chromium.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "nbs" / "tutorials" / "explore_masks.ipynb"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(cmd: list[str], url: str, env: dict, log: Path, timeout: float = 40):
    "Run a server in its own process group until `url` answers; stop the whole group (server and kernels) after."
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    urllib.request.urlopen(url, timeout=2)
                    break
                except OSError:
                    if proc.poll() is not None: raise RuntimeError(f"{cmd[1]} exited early:\n{log.read_text()[-3000:]}")
                    if time.monotonic() > deadline: raise TimeoutError(f"{url} did not answer:\n{log.read_text()[-3000:]}")
                    time.sleep(0.3)
            yield proc
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try: proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL); proc.wait(5)


@pytest.fixture
def workdir(tmp_path):
    "A copy of the explorer notebook (JupyterLab may autosave what it opens) and a test-only Jupyter config."
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: apt-get install -y chromium (.ci/run does it)"
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(NOTEBOOK, tmp_path / NOTEBOOK.name)
    config = tmp_path / "jupyter-config"
    (config / "labconfig").mkdir(parents=True)
    (config / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))  # no news toast
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return tmp_path, env


@contextmanager
def browser_page():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1100})
            yield page
        finally:
            browser.close()


def mask_state(page) -> dict:
    "What the explorer shows now: the mask title, the heatmap image, and the cross-example pair count."
    return page.evaluate("""() => {
        const img = document.querySelector('.wb-mask .hm image');
        const title = document.querySelector('.wb-mask .gtitle');
        const cell = document.querySelector('.wb-stats [data-stat="cross-example pairs"]');
        return {image: img && (img.getAttribute('href') || img.getAttribute('xlink:href')),
                title: title && title.textContent, cross: cell && cell.textContent};
    }""")


def check_redraw(page, name: str):
    "Screenshot, tick the cache trap, wait for the redraw, check the new content, screenshot again."
    explorer = page.locator(".wb-explorer")
    explorer.scroll_into_view_if_needed()
    page.wait_for_function("() => document.querySelector('.wb-mask .hm image') !== null", timeout=20000)
    before = mask_state(page)
    assert before["cross"] == "0" and before["title"].startswith("0 cross-example pairs"), before
    explorer.screenshot(path=ARTIFACTS / f"{name}_correct.png")
    page.locator(".wb-use_cache input[type=checkbox]").check()
    page.wait_for_function("""(old) => {
        const img = document.querySelector('.wb-mask .hm image');
        const cell = document.querySelector('.wb-stats [data-stat="cross-example pairs"]');
        return img && cell && cell.textContent !== '0' && (img.getAttribute('href') || img.getAttribute('xlink:href')) !== old;
    }""", arg=before["image"], timeout=15000)
    page.wait_for_timeout(300)  # let plotly finish the title
    after = mask_state(page)
    cross = int(after["cross"].replace(",", ""))
    assert cross > 0 and after["title"].startswith(f"{after['cross']} cross-example pairs"), after
    assert "cache active" in after["title"] and after["image"] != before["image"]
    explorer.screenshot(path=ARTIFACTS / f"{name}_trap_cache.png")


def test_explorer_in_jupyterlab(workdir):
    tmp, env = workdir
    port = free_port()
    cmd = [str(BIN / "jupyter"), "lab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1", "--allow-root",
           "--IdentityProvider.token=", "--ServerApp.password=", "--LabApp.expose_app_in_browser=True",
           f"--ServerApp.root_dir={tmp}", f"--LabApp.user_settings_dir={tmp / 'settings'}",
           f"--LabApp.workspaces_dir={tmp / 'workspaces'}"]
    with server(cmd, f"http://127.0.0.1:{port}/api/status", env, tmp / "lab.log"), browser_page() as page:
        page.goto(f"http://127.0.0.1:{port}/lab/tree/{NOTEBOOK.name}")
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                               " && window.jupyterapp.shell.currentWidget.sessionContext", timeout=30000)
        page.evaluate("""async () => {
            const app = window.jupyterapp, panel = app.shell.currentWidget;
            await panel.context.ready;
            await panel.sessionContext.ready;  // run-all before the kernel is up silently does nothing
            await app.commands.execute('notebook:run-all-cells');
        }""")
        page.wait_for_selector(".wb-explorer", state="attached", timeout=45000)
        check_redraw(page, "jupyterlab")


def test_explorer_in_voila(workdir):
    tmp, env = workdir
    port = free_port()
    cmd = [str(BIN / "voila"), str(tmp / NOTEBOOK.name), "--no-browser", f"--port={port}", "--Voila.ip=127.0.0.1"]
    with server(cmd, f"http://127.0.0.1:{port}/", env, tmp / "voila.log", timeout=60), browser_page() as page:
        page.goto(f"http://127.0.0.1:{port}/")
        page.wait_for_selector(".wb-explorer", state="attached", timeout=45000)
        check_redraw(page, "voila")


def test_png_and_html_export(tmp_path):
    "Every mask figure exports as PNG through kaleido and Debian's chromium, and as HTML."
    from workbench.viz import mask_figures, save_figures
    figs = mask_figures(n_examples=4)
    paths = save_figures(figs, ARTIFACTS / "figures")
    pngs = [p for p in paths if p.suffix == ".png"]
    assert len(pngs) == len(figs) and len(paths) == 2 * len(figs)
    for p in pngs:
        head = p.read_bytes()[:8]
        assert head == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000, p
