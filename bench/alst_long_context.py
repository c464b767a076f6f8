"""DeepSpeed ALST's long-context levers against the workbench's, side by side on one model in one process (issue 48).

ALST (Arctic Long Sequence Training, DeepSpeed 0.19) trains long rows on one GPU with three levers: `TiledMLP`, a tiled
loss through `sequence_tiled_compute`, and activation checkpoints offloaded to the CPU (`deepspeed.checkpointing` with
`checkpoint_in_cpu`). The workbench's levers are the same kind (`workbench.tiling`: `tile_mlp`, the tiled loss,
`checkpoint_layers(offload=True)`, plus `lean_kernels`). Both sides here are built from the same seed on the same
Qwen3-shaped model (sdpa, `--layers` decoder layers), and each step is one forward + backward of the same random row:

- per length: each side's seconds, peak and loss, and the max |diff| of the loss and of every gradient between the two
  (they compute the same mean token loss; fp32 on a CPU, so the diffs are rounding);
- with `--cap-gib`: the longest row each side fits under the cap (the search of `bench/gpu_long_context.py`, from the
  longest compared row that fitted), beside the planner's longest fit for the workbench's levers.

Peaks: on a GPU the allocator's (the step's own, with its model's weights); on a CPU the live tensors' (`LiveBytes`,
from a second, untimed step) and the resident set's growth. On a CPU the host is the device, so neither offload saves
anything there; and DeepSpeed's `checkpoint_in_cpu` cannot run on a CPU at all (its copy "to the CPU" of a CPU tensor
is the tensor itself, which it then empties: the backward's recompute fails with an IndexError), so on a CPU the ALST
side runs DeepSpeed's checkpointing without the offload. Tiles: ALST's MLP rule (ceil(tokens / hidden) shards) is the
workbench's default MLP tile; its loss runs in shards of the workbench's loss tile (1,024 tokens). ArcticTraining
sizes loss shards to about 1 GiB of fp32 logits: 1,767 tokens at Qwen3-4B's vocabulary.

  python bench/alst_long_context.py                                          # CPU: a small Qwen3-shaped model
  python bench/alst_long_context.py --qwen3-4b --lengths 32768 65536 --cap-gib 16   # one CUDA GPU
  python bench/alst_long_context.py --dry-run                                # CPU, tiny shapes, seconds
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling gpu_long_context.py
import gpu_long_context as glc  # noqa: E402
from workbench.core import IGNORE_INDEX, shift_labels  # noqa: E402
from workbench.memory import Levers, max_context, preset_config  # noqa: E402
from workbench.tiling import decoder_layers, override_forward  # noqa: E402

SMALL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=384,
             vocab_size=8192)  # Qwen3-4B's proportions (vocab / hidden 64, MLP 3x hidden) at a CPU's size
WORKBENCH = "workbench (all levers)"
ALST = "ALST (DeepSpeed)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--qwen3-4b", action="store_true", help="Qwen3-4B's layer shapes (a GPU's size), not the small ones")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192], help="row lengths to compare at")
    p.add_argument("--cap-gib", type=float, help="also find each side's longest row under this memory cap")
    p.add_argument("--step", type=float, default=1.05,
                   help="stop the search when the longest fit and the shortest miss are this close")
    p.add_argument("--max-trials", type=int, default=8, help="search trials per side")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, a tiny cap")
    args = p.parse_args(argv)
    if args.dry_run: args.lengths, args.cap_gib, args.max_trials = [128, 256], 0.004, 3
    if any(n < 2 for n in args.lengths): p.error(f"--lengths must be at least 2 tokens each, got {args.lengths}")
    if args.cap_gib is not None and args.cap_gib <= 0: p.error(f"--cap-gib must be positive, got {args.cap_gib}")
    return args


def deepspeed_api(device):
    "DeepSpeed's checkpoint function (checkpoints offloaded from a GPU), TiledMLP and sequence_tiled_compute."
    if device.type == "cpu": os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is imported
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP, sequence_tiled_compute
    if not deepspeed.comm.is_initialized():  # its checkpointing asks for ranks: a group of one, over a file (no port)
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False, rank=0, world_size=1,
                                   init_method=f"file://{tempfile.mkdtemp(prefix='alst_')}/store")
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=device.type == "cuda")
    return deepspeed.checkpointing.checkpoint, TiledMLP, sequence_tiled_compute


def _alst_mlp(tiled_mlp, forward, mlp, chunk: int, x):
    "One MLP through DeepSpeed's `TiledMLP` in ceil(tokens / chunk) shards (ALST's rule with chunk = hidden size)."
    shards = math.ceil(x.shape[-2] / chunk)
    return tiled_mlp.apply(lambda _, shard: forward(shard), mlp, x, shards, list(mlp.parameters()))


def alst_loss(tiled_compute, chunk: int):
    "ALST's tiled loss as `loss(model, batch)`: token losses per shard of `chunk` tokens, redone in backward."
    def loss(model, batch):
        hidden = model.base_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                  use_cache=False).last_hidden_state
        targets = shift_labels(batch["labels"])
        head = model.get_output_embeddings()

        def shard_loss(hidden_states, shift_labels):  # in fp32, as transformers' causal-LM loss upcasts the logits
            logits = head(hidden_states).float()
            return F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum")

        n = hidden.shape[1]
        total = tiled_compute(shard_loss, n, math.ceil(n / chunk), dict(hidden_states=hidden, shift_labels=targets), {},
                              "hidden_states", [head.weight], output_unshard_dimension=0, output_reduction="sum")
        return total / (targets != IGNORE_INDEX).sum()
    return loss


def build(cfg, side: str, device, dtype, ds) -> tuple:
    "The model with `side`'s levers (same seed, same weights for both sides) and the loss it trains with."
    levers = glc.LEVER_SETS["all levers"]
    if side == WORKBENCH: return glc.build(cfg, levers, device, dtype), glc.lever_loss(levers)
    checkpoint, tiled_mlp, tiled_compute = ds
    model = glc.build(cfg, Levers(), device, dtype)  # checkpointing on every decoder layer, nothing else
    for layer in decoder_layers(model): layer._gradient_checkpointing_func = checkpoint  # DeepSpeed's, in its place
    override_forward("ALST TiledMLP", [layer.mlp for layer in decoder_layers(model)],
                     lambda m, fwd: partial(_alst_mlp, tiled_mlp, fwd, m, cfg.hidden_size))
    return model, alst_loss(tiled_compute, levers.loss_chunk)


def grads(model) -> dict:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def compare(models: dict, n: int, device) -> list[dict]:
    "Both sides at `n` tokens: time, peaks, loss of each; the max |diff| of loss and gradients on the second row."
    rows, seen = [], {}
    for side, (model, loss) in models.items():
        step = glc.run_step(model, n, loss, device)  # timed without LiveBytes (it slows every operator)
        seen[side] = (step["loss"], grads(model))
        if device.type == "cpu":
            step["peak_bytes"] = glc.run_step(model, n, loss, device, track=True)["peak_bytes"]
        model.zero_grad(set_to_none=True)
        rows.append(dict(side=side, tokens=n, seconds=step["seconds"], peak_gib=step["peak_bytes"] / 2**30,
                         rss_gib=step["rss_bytes"] / 2**30 if "rss_bytes" in step else None, loss=step["loss"]))
    (loss_a, grad_a), (loss_b, grad_b) = seen.values()
    rows[-1].update(loss_diff=abs(loss_a - loss_b),
                    grad_diff=max((grad_a[k] - grad_b[k]).abs().max().item() for k in grad_a),
                    grad_max=max(g.abs().max().item() for g in grad_a.values()))
    for row in rows: print(json.dumps(row), flush=True)
    return rows


def longest(cfg, side: str, rows: list[dict], args, device, dtype, ds) -> dict:
    """`side`'s longest row under `--cap-gib` (the model alone on the device), searched from the longest compared row
    that fitted (the shortest one when none did); the planner's longest fit for the workbench's levers beside it."""
    glc.cap_memory(args.cap_gib, device)
    plan = max_context(cfg, args.cap_gib, levers=glc.LEVER_SETS["all levers"], zero_stage=0, optimizer_offload=True,
                       runtime_gib=0).memory_tokens  # in bf16: the planner models 2-byte training
    mine = [r for r in rows if r["side"] == side]
    start = max([r["tokens"] for r in mine if r["peak_gib"] <= args.cap_gib] or [min(r["tokens"] for r in mine)])
    model, loss = build(cfg, side, device, dtype, ds)
    print(f"cap {args.cap_gib:g} GiB, {side}: searching from {start:,} tokens", flush=True)
    trials = glc.search(lambda n: glc.run_step(model, n, loss, device, track=True)["peak_bytes"], start,
                        int(args.cap_gib * 2**30), args)
    del model
    if device.type == "cuda": torch.cuda.empty_cache()
    fits = [t for t in trials if t["fits"]]
    best = max(fits, key=lambda t: t["tokens"]) if fits else dict(tokens=0, peak_gib=None)
    misses = [t["tokens"] for t in trials if not t["fits"] and t["tokens"] > best["tokens"]]  # none: trials ran out
    return dict(side=side, cap_gib=args.cap_gib, planned_tokens=plan, start_tokens=start, longest_tokens=best["tokens"],
                shortest_miss=min(misses, default=None), peak_gib=best["peak_gib"], trials=trials)


def run(args) -> dict:
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    shapes = {} if args.qwen3_4b else glc.TINY if args.dry_run else SMALL
    cfg = preset_config("qwen3-4b", num_hidden_layers=args.layers, **shapes)
    ds = deepspeed_api(device)
    models = {side: build(cfg, side, device, dtype, ds) for side in (ALST, WORKBENCH)}
    for model, loss in models.values(): glc.run_step(model, min(256, *args.lengths), loss, device)  # warm-up: kernels
    rows = [r for n in args.lengths for r in compare(models, n, device)]
    del models
    fits = [longest(cfg, side, rows, args, device, dtype, ds) for side in (ALST, WORKBENCH)] if args.cap_gib else []
    return dict(device=torch.cuda.get_device_name(device) if cuda else "cpu", dtype=str(dtype),
                model=f"Qwen3-shaped, {args.layers} layers, " +
                      ", ".join(f"{k} {getattr(cfg, k)}" for k in ("hidden_size", "intermediate_size", "vocab_size")),
                rows=rows, longest=fits)


def table(result: dict) -> str:
    "Markdown: each side per length (and the diffs between them), then each side's longest row under the cap."
    cpu = result["device"] == "cpu"
    lines = [f"{result['model']}, {result['dtype']}, {result['device']}", "",
             "| levers | tokens | seconds | peak GiB" + (" (live tensors) | RSS growth GiB" if cpu else "") +
             " | loss | max abs diff loss | max abs diff grad (max abs grad) |",
             "|---|---|---|---|" + ("---|" if cpu else "") + "---|---|---|"]
    for r in result["rows"]:
        diff = (f"{r['loss_diff']:.1e} | {r['grad_diff']:.1e} ({r['grad_max']:.1e})" if "grad_diff" in r else " | ")
        lines.append(f"| {r['side']} | {r['tokens']:,} | {r['seconds']:.2f} | {r['peak_gib']:.3g}" +
                     (f" | {r['rss_gib']:.3g}" if cpu else "") + f" | {r['loss']:.5f} | {diff} |")
    if result["longest"]:
        lines += ["",
                  "| levers | cap GiB | planner's longest fit (workbench, bf16) | longest row that fits | its peak GiB "
                  "| shortest miss |", "|---|---|---|---|---|---|"]
        lines += [f"| {f['side']} | {f['cap_gib']:g} | {f['planned_tokens']:,} | {f['longest_tokens']:,} | "
                  f"{'-' if f['peak_gib'] is None else format(f['peak_gib'], '.3g')} | "
                  f"{'none tried' if f['shortest_miss'] is None else format(f['shortest_miss'], ',')} |"
                  for f in result["longest"]]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f: json.dump(dict(args=vars(args), **result), f, indent=1)
    return result


if __name__ == "__main__":
    main()
