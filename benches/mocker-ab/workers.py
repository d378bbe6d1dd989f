#!/usr/bin/env python3
"""Start N Dynamo mocker workers as separate processes, each publishing vLLM-format KV
events on its own ZMQ port, and keep them running until SIGTERM/SIGINT.

Run it with the Python of a venv that holds the `ai-dynamo-runtime` 1.6.1 wheel:

    python workers.py --workers 2 --run-dir /tmp/mab-run --zmq-port-base 25600

Worker i publishes KV events on tcp://127.0.0.1:(base + i) and answers replay requests on
tcp://127.0.0.1:(base + 100 + i). Discovery is a plain directory (DYN_FILE_KV =
<run-dir>/discovery), so no etcd or NATS is needed; a client in another process finds the
workers by pointing DYN_FILE_KV at the same directory. Once every worker is registered and
its KV-event port accepts connections, `<run-dir>/endpoints.json` is written and printed:

    {"namespace": ..., "endpoint": "dyn://<ns>.mocker.generate", "model_name": ...,
     "block_size": 16, "num_gpu_blocks": ..., "workers": [{"index", "instance_id",
     "kv_events_endpoint", "replay_endpoint", "pid"}, ...]}

Every child runs in the parent's process group; the parent forwards SIGTERM to each
child and waits for them, so `kill -- -<pgid>` or a plain SIGTERM to the parent stops all.
"""

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# A small BPE tokenizer that ships with the repository's tests (2,048 tokens). The mocker
# needs a tokenizer file to build its model card; it never detokenizes our token ids.
TOKENIZER = REPO / "tokenize" / "tests" / "assets" / "tokenizer" / "tokenizer.json"

REPLAY_OFFSET = 100


def write_model_dir(path: Path) -> None:
    """A model directory holding only what the mocker reads: config.json and tokenizer.json."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        # kvr replay's synthetic tokens are drawn from Llama-3's vocabulary size.
        "vocab_size": 128256,
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_bytes(TOKENIZER.read_bytes())


def engine_args(a, index: int) -> dict:
    engine = {
        "block_size": a.block_size,
        "num_gpu_blocks": a.num_gpu_blocks,
        "emit_kv_events": True,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        # < 1 slows the simulated engine down (0.2 = 5x slower), so the engine's
        # scheduling, not Python, sets the latencies.
        "speedup_ratio": a.speedup_ratio,
    }
    if a.decode_speedup_ratio is not None:
        engine["decode_speedup_ratio"] = a.decode_speedup_ratio
    return {
        "engine": engine,
        "dynamo": {
            "zmq_kv_events_port": a.zmq_port_base + index,
            "zmq_replay_port": a.zmq_port_base + REPLAY_OFFSET + index,
        },
    }


async def child_main(a) -> None:
    from dynamo._core import (DistributedRuntime, EngineType, EntrypointArgs,
                              make_engine, run_input)

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp")
    endpoint_path = f"dyn://{a.namespace}.mocker.generate"
    args = EntrypointArgs(
        EngineType.Mocker,
        model_path=str(Path(a.run_dir) / "model"),
        model_name=a.model_name,
        endpoint_id=endpoint_path,
        mocker_engine_args=engine_args(a, a.index),
    )
    engine = await make_engine(runtime, args)
    # The process's connection id is the instance id the worker registers under.
    instance_id = runtime.endpoint(endpoint_path).connection_id()
    print(json.dumps({"child": a.index, "instance_id": instance_id}), flush=True)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    task = asyncio.ensure_future(run_input(runtime, endpoint_path, engine))
    await asyncio.wait([task, asyncio.ensure_future(stop.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    runtime.shutdown()
    task.cancel()


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def registered_instances(discovery: Path) -> set:
    out = set()
    d = discovery / "v1" / "instances"
    if d.is_dir():
        for f in d.iterdir():
            try:
                out.add(json.loads(f.read_text())["instance_id"])
            except (OSError, ValueError, KeyError):
                pass
    return out


def parent_main(a) -> int:
    run_dir = Path(a.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    discovery = run_dir / "discovery"
    discovery.mkdir(exist_ok=True)
    write_model_dir(run_dir / "model")
    env = dict(os.environ, DYN_FILE_KV=str(discovery))
    env.setdefault("DYN_LOG", "warn")

    children = []

    def stop_all(*_):
        for p, _log in children:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + 5
        for p, _log in children:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)

    base_args = [sys.executable, str(Path(__file__).resolve()), "--child",
                 "--run-dir", str(run_dir), "--namespace", a.namespace,
                 "--model-name", a.model_name, "--block-size", str(a.block_size),
                 "--num-gpu-blocks", str(a.num_gpu_blocks),
                 "--speedup-ratio", str(a.speedup_ratio),
                 "--max-num-batched-tokens", str(a.max_num_batched_tokens),
                 "--zmq-port-base", str(a.zmq_port_base)]
    if a.decode_speedup_ratio is not None:
        base_args += ["--decode-speedup-ratio", str(a.decode_speedup_ratio)]
    for i in range(a.workers):
        log = open(run_dir / f"worker{i}.log", "w")
        p = subprocess.Popen(base_args + ["--index", str(i)], env=env,
                             stdout=subprocess.PIPE, stderr=log, text=True)
        children.append((p, log))

    ids = {}
    for i, (p, _log) in enumerate(children):
        line = p.stdout.readline()
        if not line:
            print(f"worker {i} exited before starting (see {run_dir}/worker{i}.log)",
                  file=sys.stderr)
            stop_all()
        ids[i] = json.loads(line)["instance_id"]

    deadline = time.time() + a.ready_timeout
    while True:
        have = registered_instances(discovery)
        ports = all(port_open(a.zmq_port_base + i) for i in range(a.workers))
        if ports and all(ids[i] in have for i in ids):
            break
        if time.time() > deadline:
            print(f"workers not ready after {a.ready_timeout} s: registered {sorted(have)}, "
                  f"expected {sorted(ids.values())}, kv ports open: {ports}", file=sys.stderr)
            stop_all()
        if any(p.poll() is not None for p, _ in children):
            print("a worker exited during start-up", file=sys.stderr)
            stop_all()
        time.sleep(0.1)

    info = {
        "namespace": a.namespace,
        "endpoint": f"dyn://{a.namespace}.mocker.generate",
        "model_name": a.model_name,
        "block_size": a.block_size,
        "num_gpu_blocks": a.num_gpu_blocks,
        "speedup_ratio": a.speedup_ratio,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "discovery_dir": str(discovery),
        "workers": [
            {
                "index": i,
                "instance_id": ids[i],
                "kv_events_endpoint": f"tcp://127.0.0.1:{a.zmq_port_base + i}",
                "replay_endpoint": f"tcp://127.0.0.1:{a.zmq_port_base + REPLAY_OFFSET + i}",
                "pid": children[i][0].pid,
            }
            for i in range(a.workers)
        ],
    }
    tmp = run_dir / "endpoints.json.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    tmp.rename(run_dir / "endpoints.json")
    print(json.dumps(info), flush=True)

    while True:
        for i, (p, _log) in enumerate(children):
            if p.poll() is not None:
                print(f"worker {i} exited with {p.returncode}", file=sys.stderr)
                stop_all()
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--namespace", default="mab")
    ap.add_argument("--model-name", default="mock")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-gpu-blocks", type=int, default=16384)
    ap.add_argument("--speedup-ratio", type=float, default=0.5,
                    help="the mocker's speed knob: < 1 is slower than its default timing model")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="prefill chunk budget per engine step (the mocker's default)")
    ap.add_argument("--decode-speedup-ratio", type=float, default=None)
    ap.add_argument("--zmq-port-base", type=int, default=25600)
    ap.add_argument("--ready-timeout", type=float, default=60)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.workers < 1 or a.workers > 8:
        ap.error("--workers must be 1..8")
    if a.child:
        asyncio.run(child_main(a))
        return 0
    return parent_main(a)


if __name__ == "__main__":
    sys.exit(main())
