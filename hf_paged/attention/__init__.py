"""The attention layer: the `"paged"` attention function and mask registered with transformers, the per-forward
plan every layer reads, the hand-off of a layer's K/V from `update()`, and the two paths that write and attend
over paged blocks (Triton kernels on a GPU, PyTorch elsewhere) with the choice between them. It reads the memory
layer's tensors; it knows no cache.
"""
