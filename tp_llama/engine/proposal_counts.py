"""How many proposals a decode row carries in a step, chosen by measuring what each count gives.

For each size of step (its decode rows, by powers of two) the tokens a second of the steps that
carried k proposals a row are kept for k = 0 .. most, and steps use the best count so far; its
neighbours are tried now and then, a few steps each (hill climbing; less often while trials lose),
so the choice follows the acceptance, the batch and the context as they move. Measured rather than
modelled: what proposals cost depends on who makes them (a draft model's steps, n-gram lookup's nothing), on the model, the
CPU and the batch, and what they yield on these very rows' acceptance. A line fitted to step seconds
against tokens had kept an int4 self-draft on at 16 clients where it lost (bench/engine/speculative.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TRIAL_STEPS = 4  # steps a count is tried for before it is compared with the best
REVISIT = 64  # steps of one size after which a neighbour of its best count is tried again, at first
LONGEST_REVISIT = 1024  # each trial that loses doubles the wait up to this: a settled best costs little
DECAY = 0.9  # each count's earlier steps weigh this much less at each new one


@dataclass
class Arm:
    """The decayed tokens and seconds of the steps that carried one proposal count."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens, self.seconds = DECAY * self.tokens + tokens, DECAY * self.seconds + seconds
        self.steps += 1


@dataclass
class Size:
    """One size of step: its counts' arms, the best count, the count on trial and for how many more steps."""

    arms: list[Arm]
    best: int = 0
    trial: int | None = None
    trial_left: int = 0
    since: int = 0  # steps since the last trial ended
    up: bool = True  # the side of `best` tried next on a revisit
    climb: int = 0  # +1 or -1 after a trial that moved the best that way: the next count that way is tried at once
    revisit: int = REVISIT  # steps between trials of a neighbour


@dataclass
class ProposalCounts:
    most: int  # proposals a row at most
    sizes: dict[int, Size] = field(default_factory=dict)
    pending: tuple[Size, int] | None = None  # the size and count of the step chosen last, not yet observed

    def choose(self, rows: int) -> int:
        """The proposal count a row for a step of `rows` decode rows."""
        size = self.sizes.setdefault(rows.bit_length(), Size([Arm() for _ in range(self.most + 1)]))
        if size.trial is None and size.arms[size.best].steps >= TRIAL_STEPS:
            size.trial = self._next_trial(size)
            if size.trial is not None:  # measured afresh: the batch and the acceptance may have moved
                size.arms[size.trial], size.trial_left = Arm(), TRIAL_STEPS
        count = size.best if size.trial is None else size.trial
        self.pending = (size, count)
        return count

    def _next_trial(self, size: Size) -> int | None:
        """The next count the way the best just moved, or an untried neighbour of the best (climbing),
        else one side then the other every REVISIT steps."""
        if size.climb and 0 <= size.best + size.climb <= self.most:
            return size.best + size.climb
        sides = [k for k in (size.best + 1, size.best - 1) if 0 <= k <= self.most]
        untried = [k for k in sides if size.arms[k].steps == 0]
        if untried:
            return untried[0]
        if size.since < size.revisit or not sides:
            return None
        size.up = not size.up
        return sides[0] if size.up or len(sides) == 1 else sides[1]

    def observe(self, tokens: int, seconds: float) -> None:
        """The step chosen last gave `tokens` tokens (its rows' picks and accepted proposals) in `seconds`."""
        if self.pending is None:
            return
        size, count = self.pending
        self.pending = None
        size.arms[count].add(tokens, seconds)
        if size.trial != count:
            size.since += 1
            return
        size.trial_left -= 1
        if size.trial_left == 0:
            better = size.arms[count].rate() > size.arms[size.best].rate()
            size.climb = count - size.best if better else 0
            size.best = count if better else size.best
            size.revisit = REVISIT if better else min(2 * size.revisit, LONGEST_REVISIT)
            size.trial, size.since = None, 0
