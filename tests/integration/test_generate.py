"""`nnstrain generate` through the binary (CPU).

- Hugging Face: a small random GPT2LMHeadModel and a small random LlamaForCausalLM
  (GQA), saved by save_pretrained; `nnstrain generate DIR --temperature 0` gives the
  ids of their generate(do_sample=False), with and without the KV cache;
- a char-level run trained under tensor parallelism (tp2, 2 processes) on text that
  `nnstrain prepare text` tokenised: generate from its tp2 checkpoint equals generate
  from the same weights merged (`nnstrain merge`), the greedy ids equal
  GPT2LMHeadModel.generate on the `merge --hf` folder, the text is the meta.json
  decoding of the ids (done here in Python), found without --tokenizer;
- sampling: a seed reproduces and another differs; --top-k 1 is greedy;
- bad inputs (a missing checkpoint, bad option values, a character outside the
  vocabulary) exit non-zero with one line naming the fault.
"""
import json
import pathlib
import random
import subprocess

import pytest
import torch

from conftest import CONFIGS, SOURCE, nnstrain_bin_path, single_process_env

transformers = pytest.importorskip("transformers")


def generate(*args, check=True):
    p = subprocess.run([nnstrain_bin_path(), "generate", *[str(a) for a in args]], cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=240)
    if check:
        assert p.returncode == 0, f"nnstrain generate {' '.join(map(str, args))}\n{p.stdout}{p.stderr}"
    return p


def samples(p):
    return [json.loads(line) for line in p.stdout.splitlines() if line.strip()]


def hf_greedy(model, prompt, n):
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPT = [5, 17, 3, 30, 8, 1]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_folder_greedy_equals_transformers_generate(arch, tmp_path):
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=80, n_positions=48, n_embd=32, n_layer=2, n_head=2,
                                      activation_function="gelu", initializer_range=0.2,
                                      bos_token_id=None, eos_token_id=None)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=90, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                                       initializer_range=0.3, bos_token_id=None, eos_token_id=None,
                                       pad_token_id=None)
        model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "hf")
    n = 30
    want = hf_greedy(model, PROMPT, n)
    assert len(set(want)) > 3, f"a degenerate reference sequence: {want}"
    ids = ",".join(map(str, PROMPT))
    for extra in ([], ["--no-kv-cache"]):
        p = generate(tmp_path / "hf", "--prompt-ids", ids, "--temperature", 0, "--max-new-tokens", n, "--json",
                     "--device", "cpu", *extra)
        (s,) = samples(p)
        assert s["prompt_ids"] == PROMPT
        assert s["ids"] == want, f"{arch} {extra}: nnstrain {s['ids']} vs transformers {want}"


WORDS = "the cat sat on a mat and ran to see my dog who is fat but not very quick".split()


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    """A tiny GPT trained 30 steps at tp2 on char-level text; its checkpoint, merged copies and meta.json."""
    d = tmp_path_factory.mktemp("gen")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(3000)]
    (d / "input.txt").write_text("\n".join(lines) + "\n")
    p = subprocess.run([nnstrain_bin_path(), "prepare", "text", "--input", d / "input.txt", "--out", d / "data",
                        "--level", "char"], cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    meta = json.loads((d / "data" / "meta.json").read_text())
    assert meta["vocab_size"] <= 64
    args = ["--config", CONFIGS / "tiny_gpt.yaml", "--run_dir", d / "run", "--vars.data", d / "data" / "train.bin",
            "--vars.seq_len", 48,  # room for a prompt and 40 tokens: transformers' GPT-2 stops at n_positions
            "--checkpoint.save_dir", d / "ckpt", "--checkpoint.every_n_train_steps", 30, "--max_train_steps", 30,
            "--compute_config.plan_ngpus", 2, "--pas_policy", "tp", "--compute_config.device", "cpu"]
    p = subprocess.run([nnstrain_bin_path(), "launch", "--nproc-per-node", "2", "--", *map(str, args)], cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    ckpt = d / "ckpt" / "step-00000030"
    for out, extra in ((d / "merged", []), (d / "merged_hf", ["--hf"])):
        p = subprocess.run([nnstrain_bin_path(), "merge", ckpt, "--out", out, *extra], cwd=SOURCE,
                           env=single_process_env(1), capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
    return {"dir": d, "ckpt": ckpt, "meta": meta}


def test_tp2_checkpoint_equals_merged_and_transformers(char_run):
    ckpt, meta = char_run["ckpt"], char_run["meta"]
    # The checkpoint really is split: rank 0 stores part of c_attn's rows (its heads' Q, K, V).
    manifest = json.loads((ckpt / "manifest.json").read_text())
    (piece,) = [e for e in manifest["files"]["rank-00000.safetensors"] if e["name"] == "model/h.0.attn.c_attn.weight"]
    assert piece["global_shape"] == [96, 32] and piece["shape"] == [16, 32] and len(piece["more_blocks"]) == 2
    common = ["--prompt", "the ", "--max-new-tokens", 40, "--json", "--device", "cpu"]
    greedy = ["--temperature", 0]
    sampled = ["--temperature", 0.8, "--top-k", 10, "--seed", 7, "--num-samples", 2]
    for mode in (greedy, sampled):
        from_tp2 = samples(generate(ckpt, *common, *mode))
        from_merged = samples(generate(char_run["dir"] / "merged", *common, *mode))
        from_hf_names = samples(generate(char_run["dir"] / "merged_hf", *common, *mode,
                                         "--tokenizer", char_run["dir"] / "data" / "meta.json"))
        assert [s["ids"] for s in from_tp2] == [s["ids"] for s in from_merged] == [s["ids"] for s in from_hf_names]
    (s,) = samples(generate(ckpt, *common, *greedy))
    # The prompt through meta.json's itos, and the text its decoding (in Python here).
    stoi = {c: i for i, c in enumerate(meta["itos"])}
    assert s["prompt_ids"] == [stoi[c] for c in "the "]
    assert s["text"] == "the " + "".join(meta["itos"][i] for i in s["ids"])
    # What transformers generates from the merge --hf folder.
    hf = transformers.GPT2LMHeadModel.from_pretrained(char_run["dir"] / "merged_hf")
    assert s["ids"] == hf_greedy(hf, s["prompt_ids"], 40)
    # Trained on words from WORDS: the greedy text is mostly those words, not noise.
    words = s["text"].split()
    assert sum(w in WORDS for w in words[:-1]) >= len(words[:-1]) * 0.6, s["text"]


def test_sampling_seed_and_top_k(char_run):
    ckpt = char_run["ckpt"]
    common = ["--prompt", "a ", "--max-new-tokens", 60, "--json", "--device", "cpu"]
    a = samples(generate(ckpt, *common, "--seed", 1, "--temperature", 1.5))
    b = samples(generate(ckpt, *common, "--seed", 1, "--temperature", 1.5))
    c = samples(generate(ckpt, *common, "--seed", 2, "--temperature", 1.5))
    assert a == b
    assert a[0]["ids"] != c[0]["ids"]
    greedy = samples(generate(ckpt, *common, "--temperature", 0))
    top1 = samples(generate(ckpt, *common, "--seed", 3, "--top-k", 1))
    assert top1[0]["ids"] == greedy[0]["ids"]
    assert a[0]["ids"] != greedy[0]["ids"]
    # Plain output: the prompt and the sampled text.
    p = generate(ckpt, "--prompt", "a ", "--max-new-tokens", 60, "--seed", 1, "--temperature", 1.5,
                 "--device", "cpu")
    assert p.stdout.rstrip("\n") == a[0]["text"]


def test_save_dir_stands_for_its_latest_checkpoint(char_run):
    common = ["--prompt", "the ", "--max-new-tokens", 20, "--json", "--temperature", 0, "--device", "cpu"]
    assert samples(generate(char_run["dir"] / "ckpt", *common)) == samples(generate(char_run["ckpt"], *common))


@pytest.mark.parametrize("args, status, needle", [
    (["{missing}"], 2, "no such checkpoint or folder"),
    (["{ckpt}", "--temperature", "-1"], 2, "--temperature: -1 is negative"),
    (["{ckpt}", "--top-p", "1.5"], 2, "--top-p: 1.5 is not in (0, 1]"),
    (["{ckpt}", "--top-k", "two"], 2, "--top-k: 'two' is not an integer"),
    (["{ckpt}", "--max-new-tokens", "0"], 2, "--max-new-tokens: 0 is below 1"),
    (["{ckpt}", "--device", "gpu"], 2, "--device: 'gpu' is not cpu, cuda or auto"),
    (["{ckpt}", "--prompt", "a", "--prompt-ids", "1"], 2, "give one of --prompt"),
    (["{ckpt}", "--frobnicate"], 2, "unexpected argument '--frobnicate'"),
    (["{ckpt}", "--prompt", "the Zoo"], 2, "the character 'Z' (U+005A) is not in the vocabulary"),
    (["{ckpt}", "--prompt-ids", "1,99"], 2, "token id 99 is outside the model's vocabulary of 64"),
    (["{ckpt}", "--tokenizer", "{missing}"], 2, "--tokenizer: "),
    ([], 2, "need SOURCE"),
])
def test_bad_inputs_one_line(char_run, args, status, needle):
    missing = char_run["dir"] / "no_such_checkpoint"
    args = [a.format(ckpt=char_run["ckpt"], missing=missing) for a in args]
    p = generate(*args, *([] if "--device" in args else ["--device", "cpu"]), check=False)
    assert p.returncode == status, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert "Exception raised from" not in p.stderr
