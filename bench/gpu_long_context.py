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

`--at TOKENS ...` measures all levers at those lengths and at the planner's longest fit under the first cap instead
(seconds, time per token, peak against the planner's peak; issue 48); `--profile TOKENS` profiles one step.

  python bench/gpu_long_context.py --json bench/gpu_long_context.json   # one CUDA GPU, about 5 min on an H200
  python bench/gpu_long_context.py --at 16384 32768 65536 --cap-gib 16  # one CUDA GPU
  python bench/gpu_long_context.py --dry-run                            # CPU, tiny shapes, the cap simulated
"""
from __future__ import annotations

import argparse
import ctypes
import json
import time

import torch

from workbench.memory import LEVER_LADDER, LiveBytes, Levers, estimate, max_context, preset_config
from workbench.readouts import peak_memory_bytes, watch_memory
from workbench.sp.loss import causal_lm_loss_sum
from workbench.tiling import checkpoint_layers, lean_kernels, tile_mlp

LEVER_SETS = {"checkpointing only": LEVER_LADDER["blog setup (checkpointing)"],
              "all levers": LEVER_LADDER["+ checkpoint offload"]}
TINY = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=192,
            vocab_size=512)  # with the dry cap below: a few hundred tokens a trial, so the dry run takes seconds


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the Qwen3-4B-shaped model")
    p.add_argument("--cap-gib", type=float, nargs="+", default=[12.0, 20.0], help="GPU memory caps to search under")
    p.add_argument("--step", type=float, default=1.05, help="stop when the longest fit and "
                                                            "the shortest miss are this close")
    p.add_argument("--max-trials", type=int, default=10, help="trials per lever set and cap")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, peaks from "
                                                          "live tensors, the cap simulated")
    p.add_argument("--at", type=int, nargs="+", metavar="TOKENS",
                   help="instead of the search: all levers at these lengths and at the planner's longest fit under the "
                        "first --cap-gib (time, peak, the planner's peak)")
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


def random_batch(n: int, vocab: int, device) -> dict:
    "One row of `n` random tokens, its positions and labels: the same row for every model at `n` (seeded by `n`)."
    ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
    return dict(input_ids=ids, position_ids=torch.arange(n, device=device)[None], labels=ids)


def lever_loss(levers: Levers):
    """The mean token loss a lever set trains with, as `loss(model, batch)`: the tiled loss's sum / count or
    transformers'."""
    def loss(model, batch):
        if not levers.tiled_loss: return model(**batch, use_cache=False).loss
        total, count = causal_lm_loss_sum(model, batch, chunk_size=levers.loss_chunk)
        return total / count
    return loss


def _trim_heap():
    "Hand the heap's freed pages back to the OS (glibc), so that a CPU step's resident-set growth is its own."
    try: ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError): pass  # not glibc: memory an earlier step freed may hide part of the growth


def run_step(model, n: int, loss, device, track: bool = False) -> dict:
    """One forward + backward of `loss(model, batch)` on `random_batch(n)`: its seconds, loss and peak bytes with the
    model's weights. On a GPU the allocator's peak (what the step adds to what was allocated before it, plus weights);
    on a CPU the resident set's growth (`rss_bytes`) and, when `track`, the live tensors' peak (`LiveBytes`: it slows
    the step, so time a step without it). Raises torch.OutOfMemoryError on a GPU that runs out."""
    model.zero_grad(set_to_none=True)
    batch = random_batch(n, model.config.vocab_size, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cuda = device.type == "cuda"
    tracker = LiveBytes() if track and not cuda else None
    if cuda:
        torch.cuda.synchronize(device); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        _trim_heap()
        watch_memory(device)
        before = peak_memory_bytes(device)  # the peak resident set restarts from the resident set now
    t0 = time.perf_counter()
    with tracker or torch.enable_grad():
        value = loss(model, batch)
        value.backward()
    if cuda: torch.cuda.synchronize(device)
    out = dict(seconds=time.perf_counter() - t0, loss=value.item())
    if cuda: out["peak_bytes"] = torch.cuda.max_memory_allocated(device) - before + weights
    else:
        out["rss_bytes"] = max(0, peak_memory_bytes(device) - before)  # the kernel's counters lag by a few pages
        if tracker: out["peak_bytes"] = tracker.peak + weights  # + the weights (their gradients are tracked)
    return out


def step_bytes(model, n: int, levers: Levers, device) -> int:
    "Peak bytes of one forward + backward at `n` tokens (raises torch.OutOfMemoryError on a GPU that runs out)."
    return run_step(model, n, lever_loss(levers), device, track=True)["peak_bytes"]


def cap_memory(cap_gib: float, device):
    "On a GPU, let this process allocate at most `cap_gib` (a CPU's cap is a comparison of the measured peak)."
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), device)


def search(measure, start: int, cap: int, args) -> list[dict]:
    """Bracket the longest length that fits (steps of 25% from `start`), then bisect until the bracket is within
    `--step`; `measure(n)` is a step's peak bytes at `n` tokens (or raises torch.OutOfMemoryError)."""
    trials = []

    def attempt(n: int) -> bool:
        t0 = time.perf_counter()
        try:
            peak = measure(n)
            fits = peak <= cap
        except torch.OutOfMemoryError:
            peak, fits = None, False
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


def profile(cfg, n: int, device, dtype, top: int = 12, sets=tuple(LEVER_SETS)) -> list[dict]:
    """One forward + backward at `n` tokens per lever set of `sets` under torch.profiler: seconds, peak (a CPU's: the
    resident set's growth) and the top ops by time."""
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = []
    for name in sets:
        levers = LEVER_SETS[name]
        model = build(cfg, levers, device, dtype)
        run_step(model, min(n, 256), lever_loss(levers), device)  # warm-up: kernels chosen and loaded
        t0 = time.perf_counter()
        try:
            with torch.profiler.profile(activities=activities) as prof:  # untracked: no LiveBytes ops in the profile
                step = run_step(model, n, lever_loss(levers), device)
        except torch.OutOfMemoryError:
            print(f"{name}, {n:,} tokens: out of memory", flush=True)
            rows.append(dict(levers=name, tokens=n, seconds=None, peak_gib=None, top_ops="out of memory"))
            del model
            continue
        seconds = time.perf_counter() - t0
        peak = step["peak_bytes"] if device.type == "cuda" else step["rss_bytes"]  # a CPU's: the resident set's growth
        ops = prof.key_averages().table(sort_by=sort_key, row_limit=top)
        print(f"{name}, {n:,} tokens: {seconds:.2f} s, {'peak' if device.type == 'cuda' else 'RSS growth'} "
              f"{peak / 2**30:.2f} GiB\n{ops}", flush=True)
        rows.append(dict(levers=name, tokens=n, seconds=seconds, peak_gib=peak / 2**30, top_ops=ops))
        del model
    return rows


def at_lengths(cfg, lengths: list[int], cap_gib: float, device, dtype, name: str = "all levers") -> list[dict]:
    """One lever set under a memory cap at each of `lengths` and at the planner's longest fit under the cap: a step's
    seconds, tokens/s and peak beside the planner's peak (their ratio), each row printed as it is measured."""
    levers = LEVER_SETS[name]
    options = dict(levers=levers, zero_stage=0, optimizer_offload=True, runtime_gib=0)
    fit = max_context(cfg, cap_gib, **options).memory_tokens
    cap_memory(cap_gib, device)
    model = build(cfg, levers, device, dtype)
    step_bytes(model, min(256, *lengths), levers, device)  # warm-up: kernels chosen and loaded
    rows = []
    for n, point in [(n, f"{n:,} tokens") for n in lengths] + [(fit, f"planner's longest fit under {cap_gib:g} GiB")]:
        row = dict(levers=name, point=point, tokens=n, cap_gib=cap_gib, planned_gib=estimate(cfg, n, **options).gib)
        try: step = run_step(model, n, lever_loss(levers), device, track=True)
        except torch.OutOfMemoryError: row.update(fits=False, seconds=None, peak_gib=None)
        else: row.update(fits=step["peak_bytes"] <= cap_gib * 2**30, seconds=step["seconds"],
                         peak_gib=step["peak_bytes"] / 2**30)
        rows.append(row)
        print(json.dumps(row), flush=True)  # a part killed at its cap keeps the rows it got to in its stdout
    return rows


def length_table(rows: list[dict]) -> str:
    "`at_lengths`'s rows as a markdown table (time per 1K tokens: what should stay flat but for attention)."
    lines = ["| levers | point | tokens | seconds | ms per 1K tokens | peak GiB | planned GiB | peak / planned |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["peak_gib"] is None:
            lines.append(f"| {r['levers']} | {r['point']} | {r['tokens']:,} | out of memory | - | - | "
                         f"{r['planned_gib']:.3g} | - |")
            continue
        lines.append(f"| {r['levers']} | {r['point']} | {r['tokens']:,} | {r['seconds']:.2f} | "
                     f"{r['seconds'] / r['tokens'] * 1e6:.1f} | "
                     f"{r['peak_gib']:.3g}{'' if r['fits'] else ' (over the cap)'}"
                     " | "
                     f"{r['planned_gib']:.3g} | {r['peak_gib'] / r['planned_gib']:.2f} |")
    return "\n".join(lines)


def run(args) -> list[dict]:
    if not args.dry_run and not torch.cuda.is_available(): raise SystemExit("no CUDA GPU: use --dry-run on a CPU")
    # an index: the memory cap needs one
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16  # the planner's activation terms are measured for 2-byte training
    cfg = preset_config("qwen3-4b", num_hidden_layers=args.layers, **(TINY if args.dry_run else {}))
    if args.profile: return profile(cfg, args.profile, device, dtype)
    if args.at: return at_lengths(cfg, args.at, args.cap_gib[0], device, dtype)
    rows = []
    for cap_gib in args.cap_gib:
        cap_memory(cap_gib, device)
        for name, levers in LEVER_SETS.items():
            options = dict(levers=levers, zero_stage=0, optimizer_offload=True, runtime_gib=0)
            plan = max_context(cfg, cap_gib, **options)
            print(f"cap {cap_gib} GiB, {name}: planner says {plan.memory_tokens:,} tokens fit", flush=True)
            model = build(cfg, levers, device, dtype)
            trials = search(lambda n: step_bytes(model, n, levers, device), plan.memory_tokens, int(cap_gib * 2**30),
                            args)
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
    if args.at: print(length_table(rows))
    elif not args.profile: print(table(rows))
    if args.json:
        with open(args.json, "w") as f: json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
