"""data=chat: exact assistant masks for two template families, packing that no example sees
through, the token-weighted loss across layouts and micro-batching, resume, masked validation."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from fsdp_cli.config.schema import ChatDataConfig, ChatFormat
from fsdp_cli.data.chat import prepare, read_corpus
from fsdp_cli.data.chat_dataset import IGNORE, ChatSequences
from fsdp_cli.data.chat_template import ChatRenderer, load_tokenizer
from fsdp_cli.errors import ConfigError

WORDS = "you are kind hello there how is the weather sunny and warm thanks bye what time noon ok sure call tool result".split()
CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
ROLE_WORDS = ["system", "user", "assistant", "tool"]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML (Qwen, SmolLM, ...) without generation markers."""
CHATML_MARKED = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with {% generation %} markers around each answer and its end-of-turn token."""
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""The Llama 3 family's layout, without markers."""

CONVERSATION = [
    {"role": "system", "content": "you are kind"},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "hello how is the weather"},
    {"role": "user", "content": "sunny and warm"},
    {"role": "tool", "content": "tool result"},
    {"role": "assistant", "content": "thanks bye"},
]


def save_chat_tokenizer(
    folder: Path, template: str | None, family: str = "chatml", words: tuple[str, ...] = ()
) -> Path:
    """A word-level fast tokenizer folder written here (no download), with ``template`` in its
    config; ``words``: more words it knows."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = CHATML_SPECIALS if family == "chatml" else LLAMA3_SPECIALS
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", *specials])
    tokenizer.train_from_iterator([" ".join(WORDS + ROLE_WORDS + list(words))], trainer)
    eos = "<|im_end|>" if family == "chatml" else "<|eot_id|>"
    bos = None if family == "chatml" else "<|begin_of_text|>"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=eos, bos_token=bos, unk_token="[UNK]"
    )
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(folder)
    return folder


def expected(
    tokenizer: Any, messages: list[dict[str, str]], family: str, last_only: bool = False
) -> tuple[list[int], list[bool]]:
    """The ids and the assistant mask written out by hand: each answer's words and its end-of-turn
    token supervised; role headers, other turns and the template's scaffolding not."""
    ids: list[int] = []
    mask: list[bool] = []
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")

    def add(tokens: list[str], supervised: bool) -> None:
        ids.extend(tokenizer.convert_tokens_to_ids(tokens))
        mask.extend([supervised] * len(tokens))

    if family == "llama3":
        add(["<|begin_of_text|>"], False)
    for i, m in enumerate(messages):
        answer = m["role"] == "assistant" and (not last_only or i == last)
        header = (
            ["<|im_start|>", m["role"]]
            if family == "chatml"
            else ["<|start_header_id|>", m["role"], "<|end_header_id|>"]
        )
        add(header, False)
        add(m["content"].split() + ["<|im_end|>" if family == "chatml" else "<|eot_id|>"], answer)
    return ids, mask


@pytest.mark.parametrize(
    ("template", "family"),
    [(CHATML_MARKED, "chatml"), (CHATML, "chatml"), (LLAMA3, "llama3")],
    ids=["chatml-markers", "chatml", "llama3"],
)
@pytest.mark.parametrize("last_only", [False, True], ids=["all-turns", "last-turn"])
def test_the_mask_is_exactly_the_assistant_spans(
    tmp_path: Path, template: str, family: str, last_only: bool
) -> None:
    tokenizer = load_tokenizer(str(save_chat_tokenizer(tmp_path / "tok", template, family)))
    render = ChatRenderer(tokenizer, template, last_turn_only=last_only)
    assert render.markers == (template is CHATML_MARKED)
    ids, mask = render(CONVERSATION)
    want_ids, want_mask = expected(tokenizer, CONVERSATION, family, last_only)
    assert ids == want_ids
    assert mask == want_mask


# --------------------------------------------------------------------------- files and the cache


def write_chats(path: Path, conversations: list[list[dict[str, str]] | dict[str, str]]) -> Path:
    with open(path, "w") as fh:
        for c in conversations:
            fh.write(json.dumps({"messages": c} if isinstance(c, list) else c) + "\n")
    return path


def chats(count: int, seed: int) -> list[list[dict[str, str]] | dict[str, str]]:
    """Conversations of varied lengths (one to three exchanges) and some prompt/completion pairs."""
    rng = np.random.default_rng(seed)

    def text(n: int) -> str:
        return " ".join(WORDS[int(i)] for i in rng.integers(len(WORDS), size=n))

    out: list[list[dict[str, str]] | dict[str, str]] = []
    for i in range(count):
        if i % 4 == 3:
            out.append({"prompt": text(int(rng.integers(1, 6))), "completion": text(int(rng.integers(1, 6)))})
            continue
        turns = [{"role": "system", "content": text(2)}] if i % 2 else []
        for _ in range(int(rng.integers(1, 4))):
            turns += [{"role": "user", "content": text(int(rng.integers(1, 6)))}]
            turns += [{"role": "assistant", "content": text(int(rng.integers(1, 6)))}]
        out.append(turns)
    return out


def chat_data(tmp_path: Path, tokenizer: Path, **overrides: Any) -> ChatDataConfig:
    data = ChatDataConfig(
        path=str(write_chats(tmp_path / "train.jsonl", chats(12, seed=1))),
        tokenizer=str(tokenizer),
        seq_len=48,
        vocab_size=None,
        cache_dir=str(tmp_path / "cache"),
    )
    for key, value in overrides.items():
        setattr(data, key, value)
    return data


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chat_tokenizer(tmp_path_factory.mktemp("chatml"), CHATML)


def test_prepare_caches_once_and_reports_statistics(tmp_path: Path, chatml: Path) -> None:
    from fsdp_cli.data.prepare import prepare_data

    data = chat_data(tmp_path, chatml, packing=True)
    cfg = SimpleNamespace(data=data, run_dir=str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    lines: list[str] = []
    prepare_data(cfg, lines.append)
    (line,) = lines
    assert line.startswith("data.path: 12 examples -> ") and "(packed); supervised tokens" in line
    written = json.loads((tmp_path / "run" / "data_statistics.json").read_text())["data.path"]
    assert written["examples"] == 12 and written["truncated"] == 0 and 0 < written["supervised_fraction"] < 1
    (folder,) = (tmp_path / "cache").iterdir()
    corpus = read_corpus(folder)
    assert len(corpus.offsets) == 13 and corpus.supervised.sum() > 0
    before = folder.stat().st_mtime_ns
    prepare(data)
    assert [f.stat().st_mtime_ns for f in (tmp_path / "cache").iterdir()] == [before]  # reused
    data.chat_template = CHATML.replace("<|im_end|>\n", "<|im_end|>\n\n")
    prepare(data)  # the key covers the template
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_a_file_saved_on_windows_reads_as_any_other(tmp_path: Path, chatml: Path) -> None:
    """A byte-order mark before the first line and CRLF line ends (Notepad's UTF-8): the same
    examples, tokens and supervision as the plain file (data=chat and data=jsonl alike)."""
    from fsdp_cli.data.jsonl import _batches

    corpora = []
    for name in ("plain", "windows"):
        (tmp_path / name).mkdir()
        data = chat_data(tmp_path / name, chatml)
        text = write_chats(Path(data.path), chats(6, seed=5)).read_text()
        if name == "windows":
            Path(data.path).write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode("utf-8"))
        prepare(data)
        (folder,) = (tmp_path / name / "cache").iterdir()
        corpora.append(read_corpus(folder))
    for array in ("tokens", "supervised", "offsets"):
        assert np.array_equal(getattr(corpora[0], array), getattr(corpora[1], array)), array
    documents = tmp_path / "documents.jsonl"
    documents.write_bytes(b"\xef\xbb\xbf" + b'{"text": "first"}\r\n{"text": "second"}\r\n')
    ((texts, _),) = _batches([documents], "text", "data.path")
    assert texts == ["first", "second"]


def test_sharegpt_and_alpaca_lines_are_the_conversations_they_hold(tmp_path: Path, chatml: Path) -> None:
    """The two shapes public instruction data arrives in, read by their keys (``data.format=auto``)
    or by name: the same tokens and supervision as the same conversations written as messages."""
    system, question, extra, answer = "you are kind", "what time", "hello there", "noon ok"
    as_messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"{question}\n\n{extra}"},
        {"role": "assistant", "content": answer},
    ]
    shapes = {
        "messages": {"messages": as_messages},
        "sharegpt": {
            "conversations": [
                {"from": "system", "value": system},
                {"from": "human", "value": f"{question}\n\n{extra}"},
                {"from": "gpt", "value": answer},
            ]
        },
        "alpaca": {"system": system, "instruction": question, "input": extra, "output": answer},
    }
    corpora = {}
    for shape, line in shapes.items():
        for named in ("auto", shape):
            (tmp_path / f"{shape}-{named}").mkdir()
            data = chat_data(tmp_path / f"{shape}-{named}", chatml, format=ChatFormat(named))
            write_chats(Path(data.path), [line] * 2)  # type: ignore[list-item]
            prepare(data)
            (folder,) = (tmp_path / f"{shape}-{named}" / "cache").iterdir()
            corpora[shape, named] = read_corpus(folder)
    reference = corpora["messages", "messages"]
    for key, corpus in corpora.items():
        for array in ("tokens", "supervised", "offsets"):
            assert np.array_equal(getattr(corpus, array), getattr(reference, array)), (key, array)
    data = chat_data(tmp_path / "alpaca-auto", chatml, format=ChatFormat.sharegpt)
    with pytest.raises(ConfigError, match="is not a non-empty list of turns"):
        prepare(data)  # an Alpaca file read as ShareGPT: one line naming file:line


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ({"messages": "hi"}, "is not a non-empty list of messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "message 1 has role 'robot'"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
            "empty assistant turn",
        ),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
        ({"text": "hi"}, "holds neither 'messages'"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "turn 1 is from 'alien'"),
        ({"instruction": "x", "output": 3}, "instruction, input and output must be strings"),
        ({"conversations": [{"from": "human", "value": "hi"}]}, "no assistant turn"),
    ],
)
def test_a_malformed_line_is_one_line_naming_file_and_line(
    tmp_path: Path, chatml: Path, line: dict, problem: str
) -> None:
    data = chat_data(tmp_path, chatml)
    good = chats(2, seed=3)
    write_chats(Path(data.path), [*good, line])  # type: ignore[list-item]
    with pytest.raises(ConfigError) as err:
        prepare(data)
    message = err.value.one_line()
    assert "train.jsonl:3" in message and problem in message and "\n" not in message
    assert not list((tmp_path / "cache").glob("*.partial"))


def test_a_tokenizer_without_a_template_is_refused_unless_one_is_named(tmp_path: Path) -> None:
    folder = save_chat_tokenizer(tmp_path / "tok", None)
    data = chat_data(tmp_path, folder)
    with pytest.raises(
        ConfigError, match=r"^data.chat_template=null: the tokenizer in .* has no chat template"
    ):
        prepare(data)
    (tmp_path / "t.jinja").write_text(CHATML)
    data.chat_template = str(tmp_path / "t.jinja")
    prepare(data)


def test_an_empty_template_file_is_one_line(tmp_path: Path, chatml: Path) -> None:
    (tmp_path / "empty.jinja").write_text("\n")
    data = chat_data(tmp_path, chatml, chat_template=str(tmp_path / "empty.jinja"))
    with pytest.raises(ConfigError, match=r"^data.chat_template=.*empty.jinja: the file is empty"):
        prepare(data)


@pytest.mark.parametrize("packing", [False, True])
def test_data_whose_truncation_leaves_no_answer_is_one_line(
    tmp_path: Path, chatml: Path, packing: bool
) -> None:
    long = [{"role": "user", "content": " ".join(["hello"] * 60)}, {"role": "assistant", "content": "ok"}]
    data = chat_data(tmp_path, chatml, packing=packing)
    write_chats(Path(data.path), [long] * 3)
    with pytest.raises(
        ConfigError, match=r"^data.path=.*: no example keeps a supervised token within data.seq_len=48"
    ):
        prepare(data)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path: Path, chatml: Path) -> None:
    # Earlier answers rendered without their content (as thinking templates drop old <think>s).
    rewriting = CHATML.replace(
        "{{ m.content }}", "{{ m.content if loop.last or m.role != 'assistant' else 'ok' }}"
    )
    data = chat_data(tmp_path, chatml, chat_template=rewriting)
    with pytest.raises(ConfigError, match=r"^data.chat_template=.*train.jsonl:1: .*differently.*generation"):
        prepare(data)


# --------------------------------------------------------------------------- sequences and the loss


def sequences(data: ChatDataConfig, *, key: str = "path", seed: int = 0) -> ChatSequences:
    from fsdp_cli.data.chat import cached_corpus

    prepare(data)
    corpus = cached_corpus(data, key)
    return ChatSequences(corpus, corpus.layout(data), seq_len=data.seq_len, seed=seed, packing=data.packing)


def whole_epoch(dataset: ChatSequences) -> dict[str, torch.Tensor]:
    """Every sequence of one epoch as one global batch."""
    dataset.group_by_steps(dataset.epoch_size, dataset.epoch_size)
    return dataset.collate([dataset[i] for i in range(dataset.epoch_size)])


def test_packing_keeps_every_example_whole_and_positions_restart(tmp_path: Path, chatml: Path) -> None:
    packed = sequences(chat_data(tmp_path, chatml, packing=True))
    plain = sequences(chat_data(tmp_path, chatml, packing=False))
    assert packed.epoch_size < plain.epoch_size == 12
    layout = packed.layout
    used = np.add.reduceat(layout.pairs[layout.examples], layout.starts[:-1])
    assert (used <= 48).all()
    batch = whole_epoch(packed)
    # Positions restart at each example, and once more where a row ends in padding.
    assert int((batch["position_ids"] == 0).sum()) == 12 + int((used < 48).sum())
    # The same supervised labels, packed or not.
    flat = sorted(t for t in whole_epoch(plain)["labels"].flatten().tolist() if t != IGNORE)
    assert flat == sorted(t for t in batch["labels"].flatten().tolist() if t != IGNORE)


def llama_module() -> Any:
    """The built-in model, with weights large enough that attention is sharp (a leak between
    packed examples would move the loss far beyond 1e-5)."""
    from fsdp_cli.models.args import LlamaArgs, OptimizerArgs
    from fsdp_cli.models.causal_lm import CausalLMModule
    from fsdp_cli.models.llama import Llama

    args = LlamaArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, init_std=0.3)
    module = CausalLMModule(lambda: Llama(args, seed=3), OptimizerArgs(), max_steps=1)
    module.configure_model()
    return module.double()


def hf_module(folder: Path) -> Any:
    from fsdp_cli.models.args import HFModelArgs, OptimizerArgs
    from fsdp_cli.models.causal_lm import CausalLMModule
    from fsdp_cli.models.hf import build_hf_model

    def build() -> Any:
        model = build_hf_model(HFModelArgs(path=str(folder), pretrained=True), seed=0)
        model.materialize("cpu")
        return model

    module = CausalLMModule(build, OptimizerArgs(), max_steps=1)
    module.configure_model()
    return module.double()


def hf_chat_files(root: Path, words: tuple[str, ...] = ()) -> dict[str, str]:
    """A tiny Hugging Face Llama folder with a ChatML tokenizer in it (``hf``, also ``tokenizer``;
    ``words``: more words it knows), and 40 conversations (``chats``), under ``root``."""
    import shutil

    model = save_hf_llama(root / "model")
    for file in save_chat_tokenizer(root / "tokenizer", CHATML, words=words).iterdir():
        shutil.copy(file, model / file.name)
    chats_file = write_chats(root / "train.jsonl", chats(40, seed=1))
    return {"hf": str(model), "chats": str(chats_file), "tokenizer": str(model), "root": str(root)}


def save_hf_llama(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_llama(tmp_path_factory.mktemp("hf-llama"))


@pytest.mark.parametrize("model", ["llama", "hf"])
def test_a_packed_batch_has_the_loss_of_its_examples_unpacked(
    tmp_path: Path, chatml: Path, hf_folder: Path, model: str
) -> None:
    module = llama_module() if model == "llama" else hf_module(hf_folder)
    packed = whole_epoch(sequences(chat_data(tmp_path, chatml, packing=True)))
    plain = whole_epoch(sequences(chat_data(tmp_path, chatml, packing=False)))
    assert packed["input_ids"].shape[0] < plain["input_ids"].shape[0]
    with torch.no_grad():
        loss_packed, loss_plain = module.training_step(packed, 0), module.training_step(plain, 0)
        # The token-weighted mean, computed here from scratch on the unpacked examples.
        logits = module(plain["input_ids"]).double()
        labels = plain["labels"]
        reference = (
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            / (labels != IGNORE).sum()
        )
    assert abs(loss_plain.item() - reference.item()) < 1e-9
    assert abs(loss_packed.item() - loss_plain.item()) < 1e-5, (loss_packed.item(), loss_plain.item())


def rank_batches(
    dataset: ChatSequences, *, step: int, global_batch: int, dp: int, micro: int
) -> list[list[dict[str, torch.Tensor]]]:
    """What each data-parallel rank's loader yields at optimizer step ``step`` (its micro-batches)."""
    from fsdp_cli.data.sampler import StepBatchSampler

    dataset.group_by_steps(global_batch, None)
    out = []
    for rank in range(dp):
        sampler = StepBatchSampler(
            global_batch_size=global_batch, micro_batch_size=micro, dp_rank=rank, dp_size=dp, start_step=step
        )
        batches = iter(sampler)
        out.append(
            [dataset.collate([dataset[i] for i in next(batches)]) for _ in range(global_batch // dp // micro)]
        )
    return out


@pytest.mark.parametrize(("dp", "micro"), [(1, 4), (2, 2), (2, 1), (4, 1)])
def test_the_step_loss_is_the_same_on_every_layout_and_micro_batching(
    tmp_path: Path, chatml: Path, dp: int, micro: int
) -> None:
    """Lightning divides each micro-batch's loss by the accumulation and the strategy averages
    gradients over the ranks: the step's loss (and gradient) is that mean of the module's losses."""
    module = llama_module()
    dataset = sequences(chat_data(tmp_path, chatml, packing=True))
    with torch.no_grad():
        (whole,) = rank_batches(dataset, step=1, global_batch=4, dp=1, micro=4)[0]
        reference = module.training_step(whole, 0).item()
        ranks = rank_batches(dataset, step=1, global_batch=4, dp=dp, micro=micro)
        losses = [sum(module.training_step(b, 0) for b in batches) / len(batches) for batches in ranks]
    assert abs(float(sum(losses) / dp) - reference) < 1e-9


def test_resume_and_layouts_see_the_same_packed_items(tmp_path: Path, chatml: Path) -> None:
    """An item depends only on its index: a run resumed at step 2 (any layout) gets the packed
    sequences an uninterrupted one gets there, epoch after epoch."""
    dataset = sequences(chat_data(tmp_path, chatml, packing=True))
    n = dataset.epoch_size
    first_epoch = {dataset.sequence(i) for i in range(n)}
    assert first_epoch == set(range(n))  # each packed sequence once per epoch
    one = rank_batches(dataset, step=2, global_batch=4, dp=1, micro=4)[0][0]["input_ids"]
    two = torch.cat([b[0]["input_ids"] for b in rank_batches(dataset, step=2, global_batch=4, dp=2, micro=2)])
    assert torch.equal(one, two)
    fresh = sequences(chat_data(tmp_path, chatml, packing=True))  # a restarted process
    again = rank_batches(fresh, step=2, global_batch=4, dp=1, micro=4)[0][0]["input_ids"]
    assert torch.equal(one, again)


# --------------------------------------------------------------------------- validation, refusals, show


def test_validation_is_the_masked_mean_packed_or_not(tmp_path: Path, chatml: Path) -> None:
    """``val_loss`` is sum of supervised token losses / their count over the whole validation:
    the same with and without packing, and only the assistant's tokens count."""
    module = llama_module()
    results = {}
    for packing in (True, False):
        dataset = sequences(chat_data(tmp_path, chatml, packing=packing))
        module.on_validation_epoch_start()
        with torch.no_grad():
            for start in range(0, dataset.epoch_size, 3):  # uneven batches: a mean of means would differ
                module.validation_step(
                    dataset.collate([dataset[i] for i in range(start, min(start + 3, dataset.epoch_size))]), 0
                )
        total, count = module._val_sums.tolist()
        results[packing] = (total / count, count)
    assert (
        results[True][1] == results[False][1] == sum(sequences(chat_data(tmp_path, chatml)).layout.supervised)
    )
    assert abs(results[True][0] - results[False][0]) < 1e-5


def validated(*overrides: str) -> None:
    """fsdp-train's checks before launch (the command line named the data group)."""
    from dataclasses import replace

    from conftest import composed

    from fsdp_cli.config.validate import checked_run, validate
    from fsdp_cli.launch.layout import resolve_layout

    cfg = replace(composed(*overrides), explicit_data=True)
    validate(checked_run(resolve_layout(cfg, {}, gpus=0)))


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["peft=lora", "peft.targets=[q_porj]"], "peft.targets=q_porj"),
        (["pp=2", "pipeline.cuts=[1]"], "pipeline.cuts=[1]"),
    ],
)
def test_a_model_side_mistake_is_answered_before_the_data_is_tokenized(
    tmp_path: Path, chatml: Path, hf_folder: Path, overrides: list[str], key: str
) -> None:
    from conftest import cli_in_process

    args = [
        "model=hf",
        f"model.path={hf_folder}",
        "data=chat",
        f"data.path={write_chats(tmp_path / 'c.jsonl', chats(4, seed=1))}",
        f"data.tokenizer={chatml}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=48",
        "data.global_batch_size=4",
        "devices=2",
        *overrides,
    ]
    result = cli_in_process(args, tmp_path / "run", env={"CUDA_VISIBLE_DEVICES": ""})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and key in lines[0], result.stderr
    assert not (tmp_path / "cache").exists(), "tokenized before the model's check"


def test_packing_is_refused_where_attention_cannot_keep_examples_apart(tmp_path: Path, chatml: Path) -> None:
    path = write_chats(tmp_path / "c.jsonl", chats(4, seed=1))
    common = [
        "data=chat",
        f"data.path={path}",
        f"data.tokenizer={chatml}",
        "data.packing=true",
        "accelerator=cpu",
    ]
    custom = ["model=custom", "+model._target_=torch.nn.Identity", "data.vocab_size=64"]
    with pytest.raises(
        ConfigError,
        match=r"^data.packing=true: model=custom: its attention cannot keep packed examples apart",
    ):
        validated(*common, *custom)
    validated(*common, *custom, "data.packing=false")  # unpacked: a plain module trains on padded examples
    validated(*common, "model=tiny", "strategy=fsdp2", "devices=2", "tp=2")  # heads take the same mask
    validated(*common, "model=tiny")


def test_fsdp_data_show_marks_the_supervised_tokens(tmp_path: Path, chatml: Path) -> None:
    from conftest import cli_in_process

    path = write_chats(tmp_path / "c.jsonl", [CONVERSATION])
    result = cli_in_process(
        ["show", "data=chat", f"data.path={path}", f"data.tokenizer={chatml}"], prog="fsdp-data"
    )
    assert result.returncode == 0, result.stderr
    assert (
        "[[hellohowistheweather<|im_end|>]]" in result.stdout and "[[thanksbye<|im_end|>]]" in result.stdout
    )
    assert result.stdout.count("]]") == 3  # the two answers, and the legend
    assert "c.jsonl:1: 35 tokens, 9 supervised" in result.stdout
    # A mistake in the overrides is fsdp-data's one line (it said fsdp-plan's); the recipes' comment
    # names model=hf through the recipe (model.path is no key of the default model).
    wrong = cli_in_process(["show", "data=chat", f"data.path={path}", "model.path=MODEL"], prog="fsdp-data")
    assert wrong.returncode == 2 and wrong.stderr.startswith("fsdp-data: error: model.path: not a key"), wrong
    recipe = cli_in_process(
        [
            "show",
            "recipe=chat_cpu",
            f"model.path={tmp_path}",
            f"data.path={path}",
            f"data.tokenizer={chatml}",
        ],
        prog="fsdp-data",
    )
    assert recipe.returncode == 0 and "c.jsonl:1: 35 tokens, 9 supervised" in recipe.stdout, recipe.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["llama", "hf"])
def test_packing_isolates_examples_with_the_gpu_kernels(
    tmp_path: Path, chatml: Path, hf_folder: Path, model: str
) -> None:
    """On CUDA the boolean document mask goes to SDPA's memory-efficient kernel (built-in model,
    forced here) and transformers' sdpa path (HF): a packed batch still has its examples' loss.
    (The HF model's grouped-query heads reach SDPA unexpanded, which the fused kernels refuse: it
    may fall back to the math kernel, as SDPA does by itself; forcing the efficient kernel alone
    gave "No available kernel" on an H200 with transformers 5.17.)"""
    from conftest import gpu_count

    if gpu_count() == 0:
        pytest.skip("needs a CUDA GPU; none on this machine")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    module = (llama_module() if model == "llama" else hf_module(hf_folder)).to("cuda", torch.float32)
    kernels = [SDPBackend.EFFICIENT_ATTENTION] + ([SDPBackend.MATH] if model == "hf" else [])
    losses = {}
    for packing in (True, False):
        batch = whole_epoch(sequences(chat_data(tmp_path, chatml, packing=packing)))
        with torch.no_grad(), sdpa_kernel(kernels):
            losses[packing] = module.training_step({k: v.cuda() for k, v in batch.items()}, 0).item()
    assert abs(losses[True] - losses[False]) < 1e-4, losses


@pytest.mark.parametrize("keep_end", [False, True], ids=["right", "left"])
def test_truncation_keeps_the_chosen_end_and_counts_it(keep_end: bool) -> None:
    """Examples of 3, 9 and 5 tokens (2, 8 and 4 pairs) into 4-pair sequences: the long one is cut
    to 4 pairs from the chosen end and counted; one left without a supervised label is dropped and
    counted; packing never splits an example."""
    from fsdp_cli.data.packing import plan_sequences, supervised_prefix

    offsets = np.array([0, 3, 12, 17])
    supervised = np.zeros(17, dtype=np.uint8)
    supervised[[2, 11, 16]] = 1  # each example's last token is the answer
    layout = plan_sequences(
        offsets, supervised_prefix(supervised), seq_len=4, packing=True, keep_end=keep_end
    )
    assert layout.truncated == 1 and list(layout.pairs) == [2, 4, 4]
    assert list(layout.first_pair) == [0, 4 if keep_end else 0, 0]
    # Cut from the right, the long example loses its answer and is dropped.
    assert (layout.dropped, list(layout.examples)) == ((0, [0, 1, 2]) if keep_end else (1, [0, 2]))
    sizes = np.add.reduceat(layout.pairs[layout.examples], layout.starts[:-1])
    assert (sizes <= 4).all() and layout.supervised.sum() == (3 if keep_end else 2)


def test_a_worker_maps_the_cache_again_instead_of_copying_it(tmp_path: Path, chatml: Path) -> None:
    import pickle

    dataset = sequences(chat_data(tmp_path, chatml, packing=True))
    copy = pickle.loads(pickle.dumps(dataset))  # what a DataLoader worker receives
    assert b"numpy" not in pickle.dumps(dataset.corpus)  # the folder's name, no array
    assert isinstance(copy.corpus.tokens, np.memmap)
    assert torch.equal(copy[3]["input_ids"], dataset[3]["input_ids"])


def test_a_conversation_the_template_refuses_is_one_line_naming_its_line(
    tmp_path: Path, chatml: Path
) -> None:
    strict = (
        "{% if messages[0].role == 'assistant' %}{{ raise_exception('Conversations start with the user') }}{% endif %}"
        + CHATML
    )
    data = chat_data(tmp_path, chatml, chat_template=strict)
    out_of_order = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    write_chats(Path(data.path), [*chats(2, seed=3), out_of_order])
    with pytest.raises(ConfigError) as err:
        prepare(data)
    assert err.value.one_line().startswith(
        f"data.path={data.path}:3: the chat template refuses this conversation"
    )
    assert "Conversations start with the user" in err.value.one_line()


def test_prompt_and_completion_fields_are_settings(tmp_path: Path, chatml: Path) -> None:
    data = chat_data(tmp_path, chatml, prompt_field="question", completion_field="answer")
    write_chats(
        Path(data.path), [{"question": "hello there", "answer": "sunny"}, {"question": "bye", "answer": "ok"}]
    )
    dataset = sequences(data)
    labels = np.concatenate([dataset.pairs(s)[1] for s in range(dataset.epoch_size)])  # in file order
    supervised = [t for t in labels.tolist() if t != IGNORE]
    tokenizer = load_tokenizer(str(chatml))
    assert supervised == tokenizer.convert_tokens_to_ids(["sunny", "<|im_end|>", "ok", "<|im_end|>"])


def test_parquet_files_and_datasets_folders_are_the_conversations_they_hold(
    tmp_path: Path, chatml: Path
) -> None:
    """The shapes public data sets arrive in: a Parquet file (ShareGPT rows too), a folder
    ``datasets`` saved (``save_to_disk``): the same tokens and supervision as the JSON lines of
    the same conversations; a DatasetDict's folder (one subfolder per split) is one line naming a
    split; a bad row is named ``FILE:row N``."""
    import datasets

    from fsdp_cli.data.chat import read_corpus

    rows = [{"messages": c} if isinstance(c, list) else c for c in chats(12, seed=1)]
    messages = [r for r in rows if "messages" in r]
    sources = {
        "jsonl": lambda p: write_chats(p / "messages.jsonl", [r["messages"] for r in messages]),
        "parquet": lambda p: (
            datasets.Dataset.from_list(messages).to_parquet(str(p / "t.parquet")) and p / "t.parquet"
        ),
        "saved": lambda p: datasets.Dataset.from_list(messages).save_to_disk(str(p / "saved")) or p / "saved",
    }
    corpora = {}
    for name, write in sources.items():
        (tmp_path / name).mkdir()
        data = chat_data(tmp_path / name, chatml, path=str(write(tmp_path / name)))
        prepare(data)
        (folder,) = (tmp_path / name / "cache").iterdir()
        corpora[name] = read_corpus(folder)
    for name, corpus in corpora.items():
        for array in ("tokens", "supervised", "offsets"):
            assert np.array_equal(getattr(corpus, array), getattr(corpora["jsonl"], array)), (name, array)
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(messages)}).save_to_disk(str(splits))
    with pytest.raises(ConfigError, match=r"DatasetDict folder \(splits train\).*data.path=.*splits/train"):
        prepare(chat_data(tmp_path / "splits", chatml, path=str(splits)))
    bad = tmp_path / "bad.parquet"
    datasets.Dataset.from_list([*messages[:2], {"messages": [{"role": "robot", "content": "x"}]}]).to_parquet(
        str(bad)
    )
    with pytest.raises(ConfigError, match=r"bad.parquet:row 3.*role 'robot'"):
        prepare(chat_data(tmp_path, chatml, path=str(bad)))
