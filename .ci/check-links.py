#!/usr/bin/env python3
"""Checks the relative links and #anchors of README.md and the book (docs/src).

Usage: check-links.py [ROOT] (default: this repository).

A link to another markdown file must name a file that exists; an anchor must
name a heading of the target, slugged the way mdBook does (lower case, letters,
digits, `-` and `_` kept, spaces to `-`, anything else dropped; a repeated
heading gets `-1`, `-2`, ...). External links (http:, https:, mailto:) are not
fetched: CI has no network beyond the package registries. A link whose text
wraps onto the next line is checked like any other (the text is scanned as a
whole, not line by line).
Exit 1 with one line per broken link.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The link text may wrap onto following lines ([^\]] matches a newline).
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def slug(text):
    text = re.sub(r"`|\*|\[|\]\([^)]*\)", "", text)
    out = []
    for ch in text.strip().lower():
        if ch.isalnum() or ch in "-_":
            out.append(ch)
        elif ch.isspace():
            out.append("-")
    return "".join(out)


def prose_lines(path):
    """The lines outside code fences, with their 1-based numbers."""
    fenced = False
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if FENCE.match(line.lstrip()):
                fenced = not fenced
                continue
            if not fenced:
                yield n, line


def anchors(path):
    seen = {}
    out = set()
    for _, line in prose_lines(path):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(2))
        if s in seen:
            seen[s] += 1
            s = f"{s}-{seen[s]}"
        else:
            seen[s] = 0
        out.add(s)
    return out


def prose(path):
    """The file's text with fenced code blanked (line numbers kept)."""
    lines = {n: line for n, line in prose_lines(path)}
    with open(path, encoding="utf-8") as f:
        count = sum(1 for _ in f)
    return "".join(lines.get(n, "\n") for n in range(1, count + 1))


def main():
    root = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    files = [os.path.join(root, "README.md")]
    book = os.path.join(root, "docs", "src")
    for dirpath, _, names in os.walk(book):
        files += [os.path.join(dirpath, n) for n in sorted(names) if n.endswith(".md")]
    cache = {}
    bad = []
    for path in files:
        text = prose(path)
        for m in LINK.finditer(text):
            target = m.group(1)
            n = text.count("\n", 0, m.start(1)) + 1
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (
                os.path.normpath(os.path.join(os.path.dirname(path), file_part))
                if file_part
                else path
            )
            where = f"{os.path.relpath(path, root)}:{n}: {target}"
            if not os.path.exists(dest):
                bad.append(f"{where}: no such file")
                continue
            if anchor and dest.endswith(".md"):
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if anchor not in cache[dest]:
                    bad.append(f"{where}: no heading #{anchor}")
    for b in bad:
        print(b)
    print(f"links: {len(files)} files checked, {len(bad)} broken")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
