"""`nnstrain prepare corpus` writes Megatron .bin/.idx that Megatron-Core's own
IndexedDataset reads, holding exactly the ids Hugging Face `tokenizers` gives for
each document; a manifest binds them to tokenizer, inputs and settings; a rerun
writes nothing; a malformed record names its file and line.
"""
import json
import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tokenizer_cases as tc  # noqa: E402

BIN = os.environ.get("NNSTRAIN_BIN")
pytestmark = pytest.mark.skipif(not BIN, reason="NNSTRAIN_BIN not set (CTest sets it)")

ALPACA_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n### Instruction:\n{}"
                     "\n\n### Input:\n{}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{}\n\n### Response:\n")


def prepare(*args):
    return subprocess.run([BIN, "prepare", "corpus", *map(str, args)], capture_output=True, text=True)


def megatron(prefix):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    return IndexedDataset(str(prefix), multimodal=False, mmap=True)


def hf_ids(hf, texts):
    hf.encode_special_tokens = True
    return [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]


@pytest.fixture(scope="module")
def docs():
    return [s for s in tc.generated_strings(400, seed=3) if s] + ["plain English text, it's fine.\n\nTwo paras."]


@pytest.mark.parametrize("which", ["gpt2", "llama3"])
def test_megatron_core_reads_our_files(tmp_path, docs, which):
    from tokenizers import Tokenizer
    if which == "gpt2":
        tok, hf = tc.gpt2_files()[0], tc.hf_gpt2_from_files()
    else:
        tok, hf = tc.llama3_files()[0], Tokenizer.from_file(str(tc.llama3_files()[0]))
    half = len(docs) // 2
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:half])))
    raw = "".join(json.dumps({"text": d}) + "\n" for d in docs[half:]).encode()
    subprocess.run(["zstd", "-q", "-o", str(tmp_path / "b.jsonl.zst")], input=raw, check=True)
    r = prepare("--tokenizer", tok, "--input", tmp_path / "a.jsonl", "--input", tmp_path / "b.jsonl.zst",
                "--out", tmp_path / "out" / "corpus", "--threads", 2)
    assert r.returncode == 0, r.stderr
    ds = megatron(tmp_path / "out" / "corpus")
    want = hf_ids(hf, docs)
    assert len(ds) == len(docs)
    assert list(ds.document_indices) == list(range(len(docs) + 1))
    assert ds.index.dtype == (np.uint16 if which == "gpt2" else np.int32)
    for i, ids in enumerate(want):
        assert ds[i].tolist() == ids, i
    m = json.loads((tmp_path / "out" / "corpus.manifest.json").read_text())
    assert m["documents"] == len(docs) and m["tokens"] == sum(map(len, want))
    assert [i["path"] for i in m["inputs"]] == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.zst")]
    assert m["tokenizer"]["vocab_size"] == (50257 if which == "gpt2" else 128256)


def test_rerun_writes_nothing_and_a_changed_input_rebuilds(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text('{"text": "one"}\n{"text": "two three"}\n')
    out = tmp_path / "ds"
    args = ("--tokenizer", tc.gpt2_files()[0], "--input", src, "--out", out)
    assert prepare(*args).returncode == 0
    stamps = [os.stat(f"{out}.{e}").st_mtime_ns for e in ("bin", "idx", "manifest.json")]
    r = prepare(*args)
    assert r.returncode == 0 and "up to date" in r.stdout
    assert [os.stat(f"{out}.{e}").st_mtime_ns for e in ("bin", "idx", "manifest.json")] == stamps
    src.write_text('{"text": "one"}\n{"text": "two three four"}\n')
    r = prepare(*args)
    assert r.returncode == 0 and "up to date" not in r.stdout
    ds = megatron(out)  # kept alive: its arrays view its mapping, closed when it goes
    assert ds[1].tolist() == tc.hf_gpt2_from_files().encode("two three four").ids


def test_text_folder_and_separator(tmp_path):
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("second file\n")
    (d / "sub" / "c.txt").write_text("third\n\nfourth")
    (d / "a.txt").write_text("first file")
    hf = tc.hf_gpt2_from_files()
    r = prepare("--tokenizer", tc.gpt2_files()[0], "--input", d, "--out", tmp_path / "one")
    assert r.returncode == 0, r.stderr
    ds = megatron(tmp_path / "one")
    assert [ds[i].tolist() for i in range(len(ds))] == hf_ids(hf, ["first file", "second file\n", "third\n\nfourth"])
    r = prepare("--tokenizer", tc.gpt2_files()[0], "--input", d, "--out", tmp_path / "sep", "--separator", "\\n\\n")
    assert r.returncode == 0, r.stderr
    ds = megatron(tmp_path / "sep")
    assert [ds[i].tolist() for i in range(len(ds))] == hf_ids(hf, ["first file", "second file\n", "third", "fourth"])


def test_alpaca_records_are_prompt_then_response(tmp_path):
    recs = [{"instruction": "Give a synonym.", "input": "happy", "output": "Joyful."},
            {"instruction": "Name a colour.", "input": "", "output": "Blue"}]
    (tmp_path / "alpaca.json").write_text(json.dumps(recs))
    r = prepare("--tokenizer", tc.gpt2_files()[0], "--input", tmp_path / "alpaca.json", "--out", tmp_path / "al")
    assert r.returncode == 0, r.stderr
    ds = megatron(tmp_path / "al")
    assert list(ds.document_indices) == [0, 2, 4]
    hf = tc.hf_gpt2_from_files()
    want = hf_ids(hf, [ALPACA_WITH_INPUT.format("Give a synonym.", "happy"), "Joyful.",
                       ALPACA_NO_INPUT.format("Name a colour."), "Blue"])
    assert [ds[i].tolist() for i in range(4)] == want
    assert json.loads((tmp_path / "al.manifest.json").read_text())["sequences_per_document"] == 2


def test_malformed_record_stops_or_is_skipped(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text('{"text": "fine"}\n{"text": 5}\n{"oops"\n{"text": "also fine"}\n')
    out = tmp_path / "ds"
    r = prepare("--tokenizer", tc.gpt2_files()[0], "--input", src, "--out", out)
    assert r.returncode == 1 and f"{src}:2: no string field 'text'" in r.stderr
    assert r.stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]  # nothing written, no temporaries
    r = prepare("--tokenizer", tc.gpt2_files()[0], "--input", src, "--out", out, "--on-error", "skip")
    assert r.returncode == 0 and "skipped 2" in r.stdout
    assert f"{src}:3: not a JSON object" in r.stderr
    assert len(megatron(out)) == 2
    assert json.loads((tmp_path / "ds.manifest.json").read_text())["skipped_records"] == 2


def test_invalid_utf8_names_the_record(tmp_path):
    src = tmp_path / "t.txt"
    src.write_bytes(b"good\n\nbad \xff here")
    r = prepare("--tokenizer", tc.gpt2_files()[0], "--input", src, "--out", tmp_path / "x", "--separator", "\\n\\n")
    assert r.returncode == 1 and f"{src}:3: text is not valid UTF-8 at byte 4" in r.stderr, r.stderr


def test_parquet_and_usage_errors(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    r = prepare("--tokenizer", tc.gpt2_files()[0], "--input", tmp_path / "d.parquet", "--out", tmp_path / "x")
    assert r.returncode == 2 and "Parquet is not supported" in r.stderr and "to_json" in r.stderr
    r = prepare("--tokenizer", tc.gpt2_files()[0], "--input", tmp_path / "missing.jsonl", "--out", tmp_path / "x")
    assert r.returncode == 2 and "no such file" in r.stderr
    r = prepare("--tokenizer", tc.gpt2_files()[0], "--input", tmp_path / "d.parquet", "--out", tmp_path / "x",
                "--format", "csv")
    assert r.returncode == 2 and "--format" in r.stderr
