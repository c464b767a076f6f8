"""The memory planner against published peaks and against the real transformers code on fake tensors (issue 7).

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/memory_planner.py
- the HF blog's Qwen3-4B SP=4 peaks beside the planner (one fitted runtime constant);
- the longest context per lever set for Qwen3-4B on an H100 80GB (SP 1-32);
- the ALST Llama-8B lengths beside the planner;
- planned vs measured activation GiB (`measure_activations`, the real model code on fake tensors) over both shapes,
  lever sets, lengths and SP degrees, with the worst relative error per row.
"""
from tqdm.auto import tqdm

from workbench.memory import (H100_80GB_GIB, HF_BLOG_QWEN3_4B_SP4, HF_BLOG_SETUP, LEVER_LADDER, PRESETS, Levers,
                              alst_table, default_runtime_gib, estimate, lever_table, measure_activations,
                              planned_activations, preset_config)

LEVER_SETS = {
    "transformers loss": Levers(),
    "tiled loss": Levers(tiled_loss=True),
    "tiled loss + lean kernels": Levers(tiled_loss=True, lean_kernels=True),
    "tiled loss + MLP": Levers(tiled_loss=True, tiled_mlp=True),
    "all + checkpoint offload": Levers(tiled_loss=True, tiled_mlp=True, offload_checkpoints=True),
    "all + lean + offload": Levers(tiled_loss=True, tiled_mlp=True, offload_checkpoints=True, lean_kernels=True),
}
POINTS = [(8192, 1), (32768, 4), (131072, 8), (131072, 1)]


def blog():
    cfg = preset_config("qwen3-4b")
    print(f"HF blog, Qwen3-4B SP=4 (runtime constant fitted: {default_runtime_gib():.2f} GiB)")
    for seq, pub in HF_BLOG_QWEN3_4B_SP4.items():
        gib = estimate(cfg, seq, **HF_BLOG_SETUP).gib
        print(f"  {seq:>7,}  published {pub:5.1f}  planned {gib:6.2f}  {gib / pub - 1:+.1%}")
    print(f"  131,072  published OOM    planned {estimate(cfg, 131072, **HF_BLOG_SETUP).gib:6.2f} "
          f"(usable {H100_80GB_GIB:.1f})")


def ladder():
    t = lever_table(preset_config("qwen3-4b"), H100_80GB_GIB, sps=(1, 2, 4, 8, 16, 32), zero_stage=3,
                    optimizer_offload=True)
    wide = t.pivot(index="levers", columns="sp", values="tokens").loc[list(LEVER_LADDER)]
    print("\nLongest context, Qwen3-4B on H100 80GB (ZeRO-3, optimizer on CPU), tokens by SP degree")
    print(wide.to_string())


def alst():
    print("\nALST Llama-8B on H100 80GB")
    print(alst_table().to_string(index=False))
    peak = estimate(preset_config("llama-3.1-8b"), 32_000, levers=Levers(), optimizer_offload=True, param_offload=True)
    print(f"one-GPU baseline at 32K: planned {peak.gib:.2f} GiB, recorded 71.91 ({peak.gib / 71.91 - 1:+.1%})")


def grid():
    print("\nPlanned vs measured activation GiB (fake tensors)")
    jobs = [(m, name, seq, sp) for m in PRESETS for name in LEVER_SETS for seq, sp in POINTS]
    rows = {}
    for m, name, seq, sp in tqdm(jobs, desc="measuring"):
        cfg, lv = preset_config(m), LEVER_SETS[name]
        measured = measure_activations(cfg, seq, sp, lv).peak
        rows.setdefault((m, name), []).append((measured / 2**30, planned_activations(cfg, seq, sp, lv) / measured - 1))
    head = " | ".join(f"{seq // 1024}K SP{sp}" for seq, sp in POINTS)
    print(f"| model | levers | {head} | worst error |\n|---|---|" + "---:|" * (len(POINTS) + 1))
    for (m, name), vals in rows.items():
        worst = max((e for _, e in vals), key=abs)
        print(f"| {m} | {name} | " + " | ".join(f"{g:.2f}" for g, _ in vals) + f" | {worst:+.1%} |")


if __name__ == "__main__":
    blog(); ladder(); alst(); grid()
