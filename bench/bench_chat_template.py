"""Chat rendering + tokenizing: `nnstrain prepare corpus --format chat` vs transformers'
apply_chat_template(tokenize=True), one thread each, same conversations, same run.

For each of a few of the parity corpus's templates (tests/integration/test_chat_templates.py:
llama-cpp-python's vendored templates, its tokenizer with their special tokens), the test's
conversations that have an assistant turn and that transformers renders, repeated to --count:
transformers renders and tokenizes each (apply_chat_template(tokenize=True)); nnstrain prepares
the same JSON lines with --threads 1 (rendering, tokenizing and the loss mask, which renders each
assistant turn's prefixes again; the process's start and the .bin/.idx writes included) and, from
`prepare chat-render`, the time spent rendering and tokenizing alone. Conversations per second.

    python bench/bench_chat_template.py [--nnstrain build/nnstrain] [--count 2000]

Writes bench/results/chat_template_<UTC time>.json and .md.
"""
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "integration"))
import bench_common  # noqa: E402

TEMPLATES = ["meta-llama-Llama-3.1-8B-Instruct", "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B",
             "google-gemma-2-2b-it", "openai-gpt-oss-120b"]


def main():
    args = bench_common.parse_args(__doc__, lambda ap: ap.add_argument("--count", type=int, default=2000))
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
        t0 = time.perf_counter()
        for c in convs:
            tok.apply_chat_template(c["messages"], tools=c.get("tools"), chat_template=text, tokenize=True,
                                    **c.get("kwargs", {}))
        hf_s = time.perf_counter() - t0
        src = tmp / f"{name}.jsonl"
        with open(src, "w", encoding="utf-8") as f:
            for c in convs:
                f.write(json.dumps({k: v for k, v in c.items() if k != "kwargs"}, ensure_ascii=False) + "\n")
        cmd = [args.nnstrain, "prepare", "corpus", "--format", "chat", "--chat-template", str(tmp / f"{name}.jinja"),
               "--tokenizer", str(tmp / "tok"), "--input", str(src), "--out", str(tmp / name), "--threads", "1",
               "--on-error", "skip"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        ours_s = time.perf_counter() - t0
        assert p.returncode == 0, p.stderr
        (tmp / f"{name}.manifest.json").unlink()
        batch = {"tokenizer": str(tmp / "tok"), "templates": [{"text": text, "source": name}],
                 "conversations": convs, "add_generation_prompt": [False]}
        (tmp / "batch.json").write_text(json.dumps(batch, ensure_ascii=False), encoding="utf-8")
        r = subprocess.run([args.nnstrain, "prepare", "chat-render", str(tmp / "batch.json")], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        engine_s = json.loads(r.stdout.splitlines()[-1])["seconds"]
        rows.append({"template": name, "conversations": len(convs), "transformers_s": hf_s,
                     "prepare_corpus_s": ours_s, "chat_render_s": engine_s, "prepared": p.stdout.strip(),
                     "speedup_prepare": hf_s / ours_s, "speedup_render": hf_s / engine_s})
    import transformers
    rec = bench_common.result_record(args.nnstrain, stamp, threads=1, rows=rows, transformers=transformers.__version__)
    md = ["# Chat rendering + tokenizing, one thread: nnstrain prepare corpus --format chat vs transformers "
          "apply_chat_template(tokenize=True)", "", bench_common.machine_line(rec),
          f"- date {rec['date']}; transformers {transformers.__version__}; {args.count} conversations per template", "",
          "| template | transformers conv/s | prepare corpus conv/s (whole run) | x | render+tokenize+mask conv/s | x |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        n = r["conversations"]
        md.append(f"| {r['template']} | {n / r['transformers_s']:.0f} | {n / r['prepare_corpus_s']:.0f} | "
                  f"{r['speedup_prepare']:.1f} | {n / r['chat_render_s']:.0f} | {r['speedup_render']:.1f} |")
    bench_common.write_result(args.out, "chat_template", stamp, rec, md)


if __name__ == "__main__":
    main()
