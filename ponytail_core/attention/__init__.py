"""Attention over the paged pool: the entry points (paged.py), one backend per file (CUDA decode,
CUDA prefill gathers, torch flash varlen, the exact torch fallback, chunks without context), their
argument checks, and the transformers attention-backend registration.

Imports: kv, kernels, utils, errors.
"""
