"""Which global samples each data-parallel rank reads, and how far the run has got.

The datasets are never-ending streams ``0, 1, 2, ...``. Micro-step ``m`` (every rank
counts the same micro-steps) takes the ``micro_batch_size x dp_size`` samples starting at
``m x micro_batch_size x dp_size``; rank ``r`` gets the ``r``-th slice of
``micro_batch_size`` of them. So the ranks never overlap, a step of ``grad_accum``
micro-steps consumes one contiguous block of ``global_batch_size`` samples, and the whole
position is one rank-independent number, ``consumed_samples``. Resuming with another
data-parallel size works whenever that number is a multiple of the new
``micro_batch_size x dp_size``.
"""
from __future__ import annotations

from lmforge.data.errors import DataError


class MicroBatchSampler:
    def __init__(self, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 consumed_samples: int = 0):
        if micro_batch_size < 1:
            raise DataError(f"data.micro_batch_size: must be >= 1, got {micro_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(f"data-parallel rank {dp_rank} is not in [0, {dp_size})")
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.micro_step = 0
        self.consumed_samples = consumed_samples

    @property
    def samples_per_micro_step(self) -> int:
        """Samples all ranks together take per micro-step."""
        return self.micro_batch_size * self.dp_size

    @property
    def consumed_samples(self) -> int:
        return self.micro_step * self.samples_per_micro_step

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        step, rest = divmod(int(value), self.samples_per_micro_step)
        if rest or value < 0:
            raise DataError(f"loader state: consumed_samples {value} is not a multiple of "
                            f"micro_batch_size x dp_size = {self.samples_per_micro_step}")
        self.micro_step = step

    def indices(self, micro_step: int) -> list[int]:
        """This rank's global sample ids at ``micro_step``."""
        start = micro_step * self.samples_per_micro_step + self.dp_rank * self.micro_batch_size
        return list(range(start, start + self.micro_batch_size))

    def next_indices(self) -> list[int]:
        out = self.indices(self.micro_step)
        self.micro_step += 1
        return out

    def __iter__(self):
        while True:
            yield self.next_indices()

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
