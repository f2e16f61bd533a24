"""Conforming: Lightning's BoringModel (one Linear(32, 2)) trained with Adam.

The memory contract measures, per rank, the parameters, gradients and Adam state each rank holds:
the whole 66-parameter replica under DDP, about half of it per rank under FSDP FULL_SHARD and
DeepSpeed ZeRO on 2 ranks. No device size is stated, so every memory item is an advisory table.
"""
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

SOURCE = "conforming"


class Model(BoringModel):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


EXPECTED = {"memory": "advisory"}
EVIDENCE = "advisory: params 264 B, grads 264 B and Adam state per rank under DDP; halved under sharding"
