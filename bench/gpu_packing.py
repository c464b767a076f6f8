"""Padded vs padding-free training throughput and peak memory on one CUDA GPU.

A Llama-7B-shaped model with few layers (bf16, AdamW) trains on synthetic FLAN-like and OrcaMath-like lengths
(`workbench.packing.synthetic_lengths`); every mode sees exactly the same examples from the same initial weights:

  padded_sdpa     one row per example, padded, attention_mask, sdpa (dense 4-D mask)
  padded_varlen   the same padded batch, attention unpadded to varlen by `workbench_varlen` (as flash-attn does with a
                  padding mask): the fair padded baseline, MLP and lm head still compute on padding
  flat_sdpa       flattened (FlatteningCollator), use_cache=False, transformers' sdpa
  flat_flex       flattened, use_cache=False, flex_attention
  flat_varlen     flattened, use_cache=False, workbench_varlen (flash-attn or torch's varlen_attn)
  flat_sdpa_cache flattened, sdpa, the cache left at its default: what a custom loop without use_cache=False runs
  hf_flat_varlen  transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True), workbench_varlen reading its
                  cu_seq_lens: the same examples through transformers' own collator
  budget_varlen   flattened, workbench_varlen, steps re-cut into token-budget bins by `plan_bins` with capacity = the
                  padded batches' mean real tokens (the same tokens, regrouped: the comparison is per token)

The table reports real (non-padding) tokens/s, ratios to both padded baselines, the ideal bound
(`packing_report(...).speedup_bound`), peak memory, and a loss-equality column: the loss of every mode on a fixed check
batch, in float32 with a 2-layer model of the same shapes, against the padded reference; a path that attends across
examples is flagged CONTAMINATED.

  python bench/gpu_packing.py                 # the full run on a CUDA GPU (< 5 min on one H200)
  python bench/gpu_packing.py --dry-run       # the whole pipeline on CPU with a tiny model, in seconds
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

import workbench.attention  # registers "workbench_varlen"
from workbench.attention import KEY as VARLEN, pick_kernel
from workbench.tiny_models import tiny_config
from workbench.packing import FlatteningCollator, PaddingCollator, packing_report, plan_bins, synthetic_lengths


@dataclass(frozen=True)
class Mode:
    name: str
    attn: str
    # "padded", "flat", "hf_flat" (transformers' collator) or "budget" (plan_bins steps)
    layout: str
    forward_kwargs: dict = field(default_factory=lambda: {"use_cache": False})
    pad_to: int | None = None        # flattened rows padded (one dummy example) to a multiple of this


MODES = {m.name: m for m in (
    Mode("padded_sdpa", "sdpa", "padded"),
    Mode("padded_varlen", VARLEN, "padded"),
    Mode("flat_sdpa", "sdpa", "flat"),
    Mode("flat_flex", "flex_attention", "flat", pad_to=512),  # fewer distinct shapes: fewer flex recompilations
    Mode("flat_varlen", VARLEN, "flat"),
    Mode("flat_sdpa_cache", "sdpa", "flat", {}),
    Mode("hf_flat_varlen", VARLEN, "hf_flat"),
    Mode("budget_varlen", VARLEN, "budget"),
)}
TRAP = "flat_sdpa_cache"  # the one mode expected to be CONTAMINATED
REFERENCE = "padded_sdpa"
LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                vocab_size=32000, max_position_embeddings=4096)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, short examples, "
                                                          "2 steps: checks the pipeline")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the 7B-shaped model")
    p.add_argument("--batch-size", type=int, default=32, help="examples per step")
    p.add_argument("--steps", type=int, default=6, help="timed steps per mode and dataset")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, allocator)")
    p.add_argument("--datasets", nargs="+", default=["flan", "orca"], choices=["flan", "orca"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--check-examples", type=int, default=8, help="examples of the float32 loss-equality check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    if args.dry_run: args.steps, args.warmup, args.batch_size, args.layers = 2, 1, 8, 2
    return args


def make_steps(kind: str, n_steps: int, batch_size: int, vocab: int, seed: int, max_len: int
               | None = None) -> list[list[dict]]:
    "The examples of every step: synthetic lengths (optionally scaled down to `max_len`), random token ids."
    lengths = synthetic_lengths(kind, n_steps * batch_size, seed=seed)
    if max_len: lengths = np.maximum(2, lengths * max_len // 2048)
    rng = np.random.default_rng(seed)
    feats = [{"input_ids": rng.integers(3, vocab, n)} for n in lengths]
    return [feats[i * batch_size:(i + 1) * batch_size] for i in range(n_steps)]


def budget_steps(steps: list[list[dict]]) -> list[list[dict]]:
    "The same examples regrouped into `plan_bins` bins of the steps' mean real tokens (longer examples are split)."
    feats = [f for step in steps for f in step]
    capacity = int(np.mean([sum(len(f["input_ids"]) for f in step) for step in steps]))
    plan = plan_bins([len(f["input_ids"]) for f in feats], capacity, overlong="split", seed=0)
    pieces = plan.dataset(feats)
    return [[pieces[i] for i in b] for b in plan.bins]


def collate(mode: Mode, feats: list[dict], device) -> dict:
    if mode.layout == "padded": batch = PaddingCollator()(feats)
    elif mode.layout == "hf_flat":
        from transformers import DataCollatorWithFlattening
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": list(f["input_ids"])}
                                                                           for f in feats])
    # pretraining-style rows: every token trained, as padded
    else: batch = FlatteningCollator(pad_to_multiple_of=mode.pad_to, train_all_tokens=True)(feats)
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def build_model(args, attn: str, layers: int, dtype, device):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(args.seed)
    cfg = tiny_config("llama", **({} if args.dry_run else LLAMA_7B), num_hidden_layers=layers)
    with torch.device(device):  # initialise on the GPU directly: seconds instead of a minute for 7B shapes
        return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)


def check_loss(args, mode: Mode, feats: list[dict], device) -> float:
    "float32 loss of `mode` on the check batch, with a 2-layer model of the same shapes (same seed, same weights)."
    model = build_model(args, mode.attn, 2, torch.float32, device).eval()
    with torch.no_grad(): return model(**collate(mode, feats, device), **mode.forward_kwargs).loss.item()


def train(args, mode: Mode, steps: list[list[dict]], dtype, device) -> dict:
    "Train `warmup + steps` steps; return real tokens/s over the timed steps, the peak memory and the first loss."
    if mode.layout == "budget": steps = budget_steps(steps)
    model = build_model(args, mode.attn, args.layers, dtype, device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    if device.type == "cuda": torch.cuda.reset_peak_memory_stats(); torch.cuda.synchronize()
    tokens, first_loss, t0 = 0, None, None
    for i, feats in enumerate(steps):
        if i == args.warmup:
            if device.type == "cuda": torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = model(**collate(mode, feats, device), **mode.forward_kwargs).loss
        loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        if first_loss is None: first_loss = loss.item()
        if i >= args.warmup: tokens += sum(len(f["input_ids"]) for f in feats)
    if device.type == "cuda": torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    del model, opt
    if device.type == "cuda": torch.cuda.empty_cache()
    return dict(tok_s=tokens / seconds, peak_gib=peak, first_loss=first_loss)


def run(args) -> list[dict]:
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available(): raise SystemExit("no CUDA GPU: use --dry-run on a CPU")
    torch._dynamo.config.cache_size_limit = 64  # flex_attention recompiles per new row length
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    vocab = tiny_config("llama").vocab_size if args.dry_run else LLAMA_7B["vocab_size"]
    max_len = 64 if args.dry_run else None
    rows = []
    for kind in args.datasets:
        steps = make_steps(kind, args.warmup + args.steps, args.batch_size, vocab, args.seed, max_len)
        check = make_steps(kind, 1, args.check_examples, vocab, args.seed + 1,
                           max_len=512 if not args.dry_run else max_len)[0]
        bound = packing_report(synthetic_lengths(kind, 20_000, seed=args.seed),
                               batch_size=args.batch_size).speedup_bound
        ref_loss = check_loss(args, MODES[REFERENCE], check, device)
        for name in args.modes:
            mode = MODES[name]
            row = dict(dataset=kind, mode=name, bound=bound)
            if device.type == "cpu" and mode.attn == "flex_attention":
                rows.append({**row, "error": "skipped on CPU: flex_attention has no backward there"}); continue
            try:
                row["check_loss_diff"] = abs(check_loss(args, mode, check, device) - ref_loss)
                row.update(train(args, mode, steps, dtype, device))
            except torch.cuda.OutOfMemoryError:
                row["error"] = "out of memory"; torch.cuda.empty_cache()
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
            print(f"  {kind} {name}: {row.get('tok_s', float('nan')):,.0f} tok/s {row.get('error', '')}", flush=True)
    return annotate(rows)


def annotate(rows: list[dict], tolerance: float = 1e-4) -> list[dict]:
    """Add to every row the share of the padding bound it reaches
    (speed-up over padded sdpa / bound) and its loss verdict."""
    base = {r["dataset"]: r.get("tok_s") for r in rows if r["mode"] == REFERENCE}
    for r in rows:
        if "tok_s" in r and base.get(r["dataset"]): r["of_bound"] = r["tok_s"] / base[r["dataset"]] / r["bound"]
        if "check_loss_diff" in r: r["contaminated"] = r["check_loss_diff"] > tolerance
    return rows


def table(rows: list[dict]) -> str:
    "The results (annotated by `annotate`) as a markdown table, ratios against both padded baselines and the bound."
    out = ["| dataset | mode | real tok/s | vs padded_sdpa | vs padded_varlen | ideal bound "
           "| share of bound | peak GiB | Δloss vs padded (fp32 check) | loss equality |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["dataset"], r["mode"]): r.get("tok_s") for r in rows}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['dataset']} | {r['mode']} | {r['error']} | | | {r['bound']:.2f}x | | | | |"); continue
        ratio = lambda m: f"{r['tok_s'] / base[(r['dataset'], m)]:.2f}x" if base.get((r["dataset"], m)) else "n/a"
        ok = "CONTAMINATED" if r["contaminated"] else "same"
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        out.append(f"| {r['dataset']} | {r['mode']} | {r['tok_s']:,.0f} | {ratio('padded_sdpa')} | "
                   f"{ratio('padded_varlen')} | {r['bound']:.2f}x | "
                   f"{r.get('of_bound', float('nan')):.0%} | {peak} | {r['check_loss_diff']:.1e} | {ok} |")
    return "\n".join(out)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()
    env = f"torch {torch.__version__}"
    if torch.cuda.is_available() and not args.dry_run:
        env += (f", {torch.cuda.get_device_name()}, varlen kernel: "
                f"{pick_kernel(torch.empty(1, device='cuda', dtype=torch.bfloat16))}")
    print(f"gpu_packing: {env}; {args.layers} layers, {args.batch_size} examples/step, {args.steps} timed steps"
          f"{' (dry run on CPU)' if args.dry_run else ''}", flush=True)
    rows = run(args)
    print(table(rows))
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f: json.dump(dict(env=env, args=vars(args), rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
