"""Real K-quant files of the default model, made locally the way users get theirs: the
default GGUF exported to float32 (its Q4_1/Q8_0 tensors dequantized, every field kept),
then quantized by llama.cpp's own quantizer (`llama_model_quantize` from llama-cpp-python,
bench/llamacpp/setup.sh) to Q4_K_M, Q5_K_M or Q6_K.

    .venv/bin/python -m pdserve_bench.kquant_file --ftype q4_k_m

prints the path (~/.cache/pdserve/kquant/smollm2-135m.q4_k_m.gguf, written once). The
default model's 576-wide rows are not multiples of a K-quant's 256 weights, so llama.cpp
keeps those tensors in its fallbacks (Q5_0, Q5_1, Q8_0) and the 1536-wide ffn_down in the
K-quant: a file that exercises five formats. Then `pdserve bench accuracy --model FILE`
compares pdserve's perplexity on it with llama.cpp's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import numpy as np

from pdserve_bench.accuracy import LLAMACPP_SETUP, LLAMACPP_VENV

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "kquant"
FTYPES = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
"""llama.cpp's llama_ftype numbers (LLAMA_FTYPE_MOSTLY_*)."""

_QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = 2
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""


def export_f32(path: Path) -> None:
    """The default GGUF with every tensor in float32, in the file's own names and layout."""
    import gguf

    from pdserve.model.files import default_model_path

    source = gguf.GGUFReader(default_model_path())
    writer = gguf.GGUFWriter(path, source.fields["general.architecture"].contents())
    skip = ("GGUF.", "general.architecture", "general.file_type", "general.quantization_version")
    for key, field in source.fields.items():
        if key.startswith(skip):
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    for t in source.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def kquant_path(ftype: str) -> Path:
    """The default model in `ftype`, quantized by llama.cpp on first use."""
    target = CACHE / f"smollm2-135m.{ftype}.gguf"
    if target.exists():
        return target
    python = LLAMACPP_VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"llama-cpp-python is not installed: run {LLAMACPP_SETUP}")
    CACHE.mkdir(parents=True, exist_ok=True)
    f32 = CACHE / "smollm2-135m.f32.gguf"
    if not f32.exists():
        export_f32(f32.with_suffix(".partial"))
        f32.with_suffix(".partial").rename(f32)
    partial = target.with_suffix(".partial")
    args = [str(python), "-c", _QUANTIZE, str(f32), str(partial), str(FTYPES[ftype])]
    subprocess.run(args, check=True)
    partial.rename(target)
    return target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ftype", default="q4_k_m", choices=sorted(FTYPES))
    path = kquant_path(p.parse_args().ftype)
    print(f"{path} ({path.stat().st_size / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
