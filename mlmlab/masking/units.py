"""Masking units of whole words: SpanBERT's spans and PMI-Masking's n-grams, cut from a batch on its device.

A unit strategy says, at each word start, how many words the unit beginning there would span
(``span_lengths``: a random length; ``NgramTable.lengths``: the longest vocabulary n-gram, else 1).
``unit_starts`` then cuts each run of words between special tokens into consecutive units, from
its first word: a unit of L words is followed by the one at the word L further on, never past
the run's end, so no unit crosses a special token or the end of a sequence. Selection itself
(exactly k positions, the last unit trimmed) is select.gumbel_top_k_units.

Word boundaries are the tokenizer's own (select.word_starts over continuation_table: WordPiece
"##", byte-level BPE "Ġ", Unigram "▁"), as whole-word masking reads them.
"""

import torch
import torch.nn.functional as F

from mlmlab.masking import seeding
from mlmlab.masking.select import unit_owner


def word_layout(starts: torch.Tensor, eligible: torch.Tensor):
    """(position, valid, run, end), each (B, W), W the most words in a row (at least 1), for word w of row b:
    its first position; whether row b has a word w; the run of words between special tokens it is in;
    the index of the first word after its run (or the row's word count)."""
    batch, length = starts.shape
    count = starts.sum(dim=1)  # (B,)
    width = max(int(count.max()) if batch else 0, 1)
    position = torch.argsort((~starts).to(torch.int8), dim=1, stable=True)[:, :width]  # (B, W) starts in order
    index = torch.arange(width, device=starts.device)
    valid = index[None, :] < count[:, None]  # (B, W)
    run = (~eligible).long().cumsum(dim=1).gather(1, position)  # (B, W) a special token begins a new run
    first_of_run = valid & F.pad(run[:, 1:] != run[:, :-1], (1, 0), value=True)  # (B, W)
    boundary = F.pad(first_of_run | ~valid, (0, 1), value=True)  # (B, W + 1): word w' begins a run, or is past
    candidate = torch.where(boundary, torch.arange(width + 1, device=starts.device), width)  # (B, W + 1)
    after = candidate.flip(1).cummin(dim=1).values.flip(1)  # (B, W + 1) first boundary at or after each
    return position, valid, run, after[:, 1:]


def unit_starts(starts: torch.Tensor, eligible: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: where units begin, each run of words cut into consecutive units from its first word.

    starts (B, T) bool: word starts (select.word_starts); lengths (B, T) long >= 1: at each word
    start, the words of the unit that would begin there. The chain "next unit = this one's start +
    its length, capped at the run's end" is followed by binary lifting (log2 W gathers, no loop
    over units): the m-th unit of a row begins at next^m(0), and m's bits pick the powers of next.
    """
    position, valid, _, end = word_layout(starts, eligible)
    width = position.size(1)
    index = torch.arange(width, device=starts.device)
    words = lengths.gather(1, position).clamp(min=1)  # (B, W)
    step = torch.where(valid, torch.minimum(index + words, end), width)  # (B, W) the next unit's first word
    jump = F.pad(step, (0, 1), value=width)  # (B, W + 1): past the end stays there
    reached = torch.zeros_like(jump)  # (B, W + 1) reached[m] = next^m(0), m = 0..W
    m = torch.arange(width + 1, device=starts.device)
    bit = 1
    while bit <= width:
        reached = torch.where((m & bit).bool(), jump.gather(1, reached), reached)
        jump = jump.gather(1, jump)
        bit <<= 1
    chained = torch.zeros_like(jump, dtype=torch.bool).scatter_(1, reached, True)[:, :width] & valid  # (B, W)
    return torch.zeros_like(starts).scatter_(1, position, chained)


def span_length_cdf(p: float, longest: int) -> torch.Tensor:
    """(longest,) float64: P(L <= l), l = 1..longest, of SpanBERT's span length in words.

    SpanBERT (Joshi et al. 2020, sec. 3.1) draws l ~ Geo(p = 0.2) "clipped at 10": its code renormalises
    p (1 - p)^(l - 1) over l = 1..10 (mean 3.8 words, as the paper says), rather than moving the tail's
    mass to 10 (which would give a mean of 4.5). This is that distribution.
    """
    mass = torch.tensor([p * (1 - p) ** (length - 1) for length in range(1, longest + 1)], dtype=torch.float64)
    return (mass / mass.sum()).cumsum(dim=0)


def span_lengths(u: torch.Tensor, p: float, longest: int) -> torch.Tensor:
    """(B, T) long in [1, longest]: span lengths in words from uniforms u (B, T), by the inverse CDF.

    Comparisons with a float64 table only (no log of u): the same draw on every device.
    """
    cdf = span_length_cdf(p, longest).to(u.device)
    return (torch.bucketize(u.double(), cdf[:-1]) + 1).long()


def drawn_span_lengths(seed: int, example_ids, epoch_keys, length: int, p: float, longest: int) -> torch.Tensor:
    """(B, T) long: the length of the span that would begin at each position, a function of
    (seed, example, epoch key, position) only (seeding.STREAM_SPAN)."""
    u = seeding.uniforms(seed, [seeding.STREAM_SPAN], example_ids, epoch_keys, length)[0]  # (B, T)
    return span_lengths(u, p, longest)


# ----- n-grams of whole words, matched by hash ----------------------------------------------------
_LANES = (0x2545F491, 0x4F1BBCDD)  # two independent 32-bit hashes make one 62-bit key: false matches ~2**-62 each


def ngram_keys(ids: torch.Tensor, starts: torch.Tensor, eligible: torch.Tensor, longest: int):
    """(keys, ok), each (longest, B, W): the 62-bit key of the n-gram of words w..w+n-1 (n = 1..longest,
    along dim 0), and whether those words exist in one run. ``ids`` (B, T).

    A word's key hashes its pieces with their offsets in the word; an n-gram's folds its words' in order.
    The vocabulary is keyed by this same function (NgramTable), so a match means the same token ids.
    """
    owner, member = unit_owner(starts, eligible)
    offset = torch.arange(ids.size(1), device=ids.device) - owner  # (B, T)
    position, valid, run, _ = word_layout(starts, eligible)
    width = position.size(1)
    lanes = []
    for salt in _LANES:
        piece = seeding.absorb(seeding.absorb(salt, ids.long()), offset)  # (B, T) < 2**32
        summed = torch.zeros_like(piece).scatter_add_(1, owner, torch.where(member, piece, 0))  # (B, T) at starts
        word = seeding.mix32(summed ^ (summed >> 32)).gather(1, position)  # (B, W)
        grams = [word]
        for n in range(1, longest):
            later = word.gather(1, (torch.arange(width, device=ids.device) + n).clamp(max=width - 1).expand_as(word))
            grams.append(seeding.absorb(grams[-1], later))
        lanes.append(torch.stack(grams))  # (longest, B, W)
    keys = (lanes[0] << 30) ^ lanes[1]  # (longest, B, W)
    index = torch.arange(width, device=ids.device)
    ok = []
    for n in range(longest):
        last = (index + n).clamp(max=width - 1).expand_as(run)
        ok.append(valid & (index + n < width) & valid.gather(1, last) & (run.gather(1, last) == run))
    return keys, torch.stack(ok)


class NgramTable:
    """The PMI n-gram vocabulary as 62-bit keys, and the longest match at each word of a batch."""

    def __init__(self, ngrams: list[list[list[int]]], longest: int):
        """``ngrams``: each n-gram as its words, each word as its token ids; ``longest``: the most words of one."""
        self.longest = longest
        self.keys = torch.sort(self._keys_of(ngrams)).values if ngrams else torch.zeros(0, dtype=torch.long)

    def _keys_of(self, ngrams: list[list[list[int]]]) -> torch.Tensor:
        """(N,) the key of each n-gram, laid out as one row per n-gram and keyed by ngram_keys."""
        rows = [[token for word in gram for token in word] for gram in ngrams]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        starts = torch.zeros(len(rows), width, dtype=torch.bool)
        eligible = torch.zeros(len(rows), width, dtype=torch.bool)
        for row, gram in enumerate(ngrams):
            at = 0
            for word in gram:
                starts[row, at] = True
                ids[row, at : at + len(word)] = torch.tensor(word)
                at += len(word)
            eligible[row, :at] = True
        keys, _ = ngram_keys(ids, starts, eligible, self.longest)  # (longest, N, W)
        words = torch.tensor([len(gram) for gram in ngrams])  # (N,)
        return keys[words - 1, torch.arange(len(ngrams)), 0]

    def lengths(self, ids: torch.Tensor, starts: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
        """(B, T) long: at each word start, the words of the longest vocabulary n-gram beginning there, else 1."""
        keys, ok = ngram_keys(ids, starts, eligible, self.longest)  # (longest, B, W)
        table = self.keys.to(ids.device)
        found = torch.isin(keys, table) & ok  # (longest, B, W)
        found[0] = True  # a single word is always a unit
        n = torch.arange(1, self.longest + 1, device=ids.device)[:, None, None]
        words = (found * n).amax(dim=0)  # (B, W) the longest match
        position, _, _, _ = word_layout(starts, eligible)
        return torch.ones_like(ids).scatter_(1, position, words)
