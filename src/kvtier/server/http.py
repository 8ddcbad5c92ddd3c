"""The store daemon's HTTP port: Prometheus metrics, and a read-only prefix lookup for routers.

    GET  /metrics         the daemon's metrics (Prometheus text format)
    GET  /v1/namespaces   {"namespaces": [{"model", "page_format", "tenant", "chunk_tokens", "layout"}]}
    POST /v1/lookup       how many leading tokens of a prompt the daemon holds, in which tier

A lookup is a JSON object with exactly one of ``tokens`` (token ids) or ``messages`` (an OpenAI
chat, rendered with ``model``'s chat template and a generation prompt), and optionally:
``model`` (a model directory or a Hugging Face cache id: the tokenizer of ``messages``; it also
narrows ``"auto"`` to namespaces of that model's name), ``namespace`` (``"auto"``, the default,
or a map as a client's hello names it -- an entry of ``/v1/namespaces`` as is), ``model_id``
(with ``"auto"``: the live namespace whose model is exactly this), ``cache_salt`` (chained as
the vLLM connector chains it), ``block_tokens`` (partial last chunks of this many tokens a block
are probed, as the vLLM connector saves them; default: the ``-bsN`` of the page format, else
none) and ``compute`` (:class:`~kvtier.core.cost_model.ComputeModel` fields; the daemon knows
no model's size nor its hardware, so fields not given are its defaults, a Llama-3-8B-like model
on 400 TFLOP/s, and the answer names them in ``cost_model.assumed``). The answer::

    {"tokens": 1216, "num_tokens": 1300, "chunk_tokens": 256, "chunks": 4, "tail_tokens": 192,
     "tiers": {"host": 768, "disk": 448}, "predicted_prefill_s_saved": 0.051,
     "cost_model": {...}, "namespace": {...}}

``tokens`` leading tokens are held (``chunks`` full chunks, then a partial one of
``tail_tokens``); ``tiers`` splits them by the fastest tier holding each chunk (the values sum
to ``tokens``); ``predicted_prefill_s_saved`` is the compute of those tokens' prefill (the time
to load them is not taken off). Errors are ``{"error": "..."}`` with 400 (malformed), 403
(tenant or Host refused), 404 (path, model or namespace not found), 405, 409 (several
namespaces: pick one), 411, 413 (body or tokens too many) or 503.

``"auto"``: the namespaces live clients named in their hellos, of readable tenants, less the
shards a vLLM scheduler never looks up (tensor- and pipeline-parallel ranks above 0), narrowed
by ``model_id`` or ``model``; exactly one must be left.

A lookup changes nothing: no policy touch, no hit or lookup counted, no lease, no promotion;
it reads the chunk index (:meth:`StoreDaemon.held`) without the daemon's lock.

Threat model. The lookup is off unless the config says ``http_lookup = true`` (``/metrics``
is served either way, on any path but ``/v1/``). The port binds loopback and has no
authentication: every local user can reach it, while the daemon's socket may be its owner's
alone. Turning the lookup on therefore tells every local user whether a prefix they can guess
is held in a readable tenant -- the daemon's default tenant when no ``[access.tenants]`` is
configured, else only the tenants it grants ``"*"`` -- which the socket's permissions may not
otherwise allow: keep traffic that must stay private in a tenant of its own. Other tenants are
refused with 403, and ``/v1/namespaces`` and ``"auto"`` never show their namespaces. ``/v1/``
answers only requests whose ``Host`` is a loopback name, so a web page in a local browser
cannot read it by rebinding a DNS name onto 127.0.0.1. An anonymous request's cost is bounded:
1 MiB of body, 128K tokens, 32 connections at once (one more is answered 503), 10 s per read
and 15 s per connection (the last three: :mod:`kvtier.server.http_port`). ``messages`` makes
the daemon load a tokenizer (local files only, never code: ``trust_remote_code`` is off; 4
kept; one load or chat at a time) and render its chat template (transformers' sandboxed
Jinja); a model directory that users other than the daemon's and root may write (or whose
files they may) is refused with 403, since its template would run in the daemon; a model
name's revision never leaves its repo in the cache, and an unknown model's answer names no
path.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, make_wsgi_app

from kvtier.core.cost_model import ComputeModel
from kvtier.core.request_extras import request_head
from kvtier.model_id import resolve_model_dir
from kvtier.server.protocol import BadRequest
from kvtier.server.settings import ANY_UID, ClientNamespace, DaemonConfig, parse_namespace

if TYPE_CHECKING:
    from kvtier.server.daemon import StoreDaemon

log = logging.getLogger(__name__)

RenderChat = Callable[[str, list[dict[str, str]]], list[int]]

MAX_BODY_BYTES = 1 << 20
MAX_TOKENS = 1 << 17
TOKEN_LIMIT = 1 << 31
_FIELDS = {"tokens", "messages", "model", "namespace", "model_id", "cache_salt", "block_tokens", "compute"}
_NS_FIELDS = {"model", "layout", "page_format", "tenant", "chunk_tokens"}
_COMPUTE_FIELDS = {"num_layers", "hidden", "params", "flops"}
_OTHER_RANK = re.compile(r"-(?:tp|pp)[1-9][0-9]*of[0-9]+")
_BLOCK = re.compile(r"-bs([0-9]+)(?:-|$)")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, **extra: object) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": message, **extra}


def describe(ns: ClientNamespace) -> dict[str, object]:
    """A namespace as ``/v1/namespaces`` lists it (and a lookup takes it back)."""
    lay = ns.layout
    return {"model": ns.model, "page_format": ns.page_format, "tenant": ns.tenant, "chunk_tokens": lay.chunk_tokens,
            "layout": {"num_layers": lay.num_layers, "num_kv_heads": lay.num_kv_heads, "head_dim": lay.head_dim,
                       "dtype": lay.dtype, "chunk_tokens": lay.chunk_tokens, "kv": lay.kv}}


def unreadable(config: DaemonConfig, tenant: str) -> str | None:
    """Why ``tenant`` may not be read on the HTTP port (None: it may; see the module)."""
    grants = config.access.tenants
    if grants is None:
        if tenant == config.tenant:
            return None
        shared = f"the daemon's default tenant {config.tenant!r}"
    else:
        everyone = grants.get(ANY_UID, ())
        if tenant in everyone:
            return None
        shared = f"the tenants [access.tenants] grants every uid (\"*\": {list(everyone)})"
    return (f"tenant {tenant!r} may not be read on the HTTP port: it has no authentication and every "
            f"local user reaches it, so it reads only {shared}")


def _check(ok: bool, message: str, status: int = 400) -> None:
    if not ok:
        raise HTTPError(status, message)


class StoreHTTP:
    """The WSGI app of the daemon's HTTP port. ``daemon()`` returns the daemon (None while it is
    not made yet)."""

    def __init__(self, daemon: Callable[[], StoreDaemon | None], registry: CollectorRegistry,
                 lookup: bool = True, render_chat: RenderChat | None = None) -> None:
        self._daemon = daemon
        self.lookup_enabled = lookup
        self._render_chat = render_chat
        """(model directory, messages) -> token ids (:class:`kvtier.engines.chat_render.ChatRenderer`,
        given by the CLI: the server imports no engine); None: ``messages`` are refused. It
        raises LookupError for a model it cannot render with, ValueError for bad messages."""
        self._metrics = make_wsgi_app(registry)
        self._routes = {"/v1/lookup": ("POST", self.lookup), "/v1/namespaces": ("GET", self.namespaces)}
        self._rendering = threading.Lock()

    def __call__(self, environ: dict[str, object], start_response: Callable[..., object]) -> Iterable[bytes]:
        path, method = str(environ.get("PATH_INFO", "")), str(environ.get("REQUEST_METHOD", ""))
        if not path.startswith("/v1/") and method in ("GET", "HEAD"):
            return self._metrics(environ, start_response)  # type: ignore[no-any-return] # (any path, as before)
        headers: list[tuple[str, str]] = []
        try:
            _check(self.lookup_enabled, "the lookup is off: set http_lookup = true in the daemon's config "
                                        "(every local user may then ask about the readable tenants' prefixes)", 404)
            allowed, handler = self._routes.get(path, (None, None))
            _check(allowed is not None or not path.startswith("/v1/"),
                   f"no such path {path[:100]!r}: the daemon serves /v1/namespaces and /v1/lookup", 404)
            _check(allowed is not None, "metrics are read with GET", 405)
            if method != allowed:
                headers.append(("Allow", str(allowed)))
                raise HTTPError(405, f"{path} takes {allowed}, not {method[:20]}")
            assert handler is not None
            host = str(environ.get("HTTP_HOST") or "")
            _check(not host or _loopback(host),
                   f"Host {host[:100]!r} is not a loopback address (a name rebound onto this machine?)", 403)
            status, body = 200, handler(environ)
        except HTTPError as exc:
            status, body = exc.status, exc.body
        except Exception:
            log.exception("kvtier HTTP %s %s failed", method, path)
            status, body = 500, {"error": "internal error (see the daemon's log)"}
        data = json.dumps(body).encode()
        start_response(f"{status} {HTTPStatus(status).phrase}",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(data))), *headers])
        return [data]

    def _live(self) -> StoreDaemon:
        daemon = self._daemon()
        _check(daemon is not None and daemon.cache is not None, "the daemon is not serving", 503)
        return daemon  # type: ignore[return-value]

    # -- GET /v1/namespaces -------------------------------------------------------------------
    def namespaces(self, environ: dict[str, object]) -> dict[str, object]:
        daemon = self._live()
        return {"namespaces": [describe(ns) for ns in daemon.namespaces()
                               if unreadable(daemon.config, ns.tenant) is None]}

    # -- POST /v1/lookup ----------------------------------------------------------------------
    def lookup(self, environ: dict[str, object]) -> dict[str, object]:
        req = _body(environ)
        daemon = self._live()
        _check(not set(req) - _FIELDS, f"unknown field(s) {sorted(set(req) - _FIELDS)[:8]}; allowed: {sorted(_FIELDS)}")
        _check(("tokens" in req) != ("messages" in req), "give exactly one of tokens (token ids) or messages (a chat)")
        model = req.get("model")
        _check(model is None or (isinstance(model, str) and 0 < len(model) <= 4096),
               "model must be a model directory or a Hugging Face cache id")
        salt = req.get("cache_salt")
        _check(salt is None or (isinstance(salt, str) and len(salt) <= 4096), "cache_salt must be a string")
        compute, assumed = _compute(req)
        chat = _messages(req["messages"]) if "messages" in req else None
        tokens = _tokens(req["tokens"]) if chat is None else []
        resolved = self._resolve(model) if model is not None else None  # type: ignore[arg-type]
        if chat is not None:
            tokens = self._render(chat, model, resolved)  # type: ignore[arg-type]
        ns = self._pick(daemon, req, None if resolved is None else resolved[1])
        c = ns.layout.chunk_tokens
        block = _block_tokens(req, ns)
        head = request_head(salt=salt)  # type: ignore[arg-type]
        found = daemon.held(ns, tokens, {0: head} if head else None, block)
        counts = dict.fromkeys((t.name for t in daemon.cache.tiers), 0)  # type: ignore[union-attr]
        for tier in found.chunk_tiers:
            counts[tier] += c
        if found.tail_tier is not None:
            counts[found.tail_tier] += found.tail_tokens
        m, tail = len(found.chunk_tiers), found.tail_tokens
        held = m * c + tail
        saved = compute.prefill_s(0, held)
        _check(math.isfinite(saved), "compute: these numbers give no finite prefill time")
        return {"tokens": held, "num_tokens": len(tokens), "chunk_tokens": c, "chunks": m, "tail_tokens": tail,
                "tiers": counts, "predicted_prefill_s_saved": saved,
                "cost_model": {"num_layers": compute.num_layers, "hidden": compute.hidden, "params": compute.params,
                               "flops": compute.flops, "assumed": assumed},
                "namespace": describe(ns)}

    def _pick(self, daemon: StoreDaemon, req: dict[str, object], name: str | None) -> ClientNamespace:
        """The namespace the request names, or the one live namespace ``"auto"`` finds (of the
        model named ``name``, when given)."""
        raw, model_id = req.get("namespace", "auto"), req.get("model_id")
        _check(model_id is None or (isinstance(model_id, str) and model_id != ""), "model_id must be a non-empty string")
        if isinstance(raw, dict):
            _check(model_id is None, "give namespace (a map) or model_id, not both")
            _check(not set(raw) - _NS_FIELDS, f"unknown namespace field(s) {sorted(set(raw) - _NS_FIELDS)[:8]}; "
                                              f"allowed: {sorted(_NS_FIELDS)}")
            try:
                ns = parse_namespace({k: v for k, v in raw.items() if k != "chunk_tokens"}, daemon.config.tenant)
            except BadRequest as exc:
                raise HTTPError(400, str(exc)) from None
            _check(raw.get("chunk_tokens", ns.layout.chunk_tokens) == ns.layout.chunk_tokens,
                   "namespace.chunk_tokens differs from namespace.layout.chunk_tokens")
            refusal = unreadable(daemon.config, ns.tenant)
            _check(refusal is None, str(refusal), 403)
            return ns
        _check(raw == "auto", 'namespace must be "auto" or a map as /v1/namespaces lists them')
        live = [ns for ns in daemon.namespaces()
                if unreadable(daemon.config, ns.tenant) is None and not _OTHER_RANK.search(ns.page_format)]
        if model_id is not None:
            found, wanted = [ns for ns in live if ns.model == model_id], f"model_id {model_id!r}"
        elif name is not None:
            found, wanted = [ns for ns in live if ns.model.startswith(f"{name}@")], f"model {name!r}"
        else:
            found, wanted = live, "any model"
        listed = [describe(ns) for ns in found or live]
        models = sorted({str(d["model"]) for d in listed})
        _check(bool(found), f"no live client named a readable namespace of {wanted} (live: {models}); "
                            'name one with "namespace": {...}', 404)
        if len(found) > 1:
            raise HTTPError(409, f"{len(found)} namespaces are in use (models {models}): pick one with "
                                 '"namespace": {...} (an entry of /v1/namespaces) or "model_id"', candidates=listed)
        return found[0]

    # -- messages -----------------------------------------------------------------------------
    @staticmethod
    def _resolve(model: str) -> tuple[str, str]:
        try:
            path, name = resolve_model_dir(model)
        except (ValueError, OSError):  # (no path in the answer: the daemon's files are its own)
            raise HTTPError(404, f"unknown model {model[:200]!r}: not a model directory nor in the "
                                 "daemon's Hugging Face cache") from None
        return str(path.resolve()), name

    def _render(self, messages: list[dict[str, str]], model: str, resolved: tuple[str, str] | None) -> list[int]:
        _check(resolved is not None, "messages need model (whose chat template renders them)")
        _check(self._render_chat is not None, "this daemon renders no chats (started without a renderer): "
                                              "send tokens instead")
        path = resolved[0]  # type: ignore[index]
        _check(_trusted(path), f"model {model!r}: its directory or a file in it may be written by users other "
                               "than the daemon's and root, and its chat template would run in the daemon", 403)
        with self._rendering:  # one chat (and one tokenizer load) at a time: they hold the GIL
            try:
                ids = self._render_chat(path, messages)  # type: ignore[misc]
            except LookupError as exc:  # (no tokenizer, no template: the renderer says which)
                raise HTTPError(404, f"model {model!r}: {exc}") from None
            except ValueError as exc:
                raise HTTPError(400, f"model {model!r}: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - a template may raise anything on odd input
                raise HTTPError(400, f"model {model!r}'s chat template refused the messages: {exc}") from None
        _check(len(ids) <= MAX_TOKENS, f"the messages render to {len(ids)} tokens; at most {MAX_TOKENS}", 413)
        return [int(t) for t in ids]


def _trusted(path: str) -> bool:
    """Whether the model directory ``path`` and the files in it (their targets, for a hub
    snapshot's links) belong to root or the daemon's user and nobody else may write them."""
    def ok(st: os.stat_result) -> bool:
        return st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o022

    try:
        with os.scandir(path) as entries:
            return ok(os.stat(path)) and all(ok(e.stat()) for e in entries if e.is_file())
    except OSError:
        return False


def _loopback(host: str) -> bool:
    """Whether a ``Host`` header (``name[:port]``, ``[v6][:port]``) names this machine's loopback."""
    name = host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] or host
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _body(environ: dict[str, object]) -> dict[str, object]:
    length = str(environ.get("CONTENT_LENGTH") or "")
    _check(length != "", "a request body needs a Content-Length", 411)
    _check(length.isdigit(), f"bad Content-Length {length[:40]!r}")
    _check(int(length) <= MAX_BODY_BYTES, f"the body is {length} bytes; at most {MAX_BODY_BYTES}", 413)
    raw = environ["wsgi.input"].read(int(length))  # type: ignore[attr-defined]
    _check(len(raw) == int(length), "the body is shorter than its Content-Length")

    def finite(text: str) -> float:
        if not math.isfinite(value := float(text)):
            raise ValueError(f"{text[:40]} is not a finite number")
        return value

    try:
        req = json.loads(raw, parse_constant=finite, parse_float=finite)
    except (ValueError, RecursionError) as exc:
        raise HTTPError(400, f"the body is not valid JSON: {exc}") from None
    _check(isinstance(req, dict), "the body must be a JSON object")
    return req  # type: ignore[no-any-return]


def _messages(raw: object) -> list[dict[str, str]]:
    _check(isinstance(raw, list) and len(raw) > 0, "messages must be a non-empty list")
    for i, msg in enumerate(raw):  # type: ignore[arg-type]
        _check(isinstance(msg, dict) and isinstance(msg.get("role"), str) and isinstance(msg.get("content"), str)
               and not set(msg) - {"role", "content", "name"},
               f"messages[{i}] must be a map of role and content (strings), and optionally name")
    return raw  # type: ignore[return-value]


def _tokens(raw: object) -> list[int]:
    _check(isinstance(raw, list), "tokens must be a list of token ids")
    _check(len(raw) <= MAX_TOKENS, f"{len(raw)} tokens; at most {MAX_TOKENS}", 413)  # type: ignore[arg-type]
    bad = next((t for t in raw if type(t) is not int or not 0 <= t < TOKEN_LIMIT), None)  # type: ignore[union-attr]
    _check(bad is None, f"tokens: every id must be an integer in [0, {TOKEN_LIMIT}), got {bad!r:.40}")
    return raw  # type: ignore[return-value]


def _block_tokens(req: dict[str, object], ns: ClientNamespace) -> int:
    c = ns.layout.chunk_tokens
    if "block_tokens" not in req:
        found = _BLOCK.search(ns.page_format)
        block = int(found.group(1)) if found else 0
        return block if 0 < block < c and c % block == 0 else 0
    block = req["block_tokens"]
    _check(type(block) is int and 0 <= block <= c and (block == 0 or c % block == 0),  # type: ignore[operator]
           f"block_tokens must be 0 (no partial chunks) or divide chunk_tokens ({c}), got {block!r:.40}")
    return block  # type: ignore[return-value]


def _compute(req: dict[str, object]) -> tuple[ComputeModel, list[str]]:
    given = req.get("compute", {})
    _check(isinstance(given, dict) and not set(given) - _COMPUTE_FIELDS,
           f"compute must be a map of some of {sorted(_COMPUTE_FIELDS)}")
    try:
        return ComputeModel(**given), sorted(_COMPUTE_FIELDS - set(given))  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise HTTPError(400, f"compute: {exc}") from None


__all__ = ["StoreHTTP", "describe", "unreadable"]
