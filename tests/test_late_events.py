"""A dashboard opened late shows the run's past events too: the event log is filled from
the run log with the events before the first record received live, once each, in order,
bounded (:data:`~gpuwatch.sources.whole_run.EARLIER_EVENTS`), and the panels get what
they imply (:class:`~gpuwatch.sources.whole_run.EarlierEvents`)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import tracemalloc

import pytest
import torch

import agent
from agent.step.record import StepRecord
from agent.wire import protocol, runs
from agent.wire.runlog import RunLog, log_dir
from gpuwatch import history
from gpuwatch.app import GpuwatchApp
from gpuwatch.client import send_command
from gpuwatch.history import flat_records
from gpuwatch.sources.live import LiveSource
from gpuwatch.sources.whole_run import (EARLIER_EVENTS, HELD_RECORDS, MEET_WAIT_S,
                                        EarlierEvents)
from gpuwatch.state import Pending, RunState
from gpuwatch.widgets.event_log import EventLog
from tests.conftest import log_texts, text_of, until, wait_until
from tests.training import digits_loader, model as make_model


def _train(run, model, optimizer, data, steps: int) -> None:
    """``steps`` windows of one micro-batch, each ended at the run's boundary (the
    forward under ``run.autocast``, which measures activation memory now and then)."""
    for _ in range(steps):
        x, y = data[(run.step or 0) % len(data)]
        with run.autocast:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        run.scaler.scale(loss).backward()
        run.scaler.step(optimizer)
        run.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        run.optimizer_step()


def _logged_event_texts(path) -> list[str]:
    return [record["text"] for record in flat_records(path) if record["type"] == "event"]


async def test_a_dashboard_opened_late_shows_the_runs_events_once_each_then_live(run_dir,
                                                                                 tmp_path):
    """A hand-written loop's run takes lr_scale and max_grad_norm, evaluates, and has a
    checkpoint accepted for step 50; a dashboard opened at step 6 shows every event the
    run logged before it, once each and in the log's order, then the live ones; the
    checkpoint is pending, the knobs have their applied values, and the activation
    measurement of the log is shown before the next one is made."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = digits_loader(batch_size=16)
    run = agent.session(model=model, optimizer=optimizer, name="late-events",
                        max_grad_norm=0.0, checkpoint_dir=tmp_path,
                        measure_activations_every=100,  # at step 1, then not until 101
                        eval_fn=lambda: {"val_loss": 1.5})
    try:
        info = runs.find_run(run.agent.run_id)
        for knob, value, step in (("lr_scale", 0.5, 2), ("max_grad_norm", 1.0, 3),
                                  ("evaluate", "now", 4), ("checkpoint", "now", 50)):
            reply = send_command(info, knob, value, apply_step=step)
            assert reply["ok"], reply
        _train(run, model, optimizer, data, 6)
        path = run.agent.info.log_path
        await _wait_logged(path, "evaluation")
        before = _logged_event_texts(path)
        assert len(before) >= 7 and any("val_loss" in text for text in before), before

        app = GpuwatchApp(LiveSource(info), readonly=True)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.source._earlier.delivered)
            reply = send_command(info, "max_grad_norm", 2.0, apply_step=8)
            assert reply["ok"], reply
            with app.source.lock:
                state = app.source.state
                assert state.pending["checkpoint"] == Pending("now", 50)
                assert state.activation_bytes is not None and state.activation_bytes > 0
                assert state.knobs["lr_scale"] == 0.5 and state.knobs["max_grad_norm"] == 1.0
                # no step since it came: the steps before it fill the charts and panels
                assert [record.step for record in state.steps] == list(range(1, 7))
                assert state.last_step["step"] == 6
            await until(pilot, lambda: "RSS" in text_of(app, "#memory"))  # not "no steps yet"
            _train(run, model, optimizer, data, 2)
            await until(pilot, lambda: any("max_grad_norm" in text and "2.0" in text
                                           and "applied" in text
                                           for text in log_texts(app)))
            texts = log_texts(app)
            past = [text for text in texts if text in before]
            assert past == before  # once each, in order
            first_live = next(i for i, text in enumerate(texts)
                              if "max_grad_norm" in text and "2.0" in text)
            assert texts.index(before[-1]) < first_live
            await until(pilot, lambda: len(app.query_one(EventLog)._entries) >= len(texts))
            shown = [str(line) for line in app.query_one(EventLog)._entries]
            assert any(before[0] in line for line in shown)  # drawn again, from the past
            assert sum(before[-1] in line for line in shown) == 1
    finally:
        run.close()


async def _wait_logged(path, kind: str) -> None:
    """Until the run log at ``path`` has an event of ``kind`` (the agent writes it
    within its flush interval)."""
    for _ in range(400):
        if any(record.get("kind") == kind for record in flat_records(path)
               if record["type"] == "event"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {kind} event in {path}")


def _crafted_log(path, events: int, *, run: str) -> None:
    """A run log of ``events`` events (their texts with control characters), a step
    batch every 1,000, and an evaluation accepted for a late step first."""
    log = RunLog(path, flush_interval_s=0.0)
    seq = 1
    log.write(protocol.envelope("hello", {"name": "crafted", "knobs": []}, run=run,
                                seq=seq, t=1000.0))
    for number in range(events):
        seq += 1
        body = {"level": "warning" if number % 7 == 0 else "info",
                "text": f"event {number} \x1b[31mred\x1b[0m \x07bell\r"}
        if number == 0:
            body.update(kind="accepted", knob="evaluate", value="now", step=10 ** 9)
        log.write(protocol.envelope("event", body, run=run, seq=seq, t=1000.0 + number))
        if number % 1000 == 999:
            seq += 1
            steps = list(range(number - 999, number + 1))
            columns = {"step": steps, "step_time_s": [0.01] * 1000,
                       "activation_bytes": [float(s) if s % 20 == 0 else None
                                            for s in steps]}
            log.write(protocol.envelope("steps", protocol.steps_body(columns, {}),
                                        run=run, seq=seq, t=1000.0 + number))
    log.close()


async def test_a_log_of_100000_events_shows_its_last_ones_and_counts_the_others(run_dir):
    """A run whose log has 100,000 events (control characters in every text) before
    this agent's records: the dashboard's event log shows the last
    :data:`EARLIER_EVENTS` of them in order, visible characters for the control ones,
    after a line counting the others; the evaluation accepted for a later step is pending
    and the last activation measurement is shown; the log is read in its own thread
    while the dashboard answers keys."""
    run_id = "20261202-090000-crafted"
    events = 100_000
    _crafted_log(log_dir() / f"{run_id}.rank0.runlog", events, run=run_id)
    monitor = agent.Agent(name="crafted", run_id=run_id).start()  # appends to that log
    delivered_in: list[str] = []
    try:
        source = LiveSource(runs.find_run(run_id))
        assert source._earlier is not None
        deliver = source._earlier._deliver

        def noted(state, activation):
            delivered_in.append(threading.current_thread().name)
            deliver(state, activation)

        source._earlier._deliver = noted
        app = GpuwatchApp(source, readonly=True)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("z")  # answered whether or not the log is read
            await until(pilot, lambda: "charts: the last" in " ".join(log_texts(app)))
            await until(pilot, lambda: source._earlier.delivered, timeout_s=120)
            monitor.optimizer_step(StepRecord(step=1, micro_batches=1, samples=8,
                                              data_wait_s=0.001))
            texts = log_texts(app)
            counted = f"+{events - EARLIER_EVENTS:,} earlier events in the run log"
            assert counted in texts
            at = texts.index(counted)
            past = texts[at + 1:at + 1 + EARLIER_EVENTS]
            assert [text.split()[:2] for text in past] == [
                ["event", str(number)] for number in range(events - EARLIER_EVENTS, events)]
            with source.lock:
                assert source.state.pending["evaluate"] == Pending("now", 10 ** 9)
                assert source.state.activation_bytes == 99_980.0
            await until(pilot, lambda: any(f"event {events - 1} " in str(line) for line
                                           in app.query_one(EventLog)._entries))
            shown = "\n".join(str(line) for line in app.query_one(EventLog)._entries)
            assert "\x1b" not in shown and "\x07" not in shown and "\r" not in shown
            assert f"event {events - 1} " in shown
    finally:
        monitor.close()
    assert delivered_in == ["gpuwatch-WholeRun"]  # never the UI's thread


@pytest.mark.slow
def test_earlier_events_of_a_100000_event_log_hold_bounded_memory(tmp_path):
    """Folding 100,000 events read before the first live record is known holds at most
    :data:`HELD_RECORDS` records and a state of bounded size: the memory it allocates
    does not grow with the log: 20,000 events and 100,000 allocate alike (about 5 MB
    here, mostly the reader's frame of the log)."""
    peaks = []
    for events in (20_000, 100_000):
        path = tmp_path / f"r{events}.rank0.runlog"
        _crafted_log(path, events, run=f"r{events}")
        log = history.log_at(path)
        delivered: list[RunState] = []
        earlier = EarlierEvents(lambda state, activation: delivered.append(state))
        tracemalloc.start()
        for _, envelope in history.LogReader(log, arrays=True):
            earlier.add(envelope)
            assert len(earlier._held) <= HELD_RECORDS + 1
        earlier.join((events + 10_000, "heartbeat", 5e9))  # after every record
        earlier.add({"type": "heartbeat", "seq": events + 10_001, "t": 5e9 + 1})
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        [state] = delivered
        assert state.events_total == events and len(state.events) <= 200
    assert peaks[1] < 1.25 * peaks[0], peaks


def _envelope(msg_type: str, seq: int, t: float, **body) -> dict:
    return protocol.envelope(msg_type, body, run="r", seq=seq, t=t)


def test_the_log_and_the_live_records_meet_where_the_first_live_one_was_sent():
    """Before the first live record: a lower seq, the same seq of another type (a
    greeting repeats the latest seq), and an earlier process's records whatever their
    seq (sent before it); the first live record itself and those after it are not
    folded; records without a seq or time never meet; nothing is delivered before the
    meeting."""
    delivered: list[RunState] = []
    earlier = EarlierEvents(lambda state, activation: delivered.append(state))
    earlier.add(_envelope("event", 50, 10.0, text="an earlier process's, seq 50"))
    earlier.add(_envelope("event", 1, 20.0, text="seq 1"))
    earlier.add({"type": "event", "body": {"text": "no seq"}})
    earlier.join((3, "hello", 30.5))  # a greeting with the latest seq, 3
    earlier.add(_envelope("event", 2, 21.0, text="seq 2"))
    earlier.add(_envelope("event", 3, 30.0, text="seq 3, before the greeting"))
    assert not delivered
    earlier.add(_envelope("event", 4, 31.0, text="seq 4, live"))
    earlier.add(_envelope("event", 5, 32.0, text="seq 5, live"))
    [state] = delivered
    assert [entry.text for entry in state.events] == [
        "an earlier process's, seq 50", "seq 1", "no seq", "seq 2",
        "seq 3, before the greeting"]

    delivered.clear()
    earlier = EarlierEvents(lambda state, activation: delivered.append(state))
    earlier.join((7, "event", 40.0))  # the first live record is an event, logged too
    earlier.add(_envelope("event", 6, 39.0, text="seq 6"))
    earlier.add(_envelope("event", 7, 40.0, text="seq 7, live"))
    [state] = delivered
    assert [entry.text for entry in state.events] == ["seq 6"]


def test_a_log_that_stops_before_the_first_live_record_is_delivered_saying_so():
    """A log whose writer stopped (no record of the first live one, nor after it):
    read to its end :data:`MEET_WAIT_S` after the first live record came, what it has is
    delivered, after a line saying where it stops; not before then."""
    delivered: list[RunState] = []
    earlier = EarlierEvents(lambda state, activation: delivered.append(state))
    earlier.add(_envelope("event", 1, 20.0, text="seq 1"))
    earlier.join((90, "heartbeat", 50.0))
    joined_at = earlier._joined_at
    earlier.read_to_end(joined_at + MEET_WAIT_S / 2)
    assert not delivered
    earlier.read_to_end(joined_at + MEET_WAIT_S)
    [state] = delivered
    texts = [entry.text for entry in state.events]
    assert texts[0] == "seq 1" and texts[1].startswith("the run log stops at ")
    assert texts[1].endswith(" are not shown") and len(texts) == 2
    earlier.read_to_end(joined_at + 2 * MEET_WAIT_S)
    assert len(delivered) == 1  # once


def test_a_live_state_keeps_what_it_heard_after_joining_over_the_past():
    """The past's pending commands, pause and knob values go where the live state heard
    nothing of them; a knob it heard of since keeps the live word."""
    past = RunState()
    for seq, body in enumerate((
            {"kind": "applied", "knob": "lr_scale", "value": 0.5, "step": 5, "text": "a"},
            {"kind": "applied", "knob": "accum_steps", "value": 4, "step": 6, "text": "b"},
            {"kind": "accepted", "knob": "evaluate", "value": "now", "step": 90, "text": "c"},
            {"kind": "accepted", "knob": "checkpoint", "value": "now", "step": 90,
             "text": "d"},
            {"kind": "applied", "knob": "pause", "value": "on", "step": 10, "text": "e"})):
        past.ingest(_envelope("event", seq, float(seq), **body))
    live = RunState()
    for seq, body in enumerate((
            {"kind": "applied", "knob": "accum_steps", "value": 2, "step": 12, "text": "f"},
            {"kind": "applied", "knob": "checkpoint", "value": "now", "step": 12,
             "text": "g"}), start=10):
        live.ingest(_envelope("event", seq, float(seq), **body))
    live.add_earlier(past, shown=3)
    assert [entry.text for entry in live.events] == [
        "+2 earlier events in the run log", "c", "d", "e", "f", "g"]
    assert live.pending == {"evaluate": Pending("now", 90)}
    assert live.paused_after == 9 and live.status_at(live.last_seen_at) == "paused"
    assert live.knobs == {"accum_steps": 2, "checkpoint": "now", "lr_scale": 0.5,
                          "pause": "on"}  # (actions too, as the live path keeps them)
    assert live.log_epoch == 1 and live.events_total == 2  # the live lines


def test_a_run_whose_log_cannot_be_read_says_where_its_earlier_events_are(run_dir,
                                                                          make_agent):
    """A run file whose log is a link (never followed), or that names none: one line
    says where the events before the first record received are, or why not shown."""
    link = os.path.join(run_dir, "elsewhere.rank0.runlog")
    os.symlink("/dev/null", link)
    fake = make_agent()
    for log_path, ending in (
            (link, f"are in the run log {link}, which cannot be read here "
                   "(not a regular file)"),
            ("", "are not shown: the run keeps no run log")):
        source = LiveSource(dataclasses.replace(fake.info, log_path=log_path))
        source.start()
        try:
            lines: list[str] = []

            def said() -> bool:
                with source.lock:
                    lines[:] = [entry.text for entry in source.state.events]
                return any(text.startswith("events before ") for text in lines)

            wait_until(said, "the line about the earlier events")
            [line] = [text for text in lines if text.startswith("events before ")]
            assert line.endswith(ending), line
        finally:
            source.close()
