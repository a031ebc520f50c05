"""`loraserve keys create | list | revoke | rotate`: the keys file of `serve --keys`.

A key is printed once, on stdout, and stored nowhere: the file gets its SHA-256 only (see
loraserve/keys.py for the format). A running server picks every change up on SIGHUP or
`POST /admin/reload-keys`: a revoked or rotated-away key gets 401 from then on (requests it
started before run to their end).
"""
from __future__ import annotations

import argparse
import json
import secrets
import sys

from loraserve.keys import (ALL_TENANTS, KEY_PREFIX, KeyEntry, Limits, Principal, append_key, load_keys,
                            revoke_key, rotate_key)


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Register `keys` (create, list, revoke, rotate) on the main parser's subcommands."""
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
    p.add_argument("--prefix", default=KEY_PREFIX,
                   help="the key's prefix: tml- and up to 12 more characters (default: tml-); "
                        "every key starts with tml-, which the Tinker and MinT SDKs take")
    p.add_argument("--id", help="the key's id in the file and the audit log "
                                "(default: the first tenant and a random suffix)")
    p.set_defaults(func=cmd_create)
    _add_maintenance(ksub)


def _add_maintenance(ksub: argparse._SubParsersAction) -> None:
    p = ksub.add_parser("list", help="the keys of a file: id, role, tenants, limits (no secrets)")
    p.add_argument("--keys", required=True, metavar="FILE", help="the keys file")
    p.add_argument("--json", action="store_true", help="one JSON object per key, a line each")
    p.set_defaults(func=cmd_list)
    p = ksub.add_parser("revoke", help="remove a key from the file (401 from the server's next "
                                       "reload on)")
    p.add_argument("key_id")
    p.add_argument("--keys", required=True, metavar="FILE", help="the keys file")
    p.set_defaults(func=cmd_revoke)
    p = ksub.add_parser("rotate", help="give a key id a new key, print it once; the old key is "
                                       "refused from the server's next reload on")
    p.add_argument("key_id")
    p.add_argument("--keys", required=True, metavar="FILE", help="the keys file")
    p.add_argument("--prefix", default=KEY_PREFIX,
                   help="the new key's prefix: tml- and up to 12 more characters (default: tml-)")
    p.set_defaults(func=cmd_rotate)


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


def key_row(entry: KeyEntry) -> dict:
    """What `keys list` shows of an entry: never the hash whole (8 hex digits name it)."""
    p = entry.principal
    row = {"id": p.key_id, "role": "admin" if p.admin else "user", "tenants": list(p.tenants),
           "load": p.load, "weight": p.weight, "sha256": entry.digest.hex()[:8]}
    row.update({name: getattr(p.limits, name) for name in
                ("max_concurrent", "requests_per_second", "tokens_per_minute")
                if getattr(p.limits, name) is not None})
    return row


def cmd_list(args: argparse.Namespace) -> int:
    for entry in load_keys(args.keys).entries:
        row = key_row(entry)
        if args.json:
            print(json.dumps(row))
            continue
        extra = " ".join(f"{k}={v}" for k, v in row.items()
                         if k not in ("id", "role", "tenants", "load", "weight", "sha256"))
        print(f"{row['id']}\t{row['role']}\ttenants={','.join(row['tenants'])}"
              f"\tload={str(row['load']).lower()}\tweight={row['weight']:g}"
              f"\tsha256={row['sha256']}" + (f"\t{extra}" if extra else ""))
    return 0


def _reload_hint(path: str) -> str:
    return (f"{path} written; a running server applies it on SIGHUP or "
            "POST /admin/reload-keys")


def cmd_revoke(args: argparse.Namespace) -> int:
    revoke_key(args.keys, args.key_id)
    print(f"revoked key {args.key_id!r}: {_reload_hint(args.keys)}", file=sys.stderr)
    return 0


def cmd_rotate(args: argparse.Namespace) -> int:
    key = rotate_key(args.keys, args.key_id, args.prefix)
    print(key)
    print(f"rotated key {args.key_id!r} (shown only this once): {_reload_hint(args.keys)}",
          file=sys.stderr)
    return 0
