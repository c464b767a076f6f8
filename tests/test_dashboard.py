"""The dashboard against what real run directories do: reused
while watched, torn lines, runs in sequence, a failing watch."""
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from workbench.dashboard import CPU_CAVEAT, Dashboard, MetricsReader


def row(step, rank=0, loss=None, t=None, **extra) -> str:
    return json.dumps(dict(step=step, rank=rank, loss=9.0 - step if loss is None else loss, tokens=100,
                           tokens_per_s=1e3,
                           peak_mem_bytes=2**30, a2a_share=0.0, time=step + 1.0 if t is None else t, **extra)) + "\n"


def replace_file(path: Path, text: str):
    "As workbench.train writes a new run's files: whole, then renamed into place."
    tmp = path.with_name(path.name + ".tmp"); tmp.write_text(text); tmp.replace(path)


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_reused_directory_rewritten_mid_watch(tmp_path):
    run = tmp_path / "latest"; run.mkdir()
    (run / "config.json").write_text(json.dumps({"ulysses": 2, "dp": 1, "steps": 5}))
    (run / "metrics.jsonl").write_text("".join(row(s, k) for s in range(5) for k in (0, 1)))  # last week's SP=2 run
    dash = Dashboard(run).watch(0.01)
    try:
        wait_for(lambda: len(dash.readers[0].rows) == 10)
        replace_file(run / "config.json", json.dumps({"ulysses": 1, "dp": 1, "steps": 4}))
        replace_file(run / "metrics.jsonl", "")  # the new run starts: train's truncate_metrics(out, 0)
        for s in range(4):  # it appends while the dashboard watches, a line in two writes
            with (run / "metrics.jsonl").open("a") as f:
                line = row(s, loss=5.0 - s); f.write(line[:7]); f.flush(); time.sleep(0.03); f.write(line[7:])
            time.sleep(0.03)
        wait_for(lambda: len(dash.readers[0].rows) == 4)
    finally:
        dash.stop()  # raises if the watch thread failed
    assert dash.readers[0].restarts >= 1
    assert list(dash.loss.data[0].y) == [5.0, 4.0, 3.0, 2.0] and list(dash.loss.data[0].x) == [0, 1, 2, 3]
    assert dash.loss.data[0].name == "SP=1 DP=1"  # the new run's label
    memory = {t.name: list(t.x) for t in dash.memory.data if t.showlegend}
    assert memory == {"SP=1 DP=1 rank 0": [0, 1, 2, 3]}  # the old run's rank 1 is gone, from the legend too
    assert [list(t.x) for t in dash.memory.data if not t.showlegend] == [[]]
    assert [(b.value, b.max) for b in dash.bars] == [(4, 4)] and dash.status.value == "1 of 1 runs done"


def test_rewritten_in_place_deleted_and_torn(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(row(0) + row(1) + row(2))
    r = MetricsReader(tmp_path); assert len(r.read()) == 3
    # same inode, longer
    with path.open("w") as f: f.write(row(0, loss=1.0) + row(1, loss=0.5) + row(2, loss=0.25) + row(3, loss=0.125))
    assert [x["loss"] for x in r.read()] == [1.0, 0.5, 0.25, 0.125] and r.restarts == 1
    path.unlink()
    assert r.read() == [] and r.rows == [] and r.restarts == 2
    path.write_text(row(0) + '{"step": 1, "rank": 0, "lo')  # a half-written last line: skipped until complete
    assert [x["step"] for x in r.read()] == [0]
    assert r.read() == []
    # completed; then a line that is no row, a blank
    with path.open("a") as f: f.write('ss": 2.0}\n' + "[1, 2]\n" + "\n")
    assert [x["loss"] for x in r.read()] == [2.0] and r.skipped == 1
    (tmp_path / "config.json").write_text('{"steps": 4, "na')  # a hand-written config caught mid-write
    assert r.config == {}


def test_three_runs_in_sequence(tmp_path):
    cfgs = [SimpleNamespace(out=str(tmp_path / f"tmpq{i}w8"), name=n, steps=3)
            for i, n in enumerate(["SP=1", "SP=2", "DP=2"])]
    dash = Dashboard(*cfgs)

    def stage():
        dash.refresh()
        return [(b.description, b.value, b.max) for b in dash.bars], dash.status.value

    assert stage() == ([("SP=1", 0, 3), ("SP=2", 0, 3), ("DP=2", 0, 3)], "0 of 3 runs done")
    assert [t.value for t in dash.texts] == ["waiting"] * 3
    for i, cfg in enumerate(cfgs):
        out = Path(cfg.out); out.mkdir()
        (out / "config.json").write_text(json.dumps({"steps": 3, "name": "ignored: the name given wins"}))
        ranks = (0, 1) if i else (0,)
        (out / "metrics.jsonl").write_text("".join(row(0, k, t=2.0) for k in ranks))
        bars, status = stage()
        assert bars[i] == (cfg.name, 1, 3) and status == f"{i} of 3 runs done"
        assert dash.texts[i].value == "1/3 steps in 2.0 s, ETA 4 s"
        assert [b[1] for b in bars] == [3] * i + [1] + [0] * (2 - i)  # earlier runs full, later ones empty
        with (out / "metrics.jsonl").open("a") as f:
            f.write("".join(row(s, k, t=2.0 * (s + 1)) for s in (1, 2) for k in ranks))
        bars, status = stage()
        assert bars[i] == (cfg.name, 3, 3) and status == f"{i + 1} of 3 runs done"
        assert dash.texts[i].value == "done, 3/3 steps in 6.0 s"
    assert [t.name for t in dash.loss.data] == ["SP=1", "SP=2", "DP=2"]
    assert all(f.layout.xaxis.tickformat == "d" and f.layout.xaxis.dtick == 1 for f in dash.figures())


def test_long_runs_tick_whole_steps_and_cost_figures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"steps": 95, "device": "cuda:0",
                                                       "predicted": {"step_s": 0.5, "mfu": 0.4, "device": "H100"}}))
    (tmp_path / "metrics.jsonl").write_text("".join(row(s, step_s=0.6, mfu=0.33) for s in range(3)))
    dash = Dashboard(tmp_path)
    assert dash.loss.layout.xaxis.dtick == 10 and dash.loss.layout.xaxis.tickformat == "d"
    assert dash.memory.layout.annotations == ()  # a GPU run: planned and measured compare, no caveat
    name = tmp_path.name  # no name, no layout in the config: the folder
    assert {t.name: list(t.y) for t in dash.mfu.data} == {name: [0.33] * 3, f"{name} predicted": [0.4, 0.4]}
    assert dash.step_time.data[1].line.dash == "dash" and dash._cost.layout.display is None
    plain = tmp_path / "plain"; plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"steps": 3, "device": "cpu", "expected_peak_bytes": 2**28}))
    (plain / "metrics.jsonl").write_text(row(0))
    old = Dashboard(plain)  # a run without the cost model's keys: no step-time figure, nothing breaks
    assert old.step_time.data == () and old._cost.layout.display == "none"
    assert old.memory.layout.annotations[0].text == CPU_CAVEAT


def test_watch_thread_whose_reader_raises(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text(row(0))
    dash = Dashboard(tmp_path, names=["mine"])
    calls, real = [], dash.readers[0].read

    def flaky():
        calls.append(1)
        if len(calls) >= 3: raise OSError("stale file handle")
        return real()
    dash.readers[0].read = flaky
    with caplog.at_level(logging.ERROR, logger="workbench.dashboard"):
        dash.watch(0.01)
        wait_for(lambda: len(calls) >= 10)  # it keeps trying
    assert dash._thread.is_alive() and "refresh failed, retrying: OSError: stale file handle" in dash.status.value
    assert caplog.text.count("dashboard refresh failed; the watch retries") == 1 and "stale file handle" in caplog.text
    with pytest.raises(RuntimeError, match="stale file handle") as e: dash.stop()  # its last refresh fails too
    assert isinstance(e.value.__cause__, OSError)
    calls.clear()
    dash.watch(0.01); wait_for(lambda: len(calls) >= 3)
    dash.readers[0].read = real  # the error passes: the next refresh clears it, and stop() raises nothing stale
    wait_for(lambda: dash.error is None)
    assert dash._thread.is_alive() and dash.status.value == "0 of 1 runs done"
    # watching again starts clean, and a second watch replaces the first
    dash.watch(0.01); dash.watch(0.01); time.sleep(0.05)
    assert len([t for t in threading.enumerate() if t.name == "dashboard watch"]) == 1
    dash.stop()
    with pytest.raises(ValueError, match="must be > 0"): dash.watch(0)
    assert dash.error is None and "refresh failed" not in dash.status.value
    assert not [t for t in threading.enumerate() if t.name == "dashboard watch"]


def test_names_and_labels(tmp_path):
    a, b = tmp_path / "tmpab12", tmp_path / "tmpcd34"
    for d in (a, b): d.mkdir(); (d / "config.json").write_text(json.dumps({"ulysses": 2, "dp": 1, "steps": 2}))
    assert Dashboard(a, b).labels() == ["SP=2 DP=1 #1", "SP=2 DP=1 #2"]  # two runs never share one trace
    assert Dashboard(a, b, names=["first", "second"]).labels() == ["first", "second"]
    with pytest.raises(ValueError, match="1 names for 2 runs"): Dashboard(a, b, names=["x"])


def test_real_runs_in_a_reused_directory(tmp_path):
    """A real run, then a resumed one in the same directory while
    watched: train rewrites metrics.jsonl, the dashboard follows."""
    from workbench.config import TrainConfig
    from workbench.train import run
    cfg = TrainConfig(steps=2, max_tokens=256, out=str(tmp_path / "latest"), name="reused")
    first = run(cfg)
    dash = Dashboard(cfg, total_steps=4).watch(0.02)
    wait_for(lambda: len(dash.readers[0].rows) == 2)
    inode = (tmp_path / "latest" / "metrics.jsonl").stat().st_ino
    second = run(TrainConfig(steps=4, max_tokens=256, out=cfg.out, name="reused", resume=True))
    dash.stop()
    assert (tmp_path / "latest" / "metrics.jsonl").stat().st_ino != inode  # train replaced the file
    assert dash.readers[0].restarts >= 1 and dash.error is None
    assert list(dash.loss.data[0].x) == [0, 1, 2, 3] and list(dash.loss.data[0].y)[:2] == first
    assert list(dash.loss.data[0].y)[2:] == second
    assert str(dash.runs[0]).startswith("reused: done, 4/4 steps")


def test_the_slowest_rank_is_named_beside_its_figure_and_old_runs_show_none(tmp_path):
    """Two DP ranks with unequal forward + backward times: the
    dashboard draws the ratio per step and names the slow rank."""
    uneven, old = tmp_path / "uneven", tmp_path / "old"
    for d in (uneven, old): d.mkdir(); (d / "config.json").write_text(json.dumps({"ulysses": 1, "dp": 2, "steps": 3}))
    times = {0: (1.0, 2.0), 1: (1.0, 3.0), 2: (2.0, 2.0)}  # step -> (rank 0, rank 1) seconds
    (uneven / "metrics.jsonl").write_text("".join(row(s, k, compute_s=times[s][k], predicted_flops=1e9 * (1 + k),
                                                                 predicted_attention_flops=1e8 * (1 + 2 * k))
                                                  for s in times for k in (0, 1)))
    # written before compute_s existed
    (old / "metrics.jsonl").write_text("".join(row(s, k) for s in range(3) for k in (0, 1)))
    dash = Dashboard(uneven, old, names=["uneven", "old"])
    traces = {t.name: list(t.y) for t in dash.balance.data}
    assert traces == {"uneven rank 0": [1.0 / 1.5, 1.0 / 2.0, 1.0], "uneven rank 1": [2.0 / 1.5, 3.0 / 2.0, 1.0],
                      "uneven rank 0 predicted": [2.0 / 3] * 3, "uneven rank 1 predicted": [4.0 / 3] * 3,
                      "uneven rank 0 attention": [0.5] * 3, "uneven rank 1 attention": [1.5] * 3,
                      # equal tokens, unequal time
                      "uneven rank 0 tokens": [1.0] * 3, "uneven rank 1 tokens": [1.0] * 3}
    assert dash._ranks.layout.display is None
    assert ("uneven</b>: slowest rank 1 at step 1: its forward + backward took 1.50x the ranks' mean"
            in dash.ranks_text.value)
    assert "predicted from the bins' FLOPs: rank 1, 1.33x" in dash.ranks_text.value
    assert "their attention: rank 1, 1.50x" in dash.ranks_text.value
    assert "old" not in dash.ranks_text.value
    only_old = Dashboard(old)
    assert only_old.balance.data == () and only_old._ranks.layout.display == "none" and only_old.ranks_text.value == ""


FRESH_WATCH = """
import json, sys, time
from pathlib import Path
from workbench.config import TrainConfig
from workbench.dashboard import Dashboard
from workbench.train import run
tmp = Path(sys.argv[1])
(tmp / "mine.jsonl").write_text("".join(json.dumps({"text": f"example {i} " * (5 + i % 7)}) + "\\n" for i in range(32)))
cfg = TrainConfig(data=str(tmp / "mine.jsonl"), steps=2, max_tokens=256, out=str(tmp / "run"), name="mine")
pandas_before = "pandas" in sys.modules
dash = Dashboard(cfg).watch(0.01)
run(cfg)
time.sleep(0.2)
try: dash.stop(); stopped = "clean"
except RuntimeError as e: stopped = str(e)
drawn = len(dash.loss.data[0].y) if dash.loss.data else 0
print("RESULT " + json.dumps(dict(pandas_before=pandas_before, stopped=stopped, status=dash.status.value,
                                  progress=dash.texts[0].value, drawn=drawn)))
"""


def test_watching_a_run_on_your_own_jsonl_in_a_fresh_process(tmp_path):
    """Nothing imported beforehand: while the watch thread draws, the run's `datasets` imports pandas on the main
    thread. Before `watch` imported what plotly reads, the thread found pandas half initialised ("partially initialized
    module 'pandas' has no attribute 'Series'"), the dashboard sat at "waiting" for the whole run and stop() raised."""
    out = subprocess.run([sys.executable, "-c", FRESH_WATCH, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert result["pandas_before"] is False, "pandas was imported before the run: this test no longer sets up the race"
    assert result == dict(pandas_before=False, stopped="clean", status="1 of 1 runs done", progress=result["progress"],
                          drawn=2), (result, out.stderr[-3000:])
    assert result["progress"].startswith("done, 2/2 steps"), result


def test_measured_lines_are_solid_beside_a_prediction(tmp_path):
    "Two runs with the cost model's prediction (the demo's SP=1 and SP=2): measured lines solid, predictions dashed."
    for sp in (1, 2):
        d = tmp_path / f"sp{sp}"; d.mkdir()
        predicted = {"step_s": 0.5, "mfu": 0.3}
        (d / "config.json").write_text(json.dumps({"ulysses": sp, "dp": 1, "steps": 2, "predicted": predicted}))
        work = dict(step_s=0.6, mfu=0.25, predicted_flops=1e9, predicted_attention_flops=1e8)
        rows = [row(s, k, compute_s=0.4 + k, **work) for s in (0, 1) for k in range(sp)]
        (d / "metrics.jsonl").write_text("".join(rows))
    dash = Dashboard(tmp_path / "sp1", tmp_path / "sp2", names=["SP=1", "SP=2"])
    styles = [{t.name: t.line.dash for t in fig.data} for fig in (dash.step_time, dash.mfu)]
    assert styles == [{"SP=1": "solid", "SP=1 predicted": "dash", "SP=2": "solid", "SP=2 predicted": "dash"}] * 2
    balance = {t.name: t.line.dash for t in dash.balance.data}
    assert [balance[f"SP=2 rank {k}"] for k in (0, 1)] == ["solid"] * 2 and balance["SP=2 rank 1 predicted"] == "dot"
    assert [t.line.dash for t in dash.loss.data] == ["solid", "dash"]  # no prediction: each run keeps its own dash


def test_a_resume_on_another_layout_shows_its_own_ranks(tmp_path, capfd):
    """An SP=2 segment, then a one-process resume into the same --out, watched (issue 47): memory and the ranks show
    the resumed segment's rank 0 from its start step (config.json's start_step), not the rank 1 that no longer exists;
    the loss keeps the whole run, and the progress line says which curves hold which steps. What the resume prints
    covers its own steps too: the memory readout names rank 0 alone, every predicted number is set beside the resumed
    segment's own measured step (its first left out as warm-up), and the progress bar shows the loss."""
    from workbench.config import TrainConfig
    from workbench.tracking import read_metrics
    from workbench.train import run
    common = dict(data="orca_like", max_tokens=256, out=str(tmp_path / "run"), name="resumed")
    run(TrainConfig(ulysses=2, steps=2, **common))
    dash = Dashboard(TrainConfig(steps=4, resume=True, **common))
    assert {t.name for t in dash.balance.data} >= {"resumed rank 0", "resumed rank 1"}  # the SP=2 segment's two ranks
    dash.watch(0.02)
    capfd.readouterr()
    losses = run(TrainConfig(steps=4, resume=True, **common))
    said = capfd.readouterr().out
    dash.stop()
    rows = read_metrics(tmp_path / "run")
    assert ({r["rank"] for r in rows if r["step"] < 2} == {0, 1}
            and [r["step"] for r in rows if r["step"] >= 2] == [2, 3])
    assert ("measured per-rank peak (peak resident memory of the process): rank 0 " in said
            and "rank 1" not in said), said
    (last,) = [r for r in rows if r["step"] == 3]  # the segment's only step past its first
    assert "predicted against measured, medians over steps 3-3 (this run's steps past its first)" in said, said
    for name, measured in (("s/step", f"{last['step_s']:.4g}"), ("tokens/s", f"{last['tokens_per_s']:,.0f}"),
                           ("MFU", f"{last['mfu']:.1%}")):
        line = next(l for l in said.splitlines() if l.startswith(f"  {name}: predicted "))
        assert f", measured {measured}, ratio " in line, (line, measured)
    assert f"loss={losses[-1]:.4f}, tokens/s={last['tokens_per_s']:,.0f}" in said  # the progress bar's last postfix
    shown = lambda fig: {t.name: list(t.x) for t in fig.data if t.showlegend}
    assert shown(dash.memory) == {"resumed rank 0": [2, 3]}
    assert shown(dash.balance) == {} and dash.ranks_text.value == "" and dash._ranks.layout.display == "none"
    assert shown(dash.loss) == {"resumed": [0, 1, 2, 3]}
    assert shown(dash.step_time) == {"resumed": [0, 1, 2, 3], "resumed predicted": [2, 3]}  # this layout's prediction
    assert dash.texts[0].value.startswith("done, 4/4 steps in ")
    assert dash.texts[0].value.endswith("; resumed at step 2: memory and ranks show this segment, the other curves the "
                                        "whole run"), dash.texts[0].value
