"""``kvtier bench``: the benchmarks, each printing ratios against a baseline run in the same
process.

The ``bench`` group; its commands live in one module per family, registered here:
:mod:`kvtier.cli.bench_tiers` (``io``, ``keys``, ``remote``, ``objects``),
:mod:`kvtier.cli.bench_model` (``ttft``, ``codecs``, ``truncation``),
:mod:`kvtier.cli.bench_vllm` (``serve``, ``vllm-ttft``, ``stall``),
:mod:`kvtier.cli.bench_daemon` (``daemon``), :mod:`kvtier.cli.bench_workload` (``workload``) and
:mod:`kvtier.cli.workload_sharegpt` (``workload-sharegpt``).
"""

from __future__ import annotations

import click

from kvtier.cli.bench_daemon import bench_daemon
from kvtier.cli.bench_model import bench_codecs, bench_truncation, bench_ttft
from kvtier.cli.bench_tiers import bench_io, bench_keys, bench_objects, bench_remote
from kvtier.cli.bench_vllm import bench_serve, bench_stall, bench_vllm_ttft
from kvtier.cli.bench_workload import bench_workload
from kvtier.cli.workload_sharegpt import workload_sharegpt  # kvtier bench workload-sharegpt


@click.group()
def bench() -> None:
    """Benchmarks of the tiers and of key bookkeeping."""


bench.add_command(bench_io)
bench.add_command(bench_remote)
bench.add_command(bench_objects)
bench.add_command(bench_truncation)
bench.add_command(bench_stall)
bench.add_command(bench_daemon)
bench.add_command(bench_serve)
bench.add_command(bench_keys)
bench.add_command(bench_vllm_ttft)
bench.add_command(bench_codecs)
bench.add_command(bench_ttft)
bench.add_command(bench_workload)
bench.add_command(workload_sharegpt)
