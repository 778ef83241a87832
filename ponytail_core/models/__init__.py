"""Loading models and tokenizers: the embedded default, local checkpoints and GGUF files. Load only.

Imports: kv (device resolution), utils, errors.
"""
