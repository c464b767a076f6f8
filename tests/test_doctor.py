"""workbench.doctor: every trap is detected on a real (tiny,
random-init) model, and every fix makes the doctor say clean."""
import pytest
import torch
import transformers as tr

from workbench.attention import KEY
from workbench.tiny_models import tiny_model
from workbench.doctor import DoctorReport, check_packing, matrix_examples
from workbench.packing import FlatteningCollator

NO_CACHE = {"use_cache": False}


@pytest.fixture(scope="module")
def feats():
    return matrix_examples()


@pytest.fixture(scope="module")
def packed(feats):
    return FlatteningCollator(train_all_tokens=True)(feats)


def _statuses(report: DoctorReport) -> dict:
    return {f.check: f.status for f in report.findings}


def test_clean_setup_is_clean_everywhere(packed):
    report = check_packing(tiny_model("mistral"), packed, NO_CACHE)
    assert report.clean and set(_statuses(report).values()) == {"pass"}
    assert report.verdict == "clean"


def test_padding_dummy_is_just_another_example(feats):
    batch = FlatteningCollator(pad_to_multiple_of=128, train_all_tokens=True)(feats)
    report = check_packing(tiny_model("llama"), batch, NO_CACHE)
    assert report.n_examples == len(feats) + 1 and report.clean


def test_cache_trap_detected_and_fixed(packed):
    model = tiny_model("llama")
    assert model.config.use_cache  # the transformers default
    sick = check_packing(model, packed)
    assert not sick.clean and sick["cache off"].status == "fail" and "use_cache=False" in sick["cache off"].fix
    assert sick["contamination probe"].status == "fail" and sick["packed == padded: loss"].status == "fail"
    assert check_packing(model, packed, NO_CACHE).clean
    model.config.use_cache = False  # the other fix the doctor suggests
    assert check_packing(model, packed).clean


def test_attention_mask_trap_detected_and_fixed(packed):
    model = tiny_model("qwen2")
    sick = check_packing(model, {**packed, "attention_mask": torch.ones_like(packed["input_ids"])}, NO_CACHE)
    assert not sick.clean and sick["no attention_mask"].status == "fail"
    assert sick["packed == padded: logits"].status == "fail"
    assert check_packing(model, packed, NO_CACHE).clean


def test_varlen_is_immune_but_warned(packed):
    model = tiny_model("llama", attn_implementation=KEY)
    report = check_packing(model, {**packed, "attention_mask": torch.ones_like(packed["input_ids"])})
    assert report.clean
    assert report["cache off"].status == "warn" and report["no attention_mask"].status == "warn"


def _tiny_qwen2_vl():
    torch.manual_seed(0)
    text = dict(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    cfg = tr.Qwen2VLConfig(text_config=text, vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2))
    return tr.Qwen2VLForConditionalGeneration(cfg).eval()


def test_3d_position_ids_detected_and_fixed(packed):
    "mRoPE position ids (3 rows) on Qwen2-VL: sdpa leaks; the varlen implementation reads cu_seq_lens and is clean."
    model = _tiny_qwen2_vl()
    batch = {**packed, "position_ids": packed["position_ids"][None].expand(3, 1, -1).contiguous()}
    sick = check_packing(model, batch, NO_CACHE)
    assert not sick.clean and sick["2-D position_ids"].status == "fail" and KEY in sick["2-D position_ids"].fix
    assert sick["contamination probe"].status == "fail"
    model.set_attn_implementation(KEY)
    healed = check_packing(model, batch, NO_CACHE)
    assert healed.clean and healed["contamination probe"].status == "pass"


def test_3d_position_ids_on_a_text_model_are_reported(packed):
    batch = {**packed, "position_ids": packed["position_ids"][None].expand(3, 1, -1).contiguous()}
    sick = check_packing(tiny_model("llama"), batch, NO_CACHE)
    assert not sick.clean and sick["2-D position_ids"].status == "fail"
    assert sick["model runs on the packed batch"].status == "fail"


def _tiny_roberta(attn):
    torch.manual_seed(0)
    cfg = tr.RobertaConfig(vocab_size=8192, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, is_decoder=True, pad_token_id=0, max_position_embeddings=512)
    return tr.RobertaForCausalLM._from_config(cfg, attn_implementation=attn).eval()


def test_position_ids_start_detected_and_fixed(feats):
    "RoBERTa-style position embeddings reserve ids up to padding_idx: positions must start at padding_idx + 1."
    model = _tiny_roberta(KEY)
    sick = check_packing(model, FlatteningCollator(train_all_tokens=True)(feats), NO_CACHE)
    assert not sick.clean and sick["position_ids start"].status == "fail"
    assert "position_ids_start=1" in sick["position_ids start"].fix
    assert check_packing(model, FlatteningCollator(position_ids_start=1, train_all_tokens=True)(feats), NO_CACHE).clean


def test_attention_that_ignores_packing_is_caught(feats):
    """OPT's own sdpa mask ignores packed position_ids (transformers 5.23-5.25; RoBERTa's did up to 5.24): the probe
    catches it; our varlen attention fixes it."""
    batch = FlatteningCollator(train_all_tokens=True)(feats)
    torch.manual_seed(0)
    cfg = tr.OPTConfig(vocab_size=8192, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                       word_embed_proj_dim=64, pad_token_id=1, max_position_embeddings=512)
    model = tr.OPTForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    sick = check_packing(model, batch, NO_CACHE)
    assert not sick.clean and sick["contamination probe"].status == "fail" and KEY in sick["contamination probe"].fix
    model.set_attn_implementation(KEY)
    assert check_packing(model, batch, NO_CACHE).clean


def test_convolution_layers_detected(feats):
    """A conv hybrid (LFM2): transformers refuses packed rows without
    causal-conv1d; the doctor names the layers and the way out."""
    torch.manual_seed(0)
    cfg = tr.AutoConfig.for_model("lfm2", vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"])
    model = tr.AutoModelForCausalLM.from_config(cfg).eval()
    # without seq_idx the convolution leaks silently
    silent = check_packing(model, FlatteningCollator(train_all_tokens=True)(feats), NO_CACHE)
    # with it, transformers refuses
    refused = check_packing(model, FlatteningCollator(return_seq_idx=True, train_all_tokens=True)(feats), NO_CACHE)
    assert not silent.clean and silent["sequence-mixing layers"].status == "fail"  # measured, not read from class names
    assert ("ShortConv" in silent["sequence-mixing layers"].detail
            and "padded batches" in silent["sequence-mixing layers"].fix)
    assert silent["contamination probe"].status == "fail" and "padded batches" in silent["contamination probe"].fix
    assert 0 < silent.cross_example_effect < 1e-2  # a weak leak: exact zero is the test, not a tolerance
    assert not refused.clean and "causal_conv1d" in refused["model runs on the packed batch"].detail
    assert "padded batches" in refused["model runs on the packed batch"].fix  # measured: the padded layout is clean


def test_model_without_position_ids(packed):
    torch.manual_seed(0)
    model = tr.BloomForCausalLM(tr.BloomConfig(vocab_size=8192, hidden_size=64, n_layer=2, n_head=4)).eval()
    sick = check_packing(model, packed)
    assert not sick.clean and sick["forward accepts position_ids"].status == "fail"
    assert ("PaddingCollator" in sick["forward accepts position_ids"].fix
            and "cross-example effect 0" in sick.verified_with)


def test_report_renders(packed):
    report = check_packing(tiny_model("llama"), packed)
    text, md, html = str(report), report._repr_markdown_(), report._repr_html_()
    assert text.startswith("Packing doctor: llama") and "NOT CLEAN" in text and "fix: pass use_cache=False" in text
    assert "| FAIL | cache off |" in md and "<table>" in html and "color:#cf222e" in html
    with pytest.raises(KeyError, match="checks:"): report["nope"]


def test_model_mode_is_restored(packed):
    model = tiny_model("llama").train()
    check_packing(model, packed, NO_CACHE)
    assert model.training and all(p.grad is None for p in model.parameters())
