"""The paged KV pool: its config, the block allocator (ids, ref counts, prefix hashes, copy-on-write),
device storage, slot writes and block copies, the elastic pool policy, and capacity estimates.

The only owner of block numbers: layers above ask the pool (`PagedKVCache`) per sequence.
Imports: kernels, utils, errors.
"""
