"""Shards in memory: their plan and their per-version record. No torch.

A **shard** is one rank's part of a version, kept raw: every tensor item's bytes at a fixed,
64-byte aligned offset of one *region* (a :class:`~gemini_ckpt.format.segments.Segment`), and every non-tensor item a small
blob. Its layout is the rank's :class:`ShardPlan`, made once by the trainer (with DCP's
planner, :mod:`gemini_ckpt.save.plan`) and reused by every version until the structure of the
state changes. Each version of a shard adds a :class:`ShardRecord`: which version, the blobs,
and a CRC32C of every item, computed by the store that took the shard from its rank.

A plan also names the tensor items the health check reads (``checked``: decided by the
trainer, which knows parameters from buffers, see :mod:`gemini_ckpt.health`); a record carries
the shard's health verdict, found by the same pass that checksums it (:mod:`.finite`).

Both travel as checked bytes (:meth:`ShardPlan.encode`, :meth:`ShardRecord.encode`): JSON
(never a pickle) whose canonical encoding carries a CRC32C of everything else, and, with a
signing key, an HMAC-SHA256 over it. The plan of rank 0 also carries the pickled skeleton of
DCP's global ``Metadata`` (checked by its CRC32C here, decoded through the allow-list by the
trainer that reads it).

This module imports only the standard library, numpy and the checksum: host-store actors use it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import numpy as np

from ..checksum import checksum
from ..errors import ShardFormatError
from ..signing import canonical, mac, mac_matches
from ..health import HEALTHY_VERDICT, UNHEALTHY, Health
from .framing import Template
from .finite import CHECKED_DTYPES, checksum_items

ALIGN = 64  # tensor items start at multiples of this in a region
PLAN_MAGIC = b"GEMINI-PLAN\x00v001"
RECORD_MAGIC = b"GEMINI-SHARD\x00v01"
_LEN = struct.Struct("<Q")
_MAX_JSON = 1 << 30
_SIGN_PLAN = b"gemini_ckpt shard plan hmac-sha256 v1\x00"
_SIGN_RECORD = b"gemini_ckpt shard record hmac-sha256 v1\x00"
VALUE_KINDS = ("bytes", "pickle")
"""How a non-tensor item's blob encodes its value: ``bytes`` (the value *is* these bytes:
TrainState's opaque blobs) or ``pickle`` (``pickle.dumps`` of the value, decoded through the
value allow-list)."""


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# --- the plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorItem:
    """One tensor item: DCP's ``MetadataIndex`` (``fqn``, ``chunk`` offsets, chunk ``index``),
    its dtype (torch's name without ``torch.``) and shape, and where its ``nbytes`` lie."""

    fqn: str
    chunk: Optional[tuple[int, ...]]
    index: Optional[int]
    dtype: str
    shape: tuple[int, ...]
    at: int
    nbytes: int
    template: int  # index into ShardPlan.templates


@dataclass(frozen=True)
class ValueItem:
    """One non-tensor item (DCP's ``BYTE_IO``): ``fqn`` and how its blob encodes it."""

    fqn: str
    index: Optional[int]
    kind: str


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank``'s layout under plan ``plan_id`` (the same id on every rank of a plan)."""

    plan_id: str
    rank: int
    world_size: int
    tensors: tuple[TensorItem, ...]
    values: tuple[ValueItem, ...]
    templates: tuple[Template, ...]
    metadata: bytes = b""  # rank 0: the pickled DCP Metadata skeleton; others: empty
    job: dict = field(default_factory=dict)
    checked: tuple[int, ...] = ()  # tensor items (indices) the health check reads: finite values only
    signature: str = ""  # digest of what the plan depends on (the live state's structure); "" unknown

    def __post_init__(self) -> None:
        object.__setattr__(self, "_region", max((align(t.at + t.nbytes) for t in self.tensors), default=0))

    @property
    def region_bytes(self) -> int:
        return self._region  # type: ignore[attr-defined]

    def fields(self) -> dict:
        return {
            "plan_id": self.plan_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "tensors": [
                [
                    t.fqn,
                    None if t.chunk is None else list(t.chunk),
                    t.index,
                    t.dtype,
                    list(t.shape),
                    t.at,
                    t.nbytes,
                    t.template,
                ]
                for t in self.tensors
            ],
            "values": [[v.fqn, v.index, v.kind] for v in self.values],
            "templates": [t.to_json() for t in self.templates],
            "metadata_bytes": len(self.metadata),
            "metadata_crc": checksum(self.metadata),
            "job": self.job,
            "checked": list(self.checked),
            "signature": self.signature,
        }

    def encode(self, key: Optional[bytes] = None) -> bytes:
        body = self.fields()
        payload = canonical(body)
        head = {"plan": body, "crc": checksum(payload)}
        if key is not None:
            head["signature"] = mac(key, _SIGN_PLAN, payload)
        text = canonical(head)
        return PLAN_MAGIC + _LEN.pack(len(text)) + text + self.metadata

    @classmethod
    def decode(cls, data: Any, key: Optional[bytes] = None) -> "ShardPlan":
        head, rest = _unframe(data, PLAN_MAGIC, "shard plan")
        try:
            body = head["plan"]
            payload = canonical(body)
            _check_crc_and_signature(head, payload, key, _SIGN_PLAN, "shard plan")
            metadata = bytes(rest)
            if len(metadata) != _nat(body["metadata_bytes"]) or checksum(metadata) != body["metadata_crc"]:
                raise ShardFormatError("the shard plan's metadata fails its checksum")
            templates = tuple(Template.from_json(t) for t in body["templates"])
            tensors = tuple(_tensor_item(row, len(templates)) for row in body["tensors"])
            values = tuple(_value_item(row) for row in body["values"])
            checked = tuple(_nat(i) for i in body.get("checked", ()))
            plan = cls(
                plan_id=_text(body["plan_id"]),
                rank=_nat(body["rank"]),
                world_size=_nat(body["world_size"]),
                tensors=tensors,
                values=values,
                templates=templates,
                metadata=metadata,
                job=_dict(body["job"]),
                checked=checked,
                signature=_text(body.get("signature", "")),
            )
        except ShardFormatError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ShardFormatError(f"malformed shard plan ({type(exc).__name__}: {exc})") from None
        if plan.rank >= plan.world_size:
            raise ShardFormatError(f"shard plan of rank {plan.rank} in a world of {plan.world_size}")
        end = 0
        for t in sorted(tensors, key=lambda t: t.at):
            if t.at < end or t.at % ALIGN:
                raise ShardFormatError(f"tensor item {t.fqn} overlaps another or is not aligned")
            if templates[t.template].nbytes != t.nbytes:
                raise ShardFormatError(f"tensor item {t.fqn} does not match its template's size")
            end = t.at + t.nbytes
        if len(set(plan.checked)) != len(plan.checked) or any(
            i >= len(tensors) or tensors[i].dtype not in CHECKED_DTYPES for i in plan.checked
        ):
            raise ShardFormatError("the shard plan's checked items are not distinct floating-point tensor items")
        return plan


def _tensor_item(row: Any, n_templates: int) -> TensorItem:
    fqn, chunk, index, dtype, shape, at, nbytes, template = row
    if not 0 <= _nat(template) < n_templates:
        raise ShardFormatError(f"tensor item {fqn!r} names template {template} of {n_templates}")
    return TensorItem(
        _text(fqn),
        None if chunk is None else tuple(_nat(c) for c in chunk),
        None if index is None else _nat(index),
        _text(dtype),
        tuple(_nat(s) for s in shape),
        _nat(at),
        _nat(nbytes),
        template,
    )


def _value_item(row: Any) -> ValueItem:
    fqn, index, kind = row
    if kind not in VALUE_KINDS:
        raise ShardFormatError(f"value item {fqn!r} has unknown kind {kind!r}")
    return ValueItem(_text(fqn), None if index is None else _nat(index), kind)


# --- one version of a shard ---------------------------------------------------------------------
@dataclass(frozen=True)
class ShardRecord:
    """Rank ``rank``'s shard of version ``(epoch, step)``: the blob of every value item, a
    CRC32C of every item (tensor items over their raw bytes, in plan order) and the shard's
    health verdict (None: not checked)."""

    epoch: int
    step: int
    rank: int
    world_size: int
    plan_id: str
    crcs: tuple[int, ...]
    values: tuple[bytes, ...]
    value_crcs: tuple[int, ...] = ()
    health: Optional[Health] = None

    def fields(self) -> dict:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "plan_id": self.plan_id,
            "crcs": list(self.crcs),
            "value_lengths": [len(v) for v in self.values],
            "value_crcs": list(self.value_crcs),
            "health": None if self.health is None else self.health.to_json(),
        }

    def encode(self, key: Optional[bytes] = None) -> bytes:
        body = self.fields()
        payload = canonical(body)
        head = {"record": body, "crc": checksum(payload)}
        if key is not None:
            head["signature"] = mac(key, _SIGN_RECORD, payload)
        text = canonical(head)
        return RECORD_MAGIC + _LEN.pack(len(text)) + text + b"".join(self.values)

    @classmethod
    def decode(cls, data: Any, key: Optional[bytes] = None) -> "ShardRecord":
        head, rest = _unframe(data, RECORD_MAGIC, "shard record")
        try:
            body = head["record"]
            _check_crc_and_signature(head, canonical(body), key, _SIGN_RECORD, "shard record")
            lengths = [_nat(n) for n in body["value_lengths"]]
            crcs = tuple(_nat(c) for c in body["value_crcs"])
            if sum(lengths) != len(rest) or len(crcs) != len(lengths):
                raise ShardFormatError("the shard record's blobs do not match their lengths")
            values, at = [], 0
            for n, crc in zip(lengths, crcs):
                blob = bytes(rest[at : at + n])
                if checksum(blob) != crc:
                    raise ShardFormatError("a blob of the shard record fails its checksum")
                values.append(blob)
                at += n
            health = body.get("health")
            return cls(
                epoch=_nat(body["epoch"]),
                step=_nat(body["step"]),
                rank=_nat(body["rank"]),
                world_size=_nat(body["world_size"]),
                plan_id=_text(body["plan_id"]),
                crcs=tuple(_nat(c) for c in body["crcs"]),
                values=tuple(values),
                value_crcs=crcs,
                health=None if health is None else Health.from_json(health),
            )
        except ShardFormatError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ShardFormatError(f"malformed shard record ({type(exc).__name__}: {exc})") from None


def make_record(
    plan: ShardPlan,
    region,
    values: Iterable[bytes],
    *,
    epoch: int,
    step: int,
    verdict: Optional[Health] = None,
    beside=None,
) -> ShardRecord:
    """The record of one staged shard: a CRC32C of every tensor item's bytes in ``region`` and
    of every blob, and the shard's health (the store that took the shard from its rank computes it).

    ``verdict``: the trainer's (metric checks and validator; None when health checks are off).
    Unless it already failed, every item of ``plan.checked`` must be finite: the first that is
    not makes the shard unhealthy. ``beside``: an executor to run the tensor check on while this
    thread checksums (:func:`gemini_ckpt.format.finite.checksum_items`); else it is fused with
    the checksum."""
    view = memoryview(region).cast("B")
    values = tuple(bytes(v) for v in values)
    if len(values) != len(plan.values):
        raise ValueError(f"rank {plan.rank}: {len(values)} blobs for {len(plan.values)} value items")
    if len(view) < plan.region_bytes:
        raise ValueError(f"rank {plan.rank}: a region of {len(view)} bytes for a plan of {plan.region_bytes}")
    failed = verdict is not None and verdict.unhealthy
    array = np.frombuffer(view, dtype=np.uint8) if len(view) else np.empty(0, np.uint8)
    crcs, bad = checksum_items(
        array, [(t.at, t.nbytes, t.dtype) for t in plan.tensors], () if failed else plan.checked, beside=beside
    )
    if failed:
        health: Optional[Health] = verdict.with_rank(plan.rank)
    elif bad is not None:
        health = Health(UNHEALTHY, "finite", plan.tensors[bad.item].fqn, bad.detail, plan.rank)
    elif verdict is not None or plan.checked:
        health = HEALTHY_VERDICT
    else:
        health = None
    return ShardRecord(
        epoch=epoch,
        step=step,
        rank=plan.rank,
        world_size=plan.world_size,
        plan_id=plan.plan_id,
        crcs=crcs,
        values=values,
        value_crcs=tuple(checksum(v) for v in values),
        health=health,
    )


def check_record(record: ShardRecord, plan: ShardPlan) -> None:
    """Raise ShardFormatError unless ``record`` fits ``plan`` (same plan, rank, item counts)."""
    if (record.plan_id, record.rank, record.world_size) != (plan.plan_id, plan.rank, plan.world_size):
        raise ShardFormatError(
            f"the record of rank {record.rank} (plan {record.plan_id[:8]}) does not belong to "
            f"the plan of rank {plan.rank} (plan {plan.plan_id[:8]})"
        )
    if len(record.crcs) != len(plan.tensors) or len(record.values) != len(plan.values):
        raise ShardFormatError(f"the record of rank {record.rank} does not have one entry per item of its plan")


# --- framing helpers ------------------------------------------------------------------------------
def _unframe(data: Any, magic: bytes, what: str) -> tuple[dict, memoryview]:
    view = memoryview(data).cast("B")
    start = len(magic) + _LEN.size
    if len(view) < start or bytes(view[: len(magic)]) != magic:
        raise ShardFormatError(f"not an encoded {what}")
    (n,) = _LEN.unpack(view[len(magic) : start])
    if n > min(_MAX_JSON, len(view) - start):
        raise ShardFormatError(f"the {what} is truncated")
    try:
        head = json.loads(bytes(view[start : start + n]))
    except (ValueError, RecursionError) as exc:
        raise ShardFormatError(f"the {what} is damaged ({exc})") from None
    if not isinstance(head, dict):
        raise ShardFormatError(f"the {what} is not a JSON object")
    return head, view[start + n :]


def _check_crc_and_signature(head: dict, payload: bytes, key: Optional[bytes], context: bytes, what: str) -> None:
    if head.get("crc") != checksum(payload):
        raise ShardFormatError(f"the {what} fails its checksum (damaged)")
    signature = head.get("signature")
    if key is None:
        return
    if signature is None:
        raise ShardFormatError(f"the {what} is not signed, and a signing key is set; refused")
    if not mac_matches(signature, key, context, payload):
        raise ShardFormatError(f"the {what} has a signature that does not match this signing key; refused")


def _nat(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ShardFormatError(f"expected an int >= 0, got {v!r}")
    return v


def _text(v: Any) -> str:
    if not isinstance(v, str):
        raise ShardFormatError(f"expected a string, got {type(v).__name__}")
    return v


def _dict(v: Any) -> dict:
    if not isinstance(v, dict):
        raise ShardFormatError(f"expected an object, got {type(v).__name__}")
    return v
