"""loraserve's adapter catalog: sharded LMDB store, blob format, PEFT exporter, bulk materializer.

Modules (none imports `loraserve`):
    errors      CatalogError and its subclasses, each with an HTTP `.status`
    ids         adapter id / model reference validation
    records     PolicyRecord, RevisionRecord (JSON in LMDB)
    format      blob format constants, header parsing, checksum (torch-free)
    layout      AdapterWeights, save_revision, load_revision
    base        BaseInfo.from_dir, base_fingerprint (basefp re-exports it)
    shards      one LMDB env per shard, map growth
    store       Catalog
    export      PEFT dir -> AdapterWeights; importer puts it into a Catalog
    materialize bulk synthetic revisions (worker processes own shards)
This package import is light on purpose: import the submodule you need.
"""
