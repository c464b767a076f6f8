"""Write the tiny random-init model configs of the family matrix into data_samples/configs/<family>/config.json.

Deterministic (no randomness, no downloads): every config is a small JSON of the fields that make a family what it is,
at toy size (hidden 64, 2 layers, 4 heads of 16 where the family allows, vocab 8192 = the shipped tokenizer, MoE with
4 small experts); transformers fills in the rest with its defaults. `llama`, `mistral` and `qwen2` are shipped by
make_samples.py and left alone. Run: python data_samples/make_family_configs.py
"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOKENIZER = json.loads((HERE / "tokenizer" / "tokenizer.json").read_text())
VOCAB = {t["content"]: t["id"] for t in TOKENIZER["added_tokens"]}
SPECIAL = dict(pad_token_id=VOCAB["<pad>"], bos_token_id=VOCAB["<s>"], eos_token_id=VOCAB["</s>"])
BASE = dict(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False, **SPECIAL)
GQA = dict(num_key_value_heads=2)
TWO_LAYER_TYPES = dict(layer_types=["sliding_attention", "full_attention"])  # one of each, for hybrid-window families

# family -> (model_type, architecture, fields that differ from BASE)
FAMILIES = {
    "llama3": ("llama", "LlamaForCausalLM", dict(head_dim=16, **GQA, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=512))),
    "mixtral": ("mixtral", "MixtralForCausalLM", dict(head_dim=16, **GQA, num_local_experts=4, num_experts_per_tok=2)),
    "granite": ("granite", "GraniteForCausalLM", dict(**GQA, embedding_multiplier=12.0, residual_multiplier=0.22,
                                                      attention_multiplier=0.0625, logits_scaling=8.0)),
    "dbrx": ("dbrx", "DbrxForCausalLM", dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=4096, vocab_size=8192,
              attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=500000.0),
              ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2), tie_word_embeddings=False,
              **SPECIAL)),
    "falcon": ("falcon", "FalconForCausalLM", dict(vocab_size=8192, hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, multi_query=True, parallel_attn=True, new_decoder_architecture=False,
               alibi=False, bias=False, ffn_hidden_size=128, max_position_embeddings=4096, **SPECIAL)),
    "gemma": ("gemma", "GemmaForCausalLM", dict(head_dim=16, num_key_value_heads=1)),
    "gemma2": ("gemma2", "Gemma2ForCausalLM", dict(head_dim=16, **GQA, sliding_window=16, query_pre_attn_scalar=16,
               attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **TWO_LAYER_TYPES)),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", dict(head_dim=16, **GQA, sliding_window=16,
               query_pre_attn_scalar=16, **TWO_LAYER_TYPES)),
    "olmo": ("olmo", "OlmoForCausalLM", dict(clip_qkv=8.0)),
    "olmo2": ("olmo2", "Olmo2ForCausalLM", dict(**GQA)),
    "phi": ("phi", "PhiForCausalLM", dict(partial_rotary_factor=0.5, hidden_act="gelu_new")),
    "phi3": ("phi3", "Phi3ForCausalLM", dict(sliding_window=16)),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM", dict(**GQA, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=64, decoder_sparse_step=1)),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", dict(head_dim=16, **GQA)),
    "stablelm": ("stablelm", "StableLmForCausalLM", dict(partial_rotary_factor=0.25, use_qkv_bias=True)),
    "starcoder2": ("starcoder2", "Starcoder2ForCausalLM", dict(**GQA, sliding_window=16, use_bias=True)),
}

def family_config(family: str) -> dict:
    "The config.json content of one family."
    model_type, arch, fields = FAMILIES[family]
    base = {} if model_type in ("dbrx", "falcon") else BASE  # these two name their sizes differently
    return dict(sorted({"architectures": [arch], "model_type": model_type, **base, **fields}.items()))

def main():
    for family in FAMILIES:
        path = HERE / "configs" / family / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(family_config(family), indent=2, sort_keys=True) + "\n")
        print(f"wrote {path.relative_to(HERE.parent)}")

if __name__ == "__main__":
    main()
