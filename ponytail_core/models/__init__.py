"""Loading models and tokenizers: the embedded default, local checkpoints and GGUF files; a
conversation through a tokenizer's chat template (chat_template.py).

Imports: kv (device resolution), utils, errors.
"""
