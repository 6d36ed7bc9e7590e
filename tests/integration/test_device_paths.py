"""The paths whose correctness depends on the device: the asynchronous save's
copy (on CUDA a non-blocking device-to-host copy on a side stream that the
writer must wait for), CUDA graphs with what a real run does around them, and
the profiler's trace. Labelled `device` in CTest: on CPU (CI) each test checks
the CPU side; `NNSTRAIN_TEST_DEVICE=cuda ctest -L device` runs the CUDA side.

Runs: tests/integration/configs/tiny_gpt.yaml on the shared generated token
file, one process.
"""
import json
import pathlib
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import CONFIGS, SOURCE, TEST_DEVICE, device_args, nnstrain_bin_path, single_process_env

CONFIG = "tiny_gpt.yaml"
# About 0.1-0.2 s of GPU clock cycles ahead of every checkpoint's copies: a writer
# that did not wait for them would write buffers the copy has not filled.
COPY_DELAY_CYCLES = 200_000_000


def checkpoint_tensors(step_dir):
    out = {}
    for f in sorted(pathlib.Path(step_dir).glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            out[k] = v
    return out


def test_async_save_equals_the_synchronous_save_bitwise(tiny_tokens, tmp_path):
    runs = {}
    for mode in ("true", "false"):
        d = tmp_path / f"async_{mode}"
        args = [nnstrain_bin_path(), "--config", str(CONFIGS / CONFIG), "--run_dir", str(d), *device_args(1),
                "--vars.data", str(tiny_tokens), "--max_train_steps", "6", "--checkpoint.save_dir", str(d / "ckpt"),
                "--checkpoint.every_n_train_steps", "1", "--checkpoint.keep_last_n_checkpoints", "0",
                "--checkpoint.async_save", mode]
        env = single_process_env(1, NNSTRAIN_TEST_COPY_DELAY_CYCLES=COPY_DELAY_CYCLES)
        p = subprocess.run(args, cwd=SOURCE, env=env, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stdout + p.stderr
        runs[mode] = d / "ckpt"
    for step in range(1, 7):
        a = checkpoint_tensors(runs["true"] / f"step-{step:08d}")
        b = checkpoint_tensors(runs["false"] / f"step-{step:08d}")
        assert sorted(a) == sorted(b) and len(a) > 5, (sorted(a), sorted(b))
        for name in b:
            assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), f"step {step}: {name}"
    # The steps saved differ from each other (a stale buffer would repeat one).
    first, last = checkpoint_tensors(runs["true"] / "step-00000001"), checkpoint_tensors(runs["true"] / "step-00000006")
    assert any(not np.array_equal(first[k], last[k]) for k in first if k.startswith("model/"))


GRAPHS = ["--grad_accumulation_steps", 2, "--precision", "16-mixed", "--val_every_n_train_steps", 5,
          "--max_val_steps", 2, "--max_train_steps", 12, "--checkpoint.every_n_train_steps", 6]


def test_cuda_graphs_with_accumulation_fp16_evaluation_and_save(nnstrain, tiny_tokens, tmp_path):
    common = ["--vars.data", tiny_tokens, *GRAPHS, "--checkpoint.save_dir"]
    if TEST_DEVICE == "cpu":
        run = nnstrain(CONFIG, *common, tmp_path / "ckpt", "--compute_config.cuda_graphs", "true",
                       run_dir=tmp_path / "g", check=False)
        assert run.returncode == 2 and "compute_config.cuda_graphs needs a CUDA device" in run.output, run.output
        return
    eager = nnstrain(CONFIG, *common, tmp_path / "ck_eager", "--compute_config.cuda_graphs", "false",
                     run_dir=tmp_path / "eager")
    # The default (auto) captures on one GPU: the graph pool below shows it did.
    graphs = nnstrain(CONFIG, *common, tmp_path / "ck_graphs", run_dir=tmp_path / "graphs")
    le, lg = eager.losses(), graphs.losses()
    assert sorted(lg) == list(range(1, 13)), graphs.output
    worst = max(abs(lg[s] - le[s]) / abs(le[s]) for s in le)
    assert worst < 1e-5, (le, lg)  # the same kernels, replayed
    assert [r["step"] for r in graphs.val] == [5, 10, 12] and all(np.isfinite(r["val_loss"]) for r in graphs.val)
    assert (tmp_path / "ck_graphs" / "step-00000006" / "manifest.json").is_file()
    assert (tmp_path / "ck_graphs" / "step-00000012" / "manifest.json").is_file()
    # The replayed steps' memory figures are the capture's, within 10% of eager's.
    pe = {r["step"]: r["peak_tensor_mb"] for r in eager.train}
    pg = {r["step"]: r["peak_tensor_mb"] for r in graphs.train}
    assert all(abs(pg[s] / pe[s] - 1) < 0.10 for s in range(6, 13)), (pe, pg)
    assert all("graph_pool_mb" in r and "activation_mb" in r for r in graphs.train if r["step"] > 4), graphs.train
    # The time split: eager steps by part, replayed ones as data + the graph whole.
    assert all(r["time_forward_ms"] > 0 and "time_graph_ms" not in r for r in eager.train), eager.train
    replayed = [r for r in graphs.train if r["step"] > 4]
    assert replayed and all(r["time_graph_ms"] > 0 and "time_forward_ms" not in r for r in replayed), replayed


def test_profiler_trace_holds_the_devices_work(nnstrain, tiny_tokens, tmp_path):
    d = tmp_path / "prof"
    run = nnstrain(CONFIG, "--vars.data", tiny_tokens, "--max_train_steps", 5, "--profile.steps", "[3, 4]", run_dir=d)
    events = json.loads((d / "profile" / "trace_rank0.json").read_text())["traceEvents"]  # valid JSON
    cats = {e.get("cat") for e in events if e.get("ph") == "X"}
    assert "cpu_op" in cats, cats
    if TEST_DEVICE == "cuda":
        kernels = [e for e in events if e.get("cat") == "kernel"]
        assert len(kernels) > 20 and any("gemm" in e["name"].lower() or "gemv" in e["name"].lower() for e in kernels), \
            sorted({e["name"] for e in kernels})[:20]
    else:
        assert "kernel" not in cats, cats  # a CPU run launches no GPU kernel
