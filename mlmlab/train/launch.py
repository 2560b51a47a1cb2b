"""The accelerator a run trains under, and the launches it refuses before training.

accelerate reads the launch (single process, torchrun/DDP, FSDP) from the environment;
what nothing here has tested, or what would silently do something other than asked,
is refused in one line.
"""

import functools
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs, parse_flag_from_env

from mlmlab import choices
from mlmlab.config import Config
from mlmlab.errors import UserError
from mlmlab.masking.strategies import strategy_entry
from mlmlab.train.mfu import peak_matmul_flops
from mlmlab.train.run_folder import run_dir_for
from mlmlab.train.trackers import accelerate_trackers
from mlmlab.utils.devices import available_cores, describe_cpu
from mlmlab.utils.progress import say_once


@dataclass(frozen=True)
class Precision:
    """One training precision under the three names it goes by."""

    name: str  # train.precision's (fp32, bf16, fp16): what the run's log says
    accelerate: str  # accelerate's mixed_precision, an Accelerator's and so a Trainer's ("no" is fp32)
    dtype: torch.dtype  # what the matmuls run in: the MFU peak's dtype, a value's bytes in the memory estimate


PRECISIONS = (
    Precision(choices.FP32, "no", torch.float32),
    Precision(choices.BF16, "bf16", torch.bfloat16),
    Precision(choices.FP16, "fp16", torch.float16),
)


def resolve_precision(setting: str) -> Precision:
    """train.precision's Precision, "auto" resolved by ``auto_precision``."""
    name = auto_precision() if setting == choices.AUTO else setting
    return next(precision for precision in PRECISIONS if precision.name == name)


def auto_precision() -> str:
    """What train.precision=auto trains in: bf16 autocast on a CUDA GPU that has it and on a CPU whose bf16
    matmuls clearly beat its fp32 ones (``cpu_bf16_speedup``), fp32 elsewhere.

    Where bf16 matmuls ran faster, bf16 autocast trained faster: 1.25x (tiny) and 1.11x (mini) the tokens/s of
    fp32 on an AMX host (docs/scale-out.md), and ended where fp32 does (studies/precision-bf16-cpu); without
    bf16 units it is slower.
    """
    if torch.cuda.is_available():
        return choices.BF16 if torch.cuda.is_bf16_supported() else choices.FP32
    return choices.BF16 if cpu_bf16_speedup() >= BF16_CLEARLY_FASTER else choices.FP32


# The bf16/fp32 matmul speed from which auto trains a CPU run in bf16. A step gains less than its matmuls
# (bf16 matmuls 2.5x fp32's trained tiny 1.33x faster on an AMD EPYC with AVX512-BF16) and pays for the casts,
# so near parity bf16 would gain nothing. Hosts measured so far sit far from it on either side (one core,
# this one's oneDNN held to each level: AMX 6.3-8.2x, AVX512-BF16 without AMX 0.55x, AVX-512 0.19x,
# AVX2 0.01x), so the processes of one launch, timing on their own, agree.
BF16_CLEARLY_FASTER = 1.5


def time_bf16_speedup() -> float:
    """This CPU's bf16 over fp32 dense-matmul FLOP/s, timed now on one core (about 0.3 s).

    Measured, never read from the CPU's name or flags: hosts of one machine type differ (AMX, AVX512-BF16
    alone, none), and oneDNN may be held below what the CPU has (ONEDNN_MAX_CPU_ISA). One thread, because
    beside another job (a study's run) a thread pool waits at each barrier for a preempted thread: timed
    on two busy cores the ratio swung 100-fold between calls, on one it stayed within 30%. Rounds alternate
    the two dtypes and keep each one's best, so a burst of load slows neither alone.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = {torch.bfloat16: 0.0, torch.float32: 0.0}
        for _round in range(3):
            for dtype in best:
                best[dtype] = max(best[dtype], peak_matmul_flops("cpu", dtype, seconds=0.03))
    finally:
        torch.set_num_threads(threads)
    return best[torch.bfloat16] / best[torch.float32]


cpu_bf16_speedup = functools.cache(time_bf16_speedup)  # once per process: a host's units do not change as it runs


# How long a process waits for the others at a collective. The first is the main process preparing the
# corpus while the others wait (Trainer: main_process_first), which on a large corpus outlasts NCCL's
# 10-minute default; prepare a large corpus beforehand (`mlmlab prepare`) and the wait is seconds.
PROCESS_GROUP_TIMEOUT = timedelta(hours=2)


def make_accelerator(cfg: Config, precision: Precision) -> Accelerator:
    """The run's accelerator, training in ``precision`` (train.precision resolved: a Trainer's ``precision``)."""
    refuse_deepspeed()
    refuse_fp16_without_cuda(cfg.train.precision)
    # The mlm objective leaves the NSP head without gradients, which DDP must be told about.
    ddp_kwargs = DistributedDataParallelKwargs(find_unused_parameters=cfg.data.objective == choices.MLM)
    # cpu=True is what makes accelerate run several CPU processes (gloo) under torchrun.
    release_other_precision(precision.accelerate)
    handlers = [ddp_kwargs, InitProcessGroupKwargs(timeout=PROCESS_GROUP_TIMEOUT)]
    accelerator = Accelerator(
        mixed_precision=precision.accelerate,
        kwargs_handlers=handlers,
        cpu=not torch.cuda.is_available(),
        log_with=accelerate_trackers(cfg.train.report_to) or None,
        project_dir=str(run_dir_for(cfg)),  # where trackers that keep local files write (Aim, DVCLive)
    )
    if accelerator.device.type == "cuda":
        use_tf32(cfg.train.precision != choices.FP32)
    use_deterministic(cfg.train.deterministic)
    check_fsdp(accelerator, cfg)
    return accelerator


def use_deterministic(on: bool) -> None:
    """train.deterministic: torch's deterministic kernels, an op that has none warning rather than stopping the run.
    Set either way: a study's arms run one after another in one process.

    Not transformers' enable_full_determinism: it also sets CUDA_LAUNCH_BLOCKING=1, which serialises every kernel
    launch (a large slowdown that determinism does not need). cuBLAS reads CUBLAS_WORKSPACE_CONFIG when its handle
    is made, so a process whose first CUDA run was not deterministic keeps that workspace: say so in the docs."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (CUDA >= 10.2)
    torch.use_deterministic_algorithms(on, warn_only=True)


def fused_head_on(setting: bool | None) -> bool:
    """train.fused_head, null (auto) resolved: off on every device. On a CPU the eager head is 1.03-1.11x faster
    since the allocator keeps large blocks; on an H200 the fused one trained 0.94x its tokens/s (one run,
    docs/benchmarks.md)."""
    return bool(setting)


def use_tf32(allowed: bool) -> None:
    """TF32 for CUDA's fp32 matmuls (a 10-bit mantissa, several times faster) where the run does not ask for
    fp32: train.precision=fp32 means IEEE fp32, so that a precision study's fp32 arm is one. Set either way: a
    study's arms of both precisions run one after another in one process."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = allowed


def say_precision(accelerator: Accelerator, cfg: Config, precision: Precision) -> None:
    """Which precision this run trains in on which device (hosts of one machine type differ in bf16 units),
    and what bf16 costs on a CPU that has none. Said once the run's refusals are past, so a refusal stays
    the one line on stderr."""
    used = precision.name
    on_gpu = accelerator.device.type == "cuda"
    where = (
        (
            f"{torch.cuda.get_device_name(accelerator.device)}, TF32 matmuls "
            + ("on" if torch.backends.cuda.matmul.allow_tf32 else "off")
        )
        if on_gpu
        else describe_cpu()
    )
    head = "fused" if fused_head_on(cfg.train.fused_head) else "eager"
    setting = "null: auto" if cfg.train.fused_head is None else str(cfg.train.fused_head).lower()
    say_once(
        accelerator,
        f"precision {used} (train.precision={cfg.train.precision}{auto_reason(cfg.train.precision, on_gpu)}), "
        f"{head} MLM head (train.fused_head={setting}) on {where}",
    )
    if not on_gpu and used == choices.BF16 and cpu_bf16_speedup() < 1:
        say_once(accelerator, slow_bf16_note())


def auto_reason(setting: str, on_gpu: bool) -> str:
    """Why auto chose as it did on a CPU: the measured speed it chose by. Empty for a precision set by name."""
    if setting != choices.AUTO or on_gpu:
        return ""
    return f": bf16 matmuls {cpu_bf16_speedup():.2g}x fp32's on one core here, bf16 from {BF16_CLEARLY_FASTER}x"


def slow_bf16_note() -> str:
    """One line for a bf16 run on a CPU whose bf16 matmuls are slower than its fp32 ones (no bf16 units)."""
    ratio = cpu_bf16_speedup()
    return (
        f"this CPU's bf16 matmuls ran at {ratio:.2g}x the speed of fp32 (one core, timed at start), so this run "
        f"may train up to {max(1.0, 1 / ratio):.0f}x slower than in fp32; train.precision=fp32 (or auto) avoids that"
    )


def release_other_precision(precision: str) -> None:
    """Let one process build Accelerators of different precisions, one after another.

    accelerate keeps one AcceleratorState per process, shared by every Accelerator, and refuses a
    new Accelerator whose mixed_precision differs ("restart your runtime"): a study whose arms
    differ in precision (precision-bf16-cpu) could then neither run unsharded nor be probed.
    Clearing that state (PartialState, which holds the process group, stays) lets the next one
    start afresh. An earlier Accelerator still trains in its own precision (its ``native_amp`` and
    its prepared model's autocast are its own; tested), but its ``mixed_precision`` property then
    reads the new one: ``Trainer.precision`` keeps each run's.
    """
    if AcceleratorState._shared_state.get("_mixed_precision", precision) != precision:
        AcceleratorState._reset_state(reset_partial_state=False)


def refuse_fp16_without_cuda(precision: str) -> None:
    """accelerate turns fp16 autocast off on CPUs without a word: the run would train in fp32, logged as fp16."""
    if precision == choices.FP16 and not torch.cuda.is_available():
        raise UserError(
            "train.precision=fp16 needs a CUDA GPU (on CPUs accelerate would silently train in fp32); "
            "use bf16 (fast on CPUs with AMX) or fp32"
        )


def refuse_deepspeed() -> None:
    """Stop a DeepSpeed launch before it trains: nothing here has run or tested it."""
    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):  # as accelerate itself reads its launch flags
        raise UserError(
            "DeepSpeed is not supported; launch with FSDP (an accelerate config with "
            "distributed_type FSDP and fsdp_version 2) or with DDP (torchrun)"
        )


def check_fsdp(accelerator: Accelerator, cfg: Config) -> None:
    """Refuse the FSDP set-ups that would silently go wrong or that nothing here has tested."""
    if accelerator.distributed_type != DistributedType.FSDP:
        if parse_flag_from_env("ACCELERATE_USE_FSDP"):
            # accelerate 1.15 shards only on accelerators: on CPU it runs an FSDP config as DDP, silently.
            raise UserError(
                "this FSDP launch would not shard (accelerate runs FSDP only on GPUs and other "
                "accelerators); on CPUs launch with DDP instead: torchrun, or accelerate with "
                "distributed_type MULTI_CPU"
            )
        return
    if not accelerator.is_fsdp2:
        raise UserError(
            "FSDP version 1 is not supported; set fsdp_version: 2 in the accelerate config (FSDP_VERSION=2)"
        )
    if refusal := strategy_entry(cfg.masking.strategy).fsdp_refusal(cfg.masking):
        raise UserError(refusal)
    if cfg.train.compile:  # the fused levers run sharded (tests/test_distributed.py); compiling was never tried
        raise UserError("train.compile with FSDP is untested; set train.compile=false or launch with DDP")


def over_processes(argv: list[str], processes: int, cfg: Config) -> tuple[list[str], dict, str]:
    """The torchrun command, its environment and one line saying what it does, to train ``mlmlab ``
    ``argv`` (a pretrain command with ``--processes``) as that many DDP processes on this host.

    The global batch stays the config's: train.batch_size is split over the processes, so the run
    is the one-process run (to float tolerance: gradients are summed in another order). On a CPU
    the cores are shared out as threads, one process's worth each, unless OMP_NUM_THREADS says.
    """
    if "LOCAL_RANK" in os.environ:
        raise UserError("--processes starts its own processes: under torchrun or accelerate launch leave it out")
    batch_size = cfg.train.batch_size
    if batch_size % processes:
        raise UserError(
            f"train.batch_size={batch_size} does not split over --processes {processes}; "
            f"give a batch size that is a multiple of {processes}"
        )
    if torch.cuda.is_available() and processes > torch.cuda.device_count():
        raise UserError(f"--processes {processes} needs a GPU each and this host has {torch.cuda.device_count()}")
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(available_cores() // processes, 1))
    # The split batch goes right after the subcommand, in place of the user's: appended, it could be
    # taken for the value of an option that ends argv (`--json` takes an optional FILE).
    subcommand = argv.index("pretrain") + 1
    rest = [arg for arg in without_option(argv[subcommand:], "--processes") if not arg.startswith("train.batch_size=")]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        "-m",
        "mlmlab.cli",
        *argv[:subcommand],
        f"train.batch_size={batch_size // processes}",
        *rest,
    ]
    where = "GPU" if torch.cuda.is_available() else f"{threads} thread(s)"
    line = (
        f"training as {processes} DDP processes x {where}, batch {batch_size // processes} each "
        f"(global batch {batch_size})"
    )
    return command, {**os.environ, "OMP_NUM_THREADS": threads}, line


def without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` less ``option VALUE`` / ``option=VALUE``."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(f"{option}="):
            kept.append(arg)
    return kept


def concat_over_processes(accelerator: Accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """(N,) here, N differing between processes -> (all N,) of every process, in rank order."""
    if accelerator.num_processes == 1:
        return tensor
    lengths = accelerator.gather(torch.tensor([len(tensor)], device=tensor.device)).tolist()
    padded = accelerator.gather(accelerator.pad_across_processes(tensor, dim=0))  # (P * max N,)
    rows = padded.view(accelerator.num_processes, -1)
    return torch.cat([row[:length] for row, length in zip(rows, lengths)])


def sum_over_processes(accelerator: Accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor summed over every process (each must call), returned on the CPU."""
    if accelerator.num_processes == 1:
        return tensor
    return accelerator.reduce(tensor.to(accelerator.device), reduction="sum").cpu()
