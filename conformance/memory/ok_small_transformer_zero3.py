"""Conforming: a two-block causal transformer language model whose Trainer config names DeepSpeed ZeRO-3.

Every block calls its linear layers as modules (ZeRO-3 gathers a module's weights around its forward),
and stage3_param_persistence_threshold=0 keeps no weight whole on every rank, so ZeRO-3 really shards
them. The memory contract measures what each rank holds under DDP, FSDP FULL_SHARD (the FSDP
equivalent of ZeRO-3) and ZeRO-3 itself; no device size is stated, so its items are advisory tables.
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming"
VOCAB, WIDTH, CONTEXT, BLOCKS = 64, 32, 16, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 2, WIDTH // 2).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.log("train_loss", loss, sync_dist=True, batch_size=len(ids))
        return loss

    def train_dataloader(self):
        ids = torch.randint(0, VOCAB, (64, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def trainer_kwargs():
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "train_micro_batch_size_per_gpu": 4}
    return {"max_epochs": 1, "strategy": DeepSpeedStrategy(config=config)}


EXPECTED = {"memory": "advisory"}
EVIDENCE = "advisory: per-rank parameter, gradient and Adam bytes, halved under FSDP FULL_SHARD and ZeRO-3"
