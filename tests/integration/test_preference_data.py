"""Preference data (issue 54, its first part): `nnstrain prepare corpus --format preference`
against TRL. Each pair is stored as three sequences (prompt, chosen completion, rejected
completion); prompt + completion must be the ids transformers gives the text TRL builds
(trl.data_utils: extract_prompt for an implicit prompt, apply_chat_template for messages;
the tokenizer's EOS text after a standard completion, as DPOTrainer appends it)."""
import json
import subprocess

import pytest

from chat_common import read_indexed, write_tokenizer
from conftest import SOURCE, nnstrain_bin_path, single_process_env

RECORDS = [
    {"prompt": "What is 2+2?", "chosen": " It is 4.", "rejected": " It is five, I think."},
    {"chosen": "The sky is blue today.", "rejected": "The sky is green."},  # implicit prompt
    {"chosen": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}],
     "rejected": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Go away."}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
     "chosen": [{"role": "assistant", "content": "Red."}], "rejected": [{"role": "assistant", "content": "No."}]},
]


def prepare(tmp_path, src, *extra, name="pref"):
    cmd = [nnstrain_bin_path(), "prepare", "corpus", "--format", "preference", "--tokenizer", str(tmp_path / "tok"),
           "--input", str(src), "--out", str(tmp_path / name), *extra]
    return subprocess.run(cmd, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture()
def hf(tmp_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(write_tokenizer(tmp_path / "tok", "chatml")))


def test_pairs_are_trls_ids(tmp_path, hf):
    from trl.data_utils import apply_chat_template, extract_prompt
    p = prepare(tmp_path, write(tmp_path / "p.jsonl", RECORDS))
    assert p.returncode == 0, p.stderr
    docs = read_indexed(tmp_path / "pref")
    assert [len(d) for d in docs] == [3] * len(RECORDS)
    for r, (prompt, chosen, rejected) in zip(RECORDS, docs):
        ex = r if "prompt" in r else extract_prompt(r)
        conversational = isinstance(ex["chosen"], list)
        if conversational:
            ex = apply_chat_template(ex, hf)
        eos = "" if conversational else hf.eos_token
        assert chosen != rejected and prompt and chosen and rejected  # the comparison means something
        for text, seq in ((ex["chosen"], chosen), (ex["rejected"], rejected)):
            assert prompt + seq == hf(ex["prompt"] + text + eos)["input_ids"], (r, ex)
        assert prompt == hf(ex["prompt"])["input_ids"][:len(prompt)]
    m = json.loads((tmp_path / "pref.manifest.json").read_text())
    assert m["sequences_per_document"] == "preference"


def test_bad_records_name_their_line(tmp_path, hf):
    bad = RECORDS[:1] + [{"prompt": "x", "chosen": "y"}] + RECORDS[1:2] + [{"prompt": "q", "chosen": " a", "rejected": " a"}]
    src = write(tmp_path / "bad.jsonl", bad)
    p = prepare(tmp_path, src)
    assert p.returncode != 0 and "bad.jsonl:2" in p.stderr and "rejected" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert not (tmp_path / "pref.manifest.json").exists()  # nothing that looks complete
    p = prepare(tmp_path, src, "--on-error", "skip")
    assert p.returncode == 0, p.stderr
    assert len(read_indexed(tmp_path / "pref")) == 2  # lines 2 and 4 skipped
