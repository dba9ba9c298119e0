#!/usr/bin/env python
"""pdserve on one GPU: decode and prefill throughput, the memory-bandwidth roofline, HF
transformers on the same shapes, and a logits check. See bench/gpu/README.md.

Self-contained: needs PyTorch, transformers (and Triton for `--attention triton`) and this
repository's `pdserve/` next to it; no network, no downloads, random ("dummy") weights.

    python bench/gpu/bench_gpu.py                               # both models, on cuda
    python bench/gpu/bench_gpu.py --models qwen2.5-0.5b --batches 1,32,256
    python bench/gpu/bench_gpu.py --smoke --device cpu          # tiny shapes, < 1 minute

Per model: one `pdserve.LLM` (load_format="dummy", a synthetic config.json) whose runner's
ops are switched between attention backends, and one HF CausalLM holding a copy of the same
weights. Measured per attention backend and batch size:

- engine: `LLM.generate` end to end (scheduler, eager model, sampler): prefill tok/s from
  max_tokens=1, decode tok/s from the extra time of max_tokens=N;
- step: one decode step of `batch` sequences with `context` tokens each through
  `ModelRunner.forward` (eager) and through `DecodeGraphRunner` (CUDA graphs), each
  followed by greedy argmax + `.tolist()` (the one host sync of a real step);
- roofline: floor = (weight bytes + KV bytes read per step) / measured copy bandwidth;
  fraction = floor / measured step time.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3_SCALING,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    # --smoke: the same two families, tiny (GQA 4/2 with qkv bias and tied embeddings;
    # GQA 4/1 with llama3 rope scaling).
    "tiny-qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3_SCALING,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}

ACCEPTANCE_ROOFLINE = {"qwen2.5-0.5b": 0.50, "llama-3.1-8b": 0.70}
ACCEPTANCE_HF_SPEEDUP = 5.0
ACCEPTANCE_HF_BATCH = 32


# -- arguments and environment (before torch, Triton or pdserve are imported) -----------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny models and batches: a test run")
    p.add_argument("--models", default=None, help="comma list; default both real shapes")
    p.add_argument("--batches", default=None, help="default 1,32,256 (smoke: 1,3)")
    p.add_argument("--hf-batches", default=None, help="default: --batches; '' skips HF")
    p.add_argument("--attention", default="triton,sdpa", help="backends to compare")
    p.add_argument("--prompt-len", type=int, default=None, help="default 512 (smoke 10)")
    p.add_argument("--output-len", type=int, default=None, help="default 128 (smoke 4)")
    p.add_argument("--step-iters", type=int, default=None, help="timed decode steps")
    p.add_argument("--repeat", type=int, default=2, help="engine/HF runs (median)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="skip the graph step")
    p.add_argument("--no-engine", action="store_true", help="skip LLM.generate timings")
    p.add_argument("--no-check", action="store_true", help="skip the logits check")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--json", default=None, help="results file (default bench/gpu/results-*.json)")
    args = p.parse_args(argv)
    smoke = args.smoke
    args.models = args.models or ("tiny-qwen2,tiny-llama" if smoke else "qwen2.5-0.5b,llama-3.1-8b")
    args.batches = args.batches or ("1,3" if smoke else "1,32,256")
    args.hf_batches = args.batches if args.hf_batches is None else args.hf_batches
    args.prompt_len = args.prompt_len or (10 if smoke else 512)
    args.output_len = args.output_len or (4 if smoke else 128)
    args.step_iters = args.step_iters or (2 if smoke else 20)
    if smoke:
        args.repeat = 1
    for name in _split(args.models):
        if name not in MODELS:
            p.error(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    for name in _split(args.attention):
        if name not in ("triton", "sdpa"):
            p.error(f"unknown attention {name!r} (triton, sdpa)")
    if args.output_len < 2:
        p.error("--output-len must be >= 2 (decode time = full run - prefill run)")
    return args


def _split(csv: str) -> list[str]:
    return [s.strip() for s in csv.split(",") if s.strip()]


def _ints(csv: str) -> list[int]:
    return [int(s) for s in _split(csv)]


def setup_environment(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.device == "cpu" and "triton" in _split(args.attention):
        # Triton on a CPU runs only in its interpreter, chosen when kernels are decorated.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


# -- measurements -----------------------------------------------------------------------


@dataclass
class Row:
    model: str
    attention: str
    batch: int
    context: int
    engine_prefill_tok_s: float | None = None
    engine_decode_tok_s: float | None = None
    step_ms_eager: float | None = None
    step_ms_graph: float | None = None
    floor_ms: float | None = None
    weight_bytes: int | None = None
    kv_bytes: int | None = None
    roofline_eager: float | None = None
    roofline_graph: float | None = None
    roofline_engine: float | None = None
    hf_prefill_tok_s: float | None = None
    hf_decode_tok_s: float | None = None
    speedup_vs_hf: float | None = None
    errors: list[str] = field(default_factory=list)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_environment(args)
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available (use --smoke --device cpu for a CPU test)")
    dtype = getattr(torch, args.dtype)
    started = time.time()
    env = environment(torch, device)
    bandwidth = copy_bandwidth(torch, device, smoke=args.smoke)
    env["copy_bandwidth_GBps"] = bandwidth / 1e9
    print(f"# pdserve GPU benchmark ({env['device_name']})", flush=True)
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write per byte copied)")

    backends = _split(args.attention)
    if "triton" in backends and not _triton_ok():
        print("triton is not importable: skipping --attention triton")
        backends = [b for b in backends if b != "triton"]
    rows: list[Row] = []
    checks: list[dict[str, Any]] = []
    kernels: list[dict[str, Any]] = []
    for name in _split(args.models):
        print(f"\n## {name}", flush=True)
        bench = ModelBench(args, name, device, dtype, bandwidth, backends)
        try:
            kernels += bench.kernel_checks()
            checks += bench.logits_checks()
            rows += bench.run()
        finally:
            bench.close()
    accept = acceptance(rows, checks)
    report = {
        "environment": env,
        "args": vars(args),
        "rows": [asdict(r) for r in rows],
        "logits_checks": checks,
        "kernel_checks": kernels,
        "acceptance": accept,
        "seconds": time.time() - started,
    }
    print()
    print(markdown(rows, accept, checks, kernels))
    out = Path(args.json) if args.json else _default_json(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nresults: {out} ({report['seconds']:.0f} s)")
    failed = [c for c in checks if not c["ok"]] + [k for k in kernels if not k["ok"]]
    return 1 if failed else 0


def _default_json(args: argparse.Namespace) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kind = "smoke" if args.smoke else args.device
    return REPO / "bench" / "gpu" / f"results-{kind}-{stamp}.json"


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def environment(torch: Any, device: Any) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device_name"] = props.name
        env["device_memory_GiB"] = props.total_memory / 2**30
        env["sms"] = props.multi_processor_count
        env["cuda"] = torch.version.cuda
    return env


def sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(torch: Any, device: Any, smoke: bool) -> float:
    """Bytes per second moved by a large device-to-device copy, counting each byte copied
    twice (read + write): the rate a memory-bound kernel can stream bytes at."""
    nbytes = (64 << 20) if smoke or device.type == "cpu" else (2 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(torch, device)
    iters = 5 if device.type == "cpu" else 20
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(torch, device)
    seconds = (time.perf_counter() - start) / iters
    del src, dst
    return 2 * nbytes / seconds


def timed(torch: Any, device: Any, fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of `fn` over `repeat` runs, the device synced around each."""
    times = []
    for _ in range(repeat):
        sync(torch, device)
        start = time.perf_counter()
        fn()
        sync(torch, device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class ModelBench:
    """One model shape: the pdserve engine, its runner, and the HF twin."""

    def __init__(
        self,
        args: argparse.Namespace,
        name: str,
        device: Any,
        dtype: Any,
        bandwidth: float,
        backends: list[str],
    ) -> None:
        import torch

        from pdserve import LLM
        from pdserve.config import ModelConfig

        self.torch, self.args, self.name = torch, args, name
        self.device, self.dtype, self.bandwidth = device, dtype, bandwidth
        self.backends = backends
        self.batches = _ints(args.batches)
        self.hf_batches = _ints(args.hf_batches)
        self.max_batch = max(self.batches + self.hf_batches + [4])
        self.bs = args.block_size
        self.max_len = args.prompt_len + args.output_len + 16
        self.blocks_per_seq = -(-self.max_len // self.bs)
        self.num_blocks = self.max_batch * self.blocks_per_seq + 2
        self.pad_block = self.num_blocks - 1
        self.tmp = tempfile.TemporaryDirectory(prefix="pdserve-gpu-bench-")
        config = dict(MODELS[name])
        (Path(self.tmp.name) / "config.json").write_text(json.dumps(config))
        options: dict[str, Any] = dict(
            load_format="dummy",
            dtype=args.dtype,
            device=str(device),
            max_model_len=self.max_len,
            block_size=self.bs,
            num_blocks=self.num_blocks,
            enable_prefix_caching=False,  # repeated prompts must be recomputed
            max_num_seqs=self.max_batch,
            max_num_batched_tokens=max(args.max_num_batched_tokens, self.max_batch),
        )
        if "kernels" in ModelConfig.__dataclass_fields__:
            options["kernels"] = "torch"  # backends are set per measurement below
        t0 = time.perf_counter()
        self.llm = LLM(self.tmp.name, **options)
        self.runner = self.llm.engine.runner
        self.model = self.runner.model
        self.arch = self.llm.engine.loaded.arch
        print(f"pdserve model built in {time.perf_counter() - t0:.1f} s", flush=True)
        sharpen_attention(self.model, self.arch, seed=args.block_size)
        self.hf: Any = None
        self.hf_error: str | None = None
        t0 = time.perf_counter()
        try:
            self.hf = build_hf_model(config, self.model, self.arch, device, dtype)
            print(f"HF model built in {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:  # reported, the pdserve side still runs
            self.hf_error = f"HF model: {e!r}"
            print(self.hf_error)

    def close(self) -> None:
        self.llm = self.runner = self.model = self.hf = None  # type: ignore[assignment]
        gc.collect()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()
        self.tmp.cleanup()

    # -- backends ----------------------------------------------------------------------

    def ops(self, backend: str) -> Any:
        from pdserve.model.ops import TorchOps

        if backend == "triton":
            from pdserve.model.triton_attention import TritonOps

            return TritonOps()
        return TorchOps()

    def use(self, backend: str) -> Any:
        ops = self.ops(backend)
        self.runner.ops = ops
        return ops

    # -- bytes per decode step ---------------------------------------------------------

    def weight_bytes(self, batch: int) -> int:
        """Weights a decode step must read: every parameter once (tied ones once), except
        that an untied embedding table is only read at the batch's rows."""
        seen: dict[int, Any] = {}
        for p in self.model.parameters():
            seen.setdefault(id(p), p)
        total = sum(p.numel() * p.element_size() for p in seen.values())
        if not self.arch.tie_word_embeddings:
            emb = self.model.embed_tokens.weight
            total -= emb.numel() * emb.element_size()
            total += batch * emb.shape[1] * emb.element_size()
        return total

    def kv_bytes(self, batch: int, context: int) -> int:
        a = self.arch
        per_token = a.num_layers * 2 * a.num_kv_heads * a.head_dim * self.dtype.itemsize
        return batch * context * per_token

    # -- step-level decode -------------------------------------------------------------

    def decode_step(self, batch: int, context: int) -> tuple[Any, list[list[int]]]:
        """A scheduler output of `batch` decodes with `context` cached tokens each, on
        disjoint blocks (the pad block excluded)."""
        from pdserve.batch import ScheduledRequest, SchedulerOutput
        from pdserve.engine.request import Request
        from pdserve.sampling_params import SamplingParams

        nb = context // self.bs + 1
        gen = self.torch.Generator().manual_seed(batch)
        entries, tables = [], []
        for i in range(batch):
            table = list(range(i * nb, (i + 1) * nb))
            ids = self.torch.randint(100, self.arch.vocab_size, (context + 1,), generator=gen)
            request = Request(f"step-{i}", ids.tolist(), SamplingParams(max_tokens=1))
            entries.append(ScheduledRequest(request, 1, context, tuple(table), True))
            tables.append(table)
        return SchedulerOutput(tuple(entries), num_decodes=batch), tables

    def graph_runner(self, ops: Any, batch_sizes: list[int]) -> Any:
        from pdserve.model.cuda_graphs import DecodeGraphRunner

        graphs = DecodeGraphRunner(
            self.model,
            self.runner.kv_cache,
            ops,
            self.bs,
            max_batch=max(batch_sizes),
            max_blocks_per_seq=self.blocks_per_seq,
            pad_block=self.pad_block,
            batch_sizes=batch_sizes,
        )
        graphs.capture()
        return graphs

    def step_times(self, backend: str, context: int) -> dict[int, tuple[float, float | None]]:
        ops = self.use(backend)
        graphs = None
        if not self.args.no_cuda_graphs:
            t0 = time.perf_counter()
            graphs = self.graph_runner(ops, self.batches)
            kind = "captured" if graphs.use_graphs else "built (eager: no CUDA)"
            print(f"  graphs {kind} in {time.perf_counter() - t0:.1f} s", flush=True)
        result: dict[int, tuple[float, float | None]] = {}
        for batch in self.batches:
            step, tables = self.decode_step(batch, context)
            eager_ms = self.per_step_ms(functools.partial(self.runner.forward, step))
            graph_ms = None
            if graphs is not None:
                tokens = [s.request.token_ids[-1] for s in step.scheduled]
                positions = [context] * batch
                graph_ms = self.per_step_ms(
                    functools.partial(graphs.run, tokens, positions, tables)
                )
            result[batch] = (eager_ms, graph_ms)
        return result

    def per_step_ms(self, step: Callable[[], Any]) -> float:
        """Milliseconds per decode step, each ending with greedy argmax + `.tolist()`
        (the host sync a real step has for sampling); two untimed steps first."""

        iters = self.args.step_iters

        def steps(count: int) -> None:
            for _ in range(count):
                step().argmax(-1).tolist()

        steps(1 if self.args.smoke else 2)
        return timed(self.torch, self.device, lambda: steps(iters), 1) / iters * 1e3

    # -- engine end to end -------------------------------------------------------------

    def prompts(self, batch: int, seed: int) -> list[list[int]]:
        gen = self.torch.Generator().manual_seed(seed)
        ids = self.torch.randint(
            100, self.arch.vocab_size, (batch, self.args.prompt_len), generator=gen
        )
        return ids.tolist()

    def engine_times(self, batch: int) -> tuple[float, float | None]:
        from pdserve import SamplingParams

        n = self.args.output_len
        prompts = self.prompts(batch, seed=batch)

        def gen(max_tokens: int) -> None:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            outs = self.llm.generate(prompts, params)
            assert sum(len(o.outputs[0].token_ids) for o in outs) == batch * max_tokens

        if not self.args.smoke:
            gen(2)  # warm-up at this batch size
        t_prefill = timed(self.torch, self.device, lambda: gen(1), self.args.repeat)
        t_full = timed(self.torch, self.device, lambda: gen(n), self.args.repeat)
        return self.rates(batch, t_prefill, t_full)

    def rates(self, batch: int, t_prefill: float, t_full: float) -> tuple[float, float | None]:
        """Prefill tok/s, and decode tok/s from the extra time of the longer run (None when
        noise made it no longer: only in tiny --smoke runs)."""
        extra = t_full - t_prefill
        decode = batch * (self.args.output_len - 1) / extra if extra > 0 else None
        return batch * self.args.prompt_len / t_prefill, decode

    def hf_times(self, batch: int) -> tuple[float, float | None]:
        torch = self.torch
        n = self.args.output_len
        ids = torch.tensor(self.prompts(batch, seed=batch), device=self.device)
        mask = torch.ones_like(ids)

        def gen(max_new: int) -> None:
            with torch.inference_mode():
                out = self.hf.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max_new,
                    min_new_tokens=max_new,
                    do_sample=False,
                    pad_token_id=0,
                )
            assert out.shape == (batch, self.args.prompt_len + max_new)

        if not self.args.smoke:
            gen(2)
        t_prefill = timed(torch, self.device, lambda: gen(1), self.args.repeat)
        t_full = timed(torch, self.device, lambda: gen(n), self.args.repeat)
        return self.rates(batch, t_prefill, t_full)

    # -- the run -----------------------------------------------------------------------

    def run(self) -> list[Row]:
        context = self.args.prompt_len + self.args.output_len // 2
        hf: dict[int, tuple[float, float | None] | str] = {}
        if self.hf is not None:
            for batch in self.hf_batches:
                try:
                    rates = self.hf_times(batch)
                    hf[batch] = rates
                    print(f"  hf batch {batch}: decode {_fmt(rates[1])} tok/s", flush=True)
                except Exception as e:
                    hf[batch] = f"hf batch {batch}: {e!r}"
                    print(f"  {hf[batch]}")
                    self._free()
        rows = []
        for backend in self.backends:
            print(f"### attention {backend}", flush=True)
            steps: dict[int, tuple[float, float | None]] = {}
            step_error = None
            try:
                steps = self.step_times(backend, context)
            except Exception as e:
                step_error = f"step: {e!r}"
                print(f"  {step_error}")
                self._free()
            for batch in self.batches:
                row = Row(self.name, backend, batch, context)
                if step_error:
                    row.errors.append(step_error)
                if self.hf_error:
                    row.errors.append(self.hf_error)
                row.weight_bytes = self.weight_bytes(batch)
                row.kv_bytes = self.kv_bytes(batch, context + 1)
                floor = (row.weight_bytes + row.kv_bytes) / self.bandwidth
                row.floor_ms = floor * 1e3
                if batch in steps:
                    row.step_ms_eager, row.step_ms_graph = steps[batch]
                    row.roofline_eager = row.floor_ms / row.step_ms_eager
                    if row.step_ms_graph:
                        row.roofline_graph = row.floor_ms / row.step_ms_graph
                if not self.args.no_engine:
                    try:
                        self.use(backend)
                        row.engine_prefill_tok_s, row.engine_decode_tok_s = self.engine_times(batch)
                        if row.engine_decode_tok_s:
                            row.roofline_engine = floor * row.engine_decode_tok_s / batch
                    except Exception as e:
                        row.errors.append(f"engine: {e!r}")
                        self._free()
                got = hf.get(batch)
                if isinstance(got, str):
                    row.errors.append(got)
                elif got is not None:
                    row.hf_prefill_tok_s, row.hf_decode_tok_s = got
                    if row.engine_decode_tok_s and row.hf_decode_tok_s:
                        row.speedup_vs_hf = row.engine_decode_tok_s / row.hf_decode_tok_s
                print("  " + _row_line(row), flush=True)
                rows.append(row)
        return rows

    def _free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()

    # -- correctness -------------------------------------------------------------------

    def logits_checks(self) -> list[dict[str, Any]]:
        """Prefill four sequences through pdserve's runner, then decode one token each
        (eager runner, and the graph runner padded to 8 rows); compare the decode logits
        with HF's forward over the full sequences, same weights. The reference is HF in
        fp32; pdserve's error must stay within twice HF-bf16's own error (+ 2% of the
        logits' spread): bf16 rounding differs between two correct implementations."""
        if self.args.no_check:
            return []
        if self.hf is None:
            return [{"model": self.name, "ok": False, "error": self.hf_error}]
        torch = self.torch
        lens = [5, 9, 17] if self.args.smoke else [23, 57, 100, 131]
        gen = torch.Generator().manual_seed(7)
        seqs = [
            torch.randint(100, self.arch.vocab_size, (n,), generator=gen).tolist() for n in lens
        ]
        ref_low = self.hf_last_logits(seqs)
        ref = self.hf_last_logits(seqs, fp32=True)
        results = []
        for backend in self.backends:
            ops = self.use(backend)
            entry: dict[str, Any] = {"model": self.name, "attention": backend}
            try:
                tables = self._prefill(seqs)
                step = self._decode_entries(seqs, tables)
                outs = {"eager": self.runner.forward(step)}
                if not self.args.no_cuda_graphs:
                    graphs = self.graph_runner(ops, [8])
                    positions = [len(s) - 1 for s in seqs]
                    got = graphs.run([s[-1] for s in seqs], positions, tables)
                    outs["graph" if graphs.use_graphs else "static-eager"] = got.clone()
                    del graphs
                for path, logits in outs.items():
                    entry[path] = compare_logits(logits, ref, ref_low)
                entry["ok"] = all(entry[p]["ok"] for p in outs)
            except Exception as e:
                entry["ok"] = False
                entry["error"] = repr(e)
            print(f"  logits check {backend}: {entry}", flush=True)
            results.append(entry)
        return results

    def hf_last_logits(self, seqs: list[list[int]], fp32: bool = False) -> Any:
        """HF's last-position logits per sequence; `fp32`: with the weights upcast for
        the call (bf16 -> fp32 -> bf16 is exact; the rotary buffers are put back as they
        were, since a cast would round them)."""
        torch = self.torch
        buffers = {n: b.clone() for n, b in self.hf.named_buffers()}
        if fp32:
            self.hf.float()
        try:
            with torch.inference_mode():
                return torch.stack(
                    [
                        self.hf(torch.tensor([s], device=self.device)).logits[0, -1].float()
                        for s in seqs
                    ]
                )
        finally:
            if fp32:
                self.hf.to(self.dtype)
                for name, buf in buffers.items():
                    module, _, leaf = name.rpartition(".")
                    self.hf.get_submodule(module)._buffers[leaf] = buf

    def _prefill(self, seqs: list[list[int]]) -> list[list[int]]:
        """Prefill every sequence but its last token (one step); their block tables."""
        from pdserve.batch import ScheduledRequest, SchedulerOutput
        from pdserve.engine.request import Request
        from pdserve.sampling_params import SamplingParams

        entries, tables, first = [], [], 0
        for i, s in enumerate(seqs):
            nb = -(-len(s) // self.bs)
            table = list(range(first, first + nb))
            first += nb
            request = Request(f"check-{i}", s, SamplingParams(max_tokens=1))
            entries.append(ScheduledRequest(request, len(s) - 1, 0, tuple(table), False))
            tables.append(table)
        self.runner.forward(SchedulerOutput(tuple(entries), num_decodes=0))
        return tables

    def _decode_entries(self, seqs: list[list[int]], tables: list[list[int]]) -> Any:
        from pdserve.batch import ScheduledRequest, SchedulerOutput
        from pdserve.engine.request import Request
        from pdserve.sampling_params import SamplingParams

        entries = [
            ScheduledRequest(
                Request(f"check-{i}", s, SamplingParams(max_tokens=1)),
                1,
                len(s) - 1,
                tuple(t),
                True,
            )
            for i, (s, t) in enumerate(zip(seqs, tables, strict=True))
        ]
        return SchedulerOutput(tuple(entries), num_decodes=len(entries))

    def kernel_checks(self) -> list[dict[str, Any]]:
        """The Triton kernel alone at this model's attention shape: against the fp32
        reference, and its KV read rate next to the gather + SDPA path's."""
        if "triton" not in self.backends or self.args.no_check:
            return []
        context = self.args.prompt_len + self.args.output_len // 2
        results = []
        for batch in self.batches:
            entry: dict[str, Any] = {"model": self.name, "batch": batch, "context": context}
            try:
                entry.update(self._kernel_check(batch, context))
            except Exception as e:
                entry["ok"] = False
                entry["error"] = repr(e)
            print(f"  kernel {entry}", flush=True)
            results.append(entry)
        return results

    def _kernel_check(self, batch: int, context: int) -> dict[str, Any]:
        from pdserve.model.attention import AttentionMetadata, DecodeGroup
        from pdserve.model.attention import decode_attention_gathered as gathered
        from pdserve.model.triton_attention import paged_decode_attention, reference_paged_decode

        torch, dev, a = self.torch, self.device, self.arch
        kv_layer = self.runner.kv_cache[:, a.num_layers - 1]
        nb = context // self.bs + 1
        gen = torch.Generator(device=dev).manual_seed(batch)
        kv_layer[: batch * nb].normal_(generator=gen)
        tables = torch.arange(batch * nb, device=dev, dtype=torch.int32).view(batch, nb)
        lens = torch.full((batch,), context + 1, dtype=torch.int32, device=dev)
        q = torch.randn((batch, a.num_heads, a.head_dim), device=dev, generator=gen).to(self.dtype)
        scale = a.head_dim**-0.5
        got = paged_decode_attention(q, kv_layer, tables, lens, scale)
        want = reference_paged_decode(q, kv_layer, tables, lens, scale)
        err = (got.float() - want.float()).abs().max().item()
        kv = batch * (context + 1) * 2 * a.num_kv_heads * a.head_dim * self.dtype.itemsize
        iters = 1 if self.args.smoke else 50

        def triton_run() -> None:
            for _ in range(iters):
                paged_decode_attention(q, kv_layer, tables, lens, scale)

        t_triton = timed(torch, dev, triton_run, 1) / iters
        keys = torch.arange(nb * self.bs, device=dev)
        mask = torch.where(keys[None, :] < lens[:, None], 0.0, float("-inf"))
        group = DecodeGroup(None, tables.long(), mask.to(self.dtype)[:, None, None, :], lens.long())
        scratch = torch.empty((2, batch * nb, *kv_layer.shape[2:]), dtype=self.dtype, device=dev)
        meta = AttentionMetadata(
            num_decode_tokens=batch,
            slot_block_ids=tables[:, 0].long(),
            slot_offsets=torch.zeros(batch, dtype=torch.long, device=dev),
            decode_groups=(group,),
            decode_block_tables=None,
            decode_seq_lens=None,
            decode_kv_buffer=scratch,
            prefills=(),
        )
        out = torch.empty_like(q)

        def sdpa_run() -> None:
            for _ in range(iters):
                gathered(q, kv_layer, meta, scale, out)

        t_sdpa = timed(torch, dev, sdpa_run, 1) / iters
        return {
            "max_abs_diff": err,
            "ok": err <= 2e-2,
            "triton_us": t_triton * 1e6,
            "triton_GBps": kv / t_triton / 1e9,
            "sdpa_us": t_sdpa * 1e6,
            "sdpa_GBps": kv / t_sdpa / 1e9,
        }


def sharpen_attention(model: Any, arch: Any, seed: int) -> None:
    """Redraw the q and k projections so attention scores have a spread of ~3 instead of
    the near-uniform attention of N(0, 0.02) weights in a narrow model: with uniform
    attention a wrong softmax scale or a misplaced key would barely move the logits the
    check compares. Values only; shapes and timings are unchanged."""
    import torch

    std = (3.0 / arch.hidden_size) ** 0.5
    qk_rows = (arch.num_heads + arch.num_kv_heads) * arch.head_dim
    for i, layer in enumerate(model.layers):
        w = layer.self_attn.qkv_proj.weight
        gen = torch.Generator(device=w.device).manual_seed(seed + i)
        with torch.no_grad():
            w[:qk_rows].normal_(0.0, std, generator=gen)


def compare_logits(got: Any, ref: Any, ref_low: Any) -> dict[str, Any]:
    """pdserve's logits against HF fp32 (`ref`), with HF in the low dtype (`ref_low`)
    as the yardstick for what bf16 rounding alone costs."""
    scale = ref.float().std().item()
    max_diff = (got.float() - ref).abs().max().item()
    hf_diff = (ref_low.float() - ref).abs().max().item()
    return {
        "max_abs_diff": max_diff,
        "hf_low_max_abs_diff": hf_diff,
        "ref_std": scale,
        "rel_max_diff": max_diff / max(scale, 1e-12),
        "argmax_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "ok": max_diff <= 2 * hf_diff + 0.02 * scale,
    }


def build_hf_model(config: dict[str, Any], model: Any, arch: Any, device: Any, dtype: Any) -> Any:
    """transformers' CausalLM for this config, holding pdserve's weights (q/k/v and
    gate/up un-fused), in `dtype` on `device`. Built under the dtype as default so an 8B
    model never exists in fp32."""
    import torch
    import transformers

    cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    cls_name = config["architectures"][0]
    config_cls = {
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "LlamaForCausalLM": transformers.LlamaConfig,
    }[cls_name]
    hf_config = config_cls(**cfg)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = getattr(transformers, cls_name)(hf_config)
    finally:
        torch.set_default_dtype(previous)
    hf.load_state_dict(hf_state_dict(model, arch), strict=True)
    hf.eval()  # no .to(dtype): it would round the fp32 rotary buffer to bf16
    # The rotary frequencies must agree too (llama3 scaling goes through the config).
    from pdserve.model.decoder import rope_inv_freq

    inv = getattr(getattr(hf.model, "rotary_emb", None), "inv_freq", None)
    if inv is not None:
        ours = rope_inv_freq(arch).to(inv.device)
        if not torch.allclose(inv.float(), ours, rtol=1e-4, atol=1e-7):
            raise RuntimeError("HF and pdserve rotary frequencies differ (rope config)")
    return hf


def hf_state_dict(model: Any, arch: Any) -> dict[str, Any]:
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    inter = arch.intermediate_size
    out = {}
    for name, t in model.state_dict().items():
        if name.startswith("rotary."):
            continue
        hf_name = name if name.startswith("lm_head.") else f"model.{name}"
        if ".qkv_proj." in name:
            for part, (start, size) in zip(
                ("q", "k", "v"), ((0, q), (q, kv), (q + kv, kv)), strict=True
            ):
                out[hf_name.replace(".qkv_proj.", f".{part}_proj.")] = t[start : start + size]
        elif ".gate_up_proj." in name:
            out[hf_name.replace(".gate_up_proj.", ".gate_proj.")] = t[:inter]
            out[hf_name.replace(".gate_up_proj.", ".up_proj.")] = t[inter:]
        else:
            out[hf_name] = t
    if arch.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# -- report ----------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "–" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def _row_line(r: Row) -> str:
    return (
        f"batch {r.batch}: step eager {_fmt(r.step_ms_eager, '.2f')} ms, graph "
        f"{_fmt(r.step_ms_graph, '.2f')} ms, floor {_fmt(r.floor_ms, '.3f')} ms "
        f"({_pct(r.roofline_graph)} graph), engine decode {_fmt(r.engine_decode_tok_s)} tok/s, "
        f"prefill {_fmt(r.engine_prefill_tok_s)} tok/s, HF decode {_fmt(r.hf_decode_tok_s)}"
        + (f"; errors: {r.errors}" if r.errors else "")
    )


def markdown(
    rows: list[Row],
    accept: list[dict[str, Any]],
    checks: list[dict[str, Any]],
    kernels: list[dict[str, Any]],
) -> str:
    head = (
        "| model | attention | batch | context | prefill tok/s | decode tok/s (engine) "
        "| step ms eager | step ms graph | floor ms | roofline eager | roofline graph "
        "| HF prefill tok/s | HF decode tok/s | pdserve/HF decode |\n"
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.attention} | {r.batch} | {r.context} "
            f"| {_fmt(r.engine_prefill_tok_s)} | {_fmt(r.engine_decode_tok_s)} "
            f"| {_fmt(r.step_ms_eager, '.2f')} | {_fmt(r.step_ms_graph, '.2f')} "
            f"| {_fmt(r.floor_ms, '.3f')} | {_pct(r.roofline_eager)} | {_pct(r.roofline_graph)} "
            f"| {_fmt(r.hf_prefill_tok_s)} | {_fmt(r.hf_decode_tok_s)} "
            f"| {_fmt(r.speedup_vs_hf, '.2f')}{'x' if r.speedup_vs_hf else ''} |"
        )
    if kernels:
        lines += [
            "",
            "| kernel: model | batch | context | max abs diff | triton µs | triton GB/s "
            "| gather+SDPA µs | gather+SDPA GB/s |",
            "|---|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for k in kernels:
            lines.append(
                f"| {k['model']} | {k['batch']} | {k['context']} "
                f"| {_fmt(k.get('max_abs_diff'), '.2e')} | {_fmt(k.get('triton_us'), '.1f')} "
                f"| {_fmt(k.get('triton_GBps'))} | {_fmt(k.get('sdpa_us'), '.1f')} "
                f"| {_fmt(k.get('sdpa_GBps'))} |"
            )
    if checks:
        lines += ["", "logits checks (max |pdserve - HF fp32| vs max |HF low dtype - HF fp32|):"]
        for c in checks:
            paths = {
                p: f"max|Δ| {v['max_abs_diff']:.3g} vs HF {v['hf_low_max_abs_diff']:.3g} "
                f"({v['rel_max_diff']:.2f} σ), argmax {100 * v['argmax_agreement']:.0f}%"
                for p, v in c.items()
                if isinstance(v, dict)
            }
            verdict = "ok" if c["ok"] else f"FAIL {c.get('error', '')}"
            lines.append(f"- {c['model']} / {c.get('attention', '-')}: {verdict} {paths}")
    if accept:
        lines += ["", "acceptance:"]
        lines += [f"- {a['criterion']}: {a['verdict']} ({a['measured']})" for a in accept]
    return "\n".join(lines)


def acceptance(rows: list[Row], checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for model, target in ACCEPTANCE_ROOFLINE.items():
        cands = [r for r in rows if r.model == model and r.batch == 256]
        best = max(
            (x for r in cands for x in (r.roofline_graph, r.roofline_eager) if x), default=None
        )
        out.append(
            {
                "criterion": f"{model} decode at batch 256 >= {target:.0%} of roofline",
                "measured": _pct(best),
                "verdict": "not measured"
                if best is None
                else ("PASS" if best >= target else "FAIL"),
            }
        )
    for model in ACCEPTANCE_ROOFLINE:
        speedups = [
            r.speedup_vs_hf
            for r in rows
            if r.model == model and r.batch == ACCEPTANCE_HF_BATCH and r.speedup_vs_hf
        ]
        best = max(speedups, default=None)
        out.append(
            {
                "criterion": f"{model} pdserve >= {ACCEPTANCE_HF_SPEEDUP:.0f}x HF generate "
                f"at batch {ACCEPTANCE_HF_BATCH}",
                "measured": _fmt(best, ".2f") + "x" if best else "–",
                "verdict": "not measured"
                if best is None
                else ("PASS" if best >= ACCEPTANCE_HF_SPEEDUP else "FAIL"),
            }
        )
    if checks:
        ok = all(c["ok"] for c in checks)
        out.append(
            {
                "criterion": "logits match HF (every backend and path)",
                "measured": f"{sum(c['ok'] for c in checks)}/{len(checks)}",
                "verdict": "PASS" if ok else "FAIL",
            }
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
