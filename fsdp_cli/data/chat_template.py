"""Conversations rendered through a tokenizer's chat template, and which tokens are the assistant's.

The tokenizer is Hugging Face's ``AutoTokenizer`` read from a LOCAL folder (never downloaded), so
the template is the one the user will chat with. The supervised tokens are found exactly in one of
two ways:

* the template marks the assistant's text with ``{% generation %}`` ... ``{% endgeneration %}``:
  transformers reports those tokens (``return_assistant_tokens_mask``);
* it does not (most templates): each assistant turn's characters are found by rendering prefixes
  of the conversation, ``render(turns[:i], add_generation_prompt=True)`` (where the answer starts)
  and ``render(turns[:i + 1])`` (where it ends, trailing whitespace left out), and a token is the
  assistant's when its characters overlap that span. A template that renders a conversation's
  beginning differently once more turns follow (e.g. one that drops earlier ``<think>`` blocks)
  has no such spans and is refused in one line: name a template with markers instead.

Either way the answer's own end-of-turn token is supervised (the model learns to stop) and the
template's scaffolding (role headers, the generation prompt) is not. Torch-free.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fsdp_cli.errors import ConfigError
from fsdp_cli.extras import install_hint

ROLES = ("system", "user", "assistant", "tool")
GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")


def load_tokenizer(folder: str | None) -> Any:
    """``AutoTokenizer`` of a local folder (``local_files_only``: nothing is downloaded); one line on
    ``data.tokenizer`` when there is none."""
    if not folder or not Path(folder).is_dir():
        raise ConfigError(
            "data.tokenizer",
            folder,
            "data=chat needs a folder holding the tokenizer (tokenizer.json, tokenizer_config.json)",
            hint="data.tokenizer=MODEL_DIR (defaults to model.path for model=hf)",
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(
            "data.tokenizer", folder, "needs the transformers package", hint=install_hint("hf")
        ) from None
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - any unreadable folder is one line for the user
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError("data.tokenizer", folder, f"no tokenizer could be read there ({first})") from None


def chat_template(tokenizer: Any, named: str | None, folder: str | None) -> str:
    """The template to render with: ``data.chat_template`` (a file, or the template's own text) if
    given, else the folder's; a folder without one is refused in one line."""
    if named:
        path = Path(named)
        if "{" not in named and path.is_file():
            return _not_empty(path.read_text(), named)
        if "{" not in named:
            raise ConfigError(
                "data.chat_template",
                named,
                "no such file",
                hint="a Jinja template file, or the template text itself",
            )
        return named
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise ConfigError(
            "data.chat_template",
            None,
            f"the tokenizer in {folder} has no chat template",
            allowed="a Jinja template file or text",
            hint="data.chat_template=FILE.jinja (the template the model will be chatted with)",
        )
    return template


def _not_empty(template: str, named: str) -> str:
    """``template``, read from the file ``named``; one line when it holds nothing to render."""
    if not template.strip():
        raise ConfigError(
            "data.chat_template",
            named,
            "the file is empty: every conversation would render to no token",
            hint="a Jinja chat template (the model's own is in its tokenizer_config.json or chat_template.jinja)",
        )
    return template


def has_generation_markers(template: str) -> bool:
    return GENERATION_MARKER.search(template) is not None


class ChatRenderer:
    """Turns one checked conversation into token ids and the mask of its supervised tokens.

    Arguments:
        tokenizer: a fast Hugging Face tokenizer (character offsets are needed).
        template: the Jinja chat template.
        last_turn_only: supervise only the last assistant turn (else every assistant turn).
    """

    def __init__(self, tokenizer: Any, template: str, *, last_turn_only: bool = False) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.last_turn_only = last_turn_only
        self.markers = has_generation_markers(template)

    def render(self, messages: list[dict[str, Any]], *, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
        )

    def __call__(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        """(token ids, supervised flag per token) of the whole conversation."""
        if self.markers:
            return self._by_markers(messages)
        return self._by_prefixes(messages)

    def _by_markers(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        out = self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        mask = [bool(m) for m in out["assistant_masks"]]
        return list(out["input_ids"]), last_run(mask) if self.last_turn_only else mask

    def _by_prefixes(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        text = self.render(messages)
        spans = [self._span(messages, i, text) for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.last_turn_only:
            spans = spans[-1:]
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [any(s < end and e > start for start, end in spans) for s, e in encoded["offset_mapping"]]
        return list(encoded["input_ids"]), mask

    def _span(self, messages: list[dict[str, Any]], i: int, text: str) -> tuple[int, int]:
        """The characters of assistant turn ``i`` in ``text`` (the whole conversation rendered)."""
        before = self.render(messages[:i], generation_prompt=True)
        through = self.render(messages[: i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise NotPrefixStable(i)
        return len(before), len(through.rstrip())


class NotPrefixStable(ValueError):
    """The template renders turn ``i`` differently once later turns follow: no exact spans."""

    def __init__(self, turn: int) -> None:
        super().__init__(
            f"the chat template renders the conversation up to turn {turn} differently once later turns follow, "
            "so the assistant's tokens cannot be found exactly"
        )


def last_run(mask: list[bool]) -> list[bool]:
    """Only the last run of consecutive True values of ``mask`` (the last assistant turn)."""
    end = max((i for i, m in enumerate(mask) if m), default=-1)
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return [start <= i <= end and end >= 0 for i in range(len(mask))]
