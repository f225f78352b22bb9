"""What every scenario is given."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.report import Row


@dataclass
class Context:
    """The run's mode, and rows for the memory scenario collected along the way."""

    quick: bool
    allow_install: bool
    memory: list[Row] = field(default_factory=list)

    def reps(self, quick: int, full: int) -> int:
        """Repetitions for this mode."""
        return quick if self.quick else full
