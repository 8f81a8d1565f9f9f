"""The commands about runs after the fact: ``runs --all``, ``report``, ``compare``, ``export``.

And opening a finished run in the dashboard (``gpuwatch RUN``).

Everything here reads run logs through :mod:`gpuwatch.history`; every text from a log
is printed through :func:`agent.wire.protocol.printable` (no control characters). The
plotting, table and metrics libraries are imported by the command that needs them, with
a clear message when they are not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

from agent.wire.protocol import printable
from agent.wire.runs import list_runs
from gpuwatch import history
from gpuwatch.branches import split_selector, tree_lines
from agent.wire.runlog import BranchTree
from gpuwatch.history import LogFiles, RunSummary
from gpuwatch.units import (counted, human_age, human_bytes, human_number, human_sig, local_time)


def add_run_argument(parser: argparse.ArgumentParser, help: str, *,
                     metavar: str = "RUN", several: bool = False) -> None:
    """The run a subcommand acts on, given as every subcommand takes it: positionally or ``--run``.

    :func:`resolve_run_arguments` merges them into ``args.run``, or ``args.runs`` with
    ``several``."""
    if several:
        parser.add_argument("runs", nargs="*", metavar=metavar, help=help)
        parser.add_argument("--run", dest="run_options", action="append", default=[],
                            metavar="RUN", help="a run (again for a second one)")
    else:
        parser.add_argument("run", nargs="?", metavar=metavar, help=help)
        parser.add_argument("--run", dest="run_option", metavar="RUN",
                            help="the same, as `set` and `tail` take it")


def resolve_run_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace
                          ) -> None:
    """Fold ``--run`` into the positional run (see :func:`add_run_argument`).

    Two different runs given both ways are an error of usage."""
    if getattr(args, "run_option", None):
        if args.run and args.run != args.run_option:
            parser.error(f"two runs given: {args.run!r} and --run {args.run_option!r}")
        args.run = args.run_option
    if getattr(args, "run_options", None):
        args.runs = [*args.runs, *args.run_options]


def add_parsers(commands: argparse._SubParsersAction) -> None:
    """Add ``report``, ``compare`` and ``export`` to the ``gpuwatch`` command line."""
    report = commands.add_parser(
        "report", help="write an HTML report of a run (plots, segments, environment)",
        description="Write one self-contained HTML file: step time and data wait, "
                    "throughput, loss, memory and activation memory over the steps with "
                    "every knob change marked, the table of segments between changes, "
                    "and the run's environment report. Needs matplotlib "
                    "(pip install 'gpuwatch[report]').")
    add_run_argument(report, "run id or unique prefix (live or finished), or a run log; "
                     "RUN@bN: branch N's path (default: the branch taken last)",
                     metavar="RUN|FILE")
    report.add_argument("-o", "--output", type=Path, metavar="FILE", required=True,
                        help="the HTML file to write")
    report.add_argument("--rank", type=int, default=None,
                        help="the rank whose log to use (default: the lowest)")
    report.set_defaults(handler=_report)

    compare = commands.add_parser(
        "compare", help="two runs, or the segments around a knob change, side by side",
        description="Compare two runs (each as a whole), or, with one run, the segments "
                    "before and after each of its knob changes, or, when the run has "
                    "branches (rewind, rollback, recovery), its branches side by side "
                    "(each from its fork on): median step time, samples/s (tokens/s), "
                    "data wait share, memory and the loss trend. RUN@bN names branch N "
                    "of RUN: its path (its parent's steps up to the fork, then its "
                    "own), e.g. `compare RUN@b0 RUN@b1`, or `compare RUN@b1` for the "
                    "knob changes along it.")
    add_run_argument(compare, "one run (its changes or branches) or two runs; RUN@bN: "
                     "branch N of RUN", metavar="RUN|FILE", several=True)
    compare.add_argument("--json", action="store_true", help="print the figures as JSON")
    compare.set_defaults(handler=_compare)

    export = commands.add_parser(
        "export", help="a run as CSV or Parquet tables, or live runs as Prometheus metrics",
        description="--csv/--parquet: write the run's steps (one row per optimizer step, "
                    "knobs as knobs.<name> columns) and events as two tables "
                    "(needs pandas and pyarrow). --prometheus HOST:PORT: serve "
                    "gpuwatch_* metrics of every live run of this user at "
                    "http://HOST:PORT/metrics until Ctrl-C (needs prometheus_client); "
                    "without --token-file every user of this machine (or host that "
                    "reaches HOST) can read them.")
    add_run_argument(export, "run id, unique prefix or run log (for --csv/--parquet)",
                     metavar="RUN|FILE")
    formats = export.add_mutually_exclusive_group(required=True)
    formats.add_argument("--csv", action="store_true",
                         help="write <out>.steps.csv and <out>.events.csv")
    formats.add_argument("--parquet", action="store_true",
                         help="write <out>.steps.parquet and <out>.events.parquet")
    formats.add_argument("--prometheus", metavar="HOST:PORT",
                         help="serve metrics of live runs (port 0: any free port)")
    export.add_argument("-o", "--output", metavar="PREFIX",
                        help="path prefix of the tables (default: the run id)")
    export.add_argument("--rank", type=int, default=None,
                        help="the rank whose log to use (default: the lowest)")
    export.add_argument("--token-file", metavar="PATH",
                        help="with --prometheus: answer only scrapes with the header "
                             "'Authorization: Bearer <the file's token>' (a new random "
                             "token, mode 0600, when PATH does not exist)")
    export.set_defaults(handler=_export)


# --- finding a run's log --------------------------------------------------------------

def _log_or_say(selector: str, rank: int | None, command: str) -> LogFiles | None:
    log = history.find_run_log(selector, rank)
    if log is None:
        print(f"gpuwatch {command}: no run log matches {printable(selector, 200)!r} (see "
              "`gpuwatch runs --all`)", file=sys.stderr)
    return log


def is_written_by_a_live_run(log: LogFiles) -> bool:
    """Whether a live run file of this user names ``log`` as its log."""
    current = log.first
    for info in list_runs():
        try:
            if info.log_path and os.path.samefile(info.log_path, current):
                return True
        except OSError:
            continue
    return False


# --- runs --all -----------------------------------------------------------------------

def print_all_runs(as_json: bool, last: int | None = None) -> int:
    """``gpuwatch runs --all``: print every run, or the ``last`` newest (a table, or JSON).

    Newest first; exit status 0; a line under the table says how many older runs
    ``last`` left out."""
    summaries = history.all_runs()
    older = max(0, len(summaries) - last) if last is not None else 0
    summaries = summaries[:last]
    if as_json:
        print(json.dumps([summary.public() for summary in summaries], indent=2))
        return 0
    if not summaries:
        print("no runs: no run logs and no live runs")
        return 0
    terminal = sys.stdout.isatty()
    width = os.get_terminal_size().columns if terminal else 80
    rows: list[tuple[str, ...]] = [("RUN", "NAME", "STARTED", "DURATION", "STEPS",
                                    "FINAL LOSS", "BEST/S", "CHANGES", "LOG", "STATE")]
    for summary in summaries:
        rows.append((
            summary.run_id, printable(summary.name, 40) or "-",
            local_time(summary.started_at or None, "%Y-%m-%d %H:%M"),
            human_age(summary.duration_s) if summary.duration_s is not None else "-",
            human_number(summary.steps),
            human_sig(summary.final_loss),
            summary.best_rate_text(),
            str(summary.knob_changes), human_bytes(summary.log_bytes),
            _state(summary) + _copied(summary)))
    left_out: list[str] = []
    if terminal:  # (a pipe gets every column, for scripts)
        rows, left_out = fit_columns(rows, width)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    state_chars = width - sum(widths) - 2 * len(widths) if terminal else 0
    for index, row in enumerate(rows):
        state = (textwrap.wrap(row[-1], state_chars) or [""] if state_chars >= STATE_MIN_CHARS
                 else [row[-1]])  # (wrapped at words, under itself)
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  "
              + state[0])
        for more in state[1:]:
            print(" " * (sum(widths) + 2 * len(widths)) + more)
        if index:
            summary = summaries[index - 1]
            if summary.resumed_from is not None:
                print("  " + summary.resumed_text())
            for line in tree_lines(summary.tree, width_chars=width - 2):
                print("  " + line)
    if older:
        print(f"({older:,} older run{'s' if older > 1 else ''} not shown: --last)")
    if left_out:
        print(textwrap.fill(f"(not shown at {width} columns: {', '.join(left_out)}: "
                            "--json)", width))
    return 0


#: The columns of ``runs --all`` a narrow terminal loses first, in order (the run id,
#: name, steps and state stay).
DROPPED_FIRST = ("LOG", "CHANGES", "STARTED", "DURATION", "BEST/S", "FINAL LOSS")
#: What the last column (the state: ``stopped by stop=now after step 991``) keeps of a
#: narrow terminal at least (characters); a longer one wraps at its words, under itself.
STATE_MIN_CHARS = 16


def fit_columns(rows: list[tuple[str, ...]], width_chars: int
                ) -> tuple[list[tuple[str, ...]], list[str]]:
    """``rows`` without the columns a line of ``width_chars`` cannot hold; the headings dropped.

    ``rows``: a heading row first; the last column free-width. Columns go in
    :data:`DROPPED_FIRST`'s order until the others, two spaces apart, leave
    :data:`STATE_MIN_CHARS` for the last. A newcomer's 80-column terminal wrapped every row of the
    130-column table in two."""
    keep = list(range(len(rows[0])))
    dropped: list[str] = []

    def used() -> int:
        return sum(max(len(row[i]) for row in rows) + 2 for i in keep[:-1])

    for heading in DROPPED_FIRST:
        if used() + STATE_MIN_CHARS <= width_chars:
            break
        if heading in rows[0]:
            keep.remove(rows[0].index(heading))
            dropped.append(heading)
    return [tuple(row[i] for i in keep) for row in rows], dropped


def _copied(summary: RunSummary) -> str:
    """``, log PATH`` for a log whose file name names another run than its records
    (a copy), else nothing."""
    path = summary.log_path
    if path is None or Path(path).name.startswith(f"{summary.run_id}.rank"):
        return ""
    return f", log {printable(path)}"


def branch_lines(log_path: str | None) -> list[str]:
    """The branches of a live run's log as :func:`gpuwatch.branches.tree_lines` draws them.

    To the terminal's width (80 when not a terminal); ``[]`` for a run of one branch or
    without a readable log. Reads the summary beside the log and what was written after
    it."""
    log = history.log_at(log_path) if log_path else None
    if log is None:
        return []
    width = os.get_terminal_size().columns if sys.stdout.isatty() else 80
    return tree_lines(history.log_summary(log, live=True)[0].tree, width_chars=width - 2)


def _state(summary: RunSummary) -> str:
    ranks = f" ({len(summary.ranks)} ranks)" if len(summary.ranks) > 1 else ""
    thinned = f", thinned x{summary.thinned:,}" if summary.thinned else ""
    if summary.live:
        return "live" + ranks + thinned
    if summary.ended:
        return printable(summary.ended, 60) + ranks + thinned
    return "no bye (killed?)" + ranks + thinned


# --- report, compare, export ----------------------------------------------------------

def _report(args: argparse.Namespace) -> int:
    try:
        from gpuwatch import report
    except ImportError as exc:
        return _missing("report", "report", exc)
    if not args.run:
        print("gpuwatch report: which run? give RUN or --run RUN (see `gpuwatch runs "
              "--all`)", file=sys.stderr)
        return 2
    selector, branch = split_selector(args.run)
    log = _log_or_say(selector, args.rank, "report")
    if log is None:
        return 1
    try:
        run = history.read_history(log, whole=False, branch=branch)
    except ValueError as exc:
        print(f"gpuwatch report: {exc}", file=sys.stderr)
        return 1
    try:
        report.write_report(run, args.output)
    except OSError as exc:
        print(f"gpuwatch report: cannot write {args.output}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    print(f"wrote {args.output} ({human_bytes(args.output.stat().st_size)}): "
          f"{counted(run.summary.steps, 'step')}, "
          f"{counted(run.knob_changes_total, 'knob change')}"
          + _not_read(run))
    return 0


def _not_read(run: history.RunHistory | history.LogReader) -> str:
    """What a command says of a log it could not read whole, or kept thinned: "" when
    it read every step as logged."""
    notes = []
    if run.thinned:
        notes.append(f"older steps thinned to buckets of {run.thinned:,} (min, max, mean)")
    if run.malformed:
        notes.append(f"{run.malformed:,} damaged records skipped")
    if run.truncated:
        notes.append("the last record was cut (a killed run)")
    notes += [printable(why, 200) for why in run.unreadable]
    return "".join(f"; {note}" for note in notes)


def _compare(args: argparse.Namespace) -> int:
    from gpuwatch import compare

    if not 1 <= len(args.runs) <= 2:
        print("gpuwatch compare: give one run (its knob changes) or two runs",
              file=sys.stderr)
        return 2
    runs = []
    branched = None  # one run given, with branches: them side by side
    for given in args.runs:
        selector, branch = split_selector(given)
        log = _log_or_say(selector, None, "compare")
        if log is None:
            return 1
        if len(args.runs) == 1 and branch is None:
            tree = history.log_summary(log)[0].tree
            if len(tree) > 1:
                branched = history.branch_segments(log, tree)
        try:
            runs.append(history.read_history(log, overview=False,
                                              whole=len(args.runs) == 2, branch=branch))
        except ValueError as exc:
            print(f"gpuwatch compare: {exc}", file=sys.stderr)
            return 1
    columns = (compare.between_runs(*runs) if len(runs) == 2
               else compare.between_branches(branched) if branched
               else compare.around_changes(runs[0]))
    if not columns:
        print(f"gpuwatch compare: run {runs[0].run_id} has no "
              + ("steps" if len(runs) == 2 or not runs[0].summary.steps
                 else "knob change to compare around"), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([column.public() for column in columns], indent=2))
    else:
        print(compare.table(columns))
        note = compare.load_note(columns)
        if note is not None:
            print(f"\n{note}")
    for run in runs:
        notes = _not_read(run) + (
            f"; {run.segments_omitted:,} segments between the first and last "
            f"{history.MAX_SEGMENTS:,} left out" if run.segments_omitted else "")
        if notes:
            print(f"run {run.run_id}: {notes[2:]}", file=sys.stderr)
    return 0


def _export(args: argparse.Namespace) -> int:
    if args.prometheus:
        try:
            from gpuwatch import prometheus
        except ImportError as exc:
            return _missing("export --prometheus", "export", exc)
        return prometheus.serve_forever(args.prometheus, args.token_file)
    try:
        from gpuwatch import tables  # pandas and pyarrow
    except ImportError as exc:
        return _missing("export", "export", exc)
    if not args.run:
        print("gpuwatch export: name the run (RUN or FILE) for --csv or --parquet",
              file=sys.stderr)
        return 2
    log = _log_or_say(args.run, args.rank, "export")
    if log is None:
        return 1
    prefix = Path(args.output or log.run_id)
    try:
        written, reader = tables.write_tables(log, prefix,
                                              "parquet" if args.parquet else "csv")
    except OSError as exc:
        print(f"gpuwatch export: cannot write {prefix}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    for path, rows in written:
        print(f"wrote {path} ({rows:,} rows)")
    if notes := _not_read(reader):
        print(f"gpuwatch export: {log.run_id}: {notes[2:]}", file=sys.stderr)
    return 0


def _missing(command: str, extra: str, exc: ImportError) -> int:
    print(f"gpuwatch {command}: needs {exc.name or exc}, which is not installed: "
          f"pip install 'gpuwatch[{extra}]'", file=sys.stderr)
    return 1


def open_finished(log: LogFiles, *,
                  branch: tuple[BranchTree, int] | None = None) -> int:
    """Open a run log in the dashboard on a timeline (read-only); return the exit status.

    On ``branch``'s path (``(tree, N)``; by default the branch taken last)."""
    from gpuwatch.app import GpuwatchApp
    from gpuwatch.sources.timeline import TimelineSource

    thinned = history.part_thinning(log)
    app = GpuwatchApp(TimelineSource(log, branch=branch), readonly=True, notes=[
        ("info", f"replaying {log.first} on a timeline: left/right step, [ ] knob "
                 "changes, , . events, home/end"),
        *([("info", f"this log reached its disk budget: older steps are kept as buckets "
                    f"of {thinned:,} (mean, min, max); every event and knob change is kept")]
          if thinned else [])])
    app.run()
    return app.return_code or 0
