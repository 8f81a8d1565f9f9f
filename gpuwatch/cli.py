"""The ``gpuwatch`` command: the dashboard, and scriptable commands around it.

``gpuwatch [RUN]`` opens the dashboard (a finished run on a timeline); ``runs``,
``set``, ``tune``, ``tail``, ``replay``, ``demo``, ``doctor``, and for runs after the
fact ``report``, ``compare`` and ``export`` (:mod:`gpuwatch.history_commands`) are
subcommands. Textual is imported only by the commands that
draw a screen, so the scriptable ones start fast.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from collections import deque
from typing import Any, Callable, Sequence

import zmq

from agent.wire import protocol
from agent.wire.protocol import printable
from agent.wire.runs import RunInfo, alive, find_run, list_runs, node_list, run_dir, run_ranks
from gpuwatch import history, history_commands, multinode_commands
from gpuwatch.state import RecentSteps, RunState, recent_steps
from gpuwatch.units import counted, human_age, human_ms, human_rate, human_sig, knob_text

SUBCOMMANDS = ("attach", "runs", "set", "tune", "tail", "replay", "demo", "doctor",
               "report", "compare", "export", "nodes", "secret")
#: How long ``gpuwatch demo`` waits for the training child to write its run file (s).
DEMO_START_TIMEOUT_S = 60.0
#: Seconds between the one-line progress reports of ``gpuwatch demo --no-ui``.
PROGRESS_EVERY_S = 5.0
#: How long the demo child gets to end after SIGINT before it is killed (s).
DEMO_STOP_TIMEOUT_S = 20.0
#: The signals that end a command as Ctrl-C does, its child process with it: SIGTERM
#: (what ``timeout``, job schedulers and systemd send) and SIGHUP (a closed terminal).
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
#: The ending signal this command received, if one came: its child is stopped with the
#: same one (its run log and ``bye`` say SIGTERM, not the SIGINT of a Ctrl-C).
_ended_by: signal.Signals | None = None
#: ``gpuwatch tail ENDPOINT`` (no run file to check) gives up after this long with
#: nothing heard (s); a run sends a heartbeat a second.
TAIL_SILENCE_S = 10.0
#: ``gpuwatch tail RUN`` and ``gpuwatch tune`` check whether the run's process lives
#: after this long with nothing heard (s).
TAIL_CHECK_AFTER_S = 3.0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gpuwatch`` command line; returns the exit status.

    Exit status: 0 success; 1 no live run, a rejected or unanswered command, a failed
    child, a run directory that is refused (another user's, a symbolic link, too open)
    or another error of the system (said in one line, no traceback); 2 bad usage (from
    argparse).
    """
    parser = _parser()
    args = parser.parse_args(_with_default_command(
        list(sys.argv[1:] if argv is None else argv)))
    history_commands.resolve_run_arguments(parser, args)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `gpuwatch runs --all | head`: the reader has enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (exit's flush)
        return 0
    except OSError as exc:  # UnsafeDirectoryError among them: a squatted run directory
        print(f"gpuwatch: {printable(str(exc))}", file=sys.stderr)
        return 1


def _with_default_command(argv: list[str]) -> list[str]:
    """``gpuwatch [RUN] [--readonly]`` means ``gpuwatch attach [RUN] [--readonly]``."""
    if argv and (argv[0] in SUBCOMMANDS or argv[0] in ("-h", "--help", "--version")):
        return argv
    return ["attach", *argv]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuwatch",
        usage="gpuwatch [RUN] [--readonly] [--quick-keys]\n       gpuwatch COMMAND ...",
        description="Watch and tune a live PyTorch training run from the terminal. "
                    "Without a subcommand: open the dashboard on the newest live run "
                    "(its options: gpuwatch attach --help).",
        epilog="Start a run with `gpuwatch demo`, or `agent.attach(trainer)` in a script.")
    parser.add_argument("--version", action="version", version=f"gpuwatch {_version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", prog="gpuwatch")

    attach = commands.add_parser(
        "attach", help="open the dashboard (the default command)",
        description="Open the dashboard on a live run, or on a finished run's log on "
                    "a timeline (see `gpuwatch runs --all`).")
    history_commands.add_run_argument(
        attach, "run id, unique prefix, or endpoint (default: the newest live run)")
    attach.add_argument("--readonly", action="store_true",
                        help="watch only: keys send no commands")
    attach.add_argument("--quick-keys", action="store_true",
                        help="keys that change the run send at once, without asking "
                             "(also GPUWATCH_QUICK_KEYS=1)")
    attach.set_defaults(handler=_attach)

    runs = commands.add_parser("runs", help="list live runs (--all: finished ones too)",
                               description="List the live runs of this user; with --all "
                                           "every run with a run log as well.")
    runs.add_argument("--all", action="store_true",
                      help="live and finished runs: name, start, duration, steps, final "
                           "loss, best throughput sustained (a batch's median), knob "
                           "changes, log size")
    runs.add_argument("--last", type=int, metavar="N",
                      help="with --all: the N newest runs only")
    runs.add_argument("--json", action="store_true", help="print a JSON list")
    runs.set_defaults(handler=_runs)

    set_ = commands.add_parser(
        "set", help="set a knob of a run: KNOB=VALUE",
        description="Send one command; the run validates it and applies it at a step "
                    "(on every rank, at one step). Exit status: 0 accepted, 1 refused or "
                    "not answered, 3 refused with the ranks left different (set it again).")
    set_.add_argument("assignment", metavar="KNOB=VALUE",
                      help="e.g. precision=bf16 or accum_steps=4 (the run checks the value)")
    set_.add_argument("--run", help="run id, prefix or endpoint (default: the newest)")
    set_.add_argument("--timeout", type=float, default=3.0, metavar="S",
                      help="seconds to wait for the reply (default 3)")
    set_.add_argument("--checkpoint", action="store_true",
                      help="save a checkpoint at the same step boundary first (before a "
                           "risky change: precision=fp16 --checkpoint); the change is not "
                           "made if the save fails. `set checkpoint=now` saves one alone")
    set_.set_defaults(handler=_set)

    tune = commands.add_parser(
        "tune", help="let the run find its fastest safe configuration",
        description="Start the in-run search: the run tries settings one at a time at "
                    "optimizer-step boundaries, measures each against the best so far, "
                    "keeps what is faster beyond noise and reverts the rest. It runs in "
                    "the training process: stopping this command (or killing it) does "
                    "not stop it. Prints each candidate until the search ends. Exit "
                    "status: 0 the search ran (or stopped), 1 refused or no answer.")
    tune.add_argument("--run", help="run id, prefix or endpoint (default: the newest)")
    tune.add_argument("--knobs", metavar="A,B",
                      help="knobs to search (default: every speed setting the run has: "
                           "cpu_threads, num_workers, prefetch_factor, pin_memory)")
    tune.add_argument("--budget-steps", type=int, metavar="N",
                      help="optimizer steps the search may spend (default 600)")
    tune.add_argument("--allow", metavar="A,B",
                      help="knobs that change numerics or memory, searched only when "
                           "named here: precision, accum_steps, micro_batch_size, kernels, "
                           "checkpointing")
    tune.add_argument("--stop", action="store_true",
                      help="stop the running search; the best configuration so far stays")
    tune.add_argument("--no-follow", action="store_true",
                      help="start it and exit (follow it in the dashboard or the run log)")
    tune.add_argument("--timeout", type=float, default=3.0, metavar="S",
                      help="seconds to wait for the reply (default 3)")
    tune.set_defaults(handler=_tune)

    tail = commands.add_parser(
        "tail", help="print a run's records as they come, or a run log's",
        description="Print a live run's records until the run ends, Ctrl-C, or --count "
                    "records (exit status 1 when the run's process dies without saying "
                    "bye, or an endpoint says nothing for 10 s). Given a run-log file "
                    "(.runlog, or an earlier version's .jsonl), or the id of a run that "
                    "is no longer live, print its log's records (a step a record) and "
                    "exit, or with --follow go on printing what is appended.")
    tail.add_argument("target", nargs="?", metavar="RUN|FILE",
                      help="run id, prefix or endpoint (default: the newest), or a run "
                           "log file (a finished run's id: its log)")
    tail.add_argument("--run", help="run id, prefix or endpoint (default: the newest)")
    tail.add_argument("--json", action="store_true",
                      help="every record as one JSON object per line")
    tail.add_argument("--count", type=int, metavar="N", help="stop after N records")
    tail.add_argument("--last", "-n", type=int, metavar="N",
                      help="the last N records of the run's log, as tail -n, then (a live "
                           "run, or with --follow) what comes after")
    tail.add_argument("--nodes", action="store_true",
                      help="a multi-node run: the other nodes' summaries (every rank's "
                           "step and step time, once a second) and events too, through "
                           "their relays (needs the job secret)")
    tail.add_argument("--follow", "-f", action="store_true",
                      help="with a FILE: keep printing lines appended to it until the "
                           "run's bye (a live run is always followed)")
    tail.set_defaults(handler=_tail)

    replay = commands.add_parser(
        "replay", help="open the dashboard on a run log (read-only)",
        description="Open the dashboard on a run log (the .runlog file of a finished "
                    "or running run; see `gpuwatch runs --json` for live runs' "
                    "log_path): a finished run's on a timeline (left/right, [ ], , ., "
                    "home/end move it), a live run's followed while it grows. Keys send "
                    "nothing. A run with branches (rewind, rollback, recovery) plays the "
                    "branch taken last: its parent's steps up to the fork, then its own; "
                    "--branch N plays branch N's path.")
    replay.add_argument("file", metavar="FILE",
                        help="the run log (.runlog, or an earlier version's .jsonl)")
    replay.add_argument("--branch", type=int, default=None, metavar="N",
                        help="play branch N's path (see `gpuwatch runs --all`)")
    replay.set_defaults(handler=_replay)

    demo = commands.add_parser(
        "demo", help="start a demo training job and watch it",
        description="Start `python -m agent.demo` as a child process and open the "
                    "dashboard on it; q stops both.")
    demo.add_argument("--model", choices=("transformer", "cnn"), default="transformer",
                      help="transformer: a character-level transformer (0.42 M "
                           "parameters) on Python's documentation text (the default); "
                           "cnn: a small CNN on scikit-learn's handwritten digits")
    demo.add_argument("--max-steps", type=int, metavar="N", help="stop after N steps")
    demo.add_argument("--device", metavar="NAME",
                      help="where the model trains: cpu, cuda, cuda:1... (default: the "
                           "first CUDA device where there is one, else cpu)")
    demo.add_argument("--compile-backend", default="inductor", metavar="NAME",
                      help="torch.compile backend used when `k` picks compile (inductor; "
                           "aot_eager compiles in about a second on a small CPU)")
    demo.add_argument("--resume", metavar="CHECKPOINT",
                      help="continue from a checkpoint the demo saved (`s` in the "
                           "dashboard, or `gpuwatch set checkpoint=now`)")
    demo.add_argument("--checkpoint-dir", metavar="DIR",
                      help="where `s` / checkpoint=now saves (default: the run's "
                           "directory under the run logs' checkpoints/)")
    demo.add_argument("--no-ui", action="store_true",
                      help="run the job in this terminal; watch it from another")
    demo.add_argument("--readonly", action="store_true",
                      help="watch only: keys send no commands")
    demo.add_argument("--quick-keys", action="store_true",
                      help="keys that change the run send at once, without asking "
                           "(also GPUWATCH_QUICK_KEYS=1)")
    demo.set_defaults(handler=_demo)

    doctor = commands.add_parser(
        "doctor", help="report the PyTorch/GPU environment",
        description="Run the environment report of gpuopt in a child process.")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.set_defaults(handler=_doctor)
    history_commands.add_parsers(commands)
    multinode_commands.add_parsers(commands)
    return parser


def _version() -> str:
    """The installed distribution's version (``unknown`` when run from a bare tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpuwatch")
    except PackageNotFoundError:
        return "unknown"


def _no_run(selector: str | None) -> int:
    """Say how to get a run to watch; the exit status for "no run"."""
    from gpuwatch.client import no_run_text

    print(no_run_text(selector), file=sys.stderr)
    return 1


def _attach(args: argparse.Namespace) -> int:
    info = find_run(args.run)
    if info is None and args.run:
        log = history.find_run_log(args.run)
        if log is not None:
            return history_commands.open_finished(log)
    if info is None:
        return _no_run(args.run)
    newest = _newest_of(info) if args.run is None else None
    notes = [("warning", f"{newest}: `gpuwatch runs` lists them, `gpuwatch RUN` opens "
                         "another")] if newest else []
    return _watch(info, readonly=args.readonly, quick_keys=args.quick_keys, notes=notes)


def _newest_of(info: RunInfo) -> str | None:
    """``run ID (NAME), the newest of N live runs`` when others are live, else None: what
    a command that picked the newest run (no run given) says, so a person sees whose job
    it shows or changes."""
    others = {run.run_id for run in list_runs()} - {info.run_id}
    if not others:
        return None
    return (f"run {printable(info.run_id)} ({printable(info.name, 60)}), the newest of "
            f"{len(others) + 1} live runs")


def _watch(info: RunInfo, *, readonly: bool, quick_keys: bool,
           notes: Sequence[tuple[str, str]] = ()) -> int:
    from gpuwatch.app import GpuwatchApp
    from gpuwatch.sources.live import LiveSource

    app = GpuwatchApp(LiveSource(info), readonly=readonly,
                      quick_keys=quick_keys or None,  # else $GPUWATCH_QUICK_KEYS
                      notes=notes)
    _end_on_signals(app.end)  # the terminal put back, as on q
    try:
        app.run()
    except OSError as exc:
        if _ended_by is not signal.SIGHUP or exc.errno != errno.EIO:
            raise
        # its terminal closed: Textual's last words (an error it met on the way out) had
        # nowhere to go; the run and its files are dealt with by the caller as on q
        return 128 + signal.SIGHUP
    return app.return_code or 0


def _runs(args: argparse.Namespace) -> int:
    if args.last is not None and (not args.all or args.last < 1):
        print("gpuwatch runs: --last N goes with --all, N >= 1", file=sys.stderr)
        return 2
    if args.all:
        return history_commands.print_all_runs(args.json, args.last)
    runs = list_runs()
    if args.json:
        print(json.dumps([info.public() for info in runs], indent=2))
        return 0
    if not runs:
        print(f"no live runs (run files in {run_dir()})")
        return 0
    now = time.time()
    rows = [("RUN", "RANK", "PID", "NAME", "AGE", "ENDPOINT")] + [
        (printable(info.run_id, protocol.MAX_NAME_CHARS), f"{info.rank}/{info.world_size}",
         str(info.pid), printable(info.name or "-", protocol.MAX_NAME_CHARS),
         human_age(now - info.started_at), printable(info.pub_endpoint)) for info in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  "
              + row[-1])
        if index:
            for line in history_commands.branch_lines(runs[index - 1].log_path):
                print("  " + line)
    for run_id in dict.fromkeys(info.run_id for info in runs if info.nnodes > 1):
        here = [info for info in runs if info.run_id == run_id]
        known = node_list(run_id)
        print(f"{printable(run_id, protocol.MAX_NAME_CHARS)}: node {here[0].node} of "
              f"{here[0].nnodes}; the job's store names "
              + (", ".join(f"node {entry['node']} ({printable(entry['host'], 40)}, ranks "
                           f"{min(entry['ranks'], default='-')}-"
                           f"{max(entry['ranks'], default='-')})" for entry in known)
                 or "no node yet")
              + "; `gpuwatch nodes` shows every rank")
    return 0


def _set(args: argparse.Namespace) -> int:
    from gpuwatch.client import parse_assignment, reply_text, send_command

    try:
        knob, value = parse_assignment(args.assignment)
    except ValueError as exc:
        print(f"gpuwatch set: {exc}", file=sys.stderr)
        return 2
    info = find_run(args.run)
    if info is None:
        return _no_run(args.run)
    newest = _newest_of(info) if args.run is None else None
    if newest:  # say which, before it changes anything
        print(f"gpuwatch set: to {newest} (--run RUN picks another)", file=sys.stderr)
    reply = send_command(info, knob, value, timeout_s=args.timeout,
                         checkpoint=args.checkpoint)
    print(printable(reply_text(knob, value, reply), newlines=True),  # its warning line
          file=sys.stdout if reply.get("ok") else sys.stderr)
    note = reply.get("note") if reply.get("ok") else None
    if isinstance(note, str) and note:  # what a running search does with it
        print(f"note: {printable(note, protocol.MAX_TEXT_CHARS)}")
    return 0 if reply.get("ok") else 3 if reply.get("ranks_differ") else 1


def _tune(args: argparse.Namespace) -> int:
    from gpuwatch.client import Subscriber, reply_text, send_command

    info = find_run(args.run)
    if info is None:
        return _no_run(args.run)
    value: dict[str, Any] = {"stop": True} if args.stop else {}
    for key, option in (("knobs", args.knobs), ("allow", args.allow)):
        if option:
            value[key] = [name.strip() for name in option.split(",") if name.strip()]
    if args.budget_steps is not None:
        value["budget_steps"] = args.budget_steps
    rank0 = min(run_ranks(info.run_id), key=lambda rank: rank.rank, default=info)
    follow = not (args.stop or args.no_follow)
    with Subscriber(rank0) as subscriber:
        if follow:  # subscribed before it starts: no candidate is missed
            subscriber.recv(timeout_s=args.timeout)
        reply = send_command(info, protocol.TUNE, value, timeout_s=args.timeout)
        if not reply.get("ok"):
            print(printable(reply_text(protocol.TUNE, value, reply)), file=sys.stderr)
            return 3 if reply.get("ranks_differ") else 1
        print(f"tune: {printable(reply.get('note', 'accepted'))}", flush=True)
        if not follow:
            return 0
        heard_at = time.monotonic()
        while True:
            message = subscriber.recv(timeout_s=1.0)
            if message is None:
                gone = _tail_gone(rank0, time.monotonic() - heard_at)
                if gone is not None:
                    print(f"gpuwatch tune: {printable(gone)}", file=sys.stderr)
                    return 1
                continue
            heard_at = time.monotonic()
            body = message["body"]
            if message["type"] == protocol.EVENT and body.get("kind") in ("tune", "tuned"):
                print(printable(body.get("text", "")), flush=True)
                if body.get("kind") == "tuned":
                    return 0
            elif message["type"] == protocol.BYE:
                print(f"gpuwatch tune: the run ended ({printable(body.get('reason', ''))}) "
                      "before the search did", file=sys.stderr)
                return 1


def _tail(args: argparse.Namespace) -> int:
    if args.last is not None and args.last < 1:
        print("gpuwatch tail: --last N needs N >= 1", file=sys.stderr)
        return 2
    if args.target and not args.run and os.path.isfile(args.target):
        return _tail_file(Path(args.target), args)
    from gpuwatch.client import Subscriber

    selector = args.run or args.target
    info = find_run(selector)
    if info is None and selector:
        log = history.find_run_log(selector)
        if log is not None:  # a finished run: its log, as `gpuwatch RUN` opens it
            return _tail_file(log.first, args)
    kind = _not_a_file(args.target) if info is None and args.target and not args.run \
        else None
    if kind is not None:  # never opened: a FIFO's open would wait for a writer
        print(f"gpuwatch tail: {printable(args.target)} is {kind}, not a run log file",
              file=sys.stderr)
        return 1
    if info is None:
        return _no_run(selector)
    if args.last:  # its log's last records, then what comes, to its bye
        if not info.log_path or not os.path.isfile(info.log_path):
            print(f"gpuwatch tail: --last reads the run's log, and run "
                  f"{printable(info.run_id)} has none on this machine", file=sys.stderr)
            return 1
        return _tail_file(Path(info.log_path), argparse.Namespace(**{**vars(args),
                                                                     "follow": True}))
    printed = 0
    hellos = _Hellos()
    try:
        subscriber = Subscriber(info)
    except zmq.ZMQError as exc:
        print(f"gpuwatch tail: cannot subscribe to {info.pub_endpoint!r}: {exc}",
              file=sys.stderr)
        return 1
    relays = _tail_relays(info) if args.nodes else []
    with subscriber:
        heard_at = time.monotonic()
        try:
            while True:
                message, other = _tail_next(subscriber, relays)
                if other is not None:  # another node's relay: summaries, events
                    if other["type"] not in (protocol.NODE, protocol.EVENT):
                        continue  # (rank 0's records, another rank's bye: not this tail's)
                    if _print_record(other, as_json=args.json, hellos=hellos,
                                     rank=info.rank):
                        printed += 1
                        sys.stdout.buffer.flush()
                    if args.count and printed >= args.count:
                        break
                    continue
                if message is None:
                    gone = _tail_gone(info, time.monotonic() - heard_at)
                    if gone is not None:
                        print(f"gpuwatch tail: {printable(gone)}", file=sys.stderr)
                        return 1
                    continue
                heard_at = time.monotonic()
                if _print_record(message, as_json=args.json, hellos=hellos):
                    printed += 1
                    sys.stdout.buffer.flush()
                if message["type"] == protocol.BYE or (args.count and printed >= args.count):
                    break
        finally:
            for relay in relays:
                relay.close()
            if subscriber.missed or subscriber.malformed:
                print(f"gpuwatch tail: {counted(subscriber.missed, 'record')} missed, "
                      f"{subscriber.malformed} malformed", file=sys.stderr)
    return 0


def _tail_relays(info: RunInfo) -> list[Any]:
    """Subscribers of the other nodes' relays of a multi-node run (``tail --nodes``)."""
    from agent.wire.commands import remote_relays
    from gpuwatch.client import Subscriber

    if info.nnodes <= 1:
        print("gpuwatch tail: --nodes: this run is on one node", file=sys.stderr)
        return []
    relays, problem = remote_relays(info.run_id, info.world_size, {info.node})
    if problem:
        print(f"gpuwatch tail: --nodes: {printable(problem)}", file=sys.stderr)
    subscribers = []
    for _, _, relay in relays:
        try:
            subscribers.append(Subscriber(relay))
        except zmq.ZMQError as exc:
            print(f"gpuwatch tail: cannot subscribe to {relay.pub_endpoint!r}: {exc}",
                  file=sys.stderr)
    return subscribers


def _tail_next(subscriber: Any, relays: list[Any]
               ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The next message within a second: ``(message, None)`` from the run's own rank
    (None after a second of silence), or ``(None, message)`` from another node."""
    if not relays:
        return subscriber.recv(timeout_s=1.0), None
    poller = zmq.Poller()
    for each in (subscriber, *relays):
        poller.register(each.socket, zmq.POLLIN)
    ready = dict(poller.poll(1000))
    for relay in relays:
        if relay.socket in ready:
            message = relay.recv(timeout_s=0)
            if message is not None:
                return None, message
    return (subscriber.recv(timeout_s=0) if subscriber.socket in ready else None), None


def _tail_gone(info: RunInfo, silent_s: float) -> str | None:
    """Why ``gpuwatch tail`` (or ``tune``, following the search) should stop after
    ``silent_s`` seconds without a message,
    or None to go on waiting: a run with a run file is gone when its process is
    (killed: no ``bye`` will come); a bare endpoint is given up on after
    :data:`TAIL_SILENCE_S`. A live process that is slow to speak (a loaded machine) is
    waited for."""
    if info.run_id != "?":
        if silent_s >= TAIL_CHECK_AFTER_S and not alive(info.pid):
            return (f"run {info.run_id} is gone: its process (pid {info.pid}) ended "
                    "without saying bye")
        return None
    if silent_s >= TAIL_SILENCE_S:
        return (f"nothing heard from {info.pub_endpoint} for {TAIL_SILENCE_S:.0f} s: "
                "is a run there? (see `gpuwatch runs`)")
    return None


def _not_a_file(path: str) -> str | None:
    """What ``path`` is when it exists and is neither a regular file nor a link (``a
    FIFO``, ``a directory``...), else None; asks ``lstat`` only (opens nothing)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return None


def _tail_file(path: Path, args: argparse.Namespace) -> int:
    """Print a run log's records; with ``--follow`` wait for more until a ``bye``.

    Without ``--follow``, a log read to its end without a ``bye`` is said (on stderr): the
    run is still going, or was killed before its last records were written. With
    ``--last N``, the records up to the log's end are kept N at most (memory: N records)
    and printed there, then what comes after as usual."""
    from gpuwatch.sources.replay import POLL_S, RunLogReader

    printed = 0
    ended = False
    hellos = _Hellos()
    last: deque[dict[str, Any]] | None = deque(maxlen=args.last) if args.last else None
    counted_hellos = _Hellos()  # (which hellos have a line, for --last)
    with RunLogReader(path) as reader:
        try:
            while True:
                try:
                    messages = reader.read()
                except OSError as exc:
                    print(printable(f"gpuwatch tail: cannot read {path}: {exc}"),
                          file=sys.stderr)
                    return 1
                if last is not None:
                    last.extend(message for message in messages
                                if _has_line(message, args.json, counted_hellos))
                    if not reader.at_eof:
                        continue
                    messages, last = list(last), None
                for message in messages:
                    if _print_record(message, as_json=args.json, hellos=hellos):
                        printed += 1
                    ended = message["type"] == protocol.BYE or (
                        ended and message["type"] != protocol.HELLO)
                    if ((args.follow and message["type"] == protocol.BYE)
                            or (args.count and printed >= args.count)):
                        return 0
                if reader.at_eof:
                    sys.stdout.buffer.flush()
                    if not args.follow:
                        if not ended:
                            print("gpuwatch tail: the log ends without the run's bye: it "
                                  "is still going (--follow waits for more), or it was "
                                  "killed before its last records were written",
                                  file=sys.stderr)
                        return 0
                    time.sleep(POLL_S)
        finally:
            if reader.malformed:
                print(f"gpuwatch tail: {counted(reader.malformed, 'malformed line')} "
                      "skipped",
                      file=sys.stderr)


def _has_line(message: dict[str, Any], as_json: bool, hellos: "_Hellos") -> bool:
    """Whether :func:`_print_record` would print ``message`` (``hellos``: the hellos
    seen before it, which this updates), printing nothing."""
    if as_json:
        return True
    if message.get("type") == protocol.HELLO:
        return hellos.line(message) is not None
    try:
        return _human_line(message) is not None
    except Exception:  # (printed raw)
        return True


def _print_record(message: dict[str, Any], *, as_json: bool, hellos: "_Hellos",
                  rank: int | None = None) -> bool:
    """Print one envelope as a JSON line (the run log's format) or a line for people
    (``[rank N]`` in front when ``rank`` is given and the record is another rank's);
    False when there is no line for people for its type, or it is a hello that
    ``hellos`` has said already."""
    if as_json:
        # bytes, with newline; what a terminal would obey escaped (exact all the same)
        sys.stdout.buffer.write(protocol.terminal_json(protocol.to_json_line(message)))
        return True
    try:
        line = hellos.line(message) if message.get("type") == protocol.HELLO \
            else _human_line(message)
    except Exception:  # a record of unexpected shape: show it raw rather than fail
        line = protocol.to_json_line(message).decode().rstrip("\n")
    if line is None:
        return False
    if (rank is not None and message.get("rank") != rank
            and message.get("type") != protocol.NODE):
        line = f"[rank {message.get('rank')}] {line}"
    sys.stdout.buffer.write(printable(line).encode() + b"\n")
    return True


class _Hellos:
    """The hello lines a tail has printed, by run and rank.

    A run repeats its hello for subscribers that come late (a person needs it once), and
    sends a new one when its knobs change (a framework binds its knobs after the loop
    starts; a resumed run restores them): that is said as what changed."""

    def __init__(self) -> None:
        self._said: dict[tuple[Any, Any], tuple[str, list[str]]] = {}

    def line(self, message: dict[str, Any]) -> str | None:
        """The line for a ``hello`` envelope; None when it says nothing new."""
        body = message["body"]
        key = (message.get("run"), message.get("rank"))
        head = f"run {message.get('run')} {body.get('name', '')} on {body.get('device', '?')}"
        knobs = [str(knob.get("name", "?")) for knob in body.get("knobs") or ()
                 if isinstance(knob, dict)]
        said = self._said.get(key)
        self._said[key] = (head, knobs)
        if said is not None and said[0] == head:
            if said[1] == knobs:
                return None
            added = [name for name in knobs if name not in said[1]]
            gone = [name for name in said[1] if name not in knobs]
            return f"run {message.get('run')} knobs " + "; ".join(
                f"{what}: {', '.join(names)}" for what, names in (("added", added),
                                                                 ("removed", gone)) if names)
        return f"{head}; knobs: " + ", ".join(knobs)


def _replay(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        print(f"gpuwatch replay: no such file {str(path)!r} (a live run's log is the "
              "log_path of `gpuwatch runs --json`)", file=sys.stderr)
        return 1
    log = history.log_at(path)
    tree = None
    if args.branch is not None:
        tree = history.log_summary(log)[0].tree if log is not None else None
        if tree is None or args.branch not in tree.branches:
            print(f"gpuwatch replay: {str(path)!r} has no branch {args.branch} (see "
                  "`gpuwatch runs --all`)", file=sys.stderr)
            return 1
    if log is not None and not history_commands.is_written_by_a_live_run(log):
        return history_commands.open_finished(
            log, branch=None if tree is None else (tree, args.branch))
    from gpuwatch.app import GpuwatchApp
    from gpuwatch.sources.replay import ReplaySource

    branch = "" if args.branch is None else f", branch b{args.branch}'s path"
    app = GpuwatchApp(ReplaySource(path, branch=None if tree is None else (tree, args.branch)),
                      readonly=True,
                      notes=[("info", f"replaying {path}{branch} (read-only; followed "
                                      "while it grows)")])
    app.run()
    return app.return_code or 0


def _human_line(message: dict[str, Any]) -> str | None:
    """A short line for steps, events and bye; None for the other types.

    (A hello's line is :class:`_Hellos`'s.)"""
    body = message["body"]
    kind = message["type"]
    if kind == protocol.STEP:
        knobs = " ".join(f"{k}={knob_text(v)}" for k, v in (body.get("knobs") or {}).items())
        loss, lr, tokens = body.get("loss"), body.get("lr"), body.get("tokens_per_s")
        wait = "unknown" if body.get("samples") == 0 else human_ms(body.get("data_wait_s"))
        return (f"step {body.get('step')}  {human_ms(body.get('step_time_s'))}  "
                f"wait {wait}  "
                f"{human_rate(body.get('samples_per_s'), 'samples/s')}  "
                + (f"{human_sig(tokens)} tokens/s  " if isinstance(tokens, (int, float)) else "")
                + f"loss {human_sig(loss) if isinstance(loss, (int, float)) else '-'}  "
                + (f"lr {human_sig(lr)}  " if isinstance(lr, (int, float)) else "")
                + (f"grad norm {human_sig(norm)}  " if isinstance(norm := body.get("grad_norm"),
                                                           (int, float)) else "")
                + knobs).rstrip()
    if kind == protocol.EVENT:
        return f"[{body.get('level', 'info')}] {body.get('text', '')}"
    if kind == protocol.BYE:
        steps = body.get("steps")
        return (f"run ended ({body.get('reason', '')}) after "
                + (counted(steps, "step") if type(steps) is int else "? steps"))
    if kind == protocol.NODE:
        return (f"node {body.get('node')} ({body.get('host', '')}): " + ", ".join(
            f"rank {entry.get('rank')} step {entry.get('step')} "
            f"{human_ms(entry.get('step_time_s'))}"
            + (f" wait {entry['data_wait_share']:.0%}"
               if isinstance(entry.get("data_wait_share"), (int, float)) else "")
            for entry in body.get("ranks") or () if isinstance(entry, dict)))
    return None


def _demo(args: argparse.Namespace) -> int:
    if args.resume is not None and not Path(args.resume).is_file():
        print(f"gpuwatch demo: no checkpoint at {printable(args.resume)} (the path the "
              "checkpoint event named, e.g. .../checkpoints/<run>/step-00000040.pt)",
              file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "agent.demo", "--model", args.model,
               "--compile-backend", args.compile_backend]
    if args.max_steps is not None:
        command += ["--max-steps", str(args.max_steps)]
    for option, value in (("--device", args.device), ("--resume", args.resume),
                          ("--checkpoint-dir", args.checkpoint_dir)):
        if value is not None:
            command += [option, value]
    command += ["--parent-pid", str(os.getpid())]  # ends with this command, however
    if args.no_ui:
        return _demo_without_ui(command)
    log_path = run_dir() / f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    with open(log_path, "wb") as log:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT)
    info = None
    try:
        print(f"gpuwatch demo: starting {args.model} training (its output in {log_path}, "
              "removed when it ends cleanly)", flush=True)
        _end_on_signals()
        info = _wait_for_run(child, log_path)
        if info is None:
            return 1
        return _watch(info, readonly=args.readonly, quick_keys=args.quick_keys, notes=[(
            "info", f"demo training job pid {child.pid}, output in {log_path} (removed "
            "when it ends cleanly)")])
    finally:  # (the dashboard closed: its job stops as "dashboard quit", not a Ctrl-C)
        _stop_child(child, info, log_path=log_path,
                    signum=signal.SIGINT if info is None else protocol.DEMO_QUIT_SIGNAL)
        ended = _job_ended_line(log_path)
        if ended:  # as --no-ui ends, once the dashboard has closed
            _say(ended)
        if child.returncode == 0:  # a clean stop: its output holds nothing to look at
            log_path.unlink(missing_ok=True)


#: How much of the end of its output :func:`_job_ended_line` reads (bytes).
_JOB_ENDED_TAIL_BYTES = 4096


def _job_ended_line(log_path: Path) -> str:
    """The demo job's last line (``gpuwatch demo: ended at step 112 (finished; ...)``)
    from the end of its output, control characters stripped; "" without one (killed, or
    the file is gone). Reads at most :data:`_JOB_ENDED_TAIL_BYTES`; never follows a
    symlink."""
    try:
        fd = os.open(log_path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as log:
        log.seek(max(0, os.fstat(fd).st_size - _JOB_ENDED_TAIL_BYTES))
        tail = log.read(_JOB_ENDED_TAIL_BYTES).decode("utf-8", "replace")
    return next((printable(line.strip()) for line in reversed(tail.splitlines())
                 if line.startswith(protocol.DEMO_ENDED)), "")


def _demo_without_ui(command: list[str]) -> int:
    """``demo --no-ui``: the training job in this terminal (its output here), and a
    one-line progress report every :data:`PROGRESS_EVERY_S` (step, step time,
    throughput, loss; or that the run is paused) read from its telemetry as a dashboard
    would (its :class:`gpuwatch.state.RunState`); Ctrl-C stops it."""
    from gpuwatch.client import Subscriber

    print("gpuwatch demo: training in this terminal; watch it with `gpuwatch` from "
          "another one", flush=True)
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    info = None
    try:
        _end_on_signals()
        info = _wait_for_run(child, None)
        if info is None:
            return 1
        started, last, shown_at = time.monotonic(), None, time.monotonic()
        state = RunState(primary_rank=info.rank)
        with Subscriber(info) as subscriber:
            while child.poll() is None:
                message = subscriber.recv(timeout_s=0.5)
                if message is not None and message["type"] == protocol.BYE:
                    break  # its last line ("ended at step N ...") stays the last one
                if message is not None:
                    state.ingest(message)
                    if message["type"] == protocol.STEP:
                        last = message["body"]
                if time.monotonic() - shown_at >= PROGRESS_EVERY_S:
                    shown_at = time.monotonic()
                    paused = state.paused_after if state.status == "paused" else None
                    print(_progress_line(last, time.monotonic() - started, paused,
                                         recent_steps(state.steps)), flush=True)
        return child.wait() or 0
    except KeyboardInterrupt:  # the terminal sent SIGINT to the job as well
        return 130
    finally:
        _stop_child(child, info)


def _progress_line(step: dict[str, Any] | None, elapsed_s: float,
                   paused_after: int | None = None,
                   recent: RecentSteps | None = None) -> str:
    """``demo: step 1,200  288 ms/step  109 samples/s  loss 2.04  (5m10s)``.

    ``paused_after``: the step a ``pause=on`` holds the run after, when it does:
    ``demo: paused after step 101 (gpuwatch set pause=off goes on)  (5m10s)``. ``recent``:
    the latest steps (:func:`gpuwatch.state.recent_steps`): the step time and the rate
    are their mean, as the dashboard's (``288 ms/step  109 samples/s (10s mean)``), not
    the last step's alone (a warm-up step among the first read as the run's pace)."""
    if paused_after is not None:
        return (f"demo: paused after step {paused_after:,} (gpuwatch set pause=off goes "
                f"on)  ({human_age(elapsed_s)})")
    if step is None:
        return f"demo: no step yet ({human_age(elapsed_s)})"
    tokens = step.get("tokens_per_s")
    field, unit = (("tokens_per_s", "tokens/s") if isinstance(tokens, (int, float))
                   else ("samples_per_s", "samples/s"))
    step_time_s, rate, label = step.get("step_time_s"), step.get(field), ""
    if recent is not None and recent.records:
        step_time_s, rate = recent.mean("step_time_s"), recent.rate(field)
        label = f" ({recent.label})"
    loss = step.get("loss")
    number = step.get("step")
    return (f"demo: step {f'{number:,}' if isinstance(number, int) else '?'}  "
            f"{human_ms(step_time_s)}/step  {human_rate(rate, unit)}{label}  "
            f"loss {human_sig(loss) if isinstance(loss, (int, float)) else '-'}  "
            f"({human_age(elapsed_s)})")


def _wait_for_run(child: subprocess.Popen, log_path: Path | None) -> RunInfo | None:
    """The run file the child writes, or None (after saying why) if it died or took
    longer than :data:`DEMO_START_TIMEOUT_S` (``log_path``: where its output went,
    None when it writes to this terminal)."""
    deadline = time.monotonic() + DEMO_START_TIMEOUT_S
    while time.monotonic() < deadline:
        for info in list_runs():
            if info.pid == child.pid:
                return info
        if child.poll() is not None:
            print(f"gpuwatch demo: the training job exited with status {child.returncode}"
                  + (f"; last lines of {log_path}:\n{_tail_of(log_path)}"
                     if log_path is not None else ""), file=sys.stderr)
            return None
        time.sleep(0.1)
    print(f"gpuwatch demo: no run file from pid {child.pid} after "
          f"{DEMO_START_TIMEOUT_S:.0f} s" + (f"; last lines of {log_path}:\n"
                                             f"{_tail_of(log_path)}"
                                             if log_path is not None else ""),
          file=sys.stderr)
    return None


def _tail_of(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read it: {exc})"


def _end_on_signals(end: Callable[[], None] | None = None) -> None:
    """Make :data:`ENDING_SIGNALS` end this command as Ctrl-C does, so that the
    ``finally`` that stops its child process runs: ``end`` is called (a dashboard's
    exit), or without it ``SystemExit(128 + signal)`` is raised in the main thread
    (once: a second signal is ignored while the child is being stopped, which takes at
    most :data:`DEMO_STOP_TIMEOUT_S` and a second)."""
    def ending(signum: int, frame: object) -> None:
        global _ended_by
        _ended_by = signal.Signals(signum)
        if end is not None:
            end()
            return
        for each in ENDING_SIGNALS:
            signal.signal(each, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    for each in ENDING_SIGNALS:
        signal.signal(each, ending)


def _stop_child(child: subprocess.Popen, info: RunInfo | None, *,
                log_path: Path | None = None, signum: int = signal.SIGINT) -> None:
    """Stop the demo's training job: ``signum`` (or the ending signal this command
    received, so that the job's ``bye`` names it), so that it ends at its next optimizer step
    (says bye, removes its run file), then SIGKILL after :data:`DEMO_STOP_TIMEOUT_S`
    (or at once on Ctrl-C). ``info``: its run, None if it wrote no run file; a run whose
    run file is gone has ended and is only exiting: it is waited for without a signal
    or a word. ``log_path``: where its output went, named when it is killed."""
    if child.poll() is not None:
        return
    said_bye = info is not None and not os.path.exists(info.path)
    if not said_bye:
        child.send_signal(_ended_by or signum)
    try:
        child.wait(1.0)
        return
    except subprocess.TimeoutExpired:  # a busy machine, or a long step
        pass
    if info is None or os.path.exists(info.path):
        _say(f"gpuwatch demo: stopping the training job (pid {child.pid}) at the end of "
             f"its optimizer step; killed if that takes over {DEMO_STOP_TIMEOUT_S:.0f} s "
             "(Ctrl-C: now) ...")
    try:
        child.wait(DEMO_STOP_TIMEOUT_S)
        return
    except subprocess.TimeoutExpired:
        why = f"its step did not end within {DEMO_STOP_TIMEOUT_S:.0f} s"
    except KeyboardInterrupt:
        why = "Ctrl-C"
    child.kill()
    child.wait()
    _say(f"gpuwatch demo: killed the training job ({why})"
         + (f"; its output is kept in {log_path}" if log_path is not None else ""),
         file=sys.stderr)


def _say(text: str, file: Any = None) -> None:
    """Print ``text`` (to stdout, or ``file``) where a terminal that has gone (a closed
    SSH session or tmux window: SIGHUP, then EIO on every write) is no error: what a
    command does on its way out (stop its child, remove its files) must not depend on
    saying so."""
    try:
        print(text, file=file or sys.stdout, flush=True)
    except (OSError, ValueError):  # (ValueError: a stream already closed on the way out)
        pass


def _doctor(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("torch") is None:
        print(f"gpuwatch doctor: torch is not installed in this Python ({sys.executable});"
              " the environment report needs it. Install PyTorch (https://pytorch.org) "
              "and run `gpuwatch doctor` again. The dashboard itself works without it.",
              file=sys.stderr)
        return 1
    command = [sys.executable, "-m", "gpuopt.environment"]
    if args.json:
        command.append("--json")
    _end_on_signals()  # (call kills its child on the way out)
    return subprocess.call(command)
