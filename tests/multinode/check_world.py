"""Fit BoringModel in a 2-node x 1-process CPU DDP world; run once per rank.

Launch under ``srun -N 2 --ntasks-per-node=1`` or two torchrun agents. Each
rank prints the launcher variables it saw, the ClusterEnvironment Lightning
detected, and at the end ``RANK <global_rank> OK world_size=<n>``.
"""

import os
import sys

from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

# Launcher variables worth recording; printed as seen before Lightning runs.
SHOWN_VARS = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_NNODES",
    "SLURM_NODEID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODELIST",
    "SLURMD_NODENAME",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


def main() -> int:
    """Fit one epoch and report this rank's view of the world."""
    tag = os.environ.get("SLURM_PROCID", os.environ.get("RANK", "?"))
    seen = " ".join(f"{k}={os.environ[k]}" for k in SHOWN_VARS if k in os.environ)
    print(f"LAUNCH {tag} {seen}", flush=True)

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        strategy="ddp",
        max_epochs=1,
        limit_train_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    env = trainer.strategy.cluster_environment
    print(
        f"RANK {trainer.global_rank} ENV {type(env).__name__} "
        f"node_rank={trainer.node_rank} local_rank={trainer.local_rank} "
        f"main={env.main_address}:{env.main_port}",
        flush=True,
    )
    trainer.fit(BoringModel())
    print(f"RANK {trainer.global_rank} OK world_size={trainer.world_size}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
