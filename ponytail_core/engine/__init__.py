"""The continuous-batching engine: requests, the token-budget scheduler, the step loop, detokenizing.

Imports: runner, sampling, kv, utils, errors.
"""
