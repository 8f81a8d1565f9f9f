"""Activation checkpointing: same gradients, same parameters, switchable at any step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gpuopt.checkpointing import ActivationCheckpointing, find_blocks
from gpuopt.demo.models import Block, CharTransformer

VOCAB, T = 17, 12


def make_model(dropout: float = 0.0, **kwargs) -> CharTransformer:
    torch.manual_seed(0)
    return CharTransformer(VOCAB, d_model=32, n_heads=2, n_layers=3, context_len=T,
                           dropout=dropout, **kwargs)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (4, T), generator=generator)
    return idx, torch.roll(idx, -1, dims=1)


def loss_of(model: nn.Module, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).flatten(0, 1), target.flatten())


def grads(model: nn.Module, seed: int = 1, rng_seed: int = 123) -> dict[str, torch.Tensor]:
    """Gradients of one forward/backward, with the RNG seeded for dropout."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(rng_seed)
    loss_of(model, *batch(seed)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def trainable(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def test_finds_the_blocks_of_the_demo_transformer():
    model = make_model()
    assert [name for name, _ in find_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    checkpointing = ActivationCheckpointing(model)
    assert len(checkpointing) == 3 and not checkpointing.enabled
    assert checkpointing.modules == tuple(model.blocks)


def test_targets_by_name_and_by_type_without_nesting():
    model = make_model()
    assert [n for n, _ in find_blocks(model, ["blocks.1", "ln_f"])] == ["blocks.1", "ln_f"]
    assert [n for n, _ in find_blocks(model, ["blocks"])] == ["blocks.0", "blocks.1", "blocks.2"]
    # Block contains LayerNorms: asking for both keeps only the outer modules
    by_type = [n for n, _ in find_blocks(model, [Block, nn.LayerNorm])]
    assert by_type == ["blocks.0", "blocks.1", "blocks.2", "ln_f"]


def test_nothing_to_checkpoint_is_a_clear_error():
    with pytest.raises(ValueError, match="no non-empty nn.ModuleList attribute 'blocks'"):
        ActivationCheckpointing(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="select no module"):
        ActivationCheckpointing(make_model(), [nn.Conv2d])
    with pytest.raises(ValueError, match="no submodule named 'blocks.9'"):
        ActivationCheckpointing(make_model(), ["blocks.9"])
    with pytest.raises(ValueError, match="module names or nn.Module subclasses"):
        ActivationCheckpointing(make_model(), [3])
    with pytest.raises(ValueError, match="must be a bool"):
        ActivationCheckpointing(make_model()).enabled = 1


def test_gradients_equal_those_without_checkpointing():
    model = make_model()
    reference = grads(model)
    ActivationCheckpointing(model, enabled=True)
    checkpointed = grads(model)
    assert reference.keys() == checkpointed.keys() == set(trainable(model))
    for name, grad in reference.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_dropout_gradients_match_exactly_in_train_mode():
    model = make_model(dropout=0.2).train()
    reference = grads(model)
    assert not torch.equal(grads(model, rng_seed=7)["blocks.0.mlp.fc.weight"],
                           reference["blocks.0.mlp.fc.weight"])  # dropout is really active
    ActivationCheckpointing(model, enabled=True)  # preserve_rng_state=True by default
    checkpointed = grads(model)
    # the recomputation redraws the same dropout masks: bit-identical (CPU kernels are
    # deterministic)
    assert checkpointed.keys() == reference.keys()
    for name, grad in reference.items():
        assert torch.equal(checkpointed[name], grad), name


def test_the_block_is_recomputed_in_backward():
    model = make_model()
    calls = []
    # attn, not mlp: the recomputation stops early after the block's last saved tensor
    model.blocks[0].attn.register_forward_hook(lambda *_: calls.append(1))
    ActivationCheckpointing(model, enabled=True)
    loss = loss_of(model, *batch())
    assert len(calls) == 1
    loss.backward()
    assert len(calls) == 2  # the recomputation
    with torch.no_grad():  # nothing to save: no checkpoint, no recomputation
        model(batch()[0])
    assert len(calls) == 3


def test_toggling_keeps_parameters_and_every_parameter_gets_a_gradient():
    model = make_model()
    ids = {name: id(p) for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    checkpointing = ActivationCheckpointing(model)
    for enabled in (True, False, True, False, True):
        checkpointing.enabled = enabled
        got = grads(model)
        assert set(got) == set(trainable(model)), enabled
        assert all(bool(g.abs().sum() > 0) for g in got.values()), enabled
        assert {name: id(p) for name, p in model.named_parameters()} == ids
        assert list(model.state_dict()) == keys
        assert all(("forward" in b.__dict__) == enabled for b in model.blocks)
    checkpointing.enabled = False
    assert all("forward" not in b.__dict__ for b in model.blocks)  # the class's forward again


def test_frozen_input_embedding_still_trains_the_blocks():
    # The classic reentrant pitfall: no input of the checkpointed block requires grad.
    model = make_model(tie_weights=False)
    model.token_embedding.weight.requires_grad_(False)
    model.position_embedding.weight.requires_grad_(False)
    ActivationCheckpointing(model, enabled=True)
    got = grads(model)
    assert set(got) == set(trainable(model))
    assert "blocks.0.attn.qkv.weight" in got and got["blocks.0.attn.qkv.weight"].abs().sum() > 0

    # ... which use_reentrant=True really does fall into (why we pass False explicitly):
    # its output is cut off from the block's parameters
    block = model.blocks[0]
    x = model.token_embedding(batch()[0])  # requires_grad=False
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        out = checkpoint(Block.forward, block, x, use_reentrant=True)
    assert not out.requires_grad


def test_optimizer_keeps_working_across_toggles():
    model = make_model(dropout=0.1)
    reference = make_model(dropout=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    checkpointing = ActivationCheckpointing(model)
    losses = []
    for step in range(6):
        checkpointing.enabled = step % 2 == 1  # off, on, off, on, ...
        for net, opt in ((model, optimizer), (reference, reference_optimizer)):
            torch.manual_seed(step)
            loss = loss_of(net, *batch(step))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if net is model:
                losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(len(optimizer.state[p]) > 0 for p in model.parameters())  # one state, kept
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_keyword_arguments_and_bf16_autocast_pass_through():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    class WithScale(nn.Linear):
        def forward(self, x, *, scale=1.0):
            return super().forward(x) * scale

    model = Scaled()
    model.blocks[1] = WithScale(8, 8)
    ActivationCheckpointing(model, enabled=True)
    x = torch.randn(3, 8, requires_grad=True)
    out = model.blocks[1](x, scale=2.0)
    torch.testing.assert_close(out, WithScale.forward(model.blocks[1], x, scale=2.0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_second_controller_over_the_same_blocks_does_not_double_wrap():
    model = make_model()
    first = ActivationCheckpointing(model, enabled=True)
    installed = model.blocks[0].__dict__["forward"]
    second = ActivationCheckpointing(model, enabled=True)  # sees the first's wrapper
    assert model.blocks[0].__dict__["forward"] is installed
    second.enabled = False  # not its wrapper: left alone
    assert model.blocks[0].__dict__["forward"] is installed
    first.enabled = False
    assert all("forward" not in b.__dict__ for b in model.blocks)
    second.enabled = True  # wraps the class's forward, not the first's wrapper
    assert model.blocks[0].forward.original.__func__ is Block.forward
    assert set(grads(model)) == set(trainable(model))
