"""The GPU suite: every GPU benchmark of the workbench in one command, one JSON file and one markdown table (issue 18).

  python bench/gpu_suite.py --out bench/results/            # one CUDA GPU; every part capped, under 8 min in all
  python bench/gpu_suite.py --out /tmp/suite --dry-run      # the same code paths on CPU, tiny shapes (the test)

Install on a bare GPU machine (torch as installed there, CUDA build):

  git clone <this repo> && cd workbench
  pip install -e .                                          # keeps the machine's torch if it meets the floor
  python bench/gpu_suite.py --out bench/results/ --install-flash-attn   # optional, see below

`--install-flash-attn` tries `pip install flash-attn --only-binary :all:` (a prebuilt wheel only, never a source build)
with a 60 s timeout; without it, or when no wheel fits, `workbench_varlen` runs torch's own varlen kernel and the
suite says so in its environment record ("flash_attn": "absent").

Each part runs in its own subprocess (its own session, killed with its children at its cap), so a slow or crashing
part is recorded as "timed out" or "failed" with its stderr tail and the suite goes on. Parts, most valuable first:

  1 packing      bench/gpu_packing.py: padded sdpa / padded varlen / flattened sdpa, flex, workbench_varlen / the
                 cache trap / transformers' DataCollatorWithFlattening / plan_bins token budget; tokens/s, ratios,
                 peak memory, loss checked against padded (CONTAMINATED when it differs)
  2 kernels      workbench_varlen against sdpa (block-diagonal mask) and flex on one packed batch, forward + backward:
                 median time over N runs and max |Δ| of output and grads against an fp32 reference
  3 long_context bench/gpu_long_context.py: longest context under a memory cap, planned vs measured
  4 memory       planner vs measured peak: part 3's rows, and one `python -m workbench.train` run (nccl on a GPU,
                 gloo on CPU) whose memory readout lines are parsed
  5 step_time    skipped: no step-time predictor exists yet (issue 17)
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # the sibling scripts gpu_packing.py and gpu_long_context.py


@dataclass(frozen=True)
class Part:
    number: int
    name: str
    cap_s: float      # wall-clock cap on a GPU
    dry_cap_s: float  # wall-clock cap of the CPU dry run
    skipped: str = "" # why the part cannot run yet ("" when it runs)


# GPU caps: 180 + 45 + 130 + 60 = 415 s, plus at most 60 s for --install-flash-attn: under 8 min in the worst case
# dry caps only catch a hang: a shared 2-core CI box under a parallel test run was seen 10x slower than an idle one
PARTS = (Part(1, "packing", 180, 120), Part(2, "kernels", 45, 120), Part(3, "long_context", 130, 120),
         Part(4, "memory", 60, 120), Part(5, "step_time", 0, 0, skipped="skipped: no predictor (issue 17)"))


# ---- the parts (each runs inside its own child process) ----

def part_packing(dry: bool) -> dict:
    import gpu_packing
    argv = ["--dry-run"] if dry else ["--steps", "4"]
    rows = gpu_packing.run(gpu_packing.parse_args(argv))  # annotated: share of the padding bound, loss verdict
    return dict(rows=rows, trap=gpu_packing.TRAP, table=gpu_packing.table(rows))


def part_kernels(dry: bool, repeats: int = 10, warmup: int = 3) -> dict:
    import numpy as np
    import torch
    from workbench.attention import pick_kernel, reference_varlen, varlen_attention
    from workbench.packing import synthetic_lengths
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    T, H, D = (256, 4, 32) if dry else (16384, 32, 128)
    lengths = synthetic_lengths("flan", 4096, seed=0)
    lengths = lengths[np.cumsum(lengths) <= T]
    lengths = np.append(lengths, T - lengths.sum()) if lengths.sum() < T else lengths
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q32, k32, v32, g32 = (torch.randn(T, H, D, generator=gen).to(device) for _ in range(4))
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.as_tensor(lengths, device=device))

    def sdpa(q, k, v):  # one dense block-diagonal causal mask over the packed row
        mask = (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool, device=device).tril()
        o = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=mask)
        return o[0].transpose(0, 1)

    impls = {"workbench_varlen": lambda q, k, v: varlen_attention(q, k, v, cu, int(lengths.max())), "sdpa": sdpa}
    if device.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        block = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), None, None, T, T, device=device)
        flex = torch.compile(flex_attention)
        impls["flex"] = lambda q, k, v: flex(*(x.transpose(0, 1)[None].contiguous() for x in (q, k, v)),
                                             block_mask=block)[0].transpose(0, 1)

    def grads(fn, dt):
        q, k, v = (x.detach().to(dt, copy=True).requires_grad_() for x in (q32, k32, v32))  # fresh leaves every call
        out = fn(q, k, v)
        out.backward(g32.to(dt))
        return [t.detach().float() for t in (out, q.grad, k.grad, v.grad)]

    def timed(fn) -> float:
        for _ in range(warmup): grads(fn, dtype)
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(); grads(fn, dtype); end.record(); torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter(); grads(fn, dtype); times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    ref = grads(lambda q, k, v: reference_varlen(q, k, v, cu), torch.float32)
    rows = []
    for name, fn in impls.items():
        got = grads(fn, dtype)
        rows.append(dict(impl=name, fwd_bwd_ms=timed(fn),
                         **{f"max_abs_d_{t}": (a - b).abs().max().item() for t, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}))
    table = ["| impl | fwd+bwd ms (median) | max abs d out | d dq | d dk | d dv |", "|---|---|---|---|---|---|"]
    table += [f"| {r['impl']} | {r['fwd_bwd_ms']:.2f} | {r['max_abs_d_out']:.1e} | {r['max_abs_d_dq']:.1e} | "
              f"{r['max_abs_d_dk']:.1e} | {r['max_abs_d_dv']:.1e} |" for r in rows]
    if device.type == "cpu": table.append("on CPU workbench_varlen runs its reference kernel (Δ 0 by construction); "
                                          "flex is not run (flex_attention has no CPU backward)")
    return dict(tokens=T, heads=H, head_dim=D, examples=len(lengths), dtype=str(dtype),
                varlen_kernel=pick_kernel(q32.to(dtype)), repeats=repeats, rows=rows, table="\n".join(table))


def part_long_context(dry: bool) -> dict:
    import gpu_long_context
    rows = gpu_long_context.run(gpu_long_context.parse_args(["--dry-run", "--max-trials", "3"] if dry
                                                            else ["--cap-gib", "16", "--max-trials", "8"]))
    return dict(rows=rows, table=gpu_long_context.table(rows))


EXPECTED = re.compile(r"expected per-rank peak \(planner, bf16\): ([\d.]+) GiB")
MEASURED = re.compile(r"rank (\d+) ([\d.]+) GiB")


def part_memory(dry: bool, out: Path) -> dict:
    points = []
    long_context = out / "part3.json"
    if long_context.exists():  # part 3's rows carry the planned and measured peak at the longest fit
        for r in json.loads(long_context.read_text())["result"]["rows"]:
            if r["measured_peak_gib"] is not None:
                points.append(dict(source=f"long_context cap {r['cap_gib']} GiB, {r['levers']}, {r['measured_tokens']:,} tokens",
                                   planned_gib=r["planned_peak_gib"], measured_gib=r["measured_peak_gib"]))
    run_dir = tempfile.mkdtemp(prefix="train_", dir=out)
    cmd = [sys.executable, "-m", "workbench.train", "--attn", "workbench_varlen", "--steps", "3" if not dry else "2",
           "--out", run_dir] + (["--max-tokens", "256"] if dry else ["--preset", "gpu-long", "--max-tokens", "16384"])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=45 if dry else 50)
    if proc.returncode: raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-1500:]}")
    expected = EXPECTED.search(proc.stdout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("measured per-rank peak")), "")
    measured = [float(g) for _, g in MEASURED.findall(line)]
    if not expected or not measured: raise RuntimeError(f"no memory readout in the train run's stdout: {proc.stdout[-1500:]}")
    points.append(dict(source=f"python -m workbench.train ({'gloo, CPU: measured is the peak RSS' if dry else 'nccl, 1 GPU'})",
                       planned_gib=float(expected.group(1)), measured_gib=max(measured)))
    table = ["| point | planned GiB | measured GiB | measured / planned |", "|---|---|---|---|"]
    table += [f"| {p['source']} | {p['planned_gib']:.3f} | {p['measured_gib']:.3f} | "
              f"{p['measured_gib'] / p['planned_gib']:.2f} |" for p in points]
    return dict(points=points, train_cmd=" ".join(cmd[1:]), table="\n".join(table))


def run_part(number: int, dry: bool, out: Path, fail: bool) -> None:
    "Child side: run one part and write `out/partN.json`."
    if fail: raise RuntimeError(f"part {number} failed on purpose (--fail-part {number})")
    fn = {1: part_packing, 2: part_kernels, 3: part_long_context, 4: lambda d: part_memory(d, out)}[number]
    (out / f"part{number}.json").write_text(json.dumps(dict(result=fn(dry)), indent=1, default=str))


# ---- the parent: environment, caps, the report ----

def version(dist: str) -> str:
    try: return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError: return "absent"


def environment(install_note: str) -> dict:
    import torch
    gpu = driver = "absent"
    if torch.cuda.is_available():  # nvidia-smi, not torch: no CUDA context held by the suite while the parts run
        try: gpu, driver = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                          capture_output=True, text=True, timeout=20).stdout.splitlines()[0].split(", ")
        except (OSError, subprocess.TimeoutExpired, IndexError, ValueError): gpu, driver = "unknown", "unknown (nvidia-smi failed)"
    return dict(gpu=gpu, driver=driver, cuda=torch.version.cuda or "absent",
                torch=torch.__version__, transformers=version("transformers"), flash_attn=version("flash-attn"),
                flash_attn_install=install_note, python=sys.version.split()[0])


def install_flash_attn(timeout_s: float = 60) -> str:
    "Try a prebuilt flash-attn wheel for `timeout_s`; never build from source."
    cmd = [sys.executable, "-m", "pip", "install", "-q", "flash-attn", "--only-binary", ":all:"]
    try: proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired: return f"not installed: no wheel in {timeout_s:.0f} s"
    return "installed" if proc.returncode == 0 else f"not installed: {proc.stderr.strip()[-300:]}"


STOPS = {signal.SIGTERM, signal.SIGINT}  # what ends the suite: a kill exits 143, Ctrl-C 130

def stop(signum, _frame): sys.exit(128 + signum)

def end_session(proc, within_s: float = 10.0):
    "SIGKILL a part's whole session, reap the part, and wait (bounded) until every process it started is gone too."
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try: os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError: break  # the session is empty
        proc.poll()  # reap the part itself once it is dead: an unreaped leader keeps its session alive
        time.sleep(0.05)
    proc.wait()

def supervise(part: Part, args, cap_s: float) -> dict:
    "Run `part` in its own session under `cap_s`; its status, wall time, result or stderr tail."
    record = dict(part=part.number, name=part.name, cap_s=cap_s)
    if part.skipped: return {**record, "status": part.skipped}
    cmd = [sys.executable, __file__, "--child", str(part.number), "--out", str(args.out)]
    if args.dry_run: cmd.append("--dry-run")
    if part.number in args.fail_part: cmd.append("--fail")
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.dry_run else None  # a dry run beside other jobs: no oversubscription
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # a kill while Popen runs waits until `proc` is known: never an orphan
    try: proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # a kill that came meanwhile is acted on here, inside the try
        stdout, stderr = proc.communicate(timeout=cap_s)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the part and every process it started (train ranks, compile workers)
        stdout, stderr = proc.communicate()
        status = f"timed out after {cap_s:g} s"
    finally:  # also on Ctrl-C or a kill of the suite, and after a part that left processes behind (train ranks)
        end_session(proc)  # before the suite goes on, or exits: no part outlives it
    record.update(status=status, seconds=round(time.perf_counter() - t0, 1))
    result = args.out / f"part{part.number}.json"
    if status == "ok": record["result"] = json.loads(result.read_text())["result"]
    else: record.update(stderr_tail=(stderr or "")[-2000:], stdout_tail=(stdout or "")[-2000:])  # the rows it got to
    print(f"part {part.number} {part.name}: {status} ({record['seconds']} s)", flush=True)
    return record


def markdown(env: dict, records: list[dict], dry: bool) -> str:
    lines = [f"# GPU suite{' (CPU dry run: tiny shapes, numbers mean nothing)' if dry else ''}", "",
             ", ".join(f"{k}: {v}" for k, v in env.items()), "",
             "| part | name | status | seconds | cap s |", "|---|---|---|---|---|"]
    lines += [f"| {r['part']} | {r['name']} | {r['status']} | {r.get('seconds', '')} | {r['cap_s']:g} |" for r in records]
    for r in records:
        lines += ["", f"## {r['part']} {r['name']}: {r['status']}", ""]
        if "result" in r: lines.append(r["result"]["table"])
        elif "stderr_tail" in r: lines += ["```", r["stdout_tail"][-800:], r["stderr_tail"][-800:], "```"]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for suite.json, suite.md and the parts' files")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, gloo: the same code paths as on a GPU")
    p.add_argument("--install-flash-attn", action="store_true", help="first try a prebuilt flash-attn wheel (60 s cap)")
    p.add_argument("--parts", type=int, nargs="+", default=[p.number for p in PARTS], help="run only these parts")
    p.add_argument("--cap-s", type=float, help="one wall-clock cap, seconds, for every part (testing)")
    p.add_argument("--fail-part", type=int, nargs="*", default=[], help="make these parts raise (testing the isolation)")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)  # internal: run one part in this process
    p.add_argument("--fail", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    known = {q.number for q in PARTS}
    if not set(args.parts) <= known or not set(args.fail_part) <= known:
        p.error(f"parts are numbered {sorted(known)}; got --parts {args.parts} --fail-part {args.fail_part}")
    if args.out.exists() and not args.out.is_dir(): p.error(f"--out {args.out} is a file: pass a directory (made if missing)")
    if args.cap_s is not None and args.cap_s <= 0: p.error(f"--cap-s must be a positive number of seconds, got {args.cap_s}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child is not None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # the mask supervise held while starting it was inherited
        return run_part(args.child, args.dry_run, args.out, args.fail)
    for s in STOPS: signal.signal(s, stop)  # a kill or Ctrl-C ends the running part's session too (supervise)
    import torch
    if not args.dry_run and not torch.cuda.is_available(): raise SystemExit("no CUDA GPU: use --dry-run on a CPU")
    for stale in args.out.glob("part*.json"): stale.unlink()  # a reused directory: never report an old part's result
    t0 = time.perf_counter()
    note = install_flash_attn() if args.install_flash_attn else "not tried (--install-flash-attn)"
    env = environment(note)
    print("gpu_suite:", json.dumps(env), flush=True)
    records = [supervise(part, args, args.cap_s or (part.dry_cap_s if args.dry_run else part.cap_s))
               for part in PARTS if part.number in args.parts]
    report = dict(env=env, dry_run=args.dry_run, total_s=round(time.perf_counter() - t0, 1), parts=records)
    (args.out / "suite.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "suite.md").write_text(markdown(env, records, args.dry_run))
    print(f"wrote {args.out / 'suite.json'} and {args.out / 'suite.md'} ({report['total_s']} s)")
    return report


if __name__ == "__main__":
    main()
