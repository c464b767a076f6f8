"""Which SDPA backend slows down on long rows (the GPU suite's part 4 diagnosis): one causal forward + backward of
Qwen3-4B's attention shape (32 query heads, 8 key/value heads, head_dim 128, bf16) at each length, once per backend,
each in its own process under a wall-clock cap, so a backend that stalls is recorded as such and the rest go on.

  python bench/sdpa_lengths.py --lengths 16384 32768 49152 65536 --cap-s 20     # one CUDA GPU
  python bench/sdpa_lengths.py --dry-run                                         # CPU, tiny shapes (the test)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

BACKENDS = ("default", "CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def one(n: int, backend: str, dry: bool) -> dict:
    "Seconds of one causal fwd + bwd at `n` tokens under `backend` (after a short warm-up at 256 tokens)."
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    device, heads, kv_heads, dim = ("cpu", 4, 2, 32) if dry else ("cuda", 32, 8, 128)
    dtype = torch.float32 if dry else torch.bfloat16

    def step(length: int) -> None:
        q = torch.randn(1, heads, length, dim, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, kv_heads, length, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        if device == "cuda": torch.cuda.synchronize()

    context = sdpa_kernel(getattr(SDPBackend, backend)) if backend != "default" else torch.enable_grad()
    with context:
        step(256)
        t0 = time.perf_counter()
        step(n)
    return dict(tokens=n, backend=backend, seconds=time.perf_counter() - t0)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 49152, 65536])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--cap-s", type=float, default=20.0, help="wall-clock cap of one (length, backend) process")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # internal: LENGTH BACKEND in this process
    args = p.parse_args(argv)
    if args.dry_run and not args.child: args.lengths = [64, 128]
    if args.child:
        print(json.dumps(one(int(args.child[0]), args.child[1], args.dry_run)))
        return []
    rows = []
    for backend in args.backends:
        for n in args.lengths:
            cmd = [sys.executable, __file__, "--child", str(n), backend] + (["--dry-run"] if args.dry_run else [])
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cap_s)
                row = (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else
                       dict(tokens=n, backend=backend, seconds=None, failed=done.stderr.strip().splitlines()[-1][:200]))
            except subprocess.TimeoutExpired:
                row = dict(tokens=n, backend=backend, seconds=None, failed=f"timed out after {args.cap_s:g} s")
            rows.append(row)
            print(f"{backend:>20} {n:>7,} tokens: "
                  + (f"{row['seconds']:.3f} s" if row["seconds"] is not None else row["failed"]), flush=True)
    if args.json:
        with open(args.json, "w") as f: json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
