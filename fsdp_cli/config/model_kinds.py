"""One entry per model kind: everything fsdp-train asks of a model, answered in one place.

Validation, the resolved run, the builders, the memory plan, the rehearsal and the throughput
report each ask the :class:`ModelKind` of the run's model (``run.model_kind``) instead of
switching on its config class (in the manner of torchtitan's ``ModelSpec``). A new model kind is
a schema in :mod:`fsdp_cli.config.schema`, its code in :mod:`fsdp_cli.models`, and an entry here;
a new question (pipeline stages, adapters, packed sequences) is a field every entry answers.

``model=custom`` is one schema and two kinds: a plain ``nn.Module`` (:data:`MODULE`, wrapped in
:class:`fsdp_cli.models.causal_lm.CausalLMModule`) and a ``LightningModule`` that trains itself
(:data:`LIGHTNING`). Which one is known only once ``model._target_`` is imported, and the parent
does not import it (a config error costs well under a second): :func:`kind_of` answers
:data:`MODULE` for the questions asked before launch (schema, checks, label, data, sizes: the two
answer them alike), :func:`kind_of_target` imports the target and tells the two apart.

The entries hold functions, not dotted names; the functions import torch and the model's code when
called, so importing the registry stays torch-free.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from fsdp_cli.config.manual_optimization import check_manual_optimization
from fsdp_cli.config.schema import CustomModelConfig, HFModelConfig, LlamaConfig
from fsdp_cli.dotted import check_dotted
from fsdp_cli.errors import ConfigError
from fsdp_cli.extras import install_hint
from fsdp_cli.models.flops import active_flops_per_token, counted_flops_per_token, llama_flops_per_token
from fsdp_cli.models.folder import (
    Experts,
    check_experts,
    check_model_type,
    check_weight_headers,
    read_model_folder,
    weight_files,
)
from fsdp_cli.models.llama_shapes import llama_block_names

if TYPE_CHECKING:  # (type-only: the resolved run asks its entry; torch only where a model is built)
    from torch import nn

    from fsdp_cli.config.resolved import ResolvedRun

Check = Callable[["ResolvedRun"], None]


class ModelKind(NamedTuple):
    """(A named tuple, as :class:`fsdp_cli.config.strategies.StrategyEntry`: the config-only
    commands import the registry.)"""

    name: str
    schema: type
    """The ``model`` group's config class (:mod:`fsdp_cli.config.schema`)."""
    label: Callable[[Any], str]
    """How reports and summaries name the model."""
    checks: tuple[Check, ...]
    """Its validation before launch (after the strategy's checks), in order."""
    build: Callable[[ResolvedRun], Any]
    """What the model builder wraps: a factory of the ``nn.Module`` (called inside
    ``configure_model``, on the meta device where the strategy shards before materialising), or,
    for ``model=custom``, the target's own ``LightningModule``."""
    meta_model: Callable[[ResolvedRun], Any]
    """The model built on the meta device (no memory) for the memory plan; None where its layers
    only appear in its own ``configure_model``."""
    tp_sizes: Callable[[Any], dict[str, int]]
    """The sizes tensor parallel (and later pipeline parallel) must divide, by the key that sets
    them (:func:`check_tp_sizes` holds each to ``tp``); empty: the model's own plan decides."""
    sizes_from: str
    """Where those sizes were read, as the error names it (`` (config.json)``)."""
    tp_plan: Callable[[Any, bool], dict[str, Any] | None]
    """``(built model, sequence_parallel)`` -> its tensor-parallel plan (the one
    :func:`fsdp_cli.parallel.parallelize.parallelize` applies), None without one."""
    flops_per_token: Callable[[ResolvedRun, Any], float | None]
    """``(run, LightningModule)`` -> training FLOPs per token (:mod:`fsdp_cli.models.flops`)."""
    closed_form: bool
    """The memory plan describes it from its config alone (parameters, blocks as FSDP units,
    activations: :func:`fsdp_cli.plan.model.llama_spec`); otherwise from :attr:`meta_model`, whose
    blocks are its repeated classes and whose FSDP units the ``wrap`` policy picks
    (:func:`fsdp_cli.parallel.wrap.wrap_units`)."""
    stage_split_points: Callable[[Any], list[str] | None]
    """Pipeline parallel: the blocks a stage boundary may fall before, for the checks before
    launch; None: not known before launch (the cut is checked when the model is built)."""
    adapter_targets: Callable[[Any], list[str] | None]
    """Adapters (``peft=lora``): the linear layers (name suffixes) adapters may wrap, known from
    the config; empty: found on its meta model (:func:`fsdp_cli.adapters.targets.block_linears`);
    None: not supported."""
    attention_heads: str = ""
    """Context parallel (cp > 1): the key of :attr:`tp_sizes` that counts the query heads, which the
    all-to-all splits over tp x cp ranks; empty: its attention cannot be reached (cp refused)."""
    document_masks: bool = False
    """Hook for packed sequences: its attention can keep the documents of one sequence apart."""
    recomputes_buffers: bool = False
    """Its buffers are tables every rank computes alike (no per-step DDP broadcast needed)."""
    target_decides: bool = False
    """``model=custom``: :data:`MODULE` or :data:`LIGHTNING`, known once ``model._target_`` is
    imported (:func:`kind_of_target`); it may bring its own data and its own parallelism."""
    lightning: bool = False
    """A ``LightningModule`` that trains itself (its ``training_step``, ``configure_model``)."""
    default_vocab: Callable[[Any], int | None] = lambda model: None
    """What ``data.vocab_size`` defaults to when neither it nor ``model.vocab_size`` is set."""
    without_weights: Callable[[Any], Any] = lambda model: model
    """The config as a rehearsal builds it: no weights read (only shapes matter there)."""
    yaml_node: Callable[[Any], dict[str, Any]] | None = None
    """Its ``config.yaml`` node, where the structured dump would not read back (``_target_``)."""
    tied_embeddings: Callable[[Any], bool] = lambda model: False
    experts: Callable[[Any], Experts | None] = lambda model: None
    """A mixture of experts' sizes (:class:`~fsdp_cli.models.folder.Experts`), which expert
    parallel splits (ep > 1 refused where None: a dense model)."""
    """Whether the head shares the input embedding's weight (a plain module's ties are found when
    its cut is traced)."""


# --------------------------------------------------------------------------- checks


def check_model(run: ResolvedRun) -> None:
    """The checks of the run's model kind."""
    for check in run.model_kind.checks:
        check(run)


def check_tp_sizes(run: ResolvedRun) -> None:
    """Each tensor-parallel rank needs an equal share of every size the model kind names."""
    tp, kind = run.layout.tp, run.model_kind
    if tp == 1:
        return
    sizes = kind.tp_sizes(run.cfg.model)
    for key, size in sizes.items():
        if size % tp != 0:
            good = [
                d
                for d in range(1, tp + 1)
                if all(s % d == 0 for s in sizes.values()) and run.layout.world_size % d == 0
            ]
            raise ConfigError(
                "tp",
                tp,
                f"{key}={size}{kind.sizes_from} is not divisible by tp={tp}; each tensor-parallel rank needs an equal share",
                allowed="tp in " + ", ".join(str(d) for d in good),
                hint=f"use tp={max(good)} or a model whose heads/ffn sizes divide by {tp}",
            )


def check_context_parallel(run: ResolvedRun) -> None:
    """cp > 1: a model kind whose attention takes part, sequences that split into equal slices,
    query heads that split over tp x cp ranks (key/value heads are repeated where they do not)."""
    cp, kind = run.layout.cp, run.model_kind
    if cp == 1:
        return
    ring = run.cfg.cp_impl.value == "ring"
    if ring:  # (its heads need not split over cp: each rank keeps every head of its slice)
        _check_ring_attention(run)
    seq = getattr(run.cfg.data, "seq_len", None)
    if isinstance(seq, int) and seq % cp:
        raise ConfigError(
            "data.seq_len",
            seq,
            f"must divide by cp={cp}: each context-parallel rank holds an equal slice of every sequence",
            allowed=f"a multiple of {cp}",
            hint=f"data.seq_len={seq + cp - seq % cp}",
        )
    if kind.target_decides:  # model=custom: its class is checked once imported (check_model_arguments)
        return
    if not kind.attention_heads:
        raise ConfigError(
            "cp",
            cp,
            f"model={kind.name}: its attention cannot be reached to exchange the sequence's slices",
            allowed="cp=1 for this model; cp > 1 with the built-in models or model=hf",
            hint="docs/context-parallel.md shows the hook a LightningModule declares",
        )
    heads = kind.tp_sizes(run.cfg.model).get(kind.attention_heads)
    split = run.layout.tp * cp
    if isinstance(heads, int) and heads % split and not ring:
        good = [d for d in range(1, cp + 1) if heads % (run.layout.tp * d) == 0]
        raise ConfigError(
            "cp",
            cp,
            f"{kind.attention_heads}={heads}{kind.sizes_from} does not split over tp={run.layout.tp} x cp={cp} "
            "ranks: the all-to-all gives each rank whole heads",
            allowed="cp in " + ", ".join(map(str, good)),
            hint=f"use cp={max(good)} (or a smaller tp)",
        )


def _check_ring_attention(run: ResolvedRun) -> None:
    """``cp_impl=ring``: torch's ring attention runs GPU kernels, causal only, on head-tail slices."""
    cp, seq = run.layout.cp, getattr(run.cfg.data, "seq_len", None)
    if not run.layout.on_gpu:
        raise ConfigError(
            "cp_impl",
            "ring",
            "torch's ring attention has no CPU kernel (the CPU SDPA op has no sharding rule for it)",
            allowed="cp_impl=ring on GPUs; cp_impl=all_to_all anywhere",
            hint="cp_impl=all_to_all (the default) on CPU processes",
        )
    if getattr(run.cfg.data, "packing", False):
        raise ConfigError(
            "cp_impl",
            "ring",
            "not with data.packing=true: ring attention is causal only, and packed documents need a document mask",
            allowed="cp_impl=all_to_all with packing",
            hint="cp_impl=all_to_all, or data.packing=false",
        )
    if isinstance(seq, int) and seq % (2 * cp):
        raise ConfigError(
            "data.seq_len",
            seq,
            f"must divide by 2 x cp={2 * cp} with cp_impl=ring: each rank holds two of 2 x cp equal chunks",
            allowed=f"a multiple of {2 * cp}",
            hint=f"data.seq_len={seq + 2 * cp - seq % (2 * cp)}",
        )


def check_expert_parallel(run: ResolvedRun) -> None:
    """A mixture of experts' sizes (experts per token within the experts; a kernel that runs the
    precision) and, under ep > 1, a model with experts that split evenly over ep ranks."""
    ep, kind = run.layout.ep, run.model_kind
    moe = None if kind.target_decides else kind.experts(run.cfg.model)
    if moe is not None:
        _check_moe_sizes(run, moe)
    if ep == 1:
        return
    if moe is None:
        raise ConfigError(
            "ep",
            ep,
            f"the model ({run.model_label}) is not a mixture of experts: it has no experts to split",
            allowed="ep=1 for this model",
            hint="expert parallel splits a MoE model=hf (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, ...)",
        )
    experts = moe.count
    if experts % ep:
        good = [d for d in range(1, run.layout.shard + 1) if experts % d == 0 and run.layout.shard % d == 0]
        raise ConfigError(
            "ep",
            ep,
            f"the {experts} experts of each MoE layer (config.json) do not split evenly over ep={ep} ranks",
            allowed="ep in " + ", ".join(map(str, good)),
            hint=f"use ep={max(good)}",
        )


def _check_moe_sizes(run: ResolvedRun, moe: Experts) -> None:
    if moe.per_token > moe.count:
        key = "model.experts_per_token" if run.model_kind.name == "llama" else "model.path"
        raise ConfigError(
            key,
            moe.per_token if key != "model.path" else run.cfg.model.path,
            f"each token is routed to {moe.per_token} experts of only {moe.count}",
            allowed=f"1..{moe.count} experts per token",
        )
    if moe.balance_loss and run.layout.pp > 1:
        # (the stages run the decoder layers themselves: the router logits the loss is formed
        # from are never collected, and the model would train without it)
        raise ConfigError(
            "pp",
            run.layout.pp,
            "the model trains a load-balancing loss (output_router_logits in config.json, "
            "model.aux_loss_coef of the built-in model), which pipeline stages do not compute",
            allowed="pp=1 for this model",
            hint="output_router_logits: false in config.json (the hub's Qwen3-MoE and Mixtral), or the "
            "built-in model's routing bias (model.aux_loss_coef=0 model.balance_bias_rate=0.001)",
        )
    kernel = getattr(run.cfg.model, "experts_implementation", "eager")
    if run.precision.param == "float64" and kernel in (None, "grouped_mm"):
        raise ConfigError(
            "model.experts_implementation",
            kernel,
            "transformers' grouped_mm experts kernel (its default) runs no float64",
            allowed="eager or batched_mm under precision=64-true",
            hint="model.experts_implementation=eager",
        )


def check_llama_sizes(run: ResolvedRun) -> None:
    """Heads that split ``dim`` evenly; key/value heads that divide the heads (each size's own
    range is declared with its field)."""
    model: LlamaConfig = run.cfg.model
    kv = model.n_kv_heads or model.n_heads
    if model.dim % model.n_heads != 0 or (model.dim // model.n_heads) % 2 != 0:
        raise ConfigError(
            "model.n_heads",
            model.n_heads,
            f"model.dim={model.dim} must split into n_heads even-sized heads",
            hint="pick n_heads so that dim / n_heads is an even integer",
        )
    if model.n_heads % kv != 0:
        raise ConfigError(
            "model.n_kv_heads",
            kv,
            f"must divide model.n_heads={model.n_heads} (grouped-query attention)",
            allowed=", ".join(str(d) for d in range(1, model.n_heads + 1) if model.n_heads % d == 0),
        )


def check_llama_experts(run: ResolvedRun) -> None:
    """The built-in mixture of experts: no tensor-parallel plan for its experts (refused at tp > 1);
    its routing bias (``balance_bias_rate``) needs experts."""
    model: LlamaConfig = run.cfg.model
    if model.balance_bias_rate and not model.n_experts:
        raise ConfigError(
            "model.balance_bias_rate",
            model.balance_bias_rate,
            "is a mixture of experts' routing bias",
            allowed="0 with model.n_experts=0",
            hint="model.n_experts > 0",
        )
    if model.n_experts and run.layout.tp > 1:
        raise ConfigError(
            "tp",
            run.layout.tp,
            f"the built-in model's mixture of experts (model.n_experts={model.n_experts}) has no tensor-parallel plan",
            allowed="tp=1 with model.n_experts > 0",
            hint="split its experts over ep instead",
        )


def llama_experts(model: LlamaConfig) -> Experts | None:
    if not model.n_experts:
        return None
    return Experts(model.n_experts, model.experts_per_token, model.aux_loss_coef > 0)


def check_llama_tied_tp(run: ResolvedRun) -> None:
    """The built-in model's tensor-parallel plan splits the head and the embedding differently."""
    if run.cfg.model.tie_embeddings and run.layout.tp > 1:
        raise ConfigError(
            "model.tie_embeddings",
            True,
            "tied embeddings are not supported with tensor parallel",
            allowed="false with tp > 1",
            hint="set model.tie_embeddings=false or tp=1",
        )


def check_custom_target(run: ResolvedRun) -> None:
    check_dotted("model._target_", run.cfg.model.target)


def check_hf_model(run: ResolvedRun) -> None:
    """``model=hf`` (its registry entry's check): transformers installed, the folder complete, its
    vocabulary and positions fit the data, no sequence parallel (the sizes ``tp`` must divide:
    :func:`fsdp_cli.config.model_kinds.check_tp_sizes`)."""
    cfg = run.cfg
    model = cfg.model
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("model", "hf", "needs the transformers package", hint=install_hint("hf"))
    folder = read_model_folder(model.path)
    check_model_type(folder)
    if model.pretrained:
        shapes = check_weight_headers(weight_files(folder.path))
        if folder.experts is not None:
            check_experts(folder.path, folder.experts, shapes)
    vocab, ids = folder.vocab_size, getattr(cfg.data, "vocab_size", None)
    if isinstance(vocab, int) and isinstance(ids, int) and ids > vocab:
        raise ConfigError(
            "data.vocab_size",
            ids,
            f"exceeds the model's vocabulary of {vocab} (config.json): token ids would index past its embedding",
            allowed=f"1..{vocab}",
            hint="data that the model's own tokenizer produced (data=jsonl data.tokenizer=MODEL_DIR, or data=tokens)",
        )
    if model.tie_embeddings and not folder.tied_embeddings:
        raise ConfigError(
            "model.tie_embeddings",
            True,
            f"the model in {model.path} has a head of its own (tie_word_embeddings: false in config.json); "
            "tying would drop it",
            allowed="null (as config.json says) or false",
            hint="model.tie_embeddings=null",
        )
    limit = folder.get("max_positions")
    if isinstance(limit, int) and cfg.data.seq_len > limit:
        raise ConfigError(
            "data.seq_len",
            cfg.data.seq_len,
            f"exceeds the model's {limit} positions (config.json)",
            allowed=f"1..{limit}",
        )
    if cfg.tp > 1:
        _check_sequence_parallel(run)


def _check_sequence_parallel(run: ResolvedRun) -> None:
    cfg = run.cfg
    settings = cfg.strategy.parallelize_settings()
    if settings is not None and settings.sequence_parallel:
        raise ConfigError(
            "strategy.sequence_parallel",
            True,
            "model=hf runs tensor parallel with transformers' own plan, which has no sequence-parallel layouts",
            hint="strategy.sequence_parallel=false",
        )


# --------------------------------------------------------------------------- answers


def llama_tp_sizes(model: LlamaConfig) -> dict[str, int]:
    return {
        "model.n_heads": model.n_heads,
        "model.n_kv_heads": model.n_kv_heads or model.n_heads,
        "model.ffn_hidden_dim": model.feed_forward_dim(),
        "model.vocab_size": model.vocab_size,
    }


def hf_tp_sizes(model: HFModelConfig) -> dict[str, int]:
    """The sizes ``config.json`` declares (read without torch)."""
    return read_model_folder(model.path).tp_sizes()


def no_tp_sizes(model: Any) -> dict[str, int]:
    """A custom model's own plan decides what it splits (checked when it is applied)."""
    return {}


def own_tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, Any] | None:
    """The model's ``tp_plan(sequence_parallel=...)`` (the built-in Llama's, transformers' for a
    Hugging Face model, a custom module's if it has one)."""
    from fsdp_cli.parallel.tensor_parallel import model_tp_plan

    return model_tp_plan(model, sequence_parallel=sequence_parallel)


def plans_in_configure_model(model: Any, sequence_parallel: bool) -> None:
    """A LightningModule applies its own parallelism in ``configure_model``: no plan to ask."""
    return None


def llama_flops(run: ResolvedRun, module: Any) -> float:
    """The closed form ``6 * N + 12 * L * d * T``."""
    return llama_flops_per_token(run.cfg.model, getattr(run.cfg.data, "seq_len", None))


def counted_flops(run: ResolvedRun, module: Any) -> float | None:
    """Counted on a meta build of the factory :class:`CausalLMModule` holds (a mixture of experts,
    whose routing needs values: from its active parameters); None for a module that trains itself
    (it has no factory)."""
    seq = getattr(run.cfg.data, "seq_len", None)
    factory = getattr(module, "model_factory", None)
    if seq and callable(factory):
        counted = counted_flops_per_token(factory, seq, run.cfg.data.vocab_size)
        return counted if counted is not None else active_flops_per_token(factory, seq)
    return None


def llama_stage_split_points(model: LlamaConfig) -> list[str]:
    """Its transformer blocks: a stage boundary may fall before any of them."""
    return llama_block_names(model)


def hf_stage_split_points(model: HFModelConfig) -> list[str] | None:
    """Its decoder layers, counted from config.json (None where it does not say)."""
    layers = read_model_folder(model.path).get("num_hidden_layers")
    return [f"hf.model.layers.{i}" for i in range(layers)] if isinstance(layers, int) else None


def not_supported(model: Any) -> None:
    """Not supported for this model kind yet."""
    return None


def llama_adapter_targets(model: LlamaConfig) -> list[str]:
    """The linear layers of each block: attention projections and the SwiGLU MLP."""
    return [
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "attention.wo",
        *(f"feed_forward.w{i}" for i in (1, 2, 3)),
    ]


def on_meta_model(model: Any) -> list[str]:
    """Its linear layers are found on its meta model (before launch) and on the real one."""
    return []


def hf_tied_embeddings(model: HFModelConfig) -> bool:
    """``config.json``'s ``tie_word_embeddings`` unless ``model.tie_embeddings`` unties it."""
    if model.tie_embeddings is not None:
        return model.tie_embeddings
    return read_model_folder(model.path).tied_embeddings


def hf_folder_vocab(model: HFModelConfig) -> int | None:
    return read_model_folder(model.path).vocab_size


def hf_without_weights(model: HFModelConfig) -> HFModelConfig:
    return dataclasses.replace(model, pretrained=False) if model.pretrained else model


def custom_node(model: CustomModelConfig) -> dict[str, Any]:
    """Custom models keep ``_target_`` (their keyword arguments beside it)."""
    return {"_target_": model.target, **model.kwargs}


# --------------------------------------------------------------------------- building


def build_llama(run: ResolvedRun) -> Callable[[], nn.Module]:
    import torch

    from fsdp_cli.models.llama import Llama

    cfg = run.cfg
    model = cfg.model
    # A strategy that parallelizes the built-in model creates it on the meta device and each rank
    # materialises only its shard; the initialisation is layout-independent, so the weights equal
    # a normal init. (FSDP1 wraps a real model; a user's parallelize_fn gets a real one too.)
    meta = cfg.strategy.builds_on_meta()

    def factory() -> nn.Module:
        if meta:
            with torch.device("meta"):
                return Llama(model, seed=cfg.seed)
        return Llama(model, seed=cfg.seed)

    return factory


def build_hf(run: ResolvedRun) -> Callable[[], nn.Module]:
    import torch

    from fsdp_cli.models.hf import build_hf_model, require_tp_plan

    cfg = run.cfg
    model = cfg.model
    # FSDP2 fills the weights after sharding the meta model, FSDP1 one unit at a time while it
    # wraps; DDP keeps a whole copy on every rank, filled here.
    sharded = run.entry.fills_after_sharding

    def factory() -> nn.Module:
        built = build_hf_model(model, seed=cfg.seed)
        if cfg.tp > 1:
            require_tp_plan(built.hf, cfg.tp)
        # Built under torch.device("meta") (Trainer.init_module(empty_init=True), a rehearsal): stays there.
        if not sharded and torch.get_default_device().type != "meta":
            built.materialize("cpu")
        return built

    return factory


def build_custom(run: ResolvedRun) -> Any:
    """The target's LightningModule, or a factory of its ``nn.Module``."""
    import inspect

    import lightning as L
    from torch import nn

    from fsdp_cli.dotted import import_object

    model = run.cfg.model
    target = import_object(model.target, "model._target_")
    kwargs = dict(model.kwargs)
    if inspect.isclass(target) and issubclass(target, L.LightningModule):
        return target(**kwargs)
    if inspect.isclass(target) and issubclass(target, nn.Module):
        # Built later, inside configure_model (under the strategy's init context).
        return lambda: target(**kwargs)
    built = target(**kwargs)
    if isinstance(built, L.LightningModule):
        return built
    if not isinstance(built, nn.Module):
        raise ConfigError(
            "model._target_",
            model.target,
            f"returned {type(built).__name__}, not an nn.Module or LightningModule",
        )
    return lambda: built


def llama_on_meta(run: ResolvedRun) -> nn.Module:
    import torch

    from fsdp_cli.models.llama import Llama

    with torch.device("meta"):
        return Llama(run.cfg.model, seed=run.cfg.seed)


def hf_on_meta(run: ResolvedRun) -> nn.Module:
    from fsdp_cli.models.hf import build_hf_model

    return build_hf_model(run.cfg.model, seed=run.cfg.seed)  # on the meta device, from config.json


def custom_on_meta(run: ResolvedRun) -> nn.Module | None:
    """The target called under the meta device; None for a LightningModule (its layers appear
    only in its ``configure_model``)."""
    import torch
    from torch import nn

    from fsdp_cli.dotted import import_object

    model = run.cfg.model
    target = import_object(model.target, "model._target_")
    with torch.device("meta"):
        built = target(**model.kwargs)
    if not isinstance(built, nn.Module) or hasattr(built, "training_step"):
        return None
    return built


# --------------------------------------------------------------------------- the entries


LLAMA = ModelKind(
    name="llama",
    schema=LlamaConfig,
    label=lambda model: model.name,
    checks=(check_llama_sizes, check_tp_sizes, check_llama_tied_tp, check_llama_experts),
    build=build_llama,
    meta_model=llama_on_meta,
    tp_sizes=llama_tp_sizes,
    sizes_from="",
    tp_plan=own_tp_plan,
    flops_per_token=llama_flops,
    closed_form=True,
    stage_split_points=llama_stage_split_points,
    adapter_targets=llama_adapter_targets,
    attention_heads="model.n_heads",
    document_masks=True,  # position_ids -> models.llama.document_mask (SDPA, boolean mask)
    recomputes_buffers=True,  # RoPE tables
    tied_embeddings=lambda model: bool(model.tie_embeddings),
    experts=llama_experts,
)
HF = ModelKind(
    name="hf",
    schema=HFModelConfig,
    label=lambda model: f"hf:{model.path}",
    checks=(check_hf_model, check_tp_sizes),
    build=build_hf,
    meta_model=hf_on_meta,
    tp_sizes=hf_tp_sizes,
    sizes_from=" (config.json)",
    tp_plan=own_tp_plan,
    flops_per_token=counted_flops,
    closed_form=False,
    stage_split_points=hf_stage_split_points,
    adapter_targets=on_meta_model,
    attention_heads="num_attention_heads",
    document_masks=True,  # position_ids, no attention mask: transformers masks packed documents
    default_vocab=hf_folder_vocab,
    without_weights=hf_without_weights,
    tied_embeddings=hf_tied_embeddings,
    experts=lambda model: read_model_folder(model.path).experts,
)
MODULE = ModelKind(
    name="module",
    schema=CustomModelConfig,
    label=lambda model: model.target,
    checks=(check_custom_target, check_manual_optimization),
    build=build_custom,
    meta_model=custom_on_meta,
    tp_sizes=no_tp_sizes,
    sizes_from="",
    tp_plan=own_tp_plan,
    flops_per_token=counted_flops,
    closed_form=False,
    stage_split_points=not_supported,
    adapter_targets=on_meta_model,
    target_decides=True,
    yaml_node=custom_node,
)
LIGHTNING = MODULE._replace(
    name="lightning",
    tp_plan=plans_in_configure_model,
    adapter_targets=not_supported,  # its layers appear only in its own configure_model
    lightning=True,
)
"""Asked the same before launch as :data:`MODULE`; built, planned and stepped as a module that
trains itself (``build`` returns it as is; ``meta_model`` finds no layers; no FLOPs counted)."""

KINDS: dict[str, ModelKind] = {k.name: k for k in (LLAMA, HF, MODULE, LIGHTNING)}
_BY_SCHEMA: dict[type, ModelKind] = {LlamaConfig: LLAMA, HFModelConfig: HF, CustomModelConfig: MODULE}


def kind_of(model: Any) -> ModelKind:
    """The entry of a ``model`` config (:data:`MODULE` for ``model=custom`` until its target is
    imported: :func:`kind_of_target`)."""
    for cls in type(model).__mro__:
        if cls in _BY_SCHEMA:
            return _BY_SCHEMA[cls]
    raise ConfigError("model", getattr(model, "name", model), "unknown model", allowed=", ".join(KINDS))


def kind_of_target(model: Any) -> ModelKind:
    """:func:`kind_of`, with ``model=custom`` told apart by importing its target: a
    LightningModule class is :data:`LIGHTNING`."""
    kind = kind_of(model)
    if not kind.target_decides:
        return kind
    import inspect

    import lightning as L

    from fsdp_cli.dotted import import_object

    target = import_object(model.target, "model._target_")
    return LIGHTNING if inspect.isclass(target) and issubclass(target, L.LightningModule) else MODULE
