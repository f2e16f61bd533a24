"""Rank reads inside step hooks: where user code asks for its rank in a step, and what it does with it.

Shared by the contracts whose premise is that the DataLoader splits the data between ranks
(data-sharding, eval-duplication): a step that reads the rank and uses it to select data
(``w[self.global_rank::world_size]``, ``x.chunk(world)[rank]``) splits the batch itself, so
identical batches on every rank are by design. A rank that only gates a side effect
(``if self.global_rank == 0: print(...)``) splits nothing.

Rank side: :class:`RankReads` wraps ``LightningModule.global_rank``/``local_rank``,
``Trainer.global_rank``/``local_rank`` and ``torch.distributed.get_rank`` and passes one event per
distinct user line (at most :data:`MAX_SITES`) to a sink::

    {"ev": RANK_READ, "hook": "training_step", "what": "self.global_rank",
     "site": {"file", "line", "func"}, "use": "select" | "gate" | "other", "how": "a subscript"}

Judge side: :func:`selecting_reads` and :func:`describe`. Imports nothing of torch or Lightning
at module level.
"""

from __future__ import annotations

import ast

from ..events import Recorded, declare


class RankReadEvent(Recorded):
    """User code read its rank (``what``) in ``hook`` at ``site`` and used it to ``use`` ('select',
    'gate', 'other'; 'data': the local rank read in a hook that builds data, DATA_HOOKS), ``how`` in
    words."""

    hook: str
    what: str
    site: dict | None
    use: str
    how: str


RANK_READ = declare("rank_read", RankReadEvent)

STEP_HOOKS = ("training_step", "validation_step", "test_step", "predict_step")
# Hooks where a dataset or loader is built: a local rank read there may pick the data (a shard id).
DATA_HOOKS = ("setup", "prepare_data", "train_dataloader", "val_dataloader", "test_dataloader",
              "predict_dataloader", "on_train_epoch_start")
MAX_SITES = 8
RANK_ATTRS = ("global_rank", "local_rank")
# Calls whose arguments pick a part of a tensor or sequence: a rank among them selects data.
SELECT_CALLS = ("chunk", "tensor_split", "split", "narrow", "index_select", "select", "take", "islice",
                "range", "arange", "split_with_sizes", "unbind")


class _RankProperty(property):
    """A property that can carry the recorder's ``__ltconform_wrapped__`` mark."""


class RankReads:
    """Rank side. ``sink(event)`` receives each recorded read; ``install(ns, recorder)`` patches
    through the recorder (undone with it). ``hook()`` says which step hook runs now (or None)."""

    def __init__(self, sink, hook, data_hook=None):
        self.sink = sink
        self.hook = hook
        # Optional: the hook running now by the recorder's name for it ("DataModule.setup"); reads of
        # the local rank there are recorded too, as use "data" (judged by data-sharding across nodes).
        self.data_hook = data_hook
        self.seen: set = set()
        self._uses: dict = {}

    def install(self, ns, recorder) -> None:
        import torch.distributed as dist

        owners = ((getattr(ns, "LightningModule", None), "self"), (getattr(ns, "Trainer", None), "trainer"))
        for owner, label in owners:
            for attr in RANK_ATTRS:
                if owner is not None and isinstance(owner.__dict__.get(attr), property):
                    recorder.patch(owner, attr, lambda prop, a=attr, w=label: self._wrap_property(prop, f"{w}.{a}"))
        recorder.patch(dist, "get_rank", self._wrap_function)

    def _wrap_property(self, prop, what: str):
        reads = self

        def fget(obj):
            value = prop.fget(obj)
            if len(reads.seen) < MAX_SITES:
                reads.record(what)
            return value

        return _RankProperty(fget, prop.fset, prop.fdel, prop.__doc__)

    def _wrap_function(self, original):
        reads = self

        def get_rank(*args, **kwargs):
            value = original(*args, **kwargs)
            if len(reads.seen) < MAX_SITES:
                reads.record("torch.distributed.get_rank()")
            return value

        return get_rank

    def record(self, what: str) -> None:
        """One read, called from the wrapper: recorded once per user line and hook, only when the
        immediate caller is user code inside a step hook."""
        from ..sites import user_site

        try:
            hook = self.hook()
            if hook not in STEP_HOOKS:
                self._record_data_read(what)
                return
            site, direct = user_site(3)
            if site is None or not direct or (site["file"], site["line"], hook) in self.seen:
                return
            self.seen.add((site["file"], site["line"], hook))
            key = (site["file"], site["line"])
            if key not in self._uses:
                self._uses[key] = classify(site["file"], site["line"])
            use, how = self._uses[key]
            self.sink({"ev": RANK_READ, "hook": hook, "what": what, "site": site, "use": use, "how": how})
        except Exception:
            pass  # a read that cannot be recorded is not recorded; the user's step goes on


    def _record_data_read(self, what: str) -> None:
        """A read of the local rank by user code inside a hook that builds data (``DATA_HOOKS``)."""
        from ..sites import user_site

        hook = self.data_hook() if self.data_hook is not None and what.endswith("local_rank") else None
        if not hook or hook.rsplit(".", 1)[-1] not in DATA_HOOKS:
            return
        site, _ = user_site(4)
        if site is None or (site["file"], site["line"], hook) in self.seen:
            return
        self.seen.add((site["file"], site["line"], hook))
        self.sink({"ev": RANK_READ, "hook": hook, "what": what, "site": site, "use": "data",
                   "how": "read while the data is built"})


def local_rank_reads(reads: list[list[dict]]) -> list[dict]:
    """Rank 0's reads of the local rank while data was built (``use`` "data"), one per line."""
    return [e for e in (reads[0] if reads else []) if e.get("use") == "data"]


def step_hook(trainer) -> str | None:
    """The LightningModule hook Lightning is running now (``_current_fx_name``), or None."""
    module = getattr(trainer, "lightning_module", None) if trainer is not None else None
    return getattr(module, "_current_fx_name", None)


# -- what the line does with the rank ------------------------------------------------------------

def classify(path: str, line: int) -> tuple[str, str]:
    """(use, how) of the rank read(s) on ``path``:``line``: ``"select"`` when the rank indexes or
    slices data (directly, or through a name assigned from it in the same function), ``"gate"``
    when it is the test of an ``if``/``while``/conditional expression/assert, else ``"other"``."""
    func = _enclosing_function(path, line)
    if func is None:
        return "other", "the source could not be read"
    parents = {child: node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}
    reads = [n for n in ast.walk(func) if _is_rank_read(n) and n.lineno <= line <= (n.end_lineno or n.lineno)]
    found = [_use_of(n, parents, func, hops=2) for n in reads]
    for want in ("select", "gate"):
        hit = next((f for f in found if f[0] == want), None)
        if hit:
            return hit
    return "other", "not used to index data or as a condition"


def _enclosing_function(path: str, line: int):
    import linecache

    source = "".join(linecache.getlines(path))
    if not source:
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
             and n.lineno <= line <= (n.end_lineno or n.lineno)]
    return min(funcs, key=lambda n: (n.end_lineno or n.lineno) - n.lineno) if funcs else tree


def _is_rank_read(node) -> bool:
    if isinstance(node, ast.Attribute) and node.attr in RANK_ATTRS:
        return True
    if isinstance(node, ast.Call):
        return _call_name(node) == "get_rank"
    return False


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _use_of(node, parents: dict, func, hops: int) -> tuple[str, str]:
    """Walk up from ``node`` to its statement: the first construct that uses the value."""
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.Subscript) and child is parent.slice:
            return "select", "a subscript (it picks this rank's rows)"
        if isinstance(parent, ast.Call) and child is not parent.func and _call_name(parent) in SELECT_CALLS:
            return "select", f"an argument of {_call_name(parent)}() (it picks this rank's part)"
        if isinstance(parent, ast.comprehension) and child in parent.ifs:
            return "select", "a comprehension filter (it keeps this rank's items)"
        if isinstance(parent, (ast.If, ast.While, ast.IfExp, ast.Assert)) and child is parent.test:
            return "gate", f"the test of {_gate_word(parent)} (it gates what runs, it selects no data)"
        if isinstance(parent, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and hops > 0:
            return _through_names(parent, parents, func, hops)
        if isinstance(parent, ast.stmt):
            break
        child, parent = parent, parents.get(parent)
    return "other", "not used to index data or as a condition"


def _gate_word(node) -> str:
    return {ast.If: "an if", ast.While: "a while", ast.IfExp: "a conditional expression",
            ast.Assert: "an assert"}[type(node)]


def _through_names(assign, parents: dict, func, hops: int) -> tuple[str, str]:
    """A name assigned from the rank: how the function uses that name afterwards."""
    targets = assign.targets if isinstance(assign, ast.Assign) else [assign.target]
    names = {t.id for t in targets if isinstance(t, ast.Name)}
    names |= {t.attr for t in targets if isinstance(t, ast.Attribute)}
    found = []
    for n in ast.walk(func):
        loads = (isinstance(n, ast.Name) and n.id in names and isinstance(n.ctx, ast.Load)) or \
                (isinstance(n, ast.Attribute) and n.attr in names and isinstance(n.ctx, ast.Load))
        if loads and n.lineno >= assign.lineno and n is not assign:
            found.append(_use_of(n, parents, func, hops - 1))
    for want in ("select", "gate"):
        hit = next((f for f in found if f[0] == want), None)
        if hit:
            return hit
    return "other", "not used to index data or as a condition"


# -- judge side ----------------------------------------------------------------------------------

def selecting_reads(per_rank: list[list[dict]], hooks: tuple[str, ...]) -> list[dict]:
    """Rank 0's reads in ``hooks`` that select data, when every rank has one (else [])."""
    chosen = [[e for e in events if e.get("hook") in hooks and e.get("use") == "select"] for events in per_rank]
    return chosen[0] if per_rank and all(chosen) else []


def gating_reads(per_rank: list[list[dict]], hooks: tuple[str, ...]) -> list[dict]:
    """Any rank's reads in ``hooks`` that only gate what runs (first rank that has them)."""
    for events in per_rank:
        gates = [e for e in events if e.get("hook") in hooks and e.get("use") == "gate"]
        if gates:
            return gates
    return []


def describe(read: dict, where: bool = True) -> str:
    """``"training_step reads self.global_rank at m.py:12 (Model._shard) as a subscript (...)"``;
    without the place when ``where`` is False (evidence carries it in its own field)."""
    from ..sites import fmt_site

    at = f" at {fmt_site(read.get('site'))}" if where else ""
    return f"{read.get('hook')} reads {read.get('what')}{at} as {read.get('how')}"
