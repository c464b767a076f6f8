"""Processes a test starts and must end, with everything they started, also when the test times out or fails.

torchrun's workers lead sessions of their own (torch.distributed.elastic starts them with `start_new_session`), so a
SIGKILL to torchrun's process group leaves them running, orphaned. A SIGTERM lets torchrun's agent end its workers
first; SIGKILL follows only if the tree outlives `grace` seconds."""
import os
import signal
import subprocess


def end_tree(p: subprocess.Popen, grace: float = 30) -> None:
    "End `p` (started with `start_new_session=True`) and its process group: SIGTERM, then SIGKILL after `grace` s."
    if p.poll() is not None: return
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


def run_tree(cmd: list, timeout: float, **popen) -> subprocess.CompletedProcess:
    "`subprocess.run(cmd, timeout=...)` with text output captured, whose timeout ends the whole tree (`end_tree`)."
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         **popen)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        end_tree(p)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)
