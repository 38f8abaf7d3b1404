#!/usr/bin/env bash
# Every relative link in the Markdown pages resolves: to a file or a
# directory of the checkout, and, when it names one (`page.md#anchor`,
# `#anchor`), to a heading of that page (GitHub's anchors: lower case,
# punctuation dropped, spaces as `-`, repeats numbered) or an explicit
# `<a id="...">`. Links with a scheme (https:, mailto:) are not fetched;
# links inside code blocks and inline code are not links.
#
#   bash scripts/check-links.sh            # README.md, CONTRIBUTING.md, CHANGELOG.md, docs/**/*.md
#   bash scripts/check-links.sh FILE...    # just these
#
# Exit 1, naming each broken link with its file and line, if any is broken.
# Needs only bash and python3 (standard library).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

exec python3 - "$@" <<'PY'
import os
import re
import sys
import urllib.parse

def pages():
    if len(sys.argv) > 1:
        return sys.argv[1:]
    found = [p for p in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md") if os.path.exists(p)]
    for root, dirs, files in os.walk("docs"):
        dirs.sort()
        found += [os.path.join(root, f) for f in sorted(files) if f.endswith(".md")]
    return found

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the target up to a space (a title) or ')'.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
EXPLICIT = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")

def lines_outside_code(text):
    """(line number, line) of every line outside fenced code blocks."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if m:
            mark = m.group(1)
            if fence is None:
                fence = mark[0] * len(mark)
                continue
            if mark[0] == fence[0] and len(mark) >= len(fence):
                fence = None
                continue
        if fence is None:
            yield n, line

def slug(heading):
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)                        # inline HTML
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")

_anchors = {}

def anchors(path):
    if path not in _anchors:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        seen = {}
        found = set()
        previous = ""
        for _, line in lines_outside_code(text):
            heading = None
            m = ATX.match(line)
            if m:
                heading = m.group(2)
            elif re.match(r"^\s{0,3}(=+|-+)\s*$", line) and previous.strip() and not previous.lstrip().startswith(("|", "-", "*", ">")):
                heading = previous.strip()
            if heading is not None:
                base = slug(heading)
                count = seen.get(base, 0)
                seen[base] = count + 1
                found.add(base if count == 0 else f"{base}-{count}")
            for a in EXPLICIT.findall(line):
                found.add(a)
            previous = line
        _anchors[path] = found
    return _anchors[path]

def links(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for n, line in lines_outside_code(text):
        m = REF_DEF.match(line)
        if m:
            yield n, m.group(1)
            continue
        bare = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
        for m in INLINE_LINK.finditer(bare):
            yield n, m.group(1)

broken = []
checked = 0
for page in pages():
    for n, target in links(page):
        if not target or SCHEME.match(target):
            continue
        checked += 1
        where, _, anchor = target.partition("#")
        where = urllib.parse.unquote(where.split("?", 1)[0])
        if where:
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), where))
        else:
            resolved = page
        if not os.path.exists(resolved):
            broken.append(f"{page}:{n}: {target}: no such file ({resolved})")
            continue
        if anchor and resolved.endswith(".md"):
            anchor = urllib.parse.unquote(anchor)
            if anchor not in anchors(resolved):
                broken.append(f"{page}:{n}: {target}: no heading #{anchor} in {resolved}")

if broken:
    print("\n".join(broken))
    print(f"check-links: {len(broken)} broken of {checked} relative links", file=sys.stderr)
    sys.exit(1)
print(f"check-links: {checked} relative links, all resolve")
PY
