"""Which batches the monitor records, and when: :class:`Batches` (the choice) and :class:`BatchSchedule`.

No training framework here: the monitor asks with plain numbers (epoch,
global step, batch index, dataloader length), so the schedule is tested on
its own.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from attn_monitor.shared.checks import check_int

__all__ = ["BatchSchedule", "Batches"]


@dataclass(frozen=True)
class Batches:
    """Which validation batches and runs, and which training steps, the monitor records; checked at construction.

    Args:
        sample: an int ``n`` (the first ``n`` batches of each validation
            dataloader, or ``n`` drawn at random with ``random_sample``) or
            explicit batch indices.
        random_sample: draw ``sample`` indices at random, once per
            dataloader (seeded by ``seed + dataloader_idx``), reused every epoch.
        seed: seed of the draw.
        every_n_epochs: record the validation runs of every n-th epoch (each
            of them), counted as Lightning counts ``check_val_every_n_epoch``
            and ``ModelCheckpoint(every_n_epochs=...)``: epochs ``e`` with
            ``(e + 1) % n == 0``. Validations outside ``fit`` are all recorded.
        skip_sanity_check: leave out the sanity-check validation run.
        train_every_n_steps: record one training batch every n optimizer
            steps (None: never).

    Raises:
        TypeError, ValueError: a bad option, named.

    Example:
        >>> Batches([5, 1, 5]).indices, Batches(3).count
        ((1, 5), 3)
        >>> Batches(-1)
        Traceback (most recent call last):
        ...
        ValueError: Expected `batches` to be an int >= 0, got -1.
    """

    sample: int | Sequence[int] = 2
    random_sample: bool = False
    seed: int = 0
    every_n_epochs: int = 1
    skip_sanity_check: bool = True
    train_every_n_steps: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.sample, int):
            check_int("batches", self.sample, 0)
        else:
            object.__setattr__(self, "sample", tuple(self.sample))
            for index in self.sample:
                check_int("batches", index, 0)
            if self.random_sample:
                raise ValueError("`random_sample` draws a count of batches; pass `batches` as an int with it.")
        object.__setattr__(self, "random_sample", bool(self.random_sample))
        object.__setattr__(self, "skip_sanity_check", bool(self.skip_sanity_check))
        check_int("seed", self.seed, 0)
        check_int("every_n_epochs", self.every_n_epochs, 1)
        if self.train_every_n_steps is not None:
            check_int("train_every_n_steps", self.train_every_n_steps, 1)

    @property
    def indices(self) -> tuple[int, ...] | None:
        """The explicit batch indices, sorted and unique (None: a count)."""
        return None if isinstance(self.sample, int) else tuple(sorted(set(self.sample)))

    @property
    def count(self) -> int:
        """How many batches of each validation dataloader are recorded (at most)."""
        return self.sample if isinstance(self.sample, int) else len(set(self.sample))


class BatchSchedule:
    """The schedule of :class:`Batches`: its random draws and the last recorded training step.

    Args:
        batches: which batches, runs and training steps.

    Example:
        >>> schedule = BatchSchedule(Batches(2, every_n_epochs=2, train_every_n_steps=3))
        >>> schedule.validation_run(sanity_checking=False, epoch=1), schedule.validation_run(False, 2)
        (True, False)
        >>> schedule.validation_run(False, 2, fitting=False)  # Trainer.validate
        True
        >>> schedule.sampled_indices(num_batches=10)
        (0, 1)
        >>> [step for step in (0, 0, 1, 2, 3, 3) if schedule.training_step(step)]  # twice 0: accumulation
        [0, 3]
    """

    def __init__(self, batches: Batches | None = None) -> None:
        self.batches = Batches() if batches is None else batches
        if not isinstance(self.batches, Batches):
            raise TypeError(f"Expected `batches` to be a Batches, got {type(self.batches).__name__}.")
        self._drawn: dict[int, tuple[int, ...]] = {}
        self._last_train_step = -1

    def validation_run(self, sanity_checking: bool, epoch: int, fitting: bool = True) -> bool:
        """Whether the validation run now starting, in ``epoch`` (0-based), is recorded."""
        if sanity_checking:
            return not self.batches.skip_sanity_check
        return not fitting or (epoch + 1) % self.batches.every_n_epochs == 0

    def sampled_indices(self, num_batches: int | float, dataloader_idx: int = 0) -> tuple[int, ...]:
        """Batch indices recorded in a validation dataloader of ``num_batches`` batches.

        Raises:
            ValueError: ``random_sample`` with a dataloader of unknown length.
        """
        batches = self.batches
        if batches.indices is not None:
            return batches.indices
        if not batches.random_sample:
            return tuple(range(batches.count))
        if dataloader_idx not in self._drawn:
            if num_batches == float("inf"):
                raise ValueError("`random_sample` needs a validation dataloader of known length.")
            population = range(int(num_batches))
            drawn = random.Random(batches.seed + dataloader_idx).sample(population, min(batches.count, len(population)))
            self._drawn[dataloader_idx] = tuple(sorted(drawn))
        return self._drawn[dataloader_idx]

    def training_step(self, global_step: int) -> bool:
        """Whether the training batch now starting at ``global_step`` is recorded.

        One batch per optimizer step: under gradient accumulation the later
        batches of a recorded step (same ``global_step``) are not.
        """
        every = self.batches.train_every_n_steps
        if every is None or global_step % every != 0:
            return False
        if global_step == self._last_train_step:
            return False
        self._last_train_step = global_step
        return True

    def reset(self) -> None:
        """Forget the draws and the last recorded training step: a new run starts from zero."""
        self._drawn = {}
        self._last_train_step = -1

    def state_dict(self) -> dict[str, Any]:
        """The random draws, so a resumed run records the same batches."""
        return {"drawn": {int(k): list(v) for k, v in self._drawn.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._drawn = {int(k): tuple(v) for k, v in state.get("drawn", {}).items()}
