"""The encoders mlmlab trains: transformers' own model classes, each behind one small adapter.

Everything that reaches into a model (the sparse loss, the model scorers, evaluation,
checkpoints, train.init) goes through ``architecture_of(model)`` or ``architecture_named(name)``,
so masking, resume and studies are the same code for every architecture. An adapter says

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
  reads and what else a config must satisfy for it (``check_config``, called by config validation), its
  forward matmul FLOPs (``forward_flops``: flops.py's count for MFU and budgets), and its model card's text.

An architecture's name is transformers' model_type, so a saved config.json says which one it is.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForPreTraining,
    ModernBertConfig,
    ModernBertForMaskedLM,
    RobertaConfig,
    RobertaForMaskedLM,
    XLMRobertaConfig,
    XLMRobertaForMaskedLM,
)

from mlmlab import choices
from mlmlab.errors import UserError

if TYPE_CHECKING:  # annotations only: config.py asks the adapters to check a config, so no import back at run time
    from mlmlab.config import ModelConfig

# The model.* settings of the encoder's shape, as config.json names them in both libraries' configs.
_SHAPE = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_heads",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
}


def attention_dropout(cfg: ModelConfig) -> float:
    """model.attention_dropout, or model.dropout when it is null."""
    return cfg.dropout if cfg.attention_dropout is None else cfg.attention_dropout


class Bert:
    """BertForPreTraining: encoder ``bert``, MLM head ``cls.predictions``, NSP head ``cls.seq_relationship``."""

    name = choices.BERT
    label = "BERT"
    loaded_by = "`BertForPreTraining` (with the NSP head)"  # besides the Auto classes, in the model card
    positions = "learned positions and global attention in every layer"  # why another's attention settings do not apply
    model_class = BertForPreTraining
    layer_class = "BertLayer"  # accelerate's default FSDP wrapping shards per module of this class
    has_nsp = True
    settings = _SHAPE  # config.json entry -> the model.* setting that sets it
    own_settings = ()  # model.* settings no other architecture reads
    as_built = {
        "hidden_act": "gelu",
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "tie_word_embeddings": True,
        "position_embedding_type": "absolute",
    }
    optional_parts = {"bert.pooler.": "pooler", "cls.seq_relationship.": "NSP head"}  # a BertForMaskedLM has neither
    unused_parts = ()

    @staticmethod
    def position_offset(saved: dict) -> int:
        return 0

    @staticmethod
    def forward_flops(cfg: ModelConfig, seq):
        """L * T * (8 H^2 + 4 H I + 4 T H): Q, K, V and output projections; the FFN; QK^T and AV."""
        h, i = cfg.hidden_size, cfg.intermediate_size
        return cfg.num_layers * seq * (8 * h * h + 4 * h * i + 4 * seq * h)

    @staticmethod
    def check(cfg: ModelConfig) -> None:
        """What a model section must satisfy beyond the ranges of its numbers: nothing more for BERT."""

    @staticmethod
    def described(saved: dict) -> str:
        """The model card's sentence on the classes, from the folder's config.json."""
        return "`BertForPreTraining`: encoder, MLM head (tied to the input embeddings) and NSP head."

    @staticmethod
    def config(cfg: ModelConfig, vocab_size: int, pad_token_id: int) -> BertConfig:
        return BertConfig(
            vocab_size=vocab_size,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_position_embeddings,
            **Bert.dropout_settings(cfg.dropout, attention_dropout(cfg)),
            pad_token_id=pad_token_id,
        )

    @staticmethod
    def dropout_settings(hidden: float, attention: float) -> dict:
        """The config entries of the dropout on hidden states and on attention."""
        return {"hidden_dropout_prob": hidden, "attention_probs_dropout_prob": attention}

    @staticmethod
    def encode(model, input_ids, attention_mask, token_type_ids, inputs_embeds=None) -> tuple:
        out = model.bert(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            inputs_embeds=inputs_embeds,
        )
        # (B, T, H), (B, H); by name, since a BertForMaskedLM (the benchmarks' anchors) has no pooler and its
        # output tuple then no second entry: evaluate_mlm scores its MLM alone
        return out.last_hidden_state, out.pooler_output

    @staticmethod
    def predict(model, hidden: torch.Tensor) -> torch.Tensor:
        return model.cls.predictions(hidden)  # (..., V)

    @staticmethod
    def head_parts(model) -> tuple[nn.Module, nn.Linear]:
        """The MLM head as (transform, decoder): predict is decoder(transform(hidden))."""
        return model.cls.predictions.transform, model.cls.predictions.decoder

    @staticmethod
    def nsp_logits(model, pooled: torch.Tensor) -> torch.Tensor:
        return model.cls.seq_relationship(pooled)  # (B, 2)

    @staticmethod
    def compiled_parts(model) -> tuple[nn.Module, ...]:
        return model.bert, model.cls.predictions

    @staticmethod
    def separate_qkv(model) -> list[nn.Module]:
        """The self-attention modules that project Q, K and V with three linears (train.fused_qkv fuses them)."""
        return [layer.attention.self for layer in model.bert.encoder.layer]


class ModernBert:
    """ModernBertForMaskedLM: encoder ``model``, MLM head ``head`` then ``decoder`` (tied to the input embeddings).

    No NSP head and no segment embeddings (token_type_ids are not read), as the published model.
    """

    name = choices.MODERNBERT
    label = "ModernBERT"
    loaded_by = "`ModernBertForMaskedLM`"
    positions = "rotary positions and local attention in most layers"
    model_class = ModernBertForMaskedLM
    layer_class = "ModernBertEncoderLayer"
    has_nsp = False
    without_nsp = "its published recipe trains MLM only"  # why it has no NSP head
    # Tuples are paths into nested entries. global_attn_every_n_layers: transformers builds layer_types from
    # it and keeps it in config.json.
    settings = {
        **_SHAPE,
        "local_attention": "local_attention",
        "global_attn_every_n_layers": "global_attention_every",
        ("rope_parameters", "full_attention", "rope_theta"): "rope_theta_global",
        ("rope_parameters", "sliding_attention", "rope_theta"): "rope_theta_local",
    }
    own_settings = tuple(setting for setting in settings.values() if setting not in _SHAPE.values())
    as_built = {
        "hidden_activation": "gelu",
        "norm_eps": 1e-5,
        "norm_bias": False,
        "attention_bias": False,
        "mlp_bias": False,
        "decoder_bias": True,
        "classifier_activation": "gelu",
        "tie_word_embeddings": True,
    }
    optional_parts = {}
    unused_parts = ()

    @staticmethod
    def position_offset(saved: dict) -> int:
        return 0

    @staticmethod
    def forward_flops(cfg: ModelConfig, seq):
        """L * T * (8 H^2 + 6 H I) + 4 H * (attended pairs of every layer): its GeGLU MLP has three H x I
        matrices (two in, one out); a global layer attends T^2 (query, key) pairs, a local one only the pairs
        at most local_attention // 2 apart."""
        h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
        global_layers = math.ceil(layers / cfg.global_attention_every)  # layers 0, n, 2n, ...
        local_pairs = local_attention_pairs(seq, cfg.local_attention // 2)
        pairs = global_layers * seq * seq + (layers - global_layers) * local_pairs
        return layers * seq * (8 * h * h + 6 * h * i) + 4 * h * pairs

    @staticmethod
    def check(cfg: ModelConfig) -> None:
        if (cfg.hidden_size // cfg.num_heads) % 2:
            raise UserError(
                f"ModernBERT's rotary positions rotate pairs of dimensions, so model.hidden_size / "
                f"model.num_heads = {cfg.hidden_size // cfg.num_heads} must be even; change either"
            )

    @staticmethod
    def described(saved: dict) -> str:
        rope = saved["rope_parameters"]
        return (
            "`ModernBertForMaskedLM`: a pre-norm encoder with rotary positions, GeGLU feed-forward and no biases "
            f"but the decoder's; layers 0, {saved['global_attn_every_n_layers']}, ... attend to the whole sequence "
            f"(RoPE base {rope['full_attention']['rope_theta']:,.0f}), the others to {saved['local_attention'] // 2} "
            f"tokens either side (RoPE base {rope['sliding_attention']['rope_theta']:,.0f}); MLM head tied to the "
            "input embeddings; no NSP head."
        )

    @staticmethod
    def config(cfg: ModelConfig, vocab_size: int, pad_token_id: int) -> ModernBertConfig:
        rope = {"full_attention": cfg.rope_theta_global, "sliding_attention": cfg.rope_theta_local}
        return ModernBertConfig(
            vocab_size=vocab_size,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_position_embeddings,
            local_attention=cfg.local_attention,
            global_attn_every_n_layers=cfg.global_attention_every,
            rope_parameters={layers: {"rope_type": "default", "rope_theta": theta} for layers, theta in rope.items()},
            **ModernBert.dropout_settings(cfg.dropout, attention_dropout(cfg)),
            pad_token_id=pad_token_id,
            # The released ModernBERT folders' config.json pool by mean for classification (answerdotai's models and
            # their fine-tunes); transformers' default, "cls", would fine-tune ours (`mlmlab glue`) on another head.
            classifier_pooling="mean",
            # The defaults are ids of ModernBERT's own 50k vocabulary, outside ours; the model reads none of them.
            bos_token_id=None,
            eos_token_id=None,
            cls_token_id=None,
            sep_token_id=None,
        )

    @staticmethod
    def dropout_settings(hidden: float, attention: float) -> dict:
        """As BERT's: hidden states (embeddings, MLP and the classifier's input) and attention."""
        return {
            "embedding_dropout": hidden,
            "mlp_dropout": hidden,
            "classifier_dropout": hidden,
            "attention_dropout": attention,
        }

    @staticmethod
    def encode(model, input_ids, attention_mask, token_type_ids=None, inputs_embeds=None) -> tuple:
        out = model.model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds)
        return out[0], None  # (B, T, H); no pooler

    @staticmethod
    def predict(model, hidden: torch.Tensor) -> torch.Tensor:
        return model.decoder(model.head(hidden))  # (..., V)

    @staticmethod
    def head_parts(model) -> tuple[nn.Module, nn.Linear]:
        return model.head, model.decoder

    @staticmethod
    def compiled_parts(model) -> tuple[nn.Module, ...]:
        return model.model, model.head, model.decoder

    @staticmethod
    def separate_qkv(model) -> list[nn.Module]:
        return []  # each layer's Wqkv projects Q, K and V in one matmul already


class _RobertaTransform(nn.Module):
    """RobertaLMHead's transform (dense, GELU, LayerNorm) as one module: the head is decoder(transform(hidden))."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.layer_norm(nn.functional.gelu(self.head.dense(hidden)))


class Roberta:
    """RobertaForMaskedLM: encoder ``roberta``, MLM head ``lm_head`` (decoder tied to the input embeddings).

    BERT's post-LayerNorm encoder as RoBERTa trains it: MLM only (no NSP head), one token type (token_type_ids
    are not passed), and positions counted from past the padding id (fairseq's make_positions), so a model of
    T tokens has T + pad_token_id + 1 position rows, as the released roberta-base's 514 for 512 tokens.
    """

    name = choices.ROBERTA
    label = "RoBERTa"
    loaded_by = "`RobertaForMaskedLM`"
    positions = Bert.positions
    model_class = RobertaForMaskedLM
    config_class = RobertaConfig
    layer_class = "RobertaLayer"
    has_nsp = False
    without_nsp = "it drops NSP and trains MLM on full sentences"
    settings = _SHAPE
    own_settings = ()
    forward_flops = Bert.forward_flops  # BERT's encoder
    check = Bert.check
    as_built = {
        "hidden_act": "gelu",
        "type_vocab_size": 1,
        "layer_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "position_embedding_type": "absolute",
    }
    optional_parts = {}
    unused_parts = ("roberta.pooler.",)  # released RoBERTa folders hold a pooler RobertaForMaskedLM does not read

    @staticmethod
    def position_offset(saved: dict) -> int:
        """Position rows before the first token's: ids start at pad_token_id + 1."""
        return (saved.get("pad_token_id") or 0) + 1

    @classmethod
    def described(cls, saved: dict) -> str:
        return (
            f"{cls.loaded_by}: BERT's post-LayerNorm encoder with one token type and learned positions "
            "counted from past the padding id; MLM head tied to the input embeddings; no NSP head."
        )

    @classmethod
    def config(cls, cfg: ModelConfig, vocab_size: int, pad_token_id: int) -> RobertaConfig | XLMRobertaConfig:
        return cls.config_class(
            vocab_size=vocab_size,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_position_embeddings + pad_token_id + 1,
            type_vocab_size=1,
            layer_norm_eps=1e-5,
            **Bert.dropout_settings(cfg.dropout, attention_dropout(cfg)),
            pad_token_id=pad_token_id,
            # RoBERTa's defaults (0, 2) are ids of its own vocabulary; the model reads neither.
            bos_token_id=None,
            eos_token_id=None,
        )

    dropout_settings = Bert.dropout_settings

    @staticmethod
    def encode(model, input_ids, attention_mask, token_type_ids=None, inputs_embeds=None) -> tuple:
        out = model.roberta(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds)
        return out[0], None  # (B, T, H); no pooler

    @staticmethod
    def predict(model, hidden: torch.Tensor) -> torch.Tensor:
        return model.lm_head(hidden)  # (..., V)

    @staticmethod
    def head_parts(model) -> tuple[nn.Module, nn.Linear]:
        return _RobertaTransform(model.lm_head), model.lm_head.decoder

    @staticmethod
    def compiled_parts(model) -> tuple[nn.Module, ...]:
        return model.roberta, model.lm_head

    @staticmethod
    def separate_qkv(model) -> list[nn.Module]:
        return [layer.attention.self for layer in model.roberta.encoder.layer]


class XlmRoberta(Roberta):
    """XLMRobertaForMaskedLM: RoBERTa's architecture under XLM-R's class names (Conneau et al. 2020), the same
    modules and weight names (``roberta``, ``lm_head``), so that a released XLM-R folder, whose config.json says
    model_type "xlm-roberta", continues as the class it was saved as. Its SentencePiece Unigram vocabulary is the
    tokenizer's (data/tokenizer.py), not the adapter's.
    """

    name = choices.XLM_ROBERTA
    label = "XLM-R"
    loaded_by = "`XLMRobertaForMaskedLM`"
    model_class = XLMRobertaForMaskedLM
    config_class = XLMRobertaConfig
    layer_class = "XLMRobertaLayer"

    @classmethod
    def described(cls, saved: dict) -> str:
        return f"{super().described(saved)} XLM-R's class for RoBERTa's architecture."


ADAPTERS = {
    adapter.name: adapter for adapter in (Bert, Roberta, XlmRoberta, ModernBert)
}  # by model.architecture (model_type)


def architecture_named(name: str):
    if name not in ADAPTERS:
        raise UserError(
            f"model_type {name!r} is not an architecture mlmlab trains; it trains {choices.listed(ADAPTERS)}"
        )
    return ADAPTERS[name]


def check_config(cfg) -> None:
    """A config's model section and objective against its architecture (named already checked), each refused in one
    line."""
    architecture = architecture_named(cfg.model.architecture)
    for other in ADAPTERS.values():
        changed = [name for name in other.own_settings if getattr(cfg.model, name) != getattr(type(cfg.model), name)]
        if changed and other is not architecture:
            raise UserError(
                f"model.{changed[0]} applies to model.architecture={other.name} only ({architecture.label} "
                f"has {architecture.positions}); drop it or set model.architecture={other.name}"
            )
    if cfg.data.objective == choices.NSP and not architecture.has_nsp:
        raise UserError(
            f"data.objective={choices.NSP} needs an NSP head, which {architecture.label} does not have "
            f"({architecture.without_nsp}); set data.objective={choices.MLM}, or "
            f"model.architecture={choices.BERT}"
        )
    architecture.check(cfg.model)


def local_attention_pairs(seq, reach: int):
    """(query, key) pairs of a sequence of ``seq`` tokens at most ``reach`` positions apart.

    Each distance d = 1..m (m = min(reach, seq - 1)) has seq - d pairs in either direction,
    besides the seq pairs of a token with itself: seq + 2 (m seq - m (m + 1) / 2).
    """
    gap = seq - 1
    nearest = (gap + reach - abs(gap - reach)) / 2  # min(seq - 1, reach), for numbers, arrays and tensors alike
    return seq + 2 * nearest * seq - nearest * (nearest + 1)


def architecture_of(model):
    """The adapter of a transformers model mlmlab built or loaded."""
    return architecture_named(model.config.model_type)


def saved_architecture(saved: dict):
    """The adapter of a config.json's model; a BERT when it names none (google-research/bert's configs)."""
    return architecture_named(saved.get("model_type", choices.BERT))


def saved_settings(saved: dict) -> dict:
    """{model.* setting: value} of a model's config.json (or its config's to_dict()); None where absent."""
    architecture = saved_architecture(saved)
    settings = {setting: config_entry(saved, key) for key, setting in architecture.settings.items()}
    if settings.get("max_position_embeddings") is not None:
        settings["max_position_embeddings"] = token_positions(saved)
    return {"architecture": architecture.name, **settings}


def token_positions(saved: dict) -> int:
    """The tokens a config.json's model takes at most: its position rows less the architecture's offset."""
    return (saved.get("max_position_embeddings") or 0) - saved_architecture(saved).position_offset(saved)


def config_entry(saved: dict, key):
    """A config.json entry; a tuple key is a path into nested entries. None where absent."""
    for part in key if isinstance(key, tuple) else (key,):
        saved = saved.get(part) if isinstance(saved, dict) else None
    return saved


def entry_name(setting: str, architecture) -> str:
    """How config.json names the entry of a model.* setting, for messages."""
    if setting == "architecture":
        return "model_type"
    key = next(key for key, name in architecture.settings.items() if name == setting)
    return ".".join(key) if isinstance(key, tuple) else key
