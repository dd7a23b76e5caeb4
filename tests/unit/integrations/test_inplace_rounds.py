"""In-place recovery's rounds without Ray: plain processes over a round store served from this
process (the role Ray Train's controller plays), a rank SIGKILLed and replaced by a new process,
the survivors re-forming the process group with it in the same processes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from gemini_ckpt.integrations import _bounds, _members, _rounds
from rounds_support import WORLD, Job, world


@pytest.mark.multiproc
def test_a_killed_rank_is_replaced_and_the_survivors_form_the_next_round_in_their_own_processes(tmp_path):
    job = Job(tmp_path, "kill@1:8,recv@0:2:8")  # rank 0 blocks on rank 2, a survivor, at the kill
    t0 = time.monotonic()
    codes = job.run()
    assert codes == {0: 0, 1: 0, 2: 0}, job.procs[1].stderr.read().decode()[-2000:] if codes[1] else codes
    assert job.replaced == [1]
    lines = job.lines()
    for rank in (0, 2):  # survivors: one process, two attempts, the second in a newer round
        starts = [x for x in lines[rank] if x["event"] == "start"]
        assert len({x["pid"] for x in lines[rank]}) == 1
        assert [x["attempt"] for x in starts] == [1, 2]
        assert starts[1]["round"] > starts[0]["round"]
    done = [x for r in range(WORLD) for x in lines[r] if x["event"] == "done"]
    assert len(done) == WORLD and len({x["round"] for x in done}) == 1
    assert {x["counter"] for x in done} == {float(WORLD * 30)}  # the last round ran whole, on every rank
    # rank 0 was blocked in a receive from a live survivor: only the cut of its connections woke it
    blocked = next(x for x in lines[0] if x["event"] == "blocked")
    second = [x for x in lines[0] if x["event"] == "start"][1]
    assert second["t"] - blocked["t"] < 30, "rank 0 waited for its group's timeout instead of being cut free"
    assert time.monotonic() - t0 < 90


@pytest.mark.multiproc
def test_a_replaced_workers_zombie_is_refused_and_its_replacement_trains_as_its_rank(tmp_path):
    """Rank 1 stops (SIGSTOP) at step 8; the controller replaces it without ending its process,
    and it runs again 0.3 s later, while its replacement still starts: it is not counted in the
    next round in its replacement's place (the incarnation is not a member), it ends at once
    with SUPERSEDED_EXIT, and the replacement trains as rank 1 to the end with the survivors."""
    from gemini_ckpt.integrations._inplace_worker import SUPERSEDED_EXIT

    job = Job(tmp_path, "stop@1:8")
    zombie = job.replace_hung(1, resume_after_s=0.3)
    assert zombie.wait(timeout=60) == SUPERSEDED_EXIT, zombie.stderr.read().decode()[-2000:]
    assert b"a newer process took its rank" in zombie.stderr.read()
    codes = job.run()
    assert codes == {0: 0, 1: 0, 2: 0}, {r: p.stderr.read().decode()[-1500:] for r, p in job.procs.items()}
    lines = job.lines()
    assert [x["event"] for x in lines[1] if x["pid"] == zombie.pid] == ["start", "stop", "resumed"]
    done = [x for r in range(WORLD) for x in lines[r] if x["event"] == "done"]
    assert len(done) == WORLD and len({x["round"] for x in done}) == 1
    assert {x["pid"] for x in lines[1] if x["event"] == "done"} == {job.procs[1].pid} != {zombie.pid}
    assert {x["counter"] for x in done} == {float(WORLD * 30)}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.ci  # ~10 s of waiting for the grace: run after the default suite
def test_survivors_whose_checkpointing_failed_first_wait_for_the_failed_peer_to_be_found(tmp_path):
    # A host's loss reaches the survivors first as a version that did not commit (their copies to
    # it failed), before any collective names the peer, and before the controller finds the dead
    # worker. They must not end with that error: Ray Train would replace the survivors and fail
    # the run on the dead worker it had not found yet.
    job = Job(tmp_path, "kill@1:8,fail@0:8,fail@2:8", notice_s=1.5)
    codes = job.run()
    assert codes == {0: 0, 1: 0, 2: 0}, {r: p.stderr.read().decode()[-1500:] for r, p in job.procs.items()}
    assert job.replaced == [1]
    lines = job.lines()
    for rank in (0, 2):
        assert len({x["pid"] for x in lines[rank]}) == 1  # the survivor kept its process
        failed = next(x for x in lines[rank] if x["event"] == "fail")
        second = [x for x in lines[rank] if x["event"] == "start"][1]
        assert second["t"] - failed["t"] >= 1.0  # it waited for the controller to find rank 1 dead
    assert {x["counter"] for r in range(WORLD) for x in lines[r] if x["event"] == "done"} == {float(WORLD * 30)}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.ci  # ~10 s of waiting for the grace: run after the default suite
def test_a_checkpointing_error_with_no_failed_peer_ends_the_rank_after_the_grace(tmp_path):
    job = Job(tmp_path, "fail@2:3", reform_s=4.0, grace_s=2.0)
    codes = job.run()
    assert codes[2] != 0 and b"BackgroundError" in job.procs[2].stderr.read()
    lines = job.lines()
    assert len([x for x in lines[2] if x["event"] == "start"]) == 1  # not run again
    assert "rank 2: BackgroundError" in _rounds.escaped(job.store)


@pytest.mark.multiproc
def test_an_error_of_the_users_code_is_not_recovered_in_place(tmp_path):
    job = Job(tmp_path, "raise@2", reform_s=4.0)
    codes = job.run()
    assert codes[2] != 0 and b"ValueError: the user's code fails here" in job.procs[2].stderr.read()
    assert "rank 2: ValueError: the user's code fails here" in _rounds.escaped(job.store)
    # the round store is open to its network: the text is there encrypted, never in the clear
    assert b"fails here" not in b"".join(job.store.raw.get(k) for k in job.store.raw.list_keys())
    # the others lose their peer: they recover (a new round is asked for), and since no worker
    # comes back in its place, they end when the round does not form in time
    assert codes[0] != 0 and codes[1] != 0
    for rank in (0, 1):
        assert b"RoundTimeoutError" in job.procs[rank].stderr.read()


@pytest.mark.multiproc
def test_an_error_that_reads_like_a_peers_failure_and_repeats_ends_the_run_after_bounded_tries(tmp_path):
    """Rank 1 raises ``TimeoutError("timed out")`` at step 3 of every attempt: it reads like a
    peer's failure, so every rank recovers in place (no worker is started, so the controller's
    count of starts never sees it), but no newer version is committed between the recoveries: after
    ``max_stuck`` of them every rank gives up with the error (``max_stuck`` + 1 attempts), and the
    round store says why, so the controller ends the run at the next start."""
    job = Job(tmp_path, "timeout@1", reform_s=20.0, max_stuck=2)
    codes = job.run()
    assert all(code != 0 for code in codes.values()), codes
    lines = job.lines()
    for rank in range(WORLD):
        attempts = [x for x in lines[rank] if x["event"] == "start"]
        assert len(attempts) <= 3 and len({x["pid"] for x in lines[rank]}) == 1, (rank, attempts)
    why = _rounds.gave_up(job.store)
    assert "2 in-place recoveries in a row ended without a newer version committed" in why, why
    assert b"TimeoutError: timed out" in job.procs[1].stderr.read()
    controller = _bounds.Attempts(max_stuck=2, max_starts=9)
    controller.start(job.store)  # the first group
    assert controller.start(job.store) == why  # the run ends at the next start of workers


@pytest.mark.multiproc
def test_a_rank_that_fails_after_the_others_finished_ends_the_run_at_its_replacement(tmp_path):
    """Ranks 0 and 2 return; rank 1 then raises (its last ``close()``, say). No round can form with
    the finished ones again: the controller ends the run at the replacement's start, with rank 1's
    error, rather than starting replacements that wait for a round that never forms (12 starts
    and 84 s here before, ~40 minutes at the defaults with 4 workers)."""
    job = Job(tmp_path, "end@1", reform_s=4.0)
    controller = _bounds.Attempts(max_stuck=3, max_starts=9)
    assert controller.start(job.store) is None  # the first group
    codes = job.run()
    assert codes == {0: 0, 1: 1, 2: 0}, (codes, job.procs[1].stderr.read())
    why = controller.start(job.store, replacing=True)
    assert why is not None and "2 worker(s) of this run already finished" in why, why
    assert "rank 1: ValueError: the user's code fails after the last step" in why, why
    # Ray Train's restart of the whole group (or a resize) starts workers none of which finished
    _rounds.new_group(job.store)
    assert controller.start(job.store, replacing=True) is None


def test_rounds_decide_once_who_forms_and_who_moves_on():
    from concurrent.futures import ThreadPoolExecutor

    store = _rounds.server("127.0.0.1", timeout_s=10)
    port = store.port
    assert _rounds.open_round(store, world(a=0)) == 1
    assert _rounds.arrive(store, 1, token="a", patience_s=5) == (1, world(a=0))
    _rounds.open_round(store, world(a=0, b=1))  # round 2, for a replacement; round 1 was closed and stays closed
    assert _rounds.arrive(store, 1, token="a", patience_s=5)[0] == 1

    def arrive(round_: int, token: str) -> int:
        client = _rounds.client("127.0.0.1", port, timeout_s=10, secret=store.secret)
        return _rounds.arrive(client, round_, token=token, patience_s=10)[0]

    # a survivor waits at round 2 for b, which never comes; b's replacement c is asked round 3:
    # round 2 is abandoned (nobody completed it) and both meet in round 3
    with ThreadPoolExecutor(2) as pool:
        survivor = pool.submit(arrive, 2, "a")
        time.sleep(0.2)
        newcomer = pool.submit(arrive, _rounds.open_round(store, world(a=0, c=1)), "c")
        assert (survivor.result(), newcomer.result()) == (3, 3)
    assert store.read(_rounds.PREFIX + "r2/state") == "abandoned"
    assert store.read(_rounds.PREFIX + "r3/state").startswith("closed ")
    _rounds.open_round(store, world(a=0, d=1))
    with pytest.raises(_rounds.RoundTimeoutError, match="1 of 2 ranks arrived at round 4"):
        _rounds.arrive(store, 4, token="a", patience_s=0.3)
    _rounds.raise_latest(store, 5)  # a round asked for by a survivor: round 4's members
    with pytest.raises(_rounds.RoundTimeoutError, match="1 of 2 ranks arrived at round 5"):
        _rounds.arrive(store, 5, token="a", patience_s=0.3)
    _rounds.revoke(store, "d")  # the controller ended d (replaced): it joins no round again
    with pytest.raises(_members.SupersededError, match="incarnation d was replaced"):
        _rounds.arrive(store, 5, token="d", patience_s=0.3)


# A rank of the test below: ``python -c FORM_ONE PORT RANK ROUND MODE``. MODE "arrive" arrives at
# the round and exits before forming it (a worker that died while the round formed); "form" forms
# it (giving up to the next round when it fails to form), then forms the next one with whoever comes.
FORM_ONE = """
import sys, torch.distributed as dist
from gemini_ckpt.integrations import _rounds
port, token, round_, mode, secret = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
_rounds.FORM_S = 2.0
store = _rounds.client("127.0.0.1", port, timeout_s=30, secret=secret)
if mode == "arrive":
    _rounds.arrive(store, round_, token=token, patience_s=30)
    sys.exit(0)
n, _ = _rounds.form(store, round_, token=token, backend="gloo", timeout_s=10, patience_s=30)
print(n, dist.distributed_c10d._get_default_group().group_name, flush=True)
"""


@pytest.mark.multiproc
def test_a_rank_whose_round_failed_to_form_meets_the_others_in_the_next_one(tmp_path):
    """Rank 1 dies after round 1 closed, so rank 0's group of round 1 fails to form; rank 1's
    replacement (a new process) and rank 0 meet in round 2 under the same group name, which torch
    counts per process (a failed ``init_process_group`` left rank 0's count one higher)."""
    store = _rounds.server("127.0.0.1", timeout_s=30)

    def rank(token: str, round_: int, mode: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", FORM_ONE, str(store.port), token, str(round_), mode, store.secret],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    survivor = rank("s", _rounds.open_round(store, world(s=0, d=1)), "form")
    dying = rank("d", 1, "arrive")
    assert dying.wait(timeout=60) == 0
    deadline = time.monotonic() + 60
    while _rounds.latest(store) < 2:  # the survivor gave round 1 up (after FORM_S) and asked for round 2
        assert time.monotonic() < deadline and survivor.poll() is None, survivor.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    replacement = rank("r", _rounds.open_round(store, world(s=0, r=1)), "form")  # round 3
    outs = [p.communicate(timeout=60) for p in (survivor, replacement)]
    assert [p.returncode for p in (survivor, replacement)] == [0, 0], [e.decode()[-2000:] for _, e in outs]
    assert [o.decode().split() for o, _ in outs] == [["3", "0"], ["3", "0"]]  # round 3, group "0" on both


def test_a_waiting_rank_is_patient_while_workers_keep_being_started():
    """Ray Train starts the replacements of several workers one after another: each start asks for
    a new round, and the wait for a round starts again with it."""
    import threading

    store = _rounds.server("127.0.0.1", timeout_s=10)
    port = store.port
    stop = threading.Event()

    def starts() -> None:  # a start every 0.3 s for 1.5 s: longer than the patience, never a gap as long
        client = _rounds.client("127.0.0.1", port, timeout_s=10, secret=store.secret)
        for _ in range(5):
            if stop.wait(0.3):
                return
            _rounds.open_round(client, world(a=0, b=1))

    thread = threading.Thread(target=starts)
    t0 = time.monotonic()
    thread.start()
    with pytest.raises(_rounds.RoundTimeoutError, match="no worker was started for 1s"):
        _rounds.arrive(store, _rounds.open_round(store, world(a=0, b=1)), token="a", patience_s=1.0)
    waited = time.monotonic() - t0
    stop.set()
    thread.join()
    assert 2.0 < waited < 5.0  # the last start at ~1.5 s, then 1 s of patience


def test_the_controller_ends_a_run_whose_recoveries_make_no_progress():
    store = _rounds.server("127.0.0.1", timeout_s=10)
    attempts = _bounds.Attempts(max_stuck=2, max_starts=3)
    assert attempts.start(store) is None  # the first group
    for round_, step in ((1, 10), (2, 20)):  # two recoveries, each after progress
        store.put(_rounds.PREFIX + "formed", str(round_))
        _rounds.note_progress(store, step)
        assert attempts.start(store) is None
    _rounds.note_escaped(store, "rank 3: ValueError: boom")
    store.put(_rounds.PREFIX + "formed", "3")  # formed again, and failed again at step 20
    assert attempts.start(store) is None
    store.put(_rounds.PREFIX + "formed", "4")
    why = attempts.start(store)
    assert why is not None and "2 recoveries in a row" in why and "step 20" in why and "ValueError: boom" in why
    # a worker that never comes back: starts without a round forming
    attempts = _bounds.Attempts(max_stuck=5, max_starts=3)
    attempts.start(store)
    outcomes = [attempts.start(store) for _ in range(4)]
    assert outcomes[:3] == [None, None, None] and "4 workers were started" in outcomes[3]
