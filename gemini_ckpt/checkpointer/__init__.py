"""``Checkpointer``: the two-phase save (blocking snapshot, background commit) and restore.

The life of a version, on the trainer's side:

1. ``save(step)``: the plan's sources are captured (:mod:`gemini_ckpt.save.sources`; the
   first version, and a version whose structure changed, plan with DCP first:
   :mod:`gemini_ckpt.save.plan`, the only collective saving runs), a free segment of the
   memory tier is taken and the tensors are copied into it (:mod:`gemini_ckpt.save.stager`).
   ``save`` returns: the snapshot aliases nothing live. With ``staging="overlap"``
   (:mod:`gemini_ckpt.save.overlap`) the parameters and optimizer state are copied on a
   copying thread while the next step runs, and the next ``optimizer.step()`` waits for it.
   The segment is handed to the memory tier before ``save`` returns (one small message);
   with host stores the checksums, replication and commit happen there, not here.
   With a health check (``CheckpointConfig.health_check``, :mod:`gemini_ckpt.health`), ``save``
   judges the step's metrics (and runs the user's validator) here; the tensor check runs where
   the checksums are computed, not here.
2. The background thread waits for the version's outcome, its health included.
3. A committed, healthy version due for the durable tier goes to the
   :class:`~gemini_ckpt.durable.writer.Persister`. An unhealthy one is never persisted; the first is
   logged loudly, and with ``on_unhealthy="raise"`` each is raised at the next ``save``.

The modules, one step each: :mod:`.facade` (``Checkpointer``, the methods users call),
:mod:`.tiers` (what ``start()`` builds), :mod:`.inflight` (admission: the in-flight slots and
the background's errors), :mod:`.snapshot` (step 1: plan, judge, stage) and :mod:`.overlapped`
(step 1 with ``staging="overlap"``), :mod:`.background` (steps 2 and 3), :mod:`.restoring`
(``restore()`` around :func:`gemini_ckpt.restore.restore_newest`); listeners are told what
happens (:mod:`gemini_ckpt.events`).
"""

from .facade import Checkpointer

__all__ = ["Checkpointer"]
