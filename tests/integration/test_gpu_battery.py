"""The GPU battery's dry run on the CPU (issue 37): what a GPU call runs is built
here and carried as .gpu_bundle/ (bench/gpu/prepare.sh), and battery.sh runs it
with no build step. Here the bundle is taken from this build folder
(NNSTRAIN_BUNDLE_FROM, so nothing is compiled), checked with the venv and the
build folders hidden (prepare.sh's check), and the battery then runs in smoke
mode from it: the device tests through the CTest file it generates from the
bundle, and the parallel_cuda phase (pp 2 / cp 2 / offload against one process).
Each assertion reads what ran: the battery's own log and results, not the flags.
"""
import json
import os
import pathlib
import subprocess
import sys

from conftest import SOURCE

BUILD = pathlib.Path(os.environ.get("NNSTRAIN_BUILD_DIR", SOURCE / "build"))
VENV = pathlib.Path(sys.executable).parent.parent  # CTest runs pytest with the venv's python


def test_bundle_from_this_build_runs_the_battery_without_building(tmp_path):
    bundle = tmp_path / "bundle"
    env = dict(os.environ, NNSTRAIN_VENV=str(VENV), NNSTRAIN_BUNDLE=str(bundle), NNSTRAIN_BUNDLE_FROM=str(BUILD))
    p = subprocess.run(["bash", SOURCE / "bench/gpu/prepare.sh"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "check passed" in p.stderr, p.stderr[-2000:]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["bytes"] < 60 * 2**20, manifest["bytes"]
    files = manifest["files"]
    for f in ("bin/nnstrain", "bin/nnstrain_tests", "bin/nnstrain_nccl_graph_check", "device_tests.json",
              "data/shakespeare_char/train.bin", "lib/libyaml-cpp.so.0.7"):
        assert f in files, (f, sorted(files))
    assert not any(f.startswith("lib/") and "torch" in f for f in files), "LibTorch itself is never bundled"

    # A bundle whose files changed since its manifest is refused before anything runs.
    results, out = tmp_path / "results", tmp_path / "out"
    # Named relative to the working directory: the battery must make it absolute, since the tests
    # it runs start elsewhere and load the bundle's libraries through LD_LIBRARY_PATH.
    benv = dict(os.environ, NNSTRAIN_BUNDLE="bundle", NNSTRAIN_BATTERY_SMOKE="1", NNSTRAIN_BATTERY_RESULTS=str(results),
                OUT=str(out), NNSTRAIN_BATTERY_PYTHON=sys.executable, NNSTRAIN_BATTERY_BUDGET_S="240",
                NNSTRAIN_BATTERY_TESTS="device[.]nccl_graph_check$|unit[.]device_tagged", OMP_NUM_THREADS="1")
    benv.pop("NNSTRAIN_BIN", None)
    data = bundle / "device_tests.json"
    original = data.read_text()
    data.write_text(original.replace("device", "devicE", 1))
    bad = subprocess.run(["bash", SOURCE / "bench/gpu/battery.sh", "build"], env=dict(benv, NNSTRAIN_BATTERY_RESULTS=str(tmp_path / "bad")),
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "does not match its manifest.json" in bad.stdout, bad.stdout[-2000:]
    data.write_text(original)

    checkout_data = SOURCE / "data" / "shakespeare_char"
    had_data = checkout_data.exists()
    b = subprocess.run(["bash", SOURCE / "bench/gpu/battery.sh", "build", "tests", "parallel_cuda"], env=benv,
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = (results / "battery.log").read_text()
    assert b.returncode == 0, log[-3000:]
    libraries = log.split("libraries: ", 1)[1].split("\n", 1)[0].split(":")
    assert str(bundle / "lib") in libraries, libraries
    assert "nothing to build" in log and "configuring" not in log and "building" not in log, log[-3000:]
    r = json.loads((results / "results.json").read_text())
    # The generated CTest file ran the bundle's device check (skipped: no CUDA) and the unit
    # binary's [device] cases (passed on the CPU) from the bundle's bin/.
    tests = r["tests"]
    assert tests["rc"] == 0 and tests["summary"].startswith("1 of 2 passed on cpu, 1 skipped"), tests
    ctest_file = (SOURCE / "runs/battery_device_tests/CTestTestfile.cmake").read_text()
    assert str(bundle / "bin/nnstrain_tests") in ctest_file and str(BUILD) not in ctest_file
    runs = r["benchmarks"]["parallel_cuda"]["runs"]
    assert set(runs) == {"one", "pp2", "cp2", "offload"}, runs
    for tag in ("pp2", "cp2", "offload"):
        assert runs[tag]["pass"] is True, (tag, runs[tag])
    assert runs["pp2"]["ran"]["1"]["pp"] == 2 and runs["cp2"]["ran"]["1"]["cp"] == 2 and runs["offload"]["ran"]["0"]["offload"]
    assert (out / "summary.md").exists() and "parallel_cuda" in (out / "summary.md").read_text()
    assert checkout_data.exists() == had_data, "the battery read the bundle's data, it wrote none into the checkout"
