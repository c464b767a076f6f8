"""Real-browser test of the live dashboard: the launch tutorial runs in JupyterLab (a real kernel), driven by headless
Debian chromium through Playwright. Its sections 4 and 5 (the ring layouts, the numbers explained) are left out of the
copy the browser runs: they draw nothing on the dashboard, and `test_notebooks` runs the whole tutorial. While its
cells run, the dashboard's plotly figures must grow in the page (live updates reach the browser while the kernel is
blocked in `run`); at the end they must hold every step of every run, the
SP=2 loss curve must equal the SP=1 curve, and the failing-rank cell must show rank 1's own error.
Screenshots go to test-artifacts/.
"""
import json
import re
import time

from browser_utils import ARTIFACTS, ROOT, browser_page, jupyter_env, jupyterlab, open_notebook, run_all_cells
from workbench.dashboard import BALANCE_TITLE, COMM_TITLE

NOTEBOOK = ROOT / "nbs" / "tutorials" / "launch_sp.ipynb"

DASHBOARD_STATE = """(k) => {  // the k-th dashboard on the page
    const root = document.querySelectorAll('.workbench-dashboard')[k] || document.createElement('div');
    const plots = {}, notes = {}, ticks = {};
    for (const gd of root.querySelectorAll('.js-plotly-plot')) {
        const title = gd._fullLayout && gd._fullLayout.title && gd._fullLayout.title.text;
        plots[title] = (gd.data || []).map(t => ({name: t.name, x: Array.from(t.x || []), y: Array.from(t.y || [])}));
        notes[title] = ((gd._fullLayout && gd._fullLayout.annotations) || []).map(a => a.text);
        ticks[title] = gd._fullLayout && gd._fullLayout.xaxis ? (gd._fullLayout.xaxis._vals || []).map(v => v.x) : [];
    }
    const bars = Array.from(root.querySelectorAll('.widget-hprogress'), w => ({
        name: (w.querySelector('.widget-label') || {}).textContent, \
width: w.querySelector('.progress-bar').style.width}));
    // each figure as the page holds it, untitled ones too (a figure whose title went missing overwrites another's key)
    const figures = Array.from(root.querySelectorAll('.js-plotly-plot'), gd => ({
        title: gd.layout && gd.layout.title, layout_keys: Object.keys(gd.layout || {}), \
traces: (gd.data || []).length}));
    return {plots, notes, ticks, bars, figures, done: window.__runAll};
}"""


# When each state of the loss figure was first drawn (a MutationObserver fires after each redraw, so no state is missed
# between two polls, as a poll every 100 ms could miss a whole six-step run of a tiny model): (run, points) -> ms.
RECORD_LOSS_CURVES = """() => {
    window.__lossCurves = {};
    const record = () => {
        for (const gd of document.querySelectorAll('.js-plotly-plot')) {
            if (!(gd._fullLayout && gd._fullLayout.title && gd._fullLayout.title.text === 'loss')) continue;
            for (const t of gd.data || []) {
                const key = JSON.stringify([t.name, (t.x || []).length]);
                if (!(key in window.__lossCurves)) window.__lossCurves[key] = performance.now();
            }
        }
    };
    new MutationObserver(record).observe(document.body, {subtree: true, childList: true, attributes: true});
}"""


def notebook_steps() -> int:
    "The steps per run the tutorial asks for (its `TrainConfig(..., steps=N, ...)`)."
    source = "".join("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"])
    return int(re.search(r"TrainConfig\([^)]*steps=(\d+)", source).group(1))


def dashboard_sections(notebook: dict) -> dict:
    "The tutorial without its sections 4 and 5: from the cell headed '## 4.' up to the one headed '## 6.'."
    heads = ["".join(c["source"]).startswith(("## 4.", "## 6.")) and c["cell_type"] == "markdown"
             for c in notebook["cells"]]
    first, last = [i for i, h in enumerate(heads) if h]
    return {**notebook, "cells": notebook["cells"][:first] + notebook["cells"][last:]}


def test_dashboard_in_jupyterlab(tmp_path):
    env = jupyter_env(tmp_path)
    tutorial = dashboard_sections(json.loads(NOTEBOOK.read_text()))  # a copy: JupyterLab may autosave what it opens
    # shown again once every run is done: a view the page draws late must show all the figures hold, not their start
    tutorial["cells"].append({"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                              "source": "dash"})
    (tmp_path / NOTEBOOK.name).write_text(json.dumps(tutorial))
    assert "## 6. When a rank fails" in json.dumps(tutorial) and "## 4." not in json.dumps(tutorial)
    steps = notebook_steps()
    with jupyterlab(tmp_path, env) as url, browser_page() as page:
        open_notebook(page, url, NOTEBOOK.name)
        page.evaluate(RECORD_LOSS_CURVES)
        run_all_cells(page, wait=False)
        # the deadline only catches a hang: the tutorial (three runs, then the failing rank) ran past 75 s beside a
        # parallel test run on a 2-core box
        deadline = time.monotonic() + 300
        bars_seen = set()  # the progress bars' widths while cells still run (each run lasts seconds: a poll sees it)
        while (state := page.evaluate(DASHBOARD_STATE, 0))["done"] is None:
            assert time.monotonic() < deadline, f"the notebook did not finish: {state}"
            bars_seen.add(tuple(b["width"] for b in state["bars"]))
            page.wait_for_timeout(100)
        assert state["done"] is True, "a cell of the tutorial failed in JupyterLab"
        drawn = {tuple(json.loads(k)): ms / 1000 for k, ms in page.evaluate("() => window.__lossCurves").items()}

        plots = state["plots"]
        assert set(plots) >= {"loss", "throughput", "peak memory per rank", COMM_TITLE}, (plots.keys(),
                                                                                          state["figures"])
        runs = [t["name"] for t in plots["loss"]]
        assert runs == ["SP=1", "SP=2", "DP=2"], runs
        assert [t["name"] for t in plots[COMM_TITLE]] == [f"{r} {kind}"
                                                          for r in runs for kind in ("all-to-all", "ring")]
        for title in ("loss", "throughput", COMM_TITLE):  # every step of every run reached the page
            assert [t["x"] for t in plots[title]] == [list(range(steps))] * len(plots[title]), (title, plots[title])
        loss = {t["name"]: t["y"] for t in plots["loss"]}
        assert max(abs(a - b) for a, b in zip(loss["SP=2"], loss["SP=1"])) < 1e-5, loss
        measured = sorted(t["name"] for t in plots["peak memory per rank"] if " rank " in t["name"])
        assert measured == ["DP=2 rank 0", "DP=2 rank 1", "SP=1 rank 0", "SP=2 rank 0", "SP=2 rank 1"], measured
        assert [(b["name"], b["width"]) for b in state["bars"]] == [(n, "100%") for n in runs], state["bars"]
        # the first run done, not all
        assert any(w[0] == "100%" and w[-1] != "100%" for w in bars_seen if len(w) == 3), bars_seen
        assert any(n.startswith("CPU run: measured") for n in state["notes"]["peak memory per rank"]), state["notes"]
        for title in ("loss", "throughput"):  # whole steps only on the step axes
            assert state["ticks"][title] and all(float(v).is_integer() for v in state["ticks"][title]), state["ticks"]
        # live, not delivered late: a partial SP=1 curve was drawn well before the DP=2 run, two launches later, drew
        # its first point (updates held back and delivered at the end would all draw within milliseconds)
        partial = [t for (run, points), t in drawn.items() if run == "SP=1" and 0 < points < steps]
        assert partial, f"no partial SP=1 curve was ever drawn: {sorted(drawn)}"
        last_run_starts = min(t for (run, points), t in drawn.items() if run == "DP=2" and points > 0)
        assert last_run_starts - min(partial) > 0.5, drawn
        # 2 x 7 figures
        page.wait_for_function("() => document.querySelectorAll('.workbench-dashboard .js-plotly-plot').length == 14")
        shares = {t["name"]: t for t in plots[BALANCE_TITLE]}
        assert {"SP=2 rank 0", "SP=2 rank 1", "DP=2 rank 0", "DP=2 rank 1", "DP=2 rank 0 predicted",
                "DP=2 rank 0 attention", "DP=2 rank 1 tokens"} <= set(shares), shares
        assert not any(n.startswith("SP=1") for n in shares), shares  # one rank: nothing to compare
        dp = [shares[f"DP=2 rank {k}"] for k in (0, 1)]
        assert all(t["x"] == list(range(steps)) for t in dp), dp  # each step's two shares average to the mean:
        assert all(abs(a + b - 2.0) < 1e-9 for a, b in zip(dp[0]["y"], dp[1]["y"])), dp
        again = page.evaluate(DASHBOARD_STATE, 1)
        assert (again["plots"], again["bars"]) == (plots, state["bars"]), again

        dashboard = page.locator(".widget-vbox:has(.js-plotly-plot)").first
        dashboard.scroll_into_view_if_needed()
        dashboard.screenshot(path=ARTIFACTS / "dashboard_jupyterlab.png")
        index = page.evaluate("""async () => {  // bring the failing-rank cell into view (JupyterLab renders lazily)
            const nb = window.jupyterapp.shell.currentWidget.content;
            const i = nb.widgets.findIndex(c => c.model.type === 'code'
                && JSON.stringify(c.model.outputs.toJSON()).includes('raised ValueError'));
            if (i >= 0) { nb.activeCellIndex = i; await nb.scrollToItem(i, 'start'); }
            return i;
        }""")
        assert index >= 0, "no output shows the failing rank's error"
        failure = page.locator(".jp-Cell.jp-mod-active .jp-OutputArea")
        failure.wait_for(state="visible", timeout=10000)
        text = failure.inner_text()
        # its own traceback (where the data is read)
        assert "rank 1 of 2 raised ValueError" in text and "workbench/data.py" in text, text
        failure.screenshot(path=ARTIFACTS / "dashboard_failing_rank_jupyterlab.png")
