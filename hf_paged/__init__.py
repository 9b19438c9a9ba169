"""hf-paged: PagedAttention for stock transformers generate()."""
