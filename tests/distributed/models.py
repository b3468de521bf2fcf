"""The tiny models the torchrun cases train, built in one place: :func:`tiny_llama` (a 2-layer Llama, 32 wide, 4
query and 2 KV heads, vocabulary 96, eager attention: the same kernels on CPU and GPU) with what a case changes."""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig, LlamaForCausalLM

TINY_LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                  attn_implementation="eager")


def tiny_llama(**config: Any) -> LlamaForCausalLM:
    """A freshly initialised (torch's RNG as it stands) :data:`TINY_LLAMA`, ``config`` overriding its entries."""
    return LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **config}))
