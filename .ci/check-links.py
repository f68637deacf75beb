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
A page that pulls in another file (`{{#include ../../BENCHMARKS.md}}`) is
checked as mdBook renders it: the included file's links resolve from the
including page's folder.

With `--html DIR` (the built book, e.g. target/book after `mdbook build`),
every relative `href` of every page there, print.html included, must name a
file of the build, and its `#anchor` an `id` in it.
Exit 1 with one line per broken link.
"""
import html.parser
import os
import re
import sys
import urllib.parse

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


INCLUDE = re.compile(r"\{\{#include\s+([^}\s:]+)[^}]*\}\}")


class Html(html.parser.HTMLParser):
    """The relative hrefs (with their line) and the ids of one built page."""

    def __init__(self):
        super().__init__()
        self.hrefs = []
        self.ids = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            if name == "href" and value and tag == "a":
                self.hrefs.append((self.getpos()[0], value))


def check_html(out_dir):
    """Broken relative links of the built book in `out_dir`."""
    pages = {}
    for dirpath, _, names in os.walk(out_dir):
        for n in names:
            if n.endswith(".html"):
                path = os.path.join(dirpath, n)
                parser = Html()
                with open(path, encoding="utf-8") as f:
                    parser.feed(f.read())
                pages[os.path.normpath(path)] = parser
    bad = []
    for path, page in sorted(pages.items()):
        for line, href in page.hrefs:
            if re.match(r"^[a-z]+:", href) or href.startswith("//"):
                continue
            file_part, _, anchor = href.partition("#")
            file_part = urllib.parse.unquote(file_part)
            dest = (
                os.path.normpath(os.path.join(os.path.dirname(path), file_part))
                if file_part
                else path
            )
            if os.path.isdir(dest):
                dest = os.path.join(dest, "index.html")
            where = f"{os.path.relpath(path, out_dir)}:{line}: {href}"
            if not os.path.exists(dest):
                bad.append(f"{where}: no such file in the built book")
            elif anchor and dest in pages and urllib.parse.unquote(anchor) not in pages[dest].ids:
                bad.append(f"{where}: no id #{anchor} in the built page")
    return bad, len(pages)


def main():
    args = sys.argv[1:]
    if args[:1] == ["--html"]:
        out_dir = os.path.abspath(args[1])
        bad, n = check_html(out_dir)
        for b in bad:
            print(b)
        print(f"links: {n} built pages checked, {len(bad)} broken")
        return 1 if bad else 0
    root = os.path.abspath(args[0]) if args else ROOT
    files = [os.path.join(root, "README.md")]
    book = os.path.join(root, "docs", "src")
    for dirpath, _, names in os.walk(book):
        files += [os.path.join(dirpath, n) for n in sorted(names) if n.endswith(".md")]
    cache = {}
    bad = []
    # (file whose text is scanned, page whose folder its links resolve
    # from, how to name it): every file, and every file a book page includes.
    scans = [(path, path, None) for path in files]
    for path in files:
        if os.path.dirname(path) == root:
            continue
        for m in INCLUDE.finditer(prose(path)):
            included = os.path.normpath(os.path.join(os.path.dirname(path), m.group(1)))
            if os.path.exists(included):
                scans.append((included, path, os.path.relpath(path, root)))
    for source, page, via in scans:
        text = prose(source)
        for m in LINK.finditer(text):
            target = m.group(1)
            n = text.count("\n", 0, m.start(1)) + 1
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (
                os.path.normpath(os.path.join(os.path.dirname(page), file_part))
                if file_part
                else page
            )
            where = f"{os.path.relpath(source, root)}:{n}: {target}"
            if via:
                where += f" (as included by {via})"
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
