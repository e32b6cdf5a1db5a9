"""Prompt files, and prompts rendered as the run's training data was (``fsdp-generate``,
``trainer.sample_prompts``).

A ``.jsonl`` (or ``.json``) file holds one JSON object a line: ``{"messages": [{"role", "content"},
...]}`` (a conversation to continue: rendered with the chat template, the generation prompt added),
``{"prompt": "..."}`` (one user turn; the raw text where there is no chat template, or with
``raw``), or ``{"input_ids": [...]}`` (token ids, for a model trained without a tokenizer). Any
other file: one prompt a line, as ``{"prompt": line}``. Blank lines are skipped; a line that is
none of these is one error naming ``file:line``. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from fsdp_cli.errors import PromptError

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
        raise PromptError(f"--prompts={path}: no such file")
    as_json = path.suffix in (".jsonl", ".json")
    out = []
    # utf-8-sig: a file saved on Windows starts with a byte-order mark.
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        if line.strip():
            where = f"{path}:{number}"
            out.append(_parse(json_line(line, where), where) if as_json else Prompt(where, text=line.strip()))
    if not out:
        raise PromptError(f"--prompts={path}: holds no prompt")
    return out


def json_line(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise PromptError(f"{where}: not a JSON line ({err.msg}); one object a line") from None


def _parse(record: Any, where: str) -> Prompt:
    if isinstance(record, dict) and "messages" in record:
        return Prompt(where, messages=check_messages(record["messages"], where))
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return Prompt(where, text=record["prompt"])
    if isinstance(record, dict) and isinstance(record.get("input_ids"), list):
        ids = record["input_ids"]
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise PromptError(f"{where}: input_ids must be token ids (integers >= 0)")
        return Prompt(where, input_ids=ids)
    keys = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
    raise PromptError(f"{where}: holds {keys or 'nothing'}; allowed: 'messages', 'prompt' or 'input_ids'")


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
        raise PromptError(
            f"{where}: messages must be a non-empty list of {{role, content}} objects; allowed roles: "
            + ", ".join(ROLES)
        )
    return messages


def prompt_ids(
    prompt: Prompt, tokenizer: Any, template: str | None, vocab_size: int, *, raw: bool = False
) -> list[int]:
    """The token ids ``prompt`` becomes: a conversation through the chat ``template`` with the
    generation prompt; text through it too as one user turn (unless ``raw`` or there is no
    template); token ids as they are (checked against the vocabulary)."""
    if prompt.input_ids is not None:
        if max(prompt.input_ids, default=0) >= vocab_size:
            raise PromptError(f"{prompt.where}: a token id >= the vocabulary's {vocab_size}")
        return list(prompt.input_ids)
    if tokenizer is None:
        raise PromptError(
            f"{prompt.where}: text needs a tokenizer, and the run had none (data.tokenizer); "
            "pass --tokenizer DIR or give input_ids"
        )
    if prompt.messages is None and (raw or template is None):
        return list(tokenizer(prompt.text)["input_ids"])
    if template is None:
        raise PromptError(
            f"{prompt.where}: a conversation needs a chat template and the tokenizer has none; "
            "give text prompts (rendered as is)"
        )
    messages = prompt.messages if prompt.messages is not None else [{"role": "user", "content": prompt.text}]
    text = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_text(tokenizer: Any, tokens: list[int], eos: frozenset[int]) -> str:
    """The answer as text, the ending end-of-sequence token left out (token ids without a tokenizer)."""
    if tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    if tokenizer is None:
        return " ".join(map(str, tokens))
    return str(tokenizer.decode(tokens, skip_special_tokens=True)).strip()


def named_template(named: str | None) -> str | None:
    """``data.chat_template``'s text: the file it names, or the template itself (None: unnamed)."""
    if not named:
        return None
    return Path(named).read_text() if "{" not in named and Path(named).is_file() else named


def own_template(tokenizer: Any, named: str | None) -> str | None:
    """``named`` (``data.chat_template``), else the tokenizer's own template, else None."""
    text = named_template(named)
    if text or tokenizer is None:
        return text
    found = getattr(tokenizer, "chat_template", None)
    if isinstance(found, dict):
        found = found.get("default")
    return found if isinstance(found, str) and found else None


def eos_ids(tokenizer: Any, generation_config: Any = None) -> frozenset[int]:
    """The token ids that end an answer: the tokenizer's and the generation config's."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


@dataclasses.dataclass
class RunPrompts:
    """``trainer.sample_prompts`` of a run, rendered: (``file:line``, as shown, token ids) each."""

    rows: list[tuple[str, Any, list[int]]]
    tokenizer: Any
    eos: frozenset[int]


def run_prompts(cfg: Any) -> RunPrompts:
    """The run's sample prompts through its tokenizer (``data.tokenizer``, else ``model.path`` of
    model=hf) and chat template; a :class:`PromptError` naming ``file:line`` for a bad one."""
    from fsdp_cli.data.chat_template import load_tokenizer

    prompts = read_prompts(Path(cfg.trainer.sample_prompts))
    folder = getattr(cfg.data, "tokenizer", None) or (
        getattr(cfg.model, "path", None) if getattr(cfg.model, "name", None) == "hf" else None
    )
    tokenizer = None
    if folder and any(p.input_ids is None for p in prompts):
        tokenizer = load_tokenizer(str(folder))
    template = own_template(tokenizer, getattr(cfg.data, "chat_template", None))
    vocab = int(getattr(cfg.data, "vocab_size", None) or getattr(cfg.model, "vocab_size", 0) or 1 << 31)
    rows = [(p.where, p.shown(), prompt_ids(p, tokenizer, template, vocab)) for p in prompts]
    for where, _, ids in rows:
        if not ids or len(ids) >= cfg.data.seq_len:
            raise PromptError(
                f"{where}: {len(ids)} tokens; a sample's prompt and answer fit in data.seq_len={cfg.data.seq_len}"
            )
    return RunPrompts(rows, tokenizer, eos_ids(tokenizer))
