"""data=tokens (flat token files, memory-mapped) and data=jsonl (tokenized once, cached): the
windows they give, the cache, and the one-line errors the parent gives before any rank starts."""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_in_process, composed
from test_hf import save_word_tokenizer

from fsdp_cli.data.files import check_token_files
from fsdp_cli.data.jsonl import cached_tokens, prepare, tokenizer_spec
from fsdp_cli.data.tokens import TokenWindows, affine_permutation
from fsdp_cli.errors import ConfigError

CPU = {"CUDA_VISIBLE_DEVICES": ""}


def token_file(path: Path, values: np.ndarray, dtype: str = "uint16") -> Path:
    values.astype(dtype).tofile(path)
    return path


# --------------------------------------------------------------------------- token windows


def test_every_window_once_per_epoch_across_file_boundaries(tmp_path: Path) -> None:
    stream = np.arange(1000) % 997
    files = [token_file(tmp_path / "a.bin", stream[:333]), token_file(tmp_path / "b.bin", stream[333:])]
    seq = 8
    data = TokenWindows(files, dtype="uint16", seq_len=seq, seed=3)
    n = data.windows
    assert n == (1000 - 1) // seq
    epoch = [data[i] for i in range(n)]
    starts = sorted(int(item[0]) for item in epoch)
    assert starts == [w * seq for w in range(n)], "each window exactly once"
    for item in epoch:
        start = int(item[0])
        assert (
            item.tolist() == stream[start : start + seq + 1].tolist()
        )  # 41 * 8 = 328 < 333 < 336 spans a.bin/b.bin
    assert [int(data[n + i][0]) for i in range(5)] != [int(x[0]) for x in epoch[:5]], "a new order each epoch"
    again = TokenWindows(files, dtype="uint16", seq_len=seq, seed=3)
    assert all(again[i].tolist() == data[i].tolist() for i in (0, 7, n + 3)), (
        "an item depends only on its index"
    )


def test_windows_never_carry_the_file_when_pickled(tmp_path: Path) -> None:
    """DataLoader workers receive the dataset pickled: paths travel, not the data."""
    big = token_file(tmp_path / "big.bin", np.arange(500_000) % 60_000)
    data = TokenWindows([big], dtype="uint16", seq_len=16, seed=0)
    first = data[0]
    copy = pickle.loads(pickle.dumps(data))
    assert len(pickle.dumps(data)) < 10_000 < big.stat().st_size
    assert copy[0].tolist() == first.tolist()


def test_affine_permutation_is_a_bijection() -> None:
    for n in (1, 2, 7, 12, 97, 1000):
        for key in ((0, 0), (5, 1), (11, 9)):
            assert sorted(affine_permutation(i, n, key=key) for i in range(n)) == list(range(n))


# --------------------------------------------------------------------------- token file checks


def test_token_file_problems_are_one_config_error_each(tmp_path: Path) -> None:
    good = token_file(tmp_path / "good.bin", np.arange(100) % 50)
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    short = token_file(tmp_path / "short.bin", np.arange(5))
    big_ids = token_file(tmp_path / "ids.bin", np.array([1, 2, 300, 4] * 20))

    def check(path: str, **kw: object) -> str:
        args = {"dtype": "uint16", "seq_len": 16, "vocab_size": 256, **kw}
        with pytest.raises(ConfigError) as err:
            check_token_files("data.path", path, **args)  # type: ignore[arg-type]
        return err.value.one_line()

    assert check_token_files("data.path", str(good), dtype="uint16", seq_len=16, vocab_size=50) == [good]
    assert "matches no file" in check(str(tmp_path / "none_*.bin"))
    assert "empty.bin is empty" in check(str(tmp_path / "empty.bin"))
    assert "holds 3 bytes, not a whole number of uint16 tokens" in check(str(tmp_path / "odd.bin"))
    assert "holds 5 tokens, fewer than data.seq_len + 1 = 17" in check(str(short))
    assert "holds token id 300, not below data.vocab_size=256" in check(str(big_ids))
    # The same bytes read as uint32 make ids no vocabulary holds: a wrong dtype is caught too.
    assert "not below data.vocab_size=256" in check(str(good), dtype="uint32", seq_len=8)


def test_bad_token_data_stops_the_parent_in_one_line(tmp_path: Path) -> None:
    path = token_file(tmp_path / "t.bin", np.arange(101) % 200)
    result = cli_in_process(
        ["data=tokens", f"data.path={path}", "data.dtype=uint32"], tmp_path / "run", env=CPU
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "holds 202 bytes, not a whole number of uint32 tokens" in lines[0]
    assert not (tmp_path / "run" / "config.yaml").exists(), "no rank started"


def test_token_corpora_validate_on_held_out_files(tmp_path: Path) -> None:
    from fsdp_cli.config.validate import checked_run, validate
    from fsdp_cli.launch.layout import resolve_layout

    path = token_file(tmp_path / "t.bin", np.arange(101) % 200)
    cfg = composed("data=tokens", f"data.path={path}", "data.seq_len=16", "trainer.val_check_interval=2")
    with pytest.raises(
        ConfigError, match=r"^data.val_path=null: trainer.val_check_interval=2 needs held-out data"
    ):
        validate(checked_run(resolve_layout(cfg, CPU)))


# --------------------------------------------------------------------------- jsonl


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    docs = ["the quick brown fox", "a lazy dog sleeps", "", "the cat runs and then jumps over the dog"]
    path.write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs)) + "\n")
    return path


def jsonl_config(path: Path, **fields: object) -> object:
    cfg = composed("data=jsonl", f"data.path={path}", "data.seq_len=4")
    return replace(cfg.data, **fields)


def test_documents_become_tokens_joined_by_end_of_text_and_are_cached_once(
    tmp_path: Path, corpus: Path
) -> None:
    tokenizer = save_word_tokenizer(tmp_path / "tokenizer.json")
    data = jsonl_config(corpus, tokenizer=str(tokenizer), vocab_size=128)
    prepare(data)
    cache, dtype = cached_tokens(data, "path")
    assert dtype == "uint16" and cache.parent.name == ".fsdp_cli_tokens"
    ids = np.fromfile(cache, dtype=dtype).tolist()
    spec = tokenizer_spec(data)
    from tokenizers import Tokenizer

    encode = Tokenizer.from_file(str(tokenizer)).encode
    expected: list[int] = []
    for text in ["the quick brown fox", "a lazy dog sleeps", "", "the cat runs and then jumps over the dog"]:
        expected += [*encode(text, add_special_tokens=False).ids, spec.eot_id]
    assert ids == expected and spec.eot_id == Tokenizer.from_file(str(tokenizer)).token_to_id("<|endoftext|>")
    description = json.loads(cache.with_suffix(".json").read_text())
    assert description["tokens"] == len(ids) and description["documents"] == 4
    written = cache.stat().st_mtime_ns
    prepare(data)
    assert cache.stat().st_mtime_ns == written, "an unchanged corpus is not tokenized again"
    with open(corpus, "a") as fh:
        fh.write(json.dumps({"text": "a new fox"}) + "\n")
    prepare(data)
    assert cached_tokens(data, "path")[0] != cache, "a changed corpus is"


def test_without_a_tokenizer_documents_are_utf8_bytes_ended_by_zero(corpus: Path) -> None:
    data = jsonl_config(corpus)
    prepare(data)
    cache, dtype = cached_tokens(data, "path")
    ids = np.fromfile(cache, dtype=dtype).tolist()
    assert ids[: len("the quick brown fox") + 1] == [*b"the quick brown fox", 0]
    assert ids.count(0) == 4


def test_jsonl_mistakes_are_one_config_error(tmp_path: Path, corpus: Path) -> None:
    tokenizer = save_word_tokenizer(tmp_path / "tokenizer.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not a JSON line"):
        prepare(jsonl_config(bad))
    with pytest.raises(
        ConfigError, match=r"^data.field=body: .*docs.jsonl:1 has no text under that key; allowed: text, n"
    ):
        prepare(jsonl_config(corpus, field="body"))
    with pytest.raises(ConfigError, match=r"^data.tokenizer=.*has 20 tokens, more than data.vocab_size=8"):
        prepare(jsonl_config(corpus, tokenizer=str(tokenizer), vocab_size=8))
    with pytest.raises(ConfigError, match=r"^data.eot_token=<eos>: no end-of-text token named '<eos>'"):
        prepare(jsonl_config(corpus, tokenizer=str(tokenizer), eot_token="<eos>"))
    # 17 words and 4 end-of-text tokens
    with pytest.raises(ConfigError, match=r"holds 21 tokens, fewer than data.seq_len \+ 1 = 101"):
        prepare(jsonl_config(corpus, tokenizer=str(tokenizer), vocab_size=128, seq_len=100))


def test_bad_jsonl_stops_the_parent_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    result = cli_in_process(["data=jsonl", f"data.path={bad}"], tmp_path / "run", env=CPU)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "data.field=text: " in lines[0] and "has no text under that key; allowed: body" in lines[0]
    assert not os.path.exists(tmp_path / "run" / "config.yaml")


def test_parquet_and_datasets_folders_tokenize_as_their_json_lines(tmp_path: Path, corpus: Path) -> None:
    """data=jsonl from a Parquet file and from a folder ``datasets`` saved: the tokens of the same
    documents as JSON lines; a row without the field is named ``FILE:row N``; without pyarrow,
    one line with the install hint before anything is read."""
    import datasets

    rows = [json.loads(line) for line in corpus.read_text().splitlines() if line.strip()]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "docs.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    tokens = {}
    for name in ("docs.jsonl", "docs.parquet", "saved"):
        data = jsonl_config(
            corpus if name == "docs.jsonl" else tmp_path / name, cache_dir=str(tmp_path / name) + ".cache"
        )
        prepare(data)
        cache, dtype = cached_tokens(data, "path")
        tokens[name] = np.fromfile(cache, dtype=dtype).tolist()
    assert tokens["docs.parquet"] == tokens["docs.jsonl"] == tokens["saved"] and len(tokens["saved"]) > 20
    datasets.Dataset.from_list([{"text": "fine"}, {"body": "x"}]).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(ConfigError, match=r"bad.parquet:row 2 has no text under that key"):
        prepare(jsonl_config(tmp_path / "bad.parquet"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "pyarrow" else object())
        with pytest.raises(ConfigError, match=r"needs pyarrow; hint: pip install .*pyarrow"):
            prepare(jsonl_config(tmp_path / "docs.parquet"))
