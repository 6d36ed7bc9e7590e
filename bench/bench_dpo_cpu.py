"""DPO's step against SFT's at the same tokens per step, on the CPU (issue 54).

One model (a Llama of 4 layers, 256 wide, the byte-level vocabulary of
configs/data/byte_tokenizer), 64 rows of 32 tokens per step: SFT on token_bin
rows, and on the shipped preference pairs (configs/data/arith_pairs.jsonl) 32
pairs (64 rows, chosen then rejected) with each reference mode: frozen (a second
forward per micro-batch), precomputed (its pass before step 1 not in the step),
and the reference-free simpo. Each run's median ms/step over steps 6..N (all
in the same session, one after another). Expected: frozen about 1.3x SFT (one
no-grad forward more, of three forward-equivalents), precomputed and simpo
about 1x.
Results: bench/results/dpo_cpu_<time>.{json,md}."""
import datetime
import json
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import ROOT, binary_commit, machine_line, parse_args, random_tokens, result_record, run_single, write_result  # noqa

SEQ, ROWS = 32, 64
MODEL = {"vocab_size": 257, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": SEQ}
BASE = """run_dir: {run}
compute_config: {{device: cpu}}
model: {{type: llama, args: {model}}}
optimizer: {{type: adamw, args: {{lr: 1.0e-3}}}}
micro_batch_size: {micro}
global_batch_size: {micro}
max_train_steps: {steps}
log_progress_every_n_train_steps: 1
"""
RUNS = {
    "sft": ("", "dataset: {{type: token_bin, train_args: {{path: {tokens}, seq_len: {seq}}}}}\n", ROWS),
    "dpo_frozen": ("alignment: {{loss_type: sigmoid, reference: frozen}}\n", None, ROWS // 2),
    "dpo_precomputed": ("alignment: {{loss_type: sigmoid, reference: precomputed, ref_log_probs: {tmp}/ref.safetensors}}\n",
                        None, ROWS // 2),
    "simpo": ("alignment: {{loss_type: simpo}}\n", None, ROWS // 2),
}
PREF = "dataset: {{type: preference, train_args: {{path: {pairs}, seq_len: {seq}}}}}\n"


def run(binary, name, tmp, steps, threads):
    align, data, micro = RUNS[name]
    cfg = tmp / f"{name}.yaml"
    text = BASE.format(run=tmp / name, model=json.dumps(MODEL), micro=micro, steps=steps)
    text += align.format(tmp=tmp) + (data or PREF).format(tokens=tmp / "tokens.bin", pairs=tmp / "pairs", seq=SEQ)
    cfg.write_text(text)
    run_single([binary, "--config", cfg], threads)
    recs = [json.loads(l) for l in (tmp / name / "metrics.jsonl").read_text().splitlines() if l.strip()]
    ms = [r["ms_per_step"] for r in recs if r["step"] > 5]
    return {"name": name, "micro_batch_size": micro, "rows_per_step": ROWS, "tokens_per_step": ROWS * SEQ,
            "median_ms_per_step": statistics.median(ms), "steps_timed": len(ms)}


def render(rec):
    sft = next(r for r in rec["runs"] if r["name"] == "sft")["median_ms_per_step"]
    md = [f"# DPO against SFT at {ROWS * SEQ} tokens per step, CPU ({rec['date']})", "", machine_line(rec),
          f"- model: Llama {MODEL}; {rec['threads']} threads; {rec['steps']} steps, median of steps 6..",
          "", "| run | micro-batch | ms/step | vs SFT |", "|---|---:|---:|---:|"]
    for r in rec["runs"]:
        md.append(f"| {r['name']} | {r['micro_batch_size']} | {r['median_ms_per_step']:.1f} | "
                  f"{r['median_ms_per_step'] / sft:.2f}x |")
    return md


def main():
    args = parse_args(__doc__, lambda ap: (ap.add_argument("--steps", type=int, default=30),
                                           ap.add_argument("--threads", type=int, default=2)))
    stamp = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory() as t:
        tmp = pathlib.Path(t)
        random_tokens(tmp / "tokens.bin", MODEL["vocab_size"], 100000)
        run_single([args.nnstrain, "prepare", "corpus", "--format", "preference", "--tokenizer",
                    ROOT / "configs" / "data" / "byte_tokenizer", "--input", ROOT / "configs" / "data" / "arith_pairs.jsonl",
                    "--out", tmp / "pairs"], 1)
        rows = [run(args.nnstrain, n, tmp, args.steps, args.threads) for n in RUNS]
    rec = result_record(args.nnstrain, stamp, binary_commit=binary_commit(args.nnstrain), steps=args.steps,
                        threads=args.threads, model=MODEL, runs=rows)
    write_result(args.out, "dpo_cpu", stamp, rec, render(rec))


if __name__ == "__main__":
    main()
