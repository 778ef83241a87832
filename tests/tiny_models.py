"""Random models for engine tests: fast, and with sharp logits so greedy choices have no near ties."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def sharp_llama(tokenizer, layers: int = 2) -> LlamaForCausalLM:
    """A random Llama (2 layers unless told) sharing `tokenizer` (the default model's), seeded."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # no greedy near-ties on random weights
    return model
