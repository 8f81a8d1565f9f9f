"""The live ``dropout`` knob: every nn.Dropout's p from the step it applies at, checked
by the masks' keep rate and scale, in the Trainer and a hand-written loop; refused with
the reason where it cannot apply."""

import math

import pytest
import torch

import agent
from agent.wire import runs
from gpuopt import Trainer
from gpuwatch.client import send_command
from tests.training import Gate, digits_loader, start

WIDTH = 4096  # dropout sees batch x WIDTH elements: ~30,000 nonzero per micro-batch


def _dropout_net(p, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, WIDTH), torch.nn.ReLU(),
                               torch.nn.Dropout(p), torch.nn.Linear(WIDTH, 10))


class MaskMeter:
    """A forward hook on a dropout module: per training forward, the module's p, the
    share of its nonzero inputs kept, how many were kept, and whether every kept value
    is its input times 1 / (1 - p), bit for bit."""

    def __init__(self, module, step):
        self.step = step
        self.seen = []
        module.register_forward_hook(self)

    def __call__(self, module, inputs, output):
        if not module.training:
            return
        x = inputs[0]
        live = x != 0
        kept = live & (output != 0)
        n = int(live.sum())
        exact = torch.equal(output[kept], x[kept] * (1.0 / (1.0 - module.p)))
        self.seen.append((self.step(), module.p, int(kept.sum()) / n, n, exact))


def _within_binomial(fraction, q, n):
    """A kept share within 5 standard deviations of Binomial(n, q) / n (a false alarm
    about once in 3.5 million forwards)."""
    return abs(fraction - q) <= 5 * math.sqrt(q * (1 - q) / n)


def _check_masks(seen, apply_step, before, after):
    assert seen, "no training forward was seen"
    for step, p, fraction, n, exact in seen:
        expected = after if step >= apply_step else before
        assert p == expected, (step, p)
        assert _within_binomial(fraction, 1 - expected, n), (step, fraction, expected, n)
        if expected in (0.5, 0.75):  # 1 / (1 - p) exact in binary: the scale bit for bit
            assert exact, step
    assert {p for _, p, *_ in seen} == {before, after}


def test_the_trainers_dropout_applies_at_its_step_with_the_new_keep_rate(run_dir):
    model = _dropout_net(0.1)
    gate = Gate(hold_at=4)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05),
                      torch.nn.functional.cross_entropy, digits_loader(), callbacks=[gate])
    meter = MaskMeter(model[2], lambda: trainer.step + 1)  # the step the forward trains
    monitor = agent.attach(trainer)
    info = runs.find_run(monitor.run_id)
    thread = start(trainer, max_steps=10)
    assert gate.reached.wait(30)
    reply = send_command(info, "dropout", 0.75)
    assert reply["ok"], reply
    gate.release.set()
    thread.join(60)
    assert not thread.is_alive()
    _check_masks(meter.seen, reply["apply_step"], 0.1, 0.75)
    assert trainer.dropout == 0.75
    # the Trainer's own checkpoint keeps it: a fresh Trainer resumes at 0.75
    again = _dropout_net(0.1)
    fresh = Trainer(again, torch.optim.SGD(again.parameters(), lr=0.05),
                    torch.nn.functional.cross_entropy, digits_loader())
    fresh.load_state_dict(trainer.state_dict())
    assert again[2].p == 0.75


def test_a_loops_dropout_applies_at_its_step_with_the_new_keep_rate(run_dir):
    model = _dropout_net(0.25)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with agent.session(name="dropout-loop", model=model, optimizer=optimizer) as run:
        meter = MaskMeter(model[2], lambda: run.step + 1)
        info = runs.find_run(run.agent.run_id)
        reply = None
        for x, y in run.loader(digits_loader()):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run.optimizer_step(loss)
            if run.step == 3:
                reply = send_command(info, "dropout", 0.5)
                assert reply["ok"], reply
            if run.step == 10:
                break
    _check_masks(meter.seen, reply["apply_step"], 0.25, 0.5)


@pytest.mark.parametrize("model, reason", [
    (torch.nn.Sequential(torch.nn.Linear(64, 10)), "Sequential has no nn.Dropout module"),
    (torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.Linear(64, 10), torch.nn.Dropout(0.2)),
     "different rates (0.1, 0.2)"),
    (None, "pass agent.session(model=model)"),
])
def test_dropout_is_refused_with_the_reason_where_it_cannot_apply(run_dir, model, reason):
    run = agent.session(name="dropout-refused", model=model)
    try:
        reply = send_command(runs.find_run(run.agent.run_id), "dropout", 0.3)
        assert not reply["ok"] and reason in reply["reason"], reply
        assert "dropout" not in run.agent.knobs.values()
    finally:
        run.close()


def test_dropout_values_beyond_its_range_are_refused_and_1_is_warned_of(run_dir):
    model = _dropout_net(0.1)
    run = agent.session(name="dropout-range", model=model)
    try:
        info = runs.find_run(run.agent.run_id)
        bad = send_command(info, "dropout", 1.5)
        assert not bad["ok"] and "above the maximum 1.0" in bad["reason"], bad
        stopping = send_command(info, "dropout", 1)
        assert stopping["ok"] and "training stops learning" in stopping["warning"], stopping
    finally:
        run.close()
    assert model[2].p == 0.1  # no boundary came: nothing applied


def test_the_demo_transformers_attention_dropout_follows_the_knob_too():
    """The demo transformer draws its attention weights' dropout inside
    scaled_dot_product_attention from a module's p: at dropout 0 its training forward is
    its evaluation forward, bit for bit (with the attention's rate left behind, it would
    still drop)."""
    from gpuopt.demo.models import CharTransformer
    from gpuopt.dropout import DropoutRate

    torch.manual_seed(0)
    model = CharTransformer(40, d_model=32, n_heads=4, n_layers=2, context_len=16,
                            dropout=0.3)
    idx = torch.randint(0, 40, (8, 16))
    rate = DropoutRate(model)
    assert rate.refusal is None and rate.p == 0.3
    assert not torch.equal(model.train()(idx), model.eval()(idx))
    rate.p = 0.0
    assert torch.equal(model.train()(idx), model.eval()(idx))


@pytest.mark.parametrize("make", ["llama", "multihead"])
def test_dropout_drawn_from_a_rate_attribute_follows_the_knob_too(make):
    """Dropout a module draws from a float rate it reads at each forward (a Hugging Face
    Llama's ``attention_dropout``, ``nn.MultiheadAttention.dropout``) is set with the
    modules': at dropout 0 the training forward is the evaluation forward, bit for bit
    (left at its old rate, the attention would still drop); rates that differ from the
    modules' are refused."""
    from gpuopt.dropout import DropoutRate

    torch.manual_seed(0)
    if make == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=4, attention_dropout=0.3,
            attn_implementation="eager"))
        inputs = torch.randint(0, 50, (4, 12))

        def forward():
            return model(inputs).logits
    else:
        model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.3,
                                                 batch_first=True)
        inputs = torch.randn(4, 12, 16)

        def forward():
            return model(inputs)
    rate = DropoutRate(model)
    assert rate.refusal is None and rate.p == 0.3

    def train_and_eval():
        model.train()
        trained = forward()
        model.eval()
        return trained, forward()

    assert not torch.equal(*train_and_eval())
    rate.p = 0.0
    assert torch.equal(*train_and_eval())
    mixed = torch.nn.MultiheadAttention(16, 2, dropout=0.1)
    assert "different rates (0, 0.1)" in DropoutRate(
        torch.nn.Sequential(torch.nn.Dropout(0.0), mixed)).refusal
