"""A separate client process for the service tests: runs requests through the SDK and
prints one JSON line per request. Usage: python service_client.py ADDRESS JOBS_JSON."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

from specserve.client import Client, SpecServeError


def run(address: str, jobs: list[dict], app: str) -> list[dict]:
    with Client(address, timeout=300, app_name=app) as client:
        def one(job: dict) -> dict:
            try:
                r = client.generate(**job)
                return {"token_ids": r.token_ids, "text": r.text, "finish": r.finish_reason,
                        "stats": r.stats,
                        "logprobs": [(t.token, t.logprob, t.top) for t in r.logprobs or ()]}
            except SpecServeError as e:
                return {"error": e.code.name, "details": e.details}

        with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
            return list(pool.map(one, jobs))


if __name__ == "__main__":
    address, app, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    for result in run(address, jobs, app):
        print(json.dumps(result))
