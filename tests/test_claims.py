"""The consistency check of a verdict's sentences against the facts they were made from
(``pytest_ltconform.claims``): each kind holds on true facts and fails on false ones; prose that
makes a claim with no claim behind it fails; an evidence line is held against its frame."""

from __future__ import annotations

import textwrap

import pytest

from pytest_ltconform import claims
from pytest_ltconform.contracts.base import Evidence, Verdict


def _record(message: str, *made: claims.Claim, contract: str = "sync-dist", evidence=()) -> dict:
    return {"contract": contract, "message": message, "claims": [c.as_dict() for c in made],
            "evidence": list(evidence)}


def test_a_claim_of_difference_needs_two_different_recorded_values():
    text = "the best_model_score differs across ranks"
    true = claims.claim("differ", text, values={"rank 0": 0.25, "rank 1": 0.5})
    false = claims.claim("differ", text, values={"rank 0": "a.ckpt", "rank 1": "a.ckpt"})
    assert claims.check(_record(text, true)) == []
    assert "the recorded values are the same" in claims.check(_record(text, false))[0]
    assert "needs two recorded values" in claims.check(_record(text, claims.claim("differ", text, values={})))[0]


def test_prose_that_claims_a_difference_with_no_claim_behind_it_fails():
    """Today's sentence: said with no recorded values next to it."""
    message = ("[sync-dist] FAILED (silently wrong values, no error): ModelCheckpoint(monitor='val_loss') ends "
               "with a different best checkpoint on each rank: the ranks disagree about which checkpoint is best.")
    problems = claims.check(_record(message))
    assert any("'different best checkpoint' is said with no differ claim" in p for p in problems), problems
    # The same words in another contract's message are not that kind's business.
    assert not [p for p in claims.check(_record(message, contract="data-sharding")) if p.startswith("differ")]


def test_a_claim_must_be_in_the_message_it_sits_next_to():
    c = claims.claim("differ", "values differ across ranks", values={"rank 0": 1.0, "rank 1": 2.0})
    assert "not in the message" in claims.check(_record("something else entirely", c))[0]


def test_reduced_needs_a_recorded_sync_and_local_its_absence():
    synced = {"sync_dist": True, "rank_zero_only": False, "vtype": "tensor"}
    plain = {"sync_dist": False, "rank_zero_only": False, "vtype": "tensor"}
    zero_only = {"sync_dist": True, "rank_zero_only": True, "vtype": "tensor"}
    metric = {"sync_dist": False, "rank_zero_only": False, "vtype": "metric"}
    text = "'acc' mean-reduced over batches and ranks"
    assert claims.check(_record(text, claims.claim("reduced", text, log=synced))) == []
    assert claims.check(_record(text, claims.claim("reduced", text, log=metric))) == []
    for log in (plain, zero_only):
        assert "not synced" in claims.check(_record(text, claims.claim("reduced", text, log=log)))[0]
    local = "'acc' averaged over rank 0's own batches"
    assert claims.check(_record(local, claims.claim("local", local, log=plain))) == []
    assert "was synced" in claims.check(_record(local, claims.claim("local", local, log=synced)))[0]
    # Said with no claim at all (as sentences were written before claims):
    assert "no reduced claim" in claims.check(_record(text))[0]


def test_a_cross_rank_comparison_names_the_rank_whose_value_it_uses():
    values = {"0": 0.2599, "1": 0.2411}
    wrong = "acc 0.2599 on 2 ranks vs 0.2484 on 1 device"
    right = "acc 0.2599 on rank 0 (rank 1: 0.2411) vs 0.2484 on 1 device"
    rec = _record(wrong, claims.claim("rank-value", wrong, rank=0, values=values), contract="eval-duplication")
    assert "does not say it uses rank 0's" in claims.check(rec)[0]
    rec = _record(right, claims.claim("rank-value", right, rank=0, values=values), contract="eval-duplication")
    assert claims.check(rec) == []
    synced = {"0": 0.25, "1": 0.25}
    ok = "acc 0.25 on 2 ranks vs 0.2484 on 1 device"
    rec = _record(ok, claims.claim("rank-value", ok, rank=0, values=synced), contract="eval-duplication")
    assert claims.check(rec) == []
    assert "no rank-value claim" in claims.check(_record(wrong, contract="eval-duplication"))[0]


def test_module_never_ran_only_when_its_parameters_were_not_used():
    text = "head never ran in forward"
    rec = _record(text, claims.claim("not-run", text, module="head", used=True, hooks=False),
                  contract="unused-parameters")
    assert "use was recorded as True" in claims.check(rec)[0]
    rec = _record(text, claims.claim("not-run", text, module="head", used=False, hooks=False),
                  contract="unused-parameters")
    assert claims.check(rec) == []
    assert "no not-run claim" in claims.check(_record(text, contract="unused-parameters"))[0]


def test_a_switched_off_requires_grad_names_the_recorded_site_or_says_unknown():
    site = {"file": "/user/model.py", "line": 12, "func": "Model.training_step"}
    guess = "requires_grad was switched off for head.p at that moment (toggle_optimizer or similar)"
    rec = _record(guess, claims.claim("switched-off", guess, site=None, via=None), contract="unused-parameters")
    assert "does not say so" in claims.check(rec)[0]
    rec = _record(guess, claims.claim("switched-off", guess, site=site, via=None), contract="unused-parameters")
    assert "is not named" in claims.check(rec)[0]
    named = "requires_grad was switched off for head.p at /user/model.py:12 (Model.training_step)"
    rec = _record(named, claims.claim("switched-off", named, site=site, via=None), contract="unused-parameters")
    assert claims.check(rec) == []
    lightning = named + " (through LightningModule.toggle_optimizer)"
    rec = _record(lightning, claims.claim("switched-off", lightning, site=site, via="LightningModule.freeze"),
                  contract="unused-parameters")
    assert "names toggle_optimizer, which was not recorded" in claims.check(rec)[0]


def test_a_named_line_is_a_line_of_its_frame_and_of_the_call(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent("""\
        class Model:
            def validation_step(self, batch):
                self.log_dict({"a": 1})
                self.log("val_loss", 2.0,
                         sync_dist=False)

            def other(self):
                pass
        """))
    frame = {"file": str(path), "line": 4, "func": "Model.validation_step"}
    assert claims.frame_problem(frame, call="log") is None
    assert claims.frame_problem({**frame, "line": 5}, call="log") is None  # inside the call's own lines
    assert "makes no log(...) call" in claims.frame_problem({**frame, "line": 3}, call="log")
    assert "is not in Model.validation_step" in claims.frame_problem({**frame, "line": 8})
    # An evidence line's frame is checked whatever the claims say.
    bad = Evidence("logged here", frame={**frame, "line": 8}).as_dict()
    assert "not in Model.validation_step" in claims.check(_record("x", evidence=[bad]))[0]
    assert claims.check(_record("x", evidence=[Evidence("logged here", frame=frame).as_dict()])) == []


def test_the_silent_label_is_not_said_over_values_measured_equal():
    """A headline that contradicts its evidence: the published values were measured equal."""
    same = claims.claim("equal", "acc 0.5 on 2 ranks = 0.5 on 1 device", values={"world": 0.5, "single": 0.5},
                        against="reference")
    verdict = Verdict("eval-duplication", "failed", f"every rank evaluates the whole set; {same.text}.",
                      category="silent", claims=[same])
    problems = claims.check({"contract": "eval-duplication", **verdict.as_dict()})
    assert any("measure the published values equal" in p for p in problems), problems
    verdict.category = "repeated"
    assert claims.check({"contract": "eval-duplication", **verdict.as_dict()}) == []


def test_a_verdict_carries_its_claims_and_frames_into_the_report_record():
    from pytest_ltconform import report

    c = claims.claim("differ", "scores differ across ranks", values={"rank 0": 1.0, "rank 1": 2.0})
    frame = {"file": "/user/m.py", "line": 3, "func": "M.f"}
    verdict = Verdict("sync-dist", "failed", "the scores differ across ranks.", claims=[c], category="silent",
                      evidence=[Evidence("here", rank=0, frame=frame)])
    rec = report.record("sync-dist", "ddp", 2, verdict.as_dict(), 1.0, target="t")
    assert [x["kind"] for x in rec["claims"]] == ["differ", "label"]
    assert rec["evidence"][0]["frame"] == frame and rec["evidence"][0]["site"] == "/user/m.py:3 (M.f)"


def test_an_unknown_kind_is_refused_where_the_claim_is_made():
    with pytest.raises(KeyError, match="no claim kind 'nope'"):
        claims.claim("nope", "x")


# -- each sentence kind, today's false sentence first ----------------------------------------------

def test_a_fix_never_calls_a_property():
    today = ("[all-rank-save] FAILED (deadlocks the world): log_dir (trainer.py:1331; its broadcast was this "
             "collective) called on rank 0 ...\nFix: call log_dir() on every rank, in the same order (it makes a "
             "collective every rank must enter).")
    assert any(p.startswith("call-form: 'call log_dir() on every rank' is said with no call-form claim")
               for p in claims.check(_record(today, contract="all-rank-save")))
    false = claims.claim("call-form", "call log_dir() on every rank", func="log_dir", property=True)
    assert "log_dir is a property" in claims.check(_record(today, false, contract="all-rank-save"))[0]
    now = today.replace("call log_dir()", "read trainer.log_dir")
    true = claims.claim("call-form", "read trainer.log_dir on every rank", func="log_dir", property=True)
    assert claims.check(_record(now, true, contract="all-rank-save")) == []


def test_deepspeed_auto_values_are_explained_key_by_key():
    today = ('[strategy-config] FAILED: DeepSpeed config has "auto" at gradient_clipping and fp16.enabled; '
             "Lightning passes them on unresolved: DeepSpeed then fails on the micro-batch size (TypeError comparing "
             "with an int) and silently replaces the bucket sizes by its 5e8 defaults.")
    assert any("auto-effect" in p for p in claims.check(_record(today, contract="strategy-config")))
    paths = ["gradient_clipping", "fp16.enabled"]
    effects = {"gradient_clipping": {"effect": "kept"}, "fp16.enabled": {"effect": "default", "value": "False"}}
    sentence = today.split("[strategy-config] FAILED: ")[1]
    assert "micro-batch size" in claims.check(_record(today, claims.claim("auto-effect", sentence, paths=paths,
                                                                            effects=effects),
                                                      contract="strategy-config"))[0]
    now = ('DeepSpeed config has "auto" at gradient_clipping and fp16.enabled. What DeepSpeed\'s own config reader '
           'makes of each: gradient_clipping: DeepSpeed keeps the string "auto"; fp16.enabled: DeepSpeed replaces it '
           "by its default, False.")
    assert claims.check(_record(now, claims.claim("auto-effect", now, paths=paths, effects=effects),
                                contract="strategy-config")) == []


def test_coupling_is_not_said_where_the_precision_explains_the_gap():
    text = "a loss or layer that couples the samples of a batch"
    today = f"[effective-batch] not judged: the gradients differ beyond rounding (0.002 > 0.001): {text} ..."
    assert any("coupling" in p for p in claims.check(_record(today, contract="effective-batch")))
    half = claims.claim("coupling", text, rel_diff=0.002, limit=0.0049, precision="16-mixed")
    assert "the precision explains it" in claims.check(_record(today, half, contract="effective-batch"))[0]
    beyond = claims.claim("coupling", text, rel_diff=0.2, limit=0.0049, precision="16-mixed")
    assert claims.check(_record(today, beyond, contract="effective-batch")) == []


def test_a_rank_that_raised_on_its_own_is_no_consequence():
    today = ("[fit[deepspeed]] the run did not finish: rank 0 raised TypeError: '>' not supported ...\n"
             "Consequences, not causes: rank 1 raised TypeError: '>' not supported between instances of 'str' and "
             "'float'.")
    assert any(p.startswith("consequence:") for p in claims.check(_record(today, contract="fit")))
    now = today.replace("Consequences, not causes: rank 1 raised TypeError",
                        "rank 1 raised the same TypeError at the same line on its own")
    peers = "Consequences, not causes: rank 0 then failed in a collective (RuntimeError: Connection closed)."
    assert not [p for p in claims.check(_record(now + "\n" + peers, contract="fit")) if p.startswith("consequence")]


def test_not_running_on_cpu_is_said_only_when_ddp_did_not_stop_the_same_way():
    today = ("[all-rank-save] skipped: the module does not run under FSDP on CPU (RuntimeError: Please call "
             "`iter(combined_loader)` first); the Trainer config does not name a sharded strategy, ...")
    assert any(p.startswith("cpu-only:") for p in claims.check(_record(today, contract="all-rank-save")))
    said = "does not run under FSDP on CPU"
    same = claims.claim("cpu-only", said, ddp="same")
    assert "runs under no strategy" in claims.check(_record(today, same, contract="all-rank-save"))[0]
    assert claims.check(_record(today, claims.claim("cpu-only", said, ddp="finished"),
                                contract="all-rank-save")) == []


def test_an_evaluation_pass_says_why_it_compared_nothing_with_the_one_device_run():
    today = ("[eval-duplication] passed: validation: every index 0..63 evaluated exactly once across ranks (rank 0: "
             "32, rank 1: 32).")
    assert any(p.startswith("one-device:") for p in claims.check(_record(today, contract="eval-duplication")))
    text = today.split("passed: ")[1].rstrip(".")
    silent = claims.claim("one-device", text, compared={}, why=None)
    assert "no reason is recorded" in claims.check(_record(today, silent, contract="eval-duplication"))[0]
    why = "the validation stage published no metric"
    now = f"[eval-duplication] passed: {text}; no value was compared with the one-device run: {why}."
    said = claims.claim("one-device", f"{text}; no value was compared with the one-device run: {why}", compared={},
                        why=why)
    assert claims.check(_record(now, said, contract="eval-duplication")) == []


def test_batches_said_to_differ_say_what_differs_and_what_is_equal():
    today = ("[data-sharding] passed: train batches differ across ranks (rank 0: 8, rank 1: 8 batches) (dataset "
             "TensorDataset, sampler DistributedSampler); the same number of train batches per epoch on every rank.")
    assert any(p.startswith("batches-differ:") for p in claims.check(_record(today, contract="data-sharding")))
    text = ("train batches hold different samples on each rank in 8 of 8 steps compared by the dataset indices they "
            "fetched; every rank ran 8 train batches")
    now = f"[data-sharding] passed: {text} (dataset TensorDataset, sampler DistributedSampler)."
    good = claims.claim("batches-differ", text, differed=8, compared=8, counts={"rank 0": 8, "rank 1": 8})
    assert claims.check(_record(now, good, contract="data-sharding")) == []
    uneven = claims.claim("batches-differ", text, differed=8, compared=8, counts={"rank 0": 8, "rank 1": 7})
    assert "misstates" in claims.check(_record(now, uneven, contract="data-sharding"))[0]
    none = claims.claim("batches-differ", text, differed=0, compared=8, counts={"rank 0": 8, "rank 1": 8})
    assert "no step with different batches" in claims.check(_record(now, none, contract="data-sharding"))[0]


# -- device-placement ----------------------------------------------------------------------------------

def _dp(message: str, *made: claims.Claim) -> list[str]:
    return claims.check(_record(message, *made, contract="device-placement"))


def test_a_tensor_said_off_its_ranks_device_rests_on_the_devices_followed():
    text = "on the CPU: on GPU ranks it stays on the CPU"
    host = {0: {"device": "cpu", "own": "cuda:0"}, 1: {"device": "cpu", "own": "cuda:1"}}
    assert _dp(f"a tensor reaches all_reduce {text}.", claims.claim("off-device", text, ranks=host)) == []
    own = {0: {"device": "cuda:0", "own": "cuda:0"}, 1: {"device": "cpu", "own": "cuda:1"}}
    assert "on the rank's own device" in _dp(text, claims.claim("off-device", text, ranks=own))[0]
    other = {0: {"device": "cuda:1", "own": "cuda:0"}}
    assert "says the CPU" in _dp(text, claims.claim("off-device", text, ranks=other))[0]
    # Said with no claim behind it:
    assert any("no off-device claim" in p for p in _dp(f"x reaches all_gather {text} while the module is there."))


def test_a_call_said_to_mix_devices_rests_on_two_recorded_devices():
    text = "gets tensors on cuda:0 and cpu"
    assert _dp(text, claims.claim("mixed-devices", text, devices=["cuda:0", "cpu"])) == []
    assert "not two different ones" in _dp(text, claims.claim("mixed-devices", text, devices=["cuda:0", "cuda:0"]))[0]
    assert any("no mixed-devices claim" in p for p in _dp("torch.add at m.py:3 gets tensors on cuda:0 and cpu"))


def test_what_a_cuda_index_is_said_to_be_rests_on_each_ranks_index_and_local_rank():
    same = "asks for the hard-coded device 'cuda:0' on every rank"
    ok = claims.claim("cuda-index", same, form="same", indices={0: 0, 1: 0}, local={0: 0, 1: 1})
    assert _dp(same, ok) == []
    own = claims.claim("cuda-index", same, form="same", indices={0: 0, 1: 1}, local={0: 0, 1: 1})
    assert "different indices" in _dp(same, own)[0]
    glob = "takes its CUDA index from the global rank"
    assert _dp(glob, claims.claim("cuda-index", glob, form="global", indices={0: 0, 1: 1}, local={0: 0, 1: 1})) == []
    assert "not the ranks' global ranks" in _dp(glob, claims.claim("cuda-index", glob, form="global",
                                                                   indices={0: 1, 1: 0}, local={0: 0, 1: 1}))[0]
    wrong = "asks each rank for a GPU that is not its own"
    assert "its own GPU" in _dp(wrong, claims.claim("cuda-index", wrong, form="wrong", indices={0: 0, 1: 1},
                                                    local={0: 0, 1: 1}))[0]


def test_a_device_finding_fails_exactly_where_the_config_is_for_gpus_and_the_fault_breaks_it():
    text = "Under the Trainer config (accelerator='gpu', devices=2)"

    def problems(failed, gpu="gpu", per_node=2, nodes=1, needs=("node",), said=text):
        return _dp(said, claims.claim("gpu-config", said, gpu=gpu, per_node=per_node, nodes=nodes,
                                      needs=list(needs), failed=failed))

    assert problems(True) == []
    assert problems(False, per_node=1) == []          # one GPU per node: two ranks never share one
    assert "do not break" in problems(True, per_node=1)[0]
    assert "do not break" in problems(True, gpu=None)[0]
    assert "break the run" in problems(False, needs=("gpu",))[0]
    assert problems(False, needs=("nodes",)) == [] and problems(True, needs=("nodes",), nodes=2) == []
    cpu = "The Trainer config is for CPU ranks (accelerator='cpu')"
    assert problems(False, gpu=None, said=cpu) == []
    assert "CPU-only" in problems(False, gpu="auto", said=cpu, needs=())[0]
    assert any("no gpu-config claim" in p for p in _dp(f"{text}: nothing found."))


def test_gather_counts_rest_on_two_different_recorded_counts_named_per_rank():
    """ZeRO-3 with a data-dependent loop: the ranks' gather counts, each named."""
    text = "the ranks made different numbers of gathers (rank 0 24 gathers, rank 1 25 gathers)"
    true = claims.claim("gather-counts", text, counts={0: 24, 1: 25}, upto=63)
    same = claims.claim("gather-counts", text, counts={0: 24, 1: 24}, upto=63)
    unnamed = claims.claim("gather-counts", text, counts={0: 24, 1: 26}, upto=63)
    record = dict(contract="all-rank-save")
    assert claims.check(_record(text, true, **record)) == []
    assert "do not differ" in claims.check(_record(text, same, **record))[0]
    assert "does not name rank 1 26" in claims.check(_record(text, unnamed, **record))[0]
    assert any("no gather-counts claim" in p for p in claims.check(_record(text, **record)))
def test_an_object_address_is_not_printed_and_is_named_instead():
    from pytest_ltconform.sites import first_sentence, no_addresses

    text = "can't pickle <function <lambda> at 0x7f3a2b1c0d30>: attribute lookup on <mod.Foo object at 0x7f00aa>"
    assert no_addresses(text) == "can't pickle <function <lambda>>: attribute lookup on <mod.Foo object>"
    assert "0x" not in first_sentence(text)
    problems = claims.check(_record(f"[memory] PASSED: x\nNote: the step was not traced, because {text}",
                                    contract="memory"))
    assert any(p.startswith("address") for p in problems)
    assert claims.check(_record(f"[memory] PASSED: x\nNote: {no_addresses(text)}", contract="memory")) == []
