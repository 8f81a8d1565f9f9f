"""ReconfigurableLoader: worker settings changed mid-epoch with real DataLoader workers.

The dataset returns its own index, so a batch is the list of indices it was built from
and "every index exactly once, in the unswitched order" can be checked directly.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import psutil
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from gpuopt.loader import (MAX_NUM_WORKERS, LoaderPosition, LoaderReconfigureError,
                           ReconfigurableLoader)

N = 1000
BATCH = 8


class Indices(Dataset):
    """Sample ``i`` is ``i``; raises in a worker that :func:`_init_poisons_if` poisoned."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.poisoned = False

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if self.poisoned:
            raise RuntimeError(f"sample {index} refused (poisoned worker)")
        return index


def _init_fails_if(flag: Path, worker_id: int) -> None:
    """worker_init_fn: a worker started while ``flag`` exists fails to start."""
    if flag.exists():
        raise RuntimeError(f"worker {worker_id} cannot start (flag present)")


def _init_poisons_if(flag: Path, worker_id: int) -> None:
    """worker_init_fn: a worker started while ``flag`` exists fails on every sample
    (workers started before keep working)."""
    torch.utils.data.get_worker_info().dataset.poisoned = flag.exists()


def _reference(n=N, *, epoch=0, num_replicas=1, rank=0, shuffle=True, seed=0,
               drop_last=False, batch=BATCH):
    """The batches a DataLoader over a DistributedSampler gives for ``epoch``."""
    dataset = Indices(n)
    sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank,
                                 shuffle=shuffle, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    loader = DataLoader(dataset, batch_sampler=BatchSampler(sampler, batch, drop_last))
    return [b.tolist() for b in loader]


def _run_epoch(loader, switches=None):
    """One epoch as lists of indices; ``switches`` maps a count of batches consumed to
    the settings applied at that point."""
    switches = switches or {}
    batches = []
    if 0 in switches:
        loader.reconfigure(**switches[0])
    for batch in loader:
        batches.append(batch.tolist())
        if len(batches) in switches:
            loader.reconfigure(**switches[len(batches)])
    return batches


def _flatten(batches):
    return [i for batch in batches for i in batch]


def test_order_matches_distributed_sampler_for_uneven_shards():
    for n, replicas, drop_last, shuffle in [(1001, 3, False, True), (1001, 3, True, True),
                                            (10, 4, False, False), (5, 8, False, True),
                                            (37, 2, True, False)]:
        for rank in range(replicas):
            loader = ReconfigurableLoader(Indices(n), BATCH, num_replicas=replicas, rank=rank,
                                          shuffle=shuffle, seed=3, drop_last=drop_last)
            for epoch in (0, 1):
                loader.set_epoch(epoch)
                expected = _reference(n, epoch=epoch, num_replicas=replicas, rank=rank,
                                      shuffle=shuffle, seed=3, drop_last=drop_last)
                assert _run_epoch(loader) == expected
                assert len(loader) == len(expected)


def test_switching_workers_mid_epoch_keeps_order_over_two_epochs():
    loader = ReconfigurableLoader(Indices(), BATCH, seed=7)
    assert len(loader) == N // BATCH
    plan = [{37: {"num_workers": 2}, 60: {"num_workers": 1}, 90: {"num_workers": 0}},
            {5: {"num_workers": 2, "prefetch_factor": 4}, 6: {"num_workers": 1},
             120: {"num_workers": 0}}]
    for epoch, switches in enumerate(plan):
        batches = _run_epoch(loader, switches)
        assert batches == _reference(epoch=epoch, seed=7)
        assert sorted(_flatten(batches)) == list(range(N))
        assert loader.position == LoaderPosition(epoch, len(loader), len(loader))
    assert _reference(epoch=0, seed=7) != _reference(epoch=1, seed=7)
    loader.close()


def test_two_ranks_switched_at_different_points_cover_the_dataset_once():
    seen = []
    for rank, switches in [(0, {3: {"num_workers": 2}, 40: {"num_workers": 0}}),
                           (1, {0: {"num_workers": 1}, 17: {"num_workers": 2},
                                61: {"num_workers": 0}})]:
        loader = ReconfigurableLoader(Indices(), BATCH, num_replicas=2, rank=rank)
        batches = _run_epoch(loader, switches)
        assert batches == _reference(num_replicas=2, rank=rank)
        seen += _flatten(batches)
        loader.close()
    assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_new_batch_size_mid_epoch_cuts_the_rest_of_the_epoch_keeping_the_order(drop_last):
    """Every sample of the epoch once, in the unswitched order; the batches after a
    change have the new size (the last one shorter, or dropped with drop_last), and the
    next epoch starts with it; workers or not, and with other settings changed at once."""
    n = 203
    loader = ReconfigurableLoader(Indices(n), BATCH, seed=5, drop_last=drop_last)
    switches = {3: {"batch_size": 5}, 7: {"batch_size": 16, "num_workers": 2},
                9: {"batch_size": 3, "num_workers": 1}}
    batches = _run_epoch(loader, switches)
    order = _flatten(_reference(n, seed=5))
    sizes = [len(batch) for batch in batches]
    assert sizes[:3] == [8] * 3 and sizes[3:7] == [5] * 4 and sizes[7:9] == [16, 16]
    assert set(sizes[9:-1]) == {3}
    assert _flatten(batches) == order[:len(_flatten(batches))]
    left = n - 3 * 8 - 4 * 5 - 2 * 16  # samples the size-3 batches cut
    assert sizes[-1] == (3 if drop_last else (left % 3 or 3))
    assert len(_flatten(batches)) == (n - left % 3 if drop_last else n)
    assert len(loader) == len(batches) and loader.batch_size == 3
    assert {len(batch) for batch in _run_epoch(loader)[:-1]} == {3}  # the next epoch
    loader.close()


def test_a_position_saved_after_a_batch_size_change_resumes_with_the_same_batches():
    """save_position after a mid-epoch change of batch size: a fresh loader built with
    the first size goes on with the saving loader's next batches, of its size."""
    n = 203
    loader = ReconfigurableLoader(Indices(n), BATCH, seed=5)
    batches = _run_epoch(loader, {3: {"batch_size": 5}})
    resumed = ReconfigurableLoader(Indices(n), BATCH, seed=5)
    loader = ReconfigurableLoader(Indices(n), BATCH, seed=5)
    iterator = iter(loader)
    seen = [next(iterator).tolist() for _ in range(3)]
    loader.reconfigure(batch_size=5)
    seen += [next(iterator).tolist() for _ in range(2)]
    resumed.restore_position(loader.save_position())
    assert resumed.batch_size == 5 and resumed.position == loader.position
    assert seen + [batch.tolist() for batch in resumed] == batches
    with pytest.raises(ValueError, match="batches_yielded"):
        resumed.restore_position({**loader.save_position(), "batches_yielded": 10 ** 6})
    assert resumed.batch_size == 5 and resumed.position.batches_yielded == len(resumed)


def test_a_batch_size_change_whose_new_workers_fail_keeps_the_old_size(tmp_path):
    flag = tmp_path / "fail"
    loader = ReconfigurableLoader(Indices(), BATCH,
                                  worker_init_fn=functools.partial(_init_fails_if, flag))
    iterator = iter(loader)
    first = next(iterator).tolist()
    flag.touch()
    with pytest.raises(LoaderReconfigureError):
        loader.reconfigure(batch_size=4, num_workers=1)
    assert loader.batch_size == BATCH and loader.position == LoaderPosition(0, 1, len(loader))
    assert [first, next(iterator).tolist()] == _reference()[:2]
    with pytest.raises(ValueError, match="batch_size must be in"):
        loader.reconfigure(batch_size=0)
    loader.close()


def test_break_resumes_and_set_epoch_restarts():
    loader = ReconfigurableLoader(Indices(), BATCH, num_workers=2, persistent_workers=True)
    expected = _reference()
    got = []
    for batch in loader:
        got.append(batch.tolist())
        if len(got) == 10:
            break
    assert loader.position == LoaderPosition(0, 10, len(loader))
    loader.reconfigure(num_workers=1)
    got += [batch.tolist() for batch in loader]  # the same epoch, from batch 10
    assert got == expected
    assert [b.tolist() for b in loader] == _reference(epoch=1)  # the next epoch
    loader.set_epoch(0)
    assert [b.tolist() for b in loader] == expected
    loader.close()


def test_reconfigure_between_epochs_applies_to_the_next_epoch():
    children = psutil.Process().children(recursive=True)
    loader = ReconfigurableLoader(Indices(100), BATCH)
    assert len(_run_epoch(loader)) == len(loader)
    config = loader.reconfigure(num_workers=2)  # nothing left to serve: starts nothing
    assert config["num_workers"] == 2
    assert psutil.Process().children(recursive=True) == children
    assert _run_epoch(loader) == _reference(100, epoch=1)
    loader.close()


def test_switches_do_not_touch_the_global_rng():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    loader = ReconfigurableLoader(Indices(100), BATCH)
    _run_epoch(loader, {2: {"num_workers": 2}, 4: {"num_workers": 0}})
    assert torch.equal(torch.get_rng_state(), state)


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _wait_for_children(baseline, timeout_s=10.0):
    """The children not in ``baseline`` once those still exiting are reaped."""
    extra = [p for p in psutil.Process().children(recursive=True) if p not in baseline]
    _, alive = psutil.wait_procs(extra, timeout=timeout_s)
    return alive


@pytest.mark.slow
def test_hundred_alternations_leak_no_process_fd_or_shared_memory():
    children = psutil.Process().children(recursive=True)
    fds = _open_fds()
    shm = sorted(os.listdir("/dev/shm"))

    loader = ReconfigurableLoader(Indices(), 4, persistent_workers=True)
    batches = iter(loader)
    seen = []
    for switch in range(100):
        seen += next(batches).tolist()
        config = loader.reconfigure(num_workers=2 if switch % 2 == 0 else 0)
        assert config["persistent_workers_effective"] == (switch % 2 == 0)
    assert loader.config["num_workers"] == 0
    assert _wait_for_children(children) == []
    assert _open_fds() == fds
    assert sorted(os.listdir("/dev/shm")) == shm

    loader.reconfigure(num_workers=2)  # persistent workers up, then closed
    seen += _flatten(b.tolist() for b in batches)
    assert seen == _flatten(_reference(batch=4))
    loader.close()
    assert _wait_for_children(children) == []
    assert _open_fds() == fds
    assert sorted(os.listdir("/dev/shm")) == shm


@pytest.mark.parametrize("settings", [
    {"num_workers": -1}, {"num_workers": MAX_NUM_WORKERS + 1}, {"num_workers": 10000},
    {"num_workers": "2"}, {"num_workers": 2.5}, {"num_workers": 2.0}, {"num_workers": True},
    {"prefetch_factor": 0}, {"prefetch_factor": -3}, {"prefetch_factor": 1.5},
    {"prefetch_factor": True}, {"pin_memory": 1}, {"persistent_workers": "yes"},
    {"num_workers": 2, "prefetch_factor": 0},  # one good value does not go through alone
])
def test_bad_values_raise_and_change_nothing(settings):
    loader = ReconfigurableLoader(Indices(200), BATCH, num_workers=1)
    batches = iter(loader)
    got = [next(batches).tolist() for _ in range(3)]
    config, position = loader.config, loader.position
    with pytest.raises(ValueError) as error:
        loader.reconfigure(**settings)
    bad = [value for value in settings.values() if not (type(value) is int and value == 2)]
    assert repr(bad[0]) in str(error.value)
    assert loader.config == config and loader.position == position
    got += [b.tolist() for b in loader]
    assert got == _reference(200)
    loader.close()

    with pytest.raises(ValueError):
        ReconfigurableLoader(Indices(200), BATCH, **settings)


def test_bad_constructor_arguments():
    for kwargs in [{"batch_size": 0}, {"batch_size": 2.0}, {"rank": 2, "num_replicas": 2},
                   {"num_replicas": 0}, {"timeout_s": -1}, {"shuffle": 1}]:
        arguments = {"batch_size": BATCH, **kwargs}
        with pytest.raises(ValueError):
            ReconfigurableLoader(Indices(10), **arguments)
    with pytest.raises(ValueError):
        ReconfigurableLoader(Indices(10), BATCH).set_epoch(-1)


def test_refused_combinations_are_normalised_and_reported():
    loader = ReconfigurableLoader(Indices(40), BATCH, prefetch_factor=4,
                                  persistent_workers=True, pin_memory=True)
    config = loader.config
    assert config["num_workers"] == 0 and config["prefetch_factor"] == 4
    assert config["prefetch_factor_effective"] is None
    assert config["persistent_workers"] and not config["persistent_workers_effective"]
    assert any("prefetch_factor" in note for note in config["notes"])
    assert any("persistent_workers" in note for note in config["notes"])
    assert _run_epoch(loader) == _reference(40)

    config = loader.reconfigure(num_workers=2)
    assert config["prefetch_factor_effective"] == 4 and config["persistent_workers_effective"]
    assert not any("ignored" in note for note in config["notes"])
    assert config["pin_memory"]
    if not torch.cuda.is_available():
        assert not config["pin_memory_effective"]
    if not config["pin_memory_effective"]:
        assert any("pin_memory has no effect" in note for note in config["notes"])
    assert _run_epoch(loader) == _reference(40, epoch=1)
    loader.close()


def test_prefetch_factor_knob_warns_that_it_waits_for_workers():
    from agent.integrations.adapters import loader_knobs

    loader = ReconfigurableLoader(Indices(40), BATCH)
    prefetch = next(k for k in loader_knobs(loader) if k.spec.name == "prefetch_factor")
    assert prefetch.warn(4) == ("prefetch_factor is kept, and takes effect once "
                                "num_workers > 0 (it is 0 now)")
    loader.reconfigure(num_workers=1)
    assert prefetch.warn(4) is None
    loader.close()


def test_default_prefetch_factor_with_workers():
    loader = ReconfigurableLoader(Indices(40), BATCH)
    assert loader.config["prefetch_factor"] is None
    assert loader.reconfigure(num_workers=1)["prefetch_factor_effective"] == 2
    loader.close()


@pytest.mark.parametrize("failure", ["worker_init_fn", "first batch"])
def test_failing_new_workers_keep_previous_config_and_position(tmp_path, failure):
    flag = tmp_path / "fail"
    init = functools.partial(_init_fails_if if failure == "worker_init_fn"
                             else _init_poisons_if, flag)
    children = psutil.Process().children(recursive=True)
    loader = ReconfigurableLoader(Indices(), BATCH, num_workers=1, worker_init_fn=init)
    got = []
    for batch in loader:
        got.append(batch.tolist())
        if len(got) == 20:
            config, position = loader.config, loader.position
            flag.touch()
            with pytest.raises(LoaderReconfigureError, match="num_workers=2") as error:
                loader.reconfigure(num_workers=2)
            assert isinstance(error.value.__cause__, Exception)
            assert "batch 20 of 125" in str(error.value)
            assert loader.config == config and loader.position == position
            flag.unlink()
    assert got == _reference()
    loader.close()
    assert _wait_for_children(children) == []


def test_dataset_error_skips_nothing():
    class FailsOnce(Indices):
        failed = False

        def __getitem__(self, index):
            if index == 500 and not FailsOnce.failed:
                FailsOnce.failed = True
                raise KeyError(index)
            return index

    loader = ReconfigurableLoader(FailsOnce(), BATCH)
    got = []
    with pytest.raises(KeyError):
        for batch in loader:
            got.append(batch.tolist())
    got += [b.tolist() for b in loader]  # resumes at the batch that failed
    assert got == _reference()


def test_persistent_workers_survive_the_epoch_boundary_and_others_do_not():
    before = set(psutil.Process().children(recursive=True))
    loader = ReconfigurableLoader(Indices(80), BATCH, num_workers=2, persistent_workers=True)
    assert _run_epoch(loader) == _reference(80)
    workers = set(psutil.Process().children(recursive=True)) - before
    assert len(workers) == 2
    assert _run_epoch(loader) == _reference(80, epoch=1)
    assert set(psutil.Process().children(recursive=True)) - before == workers

    loader.reconfigure(persistent_workers=False)  # between epochs: stops the pool now
    assert _wait_for_children(before) == []
    assert _run_epoch(loader) == _reference(80, epoch=2)
    assert _wait_for_children(before) == []  # workers end with the epoch


# ------------------------------------------------ the dataset's state reaches the workers
# pytorch/pytorch#97326: a DataLoader worker loads from its own copy of the dataset, made
# when it started; a persistent worker keeps that copy from epoch to epoch.

STATE_N = 64


class EpochState(Dataset):
    """Sample ``i`` says what the copy of the dataset that loaded it was set to:
    ``[i, epoch, tag, set_epoch calls, perm[i], scale, pid]``. ``set_epoch`` draws its
    permutation from the global torch RNG, as a dataset that reshuffles itself would."""

    def __init__(self, n: int = STATE_N) -> None:
        self.n = n
        self.epoch = -1
        self.tag = 0
        self.calls = 0
        self.perm = torch.arange(n)
        self.scale = torch.ones(1, dtype=torch.int64)

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.calls += 1
        self.perm = torch.randperm(self.n)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, self.epoch, self.tag, self.calls, int(self.perm[index]),
                             int(self.scale), os.getpid()])


class EpochStateBatched(EpochState):
    """The same, loading a batch at once (DataLoader calls ``__getitems__``); marks its
    rows with a negative index."""

    def __getitems__(self, indices):
        return [row * torch.tensor([-1, 1, 1, 1, 1, 1, 1]) for row in
                (self[i] for i in indices)]


def _rows(loader, switches=None):
    """One epoch as a (samples, 7) tensor; ``switches`` as for :func:`_run_epoch`."""
    switches = switches or {}
    batches = []
    if 0 in switches:
        loader.reconfigure(**switches[0])
    for batch in loader:
        batches.append(batch)
        if len(batches) in switches:
            loader.reconfigure(**switches[len(batches)])
    return torch.cat(batches)


def _worker_pids(rows):
    return set(rows[:, 6].tolist()) - {os.getpid()}


def test_a_plain_dataloader_with_persistent_workers_keeps_a_stale_dataset():
    """The bug as reported: set_epoch in the training process does not reach the workers."""
    dataset = EpochState()
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=2, persistent_workers=True)
    seen = []
    for epoch in range(3):
        dataset.set_epoch(epoch)
        seen.append(set(torch.cat(list(loader))[:, 1].tolist()))
    assert seen == [{0}, {0}, {0}]  # epochs 1 and 2 were loaded in epoch 0's state
    del loader


@pytest.mark.parametrize("dataset_type", [EpochState, EpochStateBatched])
def test_set_epoch_reaches_persistent_workers_across_epochs_and_live_switches(dataset_type):
    plan = [{}, {},  # two epochs on the same persistent workers
            {2: {"num_workers": 1}, 4: {"num_workers": 0}, 6: {"num_workers": 2}},
            {0: {"num_workers": 1, "prefetch_factor": 1},
             5: {"num_workers": 2, "persistent_workers": False}}]
    orders = [_flatten(_reference(STATE_N, epoch=epoch, seed=11)) for epoch in range(4)]
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    dataset = dataset_type()
    loader = ReconfigurableLoader(dataset, BATCH, num_workers=2, persistent_workers=True,
                                  seed=11)
    pids = []
    for epoch, switches in enumerate(plan):
        rows = _rows(loader, switches)
        assert rows[:, 0].abs().tolist() == orders[epoch]
        if dataset_type is EpochStateBatched:
            assert (rows[:, 0] <= 0).all()  # its own __getitems__ loaded every batch
        assert set(rows[:, 1].tolist()) == {epoch}  # every copy in this epoch's state
        assert set(rows[:, 3].tolist()) == {epoch + 1}  # set once per epoch, in each copy
        # set_epoch drew the same permutation in every process, that of the dataset here
        assert dataset.epoch == epoch
        assert torch.equal(rows[:, 4], dataset.perm[rows[:, 0].abs()])
        pids.append(_worker_pids(rows))
    assert len(pids[0]) == 2 and pids[1] == pids[0]  # the workers were kept, not restarted
    assert len(pids[2] - pids[0]) == 3 and len(pids[3] - pids[2]) == 3  # new pools
    assert loader.dataset_restarts == 0 and loader.last_dataset_restart is None
    assert torch.equal(torch.get_rng_state(), rng)  # set_epoch's draws left ours alone
    loader.close()


def test_other_changes_to_the_dataset_reach_persistent_workers_at_the_next_epoch():
    dataset = EpochState()
    loader = ReconfigurableLoader(dataset, BATCH, num_workers=2, persistent_workers=True)
    first = _rows(loader)
    assert set(first[:, 2].tolist()) == {0}
    dataset.tag = 7  # rebound between epochs
    second = _rows(loader)
    assert set(second[:, 2].tolist()) == {7} and set(second[:, 1].tolist()) == {1}
    assert loader.dataset_restarts == 1
    assert loader.last_dataset_restart == (
        "persistent workers restarted for epoch 1, batch 0: the dataset's attribute 'tag' "
        "changed since the workers copied it")
    assert not _worker_pids(second) & _worker_pids(first)
    third = _rows(loader)  # nothing changed: the same workers go on
    assert _worker_pids(third) == _worker_pids(second) and loader.dataset_restarts == 1

    # A change inside an attribute is not seen; refresh_dataset() makes it reach them,
    # mid-epoch, from the first batch not yet handed out.
    dataset.scale.fill_(3)
    batches = iter(loader)
    head = torch.cat([next(batches) for _ in range(3)])
    loader.refresh_dataset()
    tail = torch.cat(list(batches))
    assert set(head[:, 5].tolist()) == {1} and set(tail[:, 5].tolist()) == {3}
    assert torch.cat([head, tail])[:, 0].tolist() == _flatten(_reference(STATE_N, epoch=3))
    loader.close()


def test_a_change_inside_a_wrapped_dataset_is_seen_too():
    inner = EpochState()
    subset = torch.utils.data.Subset(inner, range(0, STATE_N, 2))
    loader = ReconfigurableLoader(subset, 4, num_workers=1, persistent_workers=True)
    assert set(_rows(loader)[:, 2].tolist()) == {0}
    inner.tag = 2
    assert set(_rows(loader)[:, 2].tolist()) == {2}
    assert "'dataset.tag'" in loader.last_dataset_restart
    loader.close()


def test_a_dataset_whose_length_changes_is_refused_with_the_reason():
    class Shrinks(EpochState):
        def set_epoch(self, epoch):
            super().set_epoch(epoch)
            self.n = STATE_N - epoch

    loader = ReconfigurableLoader(Shrinks(), BATCH, num_workers=1, persistent_workers=True)
    assert len(_rows(loader)) == STATE_N
    with pytest.raises(ValueError, match="len\\(dataset\\) is 63, but was 64"):
        next(iter(loader))
    loader.close()


@pytest.mark.slow
def test_set_epoch_reaches_spawned_persistent_workers():
    dataset = EpochState()
    loader = ReconfigurableLoader(dataset, 16, num_workers=1, persistent_workers=True,
                                  multiprocessing_context="spawn")
    for epoch in range(2):  # epoch 1: the same worker, then a new one from a switch
        rows = _rows(loader, {2: {"persistent_workers": False}} if epoch else None)
        assert set(rows[:, 1].tolist()) == {epoch}
        assert set(rows[:, 3].tolist()) == {epoch + 1}
        assert torch.equal(rows[:, 4], dataset.perm[rows[:, 0]])
    loader.close()
