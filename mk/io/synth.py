"""Write synthetic Kimi K3 checkpoints in the exact Hugging Face format `mk.io.checkpoint` reads.

`write_checkpoint(cfg, out_dir, seed)` writes `mk.model.params.init(cfg, seed)` (or given params) with
the tensor names, PyTorch `[out, in]` orientation and dtypes of spec 2.2 (table: `mk.io.checkpoint.
layout`): bf16 matrices and norms, fp32 for the fp32 families, AttnRes as norm weight = 1.0 (fp32)
and proj = the folded fp32 vector `[1, d]` (so the loader's fold reproduces it exactly), routed
experts as MXFP4 (`weight_packed` / `weight_scale`). Plus size-limited shards, the index,
`config.json` from `cfg.to_hf()` and tokenizer files (a small byte-level BPE vocabulary learned
from a built-in English text, see `write_tokenizer`).

MXFP4 is lossy, so the weights a checkpoint holds are `quantized_params(cfg, seed)`: the init
params with every routed expert replaced by the dequantization of what is written. Loading a
synthetic checkpoint gives exactly that tree, bit for bit.
"""
from __future__ import annotations

import base64
import heapq
import json
import os
import re
from collections import Counter

import ml_dtypes
import numpy as np

from mk.io.schema import BF16, CONFIG_FILE, INDEX_FILE, _NP_DTYPES, Entry, layout
from mk.io.convert import _transpose_into
from mk.model.config import MX_GROUP
from mk.model.config import K3Config

DEFAULT_SHARD_BYTES = 256 << 20
EXPERT_FAMILIES = ("w1", "w3", "w2")


# ---- MXFP4 quantization ------------------------------------------------------------------------------
def quantize_mxfp4(w) -> tuple[np.ndarray, np.ndarray]:
    """w [..., K, N] (our [in, out]) -> (packed u8 [..., N, K/2], scale u8 [..., N, K/32]).

    Per output row and group of 32 consecutive inputs: the smallest power-of-two scale 2^s with
    max|w| / 2^s <= 6 (E8M0 byte s + 127, kept in 1..254), then the nearest E2M1 code
    (ml_dtypes' round-to-nearest-even cast); element 2j in the low nibble.
    """
    x = np.swapaxes(np.asarray(w, np.float32), -1, -2)  # [..., N, K]
    *lead, n, k = x.shape
    if k % MX_GROUP:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {MX_GROUP}, found {k}")
    g = x.reshape(*lead, n, k // MX_GROUP, MX_GROUP)
    amax = np.abs(g).max(-1)
    mant, ex = np.frexp(amax / np.float32(6.0))            # amax/6 = mant * 2^ex, mant in [0.5, 1)
    s = np.where(mant == 0.5, ex - 1, ex).astype(np.int32)  # ceil(log2(amax / 6))
    s = np.where(amax == 0, 0, s)
    s = np.where(np.ldexp(np.float32(6.0), s) < amax, s + 1, s)  # guard the rounding of amax / 6
    e = np.clip(s + 127, 1, 254).astype(np.int32)
    step = np.ldexp(np.float32(1.0), e - 127).astype(np.float32)
    codes = (g / step[..., None]).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15
    codes = codes.reshape(*lead, n, k)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, e.astype(np.uint8)


def dequantize_reference(packed, scale) -> np.ndarray:
    """The plain spec-2.3 dequantization via ml_dtypes' float4_e2m1fn / float8_e8m0fnu types:
    packed [..., N, K/2], scale [..., N, K/32] -> bf16 [..., K, N]. (The loader's fast table path,
    `mk.io.convert.dequantize_mxfp4`, must agree with it bit for bit.)"""
    packed, scale = np.asarray(packed, np.uint8), np.asarray(scale, np.uint8)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    steps = np.repeat(scale.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), MX_GROUP, axis=-1)
    with np.errstate(over="ignore"):  # 6 * 2^127 overflows to inf, as in bf16
        return np.swapaxes((vals * steps).astype(BF16), -1, -2)


def quantized_params(cfg: K3Config, seed: int = 0, params: dict | None = None) -> dict:
    """What a synthetic checkpoint of (cfg, seed) holds: `mk.model.params.init(cfg, seed)` (or `params`)
    with the routed experts moe.w1/w3/w2 replaced by their MXFP4-dequantized values (bf16)."""
    return _quantize_tree(cfg, seed, params)[0]


def mxfp4_params(cfg: K3Config, seed: int = 0, params: dict | None = None) -> tuple[dict, dict]:
    """(packed, dequantized): what `mk.io.checkpoint.load(..., experts="mxfp4")` and `load(...)` give
    for a synthetic checkpoint of (cfg, seed) (or of `params`), without writing it. In `packed`,
    moe.w1/w3/w2 are {"packed": u8 [n_moe, E, N, K/2], "scale": u8 [n_moe, E, N, K/32]}."""
    deq, q = _quantize_tree(cfg, seed, params)
    packed = {k: (dict(v) if isinstance(v, dict) else v) for k, v in deq.items()}
    for w, (p, s) in q.items():
        packed["moe"][w] = {"packed": p, "scale": s}
    return packed, deq


def _quantize_tree(cfg, seed, params):
    import jax.numpy as jnp

    if params is None:
        from mk.model.params import init
        params = init(cfg, seed)
    q = {}
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in params.items()}
    for w in EXPERT_FAMILIES:
        # One MoE layer at a time, so the fp32 intermediates stay one layer's size (peak host
        # memory for a 1.36 GB checkpoint: 15.8 -> 14.3 GB; the rest is mk.model.params.init).
        fam = params["moe"][w]                                  # [n_moe, E, K, N]
        K, N = fam.shape[-2:]
        packed = np.empty((*fam.shape[:-2], N, K // 2), np.uint8)
        scale = np.empty((*fam.shape[:-2], N, K // MX_GROUP), np.uint8)
        deq = np.empty(fam.shape, BF16)
        for m in range(fam.shape[0]):
            packed[m], scale[m] = quantize_mxfp4(fam[m])
            deq[m] = dequantize_reference(packed[m], scale[m])
        q[w] = (packed, scale)
        out["moe"][w] = jnp.asarray(deq)
    return out, q


# ---- checkpoint writing ----------------------------------------------------------------------------
def _tensors(entry: Entry, params: dict, q: dict) -> dict[str, np.ndarray]:
    """The checkpoint tensor(s) of one layout entry, from params (our layout)."""
    if entry.kind == "mxfp4":
        packed, scale = q[entry.dest[1]]
        return {entry.sources[0].name: np.ascontiguousarray(packed[entry.index]),
                entry.sources[1].name: np.ascontiguousarray(scale[entry.index])}
    fam = params
    for k in entry.dest:
        fam = fam[k]
    return _slot_tensors(entry, np.asarray(fam[entry.index] if entry.index else fam))


def _slot_tensors(entry: Entry, x: np.ndarray) -> dict[str, np.ndarray]:
    """The checkpoint tensor(s) of a (not MXFP4) layout entry whose tree slot holds `x`."""
    src = entry.sources[0]
    dt = _NP_DTYPES[src.dtypes[0]]
    if entry.kind == "copy":
        t = x.astype(dt)
    elif entry.kind == "T":
        t = np.empty(x.shape[::-1], dt)
        _transpose_into(t, x.astype(dt, copy=False))
    elif entry.kind == "conv":
        t = np.ascontiguousarray(x.T[:, None, :].astype(dt))
    elif entry.kind == "fold":  # norm = 1, proj = the folded vector: the product is exact
        norm, proj = entry.sources
        return {norm.name: np.ones(norm.shape, _NP_DTYPES[norm.dtypes[0]]),
                proj.name: x.astype(_NP_DTYPES[proj.dtypes[0]]).reshape(proj.shape)}
    else:  # pragma: no cover
        raise AssertionError(entry.kind)
    assert t.shape == src.shape, (src.name, t.shape, src.shape)
    return {src.name: np.ascontiguousarray(t)}


def _entry_bytes(entry: Entry) -> int:
    return sum(int(np.prod(s.shape)) * _NP_DTYPES[s.dtypes[0]].itemsize for s in entry.sources)


def write_checkpoint(cfg: K3Config, out_dir, seed: int = 0, params: dict | None = None,
                     shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = False,
                     tokenizer: bool = True) -> dict:
    """Write a checkpoint of `params` (default `mk.model.params.init(cfg, seed)`) to `out_dir`.

    Shards hold at most `shard_bytes` each (a single bigger tensor gets a shard of its own).
    Returns the parameter tree the checkpoint holds (= `quantized_params(cfg, seed, params)`),
    which `mk.io.checkpoint.load(out_dir)` reproduces bit for bit.
    """
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    entries = layout(cfg)
    qparams, q = _quantize_tree(cfg, seed, params)
    base = params if params is not None else qparams  # non-expert leaves are identical in both

    shards = _shards(entries, shard_bytes)
    for i, group in enumerate(tqdm(shards, desc="writing shards", disable=not progress, leave=False)):
        tensors = {}
        for e in group:
            tensors.update(_tensors(e, base, q))
        save_file(tensors, os.path.join(out_dir, _shard_name(i, len(shards))), metadata={"format": "pt"})
        del tensors
    _write_index_and_config(cfg, out_dir, shards, tokenizer)
    return qparams


def _shards(entries: "list[Entry]", shard_bytes: int) -> list[list[Entry]]:
    """Layout entries cut into shards of at most `shard_bytes` (a bigger entry alone in its own)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        b = _entry_bytes(e)
        if shards[-1] and size + b > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += b
    return shards


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _write_index_and_config(cfg: K3Config, out_dir: str, shards: "list[list[Entry]]", tokenizer: bool):
    weight_map = {src.name: _shard_name(i, len(shards)) for i, group in enumerate(shards) for e in group
                  for src in e.sources}
    total = sum(_entry_bytes(e) for group in shards for e in group)
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)
    if tokenizer:
        write_tokenizer(out_dir, cfg.vocab)


def write_random_checkpoint(cfg: K3Config, out_dir, seed: int = 0, shard_bytes: int = DEFAULT_SHARD_BYTES,
                            threads: int | None = None, progress: bool = False, tokenizer: bool = True):
    """Write a checkpoint of random weights drawn tensor by tensor in the checkpoint's own layout, for
    checkpoints too big for `write_checkpoint` (whose `init` + MXFP4 quantization took ~190 s for
    1.36 GB on a TPU VM's host): here no parameter tree is built and nothing is quantized. The
    weights are valid but not `write_checkpoint`'s (nothing reproduces them): routed experts
    uniformly random E2M1 code bytes with E8M0 scales as `mk.model.params.init_fast(...,
    experts="mxfp4")` draws them (`init`'s std within a factor 2); bf16 matrices random bits: random
    sign and mantissa, one exponent per tensor that gives `init`'s std within a factor 1.5 (numpy's
    normal draw is ~10x slower); the rest (embedding, norms, conv taps, decays, router biases) drawn
    as `init` draws them (`mk.model.params.draw`). Shards are drawn and written by `threads` threads
    (default: one per CPU); deterministic in (cfg, seed, shard_bytes)."""
    import concurrent.futures
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    shards = _shards(layout(cfg), shard_bytes)

    def write(i: int):
        rng = np.random.default_rng([seed, i])
        tensors = {}
        for e in shards[i]:
            tensors.update(_random_tensors(cfg, e, rng))
        save_file(tensors, os.path.join(out_dir, _shard_name(i, len(shards))), metadata={"format": "pt"})

    with concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool, \
            tqdm(total=len(shards), desc="writing shards", disable=not progress, leave=False) as bar:
        for fut in concurrent.futures.as_completed([pool.submit(write, i) for i in range(len(shards))]):
            fut.result()
            bar.update(1)
    _write_index_and_config(cfg, out_dir, shards, tokenizer)


def _random_tensors(cfg: K3Config, entry: Entry, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random checkpoint tensor(s) of one layout entry (see `write_random_checkpoint`)."""
    from mk.model.params import _family, draw, mxfp4_scale_byte

    src = entry.sources[0]
    if entry.kind == "mxfp4":                          # packed [N, K/2], scale [N, K/32]
        (n, half), ssrc = src.shape, entry.sources[1]
        std = _family(cfg, entry.dest, (2 * half, n))[1]
        byte = mxfp4_scale_byte(std)
        return {src.name: rng.integers(0, 256, src.shape, dtype=np.uint8),
                ssrc.name: (byte - rng.integers(0, 2, ssrc.shape, dtype=np.uint8)).astype(np.uint8)}
    if entry.kind == "T":                              # a bf16 matrix [out, in]
        std = _family(cfg, entry.dest, src.shape[::-1])[1]
        bits = rng.integers(0, 1 << 16, src.shape, dtype=np.uint16)
        bits &= 0x807F                                 # sign and mantissa; |x| in [2^p, 2^(p+1)): RMS 1.53 * 2^p
        bits |= np.uint16((int(round(np.log2(std / 1.53))) + 127) << 7)
        return {src.name: bits.view(BF16)}
    slot = (src.shape[2], src.shape[0]) if entry.kind == "conv" else src.shape   # tree orientation ([HD, 1, C] -> [C, HD])
    return _slot_tensors(entry, draw(cfg, entry.dest, (1,) + slot, rng)[0])


# ---- tokenizer files ---------------------------------------------------------------------------------
NUM_SPECIAL = 256
SPECIAL_TOKENS = ("[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|sep|>", "<|close|>")

# Split regex of the synthetic tokenizer (GPT-4-like, with a Han-script chunk as in Kimi's).
PAT_STR_PARTS = [
    r"[\p{Han}]+",
    r"'(?i:[sdmt]|ll|ve|re)",
    r"[^\r\n\p{L}\p{N}]?\p{L}+",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
]
# The same split on ASCII text, for training with Python's `re` (no \p{..} there).
_ASCII_SPLIT = re.compile(r"'(?i:[sdmt]|ll|ve|re)|[^\r\na-zA-Z0-9]?[a-zA-Z]+|[0-9]{1,3}"
                          r"| ?[^\sa-zA-Z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

TRAINING_TEXT = """\
The morning train left the valley just after six, when the fog was still lying low over the river.
Most of the passengers were farmers on their way to the market in town, carrying baskets of apples,
pears, onions and fresh bread. A young teacher sat by the window and read a letter from her sister,
who had moved to the coast two years ago and now worked in a small harbour office.
"We count the boats every evening," the letter said, "and write down how much fish they bring back.
It is simple work, but I like the sound of the gulls and the smell of salt in the air."

In the old library of the town there are more than forty thousand books. Some of them are so old
that their pages have turned yellow and brittle, and the librarian wears cotton gloves when she
turns them. Students come on Saturdays to study history, mathematics, chemistry and music. They
whisper questions to each other, take notes, and sometimes fall asleep with their heads on the
tables. Nobody minds; the library has always been a quiet and patient place.

A good recipe for vegetable soup begins with patience. Chop two carrots, one large potato, a stalk
of celery and half an onion. Warm a spoon of olive oil in a heavy pot, add the onion first and let
it soften slowly. Then add the other vegetables, a little salt, black pepper and enough water to
cover everything. Let it simmer for thirty minutes. Taste it, adjust the seasoning, and serve it
with a slice of warm bread and perhaps a piece of cheese.

Computers follow instructions exactly as they are written, which is both their strength and their
weakness. A program that adds numbers, sorts names or draws pictures on a screen is nothing more
than a long list of small, precise steps. When a result is wrong, the mistake is almost always in
the instructions, not in the machine. Good programmers therefore test their work carefully: they
check small cases by hand, compare results with a simpler method, and write down what they expect
before they look at what they get.

The weather changed quickly in the mountains. At noon the sky was clear and blue, but by three
o'clock dark clouds had gathered above the northern ridge and the wind began to whistle through
the pines. The hikers decided to turn back. They walked down the narrow path in silence, listening
to the first drops of rain on their jackets, and reached the shelter just before the storm broke.
Inside, someone lit a fire, someone else made tea, and soon everybody was laughing about the wet
socks hanging over the stove.

Music can travel where words cannot. A simple melody played on a violin, a piano or a wooden flute
can make a crowded room fall silent. Children learn songs long before they learn to read, and old
people often remember the tunes of their youth when other memories have faded. Every culture has
its own instruments, rhythms and scales, yet a lullaby sounds gentle in any language.

On Monday the city council met to discuss the new bridge. The engineers presented three designs:
a steel arch, a concrete beam and a light suspension bridge for bicycles and pedestrians. Each
design had advantages. The arch was elegant, the beam was cheap, and the suspension bridge would
let the ferries pass underneath without waiting. After a long debate the council voted for the
third option, and construction will begin next spring if the budget is approved in time.

Gardens teach us to wait. Seeds planted in April may not show a single green leaf for weeks, and
tomatoes need the whole summer to ripen. A gardener learns to read the soil, the clouds and the
colour of the leaves. Too much water drowns the roots; too little makes the plants weak. The best
gardeners are curious: they try new varieties every year, keep notes, and share their seeds with
neighbours over the fence.

Stars appear to move across the night sky because the earth turns on its axis once a day. Long ago,
sailors used the positions of the stars to find their way across the ocean, measuring angles with
simple instruments and careful tables. Today satellites tell us where we are within a few metres,
but on a dark night far from the city lights the sky still looks exactly as it did to them:
countless small points of light, some bright and steady, some faint and trembling.

Numbers such as 7, 12, 365 and 2024 appear everywhere in daily life: seven days in a week, twelve
months in a year, three hundred and sixty five days in most years. A careful shopkeeper adds up the
prices of bread, milk, eggs and butter, gives the right change, and writes the total in a ledger.
Questions? Answers! Lists; colons: dashes - and brackets (like these) are all part of writing too.

Friendship grows from small kindnesses: a message on a difficult day, a meal shared after a long
journey, an honest word when it is needed most. Friends argue sometimes, forgive each other, and
remember the funny stories for years. Whenever people ask what makes a life rich, many of them do
not mention money at all; they talk about the people who stood beside them.
"""


def train_bpe(n_ranks: int, text: str = TRAINING_TEXT) -> list[bytes]:
    """Byte-level BPE vocabulary: the 256 single bytes (rank = byte value), then merges learned
    on `text` split like the tokenizer's regex, most frequent pair first (ties: lowest ids). When
    the text has no pairs left, merges continue across split boundaries (tokens the encoder never
    produces but that keep the vocabulary exactly `n_ranks` long), then filler byte pairs."""
    vocab = [bytes([b]) for b in range(256)]
    for pieces in (_ASCII_SPLIT.findall(text), text.split("\n")):
        if len(vocab) >= n_ranks:
            break
        _merge(vocab, Counter(p.encode() for p in pieces if p), n_ranks)
    if len(vocab) < n_ranks:  # text exhausted: fill with unused byte strings
        have = set(vocab)
        width = 2
        while len(vocab) < n_ranks:
            for i in range(256 ** width):
                tok = i.to_bytes(width, "big")
                if tok not in have:
                    vocab.append(tok)
                    have.add(tok)
                    if len(vocab) >= n_ranks:
                        break
            width += 1
    return vocab[:n_ranks]


def _merge(vocab: list[bytes], words: Counter, n_ranks: int):
    ids = {t: i for i, t in enumerate(vocab)}
    seqs = [_retokenize(w, ids) for w in words]
    freq = list(words.values())
    counts: Counter = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for wi, s in enumerate(seqs):
        for pair in zip(s, s[1:]):
            counts[pair] += freq[wi]
            where.setdefault(pair, set()).add(wi)
    heap = [(-c, p) for p, c in counts.items()]
    heapq.heapify(heap)
    while len(vocab) < n_ranks and heap:
        negc, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -negc or negc == 0:
            continue
        tok = vocab[pair[0]] + vocab[pair[1]]
        if tok in ids:  # already a token (reachable another way): drop the pair
            counts.pop(pair)
            continue
        new = len(vocab)
        vocab.append(tok)
        ids[tok] = new
        for wi in sorted(where.pop(pair, ())):
            s, f = seqs[wi], freq[wi]
            for old in zip(s, s[1:]):
                counts[old] -= f
            merged, j = [], 0
            while j < len(s):
                if j + 1 < len(s) and (s[j], s[j + 1]) == pair:
                    merged.append(new)
                    j += 2
                else:
                    merged.append(s[j])
                    j += 1
            seqs[wi] = merged
            touched = set()
            for p in zip(merged, merged[1:]):
                counts[p] += f
                where.setdefault(p, set()).add(wi)
                touched.add(p)
            for p in touched:
                heapq.heappush(heap, (-counts[p], p))
        counts.pop(pair, None)


def _retokenize(word: bytes, ids: dict[bytes, int]) -> list[int]:
    """Greedy longest-match split of a word into existing tokens (single bytes at worst)."""
    out, i = [], 0
    while i < len(word):
        for j in range(len(word), i, -1):
            t = ids.get(word[i:j])
            if t is not None:
                out.append(t)
                i = j
                break
    return out


def write_tokenizer(out_dir, vocab_size: int):
    """tiktoken.model + tokenizer_config.json + tokenization_kimi.py for a model of `vocab_size`
    (ordinary ranks + 256 specials == vocab_size when vocab_size >= 512)."""
    out_dir = os.fspath(out_dir)
    n_ranks = max(256, vocab_size - NUM_SPECIAL)
    vocab = train_bpe(n_ranks)
    with open(os.path.join(out_dir, "tiktoken.model"), "w") as f:
        for rank, tok in enumerate(vocab):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    added = {str(n_ranks + i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                "single_word": False, "special": True}
             for i, s in enumerate(SPECIAL_TOKENS)}
    config = {
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "model_max_length": 1 << 20,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    parts = "".join(f"            {p!r},\n" for p in PAT_STR_PARTS)
    with open(os.path.join(out_dir, "tokenization_kimi.py"), "w") as f:
        f.write(TOKENIZATION_TEMPLATE.replace("@PARTS@", parts))


TOKENIZATION_TEMPLATE = '''\
"""Tokenizer of a synthetic mk checkpoint (tiktoken BPE). mk reads `pat_str` from this file with
`ast` and never imports it."""
import tiktoken


class TikTokenTokenizer:
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    num_reserved_special_tokens = 256
    pat_str = "|".join(
        [
@PARTS@        ]
    )

    def __init__(self, vocab_file, **kwargs):
        from tiktoken.load import load_tiktoken_bpe
        self.model = tiktoken.Encoding(name="synthetic", pat_str=self.pat_str,
                                       mergeable_ranks=load_tiktoken_bpe(vocab_file),
                                       special_tokens={})
'''
