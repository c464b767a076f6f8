"""Real-browser test of the mask explorer on your own model and data (issue 15): the explore_masks tutorial runs in
JupyterLab, where its explorer is built on a random model saved to a folder and a `datasets.Dataset` made in the
notebook (no shipped sample). A control change must redraw the figure's data; a box zoom dragged with the mouse
(past the figure's corner) must come back from the kernel clamped into the row, one token per cell, with the tokens'
decoded text on the axes and in the hover. Screenshots go to test-artifacts/.

Servers, Jupyter config and browser come from browser_utils (shared with the other browser tests).
"""
import ast
import json
import re
import shutil

from browser_utils import ARTIFACTS, ROOT, browser_page, jupyter_env, jupyterlab, open_notebook, run_all_cells
from workbench.core import load_tokenizer
from workbench.viz import readable_tokens

NOTEBOOK = ROOT / "nbs" / "tutorials" / "explore_masks.ipynb"

FIGURE = """() => {
    const gd = document.querySelector('.wb-mask .js-plotly-plot');
    if (!gd || !gd.data || !gd._fullLayout) return null;
    const h = gd.data[0], rows = a => Array.from(a || [], r => Array.from(r));
    return {z: JSON.stringify(rows(h.z)), x: Array.from(h.x), y: Array.from(h.y), text: rows(h.text),
            xrange: gd._fullLayout.xaxis.range, yrange: gd._fullLayout.yaxis.range,
            xticks: Array.from(document.querySelectorAll('.wb-mask .xtick text'), t => t.textContent),
            yticks: Array.from(document.querySelectorAll('.wb-mask .ytick text'), t => t.textContent),
            stats: document.querySelector('.wb-stats [data-stat="view"]')?.textContent};
}"""


def notebook_texts() -> list[str]:
    "The texts of the tutorial's own dataset (its `texts = [...]`)."
    source = "\n".join("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"])
    return ast.literal_eval(re.search(r"^texts = (\[.*?\])$", source, re.S | re.M).group(1))


def test_explorer_on_your_model_and_data_in_jupyterlab(tmp_path):
    env = jupyter_env(tmp_path)
    shutil.copy(NOTEBOOK, tmp_path / NOTEBOOK.name)  # JupyterLab may autosave what it opens
    tok = load_tokenizer()
    texts = notebook_texts()
    ids = [tok(t)["input_ids"] for t in texts]
    with jupyterlab(tmp_path, env) as url, browser_page() as page:
        open_notebook(page, url, NOTEBOOK.name)
        assert run_all_cells(page) is True, "a cell of the tutorial failed in JupyterLab"
        page.wait_for_function(f"() => ({FIGURE})() !== null", timeout=30000)
        page.locator(".wb-explorer").scroll_into_view_if_needed()
        before = page.evaluate(FIGURE)
        assert before["stats"] and before["x"][-1] == sum(map(len, ids[:4])), before  # four of your examples

        # a control change: all eight examples in the batch; the figure's data must change
        size = page.locator(".wb-size input")
        size.fill("8"); size.press("Enter")
        T = sum(map(len, ids))
        page.wait_for_function(f"() => {{ const f = ({FIGURE})(); return f && f.x[f.x.length - 1] === {T}; }}", timeout=20000)
        after = page.evaluate(FIGURE)
        assert after["z"] != before["z"] and len(after["x"]) == T + 1, after["x"]
        assert not any("␣" in t for t in after["xticks"]), after["xticks"]  # T > 40 tokens: numbered ticks only
        page.locator(".wb-explorer").screenshot(path=ARTIFACTS / "explorer_own_data.png")

        # a box zoom with the mouse, from beyond the top-left corner of the plot to about 12 tokens in
        drag = page.locator(".wb-mask .nsewdrag").first.bounding_box()
        x0, y0 = drag["x"] + 1, drag["y"] + 1
        page.mouse.move(x0, y0); page.mouse.down()
        page.mouse.move(x0 + drag["width"] * 12 / T, y0 + drag["height"] * 12 / T, steps=8)
        page.mouse.move(x0 - 30, y0 - 30, steps=4)  # past the corner: plotly reports a range outside the row
        page.mouse.move(x0 + drag["width"] * 12 / T, y0 + drag["height"] * 12 / T, steps=4)
        page.mouse.up()
        first = readable_tokens(ids[0], tok)
        page.wait_for_function("(tok) => { const f = (" + FIGURE + ")(); return f && f.xticks.includes(tok); }",
                               arg=first[1], timeout=20000)
        zoomed = page.evaluate(FIGURE)
        n = len(zoomed["x"]) - 1
        assert zoomed["x"][0] == 0 and zoomed["y"][0] == 0 and 5 <= n <= 20, zoomed["x"]  # clamped at 0, single tokens
        assert min(zoomed["yrange"]) >= 0 and min(zoomed["xrange"]) >= 0, zoomed  # never a negative axis
        assert zoomed["xticks"][:min(n, len(first))] == first[:n], (zoomed["xticks"], first)
        assert zoomed["yticks"][:min(len(zoomed["y"]) - 1, len(first))] == first[:len(zoomed["y"]) - 1]
        assert not any("Ġ" in t or "Ċ" in t for t in zoomed["xticks"] + zoomed["yticks"])
        assert zoomed["text"][2][1].startswith(f"query 2 {first[2]} (example 0)<br>key 1 {first[1]} (example 0)"), zoomed["text"][2][1]
        page.locator(".wb-explorer").screenshot(path=ARTIFACTS / "explorer_own_data_zoomed.png")

        # the hover names the tokens under the mouse
        point = page.evaluate("""() => {  // the page position of the middle of cell (query 2, key 1)
            const gd = document.querySelector('.wb-mask .js-plotly-plot'), r = gd.getBoundingClientRect();
            const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
            return [r.left + xa._offset + xa.l2p(1.5), r.top + ya._offset + ya.l2p(2.5)];
        }""")
        page.mouse.move(*point)
        page.wait_for_selector(".wb-mask .hoverlayer .hovertext", timeout=5000)
        hover = page.locator(".wb-mask .hoverlayer .hovertext").first.text_content()
        assert f"key 1 {first[1]}" in hover and "(example 0)" in hover, hover
