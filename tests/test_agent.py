"""The agent on real ZeroMQ sockets, attached to a real Trainer training on real digits."""

import itertools
import os
import threading
import time
import weakref

import pytest
import torch

import agent
from agent.wire import protocol, runs
from agent.step.core import ERRORS_KEPT_MAX, LOSSES_HELD_MAX
from agent.step.record import StepRecord
from agent.wire.runlog import summary_path
from gpuopt import MixedPrecision, Trainer
from gpuwatch.client import Subscriber, send_command
from gpuwatch.history import flat_records
from tests.training import (FuncInForward, Gate, digits_loader, greeted, messages,
                            model as make_model, start)


def _next_of(sub, msg_type, timeout_s=30):
    return messages(sub, lambda m: m["type"] == msg_type, timeout_s)[-1]


def test_steps_stream_and_a_command_applies_at_the_step_it_announced(run_dir):
    model = make_model()
    gate = Gate(hold_at=5)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                      torch.nn.functional.cross_entropy, digits_loader(), callbacks=[gate])
    monitor = agent.attach(trainer, name="test-run")
    info = runs.find_run()
    assert info.run_id == monitor.run_id and info.name == "test-run"
    with Subscriber(info) as sub:
        thread = start(trainer, max_steps=40)
        assert gate.reached.wait(30)
        reply = send_command(info, "precision", "bf16")
        assert reply["ok"], reply
        assert reply["apply_step"] >= 6
        bad = send_command(info, "accum_steps", 0)
        assert not bad["ok"] and "below the minimum" in bad["reason"]
        gate.release.set()
        seen = messages(sub, lambda m: m["type"] == "bye")
        thread.join(30)
    steps = {m["body"]["step"]: m["body"] for m in seen if m["type"] == "step"}
    applied = [m["body"] for m in seen if m["type"] == "event"
               and m["body"].get("kind") == "applied"]
    assert [a["step"] for a in applied] == [reply["apply_step"]]
    assert applied[0]["text"] == f"precision=bf16 applied at step {reply['apply_step']}"
    for step, body in steps.items():
        expected = "bf16" if step >= reply["apply_step"] else "fp32"
        assert body["knobs"]["precision"] == expected, step
        assert body["knobs"]["accum_steps"] == 1
        assert body["step_time_s"] > 0 and body["samples"] == 16
        assert 0.0 <= body["data_wait_share"] <= 1.0
        assert body["samples_per_s"] == pytest.approx(16 / body["step_time_s"])
        assert isinstance(body["loss"], float) and body["host_rss_bytes"] > 0
    assert max(steps) == 40
    assert runs.list_runs() == []  # the run file is removed at the end
    assert [p for p in os.listdir(run_dir) if p != "logs"] == []  # and the ipc sockets


def test_hello_carries_schema_environment_and_model(run_dir):
    model = make_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, digits_loader())
    monitor = agent.attach(trainer)
    try:
        with Subscriber(runs.find_run()) as sub:
            hello = _next_of(sub, "hello")
        assert hello is not None and hello["run"] == monitor.run_id
        body = hello["body"]
        # the CUDA-only memory knobs are absent from a CPU run's schema
        assert [k["name"] for k in body["knobs"]] == [
            "precision", "accum_steps", "kernels", "lr_scale", "weight_decay",
            "max_grad_norm", "cpu_threads", "pause", "stop", "recover", "checkpoint",
            "rewind"]
        assert body["model"] == {"name": "Sequential", "params": 64 * 64 + 64 + 64 * 10 + 10}
        assert body["env"]["torch"]["version"] == torch.__version__
        assert body["knob_values"] == {"precision": "fp32", "accum_steps": 1, "kernels": "eager",
                                       "lr_scale": 1.0, "weight_decay": 0.0,
                                       "max_grad_norm": 0.0,
                                       "cpu_threads": torch.get_num_threads(), "recover": "off"}
    finally:
        monitor.close()


def test_commands_without_token_unknown_bad_late_or_while_ending_change_nothing(run_dir):
    model = make_model()
    gate = Gate(hold_at=3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, digits_loader(), callbacks=[gate])
    monitor = agent.attach(trainer)
    info = runs.find_run()
    thread = start(trainer, max_steps=12)
    assert gate.reached.wait(30)
    stolen = runs.RunInfo(**{**info.__dict__, "token": "0" * 32})
    replies = [
        send_command(stolen, "precision", "bf16"),
        send_command(info, "learning_rate", 0.1),
        send_command(info, "precision", "fp8"),
        send_command(info, "accum_steps", "many"),
        send_command(info, "accum_steps", 2, apply_step=1),
    ]
    reasons = [r["reason"] for r in replies]
    assert not any(r["ok"] for r in replies)
    assert "token" in reasons[0] and "unknown knob" in reasons[1]
    assert "not one of" in reasons[2] and "not an integer" in reasons[3]
    assert "has passed" in reasons[4]
    for extra, reason in [({"dry_run": 1}, "dry_run must be true or false, got 1"),
                          ({"cancel": "yes"}, "cancel must be true or false, got 'yes'"),
                          ({"id": 2.5}, "id must be a string or an integer, got 2.5"),
                          ({"id": True}, "id must be a string or an integer, got True")]:
        reply = _raw_reply(info, {"id": "x", "knob": "accum_steps", "value": 2, **extra})
        assert not reply["ok"] and reply["reason"] == reason, reply  # fields of wrong types
    monitor.mark_ending()
    ending = send_command(info, "accum_steps", 2)
    assert not ending["ok"] and ending["reason"] == "the run is ending"
    gate.release.set()
    thread.join(30)
    assert trainer.precision == "fp32" and trainer.accum_steps == 1 and trainer.step == 12


def _raw_reply(info, body):
    """Send ``body`` (with the token) as a command and return the reply, whatever its id."""
    import zmq

    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(info.cmd_endpoint)
        sock.send_multipart(protocol.encode(protocol.envelope(
            protocol.COMMAND, {**body, "token": info.token}, run=info.run_id)))
        assert sock.poll(10_000)
        return protocol.decode_frames(sock.recv_multipart())["body"]


def test_malformed_frames_get_a_reply_and_the_run_goes_on(run_dir):
    import zmq

    model = make_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, digits_loader())
    monitor = agent.attach(trainer)
    info = runs.find_run()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(info.cmd_endpoint)
    try:
        for junk in ([b"\xc1\xc1"], [b"command", b"[1, 2]"], [b"x", b"y", b"z"]):
            dealer.send_multipart(junk)
            assert dealer.poll(5000)
            reply = protocol.decode_frames(dealer.recv_multipart())
            assert reply["type"] == "reply" and not reply["body"]["ok"]
            assert "malformed" in reply["body"]["reason"]
        assert send_command(info, "accum_steps", 2)["ok"]  # still serving
        assert trainer.fit(max_steps=5) == 5
        assert trainer.accum_steps == 2
    finally:
        dealer.close()
        monitor.close()


def test_training_result_is_identical_with_and_without_the_agent(run_dir):
    def train(with_agent):
        model = make_model(seed=1)
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                          torch.nn.functional.cross_entropy, digits_loader(), accum_steps=2)
        if with_agent:
            agent.attach(trainer)
        trainer.fit(max_steps=30)
        return model.state_dict()

    plain, watched = train(False), train(True)
    for name in plain:
        assert torch.equal(plain[name], watched[name]), name


def test_a_model_that_refuses_the_activation_meter_says_so_and_trains_on(run_dir):
    model = FuncInForward()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, digits_loader())
    agent.attach(trainer)
    with Subscriber(runs.find_run()) as sub:
        greeted(sub)
        thread = start(trainer, max_steps=5)
        seen = messages(sub, lambda m: m["type"] == "bye", timeout_s=60)
        thread.join(30)
    warnings = [m["body"]["text"] for m in seen if m["type"] == "event"
                and m["body"].get("kind") == "warning"]
    assert len(warnings) == 1 and warnings[0].startswith(
        "activation memory is not measured for this model (RuntimeError: torch.func")
    steps = [m["body"] for m in seen if m["type"] == "step"]
    assert [b["step"] for b in steps] == [1, 2, 3, 4, 5]
    assert not any("activation_bytes" in b for b in steps)


def test_hand_written_loop_session_streams_steps_and_takes_precision(run_dir):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = MixedPrecision("cpu")
    seen_precision = []
    with agent.session(name="manual", model=model, mixed_precision=policy) as run:
        info = runs.find_run()
        with Subscriber(info) as sub:
            for i, (x, y) in enumerate(run.loader(digits_loader(batch_size=8))):
                with policy.autocast():
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                policy.backward(loss)
                policy.step(optimizer)
                optimizer.zero_grad()
                run.optimizer_step(loss)
                seen_precision.append(policy.precision)
                if i == 2:
                    assert send_command(info, "precision", "bf16")["ok"]
                if i == 20:
                    break
            first = _next_of(sub, "step")
    assert first["body"]["samples"] == 8 and first["body"]["micro_batches"] == 1
    assert seen_precision[0] == "fp32" and seen_precision[-1] == "bf16"


def test_run_log_holds_every_step_and_reads_as_a_table(run_dir):
    model = make_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, digits_loader())
    monitor = agent.attach(trainer)
    log_path = monitor.info.log_path
    assert log_path.startswith(os.path.join(run_dir, "logs"))
    assert oct(os.stat(log_path).st_mode & 0o777) == "0o600"
    trainer.fit(max_steps=150)
    records = list(flat_records(log_path))
    steps = [r["step"] for r in records if r["type"] == "step"]
    assert steps == list(range(1, 151))
    assert records[0]["type"] == "hello" and records[-1]["type"] == "bye"
    seqs = [r["seq"] for r in records]
    assert seqs == sorted(seqs)  # the rows of one steps batch share its seq
    others = [r["seq"] for r in records if r["type"] != "step"]
    assert len(set(others)) == len(others)
    step_seqs = {r["seq"] for r in records if r["type"] == "step"}
    assert not step_seqs & set(others)
    import pandas  # the README's one line

    steps_table = pandas.DataFrame(flat_records(log_path)).query("type == 'step'")
    assert list(steps_table.step) == list(range(1, 151))
    assert steps_table.loss.notna().all() and (steps_table.step_time_s.dropna() > 0).all()
    assert "precision" in steps_table.knobs.iloc[0]  # a map of the step's knob values


def test_a_host_loss_is_let_go_once_published_and_published_exactly(run_dir):
    """A host loss is not read on the training thread: its step's record holds the loss
    tensor (with its autograd graph) until the I/O thread has published the step, then
    lets it go; the run log holds each loss's value bit for bit. Steps after the I/O
    thread has ended (the run closed) are not kept at all."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected, held = [], []
    with agent.session(name="host-loss", model=model) as run:
        log_path = run.agent.info.log_path
        for x, y in run.loader(digits_loader(batch_size=8)):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run.optimizer_step(loss)
            expected.append(loss.item())
            held.append(weakref.ref(loss))
            if len(expected) == 30:
                break
        del loss
    assert [ref() for ref in held] == [None] * 30  # published, then let go
    losses = [r["loss"] for r in flat_records(log_path) if r["type"] == "step"]
    assert losses == expected
    late = torch.ones(2, requires_grad=True).sum()  # a step after the close
    run.agent.optimizer_step(StepRecord(1, 8, 0.0, late, step=31))
    late_ref = weakref.ref(late)
    del late
    assert late_ref() is None  # not queued for an I/O thread that is gone


def test_a_host_loss_is_read_at_the_boundary_and_its_graph_let_go(run_dir):
    """A float32 host loss and gradient norm are read from memory as the step is recorded
    (no call): the record keeps numbers, so each loss tensor, with its autograd graph, goes
    when the loop lets go of it, even with the I/O thread not started; every loss and norm
    is then published bit for bit."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = agent.Agent(name="read", model=model)  # (not started: nothing drains)
    batches = itertools.cycle(digits_loader(batch_size=8))
    expected, norms, held = [], [], []
    for step in range(1, 41):
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        monitor.optimizer_step(StepRecord(1, 8, 0.0, loss, grad_norm=norm, step=step))
        expected.append(loss.item())
        norms.append(norm.item())
        held.append(weakref.ref(loss))
    del loss, norm
    assert [ref() for ref in held] == [None] * len(held)
    monitor.start()
    log_path = monitor.info.log_path
    monitor.close()
    steps = [r for r in flat_records(log_path) if r["type"] == "step"]
    assert [r["loss"] for r in steps] == expected
    assert [r["grad_norm"] for r in steps] == norms


def test_past_the_held_bound_a_host_loss_is_read_at_once_and_its_graph_let_go(run_dir):
    """A host loss not read from memory (bfloat16 here) is held, with its autograd graph,
    until the I/O thread reads it; while the I/O thread is behind (:data:`LOSSES_HELD_MAX`
    records queued: here it has not started), each further step's loss is read as it is
    recorded: its record keeps the number and the graph goes at once; the ones before stay
    held. Every loss is then published bit for bit."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = agent.Agent(name="held", model=model)  # (not started: nothing drains)
    batches = itertools.cycle(digits_loader(batch_size=8))
    expected, held = [], []
    for step in range(1, LOSSES_HELD_MAX + 7):
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x).bfloat16(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.optimizer_step(StepRecord(1, 8, 0.0, loss, step=step))
        expected.append(loss.item())
        held.append(weakref.ref(loss))
    del loss
    assert [ref() is not None for ref in held] == [True] * LOSSES_HELD_MAX + [False] * 6
    monitor.start()
    log_path = monitor.info.log_path
    monitor.close()
    assert [ref() for ref in held] == [None] * len(held)  # published, then let go
    losses = [r["loss"] for r in flat_records(log_path) if r["type"] == "step"]
    assert losses == expected


def test_a_value_that_cannot_be_read_loses_itself_not_its_batch(run_dir):
    """NumPy numbers as losses are published as floats (a breaker's np.float32 broke the
    live stream: msgpack refuses it); a loss nobody can read (a meta tensor, a string)
    and a gradient norm of two elements are published as missing, each reported once as
    the agent's error, and every other step and value of the batch as given."""
    import numpy

    monitor = agent.Agent(name="unreadable")  # (not started: one batch)
    losses = [numpy.float32(0.5), numpy.array(0.25, dtype=numpy.float64),
              torch.tensor(1.0, device="meta"), "x", torch.tensor(0.125).bfloat16(), 2.0]
    norms = [None, torch.tensor([1.0, 2.0]), None, None, torch.tensor(3.0), 0.5]
    for step, (loss, norm) in enumerate(zip(losses, norms), 1):
        monitor.optimizer_step(StepRecord(1, 8, 0.0, loss, grad_norm=norm, step=step))
    monitor.start()
    log_path = monitor.info.log_path
    monitor.close()
    records = list(flat_records(log_path))
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r.get("loss") for r in steps] == [0.5, 0.25, None, None, 0.125, 2.0]
    assert all(type(r.get("loss")) in (float, type(None)) for r in steps)
    assert [r.get("grad_norm") for r in steps] == [None, None, None, None, 3.0, 0.5]
    errors = sorted(r["text"] for r in records
                    if r["type"] == "event" and r.get("kind") == "agent_error")
    assert [text.split(" failed: ")[0] for text in errors] == [
        "gpuwatch agent: reading a step's gradient norm",
        "gpuwatch agent: reading a step's loss", "gpuwatch agent: reading a step's loss"]
    assert monitor.errors and not monitor._broken  # (reported; the agent goes on)


def test_past_the_held_bound_number_losses_and_flags_are_published_as_marked(run_dir):
    """A loss given as a number (or None), past :data:`LOSSES_HELD_MAX` queued, is marked
    as it is (no call), with a step's GradScaler flag and gradient norm beside it."""
    monitor = agent.Agent(name="held-numbers")  # (not started: nothing drains)
    count = LOSSES_HELD_MAX + 5
    for step in range(1, count + 1):
        loss = None if step % 7 == 0 else 1.0 / step
        norm = 0.5 if step % 3 == 0 else None
        monitor.optimizer_step(StepRecord(1, 8, 0.0, loss, grad_norm=norm, step=step))
    monitor.start()
    log_path = monitor.info.log_path
    monitor.close()
    steps = [r for r in flat_records(log_path) if r["type"] == "step"]
    assert [r.get("loss") for r in steps] == [
        None if step % 7 == 0 else 1.0 / step for step in range(1, count + 1)]
    assert [r.get("grad_norm") for r in steps] == [
        0.5 if step % 3 == 0 else None for step in range(1, count + 1)]


def test_errors_of_its_own_are_kept_to_a_bound_then_counted(run_dir):
    """A failure whose message varies (a step number in it) is kept, logged and published
    once each up to :data:`ERRORS_KEPT_MAX`, then counted (repeats too: nothing is kept
    to tell them), with one event saying so; the heartbeat's count has them all."""
    monitor = agent.Agent(name="errors")
    told = []
    monitor.add_listener(told.append)
    for step in range(ERRORS_KEPT_MAX + 50):
        monitor.report_error(f"step {step}'s listener", ValueError("bad"))
        monitor.report_error(f"step {step}'s listener", ValueError("bad"))  # the same
    assert len(monitor.errors) == ERRORS_KEPT_MAX and monitor.errors_not_kept == 100
    assert monitor.errors[-1] == (f"gpuwatch agent: step {ERRORS_KEPT_MAX - 1}'s listener "
                                  "failed: ValueError: bad")
    texts = [record["text"] for record in told if record.get("kind") == "agent_error"]
    assert len(texts) == ERRORS_KEPT_MAX + 1
    assert texts[-1].startswith(f"gpuwatch agent: more than {ERRORS_KEPT_MAX} distinct errors")
    monitor.start()
    try:
        assert monitor._io._heartbeat()["errors"] == ERRORS_KEPT_MAX + 100
    finally:
        monitor.close()


def test_steps_queued_since_a_wake_up_go_as_one_batch_with_events_in_their_place(run_dir):
    """Steps recorded before the I/O thread runs are what it finds at its first wake-up:
    one ``steps`` message for the steps before the event, the event, one for the rest;
    on the wire and in the run log (one ``step`` record a step)."""
    monitor = agent.Agent(name="batch")
    loss = torch.tensor(0.5)
    for step in range(1, 8):
        monitor.optimizer_step(StepRecord(
            step=step, micro_batches=1, samples=32, data_wait_s=0.001, loss=loss,
            activation_bytes=1000 if step == 3 else None))
        if step == 4:
            monitor.event("info", "between steps 4 and 5", kind="note")
    monitor.start()
    monitor.close()
    records = list(flat_records(monitor.info.log_path))
    kinds = [(r["type"], r.get("step")) for r in records if r["type"] in ("step", "event")]
    assert kinds == [("step", 1), ("step", 2), ("step", 3), ("step", 4), ("event", None),
                     ("step", 5), ("step", 6), ("step", 7)]
    steps = [r for r in records if r["type"] == "step"]
    assert len({r["seq"] for r in steps[:4]}) == 1 and len({r["seq"] for r in steps[4:]}) == 1
    assert [r.get("activation_bytes") for r in steps] == [None, None, 1000] + [None] * 4
    assert steps[0]["samples"] == 32 and steps[0]["loss"] == 0.5
    assert steps[1]["samples_per_s"] == pytest.approx(32 / steps[1]["step_time_s"])
    assert "knobs" in steps[0] and "host_rss_bytes" in steps[0]


def test_ended_line_says_the_steps_the_final_loss_and_the_run_log(run_dir):
    monitor = agent.Agent(name="ended")
    monitor.start()
    for step, loss in enumerate((0.9, 0.7, 0.4125), 1):
        monitor.optimizer_step(StepRecord(step=step, micro_batches=1, samples=8, data_wait_s=0.0,
                                          loss=torch.tensor(loss)))
    line = monitor.ended_line()  # closes the run: its log's summary is saved
    log_path = monitor.info.log_path
    assert line == (f"run {monitor.run_id} ended: steps trained 3, final loss 0.4125, "
                    f"run log {log_path} (`gpuwatch runs --all`)")
    summary_path(log_path).write_text("not json")  # damaged: said, never raised
    assert "steps trained ?, final loss ?" in monitor.ended_line()


def test_kernel_backend_switches_live_and_triton_is_refused_without_cuda(run_dir, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a user's run: no interpreter
    from gpuopt.demo import build_demo

    workload = build_demo("transformer", batch_size=4)
    loader = torch.utils.data.DataLoader(workload.train_dataset, batch_size=4)
    gate = Gate(hold_at=2)
    trainer = Trainer(workload.model, torch.optim.AdamW(workload.model.parameters()),
                      workload.loss_fn, loader, callbacks=[gate], compile_backend="aot_eager")
    monitor = agent.attach(trainer)
    schema = {knob["name"]: knob for knob in monitor.knobs.schema()}
    assert schema["kernels"]["unavailable"] == {  # a dashboard's `k` skips it
        "triton": "Triton kernels need a CUDA device; this run is on cpu"}
    info = runs.find_run()
    with Subscriber(info) as sub:
        thread = start(trainer, max_steps=12)
        assert gate.reached.wait(30)
        refused = send_command(info, "kernels", "triton")
        assert not refused["ok"]
        assert refused["reason"] == ("kernels=triton: Triton kernels need a CUDA device; "
                                     "this run is on cpu")
        assert send_command(info, "memory_fraction", 0.5)["reason"] == (
            "memory_fraction: needs CUDA; this run is on cpu")
        assert send_command(info, "memory_snapshot_steps", 3)["reason"] == (
            "memory_snapshot_steps: needs CUDA; this run is on cpu")
        assert send_command(info, "kernels", "compile")["ok"]
        assert send_command(info, "checkpointing", True)["ok"]
        gate.release.set()
        seen = messages(sub, lambda m: m["type"] == "bye", timeout_s=120)
        thread.join(30)
    kinds = [m["body"].get("kind") for m in seen if m["type"] == "event"]
    assert "compiling" in kinds and "compiled" in kinds
    texts = [m["body"]["text"] for m in seen if m["type"] == "event"]
    assert any(t.startswith("checkpointing=on applied at step") for t in texts), texts
    last = [m["body"] for m in seen if m["type"] == "step"][-1]
    assert last["knobs"]["kernels"] == "compile" and last["knobs"]["checkpointing"] is True
    assert last["loss"] == last["loss"]  # finite: training went on
    # activation memory: measured at the first step, not under compile (Dynamo would
    # trace the meter's hooks)
    measured = [m["body"]["step"] for m in seen
                if m["type"] == "step" and "activation_bytes" in m["body"]]
    assert measured == [1], measured


def test_listening_beyond_this_machine_uses_curve_and_only_the_run_key_gets_in(run_dir):
    import zmq

    model = make_model()
    gate = Gate(hold_at=3)  # (the command applies before the run can end)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, digits_loader(), callbacks=[gate])
    monitor = agent.attach(trainer, transport="tcp", listen="0.0.0.0")
    info = runs.find_run()
    assert info.curve_server_key and info.curve_client_secret_key
    assert "curve_client_secret_key" not in info.public()
    stranger = zmq.Context.instance().socket(zmq.SUB)  # no keys: the handshake fails
    stranger.setsockopt(zmq.SUBSCRIBE, b"")
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(info.pub_endpoint)
    try:
        with Subscriber(info) as sub:
            greeted(sub)
            thread = start(trainer, max_steps=400)
            assert messages(sub, lambda m: m["type"] == "step")  # the key holder sees steps
            assert gate.reached.wait(30)
            assert send_command(info, "accum_steps", 2)["ok"]  # and can steer
            gate.release.set()
            thread.join(30)
        assert not stranger.poll(200)  # the stranger saw nothing
        unkeyed = runs.RunInfo(**{**info.__dict__, "curve_server_key": ""})
        assert not send_command(unkeyed, "accum_steps", 3, timeout_s=1.0)["ok"]
    finally:
        stranger.close()
        monitor.close()
    assert trainer.accum_steps == 2


class _ThreadRecordingNvml:
    """An NVML module with one GPU that notes the thread of every call."""

    def __init__(self):
        self.threads = []

    def __getattr__(self, name):
        def call(*args):
            self.threads.append(threading.current_thread().name)
            if name == "nvmlDeviceGetCount":
                return 1
            if name == "nvmlDeviceGetName":
                return b"Fake GPU"
            return 0
        return call


def test_nvml_psutil_and_allocator_readings_never_run_on_the_training_thread(
        run_dir, monkeypatch):
    import agent.step.encoder as encoder
    from agent.io.probes import Nvml

    nvml = _ThreadRecordingNvml()
    readings = []
    real_memory_stats = encoder.memory_stats

    def recording_memory_stats(device):
        readings.append(threading.current_thread().name)
        return real_memory_stats(device)

    monkeypatch.setattr(encoder, "memory_stats", recording_memory_stats)
    model = make_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, digits_loader())
    agent.attach(trainer, nvml=Nvml(nvml))
    trainer.fit(max_steps=40)
    assert nvml.threads and readings  # they ran, on the agent's I/O thread only
    assert set(nvml.threads) == set(readings) == {"gpuwatch-agent"}


def test_a_listener_sees_every_step_as_it_is_recorded_and_one_that_raises_is_dropped(
        run_dir):
    model = make_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, digits_loader())
    monitor = agent.attach(trainer)
    records, failures = [], []

    def keep(record):
        records.append((threading.current_thread().name, dict(record)))

    def broken(record):
        failures.append(record["type"])
        raise RuntimeError("listener bug")

    monitor.add_listener(keep)
    monitor.add_listener(broken)
    trainer.fit(max_steps=12)
    steps = [r for _, r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 13))  # every one, in order
    assert {name for name, r in records if r["type"] == "step"} == {"MainThread"}
    assert all(r["step_time_s"] > 0 and r["samples"] == 16 and r["micro_batches"] == 1
               and r["data_wait_s"] >= 0 and r["knobs"]["precision"] == "fp32"
               for r in steps)
    assert failures == ["step"]  # called once, then removed; its error is an event
    error = records[1][1]        # the other listener got at once, before step 2
    assert error["type"] == "event" and error["kind"] == "agent_error"
    assert "a record listener failed: RuntimeError: listener bug" in error["text"]
    assert [e for e in monitor.errors if "listener" in e] == [
        "gpuwatch agent: a record listener failed: RuntimeError: listener bug"]


def test_an_event_the_record_queue_drops_is_counted_and_said(run_dir):
    """Events share the bounded record queue with the steps: where the I/O thread falls
    behind, the queue drops its oldest entries, events among them (a ``branched`` event
    lost so leaves the run log's branches wrong). Each loss is said in a warning event,
    in its place, and counted; the surviving events are published as raised."""
    monitor = agent.Agent(name="lost", queue_size=8)
    loss = torch.tensor(0.5)
    monitor.event("info", "branch 1 of branch 0 at step 0", kind="branched", branch=1)
    for step in range(1, 21):  # the first event and steps 1-12 are pushed out
        monitor.optimizer_step(StepRecord(step=step, micro_batches=1, samples=8,
                                          data_wait_s=0.0, loss=loss))
    monitor.event("info", "after step 20", kind="note")
    for step in range(21, 31):  # the note too; steps 23-30 stay
        monitor.optimizer_step(StepRecord(step=step, micro_batches=1, samples=8,
                                          data_wait_s=0.0, loss=loss))
    monitor.start()
    monitor.event("info", "kept", kind="note")
    monitor.close()
    records = [r for r in flat_records(monitor.info.log_path) if r["type"] == "event"]
    lost = [r for r in records if "events lost" in r["text"]]
    assert [(r["text"].split(":")[0], r["events_dropped"]) for r in lost] == [
        ("2 events lost (2 in all)", 2)], records
    assert [r["text"] for r in records if r.get("kind") == "note"] == ["kept"]
    assert not [r for r in records if "_event_number" in r]
    assert monitor._encoder.events_dropped == 2


def test_a_fast_loops_steps_are_each_logged_or_counted_as_dropped(run_dir):
    """A loop at about 40,000 steps/s from its start overflows the queue of 8,192 before
    the I/O thread's first read (its quiet poll: half a second): every step is either
    logged or counted as dropped (those before the first read went uncounted: a run at
    40,000 steps/s lost its first 12,309 steps so)."""
    loss = torch.tensor(0.5)
    with agent.session(name="fast-start") as run:
        now, due = time.perf_counter, time.perf_counter()
        for _ in range(16_000):
            due += 25e-6
            while now() < due:  # (a step of 25 us, on the CPU: the GIL is switched)
                pass
            run.optimizer_step(loss)
        log_path = run.agent.info.log_path
    steps = [record["step"] for record in flat_records(log_path) if record["type"] == "step"]
    assert steps == sorted(set(steps)) and steps[-1] == 16_000
    assert len(steps) + run.agent.records_dropped == 16_000


def test_steps_a_full_queue_drops_before_its_first_read_are_counted(run_dir):
    monitor = agent.Agent(name="overflow", queue_size=64)  # (not started: nothing drains)
    for step in range(1, 201):
        monitor.optimizer_step(StepRecord(1, 8, 0.0, torch.tensor(float(step)), step=step))
    monitor.event("info", "an event at the queue's end")
    monitor.start()
    log_path = monitor.info.log_path
    monitor.close()
    steps = [record["step"] for record in flat_records(log_path) if record["type"] == "step"]
    assert steps == list(range(138, 201))  # the queue's last 63 records and the event
    assert monitor.records_dropped == 137
