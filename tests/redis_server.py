"""A redis-server of a test's own (restarted, flushed, killed by fault tests; nobody else
uses it). Real Redis: a missing binary fails the test with what to install, never skips."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from specserve.ports import free_port


class RedisServer:
    def __init__(self, tmp: Path, *extra: str):
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server not found: install it (Debian: apt-get install "
                        "redis-server); these tests need a real Redis they may restart")
        self.port = free_port()
        self.exe, self.tmp, self.extra = exe, tmp, extra
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.tmp), *self.extra],
            stdout=subprocess.DEVNULL)
        for _ in range(200):
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def flushall(self) -> None:
        import redis

        redis.Redis.from_url(self.url).flushall()
