"""The words items are made of: strategies, tiers and launchers.

One place for the lists that the options, the item generator, the session and the worlds share,
so that a strategy or tier is named once (what a tier does is its class in ``tiers/``). Plain
data; imports nothing.
"""

from __future__ import annotations

# Strategies a user can select (--ltconform-strategies).
STRATEGIES = ("ddp", "fsdp", "deepspeed")
# Strategies the CPU tier runs today (gloo ranks on this machine); deepspeed when importable.
CPU_STRATEGIES = ("ddp", "fsdp", "deepspeed")
# Strategies the CPU tier runs whatever is installed (the corpus judges every case on these).
CPU_CORE_STRATEGIES = ("ddp", "fsdp")
# How items and messages name a strategy.
STRATEGY_NAMES = {"ddp": "DDP", "fsdp": "FSDP", "deepspeed": "DeepSpeed"}


def unnamed_tier(strategy: str) -> str:
    """What a Trainer config that does not name ``strategy`` lacks, and that its tier does not apply
    (the end of a skip of a sharded item: "the Trainer config does not name <this>.")."""
    if strategy == "fsdp":
        return "a sharded strategy, so the sharded tier does not apply (--ltconform-strategies ddp hides it)"
    return (f"{STRATEGY_NAMES.get(strategy, strategy)}, so the {strategy} tier does not apply "
            f"(--ltconform-strategies without {strategy} hides it)")
# Strategies the GPU tier runs (NCCL ranks); deepspeed has its own tier there.
GPU_STRATEGIES = ("ddp", "fsdp", "deepspeed")
# A contract judged under one of these is also judged under the others on the GPU tier.
SHARDED_STRATEGIES = ("fsdp", "deepspeed")

# Strategies of the nodes tier (local worlds of several nodes): ddp, and fsdp where the config names it.
NODE_STRATEGIES = ("ddp", "fsdp")

# Tiers a user can require (--ltconform-require).
TIERS = ("cpu", "gpu", "multinode", "deepspeed", "nodes")
# The tiers a contract has items in unless it says otherwise.
DEFAULT_CONTRACT_TIERS = ("cpu", "gpu", "multinode")


# How local worlds start their ranks (--ltconform-launcher): forked from a parent that imported
# torch and Lightning once, or each a fresh interpreter (the baseline).
LAUNCHERS = ("fork", "spawn")
# How the ranks' random generators are seeded (--ltconform-seeding; the first is the default): "both"
# gives each rank its own seed until training starts (draws that must agree across ranks: a split, a
# subset) and one seed for every rank from then on (draws that must differ: noise that is the sample);
# "same" seeds every rank alike (a script that calls seed_everything); "per-rank" gives each its own.
SEEDINGS = ("both", "same", "per-rank")
BASE_SEED = 0


def preload_modules(strategies) -> tuple[str, ...]:
    """What a fork parent imports once for all its ranks, given the strategies whose items may
    run: Lightning; for fsdp torch's distributed checkpoint (the sharded save imports it on each
    rank); for deepspeed DeepSpeed with torch's inductor. A DeepSpeed engine imports the
    inductor on each rank while it starts (its Muon optimizer is ``torch.compile``-decorated),
    about a second per rank; importing it in the parent changes no setting a rank sees (the
    engine's own import still runs in the rank)."""
    return (("lightning.pytorch",) + (FSDP_PRELOAD if "fsdp" in strategies else ())
            + (DEEPSPEED_PRELOAD if "deepspeed" in strategies else ()))


FSDP_PRELOAD = ("torch.distributed.checkpoint",)
DEEPSPEED_PRELOAD = ("deepspeed", "torch._inductor.compile_fx")
