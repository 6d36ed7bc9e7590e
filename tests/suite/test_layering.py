"""The module layering, stated once (RULES) and checked on every source file.

base/ is the ground floor every module may use, so it includes nothing from the
modules above it (trainer/, data/, models/); what the config loader needs from
them it is handed through config::LoadOptions (base/config/load.h). models/ knows
no trainer (no ranks, no collectives: torchtitan's rule). Inside trainer/, the
parallel engine's concerns each have a folder, and planning code (plan/) never
includes the runtime (dist/, the pipeline's executor, the state's reducers):
it is a pure function of the config and the model's declaration.
"""
import os
import pathlib
import re

ROOT = pathlib.Path(os.environ.get("NNSTRAIN_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
OURS = ("base", "trainer", "data", "models")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]((?:%s)/[^>"]*)[>"]' % "|".join(OURS))
SOURCES = (".h", ".hpp", ".cpp", ".cc", ".inc")

# folder: the include prefixes its sources may use (its own folder is always allowed).
# A prefix ending in ".h" allows that one header; one ending in "/" a whole folder.
RULES = {
    "base": [],
    "models": ["base/"],
    "data": ["base/", "data/"],
    # Planning: the cost model and the search. The pure layout and schedule
    # functions the runtime also uses, never the runtime itself.
    "trainer/plan": ["base/", "models/", "trainer/optim/", "trainer/sharding/", "trainer/pipeline/schedule.h",
                     "trainer/pipeline/stages.h", "trainer/state/training_state.h"],
    "trainer/pipeline": ["base/", "models/", "data/dataset.h", "trainer/dist/", "trainer/plan/plan.h",
                         "trainer/state/", "trainer/sharding/", "trainer/optim/"],
    "trainer/state": ["base/", "models/", "trainer/sharding/", "trainer/optim/", "trainer/dist/",
                      "trainer/checkpoint/", "trainer/offload/"],
    "trainer/offload": ["base/"],
    # LoRA: the adapter math is model code (no ranks); the converter and peft I/O sit beside interop.
    "models/lora": ["base/", "models/common/"],
    "trainer/lora": ["base/", "data/sha256.h", "models/", "trainer/checkpoint/", "trainer/interop/",
                     "trainer/state/tensor_parallel.h", "trainer/plan/cost_model.h"],  # (its facts for the planner)
    # Evaluation: task files, scoring, the command and the in-training hook; never the planner.
    "trainer/eval": ["base/", "data/chat/", "data/tokenizer/", "models/", "trainer/checkpoint/", "trainer/dist/",
                     "trainer/interop/"],
}


def violations(root, folder, allowed):
    """'FILE:LINE: #include "X"' for every include under root/folder that `allowed` does not permit."""
    own = folder + "/"
    ok = lambda inc: inc.startswith(own) or any(inc == a or (a.endswith("/") and inc.startswith(a)) for a in allowed)
    bad = []
    for f in sorted(p for p in (root / folder).rglob("*") if p.suffix in SOURCES):
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            m = INCLUDE.match(line)
            if m and not ok(m.group(1)):
                bad.append(f'{f.relative_to(root)}:{n}: #include "{m.group(1)}"')
    return bad


def test_every_folder_keeps_its_layer():
    for folder, allowed in RULES.items():
        sources = [p for p in (ROOT / folder).rglob("*") if p.suffix in SOURCES]
        assert len(sources) >= 2, f"{folder}: expected its sources here, found {sources}"
        bad = violations(ROOT, folder, allowed)
        assert not bad, f"{folder}/ may include only {allowed} (tests/suite/test_layering.py):\n" + "\n".join(bad)


def test_the_parallel_engine_has_no_flat_folder_back():
    # The concerns moved out of trainer/parallel (issue 57); a file there would be a concern without a home.
    assert not (ROOT / "trainer" / "parallel").exists()
    for folder in ("plan", "pipeline", "state", "offload"):
        assert (ROOT / "trainer" / folder / "README.md").is_file(), f"trainer/{folder}: says what it owns"


def test_the_check_names_the_file_and_line(tmp_path):
    # The scan itself: a planted include of each kind is reported, a look-alike and an allowed one are not.
    base = tmp_path / "base" / "config"
    base.mkdir(parents=True)
    (base / "x.cpp").write_text('#include "base/log.h"\n// #include "trainer/a.h" in a comment\n'
                                '#include "trainer/pipeline/schedule.h"\n'
                                '  #  include <data/indexed/sample_stream.h>\n#include "models/registry.h"\n'
                                '#include "database/x.h"\n')
    assert violations(tmp_path, "base", RULES["base"]) == [
        'base/config/x.cpp:3: #include "trainer/pipeline/schedule.h"',
        'base/config/x.cpp:4: #include "data/indexed/sample_stream.h"',
        'base/config/x.cpp:5: #include "models/registry.h"',
    ]
    plan = tmp_path / "trainer" / "plan"
    plan.mkdir(parents=True)
    (plan / "y.cpp").write_text('#include "trainer/plan/plan.h"\n#include "trainer/pipeline/schedule.h"\n'
                                '#include "trainer/pipeline/runtime.h"\n#include "trainer/dist/process_groups.h"\n')
    assert violations(tmp_path, "trainer/plan", RULES["trainer/plan"]) == [
        'trainer/plan/y.cpp:3: #include "trainer/pipeline/runtime.h"',
        'trainer/plan/y.cpp:4: #include "trainer/dist/process_groups.h"',
    ]
