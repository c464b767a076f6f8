"""Longest context a Qwen3-4B-shaped model trains at on one CUDA GPU, with and without the memory levers, beside the
planner (issue 7).

The model has Qwen3-4B's layer shapes (hidden 2560, 32 heads, 8 kv heads, intermediate 9728, vocab 151936) and
`--layers` decoder layers, in bf16; a trial is one forward + backward of one row of random tokens through sdpa's
causal kernel (no mask). The optimizer step is not run: the planned setup keeps it on the CPU
(`optimizer_offload=True`), so the GPU holds parameters, gradients and activations, which is exactly what is measured
(`torch.cuda.max_memory_allocated`) and planned (`estimate(..., zero_stage=0, optimizer_offload=True, runtime_gib=0)`).

Attention is quadratic, so a trial at a million tokens takes minutes. To keep the whole run within a few minutes, the
GPU memory is capped (`torch.cuda.set_per_process_memory_fraction`) at `--cap-gib`: the longest context under that cap
is found by search (start at the planner's answer, bracket in steps of 25%, bisect to 5%) for two lever
sets, checkpointing only and all levers (`LEVER_LADDER`), and printed beside the planner's answer.

  python bench/gpu_long_context.py --json bench/gpu_long_context.json   # one CUDA GPU, about 5 min on an H200
  python bench/gpu_long_context.py --dry-run                            # CPU, tiny shapes, the cap simulated
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from workbench.memory import LEVER_LADDER, LiveBytes, Levers, estimate, max_context, preset_config
from workbench.tiling import causal_lm_loss_sum, checkpoint_layers, lean_kernels, tile_mlp

LEVER_SETS = {"checkpointing only": LEVER_LADDER["blog setup (checkpointing)"],
              "all levers": LEVER_LADDER["+ checkpoint offload"]}
TINY = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=192,
            vocab_size=512)  # with the dry cap below: a few hundred tokens a trial, so the dry run takes seconds


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the Qwen3-4B-shaped model")
    p.add_argument("--cap-gib", type=float, nargs="+", default=[12.0, 20.0], help="GPU memory caps to search under")
    p.add_argument("--step", type=float, default=1.05, help="stop when the longest fit and the shortest miss are this close")
    p.add_argument("--max-trials", type=int, default=10, help="trials per lever set and cap")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, peaks from live tensors, the cap simulated")
    p.add_argument("--profile", type=int, metavar="TOKENS",
                   help="instead of the search: one step of each lever set at TOKENS under torch.profiler, its top ops")
    args = p.parse_args(argv)
    if args.dry_run: args.cap_gib = [0.002]
    return args


def build(cfg, levers: Levers, device, dtype):
    "The model with the levers applied, in train mode on `device`."
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).to(device).train()
    if levers.checkpointing: checkpoint_layers(model, offload=levers.offload_checkpoints)
    if levers.lean_kernels: lean_kernels(model)
    if levers.tiled_mlp: tile_mlp(model, levers.mlp_chunk)
    return model


def step_bytes(model, n: int, levers: Levers, device) -> int:
    "Peak bytes of one forward + backward at `n` tokens (raises torch.OutOfMemoryError on a GPU that runs out)."
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, model.config.vocab_size, (1, n), device=device)
    batch = dict(input_ids=ids, position_ids=torch.arange(n, device=device)[None], labels=ids)
    tracker = None if device.type == "cuda" else LiveBytes()
    if device.type == "cuda": torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats(device)
    with tracker or torch.enable_grad():
        loss = (causal_lm_loss_sum(model, batch, chunk_size=levers.loss_chunk)[0] if levers.tiled_loss
                else model(**batch, use_cache=False).loss)
        loss.backward()
    if tracker is None: return torch.cuda.max_memory_allocated(device)
    return tracker.peak + sum(p.numel() * p.element_size() for p in model.parameters())  # + the weights (grads tracked)


def search(model, levers: Levers, start: int, cap: int, args, device) -> list[dict]:
    "Bracket the longest length that fits (steps of 25% from `start`), then bisect until the bracket is within `--step`."
    trials = []

    def attempt(n: int) -> bool:
        t0 = time.perf_counter()
        try:
            peak = step_bytes(model, n, levers, device)
            fits = peak <= cap
        except torch.OutOfMemoryError:
            peak, fits = None, False
        model.zero_grad(set_to_none=True)
        trials.append(dict(tokens=n, fits=fits, peak_gib=None if peak is None else peak / 2**30,
                           seconds=round(time.perf_counter() - t0, 2)))
        print(f"    {n:>10,} tokens: {'fits' if fits else 'out of memory'}"
              f"{'' if peak is None else f', peak {peak / 2**30:.2f} GiB'} ({trials[-1]['seconds']} s)", flush=True)
        return fits

    budget = lambda: len(trials) < args.max_trials
    n = max(start, 64)
    lo, hi = (n, None) if attempt(n) else (None, n)
    while lo is None and budget():
        n = int(n / 1.25)
        lo, hi = (n, hi) if attempt(n) else (None, n)
    while hi is None and budget():
        n = int(n * 1.25)
        lo, hi = (lo, n) if not attempt(n) else (n, None)
    while lo and hi and hi / lo > args.step and budget():
        mid = int((lo * hi) ** 0.5)
        lo, hi = (mid, hi) if attempt(mid) else (lo, mid)
    return trials


def profile(cfg, n: int, device, dtype, top: int = 12) -> list[dict]:
    "One forward + backward at `n` tokens per lever set under torch.profiler: seconds, peak and the ops that took the most time."
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = []
    for name, levers in LEVER_SETS.items():
        model = build(cfg, levers, device, dtype)
        step_bytes(model, min(n, 256), levers, device)  # warm-up: kernels chosen and loaded
        t0 = time.perf_counter()
        try:
            with torch.profiler.profile(activities=activities) as prof:
                peak = step_bytes(model, n, levers, device)
        except torch.OutOfMemoryError:
            print(f"{name}, {n:,} tokens: out of memory", flush=True)
            rows.append(dict(levers=name, tokens=n, seconds=None, peak_gib=None, top_ops="out of memory"))
            del model
            continue
        seconds = time.perf_counter() - t0
        ops = prof.key_averages().table(sort_by=sort_key, row_limit=top)
        print(f"{name}, {n:,} tokens: {seconds:.2f} s, peak {peak / 2**30:.2f} GiB\n{ops}", flush=True)
        rows.append(dict(levers=name, tokens=n, seconds=seconds, peak_gib=peak / 2**30, top_ops=ops))
        del model
    return rows


def run(args) -> list[dict]:
    if not args.dry_run and not torch.cuda.is_available(): raise SystemExit("no CUDA GPU: use --dry-run on a CPU")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())  # an index: the memory cap needs one
    dtype = torch.bfloat16  # the planner's activation terms are measured for 2-byte training
    cfg = preset_config("qwen3-4b", num_hidden_layers=args.layers, **(TINY if args.dry_run else {}))
    if args.profile: return profile(cfg, args.profile, device, dtype)
    rows = []
    for cap_gib in args.cap_gib:
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), device)
        for name, levers in LEVER_SETS.items():
            options = dict(levers=levers, zero_stage=0, optimizer_offload=True, runtime_gib=0)
            plan = max_context(cfg, cap_gib, **options)
            print(f"cap {cap_gib} GiB, {name}: planner says {plan.memory_tokens:,} tokens fit", flush=True)
            model = build(cfg, levers, device, dtype)
            trials = search(model, levers, plan.memory_tokens, int(cap_gib * 2**30), args, device)
            del model
            ran = [t for t in trials if t["fits"]]
            best = max(ran, key=lambda t: t["tokens"]) if ran else None
            planned_at_best = estimate(cfg, best["tokens"], **options).gib if best else None
            rows.append(dict(cap_gib=cap_gib, levers=name, planned_tokens=plan.memory_tokens,
                             measured_tokens=best["tokens"] if best else 0,
                             measured_peak_gib=best["peak_gib"] if best else None, planned_peak_gib=planned_at_best,
                             trials=trials))
            if device.type == "cuda": torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'cap GiB':>8} {'levers':<20} {'planned':>11} {'measured':>11} {'ratio':>6} {'peak':>7} {'plan':>7}"]
    for r in rows:
        ratio = r["measured_tokens"] / r["planned_tokens"] if r["planned_tokens"] else float("nan")
        peak = f"{r['measured_peak_gib']:.2f}" if r["measured_peak_gib"] is not None else "-"
        plan = f"{r['planned_peak_gib']:.2f}" if r["planned_peak_gib"] is not None else "-"
        lines.append(f"{r['cap_gib']:>8} {r['levers']:<20} {r['planned_tokens']:>11,} {r['measured_tokens']:>11,} "
                     f"{ratio:>6.2f} {peak:>7} {plan:>7}")
    for cap in sorted({r["cap_gib"] for r in rows}):
        got = {r["levers"]: r["measured_tokens"] for r in rows if r["cap_gib"] == cap}
        if got.get("checkpointing only"):
            lines.append(f"cap {cap} GiB: the levers multiply the longest context by "
                         f"{got['all levers'] / got['checkpointing only']:.1f}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if torch.cuda.is_available() and not args.dry_run:
        print(torch.cuda.get_device_name(), f"torch {torch.__version__}", flush=True)
    rows = run(args)
    if not args.profile: print(table(rows))
    if args.json:
        with open(args.json, "w") as f: json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
