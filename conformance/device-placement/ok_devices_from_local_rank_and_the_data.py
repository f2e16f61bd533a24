"""Conforming twin of the hard-coded, global-rank and plain-attribute cases: devices come from the rank or the data.

Written for GPU ranks only: the noise is made on `f"cuda:{self.local_rank}"`, the mask with
`torch.rand_like(h)`, the class weights are a registered buffer, the epoch's count goes through
self.all_gather (which moves it to self.device), a plain float is logged with sync_dist=True, the pretrained
head is loaded with map_location="cpu", the labels go to NumPy through .detach().cpu(), and a non_blocking
copy to the CPU is read after torch.cuda.synchronize(). On CPU ranks the plugin runs the CUDA names on the CPU.
"""
import os

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "conforming (fixes of the device-placement variants)"
EXPECTED = {"device-placement": "pass", "unused-parameters": "pass", "sync-dist": "pass"}
EVIDENCE = ""

WEIGHTS = "pretrained_head_ok.pt"


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0.5).long() + (x[:, 0] > -0.5).long())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(6, 8)
        self.head = torch.nn.Linear(8, 3)
        self.register_buffer("class_weights", torch.tensor([2.0, 1.0, 2.0]))
        self._seen, self._hits = 0, []

    def prepare_data(self):
        if not os.path.exists(WEIGHTS):
            torch.save(torch.nn.Linear(8, 3).state_dict(), WEIGHTS)

    def setup(self, stage):
        self.head.load_state_dict(torch.load(WEIGHTS, map_location="cpu"))

    def training_step(self, batch, batch_idx):
        x, y = batch
        noise = 0.01 * torch.randn(x.shape, device=f"cuda:{self.local_rank}")
        h = torch.relu(self.body(x + noise))
        keep = (torch.rand_like(h) > 0.1).float()
        return F.cross_entropy(self.head(h * keep), y, weight=self.class_weights)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        preds = self.head(torch.relu(self.body(x))).argmax(1)
        self._seen += len(y)
        host = preds.to("cpu", non_blocking=True)
        torch.cuda.synchronize()  # the copy is complete before it is read
        self._hits.extend((host.numpy() == y.detach().cpu().numpy()).tolist())

    def on_validation_epoch_end(self):
        counts = self.all_gather(torch.tensor(self._seen))  # LightningModule.all_gather moves it to self.device
        self.log("val_acc", float(sum(self._hits)) / max(1, len(self._hits)), sync_dist=True)
        self.log("val_samples", counts.sum().float(), rank_zero_only=True)
        self._seen, self._hits = 0, []

    def train_dataloader(self):
        return DataLoader(_data(32, 20), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(16, 21), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
