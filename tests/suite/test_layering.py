"""base/ is the ground floor every module may use, so it includes nothing from
the modules above it (trainer/, data/, models/). What the config loader needs
from them it is handed through config::LoadOptions (base/config/load.h); this
test keeps an include from growing back.
"""
import os
import pathlib
import re

ROOT = pathlib.Path(os.environ.get("NNSTRAIN_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
ABOVE = ("trainer", "data", "models")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]((?:%s)/[^>"]*)[>"]' % "|".join(ABOVE))
SOURCES = (".h", ".hpp", ".cpp", ".cc", ".inc")


def upward_includes(base):
    """'FILE:LINE: #include "X"' for every include of a module above base/ in `base`."""
    found = []
    for f in sorted(p for p in base.rglob("*") if p.suffix in SOURCES):
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            m = INCLUDE.match(line)
            if m:
                found.append(f'{f.relative_to(base.parent)}:{n}: #include "{m.group(1)}"')
    return found


def test_base_includes_nothing_above_it():
    base = ROOT / "base"
    sources = [p for p in base.rglob("*") if p.suffix in SOURCES]
    assert len(sources) >= 5, f"{base}: expected the base/ sources here, found {sources}"
    bad = upward_includes(base)
    assert not bad, ("base/ must not include trainer/, data/ or models/ (hand what it needs in through "
                     "config::LoadOptions instead):\n" + "\n".join(bad))


def test_the_check_names_the_file_and_line(tmp_path):
    # The scan itself: a planted include of each kind is reported, a look-alike is not.
    base = tmp_path / "base" / "config"
    base.mkdir(parents=True)
    (base / "x.cpp").write_text('#include "base/log.h"\n// #include "trainer/a.h" in a comment\n'
                                '#include "trainer/parallel/pipeline_schedule.h"\n'
                                '  #  include <data/indexed/sample_stream.h>\n#include "models/registry.h"\n'
                                '#include "database/x.h"\n')
    assert upward_includes(tmp_path / "base") == [
        'base/config/x.cpp:3: #include "trainer/parallel/pipeline_schedule.h"',
        'base/config/x.cpp:4: #include "data/indexed/sample_stream.h"',
        'base/config/x.cpp:5: #include "models/registry.h"',
    ]
