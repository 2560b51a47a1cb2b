"""Two CPU processes (gloo, via torchrun) follow the same loss trajectory as one process: DDP and FSDP."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import PMI_TEST_VOCAB
from safetensors.torch import load_file

from mlmlab.config import load_config
from mlmlab.errors import UserError
from mlmlab.train import run_folder
from mlmlab.train.launch import over_processes
from mlmlab.train.run_folder import load_torch

COMMON = [
    "--no-progress",
    "train.max_steps=4",
    "train.log_every=1",
    "train.eval_every=0",
    "train.save_every=0",
    "train.eval_batches=1",
    "model.dropout=0.0",
    "data.loader_workers=0",
    "train.warmup_steps=2",
    "train.precision=fp32",
]  # auto would be bf16 on AMX hosts
# What `accelerate launch` sets for an FSDP config (fsdp_version 2, per-layer auto wrap).
FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}
FSDP_LAUNCHER = Path(__file__).with_name("fsdp_on_cpu.py")


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["tokens"]) for r in records if "loss" in r]


def mask_shares(run_dir) -> list[dict]:
    """Each log record's selected share per frequency bucket."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k.startswith("mask_share_freq_")} for r in records if "loss" in r]


def weights(run_dir) -> dict:
    return load_file(run_dir / "model" / "model.safetensors")


def masking_state(run_dir) -> dict:
    """The last checkpoint's masking state, less the seconds spent scoring (a clock, not a result)."""
    state = load_torch(sorted(run_dir.glob("ckpt-*"))[-1] / "training_state.pt")["strategy"]
    return {key: value for key, value in state.items() if key != "score_seconds_total"}


def assert_same_trajectory(one, two):
    assert len(one) == len(two) == 4, "each process must log once per step, only the main one"
    for (step, loss, norm, tokens), (step2, loss2, norm2, tokens2) in zip(one, two):
        assert step == step2 and tokens == tokens2
        # torch's fp32 gradient norm is itself only good to ~1e-4 here: at step 1 the float64 norm
        # is 2.2030442, one process logs 2.2027190 and FSDP 2.2028630 (measured).
        assert loss2 == pytest.approx(loss, rel=1e-5) and norm2 == pytest.approx(norm, rel=5e-4)


# ADM learning from the losses: its tables must be learnt from the whole global batch on every
# process, or masks would depend on the process count (linear: a > 0 from step 2).
ADM_CONTEXT = ("masking.strategy=adaptive", "masking.scorer=context", "masking.adapt_schedule=linear")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process with the global batch of 8; each setting run once."""
    runs = {}

    def run(*overrides) -> Path:
        if overrides not in runs:
            out = tmp_path_factory.mktemp("one")
            single = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "mlmlab.cli",
                    "pretrain",
                    *COMMON,
                    "train.batch_size=8",
                    f"train.out_dir={out}",
                    *overrides,
                ],
                capture_output=True,
                text=True,
            )
            assert single.returncode == 0, single.stderr[-2000:]
            runs[overrides] = out
        return runs[overrides]

    return run


def fsdp_pretrain(run_dir, *overrides) -> subprocess.CompletedProcess:
    """2 processes x batch 4 under accelerate's FSDP2, checkpoints every 2 steps."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            str(FSDP_LAUNCHER),
            "pretrain",
            *COMMON,
            "train.batch_size=4",
            "train.save_every=2",
            f"train.out_dir={run_dir}",
            *overrides,
        ],
        env={**os.environ, **FSDP_ENV},
        capture_output=True,
        text=True,
    )


def ddp_pretrain(run_dir, *overrides) -> subprocess.CompletedProcess:
    """2 processes x batch 4 under torchrun (DDP)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "-m",
            "mlmlab.cli",
            "pretrain",
            *COMMON,
            "train.batch_size=4",
            f"train.out_dir={run_dir}",
            *overrides,
        ],
        capture_output=True,
        text=True,
    )


def forget_last_checkpoint(run_dir) -> None:
    """As if killed after the previous checkpoint: the rerun resumes from it."""
    shutil.rmtree(sorted(run_dir.glob("ckpt-*"))[-1])
    shutil.rmtree(run_dir / "model")
    (run_dir / "summary.json").unlink()


PMI = ("masking.strategy=pmi", f"masking.pmi_vocab_size={PMI_TEST_VOCAB}")  # the first run builds its n-grams


@pytest.mark.parametrize("masking", [(), ADM_CONTEXT, PMI], ids=["dynamic", "adm-context", "pmi"])
def test_two_processes_equal_one_with_the_same_global_batch(tmp_path, one_process, masking):
    # Dropout off: each rank draws its own dropout masks, which no split could reproduce.
    double = ddp_pretrain(tmp_path / "two", *masking)
    assert double.returncode == 0, double.stderr[-2000:]
    assert double.stdout.count("model card:") == 1, "the summary is printed by the main process only"
    assert_same_trajectory(losses(one_process(*masking)), losses(tmp_path / "two"))
    # The same masks, so the same shares, counted over the global batch (not the main process's half of it).
    assert mask_shares(tmp_path / "two") == mask_shares(one_process(*masking)) != []
    # The masking state checkpointed by the main process is what one process learnt from the same
    # global batches (ADM: loss tables; per-rank tables would hold half the observations).
    reference, split = masking_state(one_process(*masking)), masking_state(tmp_path / "two")
    assert reference.keys() == split.keys()
    for key, value in reference.items():
        torch.testing.assert_close(split[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_processes_option_splits_the_batch_and_trains_the_one_process_run(tmp_path, one_process):
    """`pretrain --processes 2` launches torchrun itself: batch 8 becomes 2 x 4, the same run as 1 x 8."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlmlab.cli",
            "pretrain",
            "--processes",
            "2",
            *COMMON,
            "train.batch_size=8",
            f"train.out_dir={tmp_path}",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "training as 2 DDP processes x 1 thread(s), batch 4 each (global batch 8)" in run.stderr
    summary = json.loads(run.stdout)  # --json ended argv: the split batch did not become its FILE
    assert (summary["distributed"], summary["processes"]) == ("MULTI_CPU", 2)
    assert_same_trajectory(losses(one_process()), losses(tmp_path))


def test_processes_command_keeps_the_users_arguments_and_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    argv = ["pretrain", "--processes=4", "--config", "tiny", "train.batch_size=64", "train.lr=2e-3", "--json"]
    command, env, _ = over_processes(argv, 4, load_config("tiny", ["train.batch_size=64"]))
    assert command[command.index("mlmlab.cli") + 1 :] == [
        "pretrain",
        "train.batch_size=16",
        "--config",
        "tiny",
        "train.lr=2e-3",
        "--json",
    ]
    assert "--nproc_per_node=4" in command and env["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize(
    "env, batch, message",
    [
        ({"LOCAL_RANK": "0"}, 32, "--processes starts its own processes: under torchrun"),
        ({}, 33, "train.batch_size=33 does not split over --processes 2"),
    ],
)
def test_processes_refuses_what_it_cannot_split_in_one_line(monkeypatch, env, batch, message):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match=re.escape(message)):
        over_processes(["pretrain", "--processes", "2"], 2, load_config("tiny", [f"train.batch_size={batch}"]))


def test_fsdp_trains_like_one_process_and_resumes_to_the_bit(tmp_path, one_process):
    run_dir = tmp_path / "fsdp"
    first = fsdp_pretrain(run_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["distributed"], summary["processes"]) == ("FSDP", 2)
    assert_same_trajectory(losses(one_process()), losses(run_dir))
    # The checkpoint gathers the shards: the whole model, equal to the one-process model.
    sharded_run, reference = weights(run_dir), weights(one_process())
    assert sharded_run.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(sharded_run[name], tensor, rtol=1e-4, atol=1e-5, msg=name)

    # As if killed after step 2's checkpoint: the rerun resumes from it, still sharded.
    trajectory = losses(run_dir)
    forget_last_checkpoint(run_dir)
    second = fsdp_pretrain(run_dir)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stdout + second.stderr
    assert losses(run_dir) == trajectory
    resumed = weights(run_dir)
    assert all(torch.equal(resumed[name], tensor) for name, tensor in sharded_run.items())


def test_fsdp_with_the_fused_levers_trains_like_one_eager_process(tmp_path, one_process):
    """train.fused_head reads the decoder's weight in the root module's forward and train.fused_qkv concatenates
    Q, K and V in each layer's: both where FSDP2 has gathered the shards, so both run sharded."""
    result = fsdp_pretrain(tmp_path / "fused", "train.fused_head=true", "train.fused_qkv=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "train.fused_qkv: 2 attention layers project Q, K and V with one matmul" in result.stdout + result.stderr
    assert_same_trajectory(losses(one_process()), losses(tmp_path / "fused"))
    fused, reference = weights(tmp_path / "fused"), weights(one_process())
    for name, tensor in reference.items():
        torch.testing.assert_close(fused[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_fsdp_with_stable_adamw_trains_like_one_process(tmp_path, one_process):
    """StableAdamW's update clipping reads each tensor's RMS over the whole tensor, not over a process's shard (one
    process clips 37, 30 and 3 of its 46 tensors at steps 2-4 of this run: the comparison covers clipped steps)."""
    settings = ("train.optimizer=stable-adamw", "train.max_grad_norm=0")
    result = fsdp_pretrain(tmp_path / "stable", *settings)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_trajectory(losses(one_process(*settings)), losses(tmp_path / "stable"))
    sharded, reference = weights(tmp_path / "stable"), weights(one_process(*settings))
    for name, tensor in reference.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("masking.strategy=adaptive", "masking.scorer=entropy"), "masking.scorer=entropy needs the whole model"),
        (("train.compile=true",), "train.compile with FSDP is untested"),
    ],
    ids=["model-scorer", "compile"],
)
def test_fsdp_refuses_what_it_cannot_run_in_one_line(tmp_path, overrides, message):
    result = fsdp_pretrain(tmp_path / "run", *overrides)
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_each_process_resumes_its_own_dropout_generator(tmp_path):
    """With dropout each process draws its own masks: a resume gives each its own generator back, not the main one's."""
    run_dir = tmp_path / "ddp"
    # Instances of random lengths, unbucketed: the processes' batches then differ in length, and so do their
    # generators (full-length or length-bucketed batches give both the same shapes, and the same states).
    varied = ("model.dropout=0.1", "train.save_every=2", "data.short_seq_prob=1.0", "data.bucket_batches=0")
    first = ddp_pretrain(run_dir, *varied)
    assert first.returncode == 0, first.stderr[-3000:]
    trajectory, straight = losses(run_dir), weights(run_dir)
    by_process = load_torch(run_dir / "ckpt-00000002" / "training_state.pt")["torch_rng_by_process"]
    assert not torch.equal(by_process[0], by_process[1]), "the processes' generators never differed: nothing tested"
    forget_last_checkpoint(run_dir)
    second = ddp_pretrain(run_dir, *varied)
    assert second.returncode == 0, second.stderr[-3000:]
    assert losses(run_dir) == trajectory
    resumed = weights(run_dir)
    assert all(torch.equal(resumed[name], tensor) for name, tensor in straight.items())


def test_a_time_budget_ends_every_process_at_the_same_step(tmp_path):
    """Each process's own clock would end the budget at its own step, and one would wait for the other forever."""
    result = ddp_pretrain(tmp_path, "train.max_minutes=0.1", "train.warmup_steps=1")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["train_seconds"] >= 6.0 and summary["steps"] == len(losses(tmp_path)) >= 2


def worker_of_rank(launcher_pid: int, rank: int) -> int:
    """The pid of torchrun's worker process of ``rank`` (from its environment; Linux /proc)."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            parent = next(line for line in status.read_text().splitlines() if line.startswith("PPid:"))
            environ = (status.parent / "environ").read_bytes().split(b"\0")
        except (OSError, StopIteration):  # a process that ended meanwhile
            continue
        if int(parent.split()[1]) == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(status.parent.name)
    raise AssertionError(f"no worker of rank {rank} under {launcher_pid}")


def test_sigterm_to_one_process_stops_all_at_the_same_step_with_a_checkpoint(tmp_path):
    """torchrun forwards a SIGTERM to every worker, each at its own moment; here only rank 1 gets one."""
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "-m",
            "mlmlab.cli",
            "pretrain",
            *COMMON,
            "train.max_steps=100000",
            "train.batch_size=4",
            f"train.out_dir={tmp_path}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    while not (tmp_path / "metrics.jsonl").exists() and launcher.poll() is None:
        time.sleep(0.1)
    os.kill(worker_of_rank(launcher.pid, 1), signal.SIGTERM)
    try:
        output, _ = launcher.communicate(timeout=180)
    except subprocess.TimeoutExpired:  # rank 1 waiting in its checkpoint's barrier, rank 0 in the next step
        os.killpg(launcher.pid, signal.SIGKILL)
        raise AssertionError("the processes did not stop together: the launch hung") from None
    assert launcher.returncode != 0 and "SIGTERM: saving a checkpoint" in output, output[-3000:]
    saved = run_folder.latest(tmp_path)
    step = json.loads((saved / "trainer_state.json").read_text())["step"]
    assert step == max(record[0] for record in losses(tmp_path)) >= 1


def test_a_cuda_resume_restores_one_state_onto_each_process_own_gpu(monkeypatch):
    """A checkpoint's per-process CUDA states go each to its own process; where the process count changed, the
    main process's own GPU state (first in its list of every GPU it saw), not the whole list: that would fail
    on a host showing fewer GPUs. The CUDA calls are recorded (this host has no GPU)."""
    from types import SimpleNamespace

    from mlmlab.train.checkpointer import set_rng_states

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append((state, device)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("restored every GPU's state"))
    monkeypatch.setattr(torch, "set_rng_state", lambda state: None)
    eight_gpus = [torch.full((4,), i, dtype=torch.uint8) for i in range(8)]
    two_processes = torch.stack([torch.full((4,), 10 + i, dtype=torch.uint8) for i in range(2)])
    states = {
        "torch_rng": torch.zeros(4, dtype=torch.uint8),
        "cuda_rng": eight_gpus,
        "cuda_rng_by_process": two_processes,
        "torch_rng_by_process": two_processes,
    }
    for processes, rank, expected in ((2, 1, two_processes[1]), (1, 0, eight_gpus[0]), (4, 3, eight_gpus[0])):
        restored.clear()
        set_rng_states(states, SimpleNamespace(num_processes=processes, process_index=rank, device=f"cuda:{rank}"))
        assert len(restored) == 1 and torch.equal(restored[0][0], expected) and restored[0][1] == f"cuda:{rank}"


def test_processes_wait_for_each_other_longer_than_nccls_ten_minutes():
    """The others wait at a barrier while the main process prepares the corpus (launch.PROCESS_GROUP_TIMEOUT)."""
    from mlmlab.train import launch

    cfg = load_config("tiny", ["train.precision=fp32"])
    accelerator = launch.make_accelerator(cfg, launch.resolve_precision(cfg.train.precision))
    assert accelerator.init_handler.timeout == launch.PROCESS_GROUP_TIMEOUT
    assert launch.PROCESS_GROUP_TIMEOUT.total_seconds() > 600
