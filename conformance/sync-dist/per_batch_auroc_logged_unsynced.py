"""AUROC computed per batch with the functional API and logged as an epoch mean without sync_dist.

training_step logs binary_auroc(batch scores, batch labels) with on_epoch=True and no sync_dist. Lightning
averages those per-batch values over each rank's own batches and publishes rank 0's: AUROC is not
additive, so rank 0's epoch value is not even the AUROC of rank 0's own predictions, and it is not the
AUROC of the epoch's predictions of all ranks either. A checker must not call the value reduced over
ranks (nothing synced it), must measure the per-batch averaging against rank 0's own samples, and must
tell the rank-local part apart. Fix: keep a torchmetrics BinaryAUROC object on the module, update it per
step, and log the object (it syncs its own state).
"""
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import BinaryAUROC
from torchmetrics.functional.classification import binary_auroc

SOURCE = "issue 32, after R12"


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + 0.5 * torch.randn(n, generator=g) > 0.9).long()  # about 20% positives
    return TensorDataset(x, y)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.reference = BinaryAUROC()  # only used to print the dataset-level value for comparison
        self.reference_value = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y.float())
        scores = logits.detach().sigmoid()
        self.log("train_auroc", binary_auroc(scores, y), on_step=False, on_epoch=True)  # not synced
        self.reference.update(scores, y)
        return loss

    def on_train_epoch_end(self):
        self.reference_value = float(self.reference.compute())
        self.reference.reset()

    def on_fit_end(self):
        logged = float(self.trainer.callback_metrics["train_auroc"])
        print(f"CASE: rank {self.global_rank} logged train_auroc = {logged:.4f}; AUROC of the last epoch's "
              f"predictions, all ranks = {self.reference_value:.4f}", flush=True)

    def train_dataloader(self):
        return DataLoader(_split(32, 1), batch_size=4, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


EXPECTED = {"sync-dist": "fail", "all-rank-save": "pass", "unused-parameters": "pass"}
EVIDENCE = ("'train_auroc' `not synced (no sync_dist), so Lightning averages its per-batch values over each rank's "
            "own batches and publishes rank 0's`: `rank 0's logged epoch value` against rank 0's own samples")
