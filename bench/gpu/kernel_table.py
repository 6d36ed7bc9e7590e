#!/usr/bin/env python3
"""Kernel tables from profiler traces (issue 20's "Measured first").

Reads the Chrome-trace JSON files that nnstrain's `profile:` window
(trace_rank<R>.json) and torch.profiler's export_chrome_trace write (plain or
.gz), sums the GPU kernels' durations by name, and writes markdown: per trace
the GPU time per step, the time by kind of kernel (matmul, attention, norm,
...), the 15 most expensive kernels with their share, and which attention
kernel ran (cuDNN, flash or memory-efficient, told from the kernel names), so
the traces answer "which attention kernel ran" without a browser.

A trace without GPU kernels (the battery's CPU smoke run) is summarised from
its CPU operators instead, inclusive times (a nested operator counts in its
parent too); the table says so.

    python bench/gpu/kernel_table.py --out kernels.md LABEL=TRACE[:STEPS] ...
      (LABEL as "benchmark/who", e.g. gpt2/nnstrain; STEPS: profiled steps, default 1)
"""
import argparse
import collections
import gzip
import json
import pathlib
import re

TOP = 15

# Attention backends by kernel (or CPU operator) name; cuDNN's SDPA kernels say
# "flash" in their names too, so cuDNN is tried first.
ATTENTION = [
    ("cuDNN", re.compile(r"cudnn|fort_native_sdpa|_cudnn_attention", re.I)),
    ("memory-efficient", re.compile(r"fmha_cutlass|cutlassF|cutlassB|PyTorchMemEffAttention|mem_eff|"
                                    r"efficient_attention", re.I)),
    ("flash", re.compile(r"flash", re.I)),
]
# Kinds of kernels, first match wins (attention first: its names hold "cutlass").
KINDS = [
    ("optimizer", re.compile(r"multi_tensor|adam|foreach|fused_sgd", re.I)),
    ("matmul", re.compile(r"gemm|xmma|nvjet|cublas|cutlass|sm90_|sm80_|ampere_|hopper_|aten::(mm|bmm|addmm|"
                          r"linear|matmul)\b", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("softmax / loss", re.compile(r"softmax|cross_entropy|nll_loss|logsumexp", re.I)),
    ("triton (compiled)", re.compile(r"^triton_", re.I)),
    ("copy / layout", re.compile(r"copy|\bcat\b|CatArray|transpose|index|gather|scatter|embedding|fill|memcpy|"
                                 r"memset|contiguous|clone", re.I)),
    ("reduction", re.compile(r"reduce|\bsum\b|\bmax\b|\bmean\b", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|silu|gelu|\bmul\b|\badd\b|exp", re.I)),
]


def attention_backend(name):
    for backend, rx in ATTENTION:
        if rx.search(name):
            return backend
    return None


def kind_of(name):
    if attention_backend(name):
        return "attention"
    for kind, rx in KINDS:
        if rx.search(name):
            return kind
    return "other"


def load(path):
    path = pathlib.Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def totals(events):
    """{name: [microseconds, calls]} of the GPU kernels, the source ("gpu" or
    "cpu"), and the GPU memcpy / memset microseconds."""
    gpu, cpu = collections.defaultdict(lambda: [0.0, 0]), collections.defaultdict(lambda: [0.0, 0])
    copies = 0.0
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = str(e.get("cat", "")).lower()
        if cat == "kernel":
            t = gpu[e.get("name", "?")]
        elif cat in ("gpu_memcpy", "gpu_memset"):
            copies += float(e["dur"])
            continue
        elif cat == "cpu_op":
            t = cpu[e.get("name", "?")]
        else:
            continue
        t[0] += float(e["dur"])
        t[1] += 1
    return (gpu, "gpu", copies) if gpu else (cpu, "cpu", copies)


def summarize(path, steps=1):
    """One trace: what the tables show, per step."""
    by_name, source, copies = totals(load(path))
    steps = max(int(steps), 1)
    total = sum(t for t, _ in by_name.values())
    kinds = collections.defaultdict(float)
    attention = collections.defaultdict(float)
    for name, (t, _) in by_name.items():
        kinds[kind_of(name)] += t
        b = attention_backend(name)
        if b:
            attention[b] += t
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP]
    return {
        "trace": str(path), "source": source, "steps": steps,
        "ms_per_step": total / 1e3 / steps, "memcpy_memset_ms_per_step": copies / 1e3 / steps,
        "kinds": {k: {"ms_per_step": t / 1e3 / steps, "share": t / total if total else 0.0}
                  for k, t in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "attention": {b: {"ms_per_step": t / 1e3 / steps, "share": t / total if total else 0.0}
                      for b, t in sorted(attention.items(), key=lambda kv: -kv[1])},
        "attention_kernels": sorted({n for n in by_name if attention_backend(n)}),
        "top": [{"name": n, "ms_per_step": t / 1e3 / steps, "share": t / total if total else 0.0,
                 "calls_per_step": c / steps, "kind": kind_of(n)} for n, (t, c) in top],
    }


def short(name, n=110):
    name = re.sub(r"^void ", "", name).replace("|", "\\|")
    return name if len(name) <= n else name[:n - 3] + "..."


def attention_line(s):
    if not s["attention"]:
        return "none of cuDNN / flash / memory-efficient (unfused attention, or none in the step)"
    return ", ".join(f"{b} {v['ms_per_step']:.2f} ms/step ({100 * v['share']:.1f}%)" for b, v in s["attention"].items())


def markdown(runs, title="Kernel profile"):
    """runs: {label "bench/who": summary}. Markdown: per benchmark, a comparison
    by kind across its traces, then each trace's top kernels."""
    L = [f"# {title}", "",
         "GPU kernel time summed by kernel name over the profiled steps, divided by their count "
         "(memcpy / memset apart). Share = of the trace's kernel time. Kinds are told from the names "
         "(bench/gpu/kernel_table.py).", ""]
    benches = collections.OrderedDict()
    for label, s in runs.items():
        bench, _, who = label.partition("/")
        benches.setdefault(bench, collections.OrderedDict())[who or bench] = s
    for bench, whos in benches.items():
        L += [f"## {bench}", ""]
        if any(s["source"] == "cpu" for s in whos.values()):
            L += ["**No GPU kernels in (some of) these traces: CPU operators instead, inclusive times "
                  "(a smoke run on the CPU; the figures mean nothing).**", ""]
        cols = list(whos)
        L += ["| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        L.append("| kernel time per step (ms) | " + " | ".join(f"{whos[c]['ms_per_step']:.2f}" for c in cols) + " |")
        L.append("| memcpy / memset per step (ms) | " +
                 " | ".join(f"{whos[c]['memcpy_memset_ms_per_step']:.2f}" for c in cols) + " |")
        L.append("| attention kernel(s) | " + " | ".join(attention_line(whos[c]) for c in cols) + " |")
        kinds = []
        for s in whos.values():
            kinds += [k for k in s["kinds"] if k not in kinds]
        for k in kinds:
            cells = []
            for c in cols:
                v = whos[c]["kinds"].get(k)
                cells.append(f"{v['ms_per_step']:.2f} ({100 * v['share']:.1f}%)" if v else "-")
            L.append(f"| {k} (ms/step, share) | " + " | ".join(cells) + " |")
        L.append("")
        for who, s in whos.items():
            L += [f"### {bench} / {who}: the {TOP} most expensive kernels", "",
                  f"trace `{pathlib.Path(s['trace']).name}`, {s['steps']} step(s); attention kernels: "
                  + (", ".join(f"`{short(n, 90)}`" for n in s["attention_kernels"]) or "none"), "",
                  "| # | kernel | kind | ms/step | share | calls/step |", "|---:|---|---|---:|---:|---:|"]
            for i, t in enumerate(s["top"], 1):
                L.append(f"| {i} | `{short(t['name'])}` | {t['kind']} | {t['ms_per_step']:.3f} | "
                         f"{100 * t['share']:.1f}% | {t['calls_per_step']:g} |")
            L.append("")
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="LABEL=TRACE[:STEPS]")
    ap.add_argument("--out", required=True, help="markdown file to write (a .json beside it)")
    a = ap.parse_args()
    runs = {}
    for spec in a.traces:
        label, _, rest = spec.partition("=")
        path, _, steps = rest.rpartition(":") if re.search(r":\d+$", rest) else (rest, "", "1")
        runs[label] = summarize(path, int(steps or 1))
    out = pathlib.Path(a.out)
    out.write_text(markdown(runs))
    out.with_suffix(".json").write_text(json.dumps(runs, indent=2) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
