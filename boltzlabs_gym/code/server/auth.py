"""Who may use the code server: tokens, one per client, in every form a client that takes only a URL can send.

A request is let in when a credential it carries matches one of the server's tokens:

* ``Authorization: Bearer TOKEN`` (curl, a Prometheus scrape's ``authorization``, clients of your own);
* HTTP basic auth whose password is the token, the user name being anything: in a URL,
  ``http://client:TOKEN@host:8080/run_code``, which ``requests`` (verl) and ``aiohttp`` (the
  ``sandbox-fusion`` client) send as ``Authorization: Basic``. (A URL with a user part only,
  ``http://TOKEN@host:8080``, is not enough: ``requests`` sends no credentials for it);
* ``token=TOKEN`` in the query string: ``http://host:8080/run_code?token=TOKEN``.

Anything else is answered ``401`` with ``WWW-Authenticate`` by :class:`TokenAuth`, an ASGI
middleware: before routing, before the body is read, so no request of a stranger is parsed or
reaches a sandbox. ``GET /v1/ping`` stays open (:data:`OPEN_PATHS`): a health check learns
``"pong"`` and nothing else.

Comparison is in constant time: the SHA-256 of each credential is compared with that of every
token with :func:`hmac.compare_digest`, all of them whichever matches (hashing first makes the
two sides the same length, so not even a token's length shows in the time taken). The token that
matched names the request's client (``request.state.code_client``), whose line it waits in
(:mod:`~boltzlabs_gym.code.fair_queue`).

>>> tokens = ClientTokens({"alice": "a-long-token-for-alice", "bob": "a-long-token-for-bob"})
>>> tokens.client_of("a-long-token-for-bob"), tokens.client_of("guess")
('bob', None)
>>> credential_from_authorization("Basic " + base64.b64encode(b"anyone:a-long-token-for-alice").decode())
'a-long-token-for-alice'
>>> is_loopback("127.0.0.2"), is_loopback("::1"), is_loopback("0.0.0.0"), is_loopback("example.org")
(True, True, False, False)
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from ...errors import AuthConfigError

__all__ = [
    "CLIENT_STATE_KEY",
    "OPEN_PATHS",
    "TOKEN_ENV",
    "ClientTokens",
    "TokenAuth",
    "check_bind",
    "collect_tokens",
    "credential_from_authorization",
    "credentials_in",
    "is_loopback",
    "read_token_file",
]

log = logging.getLogger("boltzlabs_gym.code.server")

#: The environment variable the CLI reads tokens from (one, or several separated by whitespace).
TOKEN_ENV = "BOLTZLABS_CODE_TOKEN"
#: Paths served without a token: a load balancer's health check needs none, and learns only "pong".
OPEN_PATHS = frozenset({"/v1/ping"})
#: Where :class:`TokenAuth` puts the client's name for the route (``request.state.code_client``).
CLIENT_STATE_KEY = "code_client"
#: Tokens shorter than this are accepted with a warning: they can be guessed.
SHORT_TOKEN = 16
#: Credentials looked at per request at most (a request stuffed with ``token=`` values costs no more).
MAX_CREDENTIALS = 4
REALM = "boltzlabs-gym code server"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ClientTokens:
    """The server's tokens and the client each one names.

    Args:
        tokens: ``{client name: token}``, or tokens alone (their clients are then named
            ``token-1``, ``token-2``, ... in order).

    Raises:
        AuthConfigError: a token is empty, holds whitespace or anything but printable ASCII, or two
            clients have the same token.
    """

    def __init__(self, tokens: Mapping[str, str] | Iterable[str]):
        if isinstance(tokens, str):  # one token, not its characters
            tokens = [tokens]
        named = dict(tokens) if isinstance(tokens, Mapping) else _name_in_order(tokens)
        seen: dict[bytes, str] = {}
        for client, token in named.items():
            _check_token(client, token)
            digest = _digest(token)
            if digest in seen:
                raise AuthConfigError(f"clients {seen[digest]!r} and {client!r} have the same token: give each its own")
            seen[digest] = client
        self._digests = [(digest, client) for digest, client in seen.items()]

    @property
    def clients(self) -> list[str]:
        """The clients' names, in the order given."""
        return [client for _, client in self._digests]

    def __len__(self) -> int:
        return len(self._digests)

    def client_of(self, credential: str) -> str | None:
        """The client whose token ``credential`` is, or ``None``; in constant time (module doc)."""
        digest = _digest(credential)
        found = None
        for expected, client in self._digests:
            # every token is compared, whichever matches: the time taken says nothing of which did
            if hmac.compare_digest(digest, expected):
                found = client
        return found

    def client_of_any(self, credentials: Iterable[str]) -> str | None:
        """The client whose token one of ``credentials`` is (the first that matches), or ``None``."""
        found = None
        for credential in credentials:
            client = self.client_of(credential)
            found = found or client
        return found


def _name_in_order(tokens: Iterable[str]) -> dict[str, str]:
    return {f"token-{i}": token for i, token in enumerate(tokens, 1)}


def _check_token(client: str, token: str) -> None:
    if not token:
        raise AuthConfigError(f"client {client!r} has an empty token")
    if not all("!" <= c <= "~" for c in token):
        # line-based token files and URLs need neither quoting nor encoding this way
        raise AuthConfigError(
            f"client {client!r}'s token holds whitespace or a character outside printable ASCII: "
            "make one with python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    if len(token) < SHORT_TOKEN:
        log.warning("client %r's token has %d characters: short enough to be guessed", client, len(token))


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


# ---------------------------------------------------------------------------------- reading a request
def credential_from_authorization(value: str) -> str | None:
    """The token in an ``Authorization`` header's value: a bearer token, or basic auth's password
    (the user name is anything); ``None`` for another scheme or a malformed value."""
    scheme, _, rest = value.strip().partition(" ")
    rest = rest.strip()
    if scheme.lower() == "bearer":
        return rest or None
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(rest, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return decoded.partition(":")[2] or None


def credentials_in(scope: Scope) -> list[str]:
    """Every token an HTTP request's scope carries (``Authorization`` headers, then ``token=`` in
    the query string), :data:`MAX_CREDENTIALS` at most."""
    found = []
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            credential = credential_from_authorization(value.decode("latin-1"))
            if credential:
                found.append(credential)
    query = scope.get("query_string", b"")
    if b"token=" in query:
        found.extend(parse_qs(query.decode("latin-1")).get("token", ()))
    return found[:MAX_CREDENTIALS]


# ---------------------------------------------------------------------------------- the middleware
class TokenAuth:
    """ASGI middleware: a request whose credentials (:func:`credentials_in`) match no token of
    ``tokens`` gets ``401`` (``WWW-Authenticate: Bearer`` and ``Basic``) before the app sees it;
    one that matches goes on with its client's name in ``scope["state"][CLIENT_STATE_KEY]``.

    Args:
        app: the ASGI app behind it.
        tokens: the tokens let in.
        open_paths: paths served to anyone (default :data:`OPEN_PATHS`).
        on_reject: called once per request turned away (to count it).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        tokens: ClientTokens,
        open_paths: frozenset[str] = OPEN_PATHS,
        on_reject: Callable[[], None] | None = None,
    ):
        self.app = app
        self.tokens = tokens
        self.open_paths = open_paths
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)  # lifespan events, and the health check
            return
        credentials = credentials_in(scope)
        client = self.tokens.client_of_any(credentials)
        if client is None:
            if self.on_reject is not None:
                self.on_reject()
            await _refuse(scope, send, "the token is not valid" if credentials else "a token is required")
            return
        scope.setdefault("state", {})[CLIENT_STATE_KEY] = client
        await self.app(scope, receive, send)


async def _refuse(scope: Scope, send: Send, why: str) -> None:
    """Answer 401 (a websocket: close it before it is accepted, which the server answers with 403)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    detail = (
        f"{why}: send Authorization: Bearer TOKEN, or put it in the URL as http://user:TOKEN@host:port, "
        "or add ?token=TOKEN"
    )
    body = json.dumps({"detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", f'Bearer realm="{REALM}"'.encode()),
        (b"www-authenticate", f'Basic realm="{REALM}"'.encode()),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------------------------- starting a server
def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only: ``localhost``, 127.0.0.0/8, ``::1``
    (an IPv4-mapped loopback too). Any other name counts as not: it may resolve anywhere."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_bind(host: str, *, tokens: int, insecure: bool) -> None:
    """Refuse to serve ``host`` beyond loopback without tokens unless ``insecure`` (then warn once).

    Raises:
        AuthConfigError: no token for a non-loopback ``host`` and not ``insecure``; or tokens and
            ``insecure`` both.
    """
    if tokens and insecure:
        raise AuthConfigError("--insecure-no-auth and a token were both given: drop one")
    if tokens or is_loopback(host):
        return
    if not insecure:
        raise AuthConfigError(
            f"refusing to serve {host} without a token: anyone who can reach it could run code here. "
            f"Give one or more (--token, --token-file, or ${TOKEN_ENV}), or, on a trusted network only, "
            "--insecure-no-auth"
        )
    log.warning("serving %s WITHOUT a token (--insecure-no-auth): anyone who can reach it can run code here", host)


def read_token_file(path: str) -> list[tuple[str | None, str]]:
    """The tokens of a token file: one per line, ``TOKEN`` or ``NAME TOKEN`` (the client's name);
    blank lines and ``#`` comments skipped. Warns when others than its owner may read it.

    Raises:
        AuthConfigError: the file cannot be read, holds no token, or a line has more than two fields.
    """
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthConfigError(f"cannot read the token file {path}: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the token file %s can be read by others than its owner (chmod 600 it)", path)
    entries: list[tuple[str | None, str]] = []
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if len(fields) > 2:
            raise AuthConfigError(f"{path}:{number}: a line is TOKEN or NAME TOKEN, got {len(fields)} fields")
        if fields:
            entries.append((fields[0], fields[1]) if len(fields) == 2 else (None, fields[0]))
    if not entries:
        raise AuthConfigError(f"the token file {path} holds no token")
    return entries


def collect_tokens(flags: Iterable[str], environ_value: str | None, files: Iterable[str]) -> dict[str, str]:
    """``{client name: token}`` from ``--token`` values, the :data:`TOKEN_ENV` variable's value and
    token files: a token without a name is ``token-N``, N counting those in that order.

    Raises:
        AuthConfigError: a token file cannot be used, or two clients have the same name.
    """
    entries: list[tuple[str | None, str]] = [(None, token) for token in flags]
    entries += [(None, token) for token in (environ_value or "").split()]
    for path in files:
        entries += read_token_file(path)
    named: dict[str, str] = {}
    unnamed = 0
    for name, token in entries:
        if name is None:
            unnamed += 1
            name = f"token-{unnamed}"
        if name in named:
            raise AuthConfigError(f"two tokens are named {name!r}: a client's name must be its own")
        named[name] = token
    return named
