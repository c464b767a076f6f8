"""What a run says about itself (issue 47, part "run"): a resume's readouts cover its own steps, its progress bar shows
the loss, and a rank stuck in Python ends the CLI with its stack. The checkpoint digests and the float64 loss are
asserted in their notebooks (08_checkpoint, 12_train)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_resume_reads_out_its_own_steps_and_the_bar_shows_the_loss(tmp_path, capfd):
    """An SP=2 segment, then a one-process resume into the same --out: the memory readout names rank 0 alone, and every
    predicted number is set beside the resumed segment's own measured step (its first left out as warm-up)."""
    from workbench.config import TrainConfig
    from workbench.tracking import read_metrics
    from workbench.train import run
    common = dict(data="orca_like", max_tokens=256, out=str(tmp_path / "run"))
    run(TrainConfig(ulysses=2, steps=2, **common))
    capfd.readouterr()
    losses = run(TrainConfig(steps=4, resume=True, **common))
    said = capfd.readouterr().out
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


STUCK = """
import sys, time
import workbench.train as T
real = T.train_step
def stuck(rank_run, step, bins, started):
    if step == 1: time.sleep(3600)  # a rank stuck in Python: no collective waits for it, so no timeout_s fires
    return real(rank_run, step, bins, started)
T.train_step = stuck
T.main(sys.argv[1:])
"""


def test_a_rank_stuck_in_python_ends_the_cli_with_its_stack(tmp_path):
    """Without --stall-s the CLI would wait for ever (issue 47); with it, the stuck rank is named with the line it is
    stuck on."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", STUCK, "--steps", "3", "--max-tokens", "256", "--data", "orca_like",
                        "--out", str(tmp_path / "run"), "--stall-s", "3"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 1, r.stderr[-3000:]
    assert ("RankError: rank 0 of 1 made no progress within stall_s=3 (its last progress() call was"
            in r.stderr), r.stderr[-3000:]
    assert 'File "<string>", line 6 in stuck' in r.stderr, r.stderr[-3000:]  # the stack: the very line it is stuck on
