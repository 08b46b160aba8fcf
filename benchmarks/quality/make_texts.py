"""Write the real texts of the quality benchmarks from Python's own documentation (the `pydoc_data`
topics shipped with CPython 3.11: the language reference's prose, PSF licence), two disjoint parts:
benchmarks/data/quality_eval_text.txt (held out: perplexity, agreement, needle haystack) and
benchmarks/data/quality_calibration_text.txt (fitting the calibrated index). Topics in name order;
the first go to evaluation until it holds EVAL_CHARS, the next to calibration until CALIB_CHARS.

Run: .venv/bin/python benchmarks/quality/make_texts.py   (deterministic for one CPython version)
"""

import pydoc_data.topics
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "benchmarks/data"
EVAL_CHARS, CALIB_CHARS = 110_000, 130_000


def main() -> int:
    topics = pydoc_data.topics.topics
    parts: dict[str, list[str]] = {"eval": [], "calibration": []}
    size = {"eval": 0, "calibration": 0}
    for name in sorted(topics):
        part = "eval" if size["eval"] < EVAL_CHARS else "calibration"
        if part == "calibration" and size[part] >= CALIB_CHARS:
            break
        parts[part].append(name)
        size[part] += len(topics[name])
    for part, names in parts.items():
        text = "\n\n".join(topics[n] for n in names)
        (DATA / f"quality_{part}_text.txt").write_text(text)
        print(f"{part}: {len(names)} topics ({names[0]} .. {names[-1]}), {len(text)} chars")
    return 0


if __name__ == "__main__":
    sys.exit(main())
