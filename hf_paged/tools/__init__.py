"""The command line's tools: `hf-paged demo`, `hf-paged doctor` and the argument checks they share with `serve`."""
