"""The doctor against leaky and clean setups in fp32, bf16 and fp16, wrapped models, and models it once misjudged.

A leak is a nonzero cross-example effect (exactly 0 for a clean model in every dtype), so weak leaks that a
packed-vs-padded tolerance would pass are caught; every fix the doctor prints was measured clean first.
"""
import pytest
import torch
import transformers as tr

from workbench.attention import KEY
from workbench.tiny_models import tiny_model
from workbench.doctor import NOISE_FACTOR, check_packing, contamination_probe, matrix_examples, unwrap
from workbench.packing import FlatteningCollator

NO_CACHE = {"use_cache": False}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# the fixed dtype constants it once used
OLD_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@pytest.fixture(scope="module")
def packed():
    return FlatteningCollator(train_all_tokens=True)(matrix_examples())


def _verified(report):
    "Every printed fix was measured: the report says with what, and it is clean."
    fixes = [f for f in report.findings if f.fix]
    assert fixes and "cross-example effect 0" in report.verified_with, report
    return fixes


class ShiftMix(torch.nn.Module):
    "A weak token mixer (a one-tap convolution, causal or looking ahead) around a layer's MLP: the hand-made weak leak."
    def __init__(self, mlp, scale, ahead=False):
        super().__init__()
        self.mlp, self.scale, self.ahead = mlp, scale, ahead
    def forward(self, x):
        shifted = (torch.nn.functional.pad(x[:, 1:], (0, 0, 0, 1)) if self.ahead
                   else torch.nn.functional.pad(x[:, :-1], (0, 0, 1, 0)))
        return self.mlp(x) + self.scale * shifted


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", ["sdpa", "eager", KEY])
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_clean_setups_are_exactly_clean(packed, family, impl, dtype):
    report = check_packing(tiny_model(family, attn_implementation=impl, dtype=dtype), packed, NO_CACHE)
    assert report.clean and report.verdict == "clean", str(report)
    assert report.cross_example_effect == 0.0 and report.layout_difference <= report.tolerance < OLD_TOLERANCE[dtype]
    assert report.tolerance >= NOISE_FACTOR * report.noise and not any(f.fix for f in report.findings)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weak_leak_caught_in_every_dtype(packed, dtype):
    "A mixer 1e-4 strong moves other examples' logits far below the half-type tolerances: caught all the same."
    model = tiny_model("llama", dtype=dtype)
    model.model.layers[1].mlp = ShiftMix(model.model.layers[1].mlp, 1e-4)
    report = check_packing(model, packed, NO_CACHE)
    assert not report.clean and 0 < report.cross_example_effect < 1e-2, report
    assert report["contamination probe"].status == "fail"
    assert "model.layers.1.mlp (ShiftMix" in report["sequence-mixing layers"].detail  # measured where it enters
    if dtype == torch.bfloat16:  # the old rule (leak > tolerance) would have called it clean
        assert report.cross_example_effect < OLD_TOLERANCE[dtype]
    assert "padded batches" in report["contamination probe"].fix and _verified(report)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_traps_caught_and_fixed_in_every_dtype(packed, dtype):
    model = tiny_model("llama", dtype=dtype)
    cache = check_packing(model, packed, {"use_cache": None})  # None means the config's use_cache: True
    assert not cache.clean and cache["cache off"].status == "fail" and cache.cross_example_effect > 0
    assert "use_cache=False" in cache["cache off"].fix and _verified(cache)
    ones = check_packing(model, {**packed, "attention_mask": torch.ones_like(packed["input_ids"])}, NO_CACHE)
    assert (not ones.clean and ones["no attention_mask"].status == "fail"
            and "drop attention_mask" in ones["no attention_mask"].fix)
    labels = packed["labels"].clone()
    labels[0, 1:] = packed["input_ids"][0, 1:]  # every first label trained (the loss leak the probe cannot see)
    sick = check_packing(model, {**packed, "labels": labels}, NO_CACHE)
    assert not sick.clean and sick["first labels masked"].status == "fail" and sick.cross_example_effect == 0
    assert ("4 of 4" in sick["first labels masked"].detail and "-100" in sick["first labels masked"].fix
            and _verified(sick))


def _extra_boundary(batch):
    "cu_seq_lens with one boundary more than position_ids (the second example split in two)."
    cu = batch["cu_seq_lens_q"].tolist()
    cu.insert(2, (cu[1] + cu[2]) // 2)
    return {**batch, "cu_seq_lens_q": torch.tensor(cu, dtype=torch.int32),
            "cu_seq_lens_k": torch.tensor(cu, dtype=torch.int32)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_boundaries_checked_against_their_reader(packed, dtype):
    bad = _extra_boundary(packed)
    varlen = check_packing(tiny_model("llama", attn_implementation=KEY, dtype=dtype), bad, NO_CACHE)
    assert (not varlen.clean and varlen["boundaries agree"].status == "fail"
            and "reads the boundaries from cu_seq_lens_q" in varlen["boundaries agree"].detail)
    assert (varlen.layout_difference > varlen.tolerance and "rebuild cu_seq_lens" in varlen["boundaries agree"].fix
            and _verified(varlen))
    sdpa = check_packing(tiny_model("llama", dtype=dtype), bad, NO_CACHE)  # sdpa reads position_ids: right, but warned
    assert (sdpa.clean and sdpa["boundaries agree"].status == "warn"
            and "rebuild cu_seq_lens" in sdpa["boundaries agree"].fix)
    assert not any(KEY in f.fix for f in sdpa.findings)  # the old false alarm suggested varlen, which really leaks here
    seq = {**packed, "seq_idx": torch.zeros_like(packed["input_ids"], dtype=torch.int32)}  # seq_idx marks one example
    assert "seq_idx" in check_packing(tiny_model("llama", dtype=dtype), seq, NO_CACHE)["boundaries agree"].detail


def test_batch_without_position_ids(packed):
    no_pos = {k: v for k, v in packed.items() if k != "position_ids"}
    sdpa = check_packing(tiny_model("llama"), no_pos, NO_CACHE)
    assert not sdpa.clean and sdpa["position_ids in the batch"].status == "fail" and _verified(sdpa)
    # varlen reads cu_seq_lens, and RoPE only sees differences of positions: measured harmless, still warned
    varlen = check_packing(tiny_model("llama", attn_implementation=KEY), no_pos, NO_CACHE)
    assert varlen.clean and varlen["position_ids in the batch"].status == "warn" and _verified(varlen)
    torch.manual_seed(0)  # absolute position embeddings: the positions themselves are wrong
    gpt2 = tr.GPT2LMHeadModel._from_config(tr.GPT2Config(vocab_size=8192, n_embd=64, n_layer=2, n_head=4),
                                           attn_implementation=KEY).eval()
    absolute = check_packing(gpt2, no_pos, NO_CACHE)
    assert (not absolute.clean and absolute.cross_example_effect == 0
            and absolute["position_ids in the batch"].status == "fail")
    assert "position_ids restarting" in absolute["position_ids in the batch"].fix and _verified(absolute)
    nothing = {k: v for k, v in no_pos.items() if not k.startswith(("cu_seq", "max_length"))}
    blind = check_packing(tiny_model("llama"), nothing, NO_CACHE)
    assert not blind.clean and "FlatteningCollator" in blind["example boundaries and labels"].detail
    unlabelled = check_packing(tiny_model("llama"), {k: v for k, v in packed.items() if k != "labels"}, NO_CACHE)
    assert not unlabelled.clean and "no labels" in unlabelled["example boundaries and labels"].detail


def test_model_without_position_ids_is_measured(packed):
    torch.manual_seed(0)
    bloom = tr.BloomForCausalLM(tr.BloomConfig(vocab_size=8192, hidden_size=64, n_layer=2, n_head=4)).eval()
    report = check_packing(bloom, packed, NO_CACHE)
    assert (report["forward accepts position_ids"].status == "fail"
            and "PaddingCollator" in report["forward accepts position_ids"].fix)
    torch.manual_seed(0)  # OPT takes position_ids, but its sdpa mask ignores packing: measured, and the measured fix
    opt = tr.OPTForCausalLM(tr.OPTConfig(vocab_size=8192, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                                         num_attention_heads=4, word_embed_proj_dim=64)).eval()
    sick = check_packing(opt, packed, NO_CACHE)
    assert not sick.clean and KEY in sick["contamination probe"].fix and _verified(sick)


def test_gpt2_conv1d_is_not_a_token_mixer(packed):
    torch.manual_seed(0)
    gpt2 = tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=8192, n_embd=64, n_layer=2, n_head=4)).eval()
    report = check_packing(gpt2, packed, NO_CACHE)
    assert report.clean and report["sequence-mixing layers"].status == "pass" and report.cross_example_effect == 0


def test_mamba_hybrid_leak_caught_in_bf16(packed):
    "A tiny Jamba (Mamba + attention + MoE) without mamba kernels: its SSM leaks weakly; bf16 tolerance would pass it."
    torch.manual_seed(0)
    cfg = tr.JambaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4,
                         num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                         expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_expand=2)
    report = check_packing(tr.JambaForCausalLM(cfg).to(torch.bfloat16).eval(), packed, NO_CACHE)
    assert not report.clean and 0 < report.cross_example_effect < OLD_TOLERANCE[torch.bfloat16]
    assert ("JambaMambaMixer" in report["sequence-mixing layers"].detail
            and "padded batches" in report["contamination probe"].fix)


class KwargsOnly(torch.nn.Module):
    "A wrapper whose forward(**kwargs) hides the signature."
    def __init__(self, model):
        super().__init__()
        self.inner = model
    def forward(self, **kwargs): return self.inner(**kwargs)


class DDPLike(torch.nn.Module):
    "Keeps the model in `.module`, as DistributedDataParallel and FSDP1 do."
    def __init__(self, module):
        super().__init__()
        self.module = module
    def forward(self, *args, **kwargs): return self.module(*args, **kwargs)


@pytest.mark.parametrize("wrap", [KwargsOnly, DDPLike], ids=["forward(**kwargs)", "ddp-like"])
def test_wrapped_models_are_measured(packed, wrap):
    model = wrap(tiny_model("llama"))
    assert unwrap(model)[1] is (model.inner if wrap is KwargsOnly else model.module)
    clean = check_packing(model, packed, NO_CACHE)
    assert clean.clean and clean.cross_example_effect == 0 and clean.wrappers == (wrap.__name__,)
    sick = check_packing(model, packed)
    assert not sick.clean and sick["cache off"].status == "fail" and _verified(sick)


def test_peft_lora_is_measured(packed):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("qwen3"),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    clean = check_packing(model, packed, NO_CACHE)
    assert clean.clean and clean.cross_example_effect == 0 and clean.wrappers[0] == "PeftModelForCausalLM", clean
    assert clean["packed == padded: gradients"].status == "pass"  # the LoRA weights' gradients
    sick = check_packing(model, packed)
    assert not sick.clean and "self_attn" in sick["sequence-mixing layers"].detail and _verified(sick)


def test_padded_fix_verified_without_padding():
    "Examples of one length: their padded twin has an all-ones mask and still counts one example per row."
    same = FlatteningCollator(train_all_tokens=True)([{"input_ids": f["input_ids"][:20]} for f in matrix_examples()])
    model = tiny_model("llama")
    model.model.layers[0].mlp = ShiftMix(model.model.layers[0].mlp, 1e-2)
    report = check_packing(model, same, NO_CACHE)
    assert not report.clean and "padded batches" in report["contamination probe"].fix and _verified(report)


def _rounding_by_count(grouped_mm):
    "A grouped matmul whose rows round by how many rows their expert got, as batch-dependent kernels do."
    def rounded(input, weight, offs):
        out = grouped_mm(input, weight, offs=offs)
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        # each grouped row's expert's row count (rows past offs[-1] are skipped)
        counts = sizes.repeat_interleave(sizes)
        scale = 1 + (counts % 5).to(out.dtype) * 2**-20
        return torch.cat([out[:len(counts)] * scale[:, None], out[len(counts):]])
    return rounded


def test_moe_routing_does_not_fake_a_leak(monkeypatch):
    """A clean MoE whose grouped expert matmuls round by token count: plain forwards differ, the probe stays exactly 0.
    Whether a CPU's kernels round by count depends on its BLAS (an AMD EPYC box's do not: the plain forwards were
    equal), so the experts' grouped matmul is replaced by one that does, through transformers' own dispatcher."""
    from transformers.integrations import moe
    from workbench.core import example_ids
    from workbench.samples import load_sample
    from workbench.doctor import _perturbed  # the probe's own perturbation, to show what it avoids
    monkeypatch.setattr(moe, "_grouped_mm", _rounding_by_count(moe._grouped_mm))
    model = tiny_model("mixtral", num_hidden_layers=1)
    batch = FlatteningCollator(train_all_tokens=True)([{"input_ids": f["input_ids"][:40]}
                                                       for f in load_sample("flan_like", limit=24)[20:24]])
    examples = torch.from_numpy(example_ids(torch.diff(batch["cu_seq_lens_q"]).numpy()))
    with torch.no_grad():
        base = model(**batch, use_cache=False).logits[0]
        moved = max((model(**_perturbed(batch, examples, w, model.config.vocab_size, 0), use_cache=False).logits[0]
                     - base)[examples != w].abs().max()
                    for w in (0, 3))
    assert moved > 0  # rounding from the grouped matmuls' shapes, not a leak
    report = check_packing(model, batch, NO_CACHE)
    assert report.clean and report.cross_example_effect == 0 and model.config._experts_implementation == "grouped_mm"


class Noisy(torch.nn.Module):
    "A layer that is not deterministic (fresh noise every pass): no probe can be exact on it."
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp
    def forward(self, x): return self.mlp(x) + 1e-3 * torch.randn_like(x)


def test_nondeterministic_model_is_refused_not_judged(packed):
    model = tiny_model("llama")
    model.model.layers[0].mlp = Noisy(model.model.layers[0].mlp)
    threads = torch.get_num_threads()
    report = check_packing(model, packed, NO_CACHE)
    assert not report.clean and "identical forward passes differ" in report["model runs on the packed batch"].detail
    assert torch.get_num_threads() == threads  # restored


def test_real_ddp_is_stepped_through(packed, tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(tiny_model("llama"))
        report = check_packing(ddp, packed, NO_CACHE)
        assert report.clean and report.wrappers == ("DistributedDataParallel",) and report.cross_example_effect == 0
        sick = check_packing(ddp, packed)
        assert not sick.clean and _verified(sick)
    finally: dist.destroy_process_group()


def test_leak_backwards_and_two_packed_rows(packed):
    """A mixer that looks ahead leaks from later examples into earlier ones
    (the probe changes the last example too); a batch of two packed rows."""
    model = tiny_model("llama")
    model.model.layers[0].mlp = ShiftMix(model.model.layers[0].mlp, 1e-3, ahead=True)
    assert check_packing(model, packed, NO_CACHE).cross_example_effect > 0
    feats = matrix_examples()
    rows = [FlatteningCollator(pad_to_multiple_of=96, train_all_tokens=True)(part) for part in (feats[:2], feats[2:])]
    two = {k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "labels", "position_ids")}
    report = check_packing(tiny_model("qwen2"), two, NO_CACHE)
    assert report.clean and report.n_examples == 7 and report.cross_example_effect == 0, str(report)
    assert not check_packing(tiny_model("qwen2"), two).clean  # the cache trap, on both rows


def test_not_a_transformers_model_is_a_clear_error(packed):
    with pytest.raises(TypeError, match="holds no transformers PreTrainedModel"):
        check_packing(torch.nn.Linear(4, 4), packed)


def _leak_1_into_2(module, query, key, value, attention_mask, **kwargs):
    "sdpa, except that in a packed row example 2 also sees example 1: 0.03 of its mean value (the weak middle leak)."
    from workbench.attention import positions_to_cu_seq_lens
    out, weights = tr.integrations.sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask,
                                                                          **kwargs)
    pos = kwargs.get("position_ids")
    cu = positions_to_cu_seq_lens(pos)[0].tolist() if pos is not None and pos.shape[0] == 1 else []
    if len(cu) < 4: return out, weights  # padded rows, or one example alone: nothing to leak
    seen = value.repeat_interleave(query.shape[1] // value.shape[1], 1)[:, :, cu[1]:cu[2]].mean(2)  # [B, H, D]
    out = out.clone()
    out[:, cu[2]:cu[3]] = 0.97 * out[:, cu[2]:cu[3]] + 0.03 * seen[:, None]
    return out, weights


@pytest.fixture(scope="module")
def leaky_attention():
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    tr.AttentionInterface.register("leak_1_into_2", _leak_1_into_2)
    AttentionMaskInterface.register("leak_1_into_2", sdpa_mask)  # sdpa's packed-aware mask
    return "leak_1_into_2"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weak_leak_between_middle_examples(packed, leaky_attention, dtype):
    """Example 2 sees example 1 with weight 0.03: once read 0 by a probe that changed only the first and last examples,
    and in bf16 passed packed vs padded (0.0195 under the fixed 0.05). Every example is probed now, and the tolerance is
    the clean model's measured rounding (2**-8 in bf16, doubled)."""
    report = check_packing(tiny_model("llama", attn_implementation=leaky_attention, dtype=dtype), packed, NO_CACHE)
    assert not report.clean and report.cross_example_effect > 0 and report["contamination probe"].status == "fail"
    assert report["packed == padded: logits"].status == "fail" and report.layout_difference > report.tolerance
    assert "model.layers.0.self_attn (LlamaAttention" in report["sequence-mixing layers"].detail
    clean = check_packing(tiny_model("llama", dtype=dtype), packed, NO_CACHE)
    assert clean.clean and clean.tolerance == report.tolerance  # the same model's noise: the leak does not loosen it
    if dtype == torch.bfloat16:
        assert (clean.noise, clean.tolerance) == (2 ** -8, 2 ** -7) and report.layout_difference < OLD_TOLERANCE[dtype]


def test_probe_watches_every_example(packed):
    "A leak into any example from any other shows, in both directions (ShiftMix looking ahead leaks backwards)."
    model = tiny_model("llama")
    for ahead in (False, True):
        model.model.layers[0].mlp = ShiftMix(model.model.layers[0].mlp.mlp if ahead else model.model.layers[0].mlp,
                                             1e-3, ahead)
        leak, own = contamination_probe(model, packed, NO_CACHE)
        assert leak > 0 and own > 0.1


def test_numpy_batch_is_measured_like_tensors(packed):
    model = tiny_model("llama")
    as_numpy = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in packed.items()}
    report = check_packing(model, as_numpy, NO_CACHE)
    assert report.clean and report.n_tokens == packed["input_ids"].numel() and report.cross_example_effect == 0


def test_one_example_names_the_position_ids(packed):
    T = packed["input_ids"].shape[1]
    flat = {"input_ids": packed["input_ids"], "labels": packed["labels"], "position_ids": torch.arange(T)[None]}
    report = check_packing(tiny_model("llama"), flat, NO_CACHE)
    detail = report["example boundaries and labels"].detail
    assert not report.clean and f"position_ids [0, 1, 2, ..., {T - 2}, {T - 1}] never restart" in detail
    assert "restarts position_ids at every example's first token" in detail and "at least two examples" in detail
    with pytest.raises(ValueError, match="never restart"):
        contamination_probe(tiny_model("llama"), flat)


@pytest.mark.parametrize("bad", [-3, 8192], ids=["negative", "out-of-vocabulary"])
def test_ids_outside_the_vocabulary_are_named(packed, bad):
    ids = packed["input_ids"].clone()
    ids[0, 60] = bad
    model = tiny_model("llama")
    report = check_packing(model, {**packed, "input_ids": ids}, NO_CACHE)
    assert not report.clean and report["input_ids in the vocabulary"].status == "fail"
    assert f"input_ids[0, 60] = {bad} is not a token of the model" in report["input_ids in the vocabulary"].detail
    assert "ids 0..8191" in report["input_ids in the vocabulary"].detail
    with pytest.raises(ValueError, match=r"input_ids\[0, 60\]"):
        contamination_probe(model, {**packed, "input_ids": ids})
