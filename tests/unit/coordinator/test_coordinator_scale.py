"""The coordinator at thousands of members: counts kept as states change, deadlines in a heap,
wake-ups only for the polls a change concerns, lean replies, and a bounded memory."""

from __future__ import annotations

import asyncio
import json
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.coordinator.membership import Membership, MembershipSettings, MemberState

FAST = settings(max_examples=150, deadline=None)


def _recount(m: Membership) -> dict[MemberState, int]:
    counts = {state: 0 for state in MemberState}
    for member in m.members.values():
        counts[member.state] += 1
    return counts


operations = st.lists(
    st.tuples(
        st.sampled_from(["join", "heartbeat", "dead", "leave", "failure", "form", "expire", "take"]),
        st.sampled_from(["a", "b", "c", "d", "e"]),
        st.integers(0, 3),
    ),
    max_size=60,
)


@FAST
@given(operations)
def test_the_counts_per_state_always_equal_a_recount_and_the_views_agree_with_the_members(ops):
    m = Membership(MembershipSettings(heartbeat_timeout=2.0, expected_members=2, forget_after=3.0, history_limit=2))
    now = 0.0
    for op, member, arg in ops:
        now += 0.5 * arg
        if op == "join":
            m.join(member, "n", None, arg, now)
        elif op == "heartbeat":
            m.heartbeat(member, arg, now, blocked_on="allreduce" if arg == 1 else None)
        elif op == "dead":
            m.mark_dead(member, "killed", now)
        elif op == "leave":
            m.leave(member, finished=False, step=arg, now=now)
        elif op == "failure" and m.current is not None:
            m.report_failure(member, m.current.number, now)
        elif op == "form":
            m.maybe_form(now)
        elif op == "take":
            m.take_survivors(now)
        else:
            m.expire(now)
        assert {s: m.count(s) for s in MemberState} == _recount(m)
        blocked = sum(x.state is MemberState.ACTIVE and bool(x.blocked_on) for x in m.members.values())
        assert m._blocked_active == blocked
        assert m.preformed <= set(m.current.members if m.current else ())
        live = sum(x.state in (MemberState.WAITING, MemberState.ACTIVE) for x in m.members.values())
        assert m.live_count() == live
        assert len(m.history) <= 2
        assert m.committed_step() >= max((x.step for x in m.members.values()), default=0)


def test_a_silent_member_is_declared_dead_once_its_deadline_passes_and_a_heartbeat_moves_it():
    m = Membership(MembershipSettings(heartbeat_timeout=5.0, expected_members=2))
    m.join("a", "n", None, 0, now=0.0)
    m.join("b", "n", None, 0, now=0.0)
    m.maybe_form(0.0)
    m.heartbeat("a", 0, now=4.0)
    assert m.expire(5.5) == ["b"]
    assert m.expire(8.9) == []
    m.heartbeat("a", 0, now=8.0)
    assert m.expire(12.9) == []
    assert m.expire(13.1) == ["a"]


def test_expire_costs_the_deadlines_that_came_due_not_every_member():
    m = Membership(MembershipSettings(heartbeat_timeout=5.0, expected_members=20_000))
    for i in range(20_000):
        m.join(f"m{i}", "n", None, 0, now=0.0)
    m.maybe_form(0.0)
    started = time.perf_counter()
    for tick in range(1000):
        assert m.expire(0.001 * tick) == []
        assert not m.reconfigure_wanted()
    # a scan of 20,000 members per call took about 2 s for these 1,000 calls
    assert time.perf_counter() - started < 0.5


def test_members_gone_for_longer_than_forget_after_are_forgotten_unless_the_generation_names_them():
    m = Membership(MembershipSettings(heartbeat_timeout=100.0, expected_members=2, forget_after=10.0, history_limit=3))
    for member in "abc":
        m.join(member, "n", None, 0, now=0.0)
    m.maybe_form(0.0)
    m.leave("c", finished=False, step=0, now=1.0)  # in the current generation, which it broke
    m.mark_dead("ghost", "exited before joining", now=1.0)
    m.expire(5.0)
    assert {"c", "ghost"} <= set(m.members)
    m.expire(12.0)
    assert "ghost" not in m.members and "c" in m.members  # generation 1 still names c
    m.join("a", "n", None, 0, now=12.0)
    m.join("b", "n", None, 0, now=12.0)
    m.maybe_form(12.0)
    m.expire(30.0)
    assert "c" not in m.members and m.live_count() == 2
    for round_ in range(5):
        m.join("a", "n", None, 0, now=31.0 + round_)
        m.join("b", "n", None, 0, now=31.0 + round_)
        m.maybe_form(31.0 + round_)
    assert [g.number for g in m.history] == [5, 6, 7]


class _Request:
    def __init__(self, body: dict | None = None, query: dict | None = None) -> None:
        self._body = body or {}
        self.query = query or {}
        self.transport = None

    async def json(self) -> dict:
        return self._body


def _coordinator(**membership):
    from unbroken.coordinator.server import Coordinator, CoordinatorSettings

    return Coordinator(CoordinatorSettings(hold=0.5), MembershipSettings(**membership))


def test_a_lean_join_reply_names_no_members_and_the_members_are_fetched_by_generation():
    coordinator = _coordinator(expected_members=1)

    async def run():
        lean = json.loads((await coordinator._join(_Request({"member": "a", "lean": True}))).text)
        listed = json.loads((await coordinator._members(_Request(query={"generation": "1"}))).body)
        one = json.loads((await coordinator._members(_Request(query={"generation": "1", "rank": "0"}))).text)
        return lean, listed, one

    lean, listed, one = asyncio.run(run())
    assert lean["status"] == "formed" and "members" not in lean
    assert (lean["generation"], lean["size"], lean["rank"]) == (1, 1, 0)
    assert listed == {"generation": 1, "members": ["a"]}
    assert one == {"generation": 1, "member": "a"}


def test_a_change_of_one_members_state_wakes_only_that_members_poll():
    coordinator = _coordinator(expected_members=3)

    async def turns():
        for _ in range(3):  # the wake-up itself, then the woken waiter
            await asyncio.sleep(0)

    async def run():
        coordinator.state.join("a", "n", None, 0, time.monotonic())
        coordinator._bump()
        waiting_a = asyncio.ensure_future(coordinator._wait_change(5.0, "a"))
        waiting_c = asyncio.ensure_future(coordinator._wait_change(5.0, "c"))
        await asyncio.sleep(0)
        coordinator.state.mark_dead("c", "exited", time.monotonic())  # c is not in any generation
        coordinator.state.join("c", "n", None, 0, time.monotonic())
        coordinator._bump()
        await turns()
        woken = (waiting_a.done(), waiting_c.done())
        coordinator.state.join("b", "n", None, 0, time.monotonic())  # the third: a generation forms
        coordinator._bump()
        await turns()
        return woken, waiting_a.done()

    woken, a_after_formation = asyncio.run(run())
    assert woken == (False, True)
    assert a_after_formation


def test_a_roster_fetches_single_ids_then_the_whole_list_once_and_names_unknown_ranks():
    from unbroken.errors import CoordinatorUnreachable
    from unbroken.coordinator.roster import Roster

    class Client:
        def __init__(self, members):
            self.members, self.requests = members, []

        def request(self, method, path):
            self.requests.append(path)
            if self.members is None:
                raise CoordinatorUnreachable("404")
            if "rank=" in path:
                return {"member": self.members[int(path.rsplit("=", 1)[1])]}
            return {"members": self.members}

    client = Client([f"m{i}" for i in range(20)])
    roster = Roster(client, 4, 20, "m3", 3)
    assert len(roster) == 20 and client.requests == []
    assert roster[3] == "m3" and client.requests == []
    assert [roster[i] for i in range(12)] == [f"m{i}" for i in range(12)]
    assert list(roster) == client.members
    assert sum("rank=" not in r for r in client.requests) == 1
    gone = Roster(Client(None), 4, 3, "m1", 1)
    assert list(gone) == ["rank0", "m1", "rank2"] and gone[0] == "rank0"


def test_a_change_that_concerns_every_poll_wakes_them_in_slices_between_which_the_loop_turns():
    from unbroken.coordinator.server import Coordinator, CoordinatorSettings

    coordinator = Coordinator(CoordinatorSettings(hold=0.5, wake_slice=0.0), MembershipSettings(expected_members=2))

    async def run():
        polls = [asyncio.ensure_future(coordinator._wait_change(5.0, f"m{i}")) for i in range(300)]
        await asyncio.sleep(0)
        coordinator._wake_all()
        done_per_turn = []
        for _ in range(8):
            await asyncio.sleep(0)
            done_per_turn.append(sum(p.done() for p in polls))
        return done_per_turn

    done = asyncio.run(run())
    assert done[0] <= 64 and done[-1] == 300  # a slice of no time still wakes one chunk of 64
    assert len(set(done)) >= 4  # several turns of the loop, not one


def test_the_garbage_collector_waits_while_thousands_of_polls_are_woken_and_runs_again_after():
    import gc

    from unbroken.coordinator.long_polls import GC_PAUSE_FROM
    from unbroken.coordinator.server import Coordinator, CoordinatorSettings

    coordinator = Coordinator(CoordinatorSettings(hold=0.5, wake_slice=0.0), MembershipSettings(expected_members=2))

    async def run(polls: int):
        waiters = [asyncio.ensure_future(coordinator._wait_change(5.0, f"m{i}")) for i in range(polls)]
        await asyncio.sleep(0)
        coordinator._wake_all()
        enabled = []
        while coordinator._to_wake:  # a turn that leaves some to wake
            enabled.append(gc.isenabled())
            await asyncio.sleep(0)
        await asyncio.gather(*waiters)
        return enabled, gc.isenabled()

    assert gc.isenabled()
    during, after = asyncio.run(run(GC_PAUSE_FROM))
    assert len(during) >= 2 and not any(during) and after
    during, after = asyncio.run(run(200))  # a few hundred polls: nothing paused
    assert len(during) >= 2 and all(during) and after


def test_a_join_that_crossed_the_formation_of_its_generation_is_answered_with_it_and_changes_nothing():
    coordinator = _coordinator(expected_members=2)
    state = coordinator.state
    state.join("a", "n", None, 0, now=time.monotonic())
    state.join("b", "n", None, 0, now=time.monotonic())
    generation, _ = state.maybe_form(time.monotonic())

    async def run():
        return json.loads((await coordinator._join(_Request({"member": "b", "after": 0, "lean": True}))).text)

    reply = asyncio.run(run())
    assert (reply["status"], reply["generation"], reply["rank"]) == ("formed", generation.number, 1)
    assert state.members["b"].state is MemberState.ACTIVE and not state.reconfigure_wanted()


def test_survivors_waiting_in_a_collective_hear_of_the_next_generation_in_the_reply_to_the_verdict():
    coordinator = _coordinator(expected_members=3, heartbeat_timeout=30.0)
    events: list[tuple[str, dict]] = []
    coordinator.events.emit = lambda kind, **fields: events.append((kind, fields))

    async def beat(member, seen, blocked_on=None):
        started = time.monotonic()
        body = {"member": member, "seen": seen, "hold": 0.4, "blocked_on": blocked_on}
        reply = json.loads((await coordinator._heartbeat(_Request(body))).text)
        return reply, time.monotonic() - started

    async def run():
        now = time.monotonic()
        for member in ("a", "b", "c"):
            coordinator.state.join(member, "n", None, 0, now)
        coordinator._bump()  # generation 1
        seen = {m: (await beat(m, {}, "allreduce"))[0] for m in ("a", "c")}  # both wait in the allreduce
        held = asyncio.ensure_future(beat("a", seen["a"], "allreduce"))
        await asyncio.sleep(0.05)
        coordinator.state.mark_dead("b", "killed", time.monotonic())  # the verdict
        coordinator._bump()
        view, waited = await held
        # c's runtime saw its collective fail and joins anyway: answered at once, not re-formed
        joined = json.loads((await coordinator._join(_Request({"member": "c", "after": 1, "lean": True}))).text)
        return view, waited, joined

    view, waited, joined = asyncio.run(run())
    assert waited < 0.3  # news: answered at once
    assert (view["generation"], view["broken"], view["state"], view["rank"], view["size"]) == (2, False, "active", 0, 2)
    assert view["prefix"] == "unbroken/gen2/"
    assert (joined["status"], joined["generation"], joined["rank"]) == ("formed", 2, 1)
    assert coordinator.state.current.number == 2
    generations = [fields for kind, fields in events if kind == "generation"]
    assert generations[-1]["members"] == ["a", "c"] and generations[-1]["without_joining"] == 2


def test_a_held_heartbeat_answers_a_break_at_once_but_not_the_members_own_join_or_formation():
    coordinator = _coordinator(expected_members=2, heartbeat_timeout=30.0)

    async def beat(member, seen):
        started = time.monotonic()
        reply = json.loads((await coordinator._heartbeat(_Request({"member": member, "seen": seen, "hold": 0.4}))).text)
        return reply, time.monotonic() - started

    async def run():
        now = time.monotonic()
        for member in ("a", "b"):
            coordinator.state.join(member, "n", None, 0, now)
        coordinator._bump()  # generation 1
        view, _ = await beat("a", {})
        held = asyncio.ensure_future(beat("a", view))
        await asyncio.sleep(0.05)
        coordinator.state.report_failure("b", 1, time.monotonic())  # generation 1 breaks
        coordinator._bump()
        broken, waited_for_break = await held
        held = asyncio.ensure_future(beat("a", broken))
        await asyncio.sleep(0.05)
        for member in ("a", "b"):  # both join again: a waits, then generation 2 forms
            coordinator.state.join(member, "n", None, 0, time.monotonic())
            coordinator._bump()
        formed, waited_for_formation = await held
        return broken, waited_for_break, formed, waited_for_formation

    broken, waited_for_break, formed, waited_for_formation = asyncio.run(run())
    assert broken["broken"] and waited_for_break < 0.3  # news: answered at once
    # a's join told it that it waits, then that it is in generation 2: the poll held its full hold
    assert formed["generation"] == 2 and not formed["broken"] and waited_for_formation > 0.35


def test_the_first_generation_of_a_large_job_freezes_what_lives_out_of_collections_once(monkeypatch):
    """Its members' records and lines live as long as the job: a collection of the older
    generations walked all of them (100-130 ms at 16,384 members, a healthy job's worst stall)."""
    from unbroken.coordinator import garbage, server

    frozen = []
    monkeypatch.setattr(garbage, "freeze_what_lives", lambda: frozen.append(True))

    def form(members: int) -> None:
        coordinator = _coordinator(expected_members=members, heartbeat_timeout=30.0)
        now = time.monotonic()
        for i in range(members):
            coordinator.state.join(f"m{i}", "n", None, 0, now)

        async def run():
            coordinator._bump()
            for i in range(members):  # every member waits in the step's allreduce
                coordinator.state.heartbeat(f"m{i}", 0, time.monotonic(), "allreduce")
            coordinator.state.mark_dead("m0", "killed", time.monotonic())
            coordinator._bump()  # the survivors form a second generation: no second freeze

        asyncio.run(run())
        assert coordinator.state.current.number == 2

    form(server.LARGE_JOB - 1)
    assert frozen == []
    form(server.LARGE_JOB)
    assert frozen == [True]


def test_the_backstop_sweep_looks_at_every_line_once_a_round_a_share_at_a_time():
    coordinator = _coordinator(expected_members=100)
    now = time.monotonic()
    looked: list[list[str]] = []

    class Line:
        def is_closing(self) -> bool:
            return False

    for i in range(100):
        coordinator.state.join(f"m{i}", "n", None, 0, now)
        coordinator._heartbeat_connections[f"m{i}"] = Line()
    coordinator._heartbeat_connections["gone"] = Line()  # a forgotten member's: dropped at a round's start
    coordinator._check_connections = lambda members=None: looked.append(list(members))
    for _ in range(20):
        coordinator._sweep_connections(0.05)
    assert all(len(part) == 5 for part in looked)  # a twentieth each time, never all at once
    assert sorted(m for part in looked for m in part) == sorted(f"m{i}" for i in range(100))
    assert "gone" not in coordinator._heartbeat_connections
    coordinator._sweep_connections(0.05)  # the next round starts over
    assert len(looked) == 21 and len(looked[-1]) == 5
