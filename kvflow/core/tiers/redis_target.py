"""Where the Redis tier connects, and as whom: `--l2-redis URL` resolved against the
credential flags and the KVFLOW_REDIS_* environment variables.

Each value is taken from the first place that has it: the flag or config value
(username and password only), the URL's own part, the environment
(`KVFLOW_REDIS_USERNAME`, `KVFLOW_REDIS_PASSWORD`, `KVFLOW_REDIS_HOST`,
`KVFLOW_REDIS_PORT`), then the default (localhost, 6379, db 0, no user or password).
`RedisTarget.sources` records which place each value came from, so an error can name
the place of a wrong credential without ever showing the credential. No message,
repr or str made here contains a username or password.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

DEFAULT_HOST = "localhost"
DEFAULT_PORT = 6379
SCHEMES = {"redis": False, "rediss": True}  # scheme -> TLS

URL_SOURCE = "--l2-redis URL"
USERNAME_FLAG = "--l2-redis-username"
PASSWORD_FLAG = "--l2-redis-password"
ENV_USERNAME = "KVFLOW_REDIS_USERNAME"
ENV_PASSWORD = "KVFLOW_REDIS_PASSWORD"
ENV_HOST = "KVFLOW_REDIS_HOST"
ENV_PORT = "KVFLOW_REDIS_PORT"
#: a PEM file of CA certificates to verify a rediss:// server with (else the system's)
ENV_CA = "KVFLOW_REDIS_CA"
DEFAULT_SOURCE = "default"


@dataclass(frozen=True)
class RedisTarget:
    """One Redis endpoint and the credentials to use there (kept out of repr)."""

    host: str
    port: int
    db: int = 0
    tls: bool = False
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    #: PEM CA bundle for TLS (KVFLOW_REDIS_CA); None: the system's trust store
    ca_certs: str | None = None
    #: where each of username, password, host, port, db (and ca_certs) came from
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def safe_url(self) -> str:
        """The target as a URL with any credentials replaced by "***"."""
        scheme = "rediss" if self.tls else "redis"
        creds = "***@" if self.username or self.password else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{creds}{host}:{self.port}/{self.db}"

    def __str__(self) -> str:
        return self.safe_url()

    def secrets(self) -> list[str]:
        """The credential values (to scrub from any text that might echo them)."""
        return [s for s in (self.password, self.username) if s]


def _port(text: str, where: str) -> int:
    """A TCP port from text; ValueError naming `where` (never echoing the text)."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"{where}: the port must be a number in 1..65535")
    return int(text)


def _split(url: str) -> tuple[bool, str | None, int | None, int | None, str | None, str | None]:
    """(tls, host, port, db, username, password) of the URL, None for absent parts."""
    if not isinstance(url, str):
        raise ValueError("--l2-redis must be a redis:// or rediss:// URL")
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError("--l2-redis must be a redis:// or rediss:// URL (unknown scheme)")
    tls = SCHEMES[scheme.lower()]
    try:
        parts = urlsplit(url)
    except ValueError:  # the library's text may quote the URL (and so a password)
        # Which bad [IPv6] hosts urlsplit refuses varies between Python releases; the
        # check below names the rest, so name these the same way.
        authority = url.partition("://")[2].partition("/")[0]
        detail = " (bad [IPv6] host)" if "[" in authority or "]" in authority else ""
        raise ValueError(f"--l2-redis is not a well-formed URL{detail}") from None
    if parts.query or parts.fragment:
        raise ValueError(
            "--l2-redis: query parameters and fragments are not supported "
            "(URL-encode '?', '#' and '/' in a password)"
        )
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) or None if colon else None
    host: str | None
    port: int | None = None
    if hostport.startswith("["):  # [IPv6]:port
        inner, bracket, tail = hostport[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise ValueError("--l2-redis is not a well-formed URL (bad [IPv6] host)")
        host, port_text = unquote(inner) or None, tail[1:]  # a zone is %25-encoded
    else:
        host_text, _, port_text = hostport.partition(":")
        host = unquote(host_text) or None
    if port_text:
        port = _port(port_text, "--l2-redis")
    path = parts.path.strip("/")
    db = None
    if path:
        if not path.isdigit():
            raise ValueError("--l2-redis: the path must be a database number, like /0")
        db = int(path)
    return tls, host, port, db, username, password


def resolve_target(
    url: str,
    *,
    username: str | None = None,
    password: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> RedisTarget:
    """The Redis endpoint and credentials `url`, the flags and the environment name.

    `username`/`password` are the flag or config values (they win); `environ` defaults
    to os.environ, read now. Empty strings count as not given. ValueError names the flag
    or variable at fault and never contains a credential.
    """
    env = os.environ if environ is None else environ
    tls, url_host, url_port, url_db, url_user, url_password = _split(url)
    sources: dict[str, str] = {}

    def pick(name: str, *candidates: tuple[str | None, str]) -> str | None:
        for value, source in candidates:
            if value:
                sources[name] = source
                return value
        sources[name] = DEFAULT_SOURCE
        return None

    user = pick(
        "username", (username, USERNAME_FLAG), (url_user, URL_SOURCE), (env.get(ENV_USERNAME), ENV_USERNAME)
    )  # fmt: skip
    secret = pick(
        "password", (password, PASSWORD_FLAG), (url_password, URL_SOURCE), (env.get(ENV_PASSWORD), ENV_PASSWORD)
    )  # fmt: skip
    host = pick("host", (url_host, URL_SOURCE), (env.get(ENV_HOST), ENV_HOST)) or DEFAULT_HOST
    if url_port is not None:
        port, sources["port"] = url_port, URL_SOURCE
    elif env.get(ENV_PORT):
        port, sources["port"] = _port(env[ENV_PORT].strip(), ENV_PORT), ENV_PORT
    else:
        port, sources["port"] = DEFAULT_PORT, DEFAULT_SOURCE
    sources["db"] = DEFAULT_SOURCE if url_db is None else URL_SOURCE
    ca = pick("ca_certs", (env.get(ENV_CA), ENV_CA)) if tls else None
    return RedisTarget(
        host=host,
        port=port,
        db=url_db or 0,
        tls=tls,
        username=user,
        password=secret,
        ca_certs=ca,
        sources=sources,
    )
