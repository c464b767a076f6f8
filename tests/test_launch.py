"workbench.launch from a real Jupyter kernel: a failing rank's own error, return values, no orphans after failure or interrupt."
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
    deadline = time.time() + 60
    while time.time() < deadline:  # wait for the interrupted cell to finish
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status" \
                and msg["content"]["execution_state"] == "idle": break
    out, err = run(kc, "print(len(psutil.Process().children(recursive=True)))")
    assert err is None and out.strip() == "0"
    assert psutil.Process(kernel_pid).children(recursive=True) == []
