"""``model=hf``: Hugging Face causal LMs from a local folder, sharded before any weight exists.

Tiny random Llama and GPT-2 models are built with transformers and saved to a temporary folder
(nothing is downloaded). Real runs are compared with training the same model in this process,
with transformers' own ``from_pretrained`` and a plain AdamW loop: fp32 losses per step agree
to reduction order.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_ok, cli_in_process, composed, read_metrics, run_cli, run_of

from fsdp_cli.config.schema import HFModelConfig
from fsdp_cli.errors import ConfigError

VOCAB, SEED, STEPS, BATCH, SEQ = 128, 11, 4, 8, 32
TRAIN = [
    f"trainer.max_steps={STEPS}",
    f"data.global_batch_size={BATCH}",
    f"data.seq_len={SEQ}",
    f"seed={SEED}",
    "precision=32-true",
    "accelerator=cpu",
    "trainer.gradient_clip_val=0",
]
WORDS = "the a quick lazy brown red fox dog cat jumps runs sleeps over under near far and then".split()


def save_llama(path: Path, *, tie: bool = False) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def save_gpt2(path: Path, **overrides: Any) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    # No dropout, so every layout computes the same function; bos/eos inside the tiny vocabulary.
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **overrides,
    )
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def save_word_tokenizer(path: Path) -> Path:
    """A word-level tokenizer.json trained here on the test's words, ending documents with <|endoftext|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<|endoftext|>", "[UNK]"])
    tokenizer.train_from_iterator([" ".join(WORDS)], trainer)
    tokenizer.save(str(path))
    return path


def write_documents(path: Path, count: int, seed: int, words_each: int | None = None) -> Path:
    rng = np.random.default_rng(seed)
    with open(path, "w") as fh:
        for _ in range(count):
            start = int(rng.integers(len(WORDS)))
            length = words_each or int(rng.integers(20, 60))
            words = [WORDS[(start + 3 * i) % len(WORDS)] for i in range(length)]
            fh.write(json.dumps({"text": " ".join(words), "id": start}) + "\n")
    return path


def write_token_stream(path: Path, tokens: int) -> Path:
    """Runs of arithmetic progressions mod VOCAB: learnable, deterministic."""
    rng = np.random.default_rng(5)
    out, position = [], 0
    while position < tokens:
        length, step, start = int(rng.integers(16, 64)), int(rng.integers(1, 5)), int(rng.integers(VOCAB))
        out.append((start + step * np.arange(length)) % VOCAB)
        position += length
    np.concatenate(out)[:tokens].astype(np.uint16).tofile(path)
    return path


@pytest.fixture(scope="session")
def hf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    corpus = root / "corpus"
    corpus.mkdir()
    return {
        "llama": save_llama(root / "llama"),
        "gpt2": save_gpt2(root / "gpt2"),
        # Training data of exactly BATCH windows (see reference_batch): 8 x 32 + 1 tokens; 6
        # documents of 44 words and their end-of-text token, 270 tokens.
        "tokens": write_token_stream(root / "train.bin", BATCH * SEQ + 1),
        "tokenizer": save_word_tokenizer(root / "tokenizer.json"),
        "jsonl": write_documents(corpus / "train.jsonl", 6, seed=1, words_each=44),
        "val_jsonl": write_documents(corpus / "val.jsonl", 40, seed=2),
    }


def run_args(files: dict[str, Path], name: str) -> list[str]:
    llama = ["model=hf", f"model.path={files['llama']}", "data=tokens", f"data.path={files['tokens']}"]
    gpt2 = [
        "model=hf",
        f"model.path={files['gpt2']}",
        "data=jsonl",
        f"data.path={files['jsonl']}",
        f"data.tokenizer={files['tokenizer']}",
        f"data.val_path={files['val_jsonl']}",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
    ]
    return {
        "llama_fsdp2": [*llama, "strategy=fsdp2", "devices=2"],
        "llama_tp2": [*llama, "strategy=fsdp2", "devices=2", "tp=2"],
        # Fresh weights, sharded by FSDP2 before they exist: must equal a one-process fresh init.
        "gpt2_fresh_fsdp2": [*gpt2, "model.pretrained=false", "strategy=fsdp2", "devices=2"],
        "gpt2_fsdp": [*gpt2, "strategy=fsdp", "devices=2"],
    }[name]


@pytest.fixture(scope="session")
def hf_run(hf_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("hf_runs")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            run_dir = root / name
            assert_ok(run_cli([*run_args(hf_files, name), *TRAIN], run_dir), run_dir)
            done[name] = run_dir
        return done[name]

    return get


# --------------------------------------------------------------------------- the reference


def train_in_process(model: Any, batch: torch.Tensor, steps: int = STEPS) -> list[float]:
    """The same optimisation as fsdp-train's defaults, written out: AdamW, constant lr, fp32,
    next-token cross-entropy, the global batch of each step in one piece (every step the same
    ``batch``: see :func:`reference_batch`)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def reference_batch(files: dict[str, Path], name: str) -> torch.Tensor:
    """Every training window of a run's data, read here without fsdp_cli's data code: the token
    file's stream (numpy), or each document's ids from the tokenizer itself followed by the
    end-of-text id; a window of SEQ + 1 tokens every SEQ tokens. The files hold exactly BATCH
    windows, so every step of the run trains on all of them, in an order of fsdp_cli's own that
    a mean loss does not see: the reference needs neither its sampler nor its shuffle."""
    if name.startswith("llama"):
        stream = np.fromfile(files["tokens"], dtype=np.uint16).tolist()
    else:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(files["tokenizer"]))
        eot = tokenizer.token_to_id("<|endoftext|>")
        texts = [json.loads(line)["text"] for line in files["jsonl"].read_text().splitlines()]
        stream = [i for text in texts for i in [*tokenizer.encode(text, add_special_tokens=False).ids, eot]]
    windows = [stream[k * SEQ : k * SEQ + SEQ + 1] for k in range((len(stream) - 1) // SEQ)]
    assert len(windows) == BATCH, len(windows)
    return torch.tensor(windows, dtype=torch.long)


def from_pretrained(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def losses_of(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def assert_close(reference: list[float], run_dir: Path) -> None:
    got = losses_of(run_dir)
    assert len(got) == len(reference) == STEPS
    assert max(abs(a - b) for a, b in zip(reference, got)) < 1e-5, (reference, got)


# --------------------------------------------------------------------------- real runs


distributed = pytest.mark.distributed


@distributed
@pytest.mark.parametrize("name", ["llama_fsdp2", "llama_tp2"])
def test_llama_losses_match_transformers_in_one_process(hf_files: dict, hf_run: Any, name: str) -> None:
    reference = train_in_process(from_pretrained(hf_files["llama"]), reference_batch(hf_files, name))
    assert_close(reference, hf_run(name))
    assert reference[-1] < reference[0]
    summary = json.loads((hf_run(name) / "summary.json").read_text())
    if name == "llama_tp2":
        assert summary["setup"]["tensor_parallel_modules"] > 0
    else:
        assert summary["setup"]["fsdp_units"] == ["hf.model.layers.0", "hf.model.layers.1", "<root>"]


@distributed
def test_no_rank_reads_or_holds_the_whole_model(hf_files: dict, hf_run: Any) -> None:
    from safetensors.torch import load_file

    total = sum(
        t.numel() * t.element_size() for t in load_file(str(hf_files["llama"] / "model.safetensors")).values()
    )
    weights = json.loads((hf_run("llama_fsdp2") / "summary.json").read_text())["setup"]["weights"]
    assert weights["pretrained"] and 0.45 * total <= weights["bytes_read"] <= 0.55 * total, (weights, total)
    assert weights["max_full_tensor_bytes"] <= 64 * 4, "nothing bigger than a norm weight was ever whole"
    # FSDP1 fills one unit at a time: whole tensors of one unit, never the model.
    fsdp1 = json.loads((hf_run("gpt2_fsdp") / "summary.json").read_text())["setup"]["weights"]
    assert fsdp1["max_full_tensor_bytes"] < total / 4


@distributed
def test_gpt2_without_a_tp_plan_under_fsdp_with_jsonl_and_validation(hf_files: dict, hf_run: Any) -> None:
    run_dir = hf_run("gpt2_fsdp")
    assert_close(
        train_in_process(from_pretrained(hf_files["gpt2"]), reference_batch(hf_files, "gpt2_fsdp")), run_dir
    )
    val = [r for r in read_metrics(run_dir) if "val_loss" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["step"] for r in val] == [2, 4] and summary["val_loss"] == val[-1]["val_loss"] > 0
    assert sorted(summary["setup"]["fsdp_units"]) == [
        "<root>",
        "model.hf.transformer.h.0",
        "model.hf.transformer.h.1",
    ]


@distributed
def test_fresh_weights_sharded_before_they_exist_equal_one_process_init(hf_files: dict, hf_run: Any) -> None:
    from fsdp_cli.models.hf import build_hf_model

    fresh = build_hf_model(HFModelConfig(path=str(hf_files["gpt2"]), pretrained=False), seed=SEED)
    fresh.materialize("cpu")
    reference = train_in_process(fresh.hf, reference_batch(hf_files, "gpt2_fresh_fsdp2"))
    assert_close(reference, hf_run("gpt2_fresh_fsdp2"))
    assert not json.loads((hf_run("gpt2_fresh_fsdp2") / "summary.json").read_text())["setup"]["weights"][
        "pretrained"
    ]


@distributed
def test_export_to_hf_reloads_the_trained_weights(hf_files: dict, hf_run: Any, tmp_path: Path) -> None:
    from fsdp_cli.checkpoint.convert import load
    from fsdp_cli.cli.ckpt import main as ckpt_main

    checkpoint = hf_run("llama_fsdp2") / "checkpoints" / f"step_{STEPS:08d}"
    out = tmp_path / "exported"
    ckpt_main(["convert", str(checkpoint), str(out), "--to", "hf"])
    trained = load(checkpoint, weights_only_model=True).state_dict
    reloaded = from_pretrained(out).state_dict()
    original = from_pretrained(hf_files["llama"]).state_dict()
    assert reloaded.keys() == {k.removeprefix("model.hf.") for k in trained}
    for key, value in reloaded.items():
        assert torch.equal(value, trained[f"model.hf.{key}"]), key
    assert not torch.equal(reloaded["model.norm.weight"], original["model.norm.weight"]), (
        "trained, not the start"
    )


@distributed
def test_export_refuses_a_checkpoint_of_another_model(hf_run: Any, tmp_path: Path, capsys: Any) -> None:
    from fsdp_cli.cli.ckpt import main as ckpt_main

    checkpoint = hf_run("llama_fsdp2") / "checkpoints" / f"step_{STEPS:08d}"
    with pytest.raises(SystemExit) as stop:
        ckpt_main(
            ["convert", str(checkpoint), str(tmp_path / "x"), "--to", "hf", "--hf-config", str(tmp_path)]
        )
    assert stop.value.code == 2 and "no config.json" in capsys.readouterr().err


# --------------------------------------------------------------------------- no processes


@pytest.mark.parametrize(("name", "block"), [("llama", "LlamaDecoderLayer"), ("gpt2", "GPT2Block")])
def test_built_on_meta_with_its_decoder_layer_as_the_unit(hf_files: dict, name: str, block: str) -> None:
    from fsdp_cli.models.hf import build_hf_model
    from fsdp_cli.parallel.wrap import repeated_block_class

    model = build_hf_model(HFModelConfig(path=str(hf_files[name])), seed=0)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert repeated_block_class(model).__name__ == block
    assert model.hf.dtype == torch.float32


@pytest.mark.parametrize("tied", [False, True])
def test_streamed_weights_equal_from_pretrained(hf_files: dict, tmp_path: Path, tied: bool) -> None:
    """Also from a sharded folder (index + 13 files) with tied embeddings, and GPT-2's."""
    from fsdp_cli.models.hf import build_hf_model

    folders = [hf_files["llama"], hf_files["gpt2"]]
    if tied:
        sharded = tmp_path / "tied"
        from_pretrained(save_gpt2(tmp_path / "g")).save_pretrained(sharded, max_shard_size="20KB")
        assert (sharded / "model.safetensors.index.json").is_file()
        folders = [sharded]
    for folder in folders:
        model = build_hf_model(HFModelConfig(path=str(folder)), seed=0)
        model.materialize("cpu")
        reference = from_pretrained(folder)
        ours, theirs = model.hf.state_dict(), reference.state_dict()
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
        assert all(
            torch.equal(a, b) for a, b in zip(model.hf.buffers(), reference.buffers())
        )  # RoPE recomputed
        ids = torch.randint(0, VOCAB, (2, 12))
        with torch.no_grad():
            assert torch.equal(model.eval()(ids), reference.eval()(input_ids=ids).logits)
        if folder != hf_files["llama"]:
            assert model.hf.lm_head.weight is model.hf.get_input_embeddings().weight


def test_fresh_init_follows_the_model_and_ignores_fill_order(hf_files: dict) -> None:
    """GPT-2's own init (scaled residual projections, tied head) seeded per module, so filling unit
    by unit in any order (as FSDP1 does) gives the weights a whole fill gives."""
    from fsdp_cli.models.hf import build_hf_model

    config = HFModelConfig(path=str(hf_files["gpt2"]), pretrained=False)
    whole = build_hf_model(config, seed=3)
    whole.materialize("cpu")
    std = whole.hf.config.initializer_range
    c_proj = torch.cat([b.attn.c_proj.weight.flatten() for b in whole.hf.transformer.h])
    assert abs(c_proj.std().item() - std / 2) < 1e-3 and torch.all(whole.hf.transformer.ln_f.weight == 1)
    assert whole.hf.lm_head.weight is whole.hf.transformer.wte.weight
    by_unit = build_hf_model(config, seed=3)
    blocks = list(reversed(by_unit.hf.transformer.h))
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    units = [list(block.modules()) for block in blocks]
    units.append([m for m in by_unit.hf.modules() if id(m) not in in_blocks])  # the root unit, last
    for members in units:
        for m in members:
            m.to_empty(device="cpu", recurse=False)
        by_unit.init_weights(modules=members)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), by_unit.state_dict().values()))
    other = build_hf_model(config, seed=4)
    other.materialize("cpu")
    assert not torch.equal(other.hf.lm_head.weight, whole.hf.lm_head.weight)


def test_tensor_parallel_plan_is_transformers_own_or_one_line_refusal(hf_files: dict) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from fsdp_cli.models.hf import build_hf_model, require_tp_plan
    from fsdp_cli.parallel.tensor_parallel import ReplicateParallel

    llama = build_hf_model(HFModelConfig(path=str(hf_files["llama"])), seed=0)
    plan = llama.tp_plan(sequence_parallel=False)
    assert type(plan["hf.model.layers.1.self_attn.q_proj"]) is ColwiseParallel
    assert type(plan["hf.model.layers.0.mlp.down_proj"]) is RowwiseParallel
    assert type(plan["hf.model.layers.0.input_layernorm"]) is ReplicateParallel  # one mesh for FSDP
    assert type(plan["hf.model.norm"]) is ReplicateParallel and "hf.lm_head" in plan
    gpt2 = build_hf_model(HFModelConfig(path=str(hf_files["gpt2"])), seed=0)
    with pytest.raises(
        ConfigError, match=r"^tp=2: GPT2LMHeadModel has no tensor-parallel plan.*allowed: tp=1"
    ):
        require_tp_plan(gpt2.hf, 2)


FOLDER_ERRORS = [
    (["model=hf"], "model.path=null: model=hf needs the model's folder"),
    (["model=hf", "model.path={empty}"], "no config.json there"),
    (["model=hf", "model.path={config_only}"], "no model.safetensors or model.safetensors.index.json"),
    (
        ["model=hf", "model.path={gpt2_3heads}", "model.pretrained=false", "tp=2", "devices=2"],
        "num_attention_heads=3 (config.json) is not divisible by tp=2",
    ),
    (
        ["model=hf", "model.path={llama}", "data.seq_len=128"],
        "data.seq_len=128: exceeds the model's 64 positions",
    ),
    (
        ["model=hf", "model.path={llama}", "data=text"],
        "data.vocab_size=256: exceeds the model's vocabulary of 128",
    ),
    (
        ["model=hf", "model.path={llama}", "tp=2", "devices=2", "strategy.sequence_parallel=true"],
        "strategy.sequence_parallel=True: model=hf",
    ),
]


@pytest.mark.parametrize(("args", "words"), FOLDER_ERRORS, ids=[c[1][:40] for c in FOLDER_ERRORS])
def test_model_folder_mistakes_are_found_before_any_rank(
    hf_files: dict, tmp_path: Path, args: list[str], words: str
) -> None:
    """The parent's checks (the CLI prints them as one line: next test)."""
    from fsdp_cli.config.model_folder import resolve_model_folder
    from fsdp_cli.config.validate import checked_run, validate
    from fsdp_cli.launch.layout import resolve_layout

    (tmp_path / "empty").mkdir()
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text((hf_files["gpt2"] / "config.json").read_text())
    places = {
        "empty": tmp_path / "empty",
        "config_only": tmp_path / "config_only",
        "llama": hf_files["llama"],
        "gpt2_3heads": _three_heads(hf_files, tmp_path),
    }
    cfg = composed(*(a.format(**places) for a in args))
    with pytest.raises(ConfigError) as err:
        validate(checked_run(resolve_model_folder(resolve_layout(cfg, {"CUDA_VISIBLE_DEVICES": ""}))))
    assert words in err.value.one_line()


def test_a_missing_model_folder_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = cli_in_process(
        ["model=hf", "model.path=/no/such/folder"], tmp_path / "run", env={"CUDA_VISIBLE_DEVICES": ""}
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("fsdp-train: error: model.path=/no/such/folder: no such folder; hint: ")
    assert not (tmp_path / "run" / "config.yaml").exists(), "no rank started"


def _three_heads(files: dict, tmp_path: Path) -> Path:
    folder = tmp_path / "three_heads"
    folder.mkdir(exist_ok=True)
    config = json.loads((files["gpt2"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_head": 3}))
    return folder


def test_without_transformers_model_hf_names_the_extra(
    hf_files: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from fsdp_cli.config.model_kinds import check_hf_model

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a)
    )
    cfg = replace(composed("model=hf", f"model.path={hf_files['llama']}"), dp=2)
    with pytest.raises(
        ConfigError,
        match=r'^model=hf: needs the transformers package; hint: pip install "transformers<6,>=5.23" "tokenizers>=0.22" \(or pip install "\.\[hf\]" in a checkout of fsdp_cli\)$',
    ):
        check_hf_model(run_of(cfg))


def test_vocabulary_comes_from_config_json(hf_files: dict) -> None:
    from fsdp_cli.config.model_folder import resolve_model_folder

    cfg = composed("model=hf", f"model.path={hf_files['gpt2']}", "data=tokens")
    assert cfg.data.vocab_size is None
    assert resolve_model_folder(cfg).data.vocab_size == VOCAB
    assert resolve_model_folder(replace(cfg, data=replace(cfg.data, vocab_size=500))).data.vocab_size == 500
