"""strategy-config: the strategy arguments in the user's Trainer config mean what the user thinks.

Seed sections "Choose using measured memory" (DDP timeout), "FSDP" and "DeepSpeed": FSDP policy
classes must occur in the model and ``mixed_precision`` takes a torch ``MixedPrecision``; a
DeepSpeed dict needs real numbers (no Hugging Face "auto"), one optimizer owner, and accumulation
and precision that agree with the Trainer, ZeRO keys inside "zero_optimization" (DeepSpeed ignores them
anywhere else, silently); offload paths must be writable; the process-group
timeout is ``DDPStrategy(timeout=...)``, not ``NCCL_TIMEOUT``.

Judged without the hardware: an inspection run "config" loads the targets on one rank (a
``DeepSpeedStrategy`` stays readable where deepspeed is not installed, see ``sharded.py``),
builds the model's layers inside ``configure_model`` on the meta device, and reports what the
strategy object holds; the pytest side turns that into findings with the line of the user's
config that sets each value.
"""

from __future__ import annotations

from ...claims import claim
from ...outcomes import Outcome
from ...runs import FIT, inspection
from ..base import Blame, Contract, Evidence, Run, Verdict
from .probe import DS_AUTO, StrategyConfigProbe


def _site(f: dict) -> str | None:
    from ...sites import fmt_site

    return fmt_site(f["site"]) if f.get("site") else None

class StrategyConfig(Contract):
    id = "strategy-config"
    title = "Strategy arguments (FSDP, DeepSpeed, DDP timeout) mean what the config intends"
    rule_section = "FSDP"
    run_spec = inspection("config")
    probe_class = StrategyConfigProbe
    observes = (FIT,)  # the "auto" values a DeepSpeed fit ran with, and where it stopped
    # 'ddp' reads the config alone (no deepspeed needed); 'deepspeed' also asks DeepSpeed itself.
    strategies = ("ddp", "deepspeed")
    configured_only = ("deepspeed",)  # DeepSpeed's validation applies only to a DeepSpeed config
    tiers = ("cpu",)  # judged from the config: no GPU needed

    def blames(self, run: Run) -> int | None:
        """A fit that DeepSpeed stopped while validating the config (every failed rank raised in
        its config class), or that DeepSpeed's engine stopped on a config holding "auto" values
        (:func:`stopped_on_auto`), is this contract's failure: the other items of that run are not
        judged."""
        failed = [r for r in run.job.ranks if r.status != "ok"]
        if failed and all(r.status == "error" and deepspeed_config_raise(r.traceback) for r in failed):
            return Blame.RAISED
        if stopped_on_auto(run) is not None:
            return Blame.RAISED
        return super().blames(run)

    def judge(self, run: Run) -> Verdict:
        facts = run.probe(self.id)[0]
        if facts is None:
            r = run.job.ranks[0]
            return self.verdict(Outcome.ERROR, f"the strategy config could not be read: {r.exc_type}: {r.message}",
                                diagnosis=run.job.failure_text())
        if "not_deepspeed" in facts:
            return self.verdict(Outcome.SKIPPED,
                                f"the Trainer config's strategy is {facts['not_deepspeed']}, not DeepSpeed: the "
                                f"[deepspeed] item judges a DeepSpeed config (the [ddp] item judges this one).")
        pairs = [(f, self._render(f, facts)) for f in facts["findings"]]
        pairs = [(f, r) for f, r in pairs if r is not None]
        rendered = [r for _, r in pairs]
        claims = [claim("auto-effect", r[0], paths=f["paths"], effects=f.get("effects") or {})
                  for f, r in pairs if f["kind"] == "ds_auto"]
        if not rendered:
            return self._passed(facts, run.strategy == "deepspeed")
        summary, section, fix = rendered[0][0], rendered[0][2], rendered[0][3]
        evidence = [Evidence(text, site=site) for _, (text, site), _, _ in rendered]
        notes = [r[0] for r in rendered[1:]]
        fixes = [fix] + [r[3] for r in rendered[1:] if r[3] != fix]
        stop = stopped_on_auto(run.observed.get(FIT.name)) if run.strategy == "deepspeed" else None
        if stop is not None:
            evidence.append(Evidence(f"the fit under DeepSpeed stopped there: {stop['what']} on {stop['ranks']}, "
                                     f"raised at {stop['where']}"))
        verdict = self.verdict(Outcome.FAILED, summary, evidence=evidence, fix=" Also: ".join(fixes), notes=notes,
                               claims=claims)
        verdict.rule_section = section
        return verdict

    def _passed(self, facts: dict, deepspeed_item: bool) -> Verdict:
        """The pass: what was checked for this kind of strategy, under its own rule section."""
        kind = facts.get("kind")
        extra = " (DeepSpeedStrategy read without deepspeed installed)" if facts.get("stand_in") else ""
        if kind == "deepspeed":
            what, section = "its DeepSpeed config values, precision, accumulation and timeout are consistent", \
                "DeepSpeed"
            what += (", and DeepSpeed's own config class accepts the config as written" if deepspeed_item else
                     " (DeepSpeed's own config class judges the config in strategy-config[deepspeed])")
        elif kind == "fsdp":
            what, section = "its FSDP policies, mixed precision, device mesh and timeout are consistent", "FSDP"
        else:
            what, section = "its strategy name and timeout setting are consistent", "Choose using measured memory"
        verdict = self.verdict(Outcome.PASSED,
                               f"the Trainer config's strategy {facts['strategy']}{extra} with precision "
                               f"{facts['precision']} and accumulate_grad_batches={facts['accumulate']}: {what}.")
        verdict.rule_section = section
        return verdict

    def _render(self, f: dict, facts: dict):
        """(summary, (evidence text, site), rule section, fix) for one finding; None for a finding
        that needs no verdict."""
        render = _RENDERERS.get(f["kind"])
        return render(f, _site(f)) if render is not None else None

def _render_policy_absent(f: dict, site: str | None):
    args = " and ".join(f["args"])
    summary = (f"{args} name{'s' if len(f['args']) == 1 else ''} {f['class']}, which occurs 0 times in "
               f"{f['model']}; {f['hint']}: FSDP then wraps only the root (the whole model is gathered at "
               f"once) and checkpoints nothing, with no error.")
    if f.get("note"):
        summary += f" ({f['note']})"
    fix = ("name the layer class the model really repeats in auto_wrap_policy and "
           "activation_checkpointing_policy.")
    return summary, (f"{f['class']}: 0 instances in {f['model']} after configure_model", site), "FSDP", fix

def _render_mixed_precision(f: dict, site: str | None):
    summary = (f"FSDPStrategy(mixed_precision={f['value']}): expected torch.distributed.fsdp.MixedPrecision or "
               f"None, got {f['type']}; Lightning passes it to FSDP unchecked, which fails only when it wraps "
               f"the model on the GPUs. Trainer precision is {f['precision']}"
               + (", so nothing else configures reduced precision." if f["precision"].startswith("32")
                  else "."))
    fix = ("set Trainer(precision='bf16-mixed') (Lightning builds the MixedPrecision), or pass "
           "FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=..., reduce_dtype=..., buffer_dtype=...)).")
    return summary, (f"mixed_precision is a {f['type']}", site), "FSDP", fix

def _auto_effect(path: str, effect: dict) -> str:
    """What DeepSpeed does with the "auto" at ``path``, as measured by its own config reader."""
    kind = effect.get("effect")
    if kind == "refused":
        return f"{path}: DeepSpeed refuses the config ({effect.get('error')})"
    if kind == "default":
        return f"{path}: DeepSpeed replaces it by its default, {effect.get('value')}, without a word"
    if kind == "value":
        return f"{path}: DeepSpeed reads it as {effect.get('value')}"
    if kind == "kept":
        use = effect.get("use") or "where DeepSpeed expects a number or a flag"
        return f'{path}: DeepSpeed keeps the string "auto", and {use}'
    return f"{path}: no field of DeepSpeed's config reads it"


def _render_ds_auto(f: dict, site: str | None):
    paths = f["paths"]
    listed = ", ".join(paths[:-1]) + f" and {paths[-1]}" if len(paths) > 1 else paths[0]
    effects = f.get("effects") or {}
    said = "; ".join(_auto_effect(p, effects[p]) for p in paths if p in effects)
    what = f" What DeepSpeed's own config reader makes of each: {said}." if said else \
        " (deepspeed is not importable here, so what it makes of each value was not measured)."
    summary = (f'DeepSpeed config has "auto" at {listed}; Lightning passes them on unresolved ("auto" is '
               f"Hugging Face's placeholder, filled by its own integration).{what}")
    fix = ('replace each "auto" by the value you mean, or delete the key where Lightning fills it when absent '
           "(train_micro_batch_size_per_gpu from the DataLoader, gradient_accumulation_steps from "
           "accumulate_grad_batches, gradient_clipping from Trainer(gradient_clip_val=...), the fp16/bf16 section from "
           "Trainer(precision=...)), or use DeepSpeedStrategy's typed arguments.")
    return summary, (f'"auto" at {listed}', site), "DeepSpeed", fix

def _render_ds_non_numeric(f: dict, site: str | None):
    summary = f"DeepSpeed config sizes must be numbers: {', '.join(f['items'])}."
    fix = "write the sizes as numbers (e.g. 500_000_000 or 5e8 as a float), not strings."
    return summary, (", ".join(f["items"]), site), "DeepSpeed", fix

def _render_ds_optimizer_owner(f: dict, site: str | None):
    summary = (f"the DeepSpeed config defines {' and '.join(f['keys'])} ({f['config_optimizer']}) while "
               f"configure_optimizers also returns {f['module_optimizer']}: two owners of the optimizer, and "
               f"Lightning builds the one from the config.")
    fix = "keep one owner: delete the optimizer/scheduler from the DeepSpeed config, or return none from " \
          "configure_optimizers."
    return summary, (f"config {f['keys']}; configure_optimizers -> {f['module_optimizer']}", site), "DeepSpeed", fix

def _render_ds_accumulation(f: dict, site: str | None):
    summary = (f"DeepSpeed config sets gradient_accumulation_steps={f['config']} but Trainer "
               f"accumulate_grad_batches={f['trainer']}; accumulation belongs to the Trainer (Lightning "
               f"raises MisconfigurationException at GPU setup, after the job was queued and started).")
    fix = (f"delete gradient_accumulation_steps from the DeepSpeed config and set "
           f"Trainer(accumulate_grad_batches={f['config']}).")
    return summary, (f"gradient_accumulation_steps={f['config']} vs accumulate_grad_batches={f['trainer']}",
                     site), "DeepSpeed", fix

def _render_ds_precision(f: dict, site: str | None):
    state = "enables" if f["kind"] == "ds_precision" else "disables"
    summary = (f"the DeepSpeed config {state} {f['key']} while Trainer precision is {f['precision']}: the "
               f"config wins inside DeepSpeed, so the model trains in a precision the Trainer does not know.")
    fix = "set the precision in one place: Trainer(precision=...) and no fp16/bf16 section in the config."
    return summary, (f"{f['key']} section vs precision={f['precision']}", site), "DeepSpeed", fix

def _render_ds_zero_key_outside(f: dict, site: str | None):
    key = f["key"]
    summary = (f'DeepSpeed config key "{key}" is at the top level, where DeepSpeed does not read it: ZeRO settings '
               f'are read from "zero_optimization" only, and an unknown top-level key is ignored without a warning. '
               f'The ZeRO section in effect (stage {f["stage"]}) has {f["in_effect"]}.')
    fix = f'move "{key}" into the "zero_optimization" section'
    if "offload" in key:
        fix += (" (or use DeepSpeedStrategy's typed arguments, e.g. DeepSpeedStrategy(stage=2, "
                "offload_optimizer=True), which Lightning places correctly)")
    fix += "."
    return summary, (f'"{key}": {f["value"]} at the top level is ignored; "zero_optimization" has '
                     f'{f["in_effect"]}', site), "DeepSpeed", fix

def _render_ds_offload_path(f: dict, site: str | None):
    summary = (f"DeepSpeed {f['section']} offloads to NVMe at {f['path']!r}, which {f['problem']}; "
               f"ZeRO-Infinity needs an explicit, writable local path on every node.")
    fix = "point nvme_path at a writable local NVMe folder that exists on every node, or offload to cpu."
    return summary, (f"{f['section']}.nvme_path={f['path']!r}: {f['problem']}", site), "DeepSpeed", fix

def _render_nccl_timeout(f: dict, site: str | None):
    if f["explicit"]:
        return None  # the timeout that works is set; NCCL_TIMEOUT is only noise
    summary = (f"NCCL_TIMEOUT={f['value']} is set in the environment but the strategy ({f['strategy']}) keeps "
               f"the default process-group timeout: neither torch nor Lightning reads NCCL_TIMEOUT, so a hang "
               f"still waits for the default.")
    fix = ("set DDPStrategy(timeout=datetime.timedelta(...)) (or the same argument of FSDPStrategy or "
           "DeepSpeedStrategy).")
    return summary, (f"NCCL_TIMEOUT={f['value']}; strategy timeout left at its default", site), \
        "Choose using measured memory", fix

def _render_unknown_name(f: dict, site: str | None):
    close = f" (did you mean {', '.join(map(repr, f['close']))}?)" if f["close"] else ""
    summary = f"strategy={f['name']!r} is not a strategy name Lightning knows{close}."
    return summary, (f"strategy={f['name']!r}", site), "Choose using measured memory", \
        "use a registered strategy name or a strategy object."

def _render_ds_rejected(f: dict, site: str | None):
    message = f["message"]
    # Present tense: true whether this run's fit stopped there or the CPU tier dropped the refused
    # section (an offload) and ran; on the GPUs the config as written stops every rank.
    summary = (f"DeepSpeed's own config class refuses the config as written, so every rank stops inside "
               f"deepspeed.initialize before the first step: {f['type']}: {message}")
    batch = f.get("batch") or {}
    micro, acc, world = (batch.get("train_micro_batch_size_per_gpu"), batch.get("gradient_accumulation_steps"),
                         f.get("world_size"))
    if "train_batch_size" in f["keys"] and isinstance(micro, int) and isinstance(acc, int):
        fix = (f"delete train_batch_size from the DeepSpeed config (Lightning derives the global batch: micro-batch "
               f"{micro} x accumulate_grad_batches {acc} x world size {world}), or set it to {micro * acc * world} "
               f"for this world; it must change with the number of devices.")
        text = (f"train_batch_size {batch.get('train_batch_size')} is not micro-batch {micro} x accumulation {acc} "
                f"x world size {world}")
    else:
        named = ", ".join(f["keys"]) or "the value it names"
        fix = (f"change {named} in the DeepSpeed config to a value DeepSpeed accepts (its message above says "
               f"which), or use DeepSpeedStrategy's typed arguments, which Lightning turns into a valid config.")
        text = f.get("detail") or f"{f['type']}: {first_line(message)}"
    return summary, (f"DeepSpeed rejected the config: {text}", site), "DeepSpeed", fix

def first_line(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."

# Lightning's DeepSpeedStrategy methods that check the user's config dict before DeepSpeed sees it
# (e.g. "Do not set `gradient_accumulation_steps` in the DeepSpeed config").
LIGHTNING_DS_CONFIG_CHECKS = ("_load_config", "_format_config", "_format_batch_size_and_grad_accum_config")

def stopped_on_auto(run: Run | None) -> dict | None:
    """``{"what", "ranks", "where"}`` when ``run``, a DeepSpeed fit whose config holds "auto" values
    (the probe's ``ds_auto`` event), stopped with every failed rank raising a TypeError about a
    ``str`` (what a string "auto" used as a number raises) from DeepSpeed's own code (its innermost
    frame); None otherwise."""
    import re

    if run is None or run.finished or run.strategy != "deepspeed" or not run.events(0, DS_AUTO):
        return None
    failed = [r for r in run.job.ranks if r.status != "ok"]
    frames = [re.findall(r'File "([^"]+)", line (\d+)', r.traceback or "") for r in failed]
    if not failed or any(r.status != "error" or r.exc_type != "TypeError" or "'str'" not in (r.message or "")
                         or not f or "/deepspeed/" not in f[-1][0].replace("\\", "/")
                         for r, f in zip(failed, frames)):
        return None
    path, line = frames[0][-1]
    ranks = "every rank" if len(failed) == run.world_size else ", ".join(f"rank {r.rank}" for r in failed)
    return {"what": f"{failed[0].exc_type}: {failed[0].message}", "ranks": ranks,
            "where": f"deepspeed/{path.replace(chr(92), '/').rsplit('/deepspeed/', 1)[-1]}:{line}"}


def deepspeed_config_raise(traceback_text: str | None) -> bool:
    """Whether a rank's traceback ends inside DeepSpeed's config class (its validation raised), or in
    Lightning's check of the DeepSpeed config, with no user frame after it."""
    import re

    found = re.findall(r'File "([^"]+)", line \d+(?:, in (\w+))?', traceback_text or "")
    frames = [path for path, _ in found]
    hits = [i for i, path in enumerate(frames) if path.replace("\\", "/").endswith("deepspeed/runtime/config.py")]
    if not hits and found and found[-1][0].replace("\\", "/").endswith("strategies/deepspeed.py") and \
            found[-1][1] in LIGHTNING_DS_CONFIG_CHECKS:
        return True  # Lightning's own frame raised last: no user frame can follow it
    if not hits:
        return False
    from ...sites import is_user_file

    # pydantic validates DeepSpeed's config models: its frames are DeepSpeed's doing, not the user's.
    return not any(is_user_file(path) and "/pydantic" not in path for path in frames[hits[0]:])

def _render_mesh_size(f: dict, site: str | None):
    shape, nodes, devices = tuple(f["mesh"]), f["num_nodes"], f["devices"]
    summary = (f"FSDPStrategy(device_mesh={shape}) spans {shape[0] * shape[1]} ranks but the Trainer has num_nodes "
               f"{nodes} x devices {devices} = {nodes * devices}: init_device_mesh refuses a mesh whose size is not "
               f"the world's when the job starts on the GPUs.")
    fix = (f"make the mesh (replicas, shard size) = (num_nodes, devices) = ({nodes}, {devices}), or change num_nodes "
           f"and devices to match it.")
    return summary, (f"device_mesh={shape}, num_nodes={nodes}, devices={devices}", site), "FSDP", fix


def _render_mesh_across_nodes(f: dict, site: str | None):
    shape, devices = tuple(f["mesh"]), f["devices"]
    summary = (f"FSDPStrategy(device_mesh={shape}) shards over groups of {shape[1]} ranks, but a node has "
               f"devices={devices}: each shard group crosses nodes, so every forward and backward all-gathers and "
               f"reduce-scatters over the inter-node network, which HYBRID sharding exists to avoid.")
    fix = f"keep the shard dimension within one node: device_mesh=(num_nodes, {devices}) (replicate across nodes)."
    return summary, (f"device_mesh={shape} with devices={devices} per node", site), "FSDP", fix


def _render_hybrid_one_device(f: dict, site: str | None):
    summary = (f"sharding_strategy={f['sharding']} with one device per node (devices={f['devices']}"
               + (f", device_mesh={tuple(f['mesh'])}" if f["mesh"] else "") + "): each node's shard group is one "
               "rank, and torch FSDP turns a group of one into NO_SHARD over that group, so the gradients are never "
               "all-reduced across nodes and every node trains its own replica apart from the others, with no error.")
    fix = ("with one device per node, shard over every rank instead: FULL_SHARD (or SHARD_GRAD_OP), or plain DDP; "
           "keep HYBRID_SHARD for nodes with several devices.")
    return summary, (f"sharding_strategy={f['sharding']}, devices={f['devices']}", site), "FSDP", fix


def _render_hybrid_one_node(f: dict, site: str | None):
    summary = (f"sharding_strategy={f['sharding']} replicates across nodes, but the Trainer config runs "
               f"num_nodes={f['num_nodes'] or 1}: on one node it shards like FULL_SHARD (or SHARD_GRAD_OP) and "
               f"keeps an inter-node process group that has nothing to do.")
    fix = "set num_nodes to the nodes the job runs on, or use FULL_SHARD on one node."
    return summary, (f"sharding_strategy={f['sharding']}, num_nodes={f['num_nodes'] or 1}", site), "FSDP", fix


_RENDERERS = {
    "fsdp_mesh_size": _render_mesh_size,
    "fsdp_mesh_across_nodes": _render_mesh_across_nodes,
    "fsdp_hybrid_one_node": _render_hybrid_one_node,
    "fsdp_hybrid_one_device": _render_hybrid_one_device,
    "ds_rejected": _render_ds_rejected,
    "fsdp_policy_absent": _render_policy_absent,
    "fsdp_mixed_precision": _render_mixed_precision,
    "ds_auto": _render_ds_auto,
    "ds_non_numeric": _render_ds_non_numeric,
    "ds_optimizer_owner": _render_ds_optimizer_owner,
    "ds_accumulation": _render_ds_accumulation,
    "ds_precision": _render_ds_precision,
    "ds_precision_off": _render_ds_precision,
    "ds_zero_key_outside": _render_ds_zero_key_outside,
    "ds_offload_path": _render_ds_offload_path,
    "nccl_timeout": _render_nccl_timeout,
    "unknown_name": _render_unknown_name,
}

CONTRACT = StrategyConfig()
