"""Rewrite references to benchmark results' old paths (benchmarks/results/MOVED.tsv) in the given files, in place.

A reference is `results/<old name>` (with or without `benchmarks/` before it), the file's full name or its stem
alone (`--out benchmarks/results/proposer_zoo_qwen_avx2`, `results/bf16_rows*.md`, `results/x.{json,md}`), or an
old folder (`results/serve_compare_runs/`). Running it again changes nothing: a new path is never read as an old
one. Result files themselves are left as they were recorded (their commands name the paths they wrote then).

    .venv/bin/python benchmarks/rewrite_result_paths.py README.md docs/*.md
    .venv/bin/python benchmarks/rewrite_result_paths.py --check $(git grep -l results/)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

MOVED = Path(__file__).resolve().parent / "results" / "MOVED.tsv"
PREFIX = "benchmarks/results/"


def renames(moved: Path = MOVED) -> dict[str, str]:
    """Old -> new, relative to benchmarks/results/: every file, every stem whose files all moved alike, and every
    old folder whose files all moved into one new folder."""
    files: dict[str, str] = {}
    for line in moved.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            old, new = line.split("\t")
            files[old.removeprefix(PREFIX)] = new.removeprefix(PREFIX)
    out = dict(files)
    stems: dict[str, set[str]] = {}
    folders: dict[str, set[str]] = {}
    for old, new in files.items():
        old_stem, new_stem = _stem(old), _stem(new)
        if new.endswith(old[len(old_stem):]):
            stems.setdefault(old_stem, set()).add(new_stem)
        if "/" in old:
            folder, name = old.rsplit("/", 1)
            if new.endswith("/" + name):
                folders.setdefault(folder, set()).add(new[: -len(name) - 1])
            else:
                folders.setdefault(folder, set()).add("")  # moved apart: no folder rename
    out.update({s: n.pop() for s, n in stems.items() if len(n) == 1})
    out.update({f: n.pop() for f, n in folders.items() if len(n) == 1 and "" not in n})
    return out


def _stem(path: str) -> str:
    folder, _, name = path.rpartition("/")
    base = name.rsplit(".", 1)[0] if "." in name else name
    return f"{folder}/{base}" if folder else base


def pattern(names: dict[str, str]) -> re.Pattern[str]:
    """`results/<old>` not inside a longer word before it, and not followed by more of a name or a folder
    separator (so `results/proposer_zoo/...`, the new layout, never reads as the old `results/proposer_zoo`).
    Longest names first, so a file wins over its stem."""
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(rf"(?<![\w.-])((?:benchmarks/)?results/)({alternatives})(?![\w/-])")


def rewrite(text: str, names: dict[str, str], regex: re.Pattern[str] | None = None) -> tuple[str, int]:
    """(the text with every old reference replaced, how many were)."""
    regex = regex or pattern(names)
    count = 0

    def swap(match: re.Match[str]) -> str:
        nonlocal count
        count += 1
        return match.group(1) + names[match.group(2)]

    # folders end at "/": allow it for them only
    folders = {k for k in names if "." not in k.rsplit("/", 1)[-1] and any(o.startswith(k + "/") for o in names)}
    if folders:
        folder_regex = re.compile(rf"(?<![\w.-])((?:benchmarks/)?results/)("
                                  rf"{'|'.join(re.escape(f) for f in sorted(folders, key=len, reverse=True))})(?=/)")
        text, n = folder_regex.subn(lambda m: m.group(1) + names[m.group(2)], text)
        count += n
    text = regex.sub(swap, text)
    return text, count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true", help="say what would change, write nothing (exit 1 if any)")
    args = ap.parse_args(argv)
    names = renames()
    regex = pattern(names)
    changed = 0
    for path in args.files:
        if path.resolve().is_relative_to(MOVED.parent) or path.resolve() == Path(__file__).resolve():
            continue  # results keep the paths they were recorded with (and this file's examples stay old)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        new, count = rewrite(text, names, regex)
        if count:
            changed += 1
            print(f"{path}: {count} reference{'s' * (count != 1)}{' would change' if args.check else ''}")
            if not args.check:
                path.write_text(new)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
