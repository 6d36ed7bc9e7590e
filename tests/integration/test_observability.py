"""What a run shows about itself (docs/observability.md), checked against
readers nobody here wrote:

- TensorBoard: the event files nnstrain writes are read with the `tensorboard`
  package's own loader (which checks every record's CRC32C) and its
  EventAccumulator; every numeric field of every metrics.jsonl record is there as
  a scalar with the same step and the same value (as float32, what TensorBoard
  stores).
- The step-time split is in every logged record and the progress line.
- Profiler: the Chrome trace is valid JSON with forward, backward and optimizer
  ranges inside the profiled steps only.
- Resume: metrics.jsonl and TensorBoard show every step once after a run that
  went on past its last checkpoint is resumed, and the resumed steps equal the
  uninterrupted run's.
- Run folder and `nnstrain report`: config, plan, per-rank logs; a real PNG and
  the best validation loss.

Runs: the tiny GPT of tests/integration/configs/tiny_gpt.yaml, one CPU thread.
"""
import json
import subprocess

import numpy as np
import pytest

from conftest import SOURCE, nnstrain_bin_path, single_process_env

CONFIG = "tiny_gpt.yaml"
TIME_KEYS = ["time_data_ms", "time_forward_ms", "time_backward_ms", "time_comm_ms", "time_optimizer_ms"]


def tb_scalars(folder):
    """{tag: {step: value}} as TensorBoard's EventAccumulator sees `folder` (restart
    purging on), and the number of records its raw loader read from each file."""
    from tensorboard.backend.event_processing import event_accumulator, event_file_loader
    files = sorted(p for p in folder.iterdir() if "tfevents" in p.name)
    assert files, f"no event files in {folder}"
    records = {}
    for f in files:
        # The raw loader stops at the first record whose CRC (length or payload) fails.
        n = sum(1 for _ in event_file_loader.RawEventFileLoader(str(f)).Load())
        records[f.name] = n
    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"tag {tag}: a step appears twice: {steps}"
        out[tag] = {e.step: e.value for e in events}
    return out, records, files


def framed_records(path):
    """Record count from the TFRecord framing alone (lengths), to compare with what the reader accepted."""
    data = path.read_bytes()
    pos = n = 0
    while pos < len(data):
        length = int.from_bytes(data[pos:pos + 8], "little")
        pos += 8 + 4 + length + 4
        n += 1
    assert pos == len(data), f"{path}: framing does not end at the file's end"
    return n


def tag(key):
    """The tag nnstrain gives a metrics key (docs/observability.md): grouped into time/, val/, train/."""
    for group in ("time", "val"):
        if key.startswith(group + "_"):
            return group + "/" + key[len(group) + 1:]
    return "train/" + key


def assert_scalars_match(scalars, records, what):
    """Every numeric field of every record is a TensorBoard scalar at its step, equal as float32."""
    checked = 0
    for r in records:
        for key, v in r.items():
            if key == "step" or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            t = tag(key)
            assert t in scalars, f"{what}: tag {t} missing from TensorBoard (tags: {sorted(scalars)})"
            assert r["step"] in scalars[t], f"{what}: {t} has no value at step {r['step']}"
            got = scalars[t][r["step"]]
            assert np.float32(got) == np.float32(v), f"{what}: {t} at step {r['step']}: {got} != {v}"
            checked += 1
    return checked


@pytest.fixture(scope="module")
def straight(nnstrain, tiny_tokens, tmp_path_factory):
    """An uninterrupted 40-step run with checkpoints every 10 steps (module-wide)."""
    d = tmp_path_factory.mktemp("straight")
    run = nnstrain(CONFIG, "--vars.data", tiny_tokens, "--checkpoint.save_dir", d / "ckpt",
                   "--checkpoint.every_n_train_steps", 10, run_dir=d)
    return d, run


def test_tensorboard_events_hold_every_logged_scalar(straight):
    d, run = straight
    scalars, records, files = tb_scalars(d / "tensorboard")
    assert len(files) == 1
    assert records[files[0].name] == framed_records(files[0]), "the tensorboard reader rejected a record (CRC)"
    # Every step's training record: 40 of them, with the fields the issue asks for.
    assert [r["step"] for r in run.train] == list(range(1, 41))
    for key in ["loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_mb", *TIME_KEYS]:
        assert all(key in r for r in run.train), f"{key} missing from metrics.jsonl"
    n = assert_scalars_match(scalars, run.train + run.val, "straight run")
    assert n >= 40 * 11 + 4, n
    assert sorted(scalars["val/loss"]) == [10, 20, 30, 40]
    assert sorted(scalars["train/loss"]) == list(range(1, 41))
    assert "time/forward_ms" in scalars
    # Nothing in TensorBoard that the JSONL does not have.
    keys = {k for r in run.train + run.val for k in r if k != "step"}
    assert set(scalars) == {tag(k) for k in keys}, sorted(scalars)


def test_the_reader_checks_crcs(straight, tmp_path):
    """A flipped byte in the last record's payload must make the reader stop before it,
    so the record counts compared above do check nnstrain's CRC32C."""
    from tensorboard.backend.event_processing import event_file_loader
    src = next((straight[0] / "tensorboard").iterdir())
    data = bytearray(src.read_bytes())
    data[-8] ^= 0x01  # inside the last payload (its CRC is the final 4 bytes)
    bad = tmp_path / src.name
    bad.write_bytes(bytes(data))
    n_good = sum(1 for _ in event_file_loader.RawEventFileLoader(str(src)).Load())
    n_bad = sum(1 for _ in event_file_loader.RawEventFileLoader(str(bad)).Load())
    assert n_bad == n_good - 1 == framed_records(bad) - 1


def test_step_time_split_is_logged(straight):
    _, run = straight
    for r in run.train:
        parts = [r[k] for k in TIME_KEYS]
        assert all(p >= 0 for p in parts), r
        assert r["time_forward_ms"] > 0 and r["time_backward_ms"] > 0 and r["time_optimizer_ms"] > 0, r
    assert "time data " in run.output and "/ forward " in run.output and "/ optimizer " in run.output, run.output
    # Checked against another clock: the log's timestamps of consecutive progress
    # lines (one step apart here). A step's parts fit inside that gap (which adds
    # only the logging itself), and cover most of it: a part timed twice, or one
    # left out, would break one bound or the other.
    import datetime
    import re
    stamps = {int(m.group(2)): datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f")
              for m in re.finditer(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})\] \[info\] step (\d+)/", run.output)}
    by_step = {r["step"]: sum(r[k] for k in TIME_KEYS) for r in run.train}
    ratios = []
    for s in sorted(by_step):
        if s - 1 not in stamps or s not in stamps:
            continue
        gap_ms = (stamps[s] - stamps[s - 1]).total_seconds() * 1e3
        assert by_step[s] <= gap_ms + 1.0, f"step {s}: parts sum to {by_step[s]:.2f} ms, the log saw {gap_ms:.1f} ms"
        ratios.append(by_step[s] / max(gap_ms, 1.0))
    assert len(ratios) >= 30, sorted(stamps)
    assert float(np.median(ratios)) >= 0.5, f"the parts cover a median {np.median(ratios):.2f} of each step's wall time"


def test_run_folder_holds_config_plan_and_logs(straight):
    d, _ = straight
    assert "model:" in (d / "config.yaml").read_text()
    plan = json.loads((d / "plan.json").read_text())
    assert plan["dp"] == 1 and plan["tp"] == 1
    info = json.loads((d / "run.json").read_text())
    assert info["checkpoint_dir"] == str((d / "ckpt").resolve())
    assert info["tokens_per_step"] == 4 * 16
    log = (d / "logs" / "rank0.log").read_text()
    assert "training done" in log and "step 40/40" in log


def test_profiler_trace_has_step_parts(nnstrain, tiny_tokens, tmp_path):
    d = tmp_path / "prof"
    run = nnstrain(CONFIG, "--vars.data", tiny_tokens, "--max_train_steps", 8, "--profile.steps", "[3, 4]",
                   run_dir=d)
    trace = d / "profile" / "trace_rank0.json"
    assert trace.is_file(), run.output
    events = json.loads(trace.read_text())["traceEvents"]  # valid JSON, Chrome trace layout
    spans = [e for e in events if e.get("ph") == "X"]
    names = {e["name"] for e in spans}
    for want in ["ProfilerStep#3", "ProfilerStep#4", "data", "forward", "backward", "optimizer"]:
        assert want in names, f"{want} not among the trace's ranges"
    assert not {"ProfilerStep#2", "ProfilerStep#5"} & names, "steps outside [3, 4] were profiled"
    # Each profiled step holds its forward, backward and optimizer ranges (one micro-step each here).
    for n in (3, 4):
        step = next(e for e in spans if e["name"] == f"ProfilerStep#{n}")
        inside = [e["name"] for e in spans if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
        for part in ["data", "forward", "backward", "optimizer"]:
            assert part in inside, f"no {part} range inside ProfilerStep#{n}"
        assert inside.count("forward") == inside.count("backward") == 1, inside
    def ops_inside(part):
        r = next(e for e in spans if e["name"] == part)
        return {e["name"] for e in spans if e.get("cat") == "cpu_op" and r["ts"] <= e["ts"] <= r["ts"] + r["dur"]}
    assert ops_inside("forward") & {"aten::mm", "aten::matmul", "aten::addmm", "aten::linear"}, "no matmul in forward"
    assert any(n.endswith("Backward0") for n in ops_inside("backward")), "no autograd function in backward"


def test_two_ranks_write_a_trace_and_a_log_each(tiny_tokens, tmp_path):
    d = tmp_path / "dp2"
    args = [nnstrain_bin_path(), "launch", "--nproc-per-node", "2", "--", "--config",
            str(SOURCE / "tests/integration/configs" / CONFIG), "--vars.data", str(tiny_tokens), "--run_dir", str(d),
            "--max_train_steps", "4", "--checkpoint.save_dir=", "--profile.steps", "[2, 3]"]
    p = subprocess.run(args, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout + p.stderr
    for rank in (0, 1):
        events = json.loads((d / "profile" / f"trace_rank{rank}.json").read_text())["traceEvents"]
        names = {e["name"] for e in events if e.get("ph") == "X"}
        assert {"ProfilerStep#2", "ProfilerStep#3", "forward", "backward", "communication", "optimizer"} <= names
        assert (d / "logs" / f"rank{rank}.log").is_file()
    assert "world 2 (dp 2)" in (d / "logs" / "rank0.log").read_text()
    # Only rank 0 writes metrics and events: one record per step, one event file.
    recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4]
    assert len(list((d / "tensorboard").iterdir())) == 1


def test_resume_after_an_interrupted_run_logs_every_step_once(nnstrain, tiny_tokens, tmp_path, straight):
    """The first run checkpoints at 20 and dies at 25 (no save at the end); the
    resumed run goes from 20 to 40: steps 21..25 must not appear twice."""
    want = {r["step"]: r for r in straight[1].train}
    d = tmp_path / "split"
    common = ("--vars.data", tiny_tokens, "--checkpoint.save_dir", d / "ckpt", "--checkpoint.every_n_train_steps", 10)
    first = nnstrain(CONFIG, *common, "--max_train_steps", 25, "--checkpoint.save_on_end", "false", run_dir=d)
    assert sorted(first.losses()) == list(range(1, 26))
    second = nnstrain(CONFIG, *common, run_dir=d, resume=True)
    # Steps 21..25 and the evaluation at the first run's last step (25).
    assert "at step 20" in second.output and "dropped 6 records after step 20" in second.output, second.output
    losses = second.losses()  # asserts no step twice
    assert sorted(losses) == list(range(1, 41))
    assert [r["step"] for r in second.val] == [10, 20, 30, 40]
    for s in range(21, 41):
        for key in ("loss", "lr", "grad_norm"):
            got = next(r for r in second.train if r["step"] == s)[key]
            assert got == want[s][key], f"step {s} {key}: {got} != uninterrupted {want[s][key]}"

    scalars, records, files = tb_scalars(d / "tensorboard")
    assert len(files) == 2  # one per session; the second restarts at step 21
    for f in files:
        assert records[f.name] == framed_records(f)
    assert sorted(scalars["train/loss"]) == list(range(1, 41))
    assert_scalars_match(scalars, second.train + second.val, "resumed run")


def test_report_summarises_and_plots(straight):
    d, run = straight
    png = d / "curves.png"
    p = subprocess.run([nnstrain_bin_path(), "report", str(d), "--out", str(png)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    best = min(run.val, key=lambda r: r["val_loss"])
    assert f"best val loss    {best['val_loss']:.4f} at step {best['step']}" in p.stdout, p.stdout
    assert "steps            1 .. 40 (40 logged)" in p.stdout, p.stdout
    assert "step-00000040" in p.stdout and "step time split" in p.stdout, p.stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000, len(data)
    import matplotlib.image
    img = matplotlib.image.imread(str(png))  # a reader of its own decodes it
    assert img.shape[0] > 300 and img.shape[1] > 600, img.shape
    assert np.std(img[..., :3]) > 0.05, "the image is (nearly) blank"


def test_report_without_plot_prints_the_summary_and_writes_no_image(straight, tmp_path):
    d, run = straight
    before = set(d.rglob("*.png"))
    # A Python that does not exist: a plot attempted anyway would fail the command.
    p = subprocess.run([nnstrain_bin_path(), "report", str(d), "--no-plot"], capture_output=True, text=True,
                       timeout=120, env=single_process_env(1, NNSTRAIN_PYTHON="/nonexistent/python3"))
    assert p.returncode == 0, p.stdout + p.stderr
    best = min(run.val, key=lambda r: r["val_loss"])
    assert f"best val loss    {best['val_loss']:.4f} at step {best['step']}" in p.stdout, p.stdout
    assert set(d.rglob("*.png")) == before, "report --no-plot wrote an image"


def test_report_refuses_a_folder_without_metrics(tmp_path):
    p = subprocess.run([nnstrain_bin_path(), "report", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "metrics.jsonl: not found" in p.stderr, p.stderr


@pytest.mark.parametrize("override, message", [
    (("--profile.steps", "[5, 2]"), "profile.steps"),
    (("--memory_snapshot", "true"), "memory_snapshot: true needs"),
    (("--memory_snapshot_step", "3"), "memory_snapshot_step"),
])
def test_bad_observability_settings_are_refused(nnstrain, tiny_tokens, tmp_path, override, message):
    run = nnstrain(CONFIG, "--vars.data", tiny_tokens, "--max_train_steps", 2, *override, run_dir=tmp_path / "bad",
                   check=False)
    assert run.returncode == 2 and message in run.output, run.output
    assert "Traceback" not in run.output and "terminate called" not in run.output


def test_debug_keeps_the_backtrace_of_a_libtorch_error(tiny_tokens, tmp_path):
    # A LibTorch error raised inside step 2 (a test-only switch): one line naming
    # rank and step without --debug, LibTorch's C++ backtrace with it.
    outputs = {}
    for debug in (False, True):
        args = [nnstrain_bin_path(), "--config", str(SOURCE / "tests/integration/configs" / CONFIG), "--vars.data",
                str(tiny_tokens), "--run_dir", str(tmp_path / f"debug_{debug}"), "--max_train_steps", "4",
                "--checkpoint.save_dir="] + (["--debug"] if debug else [])
        p = subprocess.run(args, cwd=SOURCE, env=single_process_env(1, NNSTRAIN_TEST_TORCH_ERROR_AT="2"),
                           capture_output=True, text=True, timeout=120)
        out = p.stdout + p.stderr
        assert p.returncode != 0 and "injected error (NNSTRAIN_TEST_TORCH_ERROR_AT)" in out, out
        outputs[debug] = out
    assert "rank 0: step 2: injected error (NNSTRAIN_TEST_TORCH_ERROR_AT)" in outputs[False], outputs[False]
    assert "Exception raised from" not in outputs[False] and "frame #" not in outputs[False], outputs[False]
    assert "Exception raised from" in outputs[True] and "frame #" in outputs[True], outputs[True]
