"""Checkpoint save and load throughput on ``s3://`` (moto on loopback) against local disk, side by side.

One checkpoint of ``--size-mb`` float32 tensors (1 GB by default, 256 MB with ``--quick``; 16 tensors,
as a model's layers) is saved and loaded by every method below, interleaved and rotated across
repeats so that noise on a shared machine hits them alike; the table shows medians and the ratio of
each method's throughput to local disk's (the issue's target: ``s3://`` >= 0.8x local disk).

Save methods:

* ``local``          ``TorchCheckpointIO().save_checkpoint`` to a local file (temporary file, fsync, rename).
* ``s3-sequential``  the same to ``s3://`` with ``transfer_concurrency=1``: s3fs's own file, parts
                     uploaded one after another (the behaviour before this change).
* ``s3-parallel``    ``transfer_concurrency=8``: ``torch.save`` streams into a multipart upload whose
                     parts go up 8 at a time (``plugins/io/object_store.py``).
* ``s3-spool-put``   the alternative design: ``torch.save`` to a local temporary file, then s3fs
                     ``put_file(max_concurrency=8)``; measured to justify the streaming choice.

Load methods (each result is then copied into preallocated tensors, as ``load_state_dict`` would, so a
lazily mapped local load is charged for reading its pages like the others):

* ``local``          ``TorchCheckpointIO().load_checkpoint`` of a local file (from the page cache).
* ``s3-sequential``  ``transfer_concurrency=1``: ``torch.load`` over s3fs's sequential read-ahead file.
* ``s3-parallel``    ``transfer_concurrency=8``: ``download_to_local`` (8 ranged reads in flight) into a
                     temporary file, mapped by ``torch.load(mmap=True)``, then removed.

The server's own ceiling, with the bytes already in memory (no serialisation, no checkpoint code):

* ``raw-put``        boto3 ``put_object`` of the whole file in one request.
* ``raw-pipe``       s3fs ``pipe_file`` (parallel multipart, 8 MiB parts, 8 at a time).
* ``raw-get``        boto3 ``get_object`` of the whole object in one request.
* ``raw-range``      one 16 MiB ranged ``get_object`` of the object, and of a 16 MiB object: moto reads
                     the whole stored object for every ranged request (``FakeKey.value``), so a ranged
                     download costs it (object size / range size) whole reads; real S3 does not.

The server runs in its own process (as S3 would be on another machine), so its Python work and
ours do not share one interpreter lock. Every sample's object is deleted after it.

    python benchmarks/object_store.py            # 1 GB, 3 repeats
    python benchmarks/object_store.py --quick    # 256 MB, 1 repeat (under 3 minutes)
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

SAVE_METHODS = ("local", "s3-sequential", "s3-parallel", "s3-spool-put")
LOAD_METHODS = ("local", "s3-sequential", "s3-parallel")
RAW_METHODS = ("raw-put", "raw-pipe", "raw-get", "raw-range-big", "raw-range-small")
TARGET_RATIO = 0.8  # s3:// throughput / local disk throughput
CONCURRENCY = 8
DEFAULT_SIZE_MB = 1024
QUICK_SIZE_MB = 256
NUM_TENSORS = 16
RESULT_PATH = common.RESULTS_DIR / "object_store.json"
MB = 1e6
BUCKET = "bench"
CREDENTIALS = {"key": "testing", "secret": "testing", "token": "testing"}

_SERVER = """
import logging, sys, time
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
if sys.argv[2] == "range-fix":
    # Stock moto answers every ranged GET by copying the whole stored object (FakeKey.value) and
    # slicing it: a 16 MiB range of a 1 GB object costs a 1 GB copy, so 8 parallel ranges of a
    # 1 GB checkpoint time out. S3 serves a range in proportion to its size; keeping the value
    # once read makes moto do the same (a slice per range). Only this benchmark's server does this.
    from moto.s3.models import FakeKey
    stock = FakeKey.value
    def read_once(key):
        if "_bench_value" not in key.__dict__:
            key.__dict__["_bench_value"] = stock.fget(key)
        return key.__dict__["_bench_value"]
    def write(key, value):
        key.__dict__.pop("_bench_value", None)
        stock.fset(key, value)
    FakeKey.value = property(read_once, write)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("ready", flush=True)
time.sleep(10**9)
"""


def start_server(stock: bool = False) -> tuple[subprocess.Popen, str]:
    """moto in its own process on a free loopback port, with the benchmark's bucket created.

    ``stock=False`` serves ranged GETs in proportion to the range, as S3 does (see ``_SERVER``).
    """
    port = common.free_port()
    # Objects kept in memory, not spooled to temporary files on this machine's disk (which the
    # local-disk side of the comparison uses): S3 stores them elsewhere.
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(4 * 2**30),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(port), "stock" if stock else "range-fix"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    endpoint = f"http://127.0.0.1:{port}"
    _boto3(endpoint).create_bucket(Bucket=BUCKET)
    return proc, endpoint


def _boto3(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        aws_session_token="testing",
    )


def make_checkpoint(size_mb: int) -> dict[str, Any]:
    import torch

    numel = size_mb * 2**20 // 4 // NUM_TENSORS
    generator = torch.Generator().manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(numel, generator=generator) for i in range(NUM_TENSORS)}
    return {
        "format_version": 1,
        "epoch": 0,
        "global_step": 1,
        "loops": {},
        "optimizer_states": [],
        "state_dict": weights,
    }


def _copy_out(loaded: dict[str, Any], into: dict[str, Any]) -> None:
    for name, tensor in loaded["state_dict"].items():
        into[name].copy_(tensor)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import fsspec
    import torch

    from trainer_core.plugins.io.torch_io import TorchCheckpointIO

    torch.set_num_threads(1)
    proc, endpoint = start_server(stock=args.stock_moto)
    options = {"endpoint_url": endpoint, **CREDENTIALS}
    workdir = Path(tempfile.mkdtemp(prefix="object-store-bench-", dir=args.dir))
    samples: dict[str, dict[str, list[float]]] = {"save": {}, "load": {}, "raw": {}}
    try:
        checkpoint = make_checkpoint(args.size_mb)
        destination = {name: torch.empty_like(t) for name, t in checkpoint["state_dict"].items()}
        ios = {
            "s3-sequential": TorchCheckpointIO(storage_options=options, transfer_concurrency=1),
            "s3-parallel": TorchCheckpointIO(storage_options=options, transfer_concurrency=CONCURRENCY),
        }
        local_io = TorchCheckpointIO()
        fs, _ = fsspec.core.url_to_fs(f"s3://{BUCKET}/x", **options)
        local_path = workdir / "local.ckpt"
        local_io.save_checkpoint(checkpoint, local_path)  # warm-up: imports, connections, page cache
        nbytes = local_path.stat().st_size
        client = _boto3(endpoint)

        def save(method: str) -> float:
            url = f"s3://{BUCKET}/{method}.ckpt"
            started = time.perf_counter()
            if method == "local":
                local_io.save_checkpoint(checkpoint, local_path)
            elif method == "s3-spool-put":
                spool = workdir / "spool.ckpt"
                torch.save(checkpoint, spool)
                fs.put_file(str(spool), url, chunksize=8 * 2**20, max_concurrency=CONCURRENCY)
                spool.unlink()
            else:
                ios[method].save_checkpoint(checkpoint, url)
            return time.perf_counter() - started

        def load(method: str) -> float:
            gc.collect()
            started = time.perf_counter()
            if method == "local":
                loaded = local_io.load_checkpoint(local_path)
            else:
                loaded = ios[method].load_checkpoint(f"s3://{BUCKET}/s3-parallel.ckpt")
            _copy_out(loaded, destination)
            elapsed = time.perf_counter() - started
            del loaded
            return elapsed

        data = local_path.read_bytes()
        small = data[: 16 * 2**20]

        def raw(method: str) -> float:
            started = time.perf_counter()
            if method == "raw-put":
                client.put_object(Bucket=BUCKET, Key="raw.bin", Body=data)
            elif method == "raw-pipe":
                fs.pipe_file(f"{BUCKET}/raw.bin", data, chunksize=8 * 2**20, max_concurrency=CONCURRENCY)
            elif method == "raw-get":
                assert len(client.get_object(Bucket=BUCKET, Key="raw.bin")["Body"].read()) == nbytes
            elif method == "raw-range-big":
                client.get_object(Bucket=BUCKET, Key="raw.bin", Range=f"bytes=0-{16 * 2**20 - 1}")[
                    "Body"
                ].read()
            else:
                client.get_object(Bucket=BUCKET, Key="small.bin", Range=f"bytes=0-{16 * 2**20 - 1}")[
                    "Body"
                ].read()
            return time.perf_counter() - started

        client.put_object(Bucket=BUCKET, Key="small.bin", Body=small)
        for repeat in range(args.repeats):
            for method in common.rotated(SAVE_METHODS, repeat):
                common.log(f"repeat {repeat + 1}/{args.repeats}: save {method}")
                samples["save"].setdefault(method, []).append(save(method))
            for method in common.rotated(LOAD_METHODS, repeat):
                if method == "s3-sequential" and args.skip_sequential_load:
                    continue
                common.log(f"repeat {repeat + 1}/{args.repeats}: load {method}")
                samples["load"].setdefault(method, []).append(load(method))
            for method in RAW_METHODS:  # in order: the gets read what raw-put/raw-pipe stored
                samples["raw"].setdefault(method, []).append(raw(method))
            for method in SAVE_METHODS[1:]:
                client.delete_object(Bucket=BUCKET, Key=f"{method}.ckpt")
                client.delete_object(Bucket=BUCKET, Key=f"{method}.ckpt.complete")
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"nbytes": nbytes, "samples": samples}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    nbytes = result["nbytes"]
    summary: dict[str, Any] = {}
    for phase in ("save", "load"):
        rows = {}
        local = common.median(result["samples"][phase]["local"])
        for method, seconds in result["samples"][phase].items():
            med = common.median(seconds)
            rows[method] = {
                "median_s": med,
                "mb_per_s": nbytes / MB / med,
                "ratio_to_local": local / med,
                "spread_pct": common.spread_pct(seconds),
            }
        summary[phase] = rows
    raw = {}
    for method, seconds in result["samples"]["raw"].items():
        med = common.median(seconds)
        size = 16 * 2**20 if method.startswith("raw-range") else nbytes
        raw[method] = {"median_s": med, "mb_per_s": size / MB / med}
    summary["raw"] = raw
    for phase in ("save", "load"):
        best = summary[phase]["s3-parallel"]["ratio_to_local"]
        summary[f"{phase}_target_met"] = best >= TARGET_RATIO
    return summary


def render(summary: dict[str, Any], nbytes: int, repeats: int) -> str:
    lines = [
        f"checkpoint {nbytes / MB:.0f} MB, {repeats} repeat(s), medians; target: s3:// >= {TARGET_RATIO}x local"
    ]
    for phase in ("save", "load"):
        rows = [
            [method, f"{row['median_s']:.2f}", f"{row['mb_per_s']:.0f}", f"{row['ratio_to_local']:.2f}x"]
            for method, row in summary[phase].items()
        ]
        lines.append(f"\n{phase}")
        lines.append(common.format_table(["method", "seconds", "MB/s", "vs local"], rows))
        met = "met" if summary[f"{phase}_target_met"] else "NOT met"
        lines.append(f"target {TARGET_RATIO}x for s3-parallel: {met}")
    rows = [[m, f"{r['median_s']:.3f}", f"{r['mb_per_s']:.0f}"] for m, r in summary["raw"].items()]
    lines.append(
        "\nserver ceiling (bytes already in memory; raw-range = one 16 MiB range of the big / a 16 MiB object)"
    )
    lines.append(common.format_table(["request", "seconds", "MB/s"], rows))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_SIZE_MB} MB, 1 repeat")
    parser.add_argument("--size-mb", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dir", default=None, help="local folder for the local-disk files (default: TMPDIR)")
    parser.add_argument(
        "--stock-moto",
        action="store_true",
        help="serve ranged GETs as stock moto does (a whole-object copy per range: a 1 GB load times out)",
    )
    parser.add_argument(
        "--skip-sequential-load",
        action="store_true",
        help="leave out the slowest method (sequential s3 load)",
    )
    args = parser.parse_args(argv)
    args.size_mb = args.size_mb or (QUICK_SIZE_MB if args.quick else DEFAULT_SIZE_MB)
    args.repeats = args.repeats or (1 if args.quick else 3)
    result = measure(args)
    summary = summarize(result)
    print(render(summary, result["nbytes"], args.repeats))
    payload = {
        "benchmark": "object_store",
        "size_mb": args.size_mb,
        "repeats": args.repeats,
        "concurrency": CONCURRENCY,
        "stock_moto": args.stock_moto,
        "target_ratio": TARGET_RATIO,
        "machine": common.machine_info(),
        "packages": common.package_versions(["torch", "s3fs", "fsspec", "moto", "boto3", "aiobotocore"]),
        **result,
        "summary": summary,
    }
    print(f"\nwrote {common.write_json(RESULT_PATH, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
