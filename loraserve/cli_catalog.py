"""`loraserve export` and `loraserve catalog ...`: argparse wiring over the `catalog` package.

`add_subcommands(subparsers)` registers them on the main parser; each sets `func(args) -> int`
(exit code). Errors are raised and reported by the caller as one line on stderr; `run(argv)`
does the same for these commands alone.
"""
from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

from loraserve.catalog.dtypes import SERVING_DTYPES


_MODEL_HELP = "base model directory (HF layout) or a .gguf file"


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register `export` and `catalog` (with its own subcommands) on `sub`."""
    p = sub.add_parser("export", help="export a PEFT LoRA directory to a serving-layout blob")
    p.add_argument("peft_dir")
    p.add_argument("--model", required=True, help="base model directory the adapter was trained on, "
                   "or a .gguf file")
    p.add_argument("--out", required=True, help="output FILE.safetensors")
    p.add_argument("--dtype", default=None, choices=SERVING_DTYPES, help="default: the base's")
    p.set_defaults(func=cmd_export)
    cat = sub.add_parser("catalog", help="manage an adapter catalog (init, import, materialize, audit, ...)")
    csub = cat.add_subparsers(dest="catalog_command", required=True, metavar="SUBCOMMAND")
    for add in (_add_init, _add_import, _add_materialize, _add_audit, _add_show, _add_list, _add_stats,
                _add_promote, _add_rollback, _add_tag, _add_delete, _add_gc, _add_publish, _add_compact_log,
                _add_store_gc):
        add(csub)


def _add_init(csub) -> None:
    p = csub.add_parser("init", help="create a catalog directory (idempotent)")
    p.add_argument("dir")
    p.add_argument("--shards", type=int, default=100)
    p.set_defaults(func=cmd_init)


def _add_import(csub) -> None:
    p = csub.add_parser("import", help="import a PEFT directory (or exported blob) as a new revision")
    p.add_argument("dir")
    p.add_argument("adapter_id")
    p.add_argument("peft_dir")
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    p.add_argument("--revision", default=None)
    p.add_argument("--promote", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", default=None, choices=SERVING_DTYPES)
    p.add_argument("--alias", action="append", default=[], metavar="URI",
                   help="another name of the imported revision, e.g. the tinker://<run-id>/"
                        "sampler_weights/<checkpoint> MinT exported it as (repeatable)")
    _store_option(p)
    p.set_defaults(func=cmd_import)


def _add_materialize(csub) -> None:
    p = csub.add_parser("materialize", help="build N synthetic adapter revisions (resumable)")
    p.add_argument("dir")
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--prefix", default="synth/a")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, choices=SERVING_DTYPES)
    p.add_argument("--shards", type=int, default=100, help="shard count if DIR is not a catalog yet")
    p.add_argument("--batch", type=int, default=1000, help="adapters per LMDB transaction")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--store", metavar="s3://BUCKET/PREFIX",
                   help="also publish every batch into this durable tier as it is committed (a "
                        "segment per batch and worker; resumable like the build)")
    p.add_argument("--store-only", action="store_true",
                   help="with --store: build into the store alone, keeping nothing in the local catalog "
                        "(its disk stays bounded; resumable by the markers in DIR/store-published)")
    p.set_defaults(func=cmd_materialize)


def _add_audit(csub) -> None:
    p = csub.add_parser("audit", help="verify a sample of adapters over every shard against the base")
    p.add_argument("dir")
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    p.add_argument("--sample", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_audit)


def _add_show(csub) -> None:
    p = csub.add_parser("show", help="print an adapter's policy record (and a revision's record)")
    p.add_argument("dir")
    p.add_argument("ref", help="tenant/name or tenant/name@rev")
    p.set_defaults(func=cmd_show)


def _add_list(csub) -> None:
    p = csub.add_parser("list", help="list adapter ids by prefix")
    p.add_argument("dir")
    p.add_argument("--prefix", default="")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--after", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)


def _add_stats(csub) -> None:
    p = csub.add_parser("stats", help="adapter / revision / byte counts, per shard with --per-shard")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true")
    p.add_argument("--per-shard", action="store_true")
    p.set_defaults(func=cmd_stats)


def _add_promote(csub) -> None:
    p = csub.add_parser("promote", help="promote a revision (or tag) of an adapter")
    p.add_argument("dir")
    p.add_argument("adapter_id")
    p.add_argument("revision")
    _store_option(p)
    p.set_defaults(func=cmd_promote)


def _add_rollback(csub) -> None:
    p = csub.add_parser("rollback", help="promote the previously promoted revision again")
    p.add_argument("dir")
    p.add_argument("adapter_id")
    _store_option(p)
    p.set_defaults(func=cmd_rollback)


def _add_tag(csub) -> None:
    p = csub.add_parser("tag", help="point a tag at a revision")
    p.add_argument("dir")
    p.add_argument("adapter_id")
    p.add_argument("tag")
    p.add_argument("revision")
    _store_option(p)
    p.set_defaults(func=cmd_tag)


def _add_delete(csub) -> None:
    p = csub.add_parser("delete", help="delete an adapter, or one revision of it (404 at once "
                                       "everywhere; `catalog gc` frees the space)")
    p.add_argument("dir")
    p.add_argument("ref", help="tenant/name (every revision) or tenant/name@rev (a revision or tag)")
    p.add_argument("--force", action="store_true",
                   help="delete the promoted revision too (the adapter is left with none promoted)")
    p.add_argument("--audit-log", metavar="FILE", help="append the action here (JSON lines)")
    _store_option(p)
    p.set_defaults(func=cmd_delete)


def _add_gc(csub) -> None:
    p = csub.add_parser("gc", help="delete the blobs of deleted revisions (LMDB reuses the pages)")
    p.add_argument("dir")
    p.add_argument("--min-age", type=float, default=60.0, metavar="S",
                   help="only blobs of revisions deleted at least S seconds ago, so requests that "
                        "resolved them just before the delete still read them (default: 60)")
    p.add_argument("--audit-log", metavar="FILE", help="append the action here (JSON lines)")
    p.set_defaults(func=cmd_gc)


def _store_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", metavar="s3://BUCKET/PREFIX",
                   help="also publish the write to this durable tier (serve --catalog-store), so "
                        "the servers caching it see it")


@contextmanager
def _writing(args):
    """The catalog at `args.dir`; with `--store`, what it commits is also published there."""
    from loraserve.catalog.store import Catalog

    with Catalog.open(args.dir) as cat:
        if not args.store:
            yield cat
            return
        from loraserve.catalog.errors import AdapterNotFound, RevisionNotFound
        from loraserve.catalog.store_s3 import ObjectStore, StoreTier, parse_store_uri
        tier = StoreTier(ObjectStore(parse_store_uri(args.store)[0]), cat)
        try:
            if getattr(args, "adapter_id", None):  # the store's state first: a new revision is numbered after its
                try:
                    tier.fault_in(args.adapter_id)
                except (AdapterNotFound, RevisionNotFound):
                    pass
            yield cat
        finally:
            tier.close()


def _add_publish(csub) -> None:
    p = csub.add_parser("publish", help="publish every adapter into a durable tier (serve --catalog-store); "
                                        "resumable: what the store holds already is skipped")
    p.add_argument("dir")
    p.add_argument("--store", required=True, metavar="s3://BUCKET/PREFIX",
                   help="the store (boto3: AWS_ENDPOINT_URL and the standard AWS credentials)")
    p.add_argument("--workers", type=int, default=8, help="adapters published at once (default: 8)")
    p.add_argument("--after", metavar="ID", help="start past this adapter id (default: the first)")
    p.set_defaults(func=cmd_publish)


def _add_compact_log(csub) -> None:
    p = csub.add_parser("compact-log", help="fold a durable tier's old change-log entries into its "
                                            "snapshot (holding the store's maintenance lease)")
    p.add_argument("--store", required=True, metavar="s3://BUCKET/PREFIX")
    p.add_argument("--keep-s", type=float, default=3600.0, metavar="S",
                   help="keep the entries of the last S seconds as entries (default: 3600)")
    p.add_argument("--horizon-s", type=float, default=7 * 86400.0, metavar="S",
                   help="the snapshot names the adapters changed in the last S seconds; a host "
                        "away longer re-checks every adapter it holds (default: 7 days)")
    p.set_defaults(func=cmd_compact_log)


def _add_store_gc(csub) -> None:
    from loraserve.catalog.store_gc import MIN_AGE_FLOOR_S
    p = csub.add_parser("store-gc", help="delete a durable tier's blobs, segments and records that no live "
                                         "revision names (catalog/store_gc.py)")
    p.add_argument("--store", required=True, metavar="s3://BUCKET/PREFIX")
    p.add_argument("--min-age", type=float, default=86400.0, metavar="S",
                   help="only objects written at least S seconds before the GC starts, so a publish "
                        f"racing it loses nothing (default: 86400; at least {MIN_AGE_FLOOR_S:g})")
    p.add_argument("--workers", type=int, default=8, help="policies and records read at once (default: 8)")
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted; delete nothing")
    p.set_defaults(func=cmd_store_gc)


# -- commands -------------------------------------------------------------------------------
def _base(model: str) -> str:
    """`--model`'s base directory: itself, or a .gguf file's converted one (model/gguf.py)."""
    from loraserve.model.gguf import resolve_base
    return str(resolve_base(model))


def cmd_export(args) -> int:
    from loraserve.catalog.base import BaseInfo
    from loraserve.catalog.importer import adapter_blob

    blob = adapter_blob(args.peft_dir, BaseInfo.from_dir(_base(args.model)), args.dtype)
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(blob)
    tmp.replace(out)
    print(f"wrote {out} ({len(blob)} bytes)")
    return 0


def cmd_init(args) -> int:
    from loraserve.catalog.store import Catalog

    with Catalog.create(args.dir, shards=args.shards) as cat:
        print(f"catalog {cat.path}: {cat.shards} shards")
    return 0


def cmd_import(args) -> int:
    from loraserve.catalog.importer import import_peft
    from loraserve.catalog.aliases import check_alias_free, record_alias

    with _writing(args) as cat:
        for alias in args.alias:  # a bad or taken alias stops the import before it writes
            check_alias_free(cat, alias, args.adapter_id)
        rec = import_peft(cat, args.adapter_id, args.peft_dir, _base(args.model), revision=args.revision,
                          promote=args.promote, dtype=args.dtype)
        for alias in args.alias:
            record_alias(cat, alias, rec.adapter_id, rec.revision)
    print(f"imported {rec.ref} ({rec.size} bytes, rank {rec.rank}, {','.join(rec.targets)})"
          + (" promoted" if args.promote else ""))
    for alias in args.alias:
        print(f"alias {alias} -> {rec.ref}")
    return 0


def cmd_materialize(args) -> int:
    from loraserve.catalog.materialize import MaterializeConfig, materialize
    from loraserve.catalog.store import Catalog
    from loraserve.catalog.store_objects import parse_store_uri

    if args.store_only and not args.store:
        print("--store-only needs --store s3://BUCKET/PREFIX", file=sys.stderr)
        return 2
    if not (Path(args.dir) / "catalog.json").exists():
        Catalog.create(args.dir, shards=args.shards).close()
    cfg = MaterializeConfig(args.dir, _base(args.model), args.count, rank=args.rank, targets=args.targets,
                            prefix=args.prefix, workers=args.workers, seed=args.seed, dtype=args.dtype,
                            batch=args.batch, progress=not args.no_progress,
                            store=parse_store_uri(args.store)[0] if args.store else None,
                            store_only=args.store_only)
    rep = materialize(cfg)
    published = f"; published {rep.published}, already in the store {rep.already}" if args.store else ""
    print(f"materialized {rep.written} new, {rep.skipped} already present, "
          f"{len(rep.errors)} build errors, {rep.seconds:.1f} s{published}")
    for e in rep.errors[:20]:
        print(f"  error: {e}", file=sys.stderr)
    if rep.failed_workers:
        print(f"{rep.failed_workers} worker(s) failed; rerun the same command to finish", file=sys.stderr)
    return 0 if rep.ok else 1


def cmd_audit(args) -> int:
    from loraserve.audit import run_audit

    rep = run_audit(args.dir, _base(args.model), sample=args.sample, seed=args.seed)
    if args.json:
        print(json.dumps({"shards": rep.shards, "shards_covered": rep.shards_covered, "audited": rep.audited,
                          "max_error": rep.max_error, "failures": rep.failures}))
    else:
        print("\n".join(rep.lines()))
    return 0 if rep.ok else 1


def cmd_show(args) -> int:
    from loraserve.catalog.ids import parse_model_ref
    from loraserve.catalog.store import Catalog

    adapter_id, rev = parse_model_ref(args.ref)
    with Catalog.open(args.dir, readonly=True) as cat:
        out = {"policy": cat.policy(adapter_id).to_dict()}
        if rev is not None or out["policy"]["promoted"] is not None:
            r = cat.resolve(adapter_id, rev)
            out["revision"] = {name: getattr(r, name) for name in r.__slots__}
    print(json.dumps(out, indent=2))
    return 0


def cmd_list(args) -> int:
    from loraserve.catalog.store import Catalog

    with Catalog.open(args.dir, readonly=True) as cat:
        rows = cat.list(args.prefix, limit=args.limit, after=args.after)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows]))
    for r in rows if not args.json else []:
        print(f"{r.adapter_id}\tpromoted={r.promoted}\trevisions={len(r.revisions)}\trank={r.rank}")
    return 0


def cmd_stats(args) -> int:
    from loraserve.catalog.store import Catalog

    with Catalog.open(args.dir, readonly=True) as cat:
        st = cat.stats()
    if not args.per_shard:
        st.pop("per_shard")
    if args.json:
        print(json.dumps(st))
        return 0
    for k in ("adapters", "revisions", "shards", "bytes", "disk_bytes"):
        print(f"{k}: {st[k]}")
    for row in st.get("per_shard", []):
        print(f"  shard-{row['shard']:03d} adapters={row['adapters']} revisions={row['revisions']} bytes={row['bytes']}")
    return 0


def _policy_line(p) -> str:
    return f"{p.adapter_id}: promoted={p.promoted} previous={p.previous} tags={p.tags}"


def cmd_promote(args) -> int:
    with _writing(args) as cat:
        print(_policy_line(cat.promote(args.adapter_id, args.revision)))
    return 0


def cmd_rollback(args) -> int:
    with _writing(args) as cat:
        print(_policy_line(cat.rollback(args.adapter_id)))
    return 0


def cmd_tag(args) -> int:
    with _writing(args) as cat:
        print(_policy_line(cat.tag(args.adapter_id, args.tag, args.revision)))
    return 0


def _audited(path: str | None, action: str, fn, adapter: str | None = None,
             revision: str | None = None):
    """`fn()`, its outcome appended to the audit log at `path` (when given) either way."""
    from loraserve.server.audit_log import FAILED, AuditLog

    audit = AuditLog(path) if path else None
    try:
        result = fn()
    except Exception as exc:
        if audit is not None:
            audit.record(key=None, action=action, adapter=adapter, revision=revision,
                         outcome=FAILED, status=getattr(exc, "status", 500), error=str(exc))
        raise
    if audit is not None:
        audit.record(key=None, action=action, adapter=adapter, revision=revision)
    return result


def cmd_delete(args) -> int:
    from loraserve.catalog.deletes import delete
    from loraserve.catalog.ids import parse_model_ref

    adapter_id, rev = parse_model_ref(args.ref)
    with _writing(args) as cat:
        done = _audited(args.audit_log, "delete",
                        lambda: delete(cat, adapter_id, rev, force=args.force), adapter_id, rev)
    left = "adapter removed" if done.policy is None else _policy_line(done.policy)
    print(f"deleted {', '.join(f'{adapter_id}@{r}' for r in done.revisions)} "
          f"({done.bytes} blob bytes, freed by `catalog gc`); {left}")
    return 0


def cmd_gc(args) -> int:
    from loraserve.catalog.deletes import collect_garbage
    from loraserve.catalog.store import Catalog

    with Catalog.open(args.dir) as cat:
        rep = _audited(args.audit_log, "gc", lambda: collect_garbage(cat, args.min_age))
    print(f"blobs deleted: {rep.blobs_deleted} ({rep.bytes_freed} bytes, pages reused by the "
          f"next writes); pending (deleted < {args.min_age:g} s ago): {rep.blobs_pending}")
    return 0


def cmd_publish(args) -> int:
    from loraserve.catalog.store import Catalog
    from loraserve.catalog.store_bulk import publish_catalog
    from loraserve.catalog.store_s3 import ObjectStore, StoreTier, parse_store_uri

    if args.workers < 1:
        raise ValueError("--workers must be >= 1")
    with Catalog.open(args.dir) as cat:
        tier = StoreTier(ObjectStore(parse_store_uri(args.store)[0], max_pool=max(10, args.workers)), cat)
        try:
            rep = publish_catalog(cat, tier, workers=args.workers, after=args.after,
                                  progress=sys.stderr.isatty())
        finally:
            tier.close()
    print(f"adapters: {rep.adapters}, published: {rep.published}, already in the store: "
          f"{rep.adapters - rep.published}; last: {rep.last}")
    return 0


def cmd_compact_log(args) -> int:
    from loraserve.catalog.store_lease import maintenance
    from loraserve.catalog.store_log import compact
    from loraserve.catalog.store_s3 import ObjectStore, parse_store_uri

    if args.keep_s < 0 or args.horizon_s < args.keep_s:
        raise ValueError("--keep-s must be >= 0 and --horizon-s >= --keep-s")
    store = ObjectStore(parse_store_uri(args.store)[0])
    with maintenance(store, "compact-log") as lease:
        pruned = compact(store, keep_s=args.keep_s, horizon_s=args.horizon_s, lease=lease)
    print(f"change-log entries folded into the snapshot: {pruned}")
    return 0


def cmd_store_gc(args) -> int:
    from loraserve.catalog.store_gc import MIN_AGE_FLOOR_S, collect
    from loraserve.catalog.store_lease import maintenance
    from loraserve.catalog.store_s3 import ObjectStore, parse_store_uri

    if args.min_age < MIN_AGE_FLOOR_S or args.workers < 1:
        raise ValueError(f"--min-age must be >= {MIN_AGE_FLOOR_S:g} (longer than any publish, plus the "
                         f"clock skew between hosts and the store) and --workers >= 1")
    store = ObjectStore(parse_store_uri(args.store)[0], max_pool=max(10, args.workers))
    with maintenance(store, "store-gc") as lease:
        rep = collect(store, min_age_s=args.min_age, workers=args.workers, dry_run=args.dry_run, lease=lease)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"live: {rep.policies} adapters, {rep.live_revisions} revisions; {verb}: "
          + ", ".join(f"{n} {kind}" for kind, n in rep.deleted.items())
          + f" ({rep.bytes_freed} bytes); pending (written < {args.min_age:g} s ago): {rep.pending}; "
          f"dead bytes in segments kept for a live revision: {rep.dead_in_live_segments}; mostly dead "
          f"segments {'to rewrite' if args.dry_run else 'rewritten'}: {rep.rewritten} "
          f"({rep.rewritten_bytes} live bytes copied)")
    return 0


def run(argv: list[str]) -> int:
    """Run one `export` / `catalog ...` command line; errors -> one line on stderr, exit 1."""
    parser = argparse.ArgumentParser(prog="loraserve")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the CLI contract is one line
        print(f"loraserve {args.command}: error: {exc}", file=sys.stderr)
        return 1
