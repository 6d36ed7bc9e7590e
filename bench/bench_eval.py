#!/usr/bin/env python3
"""nnstrain eval against lm-evaluation-harness's Hugging Face backend on CPU, in-loop evaluation's share of a run,
and a task score's curve against steps (issue 55).

A small corpus with something to learn (each of 12 nouns has a fixed colour: "the cat is red."; filler
sentences between), a byte-level BPE tokenizer trained on it, a GPT-2 (transformers, save_pretrained) and:
  speed:  one multiple-choice task ("the cat is" -> one of 6 colours, 3-shot) scored by `nnstrain eval`
          and by lm-eval (simple_evaluate, model hf, the same folder, task file and batch size, the
          same thread count) in the same run; documents per second of each (nnstrain: its task's
          scoring seconds and the whole process; lm-eval: simple_evaluate's wall time);
  in loop: nnstrain trains the GPT-2 from the folder (model.init_from) on the corpus with an eval:
          section (that task and a rolling perplexity task on held-out text) every N steps; the share
          of the run's wall time its evaluations took (the records' eval_seconds);
  curve:  the scores against steps from `nnstrain report` (its text and plot_run.py's PNG).

Results: bench/results/eval_cpu_<time>.{json,md} (+ the report's PNG).

Usage (repository root): ~/.cache/nnstrain/venv/bin/python bench/bench_eval.py [--threads 2] [--docs 120]
    [--steps 300] [--every 30]
"""
import datetime
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import ROOT, machine_line, parse_args, result_record, run_single, write_result  # noqa: E402

NOUNS = "cat dog bird fish horse cow sheep goat mouse frog duck bee".split()
COLOURS = "red blue green yellow black white".split()
FILLER = "sat on ran to saw near under over the a big small old young".split()

LM_EVAL = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[5]))
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
folder, task_dir, name, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tm = TaskManager(include_path=task_dir)
t0 = time.perf_counter()
res = simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32", tasks=[name], batch_size=batch,
                      device="cpu", task_manager=tm, fewshot_random_seed=1234)
print(json.dumps({"seconds": time.perf_counter() - t0, "results": res["results"][name]}, default=str))
"""


def corpus(rng, colour_of, n):
    out = []
    for _ in range(n):
        noun = rng.choice(NOUNS)
        if rng.random() < 0.5:
            out.append(f"the {noun} is {colour_of[noun]}.")
        else:
            out.append(f"the {noun} " + " ".join(rng.choice(FILLER) for _ in range(rng.randint(2, 5))) + ".")
    return " ".join(out)


def main():
    a = parse_args(__doc__, lambda ap: (ap.add_argument("--threads", type=int, default=2),
                                        ap.add_argument("--docs", type=int, default=120),
                                        ap.add_argument("--batch-size", type=int, default=8),
                                        ap.add_argument("--steps", type=int, default=300),
                                        ap.add_argument("--every", type=int, default=30)))
    import numpy as np
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    stamp = datetime.datetime.now(datetime.timezone.utc)
    rng = random.Random(0)
    colour_of = {n: rng.choice(COLOURS) for n in NOUNS}
    d = pathlib.Path(tempfile.mkdtemp(prefix="bench_eval_"))
    train_text, held_out = corpus(rng, colour_of, 20000), [corpus(rng, colour_of, 30) for _ in range(20)]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator([train_text[i:i + 2000] for i in range(0, len(train_text), 2000)],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>")
    import torch
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=len(fast), n_positions=128, n_embd=128, n_layer=4, n_head=4,
                                  activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    hf = d / "gpt2"
    transformers.GPT2LMHeadModel(cfg).save_pretrained(hf)
    fast.save_pretrained(hf)
    np.array(fast(train_text)["input_ids"], dtype=np.uint16).tofile(d / "train.bin")

    docs = [{"noun": n, "choices": COLOURS, "label": COLOURS.index(colour_of[n])}
            for n in (rng.choice(NOUNS) for _ in range(a.docs))]
    (d / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    (d / "roll.jsonl").write_text("".join(json.dumps({"page": t}) + "\n" for t in held_out))
    mc = d / "colour_mc.yaml"
    mc.write_text(f"task: colour_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / 'mc.jsonl'}\n"
                  "test_split: test\nfewshot_split: test\noutput_type: multiple_choice\n"
                  "doc_to_text: \"the {{noun}} is\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
                  "num_fewshot: 3\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    roll = d / "colour_roll.yaml"
    roll.write_text(f"task: colour_roll\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / 'roll.jsonl'}\n"
                    "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
                    "doc_to_target: \"{{page}}\"\nmetric_list:\n  - metric: word_perplexity\n")

    # Speed: the same folder, task and batch size; nnstrain first, then lm-eval.
    t0 = time.perf_counter()
    run_single([a.nnstrain, "eval", hf, "--tasks", mc, "--batch-size", a.batch_size, "--device", "cpu",
                "--json", d / "ours.json"], a.threads)
    ours_wall = time.perf_counter() - t0
    ours = json.loads((d / "ours.json").read_text())["colour_mc"]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(d / "hf_cache"), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(a.threads))
    p = subprocess.run([sys.executable, "-c", LM_EVAL, str(hf), str(d), "colour_mc", str(a.batch_size), str(a.threads)],
                       env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("lm-eval failed:\n" + p.stdout[-2000:] + p.stderr[-4000:])
    theirs = json.loads(p.stdout.strip().splitlines()[-1])
    same_acc = abs(ours["metrics"]["acc"] - theirs["results"]["acc,none"]) < 1e-12

    # In the loop: training with eval every N steps.
    run = d / "run"
    (d / "train.yaml").write_text(f"""
run_dir: {run}
compute_config: {{device: cpu}}
model: {{init_from: {hf}}}
optimizer: {{type: adamw, args: {{lr: 1.0e-3}}}}
lr_scheduler: {{type: cosine, args: {{warmup_steps: 20}}}}
dataset:
  type: token_bin
  train_args: {{path: {d / 'train.bin'}, dtype: uint16, seq_len: 128}}
micro_batch_size: 8
max_train_steps: {a.steps}
log_progress_every_n_train_steps: 10
eval:
  tasks: [{mc}, {roll}]
  every_n_train_steps: {a.every}
  batch_size: {a.batch_size}
""")
    t0 = time.perf_counter()
    run_single([a.nnstrain, "--config", d / "train.yaml"], a.threads)
    run_wall = time.perf_counter() - t0
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    evals = [r for r in recs if "eval_seconds" in r]
    eval_s = sum(r["eval_seconds"] for r in evals)
    report = run_single([a.nnstrain, "report", run, "--out", d / "report.png"], a.threads).stdout

    rec = result_record(a.nnstrain, stamp, threads=a.threads, batch_size=a.batch_size, docs=a.docs,
                        requests=ours["requests"],
                        nnstrain={"task_seconds": ours["seconds"], "process_seconds": ours_wall,
                                  "docs_per_s": a.docs / ours["seconds"], "docs_per_s_process": a.docs / ours_wall,
                                  "acc": ours["metrics"]["acc"]},
                        lm_eval={"seconds": theirs["seconds"], "docs_per_s": a.docs / theirs["seconds"],
                                 "acc": theirs["results"]["acc,none"]},
                        same_acc=same_acc,
                        in_loop={"steps": a.steps, "every": a.every, "evaluations": len(evals), "eval_seconds": eval_s,
                                 "run_seconds": run_wall, "share": eval_s / run_wall},
                        curve=[{k: v for k, v in r.items() if k != "eval_seconds"} for r in evals], report=report)
    speed = rec["nnstrain"]["docs_per_s"] / rec["lm_eval"]["docs_per_s"]
    md = [f"# nnstrain eval vs lm-eval (HF backend), in-loop share, score curve ({stamp:%Y-%m-%d %H:%M} UTC)", "",
          machine_line(rec), f"- {a.threads} threads; GPT-2 4 layers x 128 wide, context 128, vocabulary {len(fast)};"
          f" batch size {a.batch_size}", "",
          f"## Speed: colour_mc, {a.docs} documents x 6 choices, 3-shot ({ours['requests']} requests)", "",
          "| | seconds | documents/s | acc |", "|---|---|---|---|",
          f"| nnstrain eval (scoring) | {ours['seconds']:.2f} | {rec['nnstrain']['docs_per_s']:.1f} | {ours['metrics']['acc']:.4f} |",
          f"| nnstrain eval (whole process) | {ours_wall:.2f} | {rec['nnstrain']['docs_per_s_process']:.1f} | |",
          f"| lm-eval simple_evaluate, hf | {theirs['seconds']:.2f} | {rec['lm_eval']['docs_per_s']:.1f} | {theirs['results']['acc,none']:.4f} |",
          "", f"nnstrain / lm-eval: {speed:.1f}x (scoring), "
          f"{rec['nnstrain']['docs_per_s_process'] / rec['lm_eval']['docs_per_s']:.1f}x (whole process); same acc: {same_acc}",
          "", f"## In the loop: {a.steps} steps, eval every {a.every} ({len(evals)} evaluations)", "",
          f"evaluation {eval_s:.1f} s of the run's {run_wall:.1f} s: {100 * eval_s / run_wall:.1f}%", "",
          "## Curve (metrics.jsonl eval records)", "", "| step | colour_mc acc | acc_norm | colour_roll word_perplexity |",
          "|---|---|---|---|"]
    for r in evals:
        md.append(f"| {r['step']} | {r['eval_colour_mc/acc']:.4f} | {r['eval_colour_mc/acc_norm']:.4f} | "
                  f"{r['eval_colour_roll/word_perplexity']:.3f} |")
    md += ["", "`nnstrain report`:", "", "```", report.rstrip(), "```"]
    write_result(a.out, "eval_cpu", stamp, rec, md)
    if (d / "report.png").exists():
        shutil.copy(d / "report.png", pathlib.Path(a.out) / f"eval_cpu_{stamp:%Y%m%d-%H%M%S}.png")
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
