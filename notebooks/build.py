"""Builds the notebooks from the cells below and executes them: `python -m notebooks.build [names...]`.

The notebooks are generated (so they are reviewed as code) and committed with their outputs. They
import only from `hf_paged` (plus torch, transformers, matplotlib). `execute()` runs one with the
current interpreter as its kernel (also used by tests/test_notebooks.py).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
KERNEL_NAME = "hf-paged-python"

SETUP = '''\
import copy
import os
import warnings
warnings.filterwarnings("ignore", message="IProgress not found")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import torch
import matplotlib.pyplot as plt
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig
import hf_paged
from hf_paged.demo_model import DEMO_MODEL_PATH, load_demo_model

torch.manual_seed(0)
if (DEMO_MODEL_PATH / "model.safetensors").is_file():
    model, tokenizer = load_demo_model(attn_implementation="paged")
    ref_model, _ = load_demo_model(attn_implementation="sdpa")
else:  # the demo model is still being trained: a random Llama of its shape stands in
    tokenizer = None
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=320, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    ref_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in ref_model.parameters():
            p.mul_(3.0)  # peaked logits
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="paged").eval()
    model.load_state_dict(ref_model.state_dict())
for m in (model, ref_model):
    m.generation_config.pad_token_id = 0
assert model.config._attn_implementation == "paged" and ref_model.config._attn_implementation == "sdpa"


def encode(texts):
    """Left-padded `(input_ids, attention_mask)` for a list of strings (random ids without a tokenizer)."""
    if tokenizer is not None:
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        return batch.input_ids, batch.attention_mask
    lengths = [max(2, len(t) // 3) for t in texts]
    ids = torch.zeros(len(texts), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(1, 4096, (n,), generator=torch.Generator().manual_seed(row))
        mask[row, -n:] = 1
    return ids, mask


def decode(ids):
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else str(ids.tolist())


print(type(model).__name__, f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters,",
      "demo model" if tokenizer is not None else "random weights (demo model not trained yet)")
'''

DRAW_TABLES = '''\
def draw_tables(cache, title, snapshot=None, ax=None):
    """Each row of the cache as its block table: one box per block, labelled with the block id,
    shaded by how many of its slots hold tokens; a block shared by several rows is outlined in red.
    `snapshot`: `(tables, seq_lens)` recorded earlier, drawn instead of the cache's current rows."""
    tables, seq_lens = snapshot or (cache.block_tables(), cache.seq_lens)
    bs = cache.pool.block_size
    counts = {}
    for table in tables:
        for block in table:
            counts[block] = counts.get(block, 0) + 1
    ax = ax or plt.subplots(figsize=(min(14, 2 + 0.7 * max(map(len, tables))), 0.6 + 0.55 * len(tables)))[1]
    for row, (table, n) in enumerate(zip(tables, seq_lens)):
        for j, block in enumerate(table):
            filled = min(bs, n - j * bs)
            ax.add_patch(plt.Rectangle((j, row), 0.92, 0.8, facecolor="#dde6f5", edgecolor="none"))
            ax.add_patch(plt.Rectangle((j, row), 0.92 * filled / bs, 0.8, facecolor="#4c78a8", edgecolor="none"))
            shared = counts[block] > 1
            ax.add_patch(plt.Rectangle((j, row), 0.92, 0.8, fill=False, lw=2 if shared else 0.5,
                                       edgecolor="red" if shared else "black"))
            ax.text(j + 0.46, row + 0.4, str(block), ha="center", va="center", fontsize=8, color="white" if filled == bs else "black")
        ax.text(-0.2, row + 0.4, f"row {row}: {n} tokens", ha="right", va="center", fontsize=8)
    ax.set_xlim(-3, max(map(len, tables)) + 0.2)
    ax.set_ylim(len(tables), -0.2)
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    return ax
'''


def _nb(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for kind, text in cells:
        cell = nbformat.v4.new_markdown_cell(text) if kind == "md" else nbformat.v4.new_code_cell(text)
        nb.cells.append(cell)
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i}"  # stable ids: rebuilding gives clean diffs
    return nb


def notebooks() -> dict[str, nbformat.NotebookNode]:
    from .cells import engine, paging, quickstart, sharing  # noqa: PLC0415

    return {
        "01_quickstart.ipynb": _nb(quickstart(SETUP)),
        "02_how_paging_works.ipynb": _nb(paging(SETUP, DRAW_TABLES)),
        "03_sharing.ipynb": _nb(sharing(SETUP, DRAW_TABLES)),
        "04_engine.ipynb": _nb(engine(SETUP)),
    }


def _kernel_dir() -> str:
    """A kernelspec that runs this very interpreter (so the venv's packages are the ones used)."""
    root = Path(tempfile.mkdtemp(prefix="hf_paged_kernels_"))
    spec = root / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "hf-paged", "language": "python"}))
    return str(root)


def execute(nb: nbformat.NotebookNode, timeout: int = 600, cwd: Path = HERE) -> nbformat.NotebookNode:
    """Executes `nb` in place with the current interpreter; raises on the first failing cell."""
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [_kernel_dir(), os.environ.get("JUPYTER_PATH")]))
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    client = NotebookClient(nb, timeout=timeout, kernel_name=KERNEL_NAME, resources={"metadata": {"path": str(cwd)}})
    client.execute()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def main(argv: list[str]) -> None:
    for name, nb in notebooks().items():
        if argv and not any(a in name for a in argv):
            continue
        start = time.perf_counter()
        execute(nb)
        nbformat.write(nb, HERE / name)
        print(f"{name}: executed in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
