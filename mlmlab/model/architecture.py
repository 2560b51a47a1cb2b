"""What an architecture is to mlmlab: the ``Architecture`` interface each module of ``architectures/`` implements.

An architecture is transformers' own model class behind one small adapter. Everything that reaches into a
model (the sparse loss, the model scorers, evaluation, checkpoints, train.init) goes through
``architecture_of(model)`` or ``architecture_named(name)`` (``architectures/``), so masking, resume and
studies are the same code for every architecture. An adapter says

- how mlmlab's model section becomes the library's config (``config``) and model (``model_class``);
- how a batch is encoded (hidden states, and the pooled [CLS] where there is an NSP head), and how
  the MLM head (transform, then the decoder tied to the input embeddings) projects hidden states;
- which modules torch.compile compiles and FSDP shards by, and which train.fused_qkv fuses;
- which config.json entries fix the weights' shapes and meaning, as the model.* settings that set
  them (a resume and train.init compare them; train.init takes them), and which entries mlmlab
  leaves at the library's defaults (a folder with other values would compute something else);
- which parts a folder may lack when a run starts from it (a BertForMaskedLM's pooler and NSP head), and
  which it may hold that the model has not (a released RoBERTa's unused pooler);
- how many position rows precede the first token's (``position_offset``: RoBERTa's positions start past
  the padding id, so config.json's max_position_embeddings is the model.* setting plus that offset);
- what it is to the rest of mlmlab: its label, whether it has an NSP head, the model.* settings only it
  reads and what else a config must satisfy for it (``check``, called by ``check_config``), its
  forward matmul FLOPs (``forward_flops``: flops.py's count for MFU and budgets), and its model card's text.

An architecture's name is transformers' model_type, so a saved config.json says which one it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from mlmlab.config import ModelConfig

# The model.* settings of the encoder's shape, as config.json names them in both libraries' configs.
SHAPE = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_heads",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
}


@runtime_checkable
class Architecture(Protocol):
    """One encoder family as mlmlab trains it (see the module docstring); its methods are static or class methods."""

    name: str  # transformers' model_type, and the model.architecture that names it (in choices.ARCHITECTURES)
    label: str  # in messages, reports and the model card
    loaded_by: str  # the model card's class that loads it besides the Auto classes
    positions: str  # its position and attention scheme: why another architecture's settings do not apply
    model_class: type[PreTrainedModel]
    layer_class: str  # accelerate's default FSDP wrapping shards per module of this class
    has_nsp: bool
    without_nsp: str  # why it has no NSP head (said when data.objective=nsp is refused); empty with one
    settings: dict  # config.json entry (a tuple: a path into nested entries) -> the model.* setting that sets it
    own_settings: tuple[str, ...]  # model.* settings no other architecture reads
    as_built: dict  # config.json entries mlmlab leaves at these values; a folder with others computes otherwise
    optional_parts: dict[str, str]  # weight-name prefix -> the part a folder may lack (it starts fresh)
    unused_parts: tuple[str, ...]  # weight-name prefixes a folder may hold that the model does not read
    # (B, 2) NSP logits from the pooled [CLS] state; None without an NSP head
    nsp_logits: Callable[[PreTrainedModel, torch.Tensor], torch.Tensor] | None

    @staticmethod
    def position_offset(saved: dict) -> int:
        """Position rows before the first token's, in a config.json's model."""

    @staticmethod
    def forward_flops(cfg: ModelConfig, seq):
        """Forward matmul FLOPs of the encoder on sequences of ``seq`` tokens (a number, or an array/tensor)."""

    @staticmethod
    def check(cfg: ModelConfig) -> None:
        """What a model section must satisfy beyond the ranges of its numbers; a UserError if it does not."""

    @staticmethod
    def described(saved: dict) -> str:
        """The model card's sentence on the classes, from the folder's config.json."""

    @staticmethod
    def config(cfg: ModelConfig, vocab_size: int, pad_token_id: int) -> PreTrainedConfig:
        """transformers' config of the model the model section describes."""

    @staticmethod
    def dropout_settings(hidden: float, attention: float) -> dict:
        """The config entries of the dropout on hidden states and on attention."""

    @staticmethod
    def encode(model, input_ids, attention_mask, token_type_ids=None, inputs_embeds=None) -> tuple:
        """(hidden states (B, T, H), the pooled [CLS] state (B, H) or None without an NSP head)."""

    @staticmethod
    def predict(model, hidden: torch.Tensor) -> torch.Tensor:
        """The MLM head on hidden states: (..., H) -> (..., V)."""

    @staticmethod
    def head_parts(model) -> tuple[nn.Module, nn.Linear]:
        """The MLM head as (transform, decoder): predict is decoder(transform(hidden))."""

    @staticmethod
    def compiled_parts(model) -> tuple[nn.Module, ...]:
        """The encoder, then the head's modules: what train.compile compiles."""

    @staticmethod
    def separate_qkv(model) -> list[nn.Module]:
        """The self-attention modules that project Q, K and V with three linears (train.fused_qkv fuses them)."""


def attention_dropout(cfg: ModelConfig) -> float:
    """model.attention_dropout, or model.dropout when it is null."""
    return cfg.dropout if cfg.attention_dropout is None else cfg.attention_dropout
