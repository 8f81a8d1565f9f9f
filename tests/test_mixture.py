"""gpuopt.mixture.MixtureLoader and the live ``mixture`` knob, checked by arithmetic: the
samples each dataset gives over a window against the weights then in force (a binomial
bound of 6 standard deviations: about 2e-9 for any draw, and the draws are seeded, so it
cannot flake); the draws after a change again, bit for bit, from a saved position, with
workers and on two ranks; a live run that changes the weights at a step and resumes from
a checkpoint after it; bad weights and the runs that refuse the knob, with the reason."""

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import agent
from agent.integrations.adapters import NOT_A_MIXTURE
from agent.wire import runs
from agent.wire.knobs import MIXTURE, KnobError
from gpuopt import Trainer
from gpuopt.mixture import MixtureLoader
from gpuwatch.client import reply_text, send_command
from gpuwatch.history import flat_records
from tests.conftest import text_of, until
from tests.training import digits_loader, model as make_model


def _sources(*sizes):
    """Datasets whose samples say where they come from: ``(value, dataset number)``,
    values ``10_000 * number + index``."""
    return [TensorDataset(torch.arange(size) + 10_000 * number,
                          torch.full((size,), number)) for number, size in enumerate(sizes)]


def _from_each(batches, count=2):
    """Samples from each dataset in ``batches``."""
    sources = torch.cat([source for _, source in batches])
    return torch.bincount(sources, minlength=count).tolist()


def _within(drawn, samples, weight, sigmas=6.0):
    """Whether ``drawn`` of ``samples`` draws is within ``sigmas`` binomial standard
    deviations of ``samples * weight``."""
    return abs(drawn - samples * weight) <= sigmas * math.sqrt(samples * weight * (1 - weight))


def _take(iterator, batches):
    return [next(iterator) for _ in range(batches)]


def test_each_window_draws_the_datasets_in_the_proportion_of_the_weights_then():
    loader = MixtureLoader(_sources(3000, 3000), [0.7, 0.3], batch_size=10, seed=1)
    batches = iter(loader)
    before = _from_each(_take(batches, 60))  # 600 samples at 0.7 / 0.3
    loader.set_weights([1, 9])  # normalised: 0.1 / 0.9
    assert loader.weights == (0.1, 0.9)
    after = _from_each(_take(batches, 60))
    assert _within(before[0], 600, 0.7), before
    assert _within(after[1], 600, 0.9), after
    assert not _within(after[1], 600, 0.3)  # the bound tells the two weights apart
    # the seeded draw as torch 2.13 makes it (420 expected at 0.7, 540 at 0.9): a
    # change here changes every saved position's samples
    assert (before, after) == ([429, 171], [65, 535])


def test_each_dataset_is_walked_in_its_own_permutation_none_repeated_in_a_pass():
    loader = MixtureLoader(_sources(40, 200), [0.5, 0.5], batch_size=8, seed=2)
    values = torch.cat([value for value, _ in loader])  # one epoch: 240 samples
    assert len(values) == 240 and len(loader) == 30
    for number, size in ((0, 40), (1, 200)):
        mine = values[(values // 10_000) == number] % 10_000
        for start in range(0, len(mine), size):  # each pass a permutation of the dataset
            walk = mine[start:start + size]
            assert len(set(walk.tolist())) == len(walk) and walk.max() < size
    # the small dataset is drawn about 120 times: three passes and the start of a fourth
    assert len(values[values < 10_000]) > 80


def test_a_position_saved_after_a_change_resumes_the_same_draws_bit_for_bit():
    """Saved 5 batches after a change, mid-epoch (15 batches an epoch); a fresh loader
    built with other weights goes on with the same 20 batches, across an epoch's end."""
    loader = MixtureLoader(_sources(60, 90), [0.7, 0.3], batch_size=10, seed=3)
    batches = iter(loader)
    _take(batches, 4)
    loader.set_weights([0.2, 0.8])
    _take(batches, 5)
    saved = loader.save_position()
    expected = _take(batches, 6) + _take(iter(loader), 14)  # into the next epoch
    fresh = MixtureLoader(_sources(60, 90), [0.5, 0.5], batch_size=10, seed=3)
    fresh.restore_position(saved)
    assert fresh.weights == (0.2, 0.8)
    again = iter(fresh)
    got = _take(again, 6) + _take(iter(fresh), 14)
    for mine, theirs in zip(got, expected, strict=True):
        assert torch.equal(mine[0], theirs[0])
    with pytest.raises(ValueError, match="not a MixtureLoader's"):
        fresh.restore_position({key: value for key, value in saved.items()
                                if key != "mixture"})


@pytest.mark.parametrize(("segments", "message"), [
    ([[150, [0.5, 0.5]]], "first mixture segment must start at sample 0, got 150"),
    ([[0, [0.5, 0.5]], [80, [1, 0]], [80, [0, 1]]], "rise strictly .* got 80 after 80"),
    ([[0, [0.5, 0.5]], [90, [1, 0]], [40, [0, 1]]], "rise strictly .* got 40 after 90"),
    ([[0, [0.5, 0.5]], [200, [1, 0]]], "below the epoch's 200 samples, got 200"),
    ([[0, [0.5, 0.5]], [10.5, [1, 0]]], "must be a whole number, got '10.5'"),
    ([[0, [0.5, 0.5]], [True, [1, 0]]], "must be a whole number, got 'True'"),
    ([[0, [0.5, -1]]], "finite numbers >= 0, got -1"),
    ([[0, [1, 1, 1]]], "has 2 datasets, got 3 weights"),
    ([[0]], r"must be \[first sample, weights\]"),
    ([], "a list of 1 to 200 .* got list of 0"),
    ([[start, [1, 1]] for start in range(201)], "a list of 1 to 200 .* got list of 201"),
    ("0,0.5,0.5", "a list of 1 to 200"),
    (None, "a list of 1 to 200"),
])
def test_a_position_whose_weight_changes_do_not_cover_the_epoch_is_refused(segments,
                                                                           message):
    """A position from a file is untrusted: weight changes that would leave samples of the
    epoch undrawn (indices never written) are refused with the reason, and the loader
    goes on as it was: its next batch is the one it would have given."""
    loader = MixtureLoader(_sources(100, 100), [0.5, 0.5], batch_size=10, seed=0)
    expected = next(iter(MixtureLoader(_sources(100, 100), [0.5, 0.5], batch_size=10,
                                       seed=0)))
    saved = loader.save_position()
    with pytest.raises(ValueError, match=message):
        loader.restore_position({**saved, "mixture": {"weights": [0.5, 0.5],
                                                      "segments": segments}})
    assert torch.equal(next(iter(loader))[0], expected[0])
    assert loader.weights == (0.5, 0.5)


def test_workers_loading_ahead_give_the_batches_of_a_loader_without_workers():
    """Two persistent workers load batches ahead of the change: those are drawn again."""
    plain = MixtureLoader(_sources(100, 100), [0.9, 0.1], batch_size=5, seed=4)
    loaded = MixtureLoader(_sources(100, 100), [0.9, 0.1], batch_size=5, seed=4,
                           num_workers=2, prefetch_factor=4, persistent_workers=True)
    seen = []
    for loader in (plain, loaded):
        batches = iter(loader)
        first = _take(batches, 3)
        loader.set_weights([0.1, 0.9])
        seen.append(first + _take(batches, 20))
        loader.close()
    for mine, theirs in zip(*seen, strict=True):
        assert torch.equal(mine[0], theirs[0])
    assert _from_each(seen[1][3:])[1] > 70  # of 100 after the change: 0.9 in force


def test_two_ranks_take_their_shares_of_one_draw_and_change_it_at_one_sample():
    whole = MixtureLoader(_sources(80, 80), [0.6, 0.4], batch_size=8, seed=5)
    ranks = [MixtureLoader(_sources(80, 80), [0.6, 0.4], batch_size=4, seed=5,
                           num_replicas=2, rank=rank) for rank in (0, 1)]
    sequences = []
    for loader in (whole, *ranks):
        batches = iter(loader)
        first = _take(batches, 5)
        loader.set_weights([0.25, 0.75])
        sequences.append(torch.cat([value for value, _ in first + _take(batches, 10)]))
    single, rank0, rank1 = sequences
    assert torch.equal(single[0::2], rank0) and torch.equal(single[1::2], rank1)


@pytest.mark.parametrize(("weights", "message"), [
    ([0.5, -0.5], "finite numbers >= 0, got -0.5"),
    ([0, 0], "all 0"),
    ([1, 2, 3], "has 2 datasets, got 3 weights"),
    ([float("nan"), 1], "finite numbers >= 0, got nan"),
    ("0.5,0.5", "a sequence of numbers"),
])
def test_bad_weights_are_refused_and_change_nothing(weights, message):
    loader = MixtureLoader(_sources(10, 10), [1, 3], batch_size=2)
    with pytest.raises(ValueError, match=message):
        loader.set_weights(weights)
    assert loader.weights == (0.25, 0.75)
    with pytest.raises(ValueError, match=message):
        MixtureLoader(_sources(10, 10), weights, batch_size=2)


def test_a_mixture_needs_datasets_and_none_empty():
    with pytest.raises(ValueError, match="1 to 64 datasets, got 0"):
        MixtureLoader([], [], batch_size=2)
    with pytest.raises(ValueError, match="dataset 1 of the mixture is empty"):
        MixtureLoader(_sources(10, 0), [1, 1], batch_size=2)


@pytest.mark.parametrize(("value", "message"), [
    ("0.5,-1", "is not a list of numbers >= 0"),
    ("0,0", "the weights are all 0: no dataset to draw from"),
    ("a,b", "is not a list of numbers >= 0"),
    ("1,inf", "is not a list of numbers >= 0"),
    (",".join(["1"] * 65), "at most 64"),
    (7, "is not a list of weights"),
])
def test_the_knob_refuses_values_that_are_not_weights(value, message):
    with pytest.raises(KnobError, match=message):
        MIXTURE.coerce(value)


def test_the_knobs_value_is_the_normalised_weights_as_people_type_them():
    assert MIXTURE.coerce("7, 3") == "0.7,0.3"
    assert MIXTURE.coerce([1, 1, 2]) == "0.25,0.25,0.5"
    assert MIXTURE.coerce("1e308,1e308") == "0.5,0.5"  # a sum past float's range too
    assert MIXTURE.coerce("1,0") == "1,0"


# ------------------------------------------------------------------ a live run

def _digits_by_label():
    """Two datasets of digits: labels 0-4 (dataset 0) and 5-9 (dataset 1)."""
    x, y = (torch.cat(t) for t in zip(*digits_loader(batch_size=1797, n=1797)))
    return [TensorDataset(x[y < 5], y[y < 5]), TensorDataset(x[y >= 5], y[y >= 5])]


def _loop(run, loader, steps, model, optimizer):
    """One optimizer step per batch of ``run.loader(loader)``; each step's targets."""
    targets = {}
    for x, y in run.loader(loader, epochs=None):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        run.optimizer_step()
        targets[run.step] = y
        if run.step == steps:
            break
    log_path = run.agent.info.log_path
    run.close()
    return targets, list(flat_records(log_path))


def test_a_loop_changes_the_mixture_at_its_step_and_a_resume_draws_the_same(run_dir,
                                                                            tmp_path):
    """mixture=1,9 (0.1 / 0.9) for step 4: steps 1-3 draw at 0.7 / 0.3, steps 4-20 at 0.1 / 0.9
    (272 samples: 245 expected from dataset 1, within 6 standard deviations; 82 at the
    old weights is far outside); a checkpoint after step 8 resumes steps 9-20 with the
    same batches and losses, bit for bit, from a loader built with the first weights; a
    copy of it whose weight changes skip samples of the epoch is refused with the
    reason."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = agent.session(model=model, optimizer=optimizer, checkpoint_dir=tmp_path)
    assert run.knobs.unsupported["mixture"] == NOT_A_MIXTURE  # until the loader binds it
    loader = MixtureLoader(_digits_by_label(), [0.7, 0.3], batch_size=16, seed=6)
    info = runs.find_run(run.agent.run_id)
    run.bind_loader(loader)  # as run.loader(loader) does: its knobs, mixture among them
    for knob, value, step in (("mixture", "1,9", 4), ("checkpoint", "now", 9)):
        reply = send_command(info, knob, value, apply_step=step)
        assert reply["ok"] and reply["apply_step"] == step, reply
    assert reply_text("mixture", "1,9", send_command(info, "mixture", "1,9", apply_step=4)) \
        == "accepted: mixture=0.1,0.9 applies at step 4 (no change)"  # normalised, as
    # it applies: the value the knob will have by then (the command before it)
    refused = send_command(info, "mixture", "1,1,1")
    assert refused["reason"] == ("mixture: 3 weights, and this run's mixture has 2 "
                                 "datasets: one weight each")
    targets, records = _loop(run, loader, 20, model, optimizer)
    steps = {r["step"]: r for r in records if r["type"] == "step"}
    assert [steps[s]["knobs"]["mixture"] for s in (1, 3, 4, 20)] == [
        "0.7,0.3", "0.7,0.3", "0.1,0.9", "0.1,0.9"]
    after = sum(int((targets[s] >= 5).sum()) for s in range(4, 21))
    assert _within(after, 17 * 16, 0.9) and not _within(after, 17 * 16, 0.3), after
    [saved] = [r["path"] for r in records if r["type"] == "event"
               and r.get("kind") == "applied" and r.get("knob") == "checkpoint"]

    model = make_model(seed=1)  # the checkpoint's weights replace these
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    resumed = agent.session(model=model, optimizer=optimizer, resume_from=saved)
    loader = MixtureLoader(_digits_by_label(), [0.7, 0.3], batch_size=16, seed=6)
    again, records = _loop(resumed, loader, 20, model, optimizer)
    assert sorted(again) == list(range(9, 21))
    for step in again:
        assert torch.equal(again[step], targets[step]), step
    resumed_steps = {r["step"]: r for r in records if r["type"] == "step"}
    assert [resumed_steps[s]["loss"] for s in again] == [steps[s]["loss"] for s in again]
    assert resumed_steps[9]["knobs"]["mixture"] == "0.1,0.9"

    # the same checkpoint with a weight change that skips the epoch's first 150 samples:
    # the resume says why when the loader is bound, and draws nothing from it
    tampered = torch.load(saved, weights_only=True)
    tampered["data"]["loader"]["mixture"]["segments"] = [[150, [0.1, 0.9]]]
    torch.save(tampered, tmp_path / "tampered.pt")
    model = make_model(seed=1)
    resumed = agent.session(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            resume_from=tmp_path / "tampered.pt")
    try:
        with pytest.raises(ValueError, match="first mixture segment must start at sample 0, "
                                             "got 150"):
            resumed.loader(MixtureLoader(_digits_by_label(), [0.7, 0.3], batch_size=16,
                                         seed=6))
    finally:
        resumed.close()


def test_a_rollback_puts_the_weights_and_the_draws_back_as_they_were(run_dir):
    """In a loop: 0.1 / 0.9 after step 2, the rollback's snapshot after step 4, 0.5 / 0.5
    after step 5, then back to the snapshot after step 7 (as the guard does): steps 8-10
    train the batches of a run that made the first change only (step 5's again, then
    two more at 0.1 / 0.9)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = agent.session(model=model, optimizer=optimizer)
    loader = MixtureLoader(_digits_by_label(), [0.7, 0.3], batch_size=16, seed=7)
    twin = MixtureLoader(_digits_by_label(), [0.7, 0.3], batch_size=16, seed=7)
    twin_batches = iter(twin)
    expected = _take(twin_batches, 2)
    twin.set_weights([0.1, 0.9])
    expected += _take(twin_batches, 5)
    seen, snapshot = [], None
    for x, y in run.loader(loader, epochs=None):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        run.optimizer_step()
        seen.append(y)
        if len(seen) == 2:
            run.knobs.knobs["mixture"].set("0.1,0.9")  # as the agent applies it
        elif len(seen) == 4:
            snapshot = run.state_snapshot()
        elif len(seen) == 5:
            run.knobs.knobs["mixture"].set("0.5,0.5")
        elif len(seen) == 7:
            assert run.load_snapshot(snapshot) is None
            assert loader.weights == (0.1, 0.9)
        elif len(seen) == 10:
            break
    run.close()
    assert not torch.equal(seen[5], expected[5][1])  # 0.5 / 0.5 drew another batch 6
    for mine, theirs in zip(seen[:5] + seen[7:], expected[:5] + expected[4:], strict=True):
        assert torch.equal(mine, theirs[1])


def test_the_trainer_binds_a_mixture_loader_and_refuses_the_knob_for_other_data(run_dir):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = MixtureLoader(_digits_by_label(), [0.5, 0.5], batch_size=16)
    monitor = agent.attach(Trainer(model, optimizer, torch.nn.functional.cross_entropy,
                                   loader))
    try:
        knob = monitor.knobs.knobs["mixture"]
        assert knob.get() == "0.5,0.5" and knob.spec.minimum == knob.spec.maximum == 2
        knob.set("0.25,0.75")  # as the agent applies it at a boundary
        assert loader.weights == (0.25, 0.75)
    finally:
        monitor.close()
    monitor = agent.attach(Trainer(model, optimizer, torch.nn.functional.cross_entropy,
                                   digits_loader()))
    try:
        reply = send_command(runs.find_run(monitor.run_id), "mixture", "0.5,0.5")
        assert not reply["ok"] and reply["reason"] == f"mixture: {NOT_A_MIXTURE}", reply
    finally:
        monitor.close()


def test_fabric_binds_a_mixture_given_to_run_loader_and_refuses_it_for_other_data(run_dir):
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    plain = fabric.setup_dataloaders(DataLoader(_digits_by_label()[0], batch_size=16))
    run = agent.attach(fabric)
    next(iter(run.loader(plain)))  # a Fabric loader: no mixture to weight
    assert run.knobs.unsupported["mixture"] == NOT_A_MIXTURE
    run.close()
    loader = MixtureLoader(_digits_by_label(), [0.5, 0.5], batch_size=16)
    run = agent.attach(fabric, loader=loader)
    assert run.knobs.knobs["mixture"].get() == "0.5,0.5"
    assert "mixture" not in run.knobs.unsupported
    run.close()


async def test_the_knobs_panel_shows_the_weights_in_the_data_group_and_help_explains():
    from textual.widgets import Static

    from gpuwatch.screens.help import HelpScreen
    from tests.test_dashboard import _silent_app, envelope

    source, app = _silent_app()
    spec = {**MIXTURE.to_wire(), "min": 2, "max": 2}  # as a run of two datasets binds it
    async with app.run_test(size=(120, 40)) as pilot:
        with source.lock:
            source.state.ingest(envelope("hello", {"knobs": [spec]}))
            source.state.ingest(envelope("step", {"step": 1, "knobs": {"mixture": "0.7,0.3"}}))
        await until(pilot, lambda: "mixture 0.7,0.3" in text_of(app, "#knobs"))
        lines = text_of(app, "#knobs").splitlines()
        assert lines.index(next(line for line in lines if "mixture" in line)) > lines.index(
            next(line for line in lines if line.strip() == "data"))
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        shown = " ".join(str(cell.content) for cell in app.screen.query(Static))
        assert "mixture: the weights a gpuopt.mixture.MixtureLoader draws its datasets " \
               "with" in shown and ":mixture=0.7,0.3 sets them" in shown
