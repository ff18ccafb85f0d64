"""Live campaign progress: a rich panel on a terminal, plain periodic lines otherwise."""

from __future__ import annotations

import time
from typing import Any, TextIO

from fuzz.campaign.engine import Report

PLAIN_INTERVAL = 10.0  # seconds between lines when not on a terminal


class Progress:
    def __init__(self, out: TextIO, *, max_time: float, max_cases: int) -> None:
        self.out = out
        self.max_time = max_time
        self.max_cases = max_cases
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.last_line = 0.0
        self.live: Any = None
        if self.tty:
            from rich.console import Console
            from rich.live import Live

            self.live = Live(console=Console(file=out), refresh_per_second=4, transient=True)
            self.live.start()

    def __call__(self, report: Report) -> None:
        if self.live is not None:
            self.live.update(self._table(report))
        elif time.monotonic() - self.last_line >= PLAIN_INTERVAL:
            self.last_line = time.monotonic()
            print(self.line(report), file=self.out, flush=True)

    def line(self, report: Report) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(report.findings_by_kind().items())) or "none"
        left = max(0.0, self.max_time - report.elapsed_s)
        flaky = f" ({len(report.flaky)} flaky or unconfirmed)" if report.flaky else ""
        return (f"kvfuzz: {report.cases} cases, {report.cases_per_s:.0f}/s, findings: {kinds}{flaky}, "
                f"{report.elapsed_s:.0f} s elapsed, {left:.0f} s left, {report.restarts} restarts" + checks_line(report))

    def _table(self, report: Report) -> Any:
        from rich.table import Table

        table = Table(title="kvfuzz campaign", show_header=False)
        left = max(0.0, self.max_time - report.elapsed_s)
        table.add_row("cases", f"{report.cases:,}" + (f" / {self.max_cases:,}" if self.max_cases < 10**12 else ""))
        table.add_row("cases/s", f"{report.cases_per_s:,.0f}")
        table.add_row("elapsed / left", f"{report.elapsed_s:.0f} s / {left:.0f} s")
        table.add_row("verdicts", ", ".join(f"{k} {v:,}" for k, v in sorted(report.verdicts.items())))
        table.add_row("new findings", ", ".join(f"{k} {n}" for k, n in sorted(report.findings_by_kind().items())) or "none")
        if report.flaky:
            table.add_row("flaky / unconfirmed", str(len(report.flaky)))
        for row in report.check_rows():
            table.add_row(row["check"], check_cell(row))
        table.add_row("workers / restarts", f"{report.workers} / {report.restarts}")
        return table

    def close(self, report: Report) -> None:
        if self.live is not None:
            self.live.stop()
            from rich.console import Console
            from rich.table import Table

            table = Table(title=f"kvfuzz: {report.stop_reason}")
            for column in ("kind", "signature", "latent", "case file"):
                table.add_column(column)
            for record in report.findings:
                table.add_row(record.finding.kind, record.finding.signature, "yes" if record.finding.latent else "",
                              str(record.path) if record.path is not None else "not written")
            Console(file=self.out).print(self._table(report))
            if report.findings:
                Console(file=self.out).print(table)


def check_cell(row: dict[str, Any]) -> str:
    """One deeper check's work: keys checked of keys seen, verdicts reused, time share, findings (and how many of them were
    a bug new to their worker)."""
    return (f"{row['keys_checked']:,}/{row['keys_seen']:,} keys checked, {row['reused']:,} reused, "
            f"{row['time_share']:.0%} of the time, {row['findings']:,} finding key(s), {row['new_findings']:,} new")


def checks_line(report: Report) -> str:
    rows = report.check_rows()
    if not rows:
        return ""
    return "\n  checks: " + "; ".join(f"{row['check']} {check_cell(row)}" for row in rows)
