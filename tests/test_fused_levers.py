"""The CPU levers: train.fused_qkv (one Q/K/V matmul on the same weights) computes what the library's attention
does, a run with either fused lever trains as the eager run (train.fused_head's own unit tests: test_head_loss.py),
and model.attention=sdpa_fp32 runs the attention kernel in fp32 under bf16 autocast, else as sdpa."""

import copy
import importlib

import pytest
import torch
from test_schedules_train import small_trainer
from torch.utils._python_dispatch import TorchDispatchMode

from mlmlab.config import ModelConfig
from mlmlab.model.fused_qkv import fuse_qkv
from mlmlab.model.pretraining import build_model, pretraining_loss
from mlmlab.train.launch import fused_head_on


def tiny_bert(attention: str, architecture: str = "bert"):
    torch.manual_seed(0)
    shape = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64}
    cfg = ModelConfig(architecture=architecture, attention=attention, **shape)
    return build_model(cfg, vocab_size=100, pad_token_id=0)


def batch() -> dict:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, 100, (3, 12), generator=generator)  # (B, T)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0  # a padded row: the fused path must mask as the library's does
    labels = torch.full_like(input_ids, -100)
    labels[:, ::3] = input_ids[:, ::3]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_type_ids": torch.zeros_like(input_ids),
        "labels": labels,
        "next_sentence_label": torch.tensor([0, 1, 0]),
    }


def loss_and_gradients(model) -> tuple[torch.Tensor, dict]:
    loss = pretraining_loss(model, batch())["loss"]
    loss.backward()
    return loss.detach(), {name: parameter.grad for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_fused_projection_gives_the_library_attentions_loss_and_gradients(attention):
    separate = tiny_bert(attention)
    fused = copy.deepcopy(separate)
    assert fuse_qkv(fused) == 2
    want_loss, want_grads = loss_and_gradients(separate)
    got_loss, got_grads = loss_and_gradients(fused)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert set(got_grads) == set(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_fusing_keeps_the_weights_and_their_names_so_checkpoints_do_not_change():
    model = tiny_bert("sdpa")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    fuse_qkv(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


def test_modernbert_has_nothing_to_fuse():
    cfg = ModelConfig(architecture="modernbert", hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64)
    assert fuse_qkv(build_model(cfg, vocab_size=100, pad_token_id=0)) == 0


MODERNBERT = ("model.architecture=modernbert", "data.objective=mlm")
# What each lever's path calls: (module, function), counted to show the run took it.
CALLED = {
    "train.fused_head": ("mlmlab.model.pretraining", "linear_cross_entropy"),
    "train.fused_qkv": ("mlmlab.model.fused_qkv", "fused_qkv_forward"),
}


@pytest.mark.parametrize(
    "lever, architecture",
    [("train.fused_head", ()), ("train.fused_head", MODERNBERT), ("train.fused_qkv", ())],
    ids=["fused_head-bert", "fused_head-modernbert", "fused_qkv-bert"],
)
def test_training_with_a_fused_lever_follows_the_eager_one(tmp_path, monkeypatch, lever, architecture):
    """50 steps of a run with the lever on (its fused path taken) give the losses of the run without it, to float
    tolerance."""
    module, name = CALLED[lever]
    calls = []
    fused = getattr(importlib.import_module(module), name)
    monkeypatch.setattr(f"{module}.{name}", lambda *args, **kwargs: calls.append(1) or fused(*args, **kwargs))

    def losses(on: bool) -> list[float]:
        calls.clear()
        trainer = small_trainer(tmp_path, str(on), "train.batch_size=8", f"{lever}={on}", *architecture)
        batches = trainer.batches()
        losses = [trainer.train_step(batches)["loss"] for _ in range(50)]
        assert bool(calls) == on
        return losses

    assert losses(True) == pytest.approx(losses(False), rel=1e-4)


def test_a_run_takes_the_eager_head_unless_told_to_fuse(tmp_path, monkeypatch, capsys):
    """train.fused_head null (auto): the eager head on a CPU (faster there once large blocks stop faulting) and a GPU
    (never timed there), said at start-up; true fuses."""
    module, name = CALLED["train.fused_head"]
    calls = []
    fused = getattr(importlib.import_module(module), name)
    monkeypatch.setattr(f"{module}.{name}", lambda *args, **kwargs: calls.append(1) or fused(*args, **kwargs))
    for setting, expected in ((), False), (("train.fused_head=true",), True):
        calls.clear()
        trainer = small_trainer(tmp_path, str(expected), *setting)
        trainer.train_step(trainer.batches())
        assert bool(calls) == expected
    said = capsys.readouterr()
    assert "eager MLM head (train.fused_head=null: auto)" in said.out + said.err
    assert "fused MLM head (train.fused_head=true)" in said.out + said.err
    assert fused_head_on(None) is False and fused_head_on(True) is True


class AttentionKernelInputs(TorchDispatchMode):
    """The dtype of the query each attention kernel dispatched while it is on was given."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__:
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def loss_and_kernel_dtypes(model, autocast: bool) -> tuple[torch.Tensor, set]:
    with AttentionKernelInputs() as kernels, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = pretraining_loss(model, batch())["loss"]
    return loss.detach(), set(kernels.dtypes)


@pytest.mark.parametrize("architecture", ["bert", "modernbert"])
def test_sdpa_fp32_runs_the_attention_kernel_in_fp32_under_bf16_autocast_and_is_sdpa_otherwise(architecture):
    upcast = tiny_bert("sdpa_fp32", architecture)
    library = copy.deepcopy(upcast)
    library.config._attn_implementation = "sdpa"
    (upcast_bf16, upcast_kernels), (library_bf16, library_kernels) = (
        loss_and_kernel_dtypes(model, autocast=True) for model in (upcast, library)
    )
    assert upcast_kernels == {torch.float32} and library_kernels == {torch.bfloat16}  # the probe tells them apart
    torch.testing.assert_close(upcast_bf16, library_bf16, rtol=2e-2, atol=2e-2)  # bf16 everywhere else
    upcast_fp32, library_fp32 = (loss_and_kernel_dtypes(model, autocast=False)[0] for model in (upcast, library))
    assert torch.equal(upcast_fp32, library_fp32)


def test_a_model_trained_with_sdpa_fp32_exports_a_folder_transformers_loads_without_mlmlab(tmp_path):
    """The implementation's name is a setting of the run, not of the model: config.json does not carry it."""
    tiny_bert("sdpa_fp32", "modernbert").save_pretrained(tmp_path)
    assert "sdpa_fp32" not in (tmp_path / "config.json").read_text()
