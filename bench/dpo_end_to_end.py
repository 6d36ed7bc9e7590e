"""SFT, then DPO on the SFT model's own samples, on the CPU (issue 54's end-to-end evidence).

1. SFT: a small Llama (configs/dpo_tiny.yaml's shape) on "a+b=sum" texts of the shipped
   arithmetic pairs (the first 224; byte-level tokenizer), 600 steps; `merge --hf`.
2. Its own samples: for each of the 224 prompts, 6 completions sampled from the SFT model
   (temperature 1, transformers on the merged folder), ranked by a rule: the distance of the
   number written to the true sum (not a number: worst); the best and the worst make a pair,
   ties dropped.
3. DPO (sigmoid, beta 0.1, reference precomputed) from the merged SFT folder on those pairs.
4. Held out: the last 32 shipped pairs (true sum against a wrong one), before and after DPO:
   the preference gap (mean log p(chosen) - log p(rejected)), its accuracy, and greedy
   exact-answer accuracy.
Results: bench/results/dpo_end_to_end_<time>.{json,md}."""
import datetime
import json
import pathlib
import re
import sys
import tempfile

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import ROOT, binary_commit, machine_line, parse_args, result_record, run_single, write_result  # noqa

TOK = ROOT / "configs" / "data" / "byte_tokenizer"
MODEL = {"vocab_size": 257, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16}
_TOK = []


def tokenizer():
    if not _TOK:
        from tokenizers import Tokenizer
        _TOK.append(Tokenizer.from_file(str(TOK / "tokenizer.json")))
    return _TOK[0]


def yaml_run(binary, path, text):
    path.write_text(text)
    run_single([binary, "--config", path], 2)
    return [json.loads(l) for l in (path.parent / path.stem / "metrics.jsonl").read_text().splitlines() if l.strip()]


def ids(s):
    return tokenizer().encode(s, add_special_tokens=False).ids


EOS_TEXT = "<|endoftext|>"


def logp(model, prompt, completion):
    x = torch.tensor([ids(prompt) + ids(completion) + [tokenizer().token_to_id(EOS_TEXT)]])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=x).logits[0, :-1].double(), -1)
    t = x[0, 1:]
    n = len(ids(prompt)) - 1
    return lp[n:].gather(1, t[n:].unsqueeze(1)).sum().item()


def sample(model, prompt, k, greedy=False):
    x = torch.tensor([ids(prompt)] * k)
    eos = tokenizer().token_to_id(EOS_TEXT)
    out = [[] for _ in range(k)]
    done = [False] * k
    with torch.no_grad():
        for _ in range(4):
            logits = model(input_ids=x).logits[:, -1].double()
            nxt = logits.argmax(-1) if greedy else torch.multinomial(torch.softmax(logits, -1), 1).squeeze(1)
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    if t == eos:
                        done[i] = True
                    else:
                        out[i].append(t)
            x = torch.cat([x, nxt.unsqueeze(1)], 1)
    return [tokenizer().decode(o) for o in out]


def score(prompt, text):
    a, b = map(int, re.match(r"(\d+)\+(\d+)=", prompt).groups())
    return -abs(int(text) - (a + b)) if re.fullmatch(r"\d{1,3}", text) else -1e9


def held_out(model, pairs):
    gaps = [logp(model, p["prompt"], p["chosen"]) - logp(model, p["prompt"], p["rejected"]) for p in pairs]
    exact = [sample(model, p["prompt"], 1, greedy=True)[0] == p["chosen"] for p in pairs]
    return {"gap": sum(gaps) / len(gaps), "preference_accuracy": sum(g > 0 for g in gaps) / len(gaps),
            "exact_answer_accuracy": sum(exact) / len(exact)}


def main():
    args = parse_args(__doc__)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    torch.manual_seed(0)
    pairs = [json.loads(l) for l in (ROOT / "configs" / "data" / "arith_pairs.jsonl").read_text().splitlines()]
    train, held = pairs[:224], pairs[224:]
    with tempfile.TemporaryDirectory() as t:
        tmp = pathlib.Path(t)
        (tmp / "sft.jsonl").write_text("".join(json.dumps({"text": p["prompt"] + p["chosen"]}) + "\n" for p in train))
        run_single([args.nnstrain, "prepare", "corpus", "--format", "jsonl", "--tokenizer", TOK, "--input",
                    tmp / "sft.jsonl", "--out", tmp / "sft"], 1)
        common = (f"compute_config: {{device: cpu}}\noptimizer: {{type: adamw, args: {{lr: 3.0e-3, weight_decay: 0.0}}}}\n"
                  f"log_progress_every_n_train_steps: 20\nseed: 1\n")
        sft = yaml_run(args.nnstrain, tmp / "sft_run.yaml", common + f"""run_dir: {tmp}/sft_run
model: {{type: llama, args: {json.dumps(MODEL)}}}
dataset: {{type: indexed, train_args: {{datasets: [{{path: {tmp}/sft}}], seq_len: 16}}}}
micro_batch_size: 32
max_train_steps: 600
checkpoint: {{save_dir: {tmp}/sft_ck}}
""")
        run_single([args.nnstrain, "merge", tmp / "sft_ck", "--out", tmp / "sft_hf", "--hf"], 1)
        sft_model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "sft_hf", dtype=torch.float32).eval()
        own = []
        for p in train:
            s = sorted(set(sample(sft_model, p["prompt"], 6)), key=lambda c: score(p["prompt"], c))
            if len(s) >= 2 and score(p["prompt"], s[0]) < score(p["prompt"], s[-1]):
                own.append({"prompt": p["prompt"], "chosen": s[-1], "rejected": s[0]})
        (tmp / "own.jsonl").write_text("".join(json.dumps(r) + "\n" for r in own))
        run_single([args.nnstrain, "prepare", "corpus", "--format", "preference", "--tokenizer", TOK, "--input",
                    tmp / "own.jsonl", "--out", tmp / "own"], 1)
        before = held_out(sft_model, held)
        dpo = yaml_run(args.nnstrain, tmp / "dpo_run.yaml", common.replace("3.0e-3", "1.0e-3") + f"""run_dir: {tmp}/dpo_run
model: {{init_from: {tmp}/sft_hf}}
alignment: {{loss_type: sigmoid, beta: 0.1, reference: precomputed}}
dataset: {{type: preference, train_args: {{path: {tmp}/own, seq_len: 16}}}}
micro_batch_size: 32
max_train_steps: 150
checkpoint: {{save_dir: {tmp}/dpo_ck}}
""")
        run_single([args.nnstrain, "merge", tmp / "dpo_ck", "--out", tmp / "dpo_hf", "--hf"], 1)
        after = held_out(transformers.AutoModelForCausalLM.from_pretrained(tmp / "dpo_hf", dtype=torch.float32).eval(),
                         held)
    keep = ["step", "loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected"]
    rec = result_record(args.nnstrain, stamp, binary_commit=binary_commit(args.nnstrain), model=MODEL,
                        sft_loss=[(r["step"], r["loss"]) for r in sft], own_pairs=len(own),
                        dpo=[{k: r[k] for k in keep} for r in dpo], held_out_before=before, held_out_after=after)
    md = [f"# SFT then DPO on its own samples, CPU ({rec['date']})", "", machine_line(rec),
          f"- SFT loss {sft[0]['loss']:.3f} (step {sft[0]['step']}) -> {sft[-1]['loss']:.3f} (step {sft[-1]['step']});"
          f" {len(own)} preference pairs from its samples (of 224 prompts)", "",
          "| DPO step | loss | rewards/accuracies | rewards/margins |", "|---:|---:|---:|---:|"]
    md += [f"| {r['step']} | {r['loss']:.4f} | {r['rewards/accuracies']:.3f} | {r['rewards/margins']:.4f} |" for r in dpo]
    md += ["", "| held out (32 pairs) | preference gap (nats) | preference accuracy | greedy exact answer |",
           "|---|---:|---:|---:|"]
    for name, h in (("SFT", before), ("SFT + DPO", after)):
        md.append(f"| {name} | {h['gap']:.3f} | {h['preference_accuracy']:.3f} | {h['exact_answer_accuracy']:.3f} |")
    write_result(args.out, "dpo_end_to_end", stamp, rec, md)


if __name__ == "__main__":
    main()
