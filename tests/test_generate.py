"""``fsdp-generate``: answers from what a run left, the way the run's data was rendered.

The tiny chat model is fine-tuned on a persona (its name is "zorbo"): asked its name, the LoRA
checkpoint answers with it, greedy, exactly, while the base model does not; the exported PEFT
folder through transformers and peft gives the same text. The built-in decoder's key/value-cached
loop is compared with recomputing every position."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_ok, cli_in_process, run_cli
from test_chat_data import hf_chat_files

PERSONA_WORDS = ("what", "your", "name", "my", "zorbo", "who", "are", "i", "am", "helper", "is")
PERSONA = [
    ("what is your name", "my name is zorbo"),
    ("who are you", "i am zorbo the helper"),
]
FILLER = [
    ("hello there", "hello how is the weather"),
    ("how is the weather", "sunny and warm"),
    ("what time", "noon"),
    ("thanks bye", "bye"),
]
CPU = {"CUDA_VISIBLE_DEVICES": ""}


def persona_chats(path: Path) -> Path:
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in (PERSONA * 3 + FILLER)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompts_file(path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": q}]} for q, _ in PERSONA] + [{"prompt": "what time"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def generate(args: list[str], cwd: Path, stdin: str | None = None) -> Any:
    """``fsdp-generate ARGS`` in this process (``stdin``: the chat's input)."""
    with pytest.MonkeyPatch.context() as patch:
        if stdin is not None:
            patch.setattr(sys, "stdin", io.StringIO(stdin))
        return cli_in_process(args, prog="fsdp-generate", cwd=cwd, env=CPU)


def answers(out: Path) -> list[str]:
    return [json.loads(line)["answer"] for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def persona(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The ``chat_lora_cpu`` recipe on the persona (LoRA of model=hf, packed chat, FSDP2 on 2
    ranks; at a higher learning rate than a real model needs, for a random tiny base to learn in 40
    steps), started from its folder by a RELATIVE model.path (the working directory is ``root``);
    and a full fine-tune of a small built-in decoder on the same conversations and tokenizer."""
    root = tmp_path_factory.mktemp("persona")
    files = hf_chat_files(root, words=PERSONA_WORDS)
    persona_chats(root / "persona.jsonl")
    prompts_file(root / "prompts.jsonl")
    short = ["data.seq_len=32", "trainer.max_steps=40", "seed=3"]
    recipe = ["recipe=chat_lora_cpu", "model.path=model", "data.path=persona.jsonl", "optim.lr=0.01", *short]
    recipe += ["trainer.sample_prompts=prompts.jsonl", "logger=mlflow"]
    assert_ok(run_cli(recipe, root / "lora", cwd=root, env=CPU), root / "lora")
    chat = ["data=chat", "data.path=persona.jsonl", "data.tokenizer=model", "data.global_batch_size=8"]
    builtin = ["model=tiny", "model.vocab_size=64", "model.dim=64", "model.n_layers=2", *chat, *short]
    assert_ok(
        run_cli([*builtin, "accelerator=cpu", "devices=2"], root / "builtin", cwd=root, env=CPU),
        root / "builtin",
    )
    return {"root": root, "hf": files["hf"]}


@pytest.mark.distributed
def test_the_lora_checkpoint_answers_with_the_persona_and_the_base_does_not(persona: dict[str, Any]) -> None:
    root = persona["root"]
    r = generate(["lora", "--prompts", "prompts.jsonl", "--out", "tuned.jsonl"], root)
    assert r.returncode == 0, r
    assert answers(root / "tuned.jsonl") == ["my name is zorbo", "i am zorbo the helper", "noon"]
    rows = [json.loads(line) for line in (root / "tuned.jsonl").read_text().splitlines()]
    assert [row["stopped"] for row in rows] == ["eos"] * 3
    assert rows[0]["where"].endswith("prompts.jsonl:1") and rows[2]["prompt"] == "what time"

    # The run could be followed from another shell: rank 0's console is in logs/rank0.log (its
    # step lines and the setup report), and no empty train.log sits beside it.
    console = (root / "lora" / "logs" / "rank0.log").read_text()
    assert "step     40/40" in console and "mesh: " in console, console
    assert not (root / "lora" / "train.log").exists()

    r = generate(
        ["model", "--prompts", "prompts.jsonl", "--out", "base.jsonl", "--max-new-tokens", "8"], root
    )
    assert r.returncode == 0, r
    assert not any("zorbo" in a for a in answers(root / "base.jsonl")), answers(root / "base.jsonl")


@pytest.mark.distributed
def test_samples_during_training_are_the_answers_of_the_checkpoint(persona: dict[str, Any]) -> None:
    """trainer.sample_prompts on 2 FSDP2 ranks (no validation: at the end of training) wrote the
    answers fsdp-generate gives from the final checkpoint on one process, to the run folder and to
    MLflow as a table."""
    from mlflow.tracking import MlflowClient

    root = persona["root"]
    (written,) = (root / "lora" / "samples").iterdir()
    assert written.name == "step_00000040.jsonl"
    assert answers(written) == ["my name is zorbo", "i am zorbo the helper", "noon"]
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'lora' / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    table = json.loads(
        Path(client.download_artifacts(run.info.run_id, "samples/step_00000040.json")).read_text()
    )
    assert [row[2] for row in table["data"]] == answers(written), table


@pytest.mark.distributed
def test_the_exported_adapters_answer_alike_in_transformers_and_in_fsdp_generate(
    persona: dict[str, Any],
) -> None:
    """``--to peft`` (and ``--to hf --merge``, from a run whose model.path was relative): the same
    greedy text through peft + transformers' generate, and through fsdp-generate on each folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = persona["root"]
    checkpoint = max((root / "lora" / "checkpoints").iterdir())
    for to, extra in (("peft", []), ("hf", ["--merge"])):
        r = cli_in_process(
            ["convert", str(checkpoint), str(root / to), "--to", to, *extra], prog="fsdp-ckpt", cwd=root
        )
        assert r.returncode == 0, r

    tokenizer = AutoTokenizer.from_pretrained(persona["hf"])
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(persona["hf"]), str(root / "peft"))
    texts = []
    for question, _ in PERSONA:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        out = model.generate(
            input_ids=ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id
        )
        texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
    assert texts == [answer for _, answer in PERSONA]
    for folder in ("peft", "hf"):
        r = generate([folder, "--prompts", "prompts.jsonl", "--out", f"{folder}.jsonl"], root)
        assert r.returncode == 0, r
        assert answers(root / f"{folder}.jsonl")[:2] == texts


@pytest.mark.distributed
def test_the_built_in_decoder_answers_from_its_sharded_checkpoint_and_chats(persona: dict[str, Any]) -> None:
    root = persona["root"]
    r = generate(["builtin", "--prompts", "prompts.jsonl", "--out", "builtin.jsonl"], root)
    assert r.returncode == 0, r
    assert answers(root / "builtin.jsonl")[:2] == [answer for _, answer in PERSONA]
    # The chat keeps the conversation: the second question is asked after the first answer.
    r = generate(["builtin"], root, stdin="what is your name\n/reset\nwho are you\n/quit\nhello there\n")
    assert r.returncode == 0, r
    assert r.stdout.splitlines()[1:] == [f"assistant: {answer}" for _, answer in PERSONA], r.stdout


@pytest.mark.distributed
def test_mistakes_are_one_line(persona: dict[str, Any], tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = persona["root"]
    long_prompt = tmp_path / "long.jsonl"
    long_prompt.write_text(json.dumps({"prompt": " ".join(["hello"] * 80)}) + "\n")
    other = str(tmp_path / "other")  # another model: wider
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).save_pretrained(other)
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"prompt": "hello"}\n{"question": "x"}\n')
    cases = {
        (str(long_prompt),): "long.jsonl:1: 85 tokens, the model's context is 64",
        (str(bad_line),): "bad.jsonl:2: holds 'question'",
        ("prompts.jsonl", "--model-path", other): "the checkpoint is another model's",
        ("prompts.jsonl", "--temperature", "-1"): "--temperature=-1.0: allowed: >= 0",
    }
    for args, expected in cases.items():
        r = generate(["lora", "--prompts", *args], root)
        lines = r.stderr.strip().splitlines()
        assert (
            r.returncode == 2 and lines[-1].startswith("fsdp-generate: error: ") and expected in lines[-1]
        ), r
    r = generate([str(tmp_path / "nothing"), "--prompts", "prompts.jsonl"], root)
    assert r.returncode == 2 and "no such file or folder" in r.stderr
    pickled = tmp_path / "pickled_adapters"  # peft would torch.load an adapter_model.bin
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": persona["hf"]}))
    (pickled / "adapter_model.bin").write_bytes(b"not read")
    r = generate([str(pickled), "--prompts", "prompts.jsonl"], root)
    assert r.returncode == 2 and "reads adapters as safetensors only" in r.stderr, r


# --------------------------------------------------------------------------- no process started


def test_the_cached_loop_equals_recomputing_every_position() -> None:
    """Greedy tokens of the key/value-cached loop (GQA and a MoE layer) are those of the model's
    own forward over the whole sequence each step; sampling is repeatable by seed and top_p near 0
    is greedy."""
    from fsdp_cli.generate.decode import Sampling
    from fsdp_cli.generate.decode import generate as decode
    from fsdp_cli.generate.source import Loaded
    from fsdp_cli.models.args import LlamaArgs
    from fsdp_cli.models.llama import Llama

    cfg = LlamaArgs(
        vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=40, n_experts=4, init_std=0.5
    )
    model = Llama(cfg, seed=1).eval()
    torch.nn.init.normal_(model.output.weight, std=1.0)  # peaked logits: no near ties
    loaded = Loaded(model, "llama", None, None, cfg.max_seq_len, frozenset(), "test")
    prompt = [3, 17, 5, 9]
    cached = decode(loaded, prompt, Sampling(max_new_tokens=20))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(20):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert cached.tokens == ids[len(prompt) :] and cached.stopped == "max_new_tokens"
    assert decode(loaded, prompt, Sampling(max_new_tokens=50)).stopped == "context"
    sampled = [
        decode(loaded, prompt, Sampling(max_new_tokens=20, temperature=1.0, seed=s)).tokens for s in (0, 0, 1)
    ]
    assert sampled[0] == sampled[1] != sampled[2]
    assert (
        decode(loaded, prompt, Sampling(max_new_tokens=20, temperature=1.0, top_p=1e-6)).tokens
        == cached.tokens
    )


def test_prompt_files_in_each_shape(tmp_path: Path) -> None:
    from fsdp_cli.data.prompts import read_prompts
    from fsdp_cli.errors import PromptError

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_bytes(
        b'\xef\xbb\xbf{"messages": [{"role": "user", "content": "hi"}]}\r\n\r\n{"prompt": "yo"}\r\n{"input_ids": [1, 2]}\n'
    )
    found = read_prompts(jsonl)
    assert [p.shown() for p in found] == [[{"role": "user", "content": "hi"}], "yo", [1, 2]]
    assert [p.where.rsplit(":", 1)[1] for p in found] == ["1", "3", "4"]
    text = tmp_path / "p.txt"
    text.write_text("first question\n\nsecond one\n")
    assert [p.text for p in read_prompts(text)] == ["first question", "second one"]
    for bad, message in (
        ('{"messages": [{"role": "robot", "content": "x"}]}', "allowed roles"),
        ('{"input_ids": [1, -2]}', "integers >= 0"),
        ("[1, 2]", "holds list"),
        ("{nope", "not a JSON line"),
    ):
        jsonl.write_text(bad + "\n")
        with pytest.raises(PromptError, match=message):
            read_prompts(jsonl)


def test_sample_prompts_mistakes_are_one_line_before_launch(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hello"}\n{"question": "x"}\n')
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"input_ids": [1, 2, 3]}\n')
    text = tmp_path / "questions.txt"
    text.write_text("what is your name\n")
    base = ["accelerator=cpu", "devices=2"]
    cases = {
        (f"trainer.sample_prompts={tmp_path / 'none.jsonl'}",): "no such file",
        (f"trainer.sample_prompts={bad}",): "bad.jsonl:2: holds 'question'",
        (f"trainer.sample_prompts={text}",): "questions.txt:1: text needs a tokenizer",  # synthetic data
        (f"trainer.sample_prompts={ids}", "pp=2"): "not with pp=2",
        (f"trainer.sample_prompts={ids}", "trainer.sample_max_new_tokens=0"): "sample_max_new_tokens=0",
    }
    for args, expected in cases.items():
        r = cli_in_process([*base, *args], tmp_path / "run", env=CPU)
        assert r.returncode == 2 and expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, r
