"""``fsdp-generate``: answers from a trained model, from a prompt file or in a chat.

    fsdp-generate SOURCE --prompts FILE [--out FILE]     # JSON lines of answers
    fsdp-generate SOURCE                                 # chat in the terminal

SOURCE: a run folder (its newest checkpoint), a checkpoint (sharded folder or full file; LoRA
adapters applied), or a folder exported by ``fsdp-ckpt convert --to hf`` / ``--to peft``.
Greedy by default (``--temperature`` > 0 samples, with ``--top-p`` and ``--seed``). One process,
on the GPU when there is one. Mistakes are one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from fsdp_cli.cli.console import OneLineParser, unexpected_error
from fsdp_cli.library_noise import quiet_library_noise

PROG = "fsdp-generate"
QUIT = ("/quit", "/exit")
RESET = "/reset"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Generate from a trained model: a prompt file to JSON lines of answers, or a chat.",
    )
    parser.add_argument("source", type=Path, help="run folder, checkpoint, or exported hf/peft folder")
    parser.add_argument(
        "--prompts",
        type=Path,
        help="JSON lines of {messages}, {prompt} or {input_ids}, or a text file of one prompt a line",
    )
    parser.add_argument(
        "--out", type=Path, help="where the answers go (JSON lines; default: standard output)"
    )
    parser.add_argument("--system", help="a system message put before each conversation")
    parser.add_argument(
        "--raw", action="store_true", help="text prompts as they are, not through the chat template"
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (a GPU if there is one), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--model-path", type=Path, help="the base model folder, if the run's has moved")
    parser.add_argument("--tokenizer", type=Path, help="the tokenizer folder, if not the run's")
    return parser


def answer_rows(loaded: Any, args: argparse.Namespace) -> None:
    """Each prompt of ``--prompts`` answered, one JSON line each, in the file's order. Every
    prompt is checked before the first is answered; ``--out`` appears whole (written beside it
    as ``.partial`` meanwhile, to follow)."""
    from fsdp_cli.data.prompts import read_prompts
    from fsdp_cli.generate.decode import generate, room

    prompts = [_with_system(p, args.system) for p in read_prompts(args.prompts)]
    encoded = [loaded.prompt_ids(p, raw=args.raw) for p in prompts]
    for prompt, ids in zip(prompts, encoded, strict=True):
        room(loaded, ids, prompt.where)
    partial = args.out.with_name(args.out.name + ".partial") if args.out else None
    out = open(partial, "w", encoding="utf-8") if partial else sys.stdout
    try:
        for prompt, ids in zip(prompts, encoded, strict=True):
            answer = generate(loaded, ids, sampling(args), prompt.where)
            row = {
                "where": prompt.where,
                "prompt": prompt.shown(),
                "answer": loaded.answer_text(answer.tokens),
                "new_tokens": len(answer.tokens),
                "stopped": answer.stopped,
            }
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            out.flush()
    except BaseException:
        if partial is not None:
            out.close()
            partial.unlink()
        raise
    if partial is not None:
        out.close()
        partial.replace(args.out)


def chat(loaded: Any, args: argparse.Namespace) -> None:
    """A conversation on standard input: each line a user turn, each answer printed and kept in
    the conversation; ``/reset`` starts over, ``/quit`` or end of input ends."""
    from fsdp_cli.data.prompts import Prompt
    from fsdp_cli.generate.decode import generate

    if loaded.template is None:
        raise_error("chat needs a chat template and the model has none; use --prompts FILE for plain text")
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    print(f"{PROG}: chatting with {loaded.source}; {RESET} starts over, {QUIT[0]} or Ctrl-D ends", flush=True)
    for number, line in enumerate(sys.stdin, start=1):
        text = line.strip()
        if text in QUIT:
            break
        if text == RESET or not text:
            messages = list(start) if text else messages
            continue
        messages.append({"role": "user", "content": text})
        ids = loaded.prompt_ids(Prompt(f"turn {number}", messages=messages))
        answer = loaded.answer_text(generate(loaded, ids, sampling(args), f"turn {number}").tokens)
        messages.append({"role": "assistant", "content": answer})
        print(f"assistant: {answer}", flush=True)


def sampling(args: argparse.Namespace) -> Any:
    from fsdp_cli.generate.decode import Sampling

    return Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)


def _with_system(prompt: Any, system: str | None) -> Any:
    import dataclasses

    if not system or prompt.input_ids is not None:
        return prompt
    messages = prompt.messages if prompt.messages is not None else [{"role": "user", "content": prompt.text}]
    if messages[0]["role"] == "system":
        return prompt
    return dataclasses.replace(prompt, messages=[{"role": "system", "content": system}, *messages], text=None)


def raise_error(message: str) -> NoReturn:
    from fsdp_cli.generate.source import GenerateError

    raise GenerateError(message)


def run(args: argparse.Namespace) -> None:
    from fsdp_cli.generate.source import Options, open_source

    sampling(args)  # its ranges checked before the model is read
    if args.out and not args.prompts:
        raise_error("--out writes the answers to --prompts; give --prompts FILE")
    options = Options(
        model_path=args.model_path, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype
    )
    loaded = open_source(args.source, options)
    print(f"{PROG}: {loaded.kind} model from {loaded.source} on {loaded.device}", file=sys.stderr, flush=True)
    if args.prompts:
        answer_rows(loaded, args)
    else:
        chat(loaded, args)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    quiet_library_noise()  # what torchao and torch log as the model's libraries are imported
    from fsdp_cli.errors import PromptError

    try:
        run(args)
    except PromptError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        sys.exit(2)
    except (BrokenPipeError, KeyboardInterrupt):
        sys.exit(0)
    except Exception as err:  # noqa: BLE001 - an unreadable model; FSDP_GENERATE_DEBUG=1 shows the traceback
        unexpected_error(PROG, err, "FSDP_GENERATE_DEBUG")


if __name__ == "__main__":
    main()
