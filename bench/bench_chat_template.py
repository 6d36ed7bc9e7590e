"""Chat rendering + tokenizing: `nnstrain prepare corpus --format chat` vs transformers'
apply_chat_template(tokenize=True), one thread each, same conversations, same run.

For each of a few of the parity corpus's templates (tests/integration/test_chat_templates.py:
llama-cpp-python's vendored templates, its tokenizer with their special tokens), the test's
conversations that have an assistant turn and that transformers renders, repeated to --count:
transformers renders and tokenizes each (apply_chat_template(tokenize=True)); nnstrain prepares
the same JSON lines with --threads 1 (reading them, rendering, tokenizing and the loss mask, which
renders each assistant turn's prefixes again, and the .bin/.idx writes). The process's start-up
(loading LibTorch, the tokenizer, compiling the template) is measured apart, by a run over one
conversation, and taken off: throughput = (count - 1) / (whole run - start-up run). From
`prepare chat-render`, the time spent rendering, tokenizing and masking alone. Conversations per
second, wall clock and CPU time (the CPU figures hold on a loaded machine). --baseline runs a
second nnstrain binary (an earlier build) the same way in the same run.

    python bench/bench_chat_template.py [--nnstrain build/nnstrain] [--count 5000] [--baseline OLD_BINARY]

Writes bench/results/chat_template_<UTC time>.json and .md.
"""
import datetime
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "integration"))
import bench_common  # noqa: E402

TEMPLATES = ["meta-llama-Llama-3.1-8B-Instruct", "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B",
             "google-gemma-2-2b-it", "openai-gpt-oss-120b"]


def timed(cmd):
    """(wall seconds, CPU seconds of the child, completed process) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))}: {p.stderr}"
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), p


def run_nnstrain(binary, tmp, name, text, convs):
    """prepare corpus over convs and over one conversation (start-up), then chat-render's engine seconds."""
    out = {}
    for label, rows in (("whole", convs), ("startup", convs[:1])):
        src = tmp / f"{name}.{label}.jsonl"
        with open(src, "w", encoding="utf-8") as f:
            for c in rows:
                f.write(json.dumps({k: v for k, v in c.items() if k != "kwargs"}, ensure_ascii=False) + "\n")
        prefix = tmp / f"{name}.{label}"
        for ext in (".bin", ".idx", ".manifest.json"):
            pathlib.Path(str(prefix) + ext).unlink(missing_ok=True)
        cmd = [binary, "prepare", "corpus", "--format", "chat", "--chat-template", str(tmp / f"{name}.jinja"),
               "--tokenizer", str(tmp / "tok"), "--input", str(src), "--out", str(prefix), "--threads", "1",
               "--on-error", "skip"]
        out[label] = timed(cmd)
    out["bin"] = pathlib.Path(str(tmp / f"{name}.whole") + ".bin").read_bytes()
    batch = {"tokenizer": str(tmp / "tok"), "templates": [{"text": text, "source": name}],
             "conversations": convs, "add_generation_prompt": [False]}
    (tmp / "batch.json").write_text(json.dumps(batch, ensure_ascii=False), encoding="utf-8")
    r = subprocess.run([binary, "prepare", "chat-render", str(tmp / "batch.json")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out["engine_s"] = json.loads(r.stdout.splitlines()[-1])["seconds"]
    n = len(convs) - 1
    whole_w, whole_c, p = out["whole"]
    start_w, start_c, _ = out["startup"]
    return {"prepared": p.stdout.strip(), "prepare_wall_s": whole_w, "prepare_cpu_s": whole_c,
            "startup_wall_s": start_w, "startup_cpu_s": start_c,
            "throughput_wall": n / max(whole_w - start_w, 1e-9), "throughput_cpu": n / max(whole_c - start_c, 1e-9),
            "chat_render_s": out["engine_s"]}, out["bin"]


def main():
    def more(ap):
        ap.add_argument("--count", type=int, default=5000)
        ap.add_argument("--baseline", help="an earlier nnstrain binary, run the same way")
    args = bench_common.parse_args(__doc__, more)
    os.environ.setdefault("NNSTRAIN_BIN", args.nnstrain)
    import re
    import test_chat_templates as t
    from tokenizers import AddedToken
    from transformers import AutoTokenizer
    templates = t.corpus()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_chat_"))
    found = set(t.SPECIALS)
    for text in templates.values():
        found |= set(re.findall(r"<\|[A-Za-z0-9_]+\|>|<｜[^｜<>]{1,40}｜>|<(?:start|end)_of_turn>|<bos>|<eos>", text))
    bpe = t._train()
    bpe.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in sorted(found)])
    (tmp / "tok").mkdir()
    (tmp / "tok" / "tokenizer.json").write_text(bpe.to_str(), encoding="utf-8")
    (tmp / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "clean_up_tokenization_spaces": False, "model_max_length": 1 << 20}))
    tok = AutoTokenizer.from_pretrained(str(tmp / "tok"))
    os.environ["RAYON_NUM_THREADS"] = "1"
    stamp = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    for name in TEMPLATES:
        text = templates[name]
        (tmp / f"{name}.jinja").write_text(text, encoding="utf-8")
        base = [c for c in t.CONVERSATIONS if any(m["role"] == "assistant" for m in c["messages"])
                and t.hf_render(tok, text, c, False, tokenize=False)[1] is None]
        convs = [base[i % len(base)] for i in range(args.count)]
        t0, c0 = time.perf_counter(), time.process_time()
        for c in convs:
            tok.apply_chat_template(c["messages"], tools=c.get("tools"), chat_template=text, tokenize=True,
                                    **c.get("kwargs", {}))
        hf_s = time.perf_counter() - t0
        hf_cpu = time.process_time() - c0
        row = {"template": name, "conversations": len(convs), "transformers_s": hf_s, "transformers_cpu_s": hf_cpu}
        for label, binary in (("", args.nnstrain), ("baseline_", args.baseline)):
            if not binary:
                continue
            r, data = run_nnstrain(binary, tmp, name, text, convs)
            if label:
                assert data == ours_bin, f"{name}: the baseline binary prepares other tokens"
            else:
                ours_bin = data
            row.update({label + k: v for k, v in r.items()})
        rows.append(row)
    import transformers
    rec = bench_common.result_record(args.nnstrain, stamp, threads=1, rows=rows, transformers=transformers.__version__,
                                     baseline=args.baseline)
    md = ["# Chat rendering + tokenizing, one thread: nnstrain prepare corpus --format chat vs transformers "
          "apply_chat_template(tokenize=True)", "", bench_common.machine_line(rec),
          f"- date {rec['date']}; transformers {transformers.__version__}; {args.count} conversations per template",
          "- prepare conv/s: (count - 1) / (whole run - a one-conversation run), i.e. without the start-up, which is "
          "given apart; x: over transformers (wall / CPU time); engine: `prepare chat-render`'s render + tokenize + "
          "mask seconds" + (f"; baseline: {args.baseline}" if args.baseline else ""), ""]
    for label in (["baseline_"] if args.baseline else []) + [""]:
        md += [f"## {'baseline (' + args.baseline + ')' if label else 'this build'}", "",
               "| template | transformers conv/s (wall / CPU) | prepare conv/s (wall / CPU) | x wall | x CPU | "
               "start-up s (wall / CPU) | engine conv/s | x |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            n = r["conversations"]
            hw, hc = n / r["transformers_s"], n / r["transformers_cpu_s"]
            md.append(f"| {r['template']} | {hw:.0f} / {hc:.0f} | {r[label + 'throughput_wall']:.0f} / "
                      f"{r[label + 'throughput_cpu']:.0f} | {r[label + 'throughput_wall'] / hw:.1f} | "
                      f"{r[label + 'throughput_cpu'] / hc:.1f} | {r[label + 'startup_wall_s']:.2f} / "
                      f"{r[label + 'startup_cpu_s']:.2f} | " +
                      ("- | - |" if label else  # an older chat-render timed two more renderings
                       f"{n / r['chat_render_s']:.0f} | {r['transformers_s'] / r['chat_render_s']:.1f} |"))
        md.append("")
    bench_common.write_result(args.out, "chat_template", stamp, rec, md)


if __name__ == "__main__":
    main()
