"""all-rank-save's loop finder (ZeRO-3 with a data-dependent loop): the conditional
loop around a gather's user frame, on source text alone (no world)."""

from __future__ import annotations

import textwrap

from pytest_ltconform.contracts.all_rank_save.loops import enclosing_loop, is_gather

SOURCE = textwrap.dedent("""\
    def validation_step(self, batch, batch_idx):
        h = self.encoder(batch)
        while not done.all():
            h = self.decoder(h)
        for t in range(8):
            h = self.decoder(h)
            if done.all():
                break
        for t in range(8):
            h = self.decoder(h)
        return self.head(h)
    """)


def _site(tmp_path, line):
    path = tmp_path / "case.py"
    path.write_text(SOURCE)
    return {"file": str(path), "line": line, "func": "validation_step"}


def test_a_gather_inside_a_while_loop_is_located_at_the_loop(tmp_path):
    loop = enclosing_loop(_site(tmp_path, 4))
    assert loop["site"]["line"] == 3 and loop["source"] == "while not done.all():"


def test_a_for_loop_counts_only_when_a_break_can_leave_it(tmp_path):
    assert enclosing_loop(_site(tmp_path, 6))["source"] == "for t in range(8):"
    assert enclosing_loop(_site(tmp_path, 6))["site"]["line"] == 5
    assert enclosing_loop(_site(tmp_path, 10)) is None  # a fixed count runs the same on every rank
    assert enclosing_loop(_site(tmp_path, 2)) is None


def test_gather_operations_are_told_from_other_collectives():
    assert all(map(is_gather, ("all_gather", "_allgather_base", "allgather_into_tensor_coalesced")))
    assert not any(map(is_gather, ("broadcast", "allreduce", None)))
