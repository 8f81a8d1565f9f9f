"""The framework bridge: a real Lightning run attached with gpuwatch, a knob changed
live over the agent's socket, and gpuwatch's measurements and the change read back from
the TensorBoard event file that Lightning's own TensorBoardLogger wrote."""

from __future__ import annotations

import pytest

L = pytest.importorskip("lightning.pytorch")
pytest.importorskip("tensorboard")

from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator)

from agent.integrations.lightning import attach  # noqa: E402
from agent.integrations.lightning_loggers import GpuwatchLoggers  # noqa: E402
from tests.test_lightning import Digits, Hold, _fit_with_commands, _loader  # noqa: E402


def test_lightning_run_logs_measurements_and_knob_changes_to_tensorboard(run_dir,
                                                                         tmp_path):
    logger = TensorBoardLogger(str(tmp_path / "tb"), name="", version=0)
    hold = Hold(at=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=12, log_every_n_steps=2,
                        logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[hold])
    monitor = attach(trainer, loggers=True)
    assert sum(isinstance(callback, GpuwatchLoggers) for callback in trainer.callbacks) == 1
    [reply] = _fit_with_commands(trainer, Digits(), _loader(200), hold, monitor,
                                 [("accum_steps", 2, None)])
    assert reply["ok"], reply
    changed_at = reply["apply_step"]

    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    for name in ("step_time_s", "data_wait_s", "data_wait_share", "samples_per_s",
                 "host_rss_bytes", "knob/accum_steps", "knob/precision",
                 "knob/checkpointing"):
        assert f"gpuwatch/{name}" in scalars, scalars
    step_times = events.Scalars("gpuwatch/step_time_s")
    logged = [event.step for event in step_times]  # every 2 steps
    assert logged == [2, 4, 6, 8, 10, 12], logged  # each log holds every step up to it
    assert all(0 < event.value < 5 for event in step_times)
    accum = {event.step: event.value for event in events.Scalars("gpuwatch/knob/accum_steps")}
    assert all(value == (1 if step < changed_at else 2) for step, value in accum.items())
    assert min(accum) < changed_at <= max(accum)
    assert {event.value for event in events.Scalars("gpuwatch/knob/precision")} == {0.0}
    [text] = events.Tensors("gpuwatch/knob_changes/text_summary")
    assert text.step == changed_at
    assert text.tensor_proto.string_val[0].decode() == f"step {changed_at}: accum_steps=2"


def test_hf_run_adds_measurements_to_the_trainers_tensorboard_logs(run_dir, tmp_path,
                                                                   monkeypatch):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    import agent
    from agent.integrations.hf_loggers import GpuwatchHFLoggers
    from tests.test_hf import BATCH, SEQ, Characters, _model

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=["tensorboard"],
        logging_strategy="steps", logging_steps=2,
        disable_tqdm=True, max_steps=8, per_device_train_batch_size=BATCH, optim="sgd",
        learning_rate=0.05, save_strategy="no", seed=0)
    trainer = Trainer(model=_model(), args=args, train_dataset=Characters(32))
    agent.attach(trainer)
    trainer.add_callback(GpuwatchHFLoggers(trainer))
    trainer.train()
    [events_file] = (tmp_path / "tb").rglob("events.out.tfevents.*")
    events = EventAccumulator(str(events_file.parent), size_guidance={"scalars": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    for name in ("step_time_s", "samples_per_s", "tokens_per_s", "data_wait_share",
                 "host_rss_bytes", "knob/accum_steps", "knob/precision"):
        assert f"train/gpuwatch/{name}" in scalars, scalars  # HF puts train/ before
    logged = [event.step for event in events.Scalars("train/gpuwatch/step_time_s")]
    assert set(logged) == {2, 4, 6, 8}  # at the Trainer's own logging steps
    samples_per_s = events.Scalars("train/gpuwatch/samples_per_s")
    tokens_per_s = events.Scalars("train/gpuwatch/tokens_per_s")
    assert [event.step for event in tokens_per_s] == [event.step for event in samples_per_s]
    for tokens, samples in zip(tokens_per_s, samples_per_s):  # each step: SEQ tokens a sample
        assert samples.value > 0 and tokens.value == pytest.approx(SEQ * samples.value, rel=1e-6)
    assert "train/loss" in scalars  # its own metrics, as before
