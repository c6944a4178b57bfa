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
optimizer, row_width; carried forward through a chain), per-file size and a chunk
index (and a sha256 per file in formats 1-2), per-(writer, table) sequence watermarks, the caller's opaque ``extra``
(the AIMaster's data-shard queues, dense variable info), and a sha256 over its own
canonical JSON, so a bit flip in the manifest itself (e.g. in a learning rate) is
caught as well, not just unparseable JSON.

Data files are a sequence of chunks (see :mod:`checkpoint.format`): a header (magic,
version, kind rows|tombstones|array, table name, num_slots, slot range, n, row_width,
raw and stored length, crc32 of the stored bytes, crc32 of the header) and the payload
``keys int64 LE || rows float32 LE [n, row_width + 1]`` (value + optimizer slots,
exactly the arena row, then the row's update count; format 2, marked ``"counts": true``
in the manifest's table info. Format-1 checkpoints, without the count column, are still
read). The payload is one zstd frame (with its own xxh64 content checksum) where zstd
pays -- the writer compresses a sample of a chunk (1/16) and compresses the chunk
only if the sample shrank by >= 25%; once four chunks of a file agree, only one chunk in
eight is probed and the others follow it -- and is stored as is otherwise (header flag RAW,
format 3): trained float rows shrink by ~10% at zstd level 1 for about five times the
write time, while constant slots, zeros or sequential ids shrink far more and compress at
GB/s. An END chunk closes each file. Format 3 drops the per-file sha256: the chunk index
tiles the file, and the header and payload crc32s cover every byte of it. Format 4
(written now) lays a rows chunk out in the store's own columns, ``keys int64 || rows
float32 [n, row_width] || counts uint32 [n]`` (header flag COUNTS), and checksums
payloads with crc32c (hardware, through the C library google-crc32c ships): a restore
into a new table reserves its arena rows and the reader threads ``preadv`` each stored
chunk straight into the row -> key array, the arena and the count column, taking the
crc32c there; no read buffer, no copy, and the first touch of the new arena off the
main thread. Formats 1, 2 and 3
are still read and verified (sha256 included for 1-2); their chunks are decoded and
copied into the reserved rows.

Keyed by slot
-------------
Each chunk records the inclusive range of the routing slots
(``deeprec_ext.hashing.slot_of``) of its keys, in the header and in the manifest's chunk
index (readers take any chunk size). A full checkpoint (format 3) deals its rows into 16
contiguous slot ranges and writes a range's rows as a chunk of ~1 MB once it has that
many, so its chunks each lie within one range (sorted by slot piecewise); an incremental,
and formats 1-2, sort the rows by slot before chunking. A restore with a slot mask
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
table. A full checkpoint scans the arena in row order (``EmbeddingTable.scan_live``:
16k rows per lock hold, one sequential copy, nothing hashed under the lock), sorts each
slice by slot outside the lock and deals it into the 16 slot ranges; no global sort and
no random gather over the table. An incremental reads a plan of the changed rows from
the change log, sorted by slot (``EmbeddingTable.plan_export``: 8 bytes per row), then
the rows (``gather_planned``, 8k rows per lock hold, each row's sequence number checked
there against ``since_seq``; between holds the CPU is given away only when a lookup
or push waits for the table lock). Chunks that pay are compressed
on a small thread pool while the next is read; one I/O thread per file checksums the
stored ones and writes every chunk, in order, with one writev each, beside the thread
that scans and sorts; the disk write-back starts every 32 MB (``sync_file_range``) so that the
closing fsync overlaps the export. Peak extra memory is the pending chunks and the
slices they come from (tens of MB), and lookups and pushes are served between the lock
holds. A row rewritten after it was read is in the checkpoint with its older value and
in the next incremental with its newer; a row deleted before it was read is skipped:
both changes are after the cut. (A key deleted and re-created at a later row while the
scan runs may be written twice; the later copy, written later, wins on restore.) The
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

Saved index
-----------
A full checkpoint of a whole table (no slot mask, format 4) also writes
``<writer>.<table>.index``: the table's hash index (``HashIndex``'s own int32 table, one
code per position: 0 empty, -1 deleted, ``i + 1`` for row ``i`` of the rows file),
translated from arena rows to file rows at the end of the scan, and named in the rows
file's manifest entry as ``index`` = {path, capacity, rows, size, crc32c, probe_seed}.
It is written only if the index's ``layout`` count held from before the scan to after
the translation (no position removed, moved or re-assigned: no key scanned twice, no
probe chain broken); positions of keys inserted meanwhile whose rows were not written
are saved as deleted ones. A restore of that whole table from that one file into an
empty table commits all its rows at once and installs the index
(``EmbeddingTable.commit_load(saved_index=...)``, ``HashIndex.install_table``) once
1,024 sampled keys are found at their rows; anything else (missing, corrupt, another
probe seed, a failed sample) places the keys as below, with a warning. Not part of the
checksummed file set a checkpoint needs: a checkpoint without it is complete.

Restore applies, for each checkpoint of the chain in order: dropped tables, then
tombstones (all writers), then rows. A key deleted and re-inserted between two
checkpoints is therefore present. Tables are created from the manifest configs.
Restore writes rows with ``load_rows`` (``import_rows`` without the finiteness pass, for
checksummed rows: bit-exact value + optimizer slots + count), 64k rows per call, the
chunks of a call copied into the arena as they were read; into an empty table the rows
go to consecutive arena rows and their keys are placed in bulk (``HashIndex.place_rows``:
a key loaded twice keeps its later copy), into a table with rows each key is found or
placed in one probing pass and overwritten in place. Deletes use ``log_tombstone=False``. Afterwards ``RestoreInfo.sequence`` is the
store's counter, the ``since_seq`` for an incremental on top of the restored
checkpoint (or write a new full one).

Verification and fallback
-------------------------
``list_chains``/``verify``/``python -m checkpoint inspect`` read every byte: manifest
checksum, file size, sha256 of each file (formats 1-2), header crc, payload crc32, zstd
content checksum, slot ranges, finiteness, END chunk. ``restore`` checks, before it applies
anything, the manifests and file sizes of all checkpoints (a truncated file is
caught here) and then the header and crc32 of every chunk it is about to read
(``verify="full"``: every byte of the chain). It never checks the chunks it will not
read, because a PS restoring 1/N of the slots should not read the whole checkpoint.
A checkpoint that fails is skipped with a ``logging.warning`` naming the file and
the problem, and the newest remaining restorable checkpoint is used (its chain
possibly ends earlier). Wrong values are never loaded. While applying, each chunk is
re-read, its crc32 re-checked, and its zstd content checksum verified on
decompression. Into a store whose tables of the chain are all new or empty (job start,
warm start) the first pass is skipped: each chunk is read once and checked as it is
applied, and a failed check drops (or empties) those tables before the next
restorable checkpoint is tried -- the same outcome, one read of each byte instead of
two. Several PS restoring one job must agree on the checkpoint, so a
coordinator picks it (``list_chains``) and passes ``upto=id, exact=True``.

Retention
---------
``apply_retention(root, keep_chains)`` keeps the newest ``keep_chains`` restorable
chains and everything newer than their oldest full. By default (``verify="new"``) it
checks every manifest and file size but reads only the newest checkpoint's chunks
(header + crc32): the one just committed (under 64 MB, e.g. an incremental, on the
calling thread; larger ones on a small pool). Manifests are parsed and checked once per
process while their file is unchanged (``load_manifest(cached=True)``: same device,
inode, size and times, and older than a second). Before it deletes anything it also
reads the chunks of the chains it keeps (once per new chain), so a checkpoint that
rotted after its commit never costs the chain that would replace it. Incomplete or corrupt checkpoints
in that range are left alone: one may still be in the middle of being written. A
directory is renamed away before ``rmtree``, so a reader never sees half of one.

Object stores
-------------
``root`` may be a URL (``s3://bucket/prefix``, ``gs://...``) everywhere a root is taken:
files are staged locally and uploaded, the manifest object is PUT last (a checkpoint
exists exactly when it does), and readers mirror the committed checkpoints into a local
cache and read them as above. See :mod:`checkpoint.remote`.

Choices that differ from the issue's sketch
-------------------------------------------
* Checksum: crc32c per chunk payload (format 4; ~12 GB/s here, GIL released; zlib's
  crc32 in formats 1-3, ~4 GB/s), zlib's crc32 per header, plus zstd's xxh64 content
  checksum for compressed chunks, plus sha256 per manifest (and per file in formats
  1-2). There is no separate xxhash dependency.
* zstd level 1 where it pays, stored otherwise: float rows compress by only ~10% at any
  level (level 1: ~300 MB/s per core; level 3 about 2x slower; negative levels gain
  nothing on them). A byte-shuffle filter gained ~9% more but halved throughput in numpy.
* Chunk slot ranges, not a per-row slot column: the slot is derivable, and a column
  would add 2-4 bytes per row.
* Encoding runs on a thread pool (zstd and crc32 release the GIL), pipelined with
  the file writes (``min(4, cpu count)`` threads). Restore decompresses ahead on a pool too.
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

    from checkpoint import remote
    from checkpoint.format import DIR_RE
    if remote.is_remote(str(root)):  # incomplete ones too: an id is never reused
        return max((int(DIR_RE.match(n).group(1)) for n in remote.listing(str(root))),
                   default=0) + 1
    root = Path(root)
    if not root.is_dir():
        return 1
    ids = [int(m.group(1)) for p in root.iterdir() if (m := DIR_RE.match(p.name))]
    return max(ids, default=0) + 1
