"""Render and redraw timings of the mask views (issue 3), for BENCHMARKS.md.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/viz_masks.py
- plot_mask on one packed row of 32,768 tokens (block aggregation): build time and JSON size of the figure;
- MaskExplorer: time of one control change (full redraw: batch, mask, layout, stats) on a 16,384-token batch.
Times are medians over repeats after one warm-up, on this machine's CPU.
"""
import statistics
import time

from workbench.masks import mask_report
from workbench.explorer import MaskExplorer
from workbench.viz import _sample, plot_mask, strategy_batch


def median_ms(fn, repeats=7):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter(); fn(); times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times), min(times), max(times)


def main():
    feats = _sample("flan_like")
    batch, _ = strategy_batch(feats, "token-budget packing", 32768)
    T = batch["input_ids"].shape[1]
    for name, cache in (("correct packing", False), ("trap: cache active", True)):
        report = mask_report(batch, use_cache=cache)
        med, lo, hi = median_ms(lambda: plot_mask(mask_report(batch, use_cache=cache)))
        size = len(plot_mask(report).to_json()) / 1e6
        print(f"plot_mask, {T:,} tokens ({len(batch['cu_seq_lens_q']) - 1} examples), {name}: "
              f"built in {med:.0f} ms median (min {lo:.0f}, max {hi:.0f}), figure JSON {size:.2f} MB")
    ex = MaskExplorer(strategy="token-budget packing", size=16384)
    T = ex.report.examples.shape[1]
    box = ex.controls["use_cache"]
    med, lo, hi = median_ms(lambda: setattr(box, "value", not box.value), repeats=11)
    print(f"MaskExplorer redraw after a control change, {T:,}-token "
          f"batch: {med:.0f} ms median (min {lo:.0f}, max {hi:.0f})")
    step = ex.controls["step"]
    med, lo, hi = median_ms(lambda: setattr(step, "value", step.value + 1), repeats=11)
    print(f"MaskExplorer redraw with a new batch (step), ~16K tokens: {med:.0f} ms median (min {lo:.0f}, max {hi:.0f})")


if __name__ == "__main__":
    main()
