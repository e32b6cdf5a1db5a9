"""Prompt files, and prompts rendered as the run's training data was.

A ``.jsonl`` (or ``.json``) file holds one JSON object a line: ``{"messages": [{"role", "content"},
...]}`` (a conversation to continue: rendered with the chat template, the generation prompt added),
``{"prompt": "..."}`` (one user turn; the raw text where there is no chat template, or with
``raw``), or ``{"input_ids": [...]}`` (token ids, for a model trained without a tokenizer). Any
other file: one prompt a line, as ``{"prompt": line}``. Blank lines are skipped; a line that is
none of these is one error naming ``file:line``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from fsdp_cli.generate.source import GenerateError, Loaded

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Prompt:
    where: str
    """``file:line``, for errors and the output."""
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    input_ids: list[int] | None = None

    def shown(self) -> Any:
        """What the output file repeats of the prompt."""
        if self.messages is not None:
            return self.messages
        return self.text if self.text is not None else self.input_ids


def read_prompts(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise GenerateError(f"--prompts={path}: no such file")
    as_json = path.suffix in (".jsonl", ".json")
    out = []
    # utf-8-sig: a file saved on Windows starts with a byte-order mark.
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        if line.strip():
            where = f"{path}:{number}"
            out.append(_parse(json_line(line, where), where) if as_json else Prompt(where, text=line.strip()))
    if not out:
        raise GenerateError(f"--prompts={path}: holds no prompt")
    return out


def json_line(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise GenerateError(f"{where}: not a JSON line ({err.msg}); one object a line") from None


def _parse(record: Any, where: str) -> Prompt:
    if isinstance(record, dict) and "messages" in record:
        return Prompt(where, messages=check_messages(record["messages"], where))
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return Prompt(where, text=record["prompt"])
    if isinstance(record, dict) and isinstance(record.get("input_ids"), list):
        ids = record["input_ids"]
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise GenerateError(f"{where}: input_ids must be token ids (integers >= 0)")
        return Prompt(where, input_ids=ids)
    keys = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
    raise GenerateError(f"{where}: holds {keys or 'nothing'}; allowed: 'messages', 'prompt' or 'input_ids'")


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not ok:
        raise GenerateError(
            f"{where}: messages must be a non-empty list of {{role, content}} objects; allowed roles: "
            + ", ".join(ROLES)
        )
    return messages


def prompt_ids(loaded: Loaded, prompt: Prompt, *, raw: bool = False) -> list[int]:
    """The token ids ``prompt`` becomes: a conversation through the chat template with the
    generation prompt; text through it too as one user turn (unless ``raw`` or there is no
    template); token ids as they are (checked against the vocabulary)."""
    if prompt.input_ids is not None:
        vocab = (
            loaded.model.get_input_embeddings().num_embeddings
            if loaded.kind == "hf"
            else loaded.model.cfg.vocab_size
        )
        if max(prompt.input_ids, default=0) >= vocab:
            raise GenerateError(f"{prompt.where}: a token id >= the vocabulary's {vocab}")
        return list(prompt.input_ids)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise GenerateError(
            f"{prompt.where}: text needs a tokenizer, and the run had none (data.tokenizer); "
            "pass --tokenizer DIR or give input_ids"
        )
    if prompt.messages is None and (raw or loaded.template is None):
        return list(tokenizer(prompt.text)["input_ids"])
    if loaded.template is None:
        raise GenerateError(
            f"{prompt.where}: a conversation needs a chat template and the tokenizer has none; "
            "give text prompts (rendered as is)"
        )
    messages = prompt.messages if prompt.messages is not None else [{"role": "user", "content": prompt.text}]
    text = render(loaded, messages)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render(loaded: Loaded, messages: list[dict[str, Any]]) -> str:
    return loaded.tokenizer.apply_chat_template(
        messages, chat_template=loaded.template, tokenize=False, add_generation_prompt=True
    )


def answer_text(loaded: Loaded, tokens: list[int]) -> str:
    """The answer as text, the ending end-of-sequence token left out (token ids without a tokenizer)."""
    if tokens and tokens[-1] in loaded.eos:
        tokens = tokens[:-1]
    if loaded.tokenizer is None:
        return " ".join(map(str, tokens))
    return str(loaded.tokenizer.decode(tokens, skip_special_tokens=True)).strip()
