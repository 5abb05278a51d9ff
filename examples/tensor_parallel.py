"""Train a tiny transformer with tensor parallelism, alone or combined with data parallelism (2-D).

The module is written as for Lightning's ``ModelParallelStrategy``: ``configure_model`` applies a
tensor-parallel plan to each block with ``self.device_mesh["tensor_parallel"]``, the output layer
keeps its logits sharded over the vocabulary and the loss is computed on those shards
(``loss_parallel``). ``ModelParallelPlugin`` builds the mesh, shards what the plan left whole with
FSDP2 over the data-parallel ranks and gives the ranks of one tensor-parallel group the same batches.
Runs on CPU (gloo) in well under a minute::

    python examples/tensor_parallel.py --devices 2 --tp 2        # [tp=2]
    python examples/tensor_parallel.py --devices 4 --tp 2        # [dp=2, tp=2]
    python examples/tensor_parallel.py --devices 1               # one process, no plugin

``--batch-size`` is the global batch, split over the data-parallel ranks, and the data comes in a
fixed order, so every layout prints the same losses as one process, up to float rounding (about 1e-6).
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.plugins import ModelParallelPlugin


class NextTokenDataset(Dataset):
    """Sequences that follow ``x[t + 1] = (5 * x[t] + 3) mod vocab`` from a random start: learnable in a few steps."""

    def __init__(self, vocab_size: int, seq_length: int, size: int = 1024, seed: int = 0) -> None:
        start = torch.randint(vocab_size, (size, 1), generator=torch.Generator().manual_seed(seed))
        tokens = [start]
        for _ in range(seq_length):
            tokens.append((5 * tokens[-1] + 3) % vocab_size)
        self.tokens = torch.cat(tokens, dim=1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        # The heads this rank computes: configure_model divides them by the tensor-parallel size.
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyTransformer(LightningModule):
    def __init__(
        self, vocab_size: int = 128, dim: int = 64, n_heads: int = 4, n_layers: int = 2, lr: float = 3e-3
    ) -> None:
        super().__init__()
        self.lr = lr
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Parameter(torch.randn(64, dim) * 0.02)
        self.layers = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def configure_model(self) -> None:
        """Split every layer over the tensor-parallel ranks (column-wise in, row-wise out)."""
        if self.device_mesh is None or self.device_mesh["tensor_parallel"].size() == 1:
            return  # one process, or data parallelism only: nothing to split
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh = self.device_mesh["tensor_parallel"]
        plan = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            # Logits stay sharded over the vocabulary; training_step computes the loss on the shards.
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        for i, layer in enumerate(self.layers):
            plan.update(
                {
                    f"layers.{i}.attention.wq": ColwiseParallel(),
                    f"layers.{i}.attention.wk": ColwiseParallel(),
                    f"layers.{i}.attention.wv": ColwiseParallel(),
                    f"layers.{i}.attention.wo": RowwiseParallel(),
                    f"layers.{i}.feed_forward.w1": ColwiseParallel(),
                    f"layers.{i}.feed_forward.w2": RowwiseParallel(),
                    f"layers.{i}.feed_forward.w3": ColwiseParallel(),
                }
            )
            layer.attention.n_heads //= tp_mesh.size()
        parallelize_module(self, tp_mesh, plan)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens) + self.pos_embeddings[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        logits = self(batch[:, :-1])
        with loss_parallel():  # cross-entropy over logits sharded by class, without gathering them
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        # Averaged over the data-parallel ranks (the ranks of a tensor-parallel group share a batch).
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():  # the backward of the sharded cross-entropy needs the same context
            super().backward(loss, *args, **kwargs)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self.global_rank == 0:
            loss = self.trainer.callback_metrics["train_loss"]
            print(f"step {self.global_step:3d}  loss {float(loss):.6f}")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--devices", type=int, default=2, help="processes (CPU) or GPUs: data x tensor parallel"
    )
    parser.add_argument(
        "--tp", type=int, default=2, help="tensor-parallel size; the rest of --devices is data parallel"
    )
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument(
        "--batch-size", type=int, default=16, help="global batch, split over the data-parallel ranks"
    )
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args(argv)
    if args.devices % args.tp:
        parser.error(f"--devices {args.devices} is not a multiple of --tp {args.tp}")
    dp = args.devices // args.tp

    seed_everything(0, verbose=False)  # the same initial weights on every rank and in every layout
    plugins = None
    if args.devices > 1:
        plugins = ModelParallelPlugin(data_parallel_size=dp, tensor_parallel_size=args.tp)
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        plugins=plugins,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = TinyTransformer()
    vocab_size = model.output.out_features
    data = NextTokenDataset(vocab_size, args.seq_length)
    trainer.print(
        f"[dp={dp}, tp={args.tp}] {args.devices} process(es), first loss about {math.log(vocab_size):.2f}"
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size // dp))


if __name__ == "__main__":
    main()
