"""workbench.launch from a real Jupyter kernel: a failing rank's own error, return values, rank output, no orphans after
failure or interrupt, nothing listening beyond loopback."""
import time

import psutil
import pytest
from jupyter_client.manager import start_new_kernel
from kernel_utils import run_cell as run


@pytest.fixture
def kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    yield km, kc
    kc.stop_channels(); km.shutdown_kernel(now=True)


SETUP = """
import time, psutil, torch, torch.distributed as dist
from workbench.launch import launch, RankError
"""


def test_failing_rank_reaches_the_notebook(kernel):
    _, kc = kernel
    run(kc, SETUP)
    t = time.time()
    out, err = run(kc, """
    def train(steps):
        for step in range(steps):
            x = torch.ones(4)
            dist.all_reduce(x)
            if dist.get_rank() == 1 and step == 2: raise ZeroDivisionError("rank 1 divided by zero at step 2")
        return steps
    launch(train, 10, num_processes=2, cpu=True)
    """)
    assert time.time() - t < 90
    assert err is not None and err[0] == "RankError"
    assert "rank 1 of 2 raised ZeroDivisionError: rank 1 divided by zero at step 2" in err[1]
    assert "in train" in err[1]  # the worker's own traceback, naming the notebook function
    out, err = run(kc, "print(len(psutil.Process().children(recursive=True)))")
    assert err is None and out.strip() == "0"
    out, err = run(kc, "print(launch(lambda a: dist.get_rank() * a, 3, num_processes=2, cpu=True, quiet=True))")
    assert err is None and out.strip() == "[0, 3]"  # the kernel still launches after a failure


def test_interrupt_leaves_no_workers(kernel):
    km, kc = kernel
    run(kc, SETUP)
    kernel_pid = int(run(kc, "import os; print(os.getpid())")[0])
    msg_id = kc.execute("launch(lambda: time.sleep(300), num_processes=2, cpu=True)")
    deadline = time.time() + 60
    while len(psutil.Process(kernel_pid).children(recursive=True)) < 2 and time.time() < deadline: time.sleep(0.5)
    assert len(psutil.Process(kernel_pid).children(recursive=True)) >= 2  # the workers are up, sleeping
    time.sleep(2)
    km.interrupt_kernel()
    deadline, error = time.time() + 60, None
    while time.time() < deadline:  # wait for the interrupted cell to finish
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id: continue
        if msg["msg_type"] == "error": error = msg["content"]["ename"]
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle": break
    assert error == "KeyboardInterrupt"  # the notebook's own interrupt, not a rank's failure
    out, err = run(kc, "print(len(psutil.Process().children(recursive=True)))")
    assert err is None and out.strip() == "0"
    assert psutil.Process(kernel_pid).children(recursive=True) == []


SOCKETS = """
import os, signal
def listening(process):
    family = [process, *process.children(recursive=True)]
    return {c.laddr.ip for p in family for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
def sockets_inside_a_collective():
    dist.all_reduce(torch.ones(1))  # every pair of ranks is connected
    print(f"rank {dist.get_rank()} is up", flush=True)
    seen = listening(psutil.Process(os.getppid())) if dist.get_rank() == 0 else None
    dist.barrier()
    return sorted(seen) if seen else None
def killed_on_rank1():
    dist.barrier()
    if dist.get_rank() == 1: os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
before = listening(psutil.Process())
"""


def test_nothing_listens_beyond_loopback_and_rank_output_shows(kernel):
    _, kc = kernel
    run(kc, SETUP)
    assert run(kc, SOCKETS)[1] is None
    out, err = run(kc, "print(launch(sockets_inside_a_collective, num_processes=2, cpu=True, quiet=True)[0])")
    assert err is None and "rank 0 is up" in out and "rank 1 is up" in out  # the ranks' prints reach the cell
    during = eval(out.strip().splitlines()[-1])
    assert during and all(ip.startswith("127.") or ip == "::1" for ip in during), during
    out, err = run(kc, "print(listening(psutil.Process()) == before)")
    assert err is None and out.strip() == "True"
    # imported before the fork, bars on in the kernel
    out, err = run(kc, "import transformers.utils.logging as hub_log\nprint(hub_log.is_progress_bar_enabled(), "
                       "launch(hub_log.is_progress_bar_enabled, num_processes=2, cpu=True, quiet=True))")
    assert err is None and out.strip().splitlines()[-1] == "True [False, False]", out  # no widget bar drawn from a fork
    out, err = run(kc, "launch(killed_on_rank1, num_processes=2, cpu=True, quiet=True)")
    assert err[0] == "RankError" and "rank 1 of 2 was killed by SIGKILL" in err[1]
    out, err = run(kc, "print(listening(psutil.Process()) == before, psutil.Process().children(recursive=True))")
    assert err is None and out.strip() == "True []"  # nothing left listening or running after a failed launch
