"""Authentication, TLS, a private data plane, bounded inputs, cancellation, honest health.

Unit tests first (in-process servers, a private Redis); then the real service: a second
application with API keys on the shared Ray cluster, and the TLS gateway in front of it.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import time
from pathlib import Path

import grpc
import pytest
from redis_server import RedisServer

from specserve.auth import PEER_KEY, KeyStore
from specserve.errors import AlreadyExists, Unauthenticated
from specserve.proto_gen.specserve.v1 import internal_pb2 as ipb
from specserve.proto_gen.specserve.v1 import internal_pb2_grpc as ipb_grpc
from specserve.proto_gen.specserve.v1 import specserve_pb2 as pb

KEY_A, KEY_B = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef"
KEY_C = "carol-key-0123456789abcdef"
SECRET = "s3cret-data-plane-0123456789"


def _md(key: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")] if key else []


# ------------------------------------------------------------------------- API keys
def test_keys_constant_time_several_rotation(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text(f"alice: {KEY_A}\nbob: {KEY_B}  # comment\n")
    monkeypatch.setenv("TEST_KEYS", f"carol:{KEY_C}")
    store = KeyStore(str(path), "TEST_KEYS", reload_s=0.0)
    assert store.caller(_md(KEY_A)) == "alice"
    assert store.caller(_md(KEY_B)) == "bob"
    assert store.caller(_md(KEY_C)) == "carol"
    for bad in ([], _md("nope-nope-nope-nope"), [("authorization", KEY_A)],
                [("authorization", "Basic " + KEY_A)]):
        with pytest.raises(Unauthenticated):
            store.caller(bad)
    time.sleep(0.01)
    path.write_text(f'{{"alice": "{KEY_B}-rotated"}}')  # rotation: no restart
    assert store.caller(_md(KEY_B + "-rotated")) == "alice"
    with pytest.raises(Unauthenticated):
        store.caller(_md(KEY_A))
    path.write_text("alice: short")  # a bad file keeps the keys in force
    assert store.caller(_md(KEY_B + "-rotated")) == "alice"


def test_no_keys_means_auth_off():
    assert not KeyStore(None, None).enabled


# ------------------------------------------------------------------------- data plane
class _FakeTarget:
    def __init__(self, delay: float = 0.0):
        self.delay, self.released = delay, []

    def validate(self, item):
        pass

    def verify(self, items, prefill_chunk=None, prefill_budget=None):
        from specserve.contract import VerifyOutcome

        time.sleep(self.delay)
        return [VerifyOutcome(0, 5, False, batch_size=len(items)) for _ in items]

    def release(self, sid):
        self.released.append(sid)

    def admission(self, items, overdue=None):
        from specserve.engine.target import Admission

        return Admission([True] * len(items), [])


def _verify_msg(call_id: int, sid: str = "s1") -> ipb.VerifyRequest:
    return ipb.VerifyRequest(call_id=call_id, session_id=sid, committed_len=2, tokens_start=0,
                             tokens=[1, 2], sampling=ipb.Sampling(top_p=1.0, seed=1))


async def _stream(port: int, msgs, metadata=None, stub="target"):
    """Send ``msgs`` on one stream, keep it open until each has its reply, then close."""
    got = asyncio.Event()

    batch = ipb.VerifyBatch if stub == "target" else ipb.ProposeBatch

    async def outgoing():
        for m in msgs:
            yield batch(rows=[m])
        await got.wait()

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        method = (ipb_grpc.TargetStub(ch).Verify if stub == "target"
                  else ipb_grpc.DrafterStub(ch).Propose)
        call = method(outgoing(), metadata=metadata)
        replies = []
        async for packed in call:
            replies.extend(packed.replies)
            if len(replies) == len(msgs):
                got.set()
                break
        call.cancel()
        return replies


async def _refused(port: int, msg, metadata=None, stub: str = "target") -> None:
    """A stranger's stream is refused. Opened empty, it ends UNAUTHENTICATED (deterministic).
    With a message it fails too and the message gets no reply (the client may then see its own
    send fail first, INTERNAL, when the server already closed the stream: a client-side race)."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(_stream(port, [], metadata, stub), 30)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError):  # no reply: _stream returns only on replies
        await asyncio.wait_for(_stream(port, [msg], metadata, stub), 30)


def test_data_plane_refuses_peers_without_the_secret():
    from target_service.server import start_target_server

    async def main():
        server, port, _ = await start_target_server(_FakeTarget(), "127.0.0.1", 0, "t",
                                                    secret=SECRET)
        try:
            for md in (None, [(PEER_KEY, "wrong-wrong-wrong-wrong")]):
                await _refused(port, _verify_msg(1), md)
            replies = await _stream(port, [_verify_msg(1)], [(PEER_KEY, SECRET)])
            assert [r.extra_token for r in replies] == [5] and not replies[0].error
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_target_queue_is_bounded_and_sessions_released_when_the_stream_ends():
    from target_service.server import start_target_server

    async def main():
        engine = _FakeTarget(delay=0.05)
        server, port, servicer = await start_target_server(
            engine, "127.0.0.1", 0, "t", max_queue=2, max_batch=1)
        try:
            replies = await _stream(port, [_verify_msg(i, f"s{i}") for i in range(1, 9)])
            errors = [r.error for r in replies if r.error]
            assert errors and all(e.startswith("overloaded:") for e in errors)
            assert len(replies) == 8 and servicer.overloaded == len(errors)
            for _ in range(50):  # the stream ended: its sessions are released
                if not len(servicer.sessions):
                    break
                await asyncio.sleep(0.02)
            assert len(servicer.sessions) == 0
            assert servicer.sessions.released["stream_closed"] == 8
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_idle_sessions_are_released():
    from specserve.service.peers import SessionTracker

    released = []
    t = SessionTracker(released.append, idle_s=0.05)
    t.touch("a", 1)
    time.sleep(0.06)
    t.reap()  # its row is still here (queued, or in a step longer than idle_s): not idle
    assert released == [] and t.held("a")
    t.answered("a")
    t.reap()  # idle counts from the answer
    assert released == [] and t.held("a")
    t.busy = True
    time.sleep(0.06)
    t.reap()
    assert released == [] and not t.held("a")  # waits for the engine call to end
    t.busy = False
    t.apply()
    assert released == ["a"] and t.released["idle"] == 1


def test_drafter_refuses_huge_k(builtin_pair):
    from drafter_service.server import start_drafter_server
    from specserve.engine.drafter import DrafterEngine
    from specserve.engine.lean import LeanLlama

    async def main():
        server, port, _ = await start_drafter_server(
            DrafterEngine(LeanLlama(builtin_pair.drafter)), "127.0.0.1", 0)
        try:
            msg = ipb.ProposeRequest(call_id=1, session_id="s", committed_len=2, tokens=[1, 2],
                                     k=100_000, mode="draft",
                                     sampling=ipb.Sampling(top_p=1.0, seed=1))
            (reply,) = await _stream(port, [msg], stub="drafter")
            assert "at most 16" in reply.error and not reply.draft_tokens
        finally:
            await server.stop(0)

    asyncio.run(main())


# ------------------------------------------------------------------------- journal
@pytest.fixture()
def private_redis(tmp_path):
    """A redis-server of our own (flushed and restarted by tests; nobody else uses it)."""
    server = RedisServer(tmp_path)
    yield server.url
    server.stop()


def test_journal_binds_entries_and_never_gaps(private_redis):
    import redis

    from router.journal import Journal

    async def main():
        j = Journal(private_redis, ttl_s=60)
        e = await j.open("alice", "r1", "digest-1", 7)
        assert e is not None and e.tokens == [] and e.count == 0
        assert await j.append(e, [1, 2, 3])
        assert await j.append(e, [4], "length")
        again = await j.open("alice", "r1", "digest-1", 7)
        assert again.tokens == [1, 2, 3, 4] and again.finish == "length"
        with pytest.raises(AlreadyExists):  # the same id with other content
            await j.open("alice", "r1", "digest-2", 7)
        other = await j.open("bob", "r1", "digest-2", 7)  # callers have their own ids
        assert other.tokens == []
        assert 0 < redis.Redis.from_url(private_redis).ttl(j.key("alice", "r1")) <= 60
        # the entry lost mid-request (FLUSHALL): the next write is refused, never a gap
        e2 = await j.open("alice", "r2", "d", 1)
        assert await j.append(e2, [9])
        redis.Redis.from_url(private_redis).flushall()
        assert not await j.append(e2, [10])
        assert e2.broken and j.write_failures == 1
        assert (await j.open("alice", "r2", "d", 1)).tokens == []  # short: regenerate
        # a second writer (a stale router) cannot interleave: counts must match
        e3a = await j.open("alice", "r3", "d", 1)
        e3b = await j.open("alice", "r3", "d", 1)
        assert await j.append(e3a, [1])
        assert not await j.append(e3b, [1])
        await j.close()

    asyncio.run(main())


def test_journal_without_redis_degrades(tmp_path):
    from router.journal import Journal

    async def main():
        j = Journal("redis://127.0.0.1:1/0")
        assert await j.open("a", "r", "d", 1) is None
        assert j.degraded == 1
        assert not await j.append(None, [1])

    asyncio.run(main())


# ------------------------------------------------------------------------- resume
def test_a_resumed_stream_gets_only_the_rest_and_is_checked():
    from router.router import Delivery, RouterChunk
    from specserve.errors import DataLoss, RequestError
    from specserve.resume import ResumePoint, tokens_digest

    chunks = [("ab", [1, 2]), ("cde", [3, 4, 5]), ("f", [6])]

    def run(point):
        d = Delivery(point)
        out = []
        for i, (text, ids) in enumerate(chunks):
            ch = d.cut(RouterChunk(text, list(ids), "length" if i == 2 else None))
            if ch is not None:
                out.append((ch.text, ch.token_ids))
        return out

    assert run(ResumePoint()) == [("ab", [1, 2]), ("cde", [3, 4, 5]), ("f", [6])]
    # held 3 tokens and 3 characters: only the rest, nothing twice, nothing missing
    assert run(ResumePoint(3, 3, tokens_digest([1, 2, 3]))) == [("de", [4, 5]), ("f", [6])]
    # text and tokens need not cut at the same chunk (a character held back)
    assert run(ResumePoint(2, 1, tokens_digest([1, 2]))) == [("b", []), ("cde", [3, 4, 5]),
                                                              ("f", [6])]
    with pytest.raises(DataLoss):  # regenerated tokens differ from what the caller holds
        run(ResumePoint(3, 3, tokens_digest([1, 2, 9])))
    with pytest.raises(RequestError):  # holds more than the request produces
        run(ResumePoint(9, 9, tokens_digest(list(range(9)))))


# ------------------------------------------------------------------------- health
def test_health_is_serving_only_when_a_target_answers():
    from grpc_health.v1 import health_pb2

    from deployments.grpc_ingress import Health, Ingress

    class Handle:
        def __init__(self, ok):
            self.ping = self
            self.ok = ok

        async def remote(self):
            if not self.ok:
                raise RuntimeError("no replica")
            return True

    async def check(ok: bool, service: str = ""):
        h = Health(Ingress(None), Handle(ok))
        req = health_pb2.HealthCheckRequest(service=service).SerializeToString()
        return (await h.check(req, None)).status

    R = health_pb2.HealthCheckResponse
    assert asyncio.run(check(True)) == R.SERVING
    assert asyncio.run(check(False)) == R.NOT_SERVING
    assert asyncio.run(check(True, "other")) == R.SERVICE_UNKNOWN


# ------------------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    """A self-signed certificate for localhost / 127.0.0.1."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    c = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(days=1))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.SubjectAlternativeName([
             x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
             critical=False)
         .sign(key, hashes.SHA256()))
    d = tmp_path_factory.mktemp("tls")
    (d / "cert.pem").write_bytes(c.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return d / "cert.pem", d / "key.pem"


def test_tls_gateway_in_front_of_a_plain_server(cert):
    """Unit: TLS terminates at the gateway, the call and its deadline reach the server."""
    from deployments.tls_gateway import start_tls_gateway
    from specserve.resume import DEADLINE_KEY

    seen = {}

    async def unary(request: bytes, context):
        seen.update(dict(context.invocation_metadata()))
        return pb.GenerateResponse(text="hi", token_ids=[1]).SerializeToString()

    async def serve_plain():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "specserve.v1.SpecServe", {"GenerateUnary": grpc.unary_unary_rpc_method_handler(
                unary)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    loop = asyncio.new_event_loop()
    server, port = loop.run_until_complete(serve_plain())
    import threading

    threading.Thread(target=loop.run_forever, daemon=True).start()
    crt, key = cert
    gw = start_tls_gateway("127.0.0.1:0", f"127.0.0.1:{port}", crt.read_bytes(),
                           key.read_bytes())
    try:
        from specserve.client import Client

        with Client(f"localhost:{gw.port}", tls=True, root_certificates=crt.read_bytes(),
                    token=KEY_A, timeout=5) as c:
            assert c.generate("x", max_tokens=1).text == "hi"
        assert seen["authorization"] == f"Bearer {KEY_A}" and int(seen[DEADLINE_KEY]) <= 5000
        with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as ch, \
                pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/specserve.v1.SpecServe/GenerateUnary")(b"", timeout=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # no plaintext on the TLS port
    finally:
        gw.stop()
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)


# ------------------------------------------------------------------------- the service
SECURE = "specserve-secure"
GENERATE = "/specserve.v1.SpecServe/Generate"
UNARY = "/specserve.v1.SpecServe/GenerateUnary"
CHECK = "/grpc.health.v1.Health/Check"


@pytest.fixture(scope="module")
def secure_app(service, tmp_path_factory):
    from ray import serve

    from deployments.app import build_app

    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"alice: {KEY_A}\n")
    serve.run(build_app({"security": {"api_keys_file": str(keys)},
                         "redis_url": service.redis_url}), name=SECURE,
              route_prefix=f"/{SECURE}")
    yield keys
    serve.delete(SECURE)


def _raw(address: str, method: str, payload: bytes, md, app: str = SECURE, timeout=30):
    with grpc.insecure_channel(address) as ch:
        full = [("application", app), *md]
        if method == GENERATE:
            return list(ch.unary_stream(method)(payload, metadata=full, timeout=timeout))
        return ch.unary_unary(method)(payload, metadata=full, timeout=timeout)


def _req(**kw) -> bytes:
    return pb.GenerateRequest(**{"prompt": "def f(x):\n", "max_tokens": 4, **kw}) \
        .SerializeToString()


def test_every_public_method_needs_a_key(service, secure_app):
    from grpc_health.v1 import health_pb2

    hc = health_pb2.HealthCheckRequest().SerializeToString()
    for method, payload in ((GENERATE, _req()), (UNARY, _req()), (CHECK, hc)):
        for md in ([], _md("wrong-wrong-wrong-wrong-wrong")):
            with pytest.raises(grpc.RpcError) as e:
                _raw(service.grpc_address, method, payload, md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, md)
    assert _raw(service.grpc_address, GENERATE, _req(), _md(KEY_A))
    assert pb.GenerateResponse.FromString(
        _raw(service.grpc_address, UNARY, _req(), _md(KEY_A))).token_ids
    status = health_pb2.HealthCheckResponse.FromString(
        _raw(service.grpc_address, CHECK, hc, _md(KEY_A))).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_keys_rotate_without_a_restart(service, secure_app):
    secure_app.write_text(f"alice: {KEY_B}\n")
    try:
        for _ in range(100):
            try:
                _raw(service.grpc_address, UNARY, _req(max_tokens=1), _md(KEY_B))
                break
            except grpc.RpcError:
                time.sleep(0.1)
        with pytest.raises(grpc.RpcError) as e:
            _raw(service.grpc_address, UNARY, _req(max_tokens=1), _md(KEY_A))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        secure_app.write_text(f"alice: {KEY_A}\n")
        time.sleep(1.5)


def test_the_data_plane_refuses_strangers(service, secure_app):
    from ray import serve

    for kind, stub, msg in (("Target", "target", _verify_msg(1)),
                            ("Drafter", "drafter", ipb.ProposeRequest(
                                call_id=1, session_id="x", committed_len=1, tokens=[1], k=2,
                                mode="draft", sampling=ipb.Sampling(top_p=1.0, seed=1)))):
        gen = serve.get_deployment_handle(kind, SECURE).options(stream=True) \
            .session.remote("probe")
        address = _first(gen)
        try:
            host, port = address.rsplit(":", 1)
            assert host == "127.0.0.1"  # the node's address, not all interfaces
            asyncio.run(_refused(int(port), msg, stub=stub))
        finally:
            gen.cancel()


def _first(gen) -> str:
    return next(iter(gen))


def test_reused_request_id_with_other_content_is_refused(service, secure_app):
    from specserve.client import Client, SpecServeError

    with Client(service.grpc_address, token=KEY_A, app_name=SECURE, timeout=60) as c:
        a = c.generate("def add(a, b):\n", max_tokens=8, request_id="same-id-1")
        assert c.generate("def add(a, b):\n", max_tokens=8, request_id="same-id-1") \
            .token_ids == a.token_ids
        for other in ({"prompt": "class A:\n"}, {"max_tokens": 4}):
            args = {"prompt": "def add(a, b):\n", "max_tokens": 8, **other}
            with pytest.raises(SpecServeError) as e:
                c.generate(args.pop("prompt"), request_id="same-id-1", **args)
            assert e.value.code == grpc.StatusCode.ALREADY_EXISTS


def _router_rss_hwm(app: str) -> tuple[int, int]:
    from ray import serve

    pid = serve.get_deployment_handle("Router", app).pid.remote().result()
    status = Path(f"/proc/{pid}/status").read_text()
    kb = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines()
          if line.startswith(("VmRSS", "VmHWM"))}
    return kb["VmRSS"] * 1024, kb["VmHWM"] * 1024


def test_huge_inputs_are_refused_before_the_work(service):
    """A 32 MiB prompt is refused by the gRPC proxy's message limit (4 MiB) before any of it
    reaches the router; a 1 MiB one (under the message limit) by the router's byte limit,
    before tokenizing. Which check refused each is read from the status details; that the
    refusals did no work shows in the router's memory. Times are printed, not asserted
    (a 32 MiB transfer over loopback alone takes 120-900 ms on a loaded 2-core machine)."""
    from specserve.client import Client, SpecServeError

    app = "specserve"
    with Client(service.grpc_address, timeout=60) as c:
        c.generate("warm up", max_tokens=1)
        rss0, hwm0 = _router_rss_hwm(app)
        for size, code, says in ((32 << 20, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than"),
                                 (1 << 20, grpc.StatusCode.INVALID_ARGUMENT,
                                  f"prompt: {1 << 20} bytes, at most")):
            payload = pb.GenerateRequest(prompt="a" * size, max_tokens=1).SerializeToString()
            took = []
            for _ in range(3):
                t0 = time.perf_counter()
                with pytest.raises(grpc.RpcError) as e:
                    _raw(service.grpc_address, UNARY, payload, [], app=app)
                took.append(time.perf_counter() - t0)
                assert e.value.code() == code, e.value
                assert says in (e.value.details() or ""), e.value.details()
            print(f"\n{size >> 20} MiB prompt: {code.name} in "
                  f"{', '.join(f'{t * 1000:.0f}' for t in took)} ms")
        rss1, hwm1 = _router_rss_hwm(app)
        print(f"router RSS {rss0 >> 20} -> {rss1 >> 20} MiB, peak {hwm0 >> 20} -> "
              f"{hwm1 >> 20} MiB")
        assert hwm1 - hwm0 < 50 << 20 and rss1 - rss0 < 50 << 20
        with pytest.raises(SpecServeError) as e:  # the SDK sees the same status
            c.generate("a" * (32 << 20), max_tokens=1)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        for kw, code in (({"stop": ["x" * 300]}, "INVALID_ARGUMENT"),
                         ({"stop": ["x" * (4 << 20)]}, "RESOURCE_EXHAUSTED")):
            with pytest.raises(SpecServeError) as e:
                c.generate("def f():", max_tokens=1, **kw)
            assert e.value.code.name == code
    with pytest.raises(grpc.RpcError) as e:  # a metadata request_id is bounded like the body's
        _raw(service.grpc_address, UNARY, _req(), [("request_id", "r" * 200)], app=app)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for garbage in (b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", os.urandom(64)):
        try:
            _raw(service.grpc_address, UNARY, garbage, [], app=app)
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.OUT_OF_RANGE), err


def _journaled(service, request_id: str) -> int:
    import redis

    n = redis.Redis.from_url(service.redis_url).hget(
        f"specserve:journal:anonymous:{request_id}", "n")
    return int(n) if n else 0


def _settled(service, request_id: str) -> int:
    """The request's journaled token count once it stops growing."""
    last = -1
    for _ in range(20):
        n = _journaled(service, request_id)
        if n == last:
            return n
        last = n
        time.sleep(0.5)
    return last


def _metric(service, reason: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(service.metrics_url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ray_specserve_request_success") and
               f'finished_reason="{reason}"' in line)


def test_cancel_and_deadline_stop_the_work(service):
    """A closed stream and a passed deadline stop the request within about a round (k=4:
    at most 5 tokens a round), free its admission slot and count as abort / deadline."""
    from ray import serve

    from specserve.client import Client, SpecServeError

    router = serve.get_deployment_handle("Router", "specserve")
    with Client(service.grpc_address, timeout=120) as c:
        it = c.stream("def parse(text):\n", max_tokens=600, k=4, request_id="cancel-1")
        got = 0
        for ch in it:
            got += len(ch.token_ids)
            if got >= 12:
                break
        it.close()
        at_cancel = _journaled(service, "cancel-1")
        cancelled = _settled(service, "cancel-1")
        t0 = time.perf_counter()
        with pytest.raises(SpecServeError) as e:
            c.generate("def parse(text):\n", max_tokens=600, k=4, request_id="deadline-1",
                       timeout=0.7)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        at_deadline = _journaled(service, "deadline-1")
        expired = _settled(service, "deadline-1")
        waited = time.perf_counter() - t0
    print(f"\ncancel: client held {got}, journaled {at_cancel} at the cancel, {cancelled} in "
          f"the end (+{cancelled - at_cancel}); deadline 0.7 s: journaled {at_deadline} when "
          f"the client saw DEADLINE_EXCEEDED, {expired} in the end (+{expired - at_deadline})"
          f" of 600 ({waited:.1f}s)")
    assert cancelled < 600 and expired < 600
    assert cancelled - at_cancel <= 5 and expired - at_deadline <= 5
    for _ in range(20):
        if router.stats.remote().result()["active"] == 0:
            break
        time.sleep(0.25)
    assert router.stats.remote().result()["active"] == 0  # admission slots are free
    if service.metrics_url:
        for _ in range(40):  # Ray exports metrics every few seconds
            if _metric(service, "abort") >= 1 and _metric(service, "deadline") >= 1:
                break
            time.sleep(0.5)
        assert _metric(service, "abort") >= 1 and _metric(service, "deadline") >= 1


def test_tls_and_keys_on_the_real_service(service, secure_app, cert):
    """The TLS gateway in front of Serve's proxy (what `specserve serve --tls-cert` runs):
    the SDK, and a grpcurl-style client (server reflection, then a call by name) over TLS."""
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    from deployments.tls_gateway import start_tls_gateway
    from specserve.client import Client, SpecServeError, health_check

    crt, key = cert
    gw = start_tls_gateway("127.0.0.1:0", service.proxy_address or service.grpc_address,
                           crt.read_bytes(), key.read_bytes())
    address = f"localhost:{gw.port}"
    try:
        with Client(address, tls=True, root_certificates=crt.read_bytes(), token=KEY_A,
                    app_name=SECURE, timeout=60) as c:
            assert len(c.generate("def f(x):\n", max_tokens=6).token_ids) == 6
            assert sum(len(ch.token_ids) for ch in c.stream("def f(x):\n", max_tokens=6)) == 6
        with Client(address, tls=True, root_certificates=crt.read_bytes(), app_name=SECURE,
                    timeout=60) as c, pytest.raises(SpecServeError) as e:
            c.generate("def f(x):\n", max_tokens=2)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        creds = grpc.ssl_channel_credentials(crt.read_bytes())
        with grpc.secure_channel(address, creds) as ch:
            services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
            assert "specserve.v1.SpecServe" in services
            reply = ch.unary_unary(UNARY)(
                _req(max_tokens=3), metadata=[("application", SECURE), *_md(KEY_A)],
                timeout=60)
            assert len(pb.GenerateResponse.FromString(reply).token_ids) == 3
        assert health_check(address, tls=True, root_certificates=crt.read_bytes(),
                            token=KEY_A) in (True, False)  # answered (app routing aside)
    finally:
        gw.stop()
