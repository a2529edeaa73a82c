"""ci/fetch-wheel.py: a download cut mid-file resumes where it stopped and ends in a file whose SHA-256
is the index's; a wrong hash, a missing release and a missing package fail with one line and leave no
file. Served by a local HTTP server that cuts connections (fake input; nothing leaves the machine)."""

from __future__ import annotations

import hashlib
import http.server
import importlib.util
import json
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOB = bytes(range(256)) * 4096  # 1 MiB
NAME = "aphrodite_engine-0.99.0-cp38-abi3-manylinux1_x86_64.whl"


def _load():
    spec = importlib.util.spec_from_file_location("fetch_wheel", ROOT / "ci" / "fetch-wheel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Server:
    """A PEP 691 index with one wheel; the first ``cuts`` file requests stop after ``cut_at`` bytes."""

    def __init__(self, sha256: str, cuts: int, cut_at: int = 300_000, honour_range: bool = True):
        self.requests: list[str | None] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                port = self.server.server_address[1]
                if self.path == "/simple/aphrodite-engine/":
                    files = [
                        {"filename": "aphrodite_engine-0.99.0.tar.gz", "url": "x", "hashes": {}},
                        {
                            "filename": NAME,
                            "url": f"http://127.0.0.1:{port}/files/{NAME}",
                            "hashes": {"sha256": sha256},
                            "size": len(BLOB),
                        },
                    ]
                    body = json.dumps({"files": files}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if self.path != f"/files/{NAME}":
                    self.send_error(404)
                    return
                rng = self.headers.get("Range")
                outer.requests.append(rng)
                start = int(rng.split("=")[1].rstrip("-")) if (rng and honour_range) else 0
                body = BLOB[start:]
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if len(outer.requests) <= cuts:
                    self.wfile.write(body[:cut_at])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/simple"

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fw(monkeypatch):
    mod = _load()
    monkeypatch.setattr(mod, "WAIT_MAX_S", 0.0)
    monkeypatch.setattr(mod, "TIMEOUT_S", 10)
    return mod


GOOD = hashlib.sha256(BLOB).hexdigest()


def test_cut_download_resumes_with_ranges(fw, tmp_path, monkeypatch):
    server = _Server(GOOD, cuts=2)
    with server as index:
        monkeypatch.setattr(fw, "INDEX", index)
        path = fw.fetch("aphrodite-engine", "0.99.0", tmp_path, log=lambda m: None)
    assert path == tmp_path / NAME
    assert path.read_bytes() == BLOB
    assert not (tmp_path / (NAME + ".part")).exists()
    # Each try asked only for what was missing: 0, then 300,000, then 600,000 bytes in.
    assert server.requests == [None, "bytes=300000-", "bytes=600000-"]


def test_server_that_ignores_range_starts_over(fw, tmp_path, monkeypatch):
    server = _Server(GOOD, cuts=1, honour_range=False)
    with server as index:
        monkeypatch.setattr(fw, "INDEX", index)
        path = fw.fetch("aphrodite-engine", "0.99.0", tmp_path, log=lambda m: None)
    assert path.read_bytes() == BLOB


def test_wrong_hash_fails_and_leaves_nothing(fw, tmp_path, monkeypatch):
    with _Server("0" * 64, cuts=0) as index:
        monkeypatch.setattr(fw, "INDEX", index)
        with pytest.raises(fw.FetchError, match="SHA-256 differs"):
            fw.fetch("aphrodite-engine", "0.99.0", tmp_path, log=lambda m: None)
    assert list(tmp_path.iterdir()) == []


def test_missing_release_and_package_name_what_is_there(fw, tmp_path, monkeypatch):
    with _Server(GOOD, cuts=0) as index:
        monkeypatch.setattr(fw, "INDEX", index)
        with pytest.raises(fw.FetchError, match="wheels of that version: none"):
            fw.fetch("aphrodite-engine", "0.98.0", tmp_path)
        with pytest.raises(fw.FetchError, match="not on"):
            fw.fetch("no-such-package", "1.0", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_gives_up_after_its_tries_and_keeps_the_bytes_for_next_run(fw, tmp_path, monkeypatch):
    monkeypatch.setattr(fw, "TRIES", 2)
    with _Server(GOOD, cuts=10) as index:
        monkeypatch.setattr(fw, "INDEX", index)
        with pytest.raises(fw.FetchError, match="after 2 tries"):
            fw.fetch("aphrodite-engine", "0.99.0", tmp_path, log=lambda m: None)
    assert (tmp_path / (NAME + ".part")).stat().st_size == 600_000
    assert not (tmp_path / NAME).exists()
    # The next run (CI retried, or make install again) asks only for the rest.
    healthy = _Server(GOOD, cuts=0)
    with healthy as index:
        monkeypatch.setattr(fw, "INDEX", index)
        path = fw.fetch("aphrodite-engine", "0.99.0", tmp_path, log=lambda m: None)
    assert path.read_bytes() == BLOB
    assert healthy.requests == ["bytes=600000-"]


def test_command_line_prints_one_line_not_a_traceback(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(ROOT / "ci" / "fetch-wheel.py"), "only-one-arg"], capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == "usage: fetch-wheel.py PACKAGE VERSION DEST_DIR"
