"""docs/warm_kernels.py: the notebooks' kernels are forks of a warm process, and otherwise behave as the plain kernel
does: the notebook's folder and environment, output from its subprocesses, interrupts, a kill that takes the kernel's
children with it, a cold kernel (and why) where the environment differs, and no warm process outliving its build."""
import asyncio
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("warm_kernels", ROOT / "docs" / "warm_kernels.py")
warm_kernels = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(warm_kernels)
ENV = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # as docs/build.py's kernels get it

PROBE = """import os, sys
print("cwd", os.getcwd()); print("path0", sys.path[0]); print("ppid", os.getppid())
print("preloaded", "torch" in sys.modules, "workbench" in sys.modules, os.environ.get("WB_PROBE"))
os.system("echo from a subprocess")"""


@pytest.fixture(scope="module", autouse=True)
def warm():
    "ENV's warm process, started before the first kernel (which would otherwise be plain: `kernel_manager_class`)."
    warm_kernels.warm_socket(ENV)


def run(folder: Path, *sources: str, env: dict = ENV, **kwargs) -> nbformat.NotebookNode:
    "A notebook of `sources` executed by nbclient in `folder` with a warm kernel for ENV; its stdout text per cell."
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    client = NotebookClient(nb, kernel_name="python3", kernel_manager_class=warm_kernels.kernel_manager_class(ENV),
                            resources={"metadata": {"path": str(folder)}}, **kwargs)
    client.execute(env=env)
    return nb


def stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")


def fields(text: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in text.splitlines() if " " in line)


def test_a_kernel_is_a_fork_of_the_warm_process_in_the_notebooks_folder(tmp_path):
    out = fields(stdout(run(tmp_path, PROBE, env={**ENV, "WB_PROBE": "seen"}).cells[0]))
    warm, _ = warm_kernels._WARM[warm_kernels.json.dumps(sorted(ENV.items()))]
    # WB_PROBE differs from the warm process's environment: a cold kernel, its own imports
    assert out["preloaded"] == "False False seen" and out["ppid"] != str(warm.pid)
    out = fields(stdout(run(tmp_path, PROBE).cells[0]))
    assert out["cwd"] == out["path0"] == str(tmp_path)
    assert out["ppid"] == str(warm.pid)
    assert out["preloaded"] == "True False None"  # torch came with the fork; the workbench is the notebook's to import
    assert out["from"] == "a subprocess"  # fd 1 of the kernel and its children reaches the notebook


def test_the_first_kernel_of_a_process_is_plain_and_the_second_starts_the_warm_process():
    env = {**ENV, "WB_PROBE": "first"}
    assert warm_kernels.kernel_manager_class(env).__name__ == "AsyncKernelManager"
    assert warm_kernels._key(env) not in warm_kernels._WARM
    assert warm_kernels.kernel_manager_class(env).__name__ == "WarmKernelManager"
    assert warm_kernels._key(env) in warm_kernels._WARM


def test_another_environment_is_a_cold_kernel_that_says_why(tmp_path, capfd):
    run(tmp_path, "print(1)", env={**ENV, "WB_PROBE": "other"})
    assert "warm kernel not used: its environment differs in ['WB_PROBE']" in capfd.readouterr().err


def test_an_interrupt_reaches_the_running_cell(tmp_path):
    start = time.monotonic()
    with pytest.raises(CellExecutionError, match="KeyboardInterrupt"):
        run(tmp_path, "import time\ntime.sleep(120)", timeout=5, interrupt_on_timeout=True)
    assert time.monotonic() - start < 60


def test_killing_the_stand_in_ends_the_kernel_and_its_children(tmp_path):
    """jupyter_client's last resort, SIGKILL to the process it launched: the kernel (a fork elsewhere) and what it
    started go too, as a plain kernel's process group would."""
    async def main():
        km = warm_kernels.kernel_manager_class(ENV)(kernel_name="python3")
        await km.start_kernel(env=ENV, cwd=str(tmp_path))
        kc = km.client(); kc.start_channels(); await kc.wait_for_ready(timeout=60)
        code = "import os, subprocess\nchild = subprocess.Popen(['sleep', '300'])\nprint(os.getpid(), child.pid)"
        pids = []
        await kc.execute_interactive(code, output_hook=lambda m: pids.extend(m["content"].get("text", "").split()))
        kc.stop_channels()
        os.kill(km.provisioner.process.pid, 9)
        return [int(p) for p in pids]
    kernel, child = asyncio.run(main())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(alive(p) for p in (kernel, child)): time.sleep(0.2)
    assert not alive(kernel) and not alive(child)


def alive(pid: int) -> bool:
    "The process runs (not gone, not a zombie awaiting its parent)."
    try: return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError): return False


def test_the_warm_process_ends_with_the_build_that_started_it():
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('w', sys.argv[1]); "
            "w = importlib.util.module_from_spec(s); s.loader.exec_module(w); import os; "
            "w.warm_socket(dict(os.environ)); print(next(iter(w._WARM.values()))[0].pid)")
    pid = int(subprocess.run([sys.executable, "-c", code, str(ROOT / "docs" / "warm_kernels.py")], capture_output=True,
                             text=True, timeout=60, check=True).stdout)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and alive(pid): time.sleep(0.2)
    assert not alive(pid)


def test_what_the_imports_print_is_caught(tmp_path):
    """A warm process whose imports printed refuses every kernel (a cold one shows the notebook that output): both
    streams, at the file descriptors, as a module writes them."""
    (tmp_path / "noisy_module.py").write_text("import os, sys\nprint('to stderr', file=sys.stderr, flush=True)\n"
                                              "os.write(1, b'to stdout\\n')")
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('w', sys.argv[1]); "
            "w = importlib.util.module_from_spec(s); s.loader.exec_module(w); w.PRELOADED = ('noisy_module',); "
            "print(repr(w._preload()))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "docs" / "warm_kernels.py")], capture_output=True,
                         text=True, timeout=60, check=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}).stdout
    assert out == repr("to stderr\nto stdout\n") + "\n"


def test_a_large_request_is_read_whole_and_a_cut_one_is_refused():
    "An environment larger than one read of the socket arrives whole; a stand-in that dies mid-request is named."
    import socket
    import threading
    request = dict(cwd="/", env={"WB_BIG": "x" * 300_000}, argv=["-f", "c.json"])
    data = warm_kernels.json.dumps(request).encode()
    for cut in (False, True):
        ours, theirs = socket.socketpair()
        with open(os.devnull) as stdio:
            def send():
                socket.send_fds(theirs, [data[:1000] if cut else data + b"\n"], [stdio.fileno()] * 3)
                theirs.close()
            sender = threading.Thread(target=send); sender.start()
            if cut:
                with pytest.raises(ConnectionError, match="closed its request after 1000 bytes"):
                    warm_kernels.read_request(ours)
            else:
                got, fds = warm_kernels.read_request(ours)
                assert got == request and len(fds) == 3
                for fd in fds: os.close(fd)
            sender.join(); ours.close()
