"""workbench.launch under faults, from this (script) process: every launch returns within its deadline + 10 s, names the
rank that really failed and how, and leaves no process, socket or file descriptor behind."""
import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from workbench.launch import RankError, launch, progress

DEADLINE = 20  # every launch here is bounded, so a regression fails instead of hanging
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _after_a_collective(fault):
    "Both ranks meet once, then the fault strikes on rank 1 while rank 0 waits for it in a barrier."
    def fn():
        dist.all_reduce(torch.ones(1))
        if dist.get_rank() == 1: fault()
        dist.barrier()
        return dist.get_rank()
    return fn


def _raise(): raise ZeroDivisionError("rank 1 divided by zero")
def _interrupt(): raise KeyboardInterrupt
def _exit0(): os._exit(0)
def _exit3(): os._exit(3)
def _sigkill(): os.kill(os.getpid(), signal.SIGKILL)
def _segfault(): ctypes.string_at(0)
def _sys_exit(): sys.exit(0)


class _Unprintable(Exception):
    def __str__(self): raise RuntimeError("a __str__ that fails")
def _unprintable(): raise _Unprintable()


FAULTS = {  # fault on rank 1 -> (exc_type, exitcode, text the message must contain)
    _raise: ("ZeroDivisionError", None, "rank 1 of 2 raised ZeroDivisionError: rank 1 divided by zero"),
    _interrupt: ("KeyboardInterrupt", None, "rank 1 of 2 raised KeyboardInterrupt"),
    _sys_exit: ("SystemExit", None, "rank 1 of 2 raised SystemExit: 0"),
    _exit0: (None, 0, "rank 1 of 2 exited with code 0 before returning a result"),
    _exit3: (None, 3, "rank 1 of 2 exited with code 3 before returning a result"),
    _sigkill: (None, -signal.SIGKILL, "rank 1 of 2 was killed by SIGKILL (out of memory?"),
    _segfault: (None, -signal.SIGSEGV, "rank 1 of 2 was killed by SIGSEGV (a crash in native code)"),
    _unprintable: ("_Unprintable", None,
                   "rank 1 of 2 raised _Unprintable: <its message could not be printed: str() raised RuntimeError>"),
}


def _fails(fn, num_processes=2, **kw) -> tuple[RankError, float]:
    t = time.time()
    with pytest.raises(RankError) as e: launch(fn, num_processes=num_processes, cpu=True, quiet=True,
                                               deadline_s=DEADLINE, **kw)
    return e.value, time.time() - t


_OLDER: set = set()  # (pid, start time) of the processes this worker had before the test (`_older`)


@pytest.fixture(autouse=True)
def _older():
    "The worker's processes from before the test (a warm process for the notebooks' kernels may be one)."
    _OLDER.clear()
    _OLDER.update((c.pid, c.create_time()) for c in psutil.Process().children(recursive=True))


def _no_descendants():
    "No process the test started is left."
    left = [c for c in psutil.Process().children(recursive=True) if (c.pid, c.create_time()) not in _OLDER]
    assert left == []


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__[1:])
def test_fault_on_rank1_names_rank1_and_how(fault):
    err, seconds = _fails(_after_a_collective(fault))
    exc_type, exitcode, text = FAULTS[fault]
    assert seconds < DEADLINE + 10
    assert (err.rank, err.exc_type, err.exitcode) == (1, exc_type, exitcode), str(err)
    assert text in str(err)
    assert "Connection closed" not in str(err)  # rank 0's echo is never the report
    if exc_type: assert f"in {fault.__name__}" in err.worker_traceback  # the rank's own traceback
    if fault is _segfault: assert "in _segfault" in err.worker_traceback  # faulthandler's stack of the crash
    _no_descendants()


@pytest.mark.parametrize("hang", ["busy", "sleep", "after_peer_returned"])
def test_python_hang_ends_at_the_deadline_naming_the_stuck_rank(hang):
    stuck_rank = 1 if hang == "after_peer_returned" else 0  # there rank 0 has finished and waits for rank 1
    def stuck():
        dist.barrier()
        if dist.get_rank() == stuck_rank:
            if hang == "busy":
                while True: pass
            time.sleep(1e6)
        if hang != "after_peer_returned": dist.barrier()
    t = time.time()
    with pytest.raises(RankError) as e: launch(stuck, num_processes=2, cpu=True, quiet=True, deadline_s=3, timeout_s=60)
    assert time.time() - t < 3 + 10
    err = e.value
    assert err.rank == stuck_rank and err.exc_type is None and err.exitcode is None
    other = 1 - stuck_rank
    assert (f"rank {stuck_rank} of 2 was still running when the launch reached its deadline (3 s); "
            f"rank {other} waited for it") in str(err)
    assert "in stuck" in err.worker_traceback  # the line the rank was stuck on
    _no_descendants()


def test_a_stack_is_read_once_written_whole(tmp_path):
    """faulthandler writes a stack piece by piece; read mid-write ("Current thread 0x", the rest 0.5 s later) a rank
    waiting in `_all_finished` looked stuck and was blamed (a flake of the deadline test above)."""
    import multiprocessing as mp
    from workbench.launch import _stacks, _waits
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    def rank():
        def dump(*_):
            with open(tmp_path / "stack0.txt", "a") as f:
                f.write("Current thread 0x00007f0000000000"); f.flush()
                time.sleep(0.5)
                f.write(' (most recent call first):\n  File "launch.py", line 9 in _all_finished\n'
                        '  File "launch.py", line 1 in _rank_main\n')
        signal.signal(signal.SIGUSR1, dump)
        ready.set()
        time.sleep(60)
    p = ctx.Process(target=rank)
    p.start()
    try:
        assert ready.wait(30)
        stack = _stacks({0: p}, tmp_path)[0]
    finally:
        p.kill(); p.join()
    assert " in _all_finished" in stack and _waits(stack), stack


def test_a_rank_that_never_calls_progress_is_ended_at_the_stall_limit_with_its_stack():
    "No progress() call at all: the clock runs from the launch's start; the rank not in a collective is named."
    def silent():
        if dist.get_rank() == 1: time.sleep(1e6)
        dist.barrier()
    with pytest.raises(RankError) as e:
        launch(silent, num_processes=2, cpu=True, quiet=True, stall_s=1, deadline_s=DEADLINE)
    err = e.value
    assert (err.rank, err.exc_type, err.exitcode) == (1, None, None), str(err)
    assert "rank 1 of 2 made no progress within stall_s=1 (no progress() call since the launch started" in str(err)
    assert "rank 0 waited for it" in str(err) and "in silent" in err.worker_traceback
    _no_descendants()


def test_progress_keeps_a_run_longer_than_the_stall_limit_alive():
    """Rank 1 steps past stall_s in all, calling progress() each step; rank 0 has returned at once: a finished rank
    waits, it does not stall."""
    def steps():
        for _ in range(5 if dist.get_rank() == 1 else 0):
            progress(); time.sleep(0.4)
        return dist.get_rank()
    assert launch(steps, num_processes=2, cpu=True, quiet=True, stall_s=1, deadline_s=DEADLINE) == [0, 1]
    progress()  # outside a launched rank: nothing


@pytest.mark.parametrize("stall_s", [0, -1, float("nan")])
def test_a_stall_limit_that_is_not_positive_seconds_is_refused(stall_s):
    with pytest.raises(ValueError, match="stall_s=.*: the seconds a rank may go without calling progress"):
        launch(lambda: 0, num_processes=2, cpu=True, stall_s=stall_s)


def _start_workers(pids: str):
    "Start what a rank may leave behind: a child (a subprocess), and a grandchild whose parent has exited (an orphan)."
    child = subprocess.Popen(["sleep", "600"])
    orphan = subprocess.run("sleep 600 > /dev/null 2>&1 & echo $!", shell=True, capture_output=True,
                            text=True).stdout.strip()
    with open(f"{pids}{dist.get_rank()}", "w") as f: f.write(f"{child.pid} {orphan}")


def _survivors(pids: str, n: int = 2) -> list[int]:
    "The workers `_start_workers` started in `n` ranks that are still alive (killed here, so a failure leaves nothing)."
    started = [int(p) for r in range(n) for p in open(f"{pids}{r}").read().split()]
    alive = [p for p in started if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    for p in alive: os.kill(p, signal.SIGKILL)
    return alive


@pytest.mark.parametrize("ending", ["rank 1 fails", "both return"])
def test_no_worker_a_rank_started_outlives_the_launch(ending, tmp_path):
    "A rank that exits leaves its workers as orphans, no longer its children: the reaper ends them by the rank's group."
    def with_workers():
        _start_workers(str(tmp_path / "pids"))
        dist.barrier()
        if ending == "rank 1 fails" and dist.get_rank() == 1: raise ValueError("rank 1 fails with its workers running")
        dist.barrier()
    if ending == "rank 1 fails": assert _fails(with_workers)[0].rank == 1
    else: launch(with_workers, num_processes=2, cpu=True, quiet=True, deadline_s=DEADLINE)
    assert _survivors(str(tmp_path / "pids")) == []


def test_a_process_group_already_open_here_is_refused_with_its_fix():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError,
                           match="a torch.distributed process group is already open in this process") as e:
            launch(lambda: 0, num_processes=2, cpu=True, quiet=True, deadline_s=DEADLINE)
    finally: dist.destroy_process_group()
    assert "destroy_process_group() first, or call launch from a process without one" in str(e.value)
    _no_descendants()


def test_four_ranks_name_the_one_that_vanished():
    def vanish_on_rank2():
        dist.all_reduce(torch.ones(1))
        if dist.get_rank() == 2: os._exit(3)
        dist.all_reduce(torch.ones(1))
    err, _ = _fails(vanish_on_rank2, num_processes=4)
    assert (err.rank, err.world_size, err.exitcode) == (2, 4, 3), str(err)
    _no_descendants()


def test_unpicklable_return_names_the_rank_and_the_type():
    err, _ = _fails(lambda: threading.Lock() if dist.get_rank() == 1 else 0)
    assert (err.rank, err.exc_type) == (1, "TypeError")
    assert "its return value, a _thread.lock, cannot be pickled back to the notebook" in str(err)
    _no_descendants()


@pytest.mark.parametrize("limits",
                         [dict(deadline_s=0), dict(deadline_s=-1), dict(timeout_s=0), dict(timeout_s=float("nan"))])
def test_limits_that_are_not_positive_seconds_are_refused_before_any_fork(limits):
    with pytest.raises(ValueError, match="both are seconds > 0"): launch(lambda: 0, num_processes=2, cpu=True, **limits)
    _no_descendants()


def test_a_function_that_destroys_the_process_group_itself_returns():
    "Code written for torchrun ends with destroy_process_group(); the launcher must not trip over it."
    def tidy():
        dist.barrier(); dist.destroy_process_group()
        return dist.is_initialized()
    assert launch(tidy, num_processes=2, cpu=True, quiet=True, deadline_s=DEADLINE) == [False, False]


def test_a_collective_timeout_ends_the_launch_without_a_deadline_naming_the_stuck_rank():
    """Without a deadline, a rank that never reaches a collective
    ends the launch once its peer's wait times out, and is named."""
    def late():
        if dist.get_rank() == 0: time.sleep(1e6)
        dist.barrier()
    t = time.time()
    with pytest.raises(RankError) as e: launch(late, num_processes=2, cpu=True, quiet=True, timeout_s=3)
    assert time.time() - t < 3 + 10
    assert e.value.rank == 0 and e.value.exc_type is None  # rank 0 never raised: it slept outside the barrier
    assert "rank 1" in e.value.cause and "Timed out" in e.value.cause and "time.sleep" not in e.value.cause
    assert "in late" in e.value.worker_traceback  # rank 0's own stack, at the line that sleeps
    _no_descendants()


def test_a_peer_that_vanishes_just_after_the_timeout_is_named_with_its_exit_code():
    "The collective times out on rank 1 a moment before rank 0 exits by itself: rank 0 and its exit code are the news."
    def late_exit():
        if dist.get_rank() == 0: time.sleep(4); os._exit(3)
        dist.barrier()
    with pytest.raises(RankError) as e: launch(late_exit, num_processes=2, cpu=True, quiet=True, timeout_s=3)
    assert e.value.rank == 0 and e.value.exitcode == 3, e.value
    _no_descendants()


def test_mismatched_collectives_report_the_raise():
    "When every peer waits in a collective (they do not match), the rank whose collective failed is reported as it is."
    def mismatched():
        if dist.get_rank() == 0: dist.barrier()
        else: dist.broadcast(torch.zeros(1), src=0)
        dist.barrier()
    with pytest.raises(RankError) as e: launch(mismatched, num_processes=2, cpu=True, quiet=True, timeout_s=3)
    assert e.value.exc_type is not None
    _no_descendants()


def _listening(pid: int) -> set[str]:
    "Addresses that the process `pid` and its descendants listen on."
    root = psutil.Process(pid)
    return {c.laddr.ip for p in [root, *root.children(recursive=True)] for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def _loopback(ip: str) -> bool: return ip.startswith("127.") or ip == "::1"


def _sockets_inside_a_collective():
    dist.all_reduce(torch.ones(1))  # every pair of ranks is connected
    seen = _listening(os.getppid()) if dist.get_rank() == 0 else None
    dist.barrier()  # no rank leaves before rank 0 has looked
    return seen


def _public_interface() -> str | None:
    "A network interface of this machine with a non-loopback IPv4 address, if any."
    return next((name for name, addrs in psutil.net_if_addrs().items()
                 if any(a.family.name == "AF_INET" and not _loopback(a.address) for a in addrs)), None)


def test_nothing_listens_beyond_loopback_during_or_after_a_launch(monkeypatch):
    public = _public_interface()
    if public: monkeypatch.setenv("GLOO_SOCKET_IFNAME", public)  # a user's multi-node setting: ignored on one node
    before = _listening(os.getpid())
    during = launch(_sockets_inside_a_collective, num_processes=2, cpu=True, quiet=True, deadline_s=DEADLINE)[0]
    assert len(during) >= 1 and all(_loopback(ip) for ip in during), during  # the store's socket and gloo's pairs
    assert _listening(os.getpid()) == before
    _fails(_after_a_collective(_sigkill))
    assert _listening(os.getpid()) == before  # nothing left after a failed launch either


def test_the_socket_check_sees_a_public_listener():
    "The check above can fail: a gloo group bound to a public interface inside the launch is seen."
    public = _public_interface()
    assert public, "this machine has no non-loopback interface to bind to"
    def exposed():
        os.environ["GLOO_SOCKET_IFNAME"] = public
        group = dist.new_group(backend="gloo")  # its device is built from the environment now
        dist.barrier(group=group)
        return _sockets_inside_a_collective()
    during = launch(exposed, num_processes=2, cpu=True, quiet=True, deadline_s=DEADLINE)[0]
    assert not all(_loopback(ip) for ip in during), during


def test_twenty_launches_in_a_row_leave_nothing():
    launch(lambda: 0, num_processes=2, cpu=True, quiet=True)  # imports and first-use allocations
    me = psutil.Process()
    fds, threads, sockets = me.num_fds(), me.num_threads(), len(me.net_connections(kind="inet"))
    faults = [_raise, _sigkill, _exit3, _segfault]
    for i in range(20):
        if i % 2: assert launch(lambda r: dist.get_rank() * r, i, num_processes=2, cpu=True, quiet=True) == [0, i]
        else:
            err, _ = _fails(_after_a_collective(faults[i // 2 % len(faults)]))
            assert err.rank == 1, str(err)
        _no_descendants()
    assert (me.num_fds(), me.num_threads(), len(me.net_connections(kind="inet"))) == (fds, threads, sockets)


def _script(body: str) -> subprocess.Popen:
    "Run a launch in a fresh Python process of its own session (so a signal to its group spares pytest)."
    code = "import os, time, torch.distributed as dist\nfrom workbench.launch import launch\n" + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _ranks_of(proc: subprocess.Popen, n: int = 2) -> list[psutil.Process]:
    "The ranks once `n` of them run, after the launcher has set them up."
    end = time.time() + 60
    while time.time() < end:
        ranks = psutil.Process(proc.pid).children()
        if len(ranks) >= n: time.sleep(1); return psutil.Process(proc.pid).children()
        time.sleep(0.1)
    proc.kill(); raise AssertionError(f"no {n} ranks after 60 s: {proc.communicate()}")


def _gone(procs: list[psutil.Process], timeout: float = 10) -> bool:
    "Whether every process in `procs` ends within `timeout`; any that does not is killed, so a failure leaves nothing."
    alive = psutil.wait_procs(procs, timeout=timeout)[1]
    for p in alive: p.kill()
    return not alive


def test_ctrl_c_in_the_parent_raises_keyboardinterrupt_and_leaves_no_rank():
    proc = _script("launch(lambda: time.sleep(1e6), num_processes=2, cpu=True)")
    ranks = _ranks_of(proc)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal (or Jupyter's interrupt) does: the whole group
    try: _, err = proc.communicate(timeout=30)
    finally: proc.kill()
    assert err.rstrip().endswith("KeyboardInterrupt") and "RankError" not in err, err
    assert _gone(ranks)


def test_ctrl_c_leaves_no_worker_a_rank_started(tmp_path):
    pids = str(tmp_path / "pids")
    proc = _script(f"""
        from tests.test_launch_faults import _start_workers
        def with_workers(): _start_workers({pids!r}); time.sleep(1e6)
        launch(with_workers, num_processes=2, cpu=True)""")
    end = time.time() + 60
    while not all(os.path.exists(f"{pids}{r}") for r in range(2)) and time.time() < end: time.sleep(0.1)
    time.sleep(0.5)  # the pid files are written, the workers run
    os.killpg(proc.pid, signal.SIGINT)
    try: _, err = proc.communicate(timeout=30)
    finally: proc.kill()
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    assert _survivors(pids) == []


def _threads_taking_sigint(pid: int) -> list[int]:
    """The threads of `pid` other than its main one that do not block
    SIGINT: Linux may hand a process's Ctrl-C to any of them."""
    taking = []
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        status = open(f"/proc/{pid}/task/{tid}/status").read()
        blocked = int(next(l for l in status.splitlines() if l.startswith("SigBlk:")).split()[1], 16)
        if tid != pid and not blocked & (1 << (signal.SIGINT - 1)): taking.append(tid)
    return taking


def test_ctrl_c_that_linux_hands_to_another_thread_of_the_parent_ends_the_launch():
    """A wait with no limit hears it only when every rank has ended
    (here: never); the launch wakes every WAKE_S to run it."""
    proc = _script("launch(lambda: time.sleep(1e6), num_processes=2, cpu=True)")
    ranks = _ranks_of(proc)
    taking = _threads_taking_sigint(proc.pid)
    assert taking, "the launching process has no other thread that takes SIGINT: this test sees nothing"
    # no Python API sends to another process's thread
    ctypes.CDLL(None, use_errno=True).tgkill(proc.pid, taking[0], signal.SIGINT)
    try: _, err = proc.communicate(timeout=30)
    finally: proc.kill()
    assert err.rstrip().endswith("KeyboardInterrupt") and "RankError" not in err, err
    assert _gone(ranks)


def test_ranks_die_with_a_killed_parent():
    proc = _script("launch(lambda: time.sleep(1e6), num_processes=2, cpu=True)")
    ranks = _ranks_of(proc)
    proc.kill(); proc.communicate(timeout=30)  # SIGKILL: the parent's finally never runs
    assert _gone(ranks)


def test_importing_the_launcher_keeps_the_cuda_check_off_the_driver():
    """On the H200, `python -m workbench.train` failed in every forked rank ("Cannot re-initialize CUDA in forked
    subprocess"): torch.cuda.is_available() in the parent had started CUDA's driver. Importing any entry point that
    forks (the launcher, the trainer) makes torch ask NVML instead, unless the user set the switch themselves."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    for module in ("workbench.launch", "workbench.train"):
        code = f"import os, {module}; print(os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK'))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert out.stdout.strip() == "1", (module, out.stderr[-800:])
    kept = subprocess.run([sys.executable, "-c", "import os, workbench.launch; "
                                                 "print(os.environ['PYTORCH_NVML_BASED_CUDA_CHECK'])"],
                          capture_output=True, text=True, env={**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "0"},
                          timeout=120)
    assert kept.stdout.strip() == "0"
