"""Tokenizer speed: nnstrain's native tokenizer vs tiktoken and Hugging Face
`tokenizers`, same text, same machine, same run.

For GPT-2 (the real encoder.json + vocab.bpe; tiktoken built from the same files)
and Llama 3 (the real tokenizer.json; tiktoken from its tokenizer.model), on two
texts: tiny Shakespeare x8 (English, 8.9 MB) and a 10 MB multilingual corpus
(tests/reference/tokenizer_cases.py: corpus). Special-token text is encoded as text
everywhere (tiktoken encode_ordinary, tokenizers encode_special_tokens=True).

- 1 thread: the whole text as one string. MB/s over wall time and over the process's
  CPU time (the per-core figure, meaningful even when other work shares the cores).
- N threads: the text as documents (cut after a newline every 64 KB), each library's own batch API
  (ours --threads N, tiktoken encode_ordinary_batch(num_threads=N), tokenizers
  encode_batch with RAYON_NUM_THREADS=N); wall MB/s.
Every run's ids are checked equal to tokenizers' (the reference) for the same input
(one string, or the documents) before a time counts.

The machine's cores may be shared with other work: each measurement runs --repeats
rounds with the libraries interleaved inside a round (nnstrain, tiktoken, nnstrain,
tiktoken, ...), so that load falls on all of them alike and the ratio to tiktoken holds;
best and median per library, every round's time and the load average around it in
the .json. tokenizers (over 10x slower than both) runs once per measurement, for the
reference ids and one timed row. --before BIN adds a row for another binary's
`tokenize` (the tokenizer before a change) in the same rounds.

--whole-mb N: also the whole `nnstrain tokenize` process (start, load the tokenizer,
read, encode, write the ids) on an N MB text file (the bench's texts repeated,
written under /tmp), at 1 and 2 threads, beside tiktoken's whole process (Python
start, import, load, read, encode_ordinary, write) in the same rounds; ids checked
equal to tiktoken's.

    python bench/bench_tokenizer.py --nnstrain build/nnstrain [--threads 1 2] [--repeats 3] [--whole-mb 100]

Writes bench/results/tokenizer_<UTC time>.json and .md.

--scaling: nnstrain's thread scaling alone. The same documents at every thread count
(the 1-thread row above encodes one string, so it is no baseline for scaling),
thread counts interleaved round by round (1, 2, 1, 2, ...) so that load from other
work on the machine falls on all of them alike; best and median of --repeats rounds,
the load average around each measurement, and the ids checked equal across thread
counts and to tokenizers' (its encode_batch on the same documents). Also the
speed-up from CPU time: the 1-thread CPU time over the busiest thread's CPU time
(nnstrain tokenize reports it), which holds where other work shares the cores. Writes
bench/results/tokenizer_scaling_<UTC time>.json and .md.
"""
import argparse
import datetime
import importlib.metadata as md
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "reference"))
from bench_common import cpu_model, git_commit, libtorch_version  # noqa: E402
import tokenizer_cases as tc  # noqa: E402

# One reference measurement in a fresh interpreter, so RAYON_NUM_THREADS takes effect.
WORKER = r'''
import json, sys, time, numpy as np
sys.path.insert(0, sys.argv[1])
import tokenizer_cases as tc
lib, tok, text_path, threads, out = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
text = open(text_path, encoding="utf-8", newline="").read()
docs = tc.documents(text)
if lib == "tiktoken":
    enc = tc.tiktoken_encoding(tok)
    run1 = lambda: enc.encode_ordinary(text)
    runn = lambda: [i for d in enc.encode_ordinary_batch(docs, num_threads=threads) for i in d]
else:
    from tokenizers import Tokenizer
    t = tc.hf_gpt2_from_files() if tok == "gpt2" else Tokenizer.from_file(str(tc.llama3_files()[0]))
    t.encode_special_tokens = True
    run1 = lambda: t.encode(text, add_special_tokens=False).ids
    runn = lambda: [i for e in t.encode_batch(docs, add_special_tokens=False) for i in e.ids]
w0, c0 = time.perf_counter(), time.process_time()
ids = run1() if threads == 1 else runn()
w1, c1 = time.perf_counter(), time.process_time()
np.asarray(ids, dtype=np.int32).tofile(out)
print(json.dumps({"wall": w1 - w0, "cpu": c1 - c0}))
'''


# tiktoken's whole process on a text file (the baseline for `nnstrain tokenize`'s).
WHOLE_TIKTOKEN = r'''
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import tokenizer_cases as tc
tok, text_path, out = sys.argv[2], sys.argv[3], sys.argv[4]
enc = tc.tiktoken_encoding(tok)
text = open(text_path, encoding="utf-8", newline="").read()
np.asarray(enc.encode_ordinary(text), dtype=np.int32).tofile(out)
'''


def timed_process(cmd, env=None):
    """Runs cmd; wall seconds and the child's CPU seconds (user + system), or exits with its output."""
    import resource
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.perf_counter()
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - w0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed: {p.stderr[-3000:]}")
    return {"wall": wall, "cpu": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)}


def whole_process(args, texts, tmp):
    """`nnstrain tokenize` start to finish on a --whole-mb text file at 1 and 2 threads, tiktoken's whole
    process beside it, interleaved round by round."""
    unit = "".join(texts.values()).encode()
    target = int(args.whole_mb * 1e6)
    path = tmp / f"whole_{args.whole_mb:g}mb.txt"
    with open(path, "wb") as f:
        written = 0
        while written < target:
            chunk = unit[:target - written]
            # whole characters only: cut back to a UTF-8 start byte
            while chunk and len(chunk) < len(unit) and (unit[len(chunk)] & 0xC0) == 0x80:
                chunk = chunk[:-1]
            f.write(chunk)
            written += len(chunk)
            if len(chunk) < len(unit):
                break
    nbytes = path.stat().st_size
    rows = []
    for tok in ("gpt2", "llama3"):
        tok_path = tc.gpt2_files()[0] if tok == "gpt2" else tc.llama3_files()[0]
        runs, ref = {}, None
        entries = [("tiktoken", 1)] + [(b, t) for b in (["before"] if args.before else []) + ["nnstrain"]
                                       for t in (1, 2)]
        for _ in range(args.repeats):
            for lib, threads in entries:
                out = tmp / f"whole_{lib}_{threads}.bin"
                before = os.getloadavg()[0]
                if lib == "tiktoken":
                    r = timed_process([sys.executable, "-c", WHOLE_TIKTOKEN, ROOT / "tests" / "reference", tok, path, out])
                else:
                    binary = args.nnstrain if lib == "nnstrain" else args.before
                    r = timed_process([binary, "tokenize", "--tokenizer", tok_path, "--threads", threads,
                                       "--input", path, "--out", out])
                ids = np.fromfile(out, dtype=np.int32)
                out.unlink()
                if ref is None:
                    ref = ids
                elif ids.shape != ref.shape or not bool((ids == ref).all()):
                    sys.exit(f"whole process {tok} {lib} threads={threads}: ids differ from tiktoken's")
                r["load"] = [round(before, 2), round(os.getloadavg()[0], 2)]
                runs.setdefault((lib, threads), []).append(r)
        base = min(r["wall"] for r in runs[("tiktoken", 1)])
        for (lib, threads), rs in runs.items():
            best = min(rs, key=lambda r: r["wall"])
            walls = [r["wall"] for r in rs]
            row = {"tokenizer": tok, "bytes": nbytes, "ids": int(ref.size), "library": lib, "threads": threads,
                   "best_wall_s": round(best["wall"], 3), "median_wall_s": round(float(np.median(walls)), 3),
                   "MB_per_s_best": round(nbytes / 1e6 / best["wall"], 2),
                   "process_cpu_s_best": round(best["cpu"], 3),
                   "x_tiktoken_wall_best": round(base / best["wall"], 2),
                   "runs": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rs]}
            rows.append(row)
            print(f"whole {tok:6} {lib:9} threads {threads} {row['MB_per_s_best']:7.2f} MB/s (best wall "
                  f"{row['best_wall_s']} s, x{row['x_tiktoken_wall_best']} tiktoken)", flush=True)
    return rows


def run_reference(lib, tok, text_path, threads, out):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    p = subprocess.run([sys.executable, "-c", WORKER, str(ROOT / "tests" / "reference"), lib, tok, str(text_path),
                        str(threads), str(out)], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{lib} failed: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_ours(binary, tok, text_path, threads, out):
    """nnstrain tokenize's own timing (encoding only) on the text (1 thread) or its documents."""
    path = tc.gpt2_files()[0] if tok == "gpt2" else tc.llama3_files()[0]
    args = [str(binary), "tokenize", "--tokenizer", str(path), "--threads", str(threads), "--out", str(out)]
    if threads == 1:
        args += ["--input", str(text_path)]
    else:  # the same documents the references batch, one JSON string per line
        jl = pathlib.Path(str(text_path) + ".jsonl")
        if not jl.exists():
            with open(jl, "w", encoding="utf-8") as f:
                for d in tc.documents(open(text_path, encoding="utf-8", newline="").read()):
                    f.write(json.dumps(d) + "\n")
        args += ["--input", str(jl), "--jsonl"]
    return timing_line(subprocess.run(args, capture_output=True, text=True))


def timing_line(p):
    """wall, cpu (all threads) and busiest (the most CPU one thread spent) seconds
    from nnstrain tokenize's summary line."""
    if p.returncode != 0:
        sys.exit(f"nnstrain tokenize failed: {p.stderr[-3000:]}")
    line = [l for l in p.stderr.splitlines() if l.startswith("tokenize:") and " cpu " in l][-1]
    r = {"wall": float(line.split(" ids, ")[1].split(" s,")[0]), "cpu": float(line.split("cpu ")[1].split(" s")[0])}
    if "busiest thread " in line:
        r["busiest"] = float(line.split("busiest thread ")[1].split(" s")[0])
    return r


def scaling(args, paths):
    rows = []
    for tok in ("gpt2", "llama3"):
        for name, path in paths.items():
            nbytes = path.stat().st_size
            out = pathlib.Path(str(path) + ".ref.bin")
            run_reference("tokenizers", tok, path, max(args.threads), out)
            ref = np.fromfile(out, dtype=np.int32)
            runs = {t: [] for t in args.threads}
            for _ in range(args.repeats):
                for t in args.threads:
                    before = os.getloadavg()[0]
                    out = pathlib.Path(str(path) + f".{t}.bin")
                    r = run_ours(args.nnstrain, tok, path, t, out) if t > 1 else run_ours_docs(args.nnstrain, tok, path, out)
                    ids = np.fromfile(out, dtype=np.int32)
                    if ids.shape != ref.shape or not bool((ids == ref).all()):
                        sys.exit(f"nnstrain {tok} {name} threads={t}: ids differ from tokenizers' encode_batch")
                    r["load"] = [round(before, 2), round(os.getloadavg()[0], 2)]
                    runs[t].append(r)
            for t in args.threads:
                walls = sorted(r["wall"] for r in runs[t])
                best = min(runs[t], key=lambda r: r["wall"])
                row = {"tokenizer": tok, "text": name, "bytes": nbytes, "threads": t, "ids": int(ref.size),
                       "best_wall_s": round(best["wall"], 4), "median_wall_s": round(float(np.median(walls)), 4),
                       "MB_per_s_best": round(nbytes / 1e6 / best["wall"], 2),
                       "MB_per_s_median": round(nbytes / 1e6 / float(np.median(walls)), 2),
                       "MB_per_s_cpu_best": round(nbytes / 1e6 / best["cpu"], 2) if best["cpu"] > 0 else None,
                       "load_avg_around_runs": [r["load"] for r in runs[t]]}
                # The critical path: the least CPU time the busiest thread took (over the rounds).
                busiest = [r["busiest"] for r in runs[t] if r.get("busiest")]
                cpus = [r["cpu"] for r in runs[t]]
                row["busiest_thread_cpu_s_min"] = round(min(busiest), 4) if busiest else None
                row["cpu_s_min"] = round(min(cpus), 4)
                base = next((x for x in rows if x["tokenizer"] == tok and x["text"] == name and x["threads"] == 1),
                            None)
                row["speedup_vs_1_best"] = round(row["MB_per_s_best"] / base["MB_per_s_best"], 2) if base else 1.0
                # What idle cores would give: 1 thread's CPU time over the busiest thread's here.
                row["speedup_cpu_critical_path"] = (round(base["cpu_s_min"] / row["busiest_thread_cpu_s_min"], 2)
                                                    if base and row["busiest_thread_cpu_s_min"] else
                                                    (1.0 if t == 1 else None))
                rows.append(row)
                print(f"{tok:6} {name:20} threads {t} {row['MB_per_s_best']:7.2f} MB/s best "
                      f"{row['MB_per_s_median']:7.2f} median  x{row['speedup_vs_1_best']} "
                      f"(CPU critical path x{row['speedup_cpu_critical_path']})", flush=True)
    return rows


def run_ours_docs(binary, tok, text_path, out):
    """One thread on the documents (what the N-thread runs encode), not the whole string."""
    path = tc.gpt2_files()[0] if tok == "gpt2" else tc.llama3_files()[0]
    jl = pathlib.Path(str(text_path) + ".jsonl")
    if not jl.exists():
        with open(jl, "w", encoding="utf-8") as f:
            for d in tc.documents(open(text_path, encoding="utf-8", newline="").read()):
                f.write(json.dumps(d) + "\n")
    return timing_line(subprocess.run([str(binary), "tokenize", "--tokenizer", str(path), "--threads", "1", "--out",
                                       str(out), "--input", str(jl), "--jsonl"], capture_output=True, text=True))


def write_scaling(args, rows, load):
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "benchmark": "tokenizer_scaling", "date": now.isoformat(timespec="seconds"), "commit": git_commit(),
        "device": f"{cpu_model()}, {os.cpu_count()} cores", "load_avg_1min_before_after": load,
        "repeats": args.repeats, "results": rows,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"tokenizer_scaling_{now.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    lines = ["# Tokenizer thread scaling: nnstrain tokenize on the same documents at 1 and 2 threads", "",
             f"- date: {now.strftime('%Y-%m-%d %H:%M UTC')}; commit {record['commit']}",
             f"- device: {record['device']}; load average (1 min) before/after the whole run: {load}",
             ("- **the machine was shared** (load average above 1 before the run): absolute MB/s and the "
              "2-thread gain are lower bounds of an idle machine's"
              if load[0] > 1.0 else "- the machine was idle before the run (load average below 1)")
             + "; each row's load averages around its runs are in the .json",
             f"- {args.repeats} rounds, thread counts interleaved in each round; best and median wall time per count",
             "- ids at every thread count equal to tokenizers' encode_batch on the same documents (checked)",
             "- speed-up from CPU time: the 1-thread run's CPU time over the busiest thread's CPU time at N "
             "threads (least over the rounds): the wall-time speed-up idle cores would give, counting "
             "imbalance and per-thread overhead, not other work on the machine",
             "", "| tokenizer | text | threads | MB/s best | MB/s median | MB/s per core (CPU time, best run) "
                 "| speed-up vs 1 thread (best wall) | speed-up from CPU time (critical path) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokenizer']} | {r['text']} | {r['threads']} | {r['MB_per_s_best']} | "
                     f"{r['MB_per_s_median']} | {r['MB_per_s_cpu_best']} | {r['speedup_vs_1_best']} | "
                     f"{r.get('speedup_cpu_critical_path')} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nnstrain", default=str(ROOT / "build" / "nnstrain"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=1, help="best of N per measurement")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--scaling", action="store_true", help="nnstrain alone, the same documents at each thread count")
    ap.add_argument("--before", help="another binary whose `tokenize` runs in the same rounds (a before row)")
    ap.add_argument("--whole-mb", type=float, default=0, help="also the whole tokenize process on a text of this many MB")
    ap.add_argument("--whole-only", action="store_true", help="only the whole-process measurement (--whole-mb)")
    args = ap.parse_args()

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_tok_"))
    texts = {}
    if tc.SHAKESPEARE.exists():
        texts["shakespeare x8"] = tc.SHAKESPEARE.read_text(encoding="utf-8") * 8
    texts["multilingual 10 MB"] = tc.corpus(10_000_000, seed=1)
    paths = {}
    for name, text in texts.items():
        paths[name] = tmp / (name.replace(" ", "_") + ".txt")
        paths[name].write_bytes(text.encode())
    if args.scaling:
        load = [round(os.getloadavg()[0], 2)]
        rows = scaling(args, paths)
        load.append(round(os.getloadavg()[0], 2))
        write_scaling(args, rows, load)
        return

    rows = []
    load = [round(os.getloadavg()[0], 2)]
    timed = ["nnstrain", "tiktoken"] + (["before"] if args.before else [])
    for tok in ("gpt2", "llama3") if not args.whole_only else ():
        for name, path in paths.items():
            nbytes = path.stat().st_size
            for threads in args.threads:
                # The reference ids (one string, or the documents: they differ where lines meet), timed once.
                out = tmp / "tokenizers.bin"
                before = os.getloadavg()[0]
                r = run_reference("tokenizers", tok, path, threads, out)
                r["load"] = [round(before, 2), round(os.getloadavg()[0], 2)]
                ref_ids = np.fromfile(out, dtype=np.int32)
                runs = {"tokenizers": [r]}
                for _ in range(args.repeats):
                    for lib in timed:  # interleaved: nnstrain, tiktoken[, before], nnstrain, tiktoken, ...
                        out = tmp / f"{lib}.bin"
                        before = os.getloadavg()[0]
                        if lib == "tiktoken":
                            r = run_reference(lib, tok, path, threads, out)
                        else:
                            r = run_ours(args.nnstrain if lib == "nnstrain" else args.before, tok, path, threads, out)
                        r["load"] = [round(before, 2), round(os.getloadavg()[0], 2)]
                        ids = np.fromfile(out, dtype=np.int32)
                        if ids.shape != ref_ids.shape or not bool((ids == ref_ids).all()):
                            sys.exit(f"{lib} {tok} {name} threads={threads}: ids differ from tokenizers'")
                        runs.setdefault(lib, []).append(r)
                tik = min(runs["tiktoken"], key=lambda r: r["wall"])
                for lib in ("tokenizers", "tiktoken", "before", "nnstrain"):
                    if lib not in runs:
                        continue
                    rs = runs[lib]
                    best = min(rs, key=lambda r: r["wall"])
                    best_cpu = min(r["cpu"] for r in rs)
                    row = {"tokenizer": tok, "text": name, "bytes": nbytes, "threads": threads, "library": lib,
                           "ids": int(ref_ids.size), "runs_n": len(rs),
                           "wall_s": round(best["wall"], 4), "cpu_s": round(best_cpu, 4),
                           "MB_per_s_wall": round(nbytes / 1e6 / best["wall"], 2),
                           "MB_per_s_wall_median": round(nbytes / 1e6 / float(np.median([r["wall"] for r in rs])), 2),
                           "MB_per_s_cpu": round(nbytes / 1e6 / best_cpu, 2) if best_cpu > 0 else None,
                           "x_tiktoken_wall": round(tik["wall"] / best["wall"], 2),
                           "x_tiktoken_cpu": round(min(r["cpu"] for r in runs["tiktoken"]) / best_cpu, 2)
                           if best_cpu > 0 else None,
                           "runs": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rs]}
                    rows.append(row)
                    print(f"{tok:6} {name:20} threads {threads} {lib:10} {row['MB_per_s_wall']:7.2f} MB/s wall "
                          f"{row['MB_per_s_cpu'] or 0:7.2f} MB/s cpu  x{row['x_tiktoken_wall']} tiktoken (wall) "
                          f"x{row['x_tiktoken_cpu']} (cpu)", flush=True)
    whole = whole_process(args, texts, tmp) if args.whole_mb else []
    load.append(round(os.getloadavg()[0], 2))

    now = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "benchmark": "tokenizer", "date": now.isoformat(timespec="seconds"), "commit": git_commit(),
        "device": f"{cpu_model()}, {os.cpu_count()} cores", "libtorch": libtorch_version(args.nnstrain),
        "load_avg_1min": load, "repeats": args.repeats, "before": args.before,
        "versions": {p: md.version(p) for p in ("tokenizers", "tiktoken")} | {"python": sys.version.split()[0]},
        "results": rows, "whole_process": whole,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"tokenizer_{now.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# Tokenizer speed: nnstrain vs tiktoken and tokenizers", "",
             f"- date: {now.strftime('%Y-%m-%d %H:%M UTC')}; commit {record['commit']}; LibTorch {record['libtorch']}",
             f"- device: {record['device']}; load average (1 min) before/after: {load}"
             + ("; **the cores were shared with other work** (load above 1): wall MB/s are lower bounds, the "
                "per-core (CPU time) figures and the ratios to tiktoken (same rounds) are the ones to compare"
                if max(load) > 1.0 else ""),
             f"- versions: {record['versions']}",
             f"- {args.repeats} rounds per measurement, libraries interleaved in each round ({', '.join(timed)}); "
             "best wall (and median) per library; tokenizers once (the reference ids); every run's ids equal "
             "to tokenizers' (checked); MB/s = input bytes / encode time (nnstrain: tokenize's own encode "
             "timing, without start-up, load, read, write)"]
    if args.before:
        lines.append(f"- before: `{args.before} tokenize` (the tokenizer before the change), in the same rounds")
    lines += ["", "| tokenizer | text | threads | library | MB/s (best wall) | MB/s (median wall) "
                  "| MB/s per core (CPU time) | x tiktoken (wall) | x tiktoken (CPU) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokenizer']} | {r['text']} | {r['threads']} | {r['library']} | {r['MB_per_s_wall']} | "
                     f"{r['MB_per_s_wall_median']} | {r['MB_per_s_cpu']} | {r['x_tiktoken_wall']} | "
                     f"{r['x_tiktoken_cpu']} |")
    if whole:
        lines += ["", f"## The whole process on a {whole[0]['bytes'] / 1e6:.0f} MB text file", "",
                  "`nnstrain tokenize --tokenizer T --threads N --input FILE --out IDS` start to finish (wall "
                  "around the process: start-up, load, read, encode, write), beside tiktoken's whole process "
                  "(`python -c`: import, load, read, encode_ordinary, write) in the same rounds; ids equal "
                  "(checked). CPU: the process's user + system time.", "",
                  "| tokenizer | library | threads | MB/s (best wall) | best wall s | median wall s | process CPU s "
                  "| x tiktoken (wall) |", "|---|---|---|---|---|---|---|---|"]
        for r in whole:
            lines.append(f"| {r['tokenizer']} | {r['library']} | {r['threads']} | {r['MB_per_s_best']} | "
                         f"{r['best_wall_s']} | {r['median_wall_s']} | {r['process_cpu_s_best']} | "
                         f"{r['x_tiktoken_wall_best']} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
