"""What crosses a step's boundaries: schedule -> execute -> update (vLLM v1's ``EngineCore.step``).

    scheduled = scheduler.schedule()                       # SchedulerOutput
    launched = runner.execute_model(scheduled)             # LaunchedStep: the GPU work, queued
    scheduler.update_from_launch(scheduled, launched.seqs) # its tokens count as computed
    ...
    scheduler.update_from_output(launched.result())        # ModelRunnerOutput: the tokens, read back

With async scheduling the last line runs a step later, after the next step was launched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loramux.engine.worker.logprobs import Logprob
    from loramux.engine.core.sequence import Sequence

__all__ = ["ModelRunnerOutput", "SchedulerOutput"]


@dataclass
class SchedulerOutput:
    """One step's work: ``(sequence, number of its tokens to compute)``, decodes first; and the
    sequences that failed since the last step (at admission, or as their adapter could not be
    placed), finished with their error, for the engine to report."""

    chunks: list[tuple[Sequence, int]]
    failed: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)


@dataclass
class ModelRunnerOutput:
    """A launched step's results, on the host: the sequences it sampled a token for, in row order,
    their tokens, and each row's logprobs (None: no row asked for them; a row's None: that one did
    not)."""

    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None] | None = None
