"workbench.train end to end: SP from a real Jupyter kernel equals one process, live metrics, CLI and torchrun agree."
import json
import subprocess
import sys
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel
from kernel_utils import run_cell

ROOT = Path(__file__).resolve().parent.parent


def test_sp_from_a_kernel_equals_one_process_and_the_dashboard_sees_every_step(tmp_path):
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        out, err = run_cell(kc, f"""
        import json
        from workbench.train import TrainConfig, run
        from workbench.dashboard import Dashboard
        one = run(TrainConfig(steps=3, max_tokens=512, out="{tmp_path}/sp1", name="SP=1"))
        dash = Dashboard("{tmp_path}/sp1", "{tmp_path}/sp2").watch(0.2)   # live while SP=2 runs
        two = run(TrainConfig(steps=3, max_tokens=512, sp=2, out="{tmp_path}/sp2", name="SP=2"))
        dash.stop()
        print(json.dumps({{"one": one, "two": two, "loss_traces": [list(t.y) for t in dash.loss.data],
                          "memory_traces": sorted(t.name for t in dash.memory.data), "progress": dash.progress.value}}))
        """)
        assert err is None, err
        r = json.loads(out.strip().splitlines()[-1])
        assert len(r["one"]) == len(r["two"]) == 3
        assert all(abs(a - b) <= 1e-5 for a, b in zip(r["one"], r["two"])), (r["one"], r["two"])
        assert r["loss_traces"] == [r["one"], r["two"]]  # every step of both runs reached the dashboard
        assert r["memory_traces"] == ["SP=1 planned", "SP=1 rank 0", "SP=2 planned", "SP=2 rank 0", "SP=2 rank 1"]
        assert r["progress"] == 3
    finally:
        kc.stop_channels(); km.shutdown_kernel(now=True)


def _losses(out: Path) -> list[float]:
    from workbench.dashboard import METRIC_KEYS
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(tuple(r) == METRIC_KEYS for r in rows)  # what the trainer writes is what the dashboard reads
    return [r["loss"] for r in sorted(rows, key=lambda r: r["step"]) if r["rank"] == 0]


def test_cli_self_launch_torchrun_and_sharded_agree(tmp_path):
    args = ["--sp", "2", "--steps", "2", "--max-tokens", "512", "--data", "orca_like", "--model", "qwen2"]
    subprocess.run([sys.executable, "-m", "workbench.train", "--nproc", "2", "--out", str(tmp_path / "self"), *args],
                   check=True, cwd=ROOT, timeout=240)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "-m", "workbench.train", "--out", str(tmp_path / "torchrun"), *args],  # dp from WORLD_SIZE
                   check=True, cwd=ROOT, timeout=240)
    subprocess.run([sys.executable, "-m", "workbench.train", "--nproc", "2", "--shard", "--out", str(tmp_path / "sharded"),
                    *args], check=True, cwd=ROOT, timeout=240)
    a, b, c = _losses(tmp_path / "self"), _losses(tmp_path / "torchrun"), _losses(tmp_path / "sharded")
    assert len(a) == len(b) == len(c) == 2
    assert all(abs(x - y) <= 1e-6 for x, y in zip(a, b)), (a, b)
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(c, a)), (c, a)  # FSDP2-sharded states: the same steps
