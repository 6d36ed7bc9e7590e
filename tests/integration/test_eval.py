"""`nnstrain eval` against lm-evaluation-harness (its Hugging Face backend) on the same folders and task files.

- Two tiny random Hugging Face models saved by save_pretrained: the GPT-2 this project trains and a
  Llama of odd shape (GQA, head_dim 8, 3 layers, untied head, a BOS-adding tokenizer), each with a
  byte-level BPE tokenizer trained here on the tasks' words (no downloads);
- one task of each kind, written here as lm-eval task YAMLs over JSON-lines files: multiple_choice
  (0 and 3 shots from a train split), loglikelihood_rolling (documents longer than the model: several
  windows), generate_until (0 and 3 shots drawn from the test split itself, a regex filter, stop
  sequences); the 3-shot contexts outgrow the 40-token models, so the harness's left truncation runs
  (and is counted);
- lm-eval runs once per model with every task; every per-request log-likelihood within 1e-5
  relative, every acc/acc_norm decision identical, the perplexities within 1e-6 relative, the
  generated answers identical; the same from 2 ranks (documents split, `nnstrain launch`);
- in training (eval:), the scores under tp 2, dp 2, ZeRO-3 dp 2 and pp 2 equal one process's;
- bad task files (a malformed line, a gold index outside the choices, a missing field) exit 2 with
  one line naming the file and line.
"""
import json
import math
import os
import pathlib
import random
import subprocess
import sys

import pytest

from conftest import SOURCE, nnstrain_bin_path, single_process_env

transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
tokenizers = pytest.importorskip("tokenizers")
import torch  # noqa: E402

WORDS = ("the cat sat on a mat and ran to see my dog who is fat but not very quick red blue green "
         "house tree river stone bird sings loud soft every day night").split()
MAX_LEN = 40


def sentence(rng, lo=3, hi=8):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_tasks(d):
    """Task YAMLs (lm-eval's keys) and their JSON-lines files under d; returns {name: yaml path}."""
    rng = random.Random(7)
    mc = []
    for _ in range(16):
        choices = [sentence(rng, 1, 4) for _ in range(4)]
        mc.append({"question": sentence(rng), "choices": choices, "label": rng.randrange(4)})
    write_jsonl(d / "mc_test.jsonl", mc[:10])
    write_jsonl(d / "mc_train.jsonl", mc[10:])
    write_jsonl(d / "roll_test.jsonl", [{"page": " ".join(sentence(rng, 8, 14) + "." for _ in range(rng.randint(2, 12)))}
                                        for _ in range(6)])
    gen = [{"q": sentence(rng, 2, 5), "answer": rng.choice(WORDS)} for _ in range(10)]
    write_jsonl(d / "gen_test.jsonl", gen)

    def files(**splits):
        return "dataset_path: json\ndataset_kwargs:\n  data_files:\n" + "".join(
            f"    {k}: {d / v}\n" for k, v in splits.items())

    tasks = {}
    for shots in (0, 3):
        name = f"tiny_mc_{shots}shot"
        tasks[name] = d / f"{name}.yaml"
        tasks[name].write_text(
            f"task: {name}\n" + files(test="mc_test.jsonl", train="mc_train.jsonl") +
            "test_split: test\nfewshot_split: train\noutput_type: multiple_choice\n"
            "doc_to_text: \"Q: {{question}}\\nA:\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
            f"num_fewshot: {shots}\n"
            "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
        name = f"tiny_gen_{shots}shot"
        tasks[name] = d / f"{name}.yaml"
        tasks[name].write_text(
            f"task: {name}\n" + files(test="gen_test.jsonl") +
            "test_split: test\nfewshot_split: test\noutput_type: generate_until\n"
            "doc_to_text: \"{{q}} ->\"\ndoc_to_target: \"{{answer}}\"\n"
            f"num_fewshot: {shots}\n"
            "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 6\n  do_sample: false\n"
            "filter_list:\n  - name: first_word\n    filter:\n      - function: regex\n"
            "        regex_pattern: \"([a-z]+)\"\n      - function: take_first\n"
            "metric_list:\n  - metric: exact_match\n")
    tasks["tiny_roll"] = d / "tiny_roll.yaml"
    tasks["tiny_roll"].write_text(
        "task: tiny_roll\n" + files(test="roll_test.jsonl") +
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{page}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    return tasks


def make_tokenizer(bos):
    """A byte-level BPE over the tasks' words; `bos`: a template that prepends <s> (Llama's way)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers, processors
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>"] if bos else ["<|endoftext|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rng = random.Random(3)
    tok.train_from_iterator([sentence(rng) + ". " + sentence(rng) for _ in range(400)], trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=specials[0], eos_token=specials[-1])
    return fast


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    tasks = make_tasks(d)
    folders = {}
    for arch in ("gpt2", "llama"):
        tok = make_tokenizer(bos=arch == "llama")
        torch.manual_seed(0)
        if arch == "gpt2":
            cfg = transformers.GPT2Config(vocab_size=len(tok), n_positions=MAX_LEN, n_embd=32, n_layer=2, n_head=2,
                                          activation_function="gelu", initializer_range=0.2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # trained in-loop below
                                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
            model = transformers.GPT2LMHeadModel(cfg)
        else:
            cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=72,
                                           num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                                           max_position_embeddings=MAX_LEN, initializer_range=0.2,
                                           tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                                           eos_token_id=tok.eos_token_id, pad_token_id=None)
            model = transformers.LlamaForCausalLM(cfg)
        out = d / arch
        model.save_pretrained(out)
        tok.save_pretrained(out)
        folders[arch] = out
    return {"dir": d, "tasks": tasks, "folders": folders}


LM_EVAL = r"""
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
folder, task_dir, out, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
res = simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32", tasks=names, batch_size=4,
                      device="cpu", log_samples=True, task_manager=TaskManager(include_path=task_dir),
                      fewshot_random_seed=1234)
keep = {"results": res["results"], "samples": {}}
for name, samples in res["samples"].items():
    keep["samples"][name] = [{"doc_id": s["doc_id"], "resps": s["resps"], "filtered_resps": s["filtered_resps"],
                              "arguments": s["arguments"]} for s in samples]
json.dump(keep, open(out, "w"), default=str)
"""


def lm_eval_run(setup, arch):
    out = setup["dir"] / f"lm_eval_{arch}.json"
    if not out.exists():
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   HF_DATASETS_CACHE=str(setup["dir"] / "hf_cache"), TOKENIZERS_PARALLELISM="false")
        p = subprocess.run([sys.executable, "-c", LM_EVAL, str(setup["folders"][arch]), str(setup["dir"]), str(out),
                            ",".join(sorted(setup["tasks"]))], env=env, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return json.loads(out.read_text())


def nnstrain_eval(setup, arch, *extra, nproc=1, name="one"):
    out = setup["dir"] / f"nnstrain_{arch}_{name}.json"
    args = ["eval", setup["folders"][arch], "--tasks", *sorted(setup["tasks"].values()), "--batch-size", 4,
            "--json", out, "--device", "cpu", *extra]
    cmd = [nnstrain_bin_path(), *map(str, args)]
    if nproc > 1:
        cmd = [nnstrain_bin_path(), "launch", "--nproc-per-node", str(nproc), "--", *map(str, args)]
    p = subprocess.run(cmd, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(out.read_text()), p


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def compare(ours, theirs):
    """Asserts the parity; returns a row per task: (task, kind, documents, worst relative difference, identical decisions)."""
    rows = []
    for name, t in sorted(ours.items()):
        samples = sorted(theirs["samples"][name], key=lambda s: s["doc_id"])
        assert len(samples) == t["docs"] == len(t["per_doc"])
        worst = 0.0
        for doc, s in zip(t["per_doc"], samples):
            if t["kind"] == "multiple_choice":
                lls = [r[0][0] for r in s["resps"]]
                greedy = [bool(r[0][1]) for r in s["resps"]]
                for a, b in zip(doc["lls"], lls):
                    worst = max(worst, rel(a, b))
                    assert rel(a, b) < 1e-5, f"{name} {doc['where']}: ll {a} vs lm-eval {b}"
                assert doc["greedy"] == greedy, f"{name} {doc['where']}"
                import numpy as np
                assert doc["pred"] == int(np.argmax(lls)), f"{name} {doc['where']}: acc decision"
                norm = [ll / len(c) for ll, c in zip(lls, (a[1][1:] for a in s["arguments"]))]  # target_delimiter " "
                assert doc["pred_norm"] == int(np.argmax(norm)), f"{name} {doc['where']}: acc_norm decision"
            elif t["kind"] == "loglikelihood_rolling":
                worst = max(worst, rel(doc["ll"], s["resps"][0][0]))
                assert rel(doc["ll"], s["resps"][0][0]) < 1e-5, f"{name} {doc['where']}"
            else:
                assert doc["generated"] == s["resps"][0][0], f"{name} {doc['where']}: generated"
                assert doc["filtered"] == s["filtered_resps"][0], f"{name} {doc['where']}: filtered"
        ref = theirs["results"][name]
        for m, v in t["metrics"].items():
            want = ref[f"{m},none"] if f"{m},none" in ref else ref[f"{m},first_word"]
            tol = 1e-6 if "perplexity" in m or m == "bits_per_byte" else 0
            assert abs(v - want) <= tol * abs(want), f"{name} {m}: nnstrain {v} vs lm-eval {want}"
        rows.append((name, t["kind"], t["docs"], worst, t["truncated"]))
    return rows


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_scores_equal_lm_eval(setup, arch):
    theirs = lm_eval_run(setup, arch)
    ours, p = nnstrain_eval(setup, arch)
    rows = compare(ours, theirs)
    print(f"\n{arch}: task, kind, docs, worst relative ll difference, truncated requests")
    for r in rows:
        print("  ", r)
    # The 3-shot multiple-choice contexts outgrow the model: the left truncation ran and was counted.
    assert ours["tiny_mc_3shot"]["truncated"] > 0 and "first_truncated" in ours["tiny_mc_3shot"]
    assert "cut from the left" in p.stderr
    # The rolling documents took several windows each.
    assert max(d["windows"] for d in ours["tiny_roll"]["per_doc"]) > 1
    if arch == "gpt2":
        two, _ = nnstrain_eval(setup, arch, nproc=2, name="dp2")
        # Documents dealt over 2 ranks: other batches (other padding), the same scores to float rounding.
        for name, t in ours.items():
            for m, v in t["metrics"].items():
                assert rel(two[name]["metrics"][m], v) <= 1e-6, (name, m)
            for a, b in zip(two[name]["per_doc"], t["per_doc"]):
                if "lls" in a:
                    assert all(rel(x, y) < 1e-6 for x, y in zip(a["lls"], b["lls"])) and a["pred"] == b["pred"]
                    assert a["pred_norm"] == b["pred_norm"]
                elif "ll" in a:
                    assert rel(a["ll"], b["ll"]) < 1e-6
                else:
                    assert a["generated"] == b["generated"]


@pytest.mark.parametrize("fault,needle", [
    ("malformed", "mc_test.jsonl:3: not valid JSON"),
    ("gold", "mc_test.jsonl:2: the gold index 7 is outside the 4 choices"),
    ("missing", "mc_test.jsonl:4: the field 'question' (used by doc_to_text) is missing"),
])
def test_bad_task_files(setup, tmp_path, fault, needle):
    rows = [json.loads(line) for line in (setup["dir"] / "mc_test.jsonl").read_text().splitlines()]
    lines = [json.dumps(r) for r in rows]
    if fault == "malformed":
        lines[2] = lines[2][:-3]
    elif fault == "gold":
        rows[1]["label"] = 7
        lines[1] = json.dumps(rows[1])
    else:
        del rows[3]["question"]
        lines[3] = json.dumps(rows[3])
    (tmp_path / "mc_test.jsonl").write_text("\n".join(lines) + "\n")
    y = setup["tasks"]["tiny_mc_0shot"].read_text().replace(str(setup["dir"] / "mc_test.jsonl"),
                                                             str(tmp_path / "mc_test.jsonl"))
    (tmp_path / "t.yaml").write_text(y)
    p = subprocess.run([nnstrain_bin_path(), "eval", setup["folders"]["gpt2"], "--tasks", tmp_path / "t.yaml"],
                       cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert needle in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("option,nproc", [("--tp", 1), ("--tp", 2), ("--pp", 2)])
def test_split_plans_refused(setup, option, nproc):
    """Every rank of nnstrain eval holds the whole model: a plan that would split it is refused, never ignored."""
    cmd = [nnstrain_bin_path(), "eval", setup["folders"]["gpt2"], "--tasks", setup["tasks"]["tiny_mc_0shot"],
           option, "2", "--device", "cpu"]
    if nproc > 1:
        cmd = [nnstrain_bin_path(), "launch", "--nproc-per-node", str(nproc), "--", *cmd[1:]]
    p = subprocess.run([str(c) for c in cmd], cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [line for line in p.stderr.splitlines() if "nnstrain eval:" in line]
    assert lines and all(f"{option}: nnstrain eval does not split the model" in line for line in lines), p.stderr
    assert len(lines) == nproc and "Traceback" not in p.stderr, p.stderr  # one line per rank
    assert "eval:)" in lines[0], lines[0]  # tp and pp are served in training


# --- eval: in training (the live sharded model, no checkpoint round trip) ---

TRAIN = """
run_dir: {run}
pas_policy: dp
compute_config: {{device: cpu, backend: gloo, reducer_bucket_cap_mb: 0.01, collective_timeout_s: 60}}
model:
  init_from: {hf}
optimizer:
  type: adamw
  args: {{lr: 3.0e-3}}
  clip_gnorm: 0.0
lr_scheduler: {{type: constant}}
dataset:
  type: token_bin
  train_args: {{path: {data}, dtype: uint16, seq_len: 32}}
micro_batch_size: 4
max_train_steps: 4
log_progress_every_n_train_steps: 1
seed: 1337
checkpoint: {{save_dir: {run}/ck}}
log: [{{type: console}}, {{type: jsonl, args: {{path: {run}/metrics.jsonl}}}}, {{type: tensorboard, args: {{dir: {run}/tb}}}}]
eval:
  tasks: [{tasks}]
  every_n_train_steps: 2
  batch_size: 4
"""
IN_LOOP_TASKS = ("tiny_mc_3shot", "tiny_roll", "tiny_gen_0shot")
IN_LOOP_PLANS = {  # name: (ranks, overrides)
    "tp2": (2, ["--compute_config.plan_ngpus", "2", "--pas_policy", "tp"]),
    "dp2": (2, ["--micro_batch_size", "2"]),
    "zero3_dp2": (2, ["--micro_batch_size", "2", "--compute_config.use_zero", "3"]),
    # No rank holds the whole model: each batch goes through both stages, the last one's sums come back.
    "pp2": (2, ["--compute_config.pas_config.pp_size", "2", "--micro_batch_size", "2",
                "--grad_accumulation_steps", "2"]),
}


def train_config(setup, path, run, tasks=None):
    tasks = tasks or [setup["tasks"][n] for n in IN_LOOP_TASKS]
    path.write_text(TRAIN.format(run=run, hf=setup["folders"]["gpt2"], data=setup["tokens"],
                                 tasks=", ".join(str(t) for t in tasks)))
    return path


def eval_records(run):
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in recs if "eval_seconds" in r}


def same_scores(a, b, what):
    keys = {k for k in a if k.startswith("eval_") and k != "eval_seconds"}
    assert keys == {k for k in b if k.startswith("eval_") and k != "eval_seconds"}, (what, a, b)
    for k in keys:
        if "perplexity" in k or "bits_per_byte" in k:
            assert rel(a[k], b[k]) <= 1e-6, (what, k, a[k], b[k])
        else:  # acc, acc_norm, exact_match: the same decisions
            assert a[k] == b[k], (what, k, a[k], b[k])


@pytest.fixture(scope="module")
def in_loop_one(setup, tiny_tokens):
    setup["tokens"] = tiny_tokens
    run = setup["dir"] / "train_one"
    p = subprocess.run([nnstrain_bin_path(), "--config", train_config(setup, setup["dir"] / "train_one.yaml", run)],
                       cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return run, eval_records(run), p.stdout + p.stderr


def test_in_training_scores_the_live_model(setup, in_loop_one):
    """Every 2 steps and at the last: the scores move with training and the last equals nnstrain eval of
    the step-4 checkpoint; TensorBoard's eval/ tags and nnstrain report's eval lines show them."""
    run, recs, out = in_loop_one
    assert sorted(recs) == [2, 4], recs
    assert "eval tiny_roll/word_perplexity" in out or "tiny_roll/word_perplexity" in out, out
    assert recs[2]["eval_tiny_roll/word_perplexity"] != recs[4]["eval_tiny_roll/word_perplexity"]
    out_json = setup["dir"] / "ck_eval.json"
    p = subprocess.run([nnstrain_bin_path(), "eval", str(run / "ck"), "--tasks",
                        *[str(setup["tasks"][n]) for n in IN_LOOP_TASKS], "--batch-size", "4", "--json", str(out_json),
                        "--device", "cpu", "--tokenizer", str(setup["folders"]["gpt2"] / "tokenizer.json")],
                       cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    ck = json.loads(out_json.read_text())
    same_scores(recs[4], {"eval_" + t + "/" + m: v for t, r in ck.items() for m, v in r["metrics"].items()},
                "in-loop vs nnstrain eval of the checkpoint")
    r = subprocess.run([nnstrain_bin_path(), "report", str(run), "--no-plot"], cwd=SOURCE, env=single_process_env(1),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "eval tiny_mc_3shot/acc" in r.stdout and "eval time" in r.stdout, r.stdout
    from test_observability import tb_scalars
    scalars, _, _ = tb_scalars(run / "tb")
    for k, v in recs[4].items():
        if k.startswith("eval_") and k != "eval_seconds":
            tag = "eval/" + k[5:]
            assert sorted(scalars[tag]) == [2, 4] and rel(scalars[tag][4], v) < 1e-6, (tag, scalars.get(tag))


@pytest.mark.parametrize("plan", sorted(IN_LOOP_PLANS))
def test_in_training_plans_equal_one_process(setup, in_loop_one, plan):
    from conftest import run_ranks
    ranks, overrides = IN_LOOP_PLANS[plan]
    run = setup["dir"] / f"train_{plan}"
    cfg = train_config(setup, setup["dir"] / f"train_{plan}.yaml", run)
    run_ranks(ranks, run, ["--config", str(cfg), *overrides], overrides)
    got, want = eval_records(run), in_loop_one[1]
    assert sorted(got) == sorted(want), got
    if plan.startswith("pp"):  # the run's own log: the scores came through the stages
        log = "".join(f.read_text() for f in (run / "logs").iterdir() if f.is_file())
        assert "forwards through the 2 pipeline ranks' stages" in log, log[-2000:]
    for step in want:
        same_scores(got[step], want[step], f"{plan} step {step}")


def test_in_training_refusals(setup, tiny_tokens, tmp_path):
    setup["tokens"] = tiny_tokens
    cfg = train_config(setup, tmp_path / "c.yaml", tmp_path / "run")
    for args, needle in ((["--compute_config.context_parallel_size", "2"], "does not run under context parallelism"),
                         (["--eval.tasks", "[" + str(tmp_path / "none.yaml") + "]"], "none.yaml: no such task file")):
        p = subprocess.run([nnstrain_bin_path(), "--config", str(cfg), *args, "--print-config"], cwd=SOURCE,
                           env=single_process_env(1), capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, (args, p.stdout + p.stderr)
    # A bad task file is refused when the run starts, before its first step, naming the file and line.
    rows = (setup["dir"] / "mc_test.jsonl").read_text().splitlines()
    rows[1] = rows[1][:-2]
    (tmp_path / "mc_test.jsonl").write_text("\n".join(rows) + "\n")
    y = setup["tasks"]["tiny_mc_0shot"].read_text().replace(str(setup["dir"] / "mc_test.jsonl"),
                                                             str(tmp_path / "mc_test.jsonl"))
    (tmp_path / "bad.yaml").write_text(y)
    cfg = train_config(setup, tmp_path / "b.yaml", tmp_path / "run", tasks=[tmp_path / "bad.yaml"])
    p = subprocess.run([nnstrain_bin_path(), "--config", str(cfg)], cwd=SOURCE, env=single_process_env(1),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "mc_test.jsonl:2: not valid JSON" in p.stderr, p.stdout + p.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or "loss" not in (tmp_path / "run" / "metrics.jsonl").read_text()
