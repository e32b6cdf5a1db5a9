"""What composes with what: one table, read by the pre-launch checks, the tests and
``docs/compatibility.md``.

Every pair of features (:data:`FEATURES`: the strategies, the model kinds, and the dimensions and
settings a run can combine) has one cell in :data:`CELLS`:

* :class:`Trained` — the two train together, and the named test compares such a run with one
  process (or with another layout that is compared with one process);
* :class:`Refused` — refused before any rank starts, in one line naming both keys: by
  :func:`check_composition` from the cell's own words, or by the named check where the refusal
  depends on more than the two features;
* :class:`Moot` — the pair cannot be asked for (a key one strategy's schema lacks, a setting that
  means nothing without the other), and the config says so by itself.

``tests/test_composition.py`` fails when a pair has no cell, when a named test or check does not
exist, or when a refused pair's example launches; ``python -m fsdp_cli.config.composition >
docs/compatibility.md`` writes the table (a test fails when the file is stale). Torch-free.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdp_cli.errors import ConfigError

if TYPE_CHECKING:
    from fsdp_cli.config.resolved import ResolvedRun

COMMAND = "python -m fsdp_cli.config.composition > docs/compatibility.md"
CHECK = "config.composition.check_composition"
"""(Checks are named within the ``fsdp_cli`` package.)"""


@dataclass(frozen=True)
class Feature:
    """One thing a run can be or turn on."""

    id: str
    setting: str
    """How a user asks for it (what an error names)."""
    key: str
    """The key the one-line error names."""
    active: Callable[[ResolvedRun], bool]
    example: tuple[str, ...] = ()
    """Overrides that turn it on (``{hf}``, ``{chats}``, ``{tokenizer}``: the test's files)."""
    group: str | None = None
    """Features of one group exclude each other (one strategy, one model kind)."""


def _strategy(name: str) -> Callable[[ResolvedRun], bool]:
    return lambda run: run.entry.name == name


def _kind(*names: str) -> Callable[[ResolvedRun], bool]:
    return lambda run: run.model_kind.name in names


def _setting(name: str) -> Callable[[ResolvedRun], bool]:
    def active(run: ResolvedRun) -> bool:
        settings = run.cfg.strategy.parallelize_settings()
        value = getattr(settings, name, None) if settings is not None else None
        return bool(value) and getattr(value, "value", value) != "none"

    return active


def _hsdp(run: ResolvedRun) -> bool:
    return run.entry.name in ("fsdp2", "fsdp") and run.layout.replicate > 1 and run.layout.shard > 1


def _chat(run: ResolvedRun) -> bool:
    return getattr(run.cfg.data, "name", None) == "chat"


def _ac(run: ResolvedRun) -> bool:
    policy = getattr(run.cfg.strategy, "activation_checkpointing_policy", None)
    return bool(policy) or _setting("activation_checkpointing")(run)


CHATS = ("data=chat", "data.path={chats}", "data.tokenizer={tokenizer}", "data.seq_len=48")

FEATURES: tuple[Feature, ...] = (
    Feature("fsdp2", "strategy=fsdp2", "strategy", _strategy("fsdp2"), ("strategy=fsdp2",), "strategy"),
    Feature("fsdp", "strategy=fsdp (FSDP1)", "strategy", _strategy("fsdp"), ("strategy=fsdp",), "strategy"),
    Feature("ddp", "strategy=ddp", "strategy", _strategy("ddp"), ("strategy=ddp",), "strategy"),
    Feature(
        "model_parallel",
        "strategy=model_parallel",
        "strategy",
        _strategy("model_parallel"),
        ("strategy=model_parallel",),
        "strategy",
    ),
    Feature(
        "builtin",
        "the built-in Llama (model=tiny, llama_*)",
        "model",
        _kind("llama"),
        ("model=tiny",),
        "model",
    ),
    Feature("hf", "model=hf", "model", _kind("hf"), ("model=hf", "model.path={hf}"), "model"),
    Feature(
        "module",
        "a plain nn.Module (model=custom)",
        "model",
        _kind("module"),
        ("model=custom", "model._target_=tests.assets.custom_models.TinyLM", "data.vocab_size=64"),
        "model",
    ),
    Feature(
        "lightning",
        "a LightningModule (model=custom)",
        "model",
        _kind("lightning"),
        ("model=custom", "model._target_=tests.assets.own_loaders.BoringModel", "data.vocab_size=64"),
        "model",
    ),
    Feature(
        "hsdp",
        "HSDP (strategy.replicate_size > 1)",
        "strategy.replicate_size",
        _hsdp,
        ("strategy.replicate_size=2", "devices=4"),
    ),
    Feature("tp", "tp > 1", "tp", lambda run: run.layout.tp > 1, ("tp=2",)),
    Feature("pp", "pp > 1", "pp", lambda run: run.layout.pp > 1, ("pp=2",)),
    Feature("cp", "cp > 1 (context parallel)", "cp", lambda run: run.layout.cp > 1, ("cp=2",)),
    Feature("ep", "ep > 1 (expert parallel)", "ep", lambda run: run.layout.ep > 1, ("ep=2", "devices=4")),
    Feature("lora", "peft=lora", "peft", lambda run: run.cfg.peft.enabled, ("peft=lora",)),
    Feature(
        "qlora",
        "peft=qlora (LoRA over an NF4 base)",
        "peft.quantize_base",
        lambda run: run.cfg.peft.quantize_base.value != "none",
        ("peft=qlora",),
    ),
    Feature("chat", "data=chat", "data", _chat, CHATS),
    Feature(
        "packing",
        "data=chat data.packing=true",
        "data.packing",
        lambda run: _chat(run) and bool(run.cfg.data.packing),
        (*CHATS, "data.packing=true"),
    ),
    Feature(
        "bf16",
        "precision=bf16-mixed / bf16-true",
        "precision",
        lambda run: run.precision.name.startswith("bf16"),
        ("precision=bf16-mixed",),
    ),
    Feature(
        "ac",
        "activation checkpointing",
        "strategy.activation_checkpointing",
        _ac,
        ("strategy.activation_checkpointing=full",),
    ),
    Feature(
        "compile",
        "strategy.compile=true",
        "strategy.compile",
        _setting("compile"),
        ("strategy.compile=true",),
    ),
    Feature(
        "float8", "strategy.float8=true", "strategy.float8", _setting("float8"), ("strategy.float8=true",)
    ),
    Feature(
        "offload",
        "strategy.cpu_offload=true",
        "strategy.cpu_offload",
        lambda run: run.cfg.strategy.offloads(),
        ("strategy.cpu_offload=true",),
    ),
    Feature(
        "full_ckpt",
        "checkpoint=full",
        "checkpoint",
        lambda run: run.checkpoint_format.value == "full",
        ("checkpoint=full",),
    ),
    Feature("resume_layout", "resume at another layout", "resume", lambda run: run.cfg.resume is not None),
)
BY_ID = {f.id: f for f in FEATURES}


@dataclass(frozen=True)
class Trained:
    """Trained together; ``test`` (``tests/FILE.py::NAME``) compares such a run with one process."""

    test: str
    note: str = ""


@dataclass(frozen=True)
class Refused:
    """Refused before launch: by :func:`check_composition` with ``reason`` and ``hint``, or by
    ``check`` (a dotted function) in its own words."""

    reason: str
    hint: str = ""
    check: str = CHECK
    allowed: str = ""
    lead: str = ""
    """Features (``a,b``) whose key the line starts with (default: the later one in :data:`FEATURES`)."""


@dataclass(frozen=True)
class Moot:
    """The pair cannot be asked for; ``reason`` says why (and what answers a user who tries)."""

    reason: str


@dataclass(frozen=True)
class Untested:
    """Not refused, and no test yet compares the two together with one process: listed as such in
    docs/compatibility.md (``tests/test_composition.py`` holds their number, which may only fall)."""

    reason: str = ""


Cell = Trained | Refused | Moot | Untested


def pair(a: str, b: str) -> frozenset[str]:
    return frozenset((a, b))


def _pairs(spec: str) -> list[frozenset[str]]:
    """``"a:b c:d"`` -> the pairs; ``"a:b,c,d"`` -> a with each of b, c, d."""
    out = []
    for item in spec.split():
        first, rest = item.split(":")
        out += [pair(first, other) for other in rest.split(",")]
    return out


def _table(*rows: tuple[str, Cell]) -> dict[frozenset[str], Cell]:
    cells: dict[frozenset[str], Cell] = {}
    for spec, found in rows:
        for key in _pairs(spec):
            if key in cells:
                raise ValueError(f"{sorted(key)} has two cells")
            cells[key] = found
    return cells


def _test(name: str, note: str = "") -> Trained:
    return Trained(f"tests/{name}", note)


# The composed runs of tests/test_composition.py (each equal to one process with the same settings).
_A = "hf,hsdp,cp,lora,chat,packing,ac,offload,full_ckpt"
_ALL_A = [*_A.split(","), "fsdp2"]
_F = "builtin,pp,chat,packing,bf16,float8,ac,compile,offload,full_ckpt"
_T = "builtin,tp,chat,packing,offload,full_ckpt"


_M = "module,lora,chat,ac,compile,float8,bf16,offload,full_ckpt"
_E = "fsdp2,hf,ep,hsdp,chat,packing,ac,offload,bf16,float8,full_ckpt"
_Q = "fsdp2,builtin,qlora,lora,hsdp,cp,chat,packing,ac,offload,full_ckpt"
COMPOSED = {
    "test_composition.py::test_a_composed_hf_run_on_hsdp_equals_one_process": ["fsdp2", *_A.split(",")],
    "test_composition.py::test_a_composed_pipeline_run_in_bf16_and_float8_equals_one_process": [
        "fsdp2",
        *_F.split(","),
    ],
    "test_composition.py::test_a_composed_tensor_parallel_run_on_packed_chat_equals_one_process": [
        "fsdp2",
        *_T.split(","),
    ],
    "test_composition.py::test_a_composed_plain_module_run_equals_one_process": ["fsdp2", *_M.split(",")],
    "test_composition.py::test_the_composed_hf_run_resumes_at_another_layout": ["resume_layout", *_ALL_A],
    "test_expert_parallel.py::test_fsdp_train_at_ep2_on_hsdp_equals_one_process": _E.split(","),
    "test_expert_parallel.py::test_an_ep2_checkpoint_resumes_at_ep1": ["resume_layout", *_E.split(",")],
    "test_qlora.py::test_a_composed_qlora_run_on_hsdp_and_cp_equals_one_process": _Q.split(","),
    "test_qlora.py::test_qlora_in_bf16_true_on_two_ranks_equals_one_process": [
        "fsdp2",
        "builtin",
        "qlora",
        "bf16",
    ],
    "test_context_parallel.py::test_cp_in_bf16_with_float8_compile_and_offload_equals_one_process": [
        *"fsdp2,builtin,cp,bf16,float8,compile,offload".split(",")
    ],
}
"""The runs of ``tests/test_composition.py``, by test: the features each trains together."""

_NO_KEY = "strategy={0} has no such key (Hydra's one line: not a key of its schema)"
_SELF = (
    "the LightningModule parallelizes itself in configure_model(): strategy=model_parallel has no such key"
)

EXPLICIT = _table(
    ("fsdp2:builtin,tp ddp:builtin builtin:tp", _test("test_runs.py::test_losses_match_single_process")),
    ("fsdp2:hf hf:tp", _test("test_hf.py::test_llama_losses_match_transformers_in_one_process")),
    (
        "fsdp2:lightning",
        _test("test_lightning_conformance.py::test_lightning_modules_train_as_under_a_plain_trainer"),
    ),
    (
        "lightning:ac,offload,hsdp,compile",
        _test(
            "test_lightning_conformance.py::test_lightning_modules_train_as_under_a_plain_trainer",
            "an encoder-decoder LightningModule with manual optimization, against plain Lightning "
            "(1e-5): AC, offload and compile on its layers over HSDP's 2-D mesh (2 replicas x 1)",
        ),
    ),
    (
        "lightning:bf16,float8",
        _test(
            "test_lightning_conformance.py::test_lightning_modules_train_as_under_a_plain_trainer",
            "the encoder-decoder LightningModule under bf16-mixed and float8 linears, within bf16's "
            "tolerance of plain Lightning's fp32 losses; dtypes and float8 layers from the live units",
        ),
    ),
    (
        "tp:bf16",
        _test(
            "test_precision.py::test_tensor_parallel_computes_in_bf16_over_fp32_weights",
            "tp=2 bf16-mixed: live dtypes, and losses within 2% of fp32 (test_losses_within_tolerance_of_fp32)",
        ),
    ),
    (
        "model_parallel:lightning,tp lightning:tp",
        _test(
            "test_lightning_conformance.py::test_lightning_modules_train_as_under_a_plain_trainer",
            "against Lightning's own ModelParallelStrategy at the same layout",
        ),
    ),
    (
        "fsdp:builtin,hsdp,ac,offload,full_ckpt builtin:full_ckpt",
        _test("test_fsdp1.py::test_sharding_option_keeps_single_process_losses", "hsdp: HYBRID_SHARD"),
    ),
    ("fsdp:hf", _test("test_hf.py::test_gpt2_without_a_tp_plan_under_fsdp_with_jsonl_and_validation")),
    ("fsdp:lightning", _test("test_fsdp1.py::test_manual_wrap_matches_the_same_module_on_one_process")),
    (
        "ddp:hf,chat,packing fsdp:chat,packing hf:chat,resume_layout chat:packing,resume_layout packing:resume_layout",
        _test("test_chat_runs.py::test_packed_chat_losses_match_across_layouts_micro_batching_and_resume"),
    ),
    ("ddp:lightning", _test("test_loader_workers.py::test_loader_workers_train_as_under_plain_lightning")),
    (
        "fsdp2:hsdp,ac,offload builtin:hsdp,ac,offload tp:ac,hsdp ac:offload",
        _test("test_fsdp2.py::test_option_keeps_single_process_losses"),
    ),
    (
        "fsdp2:pp builtin:pp pp:resume_layout",
        _test("test_pipeline.py::test_fsdp_train_pp2_equals_one_process_and_resumes_on_other_layouts"),
    ),
    (
        "fsdp2:lora fsdp:lora ddp:lora builtin:lora tp:lora pp:lora",
        _test("test_lora.py::test_lora_losses_equal_one_process_under_fsdp2_fsdp_and_ddp"),
    ),
    (
        "fsdp2:chat,packing hf:packing pp:chat,packing",
        _test("test_chat_runs.py::test_packed_chat_through_a_pipeline_equals_one_process"),
    ),
    (
        "fsdp2:bf16 fsdp:bf16 ddp:bf16 builtin:bf16",
        _test("test_precision.py::test_losses_within_tolerance_of_fp32", "within bf16's tolerance of fp32"),
    ),
    (
        "fsdp2:compile builtin:compile tp:compile compile:resume_layout,hsdp",
        _test(
            "test_compile.py::test_blocks_compile_once_and_train_like_eager",
            "HSDP 2x2 compiled against one process; the compiled tp=2 run starts from the eager dp=2 run's "
            "step-3 checkpoint",
        ),
    ),
    (
        "fsdp2:float8 builtin:float8 bf16:float8",
        _test("test_precision.py::test_float8_trains_like_bf16_with_float8_all_gathers"),
    ),
    (
        "fsdp2:full_ckpt,resume_layout fsdp:resume_layout ddp:resume_layout builtin:resume_layout tp:resume_layout full_ckpt:resume_layout",
        _test("test_checkpoints.py::test_resume_at_another_layout_continues_like_the_straight_run"),
    ),
    (
        "ddp:full_ckpt model_parallel:full_ckpt,resume_layout lightning:full_ckpt,resume_layout",
        _test("test_lightning_conformance.py::test_checkpoints_pass_between_lightnings_strategies_and_ours"),
    ),
    (
        "hf:pp",
        _test(
            "test_pipeline.py::test_a_tied_hf_model_trains_under_pp_as_one_process_and_saves_one_weight",
            "a tied LlamaForCausalLM folder: its embedding on the first stage, its head on the last",
        ),
    ),
    (
        "fsdp2:module module:tp",
        _test("test_pipeline.py::test_every_schedule_equals_one_process", "the library's stages"),
    ),
    (
        "module:pp",
        _test(
            "test_pipeline_cut.py::test_a_nanogpt_style_module_trains_at_pp2_as_one_process",
            "positions added in forward: cut by torch's tracer (every schedule: test_pipeline.py's sweep)",
        ),
    ),
    (
        "fsdp:module ddp:module module:resume_layout,hsdp",
        _test(
            "test_pipeline_cut.py::test_a_nanogpt_style_module_trains_at_pp2_as_one_process",
            "its pp=2 full file resumed under FSDP1 and DDP on 2 ranks and HSDP 2x2",
        ),
    ),
    (
        "lightning:pp",
        _test("test_pipeline.py::test_a_lightning_module_with_the_pipeline_hooks_trains_under_pp"),
    ),
    ("tp:pp", _test("test_pipeline.py::test_a_3d_pipeline_equals_one_process")),
    (
        "cp:tp",
        _test(
            "test_context_parallel.py::test_context_parallel_equals_one_process_in_float64",
            "the library's layout, losses and gradients in float64",
        ),
    ),
    (
        "pp:bf16,full_ckpt bf16:resume_layout",
        _test("test_pipeline.py::test_a_full_save_under_pp_is_a_pp1_full_file_and_resumes"),
    ),
    ("lora:resume_layout", _test("test_lora.py::test_resume_is_exact_at_another_layout")),
    # Refused before launch.
    (
        "fsdp:tp ddp:tp",
        Refused("no tensor parallelism", check="config.strategies.check_tensor_parallel"),
    ),
    (
        "fsdp:pp ddp:pp model_parallel:pp",
        Refused("no pipeline schedule", check="pipeline.checks.check_pipeline"),
    ),
    (
        "model_parallel:builtin,hf",
        Refused(
            "needs a LightningModule that parallelizes itself",
            check="config.strategies.check_strategy",
        ),
    ),
    (
        "model_parallel:lora",
        Refused(
            "peft=lora needs fsdp-train to build the model",
            check="config.adapter_checks.check_adapters",
        ),
    ),
    (
        "lightning:lora",
        Refused(
            "the module builds its layers in its own configure_model",
            check="resolve.adapter_targets_check",
        ),
    ),
    (
        "tp:float8",
        Refused("float8 is not combined with tensor parallel", check="launch.layout.resolve_layout"),
    ),
    (
        "module:packing lightning:packing",
        Refused(
            "the attention cannot keep packed examples apart",
            check="config.data_checks.check_packing",
        ),
    ),
    (
        "cp:fsdp,ddp,model_parallel",
        Refused(
            "context parallel shards parameters over FSDP2's data-parallel x cp ranks",
            allowed="strategy=fsdp2 with cp > 1",
            hint="use strategy=fsdp2, or cp=1",
            lead="cp",
        ),
    ),
    (
        "cp:pp",
        Refused(
            "pipeline stages pass whole sequences between ranks",
            allowed="pp=1 with cp > 1",
            hint="for long sequences cp with dp (and tp) alone",
            lead="cp",
        ),
    ),
    (
        "cp:module",
        Refused(
            "its attention cannot be reached to exchange the sequence's slices",
            check="config.callback_classes.check_context_parallel_hook",
        ),
    ),
    (
        "cp:lightning",
        _test(
            "test_context_parallel.py::test_a_lightning_module_with_the_hook_equals_one_process_at_cp2",
            "a module that declares context_parallel (docs/context-parallel.md)",
        ),
    ),
    (
        "ep:fsdp,ddp,model_parallel",
        Refused(
            "expert parallel splits the experts over FSDP2's data-parallel ranks",
            allowed="strategy=fsdp2 with ep > 1",
            hint="use strategy=fsdp2, or ep=1",
            lead="ep",
        ),
    ),
    (
        "ep:tp",
        Refused(
            "the experts are not split by tensor parallel (no plan for the fused experts is applied)",
            allowed="tp=1 with ep > 1",
            hint="split the experts over ep and the rest over dp (FSDP2)",
            lead="ep",
        ),
    ),
    (
        "ep:cp",
        _test(
            "test_expert_parallel.py::test_the_routing_bias_under_pp_and_cp_moves_as_in_one_process",
            "the built-in MoE at ep=2 x cp=2 (4 ranks), fp32: losses, the first gradient norm and every routing bias as one process's",
        ),
    ),
    (
        "ep:module,lightning",
        Refused(
            "not a mixture of experts: no experts to split", check="config.model_kinds.check_expert_parallel"
        ),
    ),
    (
        "ep:compile",
        _test(
            "test_expert_parallel.py::test_expert_parallel_equals_one_process_in_float64",
            "a Qwen3-MoE compiled per decoder layer at ep=2, the token exchange eager: losses and "
            "gradients against one eager process within 1e-5 in float64, no recompiles",
        ),
    ),
    (
        "ep:lora",
        _test(
            "test_expert_parallel.py::test_expert_parallel_equals_one_process_in_float64",
            "Qwen3-MoE with adapters on every linear layer and on the fused experts at ep=2: "
            "losses and the adapters' gradients in float64; exported for peft in "
            "test_adapters_on_the_fused_experts_train_at_ep2_and_load_in_peft",
        ),
    ),
    (
        "ep:builtin",
        _test(
            "test_expert_parallel.py::test_expert_parallel_equals_one_process_in_float64",
            "the built-in model with model.n_experts, losses and gradients in float64",
        ),
    ),
    (
        "qlora:fsdp2,hf,lora",
        _test(
            "test_qlora.py::test_qlora_equals_a_hand_written_nf4_peft_fsdp2_loop",
            "fp32 losses within 1e-5 of torchao NF4 + peft + fully_shard by hand",
        ),
    ),
    ("qlora:resume_layout", _test("test_qlora.py::test_a_qlora_checkpoint_resumes_on_one_process")),
    (
        "qlora:fsdp,ddp,model_parallel",
        Refused(
            "the NF4 base is sharded by FSDP2 (torchao's NF4 tensor has FSDP2's all-gather hooks)",
            allowed="strategy=fsdp2 with peft=qlora (one device too)",
            hint="strategy=fsdp2, or peft=lora",
            lead="qlora",
        ),
    ),
    (
        "qlora:module,lightning",
        Refused(
            "fsdp-train quantizes the weights it fills itself: the built-in model's and model=hf's",
            check="config.adapter_checks.check_quantized_base",
        ),
    ),
    (
        "qlora:float8,compile",
        Refused(
            "the adapted layers' NF4 weights are dequantized by torchao's NF4 tensor at each forward; "
            "float8 would swap those layers and torch.compile is not tried over them",
            allowed="strategy.float8=false and strategy.compile=false with peft=qlora",
            hint="peft=qlora alone (its saving is the base's memory), or peft=lora with float8 or compile",
            lead="qlora",
        ),
    ),
    (
        "qlora:tp,pp",
        Refused(
            "the NF4 base is sharded by FSDP2 alone: torchao's NF4 tensor has no tensor-parallel "
            "layouts, and NF4 pipeline stages are not built",
            allowed="tp=1 and pp=1 with peft=qlora",
            hint="peft=qlora over data-parallel ranks, or peft=lora under tp or pp",
            lead="qlora",
        ),
    ),
    (
        "qlora:ep",
        Refused(
            "an NF4 base beside experts split over ep has not been compared with one process",
            allowed="ep=1 with peft=qlora",
            hint="peft=lora at ep > 1 (adapters over a frozen base in its dtype), or peft=qlora at ep=1",
            lead="qlora",
        ),
    ),
    # Cannot be asked for.
    ("ddp:hsdp,ac,compile,float8,offload", Moot(_NO_KEY.format("ddp"))),
    ("fsdp:compile,float8", Moot(_NO_KEY.format("fsdp"))),
    ("model_parallel:hsdp,ac,compile,float8,offload", Moot(_SELF)),
    (
        "model_parallel:packing",
        Moot(
            "strategy=model_parallel trains a LightningModule, for which packing is refused (lightning x packing)"
        ),
    ),
    (
        "model_parallel:module",
        Refused(
            "Lightning's ModelParallelStrategy leaves parallelizing to a LightningModule's "
            "configure_model(), and nothing would shard or synchronize a plain module",
            check="config.callback_classes.check_parallelizes_itself",
        ),
    ),
    (
        "hsdp:pp ep:pp",
        _test(
            "test_expert_parallel.py::test_the_routing_bias_under_pp_and_cp_moves_as_in_one_process",
            "pp=2 x HSDP 2x2 x ep=2 on 8 ranks: the built-in MoE balanced by its routing bias, "
            "losses, first gradient norm and biases; every schedule at pp x ep in test_pipeline's sweep",
        ),
    ),
    # Not refused, not yet compared with one process.
    (
        "model_parallel:chat,bf16 lightning:chat",
        _test(
            "test_lightning_conformance.py::test_a_lightning_module_trains_on_chat_batches_as_one_process",
            "a LightningModule returning chat_loss (docs/your_model_your_data.md): fsdp2 on 2 ranks "
            "as one process (1e-5); Lightning's ModelParallelStrategy, the module sharding itself, "
            "bf16-mixed within bf16's tolerance",
        ),
    ),
    (
        "compile:hf",
        _test(
            "test_expert_parallel.py::test_expert_parallel_equals_one_process_in_float64",
            "a Qwen3-MoE folder compiled per decoder layer (at ep=2): losses and gradients against "
            "one eager process within 1e-5 in float64, no recompiles",
        ),
    ),
)


CELLS: dict[frozenset[str], Cell] = {}
"""One cell per pair: :data:`EXPLICIT`, then every pair a composed run trains together."""


def _build() -> dict[frozenset[str], Cell]:
    cells = dict(EXPLICIT)
    for test, features in COMPOSED.items():
        for i, a in enumerate(features):
            for b in features[i + 1 :]:
                cells.setdefault(pair(a, b), _test(test))
    return cells


CELLS.update(_build())


def pairs() -> Iterator[tuple[Feature, Feature]]:
    """Every pair of features that can be asked for together (not two of one group)."""
    for a, b in itertools.combinations(FEATURES, 2):
        if a.group is None or a.group != b.group:
            yield a, b


def cell(a: str, b: str) -> Cell | None:
    return CELLS.get(pair(a, b))


def active_features(run: ResolvedRun) -> list[Feature]:
    return [f for f in FEATURES if f.active(run)]


def check_composition(run: ResolvedRun) -> None:
    """The first pair of the run's features that :data:`CELLS` refuses by its own words, as one
    line naming both keys."""
    on = active_features(run)
    for a, b in itertools.combinations(on, 2):
        found = cell(a.id, b.id)
        if isinstance(found, Refused) and found.check == CHECK:
            named, other = (a, b) if a.id in found.lead.split(",") else (b, a)
            raise ConfigError(
                named.key,
                value_of(run, named.key),
                f"not with {other.setting}: {found.reason}",
                allowed=found.allowed or None,
                hint=found.hint or None,
            )


def value_of(run: ResolvedRun, key: str) -> Any:
    """What the run sets ``key`` to (a group: its option's name), as an error shows it."""
    node: Any = run.cfg
    for part in key.split("."):
        node = getattr(node, part, None)
    if key == "strategy":
        return run.entry.name
    if key in ("model", "data", "peft", "precision"):
        node = getattr(node, "name", node)
    return getattr(node, "value", node)


# --------------------------------------------------------------------------- docs/compatibility.md


INTRO = f"""# Compatibility: what composes with what

Every pair of features, from one table (`fsdp_cli/config/composition.py`) that the pre-launch
checks and the tests read too; generated by `{COMMAND}`. A cell says:

* **trained**: the two train together, and the named test compares such a run with one process
  (losses, and gradients or weights where scaling could hide);
* **refused**: refused before any process starts, in one line naming both keys (exit 2);
* **—**: the pair cannot be asked for (the reason is given; the config refuses it by itself);
* **not yet compared**: neither refused nor compared with one process by a test yet (the test
  holds their number, which may only fall).

`tests/test_composition.py` fails when a pair has no cell, a named test or check does not exist,
or a refused pair's example gets past the checks.
"""


def _describe(found: Cell) -> str:
    if isinstance(found, Trained):
        name = found.test.split("::")[-1]
        return f"trained: `{name}`" + (f" ({found.note})" if found.note else "")
    if isinstance(found, Refused):
        where = "" if found.check == CHECK else f" (`{found.check.rsplit('.', 1)[-1]}`)"
        return f"refused{where}: {found.reason}"
    if isinstance(found, Untested):
        return "**not yet compared**" + (f": {found.reason}" if found.reason else "")
    return f"—: {found.reason}"


def render() -> str:
    summary = ", ".join(f"{n} {kind}" for kind, n in counts().items() if kind != "missing")
    lines = [INTRO, f"Pairs: {summary}.\n", "## Features\n", "| id | what |", "|---|---|"]
    lines += [f"| `{f.id}` | {f.setting} |" for f in FEATURES]
    lines += ["", "## Pairs\n"]
    for a in FEATURES:
        rows = [
            (b, cell(a.id, b.id))
            for b in FEATURES[FEATURES.index(a) + 1 :]
            if a.group is None or a.group != b.group
        ]
        if not rows:
            continue
        lines += [f"### `{a.id}` ({a.setting})\n", "| with | cell |", "|---|---|"]
        lines += [f"| `{b.id}` | {_describe(c) if c is not None else '**missing**'} |" for b, c in rows]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def counts() -> dict[str, int]:
    kinds: dict[str, int] = {"trained": 0, "refused": 0, "moot": 0, "untested": 0, "missing": 0}
    for a, b in pairs():
        found = cell(a.id, b.id)
        kinds["missing" if found is None else type(found).__name__.lower()] += 1
    return kinds


if __name__ == "__main__":
    sys.stdout.write(render())
