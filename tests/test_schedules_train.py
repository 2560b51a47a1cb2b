"""The learning-rate schedule is a pure function of step and budget progress."""

import math
import os
import subprocess
import sys
import time

import pytest
from conftest import TINY_MODEL

from mlmlab import choices
from mlmlab.train.optim import lr_factor, parameter_groups


def test_warmup_then_linear_decay_to_zero_on_a_step_budget():
    total, warmup = 100, 10
    factors = [lr_factor(step, warmup, step / total, warmup / total) for step in range(total + 1)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0) and factors[55] == pytest.approx(0.5) and factors[100] == 0.0
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))


def test_time_budget_decays_from_where_warmup_ended():
    assert lr_factor(50, 10, progress=0.2, warmup_end_progress=0.2) == pytest.approx(1.0)
    assert lr_factor(80, 10, progress=0.6, warmup_end_progress=0.2) == pytest.approx(0.5)
    assert lr_factor(99, 10, progress=1.0, warmup_end_progress=0.2) == 0.0


def test_warmup_stable_decay_holds_the_peak_until_the_last_share():
    total, warmup = 100, 10
    factors = [lr_factor(step, warmup, step / total, warmup / total, decay_fraction=0.2) for step in range(total + 1)]
    assert factors[9] == pytest.approx(1.0) and factors[80] == pytest.approx(1.0)
    assert factors[90] == pytest.approx(0.5) and factors[100] == 0.0
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))


def test_decay_never_starts_before_warmup_ends():
    # decay_fraction 0.9 would start decaying at progress 0.1, but warmup runs to 0.3.
    assert lr_factor(30, 30, progress=0.3, warmup_end_progress=0.3, decay_fraction=0.9) == pytest.approx(1.0)
    assert lr_factor(65, 30, progress=0.65, warmup_end_progress=0.3, decay_fraction=0.9) == pytest.approx(0.5)


def test_no_weight_decay_on_bias_and_layernorm():
    from mlmlab.config import ModelConfig
    from mlmlab.model.pretraining import build_model

    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), 100, 0)
    decay, no_decay = parameter_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim == 2 and "LayerNorm" not in names[id(p)] for p in decay["params"])
    assert any("LayerNorm" in names[id(p)] for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0


def test_non_finite_loss_skips_the_step_then_aborts(tmp_path):
    import torch

    from mlmlab.config import load_config
    from mlmlab.errors import UserError
    from mlmlab.train.loop import Trainer

    cfg = load_config("tiny", [f"train.out_dir={tmp_path}", "train.max_bad_steps=3", "data.loader_workers=0"])
    trainer = Trainer(cfg, evaluator=None, show_progress=False)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    for _ in range(2):
        assert trainer._apply_update({"loss": float("nan")}, tokens=10, flops=0.0)["skipped"]
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    with pytest.raises(UserError, match="non-finite"):
        trainer._apply_update({"loss": float("inf")}, tokens=10, flops=0.0)


def test_compiled_training_follows_the_eager_one_in_a_few_graphs(tmp_path):
    """train.compile=true (torch.compile of encoder and head) trains the same model, within float tolerance, over
    50 steps of bucketed batches of many lengths, compiling a handful of graphs, not one per length."""
    import torch
    from torch._dynamo.utils import counters

    from mlmlab.model.pretraining import eval_mode

    def run(compile_flag: bool) -> list[dict]:
        trainer = small_trainer(
            tmp_path, str(compile_flag), "train.batch_size=8", "data.max_seq_length=64", f"train.compile={compile_flag}"
        )
        batches = trainer.batches()
        steps = [trainer.train_step(batches) for _ in range(50)]
        with torch.no_grad(), eval_mode(trainer.model):  # evaluation and ADM's scorers run eager: no graph of theirs
            trainer.model(input_ids=torch.ones(3, 17, dtype=torch.long))
        return steps

    eager = run(False)
    torch._dynamo.reset()
    counters.clear()
    compiled = run(True)
    assert len({step["slots"] // 8 for step in eager}) > 4  # lengths that one graph per length would recompile for
    assert [step["loss"] for step in eager] == pytest.approx([step["loss"] for step in compiled], rel=1e-4)
    # The encoder: one graph per length padded to a multiple of 32 (32, 64); the head: one, dynamic in its rows.
    assert counters["stats"]["unique_graphs"] <= 3


def test_cosine_decay_follows_the_half_cosine_over_the_decay_window():
    total, warmup = 100, 10
    factors = [
        lr_factor(step, warmup, step / total, warmup / total, decay_fraction=1.0, shape=choices.COSINE)
        for step in range(total + 1)
    ]
    assert factors[9] == pytest.approx(1.0) and factors[10] == pytest.approx(1.0)
    assert factors[55] == pytest.approx(0.5)  # half way through the window: half the peak, as linear
    assert factors[32] == pytest.approx(0.5 * (1 + math.cos(math.pi * 22 / 90)))
    assert factors[100] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))
    linear = [lr_factor(step, warmup, step / total, warmup / total, decay_fraction=1.0) for step in range(total + 1)]
    assert all(c >= lin for c, lin in zip(factors[10:55], linear[10:55]))  # cosine keeps more LR early on
    # With a shorter decay window, the peak holds until it starts, as for warmup-stable-decay.
    held = lr_factor(70, warmup, 0.7, warmup / total, decay_fraction=0.2, shape=choices.COSINE)
    assert held == 1.0 and lr_factor(90, warmup, 0.9, 0.1, 0.2, choices.COSINE) == pytest.approx(0.5)


def test_one_minus_sqrt_decay_drops_fast_then_slowly_and_stays_below_linear():
    total, warmup = 100, 10
    window = [
        lr_factor(step, warmup, step / total, warmup / total, decay_fraction=0.2, shape=choices.ONE_MINUS_SQRT)
        for step in range(total + 1)
    ]
    assert window[10] == 1.0 and window[80] == 1.0  # the peak holds until the last 20%
    assert window[85] == pytest.approx(1 - math.sqrt(0.25))  # a quarter through the window: half the peak
    assert window[90] == pytest.approx(1 - math.sqrt(0.5)) and window[100] == pytest.approx(0.0, abs=1e-12)
    linear = [lr_factor(step, warmup, step / total, warmup / total, decay_fraction=0.2) for step in range(total + 1)]
    assert all(s < lin for s, lin in zip(window[81:100], linear[81:100]))
    assert all(a > b for a, b in zip(window[80:], window[81:]))


def test_the_linear_schedule_is_the_default_and_unchanged():
    from mlmlab.config import TrainConfig
    from mlmlab.train.optim import learning_rate

    cfg = TrainConfig(max_steps=100, warmup_steps=10, decay_fraction=0.2, lr=1e-3)
    assert cfg.lr_schedule == choices.LINEAR
    # the expression every run so far used, to the last bit
    assert learning_rate(cfg, 87, 0.87, 0.1) == 1e-3 * ((1.0 - 0.87) / max(1e-12, 1.0 - 0.8))


def small_trainer(tmp_path, name: str, *overrides: str, on_step_end=None):
    """A Trainer of a one-layer H32 model, batch 4 unless overridden, in tmp_path / name."""
    from mlmlab.config import load_config
    from mlmlab.train.loop import Trainer

    cfg = load_config(
        "tiny",
        [f"train.out_dir={tmp_path / name}", "data.loader_workers=0", *TINY_MODEL, "train.batch_size=4", *overrides],
    )
    return Trainer(cfg, evaluator=None, show_progress=False, on_step_end=on_step_end)


def test_on_step_end_sees_every_step_and_a_true_return_ends_the_run_there(tmp_path):
    """A caller's on_step_end (a benchmark evaluating at wall-clock intervals) is called with the trainer after each
    step; a true return ends the run after that step, finished as a spent budget is (final checkpoint and model)."""
    from mlmlab.train.run_folder import MODEL_DIR, PREFIX, complete_checkpoints

    seen = []

    def stop_at_third(trainer):
        seen.append(trainer.state.step)
        return trainer.state.step == 3

    small_trainer(
        tmp_path,
        "stopped",
        "train.max_steps=8",
        "train.warmup_steps=2",
        "train.save_every=0",
        on_step_end=stop_at_third,
    ).train()
    assert seen == [1, 2, 3]
    assert [path.name for path in complete_checkpoints(tmp_path / "stopped")] == [f"{PREFIX}00000003"]
    assert (tmp_path / "stopped" / MODEL_DIR / "config.json").is_file()
    seen.clear()
    record = seen.append  # returns None: a falsy return trains the whole budget
    small_trainer(
        tmp_path,
        "whole",
        "train.max_steps=4",
        "train.warmup_steps=2",
        "train.save_every=0",
        on_step_end=lambda t: record(t.state.step),
    ).train()
    assert seen == [1, 2, 3, 4]


def matmul_dtypes(trainer) -> set:
    """The dtypes of the model's linear outputs during one training step."""
    import torch

    seen = set()
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: seen.add(output.dtype) if isinstance(module, torch.nn.Linear) else None
    )
    try:
        trainer.train_step(trainer.batches())
    finally:
        hook.remove()
    return seen


def test_runs_of_different_precisions_train_side_by_side_in_one_process(tmp_path):
    """accelerate allows one precision per process; a study's fp32 and bf16 arms run in one (unsharded, or
    probed), and a benchmark interleaves trainers of both."""
    import torch

    fp32 = small_trainer(tmp_path, "a", "train.precision=fp32")
    bf16 = small_trainer(
        tmp_path, "b", "train.precision=bf16"
    )  # accelerate alone refuses this Accelerator: "restart your runtime"
    assert matmul_dtypes(fp32) == {torch.float32}  # the earlier run keeps its own precision ...
    later_fp32 = small_trainer(tmp_path, "c", "train.precision=fp32")
    assert matmul_dtypes(bf16) == {torch.bfloat16}  # ... and so does this one
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # autocast: fp32 weights
    assert matmul_dtypes(later_fp32) == {torch.float32}
    assert (fp32.precision.name, bf16.precision.name, later_fp32.precision.name) == ("fp32", "bf16", "fp32")


@pytest.mark.parametrize("scorer", ["entropy", "grad_norm"])
def test_adm_scores_in_the_precision_the_step_trains_in(tmp_path, scorer):
    """ADM's scoring forward is a forward of the training model: a bf16 run scores in bf16 (on an AMX host,
    where auto picks bf16, an fp32 scorer would cost more than the step), an fp32 run in fp32."""
    import torch

    adm = ("masking.strategy=adaptive", f"masking.scorer={scorer}", "masking.adapt_schedule=constant")
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        trainer = small_trainer(tmp_path, f"{scorer}-{precision}", f"train.precision={precision}", *adm)
        assert matmul_dtypes(trainer) == {dtype}, precision
        assert trainer.masker.stats()["mask_scored_steps"] == 1  # the step was scored


def test_held_out_evaluation_is_fp32_in_a_bf16_run_as_mlmlab_evaluate_is(tmp_path):
    """The held-out figures are the weights' own: a bf16 run evaluates in fp32, to the bit what evaluating its
    model alone (`mlmlab evaluate` of the export) gives, while its training step stays in bf16."""
    import torch

    from mlmlab.evaluate.perplexity import evaluate_mlm

    bf16 = small_trainer(tmp_path, "b", "train.precision=bf16")
    assert matmul_dtypes(bf16) == {torch.bfloat16}
    bf16.evaluator = evaluate_mlm
    seen = set()
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: seen.add(output.dtype) if isinstance(module, torch.nn.Linear) else None
    )
    try:
        in_run = bf16.evaluate(max_batches=2)
    finally:
        hook.remove()
    assert seen == {torch.float32}
    alone = evaluate_mlm(
        bf16.model, bf16.valid_store, bf16.masker.info, batch_size=bf16.cfg.train.eval_batch_size, max_batches=2
    )
    assert in_run["mlm_loss"] == alone["mlm_loss"] and in_run["mlm_accuracy"] == alone["mlm_accuracy"]
    assert matmul_dtypes(bf16) == {torch.bfloat16}  # training is back in bf16 after it


def test_held_out_evaluation_scores_a_bert_for_masked_lm_as_the_same_weights_with_an_nsp_head(tmp_path):
    """evaluate_mlm takes transformers' BertForMaskedLM (no pooler, no NSP head), as benchmarks/time_to_loss.py's
    run_mlm anchor is: the same MLM figures as the BertForPreTraining holding its weights."""
    from transformers import BertForMaskedLM

    from mlmlab.evaluate.perplexity import evaluate_mlm

    trainer = small_trainer(tmp_path, "mlm", "data.objective=mlm")
    masked_lm = BertForMaskedLM(trainer.model.config)
    unused = masked_lm.load_state_dict(trainer.model.state_dict(), strict=False).unexpected_keys
    assert {key.split(".")[1] for key in unused} == {"pooler", "seq_relationship"}
    figures = [
        evaluate_mlm(model, trainer.valid_store, trainer.masker.info, max_batches=2)
        for model in (trainer.model, masked_lm)
    ]
    assert figures[0]["masked_tokens"] > 0 and figures[0] == figures[1]


def test_a_cuda_run_uses_tf32_unless_it_asks_for_fp32(monkeypatch):
    """train.precision=fp32 means IEEE fp32 on a GPU too (a precision study's fp32 arm); auto and bf16 take
    TF32 for the fp32 matmuls left. The Accelerator is this CPU's, told it is on CUDA."""
    import torch

    from mlmlab.config import load_config
    from mlmlab.train import launch

    real_accelerator = launch.Accelerator

    class OnCuda:
        device = torch.device("cuda")

        def __init__(self, *args, **kwargs):
            self.real = real_accelerator(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.real, name)

    monkeypatch.setattr(launch, "Accelerator", OnCuda)
    # Put back by hand, not by monkeypatch: cuBLASModule handles its own attributes, and under pytest 9.2
    # monkeypatch's undo of one raised and left the fake Accelerator patched in for the rest of the suite.
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for precision, tf32 in (("fp32", False), ("auto", True), ("fp32", False)):
            launch.make_accelerator(
                load_config("tiny", [f"train.precision={precision}"]), launch.resolve_precision(precision)
            )
            assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (tf32, tf32), precision
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_auto_precision_is_bf16_where_bf16_matmuls_measure_clearly_faster(tmp_path, monkeypatch, capsys):
    """Where bf16 autocast measured faster and ended where fp32 does (studies/precision-bf16-cpu); the log says
    the measured speed it chose by."""
    import torch

    from mlmlab.train import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for speedup, expected in ((7.0, "bf16"), (launch.BF16_CLEARLY_FASTER, "bf16"), (1.3, "no"), (0.01, "no")):
        monkeypatch.setattr(launch, "cpu_bf16_speedup", lambda speedup=speedup: speedup)
        assert launch.resolve_precision("auto").accelerate == expected, speedup
        assert (launch.resolve_precision("fp32").accelerate, launch.resolve_precision("bf16").accelerate) == (
            "no",
            "bf16",
        )
    monkeypatch.setattr(launch, "cpu_bf16_speedup", lambda: 7.0)
    on_fast = small_trainer(tmp_path, "fast", "train.precision=auto")
    assert on_fast.precision.name == "bf16" and matmul_dtypes(on_fast) == {torch.bfloat16}
    assert "precision bf16 (train.precision=auto: bf16 matmuls 7x fp32's on one core here" in capsys.readouterr().err


def test_the_bf16_speed_is_timed_in_under_a_second_and_leaves_the_thread_count():
    import torch

    from mlmlab.train import launch

    threads = torch.get_num_threads()
    start = time.perf_counter()
    speedup = launch.time_bf16_speedup()  # timed now, not this process's cached figure
    assert time.perf_counter() - start < 1.5  # about 0.2 s idle, 0.3-0.75 s beside a study's run
    assert 1e-4 < speedup < 100 and torch.get_num_threads() == threads


def test_auto_precision_is_fp32_where_bf16_matmuls_are_slow():
    """oneDNN held to AVX2 computes bf16 in software, as on an AVX2-only host (0.01x fp32's speed): whatever
    this host's units, auto must then train in fp32."""
    code = "from mlmlab.train import launch; print(launch.cpu_bf16_speedup(), launch.auto_precision())"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    speedup, precision = done.stdout.split()
    assert float(speedup) < 0.5 and precision == "fp32", done.stdout + done.stderr


def test_batch_warmup_grows_a_micro_batch_at_a_time_with_equal_steps_at_each_size():
    import numpy as np

    from mlmlab.config import TrainConfig
    from mlmlab.train.optim import micro_batches_at

    cfg = TrainConfig(grad_accum=6, batch_warmup_steps=10, batch_warmup_start=1, max_steps=100)
    counts = [int(micro_batches_at(cfg, step)) for step in range(1, 14)]
    assert counts == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 6]
    assert micro_batches_at(cfg, np.arange(1, 14)).tolist() == counts  # the budget's array form agrees
    later = TrainConfig(grad_accum=6, batch_warmup_steps=8, batch_warmup_start=2, max_steps=100)
    assert [int(micro_batches_at(later, step)) for step in range(1, 10)] == [2, 2, 3, 3, 4, 4, 5, 5, 6]
    assert micro_batches_at(TrainConfig(grad_accum=3), 1) == 3  # off: every step takes grad_accum


def test_time_left_during_a_batch_warmup_counts_batches_not_steps(monkeypatch):
    """Steps 1-10 of 20 hold 30 of the run's 90 micro-batches: a third of its work in 10 minutes leaves 20,
    where the share of steps (a half) would say 10."""
    from mlmlab.config import TrainConfig
    from mlmlab.train.loop import progress_line
    from mlmlab.train.optim import work_done
    from mlmlab.utils import progress

    cfg = TrainConfig(grad_accum=6, batch_warmup_steps=10, batch_warmup_start=1, max_steps=20)
    clock = iter([0.0, 600.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    pace = progress.Pace(work_done(cfg, 0, 0.0))
    assert progress_line(cfg, 10, 0.5, 5.0, {}, pace) == "step 10/20 (50%): loss 5.000; about 20 min left"


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["train.batch_warmup_steps=10"], ["train.grad_accum=1", "train.batch_warmup_start=1"]),
        (["train.grad_accum=4", "train.batch_warmup_steps=10", "train.batch_warmup_start=4"], ["micro-batches"]),
        (["train.grad_accum=4", "train.batch_warmup_steps=1000", "train.max_steps=1000"], ["never reach"]),
    ],
)
def test_a_batch_warmup_that_cannot_grow_is_refused_in_one_line(overrides, words):
    from mlmlab.config import load_config
    from mlmlab.errors import UserError

    with pytest.raises(UserError) as refused:
        load_config("tiny", overrides)
    assert all(word in str(refused.value) for word in words) and "\n" not in str(refused.value)


def test_a_warming_step_reads_fewer_micro_batches_and_loses_no_data(tmp_path):
    """Steps 1-6 of grad_accum 3 read 1, 1, 1, 2, 2, 2 micro-batches, then 3: the loader moves on by exactly those,
    so no batch is skipped, and the losses stay normalised over the step's own targets."""
    trainer = small_trainer(
        tmp_path,
        "warm",
        "train.grad_accum=3",
        "train.batch_warmup_steps=6",
        "train.max_steps=20",
        "train.warmup_steps=2",
    )
    batches, read = trainer.batches(), []
    for _ in range(8):
        before = trainer.state.position.batch
        out = trainer.train_step(batches)
        trainer.state.advance(out["clock"], trainer.cfg.train)
        read.append(trainer.state.position.batch - before)
        assert math.isfinite(out["loss"]) and 2.0 < out["mlm_loss"] < 12.0
    assert read == [1, 1, 1, 2, 2, 2, 3, 3]


def test_train_deterministic_turns_torchs_deterministic_kernels_on_for_its_run_only(tmp_path, monkeypatch):
    """Set per run, either way: a study's arms share one process. Its bitwise resume is what a GPU needs it for
    (tests/gpu_check.py reports it there); CPU kernels are deterministic already."""
    import torch

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        small_trainer(tmp_path, "deterministic", "train.deterministic=true")
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        small_trainer(tmp_path, "default")
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
