"""Shared pieces of the real-browser tests: JupyterLab (or Voila) on 127.0.0.1 in its own process group, a test-only
Jupyter config, and headless Debian chromium driven by Playwright. Screenshots go to test-artifacts/.

Needs Debian's `chromium` (`.ci/run` installs it) and the `playwright` and `voila` Python packages; never
`playwright install` (its download fails here): the browser is launched from /usr/bin/chromium.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jupyter_env(tmp: Path, lab_defaults: bool = False) -> dict:
    """Environment of a test server: a test-only Jupyter config (no news toast), offline hub, one thread, this checkout;
    with `lab_defaults`, JupyterLab's own notebook settings (cells scrolled away are windowed out, as a user gets
    them)."""
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: apt-get install -y chromium (.ci/run does it)"
    ARTIFACTS.mkdir(exist_ok=True)
    config = tmp / "jupyter-config"
    (config / "labconfig").mkdir(parents=True, exist_ok=True)
    (config / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))  # no news toast
    settings = tmp / "lab-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True, exist_ok=True)
    if not lab_defaults:  # every cell stays attached: a cell scrolled away keeps its rendered output
        (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    return {**os.environ, "JUPYTER_CONFIG_DIR": str(config), "JUPYTERLAB_SETTINGS_DIR": str(tmp / "lab-settings"),
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


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
                    if time.monotonic() > deadline: raise TimeoutError(
                        f"{url} did not answer:\n{log.read_text()[-3000:]}")
                    time.sleep(0.3)
            yield proc
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try: proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL); proc.wait(5)


@contextmanager
def jupyterlab(tmp: Path, env: dict):
    "JupyterLab serving `tmp` on a free port of 127.0.0.1, no token; yields its base URL."
    port = free_port()
    cmd = [str(BIN / "jupyter"), "lab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1", "--allow-root",
           "--IdentityProvider.token=", "--ServerApp.password=", "--LabApp.expose_app_in_browser=True",
           f"--ServerApp.root_dir={tmp}", f"--LabApp.user_settings_dir={tmp / 'settings'}",
           f"--LabApp.workspaces_dir={tmp / 'workspaces'}"]
    with server(cmd, f"http://127.0.0.1:{port}/api/status", env, tmp / "lab.log"):
        yield f"http://127.0.0.1:{port}"


@contextmanager
def browser_page(*args: str):
    "A page of headless Debian chromium; `args` are extra Chromium flags."
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, *args], headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1100})
            yield page
        finally:
            browser.close()


def open_notebook(page, base_url: str, name: str):
    "Open notebook `name` in JupyterLab and wait until its kernel is ready (run-all before that silently does nothing)."
    page.goto(f"{base_url}/lab/tree/{name}")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.sessionContext", timeout=30000)
    page.evaluate("""async () => {
        const panel = window.jupyterapp.shell.currentWidget;
        await panel.context.ready;
        await panel.sessionContext.ready;
    }""")


def run_all_cells(page, wait: bool = True):
    """Run every cell of the open notebook. With `wait`, return when the run ends; otherwise start it and return at
    once: `window.__runAll` then holds true (all cells ran), false (a cell failed) or null (still running)."""
    page.evaluate("""() => {
        window.__runAll = null;
        window.__runAllPromise = window.jupyterapp.commands.execute('notebook:run-all-cells')
            .then(ok => { window.__runAll = ok; return ok; });
    }""")
    if wait: return page.evaluate("() => window.__runAllPromise")
