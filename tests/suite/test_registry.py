"""Every Catch2 test case runs in exactly one CTest test: nnstrain_base_tests' (no
LibTorch, a start costs nothing) each in its own, nnstrain_tests' (LibTorch, 0.5-1 s a
start) one CTest test per source file, by Catch2's filename tag (`-# [#test_x]~[.]`: not the hidden cases other cases start as children).

CTest splits a test name at ';' and Catch2 reads ',' '[' ']' '*' '~' in a filter,
so a test case whose name holds one of them can be registered under a filter that
matches nothing: Catch2 prints "No tests ran" and, without `--warn NoTests`,
exits 0, and CTest reports a pass for a test that never ran. This file checks
the registry CTest actually holds (`ctest --show-only=json-v1`) against the
test cases each Catch2 executable lists, and that a filter matching nothing
fails.

ctest writes Testing/Temporary/LastTest.log wherever it runs, even for
--show-only, so it runs on a scratch copy of the build's CTestTestfile.cmake
files: the full run that is running this test keeps its own log.
"""
import hashlib
import json
import os
import pathlib
import shutil
import subprocess

import pytest

BUILD = pathlib.Path(os.environ.get("NNSTRAIN_BUILD_DIR", ""))
CTEST = os.environ.get("NNSTRAIN_CTEST", "ctest")
CATCH_EXES = ("nnstrain_tests", "nnstrain_base_tests")


def unescape(spec):
    # catch_discover_tests escapes what Catch2 would read as filter syntax.
    for c in ",[]":
        spec = spec.replace("\\" + c, c)
    return spec


def file_state(path):
    """What would show a rewrite of `path`: None if absent, else (size, mtime_ns, sha256)."""
    if not path.exists():
        return None
    st = path.stat()
    return st.st_size, st.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest()


def scratch_test_files(build, scratch):
    """Copies every CTestTestfile.cmake of `build` to the same place under `scratch`.
    Their subdirs() are relative, so they lead to the copies; their include()s and
    test commands are absolute, so they still name the real build's files and binaries."""
    copied = []
    for f in build.rglob("CTestTestfile.cmake"):
        dst = scratch / f.relative_to(build)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst)
        copied.append(dst)
    return copied


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    if not (BUILD / "CTestTestfile.cmake").exists():
        pytest.fail(f"NNSTRAIN_BUILD_DIR={str(BUILD)!r} is not a configured build folder")
    live_log = BUILD / "Testing" / "Temporary" / "LastTest.log"
    before = file_state(live_log)
    scratch = tmp_path_factory.mktemp("ctest_scratch")
    assert scratch_test_files(BUILD, scratch), BUILD
    p = subprocess.run([CTEST, "--show-only=json-v1"], cwd=scratch, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    # ctest logged in the scratch folder (so it would have in the live one), and the live log is as it was.
    assert (scratch / "Testing" / "Temporary" / "LastTest.log").exists(), sorted(scratch.rglob("*"))
    assert file_state(live_log) == before, f"{live_log} was rewritten by this test's ctest"
    entries = {}
    for t in json.loads(p.stdout)["tests"]:
        cmd = t.get("command") or []
        if cmd and pathlib.Path(cmd[0]).name in CATCH_EXES:
            entries.setdefault(cmd[0], []).append((t["name"], cmd[1:]))
    assert sorted(pathlib.Path(e).name for e in entries) == sorted(CATCH_EXES), sorted(entries)
    return entries


def listed(exe, *spec):
    p = subprocess.run([exe, *spec, "--list-test-names-only"], capture_output=True, text=True, timeout=120)
    names = [line for line in p.stdout.splitlines() if line.strip()]
    assert names, (spec, p.stdout + p.stderr)
    return names


PER_FILE = {"nnstrain_tests"}


def check_name(exe, name):
    for bad in (";", "*", "\""):
        assert bad not in name, f"{exe}: test case name {name!r} holds {bad!r}, which a filter cannot match"
    assert not name.startswith(("~", "#", " ")) and name == name.strip(), name


def test_ctest_runs_exactly_the_catch2_test_cases(registry):
    for exe, tests in registry.items():
        cases = listed(exe)
        assert len(cases) == len(set(cases)), f"{exe}: duplicate test case names"
        for name, args in tests:
            # A filter that matches nothing fails instead of passing with "No tests ran".
            assert "--warn" in args and args[args.index("--warn") + 1] == "NoTests", (name, args)
        if pathlib.Path(exe).name in PER_FILE:
            # One entry a source file: the cases each file's tag selects, together, are every
            # case once (a case of no file's entry, or of two, fails here).
            ran = []
            for name, args in tests:
                assert name.startswith("unit.") and args[:2] == ["-#", f"[#{name[len('unit.'):]}]~[.]"], (name, args)
                ran += listed(exe, *args[:2])
            src = sorted(p.stem for p in (pathlib.Path(__file__).parents[1] / "unit").glob("test_*.cpp"))
            assert sorted(n[len("unit."):] for n, _ in tests) == src, "a unit test file without its CTest entry"
            assert sorted(ran) == sorted(cases), (
                f"{exe}: cases run by no file's entry: {sorted(set(cases) - set(ran))}; "
                f"run twice: {sorted(n for n in set(ran) if ran.count(n) > 1)}")
            for name in cases:
                check_name(exe, name)
            continue
        registered = [name for name, _ in tests]
        missing = sorted(set(cases) - set(registered))
        extra = sorted(set(registered) - set(cases))
        assert not missing and not extra, (
            f"{exe}: Catch2 test cases with no CTest entry of their own: {missing}; "
            f"CTest entries that are no Catch2 test case (a name CTest split?): {extra}")
        for name, args in tests:
            # The filter CTest passes is the name itself (escaped).
            assert unescape(args[0]) == name, (name, args)
            check_name(exe, name)


def test_a_filter_that_matches_nothing_fails(registry):
    for exe, tests in registry.items():
        args = tests[0][1]
        # The entry's options without its filter (a test name, or -# and a filename tag).
        args = args[2:] if args[0] == "-#" else args[1:]
        p = subprocess.run([exe, "no test case has this name", *[a for a in args if a]],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and "No tests ran" in p.stdout + p.stderr, (exe, p.returncode, p.stdout)
