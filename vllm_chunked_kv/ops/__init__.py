"""Attention math for CHUNKED_KV: the reference (ground truth) and, later, kernels.

Importing this package imports nothing heavy; import the submodules directly.
"""
