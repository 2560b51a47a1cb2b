"""A transformers encoder (BERT, RoBERTa or ModernBERT), trained with the MLM head on selected positions only.

The model is the library's own class (``BertForPreTraining``, ``RobertaForMaskedLM``, ``ModernBertForMaskedLM``:
architectures/) so that every checkpoint loads with the Auto classes. Training and held-out
evaluation do not call its forward: that projects all B*T positions onto the vocabulary,
while only ~15% carry a label. Gathering the selected hidden states first ("sparse
prediction", as google-research/bert, fairseq, cramming and MosaicBERT do) gives the same
loss for a fraction of the work; both go through ``SparsePretraining``.

Names: ``model`` is the transformers model (encoder + heads); its architecture's adapter
(``architecture_of(model)``) knows where the encoder and the heads are.
"""

import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedModel

from mlmlab.config import ModelConfig
from mlmlab.errors import UserError
from mlmlab.model.architectures import ADAPTERS, AnyMaskedLM, architecture_named, architecture_of
from mlmlab.model.attention_fp32 import NAME as SDPA_FP32
from mlmlab.model.head_loss import linear_cross_entropy
from mlmlab.utils.restoring import restoring

IGNORE_INDEX = -100  # the label of every position that is not predicted (HF convention)
# A compiled encoder keeps one graph per input length: lengths padded up to a multiple of this give
# a run's bucketed batches 4 graphs up to 128 tokens instead of one per length.
COMPILED_LENGTH_MULTIPLE = 32


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    return int(math.ceil(vocab_size / multiple) * multiple) if multiple > 1 else vocab_size


def build_model(cfg: ModelConfig, vocab_size: int, pad_token_id: int) -> PreTrainedModel:
    """A freshly initialised model of model.architecture; initialisation draws from torch's default generator."""
    architecture = architecture_named(cfg.architecture)
    config = architecture.config(cfg, padded_vocab_size(vocab_size, cfg.pad_vocab_multiple), pad_token_id)
    config._attn_implementation = cfg.attention
    try:
        return architecture.model_class(config)
    except (ValueError, ImportError) as err:
        if cfg.attention in ("sdpa", "eager", SDPA_FP32):  # always there on torch 2: the error is not about attention
            raise
        # transformers checks the implementation as the model is made: an unknown name, a package not installed,
        # a kernel this device lacks. Its message says which; a traceback would bury it.
        raise UserError(
            f"model.attention={cfg.attention!r} cannot be used here: {str(err).splitlines()[0]} Use "
            "model.attention=sdpa (or eager)"
        ) from None


def load_weights(model: nn.Module, path: Path, allowed_missing: tuple[str, ...] = (), prefix: str = "") -> None:
    """``path``'s safetensors weights into ``model``; any key or shape difference is a UserError naming the key.

    The one weight loader: ``allowed_missing`` lists the key prefixes the file may lack
    (an architecture's ``optional_parts`` when a run starts from it; none for a resume); the file's weights of
    the architecture's ``unused_parts`` are skipped. Names of older checkpoints are read as today's (``current_name``).
    ``prefix``: put before every saved name (a base-model folder's encoder, ``bert.`` in the model's names).
    """
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    shapes = weight_shapes(path)
    unused = architecture_of(model).unused_parts  # saved parts this architecture's class does not read
    names = {name: loaded_name(prefix + name, expected, unused) for name in shapes}
    for name, shape in shapes.items():
        current = names[name]
        if current is None:  # a saved buffer, not a weight
            continue
        if current not in expected:
            raise UserError(
                f"{path} holds {name}, which this model does not have; load it into the architecture "
                "it was saved from (its config.json)"
            )
        if shape != expected[current]:
            raise UserError(
                f"{path} holds {name} of shape {list(shape)}, this model's is {list(expected[current])}; "
                "load it into the architecture it was saved from (its config.json)"
            )
    state = {names[name]: tensor for name, tensor in load_file(str(path)).items() if names[name] is not None}
    absent = sorted(name for name in _load_state(model, state) if not name.startswith(allowed_missing))
    if absent:
        raise UserError(
            f"{path} lacks {absent[0]} ({len(absent)} weights missing); it was saved from another "
            "architecture: load it into that one (its config.json)"
        )


def loaded_name(name: str, expected: dict, unused: tuple[str, ...]) -> str | None:
    """The model's name of a saved weight; None for one the model does not read (an unused part, a saved buffer)."""
    return None if name.startswith(unused) and name not in expected else current_name(name)


# Checkpoints converted from google-research/bert's TensorFlow release name LayerNorm parameters gamma and
# beta (transformers renames them on load too), and older transformers saved the position_ids buffer.
_LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}
_NOT_WEIGHTS = ("embeddings.position_ids",)


def current_name(name: str) -> str | None:
    """A checkpoint's weight name as this transformers names it; None for a saved buffer that is no weight."""
    if name.endswith(_NOT_WEIGHTS):
        return None
    for old, new in _LEGACY_SUFFIXES.items():
        if "LayerNorm" in name and name.endswith(old):
            return name[: -len(old)] + new
    return name


def _load_state(model: nn.Module, state: dict) -> list[str]:
    """Copy ``state`` into ``model``; the names left unloaded, tied ones (decoder = embeddings) not counted."""
    missing = model.load_state_dict(state, strict=False).missing_keys
    parameters = model.state_dict(keep_vars=True)
    loaded = {id(parameters[name]) for name in state}
    return [name for name in missing if id(parameters[name]) not in loaded]


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} from a safetensors header; a missing, truncated or foreign file is a UserError."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except (SafetensorError, OSError) as err:
        raise UserError(
            f"cannot read the weights {path} ({str(err).splitlines()[0]}); the file is missing, "
            "truncated or not safetensors: copy or export the model again"
        ) from None


def compile_model(model: PreTrainedModel) -> None:
    """torch.compile the encoder and the MLM head in place.

    In place (``Module.compile``), so parameter names, checkpoints and the Auto classes
    are unchanged. The sparse loss around them stays eager: its ``nonzero`` has a
    data-dependent shape. The encoder is compiled for static shapes: SparsePretraining pads
    its input length to a multiple of COMPILED_LENGTH_MULTIPLE, so bucketed batches compile a
    handful of graphs, each specialised to its length. The head is compiled ``dynamic=True``:
    its row count (the selected positions) changes every step, and its matmuls gain nothing
    from a fixed one.
    """
    encoder, *head = architecture_of(model).compiled_parts(model)
    encoder.compile(dynamic=False)
    for part in head:
        part.compile(dynamic=True)


def padded_length(length: int, multiple: int, limit: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``, but never past ``limit`` (the model's positions)."""
    return max(length, min(-(-length // multiple) * multiple, limit))


@contextmanager
def eval_mode(model: nn.Module):
    """No dropout (and so no draws from torch's global RNG) inside; training mode restored after.

    Eager inside (a compiled model too): evaluation's and the scorers' batch shapes, grad mode and
    eval mode would each add graphs that training never reuses, and past torch's recompile limit
    training itself would fall back to eager.
    """
    with restoring(lambda: model.training, model.train, False), torch.compiler.set_stance("force_eager"):
        yield


def encode(model: PreTrainedModel, batch: dict, inputs_embeds: torch.Tensor | None = None) -> tuple:
    """Encoder outputs: hidden states (B, T, H) and pooled [CLS] (B, H), None without an NSP head.

    ``inputs_embeds``: the word embeddings (B, T, H) to encode instead of ``batch["input_ids"]``.
    """
    input_ids = batch["input_ids"] if inputs_embeds is None else None
    return architecture_of(model).encode(
        model, input_ids, batch["attention_mask"], batch.get("token_type_ids"), inputs_embeds
    )


def predict(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The MLM head's logits (..., V) of hidden states (..., H)."""
    return architecture_of(model).predict(model, hidden)


class SparsePretraining(nn.Module):
    """L = L_MLM + L_NSP over a transformers model, with the MLM head on labelled positions only.

    A module (not a function) so that DDP/FSDP wrappers see the forward call. The
    denominators let the caller normalise by the count over the *global* batch (all
    micro-batches and ranks), so the loss equals that of one big batch exactly. A model
    without an NSP head (RoBERTa, ModernBERT) is scored on MLM alone, whatever ``use_nsp`` says.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        use_nsp: bool = True,
        length_multiple: int = 1,
        fused_head: bool = False,
        architecture=None,
    ):
        """``length_multiple``: pad the encoder's input length up to a multiple of it (COMPILED_LENGTH_MULTIPLE
        for a compiled encoder); the padding is masked out of attention and cut from its output.
        ``fused_head``: in training, the decoder and its cross-entropy chunk by chunk (head_loss.py).
        ``architecture``: the adapter to reach the model through; None: its own (architecture_of)."""
        super().__init__()
        self.model, self.length_multiple, self.fused_head = model, length_multiple, fused_head
        self.architecture = architecture or architecture_of(model)
        self.use_nsp = use_nsp and self.architecture.has_nsp
        # accelerate's default FSDP wrapping (TRANSFORMER_BASED_WRAP) shards per module of these classes.
        self._no_split_modules = [self.architecture.layer_class]

    def forward(
        self,
        input_ids,
        attention_mask,
        token_type_ids,
        labels,
        next_sentence_label=None,
        mlm_denominator=None,
        nsp_denominator=None,
        **_unused,
    ) -> dict:
        # (B, T, H), and (B, H) where there is an NSP head
        hidden, pooled = self._encode(input_ids, attention_mask, token_type_ids)
        selected_index = (labels != IGNORE_INDEX).flatten().nonzero().squeeze(1)  # (M,)
        hidden_selected = hidden.flatten(0, 1).index_select(0, selected_index)  # (M, H)
        targets = labels.flatten().index_select(0, selected_index)  # (M,)
        if self.fused_head and self.model.training:
            transform, decoder = self.architecture.head_parts(self.model)
            mlm_sum, token_losses = linear_cross_entropy(
                transform(hidden_selected), decoder.weight, decoder.bias, targets
            )
        else:
            logits = self.architecture.predict(self.model, hidden_selected)  # (M, V)
            token_losses = F.cross_entropy(logits.float(), targets, reduction="none")  # (M,)
            mlm_sum = token_losses.sum()
        result = {
            "mlm_loss": mlm_sum / (mlm_denominator or max(len(targets), 1)),
            "token_losses": token_losses.detach(),
            "selected_index": selected_index,
            "mlm_count": torch.tensor(len(targets)),
        }
        if not self.model.training:
            # Accuracy is an evaluation figure. In training nothing reads it, and this argmax over
            # (M, V) logits cost 1.3% of a mini step (torch.profiler, batch 32 x 128).
            result["mlm_correct"] = (logits.argmax(-1) == targets).sum()
        loss = result["mlm_loss"]
        if self.use_nsp and next_sentence_label is not None and pooled is not None:  # a BertForMaskedLM: no pooler
            nsp_logits = self.architecture.nsp_logits(self.model, pooled)  # (B, 2)
            nsp_sum = F.cross_entropy(nsp_logits.float(), next_sentence_label, reduction="sum")
            result["nsp_loss"] = nsp_sum / (nsp_denominator or len(next_sentence_label))
            result["nsp_correct"] = (nsp_logits.argmax(-1) == next_sentence_label).sum().detach()
            loss = loss + result["nsp_loss"]
        result["loss"] = loss
        return result

    def _encode(self, input_ids, attention_mask, token_type_ids) -> tuple:
        """The encoder's (B, T, H) and pooled (B, H) of (B, T) inputs, through inputs padded to (B, T')."""
        length = input_ids.shape[1]
        extra = padded_length(length, self.length_multiple, self.model.config.max_position_embeddings) - length
        if extra:
            input_ids = F.pad(input_ids, (0, extra), value=self.model.config.pad_token_id)
            attention_mask = F.pad(attention_mask, (0, extra), value=0)
            token_type_ids = None if token_type_ids is None else F.pad(token_type_ids, (0, extra), value=0)
        hidden, pooled = self.architecture.encode(self.model, input_ids, attention_mask, token_type_ids)
        return hidden[:, :length], pooled  # (B, T, H) of (B, T', H)


def scoring_module(model: PreTrainedModel, use_nsp: bool = True) -> SparsePretraining:
    """What held-out evaluation scores a model through: the sparse loss of an architecture mlmlab builds; any other
    masked LM (DistilBERT, ELECTRA's generator) through its own forward, whose logits of every position the same
    loss picks the selected ones from."""
    known = model.config.model_type in ADAPTERS
    return SparsePretraining(model, use_nsp, architecture=None if known else AnyMaskedLM)


def pretraining_loss(model: PreTrainedModel, batch: dict, use_nsp: bool = True) -> dict:
    """One-off sparse pretraining loss of a batch, outside a training run (tests, benchmarks)."""
    return SparsePretraining(model, use_nsp)(**batch)
