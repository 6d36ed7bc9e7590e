#!/usr/bin/env python3
"""The GPU bundle's bookkeeping (bench/gpu/prepare.sh builds it, battery.sh runs it).

  bundle.py export   --build B --bundle D   D/device_tests.json: the tests labelled `device`
                                            (`ctest --show-only=json-v1`), with the paths they had here
  bundle.py manifest --bundle D             D/manifest.json: commit, LibTorch, toolkit, glibc needs,
                                            every file's size and SHA-256
  bundle.py verify   --bundle D             every file the manifest lists, byte for byte (exit 1 if not)
  bundle.py first                           the CTest regex of FIRST (battery.sh's tests / tests_more split)
  bundle.py ctest    --bundle D --root R --python P --dir T
                                            T/CTestTestfile.cmake: the same tests, pointing at the
                                            bundle's binaries, this checkout and this machine's python,
                                            plus the unit binary's [device] cases; `ctest -L device` in T

The bundle is built on a CPU machine and run on a GPU machine whose paths differ:
a test keeps its command, environment, labels, timeout and pass/skip rules, and
every path into the build folder, the source folder or the build's Python is
rewritten. A path into the build folder that names no bundled binary is refused
(the test would run something the bundle lacks).
Standard library only: the GPU machine's python3 has PyTorch and little else.
"""
import argparse
import datetime
import hashlib
import json
import pathlib
import re
import subprocess
import sys

# The binaries the battery runs, as (path in the build folder, name in bin/).
BINARIES = {"nnstrain": "nnstrain", "tests/nnstrain_tests": "nnstrain_tests",
            "tests/nnstrain_nccl_graph_check": "nnstrain_nccl_graph_check",
            "nnstrain_bench_cp_ring": "nnstrain_bench_cp_ring",
            "nnstrain_bench_doc_attention": "nnstrain_bench_doc_attention"}
# The unit binary's cases with a CUDA side (tests/unit/test_device.cpp); skipped parts print why on a CPU.
UNIT_DEVICE_TAG = "[device]"
# Issue 37's (a) checks: battery.sh's `tests` phase runs these (first in the call), `tests_more` the
# rest of the label after the benchmarks; where one phase runs all, they start first (CTest starts
# the highest COST first), not behind the long parity suites.
FIRST = ("integration.test_device_paths", "integration.test_fused_loss", "integration.test_kernels",
         "device.nccl_graph_check", "device.nccl_graph_hang", "unit.device_tagged")


def fail(msg):
    print(f"bundle.py: {msg}", file=sys.stderr)
    sys.exit(1)


def cmd_export(a):
    build = pathlib.Path(a.build).resolve()
    cache = build / "CMakeCache.txt"
    if not cache.exists():
        fail(f"{build}: no CMakeCache.txt (not a configured build folder)")
    values = dict(re.findall(r"^(\w+):\w+=(.*)$", cache.read_text(), re.M))
    out = subprocess.run(["ctest", "--show-only=json-v1", "-L", "device"], cwd=build, capture_output=True, text=True)
    if out.returncode != 0:
        fail(f"ctest --show-only in {build} failed: {out.stderr.strip()}")
    tests = json.loads(out.stdout)["tests"]
    if not tests:
        fail(f"{build}: no test is labelled device")
    doc = {"build_dir": str(build), "source_dir": values.get("CMAKE_HOME_DIRECTORY", ""),
           "python": values.get("NNSTRAIN_PYTHON", ""), "ctest": values.get("CMAKE_CTEST_COMMAND", "ctest"),
           "tests": [{"name": t["name"], "command": t["command"],
                      "properties": {p["name"]: p["value"] for p in t.get("properties", [])}} for t in tests]}
    path = pathlib.Path(a.bundle) / "device_tests.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{path}: {len(tests)} device tests")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def symbol_versions(path, prefix):
    """The highest GLIBC_ / GLIBCXX_ version the binary asks for (objdump -T)."""
    out = subprocess.run(["objdump", "-T", str(path)], capture_output=True, text=True).stdout
    found = {tuple(int(x) for x in v.split(".")) for v in re.findall(rf"\b{prefix}_([0-9.]+[0-9])\b", out)}
    return ".".join(map(str, max(found))) if found else None


def cmd_manifest(a):
    root = pathlib.Path(a.bundle)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "manifest.json")
    bins = sorted((root / "bin").iterdir())
    doc = {
        "made": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": a.commit, "torch": a.torch, "cuda_toolkit": a.toolkit,
        "needs": {"glibc": max(filter(None, (symbol_versions(b, "GLIBC") for b in bins)),
                               key=lambda v: tuple(map(int, v.split("."))), default=None),
                  "glibcxx": max(filter(None, (symbol_versions(b, "GLIBCXX") for b in bins)),
                                 key=lambda v: tuple(map(int, v.split("."))), default=None)},
        "bytes": sum(p.stat().st_size for p in files),
        "files": {str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files},
    }
    (root / "manifest.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{root}/manifest.json: {len(files)} files, {doc['bytes'] / 2**20:.1f} MiB, commit {a.commit}, "
          f"needs glibc {doc['needs']['glibc']} / GLIBCXX {doc['needs']['glibcxx']}")


def cmd_verify(a):
    root = pathlib.Path(a.bundle)
    path = root / "manifest.json"
    if not path.exists():
        fail(f"{path}: missing (run bench/gpu/prepare.sh here)")
    doc = json.loads(path.read_text())
    bad = [f"{name} missing" if not (root / name).is_file() else f"{name} differs"
           for name, f in doc["files"].items()
           if not (root / name).is_file() or (root / name).stat().st_size != f["bytes"] or sha256(root / name) != f["sha256"]]
    if bad:
        fail(f"{root}: {len(bad)} of {len(doc['files'])} files do not match manifest.json: " + "; ".join(bad[:5]))
    print(f"{root}: {len(doc['files'])} files match manifest.json (commit {doc['commit']}, made {doc['made']})")


def cmake_arg(value):
    """One CMake bracket argument: no escapes are processed inside, so a regex or path stays as it is."""
    text = ";".join(map(str, value)) if isinstance(value, list) else str(value)
    n = 1
    while f"]{'=' * n}]" in text:
        n += 1
    return f"[{'=' * n}[{text}]{'=' * n}]"


def cmd_ctest(a):
    bundle = pathlib.Path(a.bundle).resolve()
    root = pathlib.Path(a.root).resolve()
    work = pathlib.Path(a.dir).resolve()
    doc = json.loads((bundle / "device_tests.json").read_text())
    old_build, old_src = doc["build_dir"], doc["source_dir"]
    binaries = {f"{old_build}/{k}": str(bundle / "bin" / v) for k, v in BINARIES.items()}

    def rewrite(text):
        if not isinstance(text, str):
            return text
        for old, new in binaries.items():  # a bundled binary, wherever it appears
            text = re.sub(rf"{re.escape(old)}(?![\w./-])", new, text)
        text = text.replace(f"{old_build}/tests", str(work))  # the tests' working directory
        text = re.sub(rf"(^|=){re.escape(old_build)}$", rf"\g<1>{work}", text)  # the folder itself (NNSTRAIN_BUILD_DIR)
        if old_build in text:
            fail(f"device_tests.json: {text!r} points into the build folder at something the bundle lacks")
        if doc["python"]:
            text = text.replace(doc["python"], a.python)
        text = text.replace(doc["ctest"], "ctest")
        return text.replace(old_src, str(root)) if old_src else text

    lines = [f"# Generated by bench/gpu/bundle.py from {bundle}/device_tests.json"]
    tests = doc["tests"] + [{
        "name": "unit.device_tagged", "command": [f"{old_build}/tests/nnstrain_tests", UNIT_DEVICE_TAG,
                                                   "--use-colour", "no", "--warn", "NoTests"],
        "properties": {"LABELS": ["device"], "TIMEOUT": 300.0, "ENVIRONMENT": ["OMP_NUM_THREADS=1"]}}]
    for t in tests:
        cmd = [rewrite(c) for c in t["command"]]
        lines.append(f"add_test({cmake_arg(t['name'])} " + " ".join(map(cmake_arg, cmd)) + ")")
        props = t["properties"]
        props.setdefault("WORKING_DIRECTORY", str(work))
        if t["name"] in FIRST:
            props["COST"] = 1000
        props = {k: [rewrite(x) for x in v] if isinstance(v, list) else rewrite(v) for k, v in props.items()}
        if props:
            lines.append(f"set_tests_properties({cmake_arg(t['name'])} PROPERTIES "
                         + " ".join(f"{k} {cmake_arg(v)}" for k, v in props.items()) + ")")
    work.mkdir(parents=True, exist_ok=True)
    (work / "CTestTestfile.cmake").write_text("\n".join(lines) + "\n")
    print(f"{work}/CTestTestfile.cmake: {len(tests)} tests")


def cmd_first(a):
    print("^(" + "|".join(re.escape(n) for n in FIRST) + ")$")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("export")
    p.add_argument("--build", required=True)
    p.add_argument("--bundle", required=True)
    p = sub.add_parser("manifest")
    p.add_argument("--bundle", required=True)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--torch", default="")
    p.add_argument("--toolkit", default="")
    sub.add_parser("first")
    p = sub.add_parser("verify")
    p.add_argument("--bundle", required=True)
    p = sub.add_parser("ctest")
    p.add_argument("--bundle", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--python", required=True)
    p.add_argument("--dir", required=True)
    a = ap.parse_args()
    {"export": cmd_export, "manifest": cmd_manifest, "verify": cmd_verify, "ctest": cmd_ctest,
     "first": cmd_first}[a.cmd](a)


if __name__ == "__main__":
    main()
