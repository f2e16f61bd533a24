"""How to tell that pytest itself is one rank of a world that torchrun or SLURM started, read
through Lightning's own cluster environments (imported only when a launcher's variables are set)."""

from __future__ import annotations

import dataclasses
import os
import warnings


@dataclasses.dataclass(frozen=True)
class Attached:
    """This pytest process is rank ``rank`` of a world of ``world_size`` ranks that ``launcher``
    ('torchrun' or 'slurm') started. Values are read through Lightning's own ClusterEnvironment
    classes, so they are the ones a Trainer in this process would use."""

    launcher: str
    environment: str
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    main_address: str
    main_port: int
    agent_store: bool

    def describe(self) -> str:
        return f"rank {self.rank} of a {self.launcher} world of {self.world_size} ranks"


def detect_attached(environ=None) -> Attached | None:
    """The launched world this process belongs to, or None (no launcher, or a world of one rank).

    Tried in Lightning's own order: TorchElasticEnvironment (torchrun), then SLURMEnvironment
    (srun; a job named 'bash' or 'interactive' is an interactive shell, not a launch).
    """
    environ = os.environ if environ is None else environ
    if not any(k in environ for k in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS")):
        return None  # the common case costs no lightning import
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    with warnings.catch_warnings():  # detect() warns about srun on PATH; the Trainer says it if it matters
        warnings.simplefilter("ignore")
        in_slurm = SLURMEnvironment.detect()
    if TorchElasticEnvironment.detect():
        env, launcher = TorchElasticEnvironment(), "torchrun"
    elif in_slurm:
        # Without __init__: it raises on layouts such as `srun -n 2` (no --ntasks-per-node), which
        # the launch-env contract should report in that world instead of every rank dying here.
        env, launcher = object.__new__(SLURMEnvironment), "slurm"
    else:
        return None
    world_size = env.world_size()
    if world_size < 2:
        return None
    return Attached(
        launcher=launcher, environment=type(env).__name__, rank=env.global_rank(), world_size=world_size,
        local_rank=env.local_rank(), node_rank=env.node_rank(), main_address=env.main_address,
        main_port=env.main_port, agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )
