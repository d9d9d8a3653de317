"""Which batches every step of a training run takes, on every rank. Pure.

The packing of every epoch is fixed up front (a pure function of the seed), so the schedule
knows the exact number of steps and a resumed run sees the same batches. Data parallel: a step
takes `world_size` consecutive batches of its epoch's packing, one per rank; a rank the
epoch's last step has no batch for stands in with the step's first (train.loop scales its loss
to nothing).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass

from eagleflow.train.data import pack
from eagleflow.train.steps import steps_in

# A step's place in the run: (epoch, step in the epoch, steps in the epoch).
Position = tuple[int, int, int]


@dataclass(frozen=True)
class Schedule:
    epochs: list[list[list[int]]]  # the packing of every epoch: batches of sample indices
    world_size: int
    rank: int

    @classmethod
    def packed(
        cls, train: list[Sized], batch_tokens: int, seed: int, epochs: int, world_size: int, rank: int
    ) -> Schedule:
        """The schedule of `epochs` passes over the samples `train` (their lengths in tokens)."""
        return cls([pack(train, batch_tokens, shuffle_seed=seed * 1000 + e) for e in range(epochs)], world_size, rank)

    @property
    def total_steps(self) -> int:
        return sum(steps_in(len(b), self.world_size) for b in self.epochs)

    def steps_from(self, epoch: int, batch_index: int) -> Iterator[Position]:
        """The position of every step from a position on."""
        for e in range(epoch, len(self.epochs)):
            n_steps = steps_in(len(self.epochs[e]), self.world_size)
            for j in range(batch_index if e == epoch else 0, n_steps):
                yield e, j, n_steps

    def rank_batch(self, position: Position) -> tuple[list[list[int]], bool, list[int]]:
        """A step's world_size consecutive batches of the epoch's packing (one per rank),
        whether this rank's counts (False: the step has no batch for it, and it stands in with
        the step's first), and this rank's batch."""
        epoch, j, _ = position
        ws = self.world_size
        step_batches = self.epochs[epoch][j * ws : (j + 1) * ws]
        counted = self.rank < len(step_batches)
        return step_batches, counted, step_batches[self.rank if counted else 0]
