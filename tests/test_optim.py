"""The optimizer's knobs (lr_scale, weight_decay, max_grad_norm) and the checkpoint
command in the reference Trainer and hand-written loops: real training, commands over
the agent's real socket, and every claim checked by arithmetic (a twin run, a hand
computation, bit-identical resumes)."""

import hashlib
import os
import select
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import agent
from agent.wire import runs
from agent.control.checkpoints import load_checkpoint
from gpuopt import Trainer
from gpuopt.loader import ReconfigurableLoader
from gpuopt.optim import OptimizerSettings
from gpuopt.saving import write_atomically
from gpuwatch.client import Subscriber, send_command
from gpuwatch.history import flat_records
from tests.training import Gate, digits_loader, greeted, messages, model as make_model, start

ROOT = Path(__file__).resolve().parent.parent


def _records(path):
    return list(flat_records(path))


def _steps(records):
    return {r["step"]: r for r in records if r["type"] == "step"}


def _events(records, kind):
    return [r for r in records if r["type"] == "event" and r.get("kind") == kind]


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


class Snapshots:
    """Trainer callback: the parameters after every optimizer step (0: before the first)."""

    def __init__(self, model):
        self.model = model
        self.after = {}

    def on_fit_start(self, trainer):
        self.after.setdefault(trainer.step, _params(self.model))

    def on_optimizer_step(self, trainer, stats):
        self.after[stats.step] = _params(self.model)


def test_lr_scale_halves_the_next_update_against_a_twin_run(run_dir):
    """SGD without momentum: an update is -lr x gradient, so with lr_scale=0.5 from step 4
    the update of step 4 is exactly half the twin's, from the same parameters."""
    runs_ = {}
    for name in ("scaled", "twin"):
        model = make_model()
        snapshots, gate = Snapshots(model), Gate(hold_at=3)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5),
                          F.cross_entropy, digits_loader(), callbacks=[gate, snapshots])
        monitor = agent.attach(trainer, name=name)
        thread = start(trainer, max_steps=5)
        assert gate.reached.wait(30)
        if name == "scaled":
            reply = send_command(monitor.info, "lr_scale", 0.5)
            assert reply["ok"] and reply["apply_step"] == 4, reply
        log_path = monitor.info.log_path
        gate.release.set()
        thread.join(30)
        runs_[name] = (snapshots.after, _steps(_records(log_path)))
    (scaled, steps), (twin, _) = runs_["scaled"], runs_["twin"]
    for before, after in zip(scaled[3], twin[3]):
        assert torch.equal(before, after)  # the same parameters before step 4
    for before, got, full in zip(scaled[3], scaled[4], twin[4]):  # up to p's rounding
        rounding = 2 * torch.finfo(torch.float32).eps * before.abs().max().item()
        torch.testing.assert_close(got - before, 0.5 * (full - before), rtol=0, atol=rounding)
        assert (got - before).abs().max() > 100 * rounding
    assert [steps[k]["lr"] for k in range(1, 6)] == [0.5, 0.5, 0.5, 0.25, 0.25]
    assert steps[4]["lr_groups"] == [0.25] and steps[4]["knobs"]["lr_scale"] == 0.5


def _loop_step(run, model, optimizer, batch, scheduler=None):
    x, y = batch
    with run.autocast:
        loss = F.cross_entropy(model(x), y)
    run.scaler.scale(loss).backward()
    run.scaler.step(optimizer)
    run.scaler.update()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    run.optimizer_step()


def test_a_schedule_keeps_its_shape_under_the_scale_in_every_param_group(run_dir):
    """ExponentialLR multiplies what is in the param group at each step: the scale is
    applied inside the step only, so it does not compound, and back at 1 the schedule is
    where it would have been without it."""
    model = make_model()
    groups = [{"params": model[0].parameters(), "lr": 1.0},
              {"params": model[2].parameters(), "lr": 0.1}]
    optimizer = torch.optim.SGD(groups, lr=1.0)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    run = agent.session(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                        name="loop-schedule")
    data = digits_loader()
    for step in range(1, 9):
        _loop_step(run, model, optimizer, data[step], scheduler)
        if step in (2, 5):  # applies from step + 2
            assert send_command(run.agent.info, "lr_scale", 0.5 if step == 2 else 1.0)["ok"]
    log_path = run.agent.info.log_path
    run.close()
    steps = _steps(_records(log_path))
    for k in range(1, 9):
        scale = 0.5 if 4 <= k < 7 else 1.0
        assert steps[k]["lr_groups"] == pytest.approx([0.9 ** (k - 1) * scale,
                                                       0.1 * 0.9 ** (k - 1) * scale]), k
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx(
        [0.9 ** 8, 0.1 * 0.9 ** 8])
    assert scheduler.get_last_lr() == pytest.approx([0.9 ** 8, 0.1 * 0.9 ** 8])


def test_reduce_lr_on_plateau_steps_with_the_metric_given_and_keeps_its_shape_under_the_scale(
        run_dir):
    """Measured: Trainer(lr_scheduler=ReduceLROnPlateau(...)) crashed at the first step
    (step() needs a metric). Now it is stepped with lr_scheduler_metric's value after
    each step: a metric that never improves halves the rate every patience + 1 = 3
    steps; lr_scale=0.5 from step 6 halves what the steps use, not the schedule."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=2)
    with pytest.raises(ValueError, match=(
            r"ReduceLROnPlateau.step\(\) needs a metric, which the Trainer cannot guess: "
            "give lr_scheduler_metric=")):
        Trainer(model, optimizer, F.cross_entropy, digits_loader(), lr_scheduler=plateau)
    with pytest.raises(ValueError, match=r"StepLR.step\(\) takes none"):
        Trainer(model, optimizer, F.cross_entropy, digits_loader(),
                lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1),
                lr_scheduler_metric=lambda trainer, stats: 1.0)
    optimizer.param_groups[0]["lr"] = 0.1  # (StepLR's construction stepped it once)
    metrics = []
    trainer = Trainer(model, optimizer, F.cross_entropy, digits_loader(),
                      lr_scheduler=plateau,
                      lr_scheduler_metric=lambda trainer, stats: metrics.append(
                          trainer.step) or 1.0)
    monitor = agent.attach(trainer, name="plateau")
    assert send_command(monitor.info, "lr_scale", 0.5, apply_step=6)["ok"]
    log_path = monitor.info.log_path
    assert trainer.fit(max_steps=10) == 10
    steps = _steps(_records(log_path))
    assert metrics == list(range(1, 11))
    assert [steps[k]["lr"] for k in range(1, 11)] == pytest.approx(
        [0.1] * 4 + [0.05] + [0.025] * 2 + [0.0125] * 3)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0125)  # not compounded
    assert trainer.state_dict()["lr_scheduler"]["num_bad_epochs"] == 0


def test_values_that_stop_training_are_accepted_with_a_warning_that_set_prints(run_dir):
    """lr_scale=0 was accepted without a word. Now the reply warns, `gpuwatch set`
    prints it, and it holds: from the step it applies at the weights stay as they are.
    The other values that stop training (or nearly) warn through the same check (the
    reply's), and the usual ones do not."""
    model = make_model()
    snapshots, gate = Snapshots(model), Gate(hold_at=2)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=1e-4),
                      F.cross_entropy, digits_loader(), callbacks=[gate, snapshots])
    monitor = agent.attach(trainer, name="stops")
    thread = start(trainer, max_steps=5)
    assert gate.reached.wait(30)
    cli = subprocess.run([sys.executable, "-m", "gpuwatch", "set", "--run", monitor.run_id,
                          "lr_scale=0"], capture_output=True, text=True, timeout=60)
    try:
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout.splitlines() == [
            "accepted: lr_scale=0.0 applies at step 3",
            "warning: lr_scale=0 makes every learning rate 0: the weights stop changing, "
            "so training stops learning (while costing as much) until it is set back"]
        for knob, value, warning in [
                ("lr_scale", 1e-4, "lr_scale=0.0001 divides every learning rate by 10,000: "
                                   "training nearly stops learning"),
                ("lr_scale", 100, "lr_scale=100.0 multiplies every learning rate by 100: "
                                  "the loss may diverge"),
                ("weight_decay", 5, "weight_decay=5.0 is far above the usual 0.0001 to 0.1"),
                ("max_grad_norm", 1e-6, "max_grad_norm=1e-06 clips every update to a "
                                        "gradient norm of 1e-06: training nearly stops"),
                ("lr_scale", 2, None), ("weight_decay", 0.01, None),
                ("max_grad_norm", 1.0, None)]:
            said = monitor.knobs.knobs[knob].warning(monitor.knobs.validate(knob, value))
            assert (said is None) if warning is None else said.startswith(warning), said
    finally:
        gate.release.set()
        thread.join(30)
    for before, after in zip(snapshots.after[2], snapshots.after[5]):
        assert torch.equal(before, after)  # steps 3 to 5 changed nothing


def test_max_grad_norm_clips_the_global_norm_to_the_threshold(run_dir):
    """Declared in the loop (0: off), set live to 0.05: from then on each update has norm
    lr x 0.05, and each step reports the norm before clipping, as computed here."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    run = agent.session(model=model, optimizer=optimizer, max_grad_norm=0.0,
                        name="loop-clip")
    data = digits_loader()
    updates, norms = {}, {}
    for step in range(1, 7):
        before = _params(model)
        twin = make_model()
        twin.load_state_dict(model.state_dict())
        grads = torch.autograd.grad(F.cross_entropy(twin(data[step][0]), data[step][1]),
                                    list(twin.parameters()))
        norms[step] = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        _loop_step(run, model, optimizer, data[step])
        updates[step] = torch.cat([(b - a).flatten() for a, b in zip(_params(model), before)])
        if step == 2:
            assert send_command(run.agent.info, "max_grad_norm", 0.05)["ok"]
    log_path = run.agent.info.log_path
    run.close()
    steps = _steps(_records(log_path))
    for k in range(1, 7):
        update_norm = float(torch.linalg.vector_norm(updates[k]))
        if k < 4:
            assert "grad_norm" not in steps[k]
            assert update_norm == pytest.approx(float(norms[k]), rel=1e-5)
        else:
            assert norms[k] > 0.05 and steps[k]["grad_norm"] == pytest.approx(
                float(norms[k]), rel=1e-5)
            assert update_norm == pytest.approx(0.05, rel=1e-4), k
            assert steps[k]["knobs"]["max_grad_norm"] == 0.05


def test_weight_decay_goes_to_the_decaying_groups_only_in_their_proportions():
    """The groups a script keeps at 0 (biases) stay 0; the others keep their ratio; one
    real SGD step decays exactly as SGD(weight_decay=) does."""
    model = make_model()
    weights = [p for p in model.parameters() if p.ndim == 2]
    biases = [p for p in model.parameters() if p.ndim == 1]
    optimizer = torch.optim.SGD([{"params": weights[:1], "weight_decay": 0.1},
                                 {"params": weights[1:], "weight_decay": 0.01},
                                 {"params": biases, "weight_decay": 0.0}], lr=0.5)
    settings = OptimizerSettings(optimizer)
    assert settings.decay_groups == (0, 1) and not settings.decays_every_group
    for value in (0.05, 0.1, 0.2):  # read back as set: no float noise (0.1 * 0.2 / 0.1)
        settings.weight_decay = value
        assert settings.weight_decay == value
    assert [g["weight_decay"] for g in optimizer.param_groups] == pytest.approx([0.2, 0.02, 0.0])
    x, y = digits_loader()[0]
    before = _params(model)
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    decay = {id(weights[0]): 0.2, id(weights[1]): 0.02}
    for p, b, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), b - 0.5 * (g + decay.get(id(p), 0.0) * b))

    plain = OptimizerSettings(torch.optim.SGD(model.parameters(), lr=0.1))
    assert plain.decays_every_group  # nothing says which are biases: every group
    assert "Rprop has no weight_decay" in OptimizerSettings(
        torch.optim.Rprop(model.parameters())).weight_decay_reason()


def test_a_change_followed_by_a_non_finite_loss_is_rolled_back(run_dir):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = agent.session(model=model, optimizer=optimizer, max_grad_norm=1.0,
                        name="loop-guard")
    data = digits_loader()
    with Subscriber(run.agent.info) as sub:
        greeted(sub)
        for step in range(1, 4):
            _loop_step(run, model, optimizer, data[step])
        assert send_command(run.agent.info, "lr_scale", 4.0)["ok"]  # applies at step 5
        assert send_command(run.agent.info, "max_grad_norm", 0.0)["ok"]
        _loop_step(run, model, optimizer, data[4])
        assert run.optimizer_settings.lr_scale == 4.0 and run.optimizer_settings.max_grad_norm == 0
        run.optimizer_step(torch.tensor(float("nan")))  # step 5: the loss went non-finite
        messages(sub, lambda m: m["type"] == "event" and m["body"].get("kind") == "rollback")
        _loop_step(run, model, optimizer, data[6])
        _loop_step(run, model, optimizer, data[7])
    run.close()
    assert run.optimizer_settings.lr_scale == 1.0 and run.optimizer_settings.max_grad_norm == 1.0


class DropoutNet(nn.Module):
    """:func:`tests.training.model` with dropout: a resume must put back the RNG too."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.3),
                                 nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


def _digits_dataset():
    return [(x[i], y[i]) for x, y in digits_loader(batch_size=64, n=256)
            for i in range(len(x))]


def _dropout_loop(run, model, optimizer, scheduler, data, steps):
    losses = {}
    for _ in range(steps):
        x, y = data[run.step]  # the loop's own data position: its step
        loss = F.cross_entropy(model(x), y) / run.accum_steps
        run.scaler.scale(loss).backward()
        run.scaler.step(optimizer)
        run.scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        run.optimizer_step()
        losses[run.step] = loss.detach()
    return losses


def _loop_parts(seed):
    model = DropoutNet(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    return model, optimizer, scheduler


def test_a_loop_checkpoint_resumes_bit_identically_with_its_knobs(run_dir, tmp_path):
    data = digits_loader()
    model, optimizer, scheduler = _loop_parts(0)
    run = agent.session(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                        precision="fp32", accum_steps=1, max_grad_norm=0.0,
                        checkpoint_dir=tmp_path, name="loop-checkpoint")
    _dropout_loop(run, model, optimizer, scheduler, data, 2)
    for knob, value, step in (("lr_scale", 0.5, 4), ("weight_decay", 0.01, 4),
                              ("max_grad_norm", 0.5, 4), ("checkpoint", "now", 5)):
        assert send_command(run.agent.info, knob, value, apply_step=step)["ok"]
    _dropout_loop(run, model, optimizer, scheduler, data, 2)  # steps 3, 4: then it saves
    continued = _dropout_loop(run, model, optimizer, scheduler, data, 4)
    final = _params(model)
    run.close()
    path = tmp_path / "step-00000004.pt"

    model, optimizer, scheduler = _loop_parts(seed=1)  # other weights: the checkpoint's win
    fresh = agent.session(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                          precision="fp32", accum_steps=1, max_grad_norm=0.0,
                          resume_from=path, name="loop-resumed")
    assert fresh.step == 4
    assert (fresh.optimizer_settings.lr_scale, fresh.optimizer_settings.max_grad_norm,
            optimizer.param_groups[0]["weight_decay"]) == (0.5, 0.5, 0.01)
    again = _dropout_loop(fresh, model, optimizer, scheduler, data, 4)
    fresh.close()
    assert {k: v.item() for k, v in again.items()} == {k: v.item() for k, v in continued.items()}
    for got, want in zip(_params(model), final):
        assert torch.equal(got, want)


def test_checkpoint_before_a_change_saves_the_state_the_change_starts_from(run_dir, tmp_path):
    """``gpuwatch set lr_scale=0.25 --checkpoint``: one boundary, the checkpoint first, with
    the knobs as they were; a run that cannot checkpoint refuses the pair."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = agent.session(model=model, optimizer=optimizer, checkpoint_dir=tmp_path,
                        name="loop-risky")
    data = digits_loader()
    _loop_step(run, model, optimizer, data[0])
    reply = send_command(run.agent.info, "lr_scale", 0.25, checkpoint=True)
    assert reply["ok"] and reply["checkpoint"] and reply["apply_step"] == 3, reply
    for step in (1, 2, 3):
        _loop_step(run, model, optimizer, data[step])
    log_path = run.agent.info.log_path
    run.close()
    records = _records(log_path)
    applied = [(e["knob"], e["step"]) for e in _events(records, "applied")]
    assert applied == [("checkpoint", 3), ("lr_scale", 3)]
    assert load_checkpoint(tmp_path / "step-00000002.pt")["knobs"]["lr_scale"] == 1.0
    assert _steps(records)[3]["lr"] == 0.025
    assert any(e["text"] == "lr_scale=0.25 accepted, applies at step 3 after a checkpoint"
               for e in _events(records, "accepted"))

    not_a_directory = tmp_path / "file"  # the save fails: the change is not made
    not_a_directory.write_text("")
    run = agent.session(model=model, optimizer=optimizer, checkpoint_dir=not_a_directory,
                        name="loop-save-fails")
    assert send_command(run.agent.info, "lr_scale", 0.25, checkpoint=True)["ok"]
    for step in (1, 2):
        _loop_step(run, model, optimizer, data[step])
    log_path = run.agent.info.log_path
    run.close()
    failed = [(e["knob"], e["text"]) for e in _events(_records(log_path), "failed")]
    assert [knob for knob, _ in failed] == ["checkpoint", "lr_scale"]
    assert "the checkpoint asked for before it was not saved" in failed[1][1]
    assert run.optimizer_settings.lr_scale == 1.0

    bare = agent.session(precision="fp32", name="loop-no-model")
    try:
        reply = send_command(bare.agent.info, "precision", "bf16", checkpoint=True)
        assert not reply["ok"] and "checkpoint: pass agent.session(model=" in reply["reason"]
    finally:
        bare.close()


def test_knobs_a_loop_or_trainer_cannot_apply_are_refused_with_the_reason(run_dir):
    run = agent.session(name="loop-no-optimizer")
    try:
        for knob in ("lr_scale", "weight_decay", "max_grad_norm"):
            reply = send_command(run.agent.info, knob, 0.5)
            assert not reply["ok"] and "pass agent.session(optimizer=optimizer)" in reply["reason"]
    finally:
        run.close()
    model = make_model()
    run = agent.session(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        name="loop-undeclared")
    try:
        reply = send_command(run.agent.info, "max_grad_norm", 1.0)
        assert not reply["ok"] and "did not declare max_grad_norm" in reply["reason"]
    finally:
        run.close()
    trainer = Trainer(model, torch.optim.Rprop(model.parameters()), F.cross_entropy,
                      digits_loader())
    monitor = agent.attach(trainer, name="trainer-rprop")
    try:
        reply = send_command(monitor.info, "weight_decay", 0.1)
        assert reply["reason"] == "weight_decay: Rprop has no weight_decay in its param groups"
        assert send_command(monitor.info, "lr_scale", 2)["ok"]
    finally:
        monitor.close()


def test_write_atomically_replaces_a_file_whole_and_cleans_up_after_the_dead(tmp_path):
    path = tmp_path / "step-1.pt"
    write_atomically(path, lambda temporary: temporary.write_bytes(b"first"))
    with pytest.raises(RuntimeError):
        write_atomically(path, lambda temporary: (temporary.write_bytes(b"half"),
                                                  (_ for _ in ()).throw(RuntimeError())))
    assert path.read_bytes() == b"first" and [p.name for p in tmp_path.iterdir()] == [path.name]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / f".step-2.pt.tmp-{dead}").write_bytes(b"abandoned")
    size = write_atomically(tmp_path / "dir", lambda t: (t.mkdir(), (t / "a").write_bytes(b"12")))
    assert size == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["dir", "step-1.pt"]
    # a writer killed between its two renames of a directory checkpoint: the earlier one
    # waits aside in its folder, none under its name; the next write puts it back
    holder = tmp_path / f".dir.k3x9q_a1.tmp-{dead}"
    (tmp_path / "dir").rename(tmp_path / "moved")
    holder.mkdir()
    (tmp_path / "moved").rename(holder / ".old")
    (holder / "dir").mkdir()  # (the new one, half written)
    write_atomically(tmp_path / "step-2.pt", lambda temporary: temporary.write_bytes(b"2"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "step-1.pt", "step-2.pt"]
    assert (tmp_path / "dir" / "a").read_bytes() == b"12"


def test_checkpoints_are_owner_only_whatever_the_writer_chose(tmp_path):
    """Files 0600 and directories 0700 (as the run logs), though the framework wrote
    0644 / 0755 or 0666; directories created to hold it 0700; an existing one, a link
    and its target as they were."""
    def framework(temporary):  # a directory of files and a folder, world-readable
        (temporary / "model").mkdir(parents=True, mode=0o755)
        (temporary / "model" / "weights.bin").write_bytes(b"w")
        (temporary / "state.pt").write_bytes(b"s")
        os.chmod(temporary / "state.pt", 0o666)
        os.chmod(temporary, 0o755)
        (temporary / "elsewhere").symlink_to(outside)

    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"x")
    os.chmod(outside, 0o644)
    os.chmod(tmp_path, 0o755)
    path = tmp_path / "runs" / "run-1" / "checkpoint-5"
    assert write_atomically(path, framework) == 3
    modes = {str(entry.relative_to(tmp_path)): stat.S_IMODE(entry.lstat().st_mode)
             for entry in tmp_path.rglob("*") if not entry.is_symlink()}
    assert modes == {"runs": 0o700, "runs/run-1": 0o700, "runs/run-1/checkpoint-5": 0o700,
                     "runs/run-1/checkpoint-5/model": 0o700,
                     "runs/run-1/checkpoint-5/model/weights.bin": 0o600,
                     "runs/run-1/checkpoint-5/state.pt": 0o600, "outside.txt": 0o644}
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755
    file = write_atomically(tmp_path / "step-1.pt", lambda t: t.write_bytes(b"1"))
    assert file == 1 and stat.S_IMODE((tmp_path / "step-1.pt").stat().st_mode) == 0o600


@pytest.mark.slow
def test_a_checkpoint_killed_while_being_written_leaves_the_previous_one_intact(run_dir):
    """A real training process, SIGKILLed while its second checkpoint is on its way to
    the disk (held in fsync, before the rename): the first is byte for byte as it was and
    loads; the second exists only as a temporary, which the next save removes."""
    directory = Path(run_dir) / "checkpoints"
    child = subprocess.Popen([sys.executable, str(ROOT / "tests" / "checkpoint_job.py"),
                              str(directory)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = _line(child)
        assert line.startswith("run "), line
        info = runs.find_run(line.split()[1])
        with Subscriber(info) as sub:
            assert send_command(info, "checkpoint", "now")["ok"]
            first = messages(sub, lambda m: m["type"] == "event"
                             and m["body"].get("knob") == "checkpoint"
                             and m["body"].get("kind") in ("applied", "failed"))[-1]["body"]
        assert first["kind"] == "applied", first
        path = Path(first["path"])
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert send_command(info, "checkpoint", "now")["ok"]
        held = _line(child)  # the job says so from inside fsync, then waits there forever
        assert held.startswith("writing "), held
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    temporary = Path(held.split()[1]).parent  # (its private folder)
    assert temporary.exists() and temporary.name.startswith(".step-")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    assert load_checkpoint(path)["step"] == first["checkpoint_step"]
    assert sorted(p.name for p in directory.iterdir()) == sorted([path.name, temporary.name])
    write_atomically(directory / "next.pt", lambda t: t.write_bytes(b"x"))
    assert not temporary.exists()


def _line(child, timeout_s=60):
    ready, _, _ = select.select([child.stdout], [], [], timeout_s)
    assert ready, f"the checkpoint job said nothing within {timeout_s} s"
    return child.stdout.readline().strip()


@pytest.mark.slow
def test_the_demo_resumes_from_a_checkpoint_exactly(run_dir, tmp_path):
    """``gpuwatch demo``'s job: checkpoint=now at step 40 of 60 (after lr_scale=0.5 and
    max_grad_norm=0.5), then ``--resume`` of that checkpoint: steps 41-60 have the same
    losses, bit for bit, and the same knobs."""
    def demo(*options):  # one torch thread: the same numbers, faster on a busy machine
        return subprocess.Popen([sys.executable, "-m", "agent.demo", "--max-steps", "60",
                                 "--checkpoint-dir", str(tmp_path), *options],
                                stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT),
                                     "OMP_NUM_THREADS": "1"})

    first = demo()
    info = runs.find_run(_line(first).split()[3])  # "gpuwatch demo: run <id> ..."
    for knob, value, step in (("lr_scale", 0.5, 30), ("max_grad_norm", 0.5, 30),
                              ("checkpoint", "now", 41)):
        assert send_command(info, knob, value, apply_step=step)["ok"]
    assert first.wait(300) == 0
    path = tmp_path / "step-00000040.pt"
    second = demo("--resume", str(path))
    resumed = runs.find_run(_line(second).split()[3])
    assert second.wait(300) == 0
    original, again = (_steps(_records(run.log_path)) for run in (info, resumed))
    assert sorted(again) == list(range(41, 61))
    for step in range(41, 61):
        assert again[step]["loss"] == original[step]["loss"], step
        assert again[step]["knobs"] == original[step]["knobs"], step
    assert again[41]["knobs"]["lr_scale"] == 0.5 and again[41]["knobs"]["max_grad_norm"] == 0.5


def test_a_loop_resumed_after_a_micro_batch_size_change_binds_it_with_run_loader(
        run_dir, tmp_path):
    """micro_batch_size exists in a loop only once run.loader() binds it, after the resume:
    the checkpoint's value waits for it, and the saved accum_steps is kept (setting the
    size alone would move accum_steps to keep the resumed run's effective batch)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    run = agent.session(model=model, optimizer=optimizer, accum_steps=2,
                        checkpoint_dir=tmp_path, name="loop-micro-batch")
    batches = run.loader(ReconfigurableLoader(_digits_dataset(), 16), epochs=None)

    def window():
        for _ in range(run.accum_steps):
            x, y = next(batches)
            (F.cross_entropy(model(x), y) / run.accum_steps).backward()
        optimizer.step()
        optimizer.zero_grad()
        run.optimizer_step()

    window()
    for knob, value, step in (("micro_batch_size", 8, 3), ("checkpoint", "now", 4)):
        reply = send_command(run.agent.info, knob, value, apply_step=step)
        assert reply["ok"], reply
    for _ in range(4):
        window()
    run.close()
    path = tmp_path / "step-00000003.pt"
    assert {k: load_checkpoint(path)["knobs"][k] for k in ("micro_batch_size",
                                                            "accum_steps")} == {
        "micro_batch_size": 8, "accum_steps": 4}

    resumed = agent.session(model=model, optimizer=optimizer, accum_steps=2,
                            resume_from=path, name="loop-micro-batch-resumed")
    assert resumed.accum_steps == 4 and "micro_batch_size" not in resumed.agent.knobs.knobs
    loader = ReconfigurableLoader(_digits_dataset(), 16)
    resumed.loader(loader, epochs=None)
    assert (loader.batch_size, resumed.accum_steps) == (8, 4)  # the effective batch: 32
    log_path = resumed.agent.info.log_path
    resumed.close()
    first, second = [e["text"] for e in _events(_records(log_path), "resumed")]
    assert first.startswith(f"resumed from {path} at step 3 with ")
    assert "accum_steps=4" in first
    assert first.endswith("; not bound yet (set when run.loader() binds them): "
                          "num_workers=0, pin_memory=off, prefetch_factor=2, "
                          "micro_batch_size=8")
    assert second == (f"resumed from {path} at step 3 with micro_batch_size=8, "
                      "num_workers=0, pin_memory=off, prefetch_factor=2, accum_steps=4")
