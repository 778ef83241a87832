"""CUDA sources of Ponytail's kernels, shipped as package data and compiled by CuPy at first use."""
