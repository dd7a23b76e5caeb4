"""The attach channel's messages, typed (as the commit protocol's are, :mod:`.commit.messages`):
what a trainer asks its host store, what the store answers, and the outcome it tells of each
version. :mod:`.attach` carries them as JSON headers (``type`` names the message; the
request id rides beside the fields); this module turns a header into a message and back, and
refuses a header whose type is unknown or whose fields are missing or of the wrong kind.

Trainer -> store (each request gets a reply, :class:`Staged` and :class:`GiveBack` none):

- :class:`SendPlan`: payload = an encoded ShardPlan of this rank; reply :class:`Done`;
- :class:`AskSegment`: a free segment for a version of that plan; reply :class:`SegmentLent`
  (with the memfd the first time this connection sees that segment);
- :class:`Staged`, payload = the value blobs: the shard is the store's now; later an
  :class:`VersionOutcome`;
- :class:`GiveBack`: a segment not staged after all;
- :class:`AskComm`: the page this rank marks its collectives in (:mod:`gemini_ckpt.format.commstate`);
  reply :class:`CommPage` + memfd (the store clears the slot when the connection closes);
- :class:`MapShard`: read access to a shard this store holds; reply :class:`ShardMapped` + memfd
  (the shard is pinned until :class:`Unmap` or the connection closes).

The wire stays the same JSON as before these types (attach protocol 3).

Standard library only.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar, Optional, Union


class _Message:
    """A message's wire form: ``{"type": TYPE, field: value, ...}``; :meth:`from_wire` checks
    each field's kind (an int is never a bool, a list holds only ints)."""

    TYPE: ClassVar[str]

    def to_wire(self) -> dict:
        return {"type": self.TYPE, **asdict(self)}

    @classmethod
    def from_wire(cls, header: dict):
        values = {}
        for f in fields(cls):
            if f.name not in header:
                if f.default is not MISSING:
                    continue
                raise ValueError(f"attach message {cls.TYPE!r} has no {f.name!r}")
            values[f.name] = _checked(cls.TYPE, f.name, f.type, header[f.name])
        return cls(**values)


def _checked(kind: str, name: str, annotation: str, value: Any) -> Any:
    ok = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "bool": lambda v: isinstance(v, bool),
        "tuple[int, ...]": lambda v: (
            isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        ),
        "Optional[dict]": lambda v: v is None or isinstance(v, dict),
    }[annotation]
    if not ok(value):
        raise ValueError(f"attach message {kind!r}: {name!r} is not {annotation} ({type(value).__name__})")
    return tuple(value) if annotation.startswith("tuple") else value


# --- trainer -> store ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SendPlan(_Message):
    TYPE = "plan"


@dataclass(frozen=True)
class AskSegment(_Message):
    TYPE = "segment"
    plan_id: str


@dataclass(frozen=True)
class GiveBack(_Message):
    TYPE = "give_back"
    seg: int


@dataclass(frozen=True)
class Staged(_Message):
    """``lengths``: the value blobs' sizes, in the payload one after another; ``verdict``: the
    trainer's health verdict (``Health.to_json``; None: no checks)."""

    TYPE = "staged"
    step: int
    plan_id: str
    seg: int
    persist: bool = False
    lengths: tuple[int, ...] = ()
    verdict: Optional[dict] = None


@dataclass(frozen=True)
class AskComm(_Message):
    TYPE = "comm"


@dataclass(frozen=True)
class MapShard(_Message):
    TYPE = "map"
    step: int
    rank: int


@dataclass(frozen=True)
class Unmap(_Message):
    TYPE = "unmap"
    seg: int


Request = Union[SendPlan, AskSegment, GiveBack, Staged, AskComm, MapShard, Unmap]
REQUESTS: dict[str, type] = {
    cls.TYPE: cls for cls in (SendPlan, AskSegment, GiveBack, Staged, AskComm, MapShard, Unmap)
}


def request_from_wire(header: dict) -> Request:
    """The request a trainer's header carries; ValueError when it is none of them or malformed."""
    cls = REQUESTS.get(header.get("type"))
    if cls is None:
        raise ValueError(f"unknown attach message {header.get('type')!r}")
    return cls.from_wire(header)


# --- store -> trainer ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Done(_Message):
    TYPE = "done"


@dataclass(frozen=True)
class SegmentLent(_Message):
    """``forget``: segments this store freed since it last lent one (the trainer unmaps them)."""

    TYPE = "segment_lent"
    seg: int
    nbytes: int
    forget: tuple[int, ...] = ()


@dataclass(frozen=True)
class CommPage(_Message):
    TYPE = "comm_page"
    slot: int
    nbytes: int


@dataclass(frozen=True)
class ShardMapped(_Message):
    TYPE = "mapped"
    seg: int
    nbytes: int


@dataclass(frozen=True)
class VersionOutcome(_Message):
    """A version's fate at this store (request id 0: unasked). ``unhealthy``: why (empty: not);
    ``checked``: every shard of the version carries a verdict (the trainer counts a version
    without as unchecked, never healthy)."""

    TYPE = "outcome"
    step: int
    committed: bool
    reason: str = ""
    unhealthy: str = ""
    checked: bool = False
