"""Memory measurement on CPU: a profiled step, host readings, and clear refusals of what
needs CUDA. The snapshot state machine runs against a stand-in for torch.cuda.memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuopt.memory as memory
from gpuopt.demo.models import CharTransformer, DigitsCNN
from gpuopt.checkpointing import ActivationCheckpointing
from gpuopt.memory import (MemorySnapshot, SavedActivations, format_bytes, memory_stats,
                           profile_memory, set_memory_fraction)


def char_model() -> CharTransformer:
    torch.manual_seed(0)
    return CharTransformer(17, d_model=32, n_heads=2, n_layers=2, context_len=16, dropout=0.1)


def char_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def test_profile_memory_forward_and_backward():
    model = char_model()
    idx = torch.randint(0, 17, (8, 16))
    profile = profile_memory(model, idx, loss_fn=char_loss, target=idx, top=5)
    assert profile.device == "cpu" and profile.backward and profile.baseline_bytes is None
    # at least the logits [8, 16, 17] fp32 are alive at once
    assert profile.peak_bytes >= 8 * 16 * 17 * 4
    assert 0 < len(profile.top_operators) <= 5
    sizes = [op.self_memory_bytes for op in profile.top_operators]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] > 0
    assert all(op.name.startswith("aten::") and op.count >= 1 for op in profile.top_operators)
    text = profile.format()
    assert text.startswith("Memory profile on cpu, one forward+backward: peak ")
    assert profile.top_operators[0].name in text


def test_profile_memory_forward_only_and_top_zero():
    model = char_model().eval()
    with torch.no_grad():
        profile = profile_memory(model, torch.randint(0, 17, (2, 16)), top=0)
    assert not profile.backward and profile.peak_bytes > 0 and profile.top_operators == ()
    assert "one forward:" in profile.format()
    with pytest.raises(ValueError, match="top must be an integer >= 0, got -1"):
        profile_memory(model, torch.randint(0, 17, (2, 16)), top=-1)


def test_profile_memory_leaves_no_trace():
    model = DigitsCNN()  # BatchNorm running statistics and dropout
    images, labels = torch.randn(4, 1, 16, 16), torch.randint(0, 10, (4,))
    F.cross_entropy(model(images), labels).backward()  # a gradient mid-accumulation
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    profile_memory(model, images, loss_fn=F.cross_entropy, target=labels)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    assert torch.equal(torch.get_rng_state(), rng)


def test_saved_activations_count_what_backward_keeps_and_not_the_parameters():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    x = torch.randn(16, 8, requires_grad=True)  # so that addmm keeps the weight too
    with SavedActivations(model) as saved:
        out = model(x)
    # addmm keeps its input [16, 8] for the weight's gradient and the weight for the
    # input's (a parameter: not counted); ReLU keeps its output [16, 4]; 4 bytes each
    assert saved.bytes == (16 * 8 + 16 * 4) * 4
    assert saved.saved_tensors == 3  # input, weight.t() (a view of the parameter), output
    out.sum().backward()
    with SavedActivations() as everything:  # no model: parameters count too
        model(x)
    assert everything.bytes == (16 * 8 + 16 * 4 + 8 * 4) * 4


def test_saved_activations_show_checkpointing_and_precision_and_leave_training_alone():
    model = char_model().train()
    idx = torch.randint(0, 17, (8, 16))
    checkpointing = ActivationCheckpointing(model)

    def measured(autocast: bool = False) -> tuple[int, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks
        with SavedActivations(model) as saved, torch.autocast(
                "cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = char_loss(model(idx), idx)
        loss.backward()
        return saved.bytes, {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, plain_grads = measured()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    char_loss(model(idx), idx).backward()  # no meter: the same gradients, bit for bit
    assert all(torch.equal(p.grad, plain_grads[n]) for n, p in model.named_parameters())
    checkpointing.enabled = True
    checkpointed, _ = measured()
    checkpointing.enabled = False
    bf16, _ = measured(autocast=True)
    # two blocks: their inner activations are recomputed; their inputs are kept
    assert checkpointed < plain / 2, (checkpointed, plain)
    assert checkpointed >= 2 * 8 * 16 * 32 * 4  # the two blocks' inputs [8, 16, 32] fp32
    assert bf16 < plain * 0.8, (bf16, plain)
    assert measured()[0] == plain  # and back


def test_saved_activations_hooks_are_removed_even_when_the_forward_raises():
    model = torch.nn.Linear(4, 4)
    saved = SavedActivations(model)
    with pytest.raises(RuntimeError):
        with saved:
            model(torch.randn(2, 3))  # wrong shape
    before = saved.bytes
    model(torch.randn(2, 4)).sum().backward()  # outside: nothing counted, training works
    assert saved.bytes == before


def test_memory_stats_on_cpu():
    stats = memory_stats("cpu")
    assert stats["host_rss_bytes"] > 10 * 2**20  # python + torch
    assert stats["host_peak_rss_bytes"] is None or stats["host_peak_rss_bytes"] > 10 * 2**20
    assert set(stats) == {"host_rss_bytes", "host_peak_rss_bytes"}
    assert set(memory_stats()) == set(stats)  # None means CPU


def test_the_host_peak_is_never_below_the_rss_read_with_it():
    """While the process grows, the kernel's high-water mark lags its RSS counters (here
    every reading had it below): the peak reported is at least the RSS of the same
    reading."""
    held = []
    for _ in range(100):
        held.append(torch.ones(64 * 1024))  # 256 KiB of pages not touched before
        stats = memory_stats("cpu")
        if stats["host_peak_rss_bytes"] is not None:
            assert stats["host_peak_rss_bytes"] >= stats["host_rss_bytes"], stats


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_what_needs_cuda_is_refused_with_the_reason():
    fraction = "a per-process memory fraction needs CUDA"
    with pytest.raises(ValueError, match=f"{fraction}; this run is on cpu"):
        set_memory_fraction(0.5, "cpu")
    with pytest.raises(ValueError, match=f"{fraction}, which is not available here"):
        set_memory_fraction(0.5, "cuda")
    with pytest.raises(ValueError, match="a CUDA memory snapshot needs CUDA; this run is on cpu"):
        MemorySnapshot("cpu")
    with pytest.raises(ValueError, match="needs CUDA, which is not available"):
        memory_stats("cuda:0")


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, float("nan"), True, "0.5"])
def test_memory_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(ValueError, match=r"memory fraction must be a number in \(0, 1\]"):
        set_memory_fraction(fraction, "cuda")


def test_format_bytes():
    assert [format_bytes(n) for n in (None, 0, 1023, 1536, 5 * 2**20, 3 * 2**30, 2**42)] == [
        "n/a", "0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 GiB", "4096.0 GiB"]


class FakeCudaMemory:
    """Stands in for torch.cuda.memory's history recording and snapshot dump."""

    def __init__(self):
        self.calls = []

    def _record_memory_history(self, enabled="all", max_entries=None, **_):
        self.calls.append(("record", enabled, max_entries))

    def _dump_snapshot(self, filename):
        self.calls.append(("dump", filename))
        with open(filename, "wb") as file:
            file.write(b"snapshot")


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCudaMemory()
    monkeypatch.setattr(memory, "_cuda_reason", lambda device, what: None)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake._record_memory_history)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", fake._dump_snapshot)
    return fake


def test_snapshot_state_machine(fake_cuda, tmp_path):
    path = tmp_path / "snap.pickle"
    snapshot = MemorySnapshot("cuda", max_entries=1000)
    assert not snapshot.recording and snapshot.on_optimizer_step() is None
    snapshot.start(3, path)
    assert snapshot.recording and fake_cuda.calls == [("record", "all", 1000)]
    with pytest.raises(ValueError, match="already recording"):
        snapshot.start(1, path)
    assert snapshot.on_optimizer_step() is None
    assert snapshot.on_optimizer_step() is None
    assert snapshot.on_optimizer_step() == str(path)
    assert path.read_bytes() == b"snapshot" and not snapshot.recording
    assert fake_cuda.calls[1:] == [("dump", str(path)), ("record", None, None)]
    assert snapshot.on_optimizer_step() is None  # idle again

    snapshot.start(5, path)
    assert snapshot.stop(dump=False) is None and not snapshot.recording
    assert fake_cuda.calls[-1] == ("record", None, None)


def test_snapshot_bad_arguments(fake_cuda, tmp_path):
    snapshot = MemorySnapshot("cuda")
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        snapshot.start(0, tmp_path / "a.pickle")
    with pytest.raises(ValueError, match="no directory"):
        snapshot.start(2, tmp_path / "missing" / "a.pickle")
    with pytest.raises(ValueError, match="max_entries must be an integer >= 1"):
        MemorySnapshot("cuda", max_entries=0)
    assert fake_cuda.calls == []
