"""Exact resume for torchdata's ``StatefulDataLoader``.

``StatefulDataLoader.load_state_dict`` restores the position within the epoch, but the
iterator that resumes it draws a base seed (from ``loader.generator``, or from the global
torch RNG when there is none) *after* the sampler has restored its generator. An
uninterrupted run made that draw at the start of the epoch, before the snapshot was taken.
So without care the resumed run's generator is one draw behind (the next epoch shuffles
differently) or the global RNG is one draw ahead (dropout differs). We record the loader
generator's state at save time and, when the resuming iterator is created, put back both
that state and the global RNG state from just before the creation.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def loader_generator_state(loader: Any) -> Optional[torch.Tensor]:
    gen = getattr(loader, "generator", None)
    return gen.get_state() if isinstance(gen, torch.Generator) else None


def fix_resume(loader: Any, generator_state: Optional[torch.Tensor]) -> None:
    """Arrange for the next iterator of ``loader`` to leave the RNG streams as an
    uninterrupted run would have them. A no-op for loaders without that iterator hook."""
    original = getattr(loader, "_get_iterator", None)
    if original is None or not hasattr(loader, "next_iter_state"):
        return
    if "_get_iterator" in vars(loader):  # an earlier restore's hook is still pending
        del loader._get_iterator
        original = loader._get_iterator

    def resume_iterator():
        del loader._get_iterator  # one shot: later epochs use the loader's own method
        cpu_state = torch.get_rng_state()
        iterator = original()
        torch.set_rng_state(cpu_state)
        gen = getattr(loader, "generator", None)
        if generator_state is not None and isinstance(gen, torch.Generator):
            gen.set_state(generator_state)
        return iterator

    loader._get_iterator = resume_iterator
