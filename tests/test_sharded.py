"""The CPU sharded tier: fsdp items, the FSDPStrategy subclass, reading DeepSpeed configs, and one
end-to-end fsdp run with a passing and a failing contract."""

from __future__ import annotations

import json

import pytest
from conftest import BORING, REPO

FSDP_ITEMS = tuple(f"ltconform::{BORING}::{c}[fsdp]" for c in ("all-rank-save", "sync-dist", "configure-model"))


def test_fsdp_items_generated_for_opted_in_contracts(pytester):
    result = pytester.runpytest_subprocess("--ltconform", BORING, "--collect-only", "-q", "-p", "no:cacheprovider")
    out = result.stdout.str()
    for item in FSDP_ITEMS:
        assert item in out, out
    # Contracts that did not opt in to fsdp get no fsdp item; ddp items are still there.
    assert f"ltconform::{BORING}::unused-parameters[fsdp]" not in out
    assert f"ltconform::{BORING}::all-rank-save[ddp]" in out and f"ltconform::{BORING}::configure-model[ddp]" in out
    only_ddp = pytester.runpytest_subprocess("--ltconform", BORING, "--ltconform-strategies", "ddp",
                                             "--collect-only", "-q", "-p", "no:cacheprovider").stdout.str()
    assert "[fsdp]" not in only_ddp and f"ltconform::{BORING}::all-rank-save[ddp]" in only_ddp


def test_contract_strategies_opt_in():
    from pytest_ltconform import contracts
    from pytest_ltconform.contracts.base import Contract
    from pytest_ltconform.vocabulary import CPU_STRATEGIES

    assert "fsdp" in CPU_STRATEGIES
    assert Contract.strategies == ("ddp",)
    for cid in ("all-rank-save", "sync-dist", "configure-model"):
        assert contracts.get_contract(cid).strategies == ("ddp", "fsdp", "deepspeed")


def test_sharded_kind_and_describe_without_torch():
    from pytest_ltconform import sharded

    assert sharded.sharded_kind(None) is None
    assert sharded.sharded_kind("ddp") is None
    assert sharded.sharded_kind("fsdp_cpu_offload") == "fsdp"
    assert sharded.sharded_kind("deepspeed_stage_3_offload") == "deepspeed"
    assert sharded.zero_stage("deepspeed_stage_2") == 2
    assert sharded.describe("fsdp") == "'fsdp'"


def test_cpu_fsdp_strategy_keeps_user_settings_and_passes_lightning_type_check(tmp_path):
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.strategies import FSDPStrategy

    from pytest_ltconform import sharded

    user = FSDPStrategy(state_dict_type="sharded", sharding_strategy="SHARD_GRAD_OP",
                        auto_wrap_policy={torch.nn.Linear}, device_mesh=(1, 2))
    strategy = sharded.cpu_fsdp_strategy(L, user, timeout_s=7)
    assert isinstance(strategy, FSDPStrategy) and type(strategy) is not FSDPStrategy
    assert strategy._state_dict_type == "sharded"
    assert strategy.sharding_strategy.name == "SHARD_GRAD_OP"
    assert "auto_wrap_policy" in strategy.kwargs and "device_mesh" not in strategy.kwargs
    assert strategy._timeout.total_seconds() == 7
    assert "FSDPStrategy(state_dict_type='sharded', sharding_strategy='SHARD_GRAD_OP', auto_wrap_policy=...)" \
        in strategy.ltconform_note
    assert "CPU sharded tier" in strategy.ltconform_note
    # Lightning accepts it on CPU (the plain class is refused by an exact type check).
    with pytest.raises(ValueError, match="requires a GPU"):
        L.Trainer(accelerator="cpu", devices=1, strategy=FSDPStrategy(), logger=False,
                  default_root_dir=str(tmp_path))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=sharded.cpu_fsdp_strategy(L, None), logger=False,
                        default_root_dir=str(tmp_path))
    assert isinstance(trainer.strategy, FSDPStrategy)
    # Registered names keep their registered settings.
    offload = sharded.cpu_fsdp_strategy(L, "fsdp_cpu_offload")
    assert offload.cpu_offload is not None and offload.cpu_offload.offload_params


def test_deepspeed_config_readable_and_mapped_to_fsdp():
    import lightning.pytorch as L
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from pytest_ltconform import sharded

    with sharded.deepspeed_stand_in():
        user = DeepSpeedStrategy(stage=3, offload_optimizer=True)
    assert user.config["zero_optimization"]["stage"] == 3
    assert sharded.sharded_kind(user) == "deepspeed" and sharded.zero_stage(user) == 3
    strategy = sharded.cpu_fsdp_strategy(L, user)
    assert strategy.sharding_strategy.name == "FULL_SHARD"
    assert "DeepSpeedStrategy(stage=3)" in strategy.ltconform_note and "needs CUDA" in strategy.ltconform_note
    with sharded.deepspeed_stand_in():
        stage1 = DeepSpeedStrategy(config={"zero_optimization": {"stage": 1}})
    assert sharded.cpu_fsdp_strategy(L, stage1).sharding_strategy.name == "SHARD_GRAD_OP"


FSDP_TARGET = '''
import torch
import lightning.pytorch as L
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x[:, :2] * 2.0)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = None

    def configure_model(self):
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.body(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.body(x), y), sync_dist=True, batch_size=len(y))

    def train_dataloader(self):
        return DataLoader(_data(32, 1), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(16, 2), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer_kwargs():
    return {"strategy": FSDPStrategy(state_dict_type="sharded"), "max_epochs": 2}
'''


def test_fsdp_end_to_end_pass_and_fail(pytester, no_leftover_ranks):
    """One world, fsdp items only: all-rank-save (save + resume from a sharded directory) and
    sync-dist pass; configure-model fails (configure_model rebuilds its layers for validate)."""
    pytester.makepyfile(fsdp_model=FSDP_TARGET)
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        "--ltconform", "fsdp_model.Model", "--ltconform-trainer", "fsdp_model:trainer_kwargs",
        "--ltconform-nodes", "1", "--ltconform-strategies", "fsdp", "--ltconform-timeout", "60",
        "--ltconform-report", str(report),
        "-p", "no:cacheprovider", "-rA")
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["*PASSED ltconform::fsdp_model.Model::all-rank-save[[]fsdp[]]*",
                                 "*PASSED ltconform::fsdp_model.Model::sync-dist[[]fsdp[]]*",
                                 "*FAILED ltconform::fsdp_model.Model::configure-model[[]fsdp[]]*"])
    result.stdout.fnmatch_lines(["*[[]configure-model[]] FAILED*configure_model called 2 times (fit, then validate) "
                                 "replaced every parameter of body*"])
    assert "fsdp_model.py:" in out
    records = {r["contract"]: r for r in json.loads(report.read_text())["results"]
               if r["strategy"] == "fsdp" and not r.get("run")}  # the fit[fsdp] run item carries no verdict
    save = records["all-rank-save"]["message"]
    assert "saved a sharded checkpoint directory" in save and ".metadata" in save and "resumed from it" in save
    for rec in records.values():
        assert "names FSDPStrategy(state_dict_type='sharded'); no GPU is present" in rec["message"]
        assert "CPU sharded tier" in rec["message"]


def test_a_fit_stopped_in_validation_by_sync_dist_leaves_the_sharded_round_trip_judged(pytester, no_leftover_ranks):
    """The shared fit stops in the sanity check (a rank-0-only synced log); all-rank-save[fsdp] is
    judged on the second fit without validation, and its round trip's weight check (a validate
    through one batch) does not run the user's validation code into the same deadlock."""
    source = REPO / "conformance" / "sync-dist" / "epoch_end_log_rank_zero_gate.py"
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        "--ltconform", f"{source}:Model", "--ltconform-nodes", "1", "--ltconform-strategies", "fsdp",
        "--ltconform-timeout", "40",
        "--ltconform-report", str(report), "-k", "all-rank-save[ or sync-dist[", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)  # the fit[fsdp] run item passes: a contract claims its stop
    records = {r["contract"]: r for r in json.loads(report.read_text())["results"]
               if r["strategy"] == "fsdp" and not r.get("run")}  # the fit[fsdp] run item carries no verdict
    assert records["sync-dist"]["outcome"] == "failed"
    assert records["all-rank-save"]["outcome"] == "passed", records["all-rank-save"]["message"]
    assert "judged on a second fit with validation switched off (limit_val_batches=0, num_sanity_val_steps=0)" \
           in records["all-rank-save"]["message"]


RAISES_IN_STEP = '''
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.layer(x).squeeze()
        return torch.cat([out, y])  # 1-d and 2-d: raises under any strategy

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
'''


def test_a_crash_in_user_code_under_every_strategy_is_not_blamed_on_the_sharded_one(pytester, no_leftover_ranks):
    """The ddp fit stops in the user's step; the fsdp run stops with the same exception at the same
    line: its items point at fit[ddp] instead of saying the module does not run under FSDP
    (field26 ts3l, field19 chemprop)."""
    pytester.makepyfile(raises=RAISES_IN_STEP)
    result = pytester.runpytest_subprocess("--ltconform", "raises.py:Model", "--ltconform-strategies", "ddp,fsdp",
                                           "-k", "configure", "-p", "no:cacheprovider", "-rA")
    assert "does not run under FSDP" not in result.stdout.str()
    # The ddp item that reported the crash (the first one judged on that run) is the one named.
    result.stdout.fnmatch_lines(["*SKIPPED*configure-model[[]fsdp[]]: not judged: the fit run stops in your code "
                                 "under every strategy (RuntimeError at raises.py:14 (training_step): Tensors must "
                                 "have same number of dimensions*) (see configure-model[[]ddp[]])."])


EMBEDDING_THEN_TEST = '''
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 1)

    def _loss(self, batch):
        tokens, y = batch
        return torch.nn.functional.mse_loss(self.head(self.embed(tokens)).squeeze(-1), y)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def _loader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, 10, (16,), generator=g), torch.randn(16, generator=g)),
                          batch_size=4)

    def train_dataloader(self):
        return self._loader()

    def test_dataloader(self):
        return self._loader()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
'''


def test_trainer_test_after_fit_runs_an_embedding_module_under_cpu_fsdp(pytester, no_leftover_ranks):
    """trainer.test after fit under the plugin's CPU FSDP raised "'weight' must be 2-D" for any
    nn.Embedding (a second FSDP wrapper flattened the first one's 1-D shard views): the later stage
    keeps fit's wrapper, and the run item says test ran."""
    pytester.makepyfile(embed=EMBEDDING_THEN_TEST)
    result = pytester.runpytest_subprocess("--ltconform", "embed.py:Model", "--ltconform-strategies", "fsdp", "-k",
                                           "fit[ or sync-dist[ or all-rank-save[", "-p", "no:cacheprovider", "-rA")
    out = result.stdout.str()
    assert result.ret == 0, out[-3000:]
    assert "must be 2-D" not in out and "it raised" not in out, out[-3000:]
    # -rA's PASSES: the run item's line in full (the short summary trims it to the terminal's width).
    result.stdout.fnmatch_lines(["*_ ltconform embed.py:Model::fit[[]fsdp[]] _*",
                                 "the run finished on 2 ranks: fit (* training step(s) over * epoch(s) on rank 0), "
                                 "then test. This item records the run*"])
    assert "synced log keys identical on every rank (test_loss)" in out  # test's own log calls were judged


LAYERS_THEN_EVAL = '''
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    """BoringModel's nn.Linear head behind the other common layer kinds (conv, norms with and
    without buffers, embedding), each stage after fit logging a synced value."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.conv = torch.nn.Conv1d(4, 4, kernel_size=1)
        self.norm = torch.nn.LayerNorm(4)
        self.batch_norm = torch.nn.BatchNorm1d(4)
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, tokens):
        x = self.conv(self.embed(tokens).unsqueeze(-1)).squeeze(-1)
        return self.layer(self.batch_norm(self.norm(x)))

    def _loss(self, batch):
        return self(batch[0]).sum()

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def _loader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, 10, (16,), generator=g)), batch_size=4)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
'''


def test_validate_test_and_predict_after_fit_run_every_layer_kind_under_cpu_fsdp(pytester, no_leftover_ranks):
    """validate, test and predict after fit on the plugin's CPU FSDP tier ran on the 1-D flat shards
    of fit's wrapper ("mat2 must be a matrix, got 1-D tensor" in BoringModel's nn.Linear, "'weight'
    must be 2-D" in an nn.Embedding) and the contracts noted it as the user's stage raising: every
    later stage of one Trainer keeps fit's wrapper, for every layer kind."""
    pytester.makepyfile(layers=LAYERS_THEN_EVAL)
    result = pytester.runpytest_subprocess("--ltconform", "layers.py:Model", "--ltconform-strategies", "fsdp", "-k",
                                           "fit[ or configure-model[ or shared-writes[", "-p", "no:cacheprovider",
                                           "-rA")
    out = result.stdout.str()
    assert result.ret == 0, out[-3000:]
    for symptom in ("must be a matrix", "must be 2-D", "it raised", "until it raised", "1-D"):
        assert symptom not in out, out[-3000:]
    result.stdout.fnmatch_lines(["*_ ltconform layers.py:Model::fit[[]fsdp[]] _*",
                                 "the run finished on 2 ranks: fit (* training step(s) over * epoch(s) on rank 0), "
                                 "then test, predict. This item records the run*"])
    assert "validate after fit used the trained weights" in out, out[-3000:]  # configure-model's validate
    assert "user code opened no file for writing during fit and test and predict" in out, out[-3000:]
