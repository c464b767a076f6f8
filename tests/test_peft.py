"""PEFT (LoRA) models through the workbench: packed batches, `workbench_varlen`, the doctor and Ulysses SP.

What users hand it: adapters on the attention projections only or on the MLP too, `modules_to_save`, a merged and
unloaded model, a PeftModel built without a task type, `use_cache` left at its default, bf16 weights (PEFT keeps the
adapters in fp32), and reentrant gradient checkpointing (which needs `enable_input_require_grads`).
SP = 2 must equal one process: the loss and every trained (adapter) parameter's gradient.
"""
import pytest
import torch

peft = pytest.importorskip("peft")

from workbench.attention import KEY as VARLEN
from workbench.tiny_models import tiny_model
from workbench.doctor import check_packing, contamination_probe, matrix_examples, padded_twin, prompt_learning, unwrap
from workbench.packing import FlatteningCollator
from workbench.sp_proofs import Case, prove_equivalence

NO_CACHE = {"use_cache": False}
# peft 0.18 (the floor) warns when a tied lm_head is trained whole (`modules_to_save`) without `ensure_weight_tying`:
# merging or converting such an adapter may untie it. These tests train it so on purpose, neither merge nor convert,
# and compare every gradient with one process; later peft versions do not warn.
TIED_LM_HEAD = "ignore:Model has `tie_word_embeddings=True` and a tied layer is part of the adapter:UserWarning"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EVERYWHERE = ATTENTION + ("gate_proj", "up_proj", "down_proj")
TOL = {"float32": 1e-5, "float64": 1e-10}


def lora(model, targets=ATTENTION, task_type="CAUSAL_LM", **kw):
    "A LoRA model with random A and B (the default zero B leaves the A gradients zero, proving nothing about them)."
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=list(targets), task_type=task_type,
                                                      init_lora_weights=False, **kw))


def trained(model) -> set:
    return {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def packed():
    return FlatteningCollator(train_all_tokens=True)(matrix_examples())


# ---------------------------------------------------------------- one process: the doctor sees through the wrappers

@pytest.mark.filterwarnings(TIED_LM_HEAD)
@pytest.mark.parametrize("targets,save", [(ATTENTION, None), (EVERYWHERE, None), (ATTENTION, ["lm_head"])],
                         ids=["attention", "attention+mlp", "modules_to_save"])
def test_doctor_measures_lora_models_and_flags_the_default_cache(packed, targets, save):
    model = lora(tiny_model("llama"), targets, modules_to_save=save)
    runner, inner, wrappers = unwrap(model)
    assert runner is model and inner is model.base_model.model and wrappers == ("PeftModelForCausalLM", "LoraModel")
    assert all("lora_" in n or "modules_to_save" in n for n in trained(model))
    clean = check_packing(model, packed, NO_CACHE)
    assert clean.clean and clean.cross_example_effect == 0, clean
    assert clean["wrappers"].detail.startswith("PeftModelForCausalLM > LoraModel around LlamaForCausalLM")
    assert clean["packed == padded: gradients"].status == "pass"  # the adapters' (and the saved modules') gradients
    # PEFT leaves config.use_cache at True: a custom loop that does not pass use_cache=False attends across examples
    assert model.config.use_cache is True
    sick = check_packing(model, packed)
    assert not sick.clean and sick["cache off"].status == "fail" and sick.cross_example_effect > 1e-3, sick
    assert "use_cache=False" in sick["cache off"].fix and "cross-example effect 0" in sick.verified_with


def test_the_gradients_compared_are_the_adapters_and_nonzero(packed):
    """The doctor's gradient check is not vacuous for a PEFT model:
    the adapters' gradients are real and packed == padded."""
    model = lora(tiny_model("llama"), EVERYWHERE)
    grads = {}
    for name, batch in (("packed", packed), ("padded", padded_twin(packed))):
        model.zero_grad()
        model(**batch, use_cache=False).loss.backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads["packed"]) == trained(model) and len(grads["packed"]) == 2 * 2 * len(EVERYWHERE)
    assert min(g.abs().max().item() for g in grads["packed"].values()) > 0  # A and B both move
    assert max((grads["packed"][n] - g).abs().max().item() for n, g in grads["padded"].items()) < 1e-6


def test_peft_model_without_task_type_and_merged_model(packed):
    model = lora(tiny_model("qwen3"), EVERYWHERE, task_type=None)
    assert type(model).__name__ == "PeftModel" and unwrap(model)[2] == ("PeftModel", "LoraModel")
    assert check_packing(model, packed, NO_CACHE).clean
    with torch.no_grad(): before = model(**packed, use_cache=False).logits
    merged = model.merge_and_unload()  # what a user ships after training: a plain transformers model again
    assert unwrap(merged)[2] == () and not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad(): after = merged(**packed, use_cache=False).logits
    assert (after - before).abs().max().item() < 1e-5  # the adapters really are in the merged weights
    frozen = check_packing(merged, packed, NO_CACHE)  # PEFT froze the base, and the merged weights stay frozen
    assert frozen.clean and frozen["wrappers"].detail == "no wrapper: Qwen3ForCausalLM", frozen
    assert (frozen["trainable parameters"].status == "warn"
            and "requires_grad_(True)" in frozen["trainable parameters"].fix)
    assert not any(f.check == "packed == padded: gradients" for f in frozen.findings)  # not measured, and it says so
    merged.requires_grad_(True)
    thawed = check_packing(merged, packed, NO_CACHE)
    assert thawed.clean and thawed["packed == padded: gradients"].status == "pass", thawed
    assert not any(f.check == "trainable parameters" for f in thawed.findings)


def test_varlen_attention_under_peft_equals_padded_and_probes_clean(packed):
    """`workbench_varlen` (its CPU reference path) set through the
    PeftModel reaches the base model and reads cu_seq_lens."""
    model = lora(tiny_model("mistral"), EVERYWHERE)
    model.set_attn_implementation(VARLEN)  # forwarded to the transformers model inside
    assert unwrap(model)[1].config._attn_implementation == VARLEN
    leak, own = contamination_probe(model, packed)  # varlen reads the boundaries even with the cache on
    assert leak == 0 and own > 0
    report = check_packing(model, packed, NO_CACHE)
    assert report.clean and report["packed == padded: gradients"].status == "pass", report


def test_bf16_base_with_fp32_adapters(packed):
    "PEFT upcasts bf16 adapters to fp32: the packed batch still runs, stays clean, and the cache trap is still caught."
    model = lora(tiny_model("llama", dtype=torch.bfloat16), EVERYWHERE)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    assert unwrap(model)[1].dtype == torch.bfloat16
    clean = check_packing(model, packed, NO_CACHE)
    # measured, tighter than the old fixed bf16 constant
    assert clean.clean and clean.cross_example_effect == 0 and clean.tolerance < 5e-2, clean
    sick = check_packing(model, packed)
    assert not sick.clean and sick["cache off"].status == "fail"


def test_gradient_checkpointing_with_peft(packed):
    """Reentrant checkpointing under PEFT needs inputs that require grad
    (the embeddings are frozen): transformers' switch adds the hook."""
    def grads(checkpointing, hook):
        model = lora(tiny_model("llama"), EVERYWHERE).train()
        if checkpointing: model.activation_checkpointing_enable({"use_reentrant": True})
        if hook == "again": model.enable_input_require_grads()  # what PEFT recipes call as well: harmless twice
        if hook == "removed": model.disable_input_require_grads()
        loss = model(**packed, use_cache=False).loss
        if not loss.requires_grad: return None
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    plain = grads(False, None)
    assert set(plain) == trained(lora(tiny_model("llama"), EVERYWHERE)) and len(plain) == 2 * 2 * len(EVERYWHERE)
    for hook in (None, "again"):
        checkpointed = grads(True, hook)
        assert set(checkpointed) == set(plain)
        assert max((plain[n] - g).abs().max().item() for n, g in checkpointed.items()) < 1e-7
    with pytest.warns(UserWarning, match="requires_grad"):  # without the hook nothing recomputes: torch only warns
        assert grads(True, "removed") is None  # and the loss has no gradient at all (the lm_head is frozen too)


# ---------------------------------------------------------------- Ulysses: SP = 2 equals one process

@pytest.mark.filterwarnings(TIED_LM_HEAD)
def test_lora_under_sp2_equals_one_process():
    cases = [Case("llama", "sdpa", lora=ATTENTION),
             Case("llama", VARLEN, lora=EVERYWHERE, requires="workbench.attention"),
             Case("qwen2", "eager", lora=EVERYWHERE, lora_save=("lm_head",)),       # GQA, a module trained whole
             Case("llama", "sdpa", lora=EVERYWHERE, dtype="float64"),
             Case("mistral", "sdpa", lora=ATTENTION, checkpointing=True, reentrant=True),  # sliding window, recompute
             Case("qwen2", "sdpa", lora=ATTENTION, packed=False),                  # one long document
             Case("llama", "sdpa", lora=EVERYWHERE, dtype="float64", lean=True, mlp_chunk=24, checkpointing=True)]
    results = prove_equivalence(cases, world_size=2, sp_size=2)
    for r in results:
        case = r["case"]
        adapters = 2 * 2 * len(case.lora) + len(case.lora_save)  # layers x (A, B) x modules, + lm_head's weight
        assert r["n_params"] == adapters, f"{case}: {r['n_params']} parameters got gradients, expected {adapters}"
        worst = max(r["logits"], r["loss"], r["grads"])
        assert worst <= TOL[case.dtype], (f"{case}: logits {r['logits']:.2e}, loss "
                                          f"{r['loss']:.2e}, grads {r['grads']:.2e}")


# ---------------------------------------------------------------- workbench.train --lora-r: adapters only, saved as
# PEFT

def test_train_lora_sp2_sharded_equals_one_process_and_saves_a_peft_adapter(tmp_path):
    from transformers import AutoModelForCausalLM
    from workbench.checkpoint import ADAPTER_DIR, latest_checkpoint, MODEL_DIR
    from workbench.config import TrainConfig
    from workbench.model import build_model
    from workbench.train import run, train_rank
    cfg = TrainConfig(steps=3, max_tokens=256, lora_r=4, lr=1e-2, save_every=3)
    with pytest.raises(ValueError, match=r"lora_r \(--lora-r\) must be an integer >= 0"): TrainConfig(lora_r=-1)
    one = train_rank(TrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "one")}))
    two = run(TrainConfig(**{**cfg.__dict__, "ulysses": 2, "shard": True, "out": str(tmp_path / "two")}))
    assert len(one) == len(two) == 3 and all(abs(a - b) <= 1e-5 * max(abs(b), 1) for a, b in zip(one, two)), (one, two)
    start = build_model(TrainConfig(), "sdpa", torch.device("cpu")).state_dict()  # the seeded model before training
    for out in ("one", "two"):
        where, manifest = latest_checkpoint(tmp_path / out)
        assert {f"{ADAPTER_DIR}/adapter_config.json", f"{ADAPTER_DIR}/adapter_model.safetensors",
                f"{MODEL_DIR}/model.safetensors"} <= set(manifest["files"])
        trained = torch.load(where / "state.pt", weights_only=True)["model"]
        lora_keys = [k for k in trained if "lora_" in k]
        assert lora_keys and any(trained[k].abs().max() > 0 for k in lora_keys if "lora_B" in k)  # B moved from 0
        for k, v in trained.items():  # only the adapters trained: every base weight is the seeded one
            if "lora_" not in k: assert torch.equal(v, start[k.replace(".base_layer", "")]), k
        base = AutoModelForCausalLM.from_pretrained(where / MODEL_DIR)
        assert torch.equal(base.state_dict()["lm_head.weight"], start["lm_head.weight"])
        tuned = peft.PeftModel.from_pretrained(base, where / ADAPTER_DIR)  # what a user loads
        loaded = tuned.state_dict()
        assert all(torch.equal(loaded[f"base_model.model.{k}"], v) for k, v in trained.items())
        reference = build_model(cfg, "sdpa", torch.device("cpu")).eval()  # the training model, trained weights
        reference.load_state_dict(trained)
        ids = torch.arange(3, 60)[None]
        with torch.no_grad():
            assert torch.equal(tuned(input_ids=ids, use_cache=False).logits, reference(ids, use_cache=False).logits)
    # resume restores the adapters and their optimizer: step 4 after a resume equals step 4 of a straight run
    resumed = train_rank(TrainConfig(**{**cfg.__dict__, "steps": 4, "resume": True, "out": str(tmp_path / "one")}))
    straight = train_rank(TrainConfig(**{**cfg.__dict__, "steps": 4, "out": str(tmp_path / "straight")}))
    assert straight[:3] == one and abs(resumed[0] - straight[3]) <= 1e-6, (resumed, straight)


@pytest.mark.parametrize("method", ["prefix", "prompt"])
# peft's own words on what the doctor fails
@pytest.mark.filterwarnings("ignore:Position ids are not supported:UserWarning",
                            "ignore:`past_key_values` is deprecated:FutureWarning")  # peft's prefix -> transformers
def test_prompt_learning_adapters_are_refused_with_the_reason(packed, method):
    """Prefix / prompt tuning add virtual tokens per row, not per
    packed example: the doctor fails them and names the fix."""
    config = (peft.PrefixTuningConfig if method == "prefix"
              else peft.PromptTuningConfig)(num_virtual_tokens=4, task_type="CAUSAL_LM")
    report = check_packing(peft.get_peft_model(tiny_model("llama"), config), packed, NO_CACHE)
    finding = report["PEFT adapter packs"]
    assert not report.clean and finding.status == "fail" and "PaddingCollator" in finding.fix, report
    assert method.upper() in finding.detail
    assert (prompt_learning(report_model := peft.get_peft_model(tiny_model("llama"), config))
            == method.upper() + "_TUNING")
    assert prompt_learning(lora(tiny_model("llama"))) is None and prompt_learning(report_model.get_base_model()) is None
