"""Where ``kvfleet engine``'s time goes while serving (py-spy on its core and API processes).

    python -m bench.peers.peers_profile --model FOLDER [--concurrency 8] [--seconds 40]   # needs: pip install py-spy

Starts ``kvfleet engine`` (``OMP_NUM_THREADS=1`` unless set), drives chat requests closed
loop at ``--concurrency`` with ``kvfleet bench``'s load core, and samples both processes
with ``py-spy record --format raw`` for ``--seconds`` while the load runs. Each sample is
put in one bucket by its stack: layer matmuls, the LM head, attention (prefill SDPA,
the native decode kernel, rope, KV store), other model ops, sampler, scheduler,
detokenize/output, IPC; printed as shares of the samples.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench.common import (
    core_pid,  # noqa: E402
    resolve_model,  # noqa: E402
)
from kvfleet.bench import LoadSpec, parse_distribution, run_load  # noqa: E402
from kvfleet.testing.processes import engine_process as engine_process_handle  # noqa: E402


def bucket(frames: list[str]) -> str:
    stack, leaf = ";".join(frames), frames[-1]
    if "runner/sampler.py" in stack:
        return "sampler"
    if "/sched/" in stack:
        return "scheduler"
    if "detokeniz" in stack or "output_processor" in stack:
        return "detokenize/output"
    if "connection.py" in stack or "pickle" in stack:
        return "IPC (pipe, pickle)"
    if "Linear.forward" in leaf or "F.linear" in leaf or "llama.py:169" in leaf or "llama.py:141" in leaf:
        return "matmul: LM head" if "LlamaForCausalLM.forward" in stack and "DecoderLayer" not in stack else (
            "matmul: layers")  # fmt: skip
    if "/attention/" in stack or "cpu_decode" in stack or "rope" in leaf or "_rotate_half" in leaf:
        return "attention (+rope, KV store)"
    if "Attention.forward" in leaf:
        return "attention (+rope, KV store)"
    if "engine/model/" in leaf or "torch/" in leaf:
        return "other model ops (norms, silu, glue)"
    return "other: " + leaf[:70]


def shares(raw: Path) -> tuple[int, list[tuple[str, float]]]:
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        counts[bucket(stack.split(";"))] += int(n)
    total = sum(counts.values())
    return total, [(k, 100 * v / total) for k, v in counts.most_common()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seconds", type=int, default=40)
    p.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    args = p.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    folder = resolve_model(args.model)
    spec = LoadSpec(url="", endpoint="chat", num_requests=10_000, concurrency=args.concurrency,
                    input_len=parse_distribution("uniform:64:512"), output_len=parse_distribution("uniform:32:128"),
                    extra_body={"ignore_eos": True})  # fmt: skip
    flags = ["--model", str(folder), "--dtype", "float32", "--max-model-len", "1024"]
    with tempfile.TemporaryDirectory() as tmp, engine_process_handle(*flags) as (url, proc):
        pids = {"core": core_pid(proc.pid), "api": proc.pid}
        out = {name: Path(tmp) / f"{name}.txt" for name in pids}
        spies = [subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(args.seconds), "--rate",
                                   str(args.rate), "--format", "raw", "-o", str(out[name])],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for name, pid in pids.items() if pid is not None]  # fmt: skip

        async def drive() -> None:  # the load until the profiles end; asyncio.run cancels what is left
            asyncio.ensure_future(run_load(dataclasses.replace(spec, url=url)))
            await asyncio.sleep(args.seconds + 5)

        asyncio.run(drive())
        for s in spies:
            s.wait(args.seconds + 30)
        for name, path in out.items():
            if not path.exists():
                print(f"{name}: no profile (py-spy needs ptrace permission)")
                continue
            total, rows = shares(path)
            busy = total / (args.seconds * args.rate)
            print(f"{name} process: {total} samples, busy {busy:.0%} of one core")
            for k, pct in rows:
                print(f"  {pct:5.1f}%  {k}")


if __name__ == "__main__":
    main()
