"""On-disk checkpoints of the PS embedding store (numpy + zstandard, no TensorFlow).

Layout
------
::

    ROOT/ckpt-00000007-full/            one directory per checkpoint, id zero-padded
        ps-0.emb.rows                   one data file per (writer, table)
        ps-1.emb.rows                   (names %XX-escaped: "dense/w" -> "dense%2Fw")
        ps-0.dense%2Fkernel.rows
        dense.dense                     optional: named numpy arrays (write_dense)
        manifest.json                   written LAST: temp file + fsync + os.replace
    ROOT/ckpt-00000008-incr/            rows changed + keys deleted since the parent

A checkpoint exists only once its ``manifest.json`` does. The manifest holds id, kind,
parent id and the parent manifest's checksum (an incremental never attaches to a
rewritten parent), creation time, ``num_slots``, per-table config (dim, initializer,
optimizer, row_width; carried forward through a chain), per-file size, sha256 and a
chunk index, per-(writer, table) sequence watermarks, the caller's opaque ``extra``
(the AIMaster's data-shard queues, dense variable info), and a sha256 over its own
canonical JSON, so a bit flip in the manifest itself (e.g. in a learning rate) is
caught as well, not just unparseable JSON.

Data files are a sequence of chunks (see :mod:`checkpoint.format`): a header (magic,
version, kind rows|tombstones|array, table name, num_slots, slot range, n, row_width,
raw and compressed length, crc32 of the compressed bytes, crc32 of the header) and one
zstd frame of ``keys int64 LE || rows float32 LE [n, row_width + 1]`` (value + optimizer
slots, exactly the arena row, then the row's update count; format 2, marked ``"counts":
true`` in the manifest's table info. Format-1 checkpoints, without the count column,
are still read). zstd adds its own xxh64 content checksum, so corrupt
bytes are caught before and after decompression. An END chunk closes each file.

Keyed by slot
-------------
Rows are sorted by routing slot (``deeprec_ext.hashing.slot_of``) before chunking (~64k
rows or ~4 MB per chunk; readers take any chunk size), and each chunk records its inclusive
slot range, in the header and in the manifest's chunk index. A restore with a slot mask
(what one PS of a new layout owns) reads only chunks whose range intersects the mask,
and hashes keys only for chunks partly inside it. The AIMaster's routing gives each PS
contiguous slot ranges, so a PS of an N-PS job reads about 1/N of the bytes. That is how
a checkpoint written by M PS restores onto N PS. The slot is not stored per row: it is
recomputed from the key when needed (the key is the source of truth, and the slot
depends only on it and ``num_slots``).

Full and incremental
--------------------
``write_table`` reads the table's sequence counter (``cut_seq``) **before** exporting,
and, for incrementals, ``tombstones_since``. It then streams, holding no copy of the
table: a plan of the rows to write sorted by slot (``EmbeddingTable.plan_export``: 8
bytes per row, the table scanned in slices of 256k rows under short lock holds, or read
from its change log for an incremental), then chunk by chunk the rows themselves
(``gather_planned``, 8k rows per lock hold), compressed on a small thread pool while
the next chunk is read. Peak extra memory is the plan plus a few chunks (about 3% of a
4M-row Adagrad table), and lookups and pushes are served between the lock holds. A row
rewritten after the plan is written with its newer value; one deleted (or its row
reused by another slot's key) after it is skipped: both changes are after the cut. The
incremental of the next checkpoint uses ``since_seq = cut_seq``: rows written at or
before the cut are in this checkpoint or an earlier one of the chain; writes after it
may appear twice, harmlessly (upserts). Every step of an incremental (change log,
sort, gather, compress, checksum, write) is proportional to the changed rows.
``tombstones_since`` raises ``LogTrimmed`` when the table's tombstone log no longer
reaches back to ``since_seq`` (a consumer far behind, see ``deeprec_ext.store.table``):
then only a full checkpoint is exact.
``since_seq`` is required for incrementals and has no default from the parent's
watermark: after a restart or a restore the PS's sequence counter starts again, and
an old watermark would silently skip rows. ``write_table`` also rejects a
``since_seq`` that is ahead of the table's counter.

Restore applies, for each checkpoint of the chain in order: dropped tables, then
tombstones (all writers), then rows. A key deleted and re-inserted between two
checkpoints is therefore present. Tables are created from the manifest configs.
Restore writes rows with ``import_rows`` (bit-exact value + optimizer slots) and
deletes with ``log_tombstone=False``. Afterwards ``RestoreInfo.sequence`` is the
store's counter, the ``since_seq`` for an incremental on top of the restored
checkpoint (or write a new full one).

Verification and fallback
-------------------------
``list_chains``/``verify``/``python -m checkpoint inspect`` read every byte: manifest
checksum, file size, sha256 of each file, header crc, payload crc32, zstd content
checksum, slot ranges, finiteness, END chunk. ``restore`` checks, before it applies
anything, the manifests and file sizes of all checkpoints (a truncated file is
caught here) and then the header and crc32 of every chunk it is about to read
(``verify="full"``: every byte of the chain). It never checks the chunks it will not
read, because a PS restoring 1/N of the slots should not read the whole checkpoint.
A checkpoint that fails is skipped with a ``logging.warning`` naming the file and
the problem, and the newest remaining restorable checkpoint is used (its chain
possibly ends earlier). Wrong values are never loaded. While applying, each chunk is
re-read, its crc32 re-checked, and its zstd content checksum verified on
decompression. Several PS restoring one job must agree on the checkpoint, so a
coordinator picks it (``list_chains``) and passes ``upto=id, exact=True``.

Retention
---------
``apply_retention(root, keep_chains)`` keeps the newest ``keep_chains`` restorable
chains and everything newer than their oldest full. Incomplete or corrupt checkpoints
in that range are left alone: one may still be in the middle of being written. A
directory is renamed away before ``rmtree``, so a reader never sees half of one.

Choices that differ from the issue's sketch
-------------------------------------------
* Checksum: crc32 (``zlib``, >1 GB/s, stdlib) per chunk and header, plus zstd's
  xxh64 content checksum, plus sha256 per file and per manifest. There is no separate
  xxhash dependency.
* zstd level 1: float rows compress by only ~10% at any level, and level 3 is about
  2x slower. A byte-shuffle filter gained ~9% more but halved throughput in numpy.
* Chunk slot ranges, not a per-row slot column: the slot is derivable, and a column
  would add 2-4 bytes per row.
* Compression runs on a thread pool (zstd, crc32 and hashlib release the GIL),
  pipelined with the file writes. Restore decompresses ahead on a pool too.
* Each writer's table file is exported under short lock holds (slices). A checkpoint
  is therefore not a single point in time across tables or PS (the job trains
  asynchronously anyway), but the chain is exact per row up to each writer's cut.
* ``write_dense`` stores named numpy arrays for state that does not live on a PS.
  Dense *trainable* variables already live on the PS as ``dense/<path>`` tables, so
  ``write_table`` covers them.
"""
from checkpoint.format import CheckpointError, NoValidCheckpoint
from checkpoint.load import Loaded, Table, load
from checkpoint.reader import (Chain, Checkpoint, RestoreInfo, apply_retention, list_chains,
                               load_manifest, restore, scan, verify)
from checkpoint.writer import CheckpointCancelled, CheckpointWriter

__all__ = [
    "Chain",
    "Checkpoint",
    "CheckpointCancelled",
    "CheckpointError",
    "CheckpointWriter",
    "Loaded",
    "NoValidCheckpoint",
    "RestoreInfo",
    "apply_retention",
    "Table",
    "list_chains",
    "load",
    "load_manifest",
    "next_id",
    "restore",
    "scan",
    "verify",
]


def next_id(root) -> int:
    """1 + the largest checkpoint id under ``root`` (any state), 1 for an empty root."""
    from pathlib import Path

    from checkpoint.format import DIR_RE
    root = Path(root)
    if not root.is_dir():
        return 1
    ids = [int(m.group(1)) for p in root.iterdir() if (m := DIR_RE.match(p.name))]
    return max(ids, default=0) + 1
