"""A small, deterministic language-model training setup shared by the example, the demo,
the tests and the benchmarks: a transformer-ish model with dropout, AdamW, warmup+cosine,
and a shuffling ``StatefulDataLoader`` over a synthetic token corpus."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset


class TinyLM(nn.Module):
    def __init__(
        self, vocab: int = 64, dim: int = 32, heads: int = 2, layers: int = 2, seq: int = 16, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        block = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=dim * 2, dropout=dropout, batch_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        x = self.drop(self.embed(tokens) + self.pos[:seq])
        x = self.blocks(x, mask=self.mask[:seq, :seq], is_causal=True)
        return self.head(x)


class TokenDataset(Dataset):
    """Deterministic synthetic sequences (a noisy counting language) that a tiny model can learn."""

    def __init__(self, n: int = 256, seq: int = 17, vocab: int = 64, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.data = (start + stride * torch.arange(seq)) % vocab

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@dataclass
class Training:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: object

    def batches(self):
        """Endless batches: a new epoch starts when the loader is exhausted."""
        while True:
            yield from self.loader


def build_training(
    seed: int = 0,
    *,
    num_workers: int = 0,
    batch_size: int = 8,
    total_steps: int = 100,
    dataset_size: int = 256,
    dim: int = 32,
    layers: int = 2,
    mesh=None,
) -> Training:
    """The tiny LM, AdamW, warmup+cosine and a shuffling loader; with ``mesh``, the model is
    FSDP2-sharded over it (:func:`fully_shard_layers`) before the optimizer is built."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(seed)
    model = TinyLM(dim=dim, layers=layers)
    if mesh is not None:
        fully_shard_layers(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(max(1, total_steps // 10), total_steps))
    loader = StatefulDataLoader(
        TokenDataset(n=dataset_size),
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(seed + 1),
    )
    return Training(model, opt, sched, loader)


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


# --- small FSDP2 models (tests, chaos, benchmarks) -------------------------------------------------
def mlp(width: int = 64) -> nn.Sequential:
    """32 -> ``width`` -> ``width`` -> 16, ReLU between: the multi-host tests' and chaos job's model."""
    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 16))


def fully_shard_layers(model: nn.Module, mesh, layers=None) -> nn.Module:
    """FSDP2 over ``mesh``: each of ``layers`` (default: every ``nn.Linear`` child of a
    Sequential, or every block of a :class:`TinyLM`) sharded on its own, then the whole model."""
    from torch.distributed.fsdp import fully_shard

    if layers is None:
        layers = (
            list(model.blocks.layers)
            if isinstance(model, TinyLM)
            else [m for m in model.children() if isinstance(m, nn.Linear)]
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def linear_stack(layers: int, dim: int, mesh, *, seed: int, fill: bool = True) -> nn.Sequential:
    """``layers`` bias-free ``dim`` x ``dim`` linears, FSDP2-sharded over ``mesh`` and allocated
    only as local shards (built on the meta device): a benchmark model of a chosen size. With
    ``fill``, local shards get uniform random values from ``seed``; else zeros."""
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    fully_shard_layers(model, mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            if fill:
                local.copy_(torch.rand(local.shape, generator=gen))
            else:
                local.zero_()
    return model
