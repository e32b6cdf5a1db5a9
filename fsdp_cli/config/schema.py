"""Typed schemas for every config group of ``fsdp-train``.

Each YAML option under ``configs/<group>/`` extends one of these dataclasses (see
:mod:`fsdp_cli.config.store`), so a misspelled key, a wrong type or an unknown enum value
fails while Hydra composes, before anything runs. The entry point converts the composed
config into these objects once (:func:`fsdp_cli.config.convert.to_train_config`); nothing
below it sees a DictConfig or imports Hydra.

This module must stay importable without torch or lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any, NamedTuple

from omegaconf import MISSING

from fsdp_cli.adapters.options import AdapterOptions
from fsdp_cli.checkpoint_format import CheckpointFormat
from fsdp_cli.models.args import HFModelArgs, LlamaArgs, OptimizerArgs, Scheduler
from fsdp_cli.parallel.options import (
    ActivationCheckpointing,
    ContextParallelImpl,
    ParallelizeSettings,
    WrapOptions,
    WrapPolicy,
)
from fsdp_cli.pipeline.options import PipelineOptions
from fsdp_cli.ranges import at_least, between, positive

__all__ = [  # the library types the schema composes, importable from here as before
    "ActivationCheckpointing",
    "CheckpointFormat",
    "HFModelArgs",
    "LlamaArgs",
    "OptimizerArgs",
    "ParallelizeSettings",
    "Scheduler",
    "WrapOptions",
    "WrapPolicy",
]

# --------------------------------------------------------------------------- enums


class Accelerator(Enum):
    auto = "auto"
    cpu = "cpu"
    gpu = "gpu"


class DType(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class ShardingStrategy(Enum):
    """FSDP1 sharding strategies, as torch names them (its private zero-2 hybrid under a public name)."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"
    """HYBRID_SHARD with SHARD_GRAD_OP inside each shard group (torch's ``_HYBRID_SHARD_ZERO2``)."""


class BackwardPrefetch(Enum):
    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"
    none = "none"


class LoggerName(Enum):
    none = "none"
    csv = "csv"
    tensorboard = "tensorboard"
    mlflow = "mlflow"
    """Lightning's MLFlowLogger (``pip install ".[mlflow]"``)."""
    wandb = "wandb"
    """Lightning's WandbLogger (``pip install ".[wandb]"``); offline without ``WANDB_API_KEY``."""


class RankStart(Enum):
    fork = "fork"
    """Each rank is forked from the node's agent, which imported torch, Lightning and fsdp_cli once
    before it met its peers (torchrun's ``--start-method=fork``): a node's ranks skip those
    imports, and no second process imports torch for them; but they start as copies of a process
    that has run the agent, and on CPUs do the same model work 2.5-4% slower than ranks forked
    from a server or started afresh."""
    forkserver = "forkserver"
    """Each rank is forked from a server process the agent starts, which imports torch, Lightning
    and fsdp_cli once (torchrun's ``--start-method=forkserver``): the ranks skip those imports,
    and are forked from a process that runs nothing else. On Linux the agent forks the server
    from itself once it has imported torch, so that torch is imported once per node."""
    subprocess = "subprocess"
    """Each rank is a new ``python -m fsdp_cli.worker`` that imports everything itself (torchrun's
    default for a module)."""


class Profiler(Enum):
    none = "none"
    simple = "simple"
    """Lightning's SimpleProfiler: time per hook and per step, written to ``<run dir>/profiler/``."""
    torch = "torch"
    """Lightning's PyTorchProfiler: a Chrome/Perfetto trace per rank of ``trainer.profile_steps``
    optimizer steps (after one step of wait and one of warm-up), in ``<run dir>/profiler/``."""


class TokenDType(Enum):
    """Item type of a flat token file (``data=tokens``)."""

    uint16 = "uint16"
    """Vocabularies of up to 65,536 tokens (GPT-2, Llama 2, nanoGPT's ``.bin`` files)."""
    uint32 = "uint32"
    """Larger vocabularies (Llama 3's 128,256)."""


class Supervise(Enum):
    """Which assistant turns of a conversation count in the loss (``data=chat``)."""

    all = "all"
    last = "last"


class ChatFormat(Enum):
    """How a line of chat data holds its conversation (``data=chat``)."""

    auto = "auto"
    """Each line by its keys: ``messages_field``, ``prompt_field`` + ``completion_field``,
    ShareGPT's ``conversations``, or Alpaca's ``instruction`` + ``output``."""
    messages = "messages"
    """``{"messages": [{"role", "content"}, ...]}`` (or the prompt/completion pair)."""
    sharegpt = "sharegpt"
    """``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": "..."}, ...]}``."""
    alpaca = "alpaca"
    """``{"instruction", "input" (may be empty), "output"}``: the instruction and input one user
    turn (separated by a blank line), the output the answer; an optional ``system``."""


class TruncationSide(Enum):
    """Which end of an over-long example is cut (``data=chat``): ``right`` keeps its start."""

    right = "right"
    left = "left"


class SweepObjective(Enum):
    """A value of a run's ``summary.json`` that a sweep job returns to the sweeper."""

    auto = "auto"
    """``val_loss`` for a job that validated, else ``final_loss``: a sweep whose jobs validate
    (``data.val_path``, a module's own validation data) compares them on held-out data."""
    val_loss = "val_loss"
    """Validation loss of the last validation (a job that never validated returns the worst value)."""
    final_loss = "final_loss"
    """Training loss of the last logged step."""
    tokens_per_s = "tokens_per_s"
    """Training throughput: median over the steady-state steps."""
    step_time_s = "step_time_s"
    """Seconds per optimizer step: median over the steady-state steps."""


# --------------------------------------------------------------------------- group options


TIMEOUT = at_least(1)
"""Collective timeouts: whole seconds, at least one."""


# --------------------------------------------------------------------------- strategy group


class Sharding(NamedTuple):
    """How a strategy lays its data-parallel ranks out: ``replicate`` groups of ``shard`` ranks
    (``shard=1``: every rank holds every parameter)."""

    replicate: int
    shard: int


class StrategyAnswers:
    """What every strategy schema answers about itself (its registry entry,
    :mod:`fsdp_cli.config.strategies`, holds what it does not know: checks, builder, planner).
    The defaults are DDP's; a schema overrides what it changes. (Methods, not fields: nothing
    here is a config key.)"""

    def sharding(self, dp: int, devices: int, world: int) -> Sharding:
        """The replicate x shard split of ``dp`` data-parallel ranks (``devices`` per node)."""
        return Sharding(replicate=world, shard=1)

    def replicas(self) -> int:
        """The replicate factor the layout checks against ``dp`` (FSDP2's HSDP)."""
        return 1

    def parallelize_settings(self) -> ParallelizeSettings | None:
        """The parallelize settings it applies to the built-in and Hugging Face models (FSDP2)."""
        return None

    def explicit_policy(self) -> MixedPrecisionPolicyConfig | None:
        """Its own mixed-precision policy config, whose set fields override the precision."""
        return None

    def builds_on_meta(self) -> bool:
        """The built-in model is created on the meta device and each rank materialises only its
        shard (after parallelizing it)."""
        return False

    def offloads(self) -> bool:
        """Keeps shards (or parameters) in host memory."""
        return False

    def checkpoint_format(self, configured: CheckpointFormat) -> CheckpointFormat:
        """The format it saves in, given ``checkpoint.format``."""
        return configured

    def migrate(self, cfg: TrainConfig, notices: list[str]) -> TrainConfig:
        """``cfg`` with this strategy in today's names and keywords, a notice for each change
        (:mod:`fsdp_cli.config.migrate`); a current schema has nothing to change."""
        return cfg

    def search_base(self) -> FSDP2Config:
        """The FSDP2 settings ``fsdp-plan --search`` starts its candidates from: the run's own
        under fsdp2, FSDP2's defaults otherwise."""
        return FSDP2Config()

    def fake_step_refusal(self) -> str | None:
        """Why a fake step (torch's memory tracker on fake tensors, :mod:`fsdp_cli.plan.fake_step`)
        cannot measure this strategy; None where it can. (Not DDP's default: DDP overrides it.)"""
        return None


@dataclass
class DDPConfig(StrategyAnswers):
    """``strategy=ddp``: Lightning's DDPStrategy, the baseline every sharded layout is compared with."""

    name: str = "ddp"
    """Selects this schema (set by the option file)."""
    process_group_backend: str | None = None
    """``gloo`` or ``nccl``; null picks nccl on GPUs and gloo on CPUs."""
    timeout_s: int = field(default=1800, metadata=TIMEOUT)
    """Collective timeout in seconds."""
    find_unused_parameters: bool = False
    """Search the autograd graph for parameters without a gradient each step (slower; needed only by
    models that skip modules)."""
    gradient_as_bucket_view: bool = True
    """Gradients alias the all-reduce buckets (saves one gradient-sized copy)."""
    static_graph: bool = False
    """Tell DDP the graph is the same every step (enables some communication optimisations)."""
    bucket_cap_mb: int = field(default=25, metadata=at_least(1))
    """Size of the gradient all-reduce buckets in MiB."""
    broadcast_buffers: bool | None = None
    """Broadcast rank 0's buffers before every forward (DDP's default; keeps BatchNorm statistics
    in step). null: off for the built-in models, whose only buffers are derived (RoPE tables),
    on for the others."""

    def fake_step_refusal(self) -> str:
        return f"strategy={self.name}: DistributedDataParallel reads its parameters when built: no fake step"


@dataclass
class MixedPrecisionPolicyConfig:
    """FSDP2 ``MixedPrecisionPolicy``; a null dtype is derived from the ``precision`` group."""

    param_dtype: DType | None = None
    """Dtype parameters are all-gathered in and compute runs in."""
    reduce_dtype: DType | None = None
    """Dtype of the gradient reduce-scatter."""
    output_dtype: DType | None = None
    """Dtype of the root module's outputs; null keeps the compute dtype."""
    cast_forward_inputs: bool = True
    """Cast floating-point forward inputs to ``param_dtype``."""


@dataclass
class FSDP2Config(ParallelizeSettings, StrategyAnswers):
    """``strategy=fsdp2``: :class:`fsdp_cli.strategies.FSDP2Strategy` (FSDP2 + optional tensor parallel).

    The data-parallel and tensor-parallel sizes come from the top-level ``dp`` and ``tp``; the
    parallelize settings (``reshard_after_forward`` ... ``sequence_parallel``) are
    :class:`fsdp_cli.parallel.options.ParallelizeSettings`, handed to ``parallelize`` as they are.
    """

    name: str = "fsdp2"
    """Selects this schema (set by the option file)."""
    mp_policy: MixedPrecisionPolicyConfig = field(default_factory=MixedPrecisionPolicyConfig)
    """FSDP2 mixed precision; null dtypes derive from the ``precision`` group."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory."""
    replicate_size: int = field(default=1, metadata=at_least(1))
    """HSDP: number of replica groups; parameters are sharded within a group of dp/replicate_size
    ranks and replicated across groups. 1 = plain FSDP."""
    parallelize_fn: str | None = None
    """Dotted path of ``fn(model, device_mesh, **options)`` that replaces the built-in
    parallelization (tensor parallel, activation checkpointing, compile, fully_shard)."""
    process_group_backend: str | None = None
    """``gloo`` or ``nccl``; null picks nccl on GPUs and gloo on CPUs."""
    timeout_s: int = field(default=1800, metadata=TIMEOUT)
    """Collective timeout in seconds."""

    def sharding(self, dp: int, devices: int, world: int) -> Sharding:
        return Sharding(replicate=self.replicate_size, shard=dp // self.replicate_size)

    def replicas(self) -> int:
        return self.replicate_size

    def parallelize_settings(self) -> ParallelizeSettings:
        return self

    def explicit_policy(self) -> MixedPrecisionPolicyConfig:
        return self.mp_policy

    def builds_on_meta(self) -> bool:
        return self.parallelize_fn is None  # a user's parallelize_fn gets a real model

    def offloads(self) -> bool:
        return self.cpu_offload

    def search_base(self) -> FSDP2Config:
        return self


@dataclass
class FSDPConfig(StrategyAnswers):
    """``strategy=fsdp``: Lightning's FSDPStrategy (FSDP1), every documented option."""

    name: str = "fsdp"
    """Selects this schema (set by the option file)."""
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    """What is sharded: FULL_SHARD (parameters, gradients, optimizer state), SHARD_GRAD_OP
    (gradients and optimizer state), NO_SHARD (DDP-like), or the HYBRID_* variants (shard within
    a group, replicate across groups)."""
    hybrid_shard_size: int | None = field(default=None, metadata=at_least(1))
    """HYBRID_SHARD: ranks per shard group (parameters sharded within it, replicated across
    groups). null = the processes of one node."""
    cpu_offload: bool = False
    """Keep parameters and gradients in CPU memory between uses."""
    mixed_precision: MixedPrecisionPolicyConfig = field(default_factory=MixedPrecisionPolicyConfig)
    """FSDP1 MixedPrecision param/reduce/buffer dtypes; null fields derive from ``precision``."""
    activation_checkpointing_policy: list[str] = field(default_factory=list)
    """Module classes (dotted or bare names) to recompute in backward; empty = none."""
    use_orig_params: bool = True
    """Let the optimizer see the original parameters (needed by ``torch.compile`` and per-parameter
    options)."""
    limit_all_gathers: bool = True
    """Rate-limit all-gathers so prefetching cannot run ahead and exhaust GPU memory."""
    forward_prefetch: bool = False
    """Issue the next unit's all-gather before the current unit's forward computation."""
    backward_prefetch: BackwardPrefetch = BackwardPrefetch.BACKWARD_PRE
    """When to issue the next unit's all-gather in backward: BACKWARD_PRE (more overlap, more
    memory), BACKWARD_POST, or none."""
    sync_module_states: bool = False
    """Broadcast rank 0's parameters and buffers at wrap time."""
    process_group_backend: str | None = None
    """``gloo`` or ``nccl``; null picks nccl on GPUs and gloo on CPUs."""
    timeout_s: int = field(default=1800, metadata=TIMEOUT)
    """Collective timeout in seconds."""
    activation_checkpointing: list[str] | None = None
    """Deprecated (Lightning's old keyword): use ``activation_checkpointing_policy``."""

    def hybrid(self) -> bool:
        return self.sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)

    def sharding(self, dp: int, devices: int, world: int) -> Sharding:
        """FSDP1's shard groups: the hybrid size (default: the processes of one node) for HYBRID_*,
        the whole world for the fully sharded strategies, single ranks for NO_SHARD."""
        if self.sharding_strategy is ShardingStrategy.NO_SHARD:
            return Sharding(replicate=world, shard=1)
        if self.hybrid():
            shard = self.hybrid_shard_size or devices
            return Sharding(replicate=world // shard, shard=shard)
        return Sharding(replicate=1, shard=world)

    def explicit_policy(self) -> MixedPrecisionPolicyConfig:
        return self.mixed_precision

    def offloads(self) -> bool:
        return self.cpu_offload

    def migrate(self, cfg: TrainConfig, notices: list[str]) -> TrainConfig:
        """The deprecated ``activation_checkpointing`` merged into ``activation_checkpointing_policy``."""
        if not self.activation_checkpointing:
            return cfg
        notices.append(
            "warning: strategy.activation_checkpointing is deprecated; use "
            f"strategy.activation_checkpointing_policy={list(self.activation_checkpointing)}"
        )
        merged = list(dict.fromkeys([*self.activation_checkpointing_policy, *self.activation_checkpointing]))
        current = replace(self, activation_checkpointing_policy=merged, activation_checkpointing=None)
        return replace(cfg, strategy=current)

    def as_fsdp(self) -> FSDPConfig:
        """The plain ``strategy=fsdp`` schema with the fields an FSDPConfig has (an old name's
        schema, migrated)."""
        values = {f.name: getattr(self, f.name) for f in fields(FSDPConfig)}
        return FSDPConfig(**{**values, "name": "fsdp"})

    def fake_step_refusal(self) -> str | None:
        if not self.use_orig_params:
            return None
        return (
            "torch's MemTracker cannot follow FSDP1's use_orig_params views "
            "(strategy.use_orig_params=false is measured): no fake step"
        )


@dataclass
class FSDPNativeConfig(FSDPConfig):
    """``strategy=fsdp_native``: Lightning 1.x's name for native FSDP; runs as ``strategy=fsdp``."""

    name: str = "fsdp_native"

    def migrate(self, cfg: TrainConfig, notices: list[str]) -> TrainConfig:
        notices.append(
            "note: strategy=fsdp_native is Lightning 1.x's name for native FSDP; running strategy=fsdp"
        )
        new = self.as_fsdp()
        return new.migrate(replace(cfg, strategy=new), notices)


@dataclass
class DDPFullyShardedConfig(FSDPConfig):
    """``strategy=ddp_fully_sharded``: lightning_fairscale's DDPFullyShardedStrategy, mapped onto
    native FSDP (``strategy=fsdp``). Its keywords keep working; null means "not set"."""

    name: str = "ddp_fully_sharded"
    reshard_after_forward: bool | None = None
    """true -> FULL_SHARD, false -> SHARD_GRAD_OP."""
    flatten_parameters: bool | None = None
    """Native FSDP always flattens; accepted and ignored."""
    move_grads_to_cpu: bool | None = None
    """Implied by ``cpu_offload`` in native FSDP."""
    fp32_reduce_scatter: bool | None = None
    """true -> ``mixed_precision.reduce_dtype=float32``."""
    compute_dtype: DType | None = None
    """-> ``mixed_precision.param_dtype``."""
    bucket_cap_mb: int | None = field(default=None, metadata=at_least(1))
    """No native equivalent; accepted and ignored."""
    min_num_params: int | None = field(default=None, metadata=at_least(1))
    """-> ``wrap=size`` with this threshold (fairscale's default auto-wrap policy)."""
    state_dict_to_cpu: bool | None = None
    """Native full checkpoints are always gathered to CPU; accepted and ignored."""

    def migrate(self, cfg: TrainConfig, notices: list[str]) -> TrainConfig:
        """Runs as ``strategy=fsdp``, fairscale's keywords translated as their docstrings say."""
        notices.append(
            "note: strategy=ddp_fully_sharded (lightning_fairscale) now runs PyTorch's native FSDP: strategy=fsdp"
        )
        new = self.as_fsdp()
        if self.reshard_after_forward is not None:
            sharding = (
                ShardingStrategy.FULL_SHARD if self.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
            )
            new = replace(new, sharding_strategy=sharding)
        mp = new.mixed_precision
        if self.compute_dtype is not None:
            mp = replace(mp, param_dtype=self.compute_dtype)
        if self.fp32_reduce_scatter:
            mp = replace(mp, reduce_dtype=DType.float32)
        new = replace(new, mixed_precision=mp)
        if self.move_grads_to_cpu:
            new = replace(new, cpu_offload=True)
        if self.min_num_params is not None:
            cfg = replace(cfg, wrap=WrapConfig(policy=WrapPolicy.size, min_num_params=self.min_num_params))
        ignored = [
            k
            for k in ("flatten_parameters", "bucket_cap_mb", "state_dict_to_cpu")
            if getattr(self, k) is not None
        ]
        if ignored:
            notices.append(
                f"note: strategy.{', strategy.'.join(ignored)} have no native-FSDP equivalent and are ignored"
            )
        return new.migrate(replace(cfg, strategy=new), notices)


@dataclass
class ModelParallelConfig(StrategyAnswers):
    """``strategy=model_parallel``: Lightning's ModelParallelStrategy for a LightningModule that
    implements ``configure_model`` itself. Sizes come from the top-level ``dp`` and ``tp``."""

    name: str = "model_parallel"
    """Selects this schema (set by the option file)."""
    save_distributed_checkpoint: bool | None = None
    """true: sharded (DCP) checkpoints, false: one full file; null: from the ``checkpoint`` group."""
    process_group_backend: str | None = None
    """``gloo`` or ``nccl``; null picks nccl on GPUs and gloo on CPUs."""
    timeout_s: int = field(default=1800, metadata=TIMEOUT)
    """Collective timeout in seconds."""

    def sharding(self, dp: int, devices: int, world: int) -> Sharding:
        return Sharding(replicate=1, shard=dp)

    def checkpoint_format(self, configured: CheckpointFormat) -> CheckpointFormat:
        sharded = self.save_distributed_checkpoint
        if sharded is None:
            return configured
        return CheckpointFormat.sharded if sharded else CheckpointFormat.full


# --------------------------------------------------------------------------- other groups


@dataclass
class PrecisionConfig:
    name: str = "32-true"
    """Lightning's precision name: 32-true, bf16-mixed, bf16-true, 16-mixed, 16-true, 64-true, or
    auto (bf16-mixed on GPUs, 32-true on CPUs); what each means: :mod:`fsdp_cli.precision`."""


WrapConfig = WrapOptions
"""The ``wrap`` group is the parallel layer's :class:`~fsdp_cli.parallel.options.WrapOptions`."""


@dataclass
class CheckpointConfig:
    format: CheckpointFormat = CheckpointFormat.sharded
    """sharded: a DCP folder, one shard per rank, resumable at any layout; full: one consolidated
    file."""
    dir: str | None = None
    """Where checkpoints go; null = ``<run dir>/checkpoints``."""
    every_n_steps: int | None = field(default=None, metadata=at_least(1))
    """Save every N optimizer steps; null = only at the end of training."""
    keep_last: int = field(default=2, metadata=at_least(1))
    """How many complete checkpoints to keep (the newest complete one is never deleted)."""
    save_last: bool = True
    """Save when training ends."""
    save_on_sigterm: bool = True
    """On SIGTERM or SIGUSR1 (preemption, a scheduler's time-limit warning) save a checkpoint, then exit with status ``preempted``.
    From the moment the ranks have met: during the rendezvous a SIGTERM ends a rank at once (nothing to save yet)."""
    async_save: bool = False
    """Sharded checkpoints only: copy the state to CPU memory, then write it in a background
    thread while training continues (torch.distributed.checkpoint's async save). The checkpoint
    becomes visible (renamed from ``.partial``) only once every rank's write has finished."""


@dataclass
class LlamaConfig(LlamaArgs):
    """``model=llama``: the built-in Llama-style decoder (:class:`fsdp_cli.models.args.LlamaArgs`):
    RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention."""

    name: str = "llama"
    """Selects this schema (set by the option file)."""


@dataclass
class CustomModelConfig:
    """``model=custom``: any importable class or factory; the other keys are its keyword arguments.

    Not registered as a schema (arbitrary ``+model.NAME=VALUE`` keys are allowed); the
    converter builds this object from the composed node.
    """

    target: str = MISSING
    """Dotted path of the class or factory (``model._target_`` in YAML)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the target (the other ``model.*`` keys)."""
    name: str = "custom"
    """Always ``custom``."""
    vocab_size: int | None = field(default=None, metadata=at_least(1))
    """The vocabulary size, when the target takes one (``+model.vocab_size=N``)."""


@dataclass
class HFModelConfig(HFModelArgs):
    """``model=hf``: a Hugging Face causal LM (``AutoModelForCausalLM``) from a local folder
    (:class:`fsdp_cli.models.args.HFModelArgs`).

    Needs ``pip install ".[hf]"``. The model is built on the meta device and sharded before
    any weight exists; each rank then reads only its own slices of the safetensors files, so no
    rank ever holds the whole model. Nothing is ever downloaded.
    """

    name: str = "hf"
    """Selects this schema (set by the option file)."""


# --------------------------------------------------------------------------- data group


@dataclass
class DataConfig:
    """What every ``data`` option has: the batch, the sequence, the vocabulary, the workers."""

    name: str = ""
    """Selects this schema (set by the option file)."""
    global_batch_size: int = field(default=8, metadata=at_least(1))
    """Sequences per optimizer step across all data-parallel ranks."""
    seq_len: int = field(default=128, metadata=at_least(1))
    """Tokens per sequence."""
    vocab_size: int | None = field(
        default="${oc.select:model.vocab_size,null}",  # type: ignore[arg-type]
        metadata=at_least(1),
    )
    """Token ids are drawn from (or must be below) [0, vocab_size); defaults to the model's
    vocabulary size."""
    micro_batch_size: int | None = field(default=None, metadata=at_least(1))
    """Sequences per data-parallel rank per forward; null = global_batch_size / dp. Smaller
    values accumulate gradients over global_batch_size / (dp * micro_batch_size) micro-batches."""
    num_workers: int = field(default=0, metadata=at_least(0))
    """DataLoader worker processes per rank."""


@dataclass
class SyntheticDataConfig(DataConfig):
    """Deterministic random tokens: sequence i depends only on (seed, i)."""

    name: str = "synthetic"
    seq_len: int = field(default=64, metadata=at_least(1))
    """Tokens per sequence."""
    num_sequences: int | None = field(default=None, metadata=at_least(1))
    """A dataset of this many sequences, each epoch visiting every one once in an order fixed by
    ``seed`` and the epoch; null = an endless stream of new sequences, which has no epochs
    (``trainer.max_epochs`` needs a number here)."""


@dataclass
class TextDataConfig(DataConfig):
    """Byte-level tokens from local text files (no tokenizer, vocabulary 256)."""

    name: str = "text"
    vocab_size: int | None = field(default=256, metadata=at_least(1))
    """Byte-level: 256 token ids."""
    path: str | None = None
    """A file, a folder (its *.py, *.txt, *.md files) or a glob; null = the Python standard
    library sources on this machine, so a real loss curve needs no download."""
    max_bytes: int = field(default=32_000_000, metadata=at_least(1))
    """Read at most this many bytes of text."""


@dataclass
class TokensDataConfig(DataConfig):
    """Pre-tokenized flat token files (the nanoGPT / Megatron ``.bin`` convention), memory-mapped.

    The files are one stream of token ids, read in sorted order and never loaded whole. Each epoch
    visits every window of ``seq_len + 1`` tokens once, in an order fixed by ``seed``.
    """

    name: str = "tokens"
    path: str | None = None
    """A token file, a folder (its ``*.bin`` files) or a glob."""
    dtype: TokenDType = TokenDType.uint16
    """How the files store each token id."""
    val_path: str | None = None
    """Held-out token files (same format) for validation every ``trainer.val_check_interval`` steps."""


@dataclass
class JsonlDataConfig(DataConfig):
    """JSON-lines documents, tokenized once and cached as a token file (then read as ``data=tokens`` is).

    Documents are joined with an end-of-text token. The first run tokenizes (with a progress bar,
    in the launching process, before any rank starts); later runs reuse the cache while the input
    files, field and tokenizer are unchanged.
    """

    name: str = "jsonl"
    path: str | None = None
    """A ``.jsonl`` file, a folder (its ``*.jsonl`` files) or a glob; also Parquet files and a folder
    Hugging Face ``datasets`` saved (``save_to_disk``), read row by row (``pip install ".[parquet]"``)."""
    field: str = "text"
    """The key of each line's object that holds the document text."""
    tokenizer: str | None = None
    """A Hugging Face ``tokenizer.json``, or a folder holding one (a model folder); null = UTF-8
    bytes (token ids 0..255)."""
    eot_token: str | None = None
    """The token that ends each document; null = the tokenizer's end-of-sequence token
    (``eos_token`` of ``tokenizer_config.json``, else ``<|endoftext|>``, ``<|end_of_text|>`` or
    ``</s>``), or byte 0 without a tokenizer."""
    val_path: str | None = None
    """Held-out JSON-lines files for validation every ``trainer.val_check_interval`` steps."""
    cache_dir: str | None = None
    """Where tokenized corpora are kept; null = a ``.fsdp_cli_tokens`` folder beside the first input file."""


@dataclass
class ChatDataConfig(DataConfig):
    """Conversations (``messages``: system/user/assistant/tool turns) or prompt/completion pairs from
    JSON lines, rendered with the tokenizer's chat template; the loss counts the assistant's tokens
    only, averaged over the global batch's supervised tokens (docs/chat-data.md).

    The first run renders and tokenizes (a progress bar, in the launching process, before any rank
    starts; bad lines are one error naming file:line); later runs reuse the cache while the input
    files, fields, tokenizer and template are unchanged.
    """

    name: str = "chat"
    path: str | None = None
    """A ``.jsonl`` file, a folder (its ``*.jsonl`` files) or a glob; also Parquet files and a folder
    Hugging Face ``datasets`` saved (``save_to_disk``), read row by row (``pip install ".[parquet]"``)."""
    val_path: str | None = None
    """Held-out conversations for validation every ``trainer.val_check_interval`` steps (same masking)."""
    tokenizer: str | None = "${oc.select:model.path,null}"
    """A local folder holding the Hugging Face tokenizer (``tokenizer.json``, ``tokenizer_config.json``);
    defaults to ``model.path`` (``model=hf``). Nothing is downloaded."""
    chat_template: str | None = None
    """A Jinja chat template (a file, or the template text); null = the tokenizer's own."""
    format: ChatFormat = ChatFormat.auto
    """How each line holds its conversation: ``auto`` (by its keys), ``messages``, ``sharegpt``,
    ``alpaca``; every line is checked, a bad one is one error naming file:line."""
    messages_field: str = "messages"
    """The key of each line's list of ``{role, content}`` messages."""
    prompt_field: str = "prompt"
    """With ``completion_field``: a line without ``messages_field`` is a user prompt and the answer."""
    completion_field: str = "completion"
    """The key of a prompt/completion line's answer."""
    supervise: Supervise = Supervise.all
    """Which assistant turns count in the loss: ``all`` or the ``last`` one."""
    packing: bool = False
    """Pack several examples into each ``seq_len`` sequence (never splitting one); each attends only
    to itself and its positions restart at 0. Needs a model whose attention keeps documents apart."""
    truncation_side: TruncationSide = TruncationSide.right
    """An example longer than ``seq_len`` keeps its start (``right``: the end is cut) or its end
    (``left``); either way it is counted in the statistics."""
    cache_dir: str | None = None
    """Where tokenized conversations are kept; null = a ``.fsdp_cli_tokens`` folder beside the first input file."""


@dataclass
class DataModuleConfig:
    """``data=datamodule``: a LightningDataModule of your own, handed to ``trainer.fit(model,
    datamodule=...)`` as under Lightning (``prepare_data`` on local rank 0 of each node,
    ``setup("fit")`` and the loaders on every rank, a ``DistributedSampler`` per data-parallel
    rank). The model must be a LightningModule (``model=custom``).

    Not registered as a schema (arbitrary ``+data.NAME=VALUE`` keys are its constructor's
    arguments); the converter builds this object from the composed node.
    """

    target: str = MISSING
    """Dotted path of the LightningDataModule class or factory (``data._target_`` in YAML)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the target (the other ``data.*`` keys)."""
    name: str = "datamodule"
    """Always ``datamodule``."""


# --------------------------------------------------------------------------- fixed sections


OptimConfig = OptimizerArgs
"""The ``optim`` section is the training module's :class:`~fsdp_cli.models.args.OptimizerArgs`."""


@dataclass
class TrainerConfig:
    max_steps: int = field(default=30, metadata=at_least(1, also=(-1,)))
    """Optimizer steps to train for; -1 = no step limit (only with ``max_epochs``). With both set,
    training stops at whichever is reached first (Lightning's rule)."""
    log_every_n_steps: int = field(default=1, metadata=at_least(1))
    """Write a metrics.jsonl row (and print a line) every N optimizer steps."""
    gradient_clip_val: float | None = field(
        default=None,
        metadata=at_least(
            0, hint="trainer.gradient_clip_val=0 turns clipping off; null: the model's default"
        ),
    )
    """Clip gradients to this value (their global norm; each element with
    ``gradient_clip_algorithm=value``). null: the model's default, 1.0 for the built-in model,
    ``model=hf`` and a plain nn.Module, none for a LightningModule trained as it is (Lightning's
    Trainer default; a module's own ``configure_gradient_clipping`` gets this value, as from
    ``Trainer(gradient_clip_val=...)``). 0: no clipping."""
    gradient_clip_algorithm: str | None = None
    """norm: clip the global gradient norm; value: clip each gradient element. null: Lightning's
    default, by norm (a module's own ``configure_gradient_clipping`` receives None, as from a
    Trainer without ``gradient_clip_algorithm``)."""
    deterministic: bool = False
    """Lightning's deterministic mode (deterministic algorithms; slower)."""
    enable_progress_bar: bool = False
    """Lightning's progress bar (the per-step log lines replace it)."""
    val_check_interval: int | None = field(default=None, metadata=at_least(1))
    """Validate every N optimizer steps. null = the path's default: no validation on
    fsdp-train's ``data`` group; Lightning's default for a LightningModule with its own
    ``val_dataloader`` (or a ``data=datamodule`` that has one): after every training epoch."""
    limit_val_batches: int | None = field(
        default=None,
        metadata=at_least(0, hint="trainer.limit_val_batches=0 turns validation off (Lightning's way)"),
    )
    """Batches per validation run (per data-parallel rank); 0 = no validation. null = the path's
    default: 4 held-out batches of fsdp-train's ``data`` group; the whole loader for a module's
    own ``val_dataloader`` (Lightning's default)."""
    num_sanity_val_steps: int | None = field(default=None, metadata=at_least(0, also=(-1,)))
    """Validation batches run before training starts, to catch a broken ``validation_step``
    early (-1 = the whole loader). null = the path's default: none on fsdp-train's ``data``
    group; 2 for a module's own ``val_dataloader`` (Lightning's default)."""
    accumulate_grad_batches: int | None = field(default=None, metadata=at_least(1))
    """Batches of a module's own ``train_dataloader`` (or of ``data=datamodule``) per optimizer
    step, gradients synchronised once per step; null = 1. fsdp-train's ``data`` group derives its
    accumulation from ``data.global_batch_size`` and ``data.micro_batch_size`` and refuses this key."""
    profiler: Profiler = Profiler.none
    """none, simple (time per Lightning hook) or torch (a trace of a few steps per rank); written
    to ``<run dir>/profiler/``."""
    profile_steps: int = field(default=2, metadata=at_least(1))
    """With ``profiler=torch``: optimizer steps recorded in the trace."""
    peak_tflops: float | None = field(default=None, metadata=positive())
    """Peak dense TFLOP/s of one device for ``mfu`` in metrics.jsonl; null = looked up by GPU name
    and the compute dtype in effect (H100, H200, A100, L4, ...); on CPUs mfu stays null unless
    this is set."""
    skip_nonfinite_steps: int = field(default=0, metadata=at_least(0))
    """Skip (zero the update of) up to this many optimizer steps whose gradient norm is not
    finite, then fail; 0 = fail at the first non-finite loss or gradient norm. Skipping checks
    every step on the host (one device sync per step); failing alone rides on the logging step."""
    max_epochs: int | None = field(default=None, metadata=at_least(1))
    """Passes over the training data; null = no epoch limit (``max_steps`` ends the run). An epoch
    of the ``data`` group is ``floor(items / data.global_batch_size)`` optimizer steps (items:
    windows of ``text``/``tokens``/``jsonl``, ``num_sequences`` of ``synthetic``); a module's own
    DataLoaders define their own."""
    sample_prompts: str | None = None
    """A prompts file (as ``fsdp-generate --prompts`` reads it: JSON lines of ``messages``,
    ``prompt`` or ``input_ids``, or one prompt a line) answered greedily at each validation (at
    the end of training where the run does not validate), rendered as the run's data is; the
    answers go to ``samples/step_N.jsonl`` in the run folder and to the logger (a table in W&B and
    MLflow, text in TensorBoard). Text needs the run's tokenizer (``data.tokenizer``, or
    ``model.path`` for model=hf); the built-in model, model=hf or a plain nn.Module; not with pp or cp."""
    sample_max_new_tokens: int = field(default=64, metadata=at_least(1))
    """The longest answer ``trainer.sample_prompts`` writes (in tokens)."""


@dataclass
class LoggerConfig:
    name: LoggerName = LoggerName.none
    """Lightning logger in addition to metrics.jsonl: none, csv, tensorboard, mlflow or wandb."""
    project: str = "fsdp-train"
    """mlflow: the experiment name; wandb: the project."""
    run_name: str | None = None
    """mlflow and wandb: the run's name; null = the name of the run directory."""
    tracking_uri: str | None = None
    """mlflow: where runs are recorded; null = ``$MLFLOW_TRACKING_URI`` if set, else
    ``sqlite:///<run dir>/mlflow.db`` (``mlflow ui --backend-store-uri`` that URI shows it)."""
    offline: bool | None = None
    """wandb: write the run to ``<run dir>/wandb/`` only (``wandb sync`` uploads it later); null =
    offline unless ``WANDB_API_KEY`` is set."""


@dataclass
class LauncherConfig:
    """How the parent starts ranks with torch.distributed.run (ignored inside torchrun/SLURM, but
    for ``rdzv_timeout_s``)."""

    rdzv_endpoint: str | None = None
    """host:port of the rendezvous for multi-node runs (node 0's address and a free port); null =
    ``$MASTER_ADDR:$MASTER_PORT`` when ``MASTER_ADDR`` is set, else (one node) 127.0.0.1 and a free port."""
    node_rank: int | None = field(default=None, metadata=at_least(0))
    """This node's rank, 0 .. num_nodes-1; null = ``$NODE_RANK``, or 0."""
    max_restarts: int = field(default=0, metadata=at_least(0))
    """torch elastic restarts of a failed worker group (each restart resumes from the newest checkpoint)."""
    shutdown_timeout_s: int = field(default=300, metadata=at_least(0))
    """After forwarding SIGTERM, how long the launcher lets ranks finish their preemption save."""
    interrupt_grace_s: float | None = field(default=None, metadata=positive())
    """After Ctrl-C, how long the ranks get to stop by themselves before the launcher kills them
    (a rank stopped, or blocked in a collective its peer already left, never stops by itself);
    after SIGTERM, how long they get to reach the save at a step boundary (a save under way is
    left to finish, within ``shutdown_timeout_s``). null = follows the run: 1.5 x the longest
    step measured so far, at least 20 s (said when the signal comes)."""
    hang_timeout_s: float | None = field(default=900.0, metadata=positive())
    """End the job (status failed, every rank's Python stack in its log) when no rank finished a
    step or a validation batch for this many seconds; null = never."""
    startup_timeout_s: float | None = field(default=1800.0, metadata=positive())
    """The same limit while ranks start up (imports, rendezvous, build, checkpoint load) or save a
    checkpoint; null = never."""
    first_step_timeout_s: float | None = field(default=600.0, metadata=positive())
    """The same limit from the start of training to the end of the first optimizer step: the first
    batches (a DataLoader's workers starting, a first read of the data), compilation, lazy
    initialization. A loader that never delivers a batch ends here, with every rank's stack in its
    log; raise it for a first step that compiles a large model; null = never."""
    rdzv_timeout_s: float = field(default=600.0, metadata=positive())
    """How long the ranks wait to meet (the process group's rendezvous; across nodes, the
    launchers' too) before the run fails with a line naming the address: a peer that never
    starts, or a ``MASTER_ADDR``/``MASTER_PORT`` nobody listens on. Applies inside torchrun/SLURM
    too."""
    start_method: RankStart = RankStart.forkserver
    """How the agent starts a node's ranks: ``forkserver`` forks them from a server process that
    imported Lightning and fsdp_cli once (forked from the agent after its torch import, on Linux),
    while the agent meets its peers (on 2 CPU cores a 2-rank run starts ~0.7 s sooner than with
    ``fork``); ``fork`` forks them from the agent itself, which imported them before it met
    its peers (ranks that copy a process that has run the agent: on CPUs their steps' model work
    is 2.5-4% slower, with ~36 more page faults a step in the optimizer); ``subprocess`` starts
    each as a fresh Python that imports everything itself (on 2 CPU cores a 2-rank run starts ~2 s
    later than forked ranks, a 4-rank run ~8 s)."""


@dataclass
class SweepConfig:
    """How each job of a sweep (``fsdp-train -m ...``) reports to the sweeper."""

    objective: SweepObjective = SweepObjective.auto
    """What a job returns to the sweeper: Optuna minimises or maximises it, following
    ``hydra.sweeper.direction``. A job that was skipped or failed returns the worst value."""


SET_BY_THE_ENTRY_POINT = ("run_dir", "explicit_data", "run_id", "start_from")
""":class:`TrainConfig` keys the entry point fills in for the ranks, not the user's to set:
``--cfg job`` leaves them out (:func:`fsdp_cli.compat.hydra_internals.hide_from_printed_config`)."""


@dataclass
class TrainConfig:
    """The whole run. Group options fill the ``Any`` fields with their own schemas."""

    strategy: Any = MISSING
    """The ``strategy`` group: how the model is distributed."""
    precision: PrecisionConfig = MISSING
    """The ``precision`` group."""
    wrap: WrapConfig = MISSING
    """The ``wrap`` group: which modules become FSDP units."""
    checkpoint: CheckpointConfig = MISSING
    """The ``checkpoint`` group: format and schedule of checkpoints."""
    model: Any = MISSING
    """The ``model`` group."""
    data: Any = MISSING
    """The ``data`` group."""
    trainer: TrainerConfig = MISSING
    """Steps, logging, clipping, validation."""
    logger: LoggerConfig = MISSING
    """The ``logger`` group."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """How ranks are started (multi-node rendezvous, restarts)."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """What each job of a sweep reports to the sweeper."""
    dp: Any = field(default="auto", metadata=at_least(1, also=("auto",)))
    """Data-parallel size: ``auto`` = world size / tp."""
    tp: int = field(default=1, metadata=at_least(1))
    """Tensor-parallel size."""
    pp: int = field(default=1, metadata=at_least(1))
    """Pipeline-parallel size: the model cut into pp stages (x ``pipeline.stages_per_rank``);
    world = pp x dp x tp."""
    cp: int = field(default=1, metadata=at_least(1))
    """Context-parallel size: each sequence split over cp ranks, attention exchanged all-to-all
    over heads (``strategy=fsdp2``; docs/context-parallel.md); world = pp x dp x cp x tp."""
    cp_impl: ContextParallelImpl = ContextParallelImpl.all_to_all
    """With cp > 1: ``all_to_all`` (two all-to-alls over heads around ordinary attention; any device,
    packed documents) or ``ring`` (torch's ring attention over load-balanced slices; GPUs only,
    causal only, ``data.seq_len`` a multiple of 2 x cp)."""
    ep: int = field(default=1, metadata=at_least(1))
    """Expert-parallel size: each MoE layer's experts split over ep of the data-parallel ranks,
    tokens routed to them all-to-all (``strategy=fsdp2``, a MoE ``model=hf`` or the built-in
    model with ``model.n_experts``; with pp, cp, LoRA and compile too: docs/expert-parallel.md); ep
    divides dp / ``strategy.replicate_size`` and the experts."""
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    """With pp > 1: the schedule, micro-batches, stages per rank and where the model is cut."""
    peft: AdapterOptions = field(default_factory=AdapterOptions)
    """Adapters: ``peft=none`` (full fine-tuning) or ``peft=lora`` (LoRA on the blocks' linear
    layers; ``peft.targets=[all,experts]``: on a mixture of experts' fused experts too)."""
    devices: Any = field(default="auto", metadata=at_least(1, also=("auto",)))
    """Processes per node: ``auto`` = every visible GPU, or 2 CPU processes without GPUs."""
    num_nodes: int = field(default=1, metadata=at_least(1))
    """Machines the run spans (inside srun/torchrun: taken from the job)."""
    accelerator: Accelerator = Accelerator.auto
    """``auto``: gpu when a GPU is visible (one the driver has; ``CUDA_VISIBLE_DEVICES`` alone makes
    none), else cpu, with a note when ``CUDA_VISIBLE_DEVICES`` lists GPUs that are not there."""
    seed: int = field(default=1234, metadata=between(0, 2**32 - 1))
    """Seed of the model initialisation and the data order."""
    resume: str | None = None
    """null: start fresh; ``auto``: newest complete checkpoint of this run; or a checkpoint path."""
    run_dir: str = "."
    """Where outputs go; the entry point sets it to Hydra's output directory."""
    explicit_data: bool = False
    """Set by the entry point: true when the command line chose the ``data`` group or a ``data.*``
    key. A LightningModule with its own ``train_dataloader`` then refuses those settings instead
    of ignoring the data group with a notice."""
    start_from: str | None = None
    """Set by the entry point: ``resume`` named a full fine-tune's checkpoint and this run trains
    adapters (``peft=lora``): a new run (step 0, new optimizer state) whose base weights are read
    from that checkpoint (:mod:`fsdp_cli.checkpoint.start_from`)."""
    run_id: str | None = None
    """Set by the entry point: who this run's checkpoints belong to (recorded in each manifest; the
    pruner removes only saves that carry it). A resumed run keeps the id of the checkpoint it
    resumes, so it prunes that run's older saves; another run sharing ``checkpoint.dir`` has its own."""
    callbacks: dict[str, Any] = field(default_factory=dict)
    """Lightning callbacks added beside fsdp-train's own, on every rank: ``NAME: {_target_:
    dotted.Class, ARG: VALUE, ...}`` (``+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor``);
    a null entry is skipped. They see metrics.jsonl's values (``loss``, ``lr``, ...) in
    ``trainer.callback_metrics``."""
