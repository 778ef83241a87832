"""The transformers plug-in: `PonytailCache` for `model.generate(cache=...)` and `create_cache`.

Imports: attention, kv, utils, errors. Independent of the engine.
"""
