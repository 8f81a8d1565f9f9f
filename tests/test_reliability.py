"""The first rule: the training is never hurt by gpuwatch. Real processes, sockets, signals."""

import json
import signal
import subprocess
import sys

import pytest
import torch
import zmq

import agent
from agent.wire import protocol, runs
from agent.control.desk import MAX_PENDING_COMMANDS
from agent.wire.knobs import Knob, KnobSpec
from gpuopt import Trainer
from gpuwatch.history import flat_records
from tests.training import Gate, digits_loader, model as make_model, start


def _trainer(*callbacks):
    model = make_model()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05),
                   torch.nn.functional.cross_entropy, digits_loader(), callbacks=callbacks)


def _log_steps(path):
    return [r["step"] for r in flat_records(path) if r["type"] == "step"]


@pytest.mark.parametrize("kills", [pytest.param(10), pytest.param(50, marks=pytest.mark.slow)])
def test_dashboards_killed_with_sigkill_mid_run_cost_nothing(run_dir, kills):
    trainer = _trainer()
    monitor = agent.attach(trainer)
    thread = start(trainer, max_steps=100_000)
    for _ in range(kills):
        client = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "tail", "--json", "--run", monitor.run_id],
            stdout=subprocess.PIPE, text=True)
        record = json.loads(client.stdout.readline())  # it is attached and reading
        assert record["run"] == monitor.run_id
        client.send_signal(signal.SIGKILL)
        client.wait(10)
    steps_then = trainer.step
    trainer.stop()
    thread.join(30)
    assert trainer.step >= steps_then and not monitor.errors
    assert _log_steps(monitor.info.log_path) == list(range(1, trainer.step + 1))


def test_a_stalled_subscriber_does_not_block_training(run_dir):
    trainer = _trainer()
    monitor = agent.attach(trainer)
    stalled = zmq.Context.instance().socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 10)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(monitor.info.pub_endpoint)  # connected, never reads
    try:
        assert trainer.fit(max_steps=600) == 600
    finally:
        stalled.close(linger=0)
    assert _log_steps(monitor.info.log_path) == list(range(1, 601))


def test_a_command_flood_gets_replies_and_applies_nothing_by_mistake(run_dir):
    gate = Gate(hold_at=2)
    trainer = _trainer(gate)
    monitor = agent.attach(trainer)
    info = runs.find_run()
    thread = start(trainer, max_steps=50)
    assert gate.reached.wait(30)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(info.cmd_endpoint)
    commands = []
    for index in range(1000):
        body = {"id": index, "token": info.token, "knob": "accum_steps",
                "value": [2, 0, "x", 10**12][index % 4]}
        if index % 10 == 9:
            body["token"] = "wrong"
        commands.append(body)
        dealer.send_multipart(protocol.encode(protocol.envelope("command", body, run="r")))
    replies = {}
    while len(replies) < 1000 and dealer.poll(10_000):
        reply = protocol.decode_frames(dealer.recv_multipart())["body"]
        replies[reply["id"]] = reply
    dealer.close()
    assert len(replies) == 1000
    accepted = [i for i, r in replies.items() if r["ok"]]
    assert 0 < len(accepted) <= MAX_PENDING_COMMANDS
    assert all(commands[i]["value"] == 2 and commands[i]["token"] == info.token
               for i in accepted)
    refused = [r for r in replies.values() if "already waiting" in r.get("reason", "")]
    assert len(refused) == monitor.commands_refused > 0
    gate.release.set()
    thread.join(30)
    assert trainer.step == 50 and trainer.accum_steps == 2
    rejected_events = [r for r in flat_records(monitor.info.log_path)
                       if r["type"] == "event" and r.get("kind") == "rejected"]
    assert monitor.commands_rejected > 500
    assert 1 <= len(rejected_events) <= 15  # at most one a second, with the count
    applied = [r for r in flat_records(monitor.info.log_path)
               if r["type"] == "event" and r.get("kind") == "applied"]
    assert len(applied) == 1  # the accepted commands for one boundary apply once


def test_an_exception_inside_the_agent_is_reported_once_and_training_goes_on(run_dir):
    trainer = _trainer()
    monitor = agent.attach(trainer)

    class Unserialisable:
        pass

    monitor.knobs.add(Knob(KnobSpec("broken", "bool", "a knob whose value cannot be sent"),
                           get=Unserialisable, set=lambda value: None))
    monitor._knob_values = monitor.knobs.values()
    assert trainer.fit(max_steps=30) == 30
    step_errors = [e for e in monitor.errors if "encoding a steps message" in e]
    assert len(step_errors) == 1  # 30 failing steps (in batches), reported once
    errors = [r for r in flat_records(monitor.info.log_path)
              if r["type"] == "event" and r.get("kind") == "agent_error"]
    assert len(errors) == len(monitor.errors)  # (a periodic hello may fail as well)
    assert all("training continues" in e["text"] for e in errors)
    steps = [r for r in flat_records(monitor.info.log_path) if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 31))  # logged all the same,
    assert all(r["knobs"]["broken"].startswith("<") for r in steps)  # the value its repr


def test_a_command_too_far_ahead_is_refused(run_dir):
    trainer = _trainer()
    monitor = agent.attach(trainer)
    try:
        from gpuwatch.client import send_command

        reply = send_command(runs.find_run(), "accum_steps", 2, apply_step=2**63)
        assert not reply["ok"] and "steps ahead" in reply["reason"]
    finally:
        monitor.close()
