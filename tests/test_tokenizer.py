"""mk.io.tokenizer: the checkpoint's tiktoken encoding, read without executing checkpoint code."""
import json
import os
import shutil

import pytest

from mk.io import synth
from mk.io.schema import CheckpointError, MissingFileError, TokenizerError
from mk.io.tokenizer import ENCODING_NAME, Tokenizer, load_encoding, read_pat_str

VOCAB = 2048  # the mini config
TEXTS = [
    "The morning train left the valley just after six.",
    "Numbers like 12345 and 3.14159, punctuation?! (brackets) [and] {braces}\n\n  indented\ttabs",
    "Ünïcödé, 中文字符, emoji 🙂 and a trailing space ",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    synth.write_tokenizer(d, VOCAB)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer(tok_dir)


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_vocabulary_fills_the_model_vocab(tok):
    assert tok.encoding.name == ENCODING_NAME
    assert tok.n_vocab == VOCAB
    ordinary = VOCAB - 256
    assert tok.bos_id == ordinary and tok.special_tokens["[BOS]"] == ordinary
    assert tok.eos_ids == (ordinary + 1, ordinary + 2)
    for s in synth.SPECIAL_TOKENS:
        assert ordinary <= tok.token_id(s) < VOCAB
    assert tok.special_tokens[f"<|reserved_token_{ordinary + 100}|>"] == ordinary + 100
    assert len(tok.special_tokens) == 256


def test_ranks_file_format(tok_dir):
    lines = open(os.path.join(tok_dir, "tiktoken.model")).read().splitlines()
    assert len(lines) == VOCAB - 256
    assert lines[65] == "QQ== 65"  # b"A"
    assert all(len(l.split()) == 2 for l in lines)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < VOCAB - 256 for i in ids)
    assert tok.decode(ids) == text


def test_learned_merges_compress_english(tok):
    text = TEXTS[0]
    assert len(tok.encode(text)) < len(text.encode()) / 2


def test_special_tokens(tok):
    text = "[BOS]<|open|>message role=\"user\"<|sep|>Hello<|close|><|end_of_msg|>"
    ids = tok.encode(text, allow_special=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.token_id("<|end_of_msg|>")
    assert tok.token_id("<|open|>") in ids and tok.token_id("<|sep|>") in ids
    assert tok.decode(ids) == text
    plain = tok.encode(text)  # specials not allowed: encoded as ordinary text
    assert not set(plain) & set(tok.special_tokens.values())
    assert tok.decode(plain) == text
    some = tok.encode(text, allow_special={"[BOS]"})
    assert some[0] == tok.bos_id and tok.token_id("<|open|>") not in some


def test_checkpoint_code_is_never_executed(tok_dir, tmp_path):
    d = copy_dir(tok_dir, tmp_path / "evil")
    marker = tmp_path / "executed"
    code = f'''
import pathlib
pathlib.Path({str(marker)!r}).write_text("module ran")
raise SystemExit("tokenization_kimi.py must not be executed")


class TikTokenTokenizer:
    pathlib.Path({str(marker)!r}).write_text("class body ran")
    pat_str = "|".join(
        [
            r"""[\\p{{L}}]+""",
            r"""\\p{{N}}""",
            r"""\\s+""",
            r"""[^\\s\\p{{L}}\\p{{N}}]+""",
        ]
    )

    def __init__(self):
        raise RuntimeError("never")
'''
    (d / "tokenization_kimi.py").write_text(code)
    assert read_pat_str(d / "tokenization_kimi.py") == r"[\p{L}]+|\p{N}|\s+|[^\s\p{L}\p{N}]+"
    t = Tokenizer(d)
    assert t.decode(t.encode("still works 123")) == "still works 123"
    assert not marker.exists()


@pytest.mark.parametrize("assignment", [
    'pat_str = "|".join(build_parts())',
    'pat_str = "|".join([p for p in PARTS])',
    'pat_str = "|".join([r"a", compute()])',
    'pat_str = ",".join([r"a", r"b"])',
    'pat_str = r"a|b"',
    'pat_str = "|".join([1, 2])',
])
def test_pat_str_must_be_a_joined_literal_list(tok_dir, tmp_path, assignment):
    d = copy_dir(tok_dir, tmp_path / "bad")
    (d / "tokenization_kimi.py").write_text(f"class TikTokenTokenizer:\n    {assignment}\n")
    with pytest.raises(TokenizerError) as info:
        load_encoding(d)
    assert isinstance(info.value, CheckpointError)
    assert "tokenization_kimi.py" in str(info.value) and "pat_str" in str(info.value)


def test_pat_str_missing_or_no_class(tok_dir, tmp_path):
    d = copy_dir(tok_dir, tmp_path / "bad")
    (d / "tokenization_kimi.py").write_text("class Other:\n    pat_str = '|'.join(['a'])\n")
    with pytest.raises(TokenizerError, match="TikTokenTokenizer"):
        load_encoding(d)
    (d / "tokenization_kimi.py").write_text("class TikTokenTokenizer:\n    pass\n")
    with pytest.raises(TokenizerError, match="pat_str"):
        load_encoding(d)


def test_malformed_ranks_file(tok_dir, tmp_path):
    d = copy_dir(tok_dir, tmp_path / "bad")
    f = d / "tiktoken.model"
    lines = f.read_text().splitlines()
    lines[300] = "not-base64!! x"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(TokenizerError, match=r"tiktoken.model: line 301"):
        load_encoding(d)


def test_bad_tokenizer_config_and_missing_files(tok_dir, tmp_path):
    d = copy_dir(tok_dir, tmp_path / "bad")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"][str(VOCAB - 256)]["content"] = 7
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match=f"added_tokens_decoder.{VOCAB - 256}.content"):
        load_encoding(d)
    os.remove(d / "tiktoken.model")
    with pytest.raises(MissingFileError, match="tiktoken.model"):
        load_encoding(d)
