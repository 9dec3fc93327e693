"""kernel_build/bench/tuning/timeline.py: the table it prints from a timeline build's stamps.

The stamps here are synthetic (nanoseconds, as %globaltimer gives them); reading real ones needs a GPU and a
library built with -DKDTREE_TIMELINE.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernel_build" / "bench" / "tuning"))
import timeline  # noqa: E402


def cta(entry_ns: int, **after_us: float) -> list[int]:
    """One CTA's stamps: its entry, then the named ones (a stamp name's first word) at the given us after
    the time origin (1 ms); the rest not reached."""
    stamps = [entry_ns] + [0] * (len(timeline.STAMPS) - 1)
    for word, us in after_us.items():
        i = next(i for i, name in enumerate(timeline.STAMPS) if name.split()[0].lower() == word)
        stamps[i] = 1_000_000 + int(us * 1e3)
    return stamps


def values(lines: list[str], name: str) -> list[float]:
    row = next(line for line in lines if line.strip().startswith(name))
    return [float(x) for x in re.findall(r"-?\d+\.\d+", row)]


def test_stamps_are_relative_to_the_first_entry_and_skip_what_a_cta_never_reached():
    main = [
        cta(1_000_000, request=1.0, q=4.0, tile=3.0, epilogue=44.0),
        cta(1_000_500, request=1.5, q=5.0, tile=3.5, epilogue=45.0),
        cta(1_001_000, request=2.0),  # a CTA with no keys: it returned after loading its indices
        [0] * len(timeline.STAMPS),  # a CTA the launch did not have
    ]
    never = timeline.NEVER
    lines = timeline.summarize(main, [never, 0, never, 0, never, 0])
    assert lines[0].startswith("3 CTAs")
    assert values(lines, "entry") == [0.0, 0.5, 1.0]
    assert values(lines, "request indices loaded") == [1.0, 1.5, 2.0]
    assert values(lines, "Q landed") == [4.0, 4.5, 5.0]  # median of the two that got there
    assert values(lines, "epilogue done") == [44.0, 44.5, 45.0]
    assert not any("combine" in line for line in lines)  # no combine ran


def test_combine_first_and_last():
    main = [cta(1_000_000, request=1.0, epilogue=44.0)]
    lines = timeline.summarize(main, [1_002_000, 1_048_000, 1_045_000, 1_046_000, 1_047_000, 1_050_000])
    assert values(lines, "combine scheduled") == [2.0, 48.0]
    assert values(lines, "combine done") == [47.0, 50.0]


def test_an_uninstrumented_run_says_so():
    assert "KDTREE_TIMELINE" in timeline.summarize([[0] * len(timeline.STAMPS)] * 4, [0] * 6)[0]


def test_stamp_names_follow_the_kernels_enum():
    src = (ROOT / "kernel_build" / "src" / "timeline.cuh").read_text()
    enum = re.sub(r"//[^\n]*", "", re.search(r"enum Stamp \{([^}]*)\}", src).group(1))
    assert len([e for e in enum.split(",") if e.strip()]) == len(timeline.STAMPS)
