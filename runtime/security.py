"""TLS credentials and API-key authentication, shared by router and worker (no torch here).

Keys file (--api-keys-file): one key per line, `KEY TENANT [admin]`; blank lines and `#`
comments are skipped. It is read at start and again on SIGHUP (a file that fails to parse on
reload leaves the previous keys in force). Clients send `authorization: Bearer KEY`.

Without a valid key every call but health checks and reflection is UNAUTHENTICATED; Admin calls
need an admin key (PERMISSION_DENIED otherwise). A tenant's requests get the tenant folded into
their cache salt, so tenants never share cached blocks (no prefix-cache timing side channel),
and their request ids are scoped to the tenant. Admin keys are trusted to act for every tenant:
the router reaches workers with one and names the tenant it acts for in TENANT_HEADER, so the
worker scopes the request exactly as it would the tenant's own call (and echoes the caller's
request id, which the router then relays untouched).

Direct mode: a router's Route answers with a worker and a grant, and the client streams from the
worker itself. The grant is an HMAC, keyed from the router's own key to workers (the admin key it
already holds: --worker-api-key-file), over the worker id, the tenant the router acts for, an
expiry and the digest of the exact request; workers hold that key in their keys file, so they
check it without asking anyone. A worker serves a granted call as the tenant named in the grant,
only once, only before expiry, only the request it was signed for (the router's limits and
tenancy hold), and only on the worker the router chose.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_ADMIN_PREFIX = "/pagoda.v1.Admin/"
# Binary (-bin) so that any printable tenant name travels, not only ASCII.
TENANT_HEADER = "x-pagoda-tenant-bin"
GRANT_HEADER = "x-pagoda-grant-bin"
GRANT_METHOD = "/pagoda.v1.Generation/Generate"     # the one call a grant opens
GRANT_TTL_S = 10.0


@dataclass(frozen=True)
class Identity:
    tenant: str
    admin: bool = False


def read_keys(path: str) -> dict[str, Identity]:
    keys: dict[str, Identity] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "admin"):
            raise ValueError(f"{path}:{n}: expected `KEY TENANT [admin]`")
        if not parts[1].isprintable():       # the tenant delimits cache-salt namespaces
            raise ValueError(f"{path}:{n}: the tenant must be printable")
        if parts[0] in keys:
            raise ValueError(f"{path}:{n}: key listed twice")
        keys[parts[0]] = Identity(parts[1], len(parts) == 3)
    if not keys:
        raise ValueError(f"{path}: no keys")
    return keys


def read_key(path: str) -> str:
    """The single key in a file (the router's own key to workers)."""
    key = Path(path).read_text().strip()
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"{path}: expected one key and nothing else")
    return key


class KeyRing:
    """The keys in force; `identify` maps a call's metadata to an Identity (or None)."""

    def __init__(self, path: str):
        self.path = path
        self.keys = read_keys(path)

    def reload(self) -> None:
        try:
            self.keys = read_keys(self.path)
            log.info("api keys reloaded from %s: %d keys", self.path, len(self.keys))
        except (OSError, ValueError) as e:
            log.error("api keys: reload failed (%s); the previous keys stay in force", e)

    def identify(self, metadata) -> Identity | None:
        for k, v in metadata or ():
            if k == "authorization" and isinstance(v, str) and v.startswith("Bearer "):
                return self.keys.get(v[7:].strip())
        return None


def identity(keyring: KeyRing | None, context) -> Identity | None:
    """The caller of a handler's call (None when the server runs without keys)."""
    return keyring.identify(context.invocation_metadata()) if keyring is not None else None


def acting_identity(keyring: KeyRing | None, context) -> Identity | None:
    """The identity a worker serves a call as: the caller's, or the tenant named in TENANT_HEADER
    when an admin key (the router's) sends it. A server without keys has no tenancy to protect,
    so there the header alone decides, as it does for the router that sent it; a tenant's own key
    never acts for another."""
    metadata = context.invocation_metadata()
    ident = keyring.identify(metadata) if keyring is not None else None
    if keyring is not None and (ident is None or not ident.admin):
        return ident
    for k, v in metadata or ():
        if k == TENANT_HEADER:
            tenant = v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
            if tenant and tenant.isprintable() and len(tenant) <= 256:
                return Identity(tenant)
    return ident


def tenant_metadata(ident: Identity | None) -> tuple[tuple[str, bytes], ...]:
    """What the router adds to a worker call made for `ident` (nothing for admins and keyless calls)."""
    return () if ident is None or ident.admin else ((TENANT_HEADER, ident.tenant.encode()),)


def scoped_salt(ident: Identity | None, cache_salt: str) -> str:
    return cache_salt if ident is None or ident.admin else f"tenant:{ident.tenant}\x00{cache_salt}"


def scoped_id(ident: Identity | None, request_id: str) -> str:
    return request_id if ident is None or ident.admin else f"{ident.tenant}/{request_id}"


# ---- grants (direct mode) -------------------------------------------------------------------

_GRANT_VERSION = 1
# version, key id, expiry (unix ms), nonce (two grants are never the same), scoped?, tenant length
_GRANT_HEAD = struct.Struct(">B8sQ8sBH")
_MAC_BYTES = 32


class GrantError(Exception):
    """A grant refused: `code` is the gRPC status to answer, the message says why."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _grant_secret(key: str) -> tuple[bytes, bytes]:
    """(key id, HMAC key) derived from an admin key: the key itself never signs or travels."""
    raw = key.encode()
    return (hashlib.sha256(b"pagoda-grant-key-id\0" + raw).digest()[:8],
            hmac.new(raw, b"pagoda-grant-v1", hashlib.sha256).digest())


def request_digest(request) -> bytes:
    """The digest a grant binds: of the request's deterministic encoding (router and worker
    encode the same message to the same bytes)."""
    return hashlib.sha256(request.SerializeToString(deterministic=True)).digest()


def _mac(secret: bytes, head_and_tenant: bytes, worker_id: str, digest: bytes) -> bytes:
    wid = worker_id.encode()
    return hmac.new(secret, head_and_tenant + struct.pack(">H", len(wid)) + wid + digest, hashlib.sha256).digest()


class GrantSigner:
    """The router's side: signs with the key it sends workers (an admin key in their keys file)."""

    def __init__(self, key: str, ttl: float = GRANT_TTL_S):
        self.key_id, self.secret = _grant_secret(key)
        self.ttl = ttl

    def sign(self, worker_id: str, ident: Identity | None, request, now: float | None = None) -> tuple[bytes, float]:
        """(grant, expiry in unix seconds) for `request` on `worker_id`, acting for `ident`."""
        expires = (time.time() if now is None else now) + self.ttl
        scoped = ident is not None and not ident.admin
        tenant = ident.tenant.encode() if scoped and ident is not None else b""
        head = _GRANT_HEAD.pack(_GRANT_VERSION, self.key_id, int(expires * 1000), secrets.token_bytes(8), scoped,
                                len(tenant)) + tenant
        return head + _mac(self.secret, head, worker_id, request_digest(request)), expires


class GrantVerifier:
    """The worker's side: checks grants against the admin keys of its keyring (so a keys-file
    reload on SIGHUP rotates them too), each grant once."""

    def __init__(self, keyring: KeyRing, worker_id: str):
        self.keyring, self.worker_id = keyring, worker_id
        self._keys: dict | None = None
        self._secrets: dict[bytes, bytes] = {}
        self._used: dict[bytes, float] = {}        # MAC -> expiry: a grant opens one stream
        self._prune_at = 4096

    def _secret(self, key_id: bytes) -> bytes | None:
        if self._keys is not self.keyring.keys:
            self._keys = self.keyring.keys
            self._secrets = dict(_grant_secret(k) for k, ident in self._keys.items() if ident.admin)
        return self._secrets.get(key_id)

    def verify(self, grant: bytes, request, now: float | None = None) -> Identity | None:
        """The identity to serve `request` as (None: unscoped, as the router's admin key), or GrantError."""
        now = time.time() if now is None else now
        n = _GRANT_HEAD.size
        try:
            version, key_id, expires_ms, _, scoped, tlen = _GRANT_HEAD.unpack_from(grant)
        except struct.error:
            raise GrantError(grpc.StatusCode.UNAUTHENTICATED, "grant: malformed") from None
        if version != _GRANT_VERSION or len(grant) != n + tlen + _MAC_BYTES:
            raise GrantError(grpc.StatusCode.UNAUTHENTICATED, "grant: malformed")
        secret = self._secret(key_id)
        if secret is None:
            raise GrantError(grpc.StatusCode.UNAUTHENTICATED, "grant: signed with a key this worker does not hold")
        mac = grant[n + tlen:]
        if not hmac.compare_digest(mac, _mac(secret, grant[:n + tlen], self.worker_id, request_digest(request))):
            raise GrantError(grpc.StatusCode.PERMISSION_DENIED,
                             "grant: not signed for this request on this worker")
        if expires_ms / 1000 < now:
            raise GrantError(grpc.StatusCode.UNAUTHENTICATED, "grant: expired; ask the router again")
        if mac in self._used:
            raise GrantError(grpc.StatusCode.PERMISSION_DENIED, "grant: already used")
        if len(self._used) >= self._prune_at:     # amortised: at most one sweep per doubling
            self._used = {m: e for m, e in self._used.items() if e >= now}
            self._prune_at = max(4096, 2 * len(self._used))
        self._used[mac] = expires_ms / 1000
        tenant = grant[n:n + tlen].decode("utf-8", "replace")
        return Identity(tenant) if scoped else None


def grant_of(context) -> bytes | None:
    for k, v in context.invocation_metadata() or ():
        if k == GRANT_HEADER:
            return v if isinstance(v, bytes) else str(v).encode()
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid key (UNAUTHENTICATED) and Admin calls without an admin
    key (PERMISSION_DENIED) before the handler runs; health and reflection stay open. With
    `grants` (workers), Generate may come with a grant instead of a key: the handler checks it
    (it needs the request), and refuses the call when it does not hold."""

    def __init__(self, keyring: KeyRing, grants: bool = False):
        self.keyring, self.grants = keyring, grants

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(_OPEN_PREFIXES):
            return handler
        ident = self.keyring.identify(details.invocation_metadata)
        if ident is None and self.grants and method == GRANT_METHOD \
                and any(k == GRANT_HEADER for k, _ in details.invocation_metadata or ()):
            return handler
        if ident is None:
            return _refuse(handler, grpc.StatusCode.UNAUTHENTICATED,
                           "authorization: send `authorization: Bearer KEY` with a valid key")
        if method.startswith(_ADMIN_PREFIX) and not ident.admin:
            return _refuse(handler, grpc.StatusCode.PERMISSION_DENIED,
                           f"authorization: {method.rsplit('/', 1)[-1]} needs an admin key")
        return handler


def _refuse(handler, code: grpc.StatusCode, message: str):
    async def deny(request_or_iterator, context):
        await context.abort(code, message)

    kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return kind[(handler.request_streaming, handler.response_streaming)](
        deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(cert: str | None, key: str | None, client_ca: str | None) -> grpc.ServerCredentials | None:
    """TLS when cert and key are given; mTLS (client certificates required) with client_ca."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cert and key):
        raise ValueError("--tls-cert and --tls-key go together")
    ca = _read(client_ca)
    return grpc.ssl_server_credentials([(_read(key), _read(cert))], root_certificates=ca,
                                       require_client_auth=ca is not None)


def channel_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials | None:
    """For the router's channels to workers: TLS when a CA is given (client cert for mTLS)."""
    if bool(cert) != bool(key):
        raise ValueError("--worker-tls-cert and --worker-tls-key go together")
    if not ca and not cert:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                        certificate_chain=_read(cert))


def add_flags(p, worker_side: bool) -> None:
    """The TLS and key flags a server takes (the router also the ones for its worker channels)."""
    g = p.add_argument_group("TLS and authentication")
    g.add_argument("--tls-cert", help="PEM certificate chain: serve TLS")
    g.add_argument("--tls-key", help="PEM private key of --tls-cert")
    g.add_argument("--tls-client-ca", help="PEM CA: require client certificates it signed (mTLS)")
    g.add_argument("--api-keys-file", help="`KEY TENANT [admin]` per line; reloaded on SIGHUP")
    if not worker_side:
        g.add_argument("--worker-tls-ca", help="PEM CA to verify workers' certificates (TLS to workers)")
        g.add_argument("--worker-tls-cert", help="PEM client certificate for workers that require mTLS")
        g.add_argument("--worker-tls-key", help="PEM private key of --worker-tls-cert")
        g.add_argument("--worker-api-key-file", help="file holding the key the router sends to workers "
                       "(an admin key in their --api-keys-file)")
