"""Triton kernels of hf-paged (shipped as `hf_paged.kernels`; import lazily, it imports triton).

Launchers (keyword arguments only):
  * `write_kv_cache`  - scatter new K/V tokens into their slots of the paged pools
  * `paged_attention` - causal attention of ragged, left-padded queries over paged K/V
  * `copy_blocks`     - copy whole blocks in every layer's pools (copy-on-write)
`aot.compile_all` compiles every shipped specialization for a GPU target without a GPU.
"""

from .aot import compile_all
from .copy_blocks import copy_blocks
from .paged_attention import choose_num_splits, paged_attention
from .write_kv_cache import write_kv_cache

__all__ = ["choose_num_splits", "compile_all", "copy_blocks", "paged_attention", "write_kv_cache"]
