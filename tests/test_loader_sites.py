"""Where loaders were built and what a verdict counts: the construction line of the loader object a
hook returns (a package's helper, a loader class of its own), not the hook's ``def`` line."""

from __future__ import annotations

import textwrap

import pytest

from pytest_ltconform.contracts import loader_sites

# A package's own loader code, as chemprop's build_dataloader or mlcolvar's DictLoader: user code.
PKG = textwrap.dedent('''\
    import torch
    from torch.utils.data import DataLoader


    def build_loader(dataset, batch_size):
        return DataLoader(dataset, batch_size=batch_size)  # PKG_BUILD


    class OwnLoader:
        """Yields dict batches of a tensor in order: not a torch DataLoader."""

        def __init__(self, x, batch_size):
            self.x, self.batch_size = x, batch_size

        def __iter__(self):
            for i in range(0, len(self.x), self.batch_size):
                yield {"x": self.x[i:i + self.batch_size]}

        def __len__(self):
            return (len(self.x) + self.batch_size - 1) // self.batch_size
''')

MODEL = textwrap.dedent('''\
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import Dataset

    import pkgloaders


    class Rows(Dataset):
        def __init__(self, n):
            self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i]


    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def setup(self, stage):
            x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
            self.train_loader = pkgloaders.OwnLoader(x, 8)  # MODEL_OWN

        def training_step(self, batch, batch_idx):
            return self.layer(batch["x"]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.layer(batch).pow(2).mean(), sync_dist=True)

        def train_dataloader(self):
            return self.train_loader

        def val_dataloader(self):
            return pkgloaders.build_loader(Rows(5), 2)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
''')


def _line(text: str, marker: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if marker in line)


class _Base:
    def __init__(self):
        self.items = [1, 2]

    def __iter__(self):
        return iter(self.items)


class _Sub(_Base):
    def __init__(self):
        super().__init__()


def _build_sub():
    return _Sub()  # BUILT_HERE


def test_the_outermost_construction_line_is_recorded_for_any_iterable():
    from torch.utils.data import DataLoader

    loader_sites._REG.reset()
    with loader_sites._Window():
        own = _build_sub()
        torch_loader = DataLoader([1, 2, 3])  # TORCH_HERE
    loader_sites._record_hook("val_dataloader", [own, torch_loader])
    first, second = loader_sites.loaders_of("val_dataloader")
    assert first["cls"] == "_Sub" and first["torch_loader"] is False
    assert first["site"]["file"] == __file__ and first["site"]["line"] == _line(open(__file__).read(), "# BUILT_HERE")
    assert second["cls"] == "DataLoader" and second["torch_loader"] is True
    assert second["site"]["line"] == _line(open(__file__).read(), "# TORCH_HERE")


def test_objects_built_outside_a_window_have_no_site():
    loader_sites._REG.reset()
    own = _build_sub()
    loader_sites._record_hook("train_dataloader", own)
    assert loader_sites.loader_of("train_dataloader") == {"site": None, "cls": "_Sub", "torch_loader": False}
    assert loader_sites.loader_of("train_dataloader", 1) is None


@pytest.mark.slow
def test_verdicts_name_the_line_that_built_each_loader(pytester, no_leftover_ranks):
    pytester.makepyfile(pkgloaders=PKG, model=MODEL)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ltconform", "model:Model",
                                           "-k", "(eval-duplication[ or data-sharding[ddp]) and not gpu "
                                                 "and not multinode", "-v")
    out = result.stdout.str()
    result.assert_outcomes(failed=2)
    # eval-duplication: the DataLoader(...) call inside the package's helper, not the hook's def line.
    assert f"pkgloaders.py:{_line(PKG, '# PKG_BUILD')} (build_loader): the validation DataLoader is built here" in out
    assert f"model.py:{_line(MODEL, 'def val_dataloader')}" not in out
    # data-sharding: the loader is not a torch DataLoader, built in setup; the fix says what to do.
    own = f"model.py:{_line(MODEL, '# MODEL_OWN')} (Model.setup)"
    assert f"{own}: the train OwnLoader is built here; it is not a torch DataLoader" in out
    assert f"OwnLoader (built at {own}) is not a torch DataLoader, so Lightning injects no DistributedSampler" in out
