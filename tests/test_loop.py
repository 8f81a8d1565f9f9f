"""Hand-written loops (agent.session): every loop knob live, checked by arithmetic, and
the GPT-style example run in a subprocess with every loop knob changed."""

import gc
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

import agent
from agent.wire import runs
from agent.wire.runlog import LOG_SUFFIX
from gpuopt.checkpointing import find_blocks
from gpuopt.position import DataPosition
from gpuopt.precision import MixedPrecision
from gpuwatch.client import send_command
from gpuwatch.app import GpuwatchApp
from gpuwatch.sources.live import LiveSource
from tests.conftest import knows, log_texts, until, wait_until
from tests.training import digits_loader, model as make_model
from gpuwatch.history import flat_records

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _log_records(path):
    return list(flat_records(path))


def _windows_by_size(run, model, optimizer, at_boundary):
    """A loop that reads ``run.accum_steps`` at each window's start and fetches that many;
    returns each window's (parameters before, micro-batches, parameters after)."""
    batches = run.loader(digits_loader(batch_size=8))
    windows = []
    for step in range(1, 9):
        before = [p.detach().clone() for p in model.parameters()]
        used = []
        for _ in range(run.accum_steps):
            x, y = next(batches)
            used.append((x, y))
            loss = torch.nn.functional.cross_entropy(model(x), y) / run.accum_steps
            run.scaler.scale(loss).backward()
        run.scaler.step(optimizer)
        run.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        run.optimizer_step()
        windows.append((before, used, [p.detach().clone() for p in model.parameters()]))
        at_boundary(step)
    return windows


def _windows_by_fetch(run, model, optimizer, at_boundary):
    """A loop over ``run.loader`` that reads ``run.is_accumulating`` after each fetch and
    steps where it is False; returns what :func:`_windows_by_size` does."""
    with pytest.raises(RuntimeError, match=r"none came through it in this window"):
        run.is_accumulating  # (it counts the window's fetches: none yet)
    windows, used = [], []
    for x, y in run.loader(digits_loader(batch_size=8)):
        if not used:
            before = [p.detach().clone() for p in model.parameters()]
        accumulating = run.is_accumulating
        used.append((x, y))
        loss = torch.nn.functional.cross_entropy(model(x), y) / run.accum_steps
        run.scaler.scale(loss).backward()
        if not accumulating:
            run.scaler.step(optimizer)
            run.scaler.update()
            optimizer.zero_grad(set_to_none=True)
            run.optimizer_step()
            windows.append((before, used, [p.detach().clone() for p in model.parameters()]))
            used = []
            at_boundary(run.step)
            if run.step == 8:
                break
    return windows


@pytest.mark.parametrize("train", [_windows_by_size, _windows_by_fetch])
def test_live_accum_steps_windows_equal_a_hand_computation(run_dir, train):
    """Each optimizer step's update is -lr x the mean gradient over exactly the
    micro-batches of its window, before and after a live accum_steps change, in a loop
    that fetches ``run.accum_steps`` micro-batches a window and in one that steps where
    ``run.is_accumulating`` is False."""
    model = make_model()
    lr = 0.5
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    run = agent.session(model=model, optimizer=optimizer, accum_steps=2, name="loop-accum")
    info = runs.find_run(run.agent.run_id)

    def at_boundary(step):
        if step == 3:
            reply = send_command(info, "accum_steps", 3)
            assert reply["ok"] and reply["apply_step"] == 5, reply

    windows = train(run, model, optimizer, at_boundary)
    log_path = run.agent.info.log_path
    run.close()
    assert [len(used) for _, used, _ in windows] == [2, 2, 2, 2, 3, 3, 3, 3]
    for before, used, after in windows:
        twin = make_model()
        with torch.no_grad():
            for p, value in zip(twin.parameters(), before):
                p.copy_(value)
        loss = sum(torch.nn.functional.cross_entropy(twin(x), y) for x, y in used) / len(used)
        grads = torch.autograd.grad(loss, list(twin.parameters()))
        for value, grad, got in zip(before, grads, after):
            torch.testing.assert_close(got, value - lr * grad, rtol=1e-5, atol=1e-6)
    records = _log_records(log_path)
    steps = [r for r in records if r["type"] == "step"]
    assert [s["micro_batches"] for s in steps] == [2, 2, 2, 2, 3, 3, 3, 3]
    assert not [r for r in records if r["type"] == "event" and "do not reach" in r["text"]]
    assert [s["samples"] for s in steps] == [16] * 4 + [24] * 4
    # the loss reported is the window's mean (the sum of the divided losses)
    last_before, last_used, _ = windows[-1]
    twin = make_model()
    with torch.no_grad():
        for p, value in zip(twin.parameters(), last_before):
            p.copy_(value)
        mean = sum(torch.nn.functional.cross_entropy(twin(x), y) for x, y in last_used) / 3
    assert steps[-1]["loss"] == pytest.approx(float(mean), rel=1e-5)
    assert steps[-1]["lr"] == lr


def test_undeclared_knobs_are_refused_with_what_to_declare(run_dir):
    run = agent.session(name="loop-bare")
    info = runs.find_run(run.agent.run_id)
    try:
        for knob, value, reason in [
                ("accum_steps", 2, "pass agent.session(accum_steps=N)"),
                ("precision", "bf16", "pass agent.session(precision=...)"),
                ("kernels", "compile", "pass agent.session(model=model)"),
                ("num_workers", 1, "ReconfigurableLoader"),
                ("memory_fraction", 0.5, "needs CUDA")]:
            reply = send_command(info, knob, value)
            assert not reply["ok"] and reason in reply["reason"], (knob, reply)
    finally:
        run.close()


async def test_a_key_of_an_undeclared_knob_says_what_to_declare_as_set_does(run_dir):
    """``p`` on a loop without ``precision=`` says the reason ``gpuwatch set`` gets (the
    run's own words, from its hello) and sends nothing."""
    model = make_model()
    run = agent.session(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        name="loop-undeclared")
    info = runs.find_run(run.agent.run_id)
    try:
        reply = send_command(info, "precision", "bf16")
        assert not reply["ok"] and reply["reason"].startswith("precision: this loop did not")
        app = GpuwatchApp(LiveSource(info))
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: knows(app, "lr_scale"))
            await pilot.press("p")
            said = f"{reply['reason']}; nothing sent"
            await until(pilot, lambda: said in log_texts(app))
            assert not any(text.startswith("sent") for text in log_texts(app))
            assert "this run has no knob precision" not in " ".join(log_texts(app))
    finally:
        run.close()


def test_autocast_context_is_reusable_and_follows_the_live_precision():
    policy = MixedPrecision("cpu")
    ctx = policy.autocast()
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with ctx:
        assert layer(x).dtype == torch.float32
    policy.precision = "bf16"
    with ctx:
        with ctx:  # nested, as evaluation inside a training step may do
            assert layer(x).dtype == torch.bfloat16
        assert layer(x).dtype == torch.bfloat16
    assert layer(x).dtype == torch.float32
    assert ctx is policy.autocast()


def test_switchable_grad_scaler_is_a_real_grad_scaler_in_fp16_only():
    policy = MixedPrecision("cpu")
    scaler = policy.grad_scaler
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(3, 4)).pow(2).mean()
    assert scaler.scale(loss) is loss and not scaler.is_enabled()
    policy.precision = "fp16"
    assert scaler.is_enabled() and scaler.get_scale() == 65536.0
    loss = model(torch.randn(3, 4)).pow(2).mean()
    scaled = scaler.scale(loss)
    assert float(scaled.detach()) == pytest.approx(float(loss.detach()) * 65536.0, rel=1e-3)
    scaled.backward()
    weight = model.weight.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert not bool(scaler.skipped) and not torch.equal(weight, model.weight)
    model.weight.grad = torch.full_like(model.weight, float("inf"))
    scaler.step(optimizer)  # inf gradients: skipped, scale backs off
    scaler.update()
    assert bool(scaler.skipped) and scaler.get_scale() == 32768.0


def test_repeated_blocks_are_found_without_a_blocks_attribute():
    sys.path.insert(0, str(EXAMPLES))
    try:
        from gpt_loop import GPT
    finally:
        sys.path.remove(str(EXAMPLES))
    names = [name for name, _ in find_blocks(GPT(10, 8, n_layer=3, n_embd=16))]
    assert names == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


def _wait_for(predicate, path, timeout_s=120):
    def seen():  # a file another process writes: no event to await
        records = _log_records(path) if os.path.exists(path) else []
        return records if predicate(records) else None

    return wait_until(seen, f"the records awaited in {path}", timeout_s=timeout_s, poll_s=0.2)


@pytest.mark.slow
def test_gpt_example_takes_every_loop_knob_live(run_dir):
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "gpt_loop.py"), "--batch-size", "4", "--block-size",
         "16", "--eval-interval", "50", "--compile-backend", "aot_eager"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert "watch it with `gpuwatch`" in line, process.stderr.read()
        info = runs.find_run(line.split()[1].rstrip(":"))
        changes = [("precision", "bf16"), ("accum_steps", 3), ("checkpointing", True),
                   ("kernels", "compile")]
        for knob, value in changes:
            reply = send_command(info, knob, value)
            assert reply["ok"], reply

        def all_applied(records):
            applied = {r["knob"] for r in records
                       if r["type"] == "event" and r.get("kind") == "applied"}
            last = max((r["step"] for r in records if r["type"] == "event"
                        and r.get("kind") == "applied"), default=None)
            return applied == {k for k, _ in changes} and any(
                r["type"] == "step" and r["step"] >= last + 3 for r in records)

        records = _wait_for(all_applied, info.log_path)
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGTERM
    records = _log_records(info.log_path)
    assert records[-1]["type"] == "bye" and records[-1]["reason"] == "stopped by SIGTERM"
    assert list(Path(run_dir).glob("*.json")) == []
    steps = [r for r in records if r["type"] == "step"]
    last = steps[-1]
    assert last["knobs"] == {**last["knobs"], "precision": "bf16", "accum_steps": 3,
                             "checkpointing": True, "kernels": "compile"}
    assert last["micro_batches"] == 3 and last["tokens"] == 3 * 4 * 16
    assert last["tokens_per_s"] > 0 and last["lr"] > 0
    # the rate is the step's tokens over its time (any load), not a speed to reach
    assert last["tokens_per_s"] == pytest.approx(last["tokens"] / last["step_time_s"])
    assert any("activation_bytes" in s for s in steps)
    kinds = {r.get("kind") for r in records if r["type"] == "event"}
    assert "compiling" in kinds


@pytest.mark.slow
def test_gpt_example_resumes_exactly_after_a_live_change(run_dir, tmp_path):
    """nanoGPT's loop fetches the next window's first batch before the boundary: the
    resumed example gets that batch back and every later step's loss equals the twin's,
    evaluations (fetches under no_grad) included."""
    common = [sys.executable, str(EXAMPLES / "gpt_loop.py"), "--batch-size", "4",
              "--block-size", "16", "--eval-interval", "25", "--max-steps", "120"]
    twin = subprocess.Popen(common, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = twin.stdout.readline()
        assert "watch it with `gpuwatch`" in line, twin.stderr.read()
        info = runs.find_run(line.split()[1].rstrip(":"))
        change = send_command(info, "accum_steps", 3)
        # (at a later boundary: at the same one it would save the state before the change)
        saved = send_command(info, "checkpoint", "now", apply_step=change["apply_step"] + 3)
        assert change["ok"] and saved["ok"], (change, saved)
        assert twin.wait(240) == 0, twin.stderr.read()
    finally:
        if twin.poll() is None:
            twin.kill()
            twin.wait()
    records = _log_records(info.log_path)
    [checkpoint] = [r for r in records if r["type"] == "event" and r.get("kind") == "applied"
                    and r["knob"] == "checkpoint"]
    after = checkpoint["checkpoint_step"]
    assert after == change["apply_step"] + 2, checkpoint
    resumed = subprocess.run(common + ["--resume", checkpoint["path"]], capture_output=True,
                             text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    resumed_id = resumed.stdout.split()[1].rstrip(":")
    [resumed_log] = Path(info.log_path).parent.glob(f"{resumed_id}.rank0{LOG_SUFFIX}")
    steps = {r["step"]: r for r in records if r["type"] == "step"}
    resumed_records = _log_records(resumed_log)
    resumed_steps = {r["step"]: r for r in resumed_records if r["type"] == "step"}
    assert sorted(resumed_steps) == list(range(after + 1, 121))
    assert [resumed_steps[k]["loss"] for k in resumed_steps] == [
        steps[k]["loss"] for k in resumed_steps]
    assert {resumed_steps[k]["micro_batches"] for k in resumed_steps} == {3}
    [event] = [r for r in resumed_records if r["type"] == "event"
               and r.get("kind") == "resumed"]
    assert "accum_steps=3" in event["text"] and "not as in" not in event["text"]


def test_agent_imports_no_framework_and_attach_names_what_it_takes():
    code = ("import sys, agent, agent.integrations.adapters, agent.integrations.loop, "
            "agent.integrations\n"
            "frameworks = {'lightning', 'pytorch_lightning', 'transformers', 'accelerate'}\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in frameworks)\n"
            "assert not loaded, loaded\n"
            "try:\n"
            "    agent.attach(object())\n"
            "except TypeError as exc:\n"
            "    print(exc)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "a lightning.pytorch.Trainer, a transformers.Trainer" in result.stdout
    assert "agent.session(...)" in result.stdout


def test_gpt_example_attaches_in_at_most_eight_changed_lines():
    changed = [line for line in (EXAMPLES / "gpt_loop.py").read_text().splitlines()
               if line.rstrip().endswith("# gpuwatch")]
    assert 1 <= len(changed) <= 8, changed


def test_loader_knobs_live_over_epochs_of_a_reconfigurable_loader(run_dir):
    from gpuopt.loader import ReconfigurableLoader

    x, y = zip(*digits_loader(batch_size=1, n=96))
    dataset = torch.utils.data.TensorDataset(torch.cat(x), torch.cat(y))
    loader = ReconfigurableLoader(dataset, batch_size=16, shuffle=False)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = agent.session(model=model, optimizer=optimizer, name="loop-loader")
    info = runs.find_run(run.agent.run_id)
    seen = []
    try:
        for inputs, targets in run.loader(loader, epochs=3):  # 6 batches an epoch
            seen.append(targets)
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            run.optimizer_step()
            if run.step == 2:
                reply = send_command(info, "num_workers", 1)
                assert reply["ok"], reply
        log_path = run.agent.info.log_path
    finally:
        run.close()
        loader.close()
    assert len(seen) == 18
    for epoch in range(3):  # every sample once per epoch, in order, across the switch
        assert torch.equal(torch.cat(seen[6 * epoch:6 * epoch + 6]), dataset.tensors[1])
    steps = [r for r in _log_records(log_path) if r["type"] == "step"]
    assert steps[2]["knobs"]["num_workers"] == 0 and steps[-1]["knobs"]["num_workers"] == 1
    with pytest.raises(ValueError, match="epochs must be None or an integer >= 1"):
        run.loader(loader, epochs=0)


#: A loop whose SIGTERM comes while its main thread holds the import lock and the agent's
#: I/O thread waits for that lock (as when accelerate looks for a package at each step
#: while the I/O thread imports a compile backend for its hello).
SIGTERM_IN_IMPORT = r"""
import _imp, os, signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
import agent
import agent.io.ioloop as ioloop

blocked = threading.Event()
real_report = ioloop._environment_report


def report_needing_the_import_lock():
    blocked.wait(30)  # until the main thread holds the import lock
    import xml.dom.minidom  # not imported yet: needs the lock
    return real_report()


ioloop._environment_report = report_needing_the_import_lock
run = agent.session(name="sigterm-in-import")
print(run.agent.info.log_path, flush=True)
io_thread = next(t for t in threading.enumerate() if t.name == "gpuwatch-agent")
_imp.acquire_lock()
blocked.set()
deadline = time.monotonic() + 30
while "importlib" not in repr(sys._current_frames()[io_thread.ident].f_code):
    assert time.monotonic() < deadline  # the I/O thread now waits for the lock
os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode, the lock still held
for _ in range(1000):
    pass
_imp.release_lock()
while True:
    time.sleep(0.01)  # the loop goes on until the retried SIGTERM ends it
"""


def test_a_sigterm_during_an_import_still_ends_the_run_with_bye(run_dir, tmp_path):
    script = tmp_path / "sigterm_in_import.py"
    script.write_text(SIGTERM_IN_IMPORT)
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, str(script), str(EXAMPLES.parent)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log_path = process.stdout.readline().strip()
        assert log_path, process.stderr.read()
        process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGTERM, process.stderr.read()
    records = _log_records(log_path)  # the close did not wait out its timeout in vain
    assert records and records[-1]["type"] == "bye", records
    assert records[-1]["reason"] == "stopped by SIGTERM"
    assert records[0]["type"] == "hello"  # the hello that waited for the lock came out
    assert time.monotonic() - started < 60


def test_timed_fetches_of_an_evaluation_count_in_neither_samples_nor_data_wait(run_dir):
    """nanoGPT's ``estimate_loss()`` fetches its batches through the same ``get_batch``
    under ``no_grad``: a step's samples are its window's alone (2 x 8 here, not 2 x 8 +
    5 x 8), and the evaluation's fetch time is not data wait."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = agent.session(model=model, optimizer=optimizer, accum_steps=2, name="loop-eval")
    data = digits_loader(batch_size=8)
    fetched = []  # the splits fetched, in order

    def get_batch(split):
        time.sleep(0.2 if split == "val" else 0.0)  # the evaluation's fetches are slow
        fetched.append(split)
        return data[len(fetched) % len(data)]

    get_batch = run.timed(get_batch)
    for step in range(3):
        if step == 1:
            with torch.no_grad():
                for _ in range(5):
                    get_batch("val")
        for _ in range(run.accum_steps):
            x, y = get_batch("train")
            loss = torch.nn.functional.cross_entropy(model(x), y) / run.accum_steps
            run.scaler.scale(loss).backward()
        run.scaler.step(optimizer)
        run.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        run.optimizer_step()
    assert fetched.count("val") == 5
    log_path = run.agent.info.log_path
    run.close()
    steps = [r for r in _log_records(log_path) if r["type"] == "step"]
    assert [s["samples"] for s in steps] == [16, 16, 16]
    assert [s["micro_batches"] for s in steps] == [2, 2, 2]
    assert steps[1]["data_wait_s"] < 0.2  # the evaluation slept 1 s in fetches


def test_the_data_position_keeps_no_batch_the_loop_has_let_go(run_dir):
    """A loop over run.loader(a DataLoader): at each fetch only the batch just fetched is
    alive (the position keeps the latest, which the loop holds too): a batch the loop is
    done with is not kept for a checkpoint that could not need it (on a GPU, device
    memory the job did not plan for)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = (torch.cat(part) for part in zip(*digits_loader()))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets),
                                         batch_size=32)  # (a new tensor each batch)
    fetched, alive = [], []
    with agent.session(model=model, optimizer=optimizer, name="loop-held") as run:
        for x, y in run.loader(loader):
            fetched.append(weakref.ref(x))
            alive.append(sum(ref() is not None for ref in fetched))
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run.optimizer_step(loss)
            if run.step == 12:
                break
    assert alive == [1] * 12


def test_a_loop_fetching_two_ahead_has_them_in_the_checkpoints_from_its_second_boundary():
    """The position keeps as many batches as a boundary found fetched ahead: at the first
    boundary with two ahead a checkpoint says it lacks one (the position kept the latest
    only); from the next one on it has both, and a resume yields them, then the rest."""
    batches = [torch.tensor(i) for i in range(10)]
    position = DataPosition()
    iteration = position.iterate(batches)
    fetched = [int(next(iteration)) for _ in range(3)]  # a window of 1, 2 fetched ahead
    position.window_done(1)
    with pytest.raises(ValueError, match=r"2 batches are fetched ahead of this boundary, "
                                         r"and 1 kept: .* \(a checkpoint at a later boundary"):
        position.state_dict()
    fetched.append(int(next(iteration)))
    position.window_done(1)
    state = position.state_dict()
    assert [int(batch) for _, batch in state["ahead"]] == [2, 3]
    resumed = DataPosition()
    resumed.load_state_dict(state)
    assert [int(batch) for batch in resumed.iterate(batches)] == list(range(2, 10))
    assert fetched == [0, 1, 2, 3]


def test_a_loop_that_does_not_take_its_window_from_the_run_is_warned_once(run_dir):
    """accum_steps=4 declared, but the loop steps after every batch (a newcomer's first
    loop): three windows in a row of 1 micro-batch, and one warning says the live knob
    cannot reach that loop and what to read; once, however long the loop goes on."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    events = []
    run = agent.session(model=model, optimizer=optimizer, accum_steps=4, name="loop-off")
    run.agent.add_listener(lambda record: events.append(record)
                           if record["type"] == "event" else None)
    for x, y in run.loader(digits_loader(batch_size=8)):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        run.scaler.scale(loss).backward()
        run.scaler.step(optimizer)
        run.scaler.update()
        optimizer.zero_grad()
        run.optimizer_step()
        if run.step == 8:
            break
    run.close()
    warned = [event for event in events if "do not reach" in event["text"]]
    assert len(warned) == 1, warned
    assert warned[0]["level"] == "warning" and warned[0]["step"] == 3
    assert warned[0]["text"] == (
        "accum_steps is 4, but the last 3 optimizer steps had other micro-batch counts "
        "(the last: 1): the loop does not take its window's size from the run, so "
        "accum_steps changes do not reach it (it should read run.accum_steps in its "
        "micro-step loop, or run.is_accumulating after each fetch)")


def test_a_closed_session_lets_its_model_optimizer_and_kept_states_go(run_dir):
    """A sweep in one process: after ``run.close()`` nothing of gpuwatch's holds the
    trial's model, optimizer, agent or the states ``recover=on`` kept (the agent's exit
    hook held them all until the process ended, trial after trial)."""
    gone = []
    for trial in range(2):
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = agent.session(model=model, optimizer=optimizer, name=f"trial-{trial}")
        assert send_command(run.agent.info, "recover", "on")["ok"]
        for x, y in digits_loader(n=512):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.optimizer_step(loss.detach())
        assert run._ring, "recover=on kept no state: nothing to let go"
        run.close()
        gone += [weakref.ref(held) for held in (model, optimizer, run, run.agent)]
        del model, optimizer, run, loss
    gc.collect()
    assert [ref() for ref in gone] == [None] * len(gone)
