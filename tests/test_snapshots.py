"""Screens compared with snapshots at 60x20, 80x24 and 120x40 (the live ones at 100x30
too): the demo transformer, the CNN demo, a monitor-only run, a replay on a timeline, the
help screen, the command line, a key's question and a warning held over newer events,
each rendered by the real app (``run_test``) from fixed records.

The snapshots are the screens' text (``tests/snapshots/<screen>-<W>x<H>.txt``), what a
person reads, so a change shows as a readable diff in review; styles are left out.
After an intended change, write them again with ``GPUWATCH_UPDATE_SNAPSHOTS=1`` and read
the diff.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from functools import partial
from pathlib import Path

import pytest
from textual import events

from agent.wire import protocol
from agent.wire.knobs import STANDARD_KNOBS
from agent.wire.runs import RunInfo
from gpuwatch import history
from gpuwatch.app import GpuwatchApp
from gpuwatch.sources.live import LiveSource
from gpuwatch.sources.timeline import TimelineSource
from gpuwatch.widgets import event_log
from gpuwatch.widgets.command_line import CommandLine
from gpuwatch.screens.help import HelpScreen

from .conftest import screen_text, text_of
from .test_dashboard import until
from .test_history import RUN, write_run

SNAPSHOTS = Path(__file__).parent / "snapshots"
SIZES = [(60, 20), (80, 24), (120, 40)]
#: The live screens' sizes: at 100 columns too, where the panels take their widths from
#: 100 to 119 (each column counted: a label cut there went unseen).
LIVE_SIZES = [*SIZES, (100, 30)]
UPDATE = os.environ.get("GPUWATCH_UPDATE_SNAPSHOTS") == "1"
#: The monotonic time the fixed runs are shown at, and their first record's.
NOW = 10_000.0
STEPS = 120


class FixedSource(LiveSource):
    """A live source that never connects and is shown at a fixed time: ``fold`` folds
    its records when the app starts it, so the screen is the same on every machine."""

    def __init__(self, info: RunInfo, fold) -> None:
        super().__init__(info)
        self._fold = fold

    def start(self) -> None:  # no subscriber thread: nothing else changes the state
        self._fold(self)

    def now(self) -> float:
        return NOW


def _info(run_id: str) -> RunInfo:
    return RunInfo(run_id=run_id, rank=0, world_size=1, pid=0,
                   pub_endpoint="tcp://127.0.0.1:1", cmd_endpoint="", token="t",
                   started_at=0.0)


def _envelope(msg_type, body, seq):
    return protocol.envelope(msg_type, body, run="20260101-120000-abcd", seq=seq,
                             t=1_767_268_800.0 + seq)


def _fold(source: FixedSource, *, name: str, knobs: dict, tokens: bool, cnn: bool = False,
          details: dict | None = None) -> None:
    """A run of :data:`STEPS` steps: a compile stall at step 40 (an outlier), a knob
    change at step 80 that speeds it up, the loss falling; received up to :data:`NOW`."""
    state, messages = source.state, []

    def fold(msg_type, body):
        messages.append(_envelope(msg_type, body, len(messages) + 1))

    with source.lock:
        _make(fold, knobs=knobs, name=name, tokens=tokens, cnn=cnn, details=details or {})
        for index, message in enumerate(messages):
            state.ingest(message, NOW - (len(messages) - index) * 0.001)
        if knobs:
            state.log("info", "sent accum_steps=8", 1_767_268_900.0)
            state.log("info", "accum_steps=8 accepted, applies at step 121",
                      1_767_268_900.0)


def _make(fold, *, name: str, knobs: dict, tokens: bool, cnn: bool,
          details: dict | None = None) -> None:
    """The records of a run, in order (see :func:`_fold`); ``details``: knobs' schema
    ``detail`` (recover's policy)."""
    fold("hello", {"name": name, "device": "cpu", "world_size": 1,
                   "knobs": [STANDARD_KNOBS[k].to_wire() | (
                       {"detail": details[k]} if k in (details or {}) else {})
                             for k in knobs]})
    fold("system", {"cpu_pct": 97.0, "process_cpu_pct": 180.0,
                    "host_mem_used_bytes": 6 << 30, "host_mem_total_bytes": 16 << 30,
                    "gpus": [], "gpu_status": "no NVIDIA GPU (NVML unavailable: "
                                              "NVML Shared Library Not Found)"})
    values = dict(knobs)
    for step in range(1, STEPS + 1):
        if step == 80 and "num_workers" in values:
            values["num_workers"] = 2
            fold("event", {"level": "info", "kind": "applied", "knob": "num_workers",
                           "value": 2, "step": step,
                           "text": "num_workers=2 applied at step 80"})
        fast = step >= 80 and "num_workers" in values
        step_s = (0.12 if cnn else 0.28) * (0.7 if fast else 1.0) \
            + 0.01 * math.sin(step)
        if step == 40:
            step_s = 2.2  # a compile
        wait_s = (0.002 if fast else 0.04) + 0.001 * math.cos(step)
        body = {"step": step, "step_time_s": step_s, "data_wait_s": wait_s,
                "data_wait_share": wait_s / step_s,
                "data_wait_share_window": wait_s / step_s,
                "input_verdict": "compute-bound" if fast else "partly input-bound",
                "samples_per_s": 32 / step_s, "loss": 2.0 + 2.6 * math.exp(-step / 30),
                "host_rss_bytes": (450 + step // 10) << 20, "lr": 0.001,
                "grad_norm": 0.8 + 0.1 * math.sin(step / 3), "knobs": dict(values)}
        if tokens:
            body["tokens_per_s"] = 32 * 128 / step_s
        if step % 20 == 1:
            body["activation_bytes"] = 17 << 20
        fold("step", body)


def _transformer():
    return GpuwatchApp(FixedSource(_info("20260101-120000-abcd"), partial(
        _fold, name="demo-transformer", tokens=True, knobs={
            "precision": "fp32", "accum_steps": 1, "num_workers": 0, "pin_memory": False,
            "prefetch_factor": 2, "kernels": "eager", "checkpointing": False,
            "lr_scale": 1.0, "max_grad_norm": 1.0, "weight_decay": 0.01})))


def _cnn():
    return GpuwatchApp(FixedSource(_info("20260101-120000-abcd"), partial(
        _fold, name="demo-cnn", tokens=False, cnn=True, knobs={
            "precision": "fp32", "accum_steps": 1, "num_workers": 0, "pin_memory": False,
            "prefetch_factor": 2, "kernels": "eager", "checkpointing": False})))


#: Every knob the transformer demo has now, loss-spike recovery on with its policy.
DEMO_KNOBS = {
    "precision": "fp32", "accum_steps": 1, "micro_batch_size": 16, "num_workers": 0,
    "pin_memory": False, "prefetch_factor": 2, "cpu_threads": 2, "kernels": "eager",
    "checkpointing": False, "lr_scale": 1.0, "max_grad_norm": 1.0, "weight_decay": 0.01,
    "dropout": 0.0, "recover": "on"}
RECOVER_DETAIL = "every 25 x2, 3 steps > 6 MAD, lr x0.5 for 100"


def _recover():
    return GpuwatchApp(FixedSource(_info("20260101-120000-abcd"), partial(
        _fold, name="demo-transformer", tokens=True, knobs=DEMO_KNOBS,
        details={"recover": RECOVER_DETAIL})))


def _monitor_only():
    return GpuwatchApp(FixedSource(_info("20260101-120000-abcd"), partial(
        _fold, name="third-party-train", tokens=False, knobs={})), readonly=True)


def _replay(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the log's path as the screen shows it: the same anywhere
    path = write_run(Path(f"{RUN}.rank0.jsonl"), steps=80, t0=1_767_268_800.0,
                     changes=[(31, "accum_steps", 4), (61, "precision", "bf16")],
                     events=[(50, "loader is slow")])
    return GpuwatchApp(TimelineSource(history.log_at(path)), readonly=True)


#: The run opened late: its log's steps, and the last of them received live.
LATE_STEPS, LATE_RECEIVED = 5_000, 120


def _late(tmp_path):
    """A run opened at step 5,000 (:data:`LATE_STEPS`): its log has every step (a
    compile at step 1, a spike at step 50,000 beyond it, ``num_workers`` 0 -> 2 at
    step 2,501), the dashboard received the last :data:`LATE_RECEIVED`; the whole
    run is read before the app starts, so the screen is the same on every machine."""
    from tests.test_whole_run import loss, samples_per_s, step_time_s, write_log

    path = tmp_path / "20260101-120000-abcd.rank0.runlog"
    write_log(path, LATE_STEPS, run="20260101-120000-abcd", change_at=LATE_STEPS // 2 + 1)

    def fold(source: FixedSource) -> None:
        messages = [_envelope("hello", {
            "name": "late", "device": "cpu", "world_size": 1,
            "knobs": [STANDARD_KNOBS["num_workers"].to_wire()]}, 1)]
        for step in range(LATE_STEPS - LATE_RECEIVED + 1, LATE_STEPS + 1):
            messages.append(_envelope("step", {
                "step": step, "step_time_s": step_time_s(step), "data_wait_s": 0.001,
                "loss": loss(step), "samples_per_s": samples_per_s(step),
                "knobs": {"num_workers": 2}}, len(messages) + 1))
        with source.lock:
            for index, message in enumerate(messages):
                source.state.ingest(message, NOW - (len(messages) - index) * 0.001)

    info = _info("20260101-120000-abcd")
    app = GpuwatchApp(FixedSource(dataclasses.replace(info, log_path=str(path)), fold),
                      readonly=True)
    assert app.source.whole is not None
    app.source.whole.start()  # (the fixed source starts no thread of its own)
    assert app.source.whole.loaded.wait(60)
    return app


def check(name: str, text: str) -> None:
    """Compare ``text`` with the snapshot ``name`` (write it with UPDATE)."""
    path = SNAPSHOTS / f"{name}.txt"
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"no snapshot {path}: run with GPUWATCH_UPDATE_SNAPSHOTS=1"
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True),
                                            text.splitlines(True), "snapshot", "now"))
        pytest.fail(f"{name} differs from its snapshot:\n{diff}")


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch):
    """The event log's stamps at one time of day whatever the machine's zone."""
    monkeypatch.setattr(event_log, "local_time", lambda t_s, form: "12:00:00")


async def _settle(app, pilot) -> None:
    """Redraw everything at the laid-out size (charts too, at once)."""
    for _ in range(2):
        await pilot.pause()
        app._charts_drawn, app._drawn = (-1, 0.0), None
        app.redraw()
    await pilot.pause()


SCREENS = {"transformer": _transformer, "cnn": _cnn, "monitor-only": _monitor_only,
           "recover": _recover}


@pytest.mark.parametrize("size", LIVE_SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
@pytest.mark.parametrize("screen", list(SCREENS))
async def test_live_screens(screen, size):
    app = SCREENS[screen]()
    async with app.run_test(size=size) as pilot:
        await _settle(app, pilot)
        check(f"{screen}-{size[0]}x{size[1]}", screen_text(app))


@pytest.mark.parametrize("size", LIVE_SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
async def test_recovers_policy_never_cuts_a_knobs_name(size):
    """recover's policy (46 characters) never cuts a knob's name: it is left out where
    no part of it fits (every panel here: its parts, in test_panel_layout)."""
    app = _recover()
    async with app.run_test(size=size) as pilot:
        await _settle(app, pilot)
        text = text_of(app, "#knobs")
    words = text.split()
    assert "recover" in words and "on" in words
    for name in DEMO_KNOBS.keys() - {"lr_scale", "max_grad_norm"}:
        assert name in words, (name, text)
    assert "…" not in text.replace(", …)", "")


@pytest.mark.parametrize("size", SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
async def test_replay_screen(tmp_path, monkeypatch, size):
    app = _replay(tmp_path, monkeypatch)
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: "● ended" in str(app.query_one("#header").content))
        await pilot.press("home", "right_square_bracket", "right_square_bracket", "left")
        await _settle(app, pilot)
        check(f"replay-{size[0]}x{size[1]}", screen_text(app))


@pytest.mark.parametrize("size", SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
async def test_whole_run_screen(tmp_path, size):
    """Opened late: the whole run from step 1 (its log's steps, thinned, the compile
    marked at the axis' end), then the steps received; ``z``: those alone."""
    app = _late(tmp_path)
    async with app.run_test(size=size) as pilot:
        await _settle(app, pilot)
        check(f"whole-run-{size[0]}x{size[1]}", _steady_step_labels(screen_text(app)))
        await pilot.press("z")
        await _settle(app, pilot)
        check(f"received-{size[0]}x{size[1]}", _steady_step_labels(screen_text(app)))


def _steady_step_labels(text: str) -> str:
    """``text`` with the charts' step labels one space apart: plotext places a label a
    column either way depending on Python's hash seed (its ``brush`` drops repeated
    points through a set), seen with the thinned buckets of a whole run."""
    lines = text.split("\n")
    for row, line in enumerate(lines[:-1]):
        if "└┬" in line:
            lines[row + 1] = " ".join(lines[row + 1].split())
    return "\n".join(lines)


@pytest.mark.parametrize("size", SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
async def test_help_screen(size):
    app = _transformer()
    async with app.run_test(size=size) as pilot:
        await _settle(app, pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.pause()
        check(f"help-{size[0]}x{size[1]}", screen_text(app))


@pytest.mark.parametrize("size", SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
async def test_command_line(size):
    app = _transformer()
    async with app.run_test(size=size) as pilot:
        await _settle(app, pilot)
        await pilot.press("colon", *"kernels=c")
        line = app.query_one(CommandLine)
        await until(pilot, lambda: line._suggestion == "kernels=compile")
        await _settle(app, pilot)
        check(f"command-line-{size[0]}x{size[1]}", screen_text(app))


@pytest.mark.parametrize("size", SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
async def test_help_scrolls_to_its_end_with_the_keyboard(size):
    app = _transformer()
    async with app.run_test(size=size) as pilot:
        await _settle(app, pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        last = "home/end scroll;"
        if size[1] < 40:
            assert last not in screen_text(app)  # it does not fit: below, out of view
        await pilot.press("end")
        await until(pilot, lambda: last in screen_text(app))
        await pilot.press("home")
        await until(pilot, lambda: last not in screen_text(app) or size[1] >= 40)


async def test_a_burst_of_down_keys_scrolls_the_help_a_line_each():
    app = _transformer()
    async with app.run_test(size=(60, 20)) as pilot:
        await _settle(app, pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        box = app.screen.query_one("#help")
        assert box.max_scroll_y > 20
        for key, count in (("down", 15), ("up", 4)):  # queued at once, as a terminal
            for _ in range(count):                    # sends a held key's repeats
                app.post_message(events.Key(key, None))
            await pilot.pause()
        assert box.scroll_y == 11


@pytest.mark.parametrize("size", SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
async def test_the_checkpoint_question_is_shown(size):
    app = GpuwatchApp(FixedSource(_info("20260101-120000-abcd"), partial(
        _fold, name="demo-transformer", tokens=True, knobs={
            "precision": "fp32", "accum_steps": 1, "checkpoint": None})))
    async with app.run_test(size=size) as pilot:
        await _settle(app, pilot)
        await pilot.press("s")
        await _settle(app, pilot)
        check(f"confirm-{size[0]}x{size[1]}", screen_text(app))
        question = screen_text(app).splitlines()[-1]  # one row, over the footer
        assert question.endswith(("s/enter: send  esc: cancel", "s: send  esc: cancel"))
        assert question.startswith(" ? ") and "save a checkpoint at the next step" in question


@pytest.mark.parametrize("size", SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
async def test_a_warning_held_over_newer_events(size):
    """The fp16-on-CPU warning, whole, with two events after it (until a key)."""
    app = _transformer()
    async with app.run_test(size=size) as pilot:
        await _settle(app, pilot)
        with app.source.lock:
            app.source.state.log(
                "warning", "precision=fp16 accepted, applies at step 121 (warning: fp16 "
                "autocast on CPU is typically 10-20x slower than fp32 (no native fp16 "
                "matmul); this CPU has no native bf16 either (no AVX512-BF16/AMX): "
                "prefer fp32)", 1_767_268_900.0)
            app.source.state.log("info", "precision=fp16 applied at step 121",
                                 1_767_268_901.0)
        await _settle(app, pilot)
        check(f"warning-{size[0]}x{size[1]}", screen_text(app))
        assert "prefer fp32)" in screen_text(app)


@pytest.mark.parametrize("size", [(80, 40), (120, 40)], ids=str)
async def test_the_event_log_wraps_a_long_entry_without_losing_a_character(size):
    app = _transformer()
    text = "checkpoint saved: " + "/".join(f"dir{i:02d}" for i in range(20)) + "/end.pt"
    async with app.run_test(size=size) as pilot:
        await _settle(app, pilot)
        with app.source.lock:
            app.source.state.log("info", text, 1_767_268_900.0)
        app.redraw()
        await pilot.pause()
        log = app.query_one(event_log.EventLog)
        lines = [strip.text.rstrip() for strip in log.lines]
        shown = "".join(line.removeprefix("12:00:00 ") for line in lines)
        assert text.replace(" ", "") in shown.replace(" ", "")
        await pilot.resize_terminal(60, size[1])  # wrapped again at the new width
        await pilot.pause()
        narrower = [strip.text.rstrip() for strip in log.lines]
        assert max(map(len, narrower)) < max(map(len, lines)) and len(narrower) > len(lines)
        shown = "".join(line.removeprefix("12:00:00 ") for line in narrower)
        assert text.replace(" ", "") in shown.replace(" ", "")


def test_the_readme_picture_is_the_transformer_snapshot():
    """The README's 80x24 picture is the transformer screen as the app draws it now (so
    a layout change that rewrites the snapshot rewrites the picture with it)."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    snapshot = (SNAPSHOTS / "transformer-80x24.txt").read_text()
    assert "```\n" + snapshot.rstrip("\n") + "\n```\n" in readme, (
        "README.md: paste tests/snapshots/transformer-80x24.txt as its picture again")
