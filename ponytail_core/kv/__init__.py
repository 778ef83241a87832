"""The paged KV pool: its config, the block allocator (ids, ref counts, prefix hashes, copy-on-write),
device storage and its page view (kernels with a page table), slot writes and block copies, the
elastic pool policy, and capacity estimates.

The only owner of block numbers: layers above ask the pool (`PagedKVCache`) per sequence.
Imports: kernels, utils, errors.
"""
