"""The implementations of a step's three ops (`write_raw`, `write_chunks`,
`attend`): PyTorch (`compressed`), C++ for the CPU (`cpu_ext`), CUDA
(`cuda_ext`), Triton (`triton_attention`, `triton_pool`). Each imports the
plans and `shared` (the helpers they call alike), never another kernel module;
each is tested against `ops/reference.py`.
"""
