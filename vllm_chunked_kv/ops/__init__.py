"""Attention math for CHUNKED_KV: the reference (ground truth) and the
kernels checked against it (PyTorch, C++ for the CPU, Triton, CUDA), `dispatch` picks one.

Importing this package imports nothing heavy; import the submodules directly.
"""
