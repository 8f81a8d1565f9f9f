"""Attach gpuwatch to a Hugging Face ``transformers.Trainer`` run: one line.

    python examples/hf_attach.py                 # then, in another terminal: gpuwatch
    python examples/hf_attach.py --max-steps 300

A tiny GPT-2 built from its config (nothing downloaded) learns characters of Python's own
documentation (shipped with Python); ``agent.attach(trainer)`` before ``train`` adds
gpuwatch's callback, which reports every optimizer step (loss, tokens/s, data wait,
learning rate, gradient norm) and takes the knobs the Trainer can change correctly
mid-run (see the README's table). Needs ``pip install transformers accelerate``.
"""

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import agent
from gpuopt.demo.data import CharVocabulary, pydoc_text


class CharWindows(torch.utils.data.Dataset):
    """Next-character windows of ``block_size`` tokens, as ``input_ids`` and ``labels``."""

    def __init__(self, ids, block_size):
        self.ids, self.block_size = ids, block_size

    def __len__(self):
        return (len(self.ids) - 1) // self.block_size

    def __getitem__(self, i):
        window = self.ids[i * self.block_size:(i + 1) * self.block_size]
        return {"input_ids": window, "labels": window}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=1_000_000,
                        help="optimizer steps (default: about a day; Ctrl-C stops it)")
    args = parser.parse_args()
    text = pydoc_text()
    vocab = CharVocabulary.from_text(text)
    dataset = CharWindows(vocab.encode(text), block_size=64)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=128,
                                       n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0))
    model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's name maps to no loss type in HF 5
    output_dir = tempfile.mkdtemp(prefix="gpuwatch-hf-")
    trainer = Trainer(model=model, train_dataset=dataset, args=TrainingArguments(
        output_dir=output_dir, max_steps=args.max_steps, per_device_train_batch_size=16,
        learning_rate=1e-3, max_grad_norm=1.0, use_cpu=True, report_to=[],
        save_strategy="no", logging_steps=100, disable_tqdm=True))
    monitor = agent.attach(trainer, name="hf-gpt2-chars")
    print(f"run {monitor.run_id}: watch it with `gpuwatch`", flush=True)
    trainer.train()
    print(monitor.ended_line(), flush=True)  # steps trained, final loss, the run log


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the agent has said bye; no traceback
        raise SystemExit(130)
