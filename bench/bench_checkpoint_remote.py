"""Checkpoints on S3 against the same on local disk, in one run (issue 18, item 3).

    .venv/bin/python bench/bench_checkpoint_remote.py      # ROWS=500000 by default

A moto S3 server on a free 127.0.0.1 port in this process (a Python server: a real S3 or
MinIO is faster), one table of ROWS rows, dim 16, Adagrad. Per round: a full checkpoint
written + committed to a local root and to s3:// (staged, uploaded, manifest last), the
retention pass after each (for S3 it mirrors the new checkpoint), then a restore of the
whole table from local disk, from S3 with an empty cache, and from S3 again (cache warm:
only the listing). Compare ratios of one round; the machine is shared.
"""
import logging
import os
import shutil
import socket
import tempfile
import time

import numpy as np
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
sock=socket.socket(); sock.bind(("127.0.0.1",0)); port=sock.getsockname()[1]; sock.close()
srv=ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False); srv.start()
os.environ.update(AWS_ACCESS_KEY_ID="t",AWS_SECRET_ACCESS_KEY="t",AWS_DEFAULT_REGION="us-east-1",AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
tmp = tempfile.mkdtemp()
os.environ["DEEPREC_CHECKPOINT_CACHE"]=tmp+"/cache"
from deeprec_ext.data import fs
from deeprec_ext.store import EmbeddingStore
from checkpoint import CheckpointWriter, restore, apply_retention
fs.filesystem("s3://bench")[0].mkdir("bench")
N=int(os.environ.get("ROWS","500000"))
s=EmbeddingStore(); t=s.create_table("emb",16,optimizer={"name":"adagrad","learning_rate":0.05})
rng=np.random.default_rng(0); k=np.arange(N,dtype=np.int64)
t.apply_gradients(k, rng.normal(0,0.1,(N,16)).astype(np.float32))
def w(root, i):
    t0=time.perf_counter(); wr=CheckpointWriter(root,i,"full",num_slots=4096); wr.write_table("ps-0",t); wr.commit(); t1=time.perf_counter()
    apply_retention(root, 5); return t1-t0, time.perf_counter()-t1
def r(root):
    t0=time.perf_counter(); st=EmbeddingStore(); info=restore(root, st); assert len(st["emb"])==N; return time.perf_counter()-t0
for rep in range(2):
    lw=w(tmp+"/local", rep+1); sw=w("s3://bench/ck", rep+1)
    shutil.rmtree(tmp+"/cache", ignore_errors=True)
    lr=r(tmp+"/local"); cold=r("s3://bench/ck"); warm=r("s3://bench/ck")
    print(f"rep {rep}: write+commit local {lw[0]*1e3:.0f} ms, s3 {sw[0]*1e3:.0f} ms; retention local {lw[1]*1e3:.0f} ms, s3 {sw[1]*1e3:.0f} ms (downloads the new one); restore local {lr*1e3:.0f} ms, s3 cold cache {cold*1e3:.0f} ms, s3 warm cache {warm*1e3:.0f} ms", flush=True)
srv.stop(); shutil.rmtree(tmp)
