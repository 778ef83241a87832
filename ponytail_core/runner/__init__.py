"""One engine step through a stock transformers model: packed inputs, the step's attention metadata,
CUDA graphs for decode, torch.compile of the decoder layers.

Imports: attention, kv, sampling, utils, errors. Never the engine above it.
"""
