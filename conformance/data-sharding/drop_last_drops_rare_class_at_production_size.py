"""A rare class lives at the end of a training set read in order; drop_last drops it only at the job's size.

The module keeps its data in order (curriculum-style): its own DistributedSampler(shuffle=False) over
136 samples, the last 8 of class 7, batch size 2 with drop_last=True. (Lightning keeps a sampler that
is already distributed; the one it injects shuffles the training set.) On 2 ranks each rank reads 68
samples in 34 full batches: nothing is dropped. The Trainer config says the job runs on 8 nodes x 8
devices: the sampler gives each of the 64 ranks 3 samples (rank r: r, r + 64, r + 128), each rank
reads one batch of 2 and drops its third sample, and indices 128 to 135 (every sample of class 7) are
the third samples of ranks 0 to 7. No rank ever trains on class 7, in any epoch, and nothing raises.
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SOURCE = "seed (Sampling, metrics and writes: each rank gets its own share of the data); issue 33 item 7"
EXPECTED = {"data-sharding": "fail", "sync-dist": "pass"}
EVIDENCE = "at the production size (num_nodes 8 x devices 8 = 64 ranks) no rank reads any sample of class(es) 7"

N, RARE = 136, 8


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 8)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(N, 4, generator=g)
        y = torch.tensor([i % 3 for i in range(N - RARE)] + [7] * RARE)
        data = TensorDataset(x, y)
        sampler = DistributedSampler(data, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank,
                                     shuffle=False)
        return DataLoader(data, batch_size=2, drop_last=True, sampler=sampler)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer_kwargs():
    return {"num_nodes": 8, "devices": 8, "max_epochs": 1}
