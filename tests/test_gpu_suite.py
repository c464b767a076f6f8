"""The GPU suite's CPU dry run (bench/gpu_suite.py --dry-run):
every part recorded, the loss checks honest, parts isolated."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SUITE = Path(__file__).parents[1] / "bench" / "gpu_suite.py"


def suite(out: Path, *flags: str, timeout: float = 540) -> dict:  # under pytest's 600 s; the parts have their own caps
    "Run the suite's dry run in a subprocess (bounded and reaped by subprocess.run) and return its JSON report."
    env = {**os.environ, "PYTHONPATH": str(SUITE.parents[1])}
    proc = subprocess.run([sys.executable, str(SUITE), "--dry-run", "--out", str(out), *flags], capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "suite.json").read_text())


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("suite")
    return out, suite(out)


def test_every_part_has_a_status_and_the_markdown_exists(full):
    out, report = full
    assert [p["part"] for p in report["parts"]] == [1, 2, 3, 4, 5, 6]
    assert [p["status"] for p in report["parts"]] == ["ok"] * 6, [p.get("stderr_tail") for p in report["parts"]]
    assert all(isinstance(p["result"]["not_run"], list) for p in report["parts"])  # what it could not run, and why
    assert any("flex" in why for why in report["parts"][0]["result"]["not_run"])  # CPU: flex has no backward
    assert set(report["env"]) >= {"gpu", "driver", "cuda", "torch", "transformers", "flash_attn"}
    assert report["env"]["gpu"] == "absent" and all(isinstance(v, str) and v for v in report["env"].values())
    md = (out / "suite.md").read_text()
    assert "| 6 | step_time | ok" in md and "CONTAMINATED" in md and "Not run: " in md


def test_gpu_caps_fit_in_8_minutes():
    """Each suite's GPU caps, plus the flash-attn install's 60 s, stay under 8 minutes; step_time runs after what it
    reads."""
    sys.path.insert(0, str(SUITE.parent))
    import gpu_suite
    for name, numbers in gpu_suite.SUITES.items():
        assert sum(p.cap_s for p in gpu_suite.PARTS if p.number in numbers) + 60 < 8 * 60, name
    assert set().union(*gpu_suite.SUITES.values()) == {p.number for p in gpu_suite.PARTS}  # every part in some suite
    names = [p.name for p in gpu_suite.PARTS]
    assert names.index("step_time") > max(names.index(n) for n in ("packing", "long_context", "memory"))


def test_sp_kernels_and_step_time_report_real_values(full):
    _, report = full
    sp = report["parts"][2]["result"]
    plain, fused, varlen, ring, local = sp["rows"]
    assert plain["impl"].startswith("ring block pair, plain") and fused["impl"].startswith("ring block pair, fused")
    assert ring["impl"].startswith("ring 4 zigzag") and local["impl"].startswith("Ulysses local, head shard 1/4")
    assert all(0 <= r[f"max_abs_d_{t}"] < 1e-4 for r in sp["rows"] for t in ("out", "dq", "dk", "dv"))
    assert all(r["max_abs_d_dq"] > 0 for r in (plain, ring))  # the ring's own kernels, really compared against fp32
    # one block of the fused kernel on CPU makes the reference's own flash call per document: equal by construction
    assert [fused[f"max_abs_d_{t}"] for t in ("out", "dq", "dk", "dv")] == [0.0] * 4
    assert all(r["fwd_bwd_ms"] > 0 for r in sp["rows"])
    memory = sp["memory"]  # the fused ring call's operators' bytes; on CPU no allocator peak, and it says so
    # q, k, v grads alone
    assert memory["visible_peak_bytes"] > 4 * 3 * memory["tokens"] * memory["heads"] * memory["head_dim"]
    assert "allocated_peak_bytes" not in memory and any("max_memory_allocated" in why for why in sp["not_run"])
    assert f"its operators' peak {memory['visible_peak_bytes'] / 2**20:.1f} MiB" in sp["table"]
    step = report["parts"][5]["result"]
    sources = [r["source"] for r in step["rows"]]
    assert any(s.startswith("part 1 ") for s in sources) and any(s.startswith("part 4 ") for s in sources)
    assert sources[-1].startswith("part 5 train run (cpu (1 thread per process")  # a dry rank's one thread
    for r in step["rows"]:
        assert r["predicted_s"] > 0 and r["measured_s"] > 0 and abs(r["error"]
                                                                    - (r["measured_s"] / r["predicted_s"] - 1)) < 1e-9
        assert "refit_error" in r  # the refitted error beside the first
    assert 0 < step["refit"] and 0 < step["run_refit"]["matmul"]


def test_packing_loss_checks_flag_only_the_trap(full):
    _, report = full
    packing = report["parts"][0]["result"]
    checked = [r for r in packing["rows"] if "check_loss_diff" in r]
    modes = {r["mode"] for r in checked}
    assert {"padded_sdpa", "padded_varlen", "flat_sdpa", "flat_varlen", "flat_sdpa_cache", "hf_flat_varlen",
            "budget_varlen"} <= modes  # every mode CPU can run had its loss checked (flex: no CPU backward)
    for r in checked:
        assert r["contaminated"] == (r["mode"] == packing["trap"]), r
        assert r["tok_s"] > 0 and r["of_bound"] > 0


def test_kernels_and_memory_parts_report_real_values(full):
    _, report = full
    kernels = {r["impl"]: r for r in report["parts"][1]["result"]["rows"]}
    assert set(kernels) == {"workbench_varlen", "sdpa"}
    assert all(0 <= r[f"max_abs_d_{t}"] < 1e-4 for r in kernels.values() for t in ("out", "dq", "dk", "dv"))
    assert kernels["sdpa"]["max_abs_d_dq"] > 0  # a different kernel: the grads are really compared, not aliased
    points = report["parts"][4]["result"]["points"]
    assert len(points) == 3 and all(p["planned_gib"] > 0 and p["measured_gib"] > 0 for p in points)
    assert "workbench.train" in points[-1]["source"]


def test_a_train_run_the_refit_cannot_explain_keeps_its_row(full, tmp_path, monkeypatch):
    """On the H200 a short train run's timed steps left `calibrate_run` a negative compute factor: its ValueError failed
    part 6 and lost every row. Now the refusal is recorded in `not_run` and the run's first error still stands."""
    out, _ = full
    shutil.copytree(out, tmp_path / "out")
    sys.path.insert(0, str(SUITE.parent))
    import gpu_suite
    import workbench.cost
    def refuse(*args, **kwargs): raise ValueError("the measured steps leave no time for "
                                                  "compute (fitted inverse factor -116)")
    monkeypatch.setattr(workbench.cost, "calibrate_run", refuse)
    result = gpu_suite.part_step_time(True, tmp_path / "out")
    last = result["rows"][-1]
    assert last["source"].startswith("part 5 train run") and last["predicted_s"] > 0 and "refit_error" not in last
    assert ("calibrate_run on part 5's train run: the measured steps leave no time for compute"
            in " ".join(result["not_run"]))
    assert result["run_refit"] is None and result["refit"] > 0  # the part 1 and 4 refit is untouched


def test_a_failing_part_is_recorded_and_the_next_one_runs(tmp_path):
    stale = {"cap_gib": 1, "levers": "old", "measured_tokens": 1, "planned_peak_gib": 1.0, "measured_peak_gib": 1.0}
    (tmp_path / "part4.json").write_text(json.dumps({"result": {"rows": [stale]}}))  # a reused directory's old result
    report = suite(tmp_path, "--parts", "4", "5", "--fail-part", "4")
    failed, memory = report["parts"]
    assert failed["status"].startswith("failed") and "failed on purpose" in failed["stderr_tail"]
    # only the train run: no rows of an old part 4
    assert memory["status"] == "ok" and len(memory["result"]["points"]) == 1
    assert memory["result"]["not_run"] == ["part 4's rows: part 4 did not finish"]


def test_a_part_over_its_cap_is_killed_and_recorded(tmp_path):
    report = suite(tmp_path, "--parts", "2", "--cap-s", "0.5", timeout=60)
    slow, = report["parts"]
    assert slow["status"] == "timed out after 0.5 s" and slow["seconds"] < 10


def test_a_kill_while_a_part_starts_still_ends_it(tmp_path, monkeypatch):
    "A SIGTERM that lands inside Popen (after the fork, before Popen returns) must not orphan the part it created."
    monkeypatch.syspath_prepend(str(SUITE.parent))
    import gpu_suite
    started, real = [], subprocess.Popen
    def popen_then_killed(*a, **k):
        started.append(real(*a, **k))
        os.kill(os.getpid(), signal.SIGTERM)  # the suite is killed before Popen has returned the part to supervise
        return started[-1]
    monkeypatch.setattr(gpu_suite.subprocess, "Popen", popen_then_killed)
    before = {s: signal.getsignal(s) for s in gpu_suite.STOPS}
    try:
        for s in gpu_suite.STOPS: signal.signal(s, gpu_suite.stop)
        args = gpu_suite.parse_args(["--dry-run", "--out", str(tmp_path), "--parts", "2"])
        with pytest.raises(SystemExit) as stopped: gpu_suite.supervise(gpu_suite.PARTS[1], args, cap_s=60)
    finally:
        for s, handler in before.items(): signal.signal(s, handler)
        for p in started:  # a failing run of this test leaves no part behind either
            if p.poll() is None: os.killpg(p.pid, signal.SIGKILL); p.wait()
    assert stopped.value.code == 143 and started[0].returncode == -signal.SIGKILL  # ended and reaped by supervise
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) & gpu_suite.STOPS == set()  # nothing left blocked
    assert running_with(str(tmp_path)) == []


@pytest.mark.parametrize("flags, message", [(["--parts", "11"], "parts are numbered"),
                                            (["--cap-s", "0"], "--cap-s must be a positive"),
                                            (["--out", "FILE"], "is a file: pass a directory")])
def test_bad_flags_are_refused(tmp_path, flags, message):
    (tmp_path / "FILE").touch()
    flags = [str(tmp_path / f) if f == "FILE" else f for f in flags]
    proc = subprocess.run([sys.executable, str(SUITE), "--dry-run", "--out", str(tmp_path), *flags],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr


def running_with(text: str) -> list[int]:
    "Pids of live processes whose command line mentions `text`."
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError: pass
    return pids


def test_a_killed_suite_ends_its_running_part(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(SUITE.parents[1])}
    proc = subprocess.Popen([sys.executable, str(SUITE), "--dry-run", "--out", str(tmp_path), "--parts", "4"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(200):  # until the part's own process (a new session) has started
            if len(running_with(str(tmp_path))) >= 2: break
            time.sleep(0.05)
        assert len(running_with(str(tmp_path))) >= 2, "the part never started"
        proc.terminate()
        assert proc.wait(timeout=20) == 143
        time.sleep(0.5)
        assert running_with(str(tmp_path)) == []  # the part, in its own session, did not outlive the suite
    finally:
        if proc.poll() is None: proc.kill(); proc.wait()


def test_the_long_context_diagnoses_run_dry(capsys):
    "The part 4 diagnoses (a profiled step per lever set; SDPA per backend and length, each in its own capped process)."
    sys.path.insert(0, str(SUITE.parent))
    import gpu_long_context, sdpa_lengths
    rows = gpu_long_context.main(["--dry-run", "--profile", "128"])
    assert [r["levers"] for r in rows] == list(gpu_long_context.LEVER_SETS) and all(r["seconds"] > 0 for r in rows)
    assert "Self CPU time total" in capsys.readouterr().out  # the profiler's table of the ops that took the time
    timed = sdpa_lengths.main(["--dry-run", "--backends", "default", "--cap-s", "60"])
    assert [(r["tokens"], r["backend"]) for r in timed] == [(64, "default"), (128, "default")]
    assert all(r["seconds"] > 0 for r in timed)


def test_the_long_context_suite_is_issue_48s_parts(tmp_path):
    """`--suite long-context` runs the ring pair, the levers at length, ALST, the profile and the predictor; the default
    is unchanged."""
    sys.path.insert(0, str(SUITE.parent))
    import gpu_suite
    parse = lambda *flags: gpu_suite.parse_args(["--dry-run", "--out", str(tmp_path), *flags]).parts
    assert ((parse("--suite", "long-context"), parse(), parse("--parts", "8"))
            == ([3, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6], [8]))


@pytest.fixture(scope="module")
def long_context(tmp_path_factory) -> dict:
    return suite(tmp_path_factory.mktemp("long"), "--parts", "7", "8", "9", "10")


def test_the_levers_at_length_part_reports_real_values(long_context):
    part = long_context["parts"][0]
    assert (part["part"], part["status"]) == (7, "ok"), part.get("stderr_tail")
    rows = part["result"]["rows"]
    assert [r["tokens"] for r in rows[:2]] == [128, 256] and rows[2]["point"].startswith("planner's longest fit under")
    for r in rows:  # each point measured beside the planner's figure for it
        assert r["seconds"] > 0 and 0 < r["peak_gib"] <= r["cap_gib"] and r["planned_gib"] > 0 and r["fits"]
        assert f"| {r['peak_gib'] / r['planned_gib']:.2f} |" in part["result"]["table"]


def test_the_alst_part_compares_the_same_computation(long_context):
    part = long_context["parts"][1]
    assert (part["part"], part["status"]) == (8, "ok"), part.get("stderr_tail")
    result = part["result"]
    assert [(r["side"], r["tokens"]) for r in result["rows"]] == [(s, n) for n in (128, 256) for s in
                                                                    ("ALST (DeepSpeed)", "workbench (all levers)")]
    assert all(r["seconds"] > 0 and r["peak_gib"] > 0 and r["rss_gib"] is not None for r in result["rows"])
    for alst, ours in zip(result["rows"][::2], result["rows"][1::2]):  # fp32: equal up to rounding, and really compared
        assert abs(alst["loss"] - ours["loss"]) == ours["loss_diff"] < 1e-5
        assert 0 < ours["grad_diff"] < 1e-6 < ours["grad_max"]
    assert [f["side"] for f in result["longest"]] == ["ALST (DeepSpeed)", "workbench (all levers)"]
    for f in result["longest"]:
        assert f["longest_tokens"] > 0 and f["peak_gib"] <= f["cap_gib"] and len(f["trials"]) == 3
        assert f["longest_tokens"] == max(t["tokens"] for t in f["trials"] if t["fits"])
    assert "max abs diff grad" in result["table"] and any("checkpoint_in_cpu" in why for why in result["not_run"])


def test_the_profile_part_lists_the_top_ops(long_context):
    part = long_context["parts"][2]
    assert (part["part"], part["status"]) == (9, "ok"), part.get("stderr_tail")
    row, = part["result"]["rows"]
    assert row["levers"] == "all levers" and row["seconds"] > 0 and "Self CPU time total" in row["top_ops"]
    assert row["top_ops"].count("aten::") + row["top_ops"].count("Backward") >= 5  # the ops, not an empty table


def test_the_predictor_part_holds_out_gpu_rows(long_context):
    """Part 10: the H200 fit's held-out steps (fitted on part 1's FLAN rows only) and part 7's steps predicted with the
    same factors, each error on one basis, the median and worst over all of them."""
    part = long_context["parts"][3]
    assert (part["part"], part["status"]) == (10, "ok"), part.get("stderr_tail")
    result = part["result"]
    rows = result["rows"]
    h200 = [r for r in rows if r["source"].startswith("H200 ")]
    levers = [r for r in rows if r["source"].startswith("part 7 all levers")]
    assert len(h200) == 10 and not any("flan" in r["source"] for r in h200)  # the held-out steps only
    assert [r["source"].split(", ")[1] for r in levers] == ["128 tokens (one fwd+bwd", "256 tokens (one fwd+bwd"] or \
        len(levers) == 3  # 128, 256 and the planner's longest fit
    for r in rows: assert r["predicted_s"] > 0 and abs(r["error"] - (r["measured_s"] / r["predicted_s"] - 1)) < 1e-12
    errors = sorted(abs(r["error"]) for r in rows)
    assert result["median_error"] == pytest.approx(float(__import__("numpy").median(errors)))
    assert f"median |error| {result['median_error']:.1%}" in result["table"]
    assert any("GPU's factors" in why for why in result["not_run"])  # a dry run says its part 7 errors mean nothing


def test_the_ring_pair_is_set_against_varlen(full):
    _, report = full
    sp = report["parts"][2]["result"]
    fused, varlen = sp["rows"][1], sp["rows"][2]
    ratio = fused["fwd_bwd_ms"] / varlen["fwd_bwd_ms"]
    assert f"fused ring block pair / workbench_varlen on the same row: {ratio:.1f}x" in sp["table"]
