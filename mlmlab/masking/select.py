"""The one selection mechanism every masking strategy shares.

A strategy only decides per-position weights; this module turns weights into exactly
k selected positions per sequence (Gumbel-top-k = weighted sampling without
replacement) and corrupts them 80/10/10. Uniform weights give BERT/RoBERTa masking.
``mask_batch`` is the entry: training (masker.py), the fixed evaluation masks and
``mlmlab mask`` / ``dump`` all mask through it.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mlmlab.data.tokenizer import ordinary_token_ids, special_ids, word_marker
from mlmlab.masking import seeding
from mlmlab.model.pretraining import IGNORE_INDEX


@dataclass(frozen=True)
class TokenInfo:
    """What masking needs to know about the vocabulary."""

    mask_id: int
    special_ids: tuple[int, ...]  # never selected: the tokenizer's special ids ([CLS] or <s>, [PAD] or <pad>, ...)
    ordinary_ids: torch.Tensor  # (V_ord,) random replacements come only from these


@dataclass(frozen=True)
class Corruption:
    """How selected positions are shown to the model (BERT: 80% [MASK], 10% random, 10% kept)."""

    mask_prob: float = 0.8
    random_prob: float = 0.1


def token_info_for(tokenizer, mask_unk: bool = False) -> TokenInfo:
    """TokenInfo from a HF tokenizer: its own special ids (named and added), whatever their names; its unknown
    token is excluded from selection unless ``mask_unk``."""
    specials = special_ids(tokenizer) | {
        tokenizer.cls_token_id,
        tokenizer.sep_token_id,
        tokenizer.pad_token_id,
        tokenizer.mask_token_id,
        tokenizer.unk_token_id,
    }
    if mask_unk:
        specials.discard(tokenizer.unk_token_id)
    specials.discard(None)  # a tokenizer without an unknown token (byte-level BPE needs none)
    return TokenInfo(
        mask_id=tokenizer.mask_token_id,
        special_ids=tuple(sorted(specials)),
        ordinary_ids=torch.as_tensor(ordinary_token_ids(tokenizer), dtype=torch.long),
    )


def eligible_positions(input_ids: torch.Tensor, special_ids: tuple[int, ...]) -> torch.Tensor:
    """(B, T) bool: positions that may be selected (not a special token, not padding)."""
    specials = torch.tensor(special_ids, device=input_ids.device)
    return ~torch.isin(input_ids, specials)


def count_to_select(eligible: torch.Tensor, rate) -> torch.Tensor:
    """(B,) long: k = round(rate * eligible), at least 1 when anything is eligible.

    ``rate`` is a float or a (B,) tensor. The minimum of one follows google-research/bert:
    a short sequence still yields a prediction.
    """
    n = eligible.sum(dim=1)  # (B,)
    k = torch.round(torch.as_tensor(rate, dtype=torch.float32, device=n.device) * n).long()
    return torch.minimum(k.clamp(min=1), n)


def gumbel_top_k(weights: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: k[b] eligible positions of row b, drawn without replacement with P ∝ weights.

    Adding Gumbel noise to log-weights and keeping the k largest keys is exactly
    sequential weighted sampling without replacement (Vieira 2014; Kool et al. 2019).
    """
    gumbel = -torch.log(-torch.log(u))  # (B, T)
    keys = torch.log(weights.clamp(min=1e-30)) + gumbel  # (B, T)
    keys = keys.masked_fill(~eligible, float("-inf"))
    order = keys.argsort(dim=1, descending=True)  # (B, T)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.size(1), device=order.device).expand_as(order))
    return (rank < k[:, None]) & eligible


def group_quotas(counts: torch.Tensor, k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B, G) long: each group's share of the row's k, k_g = k * n_g / n rounded without bias.

    counts (B, G): n_g, the eligible positions of group g in the row; n = their sum; k (B,);
    u (B,) one uniform per row. Systematic rounding: k_g = floor(C_g + u) - floor(C_{g-1} + u)
    over the cumulative quotas C_g = k * (n_0 + ... + n_g) / n, C_{-1} = 0. The sum telescopes
    to floor(k + u) - floor(u) = k exactly; E[floor(x + u)] = x gives E[k_g] = k * n_g / n;
    and each k_g is the floor or the ceiling of k * n_g / n, so never above n_g (k <= n).
    """
    cumulative = F.pad(counts.cumsum(dim=1), (1, 0))  # (B, G + 1), leading C_{-1} = 0
    n = counts.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    # float64: k * cumulative / n + u must not round across an integer (u is within 2**-25 of 1)
    edges = torch.floor(k[:, None].double() * cumulative / n + u.double()[:, None]).long()  # (B, G + 1)
    return edges.diff(dim=1)  # (B, G)


def gumbel_top_k_grouped(
    weights: torch.Tensor,
    eligible: torch.Tensor,
    groups: torch.Tensor,
    k: torch.Tensor,
    u: torch.Tensor,
    u_quota: torch.Tensor,
) -> torch.Tensor:
    """(B, T) bool: per row, group_quotas' k_g positions of each group g, drawn within g with P ∝ weights.

    groups (B, T) long in [0, G), read at eligible positions only; u (B, T) the selection
    uniforms, u_quota (B,) one per row. Inside a group this is gumbel_top_k with k_g: the
    weights decide which positions of a group are targets, never how many.
    """
    num_groups = int(groups.max()) + 1 if groups.numel() else 1
    group = torch.where(eligible, groups.clamp(0, num_groups - 1), num_groups)  # (B, T) ineligible: group G, last
    sizes = torch.zeros(group.size(0), num_groups + 1, dtype=torch.long, device=group.device)
    sizes.scatter_add_(1, group, torch.ones_like(group))  # (B, G + 1)
    quotas = F.pad(group_quotas(sizes[:, :-1], k, u_quota), (0, 1))  # (B, G + 1): none from the ineligible
    starts = F.pad(sizes.cumsum(dim=1)[:, :-1], (1, 0))  # (B, G + 1) where each group begins in the order below
    keys = torch.log(weights.clamp(min=1e-30)) - torch.log(-torch.log(u))  # (B, T)
    by_key = torch.sort(keys, dim=1, descending=True, stable=True).indices  # (B, T)
    by_group = torch.sort(group.gather(1, by_key), dim=1, stable=True).indices  # (B, T) keeps key order in a group
    order = by_key.gather(1, by_group)  # (B, T) positions by (group, key descending)
    sorted_group = group.gather(1, order)  # (B, T)
    rank = torch.arange(order.size(1), device=order.device) - starts.gather(1, sorted_group)  # (B, T) rank in group
    take = rank < quotas.gather(1, sorted_group)  # (B, T)
    return torch.zeros_like(eligible).scatter_(1, order, take)


def continuation_table(vocab, marker: str = "##", begins: bool = False) -> torch.Tensor:
    """(V,) bool per vocabulary id: True for the pieces that continue a word, by the tokenizer's own convention.

    ``vocab`` is a tokenizer (anything with ``get_vocab()``: its convention is read from it,
    data/tokenizer.word_marker: WordPiece "##" continues a word, byte-level BPE "Ġ" and
    SentencePiece "▁" begin one), a token -> id mapping, or a list of tokens in id order (then
    ``marker`` opens a continuation piece, or with ``begins`` a word's first piece). Index it with
    input_ids to get a batch's (B, T) mask; a special token's entry is never read (never eligible).
    """
    if hasattr(vocab, "get_vocab"):
        marker, begins = word_marker(vocab)
        vocab = vocab.get_vocab()
    if not isinstance(vocab, dict):
        vocab = {token: index for index, token in enumerate(vocab)}
    table = torch.zeros(max(vocab.values()) + 1, dtype=torch.bool)
    for token, index in vocab.items():
        table[index] = token.startswith(marker) != begins
    return table


def word_starts(eligible: torch.Tensor, is_continuation: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: eligible tokens that begin a word; a continuation piece after a special token starts one."""
    prev_eligible = torch.zeros_like(eligible)
    prev_eligible[:, 1:] = eligible[:, :-1]
    return eligible & ~(is_continuation & prev_eligible)


def unit_owner(starts: torch.Tensor, eligible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner, member), both (B, T): the position of the unit start each position belongs to (the last start at
    or before it; 0 where none), and whether it is an eligible position inside a unit. ``starts``: (B, T) bool."""
    positions = torch.arange(starts.size(1), device=starts.device).expand_as(starts)
    owner = torch.where(starts, positions, torch.full_like(positions, -1)).cummax(dim=1).values  # (B, T)
    member = eligible & (owner >= 0)  # (B, T) tokens that belong to a unit
    return owner.clamp(min=0), member


def gumbel_top_k_units(weights, eligible, unit_starts, k, u) -> torch.Tensor:
    """(B, T) bool: exactly k[b] positions of row b, as whole units taken in a random order, the last one trimmed.

    A unit runs from a start in ``unit_starts`` (B, T) bool to the next start or ineligible position
    (units.unit_starts: spans, PMI n-grams); every eligible position must belong to one. Units are
    ranked by Gumbel keys of their mean piece weight (uniform weights: every unit equally likely,
    whatever its length, so the lengths of the units taken follow those drawn) and taken in that
    order until k tokens are; the unit that crosses k keeps only its first k - (tokens before it)
    tokens. So the count is exactly k, and at most one unit per sequence is cut short (it may then
    end inside a word).
    """
    owner, member = unit_owner(unit_starts, eligible)
    length = torch.zeros_like(owner).scatter_add_(1, owner, member.long())  # (B, T) tokens, at unit starts
    total = torch.zeros_like(weights, dtype=torch.float32).scatter_add_(1, owner, torch.where(member, weights, 0.0))
    unit_weight = total / length.clamp(min=1)  # (B, T) mean piece weight, at unit starts
    keys = torch.log(unit_weight.clamp(min=1e-30)) - torch.log(-torch.log(u))  # (B, T)
    keys = keys.masked_fill(~unit_starts, float("-inf"))
    order = keys.argsort(dim=1, descending=True)  # (B, T) unit starts first, best key first
    sorted_length = length.gather(1, order) * unit_starts.gather(1, order)  # (B, T)
    before = sorted_length.cumsum(dim=1) - sorted_length  # (B, T) tokens taken before each unit
    take = torch.minimum((k[:, None] - before).clamp(min=0), sorted_length)  # (B, T) tokens taken from each
    taken = torch.zeros_like(take).scatter_(1, order, take)  # (B, T) at unit starts
    offset = torch.arange(owner.size(1), device=owner.device) - owner  # (B, T) position inside its unit
    return member & (offset < taken.gather(1, owner))


def gumbel_top_k_words(weights, eligible, is_continuation, k, u) -> torch.Tensor:
    """(B, T) bool: whole words drawn without replacement, P ∝ mean weight of their pieces.

    Words are ranked by Gumbel keys (uniform weights: every word equally likely, as in
    google-research/bert's whole-word masking) and taken in that order while the token
    count gets closer to k[b], so counts stay within half a word of round(rate * eligible).
    """
    length_t = eligible.size(1)
    starts = word_starts(eligible, is_continuation)  # (B, T)
    owner, member = unit_owner(starts, eligible)
    length = torch.zeros_like(weights, dtype=torch.float32).scatter_add_(1, owner, member.float())  # (B, T) at starts
    total = torch.zeros_like(length).scatter_add_(1, owner, torch.where(member, weights.float(), 0.0))
    word_weight = total / length.clamp(min=1)  # (B, T) mean piece weight, at word starts
    keys = torch.log(word_weight.clamp(min=1e-30)) - torch.log(-torch.log(u))  # (B, T)
    keys = keys.masked_fill(~starts, float("-inf"))
    order = keys.argsort(dim=1, descending=True)  # (B, T)
    is_word = starts.gather(1, order)
    sorted_length = length.gather(1, order) * is_word  # (B, T)
    after = sorted_length.cumsum(dim=1)
    before = after - sorted_length
    kf = k[:, None].float()
    first = (torch.arange(length_t, device=order.device) == 0)[None, :] & (kf >= 1)
    take = is_word & (before < kf) & ((after <= kf) | (after - kf <= kf - before) | first)  # (B, T)
    chosen = torch.zeros_like(starts).scatter_(1, order, take)  # (B, T) chosen word starts
    return chosen.gather(1, owner) & member


def corrupt(input_ids, selected, u_action, u_token, info: TokenInfo, corruption: Corruption):
    """Apply 80/10/10 to selected positions; returns (masked input_ids, labels), both (B, T)."""
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    to_mask = selected & (u_action < corruption.mask_prob)
    to_random = selected & ~to_mask & (u_action < corruption.mask_prob + corruption.random_prob)
    ordinary = info.ordinary_ids.to(input_ids.device)
    random_ids = ordinary[(u_token * len(ordinary)).long().clamp(max=len(ordinary) - 1)]  # (B, T)
    masked = torch.where(to_mask, torch.full_like(input_ids, info.mask_id), input_ids)
    masked = torch.where(to_random, random_ids, masked)
    return masked, labels


def select_and_corrupt(
    input_ids,
    example_ids,
    epoch_keys,
    *,
    seed,
    rate,
    info,
    corruption,
    weights=None,
    eligible=None,
    is_continuation=None,
    groups=None,
    unit_starts=None,
):
    """Masks for a batch as a pure function of (seed, example, epoch key, position).

    input_ids (B, T); example_ids, epoch_keys (B,); weights (B, T) or None for uniform;
    is_continuation (B, T) bool or None: when given, whole words are selected;
    groups (B, T) long or None: when given, each group gets its proportional share of the
    k targets (gumbel_top_k_grouped); not with is_continuation;
    unit_starts (B, T) bool or None: when given, exactly k positions are selected as whole units
    (gumbel_top_k_units), whatever is_continuation says.
    Returns (masked input_ids, labels, selected), all (B, T).
    """
    batch, length = input_ids.shape
    if eligible is None:
        eligible = eligible_positions(input_ids, info.special_ids)
    if weights is None:
        weights = torch.ones(batch, length, device=input_ids.device)
    draws = dict(
        zip(seeding.MASK_STREAMS, seeding.uniforms(seed, seeding.MASK_STREAMS, example_ids, epoch_keys, length))
    )
    k = count_to_select(eligible, rate)  # (B,)
    if groups is not None and is_continuation is not None:
        raise ValueError("per-group quotas count tokens; they do not combine with whole-word selection")
    if unit_starts is not None:
        selected = gumbel_top_k_units(weights, eligible, unit_starts, k, draws[seeding.STREAM_SELECT])
    elif groups is not None:
        u_quota = seeding.row_uniforms(seed, seeding.STREAM_QUOTA, example_ids, epoch_keys)  # (B,)
        selected = gumbel_top_k_grouped(weights, eligible, groups, k, draws[seeding.STREAM_SELECT], u_quota)
    elif is_continuation is None:
        selected = gumbel_top_k(weights, eligible, k, draws[seeding.STREAM_SELECT])
    else:
        selected = gumbel_top_k_words(weights, eligible, is_continuation, k, draws[seeding.STREAM_SELECT])
    masked, labels = corrupt(
        input_ids, selected, draws[seeding.STREAM_ACTION], draws[seeding.STREAM_TOKEN], info, corruption
    )
    return masked, labels, selected


def mask_batch(
    batch: dict,
    *,
    seed: int,
    epoch_key: int,
    rate,
    info: TokenInfo,
    corruption: Corruption,
    weights=None,
    groups=None,
    whole_word: bool = False,
    continuation: torch.Tensor | None = None,
    unit_starts: torch.Tensor | None = None,
) -> dict:
    """A copy of ``batch`` with masked ``input_ids`` and ``labels`` (original ids, -100 elsewhere).

    groups: (B, T) long or None; each group keeps its proportional share of the targets
    (strategy.selection_groups: frequency-neutral ADM).
    whole_word: select whole words; "##" pieces come from batch["is_continuation"] (B, T) if
    present, else from ``continuation``, the (V,) per-id table of continuation_table.
    unit_starts: (B, T) bool or None; where each unit of whole words begins (strategy.selection_units: span,
    pmi): exactly k positions are then drawn as units, the last one trimmed (gumbel_top_k_units).
    """
    example_ids = batch["example_ids"]  # (B,)
    epoch_keys = torch.full_like(example_ids, epoch_key)
    is_continuation = None
    if whole_word:
        is_continuation = batch.get("is_continuation")
        if is_continuation is None:
            if continuation is None:
                raise ValueError(
                    "whole_word masking needs batch['is_continuation'] or continuation=continuation_table(vocab)"
                )
            is_continuation = continuation.to(batch["input_ids"].device)[batch["input_ids"]]  # (B, T)
    masked, labels, _ = select_and_corrupt(
        batch["input_ids"],
        example_ids,
        epoch_keys,
        seed=seed,
        rate=rate,
        info=info,
        corruption=corruption,
        weights=weights,
        is_continuation=is_continuation,
        groups=groups,
        unit_starts=unit_starts,
    )
    return {**batch, "input_ids": masked, "labels": labels}
