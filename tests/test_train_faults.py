"""workbench.train never loses work: kill -9 at seeded points (inside the save
too), kill one rank of two, Ctrl-C; every resume equals an uninterrupted run."""
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6
ARGS = ["--steps", str(STEPS), "--max-tokens", "256", "--save-every", "1", "--data", "orca_like"]
TIMEOUT = 120

# Run by the single-process trials instead of `python -m workbench.train`: it makes the trainer SIGKILL itself at the
# k-th call of one write (a fault the test chooses; the library has no such switch), then runs the normal CLI.
FAULTS = r'''
import io, os, pathlib, signal, sys
import torch
import workbench.checkpoint as C
import workbench.train as T
calls = [0]
def due():
    calls[0] += 1
    return calls[0] == k
def die(): os.kill(os.getpid(), signal.SIGKILL)
if point == "in torch.save":                       # half of state.pt written, then killed
    real_save = torch.save
    def save(obj, f, *a, **kw):
        if not due(): return real_save(obj, f, *a, **kw)
        buf = io.BytesIO(); real_save(obj, buf); f.write(buf.getvalue()[: len(buf.getvalue()) // 2]); f.flush(); die()
    torch.save = save
elif point == "before the manifest":                 # state.pt complete, manifest not yet written
    real_write = C._write_synced
    def write(path, fn):
        if path.name == "manifest.json" and due(): die()
        return real_write(path, fn)
    C._write_synced = write
elif point == "before the rename":                   # the whole checkpoint flushed in its temporary directory
    real_rename = pathlib.Path.rename
    def rename(self, target):
        if self.name.startswith(".tmp-") and due(): die()
        return real_rename(self, target)
    pathlib.Path.rename = rename
elif point == "while pruning":                       # the new checkpoint in place, an old one half deleted
    real_rmtree = C.shutil.rmtree
    def rmtree(path, *a, **kw):
        if pathlib.Path(path).name.startswith("step-") and due():
            next(f for f in sorted(pathlib.Path(path).rglob("*")) if f.is_file()).unlink(); die()
        return real_rmtree(path, *a, **kw)
    C.shutil.rmtree = rmtree
elif point == "in save_pretrained":                  # state.pt complete, half of model/model.safetensors written
    real_model = C.save_model_dir
    def save_model(model, weights, where, tokenizer=None):
        path = real_model(model, weights, where, tokenizer)
        if not due(): return path
        f = path / "model.safetensors"; f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]); die()
    C.save_model_dir = save_model
elif point == "slow save":                           # every save takes `k` seconds (not a kill: a slow disk)
    import time
    real_save = torch.save
    def save(obj, f, *a, **kw):
        time.sleep(k); return real_save(obj, f, *a, **kw)
    torch.save = save
elif point == "mid metrics line":                    # half a JSON line in metrics.jsonl
    real_metrics = T.write_metrics
    def metrics(out, **row):
        if not due(): return real_metrics(out, **row)
        with (out / "metrics.jsonl").open("a") as f: f.write(str(row)[:20]); f.flush()
        die()
    T.write_metrics = metrics
'''
# Every run of this file is `workbench.train.main(args)` (what `python -m workbench.train` runs) in a fresh fork of one
# interpreter that imported torch and workbench.train once and tokenized the runs' sample: ~8 s of imports and 1.2 s of
# tokenizing per run saved. It forks nothing else before (no thread, no torch op), as launch forks its ranks. Each job:
# a JSON line {point, k, args, err} on stdin; the child takes its own session (a terminal's Ctrl-C reaches its group),
# installs the fault `point` at call `k` (FAULTS), runs main with stderr to `err`; the zygote answers the child's pid,
# then its exit code as subprocess reports it.
ZYGOTE = r'''
import json, os, signal, sys, traceback
import torch
import datasets  # what a rank's first model load imports (workbench.tiny_models.no_hf_bars): once, here
import workbench.train as T
from workbench.samples import load_sample, load_tokenizer
load_sample("orca_like", load_tokenizer())  # tokenized once here (load_sample keeps it): every fork reads it
FAULTS = open(sys.argv[1]).read()
while line := sys.stdin.readline():
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            signal.signal(signal.SIGINT, signal.default_int_handler)  # a Python process's own, whatever pytest's is
            err = os.open(job["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC); os.dup2(err, 2); os.close(err)
            null = os.open(os.devnull, os.O_RDWR); os.dup2(null, 0); os.dup2(null, 1); os.close(null)
            if job["point"]: exec(FAULTS, {"point": job["point"], "k": job["k"]})
            T.main(job["args"]); code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str): print(e.code, file=sys.stderr)
        except BaseException: traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush(); os._exit(code)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
'''


class _Run:
    "One job of the zygote: pid, poll(), wait(), returncode and stderr, as of a subprocess.Popen."
    def __init__(self, zygote, pid: int, err: Path):
        self.zygote, self.pid, self.err, self.returncode = zygote, pid, err, None

    def poll(self):
        if self.returncode is None:
            line = self.zygote._line(0)
            if line is not None: self.returncode = int(line)
        return self.returncode

    def wait(self, timeout=TIMEOUT):
        if self.returncode is None:
            line = self.zygote._line(timeout)
            if line is None: raise subprocess.TimeoutExpired("zygote job", timeout)
            self.returncode = int(line)
        return self.returncode

    @property
    def stderr(self) -> str: return self.err.read_text()


class _Zygote:
    def __init__(self, tmp: Path):
        self.tmp, self.n, self.buf = tmp, 0, b""
        (tmp / "faults.py").write_text(FAULTS)
        self.p = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(tmp / "faults.py")], cwd=ROOT, env=_env(),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)

    def _line(self, timeout: float):
        "The zygote's next line, or None after `timeout` seconds."
        end = time.time() + timeout
        while b"\n" not in self.buf:
            ready = select.select([self.p.stdout], [], [], max(0.0, end - time.time()))[0]
            if not ready: return None
            chunk = os.read(self.p.stdout.fileno(), 4096)
            if not chunk: raise RuntimeError(f"the zygote died (exit {self.p.wait()})")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def start(self, args, point: str = "", k: int = 0) -> _Run:
        self.n += 1; err = self.tmp / f"err{self.n}.txt"
        self.p.stdin.write((json.dumps(dict(point=point, k=k, args=[str(a) for a in args], err=str(err)))
                            + "\n").encode())
        pid = self._line(TIMEOUT)
        assert pid is not None, "the zygote did not fork"
        return _Run(self, int(pid), err)

    def close(self):
        self.p.stdin.close(); self.p.wait(timeout=30)


_ZYGOTE: list[_Zygote] = []


@pytest.fixture(scope="module", autouse=True)
def zygote(tmp_path_factory):
    z = _Zygote(tmp_path_factory.mktemp("zygote"))
    _ZYGOTE.append(z)
    yield z
    _ZYGOTE.remove(z); z.close()
POINTS = ("in torch.save", "in save_pretrained", "before the manifest", "before the rename", "while pruning",
          "mid metrics line", "after n rows")


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _cli(*args, point: str = "", k: int = 0) -> subprocess.CompletedProcess:
    """`python -m workbench.train *args` to its end (in a fork of
    the zygote), with the fault `point` at call `k` if given."""
    run = _ZYGOTE[0].start(args, point, k)
    code = run.wait(TIMEOUT)
    return subprocess.CompletedProcess(args, code, "", run.stderr)


def _rows(out: Path) -> list[dict]:
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def _check_against(out: Path, reference: list[dict], rtol: float = 0.0):
    "Each (step, rank) exactly once, and every loss equal to the uninterrupted run's within 1e-6 (or `rtol` relative)."
    rows = _rows(out)
    keys = [(r["step"], r["rank"]) for r in rows]
    assert sorted(keys) == sorted((r["step"], r["rank"]) for r in reference), keys
    want = {(r["step"], r["rank"]): r["loss"] for r in reference}
    diffs = [(abs(r["loss"] - want[r["step"], r["rank"]]), abs(want[r["step"], r["rank"]])) for r in rows]
    assert all(d <= 1e-6 + rtol * w for d, w in diffs), diffs
    return max(d for d, _ in diffs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    r = _cli(*ARGS, "--out", str(out))
    assert r.returncode == 0, r.stderr
    return _rows(out)


def _left(out: Path) -> int:
    "Steps still to train: after the newest complete checkpoint."
    from workbench.checkpoint import latest_checkpoint
    found = latest_checkpoint(out, say=lambda _: None)
    return STEPS - (found[1]["step"] if found else 0)


def _killed_run(tmp: Path, out: Path, point: str, k: int, resume: bool) -> int:
    """The trainer killed at the k-th call of `point` in its rank,
    or (after k more rows) the CLI process itself; -SIGKILL or 0."""
    args = [*ARGS, "--out", str(out), *(["--resume"] if resume else [])]
    if point == "after n rows":
        p = _ZYGOTE[0].start(args)
        try:
            _wait_rows(out, STEPS - _left(out) + k, time.time() + TIMEOUT)
            os.kill(p.pid, signal.SIGKILL)
        finally: code = p.wait(timeout=TIMEOUT)
        return code
    r = _cli(*args, point=point, k=k)
    # the self-kill lands in the rank that trains (launch forks it): the CLI must exit 1 naming it and its signal
    killed = r.returncode == 1 and "rank 0 of 1 was killed by SIGKILL" in r.stderr
    assert r.returncode == 0 or killed, r.stderr[-3000:]
    return -signal.SIGKILL if killed else 0


@pytest.mark.parametrize("chain", range(3))
def test_kill_9_at_seeded_points_then_resume_equals_uninterrupted(tmp_path, reference, chain):
    "Each chain kills the trainer 4 times at seeded points (resuming after each), then resumes to the end: 12 kills."
    rng, out, report = random.Random(chain), tmp_path / "run", []
    for i in range(4):
        left = _left(out)  # k stays within the calls still to come, so every fault fires before the run ends
        point = rng.choice(POINTS if left >= 4 else [p for p in POINTS if p != "while pruning"])
        k = rng.randint(1, left - 3 if point == "while pruning" else left - 1 if point == "after n rows" else left)
        code = _killed_run(tmp_path, out, point, k, resume=i > 0)
        report.append((point, k, code))
        assert code == -signal.SIGKILL, report
    r = _cli(*ARGS, "--out", str(out), "--resume")
    assert r.returncode == 0, (report, r.stderr[-3000:])
    worst = _check_against(out, reference)
    from workbench.checkpoint import checkpoints
    complete = [d.name for d, m in checkpoints(out) if m is not None]
    # --keep 2 (a half-pruned one is ignored)
    assert complete == [f"step-{STEPS - 1:06d}", f"step-{STEPS:06d}"], complete
    assert not list((out / "checkpoints").glob(".tmp-*"))
    print(f"chain {chain}: {report}, resumed, max |loss diff| {worst:.1e}")


def _ranks(p: subprocess.Popen, n: int, deadline: float) -> list[psutil.Process]:
    """The rank processes, once all `n` exist: the launcher forks them in rank order,
    so by pid they are ranks 0, 1, ... (call it once the ranks train: `workbench.cost`
    measures the CPU in forks of the launcher before it launches them)"""
    while time.time() < deadline:
        mine = psutil.Process(p.pid).cmdline()
        found = [c for c in psutil.Process(p.pid).children(recursive=True) if c.cmdline() == mine]
        if len(found) == n: return sorted(found, key=lambda c: c.pid)
        if p.poll() is not None: raise RuntimeError(f"the run ended (exit {p.returncode}) before its ranks were seen")
        time.sleep(0.02)
    raise TimeoutError("the ranks never appeared")


def _wait_rows(out: Path, n: int, deadline: float):
    while time.time() < deadline:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= n: return
        time.sleep(0.01)
    raise TimeoutError(f"fewer than {n} metrics rows")


ARGS_2 = [*ARGS[2:], "--steps", str(2 * STEPS), "--nproc", "2", "--ulysses", "2"]  # 12 steps: room to kill mid-run


@pytest.fixture(scope="module")
def reference_2(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref2")
    r = _cli(*ARGS_2, "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    return _rows(out)


def _interrupt_two_ranks(out: Path, fault: str, rows: int, resume: bool, extra=()) -> int:
    "Start an SP=2 run, wait for `rows` new metrics rows, then `fault` (kill -9 rank 0 / rank 1, or SIGINT the group)."
    before = len(_rows(out)) if (out / "metrics.jsonl").exists() else 0
    p = _ZYGOTE[0].start([*ARGS_2, *extra, "--out", str(out), *(["--resume"] if resume else [])])  # its own session
    try:
        deadline = time.time() + TIMEOUT
        _wait_rows(out, before + rows, deadline)
        ranks = _ranks(p, 2, deadline)  # once training runs: before it, the launcher's CPU measurement forks look alike
        if fault == "SIGINT": os.killpg(p.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches every process of the group
        else: ranks[int(fault[-1])].kill()
        code = p.wait(timeout=60)  # the launcher notices and stops every rank
        err = p.stderr
        _, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, f"ranks left running after {fault}: {alive}"
    finally:
        if p.poll() is None: os.killpg(p.pid, signal.SIGKILL); p.wait(timeout=10)
    assert code != 0, f"the run finished before the fault ({fault} after {rows} rows)"
    if fault == "SIGINT": assert "interrupted" in err, err[-2000:]
    return code


@pytest.mark.parametrize("trial", range(3))
def test_kill_one_rank_of_two_or_ctrl_c_then_resume_equals_uninterrupted(tmp_path, reference_2, trial):
    """Two faults per trial on an SP=2 run (kill -9 of a seeded rank,
    or SIGINT to the group), each after a seeded number of rows."""
    rng, out, report = random.Random(100 + trial), tmp_path / "run", []
    for i in range(2):
        fault = "SIGINT" if (trial, i) in ((0, 1), (2, 0)) else f"kill -9 rank {rng.randint(0, 1)}"
        rows = rng.randint(1, 6)  # of 24 (12 steps x 2 ranks), so the fault always lands mid-run
        report.append((fault, rows, _interrupt_two_ranks(out, fault, rows, resume=i > 0)))
    r = _cli(*ARGS_2, "--out", str(out), "--resume")
    assert r.returncode == 0, (report, r.stderr[-3000:])
    worst = _check_against(out, reference_2)
    print(f"SP=2 trial {trial}: {report}, resumed, max |loss diff| {worst:.1e}")


def test_sharded_run_killed_resumes_to_the_same_losses(tmp_path, reference_2):
    """FSDP2-sharded states: kill -9 rank 1 mid-run, resume; the same
    steps as the unsharded run (FSDP2 sums in another order)."""
    out = tmp_path / "run"
    code = _interrupt_two_ranks(out, "kill -9 rank 1", 4, resume=False, extra=["--shard"])
    r = _cli(*ARGS_2, "--shard", "--out", str(out), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    worst = _check_against(out, reference_2, rtol=1e-5)
    print(f"sharded: kill -9 rank 1 after 4 rows, exit {code}, resumed, max |loss diff| {worst:.1e}")


def test_a_save_slower_than_the_collective_timeout_does_not_kill_the_run(tmp_path):
    "Each save sleeps 6 s under a 3 s collective timeout: the other rank waits outside the timed collectives."
    out = tmp_path / "run"
    r = _cli("--steps", "2", "--max-tokens", "256", "--data", "orca_like", "--nproc", "2", "--ulysses", "2",
             "--timeout-s", "3", "--out", out, point="slow save", k=6)
    assert r.returncode == 0, r.stderr[-3000:]
    from workbench.checkpoint import checkpoints
    # only the last: no --save-every
    assert [(d.name, m is not None) for d, m in checkpoints(out)] == [("step-000002", True)]


def test_a_save_slower_than_the_stall_limit_does_not_end_the_run(tmp_path):
    """The save sleeps 5 s under a 2 s stall limit (--stall-s): a checkpoint being written is progress, however slow
    the disk. A fork of the zygote: its rank builds the model within the limit on a busy box (a fresh interpreter
    importing datasets on the rank's first load did not, once)."""
    out = tmp_path / "run"
    r = _cli("--steps", "1", "--max-tokens", "256", "--data", "orca_like", "--stall-s", "2", "--out", out,
             point="slow save", k=5)
    assert r.returncode == 0, r.stderr[-3000:]
    from workbench.checkpoint import checkpoints
    assert [(d.name, m is not None) for d, m in checkpoints(out)] == [("step-000001", True)]

def test_ctrl_c_of_a_single_process_run_exits_130_and_resumes(tmp_path, reference):
    """SIGINT to a terminal run of one process after 2 steps: exit code
    130, the last checkpoint named, resume equals the reference."""
    out = tmp_path / "run"
    p = _ZYGOTE[0].start([*ARGS, "--out", str(out)])  # in its own session, as a terminal's foreground job
    try:
        _wait_rows(out, 2, time.time() + TIMEOUT)
        os.killpg(p.pid, signal.SIGINT)
        code, err = p.wait(timeout=60), p.stderr
    finally:
        if p.poll() is None: os.killpg(p.pid, signal.SIGKILL); p.wait(timeout=10)
    assert code == 130 and "--resume continues from it" in err, (code, err[-2000:])
    r = _cli(*ARGS, "--out", str(out), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    _check_against(out, reference)


def test_kill_inside_save_pretrained_leaves_the_previous_model_loadable(tmp_path, reference):
    """kill -9 with half of step 3's model.safetensors written: step 2 stays
    the newest complete checkpoint, its model loads; resume finishes."""
    import torch
    from transformers import AutoModelForCausalLM
    from workbench.checkpoint import latest_checkpoint, MODEL_DIR
    out = tmp_path / "run"
    assert _killed_run(tmp_path, out, "in save_pretrained", 3, resume=False) == -signal.SIGKILL
    assert sorted(d.name for d in (out / "checkpoints").iterdir()) == [".tmp-step-000003", "step-000001", "step-000002"]
    where, manifest = latest_checkpoint(out)
    assert where.name == "step-000002" and f"{MODEL_DIR}/model.safetensors" in manifest["files"]
    trained = torch.load(where / "state.pt", weights_only=True)["model"]
    loaded = AutoModelForCausalLM.from_pretrained(where / MODEL_DIR).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in trained.items())
    r = _cli(*ARGS, "--out", str(out), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    _check_against(out, reference)
    assert not list((out / "checkpoints").glob(".tmp-*"))
