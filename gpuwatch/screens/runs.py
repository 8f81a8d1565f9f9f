"""The ``r`` screen: every run of this user, live and finished, to open one in the dashboard.

The runs of ``gpuwatch runs --all``."""

from __future__ import annotations


from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from agent.wire.protocol import printable
from gpuwatch.branches import tree_lines
from gpuwatch.history import RunSummary, all_runs
from gpuwatch.units import (counted, human_age, human_bytes, human_number, human_sig, local_time)

#: The table's columns, what tells runs apart first: it shows those that fit whole (at
#: 80 columns, up to the start time with a demo's 16-character name), → scrolls to the
#: others.
COLUMNS = ("run", "name", "steps", "started", "duration", "final loss", "best/s",
           "changes", "branches", "log", "state")


def _row(summary: RunSummary) -> tuple[str, ...]:
    state = ("live" if summary.live else printable(summary.ended, 40) if summary.ended
             else "no bye (killed?)")
    return (summary.run_id, printable(summary.name, 40) or "-", human_number(summary.steps),
            local_time(summary.started_at or None, "%Y-%m-%d %H:%M"),
            human_age(summary.duration_s) if summary.duration_s is not None else "-",
            human_sig(summary.final_loss),
            summary.best_rate_text(),
            str(summary.knob_changes), str(len(summary.tree) + summary.tree.omitted),
            human_bytes(summary.log_bytes), state)


class RunsScreen(ModalScreen[RunSummary | None]):
    """The runs in a table, newest first, and under it the branches of the run under the cursor.

    The table is read in a thread (logs can be large); the branches are a tree of segments,
    when it has several, after the run a resumed run continues. Enter opens the run under
    the cursor (dismissed with its summary), escape closes."""

    BINDINGS = [
        Binding("escape,q", "dismiss(None)", "close", id="runs.close"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.summaries: list[RunSummary] = []
        #: each column's width (cells, padding included), once the runs are read
        self._widths: list[int] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="runs") as box:
            box.border_title = "runs: enter opens one, escape closes"
            yield Static(Content.styled("reading the run logs ...", "$text-muted"),
                         id="runs-status")
            yield DataTable(id="runs-table", cursor_type="row", zebra_stripes=True)
            yield Static("", id="runs-branches")

    def on_mount(self) -> None:
        self._load()

    @work(thread=True, exclusive=True)
    def _load(self) -> None:
        try:
            summaries = all_runs()
        except OSError as exc:  # the run directory cannot be read
            self.app.call_from_thread(self._failed, str(exc))
            return
        self.app.call_from_thread(self._show, summaries)

    def _failed(self, why: str) -> None:
        self.query_one("#runs-status", Static).update(
            Content.styled(f"cannot list the runs: {printable(why, 200)}", "$error"))

    def _show(self, summaries: list[RunSummary]) -> None:
        self.summaries = summaries
        table = self.query_one(DataTable)
        table.add_columns(*COLUMNS)
        rows = [_row(summary) for summary in summaries]
        for index, row in enumerate(rows):
            table.add_row(*row, key=str(index))
        self._widths = [max(Content(text).cell_length for text in texts)
                        + 2 * table.cell_padding for texts in zip(COLUMNS, *rows)]
        self._fit_columns()
        table.focus()

    def on_resize(self) -> None:
        """Fit the table's columns to the new width."""
        self._fit_columns()

    def _fit_columns(self) -> None:
        """End the table after its last column that fits whole (a column cut at the edge
        read as its heading's start, ``durati``); the status line says how many more
        columns → scrolls to. Costs O(columns)."""
        if not self._widths:  # not read yet, or it could not be
            return
        table = self.query_one(DataTable)
        room = (self.query_one("#runs").content_region.width
                - table.styles.scrollbar_size_vertical)
        shown = width = 0
        for column_width in self._widths:
            if width + column_width > room:
                break
            width += column_width
            shown += 1
        hidden = len(self._widths) - shown
        scrolls = len(self.summaries) + table.header_height > table.size.height
        table.styles.max_width = (width + (table.styles.scrollbar_size_vertical if scrolls
                                           else 0)) if hidden and shown else None
        status = (counted(len(self.summaries), "run") if self.summaries
                  else "no runs: no run logs and no live runs")
        if self.summaries and hidden:
            status += f"; {counted(hidden, 'more column')}: →"
        self.query_one("#runs-status", Static).update(Content.styled(status, "$text-muted"))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """Show the run under the cursor: the run it continues, if resumed, and its branches."""
        key = event.row_key.value
        if key is None or not self.summaries:
            return
        summary = self.summaries[int(key)]
        lines = tree_lines(summary.tree, width_chars=max(20, self.size.width - 4),
                           max_lines=12)
        if summary.resumed_from is not None:
            lines.insert(0, summary.resumed_text())
        self.query_one("#runs-branches", Static).update(Content("\n".join(lines)))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Open the chosen run."""
        key = event.row_key.value
        assert key is not None  # every row was added with a key: its index
        self.dismiss(self.summaries[int(key)])
