"""loraserve's adapter catalog: sharded LMDB store, blob format, PEFT exporter, bulk materializer.

Modules (none imports `loraserve` outside this package):
    targets     the one table of LoRA target kinds, module paths and blob tensor names (torch-free)
    dtypes      the one table of dtype names and safetensors codes (torch-free)
    safetensors_header  the one safetensors header reader, blobs and files (torch-free)
    checkpoint  the one index of a Hugging Face checkpoint directory (torch-free)
    errors      CatalogError and its subclasses, each with an HTTP `.status`
    ids         adapter id / model reference validation
    records     PolicyRecord, RevisionRecord (JSON in LMDB)
    format      blob format constants, metadata, checksum (torch-free)
    layout      AdapterWeights, save_revision, load_revision
    base        BaseInfo.from_dir, base_fingerprint (torch-free)
    baseweights one base weight as a torch tensor (the audit's reference)
    shardfile   checks of a shard's data file that never fault on a missing page (truncation)
    shards      one LMDB env per shard, map growth (MapLock), ShardUnavailable for damaged/missing files
    store       Catalog
    shardhost   shard host processes: a group of shards mapped outside the serving process
    isolated    IsolatedCatalog (open_for_serving): Catalog's API, no shard mapped in-process
    source      an adapter directory read confined to a root, non-blocking, size-bounded
    aliases     other names (URIs, e.g. MinT's tinker:// checkpoint names) of revisions
    tombstones  ids of deleted revisions (never reused) and when they were deleted
    deletes     delete an adapter or revision (records at once), gc their blobs
    export      PEFT dir -> AdapterWeights; importer puts it into a Catalog
    materialize bulk synthetic revisions (worker processes own shards)
This package import is light on purpose: import the submodule you need.
"""
