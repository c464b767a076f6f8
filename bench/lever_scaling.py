"""Time per token of one forward + backward with all memory levers, against the cost model's FLOPs (issue 48).

All levers (`LEVER_LADDER["+ checkpoint offload"]`: checkpointing with the checkpoints offloaded, the tiled loss, the
tiled MLP and the lean kernels, applied as `bench/gpu_long_context.py` applies them) on a small Qwen3-shaped model in
bf16, one row of random tokens at each length. Beside each time: the FLOPs `workbench.flops.step_cost` counts for the
same row and levers (forward, backward and recomputation), and the seconds per TFLOP. A term of the step that grows
faster than its FLOPs shows as seconds per TFLOP rising with the length. At the largest length the step runs once
more under torch.profiler and its top operators (self time) are printed.

  OMP_NUM_THREADS=1 python bench/lever_scaling.py                       # CPU: 2K-16K tokens, a few minutes
  OMP_NUM_THREADS=1 python bench/lever_scaling.py --tokens 512 1024 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # the sibling script gpu_long_context.py
from gpu_long_context import build  # noqa: E402

from workbench.flops import step_cost  # noqa: E402
from workbench.memory import LEVER_LADDER, preset_config  # noqa: E402
from workbench.sp.loss import causal_lm_loss_sum  # noqa: E402

LEVERS = LEVER_LADDER["+ checkpoint offload"]
SMALL = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=768, vocab_size=16384)  # Qwen3's shape ratios (vocab / hidden 64, MLP 3x) at hidden 256


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384], help="row lengths to time")
    p.add_argument("--top", type=int, default=12, help="operators to list from the profile at the largest length")
    p.add_argument("--json", help="write the rows and the profile here")
    return p.parse_args(argv)


def step(model, n: int, device) -> float:
    "Seconds of one forward + tiled loss + backward of one row of `n` random tokens."
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, model.config.vocab_size, (1, n), device=device)
    batch = dict(input_ids=ids, position_ids=torch.arange(n, device=device)[None], labels=ids)
    if device.type == "cuda": torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    causal_lm_loss_sum(model, batch, chunk_size=LEVERS.loss_chunk)[0].backward()
    if device.type == "cuda": torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = preset_config("qwen3-4b", **SMALL)
    model = build(cfg, LEVERS, device, torch.bfloat16)
    step(model, min(args.tokens), device)  # warm-up: kernels chosen, pools filled
    rows = []
    for n in args.tokens:
        seconds, flops = step(model, n, device), step_cost(cfg, [n], levers=LEVERS).total
        rows.append(dict(tokens=n, seconds=seconds, us_per_token=seconds / n * 1e6, tflops=flops / 1e12,
                         s_per_tflop=seconds / (flops / 1e12)))
        print(f"{n:>7,} tokens: {seconds:8.2f} s, {rows[-1]['us_per_token']:8.1f} us/token, "
              f"{flops / 1e12:7.3f} TFLOP, {rows[-1]['s_per_tflop']:6.2f} s/TFLOP", flush=True)
    kinds = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[kinds.CPU] + [kinds.CUDA] * (device.type == "cuda")) as prof:
        step(model, max(args.tokens), device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    top = prof.key_averages().table(sort_by=sort, row_limit=args.top)
    print(f"profile at {max(args.tokens):,} tokens:\n{top}")
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu, {torch.get_num_threads()} thread(s)"
    return dict(device=name, torch=torch.__version__, model=SMALL, levers=str(LEVERS), rows=rows, profile=top)


def table(out: dict) -> str:
    "The rows as a markdown table, each length's time per token and seconds per TFLOP also relative to the first."
    first = out["rows"][0]
    lines = ["| tokens | s / step | us / token | x first | cost-model TFLOP | s / TFLOP | x first |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out["rows"]:
        lines.append(f"| {r['tokens']:,} | {r['seconds']:.2f} | {r['us_per_token']:.1f} | "
                     f"{r['us_per_token'] / first['us_per_token']:.2f} | {r['tflops']:.3f} | {r['s_per_tflop']:.2f} | "
                     f"{r['s_per_tflop'] / first['s_per_tflop']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    out = run(args)
    print(table(out))
    if args.json: Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
