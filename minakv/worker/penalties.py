"""Repetition, presence and frequency penalties on the device, without resending a request's history.

Each running request that asks for a penalty holds one row of two [rows, V] tables on the device: how many
times each token occurs in its output so far (`counts`), and whether it occurs in its prompt (`seen`). The
row is filled once, when the request is admitted (from its prompt, plus its output if it was preempted),
and after that every step adds the token it just sampled, which is already on the device. So a step sends
only which row each sampled row reads, never the history, and the tables cost nothing until some request
asks for a penalty.

The formulas are vLLM's (and OpenAI's for presence and frequency), applied to the raw logits:

    logit -= presence * (count > 0) + frequency * count                    output tokens only
    logit  = logit / r if logit > 0 else logit * r                         tokens of the prompt or output
"""

from __future__ import annotations

import torch


class PenaltyTables:
    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
        self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)

    def reset(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Start row `row` for a request with this prompt and output so far."""
        device = self.counts.device
        self.counts[row].zero_()
        self.seen[row].zero_()
        if prompt_ids:
            self.seen[row, torch.tensor(prompt_ids, dtype=torch.int64).to(device)] = True
        if output_ids:
            ids = torch.tensor(output_ids, dtype=torch.int64).to(device)
            self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def apply(
        self,
        logits: torch.Tensor,  # [R, V] float32, changed in place on the penalised rows
        rows: torch.Tensor,  # [R] int64: each sample row's table row, -1 for none
        presence: torch.Tensor,  # [R] float32
        frequency: torch.Tensor,  # [R] float32
        repetition: torch.Tensor,  # [R] float32
    ) -> torch.Tensor:
        on = rows >= 0
        table = rows.clamp(min=0)
        counts = self.counts.index_select(0, table).float()  # [R, V]; rows without a penalty are masked
        occurs = counts > 0
        logits -= torch.where(on[:, None], presence[:, None] * occurs + frequency[:, None] * counts, 0.0)
        r = torch.where(on, repetition, 1.0)[:, None]
        hit = (occurs | self.seen.index_select(0, table)) & on[:, None]
        return torch.where(hit, torch.where(logits > 0, logits / r, logits * r), logits)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each sampled token in its row (sample rows without a table row are skipped)."""
        on = rows >= 0
        ones = on.to(torch.int32)
        self.counts.index_put_((rows.clamp(min=0), tokens), ones, accumulate=True)
