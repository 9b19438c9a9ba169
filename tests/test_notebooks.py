"""Executes every notebook (built from notebooks/build.py) with the current interpreter as its kernel."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from notebooks.build import notebooks, execute  # noqa: E402

NOTEBOOK_TIMEOUT_S = 600  # per cell; each notebook takes about a minute on 2 CPU cores


@pytest.mark.slow
@pytest.mark.xdist_group("notebooks")
@pytest.mark.parametrize("name", sorted(notebooks()))
def test_notebook_executes(name, tmp_path):
    nb = notebooks()[name]
    start = time.perf_counter()
    execute(nb, timeout=NOTEBOOK_TIMEOUT_S, cwd=tmp_path)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")
    print(f"{name}: {time.perf_counter() - start:.0f} s")


def test_committed_notebooks_match_build():
    """The committed .ipynb files hold the cells build.py generates (rebuild with `python -m notebooks.build`)."""
    import nbformat

    from notebooks.build import HERE

    for name, nb in notebooks().items():
        committed = nbformat.read(HERE / name, as_version=4)
        assert [c.source for c in committed.cells] == [c.source for c in nb.cells], f"{name} is stale"
        assert any(c.get("outputs") for c in committed.cells if c.cell_type == "code"), f"{name} has no outputs"
