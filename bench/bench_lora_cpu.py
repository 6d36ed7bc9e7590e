#!/usr/bin/env python3
"""Full fine-tuning against LoRA and QLoRA on a Llama of about 1.1B parameters, on CPU (issue 53).

One process, bf16-true (bf16 weights, gradients and AdamW moments for what trains), a
TinyLlama-shaped Llama (22 layers, hidden 2048, SwiGLU 5632, 32 query / 4 key-value heads,
vocabulary 32000, untied head: 1.10B parameters), fresh weights, random tokens, micro-batch
1 x 128 tokens, a few steps (the first dropped from the timings), three runs:
  full:  every weight trains;
  lora:  lora r 16, alpha 32, target_modules [all-linear] (the 7 projections of every layer);
  qlora: the same with base_quantization nf4 (double_quant).
Reported per run: peak tensor memory (metrics.jsonl peak_tensor_mb, the counting CPU
allocator: every tensor storage), peak RSS (wait4's ru_maxrss), the bytes of optimizer state
held between steps (the start-up line "held between steps": AdamW's moments, plus masters
under a mixed precision), trainable elements, mean step time, and the planner's per-rank
estimate (plan.json estimate.total_bytes, which prices LoRA's frozen base as held: docs/lora.md
"The planner") against the measured peak.

--render JSON rewrites the Markdown of a saved result.

Results: bench/results/lora_cpu_<time>.{json,md}.

Usage (repository root): ~/.cache/nnstrain/venv/bin/python bench/bench_lora_cpu.py [--steps 3] [--threads 2] [--only full lora qlora]
"""
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import binary_commit, machine_line, parse_args, random_tokens, result_record, write_result  # noqa

MODEL = ("{vocab_size: 32000, hidden_size: 2048, intermediate_size: 5632, num_hidden_layers: 22, "
         "num_attention_heads: 32, num_key_value_heads: 4, max_position_embeddings: 2048, tie_word_embeddings: false}")
CONFIG = """
run_dir: {run}
pas_policy: dp
compute_config: {{device: cpu}}
model: {{type: llama, args: {model}}}
precision: bf16-true
optimizer: {{type: adamw, args: {{lr: 1.0e-4, weight_decay: 0.0}}}}
dataset: {{type: token_bin, train_args: {{path: {data}, dtype: uint16, seq_len: 128}}}}
micro_batch_size: 1
max_train_steps: {steps}
log_progress_every_n_train_steps: 1
seed: 1
{lora}
"""
RUNS = {
    "full": "",
    "lora": "lora: {r: 16, alpha: 32, target_modules: [all-linear]}",
    "qlora": "lora: {r: 16, alpha: 32, target_modules: [all-linear], base_quantization: nf4, double_quant: true}",
}
HELD = re.compile(r"held between steps: parameters (\d+), gradients (\d+), masters (\d+), optimizer moments (\d+) bytes, "
                  r"for (\d+) parameter elements")


def run(binary, name, tmp, data, steps, threads):
    d = tmp / name
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(CONFIG.format(run=d, model=MODEL, data=data, steps=steps, lora=RUNS[name]))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.time()
    p = subprocess.Popen([str(binary), "--config", str(cfg)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    if status != 0:
        sys.exit(f"{name}: nnstrain failed ({status}):\n{out[-4000:]}")
    recs = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines() if l.strip()]
    train = [r for r in recs if "loss" in r and "step" in r]
    held = HELD.search(out)
    plan = json.loads((d / "plan.json").read_text())
    est = plan.get("estimate", {})
    peak = max(r.get("peak_tensor_mb", 0) for r in train)
    timed = [r["ms_per_step"] for r in train[1:]] or [train[0]["ms_per_step"]]
    lo = re.search(r"lora: .*", out)
    return {"name": name, "wall_s": time.time() - t0, "peak_tensor_mb": peak, "peak_rss_mb": usage.ru_maxrss / 1024,
            "param_bytes": int(held.group(1)), "grad_bytes": int(held.group(2)), "master_bytes": int(held.group(3)),
            "moment_bytes": int(held.group(4)), "trainable_elements": int(held.group(5)),
            "optimizer_state_bytes": int(held.group(3)) + int(held.group(4)),
            "ms_per_step": sum(timed) / len(timed), "losses": [r["loss"] for r in train],
            "plan_estimate_mb": est.get("total_bytes", 0) / 1048576.0, "lora_line": lo.group(0) if lo else ""}


def render(rec):
    rows, steps, threads = rec["runs"], rec["steps"], rec["threads"]
    md = [f"# Full fine-tuning vs LoRA vs QLoRA, Llama 1.1B on CPU ({rec['date'][:10]})", "", machine_line(rec),
          f"- binary built from {rec['binary_commit']}; {steps} steps, micro-batch 1 x 128 tokens, bf16-true, "
          f"{threads} threads; step time: mean of steps 2..{steps}", "",
          "| run | trainable elements | optimizer state (MiB) | gradients (MiB) | trained weights (MiB) | peak tensors (MiB) "
          "| peak RSS (MiB) | s/step | planner estimate (MiB) | estimate / peak |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pk = r["peak_tensor_mb"] or 1
        md.append(f"| {r['name']} | {r['trainable_elements']:,} | {r['optimizer_state_bytes'] / 2**20:.1f} | "
                  f"{r['grad_bytes'] / 2**20:.1f} | {r['param_bytes'] / 2**20:.1f} | {r['peak_tensor_mb']:.0f} | "
                  f"{r['peak_rss_mb']:.0f} | {r['ms_per_step'] / 1000:.1f} | {r['plan_estimate_mb']:.0f} | "
                  f"{r['plan_estimate_mb'] / pk:.2f} |")
    md += ["", "trained weights: the training state's parameters; the frozen base is in the peak "
           "(LoRA: bf16; QLoRA: the adapted layers' NF4 codes and scales, embeddings, norms and head bf16). "
           "Optimizer state: AdamW's moments (bf16-true keeps no masters)."]
    for r in rows:
        if r["lora_line"]:
            md.append(f"- {r['name']}: `{r['lora_line'].strip()}`")
    return md


def main():
    args = parse_args(__doc__, lambda ap: (ap.add_argument("--steps", type=int, default=3),
                                           ap.add_argument("--threads", type=int, default=2),
                                           ap.add_argument("--only", nargs="*", default=list(RUNS)),
                                           ap.add_argument("--render", default="")))
    if args.render:
        path = pathlib.Path(args.render)
        path.with_suffix(".md").write_text("\n".join(render(json.loads(path.read_text()))) + "\n")
        print(path.with_suffix(".md").read_text())
        return
    stamp = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory() as t:
        tmp = pathlib.Path(t)
        data = random_tokens(tmp / "tokens.bin", 32000, 200000)
        rows = [run(args.nnstrain, n, tmp, data, args.steps, args.threads) for n in args.only]
    rec = result_record(args.nnstrain, stamp, binary_commit=binary_commit(args.nnstrain), steps=args.steps,
                        threads=args.threads, model=MODEL, runs=rows)
    write_result(args.out, "lora_cpu", stamp, rec, render(rec))


if __name__ == "__main__":
    main()
