"""`loraserve keys create`: make an API key and add its entry to a keys file.

The key is printed once, on stdout, and stored nowhere: the file gets its SHA-256 only (see
loraserve/keys.py for the format). A running server picks the new key up on SIGHUP or
`POST /admin/reload-keys`.
"""
from __future__ import annotations

import argparse
import secrets
import sys

from loraserve.keys import ALL_TENANTS, Limits, Principal, append_key


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Register `keys` (with `create`) on the main parser's subcommands."""
    keys = sub.add_parser("keys", help="manage API keys (a keys file for `serve --keys`)")
    ksub = keys.add_subparsers(dest="keys_command", required=True, metavar="SUBCOMMAND")
    p = ksub.add_parser("create", help="make a key, print it once, append its hash to the file")
    p.add_argument("--keys", required=True, metavar="FILE",
                   help="the keys file (TOML; created with mode 0600 if missing)")
    p.add_argument("--tenant", action="append", default=[], metavar="T",
                   help="a tenant the key may use (repeatable; \"*\" = all); a user key needs one")
    p.add_argument("--admin", action="store_true", help="an admin key (may do everything)")
    p.add_argument("--load", action="store_true",
                   help="may load, unload, promote and roll back adapters in its tenants")
    p.add_argument("--weight", type=float, default=1.0, help="fair-share weight (default: 1)")
    p.add_argument("--max-concurrent", type=int, metavar="N", help="sequences in flight per tenant")
    p.add_argument("--requests-per-second", type=float, metavar="R", help="per tenant")
    p.add_argument("--tokens-per-minute", type=int, metavar="T",
                   help="prompt + max_tokens per minute, per tenant")
    p.add_argument("--prefix", default="ls-",
                   help="the key's prefix (default: ls-); the Tinker/MinT SDK takes sk- or tml- keys")
    p.add_argument("--id", help="the key's id in the file and the audit log "
                                "(default: the first tenant and a random suffix)")
    p.set_defaults(func=cmd_create)


def principal_from(args: argparse.Namespace) -> Principal:
    """The principal a `keys create` command line describes (ValueError if it is invalid)."""
    tenants = tuple(args.tenant) or ((ALL_TENANTS,) if args.admin else ())
    if not tenants:
        raise ValueError("a user key needs --tenant (repeatable), or pass --admin")
    first = "admin" if tenants[0] == ALL_TENANTS else tenants[0]
    key_id = args.id or f"{first}-{secrets.token_hex(4)}"
    limits = Limits(max_concurrent=args.max_concurrent,
                    requests_per_second=args.requests_per_second,
                    tokens_per_minute=args.tokens_per_minute)
    return Principal(key_id=key_id, admin=args.admin, tenants=tenants, load=args.load,
                     weight=args.weight, limits=limits)


def cmd_create(args: argparse.Namespace) -> int:
    principal = principal_from(args)
    key = append_key(args.keys, principal, args.prefix)
    print(key)
    role = "admin" if principal.admin else "user"
    print(f"added key {principal.key_id!r} ({role}, tenants {', '.join(principal.tenants)}) to "
          f"{args.keys}; it is shown only this once", file=sys.stderr)
    return 0
