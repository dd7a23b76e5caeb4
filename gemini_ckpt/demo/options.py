"""What the demo is asked to do (:class:`DemoOptions`, validated at construction): the
driver, the report and the command line all read it, so it sits below them."""

from __future__ import annotations

import sys
from dataclasses import dataclass


FAULTS = ("host", "process", "hang")
"""``host``: the host's raylet and every process on it die, and a replacement host joins;
``process``: the host's training worker is SIGKILLed; ``hang``: it is SIGSTOPped (found by Ray
Train's health check after ``hang_s``)."""


@dataclass(frozen=True)
class DemoOptions:
    hosts: int = 4
    replicas: int = 2
    kill_host: int = 1
    kill_at_step: int = 34
    steps: int = 60
    persist_every: int = 10
    failure: bool = True
    out: str = "runs"
    network: str = "loopback"
    link: str | None = None
    fault: str = "host"
    in_place: bool = True  # replace only the failed worker; False: Ray Train restarts every worker
    hang_s: float = 10.0
    replacement: bool = True  # --fault host: a replacement host joins; False: none (an elastic run shrinks)
    host_returns_s: float | None = None  # with replacement=False: the lost host joins again this much later
    full_digests: bool = False  # the workers emit digests of the whole state at each save and restore (tests)
    checkpoint: bool = True  # False: the same job without checkpointing (a benchmark's baseline)
    spares: int = 1  # in place: warm spare processes per host (gray.torch_config(spares=...))

    @property
    def elastic(self) -> bool:
        """An elastic run (``ScalingConfig(num_workers=(min, max))``, one rank per host, no pinning)."""
        return not self.replacement

    @property
    def min_workers(self) -> int:
        return max(1, self.hosts // 2)

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"--fault must be one of {', '.join(FAULTS)}, got {self.fault!r}")
        if not self.hang_s > 0:
            raise ValueError(f"--hang-s must be positive, got {self.hang_s}")
        if self.network not in ("loopback", "netns"):
            raise ValueError(f"--network must be loopback or netns, got {self.network!r}")
        if self.link is not None and self.network != "netns":
            raise ValueError("--link shapes each host's own link: it needs --network netns")
        if self.hosts < 1 or not 1 <= self.replicas <= self.hosts:
            raise ValueError(f"--replicas must be between 1 and --hosts ({self.hosts}), got {self.replicas}")
        if not self.replacement and self.fault != "host":
            raise ValueError("--no-replacement is for --fault host (a process or a hang is replaced on its host)")
        if self.host_returns_s is not None and (self.replacement or not self.host_returns_s >= 0):
            raise ValueError("--host-returns S needs --no-replacement and S >= 0")
        if not self.replacement and self.hosts < 2:
            raise ValueError("--no-replacement needs at least 2 hosts (the run goes on with the others)")
        if self.spares < 0:
            raise ValueError(f"spares must be >= 0, got {self.spares}")
        if self.failure and not self.checkpoint:
            raise ValueError("a failure needs checkpointing (checkpoint=False is for runs without one)")
        if self.steps < 2:
            raise ValueError("--steps must be at least 2")
        if self.failure:
            if not 0 <= self.kill_host < self.hosts:
                raise ValueError(f"--kill-host must be between 0 and {self.hosts - 1}, got {self.kill_host}")
            if not 0 <= self.kill_at_step < self.steps - 1:
                raise ValueError(f"--kill-at-step must be between 0 and --steps - 2 ({self.steps - 2})")
            if self.replicas < 2:
                print(
                    "note: with --replicas 1 a dead host's shards have no other copy: the restore "
                    "falls back to durable storage",
                    file=sys.stderr,
                )
