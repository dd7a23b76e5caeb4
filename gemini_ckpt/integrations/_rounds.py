"""The rounds of an in-place recovery: how the ranks of a job form their process group again,
with a new worker in a failed one's place, over a ``torch.distributed`` store no worker owns.

Every process group the job forms is one *round*, numbered from 1. The keys, under ``PREFIX``:

- ``latest``: the newest round anyone has asked for. Ray Train's controller opens a round each time
  it starts workers (the first group, a full restart, or one replacement) or renumbers them (a
  lost host not replaced: an elastic shrink), and gives new workers that number; it also asks for
  the round after the newest formed one as soon as it shuts a failed worker down
  (:func:`worker_failed`); a survivor of round ``n`` asks for ``n + 1``.
- ``r{n}/members``: the round's membership (:mod:`._members`), written by the controller when it
  opens the round: the world size and each current incarnation's rank. A round asked for by a
  survivor or at a worker's failure has none of its own: its members are the newest round's the
  controller wrote (``members_round``), so a round formed again with the same processes (a
  transient fault) needs no controller; ``revoked/{token}``: an incarnation the controller ended
  (a failed worker replaced or dropped), which joins no round again and completes none.
- ``r{n}/in/{token}``: the incarnations that arrived at round ``n``; the round closes when every
  member has arrived, none revoked, and no newer round was asked for meanwhile (whoever sees a
  newer one moves there, so every rank ends in the newest round: a second failure during a reform
  only moves everyone one round on). ``r{n}/state`` holds the verdict, with the membership the
  round closed under. An incarnation that is not a member of a round the controller opened (a
  replaced worker's zombie) is refused (:class:`._members.SupersededError`).
- ``r{n}/pg/``: the prefix the round's process group rendezvouses under, so nothing of an older
  round (a late message, a zombie's key) can mix into it.
- ``r{n}/listeners/{rank}``: where the rank's process groups of round ``n`` listen, so that the
  others can cut their connections to it when the round ends (:mod:`._sever`).
- ``formed``: the newest round that formed; ``progress``: the newest version committed in
  memory (written by rank 0 of each round); ``escaped``: the last error that ended a worker
  (encrypted, as ``gave_up`` is: the store is open to its network and errors carry data).

The controller reads ``formed`` and ``progress`` to tell a recovery that helps from one that
fails again at the same place (:class:`Attempts`).

Every value above is sealed with the run's secret (:mod:`._round_store`): one this run did not
write reads as absent, so a stranger who reaches the store's port starts no recovery and is
counted in no round.

Pure ``torch.distributed``: no Ray here, so the protocol runs in plain processes in tests.
"""

from __future__ import annotations

import os
import secrets
import time
from datetime import timedelta
from typing import Optional

from ..errors import RoundTimeoutError
from ._members import GRACE_S, Membership, SupersededError
from ._round_store import RoundStore, client, server

__all__ = ["GRACE_S", "Membership", "RoundStore", "SupersededError", "client", "server"]  # the rounds' terms

PREFIX = "gemini/rounds/"
POLL_S, POLL_MAX_S = 0.02, 0.1  # a rank waiting at a round looks this often, slower as the wait goes on
FORM_S = 20.0  # how long a closed round waits for its members to connect before it is given up
MAX_FORM_FAILURES = 8  # rounds in a row that closed and failed to form before a rank gives up


def _int(store: RoundStore, key: str, default: int = -1) -> int:
    """A number set as text; ``default`` when absent (or not sealed by this run)."""
    return store.read_int(PREFIX + key, default)


def latest(store: RoundStore) -> int:
    return store.counter(PREFIX + "latest")


def new_token(store: RoundStore) -> str:
    """A new incarnation's token (the controller, once per worker process it starts): drawn, so
    that no write to the store can make the controller hand out a revoked one again."""
    return f"i{secrets.token_hex(6)}"


def open_round(store, members: Membership) -> int:
    """Open a new round with ``members`` (the controller, at each start or renumbering of
    workers); returns its number."""
    text = members.to_text()
    n = store.add(PREFIX + "latest", 1)
    for _ in range(1000):  # a round in use already (``latest`` spoiled by a stranger): the next one
        if not (store.has(f"{PREFIX}r{n}/state") or store.has(f"{PREFIX}r{n}/members")):
            break
        n = store.add(PREFIX + "latest", 1)
    store.put(f"{PREFIX}r{n}/members", text)
    store.put(PREFIX + "members_round", str(n))  # the controller's alone: it only grows
    return n


def membership(store, round_: int) -> Optional[Membership]:
    """Round ``round_``'s membership, None while it has none."""
    text = store.read(f"{PREFIX}r{round_}/members")
    return None if text is None else Membership.from_text(text)


def raise_latest(store, at_least: int) -> int:
    """Make ``latest`` at least ``at_least`` (race-free); returns it."""
    return store.raise_to(PREFIX + "latest", at_least)


def worker_failed(store) -> int:
    """The controller found a worker failed: ask for the round after the newest formed one now,
    before its replacement starts. Every survivor then ends its attempt (its watcher cuts the
    round's connections), including one whose own symptom of the loss came first and did not
    name a peer (see ``GRACE_S``). Returns ``latest``."""
    return raise_latest(store, formed(store) + 1)


def formed(store) -> int:
    return store.counter(PREFIX + "formed", -1)  # only grows (rank 0 raises it to each round it forms)


def progress(store) -> int:
    return _int(store, "progress")


def note_progress(store, step: int) -> None:
    store.put(PREFIX + "progress", str(int(step)))


def gave_up(store) -> str:
    """Why the ranks gave in-place recovery up (:func:`note_gave_up`), "" while they have not."""
    return store.read_private(PREFIX + "gave_up") or ""


def note_gave_up(store, why: str) -> None:
    store.put_private(PREFIX + "gave_up", why[:2000])


def escaped(store) -> str:
    return store.read_private(PREFIX + "escaped") or ""


def note_escaped(store, what: str) -> None:
    store.put_private(PREFIX + "escaped", what[:2000])


def note_finished(store) -> None:
    """This worker's training function returned: it is done with the run, and no round forms
    with it again."""
    store.add(PREFIX + "finished", 1)  # sealed: compare-and-set on the value, not the store's add


def finished(store) -> int:
    """How many workers of the current group finished (:func:`note_finished`)."""
    return _int(store, "finished", 0)


def new_group(store) -> None:
    """A whole new group of workers starts (the run's first, or Ray Train's restart or resize):
    none of them finished yet."""
    store.put(PREFIX + "finished", "0")


def publish_listeners(store, round_: int, rank: int, addresses: list[tuple[str, int]]) -> None:
    """Where this rank's process groups of ``round_`` listen (see :mod:`._sever`)."""
    store.put(f"{PREFIX}r{round_}/listeners/{rank}", ";".join(f"{ip}|{port}" for ip, port in addresses))


def peer_listeners(store, round_: int, *, rank: int, world_size: int) -> list[tuple[str, int]]:
    """What the other ranks published with :func:`publish_listeners` for ``round_``."""
    out = []
    for peer in range(world_size):
        text = None if peer == rank else store.read(f"{PREFIX}r{round_}/listeners/{peer}")
        for item in (text or "").split(";"):
            if item:
                ip, port = item.rsplit("|", 1)
                out.append((ip, int(port)))
    return out


def arrive(store, round_: int, *, token: str, patience_s: float) -> tuple[int, Membership]:
    """Arrive at ``round_`` (or a newer one asked for meanwhile) as incarnation ``token`` and wait
    until every member of the same round arrived; returns (the round, its membership). Raises
    :class:`RoundTimeoutError` after ``patience_s`` without a newer round asked for (each start
    of a worker asks for one, so the ranks wait as long as workers keep being started, one after
    another), :class:`SupersededError` when ``token`` was revoked or is not a member of the round
    it reaches.

    A round's members are the ones the controller wrote for it, or else those of the newest round
    it wrote them for (a round a survivor asked for: the same incarnations, the revoked ones
    excepted, who can then never complete it). A round is decided once, by ``compare_set`` on
    ``r{n}/state``: the rank whose arrival completes it closes it, with the membership it was
    completed under (then every rank that arrived must form it), a rank that sees a newer round
    asked for first abandons it (then every rank moves on). So no rank forms a round another rank
    left, and all form it with the same ranks."""
    n = round_
    raise_latest(store, n)
    deadline = time.monotonic() + patience_s
    pause = POLL_S  # each look costs ~6 requests to the one round store: 1,024 ranks waiting ~60k/s at most
    while True:
        state_key = f"{PREFIX}r{n}/state"
        arrived = False
        while True:
            if revoked(store, token):
                raise SupersededError(f"incarnation {token} was replaced: a newer process took its rank")
            state = store.read(state_key) or ""
            members, explicit = (None, False) if state else membership_of(store, n)
            if members is not None:
                if explicit and token not in members.members:
                    members.of(token)  # raises: a round the controller opened without it
                if not arrived and token in members.members:
                    store.put(f"{PREFIX}r{n}/in/{token}", "1")
                    arrived = True
                if arrived and _complete(store, n, members):
                    state = store.decide(state_key, "closed " + members.to_text()) or ""
            if not state and latest(store) > n:
                state = store.decide(state_key, "abandoned") or ""
            if state.startswith("closed "):
                closed = Membership.from_text(state[len("closed ") :])
                closed.of(token)  # raises if it closed without this incarnation
                return n, closed
            if state == "abandoned":
                n = raise_latest(store, n + 1)
                deadline = time.monotonic() + patience_s
                break
            if time.monotonic() > deadline:
                raise RoundTimeoutError(
                    _waited(store, n, members)
                    + f", and no worker was started for {patience_s:.0f}s: the others did not come back"
                )
            time.sleep(pause)
            pause = min(POLL_MAX_S, pause * 1.25)


def _complete(store, n: int, members: Membership) -> bool:
    """Every member arrived at round ``n``, none of them revoked."""
    if not store.all_present([f"{PREFIX}r{n}/in/{t}" for t in members.members]):
        return False
    return not any(revoked(store, t) for t in members.members)


def membership_of(store, round_: int) -> tuple[Optional[Membership], bool]:
    """Round ``round_``'s members and whether they were written for it: else the newest written
    for an earlier round (None before any)."""
    explicit = membership(store, round_)
    if explicit is not None:
        return explicit, True
    newest = _int(store, "members_round")
    return (membership(store, newest) if 0 < newest <= round_ else None), False


def revoke(store, token: str) -> None:
    """The controller ended incarnation ``token`` (a failed worker replaced or dropped): it may
    join no round any more, and no round waits for it once another rank sees it revoked."""
    store.put(f"{PREFIX}revoked/{token}", "1")


def revoked(store, token: str) -> bool:
    return store.read(f"{PREFIX}revoked/{token}") is not None


def _waited(store, n: int, members: Optional[Membership]) -> str:
    if members is None:
        return f"round {n} of the process group got no members"
    count = sum(1 for t in members.members if store.read(f"{PREFIX}r{n}/in/{t}") is not None)
    return f"{count} of {members.world_size} ranks arrived at round {n} of the process group"


def form(
    store, round_: int, *, token: str, backend: str, timeout_s: float, patience_s: float
) -> tuple[int, Membership]:
    """Arrive and form the process group of the newest round (``torch.distributed``'s default
    group, under that round's prefix, at this incarnation's rank in it); returns (the round, its
    membership). A round that fails to form (a rank died while it formed) is given up for the
    next one."""
    import torch.distributed as dist

    if "nccl" in backend:
        # NCCL's watchdog must abort the communicator on an error, not end the process (Ray's own
        # backend sets 1, which kills a survivor whose peer died); the user's setting wins
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    n = round_
    failures = 0
    while True:
        n, members = arrive(store, n, token=token, patience_s=patience_s)
        me, world_size = members.of(token), members.world_size
        prefixed = dist.PrefixStore(f"{PREFIX}r{n}/pg/", store.raw)
        try:
            # Formed with a short timeout: a rank that died after the round closed is waited for
            # FORM_S, not the collectives' timeout; then the group gets its own.
            dist.init_process_group(
                backend,
                store=prefixed,
                rank=me.rank,
                world_size=world_size,
                timeout=timedelta(seconds=min(FORM_S, timeout_s)),
            )
            from torch.distributed.distributed_c10d import _set_pg_timeout

            _set_pg_timeout(timedelta(seconds=timeout_s))
            check = _check_tensor(backend, n)
            dist.all_reduce(check)
            if int(check.item()) != n * world_size or latest(store) != n:
                raise RuntimeError(f"round {n} formed with ranks of another round")
        except Exception:  # noqa: BLE001 - a member died while the round formed: the next round
            destroy()
            failures += 1
            if failures > MAX_FORM_FAILURES:
                raise
            n = raise_latest(store, n + 1)
            continue
        if me.rank == 0:
            store.raise_to(PREFIX + "formed", n)
        return n, members


def _check_tensor(backend: str, n: int):
    import torch

    device = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    return torch.tensor([n], dtype=torch.int64, device=device)


def destroy() -> None:
    """Take down every process group of this process (the default one and its subgroups), and
    start torch's count of groups from 0 again.

    Torch names an unnamed group by that count, and a group's members meet under its name. Only a
    clean ``destroy_process_group()`` resets it: an ``init_process_group`` that failed (a member
    died while the round formed) leaves it one higher, and that rank's every later group would
    rendezvous under a name no other rank uses (each round after it times out, one after another)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group whose peers are gone may refuse a clean end
            pass
    if not dist.is_initialized():
        from torch.distributed import distributed_c10d

        distributed_c10d._world.group_count = 0
