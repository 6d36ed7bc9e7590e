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
- What already lies under offload.nvme_path is never trusted: each run works
  in a private folder (rank<R>/run-XXXXXX, mode 0700, made fresh), so a
  symlink planted at a name the tier once used is never followed and its
  target never written; a rank folder that is a symlink, or owned by another
  user, is refused in one line naming it.
- A kernel whose io_uring lacks the read/write opcodes (5.1-5.5; the test hook
  NNSTRAIN_TEST_NVME_URING_PROBE=unsupported makes the probe say so): `auto`
  runs on the thread pool, `nvme_io: io_uring` exits 2 naming the key.
"""
import json
import os
import pathlib
import re
import resource
import signal
import stat
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


def command(tokens, run_dir, nproc, extra, steps=STEPS):
    args = ["--config", str(CONFIG), "--vars.data", str(tokens), "--run_dir", str(run_dir),
            "--max_train_steps", str(steps), *device_args(nproc), *extra]
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
        run_folder = pathlib.Path(nv["folder"])  # the run's private folder
        assert run_folder.parent == folder / f"rank{rank}" and re.fullmatch(r"run-\w{6}", run_folder.name), nv
        assert nv["params"] == params, nv
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
    (folder / "rank0").mkdir(mode=0o755)  # a rank folder left open to others: the run closes it
    os.chmod(folder / "rank0", 0o755)
    # The run stops itself (SIGSTOP) when step 3's optimizer step is about to
    # read its first chunk, after step 2's write-back is complete: the test
    # corrupts that chunk on disk while it is stopped.
    p = launch_single(tiny_tokens, tmp_path / "run", ("--precision", "32-true", *offload_args(folder, False)),
                      {"NNSTRAIN_TEST_NVME_FAULT": "3:stop"})
    _, status = os.waitpid(p.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"the run did not stop itself (status {status}): {p.communicate()}"
    run_folder = private_folder(folder)
    data = run_folder / "optimizer.bin"
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


def private_folder(folder, rank=0):
    """The running rank's private folder under `folder`: rank<R>/run-XXXXXX, both mode 0700 and this user's."""
    rank_folder = folder / f"rank{rank}"
    runs = list(rank_folder.iterdir())
    assert len(runs) == 1 and re.fullmatch(r"run-\w{6}", runs[0].name), runs
    for d in (rank_folder, runs[0]):
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid(), \
            f"{d}: mode {oct(st.st_mode)}, uid {st.st_uid}"
    assert sorted(x.name for x in runs[0].iterdir()) == ["NOTE.txt", "optimizer.bin"], list(runs[0].iterdir())
    return runs[0]


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
    assert re.search(rf"{folder}/rank0/run-\w{{6}}/optimizer.bin", lines[0]) and "rank 0" in lines[0] and \
        "File too large" in lines[0], lines[0]
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
    left = private_folder(folder)
    assert "the run died" in (left / "NOTE.txt").read_text()
    out2, recs = train_resumed(tiny_tokens, tmp_path / "second", extra)
    assert f"removed {left}, the files a run that did not exit cleanly left" in out2 and "at step 4" in out2, out2
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


def bad(tokens, tmp_path, *extra, env_extra=None, at_start=False):
    """The one line a refused run prints (at_start: refused when the tier starts, after the start-up log)."""
    p = subprocess.run(command(tokens, tmp_path / "run", 1, ("--precision", "32-true", *extra)), cwd=SOURCE,
                       env=single_process_env(1, **(env_extra or {})), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = error_lines(p.stderr) if at_start else p.stderr.strip().splitlines()
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


def short_run(tokens, run_dir, folder, io="auto", env_extra=None, steps=2):
    cmd = command(tokens, run_dir, 1, ("--precision", "32-true", *offload_args(folder, False, io)), steps=steps)
    p = subprocess.run(cmd, cwd=SOURCE, env=single_process_env(1, **(env_extra or {})), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stdout}{p.stderr}"
    assert sorted(io_per_step(run_dir, 0)) == list(range(1, steps + 1)), p.stdout + p.stderr  # the tier did its I/O
    return p.stdout + p.stderr


def test_kernel_without_io_uring_read_write_falls_back_to_threads(tiny_tokens, tmp_path):
    """The probe says the kernel's io_uring has no IORING_OP_READ/WRITE (as 5.1-5.5): `auto` steps on the thread
    pool and says why; `io_uring` asked for exits 2 in one line naming the key."""
    folder = tmp_path / "nvme"
    folder.mkdir()
    hook = {"NNSTRAIN_TEST_NVME_URING_PROBE": "unsupported"}
    out = short_run(tiny_tokens, tmp_path / "auto", folder, "auto", hook)
    nv = active_records(tmp_path / "auto", 1)[0]["offload"]["nvme"]
    assert nv["engine"] == "threads", nv
    assert "I/O engine threads" in out and "IORING_OP_READ" in out, out
    line = bad(tiny_tokens, tmp_path, *offload_args(folder, False, "io_uring"), env_extra=hook, at_start=True)
    assert "compute_config.offload.nvme_io" in line and "io_uring" in line and "IORING_OP_READ" in line, line
    assert list(folder.iterdir()) == [], list(folder.iterdir())
    print(f"\n{line}")


def test_planted_symlinks_are_never_followed(tiny_tokens, tmp_path):
    """Another user's symlinks under offload.nvme_path: the rank folder as a symlink is refused naming it;
    symlinks at the names the tier's files once had are left alone; their targets keep their content."""
    victim = tmp_path / "victim"
    victim.mkdir()
    theirs = {"optimizer.bin": b"their optimizer file", "params.bin": b"their params", "NOTE.txt": b"their note"}
    for name, data in theirs.items():
        (victim / name).write_bytes(data)
    folder = tmp_path / "nvme"
    folder.mkdir()
    (folder / "rank0").symlink_to(victim)
    line = bad(tiny_tokens, tmp_path, *offload_args(folder, False), at_start=True)
    assert f"{folder}/rank0" in line and "symbolic link" in line and "compute_config.offload.nvme_path" in line, line
    (folder / "rank0").unlink()
    (folder / "rank0").mkdir(mode=0o700)
    for name in theirs:
        (folder / "rank0" / name).symlink_to(victim / name)
    short_run(tiny_tokens, tmp_path / "run", folder)
    assert {x.name: x.read_bytes() for x in victim.iterdir()} == theirs
    left = sorted((x.name, x.is_symlink()) for x in (folder / "rank0").iterdir())
    assert left == [(name, True) for name in sorted(theirs)], left  # untouched, nothing else left behind
    print(f"\n{line}")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_rank_folder_of_another_user_is_refused(tiny_tokens, tmp_path):
    folder = tmp_path / "nvme"
    folder.mkdir()
    (folder / "rank0").mkdir(mode=0o777)
    os.chmod(folder / "rank0", 0o777)  # even one this user could write into
    os.chown(folder / "rank0", 65534, 65534)  # nobody
    line = bad(tiny_tokens, tmp_path, *offload_args(folder, False), at_start=True)
    assert f"{folder}/rank0" in line and "owned by uid 65534" in line and "compute_config.offload.nvme_path" in line, line
    assert list((folder / "rank0").iterdir()) == []
    print(f"\n{line}")
