"""The save triggers (bsr_runtime/save_triggers.py, engine-neutral): which prompt chunks go out in which
step. Expected ranges written out by hand for a chunk of 4 tokens."""

from __future__ import annotations

from bsr_runtime.save_triggers import SaveRange, SaveTriggers

CT = 4


def _ranges(out: list[SaveRange]) -> list[tuple[str, int, int, int, bool]]:
    return [(r.request_id, r.first_chunk, r.num_chunks, r.partial_tokens, r.overwrite) for r in out]


def test_chunks_go_out_in_the_step_that_completes_them_then_the_partial_chunk():
    t = SaveTriggers(CT)
    tokens = list(range(14))  # 3 whole chunks and 2 tokens: a partial chunk of 2
    assert t.track("a", tokens, "salt", (), partial_tokens=2)
    t.scheduled("a", 0, first=True)
    assert _ranges(t.due({"a": 5})) == [("a", 0, 1, 0, False)]  # tokens 0..4: chunk 0 only
    t.scheduled("a", 5, first=False)
    assert t.due({"a": 2}) == []  # tokens 5..6: nothing completed
    t.scheduled("a", 7, first=False)
    assert t.due({"b": 7}) == []  # another request's step
    out = t.due({"a": 7})  # tokens 7..13: chunks 1, 2, then the prompt's end: the partial chunk
    assert _ranges(out) == [("a", 1, 3, 0, False), ("a", 3, 4, 2, False)]
    assert out[1].tokens == tokens and out[0].salt == "salt"
    t.scheduled("a", 14, first=False)
    assert t.due({"a": 1}) == []  # every chunk went out once


def test_what_the_engine_held_or_a_load_restored_is_not_saved_again_unless_the_load_failed():
    t = SaveTriggers(CT)
    assert not t.track("short", [1, 2, 3], "")  # no whole chunk: nothing to track
    assert "short" not in t
    t.track("hit", list(range(16)), "")
    t.scheduled("hit", 8, first=True)  # a local hit of 2 chunks: computed (and saved) by another request
    assert _ranges(t.due({"hit": 8})) == [("hit", 2, 4, 0, False)]
    t.track("load", list(range(16)), "")
    t.loaded("load", 3, partial=False)
    t.scheduled("load", 12, first=True)
    assert _ranges(t.due({"load": 4})) == [("load", 3, 4, 0, False)]
    t.load_failed("load")  # recomputed from token 0: every chunk rewritten
    t.scheduled("load", 0, first=False)
    assert _ranges(t.due({"load": 16})) == [("load", 0, 4, 0, True)]
    t.forget("load")
    assert "load" not in t and t.due({"load": 16}) == []
    t.clear()
    assert "hit" not in t


def test_a_due_step_lists_requests_in_the_order_they_were_tracked():
    t = SaveTriggers(CT)
    for rid in ("x", "y"):
        t.track(rid, list(range(4)), "")
        t.scheduled(rid, 0, first=True)
    assert [r.request_id for r in t.due({"y": 4, "x": 4})] == ["x", "y"]
