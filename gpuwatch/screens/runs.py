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
#: 80 columns, up to the start time with a demo's 16-character name); the run id stays
#: first, and → / ← move the others by one column.
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
        Binding("right", "columns(1)", "next column", id="runs.right", priority=True),
        Binding("left", "columns(-1)", "previous column", id="runs.left", priority=True),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.summaries: list[RunSummary] = []
        #: each column's width (cells, padding included), once the runs are read
        self._widths: list[int] = []
        #: the first column shown after the run id (which always is)
        self._first = 1
        #: the column after the last one shown
        self._end = len(COLUMNS)

    def compose(self) -> ComposeResult:
        with Vertical(id="runs") as box:
            box.border_title = "runs: enter opens one, escape closes"
            yield Static(Content.styled("reading the run logs ...", "$text-muted"),
                         id="runs-status")
            yield DataTable(id="runs-table", cursor_type="row", zebra_stripes=True,
                            fixed_columns=1)
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
        """Show the run id and, from :attr:`_first`, the columns that fit whole after it
        (a column cut at the edge read as its heading's start, ``durati``); the status line
        says which are shown and that → / ← move them. Costs O(columns)."""
        if not self._widths:  # not read yet, or it could not be
            return
        table = self.query_one(DataTable)
        room = (self.query_one("#runs").content_region.width
                - table.styles.scrollbar_size_vertical)
        width, end = self._widths[0], self._first
        while end < len(self._widths) and width + self._widths[end] <= room:
            width += self._widths[end]
            end += 1
        self._end = end
        cut = self._first > 1 or end < len(self._widths)
        scrolls = len(self.summaries) + table.header_height > table.size.height
        table.styles.max_width = (width + (table.styles.scrollbar_size_vertical if scrolls
                                           else 0)) if cut and end > self._first else None
        # (after the new width's layout: the scroll's bound comes from it)
        self.call_after_refresh(table.scroll_to, x=sum(self._widths[1:self._first]),
                                animate=False)
        status = (counted(len(self.summaries), "run") if self.summaries
                  else "no runs: no run logs and no live runs")
        if self.summaries and cut:
            arrows = ("←" if self._first > 1 else "") + ("→" if end < len(self._widths)
                                                          else "")
            shown = (f"up to {COLUMNS[end - 1]!r}" if self._first == 1 else
                     f"run, {COLUMNS[self._first]!r} to {COLUMNS[end - 1]!r}")
            status += (f"; {1 + end - self._first} of {len(COLUMNS)} columns, {shown}; "
                       f"{arrows} for more" if end > self._first
                       else f"; column {COLUMNS[self._first]!r} is wider than the screen")
        self.query_one("#runs-status", Static).update(Content.styled(status, "$text-muted"))

    def action_columns(self, step: int) -> None:
        """Move the columns after the run id by ``step`` (→ +1, ← -1) while some are hidden."""
        if step > 0 and self._end >= len(self._widths):
            return
        self._first = min(max(1, self._first + step), len(COLUMNS) - 1)
        self._fit_columns()

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
