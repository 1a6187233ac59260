"""Which batches the monitor records, and when: the callback's schedule.

No Lightning here: the callback asks with plain numbers (epoch, global step,
batch index, dataloader length), so the schedule is tested on its own.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from attn_monitor.shared import check_int

__all__ = ["BatchSchedule"]


class BatchSchedule:
    """Which validation runs and batches, and which training steps, are recorded.

    Args:
        batches: an int ``n`` (the first ``n`` batches of each validation
            dataloader, or ``n`` drawn at random with ``random_sample``) or
            explicit batch indices.
        random_sample: draw ``batches`` indices at random, once per
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
        TypeError, ValueError: a bad argument, named.

    Example:
        >>> schedule = BatchSchedule(batches=2, every_n_epochs=2, train_every_n_steps=3)
        >>> schedule.validation_run(sanity_checking=False, epoch=1), schedule.validation_run(False, 2)
        (True, False)
        >>> schedule.validation_run(False, 2, fitting=False)  # Trainer.validate
        True
        >>> schedule.sampled_indices(num_batches=10)
        (0, 1)
        >>> [step for step in (0, 0, 1, 2, 3, 3) if schedule.training_step(step)]  # twice 0: accumulation
        [0, 3]
    """

    def __init__(
        self,
        *,
        batches: int | Sequence[int] = 2,
        random_sample: bool = False,
        seed: int = 0,
        every_n_epochs: int = 1,
        skip_sanity_check: bool = True,
        train_every_n_steps: int | None = None,
    ) -> None:
        if isinstance(batches, int):
            self.count = check_int("batches", batches, 0)
            self.indices: tuple[int, ...] | None = None
        else:
            indices = tuple(batches)
            for index in indices:
                check_int("batches", index, 0)
            if random_sample:
                raise ValueError("`random_sample` draws a count of batches; pass `batches` as an int with it.")
            self.count = len(set(indices))
            self.indices = tuple(sorted(set(indices)))
        self.random_sample = bool(random_sample)
        self.seed = check_int("seed", seed, 0)
        self.every_n_epochs = check_int("every_n_epochs", every_n_epochs, 1)
        self.skip_sanity_check = bool(skip_sanity_check)
        self.train_every_n_steps = (
            None if train_every_n_steps is None else check_int("train_every_n_steps", train_every_n_steps, 1)
        )
        self._drawn: dict[int, tuple[int, ...]] = {}
        self._last_train_step = -1

    def validation_run(self, sanity_checking: bool, epoch: int, fitting: bool = True) -> bool:
        """Whether the validation run now starting, in ``epoch`` (0-based), is recorded."""
        if sanity_checking:
            return not self.skip_sanity_check
        return not fitting or (epoch + 1) % self.every_n_epochs == 0

    def sampled_indices(self, num_batches: int | float, dataloader_idx: int = 0) -> tuple[int, ...]:
        """Batch indices recorded in a validation dataloader of ``num_batches`` batches.

        Raises:
            ValueError: ``random_sample`` with a dataloader of unknown length.
        """
        if self.indices is not None:
            return self.indices
        if not self.random_sample:
            return tuple(range(self.count))
        if dataloader_idx not in self._drawn:
            if num_batches == float("inf"):
                raise ValueError("`random_sample` needs a validation dataloader of known length.")
            population = range(int(num_batches))
            drawn = random.Random(self.seed + dataloader_idx).sample(population, min(self.count, len(population)))
            self._drawn[dataloader_idx] = tuple(sorted(drawn))
        return self._drawn[dataloader_idx]

    def training_step(self, global_step: int) -> bool:
        """Whether the training batch now starting at ``global_step`` is recorded.

        One batch per optimizer step: under gradient accumulation the later
        batches of a recorded step (same ``global_step``) are not.
        """
        if self.train_every_n_steps is None or global_step % self.train_every_n_steps != 0:
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
