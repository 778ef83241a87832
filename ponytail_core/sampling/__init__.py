"""Sampling parameters (the per-request contract) and the batched sampler of one engine step.

Imports: utils, errors.
"""
