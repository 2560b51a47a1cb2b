"""Turn tokenized documents into training instances: NSP pairs or packed MLM blocks.

A document here is a list of segments (sentences), each a list of token ids with no
special tokens; `doc_ids` gives each document's global index in corpus order.

NSP follows google-research/bert's `create_instances_from_document` with its known
problems fixed:
- a random B always comes from a *different* document (BERT retries 10 times and may
  keep the same document while still labelling B "random");
- the target length is drawn per instance, not once per document, so `short_seq_prob`
  is the share of short *instances* as the BERT README describes;
- half the *emitted* pairs are random (BERT forces "random" for one-segment chunks: 55%
  on the Wikipedia sample). The label is a fair coin per attempt that nothing overrides,
  and every attempt emits exactly one pair; then, by Wald's identity, the expected
  numbers of random and real pairs are equal however many attempts a document takes.
  (A random B puts A's unused segments back, as BERT does: that changes the number of
  attempts, not the balance.) Emitting one pair per attempt needs both kinds to be
  possible, so a document with one segment (no real B) or without another document to
  draw from (no random B) is never A; it can still be drawn as a random B. Format 1 let
  a one-sentence document give A + random B and nothing when the coin said "real":
  50.4% random on enwiki valid, 62.7% when every paragraph is its own document;
- no instance exceeds max_seq_length counting [CLS] and both [SEP].

The MLM objective uses RoBERTa's FULL-SENTENCES packing: whole sentences fill blocks of
up to max_seq_length - 2 tokens and may cross document boundaries, with a [SEP] between
documents, so almost no position is padding. A sentence longer than a block is cut to
the block size (BERT truncates long pairs the same way).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

IS_NEXT = 0  # HuggingFace convention: label 0 = B really follows A
RANDOM_NEXT = 1
NO_NSP_LABEL = -1  # mlm objective: there is no sentence pair

Document = list[list[int]]  # segments (sentences) of token ids, no special tokens


@dataclass(frozen=True)
class Instance:
    input_ids: list[int]  # [CLS] A [SEP] B [SEP] (nsp) or [CLS] block [SEP] (mlm)
    a_len: int  # length of "[CLS] A [SEP]": token_type_ids are 0 there and 1 after
    next_sentence_label: int  # IS_NEXT, RANDOM_NEXT or NO_NSP_LABEL
    doc_a: int  # global index of A's document (mlm: the block's first document)
    doc_b: int  # global index of B's document (mlm: the block's last document)
    seg_a: tuple[int, int]  # [start, end) segment indices of A within doc_a
    seg_b: tuple[int, int]  # [start, end) segment indices of B within doc_b


@dataclass(frozen=True)
class _Span:
    """Segments [start, end) of documents[doc_pos], before truncation."""

    doc_pos: int
    start: int
    end: int


def create_nsp_instances(
    documents: list[Document],
    doc_ids: list[int],
    max_seq_length: int,
    short_seq_prob: float,
    cls_id: int,
    sep_id: int,
    rng: np.random.Generator,
) -> list[Instance]:
    """NSP pairs from every document in order; random Bs come from other documents in this list."""
    instances = []
    for doc_pos in range(len(documents)):
        for span_a, span_b, label in _pairs_from_document(documents, doc_pos, max_seq_length - 3, short_seq_prob, rng):
            tokens_a, tokens_b = _tokens(documents, span_a), _tokens(documents, span_b)
            tokens_a, tokens_b = truncate_seq_pair(tokens_a, tokens_b, max_seq_length - 3, rng)
            instances.append(
                Instance(
                    input_ids=[cls_id, *tokens_a, sep_id, *tokens_b, sep_id],
                    a_len=len(tokens_a) + 2,
                    next_sentence_label=label,
                    doc_a=doc_ids[span_a.doc_pos],
                    doc_b=doc_ids[span_b.doc_pos],
                    seg_a=(span_a.start, span_a.end),
                    seg_b=(span_b.start, span_b.end),
                )
            )
    return instances


def _pairs_from_document(
    documents: list[Document], doc_pos: int, max_num_tokens: int, short_seq_prob: float, rng: np.random.Generator
) -> Iterator[tuple[_Span, _Span, int]]:
    """Yield (span A, span B, label) walking the document chunk by chunk, as BERT does.

    Each attempt flips a fair coin and yields exactly one pair, so random and real pairs
    are equally many in expectation. A real B needs two segments: take the next one, or
    at the document's end reuse the previous one as A.
    """
    document = documents[doc_pos]
    if len(document) < 2 or len(documents) < 2:
        return  # only one kind of pair is possible here; yielding it would unbalance the labels
    start = 0
    while start < len(document):
        target_length = pick_target_length(max_num_tokens, short_seq_prob, rng)
        end = _chunk_end(document, start, target_length)
        if rng.random() < 0.5:
            a_end = pick_segment_a_end(start, end, rng)
            span_a = _Span(doc_pos, start, a_end)
            span_b = pick_random_b(documents, doc_pos, target_length - _length(document, span_a), rng)
            yield span_a, span_b, RANDOM_NEXT
            start = a_end  # put the unused segments back, as BERT does
            continue
        start, end = _widen_for_real_b(len(document), start, end)
        a_end = pick_segment_a_end(start, end, rng)
        yield _Span(doc_pos, start, a_end), _Span(doc_pos, a_end, end), IS_NEXT
        start = end


def _widen_for_real_b(doc_len: int, start: int, end: int) -> tuple[int, int]:
    """Make segments [start, end) at least two long (the document has at least two)."""
    if end - start >= 2:
        return start, end
    if end < doc_len:
        return start, end + 1  # truncate_seq_pair trims whatever exceeds the length
    return max(start - 1, 0), end


def pick_target_length(max_num_tokens: int, short_seq_prob: float, rng: np.random.Generator) -> int:
    """Usually the full length; with short_seq_prob a shorter one, so the model sees short inputs."""
    if rng.random() < short_seq_prob:
        return int(rng.integers(2, max_num_tokens + 1))
    return max_num_tokens


def _chunk_end(document: Document, start: int, target_length: int) -> int:
    """Take segments from start until they hold target_length tokens or the document ends."""
    length = 0
    end = start
    while end < len(document) and length < target_length:
        length += len(document[end])
        end += 1
    return end


def pick_segment_a_end(start: int, end: int, rng: np.random.Generator) -> int:
    """A is segments [start, a_end): a random cut leaving at least one segment for a real B."""
    if end - start < 2:
        return end
    return int(rng.integers(start + 1, end))


def pick_random_b(documents: list[Document], doc_pos: int, target_b_length: int, rng: np.random.Generator) -> _Span:
    """A random run of segments from a document other than doc_pos (there must be one)."""
    other = int(rng.integers(len(documents) - 1))
    other += other >= doc_pos  # skip doc_pos itself: every other document equally likely
    document = documents[other]
    start = int(rng.integers(len(document)))
    # At least one segment even when A already fills the target, as BERT does.
    end = max(_chunk_end(document, start, target_b_length), start + 1)
    return _Span(other, start, end)


def truncate_seq_pair(
    tokens_a: list[int], tokens_b: list[int], max_num_tokens: int, rng: np.random.Generator
) -> tuple[list[int], list[int]]:
    """Trim the longer side one token at a time, each from a random end, until both fit.

    Same distribution as BERT's token-by-token loop (ties trim B), computed in one step:
    count the removals per side, then draw how many of them come off the front.
    """
    cut_a, cut_b = _removal_counts(len(tokens_a), len(tokens_b), max_num_tokens)
    return _trim(tokens_a, cut_a, rng), _trim(tokens_b, cut_b, rng)


def _removal_counts(len_a: int, len_b: int, max_num_tokens: int) -> tuple[int, int]:
    excess = len_a + len_b - max_num_tokens
    if excess <= 0:
        return 0, 0
    gap = abs(len_a - len_b)
    if excess <= gap:
        return (excess, 0) if len_a > len_b else (0, excess)
    # Trim the longer side down to the shorter, then alternate starting with B.
    shared = excess - gap
    cut_a = shared // 2 + (gap if len_a > len_b else 0)
    cut_b = shared - shared // 2 + (gap if len_b >= len_a else 0)
    return cut_a, cut_b


def _trim(tokens: list[int], cut: int, rng: np.random.Generator) -> list[int]:
    if cut == 0:
        return tokens
    front = int(rng.binomial(cut, 0.5))
    return tokens[front : len(tokens) - (cut - front)]


def _tokens(documents: list[Document], span: _Span) -> list[int]:
    return [t for segment in documents[span.doc_pos][span.start : span.end] for t in segment]


def _length(document: Document, span: _Span) -> int:
    return sum(len(segment) for segment in document[span.start : span.end])


def create_mlm_blocks(
    documents: list[Document], doc_ids: list[int], max_seq_length: int, cls_id: int, sep_id: int
) -> list[Instance]:
    """RoBERTa FULL-SENTENCES: pack whole sentences into [CLS] block [SEP], [SEP] between documents."""
    budget = max_seq_length - 2
    blocks = []
    tokens: list[int] = []
    first = last = (0, 0)  # (doc_pos, segment) of the block's first and last segment
    for doc_pos, document in enumerate(documents):
        for seg_index, segment in enumerate(document):
            segment = segment[:budget]
            needs_separator = bool(tokens) and last[0] != doc_pos
            if tokens and len(tokens) + needs_separator + len(segment) > budget:
                blocks.append(_mlm_block(tokens, first, last, documents, doc_ids, cls_id, sep_id))
                tokens, needs_separator = [], False
            if not tokens:
                first = (doc_pos, seg_index)
            if needs_separator:
                tokens.append(sep_id)
            tokens.extend(segment)
            last = (doc_pos, seg_index)
    if tokens:
        blocks.append(_mlm_block(tokens, first, last, documents, doc_ids, cls_id, sep_id))
    return blocks


def _mlm_block(
    tokens: list[int],
    first: tuple[int, int],
    last: tuple[int, int],
    documents: list[Document],
    doc_ids: list[int],
    cls_id: int,
    sep_id: int,
) -> Instance:
    """A block's "A" is its part of the first document, "B" its part of the last one."""
    same_doc = first[0] == last[0]
    ids = [cls_id, *tokens, sep_id]
    return Instance(
        input_ids=ids,
        a_len=len(ids),
        next_sentence_label=NO_NSP_LABEL,
        doc_a=doc_ids[first[0]],
        doc_b=doc_ids[last[0]],
        seg_a=(first[1], last[1] + 1 if same_doc else len(documents[first[0]])),
        seg_b=(first[1] if same_doc else 0, last[1] + 1),
    )
