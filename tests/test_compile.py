"""torch.compile as a switchable backend: same results, no recompilation storms, and
compile time, recompiles, graph breaks and fallbacks reported.

The fast tests use the ``aot_eager`` backend (Dynamo + AOTAutograd, about 1 s per
graph); those with ``inductor`` (C++ code generation, about 20 s per graph on a cold
cache on 2 cores) are marked slow.

``torch._dynamo`` is imported inside the tests, not at collection: it imports Triton,
which reads ``TRITON_INTERPRET`` once, and tests/test_kernels.py sets that variable when
it is collected.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpuopt.checkpointing import ActivationCheckpointing
from gpuopt.compile import CompiledModel, compile_support
from gpuopt.demo.models import CharTransformer

VOCAB, T = 17, 12


@pytest.fixture(autouse=True)
def dynamo():
    """``torch._dynamo``, with no compiled code at the start of each test (Dynamo's
    caches are process-wide and shared by all instances of a model class)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield torch._dynamo
    torch._dynamo.reset()


def make_model(dropout: float = 0.0) -> CharTransformer:
    torch.manual_seed(0)
    return CharTransformer(VOCAB, d_model=32, n_heads=2, n_layers=2, context_len=T,
                           dropout=dropout)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (4, T), generator=generator)
    return idx, torch.roll(idx, -1, dims=1)


def frames() -> int:
    """Frames Dynamo has compiled (or tried to) in this process."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def test_compile_support_reasons():
    assert compile_support("aot_eager", "cpu") is None
    assert compile_support("no-such-backend", "cpu") == \
        "unknown torch.compile backend 'no-such-backend'"
    reason = compile_support("inductor", "cpu")
    assert reason is None or "C++ compiler" in reason


QUICK_CHECK = """
import sys
import torch
import agent
from gpuopt.compile import compile_support
print("quick:", compile_support("inductor", "cpu", thorough=False))
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), 0.1)
run = agent.session(model=model, optimizer=optimizer, name="quick")
for _ in range(3):
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    run.optimizer_step()
run.close()  # (after the I/O thread's hello and its knob schema)
[kernels] = [knob for knob in run.knobs.schema() if knob["name"] == "kernels"]
print("refused:", kernels.get("unavailable", {}).get("compile"))
print("dynamo backends imported:", "torch._dynamo.backends.common" in sys.modules)
"""


@pytest.mark.parametrize("compiler", [True, False])
def test_a_monitor_never_imports_dynamo_to_answer_whether_compile_can_run(compiler, run_dir,
                                                                         tmp_path):
    """Measured: the first ``hello``'s knob schema asked ``compile_support``, which
    imported Dynamo's backends (0.55 s of CPU on the I/O thread, holding the GIL the
    training thread steps with). The quick check answers from ``PATH`` alone (the switch checks in
    full); without a C++ compiler on ``PATH`` it refuses inductor on CPU, with the
    reason, and a session's schema says so."""
    import subprocess
    import sys

    env = {name: value for name, value in os.environ.items() if name != "CXX"}
    expected = "None"
    if not compiler:
        env["PATH"] = str(tmp_path)  # (no g++ nor clang++ there)
        expected = ("inductor on CPU needs a C++ compiler (g++ or clang++ on PATH): none "
                    "found")
    done = subprocess.run([sys.executable, "-c", QUICK_CHECK], env=env, capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"quick: {expected}", f"refused: {expected}",
                                        "dynamo backends imported: False"], done.stdout


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="unknown torch.compile backend 'nope'"):
        CompiledModel(make_model(), backend="nope")
    with pytest.raises(ValueError, match="must be a bool"):
        CompiledModel(make_model(), backend="aot_eager").enabled = "yes"


def test_eager_until_enabled_and_shares_the_parameters():
    model = make_model()
    forward = CompiledModel(model, backend="aot_eager")
    idx, _ = batch(0)
    before = frames()
    torch.testing.assert_close(forward(idx), model(idx))
    assert frames() == before and not forward.compiling and forward.stats()["compiles"] == 0
    assert forward.compiled._orig_mod is model
    assert [id(p) for p in forward.compiled.parameters()] == [id(p) for p in model.parameters()]


def check_precision_switches(backend: str) -> None:
    """fp32 -> bf16 autocast -> fp32: dtype follows autocast, values match eager, the
    autocast change recompiles once and the return to fp32 compiles nothing."""
    model = make_model().eval()
    forward = CompiledModel(model, backend=backend, enabled=True)
    idx, _ = batch(0)
    assert forward.compiling  # before the first call: it will compile

    out = forward(idx)
    assert out.dtype == torch.float32 and forward.compiling
    torch.testing.assert_close(out, model(idx), rtol=1e-4, atol=1e-5)
    events = forward.pop_events()
    assert len(events) == 1 and events[0].startswith("compiled 'forward' in ")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = forward(idx)
        reference = model(idx)
    assert out.dtype == torch.bfloat16 and forward.compiling
    torch.testing.assert_close(out.float(), reference.float(), rtol=2e-2, atol=2e-2)
    (event,) = forward.pop_events()
    assert event.startswith("recompiled 'forward'") and "autocast" in event

    before = frames()
    out = forward(idx)
    assert out.dtype == torch.float32 and not forward.compiling and frames() == before
    torch.testing.assert_close(out, model(idx), rtol=1e-4, atol=1e-5)
    assert forward.pop_events() == []
    stats = forward.stats()
    assert (stats["compiles"], stats["recompiles"], stats["graph_breaks"],
            stats["compile_fallbacks"]) == (2, 1, 0, 0)
    assert stats["compile_time_s"] > 0


def test_precision_switches_aot_eager():
    check_precision_switches("aot_eager")


@pytest.mark.slow
def test_precision_switches_inductor():
    if compile_support("inductor", "cpu") is not None:
        pytest.skip(compile_support("inductor", "cpu"))
    check_precision_switches("inductor")


def check_switching_mid_training(backend: str, tolerance: float, dropout: float) -> None:
    """eager -> compiled -> eager -> compiled, against an all-eager twin: the same
    losses and parameters; the second switch to compiled compiles nothing."""
    model, twin = make_model(dropout), make_model(dropout)
    ids = [id(p) for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    forward = CompiledModel(model, backend=backend)
    schedule = [False, False, True, True, False, False, True, True]
    losses, twin_losses, compiles_at = [], [], []
    for step, compiled in enumerate(schedule):
        forward.enabled = compiled
        idx, target = batch(step)
        for net, opt, out in ((forward, optimizer, losses), (twin, twin_optimizer, twin_losses)):
            torch.manual_seed(100 + step)
            loss = F.cross_entropy(net(idx).flatten(0, 1), target.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        forward.pop_events()
        compiles_at.append((frames(), forward.stats()["compiles"]))
    assert losses == pytest.approx(twin_losses, rel=tolerance, abs=tolerance)
    assert losses[-1] < losses[0]
    assert [id(p) for p in model.parameters()] == ids
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=10 * tolerance, atol=10 * tolerance)
    # compiled once at step 2; nothing at steps 3 and 6-7 (the second switch)
    assert compiles_at[2][1] == 1
    assert compiles_at[7] == compiles_at[2]
    assert forward.stats()["recompiles"] == 0


def test_switching_mid_training_aot_eager():
    # aot_eager runs torch's own dropout kernels: even the masks are the same
    check_switching_mid_training("aot_eager", 1e-5, dropout=0.1)


@pytest.mark.slow
def test_switching_mid_training_inductor():
    if compile_support("inductor", "cpu") is not None:
        pytest.skip(compile_support("inductor", "cpu"))
    # without dropout: inductor draws its own random numbers (unless
    # torch._inductor.config.fallback_random), so masks would differ from eager's
    check_switching_mid_training("inductor", 1e-4, dropout=0.0)


@pytest.mark.slow
def test_toggling_checkpointing_under_compile_compiles_each_state_once():
    model = make_model(dropout=0.1)
    checkpointing = ActivationCheckpointing(model)
    forward = CompiledModel(model, backend="aot_eager", enabled=True)
    idx, target = batch(0)
    grads = {}
    for enabled in (False, True, False, True, False):
        checkpointing.enabled = enabled
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        F.cross_entropy(forward(idx).flatten(0, 1), target.flatten()).backward()
        got = [p.grad.clone() for p in model.parameters()]
        if enabled not in grads:
            grads[enabled] = got
        for a, b in zip(got, grads[False]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    stats = forward.stats()
    assert (stats["compiles"], stats["recompiles"]) == (2, 1)


def test_graph_breaks_are_reported(dynamo):
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            x = self.a(x)
            dynamo.graph_break()
            return self.b(x)

    model = Breaks()
    forward = CompiledModel(model, backend="aot_eager", enabled=True)
    x = torch.randn(2, 4)
    torch.testing.assert_close(forward(x), model(x))
    events = forward.pop_events()
    assert forward.graph_breaks == 1
    assert any(e.startswith("graph break: the code around it runs eagerly") for e in events)
    assert forward.compiles == 2  # the forward up to the break, and the code after it


def test_recompile_limit_fallback_to_eager_is_reported(dynamo):
    model = make_model().eval()
    forward = CompiledModel(model, backend="aot_eager", enabled=True)
    idx, _ = batch(0)
    with dynamo.config.patch(recompile_limit=1):
        forward(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward(idx)  # would need a second entry: Dynamo gives up, runs eagerly
    assert out.dtype == torch.bfloat16
    events = forward.pop_events()
    assert forward.fallbacks == 1
    assert any("gave up on a frame, it runs eagerly: Dynamo recompile limit exceeded" in e
               and "autocast" in e for e in events), events


def test_backend_failure_falls_back_to_eager_once(dynamo):
    def broken_backend(graph_module, example_inputs):
        raise RuntimeError("no C++ compiler in this test")

    model = make_model()
    forward = CompiledModel(model, backend=broken_backend, enabled=True)
    idx, _ = batch(0)
    out = forward(idx)
    torch.testing.assert_close(out, model(idx))
    assert not forward.enabled and forward.fallbacks == 1
    (event,) = forward.pop_events()
    assert event.startswith("torch.compile (broken_backend) failed, back to eager: ")
    assert event.endswith("RuntimeError: no C++ compiler in this test")

    strict = CompiledModel(model, backend=broken_backend, enabled=True,
                           fallback_on_error=False)
    with pytest.raises(dynamo.exc.BackendCompilerFailed):
        strict(idx)


def test_a_monitor_thread_sees_which_graph_compiles_and_for_how_long():
    """While the training thread is inside a compile, another thread (the agent's I/O
    thread) reads which graph Dynamo is compiling, and the system sample says it."""
    import threading
    import time

    from agent.io.probes import SystemProbe
    from gpuopt.compile import COMPILE_WATCH

    model = make_model()
    compiled = CompiledModel(model, backend="aot_eager", enabled=True)
    assert COMPILE_WATCH.progress() is None  # nothing compiles yet
    done_before = COMPILE_WATCH.graphs_compiled
    seen, samples = [], []
    finished = threading.Event()

    def train() -> None:
        idx, targets = batch(0)
        F.cross_entropy(compiled(idx).flatten(0, 1), targets.flatten()).backward()
        finished.set()

    probe = SystemProbe()
    thread = threading.Thread(target=train)
    thread.start()
    while not finished.is_set():
        progress = COMPILE_WATCH.progress()
        if progress is not None:
            seen.append(progress)
            if not samples:
                samples.append(probe.sample())
        time.sleep(0.005)
    thread.join()
    assert seen, "no compile seen from the other thread"
    first = seen[0]
    assert first["compiling_graph"] == "0/0" and first["compiling_graph_kind"] == "forward"
    assert max(p["compiling_graph_s"] for p in seen) > 0
    assert samples and samples[0]["compiling_graph"] == "0/0"
    assert COMPILE_WATCH.progress() is None  # over: the next sample says nothing
    assert COMPILE_WATCH.graphs_compiled >= done_before + 2  # forward and backward
