"""The store's side of unseen turns, on SQLite and PostgreSQL: a turn that `replaces` its
segment's last turn rewinds the segment to before it (the replaced turn stays a row, outside the
segment, in every view); only the last turn can be replaced; aborted turns are turns in the
session's detail but never in what the trainer claims or the export yields."""

from __future__ import annotations

import dataclasses

import pytest

from store import Store
from store.errors import ConflictError
from store.types import SessionFilter, TurnStatus
from tests.support.store_records import new_session, rec


async def test_a_turn_replaces_the_last_turn_of_its_segment(store: Store) -> None:
    sid = await new_session(store)
    t0 = rec("c0", sid, 0, prompt=[1, 2], prefix_len=0, output=[3], opens=True)
    t1 = rec("c1", sid, 0, prompt=[1, 2, 3, 4], prefix_len=3, output=[5, 6])
    await store.record_completions([t0])
    await store.record_completions([t1])

    not_last = rec("x", sid, 0, prompt=[1, 2], prefix_len=0, output=[9])
    with pytest.raises(ConflictError, match="not the last turn"):
        await store.record_completions([dataclasses.replace(not_last, replaces="c0")])
    retry = dataclasses.replace(
        rec("c2", sid, 0, prompt=[1, 2, 3, 4], prefix_len=3, output=[7]), replaces="c1"
    )
    await store.record_completions([retry])
    again = rec("c3", sid, 0, prompt=[1, 2, 3, 4], prefix_len=3, output=[8])
    with pytest.raises(ConflictError, match="not the last turn"):  # replaced already
        await store.record_completions([dataclasses.replace(again, replaces="c1")])

    [seg] = await store.load_segments(sid)
    assert seg.tokens == [1, 2, 3, 4, 7]
    assert seg.last_turn is not None
    assert (seg.last_turn.completion_id, seg.last_turn.prompt_len) == ("c2", 4)
    [shown] = (await store.session_detail(sid)).segments
    assert shown.completion_ids == ["c0", "c2"]
    assert shown.tokens == [1, 2, 3, 4, 7]
    assert shown.loss_mask == [0, 0, 1, 0, 1]
    run_id = (await store.session_detail(sid)).info.run_id
    [listed], _ = await store.list_sessions(run_id, SessionFilter())
    assert listed.turns == 2  # c0 and c2: the replaced attempt c1 is no turn of the session


async def test_aborted_turns_are_context_at_most_for_the_trainer_and_the_export(
    store: Store,
) -> None:
    sid = await new_session(store)
    run_id = (await store.get_session(sid)).run_id
    aborted = TurnStatus.ABORTED
    await store.record_completions(
        [rec("a0", sid, 0, prompt=[1], prefix_len=0, output=[2, 3], opens=True, status=aborted)]
    )
    await store.record_completions(
        [rec("a1", sid, 0, prompt=[1, 2, 3, 4], prefix_len=3, output=[5])]
    )
    await store.record_completions(
        [rec("a2", sid, 0, prompt=[1, 2, 3, 4, 5, 6], prefix_len=5, output=[7], status=aborted)]
    )
    await store.record_completions(
        [rec("b0", sid, 1, prompt=[9], prefix_len=0, output=[8], opens=True, status=aborted)]
    )
    await store.add_reward(
        sid, 1.0, completion_id="a2"
    )  # a reward of a left-out turn counts nowhere
    await store.add_reward(sid, 2.0)
    await store.end_session(sid)

    detail = await store.session_detail(sid)  # every turn, as recorded
    assert [s.completion_ids for s in detail.segments] == [["a0", "a1", "a2"], ["b0"]]

    [t] = await store.list_trainable(run_id)
    assert t.aborted_turns == 3
    [seg] = t.segments  # segment 1 had no other turn: dropped
    assert seg.completion_ids == ["a1"]
    assert seg.tokens == [1, 2, 3, 4, 5]  # the trailing aborted turn is cut off
    assert seg.loss_mask == [0, 0, 0, 0, 1]  # the first, followed by a1, is context
    assert seg.versions == [-1, -1, -1, -1, 0]
    assert t.returns == {"a1": 2.0}

    [(exported, _)] = [x async for x in store.export_sessions(run_id, SessionFilter())]
    assert [s.completion_ids for s in exported.segments] == [["a1"]]
    everything = SessionFilter(include_aborted=True)
    [(exported, _)] = [x async for x in store.export_sessions(run_id, everything)]
    assert [s.completion_ids for s in exported.segments] == [["a0", "a1", "a2"], ["b0"]]
