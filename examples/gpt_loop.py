"""A GPT-style hand-written training loop (after nanoGPT's train.py), with gpuwatch.

    python examples/gpt_loop.py                  # then, in another terminal: gpuwatch
    python examples/gpt_loop.py --max-steps 200 --dtype bfloat16
    python examples/gpt_loop.py --resume CHECKPOINT   # one that `s` (checkpoint=now) saved

The loop is nanoGPT's own: its ``get_batch()``, its ``micro_step`` accumulation loop,
its ``ctx`` and ``scaler``, its learning-rate schedule and gradient clipping. The lines
that attach gpuwatch end in ``# gpuwatch`` (8 of them: see the README for the diff), and
they make all the loop knobs live: ``precision`` (ctx and scaler follow it, a real
GradScaler in fp16), ``accum_steps`` (the micro-step loop and the loss division read
it), ``kernels`` (torch.compile of the model, in place) and ``checkpointing`` (of
``transformer.h``, found as the model's repeated blocks). ``--resume`` goes on from a
checkpoint the ``checkpoint`` command saved, exactly as the run would have: the batch the
loop had fetched ahead of that boundary comes back from ``get_batch`` first.

Data: character-level text of Python's own documentation (shipped with Python), as
nanoGPT's ``shakespeare_char``. Nothing is downloaded.
"""

import argparse
import math

import torch
from torch import nn
from torch.nn import functional as F

import agent  # gpuwatch
from gpuopt.demo.data import CharVocabulary, pydoc_text


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        t = x.size(1)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer=4, n_head=4, n_embd=128):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=1_000_000,
                        help="optimizer steps (default: about a day; Ctrl-C stops it)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--eval-interval", type=int, default=250)
    parser.add_argument("--resume", metavar="CHECKPOINT",
                        help="go on from a checkpoint gpuwatch's checkpoint command saved")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of kernels=compile (aot_eager: fast to "
                             "compile, fuses nothing)")
    args = parser.parse_args()
    batch_size, block_size = args.batch_size, args.block_size
    gradient_accumulation_steps = args.gradient_accumulation_steps
    learning_rate, min_lr, warmup_iters, lr_decay_iters = 1e-3, 1e-4, 100, 5000
    grad_clip, eval_iters = 1.0, 20

    text = pydoc_text()
    vocab = CharVocabulary.from_text(text)
    data = vocab.encode(text)
    n = int(0.9 * len(data))
    splits = {"train": data[:n], "val": data[n:]}

    def get_batch(split):
        source = splits[split]
        ix = torch.randint(len(source) - block_size - 1, (batch_size,))
        x = torch.stack([source[i:i + block_size] for i in ix])
        y = torch.stack([source[i + 1:i + 1 + block_size] for i in ix])
        return x, y

    torch.manual_seed(1337)
    model = GPT(len(vocab), block_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.1)
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}[args.dtype]
    run = agent.session(model=model, optimizer=optimizer, precision=ptdtype, accum_steps=gradient_accumulation_steps, tokens_per_sample=block_size, compile_backend=args.compile_backend, resume_from=args.resume, name="gpt-loop")  # gpuwatch
    ctx, scaler = run.autocast, run.scaler  # gpuwatch
    get_batch = run.timed(get_batch)  # gpuwatch
    print(f"run {run.agent.run_id}: watch it with `gpuwatch`", flush=True)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    def get_lr(it):
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters:
            return min_lr
        ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

    X, Y = get_batch("train")
    iter_num = run.step  # gpuwatch
    while iter_num < args.max_steps and not run.stopping:  # gpuwatch: stop=now ends it
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % args.eval_interval == 0 and iter_num > 0:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, "
                  f"val loss {losses['val']:.4f}", flush=True)
        for micro_step in range(run.accum_steps):  # gpuwatch
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / run.accum_steps  # gpuwatch
            X, Y = get_batch("train")
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        run.optimizer_step()  # gpuwatch
        iter_num += 1
    print(run.agent.ended_line(), flush=True)  # optional: closes the run, says what it trained


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the agent has said bye; no traceback
        raise SystemExit(130)
