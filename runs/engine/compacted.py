"""The timeline's record of each compaction (llm/compaction.py): what a fold took out of the
conversation and the tokens before and after.

| operation | when |
|---|---|
| `record(run, seq, fold)` | the claim planned a model call whose request makes a fold |

A fold is made at a call point (the conversation's length when the call is planned), and the
same call point is planned again when its call is retried (a provider error, a fallback, a wait
for budget): the fold is the same, so it is recorded once, found by its call point. In the
claim's transaction with the run locked, so two claims cannot both record it.
"""

from __future__ import annotations

from llm.compaction import Fold
from llm.tokens import estimate_text
from runs.models import Run, RunEvent
from runs.transitions import record_event

KIND = "context_compacted"


def record(run: Run, seq: int, fold: Fold) -> None:
    if RunEvent.objects.filter(run_id=run.pk, kind=KIND, skeleton__contains={"at": fold.at}).exists():
        return
    seqs = [line.seq for line in fold.lines]
    folded = f"steps {min(seqs)}-{max(seqs)}" if seqs else "earlier turns"
    record_tokens = estimate_text(fold.record)
    after = fold.live_after + record_tokens
    record_event(
        run.pk,
        KIND,
        f"history compacted for step {seq}: {folded} ({fold.turns} model turns, {len(fold.lines)} tool "
        f"results) folded into a record of {record_tokens:,} tokens; the history they held went from "
        f"{fold.live_before:,} to {after:,} tokens (estimated)",
        step_seq=seq,
        at=fold.at,
        first_step=min(seqs) if seqs else None,
        last_step=max(seqs) if seqs else None,
        turns=fold.turns,
        results=len(fold.lines),
        tokens_before=fold.live_before,
        tokens_after=after,
        record_tokens=record_tokens,
    )
