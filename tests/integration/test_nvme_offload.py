"""Offload to NVMe (compute_config.offload: nvme, issue 42) changes where the
offloaded state lives (files under offload.nvme_path, streamed through a
bounded host buffer), not what training computes.

- Parity: for the same seed and batch, `optimizer: nvme` equals the host tier
  (`optimizer: true`) bitwise over 10 steps in 32-true and bf16-mixed at one
  rank, and ZeRO-3 `params: nvme` at dp 2; the buffer holds 2 slots of the
  ~12 buckets, so the state streams through it in many chunks. That the files
  were used is read from what ran: each rank's record names the tier's folder,
  engine and slot count, and its log gives every step's bytes read and written
  (all the offloaded state, one chunk per bucket, plus the parameter chunks).
- The pread/pwrite thread pool gives the io_uring run's numbers exactly.
- Failures: a chunk corrupted on disk between two steps is named at the next
  read; a file size limit (RLIMIT_FSIZE, standing in for a full disk) fails at
  start in one line naming the file and the rank; a run killed in the middle
  of a step's write-back leaves its folder with a note and resumes from its
  checkpoint to the uninterrupted run's numbers; a clean exit removes the folder.
- Bad input exits 2 naming the key.
"""
import json
import os
import pathlib
import re
import resource
import signal
import subprocess

import pytest

from conftest import (CONFIGS, SOURCE, TEST_DEVICE, active_records, device_args, nnstrain_bin_path, read_metrics,
                      single_process_env)

CONFIG = CONFIGS / "tiny_dp.yaml"  # ~30k parameters in ~12 buckets of 0.01 MB
STEPS = 10
# 2 slots of a bucket's weights, moments and stage (ZeRO-3: of a unit's chunk, and the parameter read-ahead)
BUFFER_MB = {False: "0.15", True: "0.3"}
EXACT = TEST_DEVICE == "cpu"  # a GPU's device step is not bitwise repeatable (test_offload.py)

SETUPS = {  # name: (processes, precision, overrides)
    "fp32": (1, "32-true", ()),
    "bf16_mixed": (1, "bf16-mixed", ()),
    "zero3_dp2": (2, "32-true", ("--compute_config.use_zero", "3")),
}


def command(tokens, run_dir, nproc, extra):
    args = ["--config", str(CONFIG), "--vars.data", str(tokens), "--run_dir", str(run_dir),
            "--max_train_steps", str(STEPS), *device_args(nproc), *extra]
    return [nnstrain_bin_path(), *args] if nproc == 1 else \
        [nnstrain_bin_path(), "launch", "--nproc-per-node", str(nproc), "--", *args]


def train(tokens, run_dir, nproc, extra, env_extra=None):
    cmd = command(tokens, run_dir, nproc, extra)
    p = subprocess.run(cmd, cwd=SOURCE, env=single_process_env(1, **(env_extra or {})), capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stdout}{p.stderr}"
    recs, _ = read_metrics(pathlib.Path(run_dir) / "metrics.jsonl")
    assert sorted(r["step"] for r in recs) == list(range(1, STEPS + 1)), p.stdout + p.stderr
    return p.stdout + p.stderr, {r["step"]: r for r in recs}


def offload_args(nvme_dir, params, io="auto"):
    tier = ("--compute_config.offload.optimizer", "nvme" if nvme_dir else "true")
    if params:
        tier += ("--compute_config.offload.params", "nvme" if nvme_dir else "true")
    if nvme_dir:
        tier += ("--compute_config.offload.nvme_path", str(nvme_dir), "--compute_config.offload.nvme_io", io,
                 "--compute_config.offload.nvme_buffer_mb", BUFFER_MB[params])
    return tier


def io_per_step(run_dir, rank):
    """{step: (bytes read, chunks read, bytes written, chunks written)} from the rank's log."""
    log = (pathlib.Path(run_dir) / "logs" / f"rank{rank}.log").read_text()
    return {int(m[0]): tuple(map(int, m[1:5])) for m in re.findall(
        r"nvme offload: step (\d+) read (\d+) bytes in (\d+) chunks, wrote (\d+) bytes in (\d+) chunks \((\w+)\)", log)}


@pytest.fixture(scope="module")
def runs(tiny_tokens, tmp_path_factory):
    cache = {}

    def get(setup, nvme, io="auto"):
        key = (setup, nvme, io)
        if key not in cache:
            nproc, precision, extra = SETUPS[setup]
            d = tmp_path_factory.mktemp(f"{setup}_{'nvme_' + io if nvme else 'host'}")
            folder = d / "nvme"
            folder.mkdir()
            out, recs = train(tiny_tokens, d / "run", nproc,
                              (*extra, "--precision", precision,
                               *offload_args(folder if nvme else None, setup == "zero3_dp2", io)))
            cache[key] = (out, recs, d / "run", nproc, folder)
        return cache[key]
    return get


def assert_files_used(run, params):
    """The tier ran as the record says, streamed every step's state through its slots, and cleaned up."""
    out, _, run_dir, nproc, folder = run
    records = active_records(run_dir, nproc)
    for rank in range(nproc):
        off = records[rank]["offload"]
        nv = off["nvme"]
        assert nv["folder"] == str(folder / f"rank{rank}") and nv["params"] == params, nv
        buckets = off["host_buckets"]
        assert 2 <= nv["slots"] < buckets, f"rank {rank}: {nv['slots']} slots for {buckets} buckets: nothing streamed"
        io = io_per_step(run_dir, rank)
        assert sorted(io) == list(range(1, STEPS + 1)), io
        for step, (rb, rc, wb, wc) in io.items():
            # Every offloaded bucket read and written once (ZeRO-3: its parameter chunk written too, and read per gather).
            assert rc >= buckets and wc == buckets * (2 if params else 1), (rank, step, io[step], buckets)
            assert rb >= nv["file_bytes"] // (2 if params else 1) * 0.9 and wb > 0, (rank, step, io[step], nv)
            if params:
                assert rc > buckets, f"rank {rank} step {step}: no parameter chunk read for a gather"
    assert f"nvme offload: removed {folder}/rank0" in out, out
    assert list(folder.iterdir()) == [], f"{folder} not emptied at a clean exit: {list(folder.iterdir())}"


def assert_same(a, b, what):
    for s in range(1, STEPS + 1):
        for key in ("loss", "grad_norm"):
            x, y = a[s][key], b[s][key]
            if EXACT:
                assert x == y, f"{what}: step {s} {key} {x!r} vs {y!r} (not bitwise equal)"
            else:
                assert abs(x - y) <= 1e-4 * abs(y), f"{what}: step {s} {key} {x} vs {y}"
    assert b[STEPS]["loss"] < b[1]["loss"] - 0.05  # it trained


@pytest.mark.parametrize("setup", list(SETUPS))
def test_nvme_tier_equals_host_tier(runs, setup):
    host, nvme = runs(setup, False), runs(setup, True)
    assert "offload: optimizer state of" in host[0] and "nvme offload" not in host[0], host[0]
    assert_files_used(nvme, params=setup == "zero3_dp2")
    assert_same(nvme[1], host[1], f"{setup}: nvme vs host tier")
    io = io_per_step(nvme[2], 0)[STEPS]
    print(f"\n{setup}: nvme == host tier over {STEPS} steps; step {STEPS} read {io[0]} bytes in {io[1]} chunks, "
          f"wrote {io[2]} in {io[3]}")


def test_thread_pool_equals_io_uring(runs):
    ring, pool = runs("fp32", True, "auto"), runs("fp32", True, "threads")
    engine = active_records(ring[2], 1)[0]["offload"]["nvme"]["engine"]
    if engine != "io_uring":
        why = re.search(r"I/O engine threads: (.*)", ring[0])
        pytest.skip(f"io_uring unavailable here: {why.group(1) if why else ring[0][-400:]}")
    assert active_records(pool[2], 1)[0]["offload"]["nvme"]["engine"] == "threads"
    assert_files_used(pool, params=False)
    assert_same(pool[1], ring[1], "thread pool vs io_uring")


def launch_single(tokens, run_dir, extra, env_extra=None, preexec=None):
    return subprocess.Popen(command(tokens, run_dir, 1, extra), cwd=SOURCE, env=single_process_env(1, **(env_extra or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)


def error_lines(stderr):
    return [l for l in stderr.splitlines() if "error" in l.lower()]


def test_corrupt_chunk_is_named_at_the_next_read(tiny_tokens, tmp_path):
    folder = tmp_path / "nvme"
    folder.mkdir()
    # The run stops itself (SIGSTOP) when step 3's optimizer step is about to
    # read its first chunk, after step 2's write-back is complete: the test
    # corrupts that chunk on disk while it is stopped.
    p = launch_single(tiny_tokens, tmp_path / "run", ("--precision", "32-true", *offload_args(folder, False)),
                      {"NNSTRAIN_TEST_NVME_FAULT": "3:stop"})
    _, status = os.waitpid(p.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"the run did not stop itself (status {status}): {p.communicate()}"
    data = folder / "rank0" / "optimizer.bin"
    with open(data, "r+b") as f:  # flip a byte of chunk 0's weights
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x40]))
    os.kill(p.pid, signal.SIGCONT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, out + err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert f"{data} chunk 0" in lines[0] and "rank 0" in lines[0] and "checksum mismatch" in lines[0], lines[0]
    print(f"\n{lines[0]}")


def test_file_size_limit_fails_at_start_in_one_line(tiny_tokens, tmp_path):
    folder = tmp_path / "nvme"
    folder.mkdir()
    limit = 64 << 10  # below the ~1 MB the optimizer file needs, above the logs written before it

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    p = launch_single(tiny_tokens, tmp_path / "run", ("--precision", "32-true", *offload_args(folder, False)),
                      preexec=cap)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, out + err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert f"{folder}/rank0/optimizer.bin" in lines[0] and "rank 0" in lines[0] and "File too large" in lines[0], lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or "step" not in (tmp_path / "run" / "metrics.jsonl").read_text()
    print(f"\n{lines[0]}")


def test_killed_mid_step_resumes_from_the_checkpoint(tiny_tokens, tmp_path, runs):
    folder = tmp_path / "nvme"
    folder.mkdir()
    save = tmp_path / "ckpt"
    extra = ("--precision", "32-true", *offload_args(folder, False), "--checkpoint.save_dir", str(save),
             "--checkpoint.every_n_train_steps", "2")
    # SIGKILL in step 5's optimizer step, once bucket 0 is written back and bucket 1 read: mid-step by construction.
    p = launch_single(tiny_tokens, tmp_path / "first", extra, {"NNSTRAIN_TEST_NVME_FAULT": "5:kill"})
    out, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL, out + err
    left = sorted(x.name for x in (folder / "rank0").iterdir())
    assert left == ["NOTE.txt", "optimizer.bin"], left
    assert "the run died" in (folder / "rank0" / "NOTE.txt").read_text()
    out2, recs = train_resumed(tiny_tokens, tmp_path / "second", extra)
    assert "holds files a run that did not exit cleanly left" in out2 and "at step 4" in out2, out2
    ref = runs("fp32", False)[1]  # the host tier's uninterrupted run
    for s in range(5, STEPS + 1):
        for key in ("loss", "grad_norm"):
            a, b = recs[s][key], ref[s][key]
            assert (a == b) if EXACT else abs(a - b) <= 1e-4 * abs(b), f"step {s} {key}: resumed {a!r} vs {b!r}"
    assert list(folder.iterdir()) == []


def train_resumed(tokens, run_dir, extra):
    cmd = command(tokens, run_dir, 1, (*extra, "--resume"))
    p = subprocess.run(cmd, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stdout}{p.stderr}"
    recs, _ = read_metrics(pathlib.Path(run_dir) / "metrics.jsonl")
    return p.stdout + p.stderr, {r["step"]: r for r in recs}


def bad(tokens, tmp_path, *extra):
    p = subprocess.run(command(tokens, tmp_path / "run", 1, ("--precision", "32-true", *extra)), cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


def test_bad_input_exits_2_naming_the_key(tiny_tokens, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    line = bad(tiny_tokens, tmp_path, "--compute_config.offload.optimizer", "nvme")
    assert "compute_config.offload.nvme_path" in line and "required" in line, line
    line = bad(tiny_tokens, tmp_path, "--compute_config.offload.optimizer", "nvme",
               "--compute_config.offload.nvme_path", str(a_file))
    assert "compute_config.offload.nvme_path" in line and "is not a folder" in line, line
    line = bad(tiny_tokens, tmp_path, "--compute_config.offload.optimizer", "nvme",
               "--compute_config.offload.nvme_path", str(tmp_path / "missing"))
    assert "compute_config.offload.nvme_path" in line and "does not exist" in line, line
    line = bad(tiny_tokens, tmp_path, "--compute_config.offload.optimizer", "nvme", "--compute_config.offload.params",
               "nvme", "--compute_config.offload.nvme_path", str(tmp_path))
    assert "compute_config.offload.params" in line and "use_zero: 3" in line, line
    line = bad(tiny_tokens, tmp_path, "--compute_config.offload.optimizer", "nvme", "--compute_config.offload.nvme_path",
               str(tmp_path), "--compute_config.offload.nvme_io", "aio")
    assert "compute_config.offload.nvme_io" in line, line


def test_planner_takes_the_nvme_tier_last_where_a_disk_was_probed(tiny_tokens, tmp_path):
    """GPT ~0.8M at one rank with a device budget only offload meets and a host too small for the host tier:
    no plan without a disk (the error names the host memory), ZeRO-3 with the optimizer and parameters on
    NVMe once `--probe-disk` measured one, its files and the disk time in the estimate."""
    gpt = CONFIGS / "tiny_gpt.yaml"
    wide = ["--model.args.n_embd", "128", "--model.args.n_layer", "4", "--model.args.n_head", "4"]

    def plan(*extra):
        return subprocess.run([nnstrain_bin_path(), "plan", "--config", str(gpt), "--vars.data", str(tiny_tokens),
                               "--runtime-ngpus", "1", "--json", "--pas_policy", "autodist", *wide,
                               "--compute_config.offload.nvme_buffer_mb", "1", *map(str, extra)],
                              cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)
    disk = tmp_path / "disk"
    disk.mkdir()
    host_tier = json.loads(plan("--compute_config.offload.optimizer", "true", "--memory-budget-gb", 1000).stdout)["plan"]
    plain = json.loads(plan("--memory-budget-gb", 1000, "--model.activation_checkpointing", "true").stdout)["plan"]
    infinity = json.loads(plan("--memory-budget-gb", 1000, "--compute_config.use_zero", 3, "--compute_config.offload.optimizer",
                               "nvme", "--compute_config.offload.params", "nvme", "--compute_config.offload.nvme_path",
                               disk).stdout)["plan"]
    # A device budget the plan without offload misses and ZeRO-3 on NVMe meets; half the host tier's host memory.
    assert infinity["estimate"]["total_bytes"] < plain["estimate"]["total_bytes"], (infinity, plain)
    budget = (infinity["estimate"]["total_bytes"] + plain["estimate"]["total_bytes"]) / 2 / 2 ** 30
    host_gb = host_tier["estimate"]["host_bytes"] / 2 / 2 ** 30
    refused = plan("--memory-budget-gb", budget, "--host-memory-gb", host_gb)
    assert refused.returncode == 1 and "no plan fits the host memory" in refused.stderr and "--probe-disk" in refused.stderr, \
        refused.stderr
    p = plan("--memory-budget-gb", budget, "--host-memory-gb", host_gb, "--probe-disk", disk)
    assert p.returncode == 0, p.stderr
    chosen = json.loads(p.stdout)["plan"]
    assert chosen["offload"] == {"optimizer": True, "params": True, "ratio": 1.0, "nvme": True} and chosen["zero"] == 3, chosen
    est = chosen["estimate"]
    assert est["total_bytes"] <= budget * 2 ** 30 and est["host_bytes"] <= host_gb * 2 ** 30, est
    assert est["nvme_bytes"] >= 0.9 * host_tier["estimate"]["host_bytes"] * 12 / 20 and est["nvme_s"] > 0, est
    assert list(disk.iterdir()) == []  # the probe's files are gone
