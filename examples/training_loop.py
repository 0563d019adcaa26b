"""A whole training run with fxpipe, as a user writes it (docs/training_loop.md explains each part).

    torchrun --standalone --nproc-per-node 3 examples/training_loop.py --epochs 2 --checkpoint-dir ckpt

Epochs over a fixed dataset of byte windows, each rank loading only the rows its stage reads; gradient
accumulation, global clipping, a warm-up + cosine LR schedule, bf16 autocast, validation with
``pipe.evaluate`` every few optimizer steps, checkpoints, and preemption (SIGTERM) handling with resume.
"""

import argparse
import math
from pathlib import Path

import torch

import fxpipe
from fxpipe.data import stdlib_corpus

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch", type=int, default=12)  # rows per pipe.step
parser.add_argument("--accumulate", type=int, default=2)  # pipe.step calls per optimizer step
parser.add_argument("--windows", type=int, default=96)  # dataset size
parser.add_argument("--seq", type=int, default=32)
parser.add_argument("--validate-every", type=int, default=2)  # optimizer steps
parser.add_argument("--max-steps", type=int, default=0)  # stop after this many optimizer steps (0: no limit)
parser.add_argument("--checkpoint-dir", default="")
parser.add_argument("--layout", default="2:1")
args = parser.parse_args()
torch.set_num_threads(1)

# --- data: every rank builds the same index; each loads only the rows it reads ---------------------
corpus = stdlib_corpus(1_000_000).long()
starts = torch.arange(args.windows + 16) * (corpus.numel() // (args.windows + 16))
train_starts, val_starts = starts[:args.windows], starts[args.windows:]


def windows(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets of the windows starting at ``indices``."""
    rows = corpus[indices[:, None] + torch.arange(args.seq + 1)[None, :]]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def rows_of(batch_indices: torch.Tensor, ranges: tuple[tuple[int, int], ...] | None) -> torch.Tensor | None:
    """This rank's rows of the global batch (``pipe.input_rows()`` / ``pipe.target_rows()``), None if it reads none."""
    if ranges is None:
        return None
    return torch.cat([batch_indices[start:stop] for start, stop in ranges])


# --- the model and the pipeline ------------------------------------------------------------------
model, example_inputs = fxpipe.models.build("gpt-mini", n_layer=4, n_embd=64, n_head=4, vocab_size=256,
                                            block_size=args.seq, batch_size=args.batch)
entry = fxpipe.models.get("gpt-mini")
pipe = fxpipe.compile(model, example_inputs, loss_fn=entry.loss_fn, global_batch_size=args.batch,
                      plan=args.layout, num_microbatches=2, autocast_dtype=torch.bfloat16)
optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3, weight_decay=0.01)
steps_per_epoch = args.windows // (args.batch * args.accumulate)  # an incomplete last step is dropped
total_steps = args.epochs * steps_per_epoch


def lr_factor(step: int) -> float:
    warmup = max(1, total_steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))


scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
pipe.handle_preemption()  # SIGTERM: finish the step, then every rank sees pipe.preempted

step = 0
checkpoint = Path(args.checkpoint_dir) if args.checkpoint_dir else None
if checkpoint is not None and checkpoint.exists():
    state = pipe.load(checkpoint, optimizer=optimizer)
    step = state["step"]
    scheduler.load_state_dict(state["extra"]["scheduler"])
    if pipe.rank == 0:
        print(f"resumed at step {step}", flush=True)


def validate() -> float:
    pipe.eval()
    loss = pipe.evaluate(*windows(val_starts))  # every rank passes the whole validation batch
    pipe.train()
    return loss


def save() -> None:
    if checkpoint is not None:
        pipe.save(checkpoint, optimizer=optimizer, step=step, extra={"scheduler": scheduler.state_dict()})


stop = False
while step < total_steps and not stop:
    epoch, first = divmod(step, steps_per_epoch)
    order = torch.randperm(args.windows, generator=torch.Generator().manual_seed(epoch))  # same on every rank
    for index in range(first, steps_per_epoch):
        losses = []
        for micro in range(args.accumulate):
            offset = (index * args.accumulate + micro) * args.batch
            batch = train_starts[order[offset:offset + args.batch]]
            inputs = rows_of(batch, pipe.input_rows())
            targets = rows_of(batch, pipe.target_rows())
            loaded_inputs = None if inputs is None else windows(inputs)[0]
            loaded_targets = None if targets is None else windows(targets)[1]
            losses.append(pipe.step(loaded_inputs, loaded_targets, partial=True))
        for param in pipe.parameters():  # the mean over the accumulated steps, as (loss / n).backward() gives
            param.grad.div_(args.accumulate)
        norm = pipe.clip_grad_norm_(1.0)  # the whole model's norm, the same on every rank
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        step += 1
        message = f"epoch {epoch} step {step} loss {sum(losses) / len(losses):.4f} grad-norm {float(norm):.3f}"
        if step % args.validate_every == 0:
            message += f" val {validate():.4f}"
        if pipe.rank == 0:
            print(message, flush=True)
        if step % args.validate_every == 0 or step == total_steps:
            save()
        if pipe.preempted or step == args.max_steps:
            save()
            stop = True
            break
if pipe.rank == 0:
    print(f"done at step {step} of {total_steps}", flush=True)
pipe.close()
