"""How many proposals a decode row carries in a step, chosen by measuring what each count gives.

For each size of step (its decode rows, by powers of two) steps use the best count so far, and now and
then a neighbour of it is tried against it (hill climbing; less often while trials lose): the two
take turns in blocks of four steps (tried, best, best, tried), and the one whose steps gave more tokens
a second is the best from then on. Taking turns measures both under the same conditions: contexts grow,
a reply moves between copying and free text, other work takes the cores, and a count measured a
while ago beside one measured now had kept a losing count for hundreds of steps
(bench/engine/speculative.py). Each block gives one paired ratio of the two counts' rates (a steady
drift cancels within it), and the trial goes on until the blocks agree (their mean ratio two standard
errors from even) or MOST_BLOCKS have run: with step times swinging at random, four steps a count often
kept a count that loses (simulated: tests/test_speculative.py, docs/perf-log/2026-11-30.md). Measured
rather than modelled: what proposals cost depends on who makes them (a draft model's steps, n-gram
lookup's nothing), on the model, the CPU and the batch, and what they yield on these very rows'
acceptance. A line fitted to step seconds against tokens had
kept an int4 self-draft on at 16 clients where it lost.

A settled best is watched as well: the tokens its steps add a row beyond the row's own (what proposals
yield there) are averaged, and when that moves by MOVED from what it was once that best settled (the
rows went from copying to free text, or back), the neighbour the move points to is tried at once. A
long wait after losing trials had kept copy's count through the free text that followed it, where none
paid (bench/serving/speculative.py at 16 clients, docs/perf-log/2026-12-01.md).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

BLOCK = 4  # a trial's steps in turns: tried, best, best, tried
FEWEST_BLOCKS = 3  # blocks a trial runs before its outcome may be clear
MOST_BLOCKS = 8  # blocks after which the mean ratio decides, clear or not
CLEAR = 2.0  # standard errors between the blocks' mean ratio and even that make an outcome clear
REVISIT = 64  # steps of one size after which a neighbour of its best count is tried again, at first
LONGEST_REVISIT = 1024  # each trial that loses doubles the wait up to this: a settled best costs little
YIELD_STEPS = 32  # a settled best's steps averaged into its yield (an exponential average of this span)
WATCH_CLEAR = 3.0  # standard errors of a best's averaged yield that its move must pass (checked every step)
MOVED = 0.25  # a relative change of the tokens a best's proposals add a row that starts a trial at once


@dataclass
class Arm:
    """The tokens and seconds of one count's steps in a block of a trial."""

    tokens: int = 0
    seconds: float = 0.0

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Size:
    """One size of step: its best count, and the trial in progress (the count tried, both counts' steps)."""

    best: int = 0
    trial: int | None = None
    arms: tuple[Arm, Arm] = field(default_factory=lambda: (Arm(), Arm()))  # this block's: the tried count's, the best's
    turn: int = 0  # steps of the trial so far
    ratios: list[float] = field(default_factory=list)  # each block's: the tried count's rate over the best's, less 1
    tried: set[int] = field(default_factory=lambda: {0})
    since: int = 0  # steps since the last trial ended
    up: bool = True  # the side of `best` tried next on a revisit
    climb: int = 0  # +1 or -1 after a trial that moved the best that way: the next count that way is tried at once
    revisit: int = REVISIT  # steps between trials of a neighbour
    gain: float = 0.0  # the tokens a row the best's steps add to the row's own, averaged
    spread: float = 0.0  # the variance of a step's gain about `gain`, averaged alike
    settled: float | None = None  # `gain` once the best had YIELD_STEPS steps (or when it last moved)


@dataclass
class ProposalCounts:
    most: int  # proposals a row at most
    sizes: dict[int, Size] = field(default_factory=dict)
    pending: tuple[Size, int | None, int] | None = None  # the step chosen last, not yet observed: size, arm, rows

    def choose(self, rows: int) -> int:
        """The proposal count a row for a step of `rows` decode rows."""
        size = self.sizes.setdefault(rows.bit_length(), Size())
        if size.trial is None and (size.climb or size.since >= BLOCK):
            size.trial = self._next_trial(size)
            if size.trial is not None:
                size.arms, size.turn, size.ratios = (Arm(), Arm()), 0, []
        if size.trial is None:
            self.pending = (size, None, rows)
            return size.best
        arm = (size.turn + 1) // 2 % 2  # in turns: tried, best, best, tried, ... (a steady drift favours neither)
        self.pending = (size, arm, rows)
        return size.best if arm else size.trial

    def _next_trial(self, size: Size) -> int | None:
        """The next count the way the best just moved, or an untried neighbour of the best (climbing),
        else one side then the other every `revisit` steps."""
        if size.climb and 0 <= size.best + size.climb <= self.most:
            return size.best + size.climb
        size.climb = 0
        sides = [k for k in (size.best + 1, size.best - 1) if 0 <= k <= self.most]
        untried = [k for k in sides if k not in size.tried]
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
        size, arm, rows = self.pending
        self.pending = None
        if arm is None:
            size.since += 1
            if size.best:
                self._watch(size, tokens / rows - 1)
            return
        size.arms[arm].tokens += tokens
        size.arms[arm].seconds += seconds
        size.turn += 1
        if size.turn % BLOCK:
            return
        tried, best = size.arms
        size.ratios.append(tried.rate() / best.rate() - 1 if best.rate() > 0 else 0.0)
        size.arms = (Arm(), Arm())
        better = self._outcome(size.ratios)
        if better is None:
            return
        size.tried.add(size.trial)
        size.climb = size.trial - size.best if better else 0
        size.best = size.trial if better else size.best
        size.revisit = REVISIT if better else min(2 * size.revisit, LONGEST_REVISIT)
        size.trial, size.since = None, 0
        size.settled = None if better else size.settled  # a new best's yield is its own

    @staticmethod
    def _watch(size: Size, gain: float) -> None:
        """Averages a settled best's `gain` (tokens a row beyond its own) and its spread and, once the average
        moved by MOVED from where it settled and clearly (WATCH_CLEAR standard errors: one row's gain swings
        widely), climbs the way it moved: fewer proposals when they yield less, more when more."""
        weight = 1 / min(size.since, YIELD_STEPS) if size.settled is None else 1 / YIELD_STEPS  # a mean at first
        change = gain - size.gain
        size.gain += weight * change
        size.spread += weight * ((1 - weight) * change * change - size.spread)
        if size.settled is None:
            size.settled = size.gain if size.since >= YIELD_STEPS else None
            return
        moved = size.gain - size.settled
        if abs(moved) > max(MOVED * max(size.settled, size.gain), WATCH_CLEAR * math.sqrt(size.spread / YIELD_STEPS)):
            size.climb = 1 if moved > 0 else -1
            size.revisit, size.settled, size.since = REVISIT, size.gain, 0

    @staticmethod
    def _outcome(ratios: list[float]) -> bool | None:
        """Whether a trial's blocks so far show the tried count better (True) or not (False), or None while
        they are too few to tell: from FEWEST_BLOCKS on, a mean ratio CLEAR standard errors from even; after
        MOST_BLOCKS, the mean ratio's sign. (Keeping the best where MOST_BLOCKS leave it unclear held
        counts low where proposals pay a few percent, simulated: docs/perf-log/2026-11-30.md.)"""
        if len(ratios) < FEWEST_BLOCKS:
            return None
        mean = statistics.fmean(ratios)
        if abs(mean) > CLEAR * statistics.stdev(ratios) / math.sqrt(len(ratios)):
            return mean > 0
        return mean > 0 if len(ratios) >= MOST_BLOCKS else None
