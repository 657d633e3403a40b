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


def stream_with_fault(address: str, jobs: list[dict], fault, after_tokens: int,
                      app: str = "specserve", timeout: float = 600) -> list[dict]:
    """Stream every job through the SDK (one thread each) and call ``fault()`` once, when
    every stream has received ``after_tokens`` tokens or finished: a fault triggered by
    progress, never by a timer. Returns one result per job, like ``run``."""
    import threading

    progress = [0] * len(jobs)
    done = [threading.Event() for _ in jobs]
    results: list[dict] = [{} for _ in jobs]
    changed = threading.Condition()

    def one(i: int, job: dict, client: Client) -> None:
        ids, text, stats, finish = [], [], None, None
        try:
            for chunk in client.stream(**job):
                ids += chunk.token_ids
                text.append(chunk.text)
                stats, finish = chunk.stats or stats, chunk.finish_reason or finish
                with changed:
                    progress[i] = len(ids)
                    changed.notify_all()
            results[i] = {"token_ids": ids, "text": "".join(text), "finish": finish,
                          "stats": stats}
        except SpecServeError as e:
            results[i] = {"error": e.code.name, "details": e.details}
        finally:
            with changed:
                done[i].set()
                changed.notify_all()

    with Client(address, timeout=timeout, app_name=app) as client:
        threads = [threading.Thread(target=one, args=(i, j, client)) for i, j in enumerate(jobs)]
        for t in threads:
            t.start()
        with changed:
            changed.wait_for(lambda: all(p >= after_tokens or d.is_set()
                                         for p, d in zip(progress, done, strict=True)),
                             timeout=timeout)
        assert not all(d.is_set() for d in done), "every request ended before the fault"
        fault()
        for t in threads:
            t.join(timeout)
    return results


if __name__ == "__main__":
    address, app, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    for result in run(address, jobs, app):
        print(json.dumps(result))
