"""The cache layer: `PagedCache` (the `transformers.Cache` adapter), the rows it owns (block tables, lengths,
tokens, digests), how a forward grows them and is committed or rolled back, prefix hits, identical rows, the
K/V read back for other attentions, and `KVPool`, the public pool that hands out caches.
"""
