"""Real-browser tests: the explorer notebook runs in JupyterLab and in Voila, driven by headless Debian chromium through
Playwright; a control change must redraw the mask with new content. Screenshots go to test-artifacts/.

The servers, the Jupyter config and the browser come from browser_utils (shared with test_browser_dashboard.py).
"""
import shutil
import time

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from browser_utils import ARTIFACTS, BIN, ROOT, browser_page, free_port, jupyter_env, jupyterlab, open_notebook, \
    run_all_cells, server

NOTEBOOK = ROOT / "nbs" / "tutorials" / "explore_masks.ipynb"


@pytest.fixture
def workdir(tmp_path):
    "A copy of the explorer notebook (JupyterLab may autosave what it opens) and a test-only Jupyter config."
    env = jupyter_env(tmp_path)
    shutil.copy(NOTEBOOK, tmp_path / NOTEBOOK.name)
    return tmp_path, env


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
    t0 = time.perf_counter()
    try:  # 0.1-0.2 s here, alone or under load; CI timed out at 15 s (the first cross pair loads the model for the leak)
        page.wait_for_function("""(old) => {
            const img = document.querySelector('.wb-mask .hm image');
            const cell = document.querySelector('.wb-stats [data-stat="cross-example pairs"]');
            return img && cell && cell.textContent !== '0' && (img.getAttribute('href') || img.getAttribute('xlink:href')) !== old;
        }""", arg=before["image"], timeout=90000)
    except PlaywrightTimeout:
        raise AssertionError(f"{name}: no redraw {time.perf_counter() - t0:.0f} s after ticking use_cache; the explorer shows "
                             f"{mask_state(page)}") from None
    page.wait_for_timeout(300)  # let plotly finish the title
    after = mask_state(page)
    cross = int(after["cross"].replace(",", ""))
    assert cross > 0 and after["title"].startswith(f"{after['cross']} cross-example pairs"), after
    assert "cache active" in after["title"] and after["image"] != before["image"]
    explorer.screenshot(path=ARTIFACTS / f"{name}_trap_cache.png")


def test_explorer_in_jupyterlab(workdir):
    tmp, env = workdir
    with jupyterlab(tmp, env) as url, browser_page() as page:
        open_notebook(page, url, NOTEBOOK.name)
        assert run_all_cells(page) is True, "a cell of the explorer notebook failed in JupyterLab"
        page.wait_for_selector(".wb-explorer", state="attached", timeout=45000)
        check_redraw(page, "jupyterlab")


def test_explorer_in_voila(workdir):
    tmp, env = workdir
    port = free_port()
    cmd = [str(BIN / "voila"), str(tmp / NOTEBOOK.name), "--no-browser", f"--port={port}", "--Voila.ip=127.0.0.1"]
    with server(cmd, f"http://127.0.0.1:{port}/", env, tmp / "voila.log", timeout=60), browser_page() as page:
        page.goto(f"http://127.0.0.1:{port}/", timeout=90000)  # Voila executes the notebook before "load": slow on a loaded box
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


def test_a_png_the_kaleido_batch_dropped_is_rendered_alone(tmp_path, monkeypatch):
    "plotly drops the errors kaleido's batch returns: a PNG missing after it is rendered alone, or its figure is named."
    import plotly.graph_objects as go
    from workbench import viz
    figs = {"bars": go.Figure(go.Bar(y=[1, 3, 2])), "line": go.Figure(go.Scatter(y=[2, 1]))}
    (tmp_path / "bars.png").write_bytes(b"an old run's file")  # a reused folder
    monkeypatch.setattr(viz.pio, "write_images", lambda *a, **k: None)  # a batch whose every render failed: no file, no error
    pngs = viz.save_figures(figs, tmp_path, formats=("png",))
    assert [p.name for p in pngs] == ["bars.png", "line.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)  # rendered, not the old file
    render = go.Figure.write_image
    renders = []
    def fails_first(self, *a, **k):  # kaleido called before its page script loaded, as on a busy machine
        renders.append(1)
        if len(renders) == 1: raise RuntimeError("ReferenceError: kaleido_scopes is not defined")
        return render(self, *a, **k)
    monkeypatch.setattr(go.Figure, "write_image", fails_first)
    pngs = viz.save_figures({"bars": figs["bars"]}, tmp_path, formats=("png",))
    assert len(renders) == 2 and pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # tried once more, and written
    def render_fails(self, *a, **k):
        renders.append(1)
        raise TimeoutError("render timed out")
    monkeypatch.setattr(go.Figure, "write_image", render_fails)
    renders.clear()
    with pytest.raises(RuntimeError, match=r"figure 'bars' was not written .*2 times alone \(render timed out"):
        viz.save_figures(figs, tmp_path, formats=("png",))
    assert len(renders) == 2  # two tries, then the figure is named
    assert not (tmp_path / "bars.png").exists()  # never an old file left to pass for the new one
