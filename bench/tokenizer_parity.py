"""The full tokenizer parity sweep (the CTest test runs a subset): 100,000 generated
strings, the machine's real multilingual text (tokenizer_cases.machine_text) and a
10 MB corpus through nnstrain's tokenizer and the references (tokenizers and
tiktoken for GPT-2 and Llama 3), counting strings, bytes and mismatching ids,
checking decode(encode(x)) == x, and reporting the share of each vocabulary the
machine's text reaches.

    python bench/tokenizer_parity.py --nnstrain build/nnstrain [--strings 100000] [--corpus-mb 10]

Writes bench/results/tokenizer_parity_<UTC time>.json and .md. Exit status 1 on any mismatch.
"""
import argparse
import datetime
import importlib.metadata as md
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "reference"))
from bench_common import cpu_model, git_commit  # noqa: E402
import tokenizer_cases as tc  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nnstrain", default=str(HERE.parent / "build" / "nnstrain"))
    ap.add_argument("--strings", type=int, default=100_000)
    ap.add_argument("--corpus-mb", type=float, default=10)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="tok_parity_"))
    strings = tc.generated_strings(args.strings, seed=2024)
    text = tc.corpus(int(args.corpus_mb * 1e6), seed=9)
    corpus_path = tmp / "corpus.txt"
    corpus_path.write_bytes(text.encode())
    lj, lm = tc.llama3_files()
    trained = {}
    train_text = tc.generated_strings(3000, seed=11) + tc.corpus(200_000, seed=3).split("\n")
    for kind in ("gpt2", "llama3"):
        hf = tc.train_local(kind, train_text)
        p = tmp / f"trained_{kind}.json"
        hf.save(str(p))
        trained[kind] = (hf, p, tc.with_string_merges(p, tmp / f"trained_{kind}_strings.json"))

    def tiktoken_encoder(enc, policy):
        if policy == "text":
            return enc.encode_ordinary_batch
        return lambda texts: enc.encode_batch(texts, allowed_special="all")

    def hf_encoder(hf, policy, add_special):
        def run(texts):
            hf.encode_special_tokens = policy == "text"
            return [e.ids for e in hf.encode_batch(texts, add_special_tokens=add_special)]
        return run

    tk = tc.tiktoken_llama3()       # tokenizer.model, the pattern its tokenizer.json records
    tk_gpt2 = tc.tiktoken_gpt2()    # tiktoken's own GPT-2 pattern and file reader
    cases = []
    for policy in ("text", "special"):
        cases += [
            (f"GPT-2 encoder.json+vocab.bpe vs tokenizers ({policy})", tc.gpt2_files()[0],
             hf_encoder(tc.hf_gpt2_from_files(), policy, False), policy, False),
            (f"Llama 3 tokenizer.json vs tokenizers ({policy})", lj,
             hf_encoder(Tokenizer.from_file(str(lj)), policy, False), policy, False),
            (f"Llama 3 tokenizer.model vs tiktoken ({policy})", lm, tiktoken_encoder(tk, policy), policy, False),
            (f"GPT-2 encoder.json+vocab.bpe vs tiktoken ({policy})", tc.gpt2_files()[0],
             tiktoken_encoder(tk_gpt2, policy), policy, False),
        ]
    for kind, (hf, pairs, strs) in trained.items():
        cases.append((f"trained {kind}, merges as pairs (special, add_special)", pairs,
                      hf_encoder(hf, "special", kind == "llama3"), "special", kind == "llama3"))
        cases.append((f"trained {kind}, merges as strings (text)", strs, hf_encoder(hf, "text", False), "text", False))

    rows, failed = [], False
    nbytes = sum(len(s.encode()) for s in strings)
    for name, path, ref, policy, add_special in cases:
        extra = ["--special-tokens", policy] + (["--add-special"] if add_special else [])
        ours, _ = tc.nnstrain_encode(args.nnstrain, path, strings, tmp, *extra)  # --roundtrip: fails on a difference
        theirs = ref(strings)
        bad, first = tc.first_mismatch(strings, ours, theirs)
        rows.append({"case": name, "input": f"{len(strings)} generated strings", "strings": len(strings),
                     "bytes": nbytes, "ids": sum(map(len, ours)), "mismatches": bad, "roundtrip_failures": 0,
                     "first_mismatch": first})
        failed |= bad > 0
        print(f"{name}: {len(strings)} strings, {nbytes} bytes, {bad} mismatches", flush=True)
    # The machine's real text (as the CTest test reads it), and the share of each
    # vocabulary it reaches, alone and with the generated strings.
    docs = tc.machine_documents()
    docs_bytes = sum(len(d.encode()) for d in docs)
    for name, path, ref, vocab in (
            ("GPT-2 encoder.json+vocab.bpe vs tokenizers", tc.gpt2_files()[0],
             hf_encoder(tc.hf_gpt2_from_files(), "text", False), 50257),
            ("GPT-2 encoder.json+vocab.bpe vs tiktoken", tc.gpt2_files()[0], tk_gpt2.encode_ordinary_batch, 50257),
            ("Llama 3 tokenizer.json vs tokenizers", lj, hf_encoder(Tokenizer.from_file(str(lj)), "text", False),
             128256),
            ("Llama 3 tokenizer.model vs tiktoken", lm, tk.encode_ordinary_batch, 128256)):
        ours, _ = tc.nnstrain_encode(args.nnstrain, path, docs, tmp)
        bad, first = tc.first_mismatch(docs, ours, ref(docs))
        with_strings, _ = tc.nnstrain_encode(args.nnstrain, path, strings, tmp)
        share, share_all = tc.vocabulary_share(ours, vocab), tc.vocabulary_share(ours + with_strings, vocab)
        rows.append({"case": name, "input": f"the machine's text ({len(tc.machine_text())} sources)",
                     "strings": len(docs), "bytes": docs_bytes, "ids": sum(map(len, ours)), "mismatches": bad,
                     "roundtrip_failures": 0, "first_mismatch": first, "vocabulary_share": round(share, 4),
                     "vocabulary_share_with_strings": round(share_all, 4)})
        failed |= bad > 0
        print(f"{name}: machine text, {len(docs)} documents, {docs_bytes} bytes, {bad} mismatches; "
              f"{share:.1%} of the vocabulary ({share_all:.1%} with the generated strings)", flush=True)
    for name, path, hf in (("GPT-2 encoder.json+vocab.bpe vs tokenizers", tc.gpt2_files()[0], tc.hf_gpt2_from_files()),
                           ("Llama 3 tokenizer.json vs tokenizers", lj, Tokenizer.from_file(str(lj)))):
        hf.encode_special_tokens = True
        want = np.array(hf.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        out = tmp / "ids.bin"
        r = subprocess.run([args.nnstrain, "tokenize", "--tokenizer", str(path), "--input", str(corpus_path),
                            "--threads", "2", "--out", str(out), "--roundtrip"], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(r.stderr)
        got = np.fromfile(out, dtype="<i4")
        n = min(len(got), len(want))
        bad = int((got[:n] != want[:n]).sum()) + abs(len(got) - len(want))
        rows.append({"case": name, "input": f"{args.corpus_mb:g} MB corpus, one text, 2 threads", "strings": 1,
                     "bytes": corpus_path.stat().st_size, "ids": int(len(got)), "mismatches": bad,
                     "roundtrip_failures": 0, "first_mismatch": ""})
        failed |= bad > 0
        print(f"{name}: corpus {corpus_path.stat().st_size} bytes, {len(got)} ids, {bad} mismatching ids", flush=True)

    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"benchmark": "tokenizer_parity", "date": now.isoformat(timespec="seconds"), "commit": git_commit(),
              "device": f"{cpu_model()}", "versions": {p: md.version(p) for p in ("tokenizers", "tiktoken")},
              "results": rows}
    outdir = pathlib.Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    stem = outdir / f"tokenizer_parity_{now.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    lines = ["# Tokenizer parity: nnstrain vs tokenizers and tiktoken", "",
             f"- date: {now.strftime('%Y-%m-%d %H:%M UTC')}; commit {record['commit']}",
             f"- versions: {record['versions']}",
             "- every nnstrain run also decoded its ids and compared the bytes (--roundtrip): 0 failures", "",
             "| case | input | strings | bytes | ids | mismatches | vocabulary reached |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        share = (f"{r['vocabulary_share']:.1%} ({r['vocabulary_share_with_strings']:.1%} with the strings)"
                 if "vocabulary_share" in r else "")
        lines.append(f"| {r['case']} | {r['input']} | {r['strings']} | {r['bytes']} | {r['ids']} | {r['mismatches']} "
                     f"| {share} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.md")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
