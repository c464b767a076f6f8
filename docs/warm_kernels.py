"""Notebook kernels forked from a warm process: each notebook of the site (and of `make test`) gets a fresh ipykernel
that did not pay torch's and transformers' imports (about 8 s of a CPU per kernel, for some sixty kernels a suite).

`python docs/warm_kernels.py serve SOCKET` is the warm process: it imports torch, transformers' modeling code and
ipykernel (no workbench module: notebooks check what importing the workbench pulls in), runs no torch op and starts
no thread of its own, then forks one kernel per request on the unix socket SOCKET. It ends when its stdin closes (the
build process that started it ended, however it ended).

`python docs/warm_kernels.py kernel SOCKET -f CONNECTION_FILE` is what jupyter_client launches instead of
`python -m ipykernel_launcher -f CONNECTION_FILE` (`WarmKernelManager`). It hands its working folder, environment and
stdin/stdout/stderr to the warm process, whose fork becomes the kernel (its own session and process group), then
stands in for it: SIGINT and SIGTERM go to the kernel's group, its exit code is this process's, and if this process
is killed (jupyter_client's last resort) the kernel kills its own group. Where the warm process is missing, refuses
(its imports printed something, which a cold kernel would show in the notebook), or runs with another environment
(its imports read it once), the stand-in execs the plain kernel instead: the notebook runs
the same either way.
"""
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRELOADED = ("torch", "transformers", "transformers.modeling_utils", "ipykernel.kernelapp")


def fixed(env) -> dict:
    """What of `env` a kernel must share with the warm process: all of it but jupyter_client's own `JPY_` variables
    (PRELOADED's imports read the rest, PYTHONPATH and the thread counts among them, once)."""
    return {k: v for k, v in env.items() if not k.startswith("JPY_")}


# ---------------------------------------------------------------- the warm process

def _preload() -> str:
    "Import PRELOADED with fd 1 and 2 captured; what they printed (a cold kernel would show it in the notebook)."
    import importlib
    with tempfile.TemporaryFile() as printed:
        saved = [os.dup(1), os.dup(2)]
        os.dup2(printed.fileno(), 1); os.dup2(printed.fileno(), 2)
        try:
            for name in PRELOADED: importlib.import_module(name)
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            for fd, copy in zip((1, 2), saved): os.dup2(copy, fd); os.close(copy)
        printed.seek(0)
        return printed.read().decode(errors="replace")


def _kernel_child(conn: socket.socket, request: dict, fds: list[int]):
    "In the fork: become the kernel the request describes, in its own session; never returns."
    code = 1
    try:
        os.setsid()  # its own process group: the stand-in signals the group, as jupyter_client signals a kernel's
        for target, fd in enumerate(fds): os.dup2(fd, target)
        for fd in fds: os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear(); os.environ.update(request["env"])
        sys.path[0] = request["cwd"]  # as `python -m` sets it
        sys.argv = ["ipykernel_launcher", *request["argv"]]
        if "JPY_PARENT_PID" in os.environ:  # ipykernel read it at import, in the warm process, where it was unset
            sys.argv.append(f"--IPKernelApp.parent_handle={os.environ['JPY_PARENT_PID']}")

        def watch_stand_in():  # its end of the socket closes only when it dies (killed): take the group down with it
            conn.recv(1)
            os.killpg(0, signal.SIGKILL)
        import threading
        threading.Thread(target=watch_stand_in, daemon=True, name="warm-kernel stand-in").start()
        from ipykernel import kernelapp
        kernelapp.launch_new_instance()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        import atexit
        atexit._run_exitfuncs()  # the kernel's own exit handlers (a cold kernel runs them at interpreter exit)
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)


def _env_diff(asked: dict, warm: dict) -> str:
    "Why a kernel with environment `asked` cannot be a fork of one warm in `warm` ('' where it can)."
    names = sorted(k for k in asked.keys() | warm.keys() if asked.get(k) != warm.get(k))
    return f"its environment differs in {names}" if names else ""


def read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """A stand-in's request: its JSON line and the stdio descriptors that came with its first bytes (a unix stream
    socket may deliver a large environment in several reads)."""
    conn.settimeout(10)  # a stand-in that stops mid-request does not hold up the other kernels
    message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    try:
        while not message.endswith(b"\n"):
            more = conn.recv(1 << 16)
            if not more: raise ConnectionError(f"the stand-in closed its request after {len(message)} bytes")
            message += more
        request = json.loads(message)
    except BaseException:
        for fd in fds: os.close(fd)
        raise
    conn.settimeout(None)
    return request, fds


def serve(path: str):
    "Preload, then fork a kernel for each request on the unix socket `path` until stdin closes."
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path); server.listen()  # a stand-in connecting now waits for the imports below
    before = dict(os.environ)
    printed = _preload()
    added = {k: v for k, v in os.environ.items() if k not in before}  # set by the imports (a cold kernel's would too)
    env = fixed(before)
    children: dict[int, socket.socket] = {}  # kernel pid -> its stand-in's connection (for the exit code)
    while True:
        ready = select.select([server, sys.stdin], [], [], 0.2)[0]
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1): break
        if server in ready:
            conn, _ = server.accept()
            try: request, fds = read_request(conn)
            except (OSError, ValueError) as e:  # a stand-in killed mid-request: it is gone, nothing to answer
                print(f"warm kernels: a request was not read ({e})", file=sys.stderr)
                conn.close(); continue
            why = (f"importing {PRELOADED} printed {printed[:300]!r}" if printed else
                   _env_diff(fixed(request["env"]), env))
            if why or len(fds) != 3:
                conn.sendall(json.dumps({"cold": why or "no stdio"}).encode() + b"\n"); conn.close()
                for fd in fds: os.close(fd)
                continue
            pid = os.fork()
            if pid == 0:
                server.close()
                for other in children.values(): other.close()
                _kernel_child(conn, {**request, "env": {**request["env"], **added}}, fds)
            for fd in fds: os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = conn
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done: continue
            conn = children.pop(pid)
            try: conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError: pass  # the stand-in is gone
            conn.close()
    for pid in children:
        try: os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError: pass  # its group ended since the last look


# ---------------------------------------------------------------- the stand-in jupyter_client launches

def _cold(argv: list[str], why: str):
    "Exec the plain kernel (the same notebook, cold imports)."
    if why: print(f"warm kernel not used: {why}", file=sys.stderr)
    os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *argv])


def stand_in(path: str, argv: list[str]):
    "Ask the warm process at `path` for a kernel with this process's folder, environment and stdio; wait for it."
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try: conn.connect(path)
    except OSError as e: _cold(argv, f"no warm process at {path} ({e})")
    request = dict(cwd=os.getcwd(), env=dict(os.environ), argv=argv)
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    reader = conn.makefile("rb")
    answer = json.loads(reader.readline() or b'{"cold": "the warm process closed the connection"}')
    if "cold" in answer:
        conn.close(); _cold(argv, answer["cold"])
    pid = answer["pid"]

    def relay(signum, frame):
        try: os.killpg(pid, signum)
        except ProcessLookupError: pass
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP): signal.signal(signum, relay)
    line = reader.readline()
    sys.exit(json.loads(line)["exit"] if line else 1)


# ---------------------------------------------------------------- the build's side

_WARM: dict[str, tuple[subprocess.Popen, str]] = {}  # environment key -> (warm process, its socket)
_ASKED: dict[str, int] = {}  # environment key -> kernels asked for


def _key(env: dict) -> str: return json.dumps(sorted(env.items()))


def warm_socket(env: dict) -> str:
    """The socket of a warm process started with `env` (one per environment, for this process's life; it ends with
    it, as its stdin closes)."""
    key = _key(env)
    if key in _WARM and _WARM[key][0].poll() is None: return _WARM[key][1]
    path = os.path.join(tempfile.mkdtemp(prefix="warm-kernels-"), "socket")
    proc = subprocess.Popen([sys.executable, __file__, "serve", path], env=env, stdin=subprocess.PIPE,
                            cwd=Path(__file__).parent)
    while not os.path.exists(path) and proc.poll() is None: time.sleep(0.01)  # it listens before it imports
    _WARM[key] = (proc, path)
    return path


def kernel_manager_class(env: dict):
    """A jupyter_client AsyncKernelManager class (nbclient's default) whose python3 kernels are forks of the warm
    process for `env`; nbclient owns and shuts down each kernel as it would a plain one. The first kernel a process
    asks for is plain: a process that runs one notebook (a build's worker with one to run) gains nothing from a warm
    process, which starts with the second."""
    from jupyter_client import AsyncKernelManager
    _ASKED[_key(env)] = _ASKED.get(_key(env), 0) + 1
    if _key(env) not in _WARM and _ASKED[_key(env)] < 2: return AsyncKernelManager
    path = warm_socket(env)

    class WarmKernelManager(AsyncKernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            cmd = super().format_kernel_cmd(extra_arguments)
            if cmd[1:3] != ["-m", "ipykernel_launcher"]: return cmd  # another kernel: as its spec says
            return [sys.executable, __file__, "kernel", path, *cmd[3:]]
    return WarmKernelManager

if __name__ == "__main__":
    if sys.argv[1] == "serve": serve(sys.argv[2])
    elif sys.argv[1] == "kernel": stand_in(sys.argv[2], sys.argv[3:])
    else: sys.exit(f"usage: {sys.argv[0]} serve SOCKET | kernel SOCKET -f CONNECTION_FILE")
