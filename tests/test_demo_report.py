"""The demo report a reader would share: under 5 MB, a table of contents whose entries link to the sections, plotly.js
once, no cloud-share button, no repetition, both SP loss curves visible; and in headless chromium every figure draws
with no console error. Screenshots go to test-artifacts/."""
import base64
import gzip
import json
import re

import pytest

from browser_utils import ARTIFACTS, browser_page
from workbench.demo import PLOT_CONFIG, run_demo


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = run_demo(tmp_path_factory.mktemp("demo"), sp_steps=2)
    return path, path.read_text()


def unpacked(page: str, name: str) -> str:
    return gzip.decompress(base64.b64decode(re.search(f"id='{name}'>([^<]*)<", page).group(1))).decode()


def test_size_contents_and_plotly_once(report):
    path, page = report
    assert path.stat().st_size < 5 * 2**20, path.stat().st_size
    # each with its explanation
    sections = re.findall(r"<section id='([^']+)'><h2>([^<]+)</h2><p class='why'>([^<]+)</p>", page)
    assert [h for _, h, _ in sections] == ["Packing: flan_like", "Packing: orca_like",
                                           "Attention masks: correct packing and the traps",
                                           "Packing doctor: tiny Llama with sdpa",
                                           "Sequence parallelism: SP=2 over two CPU processes against one process"]
    assert re.findall(r"<li><a href='#([^']+)'>", page) == [s for s, _, _ in sections]
    assert all(len(why) > 80 for _, _, why in sections)
    for key in ("date", "versions", "machine"): assert f"<tr><th>{key}</th>" in page
    assert all(f"{p} " in page for p in ("torch", "transformers", "trl", "accelerate", "workbench"))
    js = unpacked(page, "plotly-js")
    # once, packed, offline
    assert js.count("plotly.js v") == 1 and "plotly.js v" not in page and "cdn.plot.ly" not in page
    assert page.count("<script") == 4  # config, plotly.js, the figures, the loader: nothing per figure
    config = json.loads(re.search(r"id='plot-config'>([^<]*)<", page).group(1))
    assert config == PLOT_CONFIG and config["showSendToCloud"] is False and config["displaylogo"] is False
    assert "sendDataToCloud" in config["modeBarButtonsToRemove"]


def test_no_repetition_and_no_hidden_line(report):
    _, page = report
    assert page.count("pass use_cache=False in every forward call") == 1  # the doctor's fix once, not per failed check
    assert page.count("NOT CLEAN") == 1 and "resolves: cache off" in page
    figures = json.loads(unpacked(page, "figures-json"))
    loss = next(f for f in figures if f["layout"]["title"]["text"] == "loss")
    one, two = loss["data"]
    assert one["y"] and max(abs(a - b) for a, b in zip(one["y"], two["y"])) < 1e-5  # the same curve twice...
    # ...both visible
    assert one["line"]["width"] > two["line"]["width"] and one["marker"]["symbol"] != two["marker"]["symbol"]
    assert one["line"].get("dash", "solid") == "solid" and two["line"]["dash"] == "dash"
    said = float(re.search(r"at every step to within ([0-9.e+-]+)", page).group(1))
    # the text states the computed difference
    assert said == float(f"{max(abs(a - b) for a, b in zip(one['y'], two['y'])):.1e}")
    memory = next(f for f in figures if f["layout"]["title"]["text"] == "peak memory per rank")
    assert "not comparable" in memory["layout"]["annotations"][0]["text"]  # the CPU caveat on the figure itself
    # filling their columns
    assert all(f["layout"].get("width") is None and f["layout"]["height"] >= 300 for f in figures)


def test_renders_in_chromium_without_console_errors(report):
    path, page_text = report
    n = len(json.loads(unpacked(page_text, "figures-json")))
    with browser_page() as page:
        errors = []
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        page.wait_for_function(f"() => document.body.dataset.rendered == {n}", timeout=60000)
        assert page.locator(".js-plotly-plot").count() == n and page.locator("#nojs").count() == 0
        titles = page.evaluate("() => Array.from(document.querySelectorAll('.modebar-btn'), b => b.dataset.title)")
        assert titles and not [t for t in titles
                               if "Share" in t or "Cloud" in t or "Produced with Plotly" in t], set(titles)
        widths = page.evaluate("() => Array.from(document.querySelectorAll('.js-plotly-plot'), "
                               "d => d.getBoundingClientRect().width)")
        assert min(widths) >= 450, widths  # no tiny charts
        page.click("nav a[href='#packing-doctor-tiny-llama-with-sdpa']")
        assert page.evaluate("() => location.hash") == "#packing-doctor-tiny-llama-with-sdpa"
        page.screenshot(path=ARTIFACTS / "demo_report.png", full_page=True)
        assert errors == [], errors
