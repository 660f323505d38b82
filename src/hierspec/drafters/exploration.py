"""The back-off between explorations that cost-aware drafting and `hd`'s scored tree share.

A drafter that sizes its drafts by learned acceptance rates must sometimes draft beyond what they say pays, or a
rate that fell too low is never tested again. Both do so every ``interval`` steps (counted their own way), with
the same rule: the interval returns to ``every`` after an exploration that was accepted and doubles, up to
``most``, after one that was not — so a drafter that keeps failing costs less and less.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the longest interval the back-off reaches by default
MOST_STEPS_BETWEEN = 128


@dataclass
class ExplorationBackOff:
    """Steps to wait before the next exploration (``interval``), updated by :meth:`record`."""

    every: int
    most: int = MOST_STEPS_BETWEEN
    interval: int = field(init=False)
    waited: int = field(default=0, init=False)  # steps counted by :meth:`tick` since the last try

    def __post_init__(self) -> None:
        self.interval = self.every

    def tick(self) -> bool:
        """Count one more step without a try: ``True`` (and the count restarts) when the next try is due."""
        self.waited += 1
        if self.waited < self.interval:
            return False
        self.waited = 0
        return True

    def restart(self) -> None:
        """Count the steps towards the next try from zero again (a step that made a try unnecessary)."""
        self.waited = 0

    def record(self, found: bool) -> None:
        """After an exploration: back to ``every`` if it was accepted, else twice the interval (at most ``most``)."""
        self.interval = self.every if found else min(2 * self.interval, self.most)
