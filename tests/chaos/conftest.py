"""Collects the chaos scenarios' outcomes and prints them as one table at the end of the run."""

from __future__ import annotations

import json

from tests.chaos.harness import REPORT


def pytest_configure(config):
    """One table per run: forget the rows of earlier runs (once, in the process that prints the table,
    not in each pytest-xdist worker that adds rows)."""
    if not hasattr(config, "workerinput"):
        REPORT.unlink(missing_ok=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not REPORT.exists():
        return
    rows = [json.loads(line) for line in REPORT.read_text().splitlines() if line.strip()]
    if not rows:
        return
    tr = terminalreporter
    tr.section("chaos table")
    head = (
        f"{'fault':<40} {'requests':>8} {'completed':>9} {'errored':>7} {'lost':>4} {'dup tokens':>10} "
        f"{'wrong':>5} {'resumed':>7} {'recovery s':>10}"
    )
    tr.write_line(head)
    for r in rows:
        tr.write_line(
            f"{r['fault']:<40} {r['requests']:>8} {r['completed']:>9} {r['errored']:>7} {r['lost']:>4} "
            f"{r['duplicated']:>10} {r['wrong']:>5} {r.get('resumed', 0):>7} {r['recovery_s']:>10}"
        )
