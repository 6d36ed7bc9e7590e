"""Chat fine-tuning end to end (issue 40), CPU/Gloo, fp32.

- Packed conversations (lengths varying over tenfold, prepared with --format chat,
  llama3's template) with document masks and the loss on the assistant's tokens:
  one process against cp 2 zigzag p2p with recompute, cp 2 contiguous all_gather
  x dp 2 with two micro-batches, cp 4 zigzag all_gather and pp 2 with recompute,
  10 steps each (every cp comm type and layout at cp 2 and 4 against one rank's
  attention, op by op: tests/unit/test_context_attention.cpp): loss and gradient norm within 1e-5
  (relative), and the same count of targets in every step however the batch is
  cut. Each run's record shows it ran what it compares: the parallelism (groups,
  cp traffic of the asked comm type, the pipeline's sends: conftest.assert_active)
  and document-masked attention tiles on every rank that ran attention.
- The shipped recipe, configs/llama3_chat_sft.yaml, fine-tunes a tiny Llama that
  transformers wrote (model.init_from) on a conversation file written here, and
  `nnstrain generate --chat` answers one turn from the checkpoint, streamed, ending
  at <|eot_id|>; the interactive mode holds two turns from standard input.
This module runs with Gloo's point-to-point under NCCL's rules (tests/CMakeLists.txt)."""
import json
import random
import subprocess

import pytest

from chat_common import TEXT, write_jsonl, write_tokenizer
from conftest import CONFIGS, SOURCE, active_records, nnstrain_bin_path, run_ranks, single_process_env

TOL = 1e-5
CP = "--compute_config.context_parallel_size"
PLANS = {  # name: (ranks, overrides)
    "one": (1, []),
    "cp2_zigzag_p2p_recompute": (2, [CP, "2", "--model.activation_checkpointing", "true"]),
    "cp2_contiguous_all_gather_dp2_accum2": (4, [CP, "2", "--compute_config.cp_load_balance", "none",
                                                 "--compute_config.cp_comm_type", "all_gather",
                                                 "--micro_batch_size", "1", "--grad_accumulation_steps", "2"]),
    "cp4_zigzag_all_gather": (4, [CP, "4", "--compute_config.cp_comm_type", "all_gather"]),
    "pp2_recompute": (2, ["--compute_config.pas_config.pp_size", "2", "--micro_batch_size", "2",
                          "--model.activation_checkpointing", "true"]),
}


def conversations(n, seed=0):
    """Conversations of one to three exchanges, answers of 2 to 20 words: about 12 to over 120 tokens."""
    rng = random.Random(seed)
    words = TEXT.split()
    say = lambda lo, hi: " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))
    out = []
    for _ in range(n):
        c = [{"role": "system", "content": say(2, 5)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3) if rng.random() < 0.3 else 1):
            c += [{"role": "user", "content": say(1, 8)}, {"role": "assistant", "content": say(2, 20)}]
        out.append(c)
    return out


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    tok = write_tokenizer(root / "tok", "llama3")
    src = write_jsonl(root / "chats.jsonl", conversations(120))
    p = subprocess.run([nnstrain_bin_path(), "prepare", "corpus", "--format", "chat", "--chat-template", "llama3",
                        "--tokenizer", str(tok), "--input", str(src), "--out", str(root / "chat"),
                        "--max-tokens", "64", "--overlong", "split"],
                       cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return root


def train(name, run_dir, data):
    ranks, overrides = PLANS[name]
    args = ["--config", str(CONFIGS / "tiny_llama_chat.yaml"), "--run_dir", str(run_dir),
            "--vars.data", str(data / "chat"), "--compute_config.runtime_ngpus", str(ranks), *overrides]
    got = run_ranks(ranks, run_dir, args, overrides)  # asserts the plan asked for really ran
    records = active_records(run_dir, ranks)
    for rank, rec in records.items():  # document-masked attention ran (on every rank holding layers)
        assert rec["first_step"]["document_tiles"] > 0, f"{name} rank {rank}: no document-masked tiles: {rec}"
    targets = [json.loads(l)["targets"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()
               if l.strip() and "targets" in json.loads(l)]
    return got, targets


def test_document_masks_under_cp_and_pp_equal_one_process(chat_data, tmp_path):
    runs = {name: train(name, tmp_path / name, chat_data) for name in PLANS}
    base, base_targets = runs["one"]
    assert len(base) == 10 and len(base_targets) == 10
    # Masked targets are real: fewer targets than tokens (the prompts are context).
    assert 0 < max(base_targets) < 4 * 64, base_targets
    for name, (got, targets) in runs.items():
        assert targets == base_targets, f"{name}: targets per step {targets}, one process {base_targets}"
        for step, (loss, gn) in base.items():
            l, g = got[step]
            assert abs(l - loss) <= TOL * abs(loss) and abs(g - gn) <= TOL * abs(gn), \
                f"{name} step {step}: loss {l} grad norm {g}, one process {loss} {gn}"


def test_recipe_fine_tunes_a_transformers_llama_and_chats(chat_data, tmp_path):
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=416, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    shrink = {"vocab_size": 416, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
    args = [nnstrain_bin_path(), "--config", str(SOURCE / "configs" / "llama3_chat_sft.yaml"),
            "--vars.hf_model", str(tmp_path / "hf"), "--vars.data", str(chat_data / "chat"), "--vars.seq_len", "64",
            "--run_dir", str(tmp_path / "run"), "--checkpoint.save_dir", str(tmp_path / "ckpt"),
            "--compute_config.device", "cpu", "--precision", "32-true", "--pas_policy", "dp",
            "--global_batch_size", "4", "--micro_batch_size", "4", "--max_epochs", "0", "--max_train_steps", "6",
            "--lr_scheduler.args.warmup_steps", "1", "--optimizer.args.lr", "1e-2",
            "--checkpoint.every_n_train_steps", "6", "--log_progress_every_n_train_steps", "1"]
    for k, v in shrink.items():
        args += [f"--model.args.{k}", str(v)]
    p = subprocess.run(args, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    train = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if l.strip()]
    assert len(train) == 6 and train[-1]["loss"] < train[0]["loss"], train
    # One turn, from the checkpoint: the template comes from the dataset's manifest, the tokenizer too.
    gen = [nnstrain_bin_path(), "generate", str(tmp_path / "ckpt"), "--chat", "--system", "Be brief.",
           "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"]
    p = subprocess.run(gen + ["--prompt", "What is the capital of France?", "--json"], cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    (answer,) = [json.loads(l) for l in p.stdout.splitlines() if l.strip()]
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(chat_data / "tok" / "tokenizer.json"))
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(str(chat_data / "tok"))
    want_prompt = hf_tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "What is the capital of France?"}],
                                             tokenize=False, add_generation_prompt=True)
    assert tok.decode(answer["prompt_ids"], skip_special_tokens=False) == want_prompt
    assert 0 < len(answer["ids"]) <= 12 and tok.token_to_id("<|eot_id|>") not in answer["ids"]
    assert answer["text"] == tok.decode(answer["ids"])
    # Interactive: two user turns on standard input, each answer streamed on its own line.
    p = subprocess.run(gen, input="Hello there\nTell me a joke about cats.\n", cwd=SOURCE, env=single_process_env(1),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("user> ") == 3, p.stderr  # asked twice, then end of input
    assert len(p.stdout.splitlines()) == 2, p.stdout
    # A Hugging Face folder with its tokenizer: the template comes from tokenizer_config.json,
    # whatever its text (a variant renders as transformers renders it); one that does not
    # compile is refused naming the file, line and column.
    import shutil
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(chat_data / "tok" / f, tmp_path / "hf" / f)
    hf_gen = [nnstrain_bin_path(), "generate", str(tmp_path / "hf"), "--chat", "--temperature", "0",
              "--max-new-tokens", "4", "--device", "cpu", "--prompt", "Hello", "--json"]
    p = subprocess.run(hf_gen, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    (answer,) = [json.loads(l) for l in p.stdout.splitlines() if l.strip()]
    assert tok.decode(answer["prompt_ids"], skip_special_tokens=False) == hf_tok.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True)
    cfg_path = tmp_path / "hf" / "tokenizer_config.json"
    tc = json.loads(cfg_path.read_text())
    tc["chat_template"] = tc["chat_template"].replace("'<|eot_id|>'", "'<|eot_id|>\\n'")  # a variant
    cfg_path.write_text(json.dumps(tc))
    p = subprocess.run(hf_gen, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    (answer,) = [json.loads(l) for l in p.stdout.splitlines() if l.strip()]
    variant = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.decode(answer["prompt_ids"], skip_special_tokens=False) == variant.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True)
    tc["chat_template"] = "{% for m in messages %}{{ m.content }\n{% endfor %}"
    cfg_path.write_text(json.dumps(tc))
    p = subprocess.run(hf_gen, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "tokenizer_config.json:1:" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) <= 2, p.stderr


def test_seq_len_shorter_than_the_prepared_cap_is_refused(chat_data, tmp_path):
    """Prepared with --max-tokens 64 (each conversation within 64 tokens, split at user turns):
    training at seq_len 32 would cut conversations mid-turn, so it exits 2 naming the key."""
    args = [nnstrain_bin_path(), "--config", str(CONFIGS / "tiny_llama_chat.yaml"), "--run_dir", str(tmp_path / "run"),
            "--vars.data", str(chat_data / "chat"), "--vars.seq_len", "32", "--max_train_steps", "1"]
    p = subprocess.run(args, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "dataset.train_args.seq_len: 32 is shorter than the 64 tokens" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_a_dataset_prepared_with_another_template_than_the_models_is_refused(chat_data, tmp_path):
    """The data was rendered with llama3's template (its manifest records the text's SHA-256); a model
    folder whose tokenizer_config.json holds ChatML's is refused naming the dataset and both hashes,
    unless the dataset sets allow_other_chat_template (then it trains); on a folder holding llama3's
    own template the key is meaningless and refused."""
    import hashlib

    import torch
    import transformers
    from chat_common import TEMPLATES
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=416, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    folders = {}
    for name in ("chatml", "llama3"):
        transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / name)
        folders[name] = write_tokenizer(tmp_path / name, name)
    sha = {name: hashlib.sha256(TEMPLATES[name].encode()).hexdigest() for name in folders}
    manifest = json.loads((chat_data / "chat.manifest.json").read_text())
    assert manifest["settings"]["chat_template_sha256"] == sha["llama3"], manifest["settings"]

    def run(folder, *extra):
        args = [nnstrain_bin_path(), "--config", str(SOURCE / "configs" / "llama3_chat_sft.yaml"),
                "--vars.hf_model", str(folder), "--vars.data", str(chat_data / "chat"), "--vars.seq_len", "64",
                "--run_dir", str(tmp_path / "run"), "--checkpoint.save_dir", str(tmp_path / "ckpt"),
                "--compute_config.device", "cpu", "--precision", "32-true", "--pas_policy", "dp",
                "--global_batch_size", "2", "--micro_batch_size", "2", "--max_epochs", "0", "--max_train_steps", "1",
                "--lr_scheduler.args.warmup_steps", "0", "--model.activation_checkpointing", "false", *extra]
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings"):
            args += [f"--model.args.{k}", str(getattr(cfg, k))]
        return subprocess.run(args, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)

    allow = ["--dataset.train_args.datasets.0.allow_other_chat_template", "true"]
    p = run(folders["chatml"])
    assert p.returncode == 2, p.stdout + p.stderr
    line = "dataset.train_args.datasets[0].path"
    assert line in p.stderr and str(chat_data / "chat.manifest.json") in p.stderr, p.stderr
    assert f"chat template {sha['llama3'][:16]}... (built-in llama3)" in p.stderr, p.stderr
    assert f"model.init_from's is {sha['chatml'][:16]}..." in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) <= 2, p.stderr

    p = run(folders["chatml"], *allow)
    assert p.returncode == 0, p.stdout + p.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) >= 1

    p = run(folders["llama3"], *allow)
    assert p.returncode == 2, p.stdout + p.stderr
    assert ("dataset.train_args.datasets[0].allow_other_chat_template" in p.stderr
            and "model.init_from's own chat template" in p.stderr), p.stderr
