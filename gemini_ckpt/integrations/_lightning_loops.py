"""The Lightning internals :mod:`gemini_ckpt.integrations.lightning` relies on, in one adapter
(tested with Lightning 2.6): the fit loop's combined loader and data fetcher, the epoch loop's
"will validation run" predicate and restart stage, and the point in ``FitLoop.setup_data`` where
the loaders' states are loaded (between building the loaders and their first ``iter()``)."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Optional

import torch

try:  # the namespace Ray Train's Lightning utilities pick
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the standalone package
    import pytorch_lightning as pl

_PrefetchDataFetcher = importlib.import_module(pl.__name__ + ".loops.fetchers")._PrefetchDataFetcher
_TESTED = ("2.6.",)


def stateful(dl: Any) -> bool:
    return callable(getattr(dl, "state_dict", None)) and callable(getattr(dl, "load_state_dict", None))


def generators(dl: Any) -> dict[str, torch.Generator]:
    """The generators a loader's next iterator draws from: its own (workers' base seed) and its
    sampler's (the shuffle; torchdata's sampler makes its own when the loader has none)."""
    found: dict[str, torch.Generator] = {}
    for name, owner in (
        ("generator", dl),
        ("sampler", getattr(dl, "sampler", None)),
        ("batch_sampler.sampler", getattr(getattr(dl, "batch_sampler", None), "sampler", None)),
    ):
        gen = getattr(owner, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found.values()):
            found[name] = gen
    return found


def generator_states(dl: Any) -> dict[str, torch.Tensor]:
    return {name: gen.get_state() for name, gen in generators(dl).items()}


def wraps_a_sampler(dl: Any) -> bool:
    samplers = (getattr(dl, "sampler", None), getattr(getattr(dl, "batch_sampler", None), "sampler", None))
    return any(c.__name__ == "DistributedSamplerWrapper" for s in samplers if s is not None for c in type(s).__mro__)


def then(first: list, rest: Any):
    """``first``'s items, then ``next(rest)`` until it stops (``itertools.chain`` would call
    ``iter(rest)``, which starts a CombinedLoader over)."""
    yield from first
    while True:
        try:
            item = next(rest)
        except StopIteration:
            return
        yield item


def set_epoch(dl: Any, epoch: int) -> None:
    samplers = {
        id(s): s
        for s in (getattr(dl, "sampler", None), getattr(getattr(dl, "batch_sampler", None), "sampler", None))
        if s is not None
    }
    for sampler in samplers.values():
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


class Loops:
    """The Lightning internals the callback needs, in one adapter (Lightning 2.6)."""

    _warned = False

    def __init__(self, trainer: "pl.Trainer") -> None:
        self.trainer = trainer
        self.fit = trainer.fit_loop
        self.epoch = trainer.fit_loop.epoch_loop

    @classmethod
    def check_version(cls) -> None:
        if not pl.__version__.startswith(_TESTED) and not cls._warned:
            cls._warned = True
            warnings.warn(
                f"gemini_ckpt's Lightning integration was tested with Lightning {', '.join(_TESTED)}x; "
                f"this is {pl.__version__}: check that resumes are exact",
                stacklevel=3,
            )

    def combined_loader(self):
        return self.fit._combined_loader

    def train_loaders(self) -> list:
        combined = self.fit._combined_loader
        return list(combined.flattened) if combined is not None else []

    def stateful_loaders(self) -> list:
        # the order CombinedLoader._state_dicts keeps
        return [dl for dl in self.train_loaders() if stateful(dl)]

    def epoch_index(self) -> int:
        return self.fit.epoch_progress.current.processed

    def validation_follows(self) -> bool:
        if self.epoch._skip_next_val:
            return False
        return bool(self.epoch._should_check_val_fx(self.fit._data_fetcher))

    def epoch_ends_here(self) -> bool:
        return bool(self.epoch._num_ready_batches_reached())

    def prefetched(self) -> Optional[list]:
        """The batches an unsized loader's fetcher took ahead of training (None when sized)."""
        fetcher = self.fit._data_fetcher
        if isinstance(fetcher, _PrefetchDataFetcher) and fetcher.length is None:
            return list(fetcher.batches)
        return None

    def hand_back_prefetched(self, saved: Optional[list]) -> None:
        """The resumed fetcher took a batch ahead from the loader, which was already one ahead:
        train on the saved batch first, then on the one just fetched, then on from the loader."""
        if not saved:
            return
        fetcher = self.fit._data_fetcher
        fetcher.iterator = then(list(fetcher.batches), fetcher.iterator)
        fetcher.batches = list(saved)
        fetcher.done = False

    def start_next_epoch_afresh(self) -> None:
        """Lightning restarts a version saved at an epoch's last batch as "in the middle of the
        epoch" and so skips the next epoch's start (its ``on_train_epoch_start`` hooks and
        progress counters); an uninterrupted run has that start."""
        if self.fit.restarted_mid_epoch:
            self.fit.reset_restart_stage()

    # the point in FitLoop.setup_data between building the loaders and their first iter()
    def patch_loader_loading(self, hook) -> None:
        self.fit._load_combined_loader_states = hook

    def unpatch(self) -> None:
        self.fit.__dict__.pop("_load_combined_loader_states", None)

    def load_loader_states(self) -> None:
        type(self.fit)._load_combined_loader_states(self.fit)

    def drop_loader_states(self) -> None:
        self.fit._combined_loader_states_to_load = []

    def iterate_again(self) -> None:
        iter(self.fit._data_fetcher)
