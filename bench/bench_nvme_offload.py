#!/usr/bin/env python3
"""NVMe offload (compute_config.offload: nvme): the tier's read and write rates
against fio and dd on the same folder in the same run, and training tokens/s
with the state on NVMe against the host tier.

1. The disk's sequential rates, three ways, on --dir: fio (sequential write,
   then read, 2 MiB blocks, O_DIRECT, io_uring, queue depth 16, 1 GiB), dd
   (8 MiB blocks, O_DIRECT, fsync), and the NVMe tier's own engine as
   `nnstrain plan --probe-disk` runs it (8 MiB chunks, 8 in flight, O_DIRECT
   where the filesystem allows; 1 GiB written, then read back). Each is run
   --rounds times, interleaved; the median is reported.
2. Training on CPU (GPT, 4 layers, n_embd 256, 3.3M parameters, fp32, bucket
   cap 1 MB so the state streams in ~14 chunks through a 12 MiB buffer (3 slots)), host
   tier against nvme tier (io_uring and the thread pool), interleaved rounds;
   tokens/s is the median over rounds of each run's median over its logged
   steps after the first, and the nvme runs' bytes read and written per step
   come from their logs.

Results: bench/results/nvme_offload_<stamp>.{json,md}.
"""
import json
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from bench_common import ROOT, machine_line, parse_args, random_tokens, result_record, run_single, write_result

GIB = 1 << 30
CONFIG = """
model: {{type: gpt, args: {{vocab_size: 256, block_size: 128, n_layer: 4, n_head: 4, n_embd: 256, dropout: 0.0, bias: true}}}}
optimizer: {{type: adamw, args: {{lr: 1.0e-3}}, clip_gnorm: 1.0}}
dataset: {{type: token_bin, train_args: {{path: {data}, dtype: uint16, seq_len: 128}}}}
compute_config: {{device: cpu, backend: gloo, reducer_bucket_cap_mb: 1}}
pas_policy: dp
micro_batch_size: 8
log_progress_every_n_train_steps: 1
max_train_steps: 12
seed: 1
"""


def fio(dirpath, rw):
    p = subprocess.run(["fio", "--name=seq", f"--directory={dirpath}", f"--rw={rw}", "--bs=2M", "--size=1G",
                        "--direct=1", "--ioengine=io_uring", "--iodepth=16", "--end_fsync=1", "--output-format=json"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"fio failed: {p.stderr}")
    job = json.loads(p.stdout)["jobs"][0]
    return job["write" if rw == "write" else "read"]["bw_bytes"]


def dd(dirpath):
    f = pathlib.Path(dirpath) / "dd.bin"

    def rate(args):
        p = subprocess.run(["dd", *args, "bs=8M", "count=128"], capture_output=True, text=True)
        m = re.search(r"copied, ([0-9.]+) s", p.stderr)
        if p.returncode != 0 or not m:
            sys.exit(f"dd failed: {p.stderr}")
        return GIB / float(m.group(1))
    w = rate(["if=/dev/zero", f"of={f}", "oflag=direct", "conv=fsync"])
    r = rate([f"if={f}", "of=/dev/null", "iflag=direct"])
    f.unlink()
    return w, r


def probe(binary, config, dirpath):
    p = run_single([binary, "plan", "--config", config, "--probe-disk", dirpath], 1)
    m = re.search(r"disk: .*: write ([0-9.]+) GB/s, read ([0-9.]+) GB/s per node \(.*probed, (\w+), (\S+)\)", p.stdout)
    if not m:
        sys.exit(f"no probe line in:\n{p.stdout}")
    return float(m.group(1)) * 1e9, float(m.group(2)) * 1e9, m.group(3), m.group(4)


def train(binary, config, data, run_dir, extra):
    shutil.rmtree(run_dir, ignore_errors=True)
    p = run_single([binary, "--config", config, "--run_dir", run_dir, "--max_train_steps", "12", *extra], 1)
    out = p.stdout + p.stderr
    tps = [float(t) for s, t in re.findall(r"step (\d+)/\d+: .*?, ([0-9.]+) tok/s", out) if int(s) > 1]
    io = [tuple(map(int, m)) for m in re.findall(r"nvme offload: step \d+ read (\d+) bytes in \d+ chunks, wrote (\d+)", out)]
    return statistics.median(tps), io


def main():
    args = parse_args(__doc__, lambda ap: (ap.add_argument("--dir", required=True, help="a folder on the disk to measure"),
                                           ap.add_argument("--rounds", type=int, default=3)))
    import datetime
    stamp = datetime.datetime.now(datetime.timezone.utc)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_nvme_"))
    config = work / "gpt.yaml"
    data = random_tokens(work / "tokens.bin", 256, 200_000)
    config.write_text(CONFIG.format(data=data))
    disk = pathlib.Path(args.dir) / f"bench_nvme_{stamp.strftime('%H%M%S')}"
    disk.mkdir()
    rates = {"fio": [], "dd": [], "offload": []}
    engine = direct = None
    for _ in range(args.rounds):
        rates["fio"].append((fio(disk, "write"), fio(disk, "read")))
        for f in disk.iterdir():
            f.unlink()
        rates["dd"].append(dd(disk))
        w, r, engine, direct = probe(args.nnstrain, config, disk)
        rates["offload"].append((w, r))
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in rates.items()}

    nv = ["--compute_config.offload.optimizer", "nvme", "--compute_config.offload.nvme_path", str(disk),
          "--compute_config.offload.nvme_buffer_mb", "12"]
    setups = {"host tier": ["--compute_config.offload.optimizer", "true"],
              "nvme tier, io_uring": [*nv, "--compute_config.offload.nvme_io", "auto"],
              "nvme tier, threads": [*nv, "--compute_config.offload.nvme_io", "threads"]}
    tps = {k: [] for k in setups}
    io = {}
    for _ in range(args.rounds):
        for k, extra in setups.items():
            t, steps = train(args.nnstrain, config, data, work / "run", extra)
            tps[k].append(t)
            if steps:
                io[k] = steps[-1]
    shutil.rmtree(disk, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)

    rec = result_record(args.nnstrain, stamp, dir=str(args.dir), rounds=args.rounds, engine=engine, direct=direct,
                        rates={k: {"write": w, "read": r} for k, (w, r) in med.items()}, rounds_raw=rates,
                        tokens_per_s={k: statistics.median(v) for k, v in tps.items()}, io_per_step=io)
    ref_w, ref_r = med["fio"]
    md = [f"# NVMe offload: the tier's disk rates against fio and dd, tokens/s against the host tier ({stamp:%Y-%m-%d})",
          "", machine_line(rec), f"- folder: {args.dir}; offload engine {engine} ({direct}); {args.rounds} rounds, medians",
          "", "| measured with | write GB/s | read GB/s | write / fio | read / fio |", "|---|---|---|---|---|"]
    for k, (w, r) in med.items():
        md.append(f"| {k} | {w / 1e9:.2f} | {r / 1e9:.2f} | {100 * w / ref_w:.0f}% | {100 * r / ref_r:.0f}% |")
    md += ["", "| training (GPT 3.3M, fp32, CPU) | tokens/s | vs host tier | bytes read / written per step |",
           "|---|---|---|---|"]
    base = statistics.median(tps["host tier"])
    for k, v in tps.items():
        rw = io.get(k)
        md.append(f"| {k} | {statistics.median(v):.0f} | {100 * statistics.median(v) / base:.0f}% | "
                  + (f"{rw[0]} / {rw[1]}" if rw else "(host memory)") + " |")
    write_result(args.out, "nvme_offload", stamp, rec, md)


if __name__ == "__main__":
    main()
