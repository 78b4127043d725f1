"""The control endpoint's shared secret: a token file that the appliance and its clients read.

Every request to the appliance's control endpoint carries ``Authorization: Bearer <token>``
(RFC 6750, section 2.1), where ``<token>`` is the content of the token file. The file is
kept like an SSH private key: a regular file that only its owner may read or write (mode
0600). The appliance creates one when the file named does not exist yet; a file that group
or others can read or write, or that holds fewer than :data:`MIN_TOKEN_BYTES` bytes, is
refused with what to do about it.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import secrets
import stat
from pathlib import Path

from gradtap.core.errors import ConfigError

log = logging.getLogger(__name__)

MIN_TOKEN_BYTES = 16      # a guessable secret is none: 128 bits at least
MAX_TOKEN_FILE_BYTES = 4096
NEW_TOKEN_BYTES = 32      # secrets.token_urlsafe(32): 256 random bits, 43 characters
_TOKEN = re.compile(rb"[\x21-\x7e]+")    # printable ASCII without spaces: it travels in a header


def read_token(path: Path) -> bytes:
    """The token in the file at ``path`` (surrounding whitespace, e.g. a final newline, removed).

    Raises ``ConfigError`` naming the file and the fix when it is missing, not a regular
    file, readable or writable by group or others, too short, or not one printable word.
    """
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"control token file {path}: {exc.strerror.lower()}; the appliance creates it when it "
                          "starts (gradtap run --control-token-file), or write one with "
                          f"`python -c 'import secrets; print(secrets.token_urlsafe(32))' > {path}; "
                          f"chmod 600 {path}`") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"control token file {path}: not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(f"control token file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others "
                          f"read or replace the secret; run `chmod 600 {path}`")
    if st.st_size > MAX_TOKEN_FILE_BYTES:
        raise ConfigError(f"control token file {path}: {st.st_size} bytes; a token file holds one token "
                          f"(at most {MAX_TOKEN_FILE_BYTES} bytes)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"control token file {path}: cannot be read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        token = f.read(MAX_TOKEN_FILE_BYTES + 1).strip()
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(f"control token file {path}: the token has {len(token)} bytes, fewer than "
                          f"{MIN_TOKEN_BYTES}; write a longer one, e.g. "
                          f"`python -c 'import secrets; print(secrets.token_urlsafe(32))' > {path}`")
    if not _TOKEN.fullmatch(token):
        raise ConfigError(f"control token file {path}: the token must be one word of printable ASCII "
                          "(it is sent in an HTTP header)")
    return token


def ensure_token(path: Path) -> bytes:
    """The token in ``path``, after creating the file (mode 0600, a fresh
    ``secrets.token_urlsafe(32)``) if it does not exist. Its directory must exist."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return read_token(path)
    except OSError as exc:
        raise ConfigError(f"control token file {path}: cannot be created ({exc.strerror})") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(NEW_TOKEN_BYTES) + "\n")
        f.flush()
        os.fsync(f.fileno())
    log.info("control token written to %s (mode 0600): clients pass it with --token-file", path)
    return read_token(path)


def bearer_matches(header: str | None, token: bytes) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <token>`` (the scheme in any case,
    the token compared in constant time)."""
    if header is None:
        return False
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), token)
