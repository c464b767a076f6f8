"""workbench.attention: the CPU fallback against padded and
per-example attention, registration, transformers integration."""
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import workbench.attention as wa
from workbench.attention import KEY, register, varlen_attention, varlen_attention_forward
from workbench.samples import load_sample
from workbench.tiny_models import tiny_model
from workbench.packing import FlatteningCollator, PaddingCollator, per_example_logits

LENGTHS = [[1], [7, 1, 3], [16, 5, 33, 2, 9], [64, 64]]


def _qkv(lengths, heads, kv_heads, dim=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return [torch.randn(t, h, dim, generator=g, dtype=dtype, requires_grad=True) for h in (heads, kv_heads, kv_heads)]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _padded_sdpa(q, k, v, lengths, causal=True, window=None):
    "Padded reference: every example in its own row, padding masked; returns the real tokens, flattened."
    L, cu = max(lengths), _cu(lengths).tolist()
    pad = lambda x: torch.stack([F.pad(x[s:e], (0, 0, 0, 0, 0, L - (e - s))) for s, e in pairwise(cu)]).transpose(1, 2)
    i = torch.arange(L)
    allowed = (i[:, None] >= i[None]) if causal else torch.ones(L, L, dtype=torch.bool)
    if window is not None: allowed = allowed & (i[:, None] - i[None] < window)
    real = i[None] < torch.tensor(lengths)[:, None]
    mask = allowed[None, None] & real[:, None, None, :]
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)[real]


def _per_example_einsum(q, k, v, lengths, causal=True, window=None):
    outs = []
    for s, e in pairwise(_cu(lengths).tolist()):
        qi, ki, vi = (q[s:e], k[s:e].repeat_interleave(q.shape[1] // k.shape[1], 1),
                      v[s:e].repeat_interleave(q.shape[1] // k.shape[1], 1))
        sc = torch.einsum("qhd,khd->hqk", qi, ki) / q.shape[-1] ** 0.5
        i = torch.arange(e - s)
        allowed = (i[:, None] >= i[None]) if causal else torch.ones(e - s, e - s, dtype=torch.bool)
        if window is not None: allowed = allowed & (i[:, None] - i[None] < window)
        outs.append(torch.einsum("hqk,khd->qhd", sc.masked_fill(~allowed, float("-inf")).softmax(-1), vi))
    return torch.cat(outs)


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("window,causal", [(None, True), (None, False), (3, True)])  # transformers' windows are causal
def test_fallback_equals_padded_and_per_example(lengths, heads, kv_heads, window, causal):
    q, k, v = _qkv(lengths, heads, kv_heads)
    out = varlen_attention(q, k, v, _cu(lengths), max(lengths), causal=causal, window=window)
    ref_pad = _padded_sdpa(q, k, v, lengths, causal, window)
    torch.testing.assert_close(out, ref_pad, atol=1e-12, rtol=0)
    torch.testing.assert_close(out, _per_example_einsum(q, k, v, lengths, causal, window), atol=1e-12, rtol=0)
    g_out = torch.autograd.grad(out.square().sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref_pad.square().sum(), (q, k, v))
    for a, b in zip(g_out, g_ref): torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_fallback_fp32_and_scale():
    lengths = [5, 12, 1]
    q, k, v = _qkv(lengths, 4, 2, dtype=torch.float32)
    out = varlen_attention(q, k, v, _cu(lengths), 12, scale=0.5)
    ref = varlen_attention(q * (0.5 * 8 ** 0.5), k, v, _cu(lengths), 12)  # the default scale is 1/sqrt(8)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(varlen_attention(q, k, v, _cu(lengths), 12), _padded_sdpa(q, k, v, lengths), atol=1e-6,
                               rtol=1e-5)


def test_torch_varlen_signatures(monkeypatch):
    "The torch varlen call adapts to the signature it finds: window_size + enable_gqa (2.13) or is_causal (older)."
    seen = {}
    def new_api(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        seen.update(window_size=window_size, enable_gqa=enable_gqa, kv_heads=k.shape[1]); return q
    def old_api(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, scale=None):
        seen.update(is_causal=is_causal, kv_heads=k.shape[1]); return q
    q, k, v = torch.zeros(6, 4, 8), torch.zeros(6, 2, 8), torch.zeros(6, 2, 8)
    cu = _cu([3, 3])
    monkeypatch.setattr(wa, "_torch_varlen", lambda: new_api)
    wa._torch_varlen_call(q, k, v, cu, 3, None, True, None)
    assert seen == dict(window_size=(-1, 0), enable_gqa=True, kv_heads=2)
    wa._torch_varlen_call(q, k, v, cu, 3, None, True, 16)
    assert seen["window_size"] == (15, 0)
    seen.clear()
    monkeypatch.setattr(wa, "_torch_varlen", lambda: old_api)
    wa._torch_varlen_call(q, k, v, cu, 3, None, True, None)
    assert seen == dict(is_causal=True, kv_heads=4)  # no enable_gqa: kv heads repeated
    assert wa.pick_kernel(q, window=16) == "reference"  # CPU tensors always take the exact fallback


def test_registration_is_idempotent_and_never_overwrites():
    sdpa = AttentionInterface._global_mapping["sdpa"]
    assert register() == KEY and register() == KEY
    assert AttentionInterface._global_mapping[KEY] is varlen_attention_forward
    assert AttentionMaskInterface._global_mapping[KEY] is wa.varlen_mask
    assert AttentionInterface._global_mapping["sdpa"] is sdpa
    for existing in ("sdpa", "eager", "flash_attention_2", "flex_attention"):
        if existing in AttentionMaskInterface._global_mapping or existing in AttentionInterface._global_mapping:
            with pytest.raises(ValueError, match="already maps"): register(existing)
    assert AttentionInterface._global_mapping["sdpa"] is sdpa


@pytest.fixture(scope="module")
def examples():
    return [{"input_ids": f["input_ids"][:60 - 9 * i]} for i, f in enumerate(load_sample("flan_like", limit=6))]


def _max_diff(a, b): return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma3"])
def test_model_packed_and_padded_equal_eager(family, examples):
    lens = [len(f["input_ids"]) for f in examples]
    ref = per_example_logits(tiny_model(family, attn_implementation="eager"), PaddingCollator()(examples), lens)
    ours = tiny_model(family, attn_implementation=KEY)
    assert _max_diff(per_example_logits(ours, FlatteningCollator(train_all_tokens=True)(examples), lens), ref) < 1e-5
    # plus one dummy example of padding
    padded_row = FlatteningCollator(pad_to_multiple_of=64, train_all_tokens=True)(examples)
    with_dummy = lens + [padded_row["input_ids"].shape[1] - sum(lens)]
    assert with_dummy[-1] > 0
    assert _max_diff(per_example_logits(ours, padded_row, with_dummy)[:-1], ref) < 1e-5
    assert _max_diff(per_example_logits(ours, PaddingCollator()(examples), lens), ref) < 1e-5


def test_unpadded_rows_without_position_ids(examples):
    "Equal-length rows, no padding, no position_ids: the model broadcasts [1, T] positions over the batch rows."
    rows = torch.stack([torch.as_tensor(f["input_ids"][:12]) for f in examples])
    ours, ref = tiny_model("qwen3", attn_implementation=KEY), tiny_model("qwen3", attn_implementation="eager")
    with torch.no_grad():
        a = ours(input_ids=rows, attention_mask=torch.ones_like(rows), use_cache=False).logits
        b = ref(input_ids=rows, use_cache=False).logits
    assert (a - b).abs().max() < 1e-5


def test_left_padding_is_unpadded(examples):
    "A left-padded batch goes through the 2-D mask path: the mask function hands the mask on, the attention unpads it."
    lens = [len(f["input_ids"]) for f in examples]
    right = PaddingCollator()(examples)
    L = right["input_ids"].shape[1]
    left = {k: torch.stack([torch.roll(row, L - n) for row, n in zip(v, lens)]) for k, v in right.items()}
    pos = (left["attention_mask"].cumsum(1) - 1).clamp(min=0)
    ours = tiny_model("llama", attn_implementation=KEY)
    ref = tiny_model("llama", attn_implementation="eager")
    with torch.no_grad():
        a = ours(input_ids=left["input_ids"], attention_mask=left["attention_mask"], position_ids=pos,
                 use_cache=False).logits
        b = ref(input_ids=left["input_ids"], attention_mask=left["attention_mask"], position_ids=pos,
                use_cache=False).logits
    real = left["attention_mask"].bool()
    assert (a[real] - b[real]).abs().max() < 1e-5


def test_set_attn_implementation_and_dropout(examples):
    model = tiny_model("llama", attn_implementation="sdpa", attention_dropout=0.5)
    model.set_attn_implementation(KEY)
    assert model.config._attn_implementation == KEY
    batch = {k: v for k, v in FlatteningCollator(train_all_tokens=True)(examples).items() if k != "labels"}
    with torch.no_grad():
        e1, e2 = model(**batch, use_cache=False).logits, model(**batch, use_cache=False).logits
        model.train()
        t1, t2 = model(**batch, use_cache=False).logits, model(**batch, use_cache=False).logits
    assert torch.equal(e1, e2)                     # eval: no dropout
    assert (t1 - t2).abs().max() > 1e-3            # train: the module's attention dropout is applied


def test_cu_seq_lens_without_max_length_is_refused():
    from types import SimpleNamespace
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="max_length_q"):
        varlen_attention_forward(SimpleNamespace(is_causal=True), x, x, x, None, cu_seq_lens_q=_cu([2, 2]))
