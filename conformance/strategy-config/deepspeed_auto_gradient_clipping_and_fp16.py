"""A DeepSpeed config copied from a Hugging Face run keeps "auto" for gradient clipping and fp16.

The micro-batch size and the ZeRO stage are real numbers, but `"gradient_clipping": "auto"` and
`"fp16": {"enabled": "auto"}` were left from the Trainer integration that fills them. Lightning passes the dict
to DeepSpeed as it is: DeepSpeed's config reader keeps the string "auto" as the clipping value, and the engine
compares it with 0.0 before the first optimizer step (`TypeError: '>' not supported between instances of 'str'
and 'float'`, on every rank); fp16's "auto" is read as disabled. The report's message spoke of micro-batch sizes and
bucket defaults, which this config does not have.
Fix: write the values (gradient_clipping: 1.0, or drop it and use Trainer(gradient_clip_val=...); fp16: drop the
section and use Trainer(precision=...)).
"""
import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.utils.data import DataLoader, TensorDataset

SOURCE = "issue 38 (a field trial's rebuilt report of a DeepSpeed config with \"auto\" clipping and fp16)"
EXPECTED = {"strategy-config": "fail"}
EVIDENCE = ('"auto" at gradient_clipping and fp16.enabled: DeepSpeed keeps the string "auto" for gradient_clipping '
            "and compares it with 0.0 (`gradient_clipping() > 0.0`); fp16.enabled is replaced by its default")

DS_CONFIG = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4,
             "gradient_clipping": "auto", "fp16": {"enabled": "auto"}}


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x[:, :2].sum(1, keepdim=True))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        return DataLoader(_rows(32, 1), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer_kwargs():
    return {"strategy": DeepSpeedStrategy(config=DS_CONFIG)}
