"""What a run says about itself (issue 47, part "run"): a rank stuck in Python ends the CLI with its stack. A resume's
readouts and progress bar are asserted in tests/test_dashboard.py (the same resumed run, watched); the checkpoint
digests and the float64 loss in their notebooks (08_checkpoint, 12_train)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
