"""The Lightning Fabric integration on a real ``Fabric`` (CPU): step records, each live
knob's windows against a plain-torch hand computation of the same micro-batches, or its
refusal with the reason. (Checkpoint and resume after live changes: the contract,
``tests/contract/fabric.py``.)"""

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

pytest.importorskip("lightning")
from lightning.fabric import Fabric  # noqa: E402

import agent  # noqa: E402
from agent.wire import runs  # noqa: E402
from agent.integrations import fabric as fabric_integration  # noqa: E402
from agent.integrations.fabric import FabricRun  # noqa: E402
from gpuopt.compile import CompiledModel  # noqa: E402
from agent.wire.runlog import LOG_SUFFIX  # noqa: E402
from gpuwatch.client import send_command  # noqa: E402
from gpuwatch.history import flat_records  # noqa: E402
from tests.contract import BATCH_SIZE, IndexedDigits  # noqa: E402
from tests.contract import run as contract_run  # noqa: E402
from tests.contract.fabric import FabricDriver  # noqa: E402
from tests.training import BlockNet, digits_loader, resume_when_paused  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LR = 0.1


@pytest.fixture(autouse=True)
def private_runs(run_dir):
    """Every test's runs in a private run directory."""


@dataclass
class Window:
    """One optimizer step as the loop saw it: the parameters and settings before it,
    its micro-batches and the parameters after."""

    before: list
    settings: dict
    micro_batches: list = field(default_factory=list)
    after: list = None


def _parameters(model):
    return [p.detach().clone() for p in model.parameters()]


def _set_up(*, n=256, precision="32-true", make=BlockNet, **attach):
    """A Fabric on the CPU with ``make()`` and SGD through ``fabric.setup``, ``n`` digits
    in batches of 8 (not shuffled) through ``fabric.setup_dataloaders``, and the run."""
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = (torch.cat(t) for t in zip(*digits_loader(batch_size=n, n=n)))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=8))
    return fabric, model, optimizer, loader, agent.attach(fabric, **attach)


def _settings(run, model):
    settings = run.optimizer_settings
    return {"accum_steps": run.accum_steps, "precision": run.precision.precision,
            "lr_scale": settings.lr_scale, "max_grad_norm": settings.max_grad_norm,
            "checkpointing": "forward" in model.module.blocks[0].__dict__}


def _train(fabric, model, optimizer, loader, run, *, steps, at_boundary=lambda n: None):
    """Fabric's accumulation loop with the gpuwatch lines, recording each window (its
    settings as its first micro-batch starts). ``at_boundary(n)`` runs after window
    ``n``'s boundary: a command sent there applies from window ``n + 2`` (the agent
    applies commands at the boundary after the step under way)."""
    windows = []
    for x, y in run.loader(loader):
        if not windows or windows[-1].after is not None:
            windows.append(Window(_parameters(model), _settings(run, model)))
        is_accumulating = run.is_accumulating
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss / run.accum_steps)
        windows[-1].micro_batches.append((x, y))
        if not is_accumulating:
            optimizer.step()
            optimizer.zero_grad()
            run.optimizer_step()
            windows[-1].after = _parameters(model)
            at_boundary(len(windows))
            if run.step >= steps:
                break
    return windows


def _by_hand(window, make=BlockNet):
    """The window's update in plain torch, as Fabric's plugins do it (bf16-mixed: the
    inputs cast to bf16, autocast, the outputs cast back to fp32), each loss divided by
    the window size, the run's clipping, SGD at the scaled rate. Returns the parameters
    after and the window's loss (the sum of the divided losses)."""
    twin = make()
    with torch.no_grad():
        for parameter, value in zip(twin.parameters(), window.before):
            parameter.copy_(value)
    settings = window.settings
    optimizer = torch.optim.SGD(twin.parameters(), lr=LR * settings["lr_scale"])
    bf16 = settings["precision"] == "bf16"
    total = None
    for x, y in window.micro_batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            output = twin(x.to(torch.bfloat16) if bf16 else x).float()
        loss = F.cross_entropy(output, y) / settings["accum_steps"]
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    if settings["max_grad_norm"]:
        nn.utils.clip_grad_norm_(list(twin.parameters()), settings["max_grad_norm"])
    optimizer.step()
    return _parameters(twin), float(total)


def _records(run):
    path = run.agent.info.log_path
    run.close()
    records = list(flat_records(path))
    steps = {r["step"]: r for r in records if r["type"] == "step"}
    events = [r for r in records if r["type"] == "event"]
    return steps, events, records


def test_attach_after_setup_finds_the_wrapped_objects_and_records_each_window():
    fabric, model, optimizer, loader, run = _set_up(n=48, accum_steps=2, max_grad_norm=0.0,
                                                    name="fabric-digits")
    assert isinstance(run, FabricRun)  # no TypeError: a Fabric is an integration now
    assert run.model is model and run.optimizer is optimizer
    assert run.optimizer_settings.optimizer is optimizer.optimizer  # the torch optimizer
    assert runs.find_run(run.agent.run_id).name == "fabric-digits"
    with pytest.raises(RuntimeError, match=r"iterate run.loader\(train_loader\)"):
        run.is_accumulating  # the window's micro-batches are those run.loader() fetched
    windows = _train(fabric, model, optimizer, loader, run, steps=3)
    steps, events, records = _records(run)
    assert sorted(steps) == [1, 2, 3] and len(windows) == 3
    for number, window in enumerate(windows, start=1):
        expected, loss = _by_hand(window)
        for got, want in zip(window.after, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        body = steps[number]
        assert body["micro_batches"] == 2 and body["samples"] == 16
        assert body["loss"] == loss  # the window's mean: its losses as fabric.backward got them
        assert body["lr"] == LR
    assert records[-1]["type"] == "bye" and runs.list_runs() == []
    assert "backward" not in vars(fabric)  # Fabric's own backward again


def test_live_accum_steps_lr_scale_clipping_precision_and_checkpointing_match_by_hand():
    fabric, model, optimizer, loader, run = _set_up(accum_steps=2, max_grad_norm=0.0)
    plan = {3: {"accum_steps": 3},  # the window each change applies from
            4: {"lr_scale": 0.5, "max_grad_norm": 0.5},
            5: {"precision": "bf16", "checkpointing": True},
            7: {"precision": "fp32", "accum_steps": 1, "checkpointing": False}}

    def at_boundary(window):
        for knob, value in plan.get(window + 2, {}).items():
            reply = send_command(run.agent.info, knob, value)
            assert reply["ok"] and reply["apply_step"] == window + 2, reply

    windows = _train(fabric, model, optimizer, loader, run, steps=8, at_boundary=at_boundary)
    assert [len(w.micro_batches) for w in windows] == [2, 2, 3, 3, 3, 3, 1, 1]
    settings = [w.settings for w in windows]
    assert [s["lr_scale"] for s in settings] == [1.0] * 3 + [0.5] * 5
    assert [s["max_grad_norm"] for s in settings] == [0.0] * 3 + [0.5] * 5
    assert [s["precision"] for s in settings] == ["fp32"] * 4 + ["bf16"] * 2 + ["fp32"] * 2
    assert [s["checkpointing"] for s in settings] == [False] * 4 + [True] * 2 + [False] * 2
    steps, _, _ = _records(run)
    for number, window in enumerate(windows, start=1):
        expected, loss = _by_hand(window)
        for got, want in zip(window.after, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0,
                                       msg=lambda m: f"step {number}: {m}")
        assert steps[number]["loss"] == loss, number
        assert steps[number]["micro_batches"] == len(window.micro_batches)
        assert steps[number]["lr"] == LR * window.settings["lr_scale"]
        assert {knob: steps[number]["knobs"][knob] for knob in window.settings} == \
            window.settings
    assert optimizer.param_groups[0]["lr"] == LR  # the schedule's own rate, between steps
    # Fabric's own autocast() followed the plugin back to fp32
    with fabric.autocast():
        assert not torch.is_autocast_enabled("cpu")


def test_fp16_keeps_one_grad_scaler_across_switches_and_reports_skipped_steps(monkeypatch):
    """fp16 on CUDA, staged on the CPU: Fabric runs 16-mixed as bf16 on a CPU, so the
    knob refuses it there; with that refusal lifted, the plugin mechanics run as on a
    GPU (torch's GradScaler works on CPU tensors)."""
    monkeypatch.setattr(fabric_integration, "_precision_refusal", lambda value, device: None)
    fabric, model, optimizer, loader, run = _set_up(accum_steps=1, max_grad_norm=1.0)
    scalers = []  # the plugin's GradScaler after each boundary: the next window's

    def at_boundary(window):
        scalers.append(getattr(fabric.strategy.precision, "scaler", None))
        value = {3: "fp16", 5: "fp32", 6: "fp16"}.get(window + 2)  # from window 3, 5, 6
        if value is not None:
            assert send_command(run.agent.info, "precision", value)["ok"]

    _train(fabric, model, optimizer, loader, run, steps=6, at_boundary=at_boundary)
    kept = run.precision.scaler
    assert isinstance(kept, torch.amp.GradScaler)
    assert scalers == [None, kept, kept, None, kept, kept]  # one GradScaler, kept
    assert kept.get_scale() == 2.0 ** 16  # nothing overflowed: the scale never backed off
    steps, _, _ = _records(run)
    assert [steps[s]["knobs"]["precision"] for s in sorted(steps)] == \
        ["fp32", "fp32", "fp16", "fp16", "fp32", "fp16"]
    assert [steps[s].get("grad_scaler_skipped") for s in sorted(steps)] == \
        [None, None, False, False, None, False]
    assert all(steps[s]["grad_norm"] > 0 for s in steps)  # clipped after the unscale


def test_kernels_compile_on_the_wrapped_module_trains_as_eager():
    fabric, model, optimizer, loader, run = _set_up(n=64, accum_steps=2,
                                                    compile_backend="aot_eager")

    def at_boundary(window):
        if window == 1:
            refused = send_command(run.agent.info, "kernels", "triton")
            assert not refused["ok"] and "no gpuopt fused modules" in refused["reason"]
            assert send_command(run.agent.info, "kernels", "compile")["ok"]

    windows = _train(fabric, model, optimizer, loader, run, steps=4, at_boundary=at_boundary)
    inner = model.module
    assert isinstance(vars(inner)["forward"], CompiledModel)  # the module's own forward
    assert "forward" not in vars(model)  # not Fabric's wrapper (its forward calls inner)
    assert run.model_backend.compiled.compiles >= 1
    for number, window in enumerate(windows, start=1):
        expected, _ = _by_hand(window)
        for got, want in zip(window.after, expected):
            torch.testing.assert_close(got, want, msg=lambda m: f"step {number}: {m}")
    steps, events, _ = _records(run)
    assert [steps[s]["knobs"]["kernels"] for s in sorted(steps)] == ["eager"] * 2 + \
        ["compile"] * 2
    kinds = {e.get("kind") for e in events}
    assert {"compiling", "compiled"} <= kinds


def test_kernels_compile_on_a_fabric_model_through_agent_session_trains():
    """The RecursionError of before: the compiled forward went through Fabric's wrapper's
    __setattr__ onto the module inside it, whose forward then called the wrapper."""
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(BlockNet())
    run = agent.session(model=model, compile_backend="eager")
    run.agent.knobs.knobs["kernels"].set("compile")
    assert "forward" not in vars(model.module)
    x, y = digits_loader(batch_size=8, n=8)[0]
    F.cross_entropy(model(x), y).backward()
    assert run.model_backend.compiled.compiles == 1
    run.agent.knobs.knobs["kernels"].set("eager")
    assert "forward" not in vars(model)  # the wrapper as it was
    run.close()


def test_knobs_that_cannot_be_exact_are_refused_with_their_reason(tmp_path):
    fabric, model, optimizer, loader, run = _set_up(n=32)
    schema = {knob["name"] for knob in run.agent.knobs.schema()}
    assert schema == {"precision", "kernels", "checkpointing", "lr_scale", "weight_decay",
                      "checkpoint", "cpu_threads", "pause", "stop", "recover", "rewind"}

    def reason(knob, value):
        reply = send_command(run.agent.info, knob, value)
        assert not reply["ok"], reply
        return reply["reason"]

    assert reason("accum_steps", 2) == (
        "accum_steps: this loop did not declare accum_steps: pass agent.attach(fabric, "
        "accum_steps=N) and use run.is_accumulating and run.accum_steps in its loop")
    assert reason("max_grad_norm", 1.0) == (
        "max_grad_norm: this loop did not declare max_grad_norm: pass agent.attach(fabric, "
        "max_grad_norm=X) (0: off) and leave out the loop's own fabric.clip_gradients; the "
        "run then clips inside optimizer.step()")
    assert reason("precision", "fp16") == (
        "precision=fp16: Fabric has no fp16 AMP on a CPU (it runs precision='16-mixed' as "
        "'bf16-mixed' there): choose bf16")
    assert "ReconfigurableLoader" in reason("micro_batch_size", 4)
    assert reason("memory_fraction", 0.5) == "memory_fraction: needs CUDA; this run is on cpu"
    with pytest.raises(AttributeError, match="agent.attach.fabric, accum_steps=N"):
        run.is_accumulating
    run.close()
    with pytest.raises(ValueError, match="is not a checkpoint of gpuwatch's"):
        torch.save({"model": model.state_dict()}, tmp_path / "other.pt")
        agent.attach(fabric, resume_from=tmp_path / "other.pt")
    assert "backward" not in vars(fabric)  # a failed attach leaves Fabric as it was

    # true half precision (the weights converted) and a module compiled before setup
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    model = fabric.setup(torch.compile(BlockNet(), backend="eager"))
    run = agent.attach(fabric)
    assert run.knobs.unsupported["precision"] == (
        "the Fabric's precision is 'bf16-true' (HalfPrecision); gpuwatch switches only "
        "between Fabric's Precision (32-true) and MixedPrecision (bf16-mixed, 16-mixed)")
    assert run.knobs.unsupported["kernels"] == ("the module was torch.compile'd before "
                                                "fabric.setup")
    assert "no optimizer set up by fabric.setup" in run.knobs.unsupported["lr_scale"]
    run.close()

    # two modules set up: which one trains is for the script to say
    fabric = Fabric(accelerator="cpu", devices=1)
    modules = [fabric.setup(BlockNet()) for _ in range(2)]
    with pytest.raises(ValueError, match="set up 2 modules"):
        agent.attach(fabric)
    agent.attach(fabric, model=modules[1]).close()
    with pytest.raises(TypeError, match="or a lightning.fabric.Fabric, not builtins.object"):
        agent.attach(object())


def _held_out_loss(model, x, y):
    """The eval_fn of the steering tests: the mean loss on held-out digits, no grad."""
    model.eval()
    with torch.no_grad():
        return {"val_loss": float(F.cross_entropy(model(x), y)), "note": "x"}


def test_pause_then_resume_loses_no_step_then_evaluate_and_stop_at_one_boundary(run_dir):
    """pause=on holds after step 2 until pause=off: steps 1..4 recorded once each, with
    an unpaused twin's losses bit for bit; evaluate=now after step 4 runs the eval_fn
    given to attach (its val_loss equals a hand call on the stopped model); stop=now at
    the same boundary ends run.loader() there, so the loop's own end runs; bye names it."""
    x_val, y_val = (torch.cat(t) for t in zip(*digits_loader(batch_size=64, n=1797)[-1:]))
    fabric, model, optimizer, loader, twin = _set_up(n=96, accum_steps=1, max_grad_norm=0.0)
    _train(fabric, model, optimizer, loader, twin, steps=6)
    twin_steps, _, _ = _records(twin)
    fabric, model, optimizer, loader, run = _set_up(
        n=96, accum_steps=1, max_grad_norm=0.0,
        eval_fn=lambda: _held_out_loss(model, x_val, y_val))
    info = runs.find_run(run.agent.run_id)
    for knob, value, step in (("pause", "on", 3), ("evaluate", "now", 5), ("stop", "now", 5)):
        reply = send_command(info, knob, value, apply_step=step)
        assert reply["ok"] and reply["apply_step"] == step, reply
    resumer, resumed = resume_when_paused(info)
    # returns before its 6 steps: run.loader() ended, and the loop's own end runs
    windows = _train(fabric, model, optimizer, loader, run, steps=6)
    resumer.join(30)
    assert resumed and resumed[0]["ok"] and resumed[0]["apply_step"] == 3, resumed
    assert run.stopping and len(windows) == 4 and run.step == 4
    steps, events, records = _records(run)
    assert sorted(steps) == [1, 2, 3, 4]  # none lost or repeated
    assert [steps[k]["loss"] for k in steps] == [twin_steps[k]["loss"] for k in steps]
    applied = [(e["knob"], e["value"], e["step"]) for e in events if e["kind"] == "applied"]
    assert applied == [("pause", "on", 3), ("pause", "off", 3), ("evaluate", "now", 5),
                       ("stop", "now", 5)]
    assert records[-1]["type"] == "bye" and records[-1]["reason"] == (
        "stopped by stop=now after step 4")
    [event] = [e for e in events if e["kind"] == "evaluation"]
    assert event["step"] == 4
    assert event["metrics"] == {"val_loss": _held_out_loss(model, x_val, y_val)["val_loss"]}
    assert runs.list_runs() == []


def test_stop_checkpoint_saves_then_ends_and_the_checkpoint_resumes_the_run(run_dir,
                                                                           tmp_path):
    """stop=checkpoint for step 4 saves after step 3 and ends run.loader() there (bye
    names it); a run resumed from that checkpoint trains steps 4..6 with the losses of a
    run that never stopped."""
    fabric, model, optimizer, loader, twin = _set_up(n=96, accum_steps=1, max_grad_norm=0.0)
    _train(fabric, model, optimizer, loader, twin, steps=6)
    twin_steps, _, _ = _records(twin)
    fabric, model, optimizer, loader, run = _set_up(n=96, accum_steps=1, max_grad_norm=0.0,
                                                    checkpoint_dir=tmp_path)
    reply = send_command(runs.find_run(run.agent.run_id), "stop", "checkpoint",
                         apply_step=4)
    assert reply["ok"], reply
    windows = _train(fabric, model, optimizer, loader, run, steps=6)
    assert len(windows) == 3 and run.step == 3 and run.stopping
    steps, events, records = _records(run)
    assert sorted(steps) == [1, 2, 3]
    [stop] = [e for e in events if e["kind"] == "applied" and e["knob"] == "stop"]
    assert stop["text"].startswith("stop=checkpoint applied at step 4: the training ends "
                                   "after step 3; checkpoint saved")
    assert records[-1]["type"] == "bye" and records[-1]["reason"] == (
        "stopped by stop=checkpoint after step 3")
    [path] = list(tmp_path.iterdir())
    fabric, model, optimizer, loader, resumed = _set_up(n=96, accum_steps=1, max_grad_norm=0.0,
                                                        resume_from=path)
    assert resumed.step == 3
    _train(fabric, model, optimizer, loader, resumed, steps=6)
    steps, _, _ = _records(resumed)
    assert sorted(steps) == [4, 5, 6]
    assert [steps[k]["loss"] for k in steps] == [twin_steps[k]["loss"] for k in steps]


class SetEpochDriver(FabricDriver):
    """The contract's Fabric loop over a sampler Fabric sets an epoch on at each
    ``iter()`` (a DistributedSampler: each epoch's order is ``seed + epoch``'s)."""

    name = "fabric-set-epoch"

    def data(self, fabric):
        digits = IndexedDigits()
        return fabric.setup_dataloaders(DataLoader(
            digits, batch_size=BATCH_SIZE,
            sampler=DistributedSampler(digits, num_replicas=1, rank=0, seed=5)))


def test_a_resume_in_a_later_epoch_sets_the_samplers_epoch_as_it_was(tmp_path):
    """Saved in the second epoch (16 batches an epoch): the resumed run's loader is new,
    and Fabric would set its sampler to epoch 0 for the epoch it makes again."""
    driver = SetEpochDriver()
    twin = contract_run(driver, steps=14, commands=[("checkpoint", "now", 11)],
                        checkpoint_dir=tmp_path)
    path = next(e["path"] for e in twin.events("applied") if e["knob"] == "checkpoint")
    resumed = contract_run(driver, steps=14, commands=[], checkpoint_dir=tmp_path / "again",
                           resume_from=path)
    assert twin.recorder.marks[10] == 20  # 4 batches into the second epoch
    for step in range(11, 15):
        assert resumed.recorder.window(step) == twin.recorder.window(step), step
        assert resumed.steps()[step]["loss"] == twin.steps()[step]["loss"], step
    for mine, theirs in zip(resumed.params, twin.params):
        assert torch.equal(mine, theirs)


@pytest.mark.slow  # importing Lightning in a fresh process: 10-20 s
def test_the_example_runs_and_cleans_up(run_dir):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "fabric_attach.py"),
                             "--max-steps", "5"], capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr
    assert "watch it with `gpuwatch`" in result.stdout
    logs = list(Path(run_dir, "logs").glob(f"*{LOG_SUFFIX}"))
    records = list(flat_records(logs[0]))
    assert [r["step"] for r in records if r["type"] == "step"] == [1, 2, 3, 4, 5]
    assert records[-1]["type"] == "bye" and list(Path(run_dir).glob("*.json")) == []
