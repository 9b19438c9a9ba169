"""The README's supported-models table is generated from the test matrix and must not rot."""

from __future__ import annotations

import support_table


def test_committed_table_matches_the_matrix() -> None:
    committed = support_table.current()
    if committed is None:  # README without markers: the table lives in docs/support_table.md
        out = support_table.README.parent / "docs" / "support_table.md"
        assert out.read_text() == f"# Supported models\n\n{support_table.render()}\n"
        return
    assert committed == support_table.render(), "stale README table: run `python tests/support_table.py`"
