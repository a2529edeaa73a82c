#!/usr/bin/env python3
"""Download one wheel from PyPI so that a dropped connection costs a retry, not the CI run.

    python ci/fetch-wheel.py aphrodite-engine 0.22.0 .cache/wheels

Why not `pip download`: the stop-26 CI run lost the 290 MB aphrodite-engine 0.22.0 wheel at
189.5 MB, and pip's own resume (`--resume-retries`, five tries within one process) got no further
byte on any try before it gave up; the whole setup failed on a network hiccup. Here each try opens a
new connection, asks for the missing bytes only (HTTP Range, RFC 9110 §14), waits longer after each
failure, keeps what arrived in `<name>.part` across tries and across runs, and the file gets its real
name only once its SHA-256 equals the index's. The index is PyPI's simple API in its JSON form
(PEP 691: `Accept: application/vnd.pypi.simple.v1+json`; pypi.org's per-release JSON API is not
reachable from every CI machine). Standard library only: it runs before the virtualenv has anything.

Picks the wheel pip would install on Linux x86_64 for that version (an `x86_64` platform tag or a
pure `none-any` wheel). Exit status 0 and the path on stdout, or 1 with one line on stderr.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

INDEX = os.environ.get("HXF_SIMPLE_INDEX", "https://pypi.org/simple")
TRIES = int(os.environ.get("HXF_FETCH_TRIES", "12"))
WAIT_MAX_S = float(os.environ.get("HXF_FETCH_WAIT_MAX_S", "30"))
TIMEOUT_S = 60
CHUNK = 1 << 20


class FetchError(Exception):
    """A failure that retrying will not mend (no such release, a hash that does not match)."""


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pick_wheel(files: list[dict], package: str, version: str) -> dict:
    """The entry of the index's file list that pip would take for ``package==version`` here."""
    stem = re.sub(r"[-.]+", "_", _normalise(package))
    wheels = [
        f
        for f in files
        if f.get("filename", "").endswith(".whl")
        and f["filename"].lower().startswith(f"{stem}-{version}-")
        and not f.get("yanked")
    ]
    for wanted in ("x86_64", "none-any"):
        match = [f for f in wheels if wanted in f["filename"]]
        if match:
            return match[0]
    names = ", ".join(f["filename"] for f in wheels) or "none"
    raise FetchError(f"no Linux x86_64 wheel of {package}=={version} on {INDEX} (wheels of that version: {names})")


def index_files(package: str) -> list[dict]:
    req = urllib.request.Request(
        f"{INDEX}/{_normalise(package)}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
        return json.load(resp)["files"]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _one_try(url: str, part: Path, size: int | None) -> None:
    """Append the bytes ``part`` lacks; raises on any network failure (the caller retries)."""
    have = part.stat().st_size if part.exists() else 0
    if size is not None and have >= size:
        return
    headers = {"Range": f"bytes={have}-"} if have else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S) as resp:
        if have and resp.status != 206:  # the server ignored the range: start over
            have = 0
        with part.open("ab" if have else "wb") as out:
            for block in iter(lambda: resp.read(CHUNK), b""):
                out.write(block)


def fetch(package: str, version: str, dest: Path, log=lambda msg: print(msg, file=sys.stderr)) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    files = None
    for attempt in range(1, TRIES + 1):
        try:
            files = index_files(package)
            break
        except (OSError, ValueError, http.client.HTTPException) as e:  # URLError is an OSError
            if isinstance(e, urllib.error.HTTPError) and e.code == 404:
                raise FetchError(f"{package} is not on {INDEX}") from e
            if attempt == TRIES:
                raise FetchError(f"the index {INDEX} did not answer for {package}: {e}") from e
            time.sleep(min(WAIT_MAX_S, 2**attempt))
    entry = pick_wheel(files, package, version)
    target = dest / entry["filename"]
    want = entry.get("hashes", {}).get("sha256")
    if target.exists() and (want is None or _sha256(target) == want):
        return target
    part = target.with_name(target.name + ".part")
    size = entry.get("size")
    for attempt in range(1, TRIES + 1):
        try:
            _one_try(entry["url"], part, size)
            have = part.stat().st_size
            if size is None or have == size:
                break
            if have > size:  # not this file: start again
                part.unlink()
            raise OSError(f"{have} of {size} bytes")
        except (OSError, http.client.HTTPException) as e:  # a cut body is an IncompleteRead
            if isinstance(e, urllib.error.HTTPError):
                if e.code == 416:  # range past the end: start over
                    part.unlink(missing_ok=True)
                elif 400 <= e.code < 500 and e.code not in (408, 429):
                    raise FetchError(f"{entry['url']}: HTTP {e.code} {e.reason}") from e
            if attempt == TRIES:
                raise FetchError(f"{entry['filename']}: download failed after {TRIES} tries ({e})") from e
            wait = min(WAIT_MAX_S, 2**attempt)
            got = part.stat().st_size if part.exists() else 0
            log(f"fetch-wheel: {entry['filename']}: {e}; {got} bytes kept, try {attempt + 1} in {wait:.0f} s")
            time.sleep(wait)
    if want is not None and _sha256(part) != want:
        part.unlink()
        raise FetchError(f"{entry['filename']}: SHA-256 differs from the index's {want}; the partial file was removed")
    part.replace(target)
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: fetch-wheel.py PACKAGE VERSION DEST_DIR", file=sys.stderr)
        return 1
    try:
        print(fetch(argv[0], argv[1], Path(argv[2])))
    except FetchError as e:
        print(f"fetch-wheel: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
