"""The checkpoint's tokenizer as a `tiktoken.Encoding`, built without executing checkpoint code.

From a checkpoint directory (spec 2.6):
- `tiktoken.model`: one `base64(token bytes) rank` per line -> mergeable ranks 0..n-1;
- `tokenization_kimi.py`: parsed with `ast` (never imported or executed). Inside class
  `TikTokenTokenizer` the assignment `pat_str = "|".join([...])` must have a literal list of
  strings; it is evaluated with `ast.literal_eval` and joined with `|` (the split regex);
- `tokenizer_config.json`: the 256 special ids n..n+255 take their strings from
  `added_tokens_decoder[str(id)].content`, defaulting to `<|reserved_token_{id}|>`.

`Tokenizer(path)` wraps the encoding with `encode`, `decode`, `bos_id` and `eos_ids` ([EOS] and
<|end_of_msg|>, the tokens that stop generation). Malformed files raise `TokenizerError` (a
`CheckpointError`) naming the file and the line or key.
"""
from __future__ import annotations

import ast
import base64
import binascii
import json
import os
from typing import Iterable

from mk.io.schema import MissingFileError, TokenizerError

ENCODING_NAME = "kimi-k3-checkpoint"
NUM_SPECIAL = 256
RANKS_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
CODE_FILE = "tokenization_kimi.py"
END_TOKENS = ("[EOS]", "<|end_of_msg|>")


def _require(path: str, name: str) -> str:
    f = os.path.join(path, name)
    if not os.path.isfile(f):
        raise MissingFileError(f"{f}: tokenizer file not found")
    return f


def read_pat_str(file) -> str:
    """The split regex of `TikTokenTokenizer.pat_str` in a tokenization_kimi.py, via `ast` only."""
    file = os.fspath(file)
    try:
        with open(file, "rb") as f:
            tree = ast.parse(f.read(), filename=file)
    except SyntaxError as e:
        raise TokenizerError(f"{file}: not valid Python (line {e.lineno}): cannot read "
                             f"TikTokenTokenizer.pat_str") from None
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "TikTokenTokenizer"]
    if not classes:
        raise TokenizerError(f"{file}: no class TikTokenTokenizer (looking for TikTokenTokenizer.pat_str)")
    values = []
    for node in ast.walk(classes[0]):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        for t in targets:
            if (isinstance(t, ast.Name) and t.id == "pat_str") or (
                    isinstance(t, ast.Attribute) and t.attr == "pat_str"):
                values.append(node.value)
    if len(values) != 1:
        raise TokenizerError(f"{file}: expected exactly one assignment to TikTokenTokenizer.pat_str, "
                             f"found {len(values)}")
    v = values[0]
    where = f"{file}: line {v.lineno}: TikTokenTokenizer.pat_str"
    ok = (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "join"
          and isinstance(v.func.value, ast.Constant) and v.func.value.value == "|"
          and len(v.args) == 1 and not v.keywords and isinstance(v.args[0], (ast.List, ast.Tuple)))
    if not ok:
        raise TokenizerError(f"{where} must be '\"|\".join([...literal list...])'")
    try:
        parts = ast.literal_eval(v.args[0])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise TokenizerError(f"{where}: the joined list is not a literal list of strings") from None
    if not parts or not all(isinstance(p, str) for p in parts):
        raise TokenizerError(f"{where}: the joined list must be a non-empty list of strings")
    return "|".join(parts)


def read_ranks(file) -> dict[bytes, int]:
    """Mergeable ranks of a tiktoken.model file (ranks must be exactly 0..n-1, tokens unique)."""
    file = os.fspath(file)
    ranks: dict[bytes, int] = {}
    with open(file, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError
                tok, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (ValueError, binascii.Error):
                raise TokenizerError(f"{file}: line {lineno}: expected 'base64(token) rank'") from None
            if tok in ranks:
                raise TokenizerError(f"{file}: line {lineno}: token {tok!r} appears twice")
            ranks[tok] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{file}: ranks must be exactly 0..{len(ranks) - 1}, each once")
    if len(ranks) < 256:
        raise TokenizerError(f"{file}: {len(ranks)} ranks, a byte-level vocabulary needs at least 256")
    return ranks


def read_special_tokens(file, base: int) -> dict[str, int]:
    """The 256 special tokens (ids base..base+255) from tokenizer_config.json."""
    file = os.fspath(file)
    try:
        with open(file, "rb") as f:
            cfg = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{file}: not valid JSON ({e})") from None
    added = cfg.get("added_tokens_decoder", {}) if isinstance(cfg, dict) else None
    if not isinstance(added, dict):
        raise TokenizerError(f"{file}: key 'added_tokens_decoder' must be an object")
    special: dict[str, int] = {}
    for i in range(base, base + NUM_SPECIAL):
        entry = added.get(str(i))
        content = f"<|reserved_token_{i}|>"
        if entry is not None:
            if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
                raise TokenizerError(f"{file}: key 'added_tokens_decoder.{i}.content' must be a string")
            content = entry["content"]
        if content in special:
            raise TokenizerError(f"{file}: special token {content!r} used for ids {special[content]} and {i}")
        special[content] = i
    return special


def load_encoding(path):
    """The `tiktoken.Encoding` (name `kimi-k3-checkpoint`) of a checkpoint directory."""
    import tiktoken

    path = os.fspath(path)
    code = _require(path, CODE_FILE)
    pat_str = read_pat_str(code)
    ranks = read_ranks(_require(path, RANKS_FILE))
    special = read_special_tokens(_require(path, CONFIG_FILE), len(ranks))
    try:
        return tiktoken.Encoding(name=ENCODING_NAME, pat_str=pat_str, mergeable_ranks=ranks,
                                 special_tokens=special)
    except ValueError as e:
        raise TokenizerError(f"{code}: TikTokenTokenizer.pat_str is not a usable regex ({e})") from None


class Tokenizer:
    """encode/decode with the checkpoint's vocabulary; `bos_id`, `eos_ids` for generation."""

    def __init__(self, path_or_encoding):
        self.encoding = (load_encoding(path_or_encoding)
                         if isinstance(path_or_encoding, (str, os.PathLike)) else path_or_encoding)
        self.special_tokens: dict[str, int] = dict(self.encoding._special_tokens)
        self.bos_id = self.special_tokens.get("[BOS]")
        self.eos_ids = tuple(self.special_tokens[t] for t in END_TOKENS if t in self.special_tokens)

    @property
    def n_vocab(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, allow_special: "bool | Iterable[str]" = False) -> list[int]:
        """Token ids of `text`. Special-token strings in `text` become their special ids only when
        allowed (`True` = all, or a set of strings); otherwise they are encoded as plain text."""
        if allow_special is True:
            allowed = "all"
        elif allow_special is False or allow_special is None:
            allowed = set()
        else:
            allowed = set(allow_special)
        return self.encoding.encode(text, allowed_special=allowed, disallowed_special=())

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def token_id(self, special: str) -> int:
        return self.special_tokens[special]
