"""The dashboard alone: RunState folding, the client sockets, and the Textual app driven
by a pilot against a fake agent with real ZeroMQ sockets (see conftest.FakeAgent)."""

from __future__ import annotations

import asyncio
import re
import queue
import time

import msgpack
import pytest
import zmq
from textual import events
from textual.geometry import Region

from agent.wire import protocol
from agent.wire.knobs import STANDARD_KNOBS
from agent.wire.runs import RunInfo
from gpuwatch import state as state_module
from gpuwatch.app import QUICK_KEYS_ENV, GpuwatchApp
from gpuwatch.client import Subscriber, send_command
from gpuwatch.sources.live import LiveSource
from gpuwatch.state import GONE_AFTER_S, STALLED_AFTER_S, STEP_HISTORY, RunState
from gpuwatch.screens.help import HelpScreen
from gpuwatch.widgets.key_bar import KeyBar, KeyItem, fold
from gpuwatch.screens.runs import RunsScreen
from gpuwatch.widgets.last_event import HOLD_AFTER_KEY_S, LastEvent
from gpuwatch.screens.tune import TuneScreen
from gpuwatch.widgets.panel import bucket_max, sparkline
from tests.conftest import knows, log_texts, redrawn, screen_text, text_of, until

RUN = "20250101-000000-abcd"


def envelope(msg_type, body, seq=0, rank=0, run=RUN):
    return protocol.envelope(msg_type, body, run=run, rank=rank, seq=seq)


def frames(msg_type, body, seq=0):
    return protocol.encode(envelope(msg_type, body, seq))


# --- RunState ------------------------------------------------------------------------

def test_state_folds_each_message_type():
    state = RunState()
    schema = [STANDARD_KNOBS[name].to_wire() for name in ("precision", "accum_steps")]
    state.ingest(envelope("hello", {"name": "tiny", "device": "cuda:0", "knobs": schema}), 1.0)
    state.ingest(envelope("step", {
        "step": 7, "step_time_s": 0.25, "data_wait_s": 0.05, "data_wait_share": 0.2,
        "samples_per_s": 128.0, "loss": 2.5, "knobs": {"precision": "fp32", "accum_steps": 1},
        "host_rss_bytes": 1 << 30, "mem_reserved_bytes": 2 << 30}), 1.1)
    state.ingest(envelope("system", {"cpu_pct": 50.0, "gpus": [], "gpu_status": "no GPU"}),
                 1.2)
    state.ingest(envelope("state", {"step": 8, "knobs": {"precision": "bf16"}}), 1.3)
    state.ingest(envelope("event", {"level": "warning", "text": "slow loader"}), 1.4)
    state.ingest(envelope("heartbeat", {"step": 9}), 1.5)
    state.ingest(envelope("some-future-type", {"x": 1}), 1.6)

    assert state.run_id == RUN and state.hello["name"] == "tiny"
    assert list(state.schema) == ["precision", "accum_steps"]
    record = state.steps[-1]
    assert (record.step, record.step_time_s, record.loss, record.samples_per_s) == (
        7, 0.25, 2.5, 128.0)
    assert state.last_step["mem_reserved_bytes"] == 2 << 30
    assert state.system["gpu_status"] == "no GPU"
    assert state.knobs == {"precision": "bf16", "accum_steps": 1}
    assert state.knob_changed_at == {"precision": 1.3}
    assert state.step == 9
    assert [e.text for e in state.events] == ["slow loader"]
    assert state.records == 7 and state.malformed == 0 and state.missed == 0


def test_state_buffers_are_bounded():
    state = RunState()
    for step in range(STEP_HISTORY + 100):
        state.ingest(envelope("step", {"step": step, "step_time_s": 0.1}, seq=step), 0.0)
        state.ingest(envelope("event", {"text": str(step)}), 0.0)
    assert len(state.steps) == STEP_HISTORY and state.steps[0].step == 100
    assert len(state.events) < state.events_total == STEP_HISTORY + 100


def test_state_counts_sequence_gaps_per_run_and_rank():
    state = RunState()
    for seq, rank in [(1, 0), (2, 0), (5, 0), (1, 1), (4, 1), (6, 0)]:
        state.ingest(envelope("heartbeat", {}, seq=seq, rank=rank))
    assert state.missed == 2 + 2 + 0  # rank 0: 3, 4 lost; rank 1: 2, 3 lost; 6 follows 5
    state.ingest(envelope("heartbeat", {}, seq=1, rank=0))  # sender restarted: no gap
    state.ingest(envelope("heartbeat", {}, seq=2, rank=0))
    assert state.missed == 4


def test_state_counts_malformed_frames_and_bodies_without_raising():
    state = RunState()
    state.ingest_frames([b"step", b"\xc1 not msgpack"])
    state.ingest_frames([b"step", msgpack.packb([1, 2, 3])])
    state.ingest_frames([b"step", b"x" * (protocol.MAX_MESSAGE_BYTES + 1)])
    state.ingest_frames([])
    state.ingest_frames(frames("step", {"step": 3, "knobs": ["not", "a", "map"]}))
    state.ingest_frames(frames("hello", {"knobs": "nonsense"}))
    state.ingest_frames(frames("step", {"step": "three", "loss": "nan", "step_time_s": True}))
    assert state.malformed == 5
    assert state.steps[-1].step is None and state.steps[-1].loss is None


def test_a_run_at_an_evaluation_or_a_save_reads_so_rather_than_stalled():
    """evaluate=now can hold the run minutes at a boundary (20 s for the demo on a loaded
    machine, which read "stalled" and then "run is live" over the metrics)."""
    later = STALLED_AFTER_S + 0.1
    for knob, status in (("evaluate", "evaluating"), ("checkpoint", "saving")):
        state = RunState()
        state.ingest(envelope("step", {"step": 7, "step_time_s": 0.1}), 10.0)
        state.ingest(envelope("event", {"kind": "accepted", "knob": knob, "value": "now",
                                        "step": 9, "text": "accepted"}), 10.1)
        state.ingest(envelope("heartbeat", {"step": 7}), 10.0 + later)
        assert state.status_at(10.0 + later) == "stalled"  # not at its boundary yet
        state.ingest(envelope("event", {"kind": "accepted", "knob": knob, "value": "now",
                                        "step": 8, "text": "accepted"}), 10.0 + later)
        assert state.status_at(10.0 + later) == status
        state.ingest(envelope("event", {"kind": "applied", "knob": knob, "value": "now",
                                        "step": 8, "text": "applied"}), 30.0)
        assert state.status_at(30.5) == "live"  # the wait for step 8 starts there
        state.ingest(envelope("heartbeat", {"step": 7}), 30.0 + later)
        assert state.status_at(30.0 + later) == "stalled"


def test_state_status_transitions():
    state = RunState()
    assert state.status_at(0.0) == "waiting"
    state.ingest(envelope("heartbeat", {"step": 0}), 10.0)
    assert state.status_at(10.5) == "live"
    assert state.status_at(10.0 + STALLED_AFTER_S + 0.1) == "gone"  # nothing heard
    state.ingest(envelope("heartbeat", {"step": 0}), 15.0)
    assert state.status_at(15.2) == "stalled"  # heartbeats, no step since 10.0
    state.ingest(envelope("step", {"step": 1}), 15.5)
    assert state.status_at(15.6) == "live"
    assert state.status_at(15.5 + GONE_AFTER_S + 0.1) == "gone"
    state.ingest(envelope("bye", {"reason": "finished", "steps": 1}), 20.0)
    assert state.status_at(1000.0) == "ended"
    assert state.events[-1].text == "run ended (finished) after 1 step"
    state.ingest(envelope("bye", {"reason": "stopped by stop=now after step 830",
                                  "steps": 830}), 21.0)  # not "... after 830 steps" again
    assert state.events[-1].text == "run ended (stopped by stop=now after step 830)"


def test_state_says_paused_not_stalled_while_pause_holds_the_run():
    state = RunState()
    state.ingest(envelope("step", {"step": 102, "step_time_s": 0.1}), 10.0)
    state.ingest(envelope("event", {"kind": "applied", "knob": "pause", "value": "on",
                                    "step": 103}), 10.1)
    # at once, not "live" for the seconds a stall takes (the demo's header said live
    # under "pause=on applied at step 103: the training waits at this boundary")
    assert state.status_at(10.2) == "paused"
    state.ingest(envelope("heartbeat", {"step": 102}), 16.0)
    assert state.paused_after == 102 and state.status_at(16.1) == "paused"
    state.ingest(envelope("event", {"kind": "applied", "knob": "pause", "value": "off",
                                    "step": 103}), 16.5)
    # let go: the wait for its next step starts now (not at step 102, before the pause)
    assert state.status_at(16.6) == "live"
    later = 16.5 + state.stall_after_s() + 0.1
    state.ingest(envelope("heartbeat", {"step": 102}), later - 0.05)  # heard, no step since
    assert state.status_at(later) == "stalled"
    state.ingest(envelope("step", {"step": 103, "step_time_s": 0.1}), 17.0)
    assert state.status_at(17.1) == "live"


def test_state_clears_pending_when_applied():
    state = RunState()
    state.ingest(envelope("step", {"step": 1, "knobs": {"precision": "fp32"}}), 1.0)
    state.note_pending("precision", "bf16", 3)
    state.ingest(envelope("step", {"step": 2, "knobs": {"precision": "fp32"}}), 2.0)
    assert state.pending["precision"].apply_step == 3
    state.ingest(envelope("step", {"step": 3, "knobs": {"precision": "bf16"}}), 3.0)
    assert state.pending == {} and state.knob_changed_at["precision"] == 3.0
    state.note_pending("precision", "fp16", 5)
    state.ingest(envelope("event", {"kind": "accepted", "knob": "precision",
                                    "text": "precision=fp16 accepted"}), 3.5)
    assert state.pending["precision"].value == "fp16"  # accepted is not settled
    state.ingest(envelope("event", {"kind": "failed", "knob": "precision",
                                    "text": "fp16 failed"}), 4.0)
    assert state.pending == {}
    state.note_pending("precision", "bf16", 4)  # the reply came after the step applying it
    assert state.pending == {}


def test_state_compiling_lasts_until_compiled_failed_or_its_step():
    state = RunState()
    state.ingest(envelope("step", {"step": 1}), 1.0)
    state.ingest(envelope("event", {"kind": "compiling", "text": "compiling"}), 2.0)
    assert state.status_at(2.1) == "compiling" and state.compiling_since == 2.0
    assert state.status_at(2.0 + STALLED_AFTER_S + 1) == "gone"  # gone still wins
    state.ingest(envelope("heartbeat", {"step": 1}), 9.0)
    assert state.status_at(9.5) == "compiling"  # slow, not stalled
    state.ingest(envelope("step", {"step": 2}), 10.0)  # the step that compiled
    assert state.status_at(10.1) == "live"
    state.ingest(envelope("event", {"kind": "compiling", "step": 4}), 11.0)
    state.ingest(envelope("step", {"step": 3}), 11.1)  # recorded before it applied
    assert state.status_at(11.2) == "compiling"
    state.ingest(envelope("step", {"step": 4}), 12.0)
    assert state.status_at(12.1) == "live"
    for end in ("compiled", "failed"):
        state.ingest(envelope("event", {"kind": "compiling", "step": 99}), 13.0)
        state.ingest(envelope("event", {"kind": end, "compile_time_s": 3.2}), 13.5)
        assert state.status_at(13.6) == "live", end


def test_state_memory_peaks_agent_counts_and_restart_after_bye():
    state = RunState()
    for step, (rss, peak) in enumerate([(700, 5000), (900, 7000), (800, 6000)]):
        state.ingest(envelope("step", {"step": step, "host_rss_bytes": rss,
                                       "mem_peak_reserved_bytes": peak}), 1.0)
    assert state.host_rss_peak_bytes == 900
    assert [r.mem_peak_reserved_bytes for r in state.steps] == [5000, 7000, 6000]
    state.ingest(envelope("step", {"step": 3, "host_rss_bytes": 850,
                                   "host_peak_rss_bytes": 2000}), 1.0)
    assert state.host_rss_peak_bytes == 2000  # the run's own peak, when it sends one
    state.ingest(envelope("heartbeat", {"step": 3, "records_dropped": 5, "errors": 2}), 1.0)
    assert (state.agent_records_dropped, state.agent_errors) == (5, 2)
    state.ingest(envelope("bye", {"reason": "finished", "steps": 3}), 2.0)
    assert state.status_at(100.0) == "ended"
    state.ingest(envelope("hello", {"name": "again"}, seq=1), 50.0)  # same run id again
    assert state.status_at(50.1) == "live"
    assert state.events[-1].text == "run restarted (records after its bye)"


def test_sparkline_is_one_column_per_value_from_zero():
    assert sparkline([0.0, 0.5, 1.0], 10, high=1.0) == "▁▅█"
    assert sparkline([0.2, None, float("nan"), 2.0], 10, high=1.0) == "▂  █"
    assert sparkline([1, 2, 3, 4, 8], 4) == "▃▄▅█"  # the newest, up to the largest shown
    assert sparkline([0, 0], 5) == "▁▁" and sparkline([1.0], 0) == ""


def test_bucket_max_keeps_every_peak_of_a_long_history():
    assert bucket_max(list(range(10)), 3) == [1, 5, 9]  # runs of 2, 4, 4
    assert bucket_max([1, None, 3], 5) == [1, None, 3]  # short: as it is
    assert bucket_max([None, None, 5, None], 2) == [None, 5]
    spikes = [0.0] * 600
    spikes[137] = 9.0
    assert bucket_max(spikes, 17).count(9.0) == 1 and len(bucket_max(spikes, 17)) == 17
    assert bucket_max([], 4) == [] and bucket_max([1.0], 0) == []


def test_state_keeps_the_activation_memory_and_what_it_was_before_a_change():
    state = RunState()
    for step, activation in enumerate([None, 18e6, None, 18.2e6, 2.5e6, None]):
        fields = {} if activation is None else {"activation_bytes": activation}
        state.ingest(envelope("step", {"step": step, **fields}), 1.0)
    assert [r.activation_bytes for r in state.steps] == [None, 18e6, 18e6, 18.2e6, 2.5e6,
                                                          2.5e6]  # carried forward
    assert (state.activation_bytes, state.activation_before_bytes) == (2.5e6, 18.2e6)
    assert list(state.activation_history) == [(1, 18e6), (3, 18.2e6), (4, 2.5e6)]
    state.ingest(envelope("step", {"step": 6, "activation_bytes": "lots"}), 1.0)
    state.ingest(envelope("step", {"step": 7, "activation_bytes": -1}), 1.0)
    state.ingest(envelope("step", {"step": 8, "activation_bytes": 10**400}), 1.0)
    assert state.activation_bytes == 2.5e6  # bad values are ignored
    assert state.step == 8  # and the record is folded all the same


def test_state_shows_one_rank_and_keeps_the_pace_of_the_others():
    state = RunState(primary_rank=0)
    for step in range(1, 41):
        state.ingest(envelope("step", {"step": step, "step_time_s": 0.020, "loss": 1.0},
                              seq=step, rank=0), 10.0)
        state.ingest(envelope("step", {"step": step, "step_time_s": 0.025, "loss": 9.0},
                              seq=step, rank=1), 10.0)
    assert state.steps_total == 40 and {r.loss for r in state.steps} == {1.0}  # rank 0's
    assert (state.ranks[0].step, state.ranks[1].step) == (40, 40)
    assert state.ranks[1].step_time_s == pytest.approx(0.025)
    rank, lag = state.slowest_rank(10.0)
    assert rank == 1 and lag == pytest.approx(0.25)
    assert state.slowest_rank(10.0 + GONE_AFTER_S + 1) is None  # nobody heard lately
    state.ingest(envelope("event", {"level": "info", "kind": "applied", "text": "ok"},
                          seq=41, rank=1), 10.0)
    state.ingest(envelope("event", {"level": "error", "text": "loader died"}, seq=43,
                          rank=1), 10.0)
    assert [e.text for e in state.events] == ["rank 1: loader died"]
    assert state.missed == 1  # rank 1's seq 42 is lost; rank 0's seq count apart
    state.ingest(envelope("step", "not a body", seq=44, rank=1), 10.0)
    assert state.malformed == 1


def test_state_catches_ranks_whose_knobs_differ_at_one_step():
    state = RunState(primary_rank=0)

    def step(rank, number, accum):
        state.ingest(envelope("step", {"step": number, "step_time_s": 0.02,
                                       "knobs": {"accum_steps": accum}}, rank=rank), 1.0)

    step(0, 10, 1), step(1, 10, 1), step(1, 11, 2)  # rank 1 is one step ahead: fine
    assert state.knobs_differ() is None
    step(0, 11, 2)
    assert state.knobs_differ() is None  # the same change at the same step
    step(1, 12, 2), step(0, 12, 1)  # rank 0 went back alone
    assert state.knobs_differ() == (1, 12, "accum_steps", 1, 2)


def test_state_folds_every_record_of_a_long_stream():
    """Every record is folded and none counted missed (its speed is bench_stream's)."""
    state = RunState()
    for i in range(20_000):
        state.ingest_frames(frames("step", {"step": i, "step_time_s": 0.01,
                                            "data_wait_s": 0.001, "samples_per_s": 1000.0,
                                            "loss": 1.0, "knobs": {"precision": "bf16"}},
                                   seq=i), 0.0)
    assert state.records == 20_000 and state.missed == 0


# --- client sockets ------------------------------------------------------------------

def _run_info(pub_endpoint="tcp://127.0.0.1:1", cmd_endpoint=""):
    return RunInfo(run_id=RUN, rank=0, world_size=1, pid=0, pub_endpoint=pub_endpoint,
                   cmd_endpoint=cmd_endpoint, token="t", started_at=0.0)


def test_subscriber_counts_gaps_and_drops_malformed_frames():
    with zmq.Context.instance().socket(zmq.PUB) as pub:
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        with Subscriber(_run_info(f"tcp://127.0.0.1:{port}")) as subscriber:
            while True:  # until the subscription has reached the publisher (as rank 1)
                pub.send_multipart(protocol.encode(envelope("heartbeat", {}, rank=1)))
                if subscriber.recv(timeout_s=0.05) is not None:
                    break
            pub.send_multipart([b"step", b"\xc1"])
            for seq in (10, 11, 14):
                pub.send_multipart(frames("step", {"step": seq}, seq=seq))
            steps = []
            while len(steps) < 3:
                message = subscriber.recv(timeout_s=2.0)
                if message["type"] == "step":
                    steps.append(message["body"]["step"])
    assert steps == [10, 11, 14]
    assert subscriber.malformed == 1 and subscriber.missed == 2


def test_one_subscriber_follows_publishers_of_different_server_keys():
    """A multi-node job's relays each have their own CURVE server key: one socket
    connects to them all (the keys are taken at each connect), and a publisher whose
    key it was not given is not heard."""
    client_public, client_secret = zmq.curve_keypair()
    pubs, infos = [], []
    for node in (1, 2, 3):
        server_public, server_secret = zmq.curve_keypair()
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.curve_secretkey, pub.curve_publickey = server_secret, server_public
        pub.curve_server = True
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        pubs.append(pub)
        wrong_key = zmq.curve_keypair()[0] if node == 3 else server_public  # a forged key
        infos.append(RunInfo(
            run_id=RUN, rank=8 * node, world_size=32, pid=0,
            pub_endpoint=f"tcp://127.0.0.1:{port}", cmd_endpoint="", token="t",
            started_at=0.0, node=node, curve_server_key=wrong_key.decode(),
            curve_client_public_key=client_public.decode(),
            curve_client_secret_key=client_secret.decode()))
    try:
        with Subscriber(infos[0]) as subscriber:
            subscriber.connect(infos[1])
            subscriber.connect(infos[2])
            heard: set[int] = set()
            deadline = time.monotonic() + 10
            while heard != {1, 2} and time.monotonic() < deadline:
                for node, pub in zip((1, 2, 3), pubs):
                    pub.send_multipart(protocol.encode(envelope("node", {"node": node},
                                                                rank=8 * node)))
                message = subscriber.recv(timeout_s=0.05)
                while message is not None:
                    heard.add(message["body"]["node"])
                    message = subscriber.recv(timeout_s=0.0)
            assert heard == {1, 2}
    finally:
        for pub in pubs:
            pub.close(linger=0)


def test_send_command_without_reply_says_so():
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    keys = {"curve_server_key": server_public.decode(),
            "curve_client_public_key": client_public.decode(),
            "curve_client_secret_key": client_secret.decode()}
    with zmq.Context.instance().socket(zmq.ROUTER) as router:
        router.curve_secretkey, router.curve_publickey = server_secret, server_public
        router.curve_server = True
        port = router.bind_to_random_port("tcp://127.0.0.1")
        info = RunInfo(**{**_run_info(cmd_endpoint=f"tcp://127.0.0.1:{port}").__dict__,
                          **keys})
        reply = send_command(info, "precision", "bf16", timeout_s=0.2)
        command = protocol.decode_frames(router.recv_multipart())
    assert reply["ok"] is False and reply["answered"] is False
    assert reply["reason"] == "no reply within 0.2 s (is the run alive?)"
    assert command["body"]["knob"] == "precision" and command["body"]["token"] == "t"
    assert send_command(_run_info(), "precision", "bf16")["ok"] is False  # no endpoint
    assert send_command(_run_info(cmd_endpoint="nonsense://"), "precision", "bf16")[
        "reason"].startswith("cannot connect to nonsense://")


def test_a_token_is_never_sent_over_tcp_without_the_runs_server_key():
    with zmq.Context.instance().socket(zmq.ROUTER) as router:  # whoever holds the port
        port = router.bind_to_random_port("tcp://127.0.0.1")
        reply = send_command(_run_info(cmd_endpoint=f"tcp://127.0.0.1:{port}"),
                             "precision", "bf16", timeout_s=0.2)
        assert not router.poll(200)  # nothing, so no token, reached it
    assert reply["ok"] is False and reply["answered"] is False
    assert "its token is not sent" in reply["reason"]


# --- the app -------------------------------------------------------------------------

async def next_command(agent):
    return await asyncio.to_thread(agent.commands.get, timeout=20)  # soon, unless loaded


def help_text(app):
    """The help screen's cells (key, description, help), in order, one per line."""
    return "\n".join(str(cell.content) for cell in app.screen.query("#help-keys Static"))


def question_text(app):
    """The question a key asks, as shown ("" when none is open)."""
    widget = app.query_one("#question")
    return str(widget.content) if widget.display else ""


def footer_line(app):
    """The footer's line as shown (trailing blanks left out)."""
    return str(app.query_one(KeyBar).content).rstrip()


def shown_keys(app):
    """The keys the footer shows now."""
    return {key for key, active in app.active_bindings.items() if active.binding.show}


async def test_p_sends_precision_and_knobs_panel_follows(fake_agent):
    app = GpuwatchApp(LiveSource(fake_agent.info))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: knows(app, "precision"))
        await until(pilot, lambda: "● live" in text_of(app, "#header"))
        await pilot.press("p", "p")  # asks, then sends
        command = await next_command(fake_agent)
        assert (command["knob"], command["value"]) == ("precision", "bf16")
        assert command["token"] == fake_agent.info.token
        await until(pilot, lambda: any(t.startswith("precision=bf16 accepted, applies at step")
                                       for t in log_texts(app)))
        assert not any(t.startswith("accepted:") for t in log_texts(app))  # said once
        await until(pilot, lambda: "precision   bf16" in text_of(app, "#knobs"))
        await until(pilot, lambda: any("applied at step" in t for t in log_texts(app)))


async def test_shift_a_sends_accum_steps_and_bounds_hold(fake_agent):
    app = GpuwatchApp(LiveSource(fake_agent.info))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: knows(app, "accum_steps"))
        await pilot.press("a")  # already at the schema's minimum 1
        assert "accum_steps is already at its minimum 1; nothing sent" in log_texts(app)
        await pilot.press("A", "A")
        command = await next_command(fake_agent)
        assert (command["knob"], command["value"]) == ("accum_steps", 2)
        await until(pilot, lambda: "accum_steps 2" in text_of(app, "#knobs"))
    assert fake_agent.commands.empty()


async def test_pending_command_is_shown_until_applied():
    source = LiveSource(_run_info("tcp://127.0.0.1:1"))  # never connects
    app = GpuwatchApp(source)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert "waiting for run" in text_of(app, "#header")
        with source.lock:
            source.state.ingest(envelope(
                "hello", {"knobs": [STANDARD_KNOBS["precision"].to_wire()]}))
            source.state.ingest(envelope("step", {"step": 5, "knobs": {"precision": "fp32"}}))
            source.state.note_pending("precision", "bf16", 9)
        await until(pilot, lambda: "fp32 -> bf16 (at step 9)" in text_of(app, "#knobs"))
        # the run went back from step 6 to 2 at the boundary before step 7: the command
        # keeps its 2 steps from that boundary, 9 - (6 - 2) = 5, and the panel says so
        with source.lock:
            source.state.ingest(envelope("event", {
                "kind": "branched", "branch": 1, "parent": 0, "step": 2,
                "text": "branch 1 of branch 0 at step 2"}))
            for value, step in (("bf16", 5), ("fp16", 1)):  # (another value's: not ours)
                source.state.ingest(envelope("event", {
                    "kind": "rescheduled", "knob": "precision", "value": value,
                    "step": step, "previous_step": step + 4, "branch": 1,
                    "text": f"precision={value} now applies at step {step}"}))
        await until(pilot, lambda: "fp32 -> bf16 (at step 5)" in text_of(app, "#knobs"))


async def test_bad_endpoint_is_reported_not_raised():
    app = GpuwatchApp(LiveSource(_run_info("nonsense://here")))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: any(t.startswith("cannot subscribe to nonsense://here")
                                       for t in log_texts(app)))
        assert "waiting for run" in text_of(app, "#header")


async def test_readonly_sends_nothing(fake_agent):
    app = GpuwatchApp(LiveSource(fake_agent.info), readonly=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: knows(app, "precision"))
        await pilot.press("p", "A")
        await app.workers.wait_for_complete()
        logged = log_texts(app)
        assert "read-only: precision=bf16 not sent" in logged
        assert "read-only: accum_steps=2 not sent" in logged
        assert "read-only" in text_of(app, "#header")
    assert fake_agent.commands.empty()


async def test_keys_of_knobs_the_run_lacks_are_hidden_and_send_nothing(make_agent):
    agent = make_agent(knobs={"accum_steps": 1})
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: knows(app, "accum_steps"))
        await until(pilot, lambda: "p" not in shown_keys(app))
        assert shown_keys(app) == {"a", "A", "question_mark", "q", "colon"}
        await pilot.press("p", "w", "W", "m", "k", "c")
        await pilot.pause()
        assert not any(text.startswith("sent") for text in log_texts(app))
        knobs = text_of(app, "#knobs")
        assert "accum_steps" in knobs and "num_workers" not in knobs  # what it has
    with pytest.raises(queue.Empty):
        agent.commands.get_nowait()


@pytest.mark.parametrize("key, knob", [
    ("p", "precision"), ("a", "accum_steps"), ("A", "accum_steps"), ("w", "num_workers"),
    ("W", "num_workers"), ("m", "pin_memory"), ("k", "kernels"), ("c", "checkpointing"),
    ("l", "lr_scale"), ("L", "lr_scale"), ("g", "max_grad_norm")])
async def test_each_key_on_a_run_without_its_knob_says_why_in_the_log(make_agent, key,
                                                                     knob):
    agent = make_agent(knobs={"weight_decay": 0.0})  # none of the keys' knobs
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: knows(app, "weight_decay"))
        await until(pilot, lambda: key not in shown_keys(app))  # hidden from the footer
        await pilot.press(key)
        expected = f"this run has no knob {knob} (it has: weight_decay); nothing sent"
        await until(pilot, lambda: expected in log_texts(app))
        await until(pilot, lambda: expected in "".join(
            line.text for line in app.query_one("#log").lines))  # on screen
    assert agent.commands.empty()


async def test_k_says_which_kernels_it_skips_and_why(make_agent):
    agent = make_agent(knobs={"kernels": "eager"},  # as a run on CPU offers them
                       unavailable={"kernels": {"compile": "needs a C compiler"}})
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: knows(app, "kernels"))
        await pilot.press("k", "k")
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("kernels", "triton")
        assert "kernels=compile skipped: needs a C compiler" in log_texts(app)


async def test_keys_before_the_schema_say_why():
    _, app = _silent_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("p", "s")
        assert log_texts(app).count("no knob schema from the run yet; nothing sent") == 1
        assert "this run has no checkpoint command; nothing sent" in log_texts(app)


LOADER = {"num_workers": 0, "pin_memory": False, "prefetch_factor": 2}


async def test_w_and_m_send_loader_knobs_within_bounds(make_agent):
    agent = make_agent(knobs={"precision": "fp32", **LOADER})
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: knows(app, "num_workers") and knows(app, "pin_memory"))
        await pilot.press("w")  # already at the schema's minimum 0
        assert "num_workers is already at its minimum 0; nothing sent" in log_texts(app)
        await pilot.press("W", "W")
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("num_workers", 1)
        await pilot.press("m", "m")
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("pin_memory", True)
        assert "sent pin_memory=on" in log_texts(app)
        await until(pilot, lambda: "num_workers     1" in text_of(app, "#knobs")
                    and "pin_memory      on" in text_of(app, "#knobs"))
        assert "num_workers" not in text_of(app, "#data")  # one place: the knobs panel
        assert "precision" in text_of(app, "#knobs")
    assert agent.commands.empty()


async def test_k_cycles_kernels_and_c_toggles_checkpointing(make_agent):
    agent = make_agent(knobs={"kernels": "eager", "checkpointing": False})
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: knows(app, "kernels") and knows(app, "checkpointing"))
        await pilot.press("k", "k")
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("kernels", "compile")
        await pilot.press("c", "c")
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("checkpointing", True)
        await until(pilot, lambda: "kernels       compile" in text_of(app, "#knobs")
                    and "checkpointing on" in text_of(app, "#knobs"))
        await pilot.press("k", "k")  # steps from the applied value
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("kernels", "triton")


def _silent_app():
    """An app on a source that never connects: the test folds envelopes by hand."""
    source = LiveSource(_run_info("tcp://127.0.0.1:1"))
    return source, GpuwatchApp(source)


async def test_data_panel_shows_the_verdict_in_its_colour():
    source, app = _silent_app()
    async with app.run_test(size=(120, 40)) as pilot:
        with source.lock:
            source.state.ingest(envelope("hello", {"knobs": [
                STANDARD_KNOBS[name].to_wire() for name in LOADER]}))
        for step, (verdict, share, style) in enumerate([
                ("input-bound", 0.62, "$error"), ("partly input-bound", 0.31, "$warning"),
                ("compute-bound", 0.04, "$success")]):
            with source.lock:
                source.state.ingest(envelope("step", {
                    "step": step, "data_wait_share": share, "data_wait_share_window": share,
                    "input_verdict": verdict, "knobs": LOADER}))
            await until(pilot, lambda: text_of(app, "#data").startswith(verdict + "\n"))
            content = app.query_one("#data").content
            assert any(style in str(span.style) for span in content.spans
                       if (span.start, span.end) == (0, len(verdict))), content.spans
            assert f"wait {share:.0%} " in content.plain
        assert "prefetch_factor 2" in text_of(app, "#knobs")  # the loader's knobs: there
        assert "prefetch_factor" not in text_of(app, "#data")


@pytest.mark.parametrize("size", [(60, 20), (80, 24)])
async def test_under_100_columns_the_verdict_heads_the_knobs_data_group(size):
    source, app = _silent_app()
    async with app.run_test(size=size) as pilot:
        with source.lock:
            source.state.ingest(envelope("hello", {"knobs": [
                STANDARD_KNOBS[name].to_wire() for name in ("precision", *LOADER)]}))
            source.state.ingest(envelope("step", {
                "step": 1, "data_wait_share": 0.31, "data_wait_share_window": 0.31,
                "input_verdict": "partly input-bound",
                "knobs": {"precision": "fp32", **LOADER}}))
        await until(pilot, lambda: "data partly input-bound 31%" in text_of(app, "#knobs"))
        assert not app.query_one("#data").display
        content = app.query_one("#knobs").content
        start = content.plain.index("partly")
        assert any("$warning" in str(span.style) for span in content.spans
                   if span.start <= start < span.end), content.spans
        for text in ("numerics", "precision", "num_workers", "pin_memory",
                     "prefetch_factor 2"):
            assert text in content.plain, content.plain


async def test_step_chart_legend_leaves_the_unit_to_the_axis():
    source, app = _silent_app()
    async with app.run_test(size=(120, 40)) as pilot:
        with source.lock:
            for step in range(1, 41):
                source.state.ingest(envelope("step", {
                    "step": step, "step_time_s": 1.6 + step * 1e-3, "data_wait_s": 0.4}))
        await until(pilot, lambda: "⢕ data wait" in "\n".join(shown_lines(app, "#timing")))
        await redrawn(app, pilot)  # at the laid-out size
        chart = "\n".join(shown_lines(app, "#timing"))
        assert "step time" in chart and "(ms)" not in chart, chart
        assert "1.64 s┤" in chart, chart  # the unit: the axis', in the one that reads best


@pytest.mark.parametrize("step_times_s, off_scale, axis_top", [
    ([8.23, 1.5], True, "6.00 s"),  # a first step that compiled: a lone outlier
    ([1.5] * 100 + [2.6, 2.7, 2.65], False, "2.70 s"),  # slowed for good: followed
    ([1.5] * 100 + [2.6, 2.7, 40.0], True, "2.70 s"),  # ... a spike among them is not
    ([1.5] * 100 + [8.0], True, "2.25 s"),  # the newest step alone, a spike
    # a noisy new level (bf16 on a CPU): some of its steps back under the old scale
    ([1.5] * 100 + [2.0, 3.2] * 5, False, "3.20 s"),
    ([1.5] * 100 + [2.0, 3.2] * 4 + [2.0, 40.0], True, "3.20 s"),  # ... and a spike
], ids=["first-step", "sustained", "sustained-and-spike", "newest-spike", "noisy-level",
        "noisy-level-and-spike"])
async def test_step_chart_follows_a_sustained_change_not_a_lone_outlier(
        step_times_s, off_scale, axis_top):
    source, app = _silent_app()
    async with app.run_test(size=(120, 40)) as pilot:
        with source.lock:
            for step, step_time_s in enumerate(step_times_s, 1):
                source.state.ingest(envelope("step", {"step": step,
                                                      "step_time_s": step_time_s}))
        await until(pilot, lambda: "mean: step time" in "\n".join(
            shown_lines(app, "#timing")))
        await redrawn(app, pilot)  # at the laid-out size
        chart = "\n".join(shown_lines(app, "#timing"))
        assert ("off scale" in chart) == off_scale, chart
        top = chart.split("┤")[0].split("\n")[-1].strip()  # the axis' first label
        assert top == axis_top, chart


def _timed_step(step, step_time_s, data_wait_s):
    """A step record of 32 samples that took ``step_time_s``, ``data_wait_s`` of it waiting."""
    return envelope("step", {"step": step, "step_time_s": step_time_s,
                             "data_wait_s": data_wait_s, "samples_per_s": 32 / step_time_s},
                    seq=step)


async def test_step_time_and_throughput_are_means_over_the_recent_steps():
    """The timing chart's title and the throughput's number are the means of the latest
    steps that add up to 10 s (RECENT_S): a slow step weighs its share of them, it does
    not stand for the run; the steps before the window do not count."""
    assert state_module.RECENT_S == 10.0
    source, app = _silent_app()
    async with app.run_test(size=(120, 40)) as pilot:
        def title():
            return "\n".join(shown_lines(app, "#timing")).split("\n")[0]
        with source.lock:
            for step in range(1, 21):  # 1 s steps: before the window
                source.state.ingest(_timed_step(step, 1.0, 0.5))
            for step in range(21, 41):  # 20 x 0.5 s: the window, exactly
                source.state.ingest(_timed_step(step, 0.5, 0.004))
        await until(pilot, lambda: "mean:" in title())
        assert "10s mean: step time 500 ms | data wait 4.00 ms" in title(), title()
        assert text_of(app, "#throughput .value") == "10s mean 64.0 samples/s"
        with source.lock:  # a checkpoint's step: 2.5 s of the 10 with 15 steps of 0.5 s
            source.state.ingest(_timed_step(41, 2.5, 0.1))
        await until(pilot, lambda: "500 ms" not in title())
        # (15 x 0.5 + 2.5) / 16 s; (15 x 4 + 100) / 16 ms; 16 x 32 samples / 10 s
        assert "10s mean: step 625 ms | wait 10.0 ms | ▲ max 2.50 s off scale" in title(), (
            title())
        assert text_of(app, "#throughput .value") == "10s mean 51.2 samples/s"


async def test_step_time_over_fewer_kept_seconds_says_their_span():
    """Steps of 10, 10, 20 and 1,000 ms: 1.04 s in all, the window is every step, and
    the title says so; a record without a step time (or a NaN, or a negative one) is
    left out of the window and the run goes on."""
    source, app = _silent_app()
    async with app.run_test(size=(120, 40)) as pilot:
        with source.lock:
            for step, (step_time_s, wait_s) in enumerate(
                    [(0.01, 0.001), (0.01, 0.001), (0.02, 0.002), (1.0, 0.004)], 1):
                source.state.ingest(_timed_step(step, step_time_s, wait_s))
            for step, bad in enumerate([None, "nan", -1.0, float("nan")], 5):
                source.state.ingest(envelope("step", {
                    "step": step, "step_time_s": bad, "data_wait_s": 0.5,
                    "samples_per_s": 1e6}, seq=step))
        await until(pilot, lambda: "mean:" in "\n".join(shown_lines(app, "#timing")))
        title = "\n".join(shown_lines(app, "#timing")).split("\n")[0]
        # (10 + 10 + 20 + 1000) / 4 ms; (1 + 1 + 2 + 4) / 4 ms; 4 x 32 samples / 1.04 s
        assert "1s mean: step 260 ms | wait 2.00 ms | ▲ max 1.00 s off scale" in title, title
        assert text_of(app, "#throughput .value") == "1s mean 123 samples/s"
        assert source.state.steps[-1].step == 8


def test_recent_steps_add_up_to_the_window_from_the_newest():
    records = [state_module.StepRecord(step, time_s, None, None, rate, None)
               for step, time_s, rate in [(1, 9.0, 10.0), (2, None, 99.0), (3, 4.0, 20.0),
                                          (4, float("inf"), 99.0), (5, 6.0, None)]]
    recent = state_module.recent_steps(records)
    assert [record.step for record in recent.records] == [3, 5] and recent.span_s == 10.0
    assert recent.mean("step_time_s", 1e3) == 5000.0
    assert recent.rate("samples_per_s") == 20.0  # the step without a rate is left out
    empty = state_module.recent_steps([])
    assert empty == ([], 0.0) and empty.mean("loss") is None
    assert empty.rate("samples_per_s") is None
    longer = state_module.recent_steps([records[0], records[2], records[0]])  # 9 + 4 s
    assert longer.span_s == 13.0 and len(longer.records) == 2
    alone = state_module.recent_steps([records[2], records[2]._replace(step_time_s=65.2)])
    assert (recent.label, longer.label, alone.label,
            state_module.recent_steps([records[2]._replace(step_time_s=0.6)]).label) == (
                "10s mean", "10s mean", "1m05s mean", "600ms mean")


async def test_knob_change_lines_are_labelled_newest_first_where_they_fit():
    """Five changes at 120x40: the newest gets its label, as many others as fit without
    overlap, and the title says how many have none and where they are (no label at all
    for more than three changes before)."""
    source, app = _silent_app()
    async with app.run_test(size=(120, 40)) as pilot:
        with source.lock:
            knobs = {"accum_steps": 1}
            for step in range(1, 121):
                if step in (20, 45, 70, 90, 110):
                    knobs = {"accum_steps": knobs["accum_steps"] + 1}
                source.state.ingest(envelope("step", {"step": step, "step_time_s": 0.1,
                                                      "knobs": knobs}))
        await until(pilot, lambda: "no steps yet" not in "\n".join(
            shown_lines(app, "#timing")))
        await redrawn(app, pilot)  # at the laid-out size
        chart = "\n".join(shown_lines(app, "#timing"))
        labelled = [value for value in range(2, 7) if f"accum_steps={value}" in chart]
        assert labelled[-1] == 6 and len(labelled) >= 2, chart
        assert f"{5 - len(labelled)} more changes in events" in chart.split("\n")[0], chart


async def test_one_stall_does_not_flatten_the_step_time_chart():
    source, app = _silent_app()
    async with app.run_test(size=(120, 40)) as pilot:
        with source.lock:
            for step in range(1, 101):
                source.state.ingest(envelope("step", {
                    "step": step, "step_time_s": 1.5 if step == 50 else 0.020 + step * 1e-5,
                    "data_wait_s": 0.001, "loss": 2.0}))
        await until(pilot, lambda: "off scale" in "\n".join(shown_lines(app, "#timing")))
        await redrawn(app, pilot)  # at the laid-out size
        chart = "\n".join(shown_lines(app, "#timing"))
        assert "max 1.50 s off scale" in chart
        assert "▲" in chart.split("\n", 1)[1]  # the stall, marked at the axis' end
        y_labels = [line.split("┤")[0].strip().replace(",", "").split(" ")
                    for line in chart.splitlines() if "┤" in line]
        assert {unit for _, unit in y_labels} == {"ms"}, y_labels  # each with its unit
        assert max(float(value) for value, _ in y_labels) < 40, y_labels  # near 21 ms
        loss = "\n".join(shown_lines(app, "#loss"))
        assert "off scale" not in loss  # the loss chart shows every value


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_memory_panel_shows_a_checkpointing_toggle_on_a_cpu_run(size):
    source, app = _silent_app()
    async with app.run_test(size=size) as pilot:
        with source.lock:
            source.state.ingest(envelope("system", {"host_mem_total_bytes": 16 << 30}))
            for step in range(1, 121):  # measured every 20 steps, and after the toggle
                fields = {"activation_bytes": (18 << 20) if step <= 60 else (2 << 20)
                          } if step % 20 == 1 or step == 61 else {}
                source.state.ingest(envelope("step", {
                    "step": step, "host_rss_bytes": 400 << 20,
                    "knobs": {"checkpointing": step > 60}, **fields}))
        await until(pilot, lambda: "activ" in text_of(app, "#memory"))
        await redrawn(app, pilot)  # at the laid-out size
        lines = shown_lines(app, "#memory")
        activation = next(line for line in lines if "activ" in line)
        if size[0] >= 120:
            assert "activ 2.0 MiB was 18.0 MiB" in activation, lines
        else:
            assert "activ 2.0 MiB" in activation, lines
        if size[0] >= 120:  # under compile no value is measured: none is shown
            with source.lock:
                source.state.ingest(envelope("step", {
                    "step": 121, "host_rss_bytes": 400 << 20,
                    "knobs": {"checkpointing": True, "kernels": "compile"}}))
            await until(pilot, lambda: "activ - (compile)" in text_of(app, "#memory"))
        trend = next(line for line in lines if "█" in line)
        bars = trend.strip("│ ").split(" ")[-1]
        half = len(bars) // 2  # the first 60 steps at 18 MiB, the last 60 at 2 MiB
        assert set(bars[:half - 1]) == {"█"} and set(bars[half + 1:]) == {"▂"}, trend
        assert "no CUDA (CPU run)" in "\n".join(lines)


async def test_header_says_compiling_until_compiled_and_shows_agent_trouble():
    source, app = _silent_app()
    async with app.run_test(size=(80, 24)) as pilot:
        with source.lock:
            source.state.ingest(envelope("step", {"step": 5}))
            source.state.ingest(envelope("event", {
                "level": "info", "kind": "compiling", "knob": "kernels", "step": 6,
                "text": "compiling the model (first steps are slow)"}))
        # (the seconds so far: 0s unless the machine is too loaded to draw within 1 s)
        await until(pilot, lambda: re.search(r"● compiling… \d+s", text_of(app, "#header")))
        assert "dropped" not in text_of(app, "#header")
        with source.lock:
            source.state.ingest(envelope("heartbeat", {"step": 5, "records_dropped": 37,
                                                       "errors": 1}))
        await until(pilot, lambda: "dropped 37  agent errors 1" in text_of(app, "#header"))
        assert "● compiling…" in text_of(app, "#header")
        with source.lock:
            source.state.ingest(envelope("event", {"level": "info", "kind": "compiled",
                                                   "compile_time_s": 41.5,
                                                   "text": "compiled in 41.5 s"}))
        await until(pilot, lambda: "● live" in text_of(app, "#header"))
        assert "compiled in 41.5 s" in log_texts(app)
        assert "run is live" not in log_texts(app)  # the end of a compile is no comeback


async def test_a_run_compiling_before_the_dashboard_came_is_noted_live_once_it_steps():
    """A dashboard that comes while the run compiles (a system sample says so: no event
    in its log) notes "run is live" at the step that ends it, so that "waiting for ..." is
    not the newest line under the header's live (the log folds to one line at 24 rows);
    a compile it saw begin ends quietly (the compile's own event tells it)."""
    source, app = _silent_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: log_texts(app)[-1].startswith("waiting for"))
        with source.lock:
            source.state.ingest(envelope("system", {"compiling_graph": "0/1",
                                                    "compiling_graph_s": 12.0}))
        await until(pilot, lambda: "● compiling" in text_of(app, "#header"))
        assert log_texts(app)[-1].startswith("waiting for")
        with source.lock:
            source.state.ingest(envelope("step", {"step": 1}))
        await until(pilot, lambda: "● live" in text_of(app, "#header"))
        await until(pilot, lambda: log_texts(app)[-1] == "run is live")


@pytest.mark.parametrize("width", [60, 120])
async def test_the_header_keeps_the_whole_run_id_before_its_counts(width):
    """At 60 columns the counts of records dropped and of commands rejected give way
    (the agent's errors stay): the run id is whole; wider, everything is said."""
    source, app = _silent_app()
    async with app.run_test(size=(width, 20)) as pilot:
        with source.lock:
            source.state.ingest(envelope("step", {"step": 355}))
            source.state.ingest(envelope("heartbeat", {
                "step": 355, "records_dropped": 37, "errors": 1, "commands_rejected": 2}))
        await until(pilot, lambda: "step 355" in text_of(app, "#header"))
        header = text_of(app, "#header")
        assert f"run {RUN}" in header and "agent errors 1" in header, header
        counted = "dropped 37" in header and "rejected 2" in header
        assert counted == (width == 120), header


def _port(endpoint):
    return int(endpoint.rsplit(":", 1)[1])


@pytest.mark.parametrize("same_endpoints", [True, False])
async def test_gone_run_that_comes_back_is_live_again(make_agent, monkeypatch,
                                                      same_endpoints):
    monkeypatch.setattr(state_module, "GONE_AFTER_S", 0.5)
    first = make_agent()
    app = GpuwatchApp(LiveSource(first.info))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: "● live" in text_of(app, "#header"))
        first.stop()  # killed: no bye
        await until(pilot, lambda: "● gone" in text_of(app, "#header"))
        ports = ((_port(first.info.pub_endpoint), _port(first.info.cmd_endpoint))
                 if same_endpoints else None)
        second = make_agent(run_id=first.info.run_id, ports=ports)  # a new token
        await until(pilot, lambda: "● live" in text_of(app, "#header"))
        await until(pilot, lambda: app.source.info.token == second.info.token)
        assert f"run {first.info.run_id} restarted (pid {second.info.pid})" in " ".join(
            log_texts(app))
        await until(pilot, lambda: knows(app, "accum_steps"))
        await pilot.press("A", "A")
        command = await next_command(second)
        assert command["knob"] == "accum_steps" and command["token"] == second.info.token


async def test_lr_clip_and_checkpoint_keys_send_commands_and_the_panel_shows_them(make_agent):
    """l / L halve and double lr_scale, g turns clipping off and back on at its threshold,
    s sends checkpoint=now (each asks first); the knobs panel shows the learning rate
    the steps use and the clipping threshold with the last gradient norm."""
    agent = make_agent(knobs={"precision": "fp32", "lr_scale": 1.0, "max_grad_norm": 1.0,
                              "checkpoint": None},
                       step_fields={"lr": 3e-4, "grad_norm": 0.834})
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: knows(app, "max_grad_norm")
                    and "step" in text_of(app, "#header"))
        await until(pilot, lambda: "lr   0.000300" in text_of(app, "#knobs"))
        assert "clip 1 norm 0.834" in text_of(app, "#knobs")
        sent = []
        for key in ("l", "l", "L", "g", "g"):
            await pilot.press(key, key)
            command = await next_command(agent)
            sent.append((command["knob"], command["value"]))
        assert sent == [("lr_scale", 0.5), ("lr_scale", 0.25), ("lr_scale", 0.5),
                        ("max_grad_norm", 0.0), ("max_grad_norm", 1.0)]
        await until(pilot, lambda: "x0.5" in text_of(app, "#knobs"))
        await pilot.press("s")
        assert "checkpoint=now: save a checkpoint" in question_text(app)
        await pilot.press("n")  # any other key cancels
        await until(pilot, lambda: "checkpoint=now not sent" in log_texts(app))
        assert agent.commands.empty() and not app.query_one("#question").display
        await pilot.press("s", "enter")
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("checkpoint", "now")
        assert not app.query_one("#question").display


async def test_help_lists_every_binding_that_acts(make_agent):
    agent = make_agent(knobs=dict(EVERY_KNOB))
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: knows(app, "checkpointing"))
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        listed = help_text(app)
        for binding in app.BINDINGS:
            if binding.id.startswith("timeline."):  # a replay on a timeline's only
                assert binding.tooltip not in listed
            else:
                assert binding.description in listed and binding.tooltip in listed
        assert "^p" in listed
        panels = "\n".join(str(cell.content)
                           for cell in app.screen.query("#help-panels Static"))
        for text in ("step time & data wait", "inside the data loader's next()",
                     "activation memory", "input-bound", "compute-bound", "proc",
                     "▲", "knobs", "events"):  # each panel and what its numbers mean
            assert text in panels, text
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
    poorer = GpuwatchApp(LiveSource(make_agent(knobs={"accum_steps": 1}).info))
    async with poorer.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: knows(poorer, "accum_steps"))
        await pilot.press("question_mark")
        listed = help_text(poorer)
        assert "accum+" in listed and "precision" not in listed and "ckpt" not in listed
        assert "lr/2" not in listed and "clip" not in listed and "save" not in listed


@pytest.mark.parametrize("size", [(60, 20), (80, 24)])
async def test_the_help_text_keeps_a_column_clear_of_its_scrollbar(make_agent, size):
    """On a terminal too short for the help, each page leaves blank the column left of
    the scrollbar: a thumb against a word read as part of it (``flattening▄▄``)."""
    agent = make_agent(knobs=dict(EVERY_KNOB))
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: knows(app, "checkpointing"))
        await pilot.press("question_mark")
        box = app.screen.query_one("#help")
        await until(pilot, lambda: box.max_scroll_y > 0)
        while True:
            await pilot.pause()
            region = box.scrollable_content_region  # the scrollbar is right of it
            lines = screen_text(app).split("\n")
            beside = [lines[y][region.right - 1:region.right]
                      for y in range(region.y, region.bottom)]
            assert set("".join(beside)) <= {" "}, (box.scroll_y, beside)
            if box.scroll_y >= box.max_scroll_y:
                break
            before = box.scroll_y
            await pilot.press("pagedown")
            await until(pilot, lambda: box.scroll_y > before)


async def test_command_palette_runs_binding_commands(fake_agent):
    app = GpuwatchApp(LiveSource(fake_agent.info))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: knows(app, "precision"))
        await pilot.press("ctrl+p")
        await pilot.press(*"accum+")
        await until(pilot, lambda: "accum+" in str(app.screen.query("CommandList").first()
                                                   .get_option_at_index(0).prompt))
        await pilot.press("enter")  # the palette's enter runs it: it asks, as the key
        await until(pilot, lambda: "accum_steps 1 → 2" in question_text(app))
        assert "enter: send" in question_text(app) and "/enter" not in question_text(app)
        await pilot.press("enter")
        command = await next_command(fake_agent)
        assert (command["knob"], command["value"]) == ("accum_steps", 2)
        titles = [command.title for command in app.get_system_commands(app.screen)]
        assert titles and all(title.startswith("display: ") for title in titles), titles
        assert not {"display: Quit", "display: Keys", "display: Maximize"} & set(titles)
        await pilot.press("ctrl+p")  # with nothing typed: the run's commands first
        commands = app.screen.query("CommandList").first()
        await until(pilot, lambda: commands.option_count >= 10 and any(
            "display: Theme" in str(option.prompt) for option in commands.options))
        prompts = [str(option.prompt).split("\n")[0] for option in commands.options]
        first_display = next(i for i, prompt in enumerate(prompts) if "display: " in prompt)
        assert first_display >= 5 and all("display: " in prompt
                                          for prompt in prompts[first_display:]), prompts
        await pilot.press("backspace", *"theme")  # and found when typed
        await until(pilot, lambda: commands.option_count and "Theme" in str(
            commands.get_option_at_index(0).prompt))


def shown_lines(app, selector):
    """The lines a widget shows on screen, border included (what is cut is cut)."""
    widget = app.query_one(selector)
    return ["".join(segment.text for segment in strip)
            for strip in widget.render_lines(Region(0, 0, *widget.outer_size))]


H200 = {"index": 0, "name": "NVIDIA H200", "util_pct": 97.0, "mem_used_bytes": 70 << 30,
        "mem_total_bytes": 141 << 30, "power_w": 650.0, "power_limit_w": 700.0,
        "temp_c": 72.0, "sm_clock_mhz": 1980}
EVERY_KNOB = {"precision": "bf16", "accum_steps": 4, **LOADER, "kernels": "eager",
              "checkpointing": False, "lr_scale": 1.0, "weight_decay": 0.0,
              "max_grad_norm": 1.0, "checkpoint": None, "pause": None,
              "stop": None, "evaluate": None}


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_terminal_sizes_render_every_panel(make_agent, size):
    agent = make_agent(gpus=[H200], knobs=dict(EVERY_KNOB), step_fields={
        "input_verdict": "partly input-bound", "data_wait_share_window": 0.31,
        "num_alloc_retries": 3, "num_ooms": 1})
    app = GpuwatchApp(LiveSource(agent.info))
    width, height = size
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: "GPU NVIDIA H200" in text_of(app, "#system")
                    and "proc 98%" in text_of(app, "#system")
                    and "accum_steps" in text_of(app, "#knobs")
                    and "31%" in text_of(app, "#data" if width >= 100 else "#knobs"))
        await until(pilot, lambda: app.query_one("#panels").size.width == width)
        await redrawn(app, pilot)  # at the laid-out size
        assert "0  97% 70/141G 650/700W 72°C 1980MHz" in text_of(app, "#system")
        # under 100 columns the data panel folds, under 32 rows the event log
        for widget in ("#header", "#timing", "#loss", "#throughput", "#memory",
                       "#system", *(("#data",) if width >= 100 else ()), "#knobs",
                       "#log" if height >= 32 else "#last"):
            region = app.query_one(widget).region
            assert region.width > 0 and region.height > 0, widget
            assert region.bottom <= height - 1, widget  # above the footer
        shown = {selector: "\n".join(shown_lines(app, selector))
                 for selector in ("#memory", "#system", "#data", "#knobs")}
        memory = (("alloc 5.0/141.0 GiB (4%)", "rsvd  6.0/141.0 GiB (4%)",
                   "peak  7.0/141.0 GiB (5%)", "RSS 700.0 MiB", "OOMs 1  retries 3")
                  if width >= 120 else
                  ("alloc  5.0 GiB  4%", "rsvd   6.0 GiB  4%", "peak   7.0 GiB  5%",
                   "RSS 700.0 MiB"))
        for text in (*memory, "─ 1 OOMs"):  # the border says it at any size
            assert text in shown["#memory"], (text, shown["#memory"])
        assert "CPU 12% proc 98%" in shown["#system"]
        if width >= 100:
            for text in ("partly input-bound", "wait 31% ▂"):
                assert text in shown["#data"], (text, shown["#data"])
        else:  # the verdict heads the knobs' data group
            assert "data wait 31%" in shown["#knobs"], shown["#knobs"]
        # every knob, under its group
        for text in ("numerics", "precision", "bf16", "accum_steps", "kernels & memory",
                     "kernels", "eager", "checkpointing off", "data", "num_workers",
                     "pin_memory", "prefetch_factor 2", "optimizer", "lr", "x1",
                     "clip 1", "weight_decay"):
            assert text in " ".join(shown["#knobs"].split()), (text, shown["#knobs"])
        assert "…" not in shown["#data"] + shown["#knobs"]
        assert "checkpoint " not in shown["#knobs"]  # a command, not a setting
        footer = app.query_one(KeyBar)
        assert footer.region.y == height - 1
        line = footer_line(app)
        assert len(line) <= width, line
        assert line.removesuffix("^p palette").split() == [  # every key in sight
            "?", "help", "q", "quit", ":", "cmd", "p", "prec", "aA", "accum", "wW", "work",
            "m", "pin", "k", "kern", "c", "ckpt", "lL", "lr", "g", "clip"], line
        def timing_title():
            return app.query_one("#timing").render().plain.split("\n")[0]
        # what, over when, in what unit: once a second of steps is in (before it, "690ms
        # mean" may leave no room for the data wait at 80 columns: a loaded machine's)
        await until(pilot, lambda: re.search(
            r"\ds mean: step (time )?[\d.]+ ms \| (data )?wait [\d.]+ ms", timing_title()))
        assert "loss" in app.query_one("#loss").render().plain
        assert "samples/s" in text_of(app, "#throughput .value")


async def test_header_names_a_straggling_rank(make_agent):
    run_id = "20250101-000000-ee77"
    first = make_agent(run_id=run_id, rank=0, world_size=2,
                       step_fields={"step_time_s": 0.020})
    make_agent(run_id=run_id, rank=1, world_size=2, step_fields={"step_time_s": 0.030})
    app = GpuwatchApp(LiveSource(first.info))
    async with app.run_test(size=(160, 40)) as pilot:
        await until(pilot, lambda: "rank 1 slowest +50%" in text_of(app, "#header"))
        assert "(rank 0 of 2, rank 1 slowest +50%)" in text_of(app, "#header")
        assert "DIFFER" not in text_of(app, "#header")
        assert {r.step_time_s for r in app.source.state.steps} == {0.020}  # rank 0's


async def test_header_says_first_when_ranks_train_with_different_knobs(make_agent):
    run_id = "20250101-000000-ff88"
    first = make_agent(run_id=run_id, rank=0, world_size=2, knobs={"accum_steps": 1})
    make_agent(run_id=run_id, rank=1, world_size=2, knobs={"accum_steps": 2})
    app = GpuwatchApp(LiveSource(first.info))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: "KNOBS DIFFER" in text_of(app, "#header"))
        header = text_of(app, "#header")
        # first (the dashboard's own name gives way when the header does not fit)
        assert header.removeprefix("gpuwatch  ").startswith("KNOBS DIFFER at step ")
        assert "accum_steps 1 (rank 0) vs 2 (rank 1)" in header


async def test_a_tiny_terminal_keeps_the_header_and_footer_in_view(make_agent):
    agent = make_agent(knobs=dict(EVERY_KNOB))
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(60, 15)) as pilot:
        await until(pilot, lambda: "step" in text_of(app, "#header")
                    and "accum_steps" in text_of(app, "#knobs") and knows(app, "precision"))
        assert app.screen.max_scroll_y == 0  # nothing to scroll: all of it fits
        assert app.query_one("#header").region.y == 0
        assert app.query_one(KeyBar).region.y == 14
        assert app.query_one("#charts").region.height >= 4
        assert not app.query_one("#log").display  # events: `gpuwatch tail`
        await pilot.press("p", "p")  # keys still work
        command = await next_command(agent)
        assert command["knob"] == "precision"


@pytest.mark.parametrize("size", [(60, 20), (80, 24), (120, 40)])
async def test_the_last_event_line_keeps_a_checkpoints_file_name(make_agent, monkeypatch,
                                                                 size):
    """A checkpoint's path on the one-line last event keeps its file name (what
    ``--resume`` needs): its middle goes, the home reads ``~``; the event log keeps it
    whole."""
    monkeypatch.setenv("HOME", "/home/newcomer")
    path = ("/home/newcomer/.local/share/gpuwatch/checkpoints/20261203-070202-030d/"
            "step-00000092.pt")
    text = f"checkpoint=now applied at step 93: saved after step 92 to {path} (1.7 MiB in 0.02 s)"
    agent = make_agent(knobs=dict(EVERY_KNOB))
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: knows(app, "precision"))
        # (the line shows the newest entry: the status's "run is live" came after the
        # event now and then, and the path was gone from the line; a redraw that shows
        # the run live has logged that note if there was one: a first draw of a run
        # already live logs none, as under two CPU burners)
        await until(pilot, lambda: "● live" in text_of(app, "#header"))
        agent.publish("event", {"level": "info", "text": text})
        await until(pilot, lambda: text in log_texts(app))
        if app.query_one("#log").display:  # tall enough for the log: it shows it whole
            await until(pilot, lambda: path in "".join(
                line.text for line in app.query_one("#log").lines))
        else:
            await until(pilot, lambda: "step-00000092.pt" in text_of(app, "#last"))
            shown = shown_lines(app, "#last")[0]
            assert "…/step-00000092.pt" in shown, shown
            assert len(shown.rstrip()) <= size[0]
            words = shown.split("… ")[0].lstrip("▸ ").split()  # (whole words only)
            assert words == text.split()[:len(words)], shown


def test_applied_event_updates_the_knob_before_the_next_step_record():
    # a key pressed again before that step record arrives must start from the new value
    state = RunState()
    state.ingest(envelope("step", {"step": 1, "knobs": {"precision": "bf16"}}), 1.0)
    state.note_pending("precision", "fp16", 3)
    state.ingest(envelope("event", {"kind": "applied", "knob": "precision", "value": "fp16",
                                    "step": 3, "text": "precision=fp16 applied at step 3"}),
                 2.0)
    assert state.knobs["precision"] == "fp16" and state.pending == {}


@pytest.mark.parametrize("size", [(60, 20), (80, 24), (120, 40)])
async def test_every_size_keeps_header_feedback_knobs_and_quit_in_view(make_agent, size):
    """The layout folds by priority: the header (live state, step, run), the answer to
    the last key, the knobs and q stay in view; charts and the other panels give way."""
    agent = make_agent(knobs=dict(EVERY_KNOB))
    app = GpuwatchApp(LiveSource(agent.info))
    width, height = size
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: knows(app, "precision") and knows(app, "kernels"))
        await until(pilot, lambda: app.query_one("#panels").size.width == width)
        await pilot.press("p", "p")
        await next_command(agent)
        await redrawn(app, pilot)  # at the laid-out size
        assert app.screen.max_scroll_y == 0
        header = shown_lines(app, "#header")[0]
        assert "● live" in header and "step " in header and agent.run_id in header, header
        assert app.query_one(KeyBar).region.y == height - 1
        assert footer_line(app).startswith(" ? help") and "q quit" in footer_line(app)
        knobs = "\n".join(shown_lines(app, "#knobs"))
        for text in ("precision", "accum_steps", "lr", "clip"):
            assert text in knobs, knobs
        assert "precisi…" not in knobs
        feedback = "precision=fp16"  # sent, accepted or applied (EVERY_KNOB has bf16)
        if height < 32:  # the log folds into its newest line
            assert not app.query_one("#log").display
            assert feedback in "".join(shown_lines(app, "#last"))
        else:
            log = app.query_one("#log")
            assert any(feedback in line for line in shown_lines(app, "#log")) or any(
                feedback in line.text for line in log.lines[int(log.scroll_y):])
        for widget in ("#timing", "#loss"):
            assert app.query_one(widget).region.height >= 4, widget


def test_the_footer_folds_whole_keys_from_the_last():
    items = [KeyItem("?", "help"), KeyItem("q", "quit"), KeyItem("aA", "accum"),
             KeyItem("g", "clip")]
    # 26 columns of keys, a margin at each end, 2 columns between keys where they fit
    assert fold(items, 46) == (items, 2, True)  # and ^p palette: 12 columns more
    assert fold(items, 45) == (items, 2, False)
    assert fold(items, 34) == (items, 2, False)
    assert fold(items, 33) == (items, 1, False)  # tighter before a key goes
    assert fold(items, 31) == (items, 1, False)
    assert fold(items, 30) == (items[:3], 1, False)  # never "g cl"
    assert fold(items, 5) == ([], 1, False)


@pytest.mark.slow
async def test_one_footer_at_every_size_and_under_every_screen(make_agent):
    """Resized 60x20 -> 120x40 -> 80x24, and with the help, search and runs screens
    open: the same keys in the same order, the tail folded whole (never a word cut),
    laid out for the new width at once."""
    agent = make_agent(knobs=dict(EVERY_KNOB))
    app = GpuwatchApp(LiveSource(agent.info))
    every = "? help q quit : cmd p prec aA accum wW work m pin k kern c ckpt lL lr g clip".split()
    async with app.run_test(size=(60, 20)) as pilot:
        await until(pilot, lambda: knows(app, "precision") and knows(app, "kernels"))
        lines = {}
        for size in ((60, 20), (120, 40), (80, 24)):
            await pilot.resize_terminal(*size)
            await until(pilot, lambda: app.size == size)
            await pilot.pause()
            lines[size] = footer_line(app)
            for screen in (HelpScreen(), TuneScreen(), RunsScreen()):
                app.push_screen(screen)
                await pilot.pause()
                assert footer_line(app) == lines[size]
                app.pop_screen()
                await pilot.pause()
        for (width, _), line in lines.items():
            words = line.removesuffix("^p palette").split()
            assert len(line) <= width and words == every[:len(words)], line
            assert words[-1] in every[1::2], line  # a description, whole
        assert lines[(120, 40)].split() == [*every, "^p", "palette"]
        assert lines[(80, 24)].split() == every
        assert lines[(60, 20)].split()[-2:] == ["k", "kern"]


@pytest.mark.slow
async def test_command_line_sends_a_typed_value_with_completion_from_the_schema(make_agent):
    agent = make_agent(knobs={"precision": "fp32", "accum_steps": 1, "kernels": "eager"})
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: knows(app, "accum_steps") and knows(app, "kernels"))
        assert "colon" in shown_keys(app)
        await pilot.press("colon")
        line = app.query_one("#command")
        assert line.display and app.focused is line
        await pilot.press(*"acc", "tab")  # completed from the run's schema
        await until(pilot, lambda: line.value == "accum_steps=")
        await pilot.press("8", "enter")
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("accum_steps", "8")  # as `set`
        assert not line.display and app.focused is not line
        await until(pilot, lambda: "accum_steps 8" in " ".join(
            text_of(app, "#knobs").split()))
        await pilot.press("colon", *"kernels=c", "tab")  # a choice's value completes too
        await until(pilot, lambda: line.value == "kernels=compile")
        await pilot.press("escape")  # closes unsent
        assert not line.display and agent.commands.empty()
        await pilot.press("colon", *"nonsense", "enter")
        assert "expected KNOB=VALUE, got 'nonsense'; nothing sent" in log_texts(app)
        await pilot.press("colon", *"accum_steps=zero", "enter")  # the run checks it
        command = await next_command(agent)
        await until(pilot, lambda: any(text.startswith("rejected: accum_steps")
                                       for text in log_texts(app)))


@pytest.mark.slow
async def test_command_line_replies_as_gpuwatch_set(make_agent, capsys):
    from gpuwatch.cli import main
    agent = make_agent(knobs={"accum_steps": 1})
    assert main(["set", "accum_steps=zero", "--run", agent.run_id]) == 1
    refused = capsys.readouterr().err.strip()
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: knows(app, "accum_steps"))
        await pilot.press("colon", *"accum_steps=zero", "enter")
        await until(pilot, lambda: refused in log_texts(app))


def test_state_keeps_how_long_each_compile_took():
    state = RunState()
    state.ingest(envelope("event", {"kind": "compiling", "text": "compiling the model"}),
                 10.0)
    state.ingest(envelope("event", {"kind": "compiled", "text": "compiled"}, seq=1), 94.0)
    state.ingest(envelope("event", {"kind": "compiling", "text": "compiling"}, seq=2),
                 100.0)
    assert state.compile_durations_s == [84.0] and state.compiling_since == 100.0


def test_a_recompile_no_event_announced_is_compiling_from_the_system_sample():
    state = RunState()
    state.ingest(envelope("step", {"step": 5}), 10.0)
    state.ingest(envelope("system", {"compiling_graph": "0/2", "compiling_graph_s": 12.0,
                                     "compiling_graph_kind": "forward",
                                     "graphs_compiled": 4}, seq=1), 20.0)
    assert state.status_at(20.5) == "compiling" and state.compiling_since == 8.0
    assert state.compile_graph == {"graph": "0/2", "kind": "forward", "number": 1}
    state.ingest(envelope("system", {"cpu_pct": 50.0}, seq=2), 21.0)
    assert state.compile_graph is None  # the sample says nothing compiles now
    state.ingest(envelope("step", {"step": 6}, seq=3), 22.0)  # the compile's step
    assert state.status_at(22.0) == "live" and state.compile_durations_s == [14.0]


def _compiling_for(text: str, since: float) -> bool:
    """Whether ``text`` says "compiling… Ns of ~1m24s, graph 1 [0/1 backward]" with N
    the 30 s the compile had run at monotonic time ``since`` plus the whole seconds
    since (a redraw a second late under load reads 31s: the exact "30s" never came)."""
    found = re.search(r"compiling… (\d+)s of ~1m24s, graph 1 \[0/1 backward\]", text)
    return found is not None and 30 <= int(found.group(1)) <= 31 + time.monotonic() - since


async def test_compile_shows_its_time_so_far_the_last_compile_and_the_compiler_cpu():
    source, app = _silent_app()
    async with app.run_test(size=(120, 40)) as pilot:
        with source.lock:
            now = time.monotonic()
            source.state.ingest(envelope("step", {"step": 1}), now - 200)
            source.state.ingest(envelope("event", {"kind": "compiling", "step": 2}, seq=1),
                                now - 190)
            source.state.ingest(envelope("event", {"kind": "compiled"}, seq=2), now - 106)
            source.state.ingest(envelope("event", {"kind": "compiling", "step": 9}, seq=3),
                                now - 30)
            source.state.ingest(envelope("system", {
                "cpu_pct": 99.0, "process_cpu_pct": 38.0, "children_cpu_pct": 350.0,
                "compiling_graph": "0/1", "compiling_graph_kind": "backward",
                "compiling_graph_s": 4.0, "graphs_compiled": 7}, seq=4), now)
        # the time so far against the run's last compile, and which graph
        await until(pilot, lambda: _compiling_for(text_of(app, "#header"), now))
        with source.lock:
            source.state.ingest(envelope("system", {
                "cpu_pct": 99.0, "process_cpu_pct": 38.0, "children_cpu_pct": 350.0,
                "compiling_graph": "1/0", "compiling_graph_kind": "forward",
                "compiling_graph_s": 1.0, "graphs_compiled": 9}, seq=5), now)
        await until(pilot, lambda: "graph 3 [1/0 forward]" in text_of(app, "#header"))
        # the compiler's processes count in the host panel (torch.compile's workers)
        await until(pilot, lambda: "CPU 99% proc 388%\n  children 350%" in text_of(app, "#system"))


async def test_the_header_names_the_step_the_charts_end_at():
    # the agent's heartbeat names the step it completed before that step's record is
    # sent (once measured): the header said step 5 over charts that end at step 4
    from tests.test_whole_run import _timing_lines  # (it imports this module)

    source, app = _silent_app()
    async with app.run_test(size=(80, 24)) as pilot:
        with source.lock:
            source.state.ingest(envelope("heartbeat", {"step": 1}))
        await until(pilot, lambda: "step 1 " in text_of(app, "#header"))  # no record yet
        with source.lock:
            for step in range(1, 5):
                source.state.ingest(envelope("step", {"step": step, "step_time_s": 0.1},
                                             seq=step))
            source.state.ingest(envelope("heartbeat", {"step": 5}, seq=5))
        await until(pilot, lambda: _timing_lines(app)[-1].split()[-1:] == ["4"])
        await redrawn(app, pilot)
        assert "step 4 " in text_of(app, "#header")


async def test_at_80_columns_a_compiles_progress_has_a_line_of_its_own():
    # the header at 80 columns had room for "compiling… 30s" alone: not the estimate,
    # nor the graph; the line above the keys shows them whole
    source, app = _silent_app()
    async with app.run_test(size=(80, 24)) as pilot:
        with source.lock:
            now = time.monotonic()
            source.state.ingest(envelope("hello", {"name": "demo-transformer",
                                                   "device": "cpu"}), now - 200)
            source.state.ingest(envelope("step", {"step": 1}, seq=1), now - 200)
            source.state.ingest(envelope("event", {"kind": "compiling", "step": 2}, seq=2),
                                now - 190)
            source.state.ingest(envelope("event", {"kind": "compiled"}, seq=3), now - 106)
            source.state.ingest(envelope("event", {"kind": "compiling", "step": 9}, seq=4),
                                now - 30)
            source.state.ingest(envelope("system", {
                "compiling_graph": "0/1", "compiling_graph_kind": "backward",
                "compiling_graph_s": 4.0, "graphs_compiled": 7}, seq=5), now)
        await until(pilot, lambda: text_of(app, "#last").startswith("▸ ")
                    and _compiling_for(text_of(app, "#last"), now))
        header = text_of(app, "#header")
        assert re.search(r"● compiling… \d+s ", header) and "run 20250101-000000-abcd" in header
        assert len(header) <= 78  # (in its width: nothing cut)
        with source.lock:  # compiled: the line has the newest entry again
            source.state.ingest(envelope("step", {"step": 9}, seq=6), time.monotonic())
        await until(pilot, lambda: "compiling" not in text_of(app, "#last"))


async def test_throughput_shows_a_speed_up_that_a_few_fast_steps_do_not_hide():
    # before: 100 samples/s with a fast step (a prefetched batch) in five; after: 300
    source, app = _silent_app()
    async with app.run_test(size=(80, 24)) as pilot:
        with source.lock:
            for step in range(1, 201):
                rate = (2000.0 if step % 5 == 0 else 100.0) if step <= 100 else 300.0
                source.state.ingest(envelope("step", {"step": step, "samples_per_s": rate,
                                                      "step_time_s": 32 / rate}))
        await until(pilot, lambda: "300 samples/s" in text_of(app, "#throughput .value"))
        await redrawn(app, pilot)  # at the laid-out size
        bars = text_of(app, "#throughput .spark").split()[-1]
        from gpuwatch.widgets.panel import SPARK_BARS
        levels = [SPARK_BARS.index(bar) for bar in bars if bar in SPARK_BARS]
        half = len(levels) // 2
        assert max(levels[:half - 1]) < min(levels[half + 1:]), bars


async def test_memory_and_throughput_count_one_step_in_the_singular():
    source, app = _silent_app()
    async with app.run_test(size=(200, 50)) as pilot:
        with source.lock:
            source.state.ingest(envelope("step", {"step": 1, "samples_per_s": 50.0,
                                                  "step_time_s": 0.64,
                                                  "host_rss_bytes": 400 << 20}))
        await until(pilot, lambda: "samples/s" in text_of(app, "#throughput .value"))
        await redrawn(app, pilot)  # at the laid-out size
        assert text_of(app, "#throughput .spark").startswith("1 step "), text_of(
            app, "#throughput .spark")
        assert "last 1 step " in text_of(app, "#memory") and "1 steps" not in text_of(
            app, "#memory")


async def test_an_evaluation_reads_as_evaluating_and_its_answer_stays_on_the_line():
    """At 80x24 (one line of events): while evaluate=now holds the run the header says
    evaluating, and once it applied its metrics stay the line, no "run is live" over
    them."""
    source, app = _silent_app()
    async with app.run_test(size=(80, 24)) as pilot:
        with source.lock:  # the last step came a stall's interval ago (no wait for it)
            source.state.ingest(envelope("step", {"step": 102, "step_time_s": 0.1}),
                                time.monotonic() - STALLED_AFTER_S - 0.1)
            source.state.ingest(envelope("event", {
                "kind": "accepted", "knob": "evaluate", "value": "now", "step": 103,
                "text": "evaluate=now accepted, applies at step 103"}))

        def heard_and_evaluating():  # heartbeats go on while it evaluates
            with source.lock:
                source.state.ingest(envelope("heartbeat", {"step": 102}))
            return "● evaluating" in text_of(app, "#header")
        await until(pilot, heard_and_evaluating)
        await until(pilot, lambda: "run is evaluating after step 102 (evaluate=now): no "
                    "optimizer step until it ends" in log_texts(app))
        with source.lock:
            source.state.ingest(envelope("event", {
                "kind": "evaluation", "step": 102, "metrics": {"val_loss": 0.412},
                "text": "evaluation at step 102: val_loss=0.412"}))
            source.state.ingest(envelope("event", {
                "kind": "applied", "knob": "evaluate", "value": "now", "step": 103,
                "text": "evaluate=now applied at step 103: val_loss=0.412"}))
            source.state.ingest(envelope("step", {"step": 103, "step_time_s": 0.1}))
        await until(pilot, lambda: "● live" in text_of(app, "#header"))
        await redrawn(app, pilot)
        assert "evaluate=now applied at step 103: val_loss=0.412" in text_of(app, "#last")
        texts = log_texts(app)
        after = texts[next(index for index, line in enumerate(texts)
                           if line.startswith("run is evaluating")):]
        assert not [line for line in texts if "stalled" in line], texts
        assert "run is live" not in after, texts  # (it was, once, as it connected)


async def test_header_and_log_say_paused_after_which_step_not_stalled():
    source, app = _silent_app()
    async with app.run_test(size=(80, 24)) as pilot:
        with source.lock:
            source.state.ingest(envelope("step", {"step": 102, "step_time_s": 0.1}))
        await until(pilot, lambda: "● live" in text_of(app, "#header"))
        with source.lock:
            source.state.ingest(envelope("event", {"kind": "applied", "knob": "pause",
                                                   "value": "on", "step": 103}))

        def heard_and_paused():  # heartbeats go on while the run is held
            with source.lock:
                source.state.ingest(envelope("heartbeat", {"step": 102}))
            return "● paused" in text_of(app, "#header")
        await until(pilot, heard_and_paused)
        await until(pilot, lambda: "run is paused after step 102: P lets it go on"
                    in log_texts(app))
        assert not any("stalled" in line for line in log_texts(app))
        assert "stalled" not in text_of(app, "#header")
        # let go: the wait for its next step starts now, not at its step before the pause
        with source.lock:
            source.state.ingest(envelope("event", {"kind": "applied", "knob": "pause",
                                                   "value": "off", "step": 103}))
            source.state.ingest(envelope("heartbeat", {"step": 102}))
        await until(pilot, lambda: "● live" in text_of(app, "#header"))
        assert not any("stalled" in line for line in log_texts(app))
        # pause=off's applied event says it goes on: no "run is live" over it
        texts = log_texts(app)
        assert "run is live" not in texts[texts.index(
            "run is paused after step 102: P lets it go on"):], texts


# --- keys that change the run ----------------------------------------------------------

#: Textual's names of the characters typed in the tests below.
KEY_NAMES = {":": "colon", "=": "equals_sign", "_": "underscore"}


def burst(app, *keys):
    """Hand ``keys`` to the app at once, as its terminal driver does with what it read in
    one go (typed ahead while the app was busy, or pasted): every key is queued before
    the app takes the first (``pilot.press`` waits for the app after each key)."""
    for key in keys:
        character = {"enter": "\r", "escape": "\x1b"}.get(key, key)
        app.post_message(events.Key(KEY_NAMES.get(key, key), character))


#: A run whose keys a burst of ``:cpu_threads=1`` would press, were they shortcuts: c
#: checkpointing, p precision, t the search's screen, r runs, a accum_steps, s save.
SHORTCUT_KNOBS = {"precision": "fp32", "accum_steps": 2, "checkpointing": False,
                  "cpu_threads": 2, "checkpoint": None}


@pytest.mark.parametrize("how", ["pilot", "burst"])
async def test_text_typed_after_a_colon_goes_to_the_command_line_however_fast(make_agent,
                                                                               how):
    agent = make_agent(knobs=dict(SHORTCUT_KNOBS))
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: knows(app, "cpu_threads") and knows(app, "precision"))
        if how == "pilot":
            await pilot.press(*":cpu_threads=1", "enter")
        else:
            burst(app, *":cpu_threads=1", "enter")
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("cpu_threads", "1")
        await until(pilot, lambda: "cpu_threads=1 applied at step" in " ".join(
            log_texts(app)))
        assert agent.knobs == {"precision": "fp32", "accum_steps": 2,
                               "checkpointing": False, "cpu_threads": 1}
        assert agent.commands.empty()  # nothing else was sent ...
        assert [text for text in log_texts(app)  # ... asked, or said
                if not text.startswith(("waiting for", "run is live", "events before"))] == [
            "sent cpu_threads=1", *(t for t in log_texts(app) if t.startswith(
                "cpu_threads=1 accepted")), *(t for t in log_texts(app) if t.startswith(
                    "cpu_threads=1 applied"))]
        assert app.screen is app.screen_stack[0] and not question_text(app)
        assert not app.query_one("#command").display and app.focused is None


async def test_the_question_of_a_key_takes_one_line_at_60_columns(make_agent):
    agent = make_agent(knobs={"precision": "fp32"})
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(60, 20)) as pilot:
        await until(pilot, lambda: knows(app, "precision"))
        await pilot.press("p")
        assert question_text(app) == ("? precision fp32 → bf16 at the next step  "
                                      "p: yes  esc: no")
        await pilot.pause()
        assert app.query_one("#question").size.height == 1
        await pilot.press("p")  # and its key still sends
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("precision", "bf16")


async def test_a_key_that_changes_the_run_asks_and_its_key_again_or_enter_sends(
        make_agent):
    agent = make_agent(knobs={"precision": "fp32", "accum_steps": 1,
                              "checkpointing": False})
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(80, 24)) as pilot:
        # (the header's live and the log's "run is live", if any, come in one redraw; a
        # first draw of a run already live logs none): no line of the run's after
        await until(pilot, lambda: knows(app, "precision") and knows(app, "checkpointing")
                    and "● live" in text_of(app, "#header"))
        await pilot.press("p")  # what it will do, and which keys answer
        assert question_text(app) == ("? precision fp32 → bf16 at the next step  "
                                      "p/enter: send  esc: cancel")
        await pilot.press("escape")
        assert log_texts(app)[-1] == "precision=bf16 not sent" and not question_text(app)
        await pilot.press("p", "A")  # another key cancels, then does what it does
        assert "precision=bf16 not sent" in log_texts(app)[-1:]
        assert question_text(app).startswith("? accum_steps 1 → 2 at the next step")
        await pilot.press("A")
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("accum_steps", 2)
        await until(pilot, lambda: "accum_steps=2 applied at step" in " ".join(
            log_texts(app)))
        await pilot.press("c", "enter")
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("checkpointing", True)
        await pilot.press("question_mark")  # help says how the keys confirm
        assert "the same key again or enter sends" in str(
            app.screen.query_one("#help-asks").content)
        await pilot.press("escape")
        await app.workers.wait_for_complete()
    assert agent.commands.empty()  # precision never went


async def test_a_key_typed_ahead_of_its_question_never_answers_it(make_agent):
    agent = make_agent(knobs={"precision": "fp32", "checkpointing": False})
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: knows(app, "precision") and knows(app, "checkpointing")
                    and "● live" in text_of(app, "#header"))  # (as above)
        burst(app, "p", "p", "c", "enter")  # a double press and an enter, in one burst
        await until(pilot, lambda: "checkpointing=on not sent: ⏎ was typed ahead of the "
                    "question" in log_texts(app))
        unsent = [text for text in log_texts(app) if "not sent" in text]  # the run's own
        assert unsent[-3:] == [  # lines may come between: the second p cancelled, asked again
            "precision=bf16 not sent: p was typed ahead of the question",
            "precision=bf16 not sent",  # by c
            "checkpointing=on not sent: ⏎ was typed ahead of the question"]
        assert not question_text(app)
        burst(app, "p", "p")  # the second p asks again: pressed after it, p sends
        await until(pilot, lambda: question_text(app).startswith("? precision fp32 → bf16"))
        await pilot.press("p")
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("precision", "bf16")
        await app.workers.wait_for_complete()
    assert agent.commands.empty()


async def test_T_asks_on_the_dashboard_even_from_the_search_screen(make_agent):
    agent = make_agent(knobs={"precision": "fp32"})
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: knows(app, "precision"))
        await pilot.press("t")
        assert isinstance(app.screen, TuneScreen)
        await pilot.press("T")  # the question is the dashboard's
        assert not isinstance(app.screen, TuneScreen)
        assert question_text(app).startswith("? tune: start a search  T/enter: send")
        await pilot.press("T")  # sent: the search's screen opens again
        command = await next_command(agent)
        assert command["knob"] == protocol.TUNE
        assert isinstance(app.screen, TuneScreen)


async def test_the_footers_run_keys_act_under_the_search_and_help_screens(make_agent):
    agent = make_agent(knobs={"precision": "fp32", "pause": "on"})
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: "pause" in app.source.state.schema)
        for opens, screen in (("t", TuneScreen), ("question_mark", HelpScreen)):
            await pilot.press(opens)
            assert isinstance(app.screen, screen)
            await pilot.press("P")  # the screen closes: the question is in view
            assert not isinstance(app.screen, screen)
            assert question_text(app).startswith("? pause"), question_text(app)
            await pilot.press("P")
            command = await next_command(agent)
            assert (command["knob"], command["value"]) == ("pause", "on")
            await until(pilot, lambda: app.source.state.paused_after is not None)
            with app.source.lock:  # (the fake run holds nothing: let it go on)
                app.source.state.paused_after = None
        await pilot.press("question_mark", "q")  # the help's own keys stay its own
        assert app.screen is app.screen_stack[0] and not question_text(app)
    assert agent.commands.empty()


async def test_quick_keys_send_at_once(make_agent, monkeypatch):
    agent = make_agent(knobs={"precision": "fp32"})
    monkeypatch.setenv(QUICK_KEYS_ENV, "1")
    app = GpuwatchApp(LiveSource(agent.info))
    assert app.quick_keys and not GpuwatchApp(LiveSource(agent.info),
                                              quick_keys=False).quick_keys
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: knows(app, "precision"))
        await pilot.press("p")
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("precision", "bf16")
        assert not question_text(app)
        await pilot.press("question_mark")
        assert "send at once" in str(app.screen.query_one("#help-asks").content)


FP16_WARNING = ("precision=fp16 accepted, applies at step 12 (warning: fp16 autocast on CPU "
                "is typically 10-20x slower than fp32 (no native fp16 matmul); this CPU "
                "has no native bf16 either (no AVX512-BF16/AMX): prefer fp32)")


def last_lines(app):
    """The last-event line's rows as shown ("" when it is not in view)."""
    widget = app.query_one("#last")
    return "\n".join(line.rstrip() for line in shown_lines(app, "#last")) \
        if widget.display else ""


@pytest.mark.parametrize("size", [(60, 20), (80, 24), (120, 40)])
async def test_a_warning_stays_on_screen_until_a_few_seconds_after_the_next_key(size):
    source, app = _silent_app()
    shown_at = time.monotonic()
    source.now = lambda: shown_at  # the run stays live: no status change is logged
    async with app.run_test(size=size) as pilot:
        with source.lock:
            source.state.ingest(envelope("step", {"step": 11}), shown_at)
        await until(pilot, lambda: "run is live" in log_texts(app))
        with source.lock:
            source.state.ingest(envelope("event", {"level": "warning",
                                                   "text": FP16_WARNING}))
            for step in (12, 13):  # the next events: the warning stays, whole
                source.state.ingest(envelope("event", {
                    "level": "info", "text": f"checkpoint saved at step {step}"}))
        await until(pilot, lambda: "prefer fp32)" in last_lines(app))
        shown = " ".join(last_lines(app).replace("▸", " ").split())
        assert shown.startswith(FP16_WARNING), shown  # every word of it ...
        assert "checkpoint saved" not in shown  # ... and no newer event until a key
        assert app.screen.max_scroll_y == 0  # nothing pushed out of view
        clock_s = shown_at
        app.query_one(LastEvent).now = lambda: clock_s  # the hold's clock, moved by hand
        await pilot.press("x")  # a key: it goes HOLD_AFTER_KEY_S later
        assert "prefer fp32)" in last_lines(app)
        if size[1] < 32:  # the newest event under it (the log is not in view)
            assert last_lines(app).endswith("▸ checkpoint saved at step 13")
        assert app.screen.max_scroll_y == 0
        clock_s = shown_at + HOLD_AFTER_KEY_S - 0.01  # a record just before it is due
        with source.lock:
            source.state.ingest(envelope("step", {"step": 12}), shown_at)
        await redrawn(app, pilot)
        assert "prefer fp32)" in last_lines(app)  # held the whole time
        clock_s = shown_at + HOLD_AFTER_KEY_S  # due: the hold's timer takes it away
        await until(pilot, lambda: "prefer fp32)" not in last_lines(app))
        if size[1] < 32:  # the newest alone
            assert last_lines(app) == " ▸ checkpoint saved at step 13"
        else:
            assert not app.query_one("#last").display  # the event log shows it


async def test_P_pauses_then_lets_the_run_go_on_E_evaluates_and_X_stops(make_agent):
    agent = make_agent(knobs={"precision": "fp32", "pause": "on", "stop": "now",
                              "evaluate": "now"})
    app = GpuwatchApp(LiveSource(agent.info))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: "pause" in app.source.state.schema)  # (no value)
        await pilot.press("P", "P")  # the key again answers its question
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("pause", "on")
        await until(pilot, lambda: app.source.state.paused_after is not None)
        await pilot.press("P", "P")
        command = await next_command(agent)
        assert (command["knob"], command["value"]) == ("pause", "off")
        await until(pilot, lambda: app.source.state.paused_after is None)
        for key, knob, value in (("E", "evaluate", "now"), ("X", "stop", "checkpoint")):
            await pilot.press(key, key)
            command = await next_command(agent)
            assert (command["knob"], command["value"]) == (knob, value)
    assert agent.commands.empty()


@pytest.mark.parametrize("size", [(60, 20), (80, 24)])
async def test_every_key_that_asks_asks_in_one_row(make_agent, size):
    agent = make_agent(knobs={"precision": "fp32", "accum_steps": 2, "num_workers": 2,
                              "pin_memory": False, "kernels": "eager",
                              "checkpointing": False, "lr_scale": 1.0,
                              "max_grad_norm": 1.0, "checkpoint": "now", "pause": "on",
                              "stop": "now", "evaluate": "now"})
    app = GpuwatchApp(LiveSource(agent.info))
    asking = [key.key for spec in STANDARD_KNOBS.values() for key in spec.keys]
    questions = {}
    assert {"p", "a", "A", "c", "k", "l", "L", "g", "P", "E", "X", "s", "m", "w",
            "W"} <= set(asking)
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: all(spec.name in app.source.state.schema for spec in
                                       STANDARD_KNOBS.values() if spec.keys))
        for key in asking:
            await pilot.press(key)
            await pilot.pause()
            shown = question_text(app)
            assert shown.startswith("? "), (key, shown)
            assert app.query_one("#question").size.height == 1, (key, shown)
            await pilot.press("escape")
            questions[key] = shown
        assert agent.commands.empty()
    if size == (80, 24):  # what this press does, not the knob's whole help
        assert questions["P"].startswith("? pause=on: hold the training at the next step ")
        assert questions["X"].startswith("? stop=checkpoint: save a checkpoint and end ")
    else:  # the assignment goes where the whole does not fit
        assert questions["P"].startswith("? hold the training at the next step  P: ")
