"""The shapes public instruction data arrives in, as ``{role, content}`` messages (``data.format``).

* ``messages``: ``{"messages": [{"role", "content"}, ...]}``, or a prompt/completion pair;
* ``sharegpt``: ``{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}``
  (``from``: system, human/user, gpt/assistant/model/bot, function_call, observation/tool);
* ``alpaca``: ``{"instruction", "input", "output"}`` (and an optional ``system``): the instruction
  and a non-empty input, separated by a blank line, one user turn; the output the answer;
* ``auto`` (the default): each line by its keys, in that order.

Only the mapping is here; the messages are then checked like any others
(:func:`fsdp_cli.data.chat.check_messages`). Torch-free.
"""

from __future__ import annotations

from typing import Any

from fsdp_cli.errors import ConfigError

SHAREGPT_FIELD = "conversations"
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
"""ShareGPT's ``from`` values (the spellings LLaMA-Factory and axolotl read) and our roles."""
ALPACA_FIELDS = ("instruction", "output")


def detect(record: dict[str, Any], data: Any) -> str:
    """The format of one line under ``data.format=auto``: by its keys; "" when none matches."""
    if data.messages_field in record or (data.prompt_field in record and data.completion_field in record):
        return "messages"
    if SHAREGPT_FIELD in record:
        return "sharegpt"
    if all(f in record for f in ALPACA_FIELDS):
        return "alpaca"
    return ""


def sharegpt(record: dict[str, Any], where: str, key: str) -> list[dict[str, Any]]:
    turns = record.get(SHAREGPT_FIELD)
    if not isinstance(turns, list) or not turns:
        raise ConfigError(
            key,
            where,
            f"{SHAREGPT_FIELD!r} is not a non-empty list of turns",
            hint='[{"from": "human", "value": "..."}, ...]',
        )
    messages = []
    for number, turn in enumerate(turns, start=1):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if speaker not in SHAREGPT_ROLES:
            raise ConfigError(
                key,
                where,
                f"turn {number} is from {speaker!r}",
                allowed=", ".join(SHAREGPT_ROLES),
                hint='each turn is {"from": ..., "value": ...} (ShareGPT)',
            )
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn.get("value")})
    if isinstance(record.get("system"), str) and record["system"] and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": record["system"]})
    return messages


def alpaca(record: dict[str, Any], where: str, key: str) -> list[dict[str, Any]]:
    instruction, extra, output = record.get("instruction"), record.get("input", ""), record.get("output")
    if not all(isinstance(v, str) for v in (instruction, extra, output)):
        raise ConfigError(
            key,
            where,
            "instruction, input and output must be strings (input may be empty)",
            hint="Alpaca's record",
        )
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    system = record.get("system")
    start = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
    return [*start, {"role": "user", "content": prompt}, {"role": "assistant", "content": output}]


def unknown_shape(record: dict[str, Any], where: str, key: str, data: Any) -> ConfigError:
    return ConfigError(
        key,
        where,
        f"holds neither {data.messages_field!r}, {data.prompt_field!r} and {data.completion_field!r}, "
        f"ShareGPT's {SHAREGPT_FIELD!r} nor Alpaca's 'instruction' and 'output'",
        allowed=", ".join(map(repr, record)) or "(an empty object)",
        hint="data.messages_field=KEY, or data.prompt_field=KEY data.completion_field=KEY",
    )
