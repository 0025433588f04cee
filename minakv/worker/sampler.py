"""Turning logits into tokens for the whole batch at once, on the device: greedy, temperature, top-k, top-p,
min-p, per-request seeds, logprobs.

Sampling is Gumbel-max: with E_i ~ Exp(1) independent, argmax_i (log p_i - log E_i) is distributed as p (the
"exponential race": token i arrives at time E_i / p_i, and the first arrival is i with probability p_i). So
a draw is one elementwise pass and one argmax per row, with no per-row cumulative sum or inverse CDF.

The noise is counter-based: E for (request seed, output index, vocabulary id) is a fixed integer hash of
those three numbers, turned into a uniform u in (0, 1) and then E = -log(1 - u). No generator state is
carried from step to step and nothing is drawn for the batch as a whole, so a row's noise, and thus its
token, depend only on its own logits, seed and position: a seeded request gives the same tokens alone or in
any batch, at any place in it. A request without a seed gets one drawn once by its caller
(`secrets.randbits(63)`) and kept for its lifetime, so it too is one fixed stream.

Filtering is a per-row threshold on the temperature-scaled logits z = logits / T, in this order: top-k keeps
the k largest; top-p keeps the smallest prefix of the sorted (top-k renormalised) distribution whose mass
reaches top_p (the first token always stays); min-p keeps z >= max z + log(min_p), i.e. p >= min_p * p_max.
Tokens tied with the last kept one are kept too. The sort runs only when some row asks for top-k or top-p.

Before any of that, a row's logit bias is added and its penalties applied (repetition, presence, frequency:
minakv/worker/penalties.py keeps each penalised request's token counts on the device), on a copy. Last, the
rows with a grammar (structured outputs) get their token mask: one bitmask for the step, filled on the host
by the matchers (minakv/grammar/matcher.py), unpacked and applied to all those rows at once; a disallowed
token's logit becomes -inf, so greedy and sampled rows alike pick an allowed one.

Logprobs are those of the model's own distribution (log-softmax of the raw logits), as OpenAI reports them.
The host reads everything back in one transfer at the end of the step (`sample_to_host`).
"""

from __future__ import annotations

import torch

from minakv.ops.sampling import gumbel_argmax_triton
from minakv.ops.top_p import top_p_threshold_triton
from minakv.ops.triton_util import use_triton
from minakv.outputs import TokenLogprob
from minakv.params import SamplingParams
from minakv.worker.penalties import PenaltyTables
from minakv.worker.sampling_tensors import GOLDEN, MASK32, MIX1, MIX2, SamplingTensors, mix32

_vocab_hash: dict[tuple[int, torch.device], torch.Tensor] = {}


def neg_log_exponential(key: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] float32: -log E for E ~ Exp(1), a pure function of (row key, vocabulary id)."""
    cache = (vocab, key.device)
    if cache not in _vocab_hash:  # the per-id half of the hash does not change from step to step
        _vocab_hash[cache] = mix32(torch.arange(vocab, device=key.device, dtype=torch.int64) * GOLDEN)
    x = _vocab_hash[cache][None, :] ^ key[:, None]
    x ^= x >> 16
    x.mul_(MIX1).bitwise_and_(MASK32)
    x ^= x >> 15
    x.mul_(MIX2).bitwise_and_(MASK32)
    x ^= x >> 16
    # u in (0, 1): fine-grained near 0, where E = -log1p(-u) ~ u is small and the noise large; capped below
    # 1 so that E > 0 stays finite and a lone kept token always wins.
    u = x.float().add_(0.5).mul_(2.0**-32).clamp_(max=1.0 - 2.0**-24)
    return u.neg_().log1p_().neg_().log_().neg_()


def thresholds(z: torch.Tensor, t: SamplingTensors) -> torch.Tensor | None:
    """[R, 1] float32: the smallest z a row keeps under its top-k, top-p and min-p, or None (keep all)."""
    if not t.filters:
        return None
    rows = z.shape[0]
    thr = torch.full((rows, 1), float("-inf"), device=z.device)
    if t.any_top_k and (use_triton(z) or not t.any_top_p):  # a partial selection, no sort
        width = min(t.max_top_k, z.shape[-1])
        top = torch.topk(z, width).values
        k = t.top_k.clamp(min=1, max=width)[:, None]
        thr = torch.where((t.top_k > 0)[:, None], top.gather(1, k - 1), thr)
    if t.any_top_p:
        if use_triton(z):  # a search for the threshold (docs in minakv/ops/top_p.py): no sort
            thr = torch.maximum(thr, top_p_threshold_triton(z, thr, t.top_p))
        else:
            thr = torch.maximum(thr, top_p_threshold_sorted(z, t))
    if t.any_min_p:
        log_min_p = torch.where(t.min_p > 0, t.min_p.log(), float("-inf"))[:, None]
        thr = torch.maximum(thr, z.amax(dim=-1, keepdim=True) + log_min_p)
    return thr


def top_p_threshold_sorted(z: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """[R, 1]: the top-k and top-p threshold from the sorted row (the reference the kernel is tested
    against): keep a token while the mass strictly before it is < top_p of the top-k total (so the first
    token always stays); rows without top-p get their top-k threshold."""
    width = z.shape[-1]
    sorted_z = torch.sort(z, dim=-1, descending=True).values
    has_k = (t.top_k > 0)[:, None]
    k = torch.where(has_k, t.top_k.clamp(min=1, max=width)[:, None], width)
    thr = torch.where(has_k, sorted_z.gather(1, k - 1), float("-inf"))
    col = torch.arange(width, device=z.device)[None, :]
    e = (sorted_z - sorted_z[:, :1].nan_to_num(neginf=0.0)).exp_().masked_fill_(col >= k, 0.0)
    cum = e.cumsum(dim=-1)
    total = cum[:, -1:]
    count = (cum.sub_(e) < t.top_p[:, None] * total).sum(dim=-1, keepdim=True).clamp_(min=1)
    thr_p = sorted_z.gather(1, torch.minimum(count, k) - 1)
    return torch.where(t.top_p[:, None] < 1.0, torch.maximum(thr, thr_p), thr)


def adjust(logits: torch.Tensor, t: SamplingTensors, tables: PenaltyTables | None) -> torch.Tensor:
    """The logits sampling draws from: the logit bias added, then the penalties, then the grammar masks (a
    copy; the raw logits still give the logprobs)."""
    if t.bias is None and t.penalty_rows is None and t.token_mask is None:
        return logits
    logits = logits.clone()
    if t.bias is not None:
        logits.index_put_(t.bias[:2], t.bias[2], accumulate=True)
    if t.penalty_rows is not None and tables is not None:
        logits = tables.apply(logits, t.penalty_rows, *t.penalties)
    if t.token_mask is not None:  # last, so nothing above can re-allow a token
        rows = logits.index_select(0, t.mask_rows)
        rows.masked_fill_(~allowed(t.token_mask, logits.shape[-1]), float("-inf"))
        logits.index_copy_(0, t.mask_rows, rows)
    return logits


_bit_shifts: dict[torch.device, torch.Tensor] = {}


def allowed(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A bitmask [G, ceil(V / 32)] int32 -> [G, V] bool: token 32 w + j is allowed iff bit j of word w is
    set."""
    if mask.device not in _bit_shifts:
        _bit_shifts[mask.device] = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask[:, :, None] >> _bit_shifts[mask.device]) & 1  # arithmetic shift; & 1 keeps the one bit
    return bits.view(mask.shape[0], -1)[:, :vocab].bool()


def sample(logits: torch.Tensor, t: SamplingTensors, tables: PenaltyTables | None = None) -> torch.Tensor:
    """logits [R, V] -> [R] int64 token ids on the device, with no host sync. `tables`: the penalty tables,
    when some row has a penalty."""
    logits = adjust(logits.float(), t, tables)
    if t.all_greedy:
        return logits.argmax(dim=-1)
    # Subtract the row max before dividing, so a tiny temperature cannot overflow to inf (and inf - inf).
    top = logits.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    if use_triton(logits) and not t.filters:  # the kernel scales the logits itself: z never materialised
        drawn = gumbel_argmax_triton(logits, t.key, None, shift=top, temperature=t.temperature)
    else:
        z = (logits - top).div_(t.temperature[:, None])
        thr = thresholds(z, t)
        if use_triton(z):
            drawn = gumbel_argmax_triton(z, t.key, thr)
        else:
            score = neg_log_exponential(t.key, z.shape[-1])
            if thr is not None:
                score.masked_fill_(z < thr, float("-inf"))
            score.add_(z)  # log p + Gumbel noise, up to a per-row constant that does not move the argmax
            drawn = score.argmax(dim=-1)
    # the greedy rows' raw argmax: a read of all the logits, so only when some row is greedy
    return torch.where(t.greedy, logits.argmax(dim=-1), drawn) if t.any_greedy else drawn


def sample_to_host(
    logits: torch.Tensor, t: SamplingTensors, params: list[SamplingParams]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Tokens and logprob records of one step, read back to the host in a single transfer."""
    return unpack(sample_packed(logits, t)[1].tolist(), params, t.max_logprobs)


def sample_packed(
    logits: torch.Tensor, t: SamplingTensors, tables: PenaltyTables | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's results still on the device: tokens [R] int64, and everything the host needs packed into one
    float64 [R, C] tensor (token, chosen logprob, top ids, top logprobs; ids < 2**53 are exact), so a caller
    can start its one copy to the host and wait for it later. `unpack` reads it."""
    tokens = sample(logits, t, tables)
    if t.penalty_rows is not None and tables is not None:
        tables.record(t.penalty_rows, tokens)  # the next step's counts include this token
    cols = [tokens[:, None].double()]
    if t.needs_logprobs:
        lp = torch.log_softmax(logits.float(), dim=-1)
        cols.append(lp.gather(1, tokens[:, None]).double())
        if t.max_logprobs > 0:
            values, ids = torch.topk(lp, t.max_logprobs, dim=-1)
            cols += [ids.double(), values.double()]
    return tokens, torch.cat(cols, dim=1)


def unpack(
    packed: list[list[float]], params: list[SamplingParams], max_logprobs: int
) -> tuple[list[int], list[TokenLogprob | None]]:
    """`sample_packed`'s tensor, as a list on the host -> token ids and per-row logprob records (each row's
    top list sliced to what it asked for)."""
    tokens = [int(row[0]) for row in packed]
    records: list[TokenLogprob | None] = []
    n = max_logprobs
    for row, p in zip(packed, params):
        if p.logprobs is None or len(row) == 1:
            records.append(None)
            continue
        top = [(int(i), v) for i, v in zip(row[2 : 2 + p.logprobs], row[2 + n : 2 + n + p.logprobs])]
        records.append(TokenLogprob(int(row[0]), row[1], top))
    return tokens, records
