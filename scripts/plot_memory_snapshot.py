"""Draws a CUDA memory snapshot (nnstrain's memory_snapshot pickle, the format
PyTorch's memory viz reads) as a PNG: bytes allocated over the recorded
allocator events, as memory viz's "Active Memory Timeline" totals them. For
machines that cannot reach memory viz's page (it loads its script from a CDN).

  python scripts/plot_memory_snapshot.py RUN/memory/rank0_step5.pickle out.png
  (a memory viz HTML from `python -m torch.cuda._memory_viz trace_plot` works too)
"""
import base64
import json
import pickle
import re
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load(path):
    data = open(path, "rb").read()
    if path.endswith(".html"):  # trace_plot embeds the pickle as base64
        m = re.search(rb'const local_files = (\[.*?\]);?\n', data)
        data = base64.b64decode(json.loads(m.group(1))[0]["base64"])
    return pickle.loads(data)


def main(src, out):
    snap = load(src)
    events = [e for trace in snap["device_traces"] for e in trace]
    total, xs, ys = 0, [], []
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            total += e["size"]
        elif e["action"] == "free_completed":
            total -= e["size"]
        xs.append(i)
        ys.append(total / 2**20)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(xs, ys, lw=1)
    ax.set_xlabel("allocator event")
    ax.set_ylabel("allocated MiB")
    ax.set_title(f"{src.split('/')[-1]}: {len(events)} events, peak {max(ys, default=0):.0f} MiB")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
