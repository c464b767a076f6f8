"""The GPU suite: every GPU benchmark of the workbench in one command, one JSON file and one markdown table (issue 18).

  python bench/gpu_suite.py --out bench/results/            # one CUDA GPU; every part capped, under 8 min in all
  python bench/gpu_suite.py --out bench/results/ --suite long-context   # long context (issue 48): under 8 min too
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
  3 sp_kernels   sequence parallelism's kernels on one GPU, on part 2's packed 16K row: the ring's block-pair kernel
                 (workbench.sp.ring.ring_attend, one block, as shipped) against workbench_varlen (flash / torch varlen),
                 and Ulysses's local attention on its head shard (H/4 heads over the whole row); time, max |Δ| vs fp32;
                 the fused ring call's memory: its operators' bytes against the allocator's peak (flash's workspace)
  4 long_context bench/gpu_long_context.py: longest context under a memory cap, planned vs measured
  5 memory       planner vs measured peak: part 4's rows, and one `python -m workbench.train` run (nccl on a GPU,
                 gloo on CPU) whose memory readout lines are parsed
  6 step_time    workbench.cost.predict_step against the measured step times of parts 1 and 4 and of part 5's train
                 run (check_run), the error per row; then calibrate on those rows and calibrate_run on the train run,
                 the refitted errors recorded beside the first ones

The long-context suite (`--suite long-context`: parts 3, 7, 8, 9, 10; issue 48):

  7 levers_at_length  bench/gpu_long_context.py --at: all levers at 16K, 32K and 64K tokens and at the planner's longest
                 fit, under a 16 GiB cap: seconds, time per 1K tokens, peak beside the planner's peak and their ratio
  8 alst         bench/alst_long_context.py: DeepSpeed ALST's levers (TiledMLP, its tiled loss, checkpoints offloaded to
                 the CPU) against the workbench's on the same 4-layer Qwen3-4B-shaped model at 32K and 64K tokens (time,
                 peak, max |diff| of loss and gradients), then each side's longest row under 16 GiB (5 trials each)
  9 profile_64k  one all-levers step at 64K tokens under torch.profiler: the top 15 ops by CUDA time
  10 predictor   workbench.cost's step predictor with the factors fitted on the H200's FLAN rows (fit_held_out over
                 recorded_steps): its held-out errors there, and part 7's all-levers steps predicted with the same
                 factors on this GPU (one forward + backward: no optimizer term; the offload's host copies kept),
                 each error and the median and worst over every held-out row
  (3 sp_kernels, as above, gives the fused ring pair against varlen on the 16K row, and their ratio)

Every part records what it could not run and why ("not run" in its result).

Not in the suite, because each needs two GPUs in one job (the suite runs on one):
  - PyTorch's context parallelism through accelerate (`ParallelismConfig(cp_size=2)`, FSDP2): its ring and gradient
    reduction. On CPU processes both accelerate and PyTorch refuse it (`workbench.engines.cp_refusals` returns their
    errors); the ledger engine `accelerate_cp` measures its attention in one process with accelerate's own hook.
    On two GPUs: a script that trains the ledger's rows (`workbench.engines.run_rows`) through `Accelerator(
    parallelism_config=ParallelismConfig(cp_size=2))` and `maybe_context_parallel`, judged with `engine_proofs.judge`.
  - Training through the fused ring on GPUs (`python -m workbench.train --ring 2 --ring-kernel fused`), against the
    same run at `--ring-kernel plain` (exact on CPU processes: tests/test_ring.py).
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
sys.path.insert(0, str(BENCH))  # the sibling scripts gpu_packing.py, gpu_long_context.py and alst_long_context.py


@dataclass(frozen=True)
class Part:
    number: int
    name: str
    cap_s: float      # wall-clock cap on a GPU
    dry_cap_s: float  # wall-clock cap of the CPU dry run
    skipped: str = "" # why the part cannot run yet ("" when it runs)


# GPU caps, most valuable first. The default suite: 150 + 40 + 40 + 100 + 60 + 25 = 415 s; the long-context one (issue
# 48): 40 + 100 + 200 + 55 + 20 = 415 s; each plus at most 60 s for --install-flash-attn, under 8 min in the worst case.
# Dry caps catch a hang: a dry part took 5-11 s on the 2-core build box at a load average of 2-5 (mostly imports) and
# 7-23 s beside 15 busy loops (load 15-19); 150 s each is ~6x the slowest of those.
PARTS = (Part(1, "packing", 150, 150), Part(2, "kernels", 40, 150), Part(3, "sp_kernels", 40, 150),
         Part(4, "long_context", 100, 150), Part(5, "memory", 60, 150), Part(6, "step_time", 25, 150),
         Part(7, "levers_at_length", 100, 150), Part(8, "alst", 200, 150), Part(9, "profile_64k", 55, 150),
         Part(10, "predictor", 20, 150))
SUITES = {"default": (1, 2, 3, 4, 5, 6),  # what `--parts` runs when not given, by `--suite`
          "long-context": (3, 7, 8, 9, 10)}  # issue 48's one GPU command: ring pair, levers, ALST, profile, predictor
LONG_LENGTHS = (16384, 32768, 65536)       # part 7's lengths (16K: the per-token baseline), under LONG_CAP_GIB
LONG_CAP_GIB = 16
TRAIN_DRY_TIMEOUT_S = 120  # part 5's train run in a dry run: under its part's cap, with room for a loaded box


# ---- the parts (each runs inside its own child process) ----

# part 1's (part 6 rebuilds its steps)
def packing_argv(dry: bool) -> list[str]: return ["--dry-run"] if dry else ["--steps", "4"]


def part_packing(dry: bool) -> dict:
    import gpu_packing
    # annotated: share of the padding bound, loss verdict
    rows = gpu_packing.run(gpu_packing.parse_args(packing_argv(dry)))
    not_run = [f"{r['dataset']} {r['mode']}: {r['error']}" for r in rows if "error" in r]
    return dict(rows=rows, trap=gpu_packing.TRAP, table=gpu_packing.table(rows), not_run=not_run)


def packed_row(dry: bool):
    """Part 2's packed row `[T, H, D]` (16K tokens of FLAN-like
    documents on a GPU, 256 on CPU): q, k, v, grad (fp32), cu, doc."""
    import numpy as np
    import torch
    from workbench.packing import synthetic_lengths
    device = torch.device("cpu" if dry else "cuda")
    T, H, D = (256, 4, 32) if dry else (16384, 32, 128)
    lengths = synthetic_lengths("flan", 4096, seed=0)
    lengths = lengths[np.cumsum(lengths) <= T]
    lengths = np.append(lengths, T - lengths.sum()) if lengths.sum() < T else lengths
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q32, k32, v32, g32 = (torch.randn(T, H, D, generator=gen).to(device) for _ in range(4))
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.as_tensor(lengths, device=device))
    return device, lengths, (q32, k32, v32, g32), cu, doc


def compare(impls: dict, reference, tensors, dtype, device, repeats: int, warmup: int, heads=slice(None)) -> list[dict]:
    """Each implementation `[T, h, D] -> [T, h, D]` on `heads` of the row:
    median fwd+bwd ms and max |Δ| of output and grads vs `reference` in fp32."""
    import torch
    q32, k32, v32, g32 = (x[:, heads] for x in tensors)

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

    ref = grads(reference, torch.float32)
    rows = []
    for name, fn in impls.items():
        got = grads(fn, dtype)
        rows.append(dict(impl=name, fwd_bwd_ms=timed(fn),
                         **{f"max_abs_d_{t}": (a - b).abs().max().item()
                            for t, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}))
    return rows


def kernel_table(rows: list[dict]) -> list[str]:
    table = ["| impl | fwd+bwd ms (median) | max abs d out | d dq | d dk | d dv |", "|---|---|---|---|---|---|"]
    return table + [f"| {r['impl']} | {r['fwd_bwd_ms']:.2f} | {r['max_abs_d_out']:.1e} | {r['max_abs_d_dq']:.1e} | "
                    f"{r['max_abs_d_dk']:.1e} | {r['max_abs_d_dv']:.1e} |" for r in rows]


def part_kernels(dry: bool, repeats: int = 10, warmup: int = 3) -> dict:
    import torch
    from workbench.attention import pick_kernel, reference_varlen, varlen_attention
    device, lengths, tensors, cu, doc = packed_row(dry)
    dtype = torch.float32 if dry else torch.bfloat16
    T, H, D = tensors[0].shape

    def sdpa(q, k, v):  # one dense block-diagonal causal mask over the packed row
        mask = (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool, device=device).tril()
        o = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)),
                                                             attn_mask=mask)
        return o[0].transpose(0, 1)

    impls = {"workbench_varlen": lambda q, k, v: varlen_attention(q, k, v, cu, int(lengths.max())), "sdpa": sdpa}
    not_run = []
    if device.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        block = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), None, None, T, T, device=device)
        flex = torch.compile(flex_attention)
        impls["flex"] = lambda q, k, v: flex(*(x.transpose(0, 1)[None].contiguous() for x in (q, k, v)),
                                             block_mask=block)[0].transpose(0, 1)
    else: not_run.append("flex: flex_attention has no CPU backward")
    rows = compare(impls, lambda q, k, v: reference_varlen(q, k, v, cu), tensors, dtype, device, repeats, warmup)
    table = kernel_table(rows)
    if device.type == "cpu": table.append("on CPU workbench_varlen runs its reference kernel (Δ 0 by construction); "
                                          "flex is not run (flex_attention has no CPU backward)")
    return dict(tokens=T, heads=H, head_dim=D, examples=len(lengths), dtype=str(dtype),
                varlen_kernel=pick_kernel(tensors[0].to(dtype)), repeats=repeats, rows=rows, table="\n".join(table),
                not_run=not_run)


ULYSSES = 4  # the Ulysses degree whose head shard part 3 times (H/4 heads over the whole row)
RING = 4     # the ring whose block pairs part 3 runs in one process (zigzag blocks of the row)


def ring_in_one_process(q, k, v, grad, ring_index, doc) -> list:
    """Every block pair of a ring run in one process through the fused kernel (no exchange): the row's output and its q,
    k, v gradients `[T, H, D]` in fp32, each block's gradients from its merged output and log-sum-exp, as the ring
    computes them."""
    import torch
    from workbench.sp.ring import fused_backward, fused_calls, fused_forward
    qb, kb, vb, gb = (x.transpose(0, 1)[None] for x in (q, k, v, grad))  # [1, H, T, D]
    scale = q.shape[-1] ** -0.5
    merged = []
    for rows in ring_index:  # forward: each query block against every key block, merged as the ring merges them
        out = torch.zeros(qb[:, :, rows].shape, dtype=torch.float32, device=q.device)
        lse = torch.full(out.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for cols in ring_index:
            fused_forward(qb[:, :, rows], kb[:, :, cols], vb[:, :, cols], fused_calls(rows, cols, doc), scale, out, lse)
        merged.append((out, lse))
    out_row, dq, dk, dv = (torch.zeros(qb.shape, dtype=torch.float32, device=q.device) for _ in range(4))
    for rows, (out, lse) in zip(ring_index, merged):  # backward: each block's share from the merged statistics
        out_row[:, :, rows] = out
        dq_block = torch.zeros(out.shape, dtype=torch.float32, device=q.device)
        for cols in ring_index:
            dk_block, dv_block = torch.zeros_like(dq_block), torch.zeros_like(dq_block)
            fused_backward(qb[:, :, rows], kb[:, :, cols], vb[:, :, cols], gb[:, :, rows], out.to(q.dtype), lse,
                           fused_calls(rows, cols, doc), scale, dq_block, dk_block, dv_block)
            dk[:, :, cols] += dk_block
            dv[:, :, cols] += dv_block
        dq[:, :, rows] = dq_block
    return [x[0].transpose(0, 1) for x in (out_row, dq, dk, dv)]


def ring_check(tensors, cu, doc, dtype, repeats: int) -> dict:
    """The fused kernel over a ring of RING zigzag blocks in one process (off-diagonal pairs, split documents) against
    the fp32 reference of the whole row: max |Δ| of the output and every gradient, and the median time of all its
    pairs."""
    import torch
    from workbench.attention import reference_varlen
    from workbench.sp.balance import zigzag_plan
    T = tensors[0].shape[0]
    ring_index = zigzag_plan(T, RING).to(doc.device)
    q32, k32, v32, g32 = tensors
    leaves = [x.detach().clone().requires_grad_() for x in (q32, k32, v32)]
    ref_out = reference_varlen(*leaves, cu)
    ref_out.backward(g32)
    ref = [ref_out.detach(), *(x.grad for x in leaves)]
    low = [x.to(dtype) for x in tensors]
    got = ring_in_one_process(*low, ring_index, doc)
    times = []
    for _ in range(repeats):
        if q32.is_cuda: torch.cuda.synchronize()
        t0 = time.perf_counter()
        ring_in_one_process(*low, ring_index, doc)
        if q32.is_cuda: torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return dict(impl=f"ring {RING} zigzag, every block pair in one process (fused)",
                fwd_bwd_ms=statistics.median(times),
                **{f"max_abs_d_{t}": (a - b).abs().max().item()
                   for t, a, b in zip(("out", "dq", "dk", "dv"), got, ref)})


def ring_memory(tensors, doc, dtype) -> dict:
    """One fused ring call over the whole row (one block: its pair with itself), forward + backward: the bytes its
    operators make (`LiveBytes`, what the memory planner counts) and, on a GPU, the allocator's peak over the same call.
    Their difference is what the kernels allocate inside themselves (flash's workspace), the term the planner's CUDA
    path still needs (issue 31)."""
    import torch
    from workbench.memory import LiveBytes
    from workbench.sp.ring import ring_attend
    T, H, D = tensors[0].shape
    q, k, v = (x.to(dtype).transpose(0, 1)[None].contiguous().requires_grad_() for x in tensors[:3])
    grad = tensors[3].to(dtype).transpose(0, 1)[None].contiguous()
    ring_index = torch.arange(T, device=q.device)[None]
    if q.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with LiveBytes() as live:
        ring_attend(q, k, v, ring_index, doc, kernel="fused").backward(grad)
    result = dict(tokens=T, heads=H, head_dim=D, dtype=str(dtype), visible_peak_bytes=live.peak)
    if q.is_cuda:
        torch.cuda.synchronize()
        result["allocated_peak_bytes"] = torch.cuda.max_memory_allocated() - before
        result["inside_kernels_bytes"] = result["allocated_peak_bytes"] - live.peak
    return result


def part_sp_kernels(dry: bool, repeats: int = 10, warmup: int = 3) -> dict:
    import torch
    from workbench.attention import pick_kernel, reference_varlen, varlen_attention
    from workbench.sp.ring import QUERY_TILE, ring_attend
    device, lengths, tensors, cu, doc = packed_row(dry)
    dtype = torch.float32 if dry else torch.bfloat16
    T, H, D = tensors[0].shape
    # one ring block holding the whole row: the block pair with itself
    ring_index = torch.arange(T, device=device)[None]
    to_bhtd = lambda x: x.transpose(0, 1)[None]
    varlen = lambda q, k, v: varlen_attention(q, k, v, cu, int(lengths.max()))
    impls = {f"ring block pair, plain kernel (tile {QUERY_TILE})":
                 lambda q, k, v: ring_attend(to_bhtd(q), to_bhtd(k), to_bhtd(v), ring_index, doc)[0].transpose(0, 1),
             "ring block pair, fused kernel":
                 lambda q, k, v: ring_attend(to_bhtd(q), to_bhtd(k), to_bhtd(v), ring_index, doc,
                                             kernel="fused")[0].transpose(0, 1),
             f"workbench_varlen ({pick_kernel(tensors[0].to(dtype))})": varlen}
    rows = compare(impls, lambda q, k, v: reference_varlen(q, k, v, cu), tensors, dtype, device, repeats, warmup)
    rows.append(ring_check(tensors, cu, doc, dtype, repeats))
    shard = slice(0, H // ULYSSES)  # the heads one of ULYSSES ranks holds after the all-to-all, over the whole row
    rows += [dict(r, impl=f"Ulysses local, head shard {H // ULYSSES}/{H}: {r['impl']}")
             for r in compare({"workbench_varlen": varlen}, lambda q, k, v: reference_varlen(q, k, v, cu), tensors,
                              dtype, device, repeats, warmup, heads=shard)]
    memory = ring_memory(tensors, doc, dtype)
    table = kernel_table(rows)
    table.append(f"fused ring block pair / workbench_varlen on the same row: "
                 f"{rows[1]['fwd_bwd_ms'] / rows[2]['fwd_bwd_ms']:.1f}x")
    table.append(f"fused ring call over the whole row, forward + backward: its operators' peak "
                 f"{memory['visible_peak_bytes'] / 2**20:.1f} MiB" + (
                     f", the allocator's {memory['allocated_peak_bytes'] / 2**20:.1f} MiB, inside the kernels "
                     f"{memory['inside_kernels_bytes'] / 2**20:.1f} MiB" if "allocated_peak_bytes" in memory else ""))
    not_run = ["the ring's exchange between GPUs (one GPU here: its compute only)",
               "Ulysses's all-to-alls (one GPU here: its local attention only)"]
    if device.type == "cpu": not_run += ["flash / torch varlen: on CPU workbench_varlen runs its "
                                         "reference kernel, PyTorch's CPU flash call per document, "
                                         "as one fused ring block does (both Δ 0 by construction)",
                                         "the allocator's peak of the fused ring call (a CPU has "
                                         "no max_memory_allocated): its operators' bytes only"]
    return dict(tokens=T, heads=H, head_dim=D, ulysses=ULYSSES, examples=len(lengths), dtype=str(dtype), rows=rows,
                memory=memory, table="\n".join(table), not_run=not_run)


def part_long_context(dry: bool) -> dict:
    import gpu_long_context
    rows = gpu_long_context.run(gpu_long_context.parse_args(["--dry-run", "--max-trials", "3"] if dry
                                                            else ["--cap-gib", "16", "--max-trials", "8"]))
    not_run = [f"cap {r['cap_gib']} GiB, {r['levers']}: no length fitted" for r in rows if not r["measured_tokens"]]
    return dict(rows=rows, table=gpu_long_context.table(rows), not_run=not_run)


def part_levers_at_length(dry: bool) -> dict:
    "All levers at LONG_LENGTHS and at the planner's longest fit under LONG_CAP_GIB: time, peak, the planner's peak."
    import gpu_long_context
    argv = (["--dry-run", "--at", "128", "256"] if dry else
            ["--at", *map(str, LONG_LENGTHS), "--cap-gib", str(LONG_CAP_GIB)])
    rows = gpu_long_context.run(gpu_long_context.parse_args(argv))
    not_run = [f"{r['point']}: out of memory under the {r['cap_gib']:g} GiB cap" for r in rows if r["peak_gib"] is None]
    return dict(rows=rows, table=gpu_long_context.length_table(rows), not_run=not_run)


def part_alst(dry: bool) -> dict:
    "DeepSpeed ALST's levers against the workbench's at 32K and 64K tokens, and each side's longest row under the cap."
    import alst_long_context
    argv = ["--dry-run"] if dry else ["--qwen3-4b", "--lengths", "32768", "65536", "--cap-gib", str(LONG_CAP_GIB),
                                      "--max-trials", "5"]
    result = alst_long_context.run(alst_long_context.parse_args(argv))
    not_run = ["ALST's checkpoint offload (DeepSpeed's checkpoint_in_cpu fails on a CPU device): its checkpointing "
               "runs without it"] if dry else []
    return dict(result, table=alst_long_context.table(result), not_run=not_run)


def part_profile_64k(dry: bool) -> dict:
    "One all-levers step at 64K tokens under torch.profiler: its top 15 ops by CUDA time (CPU time in a dry run)."
    import torch
    import gpu_long_context
    from workbench.memory import preset_config
    lc = gpu_long_context.parse_args(["--dry-run"] if dry else [])
    device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
    cfg = preset_config("qwen3-4b", num_hidden_layers=lc.layers, **(gpu_long_context.TINY if dry else {}))
    rows = gpu_long_context.profile(cfg, 128 if dry else 65536, device, torch.bfloat16, top=15, sets=("all levers",))
    table = [f"{r['levers']}, {r['tokens']:,} tokens: " + (r["top_ops"] if r["seconds"] is None else
             f"{r['seconds']:.2f} s, {'RSS growth' if dry else 'peak'} {r['peak_gib']:.2f} GiB\n\n"
             f"```\n{r['top_ops']}\n```")
             for r in rows]
    return dict(rows=rows, table="\n\n".join(table),
                not_run=["CUDA time: a CPU has none (its top ops are by CPU time)"] if dry else [])


EXPECTED = re.compile(r"expected per-rank peak \(planner, bf16\): ([\d.]+) GiB")
MEASURED = re.compile(r"rank (\d+) ([\d.]+) GiB")


def part_memory(dry: bool, out: Path) -> dict:
    points = []
    long_context = out / "part4.json"
    if long_context.exists():  # part 3's rows carry the planned and measured peak at the longest fit
        for r in json.loads(long_context.read_text())["result"]["rows"]:
            if r["measured_peak_gib"] is not None:
                points.append(dict(source=f"long_context cap {r['cap_gib']} GiB, "
                                          f"{r['levers']}, {r['measured_tokens']:,} tokens",
                                   planned_gib=r["planned_peak_gib"], measured_gib=r["measured_peak_gib"]))
    run_dir = tempfile.mkdtemp(prefix="train_", dir=out)
    cmd = [sys.executable, "-m", "workbench.train", "--attn", "workbench_varlen", "--steps", "8" if not dry else "2",
           # the planner models bf16 (fp32, a CPU's auto, it does not)
           "--out", run_dir] + (["--max-tokens", "256", "--dtype", "bfloat16"]
                                if dry else ["--preset", "gpu-long", "--max-tokens", "16384"])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TRAIN_DRY_TIMEOUT_S if dry else 50)
    if proc.returncode: raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-1500:]}")
    expected = EXPECTED.search(proc.stdout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("measured per-rank peak")), "")
    measured = [float(g) for _, g in MEASURED.findall(line)]
    if not expected or not measured: raise RuntimeError("no memory readout in the train "
                                                        f"run's stdout: {proc.stdout[-1500:]}")
    points.append(dict(source="python -m workbench.train "
                              f"({'gloo, CPU: measured is the peak RSS' if dry else 'nccl, 1 GPU'})",
                       planned_gib=float(expected.group(1)), measured_gib=max(measured)))
    table = ["| point | planned GiB | measured GiB | measured / planned |", "|---|---|---|---|"]
    table += [f"| {p['source']} | {p['planned_gib']:.3f} | {p['measured_gib']:.3f} | "
              f"{p['measured_gib'] / p['planned_gib']:.2f} |" for p in points]
    return dict(points=points, train_cmd=" ".join(cmd[1:]), run_dir=run_dir, table="\n".join(table),
                not_run=[] if long_context.exists() else ["part 4's rows: part 4 did not finish"])


def _result(out: Path, number: int) -> dict | None:
    f = out / f"part{number}.json"
    return json.loads(f.read_text())["result"] if f.exists() else None


def part_step_time(dry: bool, out: Path) -> dict:
    "predict_step against parts 1 and 4's measured steps and part 5's train run; then the factors refitted on them."
    import numpy as np
    import gpu_long_context
    import gpu_packing
    from workbench.tiny_models import tiny_config
    from workbench.cost import (Efficiency, _run_record, _seconds, calibrate, calibrate_run, check_run, cpu_device,
                                gpu_name, predict_step, run_device)
    from workbench.flops import attention_work
    from workbench.memory import Levers, preset_config
    not_run, points = [], []  # points: (source, terms, predicted_s, measured_s)
    if dry: dev = cpu_device(1)  # a dry part runs at one thread (OMP_NUM_THREADS=1)
    else:
        dev = run_device()
        if dev is None: return dict(rows=[], not_run=[f"every row: {gpu_name()} has no "
                                                      "workbench.cost.DEVICES entry (peak figures)"],
                                    table=f"no prediction: {gpu_name()} is not in workbench.cost.DEVICES")
    kind, dtype_bytes = ("cpu", 4) if dry else ("cuda", 2)
    packing = _result(out, 1)
    if packing is None: not_run.append("part 1's rows: part 1 did not finish")
    else:
        args = gpu_packing.parse_args(packing_argv(dry))
        vocab = tiny_config("llama").vocab_size if dry else gpu_packing.LLAMA_7B["vocab_size"]
        cfg = tiny_config("llama", **({} if dry else gpu_packing.LLAMA_7B), num_hidden_layers=args.layers)
        for r in packing["rows"]:
            if "tok_s" not in r: not_run.append(f"part 1 {r['dataset']} {r['mode']}: "
                                                f"not measured ({r.get('error')})"); continue
            mode = gpu_packing.MODES[r["mode"]]
            steps = gpu_packing.make_steps(r["dataset"], args.warmup + args.steps, args.batch_size, vocab, args.seed,
                                           64 if dry else None)  # as part 1 built them (same seed)
            if mode.layout == "budget": steps = gpu_packing.budget_steps(steps)
            timed = steps[args.warmup:]
            try:
                ps = [predict_step(cfg, gpu_packing.collate(mode, feats, "cpu"), dev,
                                   attention=attention_work(mode.attn, kind),
                                   dtype_bytes=dtype_bytes) for feats in timed]
            except ValueError as e: not_run.append(f"part 1 {r['dataset']} {r['mode']}: {e}"); continue
            tokens = sum(len(f["input_ids"]) for feats in timed for f in feats)
            terms = {k: float(np.mean([p.terms[k] for p in ps])) for k in ps[0].terms}
            points.append((f"part 1 {r['dataset']} {r['mode']}", terms, float(np.mean([p.step_s for p in ps])),
                           tokens / r["tok_s"] / len(timed)))
    long_context = _result(out, 4)
    if long_context is None: not_run.append("part 4's rows: part 4 did not finish")
    else:
        lc = gpu_long_context.parse_args(["--dry-run"] if dry else [])
        cfg = preset_config("qwen3-4b", num_hidden_layers=lc.layers, **(gpu_long_context.TINY if dry else {}))
        for r in long_context["rows"]:
            ran = [t for t in r["trials"][1:] if t["fits"]]  # the first trial of a row builds kernels: warm-up
            if not ran: not_run.append(f"part 4 cap {r['cap_gib']} GiB {r['levers']}: "
                                       "no fitting trial past the first"); continue
            t = max(ran, key=lambda t: t["tokens"])
            p = predict_step(cfg, [[t["tokens"]]], dev, attention=attention_work("sdpa", kind),
                             levers=gpu_long_context.LEVER_SETS[r["levers"]], dtype_bytes=dtype_bytes)
            terms = fwd_bwd_terms(p, dev)  # a trial is one forward + backward: no optimizer step, offload copies kept
            points.append((f"part 4 {r['levers']}, {t['tokens']:,} tokens (one fwd+bwd)", terms,
                           _seconds(terms, Efficiency()), t["seconds"]))
    rows = [dict(source=src, predicted_s=pred, measured_s=meas, error=meas / pred - 1) for src, _, pred, meas in points]
    refit = None
    if points:
        refit = calibrate([(terms, meas) for _, terms, _, meas in points], ("compute",))
        for row, (_, terms, _, meas) in zip(rows, points):
            row.update(refit_predicted_s=_seconds(terms, refit), refit_error=meas / _seconds(terms, refit) - 1)
    memory = _result(out, 5)
    run_refit = None
    if memory is None or not memory.get("run_dir"): not_run.append("part 5's train run: part 5 did not finish")
    else:
        h = check_run(memory["run_dir"], record=False)  # the run's own prediction (its device, its factors), one basis
        row = dict(source=f"part 5 train run ({h.device})", predicted_s=h.predicted_s, measured_s=h.measured_s,
                   error=h.error)
        try: run_refit = calibrate_run(memory["run_dir"])
        # its first error still stands
        except ValueError as e: not_run.append(f"calibrate_run on part 5's train run: {e}")
        if run_refit is not None:
            _, run_rows = _run_record(memory["run_dir"], 1)
            refit_s = np.mean([r["mfu"] * r["step_s"] / run_refit.matmul + run_refit.overhead_s for r in run_rows])
            row.update(refit_predicted_s=float(refit_s),
                       refit_error=float(np.mean([r["step_s"] for r in run_rows]) / refit_s - 1))
        rows.append(row)
    table = ["| measured step | predicted s | measured s | error | refitted predicted s | refitted error |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r['source']} | {r['predicted_s']:.4g} | {r['measured_s']:.4g} | {r['error']:+.0%} | "
              f"{r.get('refit_predicted_s', float('nan')):.4g} | {r.get('refit_error', float('nan')):+.0%} |"
              for r in rows]
    table.append(f"error = measured / predicted - 1 (+: predicted too fast). Refitted: compute efficiency fitted by "
                 f"calibrate on the part 1 and 4 rows ({refit.matmul:.3g} of peak)" if refit
                 else "no part 1 or 4 rows to refit on")
    if run_refit: table.append(f"and by calibrate_run on the train run ({run_refit.matmul:.3g} of peak, "
                               f"overhead {run_refit.overhead_s:.3g} s) on {dev.name}.")
    return dict(device=dev.name, rows=rows, refit=None if refit is None else refit.matmul,
                run_refit=None if run_refit is None else dict(matmul=run_refit.matmul, overhead_s=run_refit.overhead_s),
                table="\n".join(table), not_run=not_run)


def fwd_bwd_terms(prediction, dev) -> dict:
    "A prediction's terms for one forward + backward: no optimizer step, the offloaded checkpoints' host copies kept."
    return dict(prediction.terms, memory=prediction.cost.bytes["host transfers"] / dev.pcie)


def part_predictor(dry: bool, out: Path) -> dict:
    """The step predictor held out on GPU rows: the H200 fit's own held-out steps, and part 7's all-levers steps on this
    GPU predicted with the same factors (the target: a median and worst error within 15%)."""
    import numpy as np
    import gpu_long_context
    from workbench.bench import recorded_steps
    from workbench.cost import _seconds, cpu_device, fit_held_out, gpu_name, predict_step, run_device
    from workbench.memory import preset_config
    fit = fit_held_out(recorded_steps())
    rows = [dict(source=f"H200 {r.source}", predicted_s=r.predicted_s, measured_s=r.measured_s, error=r.error)
            for r in fit.held_out.itertuples()]
    not_run = ["a CPU dry run predicts its steps with the GPU's factors: its part 7 errors mean nothing"] if dry else []
    dev = cpu_device(1) if dry else run_device()
    levers = _result(out, 7)
    if dev is None: not_run.append(f"part 7's rows: {gpu_name()} has no workbench.cost.DEVICES entry")
    elif levers is None: not_run.append("part 7's rows: part 7 did not finish")
    else:
        lc = gpu_long_context.parse_args(["--dry-run"] if dry else [])
        cfg = preset_config("qwen3-4b", num_hidden_layers=lc.layers, **(gpu_long_context.TINY if dry else {}))
        for r in levers["rows"]:
            if r["seconds"] is None: continue  # out of memory: part 7 says so
            p = predict_step(cfg, [[r["tokens"]]], dev, fit.efficiency, attention="causal", kernel="flash",
                             levers=gpu_long_context.LEVER_SETS[r["levers"]], dtype_bytes=2)  # one document: is_causal
            predicted = _seconds(fwd_bwd_terms(p, dev), fit.efficiency)
            rows.append(dict(source=f"part 7 {r['levers']}, {r['tokens']:,} tokens (one fwd+bwd, {dev.name})",
                             predicted_s=predicted, measured_s=r["seconds"], error=r["seconds"] / predicted - 1))
    errors = [abs(r["error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["error"]))
    table = ["| held-out step | predicted s | measured s | error |", "|---|---|---|---|"]
    table += [f"| {r['source']} | {r['predicted_s']:.4g} | {r['measured_s']:.4g} | {r['error']:+.0%} |" for r in rows]
    table.append(f"error = measured / predicted - 1 (+: predicted too fast); factors fitted on "
                 f"{len(fit.efficiency.fitted_on)} H200 FLAN steps. Held out: median |error| "
                 f"{float(np.median(errors)):.1%}, worst {worst['error']:+.1%} ({worst['source']}).")
    return dict(device=dev.name if dev else None, rows=rows, median_error=float(np.median(errors)),
                worst=worst, table="\n".join(table), not_run=not_run)


def run_part(number: int, dry: bool, out: Path, fail: bool) -> None:
    "Child side: run one part and write `out/partN.json`."
    if fail: raise RuntimeError(f"part {number} failed on purpose (--fail-part {number})")
    fn = {1: part_packing, 2: part_kernels, 3: part_sp_kernels, 4: part_long_context, 5: lambda d: part_memory(d, out),
          6: lambda d: part_step_time(d, out), 7: part_levers_at_length, 8: part_alst, 9: part_profile_64k,
          10: lambda d: part_predictor(d, out)}[number]
    (out / f"part{number}.json").write_text(json.dumps(dict(result=fn(dry)), indent=1, default=str))


# ---- the parent: environment, caps, the report ----

def version(dist: str) -> str:
    try: return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError: return "absent"


def environment(install_note: str, dry: bool = False) -> dict:
    "Versions of what ran; a dry run does not import torch here (seconds on a loaded box: its parts import it anyway)."
    if dry:
        return dict(gpu="absent", driver="absent", cuda="not checked (dry run)", torch=version("torch"),
                    transformers=version("transformers"), flash_attn=version("flash-attn"),
                    flash_attn_install=install_note, python=sys.version.split()[0])
    import torch
    gpu = driver = "absent"
    if torch.cuda.is_available():  # nvidia-smi, not torch: no CUDA context held by the suite while the parts run
        try: gpu, driver = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                          capture_output=True, text=True, timeout=20).stdout.splitlines()[0].split(", ")
        except (OSError, subprocess.TimeoutExpired, IndexError, ValueError): gpu, driver = "unknown", (
            "unknown (nvidia-smi failed)")
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
    # a dry run beside other jobs: no oversubscription
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.dry_run else None
    # a kill while Popen runs waits until `proc` is known: never an orphan
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try: proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                 env=env)
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
    lines += [f"| {r['part']} | {r['name']} | {r['status']} | {r.get('seconds', '')} | {r['cap_s']:g} |"
              for r in records]
    for r in records:
        lines += ["", f"## {r['part']} {r['name']}: {r['status']}", ""]
        if "result" in r:
            lines.append(r["result"]["table"])
            if r["result"].get("not_run"): lines += ["", "Not run: " + "; ".join(r["result"]["not_run"]) + "."]
        elif "stderr_tail" in r: lines += ["```", r["stdout_tail"][-800:], r["stderr_tail"][-800:], "```"]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for suite.json, suite.md and the parts' files")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, gloo: the same code paths as on a GPU")
    p.add_argument("--install-flash-attn", action="store_true", help="first try a prebuilt flash-attn wheel (60 s cap)")
    p.add_argument("--suite", choices=tuple(SUITES), default="default", help="which parts run (unless --parts): "
                   + "; ".join(f"{k}: {' '.join(map(str, v))}" for k, v in SUITES.items()))
    p.add_argument("--parts", type=int, nargs="+", help="run only these parts")
    p.add_argument("--cap-s", type=float, help="one wall-clock cap, seconds, for every part (testing)")
    p.add_argument("--fail-part", type=int, nargs="*", default=[],
                   help="make these parts raise (testing the isolation)")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)  # internal: run one part in this process
    p.add_argument("--fail", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    known = {q.number for q in PARTS}
    if args.parts is None: args.parts = list(SUITES[args.suite])
    if not set(args.parts) <= known or not set(args.fail_part) <= known:
        p.error(f"parts are numbered {sorted(known)}; got --parts {args.parts} --fail-part {args.fail_part}")
    if args.out.exists() and not args.out.is_dir(): p.error(f"--out {args.out} is a file: pass "
                                                            "a directory (made if missing)")
    if args.cap_s is not None and args.cap_s <= 0: p.error("--cap-s must be a positive number "
                                                           f"of seconds, got {args.cap_s}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child is not None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # the mask supervise held while starting it was inherited
        return run_part(args.child, args.dry_run, args.out, args.fail)
    for s in STOPS: signal.signal(s, stop)  # a kill or Ctrl-C ends the running part's session too (supervise)
    if not args.dry_run:
        import torch
        if not torch.cuda.is_available(): raise SystemExit("no CUDA GPU: use --dry-run on a CPU")
    for stale in args.out.glob("part*.json"): stale.unlink()  # a reused directory: never report an old part's result
    t0 = time.perf_counter()
    note = install_flash_attn() if args.install_flash_attn else "not tried (--install-flash-attn)"
    env = environment(note, args.dry_run)
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
