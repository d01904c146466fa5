"""Tiny model configurations the unit tests build on one process (no data, no process groups)."""

from __future__ import annotations

from mpformer.core.model_config import ModelConfig

TINY = {
    "llama": ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=96, vocab_size=101),
    "gpt2": ModelConfig(arch="gpt2", num_layers=2, hidden_size=64, num_attention_heads=4, activation="gelu_tanh",
                        vocab_size=101, max_position_embeddings=64, tie_embeddings=True, attention_bias=True,
                        mlp_bias=True),
    "qwen2": ModelConfig(arch="qwen2", num_layers=1, hidden_size=32, num_attention_heads=4, num_kv_heads=1,
                         ffn_hidden_size=48, vocab_size=50, attention_bias=True),
    "mistral": ModelConfig(arch="mistral", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                           ffn_hidden_size=96, vocab_size=101, sliding_window=5),
}
