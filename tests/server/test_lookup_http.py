"""A router asks the store daemon's HTTP port how much of a prompt it holds: chunks saved by a
real client over the daemon's socket, looked up over real HTTP, and nothing in the cache moves."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from kvtier.core.keys import chunk_tokens_of, tail_key
from kvtier.core.request_extras import request_head
from kvtier.engines.chat_render import ChatRenderer
from kvtier.errors import ConfigError
from kvtier.server.client import StoreClient
from kvtier.server.config import daemon_config
from kvtier.server.http import MAX_TOKENS
from kvtier.server.service import StoreService

from ..conftest import make_kv
from .test_daemon import LAYOUT, MODEL

C = LAYOUT.chunk_tokens
LAYOUT_MAP = {"num_layers": LAYOUT.num_layers, "num_kv_heads": LAYOUT.num_kv_heads, "head_dim": LAYOUT.head_dim,
              "dtype": LAYOUT.dtype, "chunk_tokens": C, "kv": LAYOUT.kv}


class Port:
    """The daemon's HTTP port, asked as a router would."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.host, self.port = address

    def call(self, method: str, path: str, body: object = None, headers: dict[str, str] | None = None,
             raw: bytes | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)  # a loaded test machine
        try:
            data = raw if raw is not None else None if body is None else json.dumps(body).encode()
            conn.request(method, path, data, headers or {})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"{}")
        finally:
            conn.close()

    def lookup(self, **body: object) -> dict:
        status, answer = self.call("POST", "/v1/lookup", body)
        assert status == 200, answer
        return answer

    def namespaces(self) -> list[dict]:
        status, answer = self.call("GET", "/v1/namespaces")
        assert status == 200, answer
        return answer["namespaces"]


@pytest.fixture
def service(tmp_path):
    raw = {"socket": str(tmp_path / "kv.sock"), "metrics_port": 0, "http_lookup": True, "write_through": False,
           "host": {"capacity_bytes": 4 * LAYOUT.chunk_bytes, "extent_bytes": LAYOUT.chunk_bytes},
           "disk": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * LAYOUT.chunk_bytes}}
    svc = StoreService(daemon_config(raw), render_chat=ChatRenderer()).start()
    svc.clients = []  # type: ignore[attr-defined]
    yield svc
    for c in svc.clients:  # type: ignore[attr-defined]
        c.close()
    svc.stop()


def connect(service: StoreService, **kw: object) -> StoreClient:
    """A client whose hello has reached the daemon (a stats call is its first request)."""
    kw.setdefault("model", MODEL)
    kw.setdefault("layout", LAYOUT)
    client = StoreClient(service.daemon.config.socket_path, **kw)  # type: ignore[union-attr, arg-type]
    client.stats()
    service.clients.append(client)  # type: ignore[attr-defined]
    return client


def save_keys(client: StoreClient, keys: list, tail_tokens: int = 0) -> None:
    lease = client.reserve(keys, tail_tokens=tail_tokens)
    assert lease is not None and len(lease.keys) == len(keys)
    for view in lease.views:
        if view is not None:
            view.fill_(1)
    assert client.commit(lease) == sum(v is not None for v in lease.views)


def counters(client: StoreClient) -> dict:
    s = client.stats()
    return {k: s[k] for k in ("tiers", "lookups", "lookup_tokens", "hit_tokens", "promotions", "prefetched",
                              "loaded_tokens", "pinned_chunks")}


def test_a_lookup_counts_the_held_prefix_per_tier_and_changes_nothing(service):
    port = Port(service.metrics_address)
    client = connect(service)
    a, b, c = ([1000 * s + i for i in range(2 * C)] for s in (1, 2, 3))
    prompt = [7 + i for i in range(6 * C)]
    assert client.save(prompt, make_kv(LAYOUT, 6 * C)).stored == 6  # DRAM holds 4: some go to SSD
    tiers = client.probe(client.keys_for(prompt))
    assert "disk" in tiers and None not in tiers
    before = counters(client)
    answer = port.lookup(tokens=prompt + [5] * (C // 2))  # the half chunk after is never held
    assert answer["tokens"] == 6 * C and answer["chunks"] == 6 and answer["num_tokens"] == 6 * C + C // 2
    assert answer["tiers"] == {"host": C * tiers.count("host"), "disk": C * tiers.count("disk")}
    assert answer["chunk_tokens"] == C and answer["namespace"]["model"] == MODEL
    assert answer["predicted_prefill_s_saved"] > 0 and answer["cost_model"]["assumed"] == sorted(
        ["num_layers", "hidden", "params", "flops"])
    assert port.lookup(tokens=prompt[:C] + [0] + prompt[C + 1:])["tokens"] == C  # differs in chunk 2
    assert counters(client) == before  # no lookup, hit or miss counted

    # no policy touch: the chunks of a, looked up over HTTP, are still the least recently used
    for seq in (a, b):
        assert client.save(seq, make_kv(LAYOUT, 2 * C)).stored == 2
    assert port.lookup(tokens=a)["tiers"]["host"] == 2 * C
    assert client.save(c, make_kv(LAYOUT, 2 * C)).stored == 2
    assert client.probe(client.keys_for(a)) == ["disk", "disk"]
    assert client.probe(client.keys_for(b)) == ["host", "host"]


def test_a_salted_lookup_finds_only_salted_saves(service):
    port = Port(service.metrics_address)
    client = connect(service)
    salted, plain = [3 + i for i in range(3 * C)], [5 + i for i in range(2 * C)]
    save_keys(client, chunk_tokens_of(salted, client.namespace(), C, {0: request_head(salt="alice")}).keys)
    assert client.save(plain, make_kv(LAYOUT, 2 * C)).stored == 2
    assert port.lookup(tokens=salted, cache_salt="alice")["tokens"] == 3 * C
    assert port.lookup(tokens=salted)["tokens"] == 0
    assert port.lookup(tokens=salted, cache_salt="bob")["tokens"] == 0
    assert port.lookup(tokens=plain)["tokens"] == 2 * C
    assert port.lookup(tokens=plain, cache_salt="alice")["tokens"] == 0


def test_a_partial_last_chunk_saved_as_vllm_saves_it_is_counted(service):
    port = Port(service.metrics_address)
    client = connect(service, page_format="vllm-test-float32-bs4")  # blocks of 4 tokens
    tokens = [11 + i for i in range(C + 10)]
    ns = client.namespace()
    full = chunk_tokens_of(tokens, ns, C).keys
    save_keys(client, [*full, tail_key(full[-1], ns, tokens[C:C + 8])], tail_tokens=8)  # 2 blocks
    answer = port.lookup(tokens=tokens)  # the block size comes from the page format
    assert (answer["tokens"], answer["chunks"], answer["tail_tokens"]) == (C + 8, 1, 8)
    assert answer["tiers"]["host"] == C + 8
    assert port.lookup(tokens=tokens, block_tokens=0)["tokens"] == C  # full chunks only
    assert port.lookup(tokens=tokens[:C + 7])["tokens"] == C  # a tail of 8 never names one of 4


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory):
    """The tokenizer files of the embedded ``tiny`` model (its chat template too), without
    building the model: all a lookup of ``messages`` reads."""
    from kvtier.engines.default_model import build_tokenizer

    path = tmp_path_factory.mktemp("models") / "kvtier-llama-tiny-v2"
    build_tokenizer().save_pretrained(path)
    return path


def test_a_chat_needs_a_template_from_a_directory_only_the_daemons_user_may_write(service, tmp_path):
    from kvtier.engines.default_model import build_tokenizer

    port = Port(service.metrics_address)
    connect(service)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    plain = build_tokenizer()
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "plain")
    got, answer = port.call("POST", "/v1/lookup", {**chat, "model": str(tmp_path / "plain")})
    assert got == 400 and "has no chat template: send tokens instead" in answer["error"]
    build_tokenizer().save_pretrained(tmp_path / "shared")
    (tmp_path / "shared" / "tokenizer_config.json").chmod(0o666)  # anyone may change its template
    got, answer = port.call("POST", "/v1/lookup", {**chat, "model": str(tmp_path / "shared")})
    assert got == 403 and "may be written by users other than the daemon's" in answer["error"]
    (tmp_path / "empty").mkdir()
    got, answer = port.call("POST", "/v1/lookup", {**chat, "model": str(tmp_path / "empty")})
    assert got == 404 and "cannot load a tokenizer" in answer["error"]


def test_a_chat_is_rendered_with_the_models_template(service, tiny_tokenizer_dir):
    from kvtier.engines.default_model import build_tokenizer

    port = Port(service.metrics_address)
    client = connect(service, model="kvtier-llama-tiny-v2@0123456789abcdef")
    chat = [{"role": "system", "content": "You are terse. " * 4}, {"role": "user", "content": "Hi there!"}]
    ids = list(build_tokenizer().apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
    assert len(ids) > 3 * C
    assert client.save(ids[:3 * C], make_kv(LAYOUT, 3 * C)).stored == 3
    connect(service, model="other@0123456789abcdef")  # a second namespace: "auto" goes by the model's name
    answer = port.lookup(messages=chat, model=str(tiny_tokenizer_dir))
    assert (answer["tokens"], answer["num_tokens"]) == (3 * C, len(ids))
    assert answer["namespace"]["model"] == client.model
    other = [{"role": "system", "content": "Be verbose."}, chat[1]]
    assert port.lookup(messages=other, model=str(tiny_tokenizer_dir))["tokens"] == 0


def test_namespaces_are_listed_and_auto_needs_exactly_one(service, tmp_path):
    port = Port(service.metrics_address)
    assert port.call("POST", "/v1/lookup", {"tokens": [1]})[0] == 404  # nobody said hello yet
    one = connect(service)
    connect(service, page_format="vllm-x-float32-bs16-tp1of2")  # a shard the scheduler never looks up
    connect(service, tenant="acme")  # another tenant: never shown, never read
    listed = port.namespaces()
    assert [(n["model"], n["page_format"], n["tenant"]) for n in listed] == [
        (MODEL, "", ""), (MODEL, "vllm-x-float32-bs16-tp1of2", "")]
    assert listed[0]["layout"] == LAYOUT_MAP and listed[0]["chunk_tokens"] == C
    tokens = list(range(2 * C))
    assert one.save(tokens, make_kv(LAYOUT, 2 * C)).stored == 2
    assert port.lookup(tokens=tokens)["tokens"] == 2 * C  # auto: the rank-0 namespace
    assert port.lookup(tokens=tokens, namespace=listed[0])["tokens"] == 2 * C  # an entry, as listed

    connect(service, model="big@fedcba9876543210")
    status, answer = port.call("POST", "/v1/lookup", {"tokens": tokens})
    assert status == 409 and "big@fedcba9876543210" in answer["error"] and MODEL in answer["error"]
    assert {c["model"] for c in answer["candidates"]} == {MODEL, "big@fedcba9876543210"}
    assert port.lookup(tokens=tokens, model_id=MODEL)["tokens"] == 2 * C
    assert port.lookup(tokens=tokens, model_id="big@fedcba9876543210")["tokens"] == 0
    model_dir = tmp_path / "big"
    model_dir.mkdir()
    assert port.lookup(tokens=tokens, model=str(model_dir))["namespace"]["model"] == "big@fedcba9876543210"

    acme = {"model": MODEL, "layout": LAYOUT_MAP, "page_format": "", "tenant": "acme"}
    status, answer = port.call("POST", "/v1/lookup", {"tokens": tokens, "namespace": acme})
    assert status == 403 and "'acme' may not be read" in answer["error"]


def body_of(n: int) -> bytes:
    return json.dumps({"tokens": [0] * n}).encode()


NS = {"model": MODEL, "layout": LAYOUT_MAP}
BAD = [  # (method, path, body, headers, status, what the error names)
    ("GET", "/v1/lookup", None, {}, 405, "takes POST"),
    ("POST", "/v1/namespaces", b"{}", {}, 405, "takes GET"),
    ("POST", "/metrics", b"{}", {}, 405, "read with GET"),
    ("GET", "/v1/nope", None, {}, 404, "no such path"),
    ("POST", "/v2/lookup", b"{}", {}, 405, "read with GET"),
    ("POST", "/v1/lookup", b"{", {}, 400, "not valid JSON"),
    ("POST", "/v1/lookup", b'{"tokens": [NaN]}', {}, 400, "not valid JSON"),
    ("POST", "/v1/lookup", b"[" * 100_000, {}, 400, "not valid JSON"),
    ("POST", "/v1/lookup", b'{"tokens": [1], "compute": {"flops": 1e400}}', {}, 400, "not a finite number"),
    ("POST", "/v1/lookup", b"[1]", {}, 400, "JSON object"),
    ("POST", "/v1/lookup", {}, {}, 400, "exactly one of tokens"),
    ("POST", "/v1/lookup", {"tokens": [1], "messages": []}, {}, 400, "exactly one of tokens"),
    ("POST", "/v1/lookup", {"tokens": [1], "bogus": 1}, {}, 400, "unknown field(s) ['bogus']"),
    ("POST", "/v1/lookup", {"tokens": "1 2"}, {}, 400, "tokens must be a list"),
    ("POST", "/v1/lookup", {"tokens": [1, -1]}, {}, 400, "got -1"),
    ("POST", "/v1/lookup", {"tokens": [1.5]}, {}, 400, "got 1.5"),
    ("POST", "/v1/lookup", {"tokens": [True]}, {}, 400, "got True"),
    ("POST", "/v1/lookup", {"tokens": [1 << 31]}, {}, 400, "[0, 2147483648)"),
    ("POST", "/v1/lookup", body_of(MAX_TOKENS + 1), {}, 413, f"at most {MAX_TOKENS}"),
    ("POST", "/v1/lookup", {"tokens": [1], "namespace": "mine"}, {}, 400, 'must be "auto" or a map'),
    ("POST", "/v1/lookup", {"tokens": [1], "namespace": {"model": MODEL}}, {}, 400, "namespace.layout"),
    ("POST", "/v1/lookup", {"tokens": [1], "namespace": {**NS, "x": 1}}, {}, 400, "unknown namespace field(s) ['x']"),
    ("POST", "/v1/lookup", {"tokens": [1], "namespace": NS, "model_id": MODEL}, {}, 400, "not both"),
    ("POST", "/v1/lookup", {"tokens": [1], "namespace": {**NS, "tenant": "x"}}, {}, 403, "'x' may not be read"),
    ("POST", "/v1/lookup", {"tokens": [1], "model_id": "gone@1"}, {}, 404, f"live: ['{MODEL}']"),
    ("POST", "/v1/lookup", {"tokens": [1], "model": "/no/such/model"}, {}, 404, "unknown model"),
    ("POST", "/v1/lookup", {"messages": [{"role": "user", "content": "hi"}]}, {}, 400, "need model"),
    ("POST", "/v1/lookup", {"messages": [{"role": 1}], "model": "x"}, {}, 400, "messages[0] must be"),
    ("POST", "/v1/lookup", {"messages": [], "model": "x"}, {}, 400, "non-empty list"),
    ("POST", "/v1/lookup", {"tokens": [1], "cache_salt": 5}, {}, 400, "cache_salt must be a string"),
    ("POST", "/v1/lookup", {"tokens": [1], "block_tokens": 5}, {}, 400, "block_tokens must be"),
    ("POST", "/v1/lookup", {"tokens": [1], "compute": {"flops": -1}}, {}, 400, "ComputeModel.flops"),
    ("POST", "/v1/lookup", {"tokens": [1], "compute": {"gpus": 8}}, {}, 400, "compute must be a map"),
    ("POST", "/v1/lookup", {"tokens": [1]}, {"Host": "evil.example:9400"}, 403, "not a loopback"),
]


def test_bad_requests_get_a_4xx_naming_the_problem(service, tmp_path):
    port = Port(service.metrics_address)
    client = connect(service)
    before = counters(client)
    for method, path, body, headers, status, what in BAD:
        raw = body if isinstance(body, bytes) else None
        got, answer = port.call(method, path, None if raw is not None else body, headers, raw=raw)
        assert (got, what in answer.get("error", "")) == (status, True), (method, path, str(body)[:80], answer)

    conn = http.client.HTTPConnection(port.host, port.port, timeout=10)  # a body too large, declared
    conn.putrequest("POST", "/v1/lookup")
    conn.putheader("Content-Length", str(2 << 20))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413 and "at most 1048576" in json.loads(resp.read())["error"]
    conn.close()
    conn = http.client.HTTPConnection(port.host, port.port, timeout=10)  # no length at all
    conn.putrequest("POST", "/v1/lookup")
    conn.endheaders()
    assert conn.getresponse().status == 411
    conn.close()
    assert counters(client) == before
    assert port.lookup(tokens=[1, 2, 3])["tokens"] == 0  # still serving


def test_metrics_are_served_on_the_same_port(service):
    client = connect(service)
    client.save(list(range(2 * C)), make_kv(LAYOUT, 2 * C))
    client.lookup(list(range(2 * C)))
    host, port = service.metrics_address
    deadline = time.monotonic() + 5
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("GET", "/metrics")
    body = conn.getresponse().read().decode()
    conn.close()
    assert time.monotonic() < deadline
    assert 'kvtier_hits_total{tier="host"} 2.0' in body and "kvtier_op_seconds_bucket" in body
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("GET", "/")  # (a scraper configured for the old server's any path)
    assert 'kvtier_hits_total{tier="host"}' in conn.getresponse().read().decode()
    conn.close()


def test_the_lookup_is_off_unless_the_config_turns_it_on(tmp_path):
    raw = {"socket": str(tmp_path / "kv.sock"), "metrics_port": 0,
           "host": {"capacity_bytes": 4 * LAYOUT.chunk_bytes, "extent_bytes": LAYOUT.chunk_bytes}}
    svc = StoreService(daemon_config(raw)).start()
    try:
        status, answer = Port(svc.metrics_address).call("POST", "/v1/lookup", {"tokens": [1, 2]})
        assert status == 404 and "http_lookup = true" in answer["error"]
    finally:
        svc.stop()
    with pytest.raises(ConfigError, match="needs metrics_port"):
        daemon_config({k: v for k, v in raw.items() if k != "metrics_port"} | {"http_lookup": True})


def test_a_model_revision_never_leaves_its_repo_in_the_hub_cache(tmp_path, monkeypatch):
    from kvtier.model_id import resolve_model_dir

    repo = tmp_path / "hub" / "models--org--m"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    (tmp_path / "pointer").write_text("/etc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_dir("org/m")[0] == repo / "snapshots" / ("a" * 40)
    for bad in ("org/m@../../../pointer", "org/m@/etc/passwd", "org/m@x\0y"):
        with pytest.raises(ValueError, match="neither a directory"):
            resolve_model_dir(bad)
    (repo / "refs" / "big").write_text("b" * (1 << 20))  # not a commit: refused, never read whole
    with pytest.raises(ValueError, match="neither a directory"):
        resolve_model_dir("org/m@big")



def test_only_tenants_every_uid_may_use_are_read_on_the_http_port(tmp_path):
    from kvtier.server.http import unreadable
    from kvtier.server.settings import AccessConfig, DaemonConfig
    from kvtier.store.cache import CacheConfig
    from kvtier.tiers.host_config import HostTierConfig

    def config(**kw: object) -> DaemonConfig:
        return DaemonConfig(str(tmp_path / "kv.sock"), CacheConfig(HostTierConfig(1 << 20)), **kw)  # type: ignore[arg-type]

    open_to_socket_users = config(tenant="team")  # no [access.tenants]: only the default tenant
    assert unreadable(open_to_socket_users, "team") is None
    assert "reads only the daemon's default tenant 'team'" in unreadable(open_to_socket_users, "")
    granted = config(access=AccessConfig(tenants={"1001": ("acme", ""), "*": ("", "pub")}))
    assert unreadable(granted, "") is None and unreadable(granted, "pub") is None
    assert "grants every uid" in unreadable(granted, "acme")
    private_default = config(tenant="acme", access=AccessConfig(tenants={"1001": ("acme",)}))
    assert "'acme' may not be read" in unreadable(private_default, "acme")
