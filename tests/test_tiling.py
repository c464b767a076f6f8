"Exactness of the tiled loss, the tiled MLP and (offloaded) checkpointing: float64, real tiny models, packed batches."
import pytest
import torch
import torch.nn.functional as F

from workbench.core import shift_labels
from workbench.samples import load_sample, load_tokenizer
from workbench.tiny_models import tiny_model
from workbench.packing import FlatteningCollator
from workbench.sp.loss import causal_lm_loss_sum, tiled_cross_entropy
from workbench.tiling import checkpoint_layers, lean_kernels, tile_mlp

TOL = 1e-10
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "olmo2", "phi3", "starcoder2"]  # dense, plain lm_head


@pytest.fixture(scope="module")
def batch():
    feats = load_sample("orca_like", load_tokenizer(), limit=5)
    return FlatteningCollator(pad_to_multiple_of=2)(feats)


@pytest.fixture(scope="module")
def short_batch():
    "Three short examples packed, 67 tokens + 1 padding: every chunk size tested leaves a last tile with a real token."
    feats = [f for f in load_sample("flan_like", load_tokenizer(), limit=400) if 20 <= len(f["input_ids"]) <= 24]
    batch = FlatteningCollator(pad_to_multiple_of=2)(feats)
    T = batch["input_ids"].shape[1]
    assert T == 68 and all(T % c >= 2 for c in (13, 5, 64))  # 5 x 13 + 3, 13 x 5 + 3, 64 + 4 tokens
    return batch


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def loss_and_grads(model, fn):
    model.zero_grad()
    loss = fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def reference(model, batch):
    "The untiled computation: full float64 logits, summed cross-entropy over globally shifted labels."
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), shift_labels(batch["labels"]).flatten(), reduction="sum")


def assert_same(model, batch, fn):
    ref_loss, ref_grads = loss_and_grads(model, lambda: reference(model, batch))
    loss, grads = loss_and_grads(model, fn)
    assert rel(loss, ref_loss) <= TOL
    worst = max(rel(grads[k], ref_grads[k]) for k in ref_grads)
    assert worst <= TOL, worst


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("loss_chunk,mlp_chunk", [(1, None), (13, 5), (4096, 64)])
def test_tiled_loss_and_mlp_exact(family, short_batch, one_thread, loss_chunk, mlp_chunk):
    model = tiny_model(family, dtype=torch.float64).train()
    patch = tile_mlp(model, mlp_chunk) if mlp_chunk else None
    assert_same(model, short_batch, lambda: causal_lm_loss_sum(model, short_batch, chunk_size=loss_chunk)[0])
    if patch: patch.undo()


def test_sp2_shards_sum_to_the_whole(batch):
    "Under SP=2 each rank holds half the row and the globally shifted labels of its half: sum / global count is exact."
    model = tiny_model("llama", dtype=torch.float64).train()
    labels = shift_labels(batch["labels"])
    count = int((labels != -100).sum())

    def sharded():
        hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                             use_cache=False).last_hidden_state
        T = hidden.shape[1]
        parts = [tiled_cross_entropy(hidden[:, s], model.lm_head.weight, shift_labels=labels[:, s], chunk_size=7)
                 for s in (slice(0, T // 2), slice(T // 2, T))]
        assert sum(int(c) for _, c in parts) == count
        return sum(s for s, _ in parts)

    assert_same(model, batch, sharded)


@pytest.mark.parametrize("offload", [False, True])
def test_checkpointing_exact(batch, offload):
    model = tiny_model("qwen2", dtype=torch.float64).train()
    patch = checkpoint_layers(model, offload=offload)
    tiles = tile_mlp(model, 9)
    assert_same(model, batch, lambda: causal_lm_loss_sum(model, batch, chunk_size=33)[0])
    tiles.undo(); patch.undo()
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)


# 5, 4.5, 1.9 x the measured 9.4e-8, 2.2e-5, 1.1e-3
BF16_TOL = {"loss": 5e-7, "hidden gradient": 1e-4, "weight gradient": 2e-3}
# (the weight gradient's was 6.1e-4 while each tile's product ran in fp32; now each of 89 tiles' is rounded to bf16)


def test_bf16_tiled_matches_untiled(batch):
    "In bf16 the tiled loss reproduces the untiled fp32-upcast loss (same arithmetic, different order)."
    assert batch["input_ids"].shape[1] % 16 > 0  # a short last tile (1416 = 88 x 16 + 8 tokens): it must count too
    model = tiny_model("llama", dtype=torch.bfloat16).train()
    hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    hidden = hidden.last_hidden_state.detach()
    out = {}
    for chunk in (None, 16):
        h = hidden.clone().requires_grad_()
        w = model.lm_head.weight.detach().clone().requires_grad_()
        s, _ = tiled_cross_entropy(h, w, labels=batch["labels"], chunk_size=chunk)
        s.backward()
        out[chunk] = (s.detach().float(), h.grad.float(), w.grad.float())
    for (name, tol), a, b in zip(BF16_TOL.items(), out[16], out[None]):
        assert rel(a, b) < 2e-2
        assert rel(a, b) <= tol, f"{name}: relative error {rel(a, b):.1e} > {tol:.0e}"


def test_bad_inputs(batch):
    model = tiny_model("llama", dtype=torch.float64)
    h = torch.zeros(1, 4, model.config.hidden_size, dtype=torch.float64)
    with pytest.raises(ValueError, match="exactly one"):
        tiled_cross_entropy(h, model.lm_head.weight)
    with pytest.raises(ValueError, match="do not match"):
        tiled_cross_entropy(h, model.lm_head.weight, labels=torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden size"):
        tiled_cross_entropy(h, model.lm_head.weight[:, :3], labels=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="no labels"):
        causal_lm_loss_sum(model, {"input_ids": batch["input_ids"]})
    for family, field in (("granite", "logits_scaling"), ("phi", "bias")):
        with pytest.raises(ValueError, match=field):
            causal_lm_loss_sum(tiny_model(family, attn_implementation="eager", dtype=torch.float64), batch)


LEAN_FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]  # the families whose RMSNorm `lean_kernels` replays


@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_lean_kernels_match_transformers_in_fp32(family, batch):
    "Same forward bit for bit, gradients to fp32 rounding; `undo` leaves no instance forward behind."
    model = tiny_model(family, dtype=torch.float32).train()
    fn = lambda: causal_lm_loss_sum(model, batch, chunk_size=None)[0]
    ref_loss, ref_grads = loss_and_grads(model, fn)
    patch = lean_kernels(model)
    loss, grads = loss_and_grads(model, fn)
    patch.undo()
    assert torch.equal(loss, ref_loss)
    assert max(rel(grads[k], ref_grads[k]) for k in ref_grads) <= 1e-5
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_lean_kernels_with_tiled_mlp_and_loss_exact_in_fp64(family, short_batch, one_thread):
    "In fp64 the lean model is the reference; the tiled MLP running the lean MLP and the tiled loss add no error."
    model = tiny_model(family, dtype=torch.float64).train()
    lean = lean_kernels(model)
    ref_loss, ref_grads = loss_and_grads(model, lambda: reference(model, short_batch))
    tiles = tile_mlp(model, 5)
    loss, grads = loss_and_grads(model, lambda: causal_lm_loss_sum(model, short_batch, chunk_size=13)[0])
    tiles.undo(); lean.undo()
    assert rel(loss, ref_loss) <= TOL
    assert max(rel(grads[k], ref_grads[k]) for k in ref_grads) <= TOL


def test_lean_kernels_refuse_what_they_do_not_replay():
    with pytest.raises(ValueError, match="compute differently"): lean_kernels(tiny_model("gemma"))
    with pytest.raises(ValueError, match="SiLU"): lean_kernels(tiny_model("starcoder2"))


MATMULS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}


def test_bf16_tiles_matmul_in_bf16(short_batch):
    """Every matmul of a bf16 tiled MLP and tiled loss, forward and backward, takes bf16 operands (tensor cores on a
    GPU), none fp32 copies. The profiler's op records are used, not a TorchFunctionMode: they include the matmuls
    autograd runs in C++ (the tiled MLP's backward), which a function mode never sees."""
    from torch.profiler import profile
    model = tiny_model("llama", dtype=torch.bfloat16).train()
    tiles = tile_mlp(model, 16)
    with profile(record_shapes=True) as prof:
        causal_lm_loss_sum(model, short_batch, chunk_size=16)[0].backward()
    tiles.undo()
    ops = [(e.name, e.input_dtypes, e.input_shapes) for e in prof.events() if e.name in MATMULS]
    assert {name for name, _, _ in ops} >= {"aten::mm", "aten::linear"}
    fp32 = [op for op in ops if "float" in op[1]]
    assert not fp32, f"{len(fp32)} matmuls take fp32 operands, e.g. {fp32[:2]}"


def test_offload_pins_host_buffers_for_accelerators():
    "Pinned host buffers for any accelerator's tensors (their copies run asynchronously), plain ones for the CPU's."
    from workbench.tiling import HostPool, on_accelerator
    assert [on_accelerator(d) for d in ("cuda", torch.device("cuda", 1), "xpu", "cpu")] == [True, True, True, False]
    buf = HostPool().take(torch.ones(2, 3))
    assert buf.shape == (2, 3) and not buf.is_pinned()
    with pytest.raises(ValueError, match="CheckpointOffload"):
        from workbench.tiling import CheckpointOffload
        checkpoint_layers(tiny_model("llama"), offload=CheckpointOffload(), host_copy=lambda t: t.clone())


class _Growth(torch.utils._python_dispatch.TorchDispatchMode):
    "Counts the operators a step dispatches and records every tensor it makes with two dimensions of at least `n`."
    def __init__(self, n: int):
        super().__init__()
        self.n, self.ops, self.squares = n, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in torch.utils._pytree.tree_leaves(out):
            if torch.is_tensor(t) and sum(d >= self.n for d in t.shape) >= 2:
                self.squares.append((str(func), tuple(t.shape)))
        return out


def growth(step, lengths) -> tuple[list[int], list]:
    "Operators dispatched by `step(n)` at each length, and the `[n, n]`-sized tensors it made (any length)."
    ops, squares = [], []
    for n in lengths:
        with _Growth(n) as seen: step(n)
        ops.append(seen.ops)
        squares += seen.squares
    return ops, squares


def linear(ops: list[int]) -> bool:
    """Whether the operator counts at lengths n, 2n, 4n grow no faster
    than a line (the second step no more than twice the first)."""
    return ops[2] - ops[1] <= 2 * (ops[1] - ops[0]) * 1.05


def test_all_levers_step_grows_linearly_and_builds_nothing_square():
    """Issue 48's levers that scale, as a count rather than a timing: one forward + backward of a tiny Qwen3 with every
    lever (offloaded checkpoints, tiled loss and MLP in 32-token tiles, lean kernels) at 128, 256 and 512 tokens
    dispatches operators linear in the row (tiles, no loop over token pairs) and makes no `[n, n]` tensor (no mask
    or index built at the row's square). Both checks fail on broken steps: eager attention (its `[n, n]` mask) and a
    step with a Python loop over token pairs."""
    model = tiny_model("qwen3", attn_implementation="sdpa").train()
    checkpoint_layers(model, offload=True)
    lean_kernels(model)
    tile_mlp(model, 32)

    def step(n: int, model=model):
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        batch = dict(input_ids=ids, position_ids=torch.arange(n)[None], labels=ids)
        causal_lm_loss_sum(model, batch, chunk_size=32)[0].backward()
        model.zero_grad(set_to_none=True)

    lengths = (128, 256, 512)
    ops, squares = growth(step, lengths)
    assert linear(ops) and not squares, (ops, squares[:3])

    eager = tiny_model("qwen3", attn_implementation="eager").train()
    _, eager_squares = growth(lambda n: step(n, eager), lengths[:1])
    assert eager_squares, "eager attention's [n, n] mask was not seen"
    pairs = lambda n: [torch.zeros(1).add_(1) for _ in range(n * n // 512)]  # a loop over token pairs
    assert not linear(growth(lambda n: (step(n), pairs(n)), lengths)[0])
