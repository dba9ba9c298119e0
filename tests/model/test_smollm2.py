"""The real default model (SmolLM2-135M-Instruct GGUF) against HF transformers, in fp32."""

from __future__ import annotations

from typing import Any

from pdserve import SamplingParams
from tests.conftest import SMOLLM2_PROMPTS, assert_matches_hf

PROMPTS = SMOLLM2_PROMPTS


def test_logits_match_hf(smollm2_llm: Any, smollm2_references: Any) -> None:
    assert_matches_hf(smollm2_llm, smollm2_references)


def test_greedy_batch1_and_mixed_batch_match_hf(smollm2_llm: Any, smollm2_references: Any) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batch = [ids for ids, _, _ in smollm2_references]
    expected = [tokens for _, tokens, _ in smollm2_references]
    alone = [smollm2_llm.generate([ids], params)[0].outputs[0].token_ids for ids in batch]
    together = [o.outputs[0].token_ids for o in smollm2_llm.generate(batch, params)]
    assert alone == expected
    assert together == expected


def test_capital_of_france(smollm2_llm: Any) -> None:
    out = smollm2_llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=8)
    )
    assert "Paris" in out[0].outputs[0].text


def test_chat_template_from_gguf(smollm2_llm: Any) -> None:
    prompt = smollm2_llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    out = smollm2_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_tokenizer_matches_transformers_gguf_conversion(smollm2_llm: Any, tmp_path: Any) -> None:
    import transformers

    from pdserve.model.files import default_model_path

    path = default_model_path()
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [
        "Hello, world! It's 2026-11-30 and 12345 apples cost $3.50.",
        "  leading spaces\n\nnewlines\ttabs",
        "héllo wörld 你好 🙂 naïve café",
        "<|im_start|>user\nHi<|im_end|>",
        "def f(x):\n    return x**2  # square",
    ]
    for text in texts:
        ours = smollm2_llm.tokenizer.encode(text)
        assert ours == ref.encode(text, add_special_tokens=False), text
        assert smollm2_llm.tokenizer.decode(ours, skip_special_tokens=False) == text


def test_export_to_hf_directory_and_load_it(smollm2_llm: Any, tmp_path: Any) -> None:
    """The Hugging Face directory path (safetensors + tokenizer.json) on the real model."""
    from pdserve import LLM
    from pdserve.model.files import default_model_path
    from pdserve_bench.hf_reference import save_hf_dir

    save_hf_dir(tmp_path, default_model_path())
    from_dir = LLM(str(tmp_path), dtype="float32", num_blocks=64, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = from_dir.generate(PROMPTS[:2], params)
    b = smollm2_llm.generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert a[0].outputs[0].text == b[0].outputs[0].text
