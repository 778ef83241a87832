"""Loading the CUDA sources in cuda_kernels/ through CuPy, choosing kernel or torch fallback, launch helpers.

Imports: utils and errors only. Knows nothing of caches or models.
"""
