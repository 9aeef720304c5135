"""A draft model's proposals: a smaller model of the same tokenizer (a second Meta checkpoint, say Llama
3.2 1B for 3.1 8B), or the served checkpoint itself quantized int4 at load, decodes a few tokens
greedily for each speculating row, and the served model verifies them in one step (engine/verify.py).

The draft runs on every rank like the served model (read by the same loader onto the same TP, its
plans sent through the same broadcast with `StepPlan.draft` set) and keeps its own KV cache, whose
blocks mirror the served model's: the same block table addresses both, so the scheduler's blocks,
preemptions and forks hold for the draft too, and only tokens and positions need tracking here.

A sequence's draft KV is valid up to the first position whose token the draft did not see: after a
step, the proposals the served model rejected (and everything after them) are written again by the
next draft step, which first feeds the draft every token it has not seen (a new sequence's whole
prompt; after a step, the picked token and the accepted proposals the draft wrote no entry for).

The int4 self-draft has the served model's shapes, so it reads and writes the served model's own KV
cache instead: every computed position is there already (no prompt to feed it again, no memory of
its own, and the served model's entries are better than its own would be), and what it writes past
a sequence's newest token, the verify step writes again before anything reads it.
A draft never changes a reply, only how many proposals are taken: a draft that is wrong, stale or
slow costs time, not tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tp_llama.backend import Preparation
from tp_llama.config import EngineConfig
from tp_llama.engine.plan import Row
from tp_llama.engine.sequence import Sequence
from tp_llama.errors import CheckpointError
from tp_llama.model import ModelArgs
from tp_llama.tokenizer import Tokenizer

SELF_DRAFT_QUANTIZE = "int4"  # the served checkpoint's own draft: its weights at a quarter of bfloat16's bytes


def draft_config(config: EngineConfig) -> EngineConfig:
    """The settings the draft loads with: its own checkpoint at the served model's quantization, or the
    served checkpoint at SELF_DRAFT_QUANTIZE."""
    if config.draft_ckpt_dir:
        return dataclasses.replace(config, ckpt_dir=config.draft_ckpt_dir, speculative="off")
    return dataclasses.replace(config, quantize=SELF_DRAFT_QUANTIZE, speculative="off")


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, target_dir: str, draft_dir: str) -> None:
    """Proposals are token ids, so the draft must make the served model's ids for the same text."""
    a, b = target.token_bytes(), draft.token_bytes()
    if a == b and target.special_names() == draft.special_names():
        return
    differ = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    raise CheckpointError(
        f"{Path(draft_dir) / 'tokenizer.model'}: the draft's vocabulary ({draft.family}, {draft.n_words:,} ids) is "
        f"not the served model's ({Path(target_dir) / 'tokenizer.model'}: {target.family}, {target.n_words:,} ids; "
        f"first difference at id {differ:,}); a draft must share the served model's tokenizer")


@dataclass
class Seen:
    """What a sequence's draft KV holds: positions below `base` for certain, then the tokens `tail` at
    base, base + 1, ... as far as the sequence still has them."""

    base: int
    tail: list[int]
    preemptions: int  # a preempted sequence's blocks were freed: its draft KV went with them

    def valid(self, seq: Sequence) -> int:
        if seq.preemptions != self.preemptions:
            return 0
        tokens, at = seq.tokens, self.base
        for token in self.tail:
            if at >= len(tokens) or tokens[at] != token:
                break
            at += 1
        return min(at, seq.computed)


@dataclass
class Drafter:
    """Rank 0's side of the draft: `forward` runs a plan of rows through the draft on every rank and
    returns its sampling rows' logits."""

    forward: Callable[[list[Row]], torch.Tensor]
    n_words: int
    stop_ids: frozenset[int]
    budget: int  # tokens a draft step holds at most (the served model's prefill_budget)
    block_size: int
    shares_cache: bool = False  # the self-draft: it reads the served model's KV cache, which holds every sequence
    seen: dict[str, Seen] = field(default_factory=dict)

    def propose(self, seqs: list[Sequence], rooms: list[int], after: list[list[int]]) -> list[list[int]]:
        """Up to rooms[i] greedy draft tokens after each sequence's newest token and its `after` (a grammar's
        forced tokens, fed to the draft first); a stop token ends a row's proposals. The caller gave each
        sequence blocks for its newest token, its `after` and rooms[i] more."""
        active = [i for i, room in enumerate(rooms) if room > 0]
        start = {i: self._known(seqs[i]) for i in active}
        feed = {i: seqs[i].tokens[start[i] : seqs[i].computed + 1] + after[i] for i in active}
        drafts: list[list[int]] = [[] for _ in seqs]
        while active:
            rows, owners, budget = [], [], self.budget
            for i in active:
                chunk = feed[i][: max(budget, 1)]
                budget -= len(chunk)
                end = start[i] + len(chunk)
                rows.append(Row(start[i], chunk, len(chunk) == len(feed[i]), self._table(seqs[i], end)))
                owners.append(i)
                if budget <= 0:
                    break
            logits = self.forward(rows)  # run even with nothing to pick: its chunks fill the draft's KV cache
            sampling = any(row.sample for row in rows)  # else only prompt chunks: nothing to pick yet
            picks = iter(logits[:, : self.n_words].argmax(-1).tolist() if sampling else [])
            for i, row in zip(owners, rows):
                start[i] += len(row.tokens)
                feed[i] = feed[i][len(row.tokens) :]
                if not row.sample:
                    continue
                token = next(picks)
                drafts[i].append(token)
                if len(drafts[i]) < rooms[i] and token not in self.stop_ids:
                    feed[i] = [token]
                else:
                    active.remove(i)
        for i, seq in enumerate(seqs):
            if rooms[i] > 0 and not self.shares_cache:  # written: up to the newest token, then the rest but the last draft
                self.seen[seq.id] = Seen(seq.computed + 1, after[i] + drafts[i][:-1], seq.preemptions)
        return drafts

    def _known(self, seq: Sequence) -> int:
        if self.shares_cache:
            return seq.computed
        seen = self.seen.get(seq.id)
        return seen.valid(seq) if seen is not None else 0

    def _table(self, seq: Sequence, positions: int) -> list[int]:
        return seq.blocks[: -(-positions // self.block_size)]

    def forget(self, seq_id: str) -> None:
        self.seen.pop(seq_id, None)


def load_draft(config: EngineConfig, tokenizer: Tokenizer,
               load: Callable[[EngineConfig], tuple[nn.Module, Tokenizer, ModelArgs, Preparation | None]]
               ) -> tuple[EngineConfig, nn.Module, ModelArgs, Preparation | None]:
    """The draft's settings and model on this rank, read by `load` (the served model's loader); a draft
    of another vocabulary is refused (CheckpointError naming both)."""
    settings = draft_config(config)
    try:
        model, draft_tokenizer, args, prepared = load(settings)
    except Exception as exc:  # the same type and attributes (every rank's failure), named as the draft's
        what = settings.ckpt_dir if config.draft_ckpt_dir else f"this checkpoint at {SELF_DRAFT_QUANTIZE}"
        exc.args = (f"the draft ({what}, speculative: draft): {exc.args[0] if exc.args else exc}", *exc.args[1:])
        raise
    check_same_vocabulary(tokenizer, draft_tokenizer, config.ckpt_dir, settings.ckpt_dir)
    return settings, model, args, prepared
