"""`pdserve bench accuracy`: what each weight (and KV) format costs in accuracy, measured.

The text is `data/accuracy_text.txt` (public-domain prose that ships with pdserve; its
header names the sources), tokenized once by pdserve; every system scores those same ids.

Windows of `window` tokens every `stride` tokens; each target token is scored once, in the
first window where it has at least `stride` tokens of context before it (the first window
scores all of its targets; the last may be shorter):

    tokens   0 ............ 256 ............ 512 ............ 768 ....
    window 0 [ scored 1..255 | scored 256..511 ]
    window 1                 [   context      | scored 512..767 ]
    window 2                                  [   context      | scored 768..1023 ]

A window starts a fresh sequence and runs through the engine's model runner as prefill
chunks of `stride` tokens (two at the defaults), in blocks of the engine's paged KV cache:
each later chunk reads the earlier ones' keys and values from the cache, as any chunked
prefill does, so a KV cache format reaches the scored tokens. (The engine has no
prompt-logprobs path; the runner returns the logits of every token of a step for this.)
llama.cpp evaluates the same windows in batches of `stride` tokens (n_batch), its KV
cache carrying the earlier batches to the later ones.

For each format: perplexity (exp of the mean negative log-likelihood of the scored
targets), the ratio to llama.cpp's on the same GGUF file when bench/.venv-llamacpp exists,
and top-1 agreement: the fraction of scored positions whose most likely next token equals
the float32 dense model's.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from pdserve.errors import ConfigError
from pdserve_bench.llamacpp_amx import REPACK_OFF_REASON, repack_allowed

TEXT_RESOURCE = "accuracy_text.txt"
KV_CACHE_DTYPES = ("auto", "int8")
"""What `--kv-cache-dtypes` takes: the model's own dtype, or the engine's 8-bit cache. A float
cache in another dtype than the weights' is not an engine option (see kv_format.resolve)."""


@dataclass(frozen=True)
class WeightFormat:
    name: str
    dtype: str
    quantization: str
    """`--quantization` for the engine (`auto`: the GGUF file's own blocks)."""


REFERENCE = WeightFormat("f32-dense", "float32", "none")
FORMATS = (
    REFERENCE,
    WeightFormat("f32-gguf", "float32", "auto"),
    WeightFormat("f32-q8_0", "float32", "q8_0"),
    WeightFormat("f32-q4_0", "float32", "q4_0"),
    WeightFormat("bf16-dense", "bfloat16", "none"),
    WeightFormat("bf16-gguf", "bfloat16", "auto"),
)


@dataclass(frozen=True)
class Window:
    start: int
    end: int
    first_target: int
    """Targets first_target..end-1 are scored here (each predicted from the token before)."""


@dataclass(frozen=True)
class Scores:
    """Per scored target, in text order: its negative log-likelihood and the model's most
    likely token at that position."""

    nll: torch.Tensor
    top1: torch.Tensor
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll.double().mean()))


@dataclass(frozen=True)
class Result:
    system: str
    weights: str
    kv_cache_dtype: str
    perplexity: float | None
    ratio_to_llamacpp: float | None
    top1_agreement: float | None
    tokens_scored: int
    seconds: float
    note: str = ""


def load_text() -> str:
    """The scored text: the data file without its header (lines up to the first blank)."""
    raw = resources.files("pdserve_bench").joinpath("data", TEXT_RESOURCE).read_text("utf-8")
    return raw.split("\n\n", 1)[1]


def plan_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    if not 0 < stride < window:
        raise SystemExit(f"--stride must be in 1..window-1, got {stride} (window {window})")
    if num_tokens < 2:
        raise SystemExit("the text must have at least 2 tokens to score")
    windows = [Window(0, min(window, num_tokens), 1)]
    while windows[-1].end < num_tokens:
        start = windows[-1].end - (window - stride)
        windows.append(Window(start, min(start + window, num_tokens), windows[-1].end))
    return windows


def score_logits(window_logits: torch.Tensor, token_ids: list[int], w: Window) -> Scores:
    """`window_logits` [w.end - w.start, V]: row i predicts token w.start + i + 1."""
    rows = window_logits[w.first_target - 1 - w.start : w.end - 1 - w.start].float()
    targets = torch.tensor(token_ids[w.first_target : w.end])
    nll = -torch.log_softmax(rows, dim=-1).gather(1, targets[:, None])[:, 0]
    return Scores(nll, rows.argmax(dim=-1), 0.0)


def kv_cache_options(kv_cache_dtype: str) -> dict[str, Any]:
    """Engine options for one `--kv-cache-dtypes` entry (`auto`: the engine's default)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise SystemExit(
            f"--kv-cache-dtypes {kv_cache_dtype}: not a KV format this bench scores "
            f"(supported: {', '.join(KV_CACHE_DTYPES)})"
        )
    return {"kv_cache_dtype": kv_cache_dtype}


def score_pdserve(
    args: argparse.Namespace,
    fmt: WeightFormat,
    kv_cache_dtype: str,
    token_ids: list[int],
    windows: list[Window],
) -> tuple[Scores, str]:
    """pdserve's model on the windows; the scores and the engine's weights line."""
    from pdserve import LLM

    block_size = 64 if args.stride % 64 == 0 else 16 if args.stride % 16 == 0 else 1
    llm = LLM(
        args.model,
        dtype=fmt.dtype,
        quantization=fmt.quantization,
        block_size=block_size,
        num_blocks=-(-args.window // block_size),
        max_model_len=args.window,
        enable_prefix_caching=False,
        **kv_cache_options(kv_cache_dtype),
    )
    engine = llm.engine
    start = time.perf_counter()
    parts = [
        score_logits(_window_logits(engine, token_ids[w.start : w.end], args.stride), token_ids, w)
        for w in windows
    ]
    seconds = time.perf_counter() - start
    weights = engine.loaded.quantization
    del llm, engine
    gc.collect()
    return _joined(parts, seconds), weights


def _window_logits(engine: Any, window_ids: list[int], stride: int) -> torch.Tensor:
    """Every position's logits [len(window_ids), V] for a fresh sequence of `window_ids`,
    run as prefill chunks of `stride` tokens in blocks allocated from the engine's pool."""
    from pdserve.batch import ScheduledRequest, SchedulerOutput
    from pdserve.engine.request import Request
    from pdserve.sampling_params import SamplingParams

    request = Request("accuracy-window", window_ids, SamplingParams(max_tokens=1))
    if not engine.kv.allocate(request.request_id, len(window_ids)):
        raise RuntimeError("the KV pool cannot hold one window")
    blocks = tuple(engine.kv.block_ids(request.request_id))
    try:
        chunks = []
        with torch.inference_mode():
            for ctx in range(0, len(window_ids), stride):
                n = min(stride, len(window_ids) - ctx)
                step = ScheduledRequest(request, n, ctx, blocks, samples=False)
                chunks.append(engine.runner.forward(SchedulerOutput((step,), 0), every_token=True))
        return torch.cat(chunks)
    finally:
        engine.kv.free(request.request_id)


def _joined(parts: list[Scores], seconds: float) -> Scores:
    return Scores(torch.cat([p.nll for p in parts]), torch.cat([p.top1 for p in parts]), seconds)


_CHECKOUT = Path(__file__).resolve().parents[2]
LLAMACPP_VENV = _CHECKOUT / "bench" / ".venv-llamacpp"
LLAMACPP_SCORE_SCRIPT = _CHECKOUT / "bench" / "llamacpp" / "score_llamacpp.py"
LLAMACPP_SETUP = _CHECKOUT / "bench" / "llamacpp" / "setup.sh"


def llamacpp_missing_reason(model: str) -> str | None:
    """Why llama.cpp cannot be the reference here, or None when it can."""
    from pdserve.model.files import resolve_model_path

    if resolve_model_path(model).suffix != ".gguf":
        return "the model is not a GGUF file"
    # setup.sh stamps the virtualenv once llama-cpp-python is in it (not while it builds)
    if not any(LLAMACPP_VENV.glob(".llama-cpp-python-*-installed")):
        return f"{LLAMACPP_VENV} not found: run {LLAMACPP_SETUP}"
    return None


def score_llamacpp(
    args: argparse.Namespace, token_ids: list[int], windows: list[Window]
) -> tuple[Scores, str]:
    """llama.cpp (bench/llamacpp/score_llamacpp.py, in its virtualenv) on the same GGUF
    file, ids and windows; the scores and a line naming its version and build."""
    from pdserve.model.files import resolve_model_path

    request = {
        "model_path": str(resolve_model_path(args.model)),
        "n_threads": torch.get_num_threads(),
        "n_ctx": args.window,
        "n_batch": args.stride,
        "token_ids": token_ids,
        "windows": [[w.start, w.end, w.first_target] for w in windows],
        "repack": repack_allowed(),
    }
    done = subprocess.run(
        [str(LLAMACPP_VENV / "bin" / "python"), str(LLAMACPP_SCORE_SCRIPT)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp scoring failed ({done.returncode}):\n{done.stderr[-2000:]}")
    answer = json.loads(done.stdout.splitlines()[-1])
    scores = Scores(
        torch.tensor(answer["nll"], dtype=torch.float64),
        torch.tensor(answer["top1"], dtype=torch.long),
        float(answer["seconds"]),
    )
    line = f"llama-cpp-python {answer['version']}: {answer['system_info']}"
    return scores, line if request["repack"] else f"{line}\n{REPACK_OFF_REASON}"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "accuracy", help="perplexity and top-1 agreement per weight/KV format vs. llama.cpp"
    )
    p.add_argument("--model", default="default")
    p.add_argument(
        "--formats",
        default=",".join(f.name for f in FORMATS),
        help="weight formats to score (f32-dense, the reference, always runs): "
        + ", ".join(f"{f.name} (dtype {f.dtype}, quantization {f.quantization})" for f in FORMATS),
    )
    p.add_argument(
        "--kv-cache-dtypes",
        default="auto",
        help=f"KV cache formats to score each weight format with ({', '.join(KV_CACHE_DTYPES)})",
    )
    p.add_argument("--window", type=int, default=512, help="tokens per scored window")
    p.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N")
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp reference")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true", help="also print results as JSON")
    p.set_defaults(func=run)


def _selected_formats(names: str) -> list[WeightFormat]:
    by_name = {f.name: f for f in FORMATS}
    picked = [n for n in names.split(",") if n]
    unknown = [n for n in picked if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown format {unknown[0]!r} (supported: {', '.join(by_name)})")
    return [REFERENCE] + [by_name[n] for n in picked if n != REFERENCE.name]


def text_tokens(model: str, max_tokens: int | None) -> list[int]:
    """pdserve's tokenization of the text (a GGUF's own tokenizer, or a directory's
    tokenizer.json), which every system then scores as ids."""
    from pdserve.model.files import resolve_model_path
    from pdserve.model.gguf_file import open_gguf
    from pdserve.model.tokenizer import Tokenizer

    path = resolve_model_path(model)
    tokenizer = Tokenizer.from_hf_dir(path) if path.is_dir() else open_gguf(path).tokenizer()
    ids = tokenizer.encode(load_text())
    return ids[:max_tokens] if max_tokens else ids


def run(args: argparse.Namespace) -> int:
    from pdserve.model import cpu_isa

    torch.set_num_threads(args.threads or torch.get_num_threads())
    formats = _selected_formats(args.formats)
    kv_dtypes = [k for k in args.kv_cache_dtypes.split(",") if k]
    for kv in kv_dtypes:
        kv_cache_options(kv)  # refuse an unsupported one before any model loads
    token_ids = text_tokens(args.model, args.max_tokens)
    windows = plan_windows(len(token_ids), args.window, args.stride)
    skip_llamacpp = "--no-llamacpp" if args.no_llamacpp else llamacpp_missing_reason(args.model)
    llamacpp, llamacpp_line = (
        (None, f"llama.cpp: skipped ({skip_llamacpp})")
        if skip_llamacpp
        else score_llamacpp(args, token_ids, windows)
    )
    results: list[Result] = []
    reference: Scores | None = None
    for kv in kv_dtypes:
        for fmt in formats:
            row, scores = _score_row(args, fmt, kv, token_ids, windows, reference, llamacpp)
            results.append(row)
            if fmt is REFERENCE and kv == kv_dtypes[0]:
                reference = scores
    if llamacpp is not None:
        results.append(_row("llama.cpp", "the GGUF file as it is", "f16", llamacpp, reference, 1.0))
    print(
        f"text: {TEXT_RESOURCE}, {len(token_ids)} tokens; windows of {args.window} every "
        f"{args.stride} tokens ({len(windows)}); {torch.get_num_threads()} threads, "
        f"CPU level {cpu_isa.describe()}"
    )
    print(llamacpp_line)
    _print_table(results)
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
    return 0


def _score_row(
    args: argparse.Namespace,
    fmt: WeightFormat,
    kv: str,
    token_ids: list[int],
    windows: list[Window],
    reference: Scores | None,
    llamacpp: Scores | None,
) -> tuple[Result, Scores | None]:
    from pdserve.model import cpu_isa

    if fmt.dtype == "bfloat16" and not cpu_isa.native_bf16():
        return _skipped(fmt, kv, "no native bf16 on this CPU"), None
    try:
        scores, weights = score_pdserve(args, fmt, kv, token_ids, windows)
    except ConfigError as e:  # a format the loader cannot keep for this model or CPU
        return _skipped(fmt, kv, str(e)), None
    ratio = None if llamacpp is None else scores.perplexity / llamacpp.perplexity
    return _row(fmt.name, weights, kv, scores, reference or scores, ratio), scores


def _row(
    system: str,
    weights: str,
    kv: str,
    scores: Scores,
    reference: Scores | None,
    ratio: float | None,
) -> Result:
    agreement = None
    if reference is not None:
        agreement = float((scores.top1 == reference.top1).double().mean())
    return Result(
        system,
        weights,
        kv,
        scores.perplexity,
        ratio,
        agreement,
        int(scores.nll.numel()),
        scores.seconds,
    )


def _skipped(fmt: WeightFormat, kv: str, why: str) -> Result:
    return Result(fmt.name, "", kv, None, None, None, 0, 0.0, note=f"skipped: {why}")


def _print_table(results: list[Result]) -> None:
    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(
        f"{'format':<12}{'kv':>6}{'perplexity':>12}{'vs llama.cpp':>14}{'top-1 vs f32':>14}"
        f"{'tokens':>8}{'seconds':>9}"
    )
    for r in results:
        print(
            f"{r.system:<12}{r.kv_cache_dtype:>6}{cell(r.perplexity, '.4f'):>12}"
            f"{cell(r.ratio_to_llamacpp, '.4f'):>14}{cell(r.top1_agreement, '.4f'):>14}"
            f"{r.tokens_scored:>8}{r.seconds:>9.1f}" + (f"  {r.note}" if r.note else "")
        )
    print("vs llama.cpp = perplexity / llama.cpp's on the same file and tokens; top-1 vs f32 =")
    print("fraction of scored positions whose argmax equals f32-dense's")
    for r in results:
        if r.weights:
            print(f"  {r.system} weights: {r.weights}")
