"""Tiny random models built with transformers, one per architecture tandem supports, saved with save_pretrained.

Each covers a feature of the model core: GQA, Qwen2 q/k/v bias, Qwen3 q/k norm with head_dim != hidden/heads,
tied and untied embeddings, llama3 rope scaling. Norm weights and biases are randomised too (transformers
initialises them to 1 and 0, which would hide mistakes in their gradients).
"""
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config)

COMMON = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.08,
              bos_token_id=1, eos_token_id=2)

SPECS = {
    # Llama 3 style: GQA 4:2, llama3 rope scaling, untied.
    "llama_gqa_llama3rope": lambda: LlamaConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # SmolLM / TinyLlama style: multi-head (no GQA), tied embeddings.
    "llama_tied": lambda: LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=4,
                                      tie_word_embeddings=True),
    # Qwen2.5 style: q/k/v bias, GQA, tied.
    "qwen2_bias": lambda: Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Qwen3 style: q/k RMSNorm per head, head_dim 24 != 64/4, untied.
    "qwen3_qknorm": lambda: Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                        tie_word_embeddings=False),
    # Mistral: GQA 4:1, no sliding window.
    "mistral": lambda: MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                     sliding_window=None, tie_word_embeddings=False),
}


def build(name, out_dir, seed=0):
    torch.manual_seed(seed)
    cfg = SPECS[name]()
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return model
